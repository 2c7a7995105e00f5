"""Public API, flash-attn 2.x compatible: same names, argument order, defaults and semantics.

Layout is ``(batch, seqlen, nheads, headdim)``. Causal masks are aligned to the bottom-right
corner of the score matrix, as in flash-attn >= 2.1: with ``Sq != Sk``, query row ``i`` sees key
``j`` iff ``j <= i + Sk - Sq``. A query row that sees no key returns 0 (its lse is ``-inf``) and
gets zero gradients.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import torch

from tritonattn.configs import interpreting
from tritonattn.kernels.bwd import attention_probs
from tritonattn.kernels.fwd import attention_forward
from tritonattn.kernels.variants import MASK_KEYS, MASK_TILE, Variants
from tritonattn.ops import FlashAttnFunction, apply_compiled

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


def _check_options(q: torch.Tensor, k: torch.Tensor, dropout_p, softmax_scale, causal, window_size, softcap,
                   alibi_slopes, batch: int | None = None) -> Variants:
    """Validate the options shared by every entry point and turn them into kernel variants.
    q / k in (B, S, H, D); ``batch`` overrides B (variable length)."""
    B, Hq, D = q.shape[0] if batch is None else batch, q.shape[2], q.shape[3]
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be a float in [0, 1), got {dropout_p!r}")
    if softmax_scale is None:
        scale = 1.0 / math.sqrt(D)
    elif (isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float))
            or not math.isfinite(softmax_scale)):
        raise TypeError(f"softmax_scale must be a finite float or None, got {softmax_scale!r}")
    else:
        scale = float(softmax_scale)
    try:
        left, right = (int(w) for w in window_size)
        ok = left >= -1 and right >= -1 and all(float(w) == int(w) for w in window_size)
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"window_size must be two integers >= -1 (-1: unbounded), got {window_size!r}")
    if causal:
        right = 0  # flash-attn: causal is a window with no keys to the right of the diagonal
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not 0.0 <= softcap < math.inf:
        raise ValueError(f"softcap must be a finite float >= 0 (0: off), got {softcap!r}")
    if alibi_slopes is not None:
        if not isinstance(alibi_slopes, torch.Tensor):
            raise TypeError(f"alibi_slopes must be a torch.Tensor or None, got {type(alibi_slopes).__name__}")
        if alibi_slopes.dtype != torch.float32:
            raise TypeError(f"alibi_slopes must be float32, got {alibi_slopes.dtype}")
        if tuple(alibi_slopes.shape) not in ((Hq,), (B, Hq)):
            raise ValueError(f"alibi_slopes must have shape ({Hq},) or ({B}, {Hq}), got {tuple(alibi_slopes.shape)}")
        if alibi_slopes.device != q.device:
            raise ValueError(f"alibi_slopes is on {alibi_slopes.device} but q is on {q.device}")
        if alibi_slopes.stride(-1) != 1:
            alibi_slopes = alibi_slopes.contiguous()
    var = Variants(softmax_scale=scale, win_left=None if left == -1 else left,
                   win_right=None if right == -1 else right, softcap=float(softcap),
                   alibi_slopes=alibi_slopes, dropout_p=float(dropout_p))
    if dropout_p > 0:
        # drawn from the device's default generator, so torch.manual_seed makes runs reproducible;
        # kept on the device (the kernels load it): no host sync
        var.seed = torch.randint(0, 2**62, (1,), dtype=torch.int64, device=q.device)
    return var


def _check_mask_and_bias(q, k, bias, mask, key_padding_mask, var: Variants) -> None:
    """Validate the bias / mask arguments; store the masks in ``var`` (the bias goes through autograd)."""
    B, Sq, Hq = q.shape[0], q.shape[1], q.shape[2]
    Sk = k.shape[1]
    full = (B, Hq, Sq, Sk)

    def broadcastable(name, t):
        if t.dim() > 4 or any(s != 1 and s != f for s, f in zip(reversed(t.shape), reversed(full))):
            raise ValueError(f"{name} of shape {tuple(t.shape)} does not broadcast to (batch, nheads, seqlen_q, "
                             f"seqlen_k) = {full}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")

    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"bias must be a torch.Tensor or None, got {type(bias).__name__}")
        if bias.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"bias has dtype {bias.dtype}; expected a float tensor (use mask= for booleans)")
        broadcastable("bias", bias)
    masks = [(n, m) for n, m in (("mask", mask), ("key_padding_mask", key_padding_mask)) if m is not None]
    if len(masks) == 2:
        raise ValueError("give mask or key_padding_mask, not both")
    if masks:
        name, m = masks[0]
        if not isinstance(m, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(m).__name__}")
        if m.dtype != torch.bool:
            raise TypeError(f"{name} must be a bool tensor (True = take part), got {m.dtype}; "
                            "an additive float mask is a bias")
        if name == "key_padding_mask":
            if tuple(m.shape) != (B, Sk):
                raise ValueError(f"key_padding_mask must have shape (batch, seqlen_k) = {(B, Sk)}, "
                                 f"got {tuple(m.shape)}")
            m = m[:, None, None, :]
        broadcastable(name, m)
        m = m.expand(full).view(torch.uint8)
        if m.stride(1) == 0 and m.stride(2) == 0:  # one boolean per key: no S x S read
            var.mask, var.mask_kind = m[:, 0, 0, :], MASK_KEYS
        else:
            var.mask, var.mask_kind = m, MASK_TILE


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _finish(out: torch.Tensor, lse: torch.Tensor, probs, return_attn_probs: bool) -> Returned:
    return (out, lse, probs) if return_attn_probs else out


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
        dropout_p: dropout on the attention probabilities (scaled by 1 / (1 - p)), with a real
            backward; the keep-mask comes from Philox seeded by the device's default generator
            (``torch.manual_seed`` makes runs reproducible) and is regenerated, never stored.
        softmax_scale: defaults to ``1 / sqrt(headdim)``.
        causal: bottom-right aligned causal mask (see the module docstring).
        window_size: ``(left, right)``: query ``i`` sees keys ``j`` with
            ``i + Sk - Sq - left <= j <= i + Sk - Sq + right``; -1 leaves a side unbounded;
            ``causal`` sets ``right = 0``. Blocks outside the band are skipped.
        softcap: if > 0, scores become ``softcap * tanh(scores / softcap)`` (after scaling).
        alibi_slopes: float32 ``(nheads,)`` or ``(batch, nheads)``: adds
            ``-slope * |i + Sk - Sq - j|`` to the scores.
        deterministic: accepted for compatibility; the backward is always deterministic.
        return_attn_probs: also return ``softmax_lse`` ``(batch, nheads, seqlen_q)`` float32
            (natural log) and ``S_dmask``: with dropout, the ``(batch, nheads, seqlen_q,
            seqlen_k)`` probabilities, negated where dropped (a testing aid, S x S memory);
            ``None`` without dropout, as flash-attn.

    Returns:
        ``out`` ``(batch, seqlen_q, nheads, headdim)`` in the input dtype, or
        ``(out, softmax_lse, S_dmask)`` when ``return_attn_probs``.
    """
    _check_tensor("q", q, 4)
    _check_tensor("k", k, 4)
    _check_tensor("v", v, 4)
    _check_qkv(q, k, v)
    var = _check_options(q, k, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes)
    return_probs = return_attn_probs and dropout_p > 0
    if torch.compiler.is_compiling() and not return_probs:
        out, lse = apply_compiled(var, q, k, v, None)
        return _finish(out, lse, None, return_attn_probs)
    if not _needs_grad(q, k, v):  # inference: skip the autograd machinery (host time per call)
        out, lse = attention_forward(q, k, v, var)
        probs = attention_probs(q, k, v, lse, var) if return_probs else None
        return _finish(out, lse, probs, return_attn_probs)
    out, lse, probs = FlashAttnFunction.apply("none", var, return_probs, q, k, v, None)
    return _finish(out, lse, probs, return_attn_probs)


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
    var = _check_options(q, kv[:, :, 0], dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes)
    return_probs = return_attn_probs and dropout_p > 0
    out, lse, probs = FlashAttnFunction.apply("kv", var, return_probs, q, kv, None, None)
    return _finish(out, lse, probs, return_attn_probs)


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
    var = _check_options(qkv[:, :, 0], qkv[:, :, 1], dropout_p, softmax_scale, causal, window_size, softcap,
                         alibi_slopes)
    return_probs = return_attn_probs and dropout_p > 0
    out, lse, probs = FlashAttnFunction.apply("qkv", var, return_probs, qkv, None, None, None)
    return _finish(out, lse, probs, return_attn_probs)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    key_padding_mask: torch.Tensor | None = None,
    causal: bool = False,
    softmax_scale: float | None = None,
    dropout_p: float = 0.0,
    window_size: Sequence[int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    return_lse: bool = False,
) -> Returned:
    """:func:`flash_attn_func` plus arbitrary masks and an additive bias with gradient.

    Layout ``(batch, seqlen, nheads, headdim)`` as flash-attn. The score of query ``i`` and key
    ``j`` is ``softcap(q_i . k_j * softmax_scale) + alibi(i, j) + bias[b, h, i, j]``; pairs outside
    ``mask`` / ``key_padding_mask`` / the causal mask / the window take no part; a query that
    keeps no key outputs 0 with zero gradients.

    Args:
        bias: float tensor broadcastable to ``(batch, nheads, seqlen_q, seqlen_k)``; broadcast dims
            are read with stride 0, never expanded in memory. If it requires grad its gradient is
            returned in its own shape and dtype (summed over the broadcast dims).
        mask: bool tensor broadcastable the same way, True = take part (SDPA's convention).
        key_padding_mask: bool ``(batch, seqlen_k)``, True = real key: a fast path that reads one
            boolean per key instead of an S x S mask (a mask of shape (B, 1, 1, Sk) takes it too).
        causal, softmax_scale, dropout_p, window_size, softcap, alibi_slopes: as
            :func:`flash_attn_func` (causal bottom-right aligned).
        return_lse: also return the log-sum-exp ``(batch, nheads, seqlen_q)`` float32.
    """
    _check_tensor("q", q, 4)
    _check_tensor("k", k, 4)
    _check_tensor("v", v, 4)
    _check_qkv(q, k, v)
    var = _check_options(q, k, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes)
    _check_mask_and_bias(q, k, bias, mask, key_padding_mask, var)
    if torch.compiler.is_compiling():
        out, lse = apply_compiled(var, q, k, v, bias)
    else:
        out, lse, _ = FlashAttnFunction.apply("none", var, False, q, k, v, bias)
    return (out, lse) if return_lse else out


def _debug_checks() -> bool:
    """Checks that need a device sync (cu_seqlens contents) run on CPU tensors always, and on CUDA
    tensors only with TRITONATTN_DEBUG=1."""
    return os.environ.get("TRITONATTN_DEBUG", "0") not in ("", "0")


def _check_varlen(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> None:
    pairs = (("cu_seqlens_q", cu_seqlens_q, q.shape[0], "max_seqlen_q", max_seqlen_q),
             ("cu_seqlens_k", cu_seqlens_k, k.shape[0], "max_seqlen_k", max_seqlen_k))
    for name, cu, _, max_name, max_len in pairs:
        if not isinstance(cu, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(cu).__name__}")
        if cu.dtype != torch.int32:
            raise TypeError(f"{name} must be int32, got {cu.dtype}")
        if cu.dim() != 1 or cu.shape[0] < 2:
            raise ValueError(f"{name} must have shape (batch + 1,) with batch >= 1, got {tuple(cu.shape)}")
        if cu.device != q.device:
            raise ValueError(f"{name} is on {cu.device} but q is on {q.device}")
        if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 0:
            raise ValueError(f"{max_name} must be an int >= 0, got {max_len!r}")
    if cu_seqlens_q.shape[0] != cu_seqlens_k.shape[0]:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k describe {cu_seqlens_q.shape[0] - 1} and "
                         f"{cu_seqlens_k.shape[0] - 1} sequences")
    if not (q.device.type == "cpu" or _debug_checks()):
        return
    for name, cu, total, max_name, max_len in pairs:
        lens = cu[1:] - cu[:-1]
        if cu[0].item() != 0 or bool((lens < 0).any()):
            raise ValueError(f"{name} must start at 0 and never decrease, got {cu.tolist()}")
        if cu[-1].item() != total:
            raise ValueError(f"{name}[-1] = {cu[-1].item()} but the packed tensor holds {total} tokens")
        longest = int(lens.max().item())
        if longest > max_len:
            raise ValueError(f"{name} has a sequence of {longest} tokens, longer than {max_name} = {max_len}")


def _varlen_call(packing, var, q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, return_attn_probs,
                 block_table, tensors):
    if block_table is not None:
        raise NotImplementedError("block_table (paged KV) is not supported by the varlen functions yet")
    var.cu_seqlens_q, var.cu_seqlens_k = cu_seqlens_q, cu_seqlens_k
    var.max_seqlen_q, var.max_seqlen_k = int(max_seqlen_q), int(max_seqlen_k)
    return_probs = return_attn_probs and var.dropout_p > 0
    out, lse, probs = FlashAttnFunction.apply(packing, var, return_probs, *tensors, None)
    return _finish(out, lse, probs, return_attn_probs)


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: Sequence[int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: torch.Tensor | None = None,
) -> Returned:
    """Attention over a batch of sequences of different lengths packed along the tokens.

    Args:
        q: ``(total_q, nheads, headdim)``; k, v: ``(total_k, nheads_k, headdim)``.
        cu_seqlens_q, cu_seqlens_k: int32 ``(batch + 1,)``, the cumulative lengths (sequence ``b``
            is rows ``cu[b]:cu[b + 1]``); empty sequences are allowed. Their contents are checked
            on CPU tensors, and on CUDA tensors with ``TRITONATTN_DEBUG=1`` (a device sync).
        max_seqlen_q, max_seqlen_k: the longest sequence lengths (size the launch grid).
        The other arguments as :func:`flash_attn_func`; each sequence gives exactly what the
        dense call gives on that sequence alone (causal bottom-right within each sequence).

    Returns:
        ``out`` ``(total_q, nheads, headdim)``, or ``(out, softmax_lse, S_dmask)`` with lse
        ``(nheads, total_q)`` float32 and S_dmask ``(batch, nheads, max_seqlen_q, max_seqlen_k)``
        with dropout (``None`` without).
    """
    _check_tensor("q", q, 3)
    _check_tensor("k", k, 3)
    _check_tensor("v", v, 3)
    _check_qkv(q[None], k[None], v[None])
    _check_varlen(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    var = _check_options(q[None], k[None], dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                         batch=cu_seqlens_q.shape[0] - 1)
    return _varlen_call("none", var, q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                        return_attn_probs, block_table, (q, k, v))


def flash_attn_varlen_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: Sequence[int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> Returned:
    """As :func:`flash_attn_varlen_func` with ``kv`` ``(total_k, 2, nheads_k, headdim)``; the
    gradient of ``kv`` is written packed."""
    _check_tensor("q", q, 3)
    _check_tensor("kv", kv, 4)
    if kv.shape[1] != 2:
        raise ValueError(f"kv must have shape (total_k, 2, nheads_k, headdim), got {tuple(kv.shape)}")
    k, v = kv[:, 0], kv[:, 1]
    _check_qkv(q[None], k[None], v[None], names=("q", "kv", "kv"))
    _check_varlen(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    var = _check_options(q[None], k[None], dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                         batch=cu_seqlens_q.shape[0] - 1)
    return _varlen_call("kv", var, q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                        return_attn_probs, None, (q, kv, None))


def flash_attn_varlen_qkvpacked_func(
    qkv: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: Sequence[int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> Returned:
    """As :func:`flash_attn_varlen_func` with ``qkv`` ``(total, 3, nheads, headdim)`` and one
    ``cu_seqlens`` / ``max_seqlen`` for queries and keys; the gradient of ``qkv`` is written packed."""
    _check_tensor("qkv", qkv, 4)
    if qkv.shape[1] != 3:
        raise ValueError(f"qkv must have shape (total, 3, nheads, headdim), got {tuple(qkv.shape)}")
    q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
    _check_qkv(q[None], k[None], v[None], names=("qkv", "qkv", "qkv"))
    _check_varlen(q, k, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen)
    var = _check_options(q[None], k[None], dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                         batch=cu_seqlens.shape[0] - 1)
    return _varlen_call("qkv", var, q, k, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, return_attn_probs,
                        None, (qkv, None, None))
