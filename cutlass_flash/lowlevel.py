"""FlashAttention-2's low-level pair, for libraries that build on it (ring attention, other
context-parallel schemes): the forward returns out and the log-sum-exp, the backward takes them
(possibly computed elsewhere, e.g. merged over several key blocks) and writes dq / dk / dv into
buffers the caller passes. Same names, argument order and results as `flash_attn.flash_attn_interface`
(flash-attn 2.6+):

    from cutlass_flash.lowlevel import _flash_attn_forward, _flash_attn_backward
    out, lse, _, _ = _flash_attn_forward(q, k, v, 0.0, scale, True, -1, -1, 0.0, None, False)
    _flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, 0.0, scale, True, -1, -1, 0.0,
                         None, False)

No autograd: these run the kernels directly (eager; torch.compile sees them as opaque calls). The
variable-length twins come with variable-length batches.
"""

import torch

from . import _dispatch, _ops, _validate

__all__ = ["_flash_attn_forward", "_flash_attn_backward"]


def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left=-1,
                        window_size_right=-1, softcap=0.0, alibi_slopes=None, return_softmax=False):
    """(out, softmax_lse, S_dmask, rng_state), as FlashAttention-2's.

    out: like q; softmax_lse: float32 (batch, nheads, seqlen_q), +inf for rows that see no key;
    S_dmask: an empty tensor (return_softmax=True is not supported); rng_state: an empty int64
    tensor (no dropout). softmax_scale None: 1/sqrt(head_dim).
    """
    scale, left, right = _validate.check_call(q, k, v, dropout_p, softmax_scale, causal,
                                              (window_size_left, window_size_right), softcap,
                                              alibi_slopes, False)
    if return_softmax:
        raise NotImplementedError("cutlass_flash: return_softmax=True is not supported")
    out, lse = _ops._fwd_impl(q.detach(), k.detach(), v.detach(), scale, left, right,
                              _dispatch._forced_arch, softcap=float(softcap))
    return out, lse, q.new_empty((0,)), torch.empty((0,), dtype=torch.int64, device=q.device)


def _check_grad_buffer(name, buf, like):
    if buf is None:
        return
    if not isinstance(buf, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(buf).__name__}")
    if buf.shape != like.shape or buf.dtype != like.dtype or buf.device != like.device:
        raise ValueError(
            f"{name} must have the shape, dtype and device of its input: expected "
            f"{tuple(like.shape)} {like.dtype} on {like.device}, got {tuple(buf.shape)} {buf.dtype} "
            f"on {buf.device}"
        )


def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale,
                         causal, window_size_left=-1, window_size_right=-1, softcap=0.0,
                         alibi_slopes=None, deterministic=False, rng_state=None):
    """Writes the gradients of attention(q, k, v) for dout into dq, dk, dv (new tensors where
    None) and returns softmax_d = rowsum(dout * out), float32 (batch, nheads, seqlen_q rounded up
    to 128), as FlashAttention-2's. out and softmax_lse are taken as given (they need not come
    from _flash_attn_forward on these k, v: ring attention passes the merged ones).
    """
    scale, left, right = _validate.check_call(q, k, v, dropout_p, softmax_scale, causal,
                                              (window_size_left, window_size_right), softcap,
                                              alibi_slopes, deterministic)
    for name, t in (("dout", dout), ("out", out)):
        if not isinstance(t, torch.Tensor) or t.shape != q.shape or t.dtype != q.dtype:
            raise ValueError(f"{name} must be a tensor like q ({tuple(q.shape)} {q.dtype})")
    for name, buf, like in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        _check_grad_buffer(name, buf, like)
    dq, dk, dv = _ops._bwd_impl(dout.detach(), q.detach(), k.detach(), v.detach(), out.detach(),
                                softmax_lse, scale, left, right, _dispatch._forced_arch,
                                deterministic, dq, dk, dv, softcap=float(softcap))
    batch, seqlen_q, nheads, _ = q.shape
    rounded = -(-seqlen_q // 128) * 128
    softmax_d = torch.zeros((batch, nheads, rounded), dtype=torch.float32, device=q.device)
    softmax_d[..., :seqlen_q] = (dout.float() * out.float()).sum(-1).transpose(1, 2)
    return softmax_d
