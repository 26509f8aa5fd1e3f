"""The PyTorch operators (torch.library custom ops) and the public flash_attn_func.

One op per direction (visible to torch.compile as single nodes, with fake and autograd
implementations), dense or packed by whether cu_seqlens are given:

  cutlass_flash::fwd(q, k, v, softmax_scale, window_left, window_right, arch, deterministic,
                     softcap=0.0, alibi_slopes=None, dropout_p=0.0, rng_state=None, sinks=None,
                     cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0,
                     seqused_q=None, seqused_k=None) -> (out, lse)
  cutlass_flash::bwd(dout, q, k, v, out, lse, softmax_scale, window_left, window_right, arch,
                     deterministic, <the same optional arguments>) -> (dq, dk, dv, dsinks)

q: (batch, seqlen_q, nheads, head_dim); k, v: (batch, seqlen_k, nheads_kv, head_dim); last dim
contiguous. out: like q (contiguous); lse: float32 (batch, nheads, seqlen_q), natural log, +inf for
rows that see no key. dq, dk, dv: contiguous, shaped like q, k, v (the kernels sum the dK/dV of a
GQA group). The window is relative to the bottom-right-aligned diagonal: (-1, -1) no mask, (-1, 0)
causal. softcap > 0: the scaled scores x become softcap * tanh(x / softcap) (Gemma 2); lse is
that of the capped scores. dropout_p > 0: P is dropped with that probability under the mask
rng_state (int64 (seed, offset) on q's device, cutlass_flash.dropout) draws, the same in both
directions. sinks: None, or (nheads,) attention-sink logits (gpt-oss) that join every row's softmax
denominator; dsinks is their gradient, float32 (an empty tensor without sinks). arch: kernel
family, 0 = auto. deterministic: the backward accumulates dQ in a fixed order (the forward only
carries it to its autograd context).

With cu_seqlens (int32, batch + 1), q, k, v, out, dout are packed (total, nheads, head_dim)
tensors, sequence b the rows [cu_seqlens[b], cu_seqlens[b + 1]); max_seqlen_q / max_seqlen_k (the
longest lengths) are then needed; lse is (nheads, total_q); seqused (int32, batch):
FlashAttention-3's rows in use of each slot.

Head dims that are not instantiated run on the next instantiated kernels: the families that take
narrower tensors read them in place (NARROW_HEAD_DIM), the others get zero-padded copies here and
the results are sliced back.

flash_attn_func runs the ops' implementations directly when nothing traces the call (plain
tensors, no dispatch mode, not compiling), with the same autograd as an autograd.Function: the op
dispatch costs more per call than the kernel launch itself. Under torch.compile, make_fx or
FakeTensorMode it calls the ops.
"""

from typing import NamedTuple

import torch
import torch.nn.functional as F

from . import _dispatch, _validate, dropout
from ._catalog import HEAD_DIMS_V, NARROW_HEAD_DIM


def _ref4(t):
    s = t.stride()
    return (t.data_ptr(), s[0], s[1], s[2])


def _problem(q, k, head_dim, softmax_scale, window_left, window_right, dtype_name, softcap=0.0,
             varlen=None, alibi_slopes=None, dropout_p=0.0, rng_state=None, sinks=None):
    """The binding's problem arguments; head_dim: the kernels' (instantiated) width, q's own the
    columns in memory (head_dim_real when narrower)."""
    batch, seqlen_q, nheads, cols = q.shape
    problem = dict(
        batch=batch,
        seqlen_q=seqlen_q,
        seqlen_k=k.shape[1],
        nheads=nheads,
        nheads_kv=k.shape[2],
        head_dim=head_dim,
        softmax_scale=softmax_scale,
        window_left=window_left,
        window_right=window_right,
        softcap=softcap,
        dtype=dtype_name,
    )
    if cols != head_dim:
        problem["head_dim_real"] = cols
    if alibi_slopes is not None:  # (nheads,) or (batch, nheads): one slope per head, or per both
        problem.update(alibi_slopes=alibi_slopes.data_ptr(),
                       alibi_batch_stride=alibi_slopes.stride(0) if alibi_slopes.dim() == 2 else 0)
    if dropout_p > 0:
        problem.update(dropout_p=dropout_p, rng_state=rng_state.data_ptr())
    if sinks is not None:  # float32 (nheads,), _kernel_sinks
        problem["sinks"] = sinks.data_ptr()
    if varlen is not None:  # q, k: (1, total, nheads, head_dim) views of the packed tensors
        cu_q, cu_k, max_q, max_k, used_q, used_k = varlen
        problem.update(batch=cu_q.shape[0] - 1, seqlen_q=max_q, seqlen_k=max_k,
                       cu_seqlens_q=cu_q.data_ptr(), cu_seqlens_k=cu_k.data_ptr(),
                       total_q=seqlen_q, total_k=k.shape[1])
        for name, used in (("seqused_q", used_q), ("seqused_k", used_k)):
            if used is not None:
                problem[name] = used.data_ptr()
    return problem


def _lse_shape(q, varlen):
    """FlashAttention-2's LSE layouts: (batch, nheads, seqlen_q), or (nheads, total_q) for a
    variable-length batch (q then the (1, total_q, nheads, head_dim) view)."""
    batch, seqlen_q, nheads, _ = q.shape
    return (nheads, seqlen_q) if varlen is not None else (batch, nheads, seqlen_q)


def _no_work(varlen):
    """A variable-length batch whose longest sequence of queries or keys is empty: no kernel
    runs (out = 0, lse = +inf, zero gradients, as for rows that see no key)."""
    return varlen is not None and (varlen[2] == 0 or varlen[3] == 0)


def _head_pad(arch, direction, head_dim, padded):
    """Zero columns to append to q, k, v (a copy) for the kernels of ``arch`` at tile width
    ``padded``: those that take narrower tensors (the generator's NARROW_HEAD_DIM; they fill the
    tile's other columns on chip) need rows of whole 16-byte vectors only, a multiple of 8
    columns; the others the tile's width."""
    if direction in NARROW_HEAD_DIM.get(arch, ()):
        return -head_dim % 8
    return padded - head_dim


def _kernel_input(t, pad):
    """``t`` as the kernels read it: zero-padded to a multiple of 8 columns (a new tensor), or a
    contiguous copy when its layout is one the kernels cannot read (a broadcast stride 0 from
    expand(), a non-contiguous last dim, rows not 16-byte aligned), else ``t`` itself."""
    if pad:
        return F.pad(t, (0, pad))
    return t if _validate.is_kernel_layout(t) else t.clone(memory_format=torch.contiguous_format)


def _kernel_query(q, softmax_scale):
    """(q, scale) with a positive scale, the kernels' softmax assumes one (it takes the row
    maximum of the unscaled scores): a negative scale runs as -q with |scale| (the same scores,
    exactly), 0 as q = 0 with scale 1 (every score 0: uniform weights, plus the ALiBi bias, which
    the kernels divide by the scale). The backward then negates dq, or zeroes it."""
    if softmax_scale > 0:
        return q, softmax_scale
    if softmax_scale < 0:
        return -q, -softmax_scale
    return torch.zeros_like(q), 1.0


class Plan(NamedTuple):
    """What a call runs (plan()): the kernel family, the head dim of its kernels, the zero columns
    appended to q and k for them (0: read in place), the dtype's name, the zero columns appended to
    v (pad again, unless v's head dim differs from q's: the kernels run at the larger of the two,
    the other zero-padded), and the kernels' head dim of v and out (head_dim, unless a kernel has
    v's as its own: the generator's HEAD_DIMS_V, MLA's (192, 128) forward on sm90)."""
    arch: int
    head_dim: int
    pad: int
    dtype: str
    pad_v: int
    head_dim_v: int


def plan(q, k, direction="fwd", *, v=None, softcap=0.0, alibi_slopes=None, cu_seqlens_q=None, cu_seqlens_k=None,
         max_seqlen_q=None, max_seqlen_k=None):
    """The kernels a call of flash_attn_func (or, with cu_seqlens, flash_attn_varlen_func) on q, k
    runs for ``direction`` ("fwd" or "bwd"), as a Plan, or the error that call would raise: the
    family (cutlass_flash.force_arch's or automatic), the head dim of its kernels (the next
    instantiated one; softcap with ALiBi may move it up), the zero columns added to q, k, v for
    them, and every check that depends on these. Nothing runs on the GPU. v: where its head dim
    differs from q's (None: the same).

        cutlass_flash.plan(q, k)   # Plan(arch=90, head_dim=128, pad=0, dtype='bf16', pad_v=0, head_dim_v=128)
        cutlass_flash.plan(q, k, "bwd", softcap=30.0, alibi_slopes=slopes)  # or NotImplementedError
    """
    if direction not in ("fwd", "bwd"):
        raise ValueError(f"direction must be 'fwd' or 'bwd', got {direction!r}")
    varlen = None
    if cu_seqlens_q is not None or cu_seqlens_k is not None:
        q, k = q.unsqueeze(0), k.unsqueeze(0)
        varlen = (cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), None, None)
    head_dim_v = q.shape[-1] if v is None else v.shape[-1]
    _validate.check_head_dim_v(head_dim_v)
    return _plan(direction, q, k, _dispatch.forced_arch(), softcap, alibi_slopes, varlen, head_dim_v)


def _plan(direction, q, k, arch=0, softcap=0.0, alibi_slopes=None, varlen=None, head_dim_v=None):
    """plan() on the ops' arguments: q (batch, seqlen_q, nheads, head_dim), a packed batch's
    (1, total_q, ...) view with ``varlen`` as _fwd_impl takes it; ``arch`` 0: automatic;
    head_dim_v: v's (None: q's)."""
    head_dim_qk = q.shape[3]
    head_dim_v = head_dim_qk if head_dim_v is None else head_dim_v
    head_dim = max(head_dim_qk, head_dim_v)
    _check_limits(q, k, varlen)
    padded = _dispatch.padded_head_dim(head_dim)
    dtype_name = _dispatch.DTYPE_NAMES[q.dtype]
    arch = _dispatch.resolve_arch(arch, direction, padded, dtype_name, q.device, varlen is not None)
    padded = _validate.features_head_dim(arch, direction, padded, dtype_name, softcap, alibi_slopes)
    if direction == "bwd" and arch == 80:
        _validate.check_sm80_backward(varlen[2] if varlen is not None else q.shape[1], padded)
    own_v = head_dim_qk == padded and head_dim_v in HEAD_DIMS_V[arch][direction].get(padded, ())
    if head_dim_v != head_dim_qk and own_v:
        return Plan(arch, padded, 0, dtype_name, 0, head_dim_v)  # v and out at their own head dim
    cols = head_dim + _head_pad(arch, direction, head_dim, padded)  # what the kernels read of q, k, v
    return Plan(arch, padded, cols - head_dim_qk, dtype_name, cols - head_dim_v, padded)


def _output_buffer(dest, shape, pad, like):
    """Where the kernels write an output of ``shape``: the caller's buffer ``dest`` where they can
    write it in place (no padded head dim, a layout they write), else a new tensor that
    _deliver copies there."""
    if dest is not None and not pad and _validate.is_kernel_layout(dest):
        return dest
    return torch.empty(shape, dtype=like.dtype, device=like.device)


def _deliver(result, dest, head_dim, pad):
    """The kernels' ``result`` without its padded columns, in ``dest`` where the caller gave one
    (a fresh unpadded result is contiguous already: contiguous() returns it as it is)."""
    if pad:
        result = result[..., :head_dim]
    if dest is None:
        return result.contiguous()
    if dest.data_ptr() != result.data_ptr():
        dest.copy_(result)
    return dest


def _kernel_sinks(sinks):
    """The sink logits as the kernels read them: float32, contiguous (None stays None)."""
    return None if sinks is None else sinks.detach().to(torch.float32).contiguous()


def _launches(varlen, alibi_slopes, rng_state, *tensors):
    """(tensors, alibi_slopes, rng_state) of each launch of a call: the whole call, or for a dense
    batch larger than one launch takes (_validate.max_batch_per_launch: the grids put the batch on
    gridDim.z) the slices of sequences [b0, b1) of the tensors (batch first) and of (batch, nheads)
    ALiBi slopes, with the dropout offset moved by b0 (the mask of sequence b counts b + offset,
    cutlass_flash.dropout)."""
    batch, seqlen_q, nheads = tensors[0].shape[:3]
    step = batch if varlen is not None else _validate.max_batch_per_launch(seqlen_q, nheads)
    if step >= batch:
        yield tensors, alibi_slopes, rng_state
        return
    for b0 in range(0, batch, step):
        b1 = min(b0 + step, batch)
        slopes = alibi_slopes[b0:b1] if alibi_slopes is not None and alibi_slopes.dim() == 2 else alibi_slopes
        rng = rng_state
        if rng_state is not None and b0:
            rng = rng_state.clone()
            rng[1] += b0  # on the device: no copy from the host, no synchronisation
        yield tuple(None if t is None else t[b0:b1] for t in tensors), slopes, rng


def _fwd_impl(q, k, v, softmax_scale, window_left, window_right, arch, deterministic=False, softcap=0.0,
              varlen=None, alibi_slopes=None, dropout_p=0.0, rng_state=None, sinks=None, out=None):
    """The forward; varlen: (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q,
    seqused_k) with q, k, v the (1, total, nheads, head_dim) views of packed tensors. out: a
    buffer shaped like the output (q's, with v's head dim) to write it into (else a new tensor),
    as _bwd_impl's dq."""
    _validate.check_op_tensors(q, k, v)
    batch, seqlen_q, nheads, _ = q.shape
    head_dim_v = v.shape[3]
    nseq = batch if varlen is None else varlen[0].shape[0] - 1
    _validate.check_op_features(q, nseq, alibi_slopes, varlen, sinks=sinks)
    dropout.check_rng_state(rng_state, dropout_p, q.device)
    sinks = _kernel_sinks(sinks)
    if _no_work(varlen):  # lse: +inf, or the sink (the only term of an empty row's softmax)
        lse = q.new_full(_lse_shape(q, varlen), float("inf"), dtype=torch.float32)
        if sinks is not None:
            lse.copy_(sinks[:, None].expand_as(lse))
        return (q.new_zeros((batch, seqlen_q, nheads, head_dim_v)) if out is None else out.zero_()), lse
    arch, padded, pad, dtype_name, pad_v, kernel_dim_v = _plan("fwd", q, k, arch, softcap, alibi_slopes, varlen,
                                                               head_dim_v)
    device = q.device
    C = _dispatch.lib()
    q, k, v = _kernel_input(q, pad), _kernel_input(k, pad), _kernel_input(v, pad_v)
    q, softmax_scale = _kernel_query(q, softmax_scale)
    dest, out = out, _output_buffer(out, (batch, seqlen_q, nheads, head_dim_v + pad_v), pad_v, q)
    lse = torch.empty(_lse_shape(q, varlen), dtype=torch.float32, device=device)
    for (qs, ks, vs, os_, lses), slopes, rng in _launches(varlen, alibi_slopes, rng_state, q, k, v, out, lse):
        problem = _problem(qs, ks, padded, softmax_scale, window_left, window_right, dtype_name, softcap,
                           varlen, slopes, dropout_p, rng, sinks)
        if kernel_dim_v != padded:
            problem["head_dim_v"] = kernel_dim_v
        workspace_bytes = C.fwd_workspace_bytes(**problem, arch=arch)
        workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=device) if workspace_bytes else None
        _dispatch.launch(
            C.fwd,
            device,
            _ref4(qs),
            _ref4(ks),
            _ref4(vs),
            _ref4(os_),
            lses.data_ptr(),
            workspace.data_ptr() if workspace is not None else 0,
            **problem,
            arch=arch,
            stream=_dispatch.current_stream(device),
        )
    return _deliver(out, dest, head_dim_v, pad_v), lse


def _check_limits(q, k, varlen):
    if varlen is None:
        _validate.check_limits(q.shape[1], k.shape[1], q.shape[2])
    else:
        _validate.check_limits(varlen[2], varlen[3], q.shape[2], varlen[0].shape[0] - 1, q.shape[1], k.shape[1])


# The ops' optional arguments in their order after the required ones, with their defaults: the
# score features, then a packed batch's. cu_seqlens given, q, k, v (and out, dout, the gradients)
# are packed (total, nheads, head_dim) tensors whose sequence b is the rows [cu_seqlens[b],
# cu_seqlens[b + 1]), max_seqlen_q / max_seqlen_k the longest sequences' lengths (needed: they
# size the grid), seqused FlashAttention-3's rows in use of each slot; the LSE is then
# (nheads, total_q).
_OPTIONAL = {"softcap": ("float", 0.0), "alibi_slopes": ("Tensor?", None), "dropout_p": ("float", 0.0),
             "rng_state": ("Tensor?", None), "sinks": ("Tensor?", None), "cu_seqlens_q": ("Tensor?", None),
             "cu_seqlens_k": ("Tensor?", None), "max_seqlen_q": ("int", 0), "max_seqlen_k": ("int", 0),
             "seqused_q": ("Tensor?", None), "seqused_k": ("Tensor?", None)}  # name: (schema type, default)
_INDEX = {name: i for i, name in enumerate(_OPTIONAL)}
_SINKS = _INDEX["sinks"]  # 8 + _SINKS in the forward op's inputs
_DEFAULTS = tuple(default for _, default in _OPTIONAL.values())


def _schema(required, returns):
    """An op's schema: ``required`` (torch's "Type name" pairs), then _OPTIONAL."""
    optional = ", ".join(f"{t} {name}={default}" for name, (t, default) in _OPTIONAL.items())
    return f"({required}, {optional}) -> {returns}"


_REQUIRED = "float softmax_scale, int window_left, int window_right, int arch, bool deterministic"


def _optional(passed):
    """The optional arguments of an op call (positional, in _OPTIONAL's order), completed with
    the defaults of those not passed."""
    passed = tuple(passed)
    return passed + _DEFAULTS[len(passed):]


def _views(varlen, *tensors):
    """What _fwd_impl / _bwd_impl take: a packed batch's (total, nheads, head_dim) tensors as
    (1, total, nheads, head_dim) views; a dense batch's as they are."""
    if varlen is None:
        return tensors
    for t in tensors:
        if t is not None and t.dim() != 3:
            raise ValueError(f"with cu_seqlens, q, k, v, out and dout must be packed (total, nheads, head_dim) "
                             f"tensors, got shape {tuple(t.shape)}")
    return tuple(None if t is None else t.unsqueeze(0) for t in tensors)


def _forward(q, k, v, softmax_scale, window_left, window_right, arch, deterministic=False, softcap=0.0,
             alibi_slopes=None, dropout_p=0.0, rng_state=None, sinks=None, cu_seqlens_q=None, cu_seqlens_k=None,
             max_seqlen_q=0, max_seqlen_k=0, seqused_q=None, seqused_k=None):
    """The forward op's implementation: (out, lse) of a dense or (cu_seqlens) packed batch. The
    arguments spelled out, in the op's order, rather than gathered in a dict: this runs on every
    eager call."""
    features = dict(softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p, rng_state=rng_state,
                    sinks=sinks)
    if cu_seqlens_q is None and cu_seqlens_k is None:
        return _fwd_impl(q, k, v, softmax_scale, window_left, window_right, arch, **features)
    varlen = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k)
    out, lse = _fwd_impl(*_views(varlen, q, k, v), softmax_scale, window_left, window_right, arch, varlen=varlen,
                         **features)
    return out.squeeze(0), lse


def _backward(dout, q, k, v, out, lse, softmax_scale, window_left, window_right, arch, deterministic, softcap=0.0,
              alibi_slopes=None, dropout_p=0.0, rng_state=None, sinks=None, cu_seqlens_q=None, cu_seqlens_k=None,
              max_seqlen_q=0, max_seqlen_k=0, seqused_q=None, seqused_k=None, dq=None, dk=None, dv=None):
    """The backward op's implementation (arguments in its order): (dq, dk, dv, dsinks), written
    into dq / dk / dv where given (_bwd_impl)."""
    features = dict(softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p, rng_state=rng_state,
                    sinks=sinks)
    if cu_seqlens_q is None and cu_seqlens_k is None:
        return _bwd_impl(dout, q, k, v, out, lse, softmax_scale, window_left, window_right, arch, deterministic,
                         dq, dk, dv, **features)
    varlen = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k)
    grads = _bwd_impl(*_views(varlen, dout, q, k, v, out), lse, softmax_scale, window_left, window_right, arch,
                      deterministic, *_views(varlen, dq, dk, dv), varlen=varlen, **features)
    return tuple(g.squeeze(0) if d is None else d for g, d in zip(grads[:3], (dq, dk, dv))) + grads[3:]


fwd_op = torch.library.custom_op("cutlass_flash::fwd", _forward, mutates_args=(),
                                 schema=_schema(f"Tensor q, Tensor k, Tensor v, {_REQUIRED}", "(Tensor, Tensor)"))


@fwd_op.register_fake
def _fwd_fake(q, k, v, *args):
    optional = _optional(args[5:])
    varlen = optional[_INDEX["cu_seqlens_q"]:]  # _fwd_impl's varlen tuple: the packing arguments, in order
    if varlen[0] is None and varlen[1] is None:
        varlen = None
    out = q.new_empty(q.shape[:-1] + v.shape[-1:])
    return out, q.new_empty(_lse_shape(*_views(varlen, q), varlen), dtype=torch.float32)


def _bwd_impl(dout, q, k, v, out, lse, softmax_scale, window_left, window_right, arch,
              deterministic, dq=None, dk=None, dv=None, softcap=0.0, varlen=None, alibi_slopes=None,
              dropout_p=0.0, rng_state=None, sinks=None):
    """The backward: (dq, dk, dv, dsinks), dsinks float32 (nheads,) with sinks, else None.
    dq / dk / dv: buffers to write the gradients into (else new tensors). A
    buffer the kernels cannot write in place (a padded head dim, a layout they do not take) is
    filled by a copy. varlen: as for _fwd_impl. dout comes from autograd in any layout (stride 0
    after a sum or mean over rows): _kernel_input copies what the kernels cannot read."""
    out_shape = q.shape[:3] + v.shape[3:]
    _validate.check_op_tensors(q, k, v, ("out", out, out_shape), ("dout", dout, out_shape))
    batch, seqlen_q, nheads, head_dim = q.shape
    _, seqlen_k, nheads_kv, head_dim_v = v.shape
    nseq = batch if varlen is None else varlen[0].shape[0] - 1
    _validate.check_op_features(q, nseq, alibi_slopes, varlen, lse, _lse_shape(q, varlen), sinks=sinks)
    dropout.check_rng_state(rng_state, dropout_p, q.device)
    sinks = _kernel_sinks(sinks)
    dests = (dq, dk, dv)
    if _no_work(varlen):  # out = 0: rowsum(dout * out) = 0, so dsinks = 0 too
        grads = (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v))
        for grad, dest in zip(grads, dests):
            if dest is not None:
                dest.zero_()
        dsinks = None if sinks is None else torch.zeros_like(sinks)
        return tuple(grad if dest is None else dest for grad, dest in zip(grads, dests)) + (dsinks,)
    arch, padded, pad, dtype_name, pad_v, kernel_dim_v = _plan("bwd", q, k, arch, softcap, alibi_slopes, varlen,
                                                               head_dim_v)
    device = q.device
    C = _dispatch.lib()
    q, k = _kernel_input(q, pad), _kernel_input(k, pad)
    v, out, dout = (_kernel_input(t, pad_v) for t in (v, out, dout))
    q, kernel_scale = _kernel_query(q, softmax_scale)
    lse = lse.contiguous()

    cols = head_dim + pad
    dq = _output_buffer(dq, (batch, seqlen_q, nheads, cols), pad, q)
    dk = _output_buffer(dk, (batch, seqlen_k, nheads_kv, cols), pad, q)
    dv = _output_buffer(dv, (batch, seqlen_k, nheads_kv, head_dim_v + pad_v), pad_v, q)
    # Each query row's share of dsinks (BwdParams::dsink_rows), summed below in a fixed order. The
    # kernels write every row of a dense batch; a packed one's rows of no sequence stay 0.
    dsink_rows = None
    if sinks is not None:
        dsink_rows = torch.zeros_like(lse) if varlen is not None else torch.empty_like(lse)
    for (qs, ks, vs, os_, dos, dqs, dks, dvs, lses, dsrs), slopes, rng in _launches(
            varlen, alibi_slopes, rng_state, q, k, v, out, dout, dq, dk, dv, lse, dsink_rows):
        problem = _problem(qs, ks, padded, kernel_scale, window_left, window_right, dtype_name, softcap,
                           varlen, slopes, dropout_p, rng, sinks)
        if kernel_dim_v != padded:
            problem["head_dim_v"] = kernel_dim_v
        workspace = torch.empty(
            C.bwd_workspace_bytes(**problem, arch=arch, deterministic=deterministic),
            dtype=torch.uint8,
            device=device,
        )
        _dispatch.launch(
            C.bwd,
            device,
            _ref4(qs),
            _ref4(ks),
            _ref4(vs),
            _ref4(os_),
            _ref4(dos),
            lses.data_ptr(),
            _ref4(dqs),
            _ref4(dks),
            _ref4(dvs),
            workspace.data_ptr(),
            **problem,
            arch=arch,
            deterministic=deterministic,
            dsink_rows_ptr=dsrs.data_ptr() if dsrs is not None else 0,
            stream=_dispatch.current_stream(device),
        )
    if softmax_scale < 0:  # the kernels' dq is that of -q (_kernel_query)
        dq.neg_()
    elif softmax_scale == 0:
        dq.zero_()
    grads = (_deliver(dq, dests[0], head_dim, pad), _deliver(dk, dests[1], head_dim, pad),
             _deliver(dv, dests[2], head_dim_v, pad_v))
    # lse / dsink_rows: (batch, nheads, seqlen_q), or (nheads, total_q) for a packed batch.
    dsinks = None
    if dsink_rows is not None:
        dsinks = dsink_rows.sum(1) if varlen is not None else dsink_rows.sum((0, 2))
    return grads + (dsinks,)


def _bwd_op(*args):
    dq, dk, dv, dsinks = _backward(*args)
    # An op's outputs are tensors: no sinks gives an empty dsinks.
    return dq, dk, dv, args[1].new_empty(0, dtype=torch.float32) if dsinks is None else dsinks


bwd_op = torch.library.custom_op(
    "cutlass_flash::bwd", _bwd_op, mutates_args=(),
    schema=_schema(f"Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, {_REQUIRED}",
                   "(Tensor, Tensor, Tensor, Tensor)"))


@bwd_op.register_fake
def _bwd_fake(dout, q, k, v, out, lse, *args):
    sinks = _optional(args[5:])[_SINKS]
    dsinks = q.new_empty(0 if sinks is None else sinks.shape[0], dtype=torch.float32)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsinks


def _setup_context(ctx, inputs, output):
    q, k, v, softmax_scale, window_left, window_right, arch, deterministic, *rest = inputs
    out, lse = output
    ctx.optional = _optional(rest)  # the packed batch's too: the backward sees the same rows
    ctx.num_inputs = len(inputs)
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.args = (softmax_scale, window_left, window_right, arch, deterministic)
    # Gradients do not flow through the log-sum-exp (as in FlashAttention), and its (absent)
    # gradient is not materialized as zeros.
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)


def _input_grads(ctx, dq, dk, dv, dsinks):
    """The gradients of the forward's inputs: q, k, v's, the sinks' (in their dtype) at their place."""
    grads = [dq, dk, dv] + [None] * (ctx.num_inputs - 3)
    sinks = ctx.optional[_SINKS]
    if sinks is not None:
        grads[8 + _SINKS] = dsinks.to(sinks.dtype)
    return tuple(grads)


def _backward_with(bwd):
    """The autograd backward that runs ``bwd``: the op, or its implementation (the eager path),
    which then runs the op under create_graph=True, so that the gradients carry the op's node and
    differentiating them raises (_no_double_backward) instead of silently returning no graph."""
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        run = _bwd if torch.is_grad_enabled() else bwd
        return _input_grads(ctx, *run(dout, q, k, v, out, lse, *ctx.args, *ctx.optional))

    return backward


def _no_double_backward(ctx, *grads):
    raise RuntimeError(
        "cutlass_flash: double backward (differentiating the gradients of flash_attn_func, e.g. "
        "after backward(create_graph=True)) is not supported, as in PyTorch's flash attention "
        "backend; use torch.nn.functional.scaled_dot_product_attention with the math backend for "
        "higher-order gradients")


_fwd = torch.ops.cutlass_flash.fwd.default
_bwd = torch.ops.cutlass_flash.bwd.default
fwd_op.register_autograd(_backward_with(_bwd), setup_context=_setup_context)
bwd_op.register_autograd(_no_double_backward, setup_context=lambda ctx, inputs, output: None)


class _EagerAttention(torch.autograd.Function):
    """The ops' autograd, without the op dispatch: the eager path of the public functions. The
    custom op's Python dispatch cost 66 us more per call with grad (103 against 37 us, fake
    binding, CPU machine; PERFLOG.md entry 17); torch.compile and other tracing still see the
    ops."""

    @staticmethod
    def forward(ctx, q, k, v, softmax_scale, window_left, window_right, arch, deterministic, *optional):
        out, lse = _forward(q, k, v, softmax_scale, window_left, window_right, arch, deterministic, *optional)
        _setup_context(ctx, (q, k, v, softmax_scale, window_left, window_right, arch, deterministic, *optional),
                       (out, lse))
        return out, lse

    backward = staticmethod(_backward_with(_backward))


def _plain_eager(q, k, v):
    """True when nothing traces the call: plain tensors, no dispatch mode, not compiling."""
    return (
        type(q) is torch.Tensor
        and type(k) is torch.Tensor
        and type(v) is torch.Tensor
        and not torch.compiler.is_compiling()
        and torch._C._len_torch_dispatch_stack() == 0
    )


def _needs_grad(*tensors):
    return any(t is not None and t.requires_grad for t in tensors)


def _autocast(q, k, v):
    """q, k, v in the autocast dtype when autocast is on for the kernels' device type (what SDPA
    does: it is one of autocast's lower-precision ops), else as given."""
    device_type = _dispatch.DEVICE_TYPE
    if device_type not in ("cuda", "cpu") or not torch.is_autocast_enabled(device_type):
        return q, k, v
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != dtype
                 else t for t in (q, k, v))


def _attention(args, return_lse):
    """Runs the forward op's arguments ``args`` (positional): through the op when something traces
    the call, else its implementation, under _EagerAttention when a gradient is needed."""
    q, k, v = args[:3]
    if not _plain_eager(q, k, v):
        out, lse = _fwd(*args)
    elif torch.is_grad_enabled() and _needs_grad(q, k, v, args[8 + _SINKS]):
        out, lse = _EagerAttention.apply(*args)
    else:
        out, lse = _forward(*args)
    return (out, lse) if return_lse else out


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None, deterministic=False, return_lse=False, sinks=None):
    """Exact attention with FlashAttention kernels (CUTLASS/CuTe, sm80 and sm90 families).

    The arguments are FlashAttention-2's `flash_attn_func`'s, in its order (return_lse in place
    of return_attn_probs), so code written for flash_attn runs by changing the import.

    Args:
        q: (batch, seqlen_q, nheads, head_dim) float16 or bfloat16 CUDA tensor.
        k, v: (batch, seqlen_k, nheads_kv, head_dim), same dtype and device; nheads must be a
            multiple of nheads_kv (MHA, GQA, MQA). head_dim: 1 to 256. v may have a head dim of its
            own (DeepSeek's MLA: 192 for q and k, 128 for v); out then has v's. The kernels run at
            the larger of the two, the other side zero-padded (no kernel of their own yet). Any layout: one the kernels
            cannot read as it is (a broadcast stride 0, a non-contiguous last dim, rows not
            16-byte aligned) is copied first. fp32 inputs under torch.autocast take its dtype.
        dropout_p: probability of dropping each attention probability (FlashAttention's
            dropout on P; the kept ones are scaled by 1 / (1 - dropout_p)). The mask is drawn
            from torch's CUDA generator (reproducible under torch.manual_seed, and a CUDA graph
            draws anew on each replay); the backward uses the same mask.
            cutlass_flash.dropout.keep_mask rebuilds it. Pass 0.0 at evaluation.
        softmax_scale: scale of q @ k^T before the softmax; default 1/sqrt(head_dim). Any finite
            value (negative, or 0: uniform weights).
        causal: causal mask aligned to the bottom-right corner of the attention matrix (as in
            FlashAttention 2): query i sees keys j <= i + seqlen_k - seqlen_q. Query rows that see
            no key (seqlen_q > seqlen_k) give out = 0, lse = +inf and zero gradients.
        window_size: (left, right), sliding-window local attention: query i sees keys j in
            [i + seqlen_k - seqlen_q - left, i + seqlen_k - seqlen_q + right]; -1 leaves a side
            unbounded, (-1, -1) is no window. With causal=True, right is 0. As in FlashAttention
            2, a bound >= seqlen_k counts as unbounded. Rows that see no key: as with causal.
        softcap: > 0 caps the scaled scores x at softcap * tanh(x / softcap) before the softmax
            (Gemma 2), with its backward; 0.0 is off.
        alibi_slopes: None, or float32 (nheads,) or (batch, nheads): ALiBi, as FlashAttention-2:
            the scaled score of query i and key j gets -slope * |i + seqlen_k - seqlen_q - j|.
        deterministic: the backward accumulates dQ in a fixed order, so gradients are
            bit-identical from run to run (and for a sequence alone or inside a batch); slower
            (up to a quarter of the backward's time; docs/design.md). dK/dV are deterministic either way.
        return_lse: also return the log-sum-exp of the scaled scores.
        sinks: None, or a (nheads,) floating tensor on q's device: learnable attention sinks
            (gpt-oss), one logit per query head in the units of the scaled scores, that joins every
            row's softmax denominator and has no value: out_i = sum_j e^(x_ij) v_j /
            (e^sinks[h] + sum_j e^(x_ij)). lse includes it; a row that sees no key gets out = 0,
            lse = sinks[h]. Differentiable (its gradient has the sinks' dtype).

    Returns:
        out (batch, seqlen_q, nheads, head_dim), or (out, lse) with lse float32
        (batch, nheads, seqlen_q). Differentiable with respect to q, k, v and sinks (not
        through lse).

    The kernel family is chosen automatically (sm90 kernels on an sm90 GPU when built, else the
    sm80 family); cutlass_flash.force_arch / CUTLASS_FLASH_FORCE_ARCH override it.
    """
    q, k, v = _autocast(q, k, v)
    scale, window_left, window_right = _validate.check_call(
        q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, sinks)
    dropout.check_p(dropout_p)
    return _attention((q, k, v, scale, window_left, window_right, _dispatch.forced_arch(), deterministic,
                       float(softcap), alibi_slopes, *dropout.call_args(dropout_p, q.device), sinks), return_lse)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                           softcap=0.0, alibi_slopes=None, deterministic=False, return_lse=False,
                           seqused_q=None, seqused_k=None, sinks=None):
    """flash_attn_func on a packed batch of sequences of different lengths (FlashAttention-2's
    flash_attn_varlen_func, same arguments in its order, return_lse in place of
    return_attn_probs; then FlashAttention-3's seqused_q / seqused_k).

    Args:
        q: (total_q, nheads, head_dim), the batch's queries one sequence after the other.
        k, v: (total_k, nheads_kv, head_dim).
        cu_seqlens_q, cu_seqlens_k: int32 (batch + 1,) on q's device: sequence b owns rows
            [cu_seqlens[b], cu_seqlens[b + 1]) (cu_seqlens[0] = 0; empty sequences allowed).
        max_seqlen_q, max_seqlen_k: int, the longest sequence's length (sizes the grid); a 0-d
            integer tensor is read back (a synchronisation).
        The rest: as flash_attn_func; causal masks and windows are aligned per sequence, to its
        bottom-right corner.
        seqused_q, seqused_k: None, or int32 (batch,) on q's device (FlashAttention-3's; static
            shapes under CUDA graphs): sequence b is the first seqused[b] rows of its slot
            [cu_seqlens[b], cu_seqlens[b + 1]) on that side (clamped to the slot; negative counts
            as 0), and max_seqlen bounds these used lengths. The slot's other rows belong to no
            sequence: out and the gradients are 0 there, lse +inf.
        sinks: as flash_attn_func's (one logit per head, shared by the batch's sequences).

    Returns:
        out (total_q, nheads, head_dim), or (out, lse) with lse float32 (nheads, total_q).

    cu_seqlens and seqused content is not checked by default (that needs a synchronisation): bad
    content gives wrong numbers but no access outside the tensors; CUTLASS_FLASH_CHECK_CU_SEQLENS=1
    checks it on every call and raises ValueError. Dropout's mask of sequence b is the dense mask's
    [b, :, :len_q(b), :len_k(b)] (cutlass_flash.dropout.keep_mask over (batch, nheads,
    max_seqlen_q, max_seqlen_k)).
    """
    q, k, v = _autocast(q, k, v)
    scale, window_left, window_right, max_seqlen_q, max_seqlen_k = _validate.check_varlen_call(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_size,
        softcap, alibi_slopes, deterministic, seqused_q, seqused_k, sinks)
    dropout.check_p(dropout_p)
    return _attention((q, k, v, scale, window_left, window_right, _dispatch.forced_arch(), deterministic,
                       float(softcap), alibi_slopes, *dropout.call_args(dropout_p, q.device), sinks, cu_seqlens_q,
                       cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k), return_lse)
