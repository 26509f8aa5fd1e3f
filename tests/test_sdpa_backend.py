"""cutlass_flash as PyTorch's flash-attention implementation (cutlass_flash.sdpa): registered on
import and not active, activate / restore through torch.nn.attention, the aten kernels against our
own functions bit for bit, the fallback to the previous kernel. On CPU the kernels' Python side
runs on the fake binding, called as the dispatcher would call them; on the GPU through
F.scaled_dot_product_attention, varlen_attn and torch.compile, with the profiler naming the kernels
that ran."""

import contextlib
import importlib.util

import pytest
import torch
import torch.nn.functional as F
from torch.nn import attention

import cutlass_flash
from cutlass_flash import sdpa
from gpu_check import skip_unless_auto_built

pytestmark = pytest.mark.skipif(not hasattr(attention, "register_flash_attention_impl"),
                                reason="torch has no flash-attention registry")


@pytest.fixture
def active():
    attention.activate_flash_attention_impl(sdpa.NAME)
    yield
    attention.restore_flash_attention_impl()


@contextlib.contextmanager
def _deterministic_algorithms():
    """torch.use_deterministic_algorithms for SDPA's calls (our kernels then take dQ's fixed order,
    the only one that is bit-reproducible), restored afterwards."""
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was)


def _bhsd(batch, nheads, seqlen, head_dim, device, dtype=torch.bfloat16, seed=0, nheads_kv=None):
    g = torch.Generator().manual_seed(seed)
    shapes = [(batch, nheads, seqlen, head_dim)] + [(batch, nheads_kv or nheads, seqlen, head_dim)] * 2 + \
             [(batch, nheads, seqlen, head_dim)]
    return [torch.randn(*s, generator=g).to(device=device, dtype=dtype) for s in shapes]


# -- CPU ------------------------------------------------------------------------------------------


def test_registered_not_active():
    assert sdpa.NAME in attention.list_flash_attention_impls()
    assert attention.current_flash_attention_impl() != sdpa.NAME


def test_activate_and_restore():
    attention.activate_flash_attention_impl(sdpa.NAME)
    try:
        assert attention.current_flash_attention_impl() == sdpa.NAME
        attention.activate_flash_attention_impl(sdpa.NAME)  # again: restores, then activates
        assert attention.current_flash_attention_impl() == sdpa.NAME
    finally:
        attention.restore_flash_attention_impl()
    assert attention.current_flash_attention_impl() is None


class _Previous:
    """Stands for the kernel before activation."""

    def __init__(self):
        self.calls = []

    def call_boxed(self, keyset, *args, **kwargs):
        self.calls.append((args, kwargs))
        return "previous"


def _call(name, *args, previous=None, **kwargs):
    return sdpa._kernel(name, previous)(None, *args, **kwargs)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("gqa", [False, True])
def test_sdpa_kernels_are_ours_fake(fake_backend, causal, gqa):
    """_scaled_dot_product_flash_attention and its backward return what flash_attn_func and its
    autograd return for the transposed tensors, bit for bit."""
    q, k, v, dout = _bhsd(2, 4, 37, 64, "cpu", nheads_kv=2 if gqa else None)
    out, lse, cq, ck, mq, mk, seed, unused, mask = _call("_scaled_dot_product_flash_attention", q, k, v, 0.0,
                                                         causal, scale=0.3)
    assert (mq, mk) == (37, 37) and seed.dtype == torch.uint64 and mask.numel() == 0
    dq, dk, dv = _call("_scaled_dot_product_flash_attention_backward", dout, q, k, v, out, lse, cq, ck, mq, mk,
                       0.0, causal, seed, unused, scale=0.3)
    leaves = [t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = cutlass_flash.flash_attn_func(*leaves, softmax_scale=0.3, causal=causal, return_lse=True)
    ref_grads = torch.autograd.grad(ref_out, leaves, dout.transpose(1, 2))
    assert out.shape == q.shape and torch.equal(out, ref_out.transpose(1, 2)) and torch.equal(lse, ref_lse)
    for ours, ref in zip((dq, dk, dv), ref_grads):
        assert torch.equal(ours, ref.transpose(1, 2))


def test_sdpa_dropout_state_round_trip_fake(fake_backend):
    """The forward's dropout state comes back to the backward as the op's Philox tensors: the same
    mask in both directions, and the same as flash_attn_func's from the same generator state."""
    q, k, v, dout = _bhsd(1, 2, 33, 64, "cpu")
    torch.manual_seed(5)
    out, lse, cq, ck, mq, mk, seed, unused, _ = _call("_scaled_dot_product_flash_attention", q, k, v, 0.3, False)
    grads = _call("_scaled_dot_product_flash_attention_backward", dout, q, k, v, out, lse, cq, ck, mq, mk, 0.3,
                  False, seed, unused)
    torch.manual_seed(5)
    leaves = [t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v)]
    ref = cutlass_flash.flash_attn_func(*leaves, dropout_p=0.3)
    ref_grads = torch.autograd.grad(ref, leaves, dout.transpose(1, 2))
    assert torch.equal(out, ref.transpose(1, 2))
    assert all(torch.equal(a, b.transpose(1, 2)) for a, b in zip(grads, ref_grads))


def test_flash_attention_forward_packed_fake(fake_backend):
    """_flash_attention_forward / _backward on a packed batch (cum_seq_q / cum_seq_k): what
    flash_attn_varlen_func returns, with a window."""
    lengths = (5, 0, 19, 8)
    cu = torch.tensor([0, 5, 5, 24, 32], dtype=torch.int32)
    g = torch.Generator().manual_seed(1)
    q, k, v, dout = (torch.randn(32, 4, 64, generator=g).to(torch.bfloat16) for _ in range(4))
    out, lse, seed, unused, _ = _call("_flash_attention_forward", q, k, v, cu, cu, 19, 19, 0.0, True, False,
                                      window_size_left=6)
    grads = _call("_flash_attention_backward", dout, q, k, v, out, lse, cu, cu, 19, 19, 0.0, True, seed, unused,
                  window_size_left=6)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = cutlass_flash.flash_attn_varlen_func(*leaves, cu, cu, max(lengths), max(lengths), causal=True,
                                                        window_size=(6, 0), return_lse=True)
    ref_grads = torch.autograd.grad(ref, leaves, dout)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads))


@pytest.mark.parametrize("name, args, kwargs", [
    ("_scaled_dot_product_flash_attention", (0.0, False, True), {}),  # return_debug_mask
    ("_flash_attention_forward", (None, None, 8, 8, 0.0, False, False), {"block_table": torch.zeros(1)}),
])
def test_unsupported_calls_go_to_the_previous_kernel_fake(fake_backend, name, args, kwargs):
    q, k, v, _ = _bhsd(1, 2, 8, 64, "cpu")
    previous = _Previous()
    assert _call(name, q, k, v, *args, previous=previous, **kwargs) == "previous"
    assert len(previous.calls) == 1
    with pytest.raises(RuntimeError, match="no previous kernel"):
        _call(name, q, k, v, *args, **kwargs)


def test_kernels_not_built_go_to_the_previous_kernel_fake(fake_backend):
    fake_backend.set_built([])
    q, k, v, _ = _bhsd(1, 2, 8, 64, "cpu")
    previous = _Previous()
    assert _call("_scaled_dot_product_flash_attention", q, k, v, previous=previous) == "previous"


# -- GPU ------------------------------------------------------------------------------------------


def _sdpa(q, k, v, **kw):
    with attention.sdpa_kernel(attention.SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, **kw)


def _kernel_names(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {e.key for e in prof.key_averages()}


def _ours(names):
    return any("cutlass_flash" in n for n in names)


def _pytorch_flash(names):
    return any("pytorch_flash" in n or "flash_fwd_kernel" in n for n in names)


def _assert_bitwise(ours, ref, what):
    """out, dq, dk, dv of a PyTorch entry point (``what``) equal to our functions' bit for bit."""
    for name, a, b in zip(("out", "dq", "dk", "dv"), ours, ref):
        assert torch.equal(a, b), f"{name}: max |{what} - ours| = {(a.float() - b.float()).abs().max().item():.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("gqa", [False, True])
@pytest.mark.parametrize("dropout_p", [0.0, 0.2])
def test_sdpa_runs_our_kernels(active, causal, gqa, dropout_p):
    """Under the flash backend, SDPA (forward and backward) runs our kernels, and its results are
    our flash_attn_func's bit for bit (the same dropout mask from the same generator state; dQ in
    the deterministic order on both sides, torch.use_deterministic_algorithms for SDPA)."""
    skip_unless_auto_built(128, "bf16")
    q, k, v, dout = _bhsd(2, 8, 1000, 128, "cuda", nheads_kv=2 if gqa else None)
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def run():
        torch.manual_seed(3)
        out = _sdpa(q, k, v, is_causal=causal, dropout_p=dropout_p, enable_gqa=gqa)
        return (out,) + torch.autograd.grad(out, (q, k, v), dout)

    names = _kernel_names(run)
    assert _ours(names) and not _pytorch_flash(names), sorted(names)
    with _deterministic_algorithms():
        ours = run()
    torch.manual_seed(3)
    leaves = [t.transpose(1, 2) for t in (q, k, v)]
    ref = cutlass_flash.flash_attn_func(*leaves, causal=causal, dropout_p=dropout_p, deterministic=True)
    ref = (ref.transpose(1, 2),) + torch.autograd.grad(ref, (q, k, v), dout.transpose(1, 2))
    _assert_bitwise(ours, ref, "SDPA")


@pytest.mark.gpu
def test_restore_brings_pytorch_back():
    skip_unless_auto_built(128, "bf16")
    q, k, v, _ = _bhsd(1, 4, 512, 128, "cuda")
    attention.activate_flash_attention_impl(sdpa.NAME)
    try:
        assert _ours(_kernel_names(lambda: _sdpa(q, k, v)))
    finally:
        attention.restore_flash_attention_impl()
    names = _kernel_names(lambda: _sdpa(q, k, v))
    assert not _ours(names) and _pytorch_flash(names), sorted(names)


@pytest.mark.gpu
def test_debug_mask_falls_back(active):
    """return_debug_mask: PyTorch's kernel takes it (ours has no debug mask), and answers as it
    would: a mask with dropout, its own error without."""
    skip_unless_auto_built(128, "bf16")
    q, k, v, _ = _bhsd(1, 4, 256, 128, "cuda")
    with pytest.raises(RuntimeError, match="return_softmax is only supported when p_dropout > 0"):
        torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, True)
    names = _kernel_names(lambda: torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.5, False, True))
    assert _pytorch_flash(names) and not _ours(names), sorted(names)
    *_, mask = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.5, False, True)
    assert mask.numel() > 0


@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("torch.nn.attention.varlen") is None, reason="torch has no varlen_attn")
def test_varlen_attn_runs_our_kernels(active):
    skip_unless_auto_built(128, "bf16")
    from torch.nn.attention.varlen import varlen_attn

    cu = torch.tensor([0, 100, 100, 1000, 1300], dtype=torch.int32, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1300, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
               for _ in range(3))
    dout = torch.randn_like(q)

    def run():
        out = varlen_attn(q, k, v, cu, cu, 900, 900, window_size=(-1, 0))
        return (out,) + torch.autograd.grad(out, (q, k, v), dout)

    names = _kernel_names(run)
    assert _ours(names) and not _pytorch_flash(names), sorted(names)
    with _deterministic_algorithms():  # dQ in the fixed order, as below
        ours = run()
    ref = cutlass_flash.flash_attn_varlen_func(q, k, v, cu, cu, 900, 900, causal=True, deterministic=True)
    ref = (ref,) + torch.autograd.grad(ref, (q, k, v), dout)
    _assert_bitwise(ours, ref, "varlen_attn")


@pytest.mark.gpu
def test_sdpa_under_compile(active):
    skip_unless_auto_built(128, "bf16")
    q, k, v, _ = _bhsd(2, 8, 640, 128, "cuda")
    compiled = torch.compile(lambda q, k, v: _sdpa(q, k, v, is_causal=True), fullgraph=True)
    out = compiled(q, k, v)
    ref = cutlass_flash.flash_attn_func(*(t.transpose(1, 2) for t in (q, k, v)), causal=True).transpose(1, 2)
    assert torch.equal(out, ref)


@pytest.mark.gpu
def test_nested_jagged_sdpa_runs_our_kernels(active):
    """Nested (jagged) tensors take SDPA's packed path (_flash_attention_forward / _backward with
    cum_seq_q / cum_seq_k): our kernels, with flash_attn_varlen_func's results bit for bit."""
    skip_unless_auto_built(128, "bf16")
    lengths = (100, 1, 700, 333)
    g = torch.Generator(device="cuda").manual_seed(1)
    values = [torch.randn(sum(lengths), 8, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4)]
    offsets = torch.tensor([0, 100, 101, 801, 1134], device="cuda", dtype=torch.int64)

    def run():
        leaves = [v.detach().requires_grad_() for v in values[:3]]
        q, k, v = (torch.nested.nested_tensor_from_jagged(t, offsets).transpose(1, 2) for t in leaves)
        out = _sdpa(q, k, v, is_causal=True).transpose(1, 2).values()
        return (out,) + torch.autograd.grad(out, leaves, values[3])

    with _deterministic_algorithms():
        names = _kernel_names(run)
        ours = run()
    assert _ours(names) and not _pytorch_flash(names), sorted(names)
    cu = offsets.to(torch.int32)
    leaves = [v.detach().requires_grad_() for v in values[:3]]
    ref = cutlass_flash.flash_attn_varlen_func(*leaves, cu, cu, max(lengths), max(lengths), causal=True,
                                               deterministic=True)
    ref = (ref,) + torch.autograd.grad(ref, leaves, values[3])
    _assert_bitwise(ours, ref, "SDPA")


@pytest.mark.gpu
def test_sdpa_in_a_cuda_graph(active):
    """SDPA with our kernels captured in a CUDA graph: each replay computes the new inputs'."""
    skip_unless_auto_built(128, "bf16")
    q, k, v, _ = _bhsd(2, 8, 640, 128, "cuda")
    static = [t.clone() for t in (q, k, v)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _sdpa(*static, is_causal=True)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _sdpa(*static, is_causal=True)
    for seed in (1, 2):
        fresh = _bhsd(2, 8, 640, 128, "cuda", seed=seed)[:3]
        for s_, f in zip(static, fresh):
            s_.copy_(f)
        graph.replay()
        ref = cutlass_flash.flash_attn_func(*(t.transpose(1, 2) for t in fresh), causal=True).transpose(1, 2)
        assert torch.equal(out, ref)
