"""Accuracy of forward and backward on the GPU against a float64 reference.

Rule (tests/attn_ref.assert_within_tolerance), for out, lse, dq, dk and dv:
    max|ours - ref| <= 2 * max|torch_same_dtype - ref| + 1e-5
with ref plain PyTorch attention in float64 and torch_same_dtype the same in the input dtype.

The fast subset runs by default; --full (or CUTLASS_FLASH_FULL_TESTS=1) adds the whole grid.
Every case is one test (tests/cases.py), forced to one kernel family (sm80, and sm90 on sm90).
"""

import pytest

import cases
from gpu_check import check_case

pytestmark = pytest.mark.gpu

_GRIDS = {
    "head_dim_case": cases.head_dim_cases,
    "seqlen_case": cases.seqlen_cases,
    "heads_case": cases.heads_cases,
    "layout_case": cases.layout_cases,
    "large_logit_case": cases.large_logit_cases,
    "window_case": cases.window_cases,
    "keyless_tile_case": cases.keyless_tile_cases,
    "softcap_case": cases.softcap_cases,
    "alibi_case": cases.alibi_cases,
    "dropout_case": cases.dropout_cases,
}


def pytest_generate_tests(metafunc):
    for name, grid in _GRIDS.items():
        if name in metafunc.fixturenames:
            cs = grid()
            metafunc.parametrize(name, cs, ids=[c.id for c in cs])
    if "full_case" in metafunc.fixturenames:
        if cases.full_grid(metafunc.config):
            cs = cases.full_grid_cases()
            metafunc.parametrize("full_case", cs, ids=[c.id for c in cs])
        else:
            skip = pytest.mark.skip(
                reason="full grid: run with --full or CUTLASS_FLASH_FULL_TESTS=1")
            metafunc.parametrize("full_case", [pytest.param(None, marks=skip)], ids=["off"])


def test_head_dims(head_dim_case):
    """Every built head dim and padded ones (40, 72, 200), fp16/bf16, causal or not."""
    check_case(head_dim_case)


def test_seqlens(seqlen_case):
    """Sequence lengths 1..4097, seqlen_q != seqlen_k both ways, batch 1 and 2."""
    check_case(seqlen_case)


def test_heads(heads_case):
    """MHA, GQA and MQA."""
    check_case(heads_case)


def test_layouts(layout_case):
    """Non-contiguous inputs: packed qkv / kv, transposed (B, H, S, D), padded rows."""
    check_case(layout_case)


def test_large_logits(large_logit_case):
    """q scaled by 8: logits of large magnitude."""
    check_case(large_logit_case)


def test_windows(window_case):
    """Sliding windows (window_size), with and without causal, seqlen_q != seqlen_k both ways."""
    check_case(window_case)


def test_keyless_tiles(keyless_tile_case):
    """Query tiles that see no key, after tiles with keys on the same persistent block."""
    check_case(keyless_tile_case)


def test_softcap(softcap_case):
    """softcap: scores capped by tanh, with its backward, q scaled so that tanh saturates."""
    check_case(softcap_case)


def test_alibi(alibi_case):
    """ALiBi slopes per head or per (batch, head), with masks, a window, softcap, GQA."""
    check_case(alibi_case)


def test_dropout(dropout_case):
    """dropout_p: the kernels' mask is cutlass_flash.dropout.keep_mask's (the reference uses it), in
    the forward and the backward; with masks, a window, softcap, ALiBi, GQA."""
    check_case(dropout_case)


def test_full_grid(full_case):
    check_case(full_case)
