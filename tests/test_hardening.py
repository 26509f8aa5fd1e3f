"""Calls an ordinary user makes that once crashed, hung or gave silent NaN (issue 31's table), each
on the fake binding (CPU: the Python layer, against the float64 reference it computes) and on the
GPU (the kernels). Each test names its row."""

import math
import threading

import pytest
import torch

import cutlass_flash
from cutlass_flash import _dispatch, _validate, flash_attn_func, flash_attn_varlen_func
from cutlass_flash.lowlevel import _flash_attn_backward, _flash_attn_forward
from attn_ref import assert_within_tolerance, reference_outputs, slack
from gpu_check import skip_unless_auto_built

DEVICES = [pytest.param("cpu", id="fake"), pytest.param("cuda", id="gpu", marks=pytest.mark.gpu)]


@pytest.fixture(params=DEVICES)
def device(request):
    """"cpu": the fake binding (tests/fake_c.py); "cuda": the kernels."""
    if request.param == "cpu":
        request.getfixturevalue("fake_backend")
    return request.param


def _randn(*shape, device, dtype=torch.bfloat16, seed=0, grad=True):
    g = torch.Generator(device=device).manual_seed(seed)
    t = torch.randn(*shape, generator=g, device=device, dtype=torch.float32).to(dtype)
    return t.requires_grad_(grad)


def _check_rule(ours, q, k, v, dout, **kw):
    """ours = (out, lse, dq, dk, dv) against the float64 reference by the accuracy rule."""
    ref = reference_outputs(q, k, v, dout, dtype=torch.float64, **kw)
    same = reference_outputs(q, k, v, dout, **kw)
    rows = q.shape[1] * q.shape[2] // k.shape[2]
    for name, a, b, c in zip(("out", "lse", "dq", "dk", "dv"), ours, same, ref):
        assert_within_tolerance(name, a, b, c, slack(name, rows, q.shape[-1]))


def _ours(q, k, v, dout, **kw):
    out, lse = flash_attn_func(q, k, v, return_lse=True, **kw)
    return (out, lse, *torch.autograd.grad(out, (q, k, v), dout))


# -- Row 1: a dout with stride 0 (pooling) -------------------------------------------------------

def test_row01_pooled_output_trains(device):
    skip_unless_auto_built(64, "bf16") if device == "cuda" else None
    q, k, v = (_randn(2, 37, 4, 64, device=device, seed=s) for s in range(3))
    out = flash_attn_func(q, k, v, causal=True)
    out.mean(dim=1).sum().backward()  # autograd's dout: expand() of the pooled gradient, stride 0
    dout = torch.full_like(out, 1.0 / out.shape[1])
    _, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
    grads = (q.grad, k.grad, v.grad)
    _check_rule((out, lse, *grads), q, k, v, dout, causal=True)


# -- Row 2: K / V made with expand() -------------------------------------------------------------

@pytest.mark.parametrize("broadcast", ["heads", "batch"])
def test_row02_expanded_kv(device, broadcast):
    skip_unless_auto_built(64, "bf16") if device == "cuda" else None
    B, S, H, D = 3, 29, 4, 64
    q = _randn(B, S, H, D, device=device)
    if broadcast == "heads":  # MQA by broadcast: one K/V head seen as H
        k0, v0 = _randn(B, S, 1, D, device=device, seed=1), _randn(B, S, 1, D, device=device, seed=2)
        k, v = k0.expand(B, S, H, D), v0.expand(B, S, H, D)
    else:  # one K/V shared across the batch
        k0, v0 = _randn(1, S, H, D, device=device, seed=1), _randn(1, S, H, D, device=device, seed=2)
        k, v = k0.expand(B, S, H, D), v0.expand(B, S, H, D)
    dout = _randn(B, S, H, D, device=device, seed=3, grad=False)
    out, lse = flash_attn_func(q, k, v, return_lse=True)
    dq, dk0, dv0 = torch.autograd.grad(out, (q, k0, v0), dout)
    # The reference on materialized copies; the expanded leaves' gradients are the sums over the
    # broadcast dimension, as autograd's expand backward gives.
    kc, vc = (t.detach().contiguous().requires_grad_() for t in (k, v))
    ref_dk = reference_outputs(q, kc, vc, dout, dtype=torch.float64)
    dims = (2,) if broadcast == "heads" else (0,)
    ref = (*ref_dk[:3], ref_dk[3].sum(dims, keepdim=True), ref_dk[4].sum(dims, keepdim=True))
    same_all = reference_outputs(q, kc, vc, dout)
    same = (*same_all[:3], same_all[3].float().sum(dims, keepdim=True), same_all[4].float().sum(dims, keepdim=True))
    for name, a, b, c in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, dq, dk0, dv0), same, ref):
        assert_within_tolerance(name, a, b, c, slack(name, 4 * S, D))


# -- Row 3: softmax_scale negative or 0 ----------------------------------------------------------

@pytest.mark.parametrize("scale", [-0.125, -1.5, 0.0])
@pytest.mark.parametrize("alibi", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_row03_nonpositive_softmax_scale(device, scale, alibi, dtype):
    if device == "cuda":
        skip_unless_auto_built(64, "fp16" if dtype == torch.float16 else "bf16")
    B, Sq, Sk, H, D = 2, 45, 61, 4, 64
    q, k, v = (_randn(B, S, H, D, device=device, dtype=dtype, seed=s) for s, S in enumerate((Sq, Sk, Sk)))
    dout = _randn(B, Sq, H, D, device=device, dtype=dtype, seed=3, grad=False)
    slopes = torch.rand(H, device=device, generator=torch.Generator(device).manual_seed(4)) if alibi else None
    ours = _ours(q, k, v, dout, softmax_scale=scale, causal=True, alibi_slopes=slopes)
    _check_rule(ours, q, k, v, dout, softmax_scale=scale, causal=True, alibi_slopes=slopes)


def test_row03_zero_scale_is_the_mean_of_visible_values(device):
    skip_unless_auto_built(64, "bf16") if device == "cuda" else None
    q, k, v = (_randn(1, 16, 2, 64, device=device, seed=s, grad=False) for s in range(3))
    out = flash_attn_func(q, k, v, softmax_scale=0.0, causal=True)
    counts = torch.arange(1, 17, device=device, dtype=torch.float32).view(1, 16, 1, 1)
    want = v.float().cumsum(1) / counts
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)


# -- Row 4: every tensor argument of the public functions and ops is checked ---------------------

def _small(device):
    q, k, v = (_randn(2, 16, 4, 64, device=device, seed=s, grad=False) for s in range(3))
    return q, k, v


def test_row04_lowlevel_backward_checks_lse(device):
    q, k, v = _small(device)
    out, lse, _, _ = _flash_attn_forward(q, k, v, 0.0, None, False)
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    bad = {"on the CPU": lse.to("meta") if device == "cpu" else lse.cpu(),
           "float64": lse.double(), "shaped wrong": lse[:, :, :8]}
    for why, lse_bad in bad.items():
        with pytest.raises(ValueError, match="softmax_lse"):
            _flash_attn_backward(q, q, k, v, out, lse_bad, dq, dk, dv, 0.0, None, False)
    if device == "cuda":
        torch.cuda.synchronize()  # the process still works
        assert torch.isfinite(flash_attn_func(q, k, v)).all()


def test_row04_ops_check_their_tensor_arguments(device):
    q, k, v = _small(device)
    # A tensor on another device: CPU beside CUDA (on the fake, a meta tensor would send the op
    # to its fake implementation instead).
    other = "cpu" if device == "cuda" else None
    fwd = torch.ops.cutlass_flash.fwd
    if other:
        with pytest.raises(ValueError, match="alibi_slopes must be on"):
            fwd(q, k, v, 0.125, -1, -1, 0, False, 0.0, torch.ones(4, device=other))
    with pytest.raises(ValueError, match="alibi_slopes must have shape"):
        fwd(q, k, v, 0.125, -1, -1, 0, False, 0.0, torch.ones(5, device=device))
    with pytest.raises(TypeError, match="alibi_slopes must be float32"):
        fwd(q, k, v, 0.125, -1, -1, 0, False, 0.0, torch.ones(4, device=device, dtype=torch.float16))
    with pytest.raises(ValueError, match="rng_state"):
        fwd(q, k, v, 0.125, -1, -1, 0, False, 0.0, None, 0.1, None)
    if other:
        with pytest.raises(ValueError, match="rng_state must be on"):
            fwd(q, k, v, 0.125, -1, -1, 0, False, 0.0, None, 0.1, torch.zeros(2, dtype=torch.int64, device=other))
    qp, kp, vp = (t.reshape(32, 4, 64) for t in (q, k, v))
    cu = torch.tensor([0, 16, 32], dtype=torch.int32, device=device)
    def vf(cu_q, cu_k, **kw):
        return fwd(qp, kp, vp, 0.125, -1, -1, 0, False, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=16,
                   max_seqlen_k=16, **kw)

    if other:
        with pytest.raises(ValueError, match="cu_seqlens_q must be on"):
            vf(cu.to(other), cu)
    with pytest.raises(TypeError, match="cu_seqlens_k must be int32"):
        vf(cu, cu.long())
    with pytest.raises(TypeError, match="cu_seqlens_k must be an int32 tensor"):
        vf(cu, None)
    with pytest.raises(ValueError, match="seqused_k must have shape"):
        vf(cu, cu, seqused_k=cu)
    with pytest.raises(ValueError, match="with cu_seqlens, q, k, v, out and dout must be packed"):
        fwd(q, k, v, 0.125, -1, -1, 0, False, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=16, max_seqlen_k=16)
    out, lse = fwd(q, k, v, 0.125, -1, -1, 0, False)
    with pytest.raises(ValueError, match="softmax_lse must be float32"):
        torch.ops.cutlass_flash.bwd(q, q, k, v, out, lse[:, :2], 0.125, -1, -1, 0, False)
    if other:
        with pytest.raises(ValueError, match="softmax_lse must be on"):
            torch.ops.cutlass_flash.bwd(q, q, k, v, out, lse.to(other), 0.125, -1, -1, 0, False)


# -- Row 5: a batch past gridDim.z's 65535 -------------------------------------------------------

def test_row05_batch_slices_match_one_launch(fake_backend, monkeypatch):
    """The slicing logic on the fake binding, with a launch limit of 2 sequences: slices give what
    one launch gives, with per-batch ALiBi and dropout (the mask follows the sequence index)."""
    B, S, H, D = 5, 12, 2, 64
    q, k, v = (_randn(B, S, H, D, device="cpu", seed=s) for s in range(3))
    dout = _randn(B, S, H, D, device="cpu", seed=3, grad=False)
    slopes = torch.rand(B, H)
    torch.manual_seed(0)
    rng = cutlass_flash.dropout.new_rng_state("cpu")

    def run():
        out, lse = torch.ops.cutlass_flash.fwd(q, k, v, 0.125, -1, -1, 0, False, 0.0, slopes, 0.2, rng)
        return (out, lse, *torch.autograd.grad(out, (q, k, v), dout))

    whole = run()
    fake_backend.calls.clear()
    monkeypatch.setattr(_dispatch, "MAX_GRID_YZ", 2)
    sliced = run()
    assert len(fake_backend.calls) == 6  # 3 slices in each direction
    for a, b in zip(whole, sliced):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_row05_limits_raise_before_any_launch(fake_backend):
    big = torch.empty(1, _validate.MAX_SEQLEN + 1, 1, 8, dtype=torch.bfloat16, device="meta")
    small = torch.empty(1, 8, 1, 8, dtype=torch.bfloat16, device="meta")
    with pytest.raises(ValueError, match="seqlen_q = .* limit"):
        _validate.check_limits(big.shape[1], 8, 1)
    with pytest.raises(ValueError, match="total_k"):
        _validate.check_limits(8, 8, 1, 1, 8, _validate.MAX_TOTAL_ROWS + 1)
    with pytest.raises(ValueError, match="tiles"):
        _validate.check_limits(1 << 29, 8, 1 << 14)
    with pytest.raises(ValueError, match="sm80 backward takes at most 8388608 query rows"):
        _validate.check_sm80_backward((1 << 23) + 1, 256)
    _validate.check_sm80_backward(1 << 23, 256)
    assert _validate.max_batch_per_launch(8, 1) == _dispatch.MAX_GRID_YZ
    assert _validate.max_batch_per_launch(1 << 20, 32) == _validate.MAX_TILES // ((1 << 14) * 32)
    del small
    q = torch.empty(1, 8, _dispatch.MAX_GRID_YZ + 1, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="nheads .* at most 65535"):
        flash_attn_func(q, q, q)
    assert fake_backend.calls == []


@pytest.mark.gpu
def test_row05_batch_70000_runs():
    skip_unless_auto_built(64, "bf16")
    B, S, H, D = 70000, 1, 16, 64
    q, k, v = (_randn(B, S, H, D, device="cuda", seed=s) for s in range(3))
    dout = _randn(B, S, H, D, device="cuda", seed=3, grad=False)
    out, lse = flash_attn_func(q, k, v, return_lse=True)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    # One key per sequence: out = v, lse = the scaled score, dv = dout, dq = dk = 0.
    torch.testing.assert_close(out, v.detach())
    torch.testing.assert_close(lse, (q.float() * k.float()).sum(-1).transpose(1, 2) / 8.0, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(dv, dout)
    assert dq.abs().max().item() < 1e-3 and dk.abs().max().item() < 1e-3
    # And with keys to attend to, the sequences past the first launch against each alone.
    q, k, v = (_randn(B, 4, 2, D, device="cuda", seed=s + 5, grad=False) for s in range(3))
    torch.manual_seed(0)
    out = flash_attn_func(q, k, v, dropout_p=0.25)
    torch.manual_seed(0)
    rng = cutlass_flash.dropout.new_rng_state("cuda")
    for b in (0, 65534, 65535, 69999):
        rng_b = rng + torch.tensor([0, b], device="cuda")
        alone, _ = torch.ops.cutlass_flash.fwd(q[b:b + 1], k[b:b + 1], v[b:b + 1], 0.125, -1, -1, 0, False,
                                               0.0, None, 0.25, rng_b)
        torch.testing.assert_close(out[b:b + 1], alone, atol=0, rtol=0)


# -- Row 6: double backward ----------------------------------------------------------------------

@pytest.mark.parametrize("path", ["eager", "op"])
def test_row06_double_backward_raises(device, path):
    skip_unless_auto_built(64, "bf16") if device == "cuda" else None
    q, k, v = _small(device)
    q.requires_grad_()
    if path == "eager":
        out = flash_attn_func(q, k, v)
    else:
        out, _ = torch.ops.cutlass_flash.fwd(q, k, v, 0.125, -1, -1, 0, False)
    (dq,) = torch.autograd.grad(out.float().square().sum(), q, create_graph=True)
    assert dq.requires_grad  # the gradient carries a graph, whose backward raises
    with pytest.raises(RuntimeError, match="double backward"):
        dq.sum().backward()


# -- Rows 7 and 8: torch.compile with dropout, dynamic shapes, the low-level pair -----------------

@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _backend(device):
    return "aot_eager" if device == "cpu" else "inductor"


@pytest.mark.parametrize("dynamic", [False, True])
def test_row07_compile_dropout_and_dynamic(device, fresh_dynamo, dynamic):
    skip_unless_auto_built(64, "bf16") if device == "cuda" else None

    def step(q, k, v):
        return flash_attn_func(q, k, v, dropout_p=0.1, causal=True).float().square().mean()

    compiled = torch.compile(step, fullgraph=True, dynamic=dynamic, backend=_backend(device))
    for S in (24, 40):
        q, k, v = (_randn(2, S, 4, 64, device=device, seed=s) for s in range(3))
        torch.manual_seed(1)
        loss = compiled(q, k, v)
        loss.backward()
        assert torch.isfinite(loss) and all(torch.isfinite(t.grad).all() for t in (q, k, v))
    # Two calls draw two masks (the draw is not merged or replayed).
    q, k, v = (_randn(1, 64, 2, 64, device=device, seed=s, grad=False) for s in range(3))
    twice = torch.compile(lambda q, k, v: (flash_attn_func(q, k, v, dropout_p=0.5),
                                           flash_attn_func(q, k, v, dropout_p=0.5)),
                          fullgraph=True, backend=_backend(device))
    a, b = twice(q, k, v)
    assert not torch.equal(a, b)


def test_row08_compile_lowlevel_pair(device, fresh_dynamo):
    skip_unless_auto_built(64, "bf16") if device == "cuda" else None
    q, k, v = _small(device)
    dout = _randn(*q.shape, device=device, seed=7, grad=False)

    def step(q, k, v, dout):
        out, lse, _, _ = _flash_attn_forward(q, k, v, 0.0, 0.125, True, -1, -1, 0.0, None, False)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        _flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, 0.0, 0.125, True, -1, -1, 0.0, None, False)
        return out, dq, dk, dv

    eager = step(q, k, v, dout)
    compiled = torch.compile(step, fullgraph=True, backend=_backend(device))(q, k, v, dout)
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_row08_opcheck_lowlevel_and_varlen_ops(device):
    skip_unless_auto_built(64, "bf16") if device == "cuda" else None
    q, k, v = _small(device)
    out, lse, _, _ = _flash_attn_forward(q, k, v, 0.0, 0.125, True)
    grads = [torch.empty_like(t) for t in (q, k, v)]
    ops = torch.ops.cutlass_flash
    torch.library.opcheck(ops._flash_attn_forward, (q, k, v, 0.0, 0.125, True))
    torch.library.opcheck(ops._flash_attn_backward, (q, q, k, v, out, lse, *grads, 0.0, 0.125, True))
    qp, kp, vp = (t.reshape(32, 4, 64) for t in (q, k, v))
    cu = torch.tensor([0, 11, 32], dtype=torch.int32, device=device)
    torch.library.opcheck(ops._flash_attn_varlen_forward, (qp, kp, vp, cu, cu, 21, 21, 0.0, 0.125, True))
    o, l, _, _ = ops._flash_attn_varlen_forward(qp, kp, vp, cu, cu, 21, 21, 0.0, 0.125, True)
    vgrads = [torch.empty_like(t) for t in (qp, kp, vp)]
    torch.library.opcheck(ops._flash_attn_varlen_backward,
                          (qp, qp, kp, vp, o, l, *vgrads, cu, cu, 21, 21, 0.0, 0.125, True))
    leaves = [t.clone().requires_grad_() for t in (qp, kp, vp)]
    packing = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=21, max_seqlen_k=21)
    torch.library.opcheck(ops.fwd, (*leaves, 0.125, -1, 0, 0, False), packing)
    torch.library.opcheck(ops.bwd, (qp, qp, kp, vp, o, l, 0.125, -1, 0, 0, False), packing)


# -- Row 9: force_arch is per thread -------------------------------------------------------------

def test_row09_force_arch_is_per_thread():
    seen = {}
    started, release = threading.Event(), threading.Event()

    def worker():
        cutlass_flash.force_arch(80)  # the plain call: stays in effect, in this thread only
        started.set()
        release.wait(10)
        seen["worker"] = cutlass_flash.forced_arch()

    before = cutlass_flash.forced_arch()
    t = threading.Thread(target=worker)
    t.start()
    started.wait(10)
    seen["main"] = cutlass_flash.forced_arch()
    with cutlass_flash.force_arch(90):
        seen["main_forced"] = cutlass_flash.forced_arch()
        release.set()
        t.join(10)
    assert seen == {"worker": 80, "main": before, "main_forced": 90}
    assert cutlass_flash.forced_arch() == before


# -- Row 10: autocast ----------------------------------------------------------------------------

def test_row10_fp32_inputs_under_autocast(device):
    skip_unless_auto_built(64, "bf16") if device == "cuda" else None
    q, k, v = (_randn(2, 20, 4, 64, device=device, dtype=torch.float32, seed=s) for s in range(3))
    with torch.autocast(device, dtype=torch.bfloat16):
        out = flash_attn_func(q, k, v, causal=True)
    assert out.dtype == torch.bfloat16
    want = flash_attn_func(*(t.detach().bfloat16() for t in (q, k, v)), causal=True)
    torch.testing.assert_close(out.detach(), want, atol=0, rtol=0)
    out.float().sum().backward()
    assert q.grad.dtype == torch.float32 and torch.isfinite(q.grad).all()
    with pytest.raises(TypeError, match="float16 or torch.bfloat16"):
        flash_attn_func(q, k, v)  # without autocast fp32 stays an error


# -- Row 14: window_size as a tensor or a list ---------------------------------------------------

@pytest.mark.parametrize("window", [[5, 2], "tensor", "numpy"])
def test_row14_window_size_any_sequence_of_two_ints(device, window):
    skip_unless_auto_built(64, "bf16") if device == "cuda" else None
    import numpy as np
    q, k, v = _small(device)
    if window == "tensor":
        window = torch.tensor([5, 2])
    elif window == "numpy":
        window = (np.int64(5), np.int32(2))
    torch.testing.assert_close(flash_attn_func(q, k, v, window_size=window),
                               flash_attn_func(q, k, v, window_size=(5, 2)), atol=0, rtol=0)


# -- Row 15 (and 12): head dims that are not instantiated, nor multiples of 8 ----------------------

@pytest.mark.parametrize("arch", [0, 80])
@pytest.mark.parametrize("head_dim", [1, 3, 59, 80, 111, 200, 255])
def test_row15_any_head_dim(device, head_dim, arch):
    """Head dims between instantiated ones: the kernels read the tensors' own columns (no copy,
    row 12); a head dim that is not a multiple of 8 is padded to one (a copy) first."""
    if device == "cuda":
        skip_unless_auto_built(cutlass_flash.padded_head_dim(head_dim), "bf16", arch)
    with cutlass_flash.force_arch(arch):
        _check_any_head_dim(device, head_dim)


def _check_any_head_dim(device, head_dim):
    B, Sq, Sk, H, Hkv = 2, 33, 50, 4, 2
    q = _randn(B, Sq, H, head_dim, device=device)
    k, v = (_randn(B, Sk, Hkv, head_dim, device=device, seed=s) for s in (1, 2))
    dout = _randn(B, Sq, H, head_dim, device=device, seed=3, grad=False)
    _check_rule(_ours(q, k, v, dout, causal=True), q, k, v, dout, causal=True)
    varlen = flash_attn_varlen_func(q.detach().reshape(-1, H, head_dim), k.detach().reshape(-1, Hkv, head_dim),
                                    v.detach().reshape(-1, Hkv, head_dim),
                                    torch.tensor([0, Sq, 2 * Sq], dtype=torch.int32, device=device),
                                    torch.tensor([0, Sk, 2 * Sk], dtype=torch.int32, device=device), Sq, Sk,
                                    causal=True)
    dense = flash_attn_func(q.detach(), k.detach(), v.detach(), causal=True)
    torch.testing.assert_close(varlen, dense.reshape(-1, H, head_dim), atol=0, rtol=0)
    assert math.isclose(_validate.check_softmax_scale(None, head_dim), head_dim ** -0.5)


# -- Row 12: both families read a narrower head dim in place ----------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("head_dim", [80, 112, 200])
@pytest.mark.parametrize("packed", [False, True])
def test_row12_narrow_head_dim_reads_and_writes_its_own_columns(head_dim, packed, arch):
    """q, k, v, dout: the first head_dim columns of wider buffers whose other columns hold NaN, so a
    kernel that read past the tensor's columns would return NaN; the gradients land in slices of
    NaN-filled buffers (the low-level pair writes them in place), whose other columns must stay
    NaN: a kernel that wrote past them would overwrite them."""
    skip_unless_auto_built(cutlass_flash.padded_head_dim(head_dim), "bf16", arch)
    if arch == 90 and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the sm90 family runs on sm90 GPUs")
    from cutlass_flash.lowlevel import _flash_attn_varlen_backward, _flash_attn_varlen_forward
    B, S, H, wide = 2, 150, 4, cutlass_flash.padded_head_dim(head_dim) + 8

    def narrow(seed):
        buf = torch.full((B, S, H, wide), float("nan"), device="cuda", dtype=torch.bfloat16)
        buf[..., :head_dim] = _randn(B, S, H, head_dim, device="cuda", seed=seed, grad=False)
        return buf[..., :head_dim]

    q, k, v, dout = (narrow(s) for s in range(4))
    grads = [torch.full((B, S, H, wide), float("nan"), device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    dq, dk, dv = (g[..., :head_dim] for g in grads)
    with cutlass_flash.force_arch(arch):
        if packed:
            cu = torch.tensor([0, 77, 2 * S], dtype=torch.int32, device="cuda")
            flat = [t.reshape(B * S, H, head_dim) for t in (q, k, v, dout, dq, dk, dv)]
            out, lse, _, _ = _flash_attn_varlen_forward(*flat[:3], cu, cu, 2 * S - 77, 2 * S - 77, 0.0, None, True)
            _flash_attn_varlen_backward(flat[3], *flat[:3], out, lse, *flat[4:], cu, cu, 2 * S - 77, 2 * S - 77,
                                        0.0, None, True)
            ref = [flash_attn_varlen_func(*(t.contiguous() for t in flat[:3]), cu, cu, 2 * S - 77, 2 * S - 77,
                                          causal=True)]
            torch.testing.assert_close(out, ref[0], atol=0, rtol=0)
        else:
            out, lse, _, _ = _flash_attn_forward(q, k, v, 0.0, None, True)
            _flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, 0.0, None, True)
            leaves = [t.contiguous().requires_grad_() for t in (q, k, v)]
            ref_out = flash_attn_func(*leaves, causal=True)
            ref_grads = torch.autograd.grad(ref_out, leaves, dout.contiguous())
            torch.testing.assert_close(out, ref_out, atol=0, rtol=0)
            for a, b in zip((dq, dk, dv), ref_grads):  # dQ's additions in finishing order: not bit-exact
                torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)
    assert torch.isfinite(out).all()
    for g in grads:
        assert torch.isfinite(g[..., :head_dim]).all(), "a gradient read NaN past the tensors' columns"
        assert torch.isnan(g[..., head_dim:]).all(), "a kernel wrote past the tensors' columns"


@pytest.mark.gpu
@pytest.mark.parametrize("arch", [80, 90])
def test_row12_narrow_head_dim_memory(arch):
    """Forward + backward at head dim 80 (run on the d = 96 kernels without copies) takes at most
    1.1x the memory of head dim 96 above the inputs."""
    skip_unless_auto_built(96, "bf16", arch)
    if arch == 90 and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the sm90 family runs on sm90 GPUs")

    def extra(head_dim):
        q, k, v = (_randn(4, 2048, 16, head_dim, device="cuda", seed=s) for s in range(3))
        dout = _randn(4, 2048, 16, head_dim, device="cuda", seed=3, grad=False)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = flash_attn_func(q, k, v, causal=True)
        torch.autograd.grad(out, (q, k, v), dout)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    with cutlass_flash.force_arch(arch):
        ratio = extra(80) / extra(96)
    assert ratio <= 1.1, f"head dim 80 took {ratio:.2f}x the memory of head dim 96"
