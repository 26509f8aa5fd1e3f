"""Argument validation of flash_attn_func (CPU only).

Shape, dtype and layout checks run before the device checks, so CPU and meta tensors reach them;
the device checks are tested with CPU tensors (not CUDA) and with the fake backend (capability).
"""

import re

import pytest
import torch

import cutlass_flash
from cutlass_flash import _validate, flash_attn_func

F16, BF16 = torch.float16, torch.bfloat16


def T(*shape, dtype=F16, device="cpu"):
    return torch.empty(*shape, dtype=dtype, device=device)


def qkv(b=2, sq=16, sk=24, h=4, hkv=2, d=64, dtype=F16, device="cpu"):
    return (T(b, sq, h, d, dtype=dtype, device=device),
            T(b, sk, hkv, d, dtype=dtype, device=device),
            T(b, sk, hkv, d, dtype=dtype, device=device))


def last_dim_strided(*shape, dtype=F16):
    """A tensor of `shape` whose last dim has stride 2."""
    return T(*shape[:-1], shape[-1] * 2, dtype=dtype)[..., ::2]


def _replace(args, name, value):
    q, k, v = args
    return {"q": (value, k, v), "k": (q, value, v), "v": (q, k, value)}[name]


BAD_INPUTS = {
    # id: (q, k, v, exception, regex)
    "q-not-tensor": (lambda: _replace(qkv(), "q", [[1.0]]), TypeError,
                     r"q must be a torch\.Tensor"),
    "k-not-tensor": (lambda: _replace(qkv(), "k", None), TypeError, r"k must be a torch\.Tensor"),
    "q-3d": (lambda: _replace(qkv(), "q", T(2, 16, 64)), ValueError, r"q must be 4-D"),
    "k-5d": (lambda: _replace(qkv(), "k", T(2, 24, 2, 1, 64)), ValueError, r"k must be 4-D"),
    "v-3d": (lambda: _replace(qkv(), "v", T(24, 2, 64)), ValueError, r"v must be 4-D"),
    "q-float32": (lambda: qkv(dtype=torch.float32), TypeError,
                  r"q must be torch\.float16 or torch\.bfloat16, got torch\.float32"),
    "k-dtype-mismatch": (lambda: _replace(qkv(), "k", T(2, 24, 2, 64, dtype=BF16)), TypeError,
                         r"same dtype.*k is torch\.bfloat16"),
    "v-dtype-mismatch": (lambda: _replace(qkv(dtype=BF16), "v", T(2, 24, 2, 64)), TypeError,
                         r"same dtype.*v is torch\.float16"),
    "kv-shape-mismatch": (lambda: _replace(qkv(), "v", T(2, 25, 2, 64)), ValueError,
                          r"k and v must have the same \(batch, seqlen, nheads\)"),
    "batch-mismatch": (lambda: (T(3, 16, 4, 64),) + qkv()[1:], ValueError, r"batch"),
    "head-dim-mismatch": (lambda: (T(2, 16, 4, 128),) + qkv()[1:], ValueError, r"head_dim"),
    "head-dim-too-large": (lambda: qkv(d=264), ValueError, r"between 1 and 256, got 264"),
    "nheads-not-multiple": (lambda: qkv(h=6, hkv=4), ValueError,
                            r"nheads \(6\) must be a multiple of k/v's nheads \(4\)"),
    "seqlen-q-zero": (lambda: qkv(sq=0), ValueError, r"seqlen_q .* must be >= 1"),
    "seqlen-k-zero": (lambda: qkv(sk=0), ValueError, r"seqlen_k .* must be >= 1"),
    "batch-zero": (lambda: qkv(b=0), ValueError, r"batch .* must be >= 1"),
    "k-on-other-device": (lambda: _replace(qkv(), "k", T(2, 24, 2, 64, device="meta")),
                          ValueError, r"same device.*k is on meta"),
    "v-on-other-device": (lambda: _replace(qkv(), "v", T(2, 24, 2, 64, device="meta")),
                          ValueError, r"same device.*v is on meta"),
    "cpu-tensors": (lambda: qkv(), ValueError, r"must be CUDA tensors; q is on device 'cpu'"),
    "meta-tensors": (lambda: qkv(device="meta"), ValueError, r"CUDA tensors; q is on .*meta"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS), ids=list(BAD_INPUTS))
def test_bad_inputs_raise(case):
    make, exc, pattern = BAD_INPUTS[case]
    q, k, v = make()
    with pytest.raises(exc, match=pattern):
        flash_attn_func(q, k, v)
    # The same through the internal entry point the wrapper uses.
    with pytest.raises(exc, match=pattern):
        _validate.check_inputs(q, k, v)


def test_kernel_layout_ignores_strides_of_size_one_dims():
    # Batch and head strides of size-1 dims are never used: they need not be aligned, or positive.
    assert _validate.is_kernel_layout(T(1, 16, 1, 64).as_strided((1, 16, 1, 64), (5, 64, 7, 1)))
    assert _validate.is_kernel_layout(T(1, 16, 1, 64).as_strided((1, 16, 1, 64), (0, 64, 0, 1)))
    # A row stride of 68 elements (136 bytes) is not 16-byte aligned; stride 0 broadcasts.
    assert not _validate.is_kernel_layout(T(1, 16, 1, 68).as_strided((1, 16, 1, 64), (5, 68, 7, 1)))
    assert not _validate.is_kernel_layout(T(1, 1, 1, 64).expand(1, 16, 1, 64))
    assert not _validate.is_kernel_layout(T(2, 16, 1, 64).expand(2, 16, 4, 64))
    assert not _validate.is_kernel_layout(T(1, 16, 4, 64).expand(3, 16, 4, 64))


@pytest.mark.parametrize("scale,exc", [(float("nan"), ValueError), (float("inf"), ValueError),
                                       (torch.tensor(0.5), TypeError), ("0.5", TypeError)])
def test_bad_softmax_scale(fake_backend, scale, exc):
    q, k, v = qkv()
    with pytest.raises(exc, match="softmax_scale"):
        flash_attn_func(q, k, v, softmax_scale=scale)


def test_valid_inputs_pass(fake_backend):
    # On the fake backend, CPU stands in for CUDA.
    for args in (qkv(), qkv(h=8, hkv=1, d=40, dtype=BF16), qkv(b=1, sq=1, sk=1, h=1, hkv=1, d=8)):
        _validate.check_inputs(*args)


@pytest.mark.parametrize("cap", [(7, 5), (7, 0), (6, 1)])
def test_gpu_older_than_sm80_raises(fake_backend, cap):
    fake_backend.set_capability(cap)
    q, k, v = qkv()
    msg = re.escape(f"compute capability {cap[0]}.{cap[1]} (sm{cap[0]}{cap[1]})")
    with pytest.raises(RuntimeError, match=msg):
        flash_attn_func(q, k, v)
    assert fake_backend.calls == []


def test_validation_precedes_the_op(fake_backend):
    q, k, v = qkv(d=264)
    with pytest.raises(ValueError):
        flash_attn_func(q, k, v)
    assert fake_backend.calls == []


def test_op_checks_shapes_when_called_directly(fake_backend):
    q, k, v = qkv()
    with pytest.raises(ValueError, match="inconsistent shapes"):
        torch.ops.cutlass_flash.fwd(q, k, v[:, :3], 0.125, -1, -1, 0, False)
    with pytest.raises(TypeError):
        torch.ops.cutlass_flash.fwd(q, k.to(BF16), v, 0.125, -1, -1, 0, False)
    assert fake_backend.calls == []


def test_public_names():
    for name in cutlass_flash.__all__:
        assert hasattr(cutlass_flash, name), name


# -- masks, softcap, ALiBi and the FlashAttention-2 arguments without a kernel path yet -------------

BAD_ARGS = {
    # id: (keyword arguments, exception, regex)
    "causal-int": (dict(causal=1), TypeError, r"causal must be a bool, got int"),
    "window-int": (dict(window_size=4), TypeError, r"window_size must be a sequence \(left, right\)"),
    "window-three": (dict(window_size=(1, 2, 3)), TypeError, r"window_size must be a sequence"),
    "window-float": (dict(window_size=(1.0, 2)), TypeError, r"window_size left must be an int"),
    "window-bool": (dict(window_size=(4, True)), TypeError, r"window_size right must be an int"),
    "window-below-minus-one": (dict(window_size=(-2, 0)), ValueError,
                               r"window_size left must be >= 0, or -1 for unbounded, got -2"),
    "dropout-negative": (dict(dropout_p=-0.1), ValueError, r"dropout_p must be in \[0, 1\)"),
    "dropout-one": (dict(dropout_p=1.0), ValueError, r"dropout_p must be in \[0, 1\), got 1.0"),
    "dropout-str": (dict(dropout_p="0.1"), TypeError, r"dropout_p must be a float"),
    "softcap-negative": (dict(softcap=-1.0), ValueError, r"softcap must be a finite float >= 0"),
    "softcap-nan": (dict(softcap=float("nan")), ValueError, r"softcap must be a finite float"),
    "alibi-list": (dict(alibi_slopes=[0.5] * 4), TypeError, r"alibi_slopes must be None or a"),
    "alibi-float64": (dict(alibi_slopes=torch.zeros(4, dtype=torch.float64)), TypeError,
                      r"alibi_slopes must be float32"),
    "alibi-shape": (dict(alibi_slopes=torch.zeros(3)), ValueError, r"alibi_slopes must have shape"),
    "alibi-strided": (dict(alibi_slopes=torch.zeros(2, 8)[:, ::2]), ValueError,
                      r"alibi_slopes must have a contiguous last dimension"),
}


@pytest.mark.parametrize("case", list(BAD_ARGS), ids=list(BAD_ARGS))
def test_bad_arguments_raise_before_the_op(fake_backend, case):
    kwargs, exc, pattern = BAD_ARGS[case]
    with pytest.raises(exc, match=pattern):
        flash_attn_func(*qkv(), **kwargs)
    assert fake_backend.calls == []


def test_softcap_with_alibi(fake_backend):
    """softcap with ALiBi (the generator's SOFTCAP_ALIBI): both forwards run the pair at every
    head dim; the sm90 backward from d = 96 (its 64-query steps hold tanh's derivative), and at
    d = 64 zero-padded to d = 96 (_validate.features_head_dim); the sm80 backward refuses it,
    naming it and the family that takes it, before any kernel runs."""
    slopes = torch.full((4,), 0.25)
    for arch, d, runs_at in ((90, 64, 96), (90, 128, 128), (80, 64, None), (80, 128, None)):
        q, k, v = (torch.randn_like(t).requires_grad_() for t in qkv(d=d))
        fake_backend.calls.clear()
        with cutlass_flash.force_arch(arch):
            out = flash_attn_func(q, k, v, softcap=5.0, alibi_slopes=slopes)
            assert [(dr, a) for dr, a, _ in fake_backend.calls] == [("fwd", arch)]
            if runs_at:
                out.sum().backward()
                assert [(dr, a) for dr, a, _ in fake_backend.calls] == [("fwd", arch), ("bwd", arch)]
                assert fake_backend.calls[1][2]["head_dim"] == runs_at
                assert q.grad.shape == q.shape and k.grad.shape == k.shape
                continue
            with pytest.raises(NotImplementedError,
                               match=rf"sm{arch} backward at head_dim {d} does not support softcap and "
                                     rf"alibi_slopes together \(the sm90 family does\)"):
                out.sum().backward()
        assert [dr for dr, _, _ in fake_backend.calls] == ["fwd"]


@pytest.mark.parametrize("causal,window,seqlen_k,expected", [
    (False, (-1, -1), 24, (-1, -1)),
    (True, (-1, -1), 24, (-1, 0)),
    (True, (8, 5), 24, (8, 0)),        # causal: right is 0 whatever window_size says
    (False, (8, 5), 24, (8, 5)),
    (False, (0, 0), 24, (0, 0)),
    (False, [3, -1], 24, (3, -1)),     # a list works too
    (False, (24, 23), 24, (-1, 23)),   # a bound >= seqlen_k is unbounded (FlashAttention-2)
    (True, (5000, 7), 24, (-1, 0)),
])
def test_mask_normalization(causal, window, seqlen_k, expected):
    assert _validate.check_mask(causal, window, seqlen_k) == expected


def test_flash_attention_2_positional_order(fake_backend):
    # flash_attn.flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, ...):
    # positional calls written for it mean the same here.
    q, k, v = qkv()
    flash_attn_func(q, k, v, 0.0, 0.25, True, (4, 0))
    direction, _, kw = fake_backend.calls[-1]
    assert direction == "fwd" and kw["softmax_scale"] == 0.25
    assert (kw["window_left"], kw["window_right"]) == (4, 0)
