"""A drop-in for ``torch.nn.functional.scaled_dot_product_attention``.

Same signature and semantics as PyTorch's: layout ``(..., heads, seqlen, headdim)``, ``is_causal``
aligned **top-left** (query ``i`` sees keys ``j <= i``, unlike flash-attn's bottom-right), boolean
masks True = attend, float masks added to the scores and differentiable, broadcasting,
``enable_gqa``, and ``attn_mask`` together with ``is_causal`` applying both (as PyTorch's math
backend does). Calls tritonattn cannot serve fall back to PyTorch's own SDPA with a warning, once
per reason: never a silently different result.
"""

from __future__ import annotations

import math
import warnings

import torch

from tritonattn.configs import interpreting

_TORCH_SDPA = torch.nn.functional.scaled_dot_product_attention
_SDPA_GRAD = "sdpa-grad"  # interface._fast_key's tag of a call that needs gradients
_warned: set[str] = set()
# Signatures of calls that passed every check (interface._signature of the three tensors, attn_mask
# (None or its shape, dtype and device) and the options) -> the Variants fields they gave: a repeated
# call (each layer, each step) skips the checks and the fallback test, whose results depend only on
# what the key holds, and only lays out its mask.
_VALIDATED: dict = {}


def _fallback_reason(query, key, value, attn_mask) -> str | None:
    tensors = (query, key, value)
    if any(not isinstance(t, torch.Tensor) for t in tensors):
        return "query, key and value must be tensors"
    if any(t.is_nested for t in tensors):
        return "nested tensors"
    if any(t.dtype not in (torch.float16, torch.bfloat16, torch.float32) for t in tensors):
        return f"dtype {query.dtype}"
    if len({t.dtype for t in tensors}) != 1:
        return "mixed dtypes"
    dev = query.device
    if any(t.device != dev for t in tensors) or not (dev.type == "cuda" or (dev.type == "cpu" and interpreting())):
        return f"tensors on {dev}"
    if query.dim() < 3 or key.dim() != query.dim() or value.dim() != query.dim():
        return "fewer than 3 dims or different ranks"
    if query.shape[-1] > 256 or key.shape[-1] != query.shape[-1] or value.shape[-1] != query.shape[-1]:
        return "head dims over 256 or different for q, k and v"
    if attn_mask is not None and (not isinstance(attn_mask, torch.Tensor) or attn_mask.is_nested
                                  or attn_mask.dtype not in (torch.bool, torch.float16, torch.bfloat16,
                                                             torch.float32)):
        return "attn_mask type"
    return None


def scaled_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """PyTorch's ``scaled_dot_product_attention`` computed by tritonattn's kernels (see the module doc)."""
    import tritonattn.interface as ti  # (deferred: it imports Triton; one import statement, not eight names)

    fast = free = None
    # an inference call (no mask, or a bool one) with the key of an earlier one: its launch plan, replayed
    if not torch.compiler.is_compiling() and type(query) is torch.Tensor and query.dim() == 4:
        fast = ti._fast_key("sdpa", query, key, value, (dropout_p, is_causal, scale, enable_gqa), attn_mask,
                            _SDPA_GRAD)
        if fast is not None and fast[0] is _SDPA_GRAD:  # a training call (no mask), as flash_attn_func's
            var = ti._GRAD_VARS.get(fast)
            if var is not None:
                u = ti._unwrap_if_dead
                return ti._function_apply("none", var, False, u(query).transpose(1, 2), u(key).transpose(1, 2),
                                          u(value).transpose(1, 2), None)[0].transpose(1, 2)
        elif fast is not None:
            # a replay takes the tensors' addresses, which the (B, S, H, D) views share: the views'
            # strides are the recorded call's (in the key), so no transpose is needed here
            res = ti.replay_linked(fast, query, key, value, attn_mask)
            if res is not None:
                return res[0].transpose(1, 2)
            # a decoding step over a cache whose length changes every call (no mask; not is_causal,
            # whose top-left window is a function of the lengths): the length-free plan, as
            # flash_attn_func's (the checks below read no length but key's and value's agreement)
            if attn_mask is None and not is_causal:
                free, res = ti._replay_free(fast, query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2))
                if res is not None:
                    return res[0].transpose(1, 2)
    sig = None
    if not torch.compiler.is_compiling():
        sig = ti._signature((query, key, value, attn_mask), (dropout_p, is_causal, scale, enable_gqa))
    var = ti._recall(sig, dropout_p, query, _VALIDATED)  # None unless this signature passed the checks
    if var is None:
        reason = _fallback_reason(query, key, value, attn_mask)
        if reason is not None:
            if reason not in _warned:
                _warned.add(reason)
                warnings.warn(f"tritonattn: falling back to torch's scaled_dot_product_attention ({reason})",
                              stacklevel=2)
            return _TORCH_SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                               scale=scale, enable_gqa=enable_gqa)

    lead = query.shape[:-3]
    Hq, Sq, D = query.shape[-3:]
    Hkv, Sk = key.shape[-3], key.shape[-2]
    if var is None:
        if key.shape[:-3] != lead or value.shape[:-3] != lead or value.shape[-2] != Sk or value.shape[-3] != Hkv:
            raise RuntimeError(f"scaled_dot_product_attention: shapes {tuple(query.shape)}, {tuple(key.shape)}, "
                               f"{tuple(value.shape)} do not match")
        if Hq != Hkv and not enable_gqa and Hkv != 1:
            raise RuntimeError(f"The size of tensor a ({Hq}) must match the size of tensor b ({Hkv}) at "
                               "non-singleton dimension 1 (pass enable_gqa=True for grouped-query attention)")
    four = len(lead) == 1
    B = lead[0] if four else math.prod(lead)
    # (..., H, S, D) -> (B, S, H, D) views: no copy when the leading dims flatten (4-d: no reshape at all)
    if four:
        q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    else:
        q = query.reshape(B, Hq, Sq, D).transpose(1, 2)
        k = key.reshape(B, Hkv, Sk, D).transpose(1, 2)
        v = value.reshape(B, Hkv, Sk, D).transpose(1, 2)
    bias = mask = None
    if attn_mask is not None:
        m = attn_mask
        if m.dim() > 3 and not four:  # several leading dims: broadcast over them, then flatten
            m = m.expand(*lead, *m.shape[-3:]).reshape(B, *m.shape[-3:])
        if m.dtype == torch.bool:
            mask = m
        else:
            bias = m
    if var is None:
        ti._check_qkv(q, k, v, names=("query", "key", "value"))
        var = ti._check_options(q, k, dropout_p, scale, False, (-1, -1), 0.0, None)
        if is_causal:
            var.win_right = Sq - Sk  # top-left: j <= i, i.e. j <= i + (Sk - Sq) + (Sq - Sk)
        ti._check_mask_and_bias(q, k, bias, mask, None, var)
        if sig is not None:
            ti._remember(sig, var, _VALIDATED)
    else:
        ti._lay_out_mask(q, k, mask, None, var)
    var.fast_key, var.free_key = fast, free  # (the launcher links them to its plan)
    out, _, _ = ti._apply("none", var, False, (q, k, v), bias, keep_lse=False)
    if fast is not None and fast[0] is _SDPA_GRAD:  # (after the call: it raised nothing)
        ti._keep_grad_var(fast, var)
    out = out.transpose(1, 2)
    return out if four else out.reshape(*lead, Hq, Sq, D)


class patch_sdpa:
    """Route ``torch.nn.functional.scaled_dot_product_attention`` to tritonattn, process-wide.

    ``patch_sdpa()`` patches at once and returns a handle whose ``undo()`` restores PyTorch's;
    ``with patch_sdpa(): ...`` patches for the block only. Models that call
    ``F.scaled_dot_product_attention`` (looked up at call time) need no edit."""

    def __init__(self) -> None:
        self._saved = torch.nn.functional.scaled_dot_product_attention
        torch.nn.functional.scaled_dot_product_attention = scaled_dot_product_attention

    def undo(self) -> None:
        torch.nn.functional.scaled_dot_product_attention = self._saved

    def __enter__(self) -> patch_sdpa:
        return self

    def __exit__(self, *exc) -> None:
        self.undo()
