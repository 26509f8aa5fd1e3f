"""cutlass_flash as PyTorch's flash-attention implementation.

Importing cutlass_flash registers the name ``"cutlass_flash"`` with
``torch.nn.attention.register_flash_attention_impl`` (where the installed torch has it) without
activating it; the user opts in::

    torch.nn.attention.activate_flash_attention_impl("cutlass_flash")
    F.scaled_dot_product_attention(q, k, v, is_causal=True)   # the flash backend runs our kernels
    torch.nn.attention.restore_flash_attention_impl()          # PyTorch's own kernels again

Activation registers CUDA kernels for the aten operators behind SDPA's flash backend (as
torch/nn/attention/_fa3.py and _fa4.py do for FlashAttention-3 and -4):
``_scaled_dot_product_flash_attention`` and its backward (dense SDPA, and the ring of
``torch.distributed.tensor.experimental.context_parallel``), ``_flash_attention_forward`` /
``_flash_attention_backward`` (nested / packed batches, ``torch.nn.attention.varlen_attn``), and
``_flash_attention_forward_no_dropout_inplace`` where torch has it. Each runs the same
implementation as ``flash_attn_func`` / ``flash_attn_varlen_func`` (so results are bit-identical to
theirs), in the same kernel family (``cutlass_flash.force_arch`` applies), deterministic under
``torch.use_deterministic_algorithms``. A call our kernels cannot run (``return_debug_mask``, a
paged KV cache, a head dim or dtype this build lacks) goes to the kernel PyTorch had before
activation, which accepts or raises as it would have.
"""

import math

import torch

from . import _dispatch, _ops, _validate, dropout

#: The name under torch.nn.attention's registry.
NAME = "cutlass_flash"


class _Handle:
    """What activation returns to torch's registry: remove() drops our kernels (the previous ones
    come back)."""

    def __init__(self, library):
        self.library = library

    def remove(self):
        if self.library is not None:
            self.library._destroy()
            self.library = None


class _Unsupported(Exception):
    """A call our kernels do not take: the previous kernel runs it."""


def _op(name):
    return getattr(torch.ops.aten, name).default


def _bind(name, args, kwargs):
    """The call's arguments by the operator's schema names (the schemas grow keyword arguments
    from one torch release to the next)."""
    schema = _op(name)._schema
    bound = {a.name: a.default_value if a.has_default_value() else None for a in schema.arguments}
    positional = [a.name for a in schema.arguments if not a.kwarg_only]
    bound.update(zip(positional, args))
    bound.update(kwargs)
    return bound


def _window(a, seqlen_k):
    """(window_left, window_right) as our kernels take them, from is_causal and the aten window
    (None or -1: unbounded)."""
    left = -1 if a.get("window_size_left") is None else int(a["window_size_left"])
    right = -1 if a.get("window_size_right") is None else int(a["window_size_right"])
    return _validate.check_mask(bool(a["is_causal"]), (left, right), max(int(seqlen_k), 1))


def _scale(a, head_dim):
    return 1.0 / math.sqrt(head_dim) if a.get("scale") is None else float(a["scale"])


def _check_common(a, query):
    if a.get("return_debug_mask"):
        raise _Unsupported("return_debug_mask")
    if a.get("block_table") is not None:
        raise _Unsupported("block_table (paged KV cache)")
    if query.dtype not in (torch.float16, torch.bfloat16):
        raise _Unsupported(f"dtype {query.dtype}")
    if query.shape[-1] > 256:
        raise _Unsupported(f"head_dim {query.shape[-1]}")


def _rng_out(rng_state, device):
    """Our (seed, offset) int64 pair as the ops return their Philox state: uint64 (2,) (zeros
    without dropout), and the unused second tensor."""
    state = rng_state.view(torch.uint64) if rng_state is not None else torch.zeros(2, dtype=torch.uint64, device=device)
    return state, torch.zeros((), dtype=torch.uint64, device=device)


def _rng_in(dropout_p, rng_state):
    return rng_state.view(torch.int64) if dropout_p > 0 else None


def _deterministic():
    return torch.are_deterministic_algorithms_enabled()


def _forward(q, k, v, a, out, varlen=None, alibi_slopes=None):
    """(out, lse, rng_state) of our forward on BSHD views (a packed batch: (1, total, H, D) with
    varlen as _ops._fwd_impl takes it), written into `out` (shaped like q)."""
    dropout_p, rng_state = dropout.call_args(a["dropout_p"], q.device)
    seqlen_k = k.shape[1] if varlen is None else varlen[3]
    left, right = _window(a, seqlen_k)
    out, lse = _ops._fwd_impl(q, k, v, _scale(a, q.shape[-1]), left, right, _dispatch.forced_arch(),
                              varlen=varlen, alibi_slopes=alibi_slopes, dropout_p=dropout_p, rng_state=rng_state,
                              out=out)
    return out, lse, rng_state


def _backward(dout, q, k, v, out, lse, a, rng_state, grads, varlen=None):
    """dq, dk, dv of our backward, written into `grads` (shaped like q, k, v)."""
    dropout_p = float(a["dropout_p"])
    seqlen_k = k.shape[1] if varlen is None else varlen[3]
    left, right = _window(a, seqlen_k)
    dq, dk, dv, _ = _ops._bwd_impl(dout, q, k, v, out, lse, _scale(a, q.shape[-1]), left, right,
                                   _dispatch.forced_arch(), _deterministic(), *grads, varlen=varlen,
                                   dropout_p=dropout_p, rng_state=_rng_in(dropout_p, rng_state))
    return dq, dk, dv


def _empty_mask(query):
    return torch.empty(0, dtype=query.dtype, device=query.device)


# The outputs are allocated as PyTorch's meta functions allocate them (empty_like of the inputs),
# so that compiled graphs, which check their strides, see the layouts they were traced with.


def _sdpa_forward(a):
    """_scaled_dot_product_flash_attention: (B, H, S, D) tensors."""
    query, key, value = a["query"], a["key"], a["value"]
    _check_common(a, query)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    output = torch.empty_like(query)
    _, lse, rng_state = _forward(q, k, v, a, output.transpose(1, 2))
    seed, unused = _rng_out(rng_state, query.device)
    return (output, lse, None, None, query.shape[2], key.shape[2], seed, unused, _empty_mask(query))


def _sdpa_backward(a):
    grads = [torch.empty_like(a[n]) for n in ("query", "key", "value")]
    _backward(*(a[n].transpose(1, 2) for n in ("grad_out", "query", "key", "value", "out")), a["logsumexp"],
              a, a["philox_seed"], [g.transpose(1, 2) for g in grads])
    return tuple(grads)


def _varlen(a):
    """_ops' varlen tuple of a packed call (cum_seq_q set), else None; dense seqused_k raises."""
    if a["cum_seq_q"] is None:
        if a.get("seqused_k") is not None:
            raise _Unsupported("seqused_k without cum_seq_q")
        return None
    return (a["cum_seq_q"], a["cum_seq_k"], int(a["max_q"]), int(a["max_k"]), None, a.get("seqused_k"))


def _flash_forward(a):
    """_flash_attention_forward: (B, S, H, D) tensors, or packed (T, H, D) with cum_seq_q/k."""
    query, key, value = a["query"], a["key"], a["value"]
    _check_common(a, query)
    varlen = _varlen(a)
    output = torch.empty_like(query)
    view = (lambda t: t.unsqueeze(0)) if varlen is not None else (lambda t: t)
    _, lse, rng_state = _forward(view(query), view(key), view(value), a, view(output), varlen, a.get("alibi_slopes"))
    seed, unused = _rng_out(rng_state, query.device)
    return output, lse, seed, unused, _empty_mask(query)


def _flash_forward_inplace(a):
    """_flash_attention_forward_no_dropout_inplace: writes `out`, returns the LSE."""
    out, lse, *_ = _flash_forward(a)
    a["out"].copy_(out)
    return lse


def _flash_backward(a):
    varlen = _varlen(a)
    view = (lambda t: t.unsqueeze(0)) if varlen is not None else (lambda t: t)
    grads = [torch.empty_like(a[n]) for n in ("query", "key", "value")]
    _backward(*(view(a[n]) for n in ("grad_out", "query", "key", "value", "out")), a["logsumexp"], a,
              a["rng_state"], [view(g) for g in grads], varlen)
    return tuple(grads)


# The operators we implement: aten name -> our implementation.
_IMPLS = {
    "_scaled_dot_product_flash_attention": _sdpa_forward,
    "_scaled_dot_product_flash_attention_backward": _sdpa_backward,
    "_flash_attention_forward": _flash_forward,
    "_flash_attention_backward": _flash_backward,
    "_flash_attention_forward_no_dropout_inplace": _flash_forward_inplace,
}


def _kernel(name, previous):
    """The CUDA kernel of aten `name`: ours, or `previous` (the kernel before activation, called
    with the dispatch keys) for what ours does not take."""
    impl = _IMPLS[name]

    def kernel(keyset, *args, **kwargs):
        try:
            return impl(_bind(name, args, kwargs))
        except (_Unsupported, NotImplementedError) as e:  # NotImplementedError: a kernel not built
            if previous is None:
                raise RuntimeError(f"cutlass_flash: aten::{name} unsupported here ({e}) and no previous "
                                   f"kernel to run it") from e
            return previous.call_boxed(keyset, *args, **kwargs)

    return kernel


def _previous_kernel(name):
    """The CUDA kernel aten `name` has now (torch.library.get_kernel, torch >= 2.9), or None (a
    CPU-only torch has none)."""
    get_kernel = getattr(torch.library, "get_kernel", None)
    try:
        return get_kernel(_op(name), "CUDA") if get_kernel is not None else None
    except RuntimeError:
        return None


def activate():
    """The registry's register_fn: our kernels for every operator of _IMPLS this torch has."""
    library = torch.library.Library("aten", "IMPL", "CUDA")
    for name in _IMPLS:
        if not hasattr(torch.ops.aten, name):
            continue
        library.impl(name, _kernel(name, _previous_kernel(name)), "CUDA", with_keyset=True)
    return _Handle(library)


def register():
    """Registers NAME with torch's flash-attention registry, where it has one (idempotent); does
    not activate it."""
    reg = getattr(torch.nn.attention, "register_flash_attention_impl", None)
    if reg is not None:
        reg(NAME, register_fn=activate)
    return reg is not None
