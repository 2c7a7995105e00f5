"""tritonattn: FlashAttention in Triton for PyTorch, with flash-attn 2's API.

The kernels are imported on first use, so that ``python -m tritonattn`` (and tests) can choose
the Triton interpreter (``TRITON_INTERPRET=1``, read by Triton at import) before Triton loads.
"""

from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = [
    "attention",
    "attention_varlen",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
    "patch_sdpa",
    "scaled_dot_product_attention",
]

if TYPE_CHECKING:  # pragma: no cover
    from tritonattn.inference import flash_attn_with_kvcache
    from tritonattn.integrations.sdpa import patch_sdpa, scaled_dot_product_attention
    from tritonattn.interface import (
        attention,
        attention_varlen,
        flash_attn_func,
        flash_attn_kvpacked_func,
        flash_attn_qkvpacked_func,
        flash_attn_varlen_func,
        flash_attn_varlen_kvpacked_func,
        flash_attn_varlen_qkvpacked_func,
    )


def __getattr__(name: str):
    if name in ("scaled_dot_product_attention", "patch_sdpa"):
        from tritonattn.integrations import sdpa

        value = getattr(sdpa, name)
    elif name == "flash_attn_with_kvcache":
        from tritonattn.inference import flash_attn_with_kvcache

        value = flash_attn_with_kvcache
    elif name in __all__:
        from tritonattn import interface

        value = getattr(interface, name)
    else:
        raise AttributeError(f"module 'tritonattn' has no attribute {name!r}")
    globals()[name] = value  # resolved once: later lookups cost nothing per call
    return value
