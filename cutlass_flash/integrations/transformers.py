"""Hugging Face transformers: importing this module registers the attention implementation
``"cutlass_flash"``, so that

    import cutlass_flash.integrations.transformers
    model = AutoModelForCausalLM.from_config(config, attn_implementation="cutlass_flash")
    model.set_attn_implementation("cutlass_flash")     # or on a model already built

runs our kernels. It reuses transformers' own FlashAttention path rather than writing its steps
again: `flash_attention_forward` (which transposes, unpads padded batches through the 2-D
attention mask, detects packed sequences from `position_ids` or takes the `cu_seq_lens_*`
keyword arguments of the flattening collator, and passes the model's sliding window, softcap and
attention dropout) calls the `flash_attn_func` / `flash_attn_varlen_func` of the implementation it
loads, and for this name it loads ours (FlashAttention-2's signatures), with the attention sinks
of models such as gpt-oss, which transformers passes as `s_aux`, as our `sinks`. The mask function
is transformers' FlashAttention one (a 2-D padding mask, or None).

transformers is an optional dependency (`pip install cutlass_flash[transformers]`); this module
is the only one that imports it.
"""
import importlib
import inspect

import transformers  # noqa: F401  (ImportError here names the missing extra)
from transformers import AttentionInterface
from transformers import modeling_flash_attention_utils as _fa_utils
from transformers.integrations.flash_attention import flash_attention_forward
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

from .._ops import flash_attn_func, flash_attn_varlen_func

#: The attn_implementation name. It contains "flash", which is how transformers recognizes a
#: FlashAttention implementation (is_flash_attention_requested): models then pass the arguments
#: and masks they pass to FlashAttention-2.
NAME = "cutlass_flash"

_original_lazy_imports = _fa_utils._lazy_imports


def _taking_s_aux(fn):
    """fn with its `sinks` argument named `s_aux`, transformers' name for attention sinks. The
    signature is fn's: transformers reads it to decide which features to pass."""
    def call(*args, s_aux=None, **kwargs):
        return fn(*args, sinks=s_aux, **kwargs)

    sig = inspect.signature(fn)
    params = [p for name, p in sig.parameters.items() if name != "sinks"]
    call.__signature__ = sig.replace(parameters=params + [inspect.Parameter("s_aux", inspect.Parameter.KEYWORD_ONLY,
                                                                            default=None)])
    call.__name__ = fn.__name__
    call.__doc__ = fn.__doc__
    return call


_flash_fn, _flash_varlen_fn = _taking_s_aux(flash_attn_func), _taking_s_aux(flash_attn_varlen_func)


def _lazy_imports(implementation, *args, **kwargs):
    """transformers' loader of FlashAttention functions, which answers ours for NAME (a name it
    would otherwise look up as a hub kernel) and defers to the original for every other name."""
    if implementation == NAME:
        return _flash_fn, _flash_varlen_fn, None, _fa_utils._pad_input, _fa_utils._unpad_input
    return _original_lazy_imports(implementation, *args, **kwargs)


#: Models that list the FlashAttention implementations they run on (a model with attention sinks
#: names those that take them) and that ours runs (tests/test_transformers.py); transformers would
#: otherwise replace NAME there by the first of its list.
_LISTED_BY = ("gpt_oss",)


def register():
    """Registers NAME (idempotent; importing the module does it)."""
    if _fa_utils._lazy_imports is not _lazy_imports:
        _fa_utils._lazy_imports = _lazy_imports
    AttentionInterface.register(NAME, flash_attention_forward)
    AttentionMaskInterface.register(NAME, flash_attention_mask)
    for model_type in _LISTED_BY:
        module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
        for cls in vars(module).values():
            listed = getattr(cls, "_compatible_flash_implementations", None)
            if isinstance(cls, type) and listed is not None and NAME not in listed:
                cls._compatible_flash_implementations = [*listed, NAME]


register()
