"""Variable-length batches (flash_attn_varlen_func): the API on the fake binding (CPU) and the
kernels against the float64 reference, sequence by sequence (GPU)."""

import pytest
import torch

import cutlass_flash
from attn_ref import assert_within_tolerance, reference_outputs, slack
from cutlass_flash import _validate, flash_attn_func, flash_attn_varlen_func
from cutlass_flash._catalog import VARLEN
from cases import Case, head_dims, kernel_archs, missing_kernels
from gpu_check import skip_if_not_built

# Issue 11's mix: lengths 1, 17, 128, 1000, 4097, an empty sequence; keys differ from queries.
LENGTHS_Q = (1, 17, 0, 128, 1000, 4097)
LENGTHS_K = (17, 1, 5, 128, 1200, 4000)
SMALL_Q = (1, 17, 0, 130, 33)
SMALL_K = (20, 1, 4, 100, 33)


def _cu(lengths, device):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=device)


def packed(lengths_q, lengths_k, nheads, nheads_kv, head_dim, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)

    def randn(rows, heads):
        return torch.randn(rows, heads, head_dim, generator=g).to(device=device, dtype=dtype)

    q = randn(sum(lengths_q), nheads).requires_grad_()
    k = randn(sum(lengths_k), nheads_kv).requires_grad_()
    v = randn(sum(lengths_k), nheads_kv).requires_grad_()
    dout = randn(sum(lengths_q), nheads)
    return q, k, v, dout, _cu(lengths_q, device), _cu(lengths_k, device)


def _slopes(batch, nheads, device):
    """ALiBi slopes (batch, nheads), different per sequence."""
    heads = torch.arange(nheads, dtype=torch.float32)
    return (torch.pow(2.0, -(heads + 1)).view(1, -1) * (1 + torch.arange(batch)).view(-1, 1)).to(device)


def _run(q, k, v, dout, cu_q, cu_k, lengths_q, lengths_k, **kw):
    out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k),
                                      return_lse=True, **kw)
    return (out, lse) + torch.autograd.grad(out, (q, k, v), dout)


# -- CPU, on the fake binding --------------------------------------------------------------------


# Windows are normalized as FlashAttention-2 does, with max_seqlen_k for a packed batch: a right
# bound >= a sequence's own seqlen_k means no bound to flash_attn_func on that sequence alone but
# not to the packed call (the two differ where seqlen_q > seqlen_k), so the right bound here stays
# below every non-empty sequence's keys.
@pytest.mark.parametrize("mask", [dict(), dict(causal=True), dict(window_size=(7, 0)), dict(causal=True, alibi=True)],
                         ids=["nomask", "causal", "window", "alibi"])
def test_varlen_matches_dense_per_sequence(fake_backend, mask):
    """Each sequence of the packed batch gets what flash_attn_func gives it alone: the slices,
    the (nheads, total_q) LSE and the gradients are marshalled right; a sequence without keys
    gives out = 0, lse = +inf, zero gradients."""
    lq, lk = SMALL_Q, SMALL_K
    q, k, v, dout, cu_q, cu_k = packed(lq, lk, 4, 2, 40, torch.bfloat16, "cpu")
    mask = dict(mask)
    slopes = _slopes(len(lq), 4, "cpu") if mask.pop("alibi", False) else None
    out, lse, dq, dk, dv = _run(q, k, v, dout, cu_q, cu_k, lq, lk, alibi_slopes=slopes, **mask)
    assert out.shape == q.shape and lse.shape == (4, sum(lq)) and dk.shape == k.shape
    # auto: on the fake's sm90 GPU the sm90 family where it has variable-length kernels
    assert fake_backend.archs_called() == [90 if d in VARLEN[90] else 80 for d in ("fwd", "bwd")]
    for b, (nq, nk) in enumerate(zip(lq, lk)):
        sq = slice(int(cu_q[b]), int(cu_q[b + 1]))
        sk = slice(int(cu_k[b]), int(cu_k[b + 1]))
        if nq == 0:
            assert dk[sk].abs().max() == 0 and dv[sk].abs().max() == 0
            continue
        qb, kb, vb = (t.detach()[s].unsqueeze(0).requires_grad_() for t, s in ((q, sq), (k, sk), (v, sk)))
        o1, l1 = flash_attn_func(qb, kb, vb, return_lse=True,
                                 alibi_slopes=None if slopes is None else slopes[b:b + 1], **mask)
        g1 = torch.autograd.grad(o1, (qb, kb, vb), dout[sq].unsqueeze(0))
        torch.testing.assert_close(out[sq], o1[0])
        torch.testing.assert_close(lse[:, sq], l1[0])
        for mine, theirs in zip((dq[sq], dk[sk], dv[sk]), g1):
            torch.testing.assert_close(mine, theirs[0])


def test_varlen_sequence_without_keys(fake_backend):
    lq, lk = (3, 2), (0, 4)
    q, k, v, dout, cu_q, cu_k = packed(lq, lk, 2, 2, 64, torch.float16, "cpu")
    out, lse, dq, dk, dv = _run(q, k, v, dout, cu_q, cu_k, lq, lk)
    assert out[:3].abs().max() == 0 and bool(torch.isinf(lse[:, :3]).all())
    assert dq[:3].abs().max() == 0


def test_varlen_empty_longest(fake_backend):
    """max_seqlen_k = 0: no kernel runs; zeros and +inf, as for rows that see no key."""
    q, k, v, dout, cu_q, cu_k = packed((2, 1), (0, 0), 2, 2, 64, torch.bfloat16, "cpu")
    k = torch.zeros(1, 2, 64, dtype=torch.bfloat16, requires_grad=True)  # one unused row
    v = torch.zeros_like(k, requires_grad=True)
    out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 2, 0, return_lse=True)
    assert out.abs().max() == 0 and bool(torch.isinf(lse).all())
    assert fake_backend.calls == []


@pytest.mark.parametrize("arch", [80, 90])
def test_varlen_on_each_family(fake_backend, arch):
    """Forced to a family: it runs there, or raises NotImplementedError where that family has no
    variable-length kernel of a direction (cutlass_flash._catalog.VARLEN)."""
    q, k, v, dout, cu_q, cu_k = packed(SMALL_Q, SMALL_K, 2, 2, 64, torch.bfloat16, "cpu")
    with cutlass_flash.force_arch(arch):
        if "fwd" not in VARLEN[arch]:
            with pytest.raises(NotImplementedError, match="no variable-length fwd kernel"):
                flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(SMALL_Q), max(SMALL_K))
            return
        out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(SMALL_Q), max(SMALL_K))
        if "bwd" not in VARLEN[arch]:
            with pytest.raises(NotImplementedError, match="no variable-length bwd kernel"):
                torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
            return
        torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert fake_backend.archs_called() == [arch, arch]


def _bad_calls():
    q, k, v, _, cu_q, cu_k = packed(SMALL_Q, SMALL_K, 4, 2, 64, torch.bfloat16, "cpu")
    mq, mk = max(SMALL_Q), max(SMALL_K)
    return [
        ("4-D q", (q.unsqueeze(0), k, v, cu_q, cu_k, mq, mk), ValueError, "q must be 3-D"),
        ("int64 cu", (q, k, v, cu_q.long(), cu_k, mq, mk), TypeError, "cu_seqlens_q must be int32"),
        ("list cu", (q, k, v, cu_q.tolist(), cu_k, mq, mk), TypeError, "cu_seqlens_q must be an int32 tensor"),
        ("2-D cu", (q, k, v, cu_q.view(1, -1), cu_k, mq, mk), ValueError, "cu_seqlens_q must be 1-D"),
        ("cu lengths", (q, k, v, cu_q, cu_k[:-1], mq, mk), ValueError, "the same length"),
        ("float max", (q, k, v, cu_q, cu_k, float(mq), mk), TypeError, "max_seqlen_q must be an int"),
        ("negative max", (q, k, v, cu_q, cu_k, mq, -1), ValueError, "max_seqlen_k must be >= 0"),
        ("gqa heads", (q, k[:, :1].expand(-1, 3, -1), v[:, :1].expand(-1, 3, -1), cu_q, cu_k, mq, mk),
         ValueError, "multiple of"),
        ("no rows", (q[:0], k, v, cu_q, cu_k, mq, mk), ValueError, "at least one row"),
    ]


@pytest.mark.parametrize("name, args, exc, match", _bad_calls(), ids=[c[0] for c in _bad_calls()])
def test_varlen_bad_arguments(fake_backend, name, args, exc, match):
    with pytest.raises(exc, match=match):
        flash_attn_varlen_func(*args)
    assert fake_backend.calls == []


@pytest.mark.parametrize("cu, match", [
    ([1, 17, 18, 148, 178, 211], r"cu_seqlens_q\[0\] must be 0"),
    ([0, 17, 1, 148, 178, 211], "must not decrease"),
    ([0, 1, 18, 18, 148, 182], "past the tensor"),
    ([0, 1, 18, 18, 149, 181], "more than its max_seqlen"),
])
def test_varlen_debug_switch_checks_content(fake_backend, monkeypatch, cu, match):
    """Bad cu_seqlens content: a clear error under the debug switch; without it the call still
    runs (the kernels clamp every sequence to the tensors, as the fake does)."""
    q, k, v, _, cu_q, cu_k = packed(SMALL_Q, SMALL_K, 2, 2, 64, torch.bfloat16, "cpu")
    bad = torch.tensor(cu, dtype=torch.int32)
    monkeypatch.setenv(_validate.CHECK_CU_SEQLENS_ENV, "1")
    with pytest.raises(ValueError, match=match):
        flash_attn_varlen_func(q, k, v, bad, cu_k, max(SMALL_Q), max(SMALL_K))
    monkeypatch.setenv(_validate.CHECK_CU_SEQLENS_ENV, "0")
    out = flash_attn_varlen_func(q, k, v, bad, cu_k, max(SMALL_Q), max(SMALL_K))
    assert out.shape == q.shape


def test_varlen_op_under_make_fx(fake_backend):
    """The variable-length ops trace as single nodes (fake implementations give the shapes)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    q, k, v, dout, cu_q, cu_k = packed(SMALL_Q, SMALL_K, 2, 2, 64, torch.bfloat16, "cpu")

    def f(q, k, v, cu_q, cu_k):
        return flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(SMALL_Q), max(SMALL_K), return_lse=True)

    gm = make_fx(f, tracing_mode="fake")(q.detach(), k.detach(), v.detach(), cu_q, cu_k)
    assert gm.code.count("cutlass_flash.fwd") == 1, gm.code


# -- GPU: the kernels against the float64 reference -------------------------------------------


def _reference(q, k, v, dout, cu_q, cu_k, lengths_q, lengths_k, dtype, mask, slopes=None, sinks=None):
    """(out, lse, dq, dk, dv) in the packed layouts, attention_ref sequence by sequence; with
    sinks, dsinks summed over the sequences after them, and lse = the sink on the rows of a
    sequence without keys. out is shaped like dout (v's head dim where it differs from q's)."""
    outs = [torch.zeros_like(t, dtype=dtype or t.dtype) for t in (dout, q, k, v)]
    out, dq, dk, dv = outs
    lse = torch.full((q.shape[1], q.shape[0]), float("inf"), dtype=torch.float64 if dtype else torch.float32,
                     device=q.device)
    dsinks = torch.zeros(q.shape[1], dtype=lse.dtype, device=q.device)
    for b, (nq, nk) in enumerate(zip(lengths_q, lengths_k)):
        sq = slice(int(cu_q[b]), int(cu_q[b + 1]))
        sk = slice(int(cu_k[b]), int(cu_k[b + 1]))
        if nq == 0 or nk == 0:
            if sinks is not None:
                lse[:, sq] = sinks.detach().to(lse.dtype)[:, None]
            continue
        r = reference_outputs(q[sq][None], k[sk][None], v[sk][None], dout[sq][None], dtype=dtype, window=mask,
                              alibi_slopes=None if slopes is None else slopes[b:b + 1], sinks=sinks)
        out[sq], lse[:, sq], dq[sq], dk[sk], dv[sk] = (t[0] for t in r[:5])
        if sinks is not None:
            dsinks += r[5].to(dsinks.dtype)
    return (out, lse, dq, dk, dv) + ((dsinks,) if sinks is not None else ())


def _mask(causal, window, max_k):
    left, right = _validate.check_mask(causal, window, max(max_k, 1))
    return (left, right)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", kernel_archs(), ids=lambda a: f"sm{a}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", head_dims())
@pytest.mark.parametrize("causal, window, alibi", [(False, (-1, -1), False), (True, (-1, -1), False),
                                                   (False, (300, 0), False), (True, (-1, -1), True)],
                         ids=["nomask", "causal", "w300_0", "causal_alibi"])
def test_varlen_accuracy(arch, dtype, head_dim, causal, window, alibi):
    if dtype == torch.float16 and head_dim not in (64, 128):
        pytest.skip("fp16: two head dims suffice (the dtype changes no addressing)")
    skip_if_not_built(Case(1, 1, 1, 4, 2, head_dim, "bf16" if dtype == torch.bfloat16 else "fp16", causal, arch))
    lq, lk = LENGTHS_Q, LENGTHS_K
    torch.full((64 << 20,), float("nan"), device="cuda")  # poison the caching allocator
    q, k, v, dout, cu_q, cu_k = packed(lq, lk, 4, 2, head_dim, dtype, "cuda", seed=head_dim)
    slopes = _slopes(len(lq), 4, "cuda") if alibi else None
    with cutlass_flash.force_arch(arch):
        ours = _run(q, k, v, dout, cu_q, cu_k, lq, lk, causal=causal, window_size=window, alibi_slopes=slopes)
    mask = _mask(causal, window, max(lk))
    ref = _reference(q, k, v, dout, cu_q, cu_k, lq, lk, torch.float64, mask, slopes)
    same = _reference(q, k, v, dout, cu_q, cu_k, lq, lk, None, mask, slopes)
    rows_per_key = max(lq) * 2
    for name, o, s, r in zip(("out", "lse", "dq", "dk", "dv"), ours, same, ref):
        assert_within_tolerance(f"varlen d={head_dim} {name}", o, s, r, slack=slack(name, rows_per_key, head_dim))


def _a_built_head_dim(arch):
    for d in head_dims():
        if not missing_kernels(Case(1, 1, 1, 4, 2, d, "bf16", False, arch)):
            return d
    import gpu_check

    (pytest.fail if gpu_check.STRICT else pytest.skip)(
        "no bf16 kernel of a family with variable-length batches in this build")


@pytest.mark.gpu
@pytest.mark.parametrize("arch", kernel_archs(), ids=lambda a: f"sm{a}")
def test_varlen_deterministic_alone_and_in_batch(arch):
    """deterministic=True: bit-identical over runs, and one sequence's gradients the same bits
    alone as inside the packed batch."""
    lq, lk = (300, 1000, 77), (900, 1000, 500)
    q, k, v, dout, cu_q, cu_k = packed(lq, lk, 4, 2, _a_built_head_dim(arch), torch.bfloat16, "cuda", seed=1)
    with cutlass_flash.force_arch(arch):
        first = _run(q, k, v, dout, cu_q, cu_k, lq, lk, causal=True, deterministic=True)
        again = _run(q, k, v, dout, cu_q, cu_k, lq, lk, causal=True, deterministic=True)
    for a, b in zip(first, again):
        assert torch.equal(a, b)
    sq, sk = slice(300, 1300), slice(900, 1900)
    qa, ka, va = (t.detach()[s].clone().requires_grad_() for t, s in ((q, sq), (k, sk), (v, sk)))
    with cutlass_flash.force_arch(arch):
        alone = _run(qa, ka, va, dout[sq], _cu((1000,), "cuda"), _cu((1000,), "cuda"), (1000,), (1000,),
                     causal=True, deterministic=True)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), first, alone):
        part = a[:, sq] if name == "lse" else a[sk if name in ("dk", "dv") else sq]
        assert torch.equal(part, b), f"{name} of sequence 1 differs alone and in the batch"


@pytest.mark.gpu
@pytest.mark.parametrize("arch", kernel_archs(), ids=lambda a: f"sm{a}")
def test_varlen_bad_cu_seqlens_stay_in_bounds(arch):
    """cu_seqlens past the tensors, decreasing or not starting at 0: the kernels clamp, so the
    call completes without a CUDA error (compute-sanitizer's memcheck would name any stray
    access: lab/sanitize_small.py)."""
    q, k, v, dout, cu_q, cu_k = packed((100, 200), (150, 50), 2, 2, _a_built_head_dim(arch), torch.bfloat16, "cuda")
    for bad in ([0, 100, 100000], [50, 10, 300], [-7, 300, 200]):
        cu = torch.tensor(bad, dtype=torch.int32, device="cuda")
        with cutlass_flash.force_arch(arch):
            out = flash_attn_varlen_func(q, k, v, cu, cu, 200, 150)
            torch.autograd.grad(out, (q, k, v), dout)
        torch.cuda.synchronize()
