"""seqused_q / seqused_k of flash_attn_varlen_func (FlashAttention-3's static-shape packing), both
kernel families, on the GPU: sequence b is the first seqused[b] rows of its slot
[cu_seqlens[b], cu_seqlens[b + 1]), and the slot's other rows belong to no sequence.

Each test packs the same documents twice: into slots with unused rows (NaN in q, k, v and dout,
slots longer than max_seqlen among them) and with seqused, and back to back without seqused (the
compacted call). The documents' out and lse must be the compacted call's bits, and so must dq,
dk, dv under deterministic=True (a sequence has the same bits in any batch); without it the
gradients pass the accuracy rule. The unused rows and those after cu_seqlens[-1] must be exactly
0 in out, dq, dk, dv and +inf in lse, with the caching allocator full of NaN before the call. A
kernel that ignored seqused would read the NaN rows (NaN in the documents), and a launch that left
the unused rows unwritten would return NaN there.

test_seqused_matches_compacted_fake runs the same check on the CPU against tests/fake_c.py (the
Python layer's plumbing; the fake honours seqused as the kernels do).
"""

import pytest
import torch

import cutlass_flash
from attn_ref import assert_within_tolerance, reference_outputs, slack
from cutlass_flash import _dispatch, flash_attn_varlen_func
from cases import Case, kernel_archs
from fake_c import FakeC
from gpu_check import skip_if_not_built

NAN, INF = float("nan"), float("inf")
NHEADS, NHEADS_KV = 4, 2  # GQA: dK / dV summed over a group as well
DTYPE = torch.bfloat16
HEAD_DIMS = (64, 128)
# Used rows per sequence and the unused rows after them in each slot: gaps shorter than a tile,
# longer than two, none; a sequence without queries, one without keys (its query sees none), and
# a last key slot of 1300 rows, longer than max_seqlen_k = 1100 (legal: the used rows are not).
USED_Q = (17, 113, 0, 239, 1, 1100)
UNUSED_Q = (5, 0, 40, 130, 300, 3)
USED_K = (40, 113, 9, 200, 0, 1100)
UNUSED_K = (7, 130, 0, 1, 64, 200)
TAIL_Q, TAIL_K = 9, 5  # rows after cu_seqlens[-1] as well
# Which sides get seqused (the other side's slots are exactly its used rows).
SIDES = ("q", "k", "qk")
# The features a sequence's numbers depend on besides its rows: a window (normalized with
# max_seqlen_k), per-sequence ALiBi slopes, dropout (the mask of sequence b is the dense mask's
# corner [b, :, :used_q, :used_k], so both calls draw the same one from the same seed).
FEATURES = {"plain": {}, "window-alibi-dropout": dict(window_size=(64, 16), alibi=True, dropout_p=0.1)}


def _cu(lengths):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


def _used_rows(slots, used, device):
    """The rows of the slotted tensor that hold the documents, in document order."""
    cu = _cu(slots)
    return torch.cat([torch.arange(cu[b], cu[b] + n) for b, n in enumerate(used)]).to(device)


def _poison_allocator(rows_q, rows_k, head_dim, device):
    """Leaves blocks full of 0xFF bytes (NaN in bf16 and fp32) of the sizes the calls allocate in
    the caching allocator, so that an output row the call does not write reads NaN."""
    if torch.device(device).type != "cuda":
        return
    sizes = {2 * rows_q * NHEADS * head_dim, 4 * rows_q * NHEADS * head_dim, 4 * NHEADS * rows_q,
             2 * rows_k * NHEADS_KV * head_dim, 4 * rows_k * NHEADS_KV * head_dim}
    blocks = [torch.full((n,), 0xFF, dtype=torch.uint8, device=device) for n in sorted(sizes) for _ in range(3)]
    blocks.append(torch.full((64 << 20,), NAN, device=device))
    del blocks  # back to the cache, still holding NaN


class Packing:
    """The documents of USED_Q / USED_K in slots (seqused on `sides`) and compacted."""

    def __init__(self, sides, head_dim, device, seed):
        self.device = device
        self.slots_q = [u + (x if "q" in sides else 0) for u, x in zip(USED_Q, UNUSED_Q)]
        self.slots_k = [u + (x if "k" in sides else 0) for u, x in zip(USED_K, UNUSED_K)]
        self.seqused_q = self._int32(USED_Q) if "q" in sides else None
        self.seqused_k = self._int32(USED_K) if "k" in sides else None
        self.rows_q = _used_rows(self.slots_q, USED_Q, device)
        self.rows_k = _used_rows(self.slots_k, USED_K, device)
        self.total_q, self.total_k = sum(self.slots_q) + TAIL_Q, sum(self.slots_k) + TAIL_K
        g = torch.Generator(device=device).manual_seed(seed)

        def randn(rows, heads):
            return torch.randn(rows, heads, head_dim, device=device, dtype=DTYPE, generator=g)

        # Compacted documents, and the same rows in slots with NaN everywhere else.
        self.compact = (randn(sum(USED_Q), NHEADS), randn(sum(USED_K), NHEADS_KV),
                        randn(sum(USED_K), NHEADS_KV), randn(sum(USED_Q), NHEADS))
        self.slotted = []
        for t, rows, total in zip(self.compact, (self.rows_q, self.rows_k, self.rows_k, self.rows_q),
                                  (self.total_q, self.total_k, self.total_k, self.total_q)):
            s = torch.full((total,) + t.shape[1:], NAN, device=device, dtype=DTYPE)
            s[rows] = t
            self.slotted.append(s)
        self.slopes = (torch.pow(2.0, -(torch.arange(NHEADS) + 1.0)).view(1, -1)
                       * (1 + torch.arange(len(USED_Q))).view(-1, 1)).to(device)

    def _int32(self, values):
        return torch.tensor(values, dtype=torch.int32, device=self.device)

    def run(self, slotted, arch, causal, features, deterministic=False, grad=True):
        """(out, lse[, dq, dk, dv]) of the slotted call with seqused, or of the compacted one."""
        kw = dict(features)
        kw["alibi_slopes"] = self.slopes if kw.pop("alibi", False) else None
        tensors = self.slotted if slotted else self.compact
        cu_q = self._int32(_cu(self.slots_q) if slotted else _cu(USED_Q))
        cu_k = self._int32(_cu(self.slots_k) if slotted else _cu(USED_K))
        if slotted:
            kw.update(seqused_q=self.seqused_q, seqused_k=self.seqused_k)
            _poison_allocator(self.total_q, self.total_k, tensors[0].shape[-1], self.device)
        q, k, v = (t.detach().clone().requires_grad_(grad) for t in tensors[:3])
        torch.manual_seed(1234)  # the same dropout mask in both calls
        with torch.set_grad_enabled(grad), cutlass_flash.force_arch(arch):
            out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(USED_Q), max(USED_K), causal=causal,
                                              deterministic=deterministic, return_lse=True, **kw)
            if not grad:
                return out, lse
            return (out, lse) + torch.autograd.grad(out, (q, k, v), tensors[3])

    def documents(self, name, t):
        """The documents' rows of a slotted output (dim 1 of lse), in document order."""
        if name == "lse":
            return t[:, self.rows_q]
        return t[self.rows_k if name in ("dk", "dv") else self.rows_q]

    def check_unused_rows(self, name, t):
        """The rows of no sequence (slot gaps and the tail) hold exactly 0 (+inf in lse)."""
        keys = name in ("dk", "dv")
        total = self.total_k if keys else self.total_q
        unused = torch.ones(total, dtype=torch.bool, device=t.device)
        unused[self.rows_k if keys else self.rows_q] = False
        rest = t[:, unused] if name == "lse" else t[unused]
        expected = INF if name == "lse" else 0.0
        n_bad = int((rest != expected).sum())
        assert n_bad == 0, (f"{name}: {n_bad} of {rest.numel()} entries of the rows outside every sequence are not "
                            f"{expected} (e.g. {rest[rest != expected][:4].tolist()})")


NAMES = ("out", "lse", "dq", "dk", "dv")


def check_matches_compacted(device, arch, head_dim, causal, sides, features, grad=True, seed=0):
    """The slotted call with seqused against the compacted one, deterministic=True: the same bits
    in the documents' rows; 0 / +inf in the others."""
    pack = Packing(sides, head_dim, device, seed)
    ours = pack.run(True, arch, causal, features, deterministic=True, grad=grad)
    compact = pack.run(False, arch, causal, features, deterministic=True, grad=grad)
    for name, mine, theirs in zip(NAMES, ours, compact):
        pack.check_unused_rows(name, mine)
        docs = pack.documents(name, mine)
        n_diff = int((docs != theirs).sum()) if docs.shape == theirs.shape else -1
        assert n_diff == 0, (f"{name}: {n_diff} entries of the documents differ from the compacted call "
                             f"without seqused (-1: shapes {tuple(docs.shape)} / {tuple(theirs.shape)})")


def _skip_unbuilt(arch, head_dim, causal):
    skip_if_not_built(Case(1, 1, 1, NHEADS, NHEADS_KV, head_dim, "bf16", causal, arch))


@pytest.mark.gpu
@pytest.mark.parametrize("arch", kernel_archs(), ids=lambda a: f"sm{a}")
@pytest.mark.parametrize("head_dim", HEAD_DIMS, ids=lambda d: f"d{d}")
@pytest.mark.parametrize("causal", [False, True], ids=["nomask", "causal"])
@pytest.mark.parametrize("sides", SIDES, ids=lambda s: f"seqused-{s}")
@pytest.mark.parametrize("features", list(FEATURES.values()), ids=list(FEATURES))
def test_seqused_matches_compacted(arch, head_dim, causal, sides, features):
    """Forward and backward, deterministic=True: out, lse, dq, dk, dv of the documents are the
    compacted call's bits, and the unused rows are 0 / +inf."""
    _skip_unbuilt(arch, head_dim, causal)
    check_matches_compacted("cuda", arch, head_dim, causal, sides, features, seed=head_dim + causal)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", kernel_archs(), ids=lambda a: f"sm{a}")
@pytest.mark.parametrize("head_dim", HEAD_DIMS, ids=lambda d: f"d{d}")
@pytest.mark.parametrize("causal", [False, True], ids=["nomask", "causal"])
@pytest.mark.parametrize("sides", SIDES, ids=lambda s: f"seqused-{s}")
def test_seqused_forward_alone(arch, head_dim, causal, sides):
    """The forward without autograd: out and lse as the compacted call's, 0 / +inf elsewhere."""
    _skip_unbuilt(arch, head_dim, causal)
    check_matches_compacted("cuda", arch, head_dim, causal, sides, {}, grad=False, seed=7 + head_dim)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", kernel_archs(), ids=lambda a: f"sm{a}")
@pytest.mark.parametrize("head_dim", HEAD_DIMS, ids=lambda d: f"d{d}")
@pytest.mark.parametrize("causal", [False, True], ids=["nomask", "causal"])
def test_seqused_gradients_accurate(arch, head_dim, causal):
    """deterministic=False (dQ accumulated in any order): out and lse still the compacted call's
    bits, the gradients of the documents within the accuracy rule of the float64 reference of the
    clean documents, the unused rows 0 / +inf."""
    _skip_unbuilt(arch, head_dim, causal)
    pack = Packing("qk", head_dim, "cuda", seed=3 + head_dim + causal)
    ours = pack.run(True, arch, causal, {})
    compact = pack.run(False, arch, causal, {}, grad=False)
    for name, mine in zip(NAMES, ours):
        pack.check_unused_rows(name, mine)
    for name, mine, theirs in zip(NAMES, ours[:2], compact):
        assert torch.equal(pack.documents(name, mine), theirs), f"{name} differs from the compacted call"
    q, k, v, dout = pack.compact
    cu_q, cu_k = _cu(USED_Q), _cu(USED_K)
    refs = [[torch.zeros_like(t, dtype=dt) for t in (q, k, v)] for dt in (torch.float64, DTYPE)]
    for b, (nq, nk) in enumerate(zip(USED_Q, USED_K)):
        if nq == 0 or nk == 0:
            continue
        sq, sk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        for dt, grads in zip((torch.float64, None), refs):
            _, _, gq, gk, gv = reference_outputs(q[sq][None], k[sk][None], v[sk][None], dout[sq][None],
                                                 causal=causal, dtype=dt)
            grads[0][sq], grads[1][sk], grads[2][sk] = gq[0], gk[0], gv[0]
    rows_per_key = max(USED_Q) * (NHEADS // NHEADS_KV)
    for i, name in enumerate(("dq", "dk", "dv")):
        assert_within_tolerance(f"seqused: {name}", pack.documents(name, ours[2 + i]), refs[1][i], refs[0][i],
                                slack=slack(name, rows_per_key, head_dim))


@pytest.mark.gpu
@pytest.mark.parametrize("arch", kernel_archs(), ids=lambda a: f"sm{a}")
def test_seqused_read_on_each_graph_replay(arch):
    """The use case: a CUDA graph captured once, seqused changed in place between replays. The
    kernels read seqused on the GPU (tile lists, clearing), so each replay is the compacted call of
    its lengths."""
    if isinstance(_dispatch._C, FakeC):
        pytest.skip("the fake binding reads cu_seqlens on the host (a synchronisation: no capture)")
    _skip_unbuilt(arch, 64, True)
    pack = Packing("qk", 64, "cuda", seed=5)
    q, k, v = (t.detach() for t in pack.slotted[:3])
    cu_q = torch.tensor(_cu(pack.slots_q), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor(_cu(pack.slots_k), dtype=torch.int32, device="cuda")
    used_q, used_k = pack.seqused_q.clone(), pack.seqused_k.clone()

    def call():
        return flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(USED_Q), max(USED_K), causal=True,
                                      return_lse=True, seqused_q=used_q, seqused_k=used_k)

    with cutlass_flash.force_arch(arch):
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):  # warm-up outside capture
            call()
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out, lse = call()
    # Fewer used rows on replay (the slots' data unchanged: NaN past USED, the documents before).
    shorter_q = [max(n - 9, 0) for n in USED_Q]
    shorter_k = [max(n - 30, 1) if n else 0 for n in USED_K]
    for lengths_q, lengths_k in ((USED_Q, USED_K), (shorter_q, shorter_k)):
        used_q.copy_(torch.tensor(lengths_q, dtype=torch.int32))
        used_k.copy_(torch.tensor(lengths_k, dtype=torch.int32))
        out.fill_(NAN)
        lse.fill_(NAN)
        graph.replay()
        torch.cuda.synchronize()
        rows_q = _used_rows(pack.slots_q, lengths_q, "cuda")
        rows_k = _used_rows(pack.slots_k, lengths_k, "cuda")
        cq = torch.tensor(_cu(lengths_q), dtype=torch.int32, device="cuda")
        ck = torch.tensor(_cu(lengths_k), dtype=torch.int32, device="cuda")
        with cutlass_flash.force_arch(arch):
            o1, l1 = flash_attn_varlen_func(q[rows_q], k[rows_k], v[rows_k], cq, ck, max(USED_Q), max(USED_K),
                                            causal=True, return_lse=True)
        what = f"replay with seqused {lengths_q} / {lengths_k}"
        assert torch.equal(out[rows_q], o1) and torch.equal(lse[:, rows_q], l1), what
        unused = torch.ones(q.shape[0], dtype=torch.bool, device="cuda")
        unused[rows_q] = False
        assert bool((out[unused] == 0).all()) and bool((lse[:, unused] == INF).all()), what


# -- CPU: the same check against the fake binding ------------------------------------------------


@pytest.mark.parametrize("sides", SIDES, ids=lambda s: f"seqused-{s}")
@pytest.mark.parametrize("features", list(FEATURES.values()), ids=list(FEATURES))
def test_seqused_matches_compacted_fake(fake_backend, sides, features):
    """check_matches_compacted on the CPU, the kernels replaced by tests/fake_c.py: seqused reaches
    the binding in both directions (the backward gets the forward's), and the fake's rows of no
    sequence are 0 / +inf."""
    check_matches_compacted("cpu", 0, 64, True, sides, features)
    assert [d for d, _, _ in fake_backend.calls] == ["fwd", "bwd", "fwd", "bwd"]
    for direction, _, passed in fake_backend.calls[:2]:  # the slotted call's (the compacted one's after)
        if "q" in sides:
            assert passed.get("seqused_q"), f"{direction}: no seqused_q"
        if "k" in sides:
            assert passed.get("seqused_k"), f"{direction}: no seqused_k"
