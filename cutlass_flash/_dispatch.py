"""Kernel selection: the compiled module, head-dim padding, the kernel family (arch) to run.

Everything here that depends only on (device, head dim, dtype, direction) is cached, so that the
per-call cost of dispatch is one dictionary lookup.
"""

import functools
import importlib
import os
import threading

import torch

try:  # The compiled kernels are built with the package; importing them here fails loudly at use.
    _C = importlib.import_module(__package__ + "._C")
    _C_IMPORT_ERROR = None
except ImportError as _e:  # pragma: no cover - depends on the build
    _C = None
    _C_IMPORT_ERROR = _e

ENV_FORCE_ARCH = "CUTLASS_FLASH_FORCE_ARCH"

from ._catalog import FAMILIES, HEAD_DIMS, VARLEN  # noqa: E402

#: Kernel families: 80 = Ampere-style (FlashAttention-2, mma.sync; runs on sm80 and newer),
#: 90 = Hopper (wgmma/TMA; runs on sm90 only). From the generator's catalogue (_catalog.py).
ARCHS = tuple(FAMILIES)

#: Directions each family has kernels for.
FAMILY_DIRECTIONS = {arch: tuple(dirs) for arch, dirs in FAMILIES.items()}
#: A (direction, head dim) a family lacks (a Family.bwd_head_dims narrower than its head dims in
#: csrc/generate.py) runs on FALLBACK_ARCH. Today every family has every (direction, head dim).
FALLBACK_ARCH = 80

#: Head dims that have kernels. Any other head dim up to 256 is zero-padded to the next one.
INSTANTIATED_HEAD_DIMS = HEAD_DIMS
MAX_HEAD_DIM = INSTANTIATED_HEAD_DIMS[-1]

#: CUDA's limit on gridDim.y and gridDim.z. The kernels put heads on y and, for a dense batch,
#: the batch on z (csrc/kernels/common/tile_order.h): _ops runs a larger batch in slices of
#: this many sequences; more heads than this is an error before any launch.
MAX_GRID_YZ = 65535

#: Kernel families the package has: GPUs from sm80 up to (not including) this major version run
#: them. Newer architectures (Blackwell, sm100 / sm120) are refused until they have kernels.
FIRST_UNSUPPORTED_MAJOR = 10

#: torch dtype -> the binding's dtype name.
DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16"}

#: The device type the kernels run on. Tests that run the Python layer on CPU against a fake
#: binding change it to "cpu"; nothing else should.
DEVICE_TYPE = "cuda"

# d -> instantiated head dim, for every valid d (1 to 256).
_PADDED_HEAD_DIM = {
    d: next(p for p in INSTANTIATED_HEAD_DIMS if p >= d) for d in range(1, MAX_HEAD_DIM + 1)
}


def padded_head_dim(head_dim):
    """The instantiated head dim that ``head_dim`` (1 to 256) is zero-padded to."""
    try:
        return _PADDED_HEAD_DIM[head_dim]
    except KeyError:
        raise ValueError(f"head_dim must be between 1 and {MAX_HEAD_DIM}, got {head_dim}") from None


def missing_extension_message():
    return (
        "cutlass_flash._C (the compiled CUDA kernels) could not be imported"
        + (f" ({_C_IMPORT_ERROR})" if _C_IMPORT_ERROR is not None else "")
        + ". Build it from the repository root with a CUDA toolkit, e.g. "
        "`pip install --no-build-isolation -e .` (see docs/build.md), and import "
        "cutlass_flash from that checkout or from the installed package."
    )


def lib():
    """The compiled module; ImportError with build instructions if it is missing."""
    if _C is None:
        raise ImportError(missing_extension_message()) from _C_IMPORT_ERROR
    return _C


def extension_available():
    return _C is not None


# ---------------------------------------------------------------------------------------------
# Cached facts about the build and the device.


@functools.lru_cache(maxsize=None)
def built_kernel_set():
    """frozenset of (arch, direction, head_dim, dtype_name) the build contains."""
    return frozenset(
        (int(a), str(d), int(h), str(t)) for (a, d, h, t) in lib().built_kernels()
    )


def built_kernels():
    """Sorted list of (arch, direction, head_dim, dtype) tuples compiled into this build."""
    return sorted(built_kernel_set())


def _query_capability(device):
    return torch.cuda.get_device_capability(device)


@functools.lru_cache(maxsize=None)
def device_capability(device):
    """(major, minor) of a CUDA device; ValueError for a device of another type."""
    if device.type != DEVICE_TYPE:
        raise ValueError(
            f"cutlass_flash needs {DEVICE_TYPE.upper()} tensors, got tensors on device '{device}'"
        )
    return tuple(_query_capability(device))


def _device_name(device):
    try:
        return torch.cuda.get_device_name(device)
    except Exception:  # pragma: no cover
        return "unknown GPU"


def check_capability(device):
    """RuntimeError unless the device is sm80 or newer; NotImplementedError for architectures
    without kernels yet (FIRST_UNSUPPORTED_MAJOR and newer). Returns the capability."""
    cap = device_capability(device)
    if cap < (8, 0):
        raise RuntimeError(
            f"cutlass_flash needs an sm80 (Ampere) or newer GPU; {device} "
            f"({_device_name(device)}) has compute capability {cap[0]}.{cap[1]} "
            f"(sm{cap[0]}{cap[1]})"
        )
    if cap[0] >= FIRST_UNSUPPORTED_MAJOR:
        raise NotImplementedError(
            f"cutlass_flash has kernels for sm80-sm90 GPUs (Ampere, Ada, Hopper); {device} "
            f"({_device_name(device)}, sm{cap[0]}{cap[1]}) is not supported yet"
        )
    return cap


def _parse_arch(value, source):
    if value is None:
        return 0
    if isinstance(value, str):
        v = value.strip().lower()
        if v in ("", "0", "auto"):
            return 0
        if v.startswith("sm"):
            v = v[2:]
        try:
            value = int(v)
        except ValueError:
            raise ValueError(
                f"{source} must be one of auto, 0, 80, 90; got {value!r}"
            ) from None
    value = int(value)
    if value != 0 and value not in ARCHS:
        raise ValueError(f"{source} must be one of auto, 0, 80, 90; got {value!r}")
    return value


def arch_from_env(environ=None):
    """The kernel family forced by CUTLASS_FLASH_FORCE_ARCH (0 = auto)."""
    environ = os.environ if environ is None else environ
    return _parse_arch(environ.get(ENV_FORCE_ARCH), ENV_FORCE_ARCH)


# The kernel family the calls of a thread ask for: 0 = auto. Every thread starts from the
# environment's value, read once at import; force_arch() changes it for its own thread. A
# threading.local rather than a contextvars.ContextVar: torch.compile traces (and guards on) an
# attribute of a threading.local, and cannot trace ContextVar.get.
_default_arch = arch_from_env()
_thread_arch = threading.local()


def forced_arch():
    """The kernel family the calling thread's calls request (0 = auto)."""
    return getattr(_thread_arch, "arch", _default_arch)


def _set_forced_arch(arch):
    _thread_arch.arch = arch


class force_arch:
    """Force the kernel family used by flash_attn_func: 80, 90, or 0/None/"auto" for automatic.

    Works as a context manager (restores the previous setting on exit)::

        with cutlass_flash.force_arch(80):
            out = flash_attn_func(q, k, v)

    or as a plain call that stays in effect: ``cutlass_flash.force_arch(80)``.
    Either way the setting is the calling thread's: other threads keep theirs. The environment
    variable CUTLASS_FLASH_FORCE_ARCH sets every thread's initial value at import. The family is
    fixed at the forward call: the backward of that call uses the same request (autograd runs it
    on a thread of its own).
    """

    def __init__(self, arch):
        self._arch = _parse_arch(arch, "force_arch(arch)")
        self._prev = forced_arch()
        _set_forced_arch(self._arch)

    def __enter__(self):
        _set_forced_arch(self._arch)
        return self

    def __exit__(self, *exc):
        _set_forced_arch(self._prev)
        return False


def _not_built(arch, direction, head_dim, dtype_name, requested):
    have = sorted(
        (a, h) for (a, d, h, t) in built_kernel_set() if d == direction and t == dtype_name
    )
    have_txt = ", ".join(f"sm{a}/d{h}" for a, h in have) or "none"
    how = "forced" if requested else "selected automatically"
    knobs = f"CUTLASS_FLASH_ARCHS={arch}, CUTLASS_FLASH_HEAD_DIMS={head_dim}, " \
            f"CUTLASS_FLASH_DTYPES={dtype_name}"
    if direction == "bwd":
        knobs += ", CUTLASS_FLASH_FWD_ONLY unset"
    return NotImplementedError(
        f"cutlass_flash: this build has no {direction} kernel for arch={arch} ({how}), "
        f"head_dim={head_dim}, dtype={dtype_name}. Built {direction} kernels for {dtype_name}: "
        f"{have_txt}. Rebuild cutlass_flash with the instantiation included ({knobs}; see "
        f"docs/build.md), or use another head dim / dtype"
        + (" / kernel family (cutlass_flash.force_arch)" if requested else "")
        + "."
    )


@functools.lru_cache(maxsize=None)
def resolve_arch(requested, direction, head_dim, dtype_name, device, varlen=False):
    """The kernel family to run: ``requested`` (80 or 90) or, for 0, auto.

    Auto is 90 on an sm90 GPU when this build has the sm90 kernel for (direction, head_dim,
    dtype) and, for a variable-length batch, the sm90 family takes one (VARLEN), else 80.
    A family with no kernel of ``direction`` for ``head_dim`` is replaced by FALLBACK_ARCH, forced
    or not. Raises ValueError (not a CUDA device / bad request), RuntimeError (GPU too old, or
    sm90 kernels forced on a GPU that is not sm90), NotImplementedError (not built, or a forced
    family without variable-length kernels). ``head_dim`` is the instantiated (padded) head dim.
    """
    cap = check_capability(device)
    built = built_kernel_set()
    if requested in FAMILIES and head_dim not in FAMILIES[requested].get(direction, ()):
        requested = FALLBACK_ARCH
    if varlen and requested in FAMILIES and direction not in VARLEN.get(requested, ()):
        raise NotImplementedError(
            f"cutlass_flash: the sm{requested} kernel family (forced) has no variable-length "
            f"{direction} kernel; auto picks a family that has one"
        )
    if requested == 0:
        if (cap[0] == 9 and (90, direction, head_dim, dtype_name) in built
                and (not varlen or direction in VARLEN.get(90, ()))):
            return 90
        arch = 80
    elif requested in ARCHS:
        arch = requested
        if arch == 90 and cap[0] != 9:
            raise RuntimeError(
                f"cutlass_flash: the sm90 kernel family (forced) needs an sm90 GPU (H100/H200); "
                f"{device} ({_device_name(device)}) has compute capability {cap[0]}.{cap[1]}"
            )
    else:
        raise ValueError(f"arch must be 0 (auto), 80 or 90, got {requested}")
    if (arch, direction, head_dim, dtype_name) not in built:
        raise _not_built(arch, direction, head_dim, dtype_name, requested)
    return arch


def reset_caches():
    """Forget cached build/device facts (tests that monkeypatch them call this)."""
    built_kernel_set.cache_clear()
    device_capability.cache_clear()
    resolve_arch.cache_clear()


# ---------------------------------------------------------------------------------------------
# Streams and devices, as plain ints for the binding.

_raw_stream_fn = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def current_stream(device):
    """The current CUDA stream of ``device`` as an int (cudaStream_t)."""
    if _raw_stream_fn is not None:
        return _raw_stream_fn(device.index)
    return torch.cuda.current_stream(device).cuda_stream  # pragma: no cover


def current_device():
    return torch.cuda.current_device()


def launch(fn, device, *args, **kwargs):
    """Calls ``fn`` (a binding entry point) with ``device`` current."""
    if device.index is not None and device.index != current_device():
        with torch.cuda.device(device.index):
            return fn(*args, **kwargs)
    return fn(*args, **kwargs)
