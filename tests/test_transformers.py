"""Hugging Face transformers: attn_implementation="cutlass_flash" against transformers' own
sdpa / eager attention on tiny random-weight models built from its classes (Llama; Mistral with a
sliding window; Gemma 2 with softcap and alternating sliding layers; gpt-oss with attention sinks and
alternating sliding layers), for padded batches, packed
(padding-free) batches, a short training run, and attention dropout in training. On CPU the
kernels are the fake binding's float64 stand-in (the integration's unpad / pad / packing /
argument plumbing); on the GPU the kernels."""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import cutlass_flash.integrations.transformers as hf  # noqa: E402  (registers the name)
from gpu_check import skip_unless_auto_built  # noqa: E402

VOCAB = 128


HEAD_DIM = 16  # of every config below (zero-padded to the smallest instantiated head dim)


def _config(kind):
    common = dict(vocab_size=VOCAB, hidden_size=4 * HEAD_DIM, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    if kind == "llama":
        return transformers.LlamaConfig(**common)
    if kind == "mistral":
        return transformers.MistralConfig(**common, sliding_window=8)
    if kind == "gemma2":
        return transformers.Gemma2Config(**common, head_dim=HEAD_DIM, sliding_window=8,
                                         attn_logit_softcapping=20.0, final_logit_softcapping=None,
                                         query_pre_attn_scalar=16)
    if kind == "gpt_oss":
        return transformers.GptOssConfig(**common, head_dim=HEAD_DIM, sliding_window=8, num_local_experts=4,
                                         num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention"])
    raise ValueError(kind)


# sdpa has no softcap: Gemma 2's reference is eager; gpt-oss's attention sinks are eager's only.
REFERENCE = {"llama": "sdpa", "mistral": "sdpa", "gemma2": "eager", "gpt_oss": "eager"}
KINDS = list(REFERENCE)


def _models(kind, device, dtype=torch.bfloat16):
    torch.manual_seed(0)
    ours = transformers.AutoModelForCausalLM.from_config(_config(kind), attn_implementation=hf.NAME)
    ours = ours.to(device=device, dtype=dtype).eval()
    ref = transformers.AutoModelForCausalLM.from_config(_config(kind), attn_implementation=REFERENCE[kind])
    ref.load_state_dict(ours.state_dict())
    ref = ref.to(device=device, dtype=dtype).eval()
    return ours, ref


def _batch(device, lengths=(20, 13, 7), left_pad=False):
    g = torch.Generator().manual_seed(1)
    n = max(lengths)
    ids = torch.randint(0, VOCAB, (len(lengths), n), generator=g)
    mask = torch.zeros(len(lengths), n, dtype=torch.long)
    for i, m in enumerate(lengths):
        if left_pad:
            mask[i, n - m:] = 1
        else:
            mask[i, :m] = 1
    return ids.to(device), mask.to(device)


def _bf16_noise(ours, ref):
    """Logits differ by bf16 rounding through the layers: bound the error by the logits' scale."""
    err = (ours.float() - ref.float()).abs().max().item()
    scale = ref.float().abs().max().item()
    assert err <= 0.05 * scale + 0.05, f"max |ours - ref| = {err:.4g} against logits up to {scale:.4g}"


def _check_padded(kind, device, left_pad):
    ours, ref = _models(kind, device)
    ids, mask = _batch(device, left_pad=left_pad)
    with torch.no_grad():
        a = ours(input_ids=ids, attention_mask=mask).logits
        b = ref(input_ids=ids, attention_mask=mask).logits
    keep = mask.bool()
    _bf16_noise(a[keep], b[keep])


def _check_packed(kind, device):
    """Padding-free: three sequences in one row, position_ids restarting at each; each must match
    the same sequence run alone."""
    ours, ref = _models(kind, device)
    ids, mask = _batch(device)
    lengths = mask.sum(1).tolist()
    packed = torch.cat([ids[i, :n] for i, n in enumerate(lengths)]).unsqueeze(0)
    pos = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0).to(device)
    with torch.no_grad():
        a = ours(input_ids=packed, position_ids=pos).logits[0]
        alone = [ref(input_ids=ids[i:i + 1, :n]).logits[0] for i, n in enumerate(lengths)]
    _bf16_noise(a, torch.cat(alone))


def _train(model, device, steps):
    g = torch.Generator().manual_seed(2)
    # Two fixed batches in turn: the model learns them, so the loss falls well below ln(VOCAB).
    data = torch.randint(0, VOCAB, (2, 4, 32), generator=g).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(steps):
        x = data[step % 2]
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _check_training(kind, device, steps):
    ours, ref = _models(kind, device)
    ours.train()
    ref.train()
    a, b = _train(ours, device, steps), _train(ref, device, steps)
    assert a[-1] < a[0] - 0.5, f"our loss did not fall: {a[0]:.3f} -> {a[-1]:.3f}"
    worst = max(abs(x - y) for x, y in zip(a, b))
    assert worst < 0.15, f"loss curves apart by {worst:.3f}: ours {a[::5]} reference {b[::5]}"


# -- CPU, on the fake binding -----------------------------------------------------------------


def test_registered(fake_backend):
    assert hf.NAME in transformers.AttentionInterface().valid_keys()
    hf.register()  # idempotent
    model = transformers.AutoModelForCausalLM.from_config(_config("llama"))
    model.set_attn_implementation(hf.NAME)
    assert model.config._attn_implementation == hf.NAME


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("left_pad", [False, True], ids=["right_pad", "left_pad"])
def test_padded_batch_fake(fake_backend, kind, left_pad):
    _check_padded(kind, "cpu", left_pad)
    assert fake_backend.archs_called("fwd"), "our kernels never ran"
    # A padded batch goes through the variable-length kernels (transformers unpads it).
    assert any(p.get("cu_seqlens_q") for _, _, p in fake_backend.calls)


@pytest.mark.parametrize("kind", ["llama", "gemma2", "gpt_oss"])
def test_packed_batch_fake(fake_backend, kind):
    _check_packed(kind, "cpu")
    assert any(p.get("cu_seqlens_q") for _, _, p in fake_backend.calls)


def test_windows_and_softcap_reach_the_kernels(fake_backend):
    """Mistral's sliding window and Gemma 2's softcap arrive as window_size / softcap."""
    for kind in ("mistral", "gemma2"):
        ours, _ = _models(kind, "cpu")
        ids, _ = _batch("cpu", lengths=(20, 20, 20))
        with torch.no_grad():
            ours(input_ids=ids)
    windows = {(p["window_left"], p["window_right"]) for _, _, p in fake_backend.calls}
    assert (7, 0) in windows, windows  # sliding_window 8: 7 keys back, causal
    assert any(p["softcap"] == 20.0 for _, _, p in fake_backend.calls)


def test_training_fake(fake_backend):
    _check_training("llama", "cpu", steps=10)


def _dropout_model(device):
    torch.manual_seed(0)
    config = _config("llama")
    config.attention_dropout = 0.25
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=hf.NAME).to(device)


def _check_attention_dropout(device, steps):
    """The model's attention_dropout reaches our dropout_p in training (not in eval), and a
    training run with it learns."""
    model = _dropout_model(device).to(torch.bfloat16)
    ids, _ = _batch(device, lengths=(20, 20, 20))
    with torch.no_grad():
        model.eval()
        a, b = model(input_ids=ids).logits, model(input_ids=ids).logits
        model.train()
        c = model(input_ids=ids).logits
    assert torch.equal(a, b) and not torch.equal(a, c)
    losses = _train(model, device, steps)
    assert losses[-1] < losses[0] - 0.5, f"loss did not fall with dropout: {losses[0]:.3f} -> {losses[-1]:.3f}"


def test_attention_dropout_fake(fake_backend):
    _check_attention_dropout("cpu", steps=10)
    assert {p.get("dropout_p", 0.0) for _, _, p in fake_backend.calls} == {0.0, 0.25}


# -- GPU ----------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("left_pad", [False, True], ids=["right_pad", "left_pad"])
def test_padded_batch(kind, left_pad):
    skip_unless_auto_built(HEAD_DIM, "bf16")
    _check_padded(kind, "cuda", left_pad)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
def test_packed_batch(kind):
    skip_unless_auto_built(HEAD_DIM, "bf16")
    _check_packed(kind, "cuda")


@pytest.mark.gpu
def test_attention_dropout():
    skip_unless_auto_built(HEAD_DIM, "bf16")
    _check_attention_dropout("cuda", steps=30)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
def test_training(kind):
    """30 training steps: our loss curve matches transformers' own attention's."""
    skip_unless_auto_built(HEAD_DIM, "bf16")
    _check_training(kind, "cuda", steps=30)


# -- Softcap that matters, with a tolerance calibrated on its effect --------------------------------

SCALE_QK = 16.0  # query and key projections scaled up: logits a softcap of 5 changes


def _errors(device, models, monkeypatch=None, dropped=None):
    """(max |ours - ref|, max |without - ref|) of the logits of ``models`` (ours, the eager
    reference, eager without the feature) on one batch. ``dropped``: the arguments our functions
    then run with instead, {name: value}, a stand-in that ignores the feature (every forward goes
    through _ops._fwd_impl: transformers caches the functions)."""
    models = [m.to(device=device, dtype=torch.bfloat16).eval() for m in models]
    if dropped:
        from cutlass_flash import _ops

        real = _ops._fwd_impl
        monkeypatch.setattr(_ops, "_fwd_impl", lambda *a, **kw: real(*a, **{**kw, **dropped}))
    ids, _ = _batch(device, lengths=(24, 24))
    with torch.no_grad():
        a, b, c = (m(input_ids=ids).logits.float() for m in models)
    return (a - b).abs().max().item(), (c - b).abs().max().item()


def _check_feature_matters(name, errors, min_effect):
    """errors(broken) as _errors for a feature ``name``: the feature changes the logits, our error
    is a small part of that change, and a stand-in that ignores the feature cannot meet it."""
    err, effect = errors(False)
    assert effect > min_effect, f"{name} barely changes these logits ({effect:.3g}): the check could not fail"
    assert err <= 0.2 * effect, f"max |ours - eager| = {err:.3g} against {name}'s effect {effect:.3g}"
    broken, _ = errors(True)
    assert broken > 0.2 * effect, f"the {name}-ignoring stand-in passed ({broken:.3g} <= 0.2 x {effect:.3g})"


def _gemma2_softcap_models():
    """Gemma 2 with attention logits large enough for a softcap of 5 to change them (SCALE_QK):
    ours, eager, eager without softcap, with the same weights."""
    torch.manual_seed(0)
    config = _config("gemma2")
    config.attn_logit_softcapping = 5.0
    ours = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=hf.NAME)
    with torch.no_grad():
        for layer in ours.model.layers:
            layer.self_attn.q_proj.weight.mul_(SCALE_QK)
            layer.self_attn.k_proj.weight.mul_(SCALE_QK)
    # A config of its own: from_config sets the attention implementation on the config object,
    # which the models read at every forward.
    ref = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="eager")
    config_nocap = _config("gemma2")
    config_nocap.attn_logit_softcapping = None
    nocap = transformers.AutoModelForCausalLM.from_config(config_nocap, attn_implementation="eager")
    for m in (ref, nocap):
        m.load_state_dict(ours.state_dict())
    return ours, ref, nocap


def _check_gemma2_softcap(device, monkeypatch):
    _check_feature_matters("softcap", lambda broken: _errors(device, _gemma2_softcap_models(), monkeypatch,
                                                             {"softcap": 0.0} if broken else None), 0.25)


def test_gemma2_softcap_is_checked_fake(fake_backend, monkeypatch):
    _check_gemma2_softcap("cpu", monkeypatch)


@pytest.mark.gpu
def test_gemma2_softcap_is_checked(monkeypatch):
    skip_unless_auto_built(HEAD_DIM, "bf16")
    _check_gemma2_softcap("cuda", monkeypatch)


# -- Attention sinks that matter (gpt-oss), checked as softcap is -----------------------------------

SINK = 2.0  # every head's sink logit: e^2 against the ~e^0 of each of 24 keys takes a fifth of P


def _gpt_oss_sink_models():
    """gpt-oss with every sink at SINK: ours, eager, eager without sinks, with the same weights."""
    torch.manual_seed(0)
    ours = transformers.AutoModelForCausalLM.from_config(_config("gpt_oss"), attn_implementation=hf.NAME)
    with torch.no_grad():
        for layer in ours.model.layers:
            layer.self_attn.sinks.fill_(SINK)
    ref = transformers.AutoModelForCausalLM.from_config(_config("gpt_oss"), attn_implementation="eager")
    nosink = transformers.AutoModelForCausalLM.from_config(_config("gpt_oss"), attn_implementation="eager")
    ref.load_state_dict(ours.state_dict())
    nosink.load_state_dict(ours.state_dict())
    with torch.no_grad():
        for layer in nosink.model.layers:
            layer.self_attn.sinks.fill_(float("-inf"))  # e^-inf = 0: no sink
    return ours, ref, nosink


def _check_gpt_oss_sinks(device, monkeypatch):
    _check_feature_matters("sinks", lambda broken: _errors(device, _gpt_oss_sink_models(), monkeypatch,
                                                           {"sinks": None} if broken else None), 0.1)


def test_gpt_oss_sinks_are_checked_fake(fake_backend, monkeypatch):
    _check_gpt_oss_sinks("cpu", monkeypatch)
    assert any(p.get("sinks") for _, _, p in fake_backend.calls), "the sinks never reached the kernels"


@pytest.mark.gpu
def test_gpt_oss_sinks_are_checked(monkeypatch):
    skip_unless_auto_built(HEAD_DIM, "bf16")
    _check_gpt_oss_sinks("cuda", monkeypatch)
