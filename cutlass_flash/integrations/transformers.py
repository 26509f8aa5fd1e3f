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
loads, and for this name it loads ours (FlashAttention-2's signatures). The mask function is
transformers' FlashAttention one (a 2-D padding mask, or None).

transformers is an optional dependency (`pip install cutlass_flash[transformers]`); this module
is the only one that imports it.
"""
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


def _lazy_imports(implementation, *args, **kwargs):
    """transformers' loader of FlashAttention functions, which answers ours for NAME (a name it
    would otherwise look up as a hub kernel) and defers to the original for every other name."""
    if implementation == NAME:
        return flash_attn_func, flash_attn_varlen_func, None, _fa_utils._pad_input, _fa_utils._unpad_input
    return _original_lazy_imports(implementation, *args, **kwargs)


def register():
    """Registers NAME (idempotent; importing the module does it)."""
    if _fa_utils._lazy_imports is not _lazy_imports:
        _fa_utils._lazy_imports = _lazy_imports
    AttentionInterface.register(NAME, flash_attention_forward)
    AttentionMaskInterface.register(NAME, flash_attention_mask)


register()
