"""Hugging Face transformers attention backend: ``attn_implementation="tritonattn"``.

Importing this module (or calling :func:`register`) registers the backend with transformers'
``AttentionInterface`` and its mask interface, so ``from_pretrained(..., attn_implementation=
"tritonattn")`` and ``model.set_attn_implementation("tritonattn")`` work for models that use the
attention interface (Llama, Mistral, Qwen2/3, Gemma...). The name avoids "flash": transformers
treats such names as flash-attn hub kernels.

- no mask (pure causal / bidirectional): the flash-attn path, causal aligned bottom-right (right
  for generation with a cache: the new queries are the last ones), GQA without repeat_kv;
- packed sequences (``cu_seq_lens_q`` / ``cu_seq_lens_k`` kwargs, batch 1): the varlen path;
- any other mask: transformers' boolean SDPA-style mask (True = attend) on the mask path;
- q / k / v of different dtypes (autocast: rotary embeddings return fp32 q / k) are cast to the
  autocast dtype, or to v's dtype without autocast;
- ``scaling``, ``dropout``, ``sliding_window`` (window of ``sliding_window - 1`` keys to the left,
  as transformers' flash path) and ``softcap`` are honoured; ``output_attentions=True`` raises.
"""

from __future__ import annotations

import torch

NAME = "tritonattn"


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
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    query, key, value = _common_dtype(query, key, value)
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)  # (B, S, H, D) views
    window = (sliding_window - 1, -1) if sliding_window else (-1, -1)
    opts = dict(softmax_scale=scaling, dropout_p=dropout if module.training else 0.0, window_size=window,
                softcap=softcap or 0.0)
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None and cu_k is not None and q.shape[0] == 1:
        out = flash_attn_varlen_func(q[0], k[0], v[0], cu_q.to(torch.int32), cu_k.to(torch.int32),
                                     int(kwargs["max_length_q"]), int(kwargs["max_length_k"]), causal=causal, **opts)
        return out[None], None
    if attention_mask is None:
        return flash_attn_func(q, k, v, causal=causal and q.shape[1] > 1, **opts), None
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


def register() -> None:
    """Register ``"tritonattn"`` with transformers' attention and mask interfaces (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(NAME, tritonattn_attention_forward)
    # boolean (batch, 1, q, kv) masks, or None when the mask is purely causal / absent
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)


register()
