"""Isolation of the documents of a packed batch (flash_attn_varlen_func), both kernel families, on
the GPU:

- NaN / Inf in the rows of one document never reach another document's out, lse, dq, dk, dv
  (documents end mid-tile, so the kernels' tiles overlap the neighbours' rows);
- rows after cu_seqlens[-1] (a static buffer larger than the documents, filled with NaN) neither
  reach the documents nor stay unwritten: out, dq, dk, dv are 0 there and lse is +inf, forward
  and backward, and forward alone;
- deterministic=True with non-monotone cu_seqlens returns (any numbers) instead of hanging: run in
  a subprocess with a timeout, so that a hang fails the test instead of freezing pytest.
"""

import os
import subprocess
import sys

import pytest
import torch

import cutlass_flash
from attn_ref import assert_within_tolerance, reference_outputs, slack
from cutlass_flash import _validate, flash_attn_varlen_func
from cases import Case, full_grid, kernel_archs
from gpu_check import skip_if_not_built

pytestmark = pytest.mark.gpu

NAN, INF = float("nan"), float("inf")
NHEADS, NHEADS_KV = 4, 2  # GQA: dK / dV summed over a group as well
DTYPE = torch.bfloat16
# Documents that end mid-tile (17, 113, 239), a one-row document and a long one (1100 rows: 8.6
# tiles of 128), back to back.
LENGTHS = (17, 113, 239, 1, 1100)
# Keys of the padding tests differ from the queries (some causal rows of a document see no key).
LENGTHS_K = (40, 113, 200, 1, 1100)
HEAD_DIMS = (64, 128)


def _cu(lengths):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


def _cu_tensor(lengths):
    return torch.tensor(_cu(lengths), dtype=torch.int32, device="cuda")


def _skip_unbuilt(arch, head_dim, causal):
    skip_if_not_built(Case(1, 1, 1, NHEADS, NHEADS_KV, head_dim, "bf16", causal, arch))


def _randn(rows, heads, head_dim, g):
    return torch.randn(rows, heads, head_dim, device="cuda", dtype=DTYPE, generator=g)


def _inputs(lengths_q, lengths_k, head_dim, seed, pad_q=0, pad_k=0, dout_pad=NAN):
    """q, k, v, dout with pad_q / pad_k rows after the documents, filled with NaN (dout's with
    dout_pad) (not leaves: the callers clone them into leaves)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    tq, tk = sum(lengths_q), sum(lengths_k)
    q = _randn(tq + pad_q, NHEADS, head_dim, g)
    k = _randn(tk + pad_k, NHEADS_KV, head_dim, g)
    v = _randn(tk + pad_k, NHEADS_KV, head_dim, g)
    dout = _randn(tq + pad_q, NHEADS, head_dim, g)
    for t, n in ((q, tq), (k, tk), (v, tk)):
        t[n:] = NAN
    dout[tq:] = dout_pad
    return q, k, v, dout


def _leaves(*tensors):
    return tuple(t.detach().clone().requires_grad_() for t in tensors)


def _poison_allocator(rows_q, rows_k, head_dim, copies=3):
    """Leaves blocks full of 0xFF bytes (NaN in bf16 and fp32) of the sizes the call allocates in
    the caching allocator (small and large pools alike), so that an output element the call does
    not write reads NaN rather than a stale, possibly zero, value."""
    sizes = {
        2 * rows_q * NHEADS * head_dim,     # out, dq
        4 * rows_q * NHEADS * head_dim,     # fp32 dq accumulator
        4 * NHEADS * rows_q,                # lse, rowsum(dO * O)
        2 * rows_k * NHEADS_KV * head_dim,  # dk, dv
        4 * rows_k * NHEADS_KV * head_dim,  # fp32 dk / dv accumulators
    }
    blocks = [torch.full((n,), 0xFF, dtype=torch.uint8, device="cuda")
              for n in sorted(sizes) for _ in range(copies)]
    blocks.append(torch.full((64 << 20,), NAN, device="cuda"))
    del blocks  # back to the cache, still holding NaN


def _documents_reference(q, k, v, dout, lengths_q, lengths_k, causal, dtype):
    """(out, lse, dq, dk, dv) over the documents' rows only (rows after cu_seqlens[-1] left out):
    attention_ref document by document, in ``dtype`` (None: the inputs' own). Rows that see no key
    have out = 0, lse = +inf, dq = 0, as the kernels."""
    tq, tk, D = sum(lengths_q), sum(lengths_k), q.shape[-1]
    dt = dtype or q.dtype
    out = torch.zeros(tq, NHEADS, D, dtype=dt, device=q.device)
    dq = torch.zeros_like(out)
    dk = torch.zeros(tk, NHEADS_KV, D, dtype=dt, device=q.device)
    dv = torch.zeros_like(dk)
    lse = torch.full((NHEADS, tq), INF, dtype=torch.float64 if dtype else torch.float32, device=q.device)
    cu_q, cu_k = _cu(lengths_q), _cu(lengths_k)
    for b, (nq, nk) in enumerate(zip(lengths_q, lengths_k)):
        if nq == 0 or nk == 0:
            continue
        sq, sk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        o, l, gq, gk, gv = reference_outputs(q[sq][None], k[sk][None], v[sk][None], dout[sq][None],
                                             causal=causal, dtype=dtype)
        out[sq], lse[:, sq], dq[sq], dk[sk], dv[sk] = o[0], l[0], gq[0], gk[0], gv[0]
    return out, lse, dq, dk, dv


def _assert_documents_accurate(ours, q, k, v, dout, lengths_q, lengths_k, causal, head_dim, what):
    """The accuracy rule on the documents' rows of ours = (out, lse, dq, dk, dv) (dq... may be
    left out: forward only), against the float64 reference of the clean documents."""
    tq, tk = sum(lengths_q), sum(lengths_k)
    ref = _documents_reference(q, k, v, dout, lengths_q, lengths_k, causal, torch.float64)
    same = _documents_reference(q, k, v, dout, lengths_q, lengths_k, causal, None)
    rows_per_key = max(lengths_q) * (NHEADS // NHEADS_KV)
    names = ("out", "lse", "dq", "dk", "dv")
    for name, o, s, r in zip(names, ours, same, ref):
        if name == "lse":
            o = o[:, :tq]
        else:
            o = o[:tk] if name in ("dk", "dv") else o[:tq]
        assert_within_tolerance(f"{what}: {name}", o, s, r, slack=slack(name, rows_per_key, head_dim))


def _assert_rows_after_documents(name, t, first_row, expected):
    """t's rows from first_row on (dim 1 for lse, dim 0 otherwise) hold exactly ``expected``."""
    tail = t[:, first_row:] if name == "lse" else t[first_row:]
    assert tail.numel() > 0
    bad = tail != expected
    n_bad = int(bad.sum())
    if n_bad:
        sample = tail[bad][:4].tolist()
        pytest.fail(f"{name}: {n_bad} of {tail.numel()} entries after cu_seqlens[-1] = {first_row} are "
                    f"not {expected} (e.g. {sample})")


# -- (a) NaN / Inf in one document stay there -----------------------------------------------------


def _plant(q, k, v, dout, doc, poison_dout):
    """Poisons the first and the last row of document ``doc`` (one row when it has one): NaN in Q
    and K, +Inf in V, NaN in dO too with poison_dout. A tile that runs past a document's end reads
    the next document's first rows; one that started before a document's start would read the
    previous one's last rows."""
    cu = _cu(LENGTHS)
    rows = [cu[doc], cu[doc + 1] - 1]
    q[rows] = NAN
    k[rows] = NAN
    v[rows] = INF
    if poison_dout:
        dout[rows] = NAN


# Whether dO (the gradient autograd passes in) is poisoned too, beside Q, K and V: a failure with
# "qkv+dout" alone says that the backward lets dO rows of a neighbour (or of padding) through.
POISON = {"qkv": False, "qkv+dout": True}


@pytest.mark.parametrize("arch", kernel_archs(), ids=lambda a: f"sm{a}")
@pytest.mark.parametrize("head_dim", HEAD_DIMS, ids=lambda d: f"d{d}")
@pytest.mark.parametrize("causal", [False, True], ids=["nomask", "causal"])
@pytest.mark.parametrize("poisoned", range(len(LENGTHS)), ids=lambda b: f"poison-doc{b}-len{LENGTHS[b]}")
@pytest.mark.parametrize("poison_dout", list(POISON.values()), ids=list(POISON))
def test_varlen_nonfinite_rows_stay_in_their_document(arch, head_dim, causal, poisoned, poison_dout):
    """NaN in Q and K (and dO), +Inf in V in the first and last rows of one document of
    17 / 113 / 239 / 1 / 1100 rows: every other document's out and lse are bit for bit those of
    the same varlen call (same max_seqlen) on that document alone with clean data, and its dq, dk,
    dv pass the accuracy rule against the float64 reference of the clean data. Fails where a tile
    that runs past a document's end lets a masked row of the neighbour into a GEMM (0 * Inf and
    0 * NaN are NaN), a row max or a row sum, forward or backward."""
    _skip_unbuilt(arch, head_dim, causal)
    clean = _inputs(LENGTHS, LENGTHS, head_dim, seed=1000 * head_dim + 10 * poisoned + causal)
    dirty = [t.clone() for t in clean]
    _plant(*dirty, poisoned, poison_dout)
    q, k, v = _leaves(*dirty[:3])
    cu = _cu_tensor(LENGTHS)
    longest = max(LENGTHS)
    with cutlass_flash.force_arch(arch):
        out, lse = flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=causal, return_lse=True)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), dirty[3])

    starts = _cu(LENGTHS)
    kept = [b for b in range(len(LENGTHS)) if b != poisoned]
    cq, ck, cv, cdout = clean
    # Forward: each other document alone through the same call, clean data: the same bits.
    for b in kept:
        rows = slice(starts[b], starts[b + 1])
        alone_cu = _cu_tensor((LENGTHS[b],))
        with torch.no_grad(), cutlass_flash.force_arch(arch):
            o1, l1 = flash_attn_varlen_func(cq[rows].clone(), ck[rows].clone(), cv[rows].clone(), alone_cu,
                                            alone_cu, longest, longest, causal=causal, return_lse=True)
        for name, mine, alone in (("out", out[rows], o1), ("lse", lse[:, rows], l1)):
            n_bad = int((~torch.isfinite(mine)).sum())
            assert n_bad == 0, (f"{name} of document {b} (len {LENGTHS[b]}): {n_bad} non-finite values "
                                f"(document {poisoned} poisoned)")
            n_diff = int((mine != alone).sum())
            assert n_diff == 0, (f"{name} of document {b} (len {LENGTHS[b]}): {n_diff} entries differ from "
                                 f"the same call on the document alone (document {poisoned} poisoned)")

    # Backward: the other documents' gradients against the float64 reference of the clean data.
    rows = torch.cat([torch.arange(starts[b], starts[b + 1]) for b in kept]).cuda()
    ref = _documents_reference(cq, ck, cv, cdout, LENGTHS, LENGTHS, causal, torch.float64)
    same = _documents_reference(cq, ck, cv, cdout, LENGTHS, LENGTHS, causal, None)
    rows_per_key = longest * (NHEADS // NHEADS_KV)
    for name, mine, r, s in zip(("dq", "dk", "dv"), (dq, dk, dv), ref[2:], same[2:]):
        assert_within_tolerance(f"documents other than {poisoned}: {name}", mine[rows], s[rows], r[rows],
                                slack=slack(name, rows_per_key, head_dim))


# -- (b), (d) rows after cu_seqlens[-1] --------------------------------------------------------------


# (rows of q after the documents, rows of k and v after them): less than a tile, more than two.
PADDING = {"padq5-padk130": (5, 130), "padq300-padk1": (300, 1)}


def _check_rows_after_documents(outputs, lengths_q, lengths_k):
    tq, tk = sum(lengths_q), sum(lengths_k)
    for name, t in zip(("out", "lse", "dq", "dk", "dv"), outputs):
        _assert_rows_after_documents(name, t, tk if name in ("dk", "dv") else tq, INF if name == "lse" else 0.0)


@pytest.mark.parametrize("arch", kernel_archs(), ids=lambda a: f"sm{a}")
@pytest.mark.parametrize("head_dim", HEAD_DIMS, ids=lambda d: f"d{d}")
@pytest.mark.parametrize("causal", [False, True], ids=["nomask", "causal"])
@pytest.mark.parametrize("pad_q, pad_k", list(PADDING.values()), ids=list(PADDING))
@pytest.mark.parametrize("poison_dout", list(POISON.values()), ids=["dout-pad-zero", "dout-pad-nan"])
def test_varlen_rows_after_documents(arch, head_dim, causal, pad_q, pad_k, poison_dout):
    """A static buffer larger than the documents: q, k, v have rows after cu_seqlens[-1], all NaN
    (dout's rows there are 0, or NaN too). The documents' out, lse, dq, dk, dv pass the accuracy
    rule (finite: no NaN row read into the last document's tiles), and the rows after the
    documents are exactly 0 in out, dq, dk, dv and +inf in lse. The caching allocator holds
    NaN-filled blocks of the outputs' sizes before the call, so a row the call leaves unwritten
    reads NaN and fails."""
    _skip_unbuilt(arch, head_dim, causal)
    data = _inputs(LENGTHS, LENGTHS_K, head_dim, seed=7 + head_dim + causal + pad_q, pad_q=pad_q, pad_k=pad_k,
                   dout_pad=NAN if poison_dout else 0.0)
    q, k, v = _leaves(*data[:3])
    cu_q, cu_k = _cu_tensor(LENGTHS), _cu_tensor(LENGTHS_K)
    _poison_allocator(q.shape[0], k.shape[0], head_dim)
    with cutlass_flash.force_arch(arch):
        out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(LENGTHS), max(LENGTHS_K), causal=causal,
                                          return_lse=True)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), data[3])
    ours = (out, lse, dq, dk, dv)
    _check_rows_after_documents(ours, LENGTHS, LENGTHS_K)
    _assert_documents_accurate(ours, *data, LENGTHS, LENGTHS_K, causal, head_dim,
                               f"documents before {pad_q} / {pad_k} NaN rows")


# (lengths_q, lengths_k, pad_q, pad_k): the five documents; a last document with queries and no
# keys; one one-row document in a large buffer.
FORWARD_PADDING = {
    "5docs-padq5-padk130": (LENGTHS, LENGTHS_K, 5, 130),
    "lastkeysempty-padq130-padk7": ((239, 50), (200, 0), 130, 7),
    "onerow-padq300-padk300": ((1,), (1,), 300, 300),
}


@pytest.mark.parametrize("arch", kernel_archs(), ids=lambda a: f"sm{a}")
@pytest.mark.parametrize("head_dim", HEAD_DIMS, ids=lambda d: f"d{d}")
@pytest.mark.parametrize("causal", [False, True], ids=["nomask", "causal"])
@pytest.mark.parametrize("layout", list(FORWARD_PADDING), ids=list(FORWARD_PADDING))
def test_varlen_forward_rows_after_documents(arch, head_dim, causal, layout):
    """The forward alone (no grad: the op without autograd's wrapper) on the NaN-padded buffer:
    out is exactly 0 and lse +inf after cu_seqlens[-1], the documents pass the accuracy rule."""
    _skip_unbuilt(arch, head_dim, causal)
    lengths_q, lengths_k, pad_q, pad_k = FORWARD_PADDING[layout]
    q, k, v, dout = _inputs(lengths_q, lengths_k, head_dim, seed=11 + head_dim + causal + pad_q,
                            pad_q=pad_q, pad_k=pad_k)
    cu_q, cu_k = _cu_tensor(lengths_q), _cu_tensor(lengths_k)
    _poison_allocator(q.shape[0], k.shape[0], head_dim)
    with torch.no_grad(), cutlass_flash.force_arch(arch):
        out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=causal,
                                          return_lse=True)
    _check_rows_after_documents((out, lse), lengths_q, lengths_k)
    _assert_documents_accurate((out, lse), q, k, v, dout, lengths_q, lengths_k, causal, head_dim,
                               f"forward, documents before {pad_q} NaN rows")


# -- (c) deterministic=True with non-monotone cu_seqlens returns ------------------------------------


HANG_TIMEOUT_S = 60
# 400 rows, max_seqlen 300: a document of negative length (the fast grid's); a last entry before
# the one ahead of it (--full).
BAD_CU_SEQLENS = {"0-300-100-400": [0, 300, 100, 400], "0-100-400-300": [0, 100, 400, 300]}
FAST_BAD_CU_SEQLENS = ("0-300-100-400",)
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))

_CHILD = """
import os, sys, torch
if os.environ.get("CUTLASS_FLASH_TEST_FAKE_BINDING", "").strip().lower() not in ("", "0", "false"):
    from cutlass_flash import _dispatch
    from fake_c import FakeC
    _dispatch._C = FakeC(device="cuda")
    _dispatch.reset_caches()
import cutlass_flash
arch, head_dim, causal, cu = {arch}, {head_dim}, {causal}, {cu}
torch.manual_seed(0)
q, k, v = (torch.randn(400, n, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
           for n in ({nheads}, {nheads_kv}, {nheads_kv}))
cu = torch.tensor(cu, dtype=torch.int32, device="cuda")
with cutlass_flash.force_arch(arch):
    with torch.no_grad():
        cutlass_flash.flash_attn_varlen_func(q, k, v, cu, cu, 300, 300, causal=causal, deterministic=True)
    torch.cuda.synchronize()
    print("forward returned", flush=True)
    out = cutlass_flash.flash_attn_varlen_func(q, k, v, cu, cu, 300, 300, causal=causal, deterministic=True)
    torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    torch.cuda.synchronize()
    print("backward returned", flush=True)
"""


def _text(x):
    return x.decode(errors="replace") if isinstance(x, bytes) else (x or "")


@pytest.mark.parametrize("arch", kernel_archs(), ids=lambda a: f"sm{a}")
@pytest.mark.parametrize("head_dim", (64, 128, 192, 256), ids=lambda d: f"d{d}")
@pytest.mark.parametrize("causal", [False, True], ids=["nomask", "causal"])
@pytest.mark.parametrize("cu_name", list(BAD_CU_SEQLENS))
def test_varlen_deterministic_bad_cu_seqlens_returns(request, arch, head_dim, causal, cu_name):
    """deterministic=True with non-monotone cu_seqlens (400 rows, max_seqlen 300): the forward
    (no grad) and then forward + backward return, whatever the numbers. A child process runs the
    calls and prints a line after each synchronizes: a hang (a deterministic backward waiting for
    a block that never comes) fails at the timeout, a CUDA error or exception by the exit status,
    and the missing line says which call. A child process costs seconds (torch's import, a CUDA
    context): the fast grid runs one pattern, --full both."""
    if cu_name not in FAST_BAD_CU_SEQLENS and not full_grid(request.config):
        pytest.skip("full grid: run with --full or CUTLASS_FLASH_FULL_TESTS=1")
    _skip_unbuilt(arch, head_dim, causal)
    code = _CHILD.format(arch=arch, head_dim=head_dim, causal=causal, cu=BAD_CU_SEQLENS[cu_name],
                         nheads=NHEADS, nheads_kv=NHEADS_KV)
    env = dict(os.environ)
    # The package this process imported (the checkout or an installed one), and tests/ (fake_c).
    paths = [os.path.dirname(os.path.dirname(os.path.abspath(cutlass_flash.__file__))), TESTS_DIR]
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [env.get("PYTHONPATH")] if p])
    env[_validate.CHECK_CU_SEQLENS_ENV] = "0"  # the call must run, not raise ValueError
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                           timeout=HANG_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        stdout = _text(e.stdout)
        stage = "forward + backward" if "forward returned" in stdout else "forward (no grad)"
        pytest.fail(f"cu_seqlens {BAD_CU_SEQLENS[cu_name]}, deterministic=True: the {stage} did not return "
                    f"within {HANG_TIMEOUT_S} s (a hang); child stdout: {stdout.strip()!r}, stderr tail: "
                    f"{_text(e.stderr)[-2000:]}")
    tail = f"stdout: {r.stdout.strip()!r}\nstderr tail:\n{r.stderr[-3000:]}"
    assert r.returncode == 0, f"child exited with {r.returncode}\n{tail}"
    assert "forward returned" in r.stdout and "backward returned" in r.stdout, tail
