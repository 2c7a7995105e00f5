"""Inference: ``flash_attn_with_kvcache`` (flash-attn 2.x semantics), contiguous or paged KV cache.

The new keys / values are appended to the cache in place (rotary applied first when cos / sin are
given), then attention runs over each batch row's valid cache prefix with the forward kernel,
which reads paged caches through the block table row by row.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from tritonattn.interface import _check_options, _check_pages, _check_qkv, _check_tensor, _debug_checks, _signature
from tritonattn.kernels.decode import cache_append, decode_forward
from tritonattn.kernels.fwd import attention_forward
from tritonattn.kernels.variants import Variants

# split-KV decoding packs seqlen_q x (nheads / nheads_k) query rows into one tile
DECODE_MAX_ROWS = 64


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                 interleaved: bool) -> torch.Tensor:
    """Rotary embedding of ``x`` (B, S, H, D) at ``positions`` (B, S) with tables (seqlen_ro, rotary_dim / 2).

    Rotates the first ``rotary_dim`` dims of the head dim: interleaved pairs (x0, x1), (x2, x3), ...
    (GPT-J) or the two halves (GPT-NeoX). Computed in fp32, returned in x's dtype."""
    rot = cos.shape[-1] * 2
    c = cos[positions].float()[:, :, None, :]  # (B, S, 1, rot/2)
    s = sin[positions].float()[:, :, None, :]
    xr = x[..., :rot].float()
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        out = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., : rot // 2], xr[..., rot // 2:]
        out = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    return torch.cat((out.to(x.dtype), x[..., rot:]), dim=-1)


@functools.lru_cache(maxsize=256)
def _filled(B: int, value: int, device: torch.device) -> torch.Tensor:
    """int32 (B,) filled with ``value``, kept between calls (host time: no allocation and fill per
    decoding step); only ever read."""
    return torch.full((B,), value, dtype=torch.int32, device=device)


def _int_tensor(name: str, t, B: int, device) -> torch.Tensor | None:
    if t is None:
        return None
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or tuple(t.shape) != (B,):
        raise TypeError(f"{name} must be an int32 tensor of shape ({B},), got "
                        f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}"
                        f"{' ' + str(t.dtype) if isinstance(t, torch.Tensor) else ''}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but q is on {device}")
    return t


# Signatures of calls that passed every check (each step of a decoding loop repeats one), as
# interface._signature; of an int cache_seqlens only the type (its range is checked on every call).
# Not while torch.compile traces, not with ALiBi slopes. Checks of tensor contents (TRITONATTN_DEBUG,
# CPU tensors) run on every call.
_KV_VALIDATED: dict = {}


def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    rotary_cos: torch.Tensor | None = None,
    rotary_sin: torch.Tensor | None = None,
    cache_seqlens: int | torch.Tensor | None = None,
    cache_batch_idx: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: Sequence[int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: torch.Tensor | None = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
):
    """Attention of new queries over a KV cache, appending new keys / values in place.

    Args:
        q: ``(batch, seqlen_q, nheads, headdim)``.
        k_cache, v_cache: ``(batch_cache, seqlen_cache, nheads_k, headdim)``, or with
            ``block_table`` paged ``(num_blocks, page_size, nheads_k, headdim)`` (any page size).
        k, v: optional new tokens ``(batch, seqlen_new, nheads_k, headdim)``, written into the cache
            at rows ``cache_seqlens[b] ...`` before attention (in place). Batch rows must not share
            cache rows (a repeated ``cache_batch_idx``, a page in two rows of ``block_table``):
            whether one row then sees another's new tokens depends on the kernel (as in flash-attn,
            whose kernel appends too).
        rotary_cos, rotary_sin: optional ``(seqlen_ro, rotary_dim / 2)``: rotary embedding applied
            to the new k (at their positions) and to q (at the same positions when causal or with
            a window, else all at position ``cache_seqlens``), positions counted from ``cache_leftpad``.
        cache_seqlens: int or int32 ``(batch,)``: tokens already in the cache (default: all of it).
        cache_batch_idx: int32 ``(batch,)``: cache row of each batch row (contiguous caches).
        cache_leftpad: int32 ``(batch,)``: the cache of row b starts at this index.
        block_table: int32 ``(batch, max_blocks)``: pages of each row (paged cache).
        softmax_scale, causal, window_size, softcap, alibi_slopes: as ``flash_attn_func``; causal is
            aligned bottom-right (the new queries are the last ones).
        num_splits: how many key splits the decoding kernel uses (every query of a kv head's GQA
            group in one tile, splits merged by log-sum-exp; 1: no split, the kernel writes the
            output itself; at most 128 are used); 0 picks one split for caches of at most 1024
            rows (one launch), else about one wave of programs, and one split once batch x
            nheads_k fills two waves of the GPU's SMs. That kernel runs when
            ``seqlen_q * nheads / nheads_k <= 64``; longer query blocks take the forward kernel
            (one program per query block, no split), and ``num_splits`` is then only a hint, as
            results do not depend on it.
        return_softmax_lse: also return the lse ``(batch, nheads, seqlen_q)``.
    """
    compiling = torch.compiler.is_compiling()  # torch.compile traces: checks only, then the custom op
    lens_tensor = isinstance(cache_seqlens, torch.Tensor)
    key = None if compiling or alibi_slopes is not None else _signature(
        (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens if lens_tensor else None, cache_batch_idx,
         cache_leftpad, block_table),
        (None if lens_tensor else type(cache_seqlens), softmax_scale, causal, window_size, softcap, rotary_interleaved,
         num_splits))
    known = None if key is None else _KV_VALIDATED.get(key)
    if known is not None:  # this signature passed the checks before (every step of a decoding loop)
        B, Sq, Hq, D, paged, page_size, capacity, n_new, fields = known
        batch_idx, leftpad = cache_batch_idx, cache_leftpad
        if cache_seqlens is None:
            seqlens = _filled(B, capacity, q.device)
        elif type(cache_seqlens) is int:
            if not 0 <= cache_seqlens <= capacity:
                raise ValueError(f"cache_seqlens = {cache_seqlens} is outside [0, {capacity}]")
            seqlens = _filled(B, cache_seqlens, q.device)
        else:
            seqlens = cache_seqlens
        var = Variants(**fields)
    else:
        page_size = 0
        _check_tensor("q", q, 4)
        _check_tensor("k_cache", k_cache, 4)
        _check_tensor("v_cache", v_cache, 4)
        B, Sq, Hq, D = q.shape
        paged = block_table is not None
        if paged:
            if not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32 or block_table.dim() != 2 \
                    or block_table.shape[0] != B:
                raise ValueError(f"block_table must be an int32 tensor of shape ({B}, max_blocks)")
            if block_table.device != q.device:
                raise ValueError(f"block_table is on {block_table.device} but q is on {q.device}")
            if cache_batch_idx is not None:
                raise ValueError("cache_batch_idx cannot be used with a paged cache (block_table)")
            page_size = k_cache.shape[1]
            capacity = block_table.shape[1] * page_size
        else:
            capacity = k_cache.shape[1]
        if v_cache.shape != k_cache.shape:
            raise ValueError(f"k_cache and v_cache must have the same shape, got {tuple(k_cache.shape)} and "
                             f"{tuple(v_cache.shape)}")
        # the shared shape / dtype / head checks, on the cache seen as (batch, capacity, Hkv, D)
        _check_qkv(q, _CacheView(B, capacity, k_cache), _CacheView(B, capacity, v_cache),
                   names=("q", "k_cache", "v_cache"))
        # without cache_batch_idx, batch row b uses cache row b (flash-attn's): a cache of more rows is fine
        if not paged and cache_batch_idx is None and k_cache.shape[0] < B:
            raise ValueError(f"k_cache holds {k_cache.shape[0]} rows, fewer than q's batch {B} (without "
                             "cache_batch_idx, batch row b uses cache row b)")
        batch_idx = _int_tensor("cache_batch_idx", cache_batch_idx, B, q.device)
        leftpad = _int_tensor("cache_leftpad", cache_leftpad, B, q.device)

        if cache_seqlens is None:
            seqlens = None if compiling else _filled(B, capacity, q.device)
        elif isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
            if not 0 <= cache_seqlens <= capacity:
                raise ValueError(f"cache_seqlens = {cache_seqlens} is outside [0, {capacity}]")
            seqlens = None if compiling else _filled(B, cache_seqlens, q.device)
        else:
            seqlens = _int_tensor("cache_seqlens", cache_seqlens, B, q.device)

        n_new = 0
        if (k is None) != (v is None):
            raise ValueError("give both k and v (new tokens) or neither")
        if k is not None:
            _check_tensor("k", k, 4)
            _check_tensor("v", v, 4)
            if k.shape != v.shape or k.shape[0] != B or k.shape[2:] != k_cache.shape[2:] or k.dtype != k_cache.dtype:
                raise ValueError(f"k and v must have shape ({B}, seqlen_new, {k_cache.shape[2]}, {D}) and the cache's "
                                 f"dtype, got {tuple(k.shape)} {k.dtype} and {tuple(v.shape)} {v.dtype}")
            n_new = k.shape[1]
        if (rotary_cos is None) != (rotary_sin is None):
            raise ValueError("give both rotary_cos and rotary_sin or neither")
        if rotary_cos is not None:
            if rotary_cos.shape != rotary_sin.shape or rotary_cos.dim() != 2 or rotary_cos.shape[1] * 2 > D:
                raise ValueError(f"rotary_cos / rotary_sin must have shape (seqlen_ro, rotary_dim / 2) with rotary_dim "
                                 f"<= {D}, got {tuple(rotary_cos.shape)} and {tuple(rotary_sin.shape)}")
        if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 0:
            raise ValueError(f"num_splits must be an int >= 0, got {num_splits!r}")
        var = _check_options(q, q, 0.0, softmax_scale, causal, window_size, softcap, alibi_slopes)
        if key is not None:
            if len(_KV_VALIDATED) >= 4096:
                _KV_VALIDATED.clear()
            _KV_VALIDATED[key] = (B, Sq, Hq, D, paged, page_size, capacity, n_new, dict(
                softmax_scale=var.softmax_scale, win_left=var.win_left, win_right=var.win_right, softcap=var.softcap))
    if not compiling and (q.device.type == "cpu" or _debug_checks()):  # contents: a device sync on CUDA
        start = leftpad if leftpad is not None else torch.zeros_like(seqlens)
        if bool((seqlens < start).any()) or bool((seqlens + n_new > capacity).any()):
            raise ValueError(f"cache_seqlens (+ {n_new} new tokens) must lie in [cache_leftpad, {capacity}], got "
                             f"{seqlens.tolist()}")
        if rotary_cos is not None and int((seqlens - start).max()) + max(n_new, Sq) > rotary_cos.shape[0]:
            raise ValueError(f"rotary tables of {rotary_cos.shape[0]} positions are too short")
        # rows and pages the call reads or writes must lie in the cache (else reads out of bounds)
        if batch_idx is not None and bool(((batch_idx < 0) | (batch_idx >= k_cache.shape[0])).any()):
            raise ValueError(f"cache_batch_idx must index rows of k_cache (0 <= i < {k_cache.shape[0]}), got "
                             f"{batch_idx.tolist()}")
        if paged:  # the pages of rows [cache_leftpad, cache_seqlens + new) of each batch row
            _check_pages(block_table, page_size, k_cache.shape[0], seqlens + n_new, "k_cache", start=start)

    if compiling:
        seqlens_t, seqlens_int = (cache_seqlens, -1) if isinstance(cache_seqlens, torch.Tensor) else \
            (None, -1 if cache_seqlens is None else cache_seqlens)
        out, lse = kvcache_fwd_op(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, seqlens_t, seqlens_int,
                                  cache_batch_idx, cache_leftpad, block_table,
                                  None if softmax_scale is None else float(softmax_scale), bool(causal),
                                  int(window_size[0]), int(window_size[1]), float(softcap),
                                  bool(rotary_interleaved), alibi_slopes, num_splits)
        return (out, lse) if return_softmax_lse else out
    local = var.win_left is not None or var.win_right is not None  # causal or a window: q at its own position
    # the decoding kernel holds a kv head's whole GQA group of queries in one tile: a few rows only
    split = Sq * (Hq // k_cache.shape[2]) <= DECODE_MAX_ROWS
    new = None
    if split:  # rotary on q and the new keys, and the append, inside the decoding kernel
        if rotary_cos is not None or n_new:
            new = (k, v, rotary_cos, rotary_sin, rotary_interleaved, local, k_cache.shape[0])
        var.kv_lens = seqlens
    else:  # the same before the forward kernel, as one kernel of its own
        q, var.kv_lens = cache_append(q, k, v, k_cache, v_cache, rotary_cos, rotary_sin, seqlens, leftpad, batch_idx,
                                      block_table, rotary_interleaved, local)
    var.kv_leftpad, var.kv_batch_idx = leftpad, batch_idx
    if paged:
        var.use_pages(block_table, k_cache, v_cache)
        # the kernel reads pages through the block table: pass one page per row, batch stride 0
        k_arg, v_arg = k_cache[:1].expand(B, *k_cache.shape[1:]), v_cache[:1].expand(B, *v_cache.shape[1:])
    else:
        k_arg, v_arg = k_cache, v_cache
    # (the launchers allocate their outputs and launch Triton kernels: nothing for autograd to record,
    # so no no_grad context, ~1 us a step)
    if split:
        out, lse = decode_forward(q, k_arg, v_arg, var, capacity, num_splits, new)
    else:
        out, lse = attention_forward(q, k_arg, v_arg, var)
    return (out, lse) if return_softmax_lse else out


class _CacheView:
    """A shape-and-dtype stand-in for the cache seen as (batch, capacity, Hkv, D), for the shared checks."""

    def __init__(self, B, capacity, cache):
        self.shape = torch.Size((B, capacity, *cache.shape[2:]))
        self.dtype, self.device = cache.dtype, cache.device


# ---------------------------------------------------------------------------------------------
# torch.compile: the whole call as one torch.library op that writes the new keys / values into the
# caches in place (declared as mutated, so functionalization orders it), opaque to dynamo.

@torch.library.custom_op("tritonattn::fwd_kvcache", mutates_args=("k_cache", "v_cache"))
def kvcache_fwd_op(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
    rotary_cos: torch.Tensor | None, rotary_sin: torch.Tensor | None, cache_seqlens: torch.Tensor | None,
    cache_seqlens_int: int, cache_batch_idx: torch.Tensor | None, cache_leftpad: torch.Tensor | None,
    block_table: torch.Tensor | None, softmax_scale: float | None, causal: bool, win_left: int, win_right: int,
    softcap: float, rotary_interleaved: bool, alibi_slopes: torch.Tensor | None, num_splits: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`flash_attn_with_kvcache` as an op (``cache_seqlens_int`` >= 0: an int ``cache_seqlens``;
    -1 with ``cache_seqlens`` None: the whole cache). Returns ``(out, lse)``, out contiguous."""
    seqlens = cache_seqlens if cache_seqlens is not None else (None if cache_seqlens_int < 0 else cache_seqlens_int)
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, seqlens, cache_batch_idx,
                                       cache_leftpad, block_table, softmax_scale, causal, (win_left, win_right),
                                       softcap, rotary_interleaved, alibi_slopes, num_splits, return_softmax_lse=True)
    return out.contiguous(), lse


@kvcache_fwd_op.register_fake
def _(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_seqlens_int, cache_batch_idx,
      cache_leftpad, block_table, softmax_scale, causal, win_left, win_right, softcap, rotary_interleaved,
      alibi_slopes, num_splits):
    B, Sq, Hq, _ = q.shape
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            q.new_empty((B, Hq, Sq), dtype=torch.float32))
