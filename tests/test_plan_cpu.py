"""cutlass_flash.plan(): what a call runs, or the error it raises, without running it; on the fake
binding (tests/fake_c.py), which pretends to be an sm90 GPU with every kernel built. The answers
come from the generator's tables (_catalog), never restated here."""

import pytest
import torch

import cutlass_flash
from cutlass_flash import _catalog

BF16 = torch.bfloat16


def _qk(head_dim, seqlen=32, nheads=4, nheads_kv=2):
    return (torch.randn(2, seqlen, nheads, head_dim, dtype=BF16),
            torch.randn(2, seqlen, nheads_kv, head_dim, dtype=BF16))


def test_plan_matches_what_the_call_runs(fake_backend):
    q, k = _qk(128)
    p = cutlass_flash.plan(q, k)
    assert p == cutlass_flash.Plan(90, 128, 0, "bf16", 0, 128)
    cutlass_flash.flash_attn_func(q, k, k)
    direction, arch, problem = fake_backend.calls[-1]
    assert (direction, arch, problem["head_dim"]) == ("fwd", p.arch, p.head_dim)


def test_plan_under_force_arch(fake_backend):
    q, k = _qk(64)
    with cutlass_flash.force_arch(80):
        assert cutlass_flash.plan(q, k, "bwd").arch == 80


@pytest.mark.parametrize("head_dim", [40, 72, 100, 130])
def test_plan_head_dims_between_instantiations(fake_backend, head_dim):
    """The next instantiated head dim, read in place (pad to whole 16-byte rows) where the family
    takes narrower tensors (_catalog.NARROW_HEAD_DIM), else zero-padded to it."""
    q, k = _qk(head_dim)
    for direction in ("fwd", "bwd"):
        p = cutlass_flash.plan(q, k, direction)
        assert p.head_dim == cutlass_flash.padded_head_dim(head_dim)
        narrow = direction in _catalog.NARROW_HEAD_DIM.get(p.arch, ())
        assert p.pad == (-head_dim % 8 if narrow else p.head_dim - head_dim)
        assert p.pad_v == p.pad


def test_plan_softcap_with_alibi(fake_backend):
    """Where a backward has no path for softcap with ALiBi at a head dim, plan() gives the larger
    head dim that has one, or raises as the call would."""
    q, k = _qk(64)
    slopes = torch.rand(4)
    for arch in (80, 90):
        takers = sorted(_catalog.SOFTCAP_ALIBI.get(arch, {}).get("bwd", ()))
        with cutlass_flash.force_arch(arch):
            if any(d >= 64 for d in takers):
                p = cutlass_flash.plan(q, k, "bwd", softcap=30.0, alibi_slopes=slopes)
                assert p.head_dim == min(d for d in takers if d >= 64)
            else:
                with pytest.raises(NotImplementedError, match="softcap and alibi_slopes together"):
                    cutlass_flash.plan(q, k, "bwd", softcap=30.0, alibi_slopes=slopes)


def test_plan_packed_batch(fake_backend):
    q, k = (torch.randn(40, 4, 64, dtype=BF16) for _ in range(2))
    cu = torch.tensor([0, 10, 40], dtype=torch.int32)
    p = cutlass_flash.plan(q, k, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=30, max_seqlen_k=30)
    assert p.head_dim == 64 and p.arch in _catalog.VARLEN


@pytest.mark.parametrize("head_dim, direction, exc", [(300, "fwd", ValueError), (64, "sideways", ValueError)])
def test_plan_errors(fake_backend, head_dim, direction, exc):
    q, k = _qk(head_dim)
    with pytest.raises(exc):
        cutlass_flash.plan(q, k, direction)
