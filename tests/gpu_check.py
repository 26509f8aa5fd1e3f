"""Running one accuracy case on the GPU: poisoned memory, our call, the two references, the rule."""

import pytest
import torch

import cutlass_flash
import cutlass_flash.dropout
from attn_ref import assert_within_tolerance, reference_outputs, slack
from cases import Case, kernel_archs, make_dout, make_inputs, missing_kernels

OUTPUT_NAMES = ("out", "lse", "dq", "dk", "dv")


def poison_cuda_cache(case, device="cuda", copies=3):
    """Leaves NaN-filled blocks of the sizes our call allocates in the caching allocator, so
    outputs (torch.empty) the kernels fail to write hold NaN instead of stale valid numbers."""
    hd = cutlass_flash.padded_head_dim(case.head_dim)
    B, Sq, Sk, H, Hkv, D = (case.batch, case.seqlen_q, case.seqlen_k, case.nheads,
                            case.nheads_kv, case.head_dim)
    poison_cuda_blocks({
        2 * B * Sq * H * hd,   # out, dq (padded)
        4 * B * H * Sq,        # lse
        2 * B * Sk * Hkv * hd,  # dk, dv (padded)
        2 * B * Sq * H * D,    # out, dq (sliced)
        2 * B * Sk * Hkv * D,  # dk, dv (sliced)
    }, device, copies)


def poison_cuda_blocks(sizes, device="cuda", copies=3):
    """NaN-filled blocks of these byte sizes left in the caching allocator (poison_cuda_cache)."""
    blocks = [torch.full((n,), 0xFF, dtype=torch.uint8, device=device)
              for n in sorted(sizes) for _ in range(copies)]
    del blocks  # back to the cache, still holding 0xFF bytes (NaN in fp16, bf16 and fp32)


#: Set by conftest (--strict-gpu / CUTLASS_FLASH_STRICT_GPU=1): a kernel a GPU test needs and
#: the build lacks fails the test instead of skipping it.
STRICT = False


def skip_if_not_built(case):
    missing = missing_kernels(case)
    if missing:
        why = f"kernels not in this build: {missing}"
        if STRICT:
            pytest.fail(f"--strict-gpu: {why}")
        pytest.skip(why)


def skip_unless_auto_built(head_dim, dtype, arch=0):
    """Skips a test whose calls (forward and backward, of family `arch`: by default the one the
    dispatch picks on this GPU) need kernels of head_dim (padded) and dtype ("bf16" / "fp16")
    that a restricted build lacks (CUTLASS_FLASH_ARCHS, _FWD_ONLY, _HEAD_DIMS, _DTYPES), instead
    of failing with NotImplementedError."""
    skip_if_not_built(Case(1, 1, 1, 1, 1, head_dim, dtype, False, arch or max(kernel_archs())))


def check_case(case, device="cuda"):
    """Forward and backward of one case against the float64 reference, by the accuracy rule."""
    skip_if_not_built(case)
    q, k, v = make_inputs(case, device)
    dout = make_dout(case, device)
    poison_cuda_cache(case, device)
    torch.manual_seed(case.seed)  # the call's dropout mask: rebuilt below from the same draw
    with cutlass_flash.force_arch(case.arch):
        out, lse = cutlass_flash.flash_attn_func(q, k, v, causal=case.causal, window_size=case.window,
                                                 softcap=case.softcap, alibi_slopes=case.alibi_slopes(device),
                                                 dropout_p=case.dropout, return_lse=True)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    ours = (out, lse, dq, dk, dv)
    # The reference takes the mask the call normalizes to (causal: right = 0; bounds past the
    # sequence: unbounded), which it applies literally.
    slopes = case.alibi_slopes(device)
    features = dict(window=case.mask, softcap=case.softcap, alibi_slopes=slopes)
    if case.dropout:  # the mask the call drew (cutlass_flash.dropout), from the same generator state
        torch.manual_seed(case.seed)
        rng_state = cutlass_flash.dropout.new_rng_state(device)
        features.update(dropout_p=case.dropout, keep=cutlass_flash.dropout.keep_mask(
            rng_state, case.batch, case.nheads, case.seqlen_q, case.seqlen_k, case.dropout))
    ref = reference_outputs(q, k, v, dout, dtype=torch.float64, **features)
    same = reference_outputs(q, k, v, dout, **features)
    rows_per_key = case.seqlen_q * (case.nheads // case.nheads_kv)
    for name, o, s, r in zip(OUTPUT_NAMES, ours, same, ref):
        assert_within_tolerance(f"{case.id}: {name}", o, s, r,
                                slack=slack(name, rows_per_key, case.head_dim))
    return ours
