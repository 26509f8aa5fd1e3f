"""seqused_q / seqused_k on the CPU: argument errors, the debug content check, and the ops'
plumbing (custom op, autograd, make_fx, the low-level pair) against tests/fake_c.py, which honours
seqused as the kernels do. tests/test_seqused.py has the kernels' side."""

import pytest
import torch

from cutlass_flash import _validate, flash_attn_varlen_func
from cutlass_flash.lowlevel import _flash_attn_varlen_backward, _flash_attn_varlen_forward

# Slots of 3 sequences and the rows each uses (an empty one, a whole slot, one shorter).
SLOTS_Q, USED_Q = (5, 20, 9), (0, 20, 4)
SLOTS_K, USED_K = (8, 16, 12), (3, 16, 12)
NAN = float("nan")


def _cu(lengths):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32)


def _i32(values):
    return torch.tensor(values, dtype=torch.int32)


def _inputs(seed=0, nheads=4, nheads_kv=2, head_dim=64):
    """q, k, v, dout in slots: the used rows random, the others NaN."""
    g = torch.Generator().manual_seed(seed)
    tensors = []
    for slots, used, heads in ((SLOTS_Q, USED_Q, nheads), (SLOTS_K, USED_K, nheads_kv), (SLOTS_K, USED_K, nheads_kv),
                               (SLOTS_Q, USED_Q, nheads)):
        t = torch.randn(sum(slots), heads, head_dim, generator=g).to(torch.bfloat16)
        for start, n, u in zip(_cu(slots).tolist(), slots, used):
            t[start + u:start + n] = NAN
        tensors.append(t)
    return tensors


def _call(q, k, v, **kw):
    return flash_attn_varlen_func(q, k, v, _cu(SLOTS_Q), _cu(SLOTS_K), max(USED_Q), max(USED_K), **kw)


# -- argument errors --------------------------------------------------------------------------


BAD_SEQUSED = {
    # id: (seqused, exception, message); batch is 3
    "list": ([1, 2, 3], TypeError, r"seqused_q must be None or an int32 tensor"),
    "int64": (torch.tensor([1, 2, 3]), TypeError, r"seqused_q must be int32"),
    "batch-plus-one": (_i32([0, 1, 2, 3]), ValueError, r"seqused_q must have shape \(3,\)"),
    "2-D": (_i32([[1, 2, 3]]), ValueError, r"seqused_q must have shape \(3,\)"),
    "strided": (_i32([1, 0, 2, 0, 3, 0])[::2], ValueError, r"seqused_q must be contiguous"),
    "other-device": (torch.zeros(3, dtype=torch.int32, device="meta"), ValueError,
                     r"seqused_q must be on q's device cpu"),
}


@pytest.mark.parametrize("side", ["q", "k"])
@pytest.mark.parametrize("bad", list(BAD_SEQUSED), ids=list(BAD_SEQUSED))
def test_seqused_bad_arguments(fake_backend, side, bad):
    """TypeError / ValueError naming the argument, before any kernel runs."""
    value, exc, match = BAD_SEQUSED[bad]
    q, k, v, _ = _inputs()
    with pytest.raises(exc, match=match.replace("seqused_q", f"seqused_{side}")):
        _call(q, k, v, **{f"seqused_{side}": value})
    assert fake_backend.calls == []


@pytest.mark.parametrize("used_q, used_k, match", [
    ((0, 21, 4), USED_K, r"seqused_q\[1\] = 21 must be in \[0, 20\]"),
    (USED_Q, (3, 16, -1), r"seqused_k\[2\] = -1 must be in \[0, 12\]"),
    (USED_Q, (3, 16, 13), r"seqused_k\[2\] = 13 must be in \[0, 12\]"),
])
def test_seqused_debug_switch_checks_content(fake_backend, monkeypatch, used_q, used_k, match):
    """Under CUTLASS_FLASH_CHECK_CU_SEQLENS=1, seqused[b] outside [0, slot length] raises
    ValueError naming the entry; without it the call runs (the kernels clamp to the slot)."""
    q, k, v, _ = _inputs()
    monkeypatch.setenv(_validate.CHECK_CU_SEQLENS_ENV, "1")
    with pytest.raises(ValueError, match=match):
        _call(q, k, v, seqused_q=_i32(used_q), seqused_k=_i32(used_k))
    monkeypatch.setenv(_validate.CHECK_CU_SEQLENS_ENV, "0")
    assert _call(q, k, v, seqused_q=_i32(used_q), seqused_k=_i32(used_k)).shape == q.shape


def test_seqused_debug_switch_bounds_used_lengths(fake_backend, monkeypatch):
    """With seqused, max_seqlen bounds the used lengths, not the slots: a slot longer than
    max_seqlen passes when its used rows do not, and a used length past it raises."""
    q, k, v, _ = _inputs()
    monkeypatch.setenv(_validate.CHECK_CU_SEQLENS_ENV, "1")
    used_q, used_k = _i32(USED_Q), _i32(USED_K)
    flash_attn_varlen_func(q, k, v, _cu(SLOTS_Q), _cu(SLOTS_K), 19, max(USED_K), seqused_q=_i32((0, 19, 4)),
                           seqused_k=used_k)
    with pytest.raises(ValueError, match=r"sequence 1 has 20 rows by seqused_q, more than its max_seqlen 19"):
        flash_attn_varlen_func(q, k, v, _cu(SLOTS_Q), _cu(SLOTS_K), 19, max(USED_K), seqused_q=used_q,
                               seqused_k=used_k)
    with pytest.raises(ValueError, match=r"sequence 1 has 20 rows by cu_seqlens_q, more than its max_seqlen 19"):
        flash_attn_varlen_func(q, k, v, _cu(SLOTS_Q), _cu(SLOTS_K), 19, max(USED_K), seqused_k=used_k)


# -- plumbing ---------------------------------------------------------------------------------


def _compacted(tensors, slots, used):
    """The used rows of slotted tensors, back to back."""
    rows = torch.cat([torch.arange(s, s + u) for s, u in zip(_cu(slots).tolist(), used)])
    return [t[rows] for t in tensors], rows


def test_seqused_op_and_autograd(fake_backend):
    """The custom op (what torch.compile sees) with its registered autograd, and the eager path:
    both give the compacted call's numbers on the used rows, 0 / +inf elsewhere, and the backward
    gets the forward's seqused."""
    q, k, v, dout = _inputs(seed=1)
    used_q, used_k = _i32(USED_Q), _i32(USED_K)
    (qc, doc), rows_q = _compacted((q, dout), SLOTS_Q, USED_Q)
    (kc, vc), rows_k = _compacted((k, v), SLOTS_K, USED_K)
    leaves = [t.clone().requires_grad_() for t in (qc, kc, vc)]
    ref = flash_attn_varlen_func(*leaves, _cu(USED_Q), _cu(USED_K), max(USED_Q), max(USED_K), causal=True,
                                 return_lse=True)
    ref = ref + torch.autograd.grad(ref[0], leaves, doc)
    scale = 64 ** -0.5
    for path in ("op", "eager"):
        fake_backend.calls.clear()
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        if path == "op":
            out, lse = torch.ops.cutlass_flash.fwd(
                *leaves, scale, -1, 0, 0, False, cu_seqlens_q=_cu(SLOTS_Q), cu_seqlens_k=_cu(SLOTS_K),
                max_seqlen_q=max(USED_Q), max_seqlen_k=max(USED_K), seqused_q=used_q, seqused_k=used_k)
        else:
            out, lse = _call(*leaves, causal=True, return_lse=True, seqused_q=used_q, seqused_k=used_k)
        ours = (out, lse) + torch.autograd.grad(out, leaves, dout)
        for name, mine, theirs in zip(("out", "lse", "dq", "dk", "dv"), ours, ref):
            rows = rows_k if name in ("dk", "dv") else rows_q
            unused = torch.ones(mine.shape[1] if name == "lse" else mine.shape[0], dtype=torch.bool)
            unused[rows] = False
            if name == "lse":
                assert torch.equal(mine[:, rows], theirs), f"{path}: {name}"
                assert bool((mine[:, unused] == float("inf")).all()), f"{path}: {name} unused rows"
            else:
                assert torch.equal(mine[rows], theirs), f"{path}: {name}"
                assert bool((mine[unused] == 0).all()), f"{path}: {name} unused rows"
        ptrs = {(used_q.data_ptr(), used_k.data_ptr())}
        assert {(p["seqused_q"], p["seqused_k"]) for _, _, p in fake_backend.calls} == ptrs
        assert [d for d, _, _ in fake_backend.calls] == ["fwd", "bwd"]


def test_seqused_under_make_fx(fake_backend):
    """The variable-length op traces as one node with seqused among its inputs."""
    from torch.fx.experimental.proxy_tensor import make_fx

    q, k, v, _ = _inputs()

    def f(q, k, v, cu_q, cu_k, used_q, used_k):
        return flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(USED_Q), max(USED_K), return_lse=True,
                                      seqused_q=used_q, seqused_k=used_k)

    args = (q, k, v, _cu(SLOTS_Q), _cu(SLOTS_K), _i32(USED_Q), _i32(USED_K))
    gm = make_fx(f, tracing_mode="fake")(*args)
    node = next(n for n in gm.graph.nodes if "cutlass_flash.fwd" in str(n.target))
    names = {n.name for n in node.all_input_nodes}
    assert {"used_q_1", "used_k_1"} <= names, names
    out, lse = gm(*args)
    ref_out, ref_lse = f(*args)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


def test_seqused_k_in_the_low_level_pair(fake_backend):
    """FlashAttention-2's _flash_attn_varlen_forward takes seqused_k (its argument, which raised
    NotImplementedError before); the backward takes it as a keyword: the compacted keys' results."""
    q, k, v, dout = _inputs(seed=2)
    q, dout = (torch.nan_to_num(t) for t in (q, dout))  # no seqused_q in FlashAttention-2's pair
    used_k = _i32(USED_K)
    (kc, vc), rows_k = _compacted((k, v), SLOTS_K, USED_K)
    cu_q = _cu(SLOTS_Q)
    out, lse, _, _ = _flash_attn_varlen_forward(q, k, v, cu_q, _cu(SLOTS_K), max(SLOTS_Q), max(USED_K), 0.0, None,
                                                True, seqused_k=used_k)
    ref_out, ref_lse, _, _ = _flash_attn_varlen_forward(q, kc, vc, cu_q, _cu(USED_K), max(SLOTS_Q), max(USED_K),
                                                        0.0, None, True)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    grads = [torch.full_like(t, NAN) for t in (q, k, v)]
    ref_grads = [torch.empty_like(t) for t in (q, kc, vc)]
    _flash_attn_varlen_backward(dout, q, k, v, out, lse, *grads, cu_q, _cu(SLOTS_K), max(SLOTS_Q), max(USED_K),
                                0.0, None, True, seqused_k=used_k)
    _flash_attn_varlen_backward(dout, q, kc, vc, ref_out, ref_lse, *ref_grads, cu_q, _cu(USED_K), max(SLOTS_Q),
                                max(USED_K), 0.0, None, True)
    assert torch.equal(grads[0], ref_grads[0])
    unused = torch.ones(k.shape[0], dtype=torch.bool)
    unused[rows_k] = False
    for mine, theirs in zip(grads[1:], ref_grads[1:]):
        assert torch.equal(mine[rows_k], theirs) and bool((mine[unused] == 0).all())

