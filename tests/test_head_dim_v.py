"""A head dim for V other than Q and K's (DeepSeek's MLA trains with 192 for Q.K and 128 for V):
the kernels run at the larger of the two (plan()'s head_dim) with the narrower side zero-padded,
and out / dv come back at V's head dim; or, where a kernel has V's head dim as its own (the
generator's HEAD_DIMS_V: the sm90 forward and backward at (192, 128)), at their own widths. By the accuracy
rule on out, lse, dq, dk, dv against the float64 reference, dense and packed, both families; on
CPU the fake binding (the padding and the slicing), on the GPU the kernels."""

import pytest
import torch

import cutlass_flash
from attn_ref import assert_within_tolerance, reference_outputs, slack
from cases import Case, kernel_archs
from cutlass_flash._catalog import HEAD_DIMS_V
from gpu_check import poison_cuda_blocks, skip_if_not_built
from test_sinks import _dsinks_slack
from test_varlen import _cu, _reference

NAMES = ("out", "lse", "dq", "dk", "dv")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
PAIRS = [(192, 128), (64, 128), (128, 72)]  # (head dim of Q and K, of V)


def _randn(g, shape, dtype, device, grad=True):
    t = torch.randn(*shape, generator=g).to(device=device, dtype=dtype)
    return t.requires_grad_() if grad else t


def _inputs(rows_q, rows_k, nheads, nheads_kv, dqk, dv, dtype, device, lead=(), seed=0):
    g = torch.Generator().manual_seed(seed)
    return (_randn(g, (*lead, rows_q, nheads, dqk), dtype, device), _randn(g, (*lead, rows_k, nheads_kv, dqk), dtype,
                                                                          device),
            _randn(g, (*lead, rows_k, nheads_kv, dv), dtype, device),
            _randn(g, (*lead, rows_q, nheads, dv), dtype, device, grad=False))


def _check(ours, same, ref, rows_per_key, head_dim, what):
    for name, o, s, r in zip(NAMES, ours, same, ref):
        assert o.shape == r.shape, f"{what}: {name} {tuple(o.shape)} against {tuple(r.shape)}"
        assert_within_tolerance(f"{what}: {name}", o, s, r, slack=slack(name, rows_per_key, head_dim))


def _check_dense(device, arch, dqk, dv, dtype, causal, shape=(2, 239, 200, 4, 2)):
    batch, seqlen_q, seqlen_k, nheads, nheads_kv = shape
    q, k, v, dout = _inputs(seqlen_q, seqlen_k, nheads, nheads_kv, dqk, dv, DTYPES[dtype], device, (batch,), dqk)
    if device != "cpu":
        skip_if_not_built(Case(batch, seqlen_q, seqlen_k, nheads, nheads_kv, max(dqk, dv), dtype, causal, arch))
        # NaN in the caching allocator's blocks of our outputs' sizes: rows a kernel fails to
        # write hold NaN (one large block was split for them or not, as the allocator saw fit).
        rows_q, rows_k = batch * seqlen_q * nheads, batch * seqlen_k * nheads_kv
        poison_cuda_blocks({2 * rows_q * dv, 4 * rows_q, 2 * rows_q * dqk, 2 * rows_k * dqk, 2 * rows_k * dv}, device)
    with cutlass_flash.force_arch(arch):
        out, lse = cutlass_flash.flash_attn_func(q, k, v, causal=causal, return_lse=True)
        ours = (out, lse) + torch.autograd.grad(out, (q, k, v), dout)
    window = (-1, 0) if causal else (-1, -1)
    ref = reference_outputs(q, k, v, dout, dtype=torch.float64, window=window)
    same = reference_outputs(q, k, v, dout, window=window)
    _check(ours, same, ref, seqlen_q * nheads // nheads_kv, max(dqk, dv), f"sm{arch} ({dqk}, {dv}) {dtype}")


LENGTHS_Q = (1, 17, 0, 130, 33)
LENGTHS_K = (20, 1, 4, 100, 257)


def _check_packed(device, arch, dqk, dv, dtype, causal):
    lq, lk, nheads, nheads_kv = LENGTHS_Q, LENGTHS_K, 4, 2
    q, k, v, dout = _inputs(sum(lq), sum(lk), nheads, nheads_kv, dqk, dv, DTYPES[dtype], device, seed=dqk)
    cu_q, cu_k = _cu(lq, device), _cu(lk, device)
    if device != "cpu":
        skip_if_not_built(Case(1, max(lq), max(lk), nheads, nheads_kv, max(dqk, dv), dtype, causal, arch))
    with cutlass_flash.force_arch(arch):
        out, lse = cutlass_flash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=causal,
                                                        return_lse=True)
        ours = (out, lse) + torch.autograd.grad(out, (q, k, v), dout)

    def reference(dtype_ref):
        return _reference(q, k, v, dout, cu_q, cu_k, lq, lk, dtype_ref, (-1, 0) if causal else (-1, -1))

    _check(ours, reference(None), reference(torch.float64), max(lq) * nheads // nheads_kv, max(dqk, dv),
           f"packed sm{arch} ({dqk}, {dv}) {dtype}")


# -- CPU, on the fake binding --------------------------------------------------------------------


@pytest.mark.parametrize("dqk, dv", PAIRS)
@pytest.mark.parametrize("arch", [80, 90], ids=["sm80", "sm90"])
def test_head_dim_v_dense_fake(fake_backend, arch, dqk, dv):
    _check_dense("cpu", arch, dqk, dv, "bf16", causal=True, shape=(1, 70, 50, 2, 1))
    assert {p["head_dim"] for _, _, p in fake_backend.calls} == {cutlass_flash.padded_head_dim(max(dqk, dv))}
    # Each direction of a pair with a kernel of its own gets v (out, dout, dv) unpadded and
    # head_dim_v; others pad.
    for direction in ("fwd", "bwd"):
        own = dv in HEAD_DIMS_V[arch][direction].get(dqk, ())
        calls = [p.get("head_dim_v", 0) for d, _, p in fake_backend.calls if d == direction]
        assert calls == [dv if own else 0], (direction, calls)


def test_head_dim_v_packed_fake(fake_backend):
    _check_packed("cpu", 90, 192, 128, "bf16", causal=False)


def test_plan_head_dim_v(fake_backend):
    q, k = (torch.empty(1, 8, 2, 192, dtype=torch.bfloat16) for _ in range(2))
    v = torch.empty(1, 8, 2, 128, dtype=torch.bfloat16)
    assert cutlass_flash.plan(q, k, "bwd", v=v) == cutlass_flash.Plan(90, 192, 0, "bf16", 0, 128)
    assert cutlass_flash.plan(q, k, "fwd", v=v) == cutlass_flash.Plan(90, 192, 0, "bf16", 0, 128)
    with cutlass_flash.force_arch(80):
        assert cutlass_flash.plan(q, k, "bwd", v=v) == cutlass_flash.Plan(80, 192, 0, "bf16", 64, 192)
    with cutlass_flash.force_arch(80):
        assert cutlass_flash.plan(q, k, "fwd", v=v) == cutlass_flash.Plan(80, 192, 0, "bf16", 64, 192)
    assert cutlass_flash.plan(v, v, v=q).pad == 64


def test_head_dim_v_checks(fake_backend):
    q = torch.empty(1, 8, 2, 192, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="v's head_dim"):
        cutlass_flash.flash_attn_func(q, q, torch.empty(1, 8, 2, 264, dtype=torch.bfloat16))
    for bad in (0, 264):
        with pytest.raises(ValueError, match="v's head_dim"):
            cutlass_flash.plan(q, q, v=torch.empty(1, 8, 2, bad, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"k and v must have the same \(batch, seqlen, nheads\)"):
        cutlass_flash.flash_attn_func(q, q, torch.empty(1, 9, 2, 128, dtype=torch.bfloat16))


# -- GPU -------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("arch", kernel_archs(), ids=lambda a: f"sm{a}")
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("dqk, dv", PAIRS)
@pytest.mark.parametrize("causal", [False, True], ids=["nomask", "causal"])
def test_head_dim_v_accuracy(arch, dtype, dqk, dv, causal):
    _check_dense("cuda", arch, dqk, dv, dtype, causal)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", kernel_archs(), ids=lambda a: f"sm{a}")
def test_head_dim_v_keyless_tiles(arch):
    """(192, 128), causal, the first six query tiles without keys after tiles with keys on the same
    persistent block (cases.keyless_tile_cases says why)."""
    _check_dense("cuda", arch, 192, 128, "bf16", True, shape=(4, 1000, 200, 8, 2))


@pytest.mark.gpu
@pytest.mark.parametrize("arch", kernel_archs(), ids=lambda a: f"sm{a}")
@pytest.mark.parametrize("causal", [False, True], ids=["nomask", "causal"])
def test_head_dim_v_packed(arch, causal):
    _check_packed("cuda", arch, 192, 128, "bf16", causal)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", kernel_archs(), ids=lambda a: f"sm{a}")
@pytest.mark.parametrize("features", ["softcap-window-sinks", "alibi-causal"])
def test_head_dim_v_features_deterministic(arch, features):
    # (192, 128) through the kernels that take the score features (the sm90 backward's own-V
    # kernel with every feature compiled in), deterministic: by the accuracy rule, and the
    # gradients bit-identical across two calls.
    batch, seqlen_q, seqlen_k, nheads, nheads_kv, dqk, dv = 2, 239, 200, 4, 2, 192, 128
    q, k, v, dout = _inputs(seqlen_q, seqlen_k, nheads, nheads_kv, dqk, dv, torch.bfloat16, "cuda", (batch,), 7)
    skip_if_not_built(Case(batch, seqlen_q, seqlen_k, nheads, nheads_kv, dqk, "bf16", True, arch))
    kw, ref_kw, leaves = {}, {}, [q, k, v]
    if features == "softcap-window-sinks":
        sinks = torch.linspace(-2.0, 4.0, nheads, device="cuda").requires_grad_()
        kw = dict(softcap=20.0, window_size=(60, 5), sinks=sinks)
        ref_kw = dict(softcap=20.0, window=(60, 5), sinks=sinks)
        leaves.append(sinks)
    else:
        slopes = torch.linspace(0.05, 0.4, nheads, device="cuda")
        kw = dict(alibi_slopes=slopes, causal=True)
        ref_kw = dict(alibi_slopes=slopes, window=(-1, 0))
    runs = []
    with cutlass_flash.force_arch(arch):
        for _ in range(2):
            torch.full((64 << 20,), float("nan"), device="cuda")  # poison the caching allocator
            out, lse = cutlass_flash.flash_attn_func(q, k, v, deterministic=True, return_lse=True, **kw)
            runs.append((out, lse) + torch.autograd.grad(out, leaves, dout))
    for a, b in zip(runs[0], runs[1]):
        assert torch.equal(a, b), "deterministic calls differ"
    ref = reference_outputs(q, k, v, dout, dtype=torch.float64, **ref_kw)
    same = reference_outputs(q, k, v, dout, **ref_kw)
    rows = seqlen_q * nheads // nheads_kv
    what = f"sm{arch} (192, 128) {features}"
    _check(runs[0][:5], same[:5], ref[:5], rows, dqk, what)
    if "sinks" in kw:  # dsinks: D = rowsum(dout * out) over v's 128 columns (the preprocess)
        assert_within_tolerance(f"{what}: dsinks", runs[0][5], same[5], ref[5],
                                slack=slack("dsinks", rows, dqk) + _dsinks_slack(ref[0], dout, ref[1], kw["sinks"],
                                                                                 torch.bfloat16))
