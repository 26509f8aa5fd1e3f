"""ring-flash-attn (PyPI ``ring-flash-attn``) on our kernels. Its ring, zigzag, stripe and
llama3 functions call FlashAttention-2's low-level pair (``flash_attn.flash_attn_interface.
_flash_attn_forward`` / ``_flash_attn_backward`` and their varlen twins), which
``cutlass_flash.lowlevel`` mirrors; ``install()`` points them at ours::

    from cutlass_flash.integrations.ring_flash_attn import install
    ring_flash_attn = install()
    out = ring_flash_attn.zigzag_ring_flash_attn_func(q, k, v, causal=True, group=process_group)

flash-attn need not be installed: while ring_flash_attn is imported, a stand-in module serves its
``from flash_attn.flash_attn_interface import ...`` and is removed afterwards, so other libraries
still see flash-attn as absent. ring-flash-attn 0.1.8's Hugging Face adapter does not import with
transformers 5 (it imports names transformers removed); where it fails, its two functions are
replaced by ones that raise, and the attention functions import.
"""

import importlib
import sys
import types

from .. import lowlevel

_NAMES = ("_flash_attn_forward", "_flash_attn_backward", "_flash_attn_varlen_forward", "_flash_attn_varlen_backward")


def _adapter_stub(error):
    module = types.ModuleType("ring_flash_attn.adapters")

    def unavailable(*args, **kwargs):
        raise ImportError(f"ring_flash_attn's Hugging Face adapter did not import: {error}")

    module.substitute_hf_flash_attn = module.update_ring_flash_attn_params = unavailable
    return module


def _import_package():
    try:
        return importlib.import_module("ring_flash_attn")
    except ImportError as error:
        if "adapters" not in (error.name or "") and "transformers" not in str(error):
            raise
        for name in [n for n in sys.modules if n == "ring_flash_attn" or n.startswith("ring_flash_attn.")]:
            del sys.modules[name]
        sys.modules["ring_flash_attn.adapters"] = _adapter_stub(error)
        return importlib.import_module("ring_flash_attn")


def _import_ring_flash_attn():
    try:
        importlib.import_module("flash_attn.flash_attn_interface")
        return _import_package()
    except ImportError:
        pass
    package, interface = types.ModuleType("flash_attn"), types.ModuleType("flash_attn.flash_attn_interface")
    for name in _NAMES:
        setattr(interface, name, getattr(lowlevel, name))
    package.flash_attn_interface = interface
    saved = {name: sys.modules.get(name) for name in ("flash_attn", "flash_attn.flash_attn_interface")}
    sys.modules.update({"flash_attn": package, "flash_attn.flash_attn_interface": interface})
    try:
        return _import_package()
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def install():
    """Imports ring_flash_attn with every module of it calling our low-level pair; returns it."""
    ring = _import_ring_flash_attn()
    for name, module in list(sys.modules.items()):
        if module is not None and (name == "ring_flash_attn" or name.startswith("ring_flash_attn.")):
            for fn in _NAMES:
                if hasattr(module, fn):
                    setattr(module, fn, getattr(lowlevel, fn))
    return ring
