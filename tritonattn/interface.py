"""Public API, flash-attn 2.x compatible: same names, argument order, defaults and semantics.

Layout is ``(batch, seqlen, nheads, headdim)``. Causal masks are aligned to the bottom-right
corner of the score matrix, as in flash-attn >= 2.1: with ``Sq != Sk``, query row ``i`` sees key
``j`` iff ``j <= i + Sk - Sq``. A query row that sees no key returns 0 (its lse is ``-inf``) and
gets zero gradients.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from tritonattn.configs import interpreting
from tritonattn.ops import FlashAttnFunction

MAX_HEAD_DIM = 256
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

Returned = torch.Tensor | tuple  # out, or (out, softmax_lse, S_dmask)


def _check_tensor(name: str, t, ndim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} has dtype {t.dtype}; expected torch.float16, torch.bfloat16 or torch.float32")
    if t.device.type != "cuda" and not (t.device.type == "cpu" and interpreting()):
        raise ValueError(
            f"{name} is on {t.device}; tritonattn needs CUDA tensors "
            "(or CPU tensors with TRITON_INTERPRET=1 set before triton is imported)"
        )


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, names=("q", "k", "v")) -> None:
    nq, nk, nv = names
    for name, t in ((nk, k), (nv, v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but {nq} has {q.dtype}; all inputs must share one dtype")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but {nq} is on {q.device}")
    B, _, Hq, D = q.shape
    if k.shape != v.shape:
        raise ValueError(f"{nk} and {nv} must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[0] != B:
        raise ValueError(f"{nk} has batch size {k.shape[0]} but {nq} has {B}")
    if k.shape[3] != D:
        raise ValueError(f"{nk} has head dim {k.shape[3]} but {nq} has {D}")
    if not 1 <= D <= MAX_HEAD_DIM:
        raise ValueError(f"head dim {D} is not supported; expected 1 <= head dim <= {MAX_HEAD_DIM}")
    Hkv = k.shape[2]
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(
            f"number of query heads ({Hq}) must be a multiple of the number of key/value heads ({Hkv})"
        )


def _check_options(dropout_p, softmax_scale, window_size, softcap, alibi_slopes, head_dim: int) -> float:
    """Validate the options shared by every entry point; returns the softmax scale to use."""
    if dropout_p != 0.0:
        raise NotImplementedError("dropout_p > 0 is not supported yet (it comes with the attention variants)")
    if tuple(window_size) != (-1, -1):
        raise NotImplementedError("window_size other than (-1, -1) is not supported yet (attention variants)")
    if softcap != 0.0:
        raise NotImplementedError("softcap other than 0.0 is not supported yet (attention variants)")
    if alibi_slopes is not None:
        raise NotImplementedError("alibi_slopes is not supported yet (attention variants)")
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if (isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float))
            or not math.isfinite(softmax_scale)):
        raise TypeError(f"softmax_scale must be a finite float or None, got {softmax_scale!r}")
    return float(softmax_scale)


def _finish(out: torch.Tensor, lse: torch.Tensor, return_attn_probs: bool) -> Returned:
    # S_dmask is only meaningful with dropout; flash-attn's slot is kept for the same unpacking
    return (out, lse, None) if return_attn_probs else out


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: Sequence[int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> Returned:
    """Exact scaled dot-product attention with O(seqlen) memory.

    Args:
        q: ``(batch, seqlen_q, nheads, headdim)``, float16 / bfloat16 / float32.
        k, v: ``(batch, seqlen_k, nheads_k, headdim)``; ``nheads % nheads_k == 0`` (GQA / MQA:
            query heads ``[g*r, (g+1)*r)`` use kv head ``g``, ``r = nheads / nheads_k``).
        dropout_p, window_size, softcap, alibi_slopes: not supported yet; a non-default value
            raises ``NotImplementedError``.
        softmax_scale: defaults to ``1 / sqrt(headdim)``.
        causal: bottom-right aligned causal mask (see the module docstring).
        deterministic: accepted for compatibility; the backward is always deterministic.
        return_attn_probs: also return ``softmax_lse`` ``(batch, nheads, seqlen_q)`` float32
            (natural log) and ``S_dmask`` (``None`` without dropout).

    Returns:
        ``out`` ``(batch, seqlen_q, nheads, headdim)`` in the input dtype, or
        ``(out, softmax_lse, S_dmask)`` when ``return_attn_probs``.
    """
    _check_tensor("q", q, 4)
    _check_tensor("k", k, 4)
    _check_tensor("v", v, 4)
    _check_qkv(q, k, v)
    scale = _check_options(dropout_p, softmax_scale, window_size, softcap, alibi_slopes, q.shape[-1])
    out, lse = FlashAttnFunction.apply("none", scale, bool(causal), q, k, v)
    return _finish(out, lse, return_attn_probs)


def flash_attn_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: Sequence[int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> Returned:
    """As :func:`flash_attn_func` with ``kv`` ``(batch, seqlen_k, 2, nheads_k, headdim)``.

    The gradient of ``kv`` is written packed, with no concatenation copy.
    """
    _check_tensor("q", q, 4)
    _check_tensor("kv", kv, 5)
    if kv.shape[2] != 2:
        raise ValueError(f"kv must have shape (batch, seqlen_k, 2, nheads_k, headdim), got {tuple(kv.shape)}")
    _check_qkv(q, kv[:, :, 0], kv[:, :, 1], names=("q", "kv", "kv"))
    scale = _check_options(dropout_p, softmax_scale, window_size, softcap, alibi_slopes, q.shape[-1])
    out, lse = FlashAttnFunction.apply("kv", scale, bool(causal), q, kv)
    return _finish(out, lse, return_attn_probs)


def flash_attn_qkvpacked_func(
    qkv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: Sequence[int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> Returned:
    """As :func:`flash_attn_func` with ``qkv`` ``(batch, seqlen, 3, nheads, headdim)``.

    The gradient of ``qkv`` is written packed, with no concatenation copy.
    """
    _check_tensor("qkv", qkv, 5)
    if qkv.shape[2] != 3:
        raise ValueError(f"qkv must have shape (batch, seqlen, 3, nheads, headdim), got {tuple(qkv.shape)}")
    _check_qkv(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], names=("qkv", "qkv", "qkv"))
    scale = _check_options(dropout_p, softmax_scale, window_size, softcap, alibi_slopes, qkv.shape[-1])
    out, lse = FlashAttnFunction.apply("qkv", scale, bool(causal), qkv)
    return _finish(out, lse, return_attn_probs)
