"""FlashAttention-2's low-level pair, for libraries that build on it (ring attention, other
context-parallel schemes): the forward returns out and the log-sum-exp, the backward takes them
(possibly computed elsewhere, e.g. merged over several key blocks) and writes dq / dk / dv into
buffers the caller passes. Same names, argument order and results as `flash_attn.flash_attn_interface`
(flash-attn 2.6+):

    from cutlass_flash.lowlevel import _flash_attn_forward, _flash_attn_backward
    out, lse, _, _ = _flash_attn_forward(q, k, v, 0.0, scale, True, -1, -1, 0.0, None, False)
    _flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, 0.0, scale, True, -1, -1, 0.0,
                         None, False)

and their variable-length twins `_flash_attn_varlen_forward` / `_flash_attn_varlen_backward`
(cu_seqlens_q may differ from cu_seqlens_k). No autograd. Eager calls run the kernels directly;
under torch.compile (or any tracing) they go through custom ops of the same names
(torch.ops.cutlass_flash._flash_attn_forward, ...; the backwards mutate dq, dk, dv), as
flash-attn >= 2.7 registers its own, so a compiled ring-attention step traces them.
"""

from typing import Optional

import torch

from . import _dispatch, _ops, _validate, dropout

_Tensor = torch.Tensor

__all__ = ["_flash_attn_forward", "_flash_attn_backward", "_flash_attn_varlen_forward",
           "_flash_attn_varlen_backward"]

# FlashAttention-2 returns softmax_d with its rows padded: to a multiple of this per (batch, head)
# when dense, and by this many rows per sequence when packed.
_SOFTMAX_D_PAD = 128


def _eager_flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left=-1,
                        window_size_right=-1, softcap=0.0, alibi_slopes=None, return_softmax=False):
    """(out, softmax_lse, S_dmask, rng_state), as FlashAttention-2's.

    out: like q; softmax_lse: float32 (batch, nheads, seqlen_q), +inf for rows that see no key;
    S_dmask: an empty tensor (return_softmax=True is not supported; cutlass_flash.dropout.keep_mask
    rebuilds the dropout mask); rng_state: int64 (seed, offset) of the dropout mask, for the
    backward (an empty tensor when dropout_p is 0). softmax_scale None: 1/sqrt(head_dim).
    """
    scale, left, right = _validate.check_call(q, k, v, softmax_scale, causal, (window_size_left, window_size_right),
                                              softcap, alibi_slopes, False)
    dropout.check_p(dropout_p)
    if return_softmax:
        raise NotImplementedError("cutlass_flash: return_softmax=True is not supported")
    dropout_p, rng_state = dropout.call_args(dropout_p, q.device)
    out, lse = _ops._fwd_impl(q.detach(), k.detach(), v.detach(), scale, left, right,
                              _dispatch.forced_arch(), softcap=float(softcap), alibi_slopes=alibi_slopes,
                              dropout_p=dropout_p, rng_state=rng_state)
    return out, lse, q.new_empty((0,)), _rng_state_out(rng_state, q.device)


def _rng_state_out(rng_state, device):
    return torch.empty((0,), dtype=torch.int64, device=device) if rng_state is None else rng_state


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


def _check_backward_args(q, k, v, dout, out, dq, dk, dv, dropout_p, rng_state):
    """What both backwards take beyond the forward's arguments: dout and out like q, the gradient
    buffers (or None), and the forward's rng_state when dropout_p > 0."""
    dropout.check_p(dropout_p)
    dropout.check_rng_state(rng_state, dropout_p, q.device)
    for name, t in (("dout", dout), ("out", out)):
        if not isinstance(t, torch.Tensor) or t.shape != q.shape or t.dtype != q.dtype:
            raise ValueError(f"{name} must be a tensor like q ({tuple(q.shape)} {q.dtype})")
    for name, buf, like in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        _check_grad_buffer(name, buf, like)


def _eager_flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale,
                         causal, window_size_left=-1, window_size_right=-1, softcap=0.0,
                         alibi_slopes=None, deterministic=False, rng_state=None):
    """Writes the gradients of attention(q, k, v) for dout into dq, dk, dv (new tensors where
    None) and returns softmax_d = rowsum(dout * out), float32 (batch, nheads, seqlen_q rounded up
    to 128), as FlashAttention-2's. out and softmax_lse are taken as given (they need not come
    from _flash_attn_forward on these k, v: ring attention passes the merged ones). dropout_p > 0
    needs the forward's rng_state.
    """
    scale, left, right = _validate.check_call(q, k, v, softmax_scale, causal, (window_size_left, window_size_right),
                                              softcap, alibi_slopes, deterministic)
    _check_backward_args(q, k, v, dout, out, dq, dk, dv, dropout_p, rng_state)
    dq, dk, dv, _ = _ops._bwd_impl(dout.detach(), q.detach(), k.detach(), v.detach(), out.detach(),
                                   softmax_lse, scale, left, right, _dispatch.forced_arch(),
                                   deterministic, dq, dk, dv, softcap=float(softcap),
                                   alibi_slopes=alibi_slopes, dropout_p=float(dropout_p),
                                   rng_state=rng_state if dropout_p > 0 else None)
    batch, seqlen_q, nheads, _ = q.shape
    rounded = -(-seqlen_q // _SOFTMAX_D_PAD) * _SOFTMAX_D_PAD
    softmax_d = torch.zeros((batch, nheads, rounded), dtype=torch.float32, device=q.device)
    softmax_d[..., :seqlen_q] = (dout.float() * out.float()).sum(-1).transpose(1, 2)
    return softmax_d


def _unsupported_varlen(block_table=None, leftpad_k=None):
    for name, value in (("block_table", block_table), ("leftpad_k", leftpad_k)):
        if value is not None:
            raise NotImplementedError(f"cutlass_flash: {name} is not supported yet (pass None)")


def _eager_flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               dropout_p, softmax_scale, causal, window_size_left=-1,
                               window_size_right=-1, softcap=0.0, alibi_slopes=None,
                               return_softmax=False, block_table=None, leftpad_k=None,
                               seqused_k=None, zero_tensors=False):
    """(out, softmax_lse, S_dmask, rng_state) of a packed batch, as FlashAttention-2's: q
    (total_q, nheads, d), k / v (total_k, nheads_kv, d), out like q, softmax_lse float32
    (nheads, total_q). seqused_k: None or int32 (batch,), sequence b's keys are the first
    seqused_k[b] rows of its slot (flash_attn_varlen_func's). zero_tensors is accepted and ignored
    (as in FlashAttention-2's kernels)."""
    scale, left, right, max_q, max_k = _validate.check_varlen_call(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
        (window_size_left, window_size_right), softcap, alibi_slopes, False, seqused_k=seqused_k)
    dropout.check_p(dropout_p)
    _unsupported_varlen(block_table, leftpad_k)
    if return_softmax:
        raise NotImplementedError("cutlass_flash: return_softmax=True is not supported")
    dropout_p, rng_state = dropout.call_args(dropout_p, q.device)
    out, lse = _ops._forward(q.detach(), k.detach(), v.detach(), scale, left, right, _dispatch.forced_arch(),
                             softcap=float(softcap), alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                             rng_state=rng_state, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                             max_seqlen_q=max_q, max_seqlen_k=max_k, seqused_k=seqused_k)
    return out, lse, q.new_empty((0,)), _rng_state_out(rng_state, q.device)


def _eager_flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q,
                                cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                                causal, window_size_left=-1, window_size_right=-1, softcap=0.0,
                                alibi_slopes=None, deterministic=False, rng_state=None,
                                zero_tensors=False, seqused_k=None):
    """Writes the gradients of a packed batch into dq, dk, dv (new tensors where None) and returns
    softmax_d, float32 (nheads, total_q + 128 * batch) with sequence b's rows from
    cu_seqlens_q[b] + 128 * b, as FlashAttention-2's. out and softmax_lse are taken as given.
    seqused_k (not in FlashAttention-2's backward): the forward's, so that the gradients are of
    the keys it used (dk, dv 0 in the other rows of each slot)."""
    scale, left, right, max_q, max_k = _validate.check_varlen_call(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
        (window_size_left, window_size_right), softcap, alibi_slopes, deterministic, seqused_k=seqused_k)
    _check_backward_args(q, k, v, dout, out, dq, dk, dv, dropout_p, rng_state)
    _ops._backward(dout.detach(), q.detach(), k.detach(), v.detach(), out.detach(), softmax_lse, scale, left, right,
                   _dispatch.forced_arch(), deterministic, dq=dq, dk=dk, dv=dv, softcap=float(softcap),
                   alibi_slopes=alibi_slopes, dropout_p=float(dropout_p),
                   rng_state=rng_state if dropout_p > 0 else None, cu_seqlens_q=cu_seqlens_q,
                   cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_q, max_seqlen_k=max_k, seqused_k=seqused_k)
    total_q, nheads, _ = q.shape
    batch = cu_seqlens_q.shape[0] - 1
    rows = torch.arange(total_q, device=q.device)
    # Each row's sequence without a synchronisation: the number of sequence ends at or before it.
    seq = torch.searchsorted(cu_seqlens_q[1:].to(torch.int64), rows, right=True)
    softmax_d = torch.zeros((nheads, total_q + _SOFTMAX_D_PAD * batch), dtype=torch.float32, device=q.device)
    softmax_d[:, rows + _SOFTMAX_D_PAD * seq] = (dout.float() * out.float()).sum(-1).t()
    return softmax_d



# -- The custom ops (what tracing sees) and the public functions -------------------------------


def _rng_state_like(dropout_p, device):
    return torch.empty((2,) if dropout_p > 0 else (0,), dtype=torch.int64, device=device)


@torch.library.custom_op("cutlass_flash::_flash_attn_forward", mutates_args=())
def _forward_op(q: _Tensor, k: _Tensor, v: _Tensor, dropout_p: float, softmax_scale: Optional[float],
                causal: bool, window_size_left: int = -1, window_size_right: int = -1, softcap: float = 0.0,
                alibi_slopes: Optional[_Tensor] = None, return_softmax: bool = False
                ) -> tuple[_Tensor, _Tensor, _Tensor, _Tensor]:
    return _eager_flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left,
                                     window_size_right, softcap, alibi_slopes, return_softmax)


@_forward_op.register_fake
def _(q, k, v, dropout_p, softmax_scale, causal, window_size_left=-1, window_size_right=-1, softcap=0.0,
      alibi_slopes=None, return_softmax=False):
    batch, seqlen_q, nheads, _ = q.shape
    return (q.new_empty(q.shape), q.new_empty((batch, nheads, seqlen_q), dtype=torch.float32),
            q.new_empty((0,)), _rng_state_like(dropout_p, q.device))


@torch.library.custom_op("cutlass_flash::_flash_attn_backward", mutates_args=("dq", "dk", "dv"))
def _backward_op(dout: _Tensor, q: _Tensor, k: _Tensor, v: _Tensor, out: _Tensor, softmax_lse: _Tensor,
                 dq: Optional[_Tensor], dk: Optional[_Tensor], dv: Optional[_Tensor], dropout_p: float,
                 softmax_scale: Optional[float], causal: bool, window_size_left: int = -1,
                 window_size_right: int = -1, softcap: float = 0.0, alibi_slopes: Optional[_Tensor] = None,
                 deterministic: bool = False, rng_state: Optional[_Tensor] = None) -> _Tensor:
    return _eager_flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale,
                                      causal, window_size_left, window_size_right, softcap, alibi_slopes,
                                      deterministic, rng_state)


@_backward_op.register_fake
def _(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, window_size_left=-1,
      window_size_right=-1, softcap=0.0, alibi_slopes=None, deterministic=False, rng_state=None):
    batch, seqlen_q, nheads, _ = q.shape
    rounded = -(-seqlen_q // _SOFTMAX_D_PAD) * _SOFTMAX_D_PAD
    return q.new_empty((batch, nheads, rounded), dtype=torch.float32)


@torch.library.custom_op("cutlass_flash::_flash_attn_varlen_forward", mutates_args=())
def _varlen_forward_op(q: _Tensor, k: _Tensor, v: _Tensor, cu_seqlens_q: _Tensor, cu_seqlens_k: _Tensor,
                       max_seqlen_q: int, max_seqlen_k: int, dropout_p: float, softmax_scale: Optional[float],
                       causal: bool, window_size_left: int = -1, window_size_right: int = -1,
                       softcap: float = 0.0, alibi_slopes: Optional[_Tensor] = None,
                       return_softmax: bool = False, block_table: Optional[_Tensor] = None,
                       leftpad_k: Optional[_Tensor] = None, seqused_k: Optional[_Tensor] = None,
                       zero_tensors: bool = False) -> tuple[_Tensor, _Tensor, _Tensor, _Tensor]:
    return _eager_flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                            dropout_p, softmax_scale, causal, window_size_left,
                                            window_size_right, softcap, alibi_slopes, return_softmax,
                                            block_table, leftpad_k, seqused_k, zero_tensors)


@_varlen_forward_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
      window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None, return_softmax=False,
      block_table=None, leftpad_k=None, seqused_k=None, zero_tensors=False):
    total_q, nheads, _ = q.shape
    return (q.new_empty(q.shape), q.new_empty((nheads, total_q), dtype=torch.float32), q.new_empty((0,)),
            _rng_state_like(dropout_p, q.device))


@torch.library.custom_op("cutlass_flash::_flash_attn_varlen_backward", mutates_args=("dq", "dk", "dv"))
def _varlen_backward_op(dout: _Tensor, q: _Tensor, k: _Tensor, v: _Tensor, out: _Tensor, softmax_lse: _Tensor,
                        dq: Optional[_Tensor], dk: Optional[_Tensor], dv: Optional[_Tensor],
                        cu_seqlens_q: _Tensor, cu_seqlens_k: _Tensor, max_seqlen_q: int, max_seqlen_k: int,
                        dropout_p: float, softmax_scale: Optional[float], causal: bool,
                        window_size_left: int = -1, window_size_right: int = -1, softcap: float = 0.0,
                        alibi_slopes: Optional[_Tensor] = None, deterministic: bool = False,
                        rng_state: Optional[_Tensor] = None, zero_tensors: bool = False,
                        seqused_k: Optional[_Tensor] = None) -> _Tensor:
    return _eager_flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q,
                                             cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                             softmax_scale, causal, window_size_left, window_size_right,
                                             softcap, alibi_slopes, deterministic, rng_state, zero_tensors,
                                             seqused_k)


@_varlen_backward_op.register_fake
def _(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
      dropout_p, softmax_scale, causal, window_size_left=-1, window_size_right=-1, softcap=0.0,
      alibi_slopes=None, deterministic=False, rng_state=None, zero_tensors=False, seqused_k=None):
    total_q, nheads, _ = q.shape
    batch = cu_seqlens_q.shape[0] - 1
    return q.new_empty((nheads, total_q + _SOFTMAX_D_PAD * batch), dtype=torch.float32)


def _traced(q, k, v):
    return not _ops._plain_eager(q, k, v)


def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left=-1,
                        window_size_right=-1, softcap=0.0, alibi_slopes=None, return_softmax=False):
    run = _forward_op if _traced(q, k, v) else _eager_flash_attn_forward
    return run(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap,
               alibi_slopes, return_softmax)


def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale,
                         causal, window_size_left=-1, window_size_right=-1, softcap=0.0,
                         alibi_slopes=None, deterministic=False, rng_state=None):
    run = _backward_op if _traced(q, k, v) else _eager_flash_attn_backward
    return run(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
               window_size_left, window_size_right, softcap, alibi_slopes, deterministic, rng_state)


def _flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               dropout_p, softmax_scale, causal, window_size_left=-1,
                               window_size_right=-1, softcap=0.0, alibi_slopes=None,
                               return_softmax=False, block_table=None, leftpad_k=None,
                               seqused_k=None, zero_tensors=False):
    run = _varlen_forward_op if _traced(q, k, v) else _eager_flash_attn_varlen_forward
    return run(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
               causal, window_size_left, window_size_right, softcap, alibi_slopes, return_softmax,
               block_table, leftpad_k, seqused_k, zero_tensors)


def _flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q,
                                cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                                causal, window_size_left=-1, window_size_right=-1, softcap=0.0,
                                alibi_slopes=None, deterministic=False, rng_state=None,
                                zero_tensors=False, seqused_k=None):
    run = _varlen_backward_op if _traced(q, k, v) else _eager_flash_attn_varlen_backward
    return run(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
               max_seqlen_k, dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap,
               alibi_slopes, deterministic, rng_state, zero_tensors, seqused_k)


for _public, _eager in ((_flash_attn_forward, _eager_flash_attn_forward),
                        (_flash_attn_backward, _eager_flash_attn_backward),
                        (_flash_attn_varlen_forward, _eager_flash_attn_varlen_forward),
                        (_flash_attn_varlen_backward, _eager_flash_attn_varlen_backward)):
    _public.__doc__ = _eager.__doc__
del _public, _eager
