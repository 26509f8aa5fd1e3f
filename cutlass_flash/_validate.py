"""Argument checks of the public API. Cheap: metadata only, no device work, no allocation.

Each check has a fast path (a few comparisons that accept every valid input) and falls back to
the detailed checks, which find the first problem and raise an exception naming the argument,
only when the fast path fails. The detailed order: types and ranks, dtypes, shapes, then devices
(same device, a CUDA device, compute capability >= 8.0). Shape and dtype checks need no GPU:
tests run them on CPU or meta tensors. Memory layout is not an error: _ops copies a tensor the
kernels cannot read as it is (is_kernel_layout), as FlashAttention-2 copies a non-contiguous
last dimension.
"""

import math
import operator
import os
import warnings

import torch

from . import _dispatch
from ._catalog import SOFTCAP_ALIBI

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)

#: Rows are read with 16-byte vector loads (and TMA on sm90): pointers and the batch/row/head
#: strides must be multiples of 16 bytes, i.e. 8 elements of a 2-byte type.
ALIGN_ELEMENTS = 8
_ALIGN_MASK = ALIGN_ELEMENTS - 1

_NAMES = ("q", "k", "v")


def _layout_fast(t, offset):
    """True if ``t`` certainly has the kernels' layout (False: ask check_layout)."""
    s0, s1, s2, s3 = t.stride()
    return s3 == 1 and s0 > 0 and s1 > 0 and s2 > 0 and not ((s0 | s1 | s2 | offset) & _ALIGN_MASK)


def check_layout(name, t, offset=None):
    """ValueError unless ``t`` (4-D) has a contiguous last dim and 16-byte aligned rows, each
    dim of more than one index a positive stride (not 0, as expand() gives).

    Strides of dims of size 1 are never used and may be anything. ``offset``: the storage offset
    (None: read it; pass 0 under torch.compile, which cannot trace storage_offset()).
    """
    s0, s1, s2, s3 = t.stride()
    if s3 != 1:
        raise ValueError(
            f"{name} must have a contiguous last dimension (stride(-1) == 1), got strides "
            f"{tuple(t.stride())} for shape {tuple(t.shape)}; pass {name}.contiguous()"
        )
    if offset is None:
        offset = t.storage_offset()
    n0, n1, n2, _ = t.shape
    if (n0 > 1 and s0 <= 0) or (n1 > 1 and s1 <= 0) or (n2 > 1 and s2 <= 0):
        raise ValueError(
            f"{name} must not broadcast (a stride of 0 or less, as expand() gives) over dims 0-2, "
            f"got strides {tuple(t.stride())} for shape {tuple(t.shape)}"
        )
    if (
        offset % ALIGN_ELEMENTS
        or (n0 > 1 and s0 % ALIGN_ELEMENTS)
        or (n1 > 1 and s1 % ALIGN_ELEMENTS)
        or (n2 > 1 and s2 % ALIGN_ELEMENTS)
    ):
        raise ValueError(
            f"{name} must be 16-byte aligned: its storage offset and the strides of dims 0-2 "
            f"must be multiples of {ALIGN_ELEMENTS} elements, got storage_offset "
            f"{offset} and strides {tuple(t.stride())}; pass a copy "
            f"({name}.clone(memory_format=torch.contiguous_format))"
        )


def check_inputs(q, k, v):
    """Validates the arguments of flash_attn_func; raises TypeError/ValueError/RuntimeError."""
    compiling = torch.compiler.is_compiling()
    if _inputs_fast(q, k, v):
        if not compiling:  # under torch.compile the op checks the GPU when it runs
            _dispatch.check_capability(q.device)
        return
    _check_inputs_detailed(q, k, v, compiling)


def _inputs_fast(q, k, v):
    if not (type(q) is torch.Tensor and type(k) is torch.Tensor and type(v) is torch.Tensor):
        return False
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return False
    B, Sq, H, D = q.shape
    Bk, Sk, Hk, Dk = k.shape
    dt = q.dtype
    dev = q.device
    return (
        v.shape[:3] == k.shape[:3]
        and 1 <= v.shape[3] <= _dispatch.MAX_HEAD_DIM
        and (dt is torch.float16 or dt is torch.bfloat16)
        and k.dtype is dt
        and v.dtype is dt
        and Bk == B
        and Dk == D
        and 1 <= D <= _dispatch.MAX_HEAD_DIM
        and B >= 1
        and Sq >= 1
        and Sk >= 1
        and Hk >= 1
        and H % Hk == 0
        and H <= _dispatch.MAX_GRID_YZ
        and k.device == dev
        and v.device == dev
        and dev.type == _dispatch.DEVICE_TYPE
    )


def _check_ranks(tensors, rank, layout):
    """TypeError / ValueError unless q, k, v are tensors of `rank` dims (`layout` says which)."""
    for name, t in zip(_NAMES, tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != rank:
            raise ValueError(
                f"{name} must be {rank}-D {layout}, got {t.dim()}-D tensor of shape {tuple(t.shape)}"
            )


def _check_inputs_detailed(q, k, v, compiling):
    _check_ranks((q, k, v), 4, "(batch, seqlen, nheads, head_dim)")
    if q.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"q must be torch.float16 or torch.bfloat16, got {q.dtype}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(
                f"q, k and v must have the same dtype: q is {q.dtype} but {name} is {t.dtype}"
            )

    batch, seqlen_q, nheads, head_dim = q.shape
    batch_k, seqlen_k, nheads_kv, head_dim_k = k.shape
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(
            f"k and v must have the same (batch, seqlen, nheads), got k {tuple(k.shape)} and v {tuple(v.shape)}"
        )
    check_head_dim_v(v.shape[3])
    if batch_k != batch:
        raise ValueError(
            f"k and v must have q's batch size: q {tuple(q.shape)} has batch {batch}, "
            f"k {tuple(k.shape)} has batch {batch_k}"
        )
    if head_dim_k != head_dim:
        raise ValueError(
            f"k and v must have q's head_dim: q {tuple(q.shape)} has head_dim {head_dim}, "
            f"k {tuple(k.shape)} has head_dim {head_dim_k}"
        )
    if head_dim < 1 or head_dim > _dispatch.MAX_HEAD_DIM:
        raise ValueError(
            f"head_dim (last dim of q, k, v) must be between 1 and {_dispatch.MAX_HEAD_DIM}, "
            f"got {head_dim}"
        )
    if batch < 1:
        raise ValueError(f"batch (dim 0 of q, k, v) must be >= 1, got {batch}")
    if seqlen_q < 1:
        raise ValueError(f"seqlen_q (q.shape[1]) must be >= 1, got shape {tuple(q.shape)}")
    if seqlen_k < 1:
        raise ValueError(f"seqlen_k (k.shape[1]) must be >= 1, got shape {tuple(k.shape)}")
    if nheads < 1 or nheads_kv < 1:
        raise ValueError(
            f"nheads (dim 2) must be >= 1, got q {tuple(q.shape)} and k {tuple(k.shape)}"
        )
    if nheads % nheads_kv != 0:
        raise ValueError(
            f"q's nheads ({nheads}) must be a multiple of k/v's nheads ({nheads_kv}) "
            f"(MHA: equal, GQA: a divisor, MQA: 1)"
        )
    if nheads > _dispatch.MAX_GRID_YZ:
        raise ValueError(
            f"nheads (dim 2 of q) must be at most {_dispatch.MAX_GRID_YZ} (the kernels' grids "
            f"hold one head per index of CUDA's gridDim.y), got {nheads}"
        )

    device = q.device
    for name, t in (("k", k), ("v", v)):
        if t.device != device:
            raise ValueError(
                f"q, k and v must be on the same device: q is on {device} but {name} is on "
                f"{t.device}"
            )
    if device.type != _dispatch.DEVICE_TYPE:
        raise ValueError(
            f"q, k and v must be {_dispatch.DEVICE_TYPE.upper()} tensors; q is on device "
            f"'{device}' (move them with .cuda())"
        )
    if not compiling:
        _dispatch.check_capability(device)


def check_head_dim_v(head_dim_v):
    """ValueError unless v's head dim (its last dim, which may differ from q's) is 1 to 256."""
    if not 1 <= head_dim_v <= _dispatch.MAX_HEAD_DIM:
        raise ValueError(f"v's head_dim (last dim) must be between 1 and {_dispatch.MAX_HEAD_DIM}, got {head_dim_v}")


def check_softmax_scale(softmax_scale, head_dim):
    """The softmax scale as a float: 1/sqrt(head_dim) for None. Any finite value: _ops runs a
    negative scale as -q with |scale|, and 0 as q = 0 (uniform weights)."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(softmax_scale, torch.Tensor) or not isinstance(softmax_scale, (int, float)):
        raise TypeError(
            f"softmax_scale must be a Python float or None, got {type(softmax_scale).__name__}"
        )
    softmax_scale = float(softmax_scale)
    if not _finite(softmax_scale):
        raise ValueError(f"softmax_scale must be finite, got {softmax_scale}")
    return softmax_scale


def _finite(x):
    """math.isfinite by comparisons, which torch.compile traces on the symbolic floats of
    dynamic=True (it cannot trace math.isfinite); False for NaN."""
    return -math.inf < x < math.inf


def _is_int(x):
    return isinstance(x, int) and not isinstance(x, bool)


def _as_int(x):
    """An int from anything integral (int, numpy integer, 0-d integer tensor), else None."""
    if isinstance(x, bool) or (isinstance(x, torch.Tensor) and x.dtype == torch.bool):
        return None
    try:
        return operator.index(x)
    except TypeError:
        return None


def check_mask(causal, window_size, seqlen_k):
    """(window_left, window_right) the kernels take, from FlashAttention-2's causal and window_size.

    Query i sees keys j with i + d - left <= j <= i + d + right, d = seqlen_k - seqlen_q (the
    bottom-right-aligned diagonal); -1 leaves a side unbounded. As in FlashAttention-2, causal=True
    sets right to 0, and a bound >= seqlen_k is unbounded (-1).
    """
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if isinstance(window_size, torch.Tensor):  # FlashAttention-2's tests pass a tensor of two
        window_size = window_size.tolist() if window_size.dim() == 1 else window_size
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise TypeError(
            f"window_size must be a sequence (left, right) of two ints, got {window_size!r}"
        ) from None
    sides = []
    for side, value in (("left", left), ("right", right)):
        as_int = _as_int(value)
        if as_int is None:
            raise TypeError(
                f"window_size {side} must be an int (-1: unbounded), got {type(value).__name__}"
            )
        sides.append(as_int)
    left, right = sides
    for side, value in (("left", left), ("right", right)):
        if value < -1:
            raise ValueError(
                f"window_size {side} must be >= 0, or -1 for unbounded, got {value}"
            )
    if causal:
        right = 0
    left = -1 if left >= seqlen_k else left
    right = -1 if right >= seqlen_k else right
    return left, right


def check_alibi(alibi_slopes, batch, nheads, device):
    """alibi_slopes: None, or float32 (nheads,) or (batch, nheads) on q's device with a contiguous
    last dim (FlashAttention-2's)."""
    if alibi_slopes is None:
        return
    if not isinstance(alibi_slopes, torch.Tensor):
        raise TypeError(
            f"alibi_slopes must be None or a float32 tensor, got {type(alibi_slopes).__name__}"
        )
    if alibi_slopes.dtype != torch.float32:
        raise TypeError(f"alibi_slopes must be float32, got {alibi_slopes.dtype}")
    if tuple(alibi_slopes.shape) not in ((nheads,), (batch, nheads)):
        raise ValueError(
            f"alibi_slopes must have shape ({nheads},) or ({batch}, {nheads}) (nheads of q, batch), "
            f"got {tuple(alibi_slopes.shape)}"
        )
    if alibi_slopes.device != device:
        raise ValueError(f"alibi_slopes must be on q's device {device}, got {alibi_slopes.device}")
    if alibi_slopes.stride(-1) != 1:
        raise ValueError("alibi_slopes must have a contiguous last dimension; pass alibi_slopes.contiguous()")


def check_sinks(sinks, nheads, device):
    """sinks: None, or a floating (nheads,) tensor on q's device (attention-sink logits)."""
    if sinks is None:
        return
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"sinks must be None or a tensor of shape ({nheads},), got {type(sinks).__name__}")
    if sinks.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"sinks must be float32, float16 or bfloat16, got {sinks.dtype}")
    if tuple(sinks.shape) != (nheads,):
        raise ValueError(f"sinks must have shape ({nheads},) (one logit per head of q), got {tuple(sinks.shape)}")
    if sinks.device != device:
        raise ValueError(f"sinks must be on q's device {device}, got {sinks.device}")


def features_head_dim(arch, direction, head_dim, dtype_name, softcap, alibi_slopes):
    """The head dim a call with these features runs at in family ``arch``: ``head_dim``
    (instantiated), or, for softcap with ALiBi where that kernel has no path for the pair (the
    generator's SOFTCAP_ALIBI), the next larger built head dim whose kernel has one, zero-padded as
    other head dims are: the sm90 backward at d = 64 (which recovers tanh's value from P, shifted
    by the bias) runs the pair at d = 96, about 1.5x the work. NotImplementedError where no built
    head dim takes the pair (every sm80 backward)."""
    if not (softcap > 0 and alibi_slopes is not None):
        return head_dim
    takers = SOFTCAP_ALIBI.get(arch, {}).get(direction, ())
    if head_dim in takers:
        return head_dim
    built = _dispatch.built_kernel_set()
    for d in sorted(takers):
        if d > head_dim and (arch, direction, d, dtype_name) in built:
            return d
    families = sorted(a for a, dims in SOFTCAP_ALIBI.items() if any(d >= head_dim for d in dims.get(direction, ())))
    where = f"the {', '.join(f'sm{a}' for a in families)} family does" if families else "no family does"
    hint = "pass one of them, or run without gradients" if direction == "bwd" else "pass one of them"
    raise NotImplementedError(
        f"cutlass_flash: the sm{arch} {'backward' if direction == 'bwd' else 'forward'} at head_dim "
        f"{head_dim} does not support softcap and alibi_slopes together ({where}); {hint}"
    )


def check_softcap(softcap):
    """Validates softcap (a finite float >= 0)."""
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"softcap must be a float >= 0, got {type(softcap).__name__}")
    if not (softcap >= 0.0 and _finite(softcap)):
        raise ValueError(f"softcap must be a finite float >= 0 (0: off), got {softcap}")


def check_features(softcap, alibi_slopes, deterministic, batch, nheads, device):
    """The feature arguments both call forms share: softcap, alibi_slopes (for `batch` sequences
    of `nheads` heads on `device`), deterministic."""
    check_softcap(softcap)
    check_alibi(alibi_slopes, batch, nheads, device)
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__}")


def check_call(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, sinks=None):
    """The checks of a FlashAttention-2-style call (flash_attn_func and the low-level pair), in
    order: inputs, softmax_scale, mask, the features without a kernel path, deterministic.
    Returns (softmax_scale, window_left, window_right) as the kernels take them."""
    check_inputs(q, k, v)
    scale = check_softmax_scale(softmax_scale, q.shape[3])
    window_left, window_right = check_mask(causal, window_size, k.shape[1])
    check_features(softcap, alibi_slopes, deterministic, q.shape[0], q.shape[2], q.device)
    check_sinks(sinks, q.shape[2], q.device)
    return scale, window_left, window_right


#: Set to 1 to check the content of cu_seqlens on every variable-length call (a device-to-host
#: copy and a synchronisation): starts at 0, never decreasing, within the tensors, and each length
#: at most max_seqlen (with seqused: each seqused[b] within its slot, and at most max_seqlen).
#: Without it, bad content gives wrong numbers but never an access outside the tensors (the
#: kernels clamp every sequence to them).
CHECK_CU_SEQLENS_ENV = "CUTLASS_FLASH_CHECK_CU_SEQLENS"


def _check_cu_seqlens(name, cu, batch, device):
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be an int32 tensor (batch + 1,), got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise TypeError(f"{name} must be int32 (FlashAttention's layout), got {cu.dtype}")
    if cu.dim() != 1 or cu.shape[0] < 2:
        raise ValueError(
            f"{name} must be 1-D with batch + 1 >= 2 entries (cumulative sequence lengths from "
            f"0), got shape {tuple(cu.shape)}"
        )
    if batch is not None and cu.shape[0] != batch + 1:
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1), got "
            f"{batch + 1} and {cu.shape[0]}"
        )
    if cu.device != device:
        raise ValueError(f"{name} must be on q's device {device}, got {cu.device}")
    if cu.stride(0) != 1:
        raise ValueError(f"{name} must be contiguous; pass {name}.contiguous()")


def _check_seqused(name, used, batch, device):
    """seqused_q / seqused_k: None, or int32 (batch,) on q's device, contiguous (FlashAttention-3's)."""
    if used is None:
        return
    if not isinstance(used, torch.Tensor):
        raise TypeError(f"{name} must be None or an int32 tensor (batch,), got {type(used).__name__}")
    if used.dtype != torch.int32:
        raise TypeError(f"{name} must be int32 (FlashAttention-3's layout), got {used.dtype}")
    if tuple(used.shape) != (batch,):
        raise ValueError(f"{name} must have shape ({batch},) (batch = len(cu_seqlens_q) - 1), got "
                         f"{tuple(used.shape)}")
    if used.device != device:
        raise ValueError(f"{name} must be on q's device {device}, got {used.device}")
    if not used.is_contiguous():
        raise ValueError(f"{name} must be contiguous; pass {name}.contiguous()")


def _check_max_seqlen(name, value):
    """The int; a 0-d integer tensor (what transformers passes for packed batches) is read back
    (one synchronisation)."""
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_floating_point():
        value = int(value)
    if not _is_int(value):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


def check_cu_seqlens_content(name, cu, total, max_seqlen, used_name=None, used=None):
    """The debug check (CHECK_CU_SEQLENS_ENV): ValueError naming the first bad entry. With
    seqused (``used``, named ``used_name``), each entry must lie in [0, its slot's length], and
    max_seqlen bounds the used lengths (the rows the kernels see), not the slots."""
    values = cu.tolist()
    used = None if used is None else used.tolist()
    if values[0] != 0:
        raise ValueError(f"{name}[0] must be 0, got {values[0]}")
    for i in range(1, len(values)):
        n = values[i] - values[i - 1]
        if n < 0:
            raise ValueError(f"{name} must not decrease: {name}[{i}] = {values[i]} < "
                             f"{name}[{i - 1}] = {values[i - 1]}")
        by = name
        if used is not None:
            if not 0 <= used[i - 1] <= n:
                raise ValueError(f"{used_name}[{i - 1}] = {used[i - 1]} must be in [0, {n}] (the rows of "
                                 f"sequence {i - 1}'s slot by {name})")
            n, by = used[i - 1], used_name
        if n > max_seqlen:
            raise ValueError(f"sequence {i - 1} has {n} rows by {by}, more than its max_seqlen {max_seqlen}")
    if values[-1] > total:
        raise ValueError(f"{name}[-1] = {values[-1]} is past the tensor's {total} rows")
    if values[-1] < total:
        # Legal (a static buffer's padding: its rows of out and the gradients are written as
        # zeros, lse as +inf), but often a mistake, which this debug check exists to find.
        warnings.warn(f"{name}[-1] = {values[-1]} leaves {total - values[-1]} of the tensor's {total} rows "
                      f"outside every sequence (padding: out and gradients 0, lse +inf there)",
                      stacklevel=4)


def check_varlen_call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                      window_size, softcap, alibi_slopes, deterministic, seqused_q=None, seqused_k=None,
                      sinks=None):
    """The checks of flash_attn_varlen_func: q (total_q, nheads, head_dim), k and v (total_k,
    nheads_kv, head_dim), cu_seqlens int32 (batch + 1,), seqused None or int32 (batch,). Returns
    (softmax_scale, window_left, window_right, max_seqlen_q, max_seqlen_k) as the kernels take
    them; the content of cu_seqlens and seqused is checked only under CHECK_CU_SEQLENS_ENV (it
    would need a synchronisation)."""
    _check_ranks((q, k, v), 3, "(total_tokens, nheads, head_dim) for flash_attn_varlen_func")
    for name, t in (("q", q), ("k", k)):
        if t.shape[0] < 1:
            raise ValueError(f"{name} must have at least one row (total_tokens >= 1), got shape "
                             f"{tuple(t.shape)}")
    check_inputs(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0))
    _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, None, q.device)
    _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, cu_seqlens_q.shape[0] - 1, q.device)
    _check_seqused("seqused_q", seqused_q, cu_seqlens_q.shape[0] - 1, q.device)
    _check_seqused("seqused_k", seqused_k, cu_seqlens_q.shape[0] - 1, q.device)
    max_seqlen_q = _check_max_seqlen("max_seqlen_q", max_seqlen_q)
    max_seqlen_k = _check_max_seqlen("max_seqlen_k", max_seqlen_k)
    scale = check_softmax_scale(softmax_scale, q.shape[2])
    window_left, window_right = check_mask(causal, window_size, max(max_seqlen_k, 1))
    check_features(softcap, alibi_slopes, deterministic, cu_seqlens_q.shape[0] - 1, q.shape[1], q.device)
    check_sinks(sinks, q.shape[1], q.device)
    if os.environ.get(CHECK_CU_SEQLENS_ENV, "0") not in ("", "0"):
        check_cu_seqlens_content("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q, "seqused_q", seqused_q)
        check_cu_seqlens_content("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k, "seqused_k", seqused_k)
    return scale, window_left, window_right, max_seqlen_q, max_seqlen_k


def is_kernel_layout(t):
    """Whether a 4-D tensor can be passed to the kernels as it is (eager only)."""
    if t.dim() != 4:
        return False
    if _layout_fast(t, t.storage_offset()):
        return True
    try:
        check_layout("t", t)
    except ValueError:
        return False
    return True


def check_op_tensors(q, k, v, *others):
    """Memory-safety checks of the ops themselves, which may be called without the wrapper:
    shapes, dtypes and devices the binding cannot see (the layout it assumes, _ops makes by a copy
    where needed). ``others``: (name, tensor, shape) triples of further inputs like q. Runs inside
    the ops, on real tensors."""
    if q.dim() == 4 and k.dim() == 4 and v.dim() == 4:
        qs, ks = q.shape, k.shape
        dt, dev = q.dtype, q.device
        if (
            v.shape[:3] == ks[:3]
            and 1 <= v.shape[3] <= _dispatch.MAX_HEAD_DIM
            and ks[0] == qs[0]
            and ks[3] == qs[3]
            and ks[2] >= 1
            and qs[2] % ks[2] == 0
            and (dt is torch.float16 or dt is torch.bfloat16)
            and k.dtype is dt
            and v.dtype is dt
            and k.device == dev
            and v.device == dev
            and 1 <= qs[3] <= _dispatch.MAX_HEAD_DIM
            and qs[2] <= _dispatch.MAX_GRID_YZ
            and all(t.shape == shape and t.dtype is dt and t.device == dev for _, t, shape in others)
        ):
            return
    _check_op_tensors_detailed(q, k, v, others)


def _check_op_tensors_detailed(q, k, v, others):
    if (
        q.dim() != 4
        or k.dim() != 4
        or v.dim() != 4
        or v.shape[:3] != k.shape[:3]
        or not 1 <= v.shape[3] <= _dispatch.MAX_HEAD_DIM
        or k.shape[0] != q.shape[0]
        or k.shape[3] != q.shape[3]
        or k.shape[2] < 1
        or q.shape[2] % k.shape[2] != 0
    ):
        raise ValueError(
            f"cutlass_flash: inconsistent shapes q {tuple(q.shape)}, k {tuple(k.shape)}, "
            f"v {tuple(v.shape)}"
        )
    if not 1 <= q.shape[3] <= _dispatch.MAX_HEAD_DIM:
        raise ValueError(f"cutlass_flash: head_dim must be between 1 and {_dispatch.MAX_HEAD_DIM}, "
                         f"got {q.shape[3]}")
    if q.shape[2] > _dispatch.MAX_GRID_YZ:
        raise ValueError(f"cutlass_flash: nheads must be at most {_dispatch.MAX_GRID_YZ}, got {q.shape[2]}")
    if q.dtype not in SUPPORTED_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(
            f"cutlass_flash: q, k, v must all be float16 or all bfloat16, got {q.dtype}, "
            f"{k.dtype}, {v.dtype}"
        )
    if k.device != q.device or v.device != q.device:
        raise ValueError(
            f"cutlass_flash: q, k, v must be on one device, got {q.device}, {k.device}, "
            f"{v.device}"
        )
    for name, t, shape in others:
        if t.shape != shape:
            raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
        if t.dtype != q.dtype:
            raise TypeError(f"{name} must have dtype {q.dtype}, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} must be on {q.device}, got {t.device}")


#: Largest sequence length (rows of one sequence, dense or packed): the masks add row and column
#: offsets to a 2^30 sentinel in int32 (csrc/kernels/common/mask.h).
MAX_SEQLEN = (1 << 30) - 1
#: Largest number of rows of a packed tensor (total_q, total_k: int32 in the kernels' parameters,
#: and TMA row coordinates go up to total + one tile of 256 rows).
MAX_TOTAL_ROWS = (1 << 31) - 256
#: Largest tile count of one launch: the sm90 forward's persistent scheduler counts tiles in
#: int32 and claims up to count + one per SM (less than 1024 SMs). Counted with 64-row tiles, the
#: smallest of any family (csrc/kernels/*/tile_config.h), so the bound holds for every family.
MAX_TILES = (1 << 31) - 1024
MIN_BLOCK_M = 64


#: Largest elements of one sequence's head in the sm80 backward's fp32 dQ accumulator (rows x
#: padded head dim): its tile offsets are int32 products (csrc/kernels/sm80/bwd_mainloop.h; in 64
#: bits the packed kernel at d = 96 spilled 4 B), so 8M rows at d = 256, 16M at d = 128.
MAX_SM80_BWD_ELEMENTS = 1 << 31


def check_sm80_backward(seqlen_q, padded_head_dim):
    """ValueError when the sm80 backward's dQ offsets would pass int32 (MAX_SM80_BWD_ELEMENTS)."""
    if seqlen_q * padded_head_dim > MAX_SM80_BWD_ELEMENTS:
        raise ValueError(
            f"the sm80 backward takes at most {MAX_SM80_BWD_ELEMENTS // padded_head_dim} query rows per "
            f"sequence at head dim {padded_head_dim}, got {seqlen_q} (int32 dQ offsets); the sm90 family "
            f"(H100 / H200) has no such limit")


def tiles(rows, nheads, batch=1):
    """An upper bound on the (query block, head, sequence) tiles of a launch."""
    return -(-rows // MIN_BLOCK_M) * nheads * batch


def max_batch_per_launch(seqlen_q, nheads):
    """The most sequences of a dense batch one launch takes: gridDim.z, and the tile count."""
    return max(1, min(_dispatch.MAX_GRID_YZ, MAX_TILES // tiles(seqlen_q, nheads)))


def check_limits(seqlen_q, seqlen_k, nheads, batch=None, total_q=None, total_k=None):
    """ValueError for sizes past the kernels' 32-bit indices, before any launch. A dense batch
    larger than one launch takes is run in slices (max_batch_per_launch), so batch has no limit of
    its own; a packed batch (total_q / total_k given, seqlen_* its max_seqlen) needs its tiles to
    fit one launch."""
    for name, n in (("seqlen_q", seqlen_q), ("seqlen_k", seqlen_k)):
        if n > MAX_SEQLEN:
            raise ValueError(f"{name} = {n} is larger than the kernels' limit of {MAX_SEQLEN} rows per sequence")
    if tiles(seqlen_q, nheads) > MAX_TILES:
        raise ValueError(f"one sequence of {seqlen_q} queries with {nheads} heads is more than the kernels' "
                         f"{MAX_TILES} tiles of {MIN_BLOCK_M} rows per launch")
    for name, n in (("total_q", total_q), ("total_k", total_k)):
        if n is not None and n > MAX_TOTAL_ROWS:
            raise ValueError(f"{name} = {n} rows is more than the kernels' limit of {MAX_TOTAL_ROWS} (int32 "
                             f"row indices)")
    if total_q is not None and tiles(total_q + batch * (MIN_BLOCK_M - 1), nheads) > MAX_TILES:
        raise ValueError(f"a packed batch of {total_q} queries in {batch} sequences with {nheads} heads is more "
                         f"than the kernels' {MAX_TILES} tiles per launch")


def check_op_features(q, batch, alibi_slopes, varlen=None, lse=None, lse_shape=None, sinks=None):
    """The ops' checks of their other tensor arguments (the public functions check them too, but
    an op may be called directly, and the kernels read these through raw pointers): alibi_slopes,
    sinks, the packed batch's cu_seqlens / seqused, the backward's lse. ``q``: the 4-D query
    (a packed batch's (1, total, nheads, d) view); ``batch``: the number of sequences."""
    device = q.device
    if alibi_slopes is not None:
        check_alibi(alibi_slopes, batch, q.shape[2], device)
    check_sinks(sinks, q.shape[2], device)
    if varlen is not None:
        cu_q, cu_k, _, _, used_q, used_k = varlen
        _check_cu_seqlens("cu_seqlens_q", cu_q, None, device)
        _check_cu_seqlens("cu_seqlens_k", cu_k, cu_q.shape[0] - 1, device)
        _check_seqused("seqused_q", used_q, cu_q.shape[0] - 1, device)
        _check_seqused("seqused_k", used_k, cu_q.shape[0] - 1, device)
    if lse is not None:
        if not isinstance(lse, torch.Tensor):
            raise TypeError(f"softmax_lse must be a torch.Tensor, got {type(lse).__name__}")
        if tuple(lse.shape) != tuple(lse_shape) or lse.dtype != torch.float32:
            raise ValueError(f"softmax_lse must be float32 of shape {tuple(lse_shape)}, got {lse.dtype} "
                             f"{tuple(lse.shape)}")
        if lse.device != device:
            raise ValueError(f"softmax_lse must be on q's device {device}, got {lse.device}")
