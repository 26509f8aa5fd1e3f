"""The torch.library ops on CPU: fake (meta) implementations, opcheck, autograd and torch.compile,
and the whole Python path against the float64 reference, using the fake binding (tests/fake_c.py)
where something has to run."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import cutlass_flash
from cutlass_flash import _dispatch, flash_attn_func
from attn_ref import assert_within_tolerance, reference_outputs
from cases import Case, make_dout, make_inputs

SHAPES = {
    # id: (batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim)
    "mha": (2, 16, 24, 4, 4, 64),
    "gqa-padded": (2, 17, 5, 8, 2, 40),
    "mqa-d256": (1, 3, 9, 4, 1, 256),
}


def _meta_inputs(shape, dtype, device="meta"):
    b, sq, sk, h, hkv, d = shape
    return (torch.empty(b, sq, h, d, dtype=dtype, device=device),
            torch.empty(b, sk, hkv, d, dtype=dtype, device=device),
            torch.empty(b, sk, hkv, d, dtype=dtype, device=device))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
def test_meta_shapes(shape, dtype):
    q, k, v = _meta_inputs(shape, dtype)
    out, lse = torch.ops.cutlass_flash.fwd(q, k, v, 0.125, -1, 0, 0, False)
    b, sq, sk, h, hkv, d = shape
    assert out.shape == q.shape and out.dtype == dtype and out.device.type == "meta"
    assert lse.shape == (b, h, sq) and lse.dtype == torch.float32
    dq, dk, dv, _ = torch.ops.cutlass_flash.bwd(out, q, k, v, out, lse, 0.125, -1, 0, 0, False)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert {dq.dtype, dk.dtype, dv.dtype} == {dtype}


@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
def test_fake_tensor_mode_cuda(shape):
    # FakeTensorMode can pretend CUDA tensors without a GPU.
    with FakeTensorMode():
        q, k, v = _meta_inputs(shape, torch.bfloat16, device="cuda")
        out, lse = torch.ops.cutlass_flash.fwd(q, k, v, 0.125, -1, -1, 80, False)
        dq, dk, dv, _ = torch.ops.cutlass_flash.bwd(out, q, k, v, out, lse, 0.125, -1, -1, 80, False)
    assert out.device.type == "cuda" and lse.device.type == "cuda"
    assert out.shape == q.shape and lse.shape == (shape[0], shape[3], shape[1])
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)


def test_make_fx_fake_cuda_forward(monkeypatch):
    # Trace the public function on fake CUDA tensors (no GPU needed): one op node.
    monkeypatch.setattr(_dispatch, "_query_capability", lambda device: (9, 0))
    _dispatch.reset_caches()
    try:
        with FakeTensorMode():
            q, k, v = _meta_inputs(SHAPES["gqa-padded"], torch.float16, device="cuda")
            gm = make_fx(lambda q, k, v: flash_attn_func(q, k, v, return_lse=True),
                         tracing_mode="fake")(q, k, v)
    finally:
        _dispatch.reset_caches()
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count("cutlass_flash.fwd.default") == 1, targets


def test_make_fx_meta_forward_backward(monkeypatch):
    # The joint graph on meta tensors (the backward engine needs no GPU there).
    monkeypatch.setattr(_dispatch, "DEVICE_TYPE", "meta")
    monkeypatch.setattr(_dispatch, "_query_capability", lambda device: (9, 0))
    _dispatch.reset_caches()

    def f(q, k, v):
        out = flash_attn_func(q, k, v, causal=True)
        return torch.autograd.grad(out.sum(), (q, k, v))

    try:
        q, k, v = (t.requires_grad_() for t in _meta_inputs(SHAPES["gqa-padded"], torch.float16))
        gm = make_fx(f)(q, k, v)
    finally:
        _dispatch.reset_caches()
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count("cutlass_flash.fwd.default") == 1, targets
    assert targets.count("cutlass_flash.bwd.default") == 1, targets
    assert "aten.zeros.default" not in targets  # no zero gradient materialized for lse
    assert [tuple(t.shape) for t in gm(q, k, v)] == [tuple(q.shape), tuple(k.shape),
                                                      tuple(v.shape)]


@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
def test_opcheck(fake_backend, shape):
    q, k, v = (t.requires_grad_() for t in
               (torch.randn(*t.shape).to(torch.bfloat16) for t in _meta_inputs(shape, None)))
    torch.library.opcheck(torch.ops.cutlass_flash.fwd.default, (q, k, v, 0.2, -1, 0, 0, False))
    out, lse = torch.ops.cutlass_flash.fwd(q, k, v, 0.2, -1, 0, 0, False)
    dout = torch.randn_like(out)
    torch.library.opcheck(torch.ops.cutlass_flash.bwd.default,
                          (dout, q.detach(), k.detach(), v.detach(), out.detach(), lse,
                           0.2, -1, 0, 0, False))


# -- the Python path end to end, on the fake binding ---------------------------------------------

CPU_CASES = [
    Case(2, 17, 33, 4, 2, 40, "fp16", True, 0, "strided"),
    Case(2, 33, 17, 4, 1, 64, "bf16", True, 0, "bhsd"),      # rows that see no key
    Case(1, 20, 20, 4, 2, 128, "bf16", False, 0, "qkvpacked"),
    Case(1, 20, 30, 4, 4, 200, "fp16", False, 0, "kvpacked", q_scale=8.0),
    Case(2, 1, 9, 2, 2, 96, "bf16", True, 80, "contiguous"),
]


@pytest.mark.parametrize("case", CPU_CASES, ids=[c.id for c in CPU_CASES])
def test_end_to_end_fake(fake_backend, case):
    q, k, v = make_inputs(case, "cpu")
    dout = make_dout(case, "cpu")
    with cutlass_flash.force_arch(case.arch):
        out, lse = flash_attn_func(q, k, v, causal=case.causal, return_lse=True)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    ref = reference_outputs(q, k, v, dout, case.causal, dtype=torch.float64)
    same = reference_outputs(q, k, v, dout, case.causal)
    for name, ours, pt, r in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, dq, dk, dv),
                                 same, ref):
        assert_within_tolerance(name, ours, pt, r)
    assert lse.dtype == torch.float32 and lse.shape == (case.batch, case.nheads, case.seqlen_q)


WINDOW_CPU_CASES = [
    Case(2, 17, 33, 4, 2, 40, "fp16", False, 0, window=(3, 5)),
    Case(2, 33, 17, 4, 1, 64, "bf16", True, 0, window=(4, 9)),     # causal: right = 0
    Case(1, 20, 20, 4, 4, 128, "bf16", False, 80, window=(0, 0)),  # one key per query
    Case(1, 40, 9, 2, 2, 64, "fp16", False, 0, window=(2, 0)),     # rows 0-30 see no key
    Case(1, 9, 30, 2, 1, 96, "bf16", False, 0, window=(-1, 40)),   # right past the keys
]


@pytest.mark.parametrize("case", WINDOW_CPU_CASES, ids=[c.id for c in WINDOW_CPU_CASES])
def test_window_end_to_end_fake(fake_backend, case):
    q, k, v = make_inputs(case, "cpu")
    dout = make_dout(case, "cpu")
    with cutlass_flash.force_arch(case.arch):
        out, lse = flash_attn_func(q, k, v, causal=case.causal, window_size=case.window,
                                   return_lse=True)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    for direction, _, kw in fake_backend.calls[-2:]:
        assert (kw["window_left"], kw["window_right"]) == case.mask, direction
    ref = reference_outputs(q, k, v, dout, dtype=torch.float64, window=case.mask)
    same = reference_outputs(q, k, v, dout, window=case.mask)
    for name, ours, pt, r in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, dq, dk, dv),
                                 same, ref):
        assert_within_tolerance(name, ours, pt, r)


SOFTCAP_CPU_CASES = [
    Case(2, 17, 33, 4, 2, 64, "bf16", False, 0, q_scale=4.0, softcap=5.0),
    Case(1, 33, 17, 4, 1, 40, "fp16", True, 80, q_scale=4.0, softcap=30.0, window=(8, 0)),
]


@pytest.mark.parametrize("case", SOFTCAP_CPU_CASES, ids=[c.id for c in SOFTCAP_CPU_CASES])
def test_softcap_end_to_end_fake(fake_backend, case):
    q, k, v = make_inputs(case, "cpu")
    dout = make_dout(case, "cpu")
    with cutlass_flash.force_arch(case.arch):
        out, lse = flash_attn_func(q, k, v, causal=case.causal, window_size=case.window,
                                   softcap=case.softcap, return_lse=True)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    for direction, _, kw in fake_backend.calls[-2:]:
        assert kw["softcap"] == case.softcap, direction
    ref = reference_outputs(q, k, v, dout, dtype=torch.float64, window=case.mask, softcap=case.softcap)
    same = reference_outputs(q, k, v, dout, window=case.mask, softcap=case.softcap)
    for name, ours, pt, r in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, dq, dk, dv),
                                 same, ref):
        assert_within_tolerance(name, ours, pt, r)
    # The cap changes the result (tanh saturates at q x 4).
    no_cap = reference_outputs(q, k, v, dout, dtype=torch.float64, window=case.mask)
    assert (no_cap[0] - ref[0]).abs().max() > 1e-2


ALIBI_CASES = [
    Case(2, 17, 33, 4, 2, 64, "bf16", False, 0, alibi=1),
    Case(2, 33, 17, 4, 1, 40, "fp16", True, 80, alibi=2, window=(8, 0)),
    Case(2, 20, 20, 2, 2, 64, "bf16", True, 90, alibi=2, window=(3, -1)),
]


@pytest.mark.parametrize("case", ALIBI_CASES, ids=[c.id for c in ALIBI_CASES])
def test_alibi_end_to_end_fake(fake_backend, case):
    """alibi_slopes reach the binding (pointer and batch stride) and give the reference's
    results, forward and backward; they change the result."""
    q, k, v = make_inputs(case, "cpu")
    dout = make_dout(case, "cpu")
    slopes = case.alibi_slopes("cpu")
    with cutlass_flash.force_arch(case.arch):
        out, lse = flash_attn_func(q, k, v, causal=case.causal, window_size=case.window,
                                   softcap=case.softcap, alibi_slopes=slopes, return_lse=True)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    for direction, _, kw in fake_backend.calls[-2:]:
        assert kw["alibi_slopes"] == slopes.data_ptr(), direction
        assert kw["alibi_batch_stride"] == (slopes.stride(0) if slopes.dim() == 2 else 0)
    ref = reference_outputs(q, k, v, dout, dtype=torch.float64, window=case.mask, softcap=case.softcap,
                            alibi_slopes=slopes)
    same = reference_outputs(q, k, v, dout, window=case.mask, softcap=case.softcap, alibi_slopes=slopes)
    for name, ours, pt, r in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, dq, dk, dv), same, ref):
        assert_within_tolerance(name, ours, pt, r)
    plain = reference_outputs(q, k, v, dout, dtype=torch.float64, window=case.mask, softcap=case.softcap)
    assert (plain[0] - ref[0]).abs().max() > 1e-2


def test_window_changes_the_result(fake_backend):
    # A window that cuts keys must change out (the mask reaches the kernels), one wider than the
    # sequence must not.
    case = Case(1, 24, 24, 2, 2, 64, "bf16", False, 0)
    q, k, v = (t.detach() for t in make_inputs(case, "cpu"))
    full = flash_attn_func(q, k, v)
    assert not torch.equal(flash_attn_func(q, k, v, window_size=(2, 2)), full)
    assert torch.equal(flash_attn_func(q, k, v, window_size=(24, 100)), full)


def test_rows_without_keys(fake_backend):
    q, k, v = (t.requires_grad_() for t in
               (torch.randn(1, 7, 2, 64).to(torch.float16), torch.randn(1, 3, 2, 64).half(),
                torch.randn(1, 3, 2, 64).half()))
    out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert torch.all(out[:, :4] == 0) and torch.all(lse[..., :4] == float("inf"))
    assert torch.isfinite(lse[..., 4:]).all()
    dq, = torch.autograd.grad(out.float().sum(), (q,))
    assert torch.all(dq[:, :4] == 0)


def test_expanded_grad_and_lse_not_differentiable(fake_backend):
    q, k, v = (t.requires_grad_() for t in (torch.randn(2, 8, 2, 64).half() for _ in range(3)))
    out, lse = flash_attn_func(q, k, v, return_lse=True)
    assert out.requires_grad and not lse.requires_grad
    # out.sum() gives an expanded (stride 0) gradient: the op copies it to a usable layout.
    out.sum().backward()
    ref = reference_outputs(q, k, v, torch.ones_like(out), dtype=torch.float64)
    for t, g in zip((q, k, v), ref[2:]):
        torch.testing.assert_close(t.grad.double(), g, atol=2e-2, rtol=2e-2)


def test_no_grad_inputs(fake_backend):
    q, k, v = (torch.randn(2, 8, 2, 64).bfloat16() for _ in range(3))
    out = flash_attn_func(q, k, v)
    assert not out.requires_grad and out.shape == q.shape


# -- torch.compile -------------------------------------------------------------------------------

class TinyAttention(torch.nn.Module):
    def __init__(self, dim=64, nheads=4, dtype=torch.bfloat16, device="cpu"):
        super().__init__()
        self.nheads = nheads
        self.qkv = torch.nn.Linear(dim, 3 * dim, dtype=dtype, device=device)
        self.proj = torch.nn.Linear(dim, dim, dtype=dtype, device=device)

    def forward(self, x):
        b, s, dim = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.nheads, dim // self.nheads).unbind(2)
        y = flash_attn_func(q, k, v, causal=True).reshape(b, s, dim)
        return self.proj(y).float().square().mean()


def _train_step(model, fn, x):
    model.zero_grad(set_to_none=True)
    loss = fn(x)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()  # compiled code guards on the fake backend's settings


def test_compile_fullgraph_training_step(fake_backend, fresh_dynamo):
    torch.manual_seed(0)
    model = TinyAttention()
    x = torch.randn(2, 32, 64, dtype=torch.bfloat16)
    loss_e, grads_e = _train_step(model, model, x)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    loss_c, grads_c = _train_step(model, compiled, x)
    torch.testing.assert_close(loss_c, loss_e)
    for a, b in zip(grads_c, grads_e):
        torch.testing.assert_close(a, b)
    # force_arch is seen by compiled code (a recompile), forward and backward alike.
    fake_backend.calls.clear()
    with cutlass_flash.force_arch(80):
        _train_step(model, compiled, x)
    assert fake_backend.archs_called() == [80, 80]
    fake_backend.calls.clear()
    _train_step(model, compiled, x)
    assert fake_backend.archs_called() == [90, 90]  # auto on the fake sm90
    # A new sequence length recompiles (dynamic) and still runs our op.
    fake_backend.calls.clear()
    _train_step(model, compiled, torch.randn(2, 48, 64, dtype=torch.bfloat16))
    assert fake_backend.archs_called() == [90, 90]


def test_misaligned_grad_is_copied(fake_backend):
    # A gradient at an odd storage offset (contiguous, yet not 16-byte aligned) is copied.
    q, k, v = (t.requires_grad_() for t in (torch.randn(1, 8, 2, 64).half() for _ in range(3)))
    out = flash_attn_func(q, k, v)
    dout = torch.randn(out.numel() + 1).half()[1:].view(out.shape)
    assert dout.is_contiguous() and dout.storage_offset() == 1
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    ref = reference_outputs(q, k, v, dout, dtype=torch.float64)
    for a, b in zip((dq, dk, dv), ref[2:]):
        torch.testing.assert_close(a.double(), b, atol=2e-2, rtol=2e-2)


def test_eager_path_matches_the_op(fake_backend):
    # Plain eager calls skip the op dispatch (an autograd.Function over the same implementation);
    # results, gradients and kernel calls must be those of the op.
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 17, 4, 64, generator=g).to(torch.bfloat16).requires_grad_()
               for _ in range(3))
    dout = torch.randn(2, 17, 4, 64, generator=g).to(torch.bfloat16)
    fake_backend.calls.clear()
    out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert type(out.grad_fn).__name__ == "_EagerAttentionBackward"
    assert not lse.requires_grad
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert fake_backend.archs_called() == [90, 90]
    out_op, lse_op = torch.ops.cutlass_flash.fwd(q, k, v, 64 ** -0.5, -1, 0, 0, False)
    grads_op = torch.autograd.grad(out_op, (q, k, v), dout)
    for a, b in zip((out, lse, *grads), (out_op, lse_op, *grads_op)):
        assert torch.equal(a, b)
    with torch.no_grad():
        out_ng = flash_attn_func(q, k, v, causal=True)
    assert out_ng.grad_fn is None and torch.equal(out_ng, out)


def test_alibi_without_grad_matches_with_grad(fake_backend):
    """The eager no-grad path passes the feature arguments by name: it once handed alibi_slopes to
    _fwd_impl's positional varlen slot (found while adding dropout)."""
    case = Case(2, 17, 33, 4, 4, 64, "bf16", False, 0, alibi=1)
    q, k, v = make_inputs(case, "cpu")
    slopes = case.alibi_slopes("cpu")
    with torch.no_grad():
        out_no_grad = flash_attn_func(q, k, v, alibi_slopes=slopes)
    out = flash_attn_func(q, k, v, alibi_slopes=slopes)
    assert torch.equal(out_no_grad, out.detach())
