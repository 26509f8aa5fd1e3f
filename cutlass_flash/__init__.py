"""cutlass_flash: FlashAttention forward/backward kernels (CUTLASS/CuTe, sm80 and sm90) for PyTorch.

Public API::

    from cutlass_flash import flash_attn_func
    out = flash_attn_func(q, k, v, causal=True)            # (batch, seqlen, nheads, head_dim)
    out, lse = flash_attn_func(q, k, v, return_lse=True)

    with cutlass_flash.force_arch(80):                     # force the sm80 kernel family
        ...
    cutlass_flash.built_kernels()                          # [(arch, 'fwd'|'bwd', head_dim, dtype)]
    cutlass_flash.plan(q, k, "bwd")                        # what a call runs, or its error

Importing works without a GPU or driver. If the compiled module (cutlass_flash._C) is missing,
the import still succeeds and the first call that needs kernels raises ImportError saying how to
build it (cutlass_flash.extension_error() returns that message, or None).
"""

from . import _dispatch, _ops, _validate  # noqa: F401  (_ops registers the torch ops)
from ._dispatch import (
    ENV_FORCE_ARCH,
    INSTANTIATED_HEAD_DIMS,
    built_kernels,
    force_arch,
    forced_arch,
    padded_head_dim,
)
from ._ops import Plan, flash_attn_func, flash_attn_varlen_func, plan
from . import sdpa

sdpa.register()  # torch.nn.attention.activate_flash_attention_impl("cutlass_flash") opts in


def _version():
    try:
        from . import _build_info  # written by the build, if it writes one

        v = getattr(_build_info, "version", None) or getattr(_build_info, "__version__", None)
        if v:
            return str(v)
    except Exception:
        pass
    try:
        from importlib.metadata import version

        return version("cutlass_flash")
    except Exception:
        pass
    try:  # a source checkout that is not installed: the version pyproject.toml declares
        import os
        import re

        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        with open(os.path.join(root, "pyproject.toml")) as f:
            m = re.search(r'^version\s*=\s*"([^"]+)"', f.read(), re.M)
        if m:
            return m.group(1) + "+source"
    except Exception:
        pass
    return "0+unknown"


__version__ = _version()


def extension_error():
    """None if the compiled kernels (cutlass_flash._C) are importable, else why not and how to
    build them."""
    return None if _dispatch.extension_available() else _dispatch.missing_extension_message()


__all__ = [
    "ENV_FORCE_ARCH",
    "INSTANTIATED_HEAD_DIMS",
    "Plan",
    "__version__",
    "built_kernels",
    "extension_error",
    "flash_attn_func",
    "flash_attn_varlen_func",
    "force_arch",
    "forced_arch",
    "padded_head_dim",
    "plan",
]
