"""Hugging Face transformers attention backend: ``attn_implementation="tritonattn"``.

Importing this module (or calling :func:`register`) registers the backend with transformers'
``AttentionInterface`` and its mask interface, so ``from_pretrained(..., attn_implementation=
"tritonattn")`` and ``model.set_attn_implementation("tritonattn")`` work for models that use the
attention interface (Llama, Mistral, Qwen2/3, Gemma...). The name avoids "flash": transformers
treats such names as flash-attn hub kernels.

- masks: the backend registers its own mask function (:func:`tritonattn_mask`). A causal,
  sliding-window causal or bidirectional mask with padding only comes out as the 2D
  ``(batch, kv_len)`` boolean padding mask (bidirectional: a ``(batch, 1, 1, kv_len)`` view of it),
  or ``None`` when nothing is padded, and takes the key-padding path (one boolean read per key, no
  S x S mask is built). A sliding window that cuts keys travels with the 2D mask (an attribute,
  ``WINDOW_ATTR``), since not every model passes ``sliding_window`` to the attention function. Any
  other mask (chunked, packed sequences, ``or`` / ``and`` overlays, static caches, callers that ask
  for a materialised mask, sliding windows while torch.compile traces) is transformers' boolean
  ``sdpa_mask`` ``(batch, 1, q_len, kv_len)``, True = attend, on the mask path;
- no mask / a 2D padding mask: causal aligned bottom-right, which is transformers' alignment because
  the mask function only hands them out when the last query and the last key are the same position
  (prefill, dynamic caches: the new queries are the last keys); GQA without repeat_kv;
- packed sequences (``cu_seq_lens_q`` / ``cu_seq_lens_k`` kwargs, batch 1): the varlen path;
- q / k / v of different dtypes (autocast: rotary embeddings return fp32 q / k) are cast to the
  autocast dtype, or to v's dtype without autocast;
- ``attn_implementation="tritonattn_fa"`` instead runs transformers' own flash-attention code
  (the one behind ``"flash_attention_2"``: unpadding, varlen, its kwargs handling) on tritonattn's
  flash-attn-compatible functions, with the ``flash_attention_2`` mask function;
- ``scaling``, ``dropout``, ``sliding_window`` (window of ``sliding_window - 1`` keys to the left,
  as transformers' flash path) and ``softcap`` are honoured; ``output_attentions=True`` raises. A 4D
  mask is the whole pattern, sliding window included (as ``sdpa`` reads it): no window is added.
"""

from __future__ import annotations

import functools

import torch

# imported here, not inside the functions: torch.compile cannot trace an import through
# transformers' lazy module (a graph break with transformers 5.17)
from transformers import masking_utils as mu
from transformers.utils.import_utils import is_tracing

NAME = "tritonattn"
# transformers' own flash-attention path (unpad -> varlen) on tritonattn's flash-attn-compatible functions
FLASH_PATH_NAME = "tritonattn_fa"
# set by tritonattn_mask on a 2D padding mask of a sliding-window layer: the window, in transformers' terms
WINDOW_ATTR = "tritonattn_sliding_window"


def tritonattn_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: q/k/v ``(batch, heads, seqlen, head_dim)``;
    returns ``(attn_output (batch, seqlen, heads, head_dim), None)``."""
    from tritonattn import attention, flash_attn_func, flash_attn_varlen_func

    if kwargs.get("output_attentions", False):
        raise ValueError("tritonattn does not return attention weights: output_attentions=True is not supported "
                         "(use attn_implementation='eager' for that)")
    if kwargs.get("s_aux") is not None:
        raise ValueError("tritonattn does not support attention sinks (s_aux)")
    if kwargs.get("position_bias") is not None:
        raise ValueError("tritonattn's transformers backend does not take position_bias; pass it as an additive "
                         "mask, or call tritonattn.attention(q, k, v, bias=...) directly")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    query, key, value = _common_dtype(query, key, value)
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)  # (B, S, H, D) views
    window = (sliding_window - 1, -1) if sliding_window else (-1, -1)
    opts = dict(softmax_scale=scaling, dropout_p=dropout if module.training else 0.0, softcap=softcap or 0.0)
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None and cu_k is not None and q.shape[0] == 1:
        out = flash_attn_varlen_func(q[0], k[0], v[0], cu_q.to(torch.int32), cu_k.to(torch.int32),
                                     int(kwargs["max_length_q"]), int(kwargs["max_length_k"]), causal=causal,
                                     window_size=window, **opts)
        return out[None], None
    if attention_mask is None:
        return flash_attn_func(q, k, v, causal=causal and q.shape[1] > 1, window_size=window, **opts), None
    if attention_mask.dim() == 2:
        # from tritonattn_mask: (causal or sliding-window causal) + key padding, last query = last key. The
        # mask carries its window: not every model passes sliding_window to the attention function
        mask_window = getattr(attention_mask, WINDOW_ATTR, None)
        if mask_window is not None:
            window = (mask_window - 1, -1)
        return attention(q, k, v, key_padding_mask=attention_mask, causal=True, window_size=window, **opts), None
    # a 4D mask is the whole pattern, sliding window included (as sdpa reads it); a (B, 1, 1, Sk) one
    # (bidirectional + padding) takes the key-padding path inside attention()
    if attention_mask.dtype != torch.bool:  # an additive float mask
        return attention(q, k, v, bias=attention_mask, **opts), None
    return attention(q, k, v, mask=attention_mask, **opts), None


def _common_dtype(query, key, value):
    """One dtype for q, k, v, as transformers' sdpa and flash paths do: under autocast its dtype
    (rotary embeddings hand back fp32 q / k next to a bf16 v); otherwise v's when they differ."""
    device = query.device.type
    if torch.is_autocast_enabled(device):
        target = torch.get_autocast_dtype(device)
    elif query.dtype == key.dtype == value.dtype:
        return query, key, value
    else:
        target = value.dtype
    return query.to(target), key.to(target), value.to(target)


def _closure(fn, code) -> dict | None:
    """The free variables of ``fn`` if it is a closure made by the code object ``code``, else None."""
    if getattr(fn, "__code__", None) is not code or fn.__closure__ is None:
        return None
    return dict(zip(code.co_freevars, (cell.cell_contents for cell in fn.__closure__)))


def _mask_pattern(mask_function, local_size) -> tuple[bool, int | None] | None:
    """``(causal, sliding_window)`` when ``mask_function`` is one of transformers' plain patterns that
    tritonattn's flags express (causal, bidirectional, sliding-window causal), else None. Recognised by
    identity / code object, so anything composed differently (chunked, packed, ``or`` / ``and``
    overlays, user functions) is not mistaken for one of them."""

    if mask_function is mu.causal_mask_function:
        return True, None
    if mask_function is mu.bidirectional_mask_function:
        return False, None
    if torch.compiler.is_compiling():
        return None  # dynamo cannot read a closure's cells: the sliding window takes sdpa_mask's path
    # sliding_window_causal_mask_function(w) = and_masks(sliding_window_overlay(w), causal_mask_function)
    parts = _closure(mask_function, _codes()[0])
    if parts is None or len(parts.get("mask_functions", ())) != 2:
        return None
    overlay, base = parts["mask_functions"]
    sliding = _closure(overlay, _codes()[1])
    if base is not mu.causal_mask_function or sliding is None:
        return None
    window = sliding.get("sliding_window")
    if not isinstance(window, int) or window < 1 or (local_size is not None and local_size != window):
        return None
    return True, window


@functools.cache
def _codes():

    return (mu.and_masks(mu.causal_mask_function).__code__,
            mu.sliding_window_overlay(1).__code__)


def tritonattn_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=None,
    attention_mask: torch.Tensor | None = None,
    local_size: int | None = None,
    allow_is_causal_skip: bool = True,
    allow_is_bidirectional_skip: bool = False,
    **kwargs,
) -> torch.Tensor | None:
    """transformers' mask-interface function for ``"tritonattn"``.

    A causal or sliding-window causal mask with padding only gives the 2D ``(batch_size, kv_length)``
    boolean padding mask (True = real key), or None when no key is padded; a bidirectional one gives
    a ``(batch_size, 1, 1, kv_length)`` view of the padding mask, or None. The attention function
    turns them into the key-padding path (no S x S mask). A sliding window that cuts keys
    (``kv_length > sliding_window``) always gives the 2D mask (all True without padding), carrying
    the window as its ``WINDOW_ATTR`` attribute. This needs the causal diagonal to end at the last
    key (``q_offset + q_length == kv_offset + kv_length``, int offsets: no cache or dynamic caches),
    and the caller to accept an unmaterialised mask (``allow_is_causal_skip`` /
    ``allow_is_bidirectional_skip``). Anything else is ``sdpa_mask``'s boolean 4D mask."""

    if mask_function is None:
        mask_function = mu.causal_mask_function
    pattern = _mask_pattern(mask_function, local_size)
    plain_offsets = not isinstance(q_offset, torch.Tensor) and not isinstance(kv_offset, torch.Tensor)
    if pattern is not None and plain_offsets:
        causal, window = pattern
        aligned = q_offset + q_length == kv_offset + kv_length
        if (causal and allow_is_causal_skip and aligned) or (not causal and allow_is_bidirectional_skip):
            padding = _key_padding(attention_mask, kv_length, kv_offset)
            if window is not None and kv_length > window:  # the window cuts: it travels with the mask
                if padding is None:
                    padding = torch.ones(batch_size, kv_length, dtype=torch.bool, device=kwargs.get("device", "cpu"))
                setattr(padding, WINDOW_ATTR, window)
            if padding is None:
                return None
            return padding if causal else padding[:, None, None, :]
    # sdpa_mask returns None where torch's top-left is_causal would do (e.g. a static cache's prefill);
    # the attention function reads None as bottom-right causal: the same only when q_length == kv_length
    allow_is_causal_skip = allow_is_causal_skip and q_length == kv_length
    return mu.sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                        kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                        local_size=local_size, allow_is_causal_skip=allow_is_causal_skip,
                        allow_is_bidirectional_skip=allow_is_bidirectional_skip, **kwargs)


def _key_padding(attention_mask: torch.Tensor | None, kv_length: int, kv_offset: int) -> torch.Tensor | None:
    """The (batch, kv_length) boolean key mask of the keys the attention will see, or None when
    nothing is padded (not checked while tracing: that would read the mask's values)."""

    if attention_mask is None:
        return None
    padding = mu.prepare_padding_mask(attention_mask, kv_length, kv_offset)[:, kv_offset:kv_offset + kv_length]
    if not is_tracing(padding) and bool(padding.all()):
        return None
    return padding


def _flash_path_functions():
    """flash-attn's five entry points as transformers' flash path loads them, served by tritonattn."""
    from transformers import modeling_flash_attention_utils as fau

    from tritonattn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

    return flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache, fau._pad_input, fau._unpad_input


def _install_flash_path() -> None:
    """Teach transformers' flash-attention loader the name FLASH_PATH_NAME: it then returns
    tritonattn's flash-attn-compatible functions instead of importing the ``flash_attn`` package or
    a hub kernel. (transformers has no public hook for a local flash-attn implementation; this
    wraps its loader, ``modeling_flash_attention_utils._lazy_imports``, for that one name only.)"""
    from transformers import modeling_flash_attention_utils as fau

    real = fau._lazy_imports
    if getattr(real, "_tritonattn", False):
        return

    def lazy_imports(implementation, *args, **kwargs):
        if implementation == FLASH_PATH_NAME:
            return _flash_path_functions()
        return real(implementation, *args, **kwargs)

    lazy_imports._tritonattn = True
    fau._lazy_imports = lazy_imports


def tritonattn_flash_path_forward(module, query, key, value, attention_mask, **kwargs):
    """``attn_implementation="tritonattn_fa"``: transformers' own flash-attention path (its unpadding,
    varlen and kwargs handling, exactly as for ``"flash_attention_2"``) running on tritonattn."""
    from transformers.integrations.flash_attention import flash_attention_forward

    return flash_attention_forward(module, query, key, value, attention_mask, **kwargs)


def register() -> None:
    """Register ``"tritonattn"`` (and ``"tritonattn_fa"``, transformers' own flash-attention path on
    tritonattn's flash-attn-compatible functions) with transformers' attention and mask interfaces
    (idempotent)."""
    from transformers import AttentionInterface
    ALL_MASK_ATTENTION_FUNCTIONS = mu.ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(NAME, tritonattn_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, tritonattn_mask)
    _install_flash_path()
    AttentionInterface.register(FLASH_PATH_NAME, tritonattn_flash_path_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(FLASH_PATH_NAME, ALL_MASK_ATTENTION_FUNCTIONS["flash_attention_2"])


register()
