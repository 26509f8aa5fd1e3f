"""Dropout's keep mask, as the kernels draw it (csrc/kernels/common/dropout.h), in torch.

The mask is a pure function of (sequence b, query head h, query row i, key column j) and the
call's rng_state (two int64: seed, offset), so it can be rebuilt outside the kernels: the tests
compare the kernels against attention with this mask, and users can inspect what a call dropped.

    rng_state = cutlass_flash.dropout.new_rng_state(q.device)     # what flash_attn_func draws
    keep = cutlass_flash.dropout.keep_mask(rng_state, batch, nheads, seqlen_q, seqlen_k, 0.1)

With i = 16 I + 8 a + r and j = 32 J + 16 e + 8 c + 2 t + g (a, c, e, g in {0, 1}, r < 8,
t < 4): Philox4x32 (ROUNDS rounds) of counter (J, I, 32 h + 4 r + t, b + offset) under key seed
gives 4 words; score (i, j) takes byte 2 e + c of word 2 g + a and is kept when it is below
round((1 - dropout_p) * 256) (float32 arithmetic, as the kernels); the kept scores are scaled by
256 / that threshold (keep_scale).
"""

import numpy as np
import torch

from ._catalog import DROPOUT_PHILOX_ROUNDS

__all__ = ["new_rng_state", "keep_threshold", "keep_scale", "keep_mask", "philox4x32"]

_M0, _M1 = 0xD2511F53, 0xCD9E8D57  # Philox4x32's multipliers
_W0, _W1 = 0x9E3779B9, 0xBB67AE85  # its key increments (Weyl sequence)
_U32 = 0xFFFFFFFF
ROUNDS = DROPOUT_PHILOX_ROUNDS  # csrc/generate.py's, as the kernels' kPhiloxRounds


def new_rng_state(device):
    """(seed, offset) for one call, int64 on `device`, drawn from torch's generator for that
    device: reproducible under torch.manual_seed, and inside a CUDA graph each replay draws anew
    (the kernels read the values from device memory). torch.randint rather than Tensor.random_:
    torch.compile traces it (fullgraph, and the graph keeps it: random ops are not merged or
    recomputed)."""
    return torch.randint(0, 2**63 - 1, (2,), dtype=torch.int64, device=device)


def check_p(dropout_p):
    """TypeError / ValueError unless dropout_p is a float in [0, 1)."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        raise TypeError(f"dropout_p must be a float in [0, 1), got {type(dropout_p).__name__}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")


def call_args(dropout_p, device):
    """(dropout_p, rng_state) as the ops take them: a fresh (seed, offset) (new_rng_state) when
    dropout_p > 0."""
    dropout_p = float(dropout_p)
    return (dropout_p, new_rng_state(device)) if dropout_p > 0 else (0.0, None)


def check_rng_state(rng_state, dropout_p, device):
    """The (seed, offset) a backward with dropout_p > 0 must be given: the forward's rng_state,
    int64 of shape (2,) on q's device, 16-byte aligned (ignored when dropout_p is 0)."""
    if dropout_p == 0:
        return
    if rng_state is None:
        raise ValueError("dropout_p > 0 needs the forward's rng_state (returned by the forward), got None")
    if not isinstance(rng_state, torch.Tensor):
        raise TypeError(f"rng_state must be a torch.Tensor, got {type(rng_state).__name__}")
    if rng_state.dtype != torch.int64 or tuple(rng_state.shape) != (2,) or not rng_state.is_contiguous():
        raise ValueError(
            f"rng_state must be a contiguous int64 tensor of shape (2,) (seed, offset), got "
            f"{rng_state.dtype} {tuple(rng_state.shape)}"
        )
    if rng_state.device != device:
        raise ValueError(f"rng_state must be on q's device {device}, got {rng_state.device}")
    if rng_state.data_ptr() % 16:
        raise ValueError("rng_state must be 16-byte aligned (pass rng_state.clone())")


def keep_threshold(dropout_p):
    """The byte value below which a score is kept, computed as the kernels do (float32)."""
    keep = np.float32(1.0) - np.float32(dropout_p)
    return int(keep * np.float32(256.0) + np.float32(0.5))


def keep_scale(dropout_p):
    """What the kernels multiply kept probabilities by: 1 / the keep rate drawn (256 / threshold),
    0 when nothing is kept; 1 without dropout."""
    if dropout_p == 0:
        return 1.0
    threshold = keep_threshold(dropout_p)
    return 256.0 / threshold if threshold else 0.0


def _mulhilo(a, m):
    """(hi, lo) 32-bit halves of a * m for int64 tensors of 32-bit values, without int64 overflow."""
    p_lo = (a & 0xFFFF) * m  # < 2^48
    p_hi = (a >> 16) * m
    t = p_lo + ((p_hi & 0xFFFF) << 16)
    return ((p_hi >> 16) + (t >> 32)) & _U32, t & _U32


def philox4x32(c0, c1, c2, c3, k0, k1, rounds=ROUNDS):
    """Philox4x32 (Random123) on int64 tensors (or ints) holding 32-bit counters; key (k0, k1) ints."""
    for i in range(rounds):
        if i:
            k0, k1 = (k0 + _W0) & _U32, (k1 + _W1) & _U32
        hi0, lo0 = _mulhilo(c0, _M0)
        hi1, lo1 = _mulhilo(c2, _M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def keep_mask(rng_state, batch, nheads, seqlen_q, seqlen_k, dropout_p):
    """bool (batch, nheads, seqlen_q, seqlen_k) on rng_state's device: True where the kernels
    keep P. For a packed batch, sequence b's mask is [b, :, :len_q(b), :len_k(b)] of the mask
    of (batch, nheads, max_seqlen_q, max_seqlen_k)."""
    seed, offset = (int(x) for x in rng_state.tolist())
    k0, k1 = seed & _U32, (seed >> 32) & _U32
    dev = rng_state.device

    def axis(n, dim):
        shape = [1] * 6
        shape[dim] = n
        return torch.arange(n, dtype=torch.int64, device=dev).view(shape)

    n_i, n_j = -(-seqlen_q // 16), -(-seqlen_k // 32)
    b, h, I, J, r, t = axis(batch, 0), axis(nheads, 1), axis(n_i, 2), axis(n_j, 3), axis(8, 4), axis(4, 5)
    shape = (batch, nheads, n_i, n_j, 8, 4)
    words = philox4x32(J.expand(shape), I.expand(shape), ((h << 5) | (r << 2) | t).expand(shape),
                       ((b + offset) & _U32).expand(shape), k0, k1)
    w = torch.stack(words, -1).view(*shape, 2, 2)  # (..., g, a): word 2 g + a
    u = torch.stack([(w >> (8 * n)) & 0xFF for n in range(4)], -1).view(*shape, 2, 2, 2, 2)
    # u: (B, H, I, J, r, t, g, a, e, c), byte 2 e + c; i = 16 I + 8 a + r, j = 32 J + 16 e + 8 c + 2 t + g
    u = u.permute(0, 1, 2, 7, 4, 3, 8, 9, 5, 6).reshape(batch, nheads, n_i * 16, n_j * 32)
    return (u < keep_threshold(dropout_p))[:, :, :seqlen_q, :seqlen_k]
