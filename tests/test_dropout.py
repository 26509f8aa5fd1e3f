"""Dropout (issue 11) on CPU: the Philox generator and the keep mask of cutlass_flash.dropout (the
function the kernels implement, csrc/kernels/common/dropout.h), and the Python path end to end
on the fake binding (the same rng_state reaching the forward and the backward, reproducibility
under torch.manual_seed, the low-level pair). tests/test_gpu_accuracy.py::test_dropout checks the
kernels against this mask."""

import math

import pytest
import torch

import cutlass_flash
from cutlass_flash import dropout, flash_attn_func, flash_attn_varlen_func
from cutlass_flash.lowlevel import _flash_attn_backward, _flash_attn_forward
from attn_ref import assert_within_tolerance, reference_outputs
from cases import Case, make_dout, make_inputs

# Random123's known-answer vectors for Philox4x32-10 (the masks use dropout.ROUNDS, the same
# round function): (counter, key) -> output.
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter,key,expected", KAT, ids=["zeros", "ones", "pi"])
def test_philox_known_answers(counter, key, expected):
    out = dropout.philox4x32(*(torch.tensor([c], dtype=torch.int64) for c in counter), *key, rounds=10)
    assert tuple(int(w) for w in out) == expected


def _state(seed, offset=0):
    return torch.tensor([seed, offset], dtype=torch.int64)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_rate(p):
    """The keep rate is the threshold's (1 - p to 1/256) within 5 standard deviations of a
    Bernoulli count, per head, and the kept scores' scale is its inverse."""
    keep = dropout.keep_mask(_state(1234, 99), 2, 3, 200, 300, p)
    rate = dropout.keep_threshold(p) / 256
    assert abs(rate - (1 - p)) <= 0.5 / 256
    assert dropout.keep_scale(p) == pytest.approx(1 / rate)
    n = keep[0, 0].numel()
    sd = math.sqrt(n * rate * (1 - rate))
    for b in range(2):
        for h in range(3):
            assert abs(int(keep[b, h].sum()) - n * rate) < 5 * sd


def test_mask_is_a_pure_function_of_position():
    """A sequence's mask does not depend on the rest of the batch or on the padded size: the mask
    of (2, 3, 100, 77) is the corner of (3, 3, 129, 160)'s (what lets every kernel, tile shape
    and packed batch draw the same one)."""
    small = dropout.keep_mask(_state(7), 2, 3, 100, 77, 0.3)
    big = dropout.keep_mask(_state(7), 3, 3, 129, 160, 0.3)
    assert torch.equal(small, big[:2, :, :100, :77])


def test_masks_differ_between_states_heads_and_sequences():
    a = dropout.keep_mask(_state(7), 2, 2, 64, 64, 0.5)
    b = dropout.keep_mask(_state(8), 2, 2, 64, 64, 0.5)
    c = dropout.keep_mask(_state(7, 1), 2, 2, 64, 64, 0.5)
    for other in (b, c):
        assert 0.4 < (a != other).float().mean() < 0.6
    assert 0.4 < (a[0, 0] != a[0, 1]).float().mean() < 0.6
    assert 0.4 < (a[0, 0] != a[1, 0]).float().mean() < 0.6
    # Neighbouring rows and columns are not copies of each other (the 16 x 16 tile layout).
    assert 0.4 < (a[0, 0, :-1] != a[0, 0, 1:]).float().mean() < 0.6
    assert 0.4 < (a[0, 0, :, :-1] != a[0, 0, :, 1:]).float().mean() < 0.6


def test_new_rng_state_follows_manual_seed():
    torch.manual_seed(3)
    first = dropout.new_rng_state("cpu")
    second = dropout.new_rng_state("cpu")
    torch.manual_seed(3)
    assert torch.equal(dropout.new_rng_state("cpu"), first)
    assert not torch.equal(first, second)
    assert first.dtype == torch.int64 and first.shape == (2,)


DROPOUT_CASES = [
    Case(2, 17, 33, 4, 2, 64, "bf16", False, 0, dropout=0.2),
    Case(1, 40, 40, 4, 4, 128, "fp16", True, 80, dropout=0.5),
    Case(2, 33, 9, 2, 1, 40, "bf16", False, 90, dropout=0.1, window=(4, 2)),
    Case(1, 20, 30, 4, 2, 96, "bf16", False, 0, dropout=0.3, softcap=5.0),
]


def _expected(case, q, k, v, dout, seed):
    torch.manual_seed(seed)
    keep = dropout.keep_mask(dropout.new_rng_state("cpu"), case.batch, case.nheads, case.seqlen_q,
                             case.seqlen_k, case.dropout)
    kw = dict(window=case.mask, softcap=case.softcap, dropout_p=case.dropout, keep=keep)
    return reference_outputs(q, k, v, dout, dtype=torch.float64, **kw), reference_outputs(q, k, v, dout, **kw)


@pytest.mark.parametrize("case", DROPOUT_CASES, ids=[c.id for c in DROPOUT_CASES])
def test_dropout_end_to_end_fake(fake_backend, case):
    """Out and gradients equal attention with keep_mask's mask drawn from the generator state the
    call saw: one rng_state, drawn once, reaches the forward and the backward."""
    q, k, v = make_inputs(case, "cpu")
    dout = make_dout(case, "cpu")
    torch.manual_seed(11)
    with cutlass_flash.force_arch(case.arch):
        out, lse = flash_attn_func(q, k, v, dropout_p=case.dropout, causal=case.causal,
                                   window_size=case.window, softcap=case.softcap, return_lse=True)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref, same = _expected(case, q, k, v, dout, 11)
    for name, ours, pt, r in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), same, ref):
        assert_within_tolerance(name, ours, pt, r)
    fwd, bwd = [kw["rng_state"] for _, _, kw in fake_backend.calls[-2:]]
    assert fwd == bwd  # the backward read the forward's (seed, offset)
    # Without the mask the output is far from it (the test can fail).
    plain = reference_outputs(q, k, v, dout, dtype=torch.float64, window=case.mask, softcap=case.softcap)
    assert (out.double() - plain[0]).abs().max() > 10 * (out.double() - ref[0]).abs().max()


def test_dropout_reproducible_under_manual_seed(fake_backend):
    case = DROPOUT_CASES[0]
    q, k, v = make_inputs(case, "cpu")
    outs = []
    for seed in (5, 5, 6):
        torch.manual_seed(seed)
        outs.append(flash_attn_func(q, k, v, dropout_p=0.3))
    assert torch.equal(outs[0], outs[1])
    assert not torch.equal(outs[0], outs[2])


def test_varlen_dropout_fake(fake_backend):
    """A packed batch draws each sequence's corner of the dense mask (flash_attn_varlen_func)."""
    lengths_q, lengths_k, H, D, p = [5, 0, 17], [9, 3, 4], 2, 64, 0.25
    cu_q = torch.tensor([0, *torch.tensor(lengths_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lengths_k).cumsum(0).tolist()], dtype=torch.int32)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(sum(lengths_q), H, D, generator=g).bfloat16()
    k = torch.randn(sum(lengths_k), H, D, generator=g).bfloat16()
    v = torch.randn(sum(lengths_k), H, D, generator=g).bfloat16()
    torch.manual_seed(21)
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), dropout_p=p)
    torch.manual_seed(21)
    keep = dropout.keep_mask(dropout.new_rng_state("cpu"), 3, H, max(lengths_q), max(lengths_k), p)
    for b, (lq, lk) in enumerate(zip(lengths_q, lengths_k)):
        if lq == 0:
            continue
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        keys = slice(int(cu_k[b]), int(cu_k[b + 1]))
        ref = reference_outputs(q[None, rows], k[None, keys], v[None, keys], torch.zeros_like(q[None, rows]),
                                   dtype=torch.float64, dropout_p=p, keep=keep[b:b + 1, :, :lq, :lk])
        assert (out[rows].double() - ref[0]).abs().max() < 2e-2


def test_lowlevel_pair_passes_rng_state(fake_backend):
    case = DROPOUT_CASES[0]
    q, k, v = (t.detach() for t in make_inputs(case, "cpu"))
    dout = make_dout(case, "cpu")
    out, lse, _, rng_state = _flash_attn_forward(q, k, v, 0.2, None, False)
    assert rng_state.shape == (2,) and rng_state.dtype == torch.int64
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    _flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, 0.2, None, False, rng_state=rng_state)
    keep = dropout.keep_mask(rng_state, case.batch, case.nheads, case.seqlen_q, case.seqlen_k, 0.2)
    ref = reference_outputs(q, k, v, dout, dtype=torch.float64, dropout_p=0.2, keep=keep)
    same = reference_outputs(q, k, v, dout, dropout_p=0.2, keep=keep)
    for name, ours, pt, r in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), same[:1] + same[2:],
                                 ref[:1] + ref[2:]):
        assert_within_tolerance(name, ours, pt, r)
    with pytest.raises(ValueError, match="needs the forward's rng_state"):
        _flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, 0.2, None, False)
    bad_states = [
        (rng_state.float(), "int64 tensor of shape \\(2,\\)"),
        (torch.zeros(3, dtype=torch.int64), "int64 tensor of shape \\(2,\\)"),
        (rng_state.to("meta"), "must be on q's device"),
        (torch.zeros(3, dtype=torch.int64)[1:], "16-byte aligned"),
    ]
    for bad, message in bad_states:
        with pytest.raises(ValueError, match=message):
            _flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, 0.2, None, False, rng_state=bad)
    with pytest.raises(TypeError, match="rng_state must be a torch.Tensor"):
        _flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, 0.2, None, False, rng_state=[1, 2])
    _, _, _, empty = _flash_attn_forward(q, k, v, 0.0, None, False)
    assert empty.numel() == 0
