"""FlashAttention-2's low-level pair (cutlass_flash.lowlevel): on the fake binding (CPU) and on
the GPU: the forward's out and LSE, the backward writing into the caller's buffers, LSE taken as
given, the padded head dims, and the argument checks."""

import pytest
import torch

import cutlass_flash
from cutlass_flash import flash_attn_func
from cutlass_flash.lowlevel import _flash_attn_backward, _flash_attn_forward
from attn_ref import assert_within_tolerance, attention_ref, reference_outputs
from cases import Case, make_dout, make_inputs
from gpu_check import skip_if_not_built, skip_unless_auto_built

CASES = [
    Case(2, 33, 47, 4, 2, 64, "bf16", True, 0),     # GQA, causal with seqlen_q < seqlen_k
    Case(1, 40, 17, 4, 4, 40, "fp16", False, 0),    # a padded head dim: buffers filled by a copy
    Case(2, 20, 20, 2, 1, 128, "bf16", False, 0, window=(3, 2)),
]


def _run(case, device):
    q, k, v = (t.detach() for t in make_inputs(case, device))
    dout = make_dout(case, device)
    left, right = case.window
    out, lse, s_dmask, rng_state = _flash_attn_forward(
        q, k, v, 0.0, None, case.causal, left, right, 0.0, None, False)
    assert s_dmask.numel() == 0 and rng_state.dtype == torch.int64
    nan = float("nan")
    dq, dk, dv = (torch.full_like(t, nan) for t in (q, k, v))
    softmax_d = _flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, 0.0, None, case.causal,
                                     left, right, 0.0, None, False)
    return q, k, v, dout, out, lse, (dq, dk, dv), softmax_d


def _check(case, device):
    q, k, v, dout, out, lse, grads, softmax_d = _run(case, device)
    # The pair gives what flash_attn_func and its autograd give (same kernels).
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out_f, lse_f = flash_attn_func(*leaves, causal=case.causal, window_size=case.window,
                                   return_lse=True)
    assert torch.equal(out, out_f.detach()) and torch.equal(lse, lse_f)
    for name, g, ref in zip(("dq", "dk", "dv"), grads, torch.autograd.grad(out_f, leaves, dout)):
        assert torch.equal(g, ref), f"{name}: the buffer differs from the autograd gradient"
    # And the float64 reference, by the accuracy rule.
    ref = reference_outputs(q, k, v, dout, dtype=torch.float64, window=case.mask)
    same = reference_outputs(q, k, v, dout, window=case.mask)
    for name, ours, pt, r in zip(("dq", "dk", "dv"), grads, same[2:], ref[2:]):
        assert_within_tolerance(name, ours, pt, r, slack=1e-4)
    sq = case.seqlen_q
    assert softmax_d.shape == (case.batch, case.nheads, -(-sq // 128) * 128)
    expected = (dout.double() * out.double()).sum(-1).transpose(1, 2)
    torch.testing.assert_close(softmax_d[..., :sq].double(), expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_pair_on_the_fake_binding(fake_backend, case):
    _check(case, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_pair_on_the_gpu(case):
    skip_if_not_built(case)
    _check(case, "cuda")


def test_lse_from_elsewhere(fake_backend):
    # Ring attention passes an LSE merged over several key blocks: the backward uses it as given.
    case = Case(1, 24, 24, 2, 2, 64, "bf16", False, 0)
    q, k, v = (t.detach() for t in make_inputs(case, "cpu"))
    dout = make_dout(case, "cpu")
    out64, lse64 = attention_ref(q.double(), k.double(), v.double())
    out = out64.to(q.dtype)
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    _flash_attn_backward(dout, q, k, v, out, lse64.float(), dq, dk, dv, 0.0, None, False)
    ref = reference_outputs(q, k, v, dout, dtype=torch.float64)
    same = reference_outputs(q, k, v, dout)
    for name, ours, pt, r in zip(("dq", "dk", "dv"), (dq, dk, dv), same[2:], ref[2:]):
        assert_within_tolerance(name, ours, pt, r, slack=1e-4)
    # A different LSE changes the gradients: it is read, not recomputed.
    dq2 = torch.empty_like(q)
    _flash_attn_backward(dout, q, k, v, out, lse64.float() + 1.0, dq2, None, None, 0.0, None, False)
    assert not torch.allclose(dq2.float(), dq.float())


def test_none_buffers_are_allocated(fake_backend):
    case = Case(1, 16, 16, 2, 2, 64, "fp16", True, 0)
    q, k, v = (t.detach() for t in make_inputs(case, "cpu"))
    out, lse, _, _ = _flash_attn_forward(q, k, v, 0.0, None, True)
    d = _flash_attn_backward(make_dout(case, "cpu"), q, k, v, out, lse, None, None, None, 0.0,
                             None, True)
    assert d.dtype == torch.float32


@pytest.mark.parametrize("kwargs,exc,pattern", [
    (dict(dropout_p=1.0), ValueError, r"dropout_p must be in \[0, 1\)"),
    (dict(softcap=-5.0), ValueError, "softcap must be a finite float >= 0"),
    (dict(return_softmax=True), NotImplementedError, "return_softmax"),
    (dict(window_size_left=-3), ValueError, "window_size left"),
])
def test_forward_arguments(fake_backend, kwargs, exc, pattern):
    q = torch.randn(1, 8, 2, 64).half()
    args = dict(dropout_p=0.0, softmax_scale=None, causal=False)
    args.update(kwargs)
    with pytest.raises(exc, match=pattern):
        _flash_attn_forward(q, q, q, **args)


def test_backward_buffer_checks(fake_backend):
    q = torch.randn(1, 8, 2, 64).half()
    out, lse, _, _ = _flash_attn_forward(q, q, q, 0.0, None, False)
    with pytest.raises(ValueError, match=r"dk must have the shape, dtype and device"):
        _flash_attn_backward(q, q, q, q, out, lse, None, torch.empty(1, 8, 2, 32).half(), None,
                             0.0, None, False)
    with pytest.raises(ValueError, match=r"dq must have the shape, dtype and device"):
        _flash_attn_backward(q, q, q, q, out, lse, torch.empty(1, 8, 2, 64), None, None, 0.0,
                             None, False)
    with pytest.raises(ValueError, match=r"dout must be a tensor like q"):
        _flash_attn_backward(q[:, :4], q, q, q, out, lse, None, None, None, 0.0, None, False)
    assert cutlass_flash.lowlevel.__all__ == ["_flash_attn_forward", "_flash_attn_backward",
                                              "_flash_attn_varlen_forward", "_flash_attn_varlen_backward"]


def test_buffers_the_kernels_cannot_write_are_filled_by_a_copy(fake_backend):
    # dq with a strided last dim (not the kernels' layout) and dk as a (B, H, S, D) transpose (their
    # layout): both end up holding the gradients, and the returned buffers are the caller's.
    case = Case(1, 16, 16, 2, 2, 64, "bf16", False, 0)
    q, k, v = (t.detach() for t in make_inputs(case, "cpu"))
    dout = make_dout(case, "cpu")
    out, lse, _, _ = _flash_attn_forward(q, k, v, 0.0, None, False)
    dq = torch.full((1, 16, 2, 128), float("nan"), dtype=q.dtype)[..., ::2]
    dk = torch.full((1, 2, 16, 64), float("nan"), dtype=q.dtype).transpose(1, 2)
    dv = torch.full_like(v, float("nan"))
    _flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, 0.0, None, False)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    grads = torch.autograd.grad(flash_attn_func(*leaves), leaves, dout)
    for name, buf, ref in zip(("dq", "dk", "dv"), (dq, dk, dv), grads):
        assert torch.equal(buf, ref), name


def _varlen_pair_check(device):
    """The varlen pair on a packed batch gives, per sequence, the dense pair's results, and
    softmax_d in FlashAttention-2's varlen layout (sequence b from cu_seqlens_q[b] + 128 b)."""
    from cutlass_flash.lowlevel import _flash_attn_varlen_backward, _flash_attn_varlen_forward

    lq, lk = (5, 0, 17, 9), (7, 3, 17, 1)
    g = torch.Generator().manual_seed(3)
    q, k, v, dout = (torch.randn(sum(n), h, 64, generator=g).to(device, torch.bfloat16)
                     for n, h in ((lq, 4), (lk, 2), (lk, 2), (lq, 4)))
    cu_q = torch.tensor([0, 5, 5, 22, 31], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 7, 10, 27, 28], dtype=torch.int32, device=device)
    out, lse, _, _ = _flash_attn_varlen_forward(q, k, v, cu_q, cu_k, 17, 17, 0.0, None, True)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    d = _flash_attn_varlen_backward(dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, 17, 17, 0.0, None, True)
    assert d.shape == (4, sum(lq) + 128 * 4)
    for b in range(4):
        sq, sk = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        if lq[b] == 0:
            continue
        o1, l1, _, _ = _flash_attn_forward(q[sq][None], k[sk][None], v[sk][None], 0.0, None, True)
        g1 = [torch.empty_like(t[s][None]) for t, s in ((q, sq), (k, sk), (v, sk))]
        d1 = _flash_attn_backward(dout[sq][None], q[sq][None], k[sk][None], v[sk][None], o1, l1, *g1,
                                  0.0, None, True)
        torch.testing.assert_close(out[sq], o1[0])
        torch.testing.assert_close(lse[:, sq], l1[0])
        for mine, theirs in zip((dq[sq], dk[sk], dv[sk]), g1):
            torch.testing.assert_close(mine, theirs[0])
        first = int(cu_q[b]) + 128 * b
        torch.testing.assert_close(d[:, first:first + lq[b]], d1[0, :, :lq[b]])


def test_varlen_pair(fake_backend):
    _varlen_pair_check("cpu")


@pytest.mark.gpu
def test_varlen_pair_on_the_gpu():
    skip_unless_auto_built(64, "bf16")
    _varlen_pair_check("cuda")
