"""Attention sinks (``sinks=``, gpt-oss): one logit per head that joins every row's softmax
denominator. By the accuracy rule on out, lse, dq, dk, dv and dsinks against the float64 reference
(tests/attn_ref.py: the sinks as one more column of the scores, dropped after the softmax), dense
and packed, both families. Each check also measures how far the reference without sinks is, so
that a kernel ignoring the sinks would fail it (``_assert_sinks_matter``). On CPU the same checks
run the fake binding (the plumbing: the sinks' pointer, the dsinks rows and their sum, the packed
layout); on the GPU the kernels."""

import pytest
import torch

import cutlass_flash
from attn_ref import assert_within_tolerance, max_abs_err, reference_outputs, slack
from cases import Case, kernel_archs
from gpu_check import skip_if_not_built
from test_varlen import _mask, _reference, packed

NAMES = ("out", "lse", "dq", "dk", "dv", "dsinks")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _sinks(nheads, device, dtype=torch.float32):
    """From a sink that takes little of a row to one that takes most of it: a row of 200 keys of
    unit-variance q, k at scale 1/sqrt(d) sums to about 200 e^0.5 = 330 = e^5.8."""
    return torch.linspace(-2.0, 6.0, nheads).to(device=device, dtype=dtype).requires_grad_()


def _dense(batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    q, k, v = (randn(batch, s, h, head_dim).requires_grad_()
               for s, h in ((seqlen_q, nheads), (seqlen_k, nheads_kv), (seqlen_k, nheads_kv)))
    return q, k, v, randn(batch, seqlen_q, nheads, head_dim)


def _assert_sinks_matter(ref, same, ref_without):
    """The reference without sinks must miss out and lse by far more than the rule allows
    (2 x the same-dtype error + slack), or a kernel that ignores the sinks would pass."""
    for i, name in enumerate(("out", "lse")):
        finite = torch.isfinite(ref[i]) & torch.isfinite(ref_without[i])
        gap = max_abs_err(ref[i][finite], ref_without[i][finite])
        allowed = 2 * max_abs_err(same[i][finite], ref[i][finite]) + slack(name, 1, 1)
        assert gap > 5 * allowed, f"{name}: the sinks move it by {gap:.3g} only; the check could not fail"


def _dsinks_slack(out, dout, lse, sinks, dtype, packed=False):
    """The part of dsinks' error that comes from D = rowsum(dout * out) with out rounded to the
    dtype, as every FlashAttention backward (FlashAttention-4's dsinks included) takes D: each out
    element off by up to u (the unit roundoff) relative, in random directions, so dsinks = -sum of
    P_sink D over a head's rows is off by about u sqrt(sum P_sink^2 sum_d (dout out)^2); three of
    those. PyTorch's same-dtype autograd takes D from P and dP instead, without that rounding.
    A dsinks off by a tenth is still far outside (the rows' terms add to ~sqrt(rows) of them)."""
    u = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}[dtype]
    terms = (dout.double() * out.double()) ** 2  # (..., rows, heads, d)
    per_row = terms.sum(-1).transpose(-1, -2)  # (heads, rows) or (batch, heads, rows)
    p_sink = torch.exp(sinks.detach().double().view(-1, 1) - lse.double())
    sums = (p_sink ** 2 * per_row).nan_to_num()
    sums = sums.sum(-1) if packed else sums.sum(-1).sum(0)
    return 3 * u * sums.sqrt().max().item()


def _check(ours, same, ref, rows_per_key, head_dim, what, dsinks_slack):
    for name, o, s, r in zip(NAMES, ours, same, ref):
        extra = dsinks_slack if name == "dsinks" else 0.0
        assert_within_tolerance(f"{what}: {name}", o, s, r, slack=slack(name, rows_per_key, head_dim) + extra)


def _check_dense(device, arch, head_dim, dtype, causal, window=(-1, -1), deterministic=False,
                 shape=(2, 239, 200, 4, 2)):
    batch, seqlen_q, seqlen_k, nheads, nheads_kv = shape
    q, k, v, dout = _dense(batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, DTYPES[dtype], device,
                           seed=head_dim)
    sinks = _sinks(nheads, device)
    if device != "cpu":
        torch.full((64 << 20,), float("nan"), device=device)  # poison the caching allocator
    with cutlass_flash.force_arch(arch):
        out, lse = cutlass_flash.flash_attn_func(q, k, v, causal=causal, window_size=window,
                                                 deterministic=deterministic, sinks=sinks, return_lse=True)
        grads = torch.autograd.grad(out, (q, k, v, sinks), dout)
    assert grads[3].dtype == sinks.dtype
    left, right = cutlass_flash._validate.check_mask(causal, window, seqlen_k)
    ref = reference_outputs(q, k, v, dout, dtype=torch.float64, window=(left, right), sinks=sinks)
    same = reference_outputs(q, k, v, dout, window=(left, right), sinks=sinks)
    rows_per_key = seqlen_q * nheads // nheads_kv
    _check((out, lse) + grads, same, ref, rows_per_key, head_dim, f"sm{arch} d={head_dim} {dtype}",
           _dsinks_slack(ref[0], dout, ref[1], sinks, DTYPES[dtype]))
    _assert_sinks_matter(ref, same, reference_outputs(q, k, v, dout, dtype=torch.float64, window=(left, right)))
    return out, lse, grads


LENGTHS_Q = (1, 17, 0, 130, 300, 33)
LENGTHS_K = (20, 1, 4, 100, 257, 0)  # the last sequence has no keys: out 0, lse = the sink


def _check_packed(device, arch, head_dim, dtype, causal):
    lq, lk, nheads, nheads_kv = LENGTHS_Q, LENGTHS_K, 4, 2
    q, k, v, dout, cu_q, cu_k = packed(lq, lk, nheads, nheads_kv, head_dim, DTYPES[dtype], device, seed=head_dim)
    sinks = _sinks(nheads, device, torch.bfloat16)  # the dtype transformers passes
    with cutlass_flash.force_arch(arch):
        out, lse = cutlass_flash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=causal,
                                                        sinks=sinks, return_lse=True)
        ours = (out, lse) + torch.autograd.grad(out, (q, k, v, sinks), dout)

    def reference(dtype_ref, with_sinks=True):
        return _reference(q, k, v, dout, cu_q, cu_k, lq, lk, dtype_ref, _mask(causal, (-1, -1), max(lk)),
                          sinks=sinks if with_sinks else None)

    ref, same = reference(torch.float64), reference(None)
    _check(ours, same, ref, max(lq) * nheads // nheads_kv, head_dim, f"packed sm{arch} d={head_dim} {dtype}",
           _dsinks_slack(ref[0], dout, ref[1], sinks, DTYPES[dtype], packed=True))
    assert torch.equal(ours[1][:, sum(lq[:-1]):], sinks.detach().float()[:, None].expand(-1, lq[-1])), \
        "rows without keys: lse = the sink"
    _assert_sinks_matter(ref, same, reference(torch.float64, with_sinks=False))


# -- CPU, on the fake binding --------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True], ids=["nomask", "causal"])
def test_sinks_dense_fake(fake_backend, causal):
    _check_dense("cpu", 90, 64, "bf16", causal)
    assert all(p.get("sinks") for _, _, p in fake_backend.calls)


def test_sinks_rows_without_keys_fake(fake_backend):
    """seqlen_q > seqlen_k under a causal mask: the first rows see no key, out 0 and lse the sink."""
    out, lse, _ = _check_dense("cpu", 90, 64, "bf16", True, shape=(1, 50, 20, 4, 2))
    assert torch.equal(lse[0, :, :30], _sinks(4, "cpu").detach()[:, None].expand(-1, 30))
    assert not out[0, :30].any()


def test_sinks_packed_fake(fake_backend):
    _check_packed("cpu", 90, 64, "bf16", causal=True)


def test_no_sinks_gives_no_sink_gradient_fake(fake_backend):
    q, k, v, dout = _dense(1, 16, 16, 2, 2, 64, torch.bfloat16, "cpu")
    out = cutlass_flash.flash_attn_func(q, k, v)
    dq, dk, dv, dsinks = torch.ops.cutlass_flash.bwd(dout, q, k, v, out, torch.zeros(1, 2, 16), 0.125, -1, -1, 0,
                                                     False)
    assert dsinks.numel() == 0


@pytest.mark.parametrize("sinks, exc, match", [
    (lambda: [0.0, 0.0], TypeError, "sinks must be None or a tensor"),
    (lambda: torch.zeros(4, dtype=torch.int32), TypeError, "sinks must be float32, float16 or bfloat16"),
    (lambda: torch.zeros(3), ValueError, r"sinks must have shape \(4,\)"),
    (lambda: torch.zeros(1, 4), ValueError, r"sinks must have shape \(4,\)"),
    (lambda: torch.zeros(4, device="meta"), ValueError, "sinks must be on q's device"),
])
def test_bad_sinks(fake_backend, sinks, exc, match):
    q, k, v, _ = _dense(1, 8, 8, 4, 2, 64, torch.bfloat16, "cpu")
    with pytest.raises(exc, match=match):
        cutlass_flash.flash_attn_func(q, k, v, sinks=sinks())
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(exc, match=match):
        cutlass_flash.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 8, 8, sinks=sinks())


# -- GPU ------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["nomask", "causal"])
@pytest.mark.parametrize("arch", kernel_archs(), ids=lambda a: f"sm{a}")
def test_sinks_dense(arch, causal, head_dim, dtype):
    if dtype == "fp16" and head_dim not in (64, 128):
        pytest.skip("fp16: two head dims suffice (the dtype changes no addressing)")
    skip_if_not_built(Case(1, 1, 1, 4, 2, head_dim, dtype, causal, arch))
    _check_dense("cuda", arch, head_dim, dtype, causal)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", kernel_archs(), ids=lambda a: f"sm{a}")
def test_sinks_window_rows_without_keys_deterministic(arch):
    """A window under which the first rows see no key (seqlen_q > seqlen_k, causal), deterministic:
    lse = the sink there, and dsinks bit-identical from run to run."""
    skip_if_not_built(Case(1, 1, 1, 4, 2, 128, "bf16", True, arch))
    shape = (2, 700, 300, 4, 1)
    out, lse, grads = _check_dense("cuda", arch, 128, "bf16", True, window=(100, 0), deterministic=True, shape=shape)
    assert not out[:, :400].any()
    assert torch.equal(lse[:, :, :400], _sinks(4, "cuda").detach()[None, :, None].expand(2, -1, 400))
    _, _, again = _check_dense("cuda", arch, 128, "bf16", True, window=(100, 0), deterministic=True, shape=shape)
    assert all(torch.equal(a, b) for a, b in zip(grads, again))


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["nomask", "causal"])
@pytest.mark.parametrize("arch", kernel_archs(), ids=lambda a: f"sm{a}")
def test_sinks_packed(arch, causal, head_dim):
    skip_if_not_built(Case(1, 1, 1, 4, 2, head_dim, "bf16", causal, arch))
    _check_packed("cuda", arch, head_dim, "bf16", causal)
