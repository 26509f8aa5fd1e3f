"""GPU tests beyond the accuracy grid: the binding writes every output element, determinism,
opcheck, torch.compile, forced kernel families, missing kernels, streams, CUDA graphs, devices."""

import math
import os

import pytest
import torch

import cutlass_flash
from cutlass_flash import _catalog, _dispatch, _ops, flash_attn_func
from attn_ref import assert_within_tolerance, reference_outputs, slack
from cases import Case, make_dout, make_inputs, kernel_archs
from fake_c import _generator
from gpu_check import OUTPUT_NAMES, check_case, skip_if_not_built

# Long key ranges (where deterministic mode once split dQ into groups, csrc/generate.py), without a
# mask and under a causal one: long chains of turns (DqSemaphore::turn's closed form).
GROUPED_KEYS = _generator().BWD_DQ_GROUPS_MIN_SEQLEN_K + 1
GROUPED_KEYS_CAUSAL = _generator().BWD_DQ_GROUPS_MIN_SEQLEN_K_RIGHT_BOUNDED + 1

pytestmark = pytest.mark.gpu


def _sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


class SpyC:
    """Wraps the binding: records the family of each call, can hide kernels from built_kernels."""

    def __init__(self, real, hide=()):
        self._real = real
        self._hide = set(hide)
        self.calls = []

    def built_kernels(self):
        return [k for k in self._real.built_kernels() if tuple(k) not in self._hide]

    def fwd(self, *args, **kw):
        self.calls.append(("fwd", kw["arch"]))
        return self._real.fwd(*args, **kw)

    def bwd(self, *args, **kw):
        self.calls.append(("bwd", kw["arch"]))
        return self._real.bwd(*args, **kw)

    def __getattr__(self, name):
        return getattr(self._real, name)


@pytest.fixture
def spy(monkeypatch):
    s = SpyC(_dispatch.lib())
    monkeypatch.setattr(_dispatch, "_C", s)
    _dispatch.reset_caches()
    yield s
    _dispatch.reset_caches()


# -- the binding writes every element -----------------------------------------------------------

def _binding_cases():
    out = []
    for arch in kernel_archs():
        out += [
            Case(2, 239, 113, 4, 1, 64, "fp16", True, arch),    # MQA, 126 rows see no key
            Case(2, 113, 239, 4, 2, 128, "bf16", False, arch),  # GQA
            Case(1, 1023, 1024, 2, 2, 256, "bf16", True, arch),
            Case(2, 17, 1, 2, 2, 96, "fp16", True, arch),
        ]
    return out


@pytest.mark.parametrize("case", _binding_cases(), ids=lambda c: c.id)
def test_binding_writes_every_element(case):
    """_C.fwd/_C.bwd into NaN-filled out, lse, dq, dk, dv and workspace: no NaN may remain."""
    skip_if_not_built(case)
    C = _dispatch.lib()
    q, k, v = (t.detach().contiguous() for t in make_inputs(case, "cuda"))
    dout = make_dout(case, "cuda")
    B, Sq, Sk, H, Hkv, D = (case.batch, case.seqlen_q, case.seqlen_k, case.nheads,
                            case.nheads_kv, case.head_dim)
    nan = float("nan")
    out = torch.full_like(q, nan)
    lse = torch.full((B, H, Sq), nan, dtype=torch.float32, device="cuda")
    problem = _ops._problem(q, k, D, 1 / math.sqrt(D), -1, 0 if case.causal else -1, case.dtype)
    stream = torch.cuda.current_stream().cuda_stream
    fwd_workspace = torch.full((C.fwd_workspace_bytes(**problem, arch=case.arch),), 0xFF,
                               dtype=torch.uint8, device="cuda")  # not zeroed: the launch does
    C.fwd(_ops._ref4(q), _ops._ref4(k), _ops._ref4(v), _ops._ref4(out), lse.data_ptr(),
          fwd_workspace.data_ptr() if fwd_workspace.numel() else 0,
          **problem, arch=case.arch, stream=stream)
    # A head dim the family has no backward for runs on the fallback family, as in the op.
    bwd_arch = (case.arch if D in _dispatch.FAMILIES[case.arch]["bwd"] else _dispatch.FALLBACK_ARCH)
    dq = torch.full_like(q, nan)
    dk = torch.full((B, Sk, Hkv, D), nan, dtype=q.dtype, device="cuda")
    dv = torch.full_like(dk, nan)
    workspace = torch.full(
        (C.bwd_workspace_bytes(**problem, arch=bwd_arch, deterministic=False),), 0xFF,
        dtype=torch.uint8, device="cuda")
    C.bwd(_ops._ref4(q), _ops._ref4(k), _ops._ref4(v), _ops._ref4(out), _ops._ref4(dout),
          lse.data_ptr(), _ops._ref4(dq), _ops._ref4(dk), _ops._ref4(dv), workspace.data_ptr(),
          **problem, arch=bwd_arch, deterministic=False, stream=stream)
    torch.cuda.synchronize()
    for name, t in (("out", out), ("lse", lse), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert not torch.isnan(t).any(), f"{name}: {int(torch.isnan(t).sum())} unwritten (NaN)"
    ref = reference_outputs(q, k, v, dout, case.causal, dtype=torch.float64)
    same = reference_outputs(q, k, v, dout, case.causal)
    for name, o, s, r in zip(OUTPUT_NAMES, (out, lse, dq, dk, dv), same, ref):
        assert_within_tolerance(f"{case.id}: {name}", o, s, r)
    # The public API runs the same kernels: identical forward.
    with cutlass_flash.force_arch(case.arch):
        out_api, lse_api = flash_attn_func(q, k, v, causal=case.causal, return_lse=True)
    assert torch.equal(out_api, out) and torch.equal(lse_api, lse)


def test_sm90_forward_rejects_a_missing_workspace():
    case = Case(1, 64, 64, 2, 2, 64, "bf16", False, 90)
    skip_if_not_built(case)
    C = _dispatch.lib()
    q, k, v = (t.detach().contiguous() for t in make_inputs(case, "cuda"))
    out = torch.empty_like(q)
    lse = torch.empty((1, 2, 64), dtype=torch.float32, device="cuda")
    problem = _ops._problem(q, k, 64, 0.125, -1, -1, case.dtype)
    with pytest.raises(ValueError, match="workspace is a null pointer"):
        C.fwd(_ops._ref4(q), _ops._ref4(k), _ops._ref4(v), _ops._ref4(out), lse.data_ptr(), 0,
              **problem, arch=90, stream=torch.cuda.current_stream().cuda_stream)


# -- determinism ----------------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True], ids=["nomask", "causal"])
@pytest.mark.parametrize("arch", kernel_archs(), ids=lambda a: f"sm{a}")
def test_forward_deterministic(arch, causal):
    case = Case(2, 1023, 2047, 8, 2, 128, "bf16", causal, arch)
    skip_if_not_built(case)
    q, k, v = (t.detach() for t in make_inputs(case, "cuda"))
    with cutlass_flash.force_arch(arch):
        out1, lse1 = flash_attn_func(q, k, v, causal=causal, return_lse=True)
        out2, lse2 = flash_attn_func(q, k, v, causal=causal, return_lse=True)
    assert torch.equal(out1, out2) and torch.equal(lse1, lse2)


def _grads(case, q, k, v, dout, deterministic):
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    with cutlass_flash.force_arch(case.arch):
        out = flash_attn_func(qg, kg, vg, causal=case.causal, deterministic=deterministic)
    return torch.autograd.grad(out, (qg, kg, vg), dout)


@pytest.mark.parametrize("keys", ["one_chain", "grouped"])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["nomask", "causal"])
@pytest.mark.parametrize("arch", kernel_archs(), ids=lambda a: f"sm{a}")
def test_backward_deterministic(arch, causal, head_dim, keys):
    """deterministic=True: dq/dk/dv bit-identical over repeated runs, and a sequence's gradients
    the same bits alone as inside a batch. GQA, so dK/dV sum a group; 2047 keys: many key blocks
    add to each dQ tile, in one chain (causal on sm90: walking upwards); "grouped": over 4k / 8k
    keys, the lengths that once took dQ groups (one chain now, its turns in closed form)."""
    seqlen_k = 2047 if keys == "one_chain" else GROUPED_KEYS_CAUSAL if causal else GROUPED_KEYS
    case = Case(3, 1023, seqlen_k, 8, 2, head_dim, "bf16", causal, arch)
    skip_if_not_built(case)
    q, k, v = (t.detach() for t in make_inputs(case, "cuda"))
    dout = make_dout(case, "cuda")
    first = _grads(case, q, k, v, dout, True)
    for _ in range(3):
        again = _grads(case, q, k, v, dout, True)
        for name, a, b in zip(("dq", "dk", "dv"), first, again):
            assert torch.equal(a, b), f"{name} differs between runs"
    alone = _grads(case, q[1:2], k[1:2], v[1:2], dout[1:2], True)
    for name, a, b in zip(("dq", "dk", "dv"), first, alone):
        assert torch.equal(a[1:2], b), f"{name} of sequence 1 differs alone and in the batch"
    # The default order is as accurate: same inputs, the two agree to rounding.
    fast = _grads(case, q, k, v, dout, False)
    for name, a, b in zip(("dq", "dk", "dv"), first, fast):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2, msg=name)


@pytest.mark.parametrize("window", [(300, 0), (100, 100), (0, -1)], ids=lambda w: f"w{w[0]}_{w[1]}")
@pytest.mark.parametrize("arch", kernel_archs(), ids=lambda a: f"sm{a}")
def test_backward_deterministic_window(arch, window):
    """deterministic=True under sliding windows, where each key block adds to its own range of
    query tiles (the fixed order's turns count only the blocks that see a tile): with a right edge
    in one chain (on sm90 walking upwards), without one ((0, -1)) in dQ groups."""
    case = Case(2, 1500, GROUPED_KEYS, 4, 2, 128, "bf16", False, arch, window=window)
    skip_if_not_built(case)
    q, k, v = (t.detach() for t in make_inputs(case, "cuda"))
    dout = make_dout(case, "cuda")

    def grads():
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        with cutlass_flash.force_arch(case.arch):
            out = flash_attn_func(qg, kg, vg, window_size=window, deterministic=True)
        return torch.autograd.grad(out, (qg, kg, vg), dout)

    first = grads()
    for _ in range(3):
        for name, a, b in zip(("dq", "dk", "dv"), first, grads()):
            assert torch.equal(a, b), f"{name} differs between runs"


# -- torch.library.opcheck ------------------------------------------------------------------------

OPCHECK_CASES = [
    Case(2, 64, 96, 4, 4, 64, "bf16", False, 0),
    Case(2, 77, 50, 6, 2, 40, "fp16", True, 0),
]


@pytest.mark.parametrize("case", OPCHECK_CASES, ids=lambda c: c.id)
def test_opcheck(case):
    skip_if_not_built(case)
    q, k, v = make_inputs(case, "cuda")
    q, k, v = (t.detach().contiguous().requires_grad_() for t in (q, k, v))
    wr = 0 if case.causal else -1
    scale = case.head_dim ** -0.5
    tol = dict(atol=2e-2, rtol=2e-2)
    torch.library.opcheck(torch.ops.cutlass_flash.fwd.default, (q, k, v, scale, -1, wr, 0, False), **tol)
    out, lse = torch.ops.cutlass_flash.fwd(q, k, v, scale, -1, wr, 0, False)
    dout = make_dout(case, "cuda")
    torch.library.opcheck(
        torch.ops.cutlass_flash.bwd.default,
        (dout, q.detach(), k.detach(), v.detach(), out.detach(), lse, scale, -1, wr, 0, False),
        **tol,
    )


# -- torch.compile --------------------------------------------------------------------------------

class TinyAttention(torch.nn.Module):
    def __init__(self, dim=256, nheads=4, nheads_kv=2):
        super().__init__()
        self.nheads, self.nheads_kv, self.head_dim = nheads, nheads_kv, dim // nheads
        kv_dim = nheads_kv * self.head_dim
        self.q = torch.nn.Linear(dim, dim, device="cuda", dtype=torch.bfloat16)
        self.kv = torch.nn.Linear(dim, 2 * kv_dim, device="cuda", dtype=torch.bfloat16)
        self.proj = torch.nn.Linear(dim, dim, device="cuda", dtype=torch.bfloat16)
        self.norm = torch.nn.LayerNorm(dim, device="cuda", dtype=torch.bfloat16)

    def forward(self, x):
        b, s, dim = x.shape
        h = self.norm(x)
        q = self.q(h).view(b, s, self.nheads, self.head_dim)
        k, v = self.kv(h).view(b, s, 2, self.nheads_kv, self.head_dim).unbind(2)
        y = flash_attn_func(q, k, v, causal=True).reshape(b, s, dim)
        return (x + self.proj(y)).float().square().mean()


def _train_step(model, fn, x):
    model.zero_grad(set_to_none=True)
    loss = fn(x)
    loss.backward()
    return loss.detach(), [p.grad.detach().clone() for p in model.parameters()]


def test_compile_fullgraph_training_step():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TinyAttention()
    skip_if_not_built(Case(2, 200, 200, model.nheads, model.nheads_kv, model.head_dim, "bf16", True, 0))
    x = torch.randn(2, 200, 256, device="cuda", dtype=torch.bfloat16)
    loss_e, grads_e = _train_step(model, model, x)
    compiled = torch.compile(model, fullgraph=True)  # raises on any graph break
    loss_c, grads_c = _train_step(model, compiled, x)
    torch.testing.assert_close(loss_c, loss_e, rtol=2e-2, atol=1e-4)
    for (name, _), gc, ge in zip(model.named_parameters(), grads_c, grads_e):
        scale = ge.abs().max().item()
        err = (gc.float() - ge.float()).abs().max().item()
        assert err <= 5e-2 * scale + 1e-6, f"{name}: max|compiled - eager| = {err} (max {scale})"
    torch._dynamo.reset()


# -- kernel families -----------------------------------------------------------------------------

# The automatic choice, which CUTLASS_FLASH_FORCE_ARCH (a run that forces a family on every test)
# replaces.
_env_forces_family = pytest.mark.skipif(
    os.environ.get("CUTLASS_FLASH_FORCE_ARCH", "0") not in ("", "0"),
    reason="CUTLASS_FLASH_FORCE_ARCH forces a family: no automatic choice to check")


@_env_forces_family
@pytest.mark.skipif(not _sm90(), reason="needs an sm90 GPU")
def test_force_arch_80_on_sm90(spy):
    case = Case(2, 239, 300, 4, 2, 128, "bf16", True, 80)
    check_case(case)  # check_case runs under force_arch(case.arch)
    assert spy.calls == [("fwd", 80), ("bwd", 80)]
    spy.calls.clear()
    q, k, v = make_inputs(case, "cuda")
    flash_attn_func(q, k, v).sum().backward()
    expected = 90 if (90, "fwd", 128, "bf16") in cutlass_flash.built_kernels() else 80
    assert spy.calls[0] == ("fwd", expected)


@pytest.mark.skipif(_sm90(), reason="runs on GPUs that are not sm90")
def test_force_arch_90_needs_sm90():
    q, k, v = (t.detach() for t in make_inputs(Case(1, 16, 16, 2, 2, 64, "fp16", False, 0), "cuda"))
    with cutlass_flash.force_arch(90), pytest.raises(RuntimeError, match="sm90"):
        flash_attn_func(q, k, v)


@_env_forces_family
def test_auto_arch(spy):
    case = Case(1, 128, 128, 2, 2, 64, "fp16", False, 0)
    skip_if_not_built(Case(1, 128, 128, 2, 2, 64, "fp16", False, 80))
    q, k, v = make_inputs(case, "cuda")
    flash_attn_func(q, k, v).sum().backward()
    built = set(cutlass_flash.built_kernels())
    expected = [(d, 90 if _sm90() and (90, d, 64, "fp16") in built else 80) for d in ("fwd", "bwd")]
    assert spy.calls == expected


def test_missing_kernel_raises_not_implemented(monkeypatch):
    hidden = [(a, d, 128, "bf16") for a in (80, 90) for d in ("fwd", "bwd")]
    monkeypatch.setattr(_dispatch, "_C", SpyC(_dispatch.lib(), hide=hidden))
    _dispatch.reset_caches()
    try:
        q, k, v = (t.detach() for t in make_inputs(Case(1, 32, 32, 2, 2, 128, "bf16", False, 0),
                                                    "cuda"))
        with pytest.raises(NotImplementedError, match=r"head_dim=128, dtype=bf16"):
            flash_attn_func(q, k, v)
        # A padded head dim that maps onto the missing one fails the same way.
        with pytest.raises(NotImplementedError, match=r"head_dim=128"):
            flash_attn_func(q[..., :104], k[..., :104], v[..., :104])
    finally:
        _dispatch.reset_caches()


# -- streams, CUDA graphs, devices ---------------------------------------------------------------

def test_side_stream():
    case = Case(2, 300, 300, 4, 4, 64, "fp16", True, 0)
    skip_if_not_built(case)
    q, k, v = (t.detach() for t in make_inputs(case, "cuda"))
    ref = flash_attn_func(q, k, v, causal=True)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        out = flash_attn_func(q, k, v, causal=True)
    torch.cuda.current_stream().wait_stream(s)
    assert torch.equal(out, ref)


def test_cuda_graph_capture():
    case = Case(2, 256, 256, 4, 2, 128, "bf16", True, 0)
    skip_if_not_built(case)
    q, k, v = (t.detach() for t in make_inputs(case, "cuda"))
    ref = flash_attn_func(q, k, v, causal=True)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up outside capture
        flash_attn_func(q, k, v, causal=True)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flash_attn_func(q, k, v, causal=True)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, ref)


def test_cuda_graph_dropout_draws_anew_each_replay():
    """Dropout inside a CUDA graph: the captured generator call writes a new (seed, offset) on
    each replay, which the kernels read from device memory; each replay's output is attention
    under that replay's mask (the low-level forward returns its rng_state buffer)."""
    from cutlass_flash import dropout
    from cutlass_flash.lowlevel import _flash_attn_forward

    case = Case(2, 200, 200, 4, 2, 128, "bf16", False, 0)
    skip_if_not_built(case)
    q, k, v = (t.detach() for t in make_inputs(case, "cuda"))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up outside capture
        _flash_attn_forward(q, k, v, 0.3, None, False)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, _, _, rng_state = _flash_attn_forward(q, k, v, 0.3, None, False)
    outs, states = [], []
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        outs.append(out.clone())
        states.append(rng_state.clone())
    assert not torch.equal(states[0], states[1]) and not torch.equal(outs[0], outs[1])
    for o, st in zip(outs, states):
        keep = dropout.keep_mask(st, case.batch, case.nheads, case.seqlen_q, case.seqlen_k, 0.3)
        ref = reference_outputs(q, k, v, torch.zeros_like(q), dtype=torch.float64, dropout_p=0.3, keep=keep)
        same = reference_outputs(q, k, v, torch.zeros_like(q), dropout_p=0.3, keep=keep)
        assert_within_tolerance("out", o, same[0], ref[0])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tensors_on_second_gpu():
    case = Case(2, 128, 200, 4, 2, 64, "bf16", True, 0)
    skip_if_not_built(case)
    torch.cuda.set_device(0)
    check_case(case, device="cuda:1")
    assert torch.cuda.current_device() == 0


@pytest.mark.parametrize("arch", kernel_archs(), ids=lambda a: f"sm{a}")
def test_softcap_after_a_call_without(arch):
    """Calls of the same shapes with and without softcap, in turn: each gets its own (the sm90
    launchers cache their TMA plans by shape; softcap must not come from the cache)."""
    case = Case(2, 200, 300, 4, 2, 64, "bf16", False, arch, q_scale=4.0, softcap=5.0)
    skip_if_not_built(case)
    q, k, v = make_inputs(case, "cuda")
    dout = make_dout(case, "cuda")
    with cutlass_flash.force_arch(arch):
        for cap in (0.0, 5.0, 0.0, 5.0):
            out, lse = flash_attn_func(q, k, v, softcap=cap, return_lse=True)
            grads = torch.autograd.grad(out, (q, k, v), dout)
            ref = reference_outputs(q, k, v, dout, dtype=torch.float64, softcap=cap)
            same = reference_outputs(q, k, v, dout, softcap=cap)
            for name, o, s, r in zip(OUTPUT_NAMES, (out, lse) + grads, same, ref):
                assert_within_tolerance(f"softcap={cap} {name}", o, s, r, slack=1e-3)


@pytest.mark.parametrize("head_dim", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["nomask", "causal"])
@pytest.mark.parametrize("arch", kernel_archs(), ids=lambda a: f"sm{a}")
def test_softcap_with_alibi(arch, causal, head_dim):
    """softcap and ALiBi in one call (tanh first, then the bias, FlashAttention-2's order), q
    scaled so that tanh saturates, by the accuracy rule: out and lse where the forward takes the
    pair, the gradients too where the backward does (the generator's SOFTCAP_ALIBI: the sm90
    backward from d = 96, and at d = 64 zero-padded to 96); elsewhere the backward refuses it."""
    case = Case(2, 239, 200, 4, 2, head_dim, "bf16", causal, arch, q_scale=4.0, softcap=5.0, alibi=2)
    skip_if_not_built(case)
    takes = {d: any(t >= head_dim for t in _catalog.SOFTCAP_ALIBI.get(arch, {}).get(d, ())) for d in ("fwd", "bwd")}
    assert takes["fwd"], "every forward takes the pair"
    q, k, v = (t.detach().requires_grad_() for t in make_inputs(case, "cuda"))
    slopes = case.alibi_slopes("cuda")
    dout = make_dout(case, "cuda")
    with cutlass_flash.force_arch(arch):
        out, lse = flash_attn_func(q, k, v, causal=causal, softcap=case.softcap, alibi_slopes=slopes, return_lse=True)
        if not takes["bwd"]:
            with pytest.raises(NotImplementedError, match="softcap and alibi_slopes together"):
                torch.autograd.grad(out, (q, k, v), dout)
        else:
            grads = torch.autograd.grad(out, (q, k, v), dout)
    features = dict(window=case.mask, softcap=case.softcap, alibi_slopes=slopes)
    ref = reference_outputs(q, k, v, dout, dtype=torch.float64, **features)
    same = reference_outputs(q, k, v, dout, **features)
    ours = (out, lse) + (grads if takes["bwd"] else ())
    rows_per_key = case.seqlen_q * (case.nheads // case.nheads_kv)
    for name, o, s_, r in zip(OUTPUT_NAMES, ours, same, ref):
        assert_within_tolerance(f"{case.id}: {name}", o, s_, r, slack=slack(name, rows_per_key, head_dim))


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("arch", kernel_archs(), ids=lambda a: f"sm{a}")
def test_row_max_rising_along_the_walk(arch, head_dim, dtype):
    """Logits that rise by 5 (log2 units) per 128 keys in the order the kernels walk the keys (from
    the last key block down): the forward keeps a stale row max while a key block's max stays
    within 2^8 of it (P up to 256 there) and rescales when it rises further, about every second
    block (common/softmax.h); the last blocks walked carry most of the weight, so a wrong rescale
    or offset shows. By the accuracy rule on out, lse and the gradients. Each query has a
    component along one direction u, each key one that grows towards key 0."""
    case = Case(2, 300, 1100, 4, 2, head_dim, dtype, False, arch)
    skip_if_not_built(case)
    q, k, v = (t.detach() for t in make_inputs(case, "cuda"))
    g = torch.Generator(device="cuda").manual_seed(case.seed + 1)
    u = torch.randn(head_dim, device="cuda", generator=g)
    u /= u.norm()
    c = 4.0  # q's component along u
    log2_per_unit = c * math.log2(math.e) / math.sqrt(head_dim)  # scaled log2 score per unit of k along u
    ramp = torch.arange(case.seqlen_k - 1, -1, -1, device="cuda", dtype=torch.float32) * (5.0 / 128) / log2_per_unit
    q = (q.float() + c * u).to(q.dtype).requires_grad_()
    k = (k.float() + ramp.view(1, -1, 1, 1) * u).to(k.dtype).requires_grad_()
    v = v.clone().requires_grad_()
    dout = make_dout(case, "cuda")
    with cutlass_flash.force_arch(arch):
        out, lse = flash_attn_func(q, k, v, return_lse=True)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref = reference_outputs(q, k, v, dout, dtype=torch.float64)
    same = reference_outputs(q, k, v, dout)
    for name, o, s, r in zip(OUTPUT_NAMES, (out, lse) + grads, same, ref):
        assert_within_tolerance(f"{case.id}: {name}", o, s, r, slack=1e-3)
