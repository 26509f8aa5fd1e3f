"""Reference attention and the accuracy rule shared by the tests.

attention_ref computes plain PyTorch math attention in the dtype of its inputs (FlashAttention's
tests call this ``upcast=False`` when the inputs are fp16/bf16); call it on float64 copies for the
reference. Masks are aligned to the bottom-right corner, as the kernels' are.
"""

import math

import torch

from cutlass_flash.dropout import keep_scale


def window_mask(seqlen_q, seqlen_k, window_left, window_right, device):
    """Bool (seqlen_q, seqlen_k): True where query i may attend key j (bottom-right aligned)."""
    i = torch.arange(seqlen_q, device=device).view(-1, 1)
    j = torch.arange(seqlen_k, device=device).view(1, -1)
    diag = i + (seqlen_k - seqlen_q)
    allowed = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if window_right >= 0:
        allowed &= j <= diag + window_right
    if window_left >= 0:
        allowed &= j >= diag - window_left
    return allowed


def attention_probs(q, k, softmax_scale, window=(-1, -1)):
    """softmax(scale * q @ k^T) over allowed keys, (batch, nheads, seqlen_q, seqlen_k); rows that
    see no key are 0. k has nheads heads (expand GQA first)."""
    scores = torch.einsum("bthd,bshd->bhts", q * softmax_scale, k)
    if window[0] >= 0 or window[1] >= 0:
        allowed = window_mask(q.shape[1], k.shape[1], window[0], window[1], q.device)
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        return probs.masked_fill(~allowed.any(dim=-1).view(-1, 1), 0.0)
    return torch.softmax(scores, dim=-1)


def alibi_bias(slopes, batch, nheads, seqlen_q, seqlen_k, device, dtype):
    """ALiBi as FlashAttention-2: -slope * |i + seqlen_k - seqlen_q - j|, (batch, nheads, sq, sk);
    slopes (nheads,) or (batch, nheads)."""
    slopes = slopes.to(device=device, dtype=dtype).reshape(-1, nheads).expand(batch, nheads)
    i = torch.arange(seqlen_q, device=device).view(-1, 1)
    j = torch.arange(seqlen_k, device=device).view(1, -1)
    dist = (i + seqlen_k - seqlen_q - j).abs().to(dtype)
    return -slopes.view(batch, nheads, 1, 1) * dist


def attention_ref(q, k, v, causal=False, softmax_scale=None, window=(-1, -1), softcap=0.0, alibi_slopes=None,
                  dropout_p=0.0, keep=None, sinks=None):
    """Returns (out, lse) computed in q's dtype. keep: bool (batch, nheads, seqlen_q, seqlen_k),
    dropout's mask (cutlass_flash.dropout.keep_mask): P is multiplied by keep times the scale the
    kernels apply (keep_scale: 1 / the keep rate, 1 / (1 - dropout_p) to 1/256)
    (lse is that of the undropped scores).

    q: (batch, seqlen_q, nheads, d); k, v: (batch, seqlen_k, nheads_kv, d). out: like q.
    lse: (batch, nheads, seqlen_q), +inf for rows that see no key (whose out is 0), as the kernels.
    sinks: (nheads,) attention-sink logits, as gpt-oss's eager attention: a column of the scaled
    scores that joins the softmax and is dropped after it (a row with no key: out 0, lse the sink).
    """
    batch, seqlen_q, nheads, d = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    if nheads != nheads_kv:
        k = k.repeat_interleave(nheads // nheads_kv, dim=2)
        v = v.repeat_interleave(nheads // nheads_kv, dim=2)
    scores = torch.einsum("bthd,bshd->bhts", q * scale, k)
    if softcap > 0:  # Gemma 2: the scaled scores capped at softcap * tanh(x / softcap)
        scores = softcap * torch.tanh(scores / softcap)
    if alibi_slopes is not None:
        scores = scores + alibi_bias(alibi_slopes, batch, nheads, seqlen_q, seqlen_k, q.device, scores.dtype)
    window_left, window_right = (-1, 0) if causal else window
    if window_left >= 0 or window_right >= 0:
        allowed = window_mask(seqlen_q, seqlen_k, window_left, window_right, q.device)
        scores = scores.masked_fill(~allowed, float("-inf"))
        empty_rows = ~allowed.any(dim=-1)  # (seqlen_q,)
    else:
        empty_rows = None
    if sinks is not None:
        column = sinks.to(scores.dtype).view(1, nheads, 1, 1).expand(batch, nheads, seqlen_q, 1)
        scores = torch.cat([scores, column], dim=-1)
        empty_rows = None  # the sink is always there
    lse = torch.logsumexp(scores, dim=-1)
    attn = torch.softmax(scores, dim=-1)
    if sinks is not None:
        attn = attn[..., :-1]
    if empty_rows is not None:  # (no data-dependent branch: keeps CUDA graph capture working)
        attn = attn.masked_fill(empty_rows.view(-1, 1), 0.0)
        lse = lse.masked_fill(empty_rows, float("inf"))
    if keep is not None:
        attn = attn * keep.to(attn.dtype) * keep_scale(dropout_p)
    out = torch.einsum("bhts,bshd->bthd", attn, v)
    return out, lse


def reference_outputs(q, k, v, dout, causal=False, softmax_scale=None, dtype=None, window=(-1, -1),
                      softcap=0.0, alibi_slopes=None, dropout_p=0.0, keep=None, sinks=None):
    """(out, lse, dq, dk, dv) of attention_ref on detached copies of q, k, v cast to ``dtype``
    (default: their own), with gradients for ``dout``; with ``sinks``, dsinks after them (the sinks
    in float32, as the kernels read them, then cast). ``window``: (left, right) as the kernels
    take it (causal=True overrides it with (-1, 0))."""
    dtype = q.dtype if dtype is None else dtype
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    if sinks is not None:
        leaves.append(sinks.detach().float().to(dtype).requires_grad_())
    out, lse = attention_ref(*leaves[:3], causal=causal, softmax_scale=softmax_scale, window=window,
                             softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p, keep=keep,
                             sinks=leaves[3] if sinks is not None else None)
    grads = torch.autograd.grad(out, leaves, dout.to(dtype))
    return (out.detach(), lse.detach()) + tuple(grads)


# The slack of the rule. Gradients get more: with seqlen_k = 1 the softmax is constant, the exact
# dK is 0 and PyTorch's same-dtype path returns exactly 0, while dS = P * (dP - D) is a difference
# of two fp32 dot products of length head_dim accumulated in different orders; that cancellation
# noise, summed over the seqlen_q * group rows of a key, measured 1.19e-5 at 239 * 4 rows (H200,
# bf16, d = 128) and 1.1e-4 to 1.6e-4 at 4097 * 4 rows (fp16, d = 192-256). Sums of rounding
# errors of random sign grow like the square root of their count, so the gradients' slack is
# 1e-4 at up to 1024 rows of d = 128 and grows as sqrt(rows * head_dim) beyond (`slack`).
# Typical bf16 gradient errors are ~1e-2, far above it, where the rule's main term decides.
# dsinks sums a term per query row of each head (common/bwd_preprocess.h): the gradients' slack.
SLACK = {"out": 1e-5, "lse": 1e-5, "dq": 1e-4, "dk": 1e-4, "dv": 1e-4, "dsinks": 1e-4}


def slack(name, rows_per_key, head_dim):
    """SLACK[name], scaled for gradients summed over more than 1024 rows of head_dim 128."""
    if name not in ("dq", "dk", "dv", "dsinks"):
        return SLACK[name]
    return SLACK[name] * max(1.0, (rows_per_key * head_dim / (1024 * 128)) ** 0.5)


def max_abs_err(a, b):
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def assert_within_tolerance(name, ours, torch_same_dtype, ref, slack=1e-5):
    """The accuracy rule: max|ours - ref| <= 2 * max|torch_same_dtype - ref| + slack.

    ``ref`` is the float64 reference, ``torch_same_dtype`` plain PyTorch attention in the input
    dtype. Non-finite reference entries (lse = +inf for rows that see no key) must be matched
    exactly and are left out of the maxima; NaN in ``ours`` always fails.
    """
    assert ours.shape == ref.shape, f"{name}: shape {tuple(ours.shape)} != {tuple(ref.shape)}"
    ours64, same64, ref64 = ours.double(), torch_same_dtype.double(), ref.double()
    n_nan = int(torch.isnan(ours64).sum())
    assert n_nan == 0, f"{name}: {n_nan} NaN values (unwritten or invalid output)"
    finite = torch.isfinite(ref64)
    if not bool(finite.all()):
        mismatch = int((ours64[~finite] != ref64[~finite]).sum())
        assert mismatch == 0, f"{name}: {mismatch} entries differ where the reference is +-inf"
    n_inf = int((~torch.isfinite(ours64[finite])).sum())
    assert n_inf == 0, f"{name}: {n_inf} non-finite values where the reference is finite"
    err = max_abs_err(ours64[finite], ref64[finite])
    base = max_abs_err(same64[finite], ref64[finite])
    bound = 2 * base + slack
    assert err <= bound, (
        f"{name}: max|ours - ref| = {err:.4g} > 2 * max|torch_{ours.dtype} - ref| + {slack:g} "
        f"= 2 * {base:.4g} + {slack:g} = {bound:.4g}"
    )
