"""Host side of the attention variants: what the launchers pass to every kernel.

One object carries the options of a call (scale, window / causal, softcap, ALiBi, bias, mask,
dropout) and turns them into the kernels' runtime arguments and constexpr flags, so every
launcher passes the same block of arguments in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tritonattn.kernels.common import LOG2E

MASK_NONE, MASK_KEYS, MASK_TILE = 0, 1, 2
WINDOW_CAP = 1 << 29  # see Variants.window_args


@dataclass
class Variants:
    softmax_scale: float
    win_left: int | None = None  # None: unbounded
    win_right: int | None = None  # None: unbounded; causal is 0 (top-left causal with Sq != Sk: Sq - Sk)
    softcap: float = 0.0
    alibi_slopes: torch.Tensor | None = None  # fp32 (Hq,) or (B, Hq)
    bias: torch.Tensor | None = None  # float, expanded (stride-0 views) to (B, Hq, Sq, Sk)
    mask: torch.Tensor | None = None  # uint8 view of a bool mask: (B, Hq, Sq, Sk) expanded, or (B, Sk) keys
    mask_kind: int = MASK_NONE
    dropout_p: float = 0.0
    seed: torch.Tensor | None = None  # int64 (1,) on the inputs' device
    deterministic: bool = False  # the caller asked for it: never the opt-in atomic-dQ backward
    # variable length: int32 (B + 1,) offsets into packed (total, H, D) tensors, and the longest lengths
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    # KV cache (forward only): keys of batch row b are cache rows [leftpad[b], kv_lens[b]) of cache row
    # batch_idx[b] (or b); paged caches are (num_blocks, page_size, H, D) addressed through block_table
    kv_lens: torch.Tensor | None = None
    kv_leftpad: torch.Tensor | None = None
    kv_batch_idx: torch.Tensor | None = None
    block_table: torch.Tensor | None = None
    page_size: int = 0
    kv_page_strides: tuple = (0, 0)
    # False: the caller reads no lse (an inference call that does not return it): the launcher writes it
    # to a kept buffer (fwd._discarded) instead of a new one
    need_lse: bool = True
    # an entry point's key of this call (interface._fast_key): the launcher links it to its launch
    # plan (plan.link), so that the next call with that key skips the checks and the launcher
    fast_key: tuple | None = None
    # the same call's key without its k / v length (kernels/decode.py free_key: a dense call that takes
    # the decoding kernel), linked to the length-free plan
    free_key: tuple | None = None

    def tensors(self) -> tuple:
        """The tensor fields, in a fixed order (None where unset): the slots of a launch plan."""
        return (self.alibi_slopes, self.bias, self.mask, self.seed, self.cu_seqlens_q, self.cu_seqlens_k,
                self.kv_lens, self.kv_leftpad, self.kv_batch_idx, self.block_table)

    def signature(self) -> tuple:
        """Everything a launcher's work depends on besides the tensors' contents: the scalar fields,
        and shape, strides and dtype of each tensor field (a launch plan's key, kernels/plan.py)."""
        return (self.softmax_scale, self.win_left, self.win_right, self.softcap, self.mask_kind, self.dropout_p,
                self.deterministic, self.max_seqlen_q, self.max_seqlen_k, self.page_size, self.kv_page_strides,
                self.need_lse,
                *(None if t is None else (t.shape, t.stride(), t.dtype) for t in self.tensors()))

    @property
    def varlen(self) -> bool:
        return self.cu_seqlens_q is not None

    def dims(self, q: torch.Tensor, k: torch.Tensor) -> tuple:
        """(B, Sq, Sk, Hq, Hkv, D); for variable length Sq / Sk are the longest sequences."""
        if self.varlen:
            return (self.cu_seqlens_q.shape[0] - 1, self.max_seqlen_q, self.max_seqlen_k,
                    q.shape[1], k.shape[1], q.shape[2])
        return q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3]

    def score_shape(self, q: torch.Tensor, k: torch.Tensor) -> tuple:
        """(B, Hq, Sq, Sk), what a bias or mask is expanded to; variable length: (B, Hq, max_seqlen_q,
        max_seqlen_k), entry [b, h, i, j] for query i and key j of sequence b (local indices)."""
        B, Sq, Sk, Hq, _, _ = self.dims(q, k)
        return B, Hq, Sq, Sk

    def lse_shape(self, q: torch.Tensor) -> tuple:
        return (q.shape[1], q.shape[0]) if self.varlen else (q.shape[0], q.shape[2], q.shape[1])

    def bshd_strides(self, t: torch.Tensor) -> tuple:
        """(batch, seq, head, dim) strides; packed variable-length tensors have no batch stride."""
        return (0, *t.stride()) if self.varlen else tuple(t.stride())

    def seq_args(self, q: torch.Tensor, lse: torch.Tensor) -> tuple:
        """CU_Q, CU_K and the (batch, head) strides of the lse / delta buffers."""
        if self.varlen:
            return self.cu_seqlens_q, self.cu_seqlens_k, 0, lse.stride(0)
        return q, q, lse.stride(0), lse.stride(1)

    @property
    def causal(self) -> bool:
        return self.win_right == 0

    def use_pages(self, block_table: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """K / V are paged caches (num_blocks, page_size, Hkv, D) read through ``block_table``: the
        kernels get one page for the row / head strides and address pages with these fields."""
        self.block_table, self.page_size = block_table, k_cache.shape[1]
        self.kv_page_strides = (k_cache.stride(0), v_cache.stride(0))

    @property
    def right_edge_only(self) -> bool:
        """No option but the scale and a window's right edge (a causal mask is one), dense or
        varlen: no left edge, softcap, ALiBi, bias, mask or dropout, no kv cache or pages."""
        return (self.win_left is None and self.softcap == 0 and self.alibi_slopes is None and self.bias is None
                and self.mask is None and self.dropout_p == 0 and self.kv_lens is None and self.block_table is None)

    @property
    def plain(self) -> bool:
        """Attention with no option but the scale, dense or varlen: :attr:`right_edge_only` without the
        right edge either (what a tile measured on plain calls may take)."""
        return self.right_edge_only and self.win_right is None

    @property
    def extra_smem(self) -> bool:
        """A bias or mask tile is read next to each score tile, or dropout's random bits are
        reshaped: the tile configs leave room for them (see configs.forward_config)."""
        return self.bias is not None or self.mask_kind == MASK_TILE or self.dropout_p > 0

    def constexprs(self) -> dict:
        return dict(
            WIN_LEFT=self.win_left is not None, WIN_RIGHT=self.win_right is not None, SOFTCAP=self.softcap > 0,
            HAS_ALIBI=self.alibi_slopes is not None, HAS_BIAS=self.bias is not None,
            MASK_KIND=self.mask_kind, HAS_DROPOUT=self.dropout_p > 0, IS_VARLEN=self.varlen,
        )

    def kernel_args(self, q: torch.Tensor) -> tuple:
        """BIAS + 4 strides, MASK + 4 strides, ALIBI + batch stride, SEED, dropout_p. Absent
        tensors are replaced by ``q`` (never read: their constexpr flag is off)."""
        bias = (self.bias, *self.bias.stride()) if self.bias is not None else (q, 0, 0, 0, 0)
        if self.mask is None:
            mask = (q, 0, 0, 0, 0)
        elif self.mask_kind == MASK_KEYS:  # (B, Sk): batch stride, no head / row stride
            mask = (self.mask, self.mask.stride(0), 0, 0, self.mask.stride(1))
        else:
            mask = (self.mask, *self.mask.stride())
        seed = self.seed if self.seed is not None else q
        return (*bias, *mask, *self.alibi_args(q), seed, float(self.dropout_p))

    def alibi_args(self, q: torch.Tensor) -> tuple:
        """ALIBI and its batch stride (0 for per-head slopes)."""
        if self.alibi_slopes is None:
            return q, 0
        return self.alibi_slopes, self.alibi_slopes.stride(0) if self.alibi_slopes.dim() == 2 else 0

    def cache_args(self, q: torch.Tensor) -> tuple:
        """KV_LENS, KV_LEFTPAD, KV_BATCH_IDX, BLOCK_TABLE, its batch stride, page_size and the page
        strides of K and V (placeholders when unused)."""
        bt = self.block_table
        return (self.kv_lens if self.kv_lens is not None else q,
                self.kv_leftpad if self.kv_leftpad is not None else q,
                self.kv_batch_idx if self.kv_batch_idx is not None else q,
                bt if bt is not None else q, bt.stride(0) if bt is not None else 0,
                max(self.page_size, 1), *self.kv_page_strides)

    def cache_constexprs(self) -> dict:
        return dict(KV_CACHE=self.kv_lens is not None, HAS_LEFTPAD=self.kv_leftpad is not None,
                    HAS_BATCH_IDX=self.kv_batch_idx is not None, PAGED=self.block_table is not None)

    def scale_args(self) -> tuple:
        """qk_scale (exp2 domain), softcap_scale (softmax_scale / softcap), softcap_log2."""
        qk_scale = self.softmax_scale * LOG2E.value
        if self.softcap > 0:
            return qk_scale, self.softmax_scale / self.softcap, self.softcap * LOG2E.value
        return qk_scale, 0.0, 0.0

    def window_args(self) -> tuple:
        """win_left, win_right for the kernels, capped at WINDOW_CAP: an edge that far out leaves every
        key of any sequence that fits in memory in the window, and the kernels add it to lengths and
        offsets in 32-bit integers (2^31 - 2 there wrapped round and masked every key)."""
        return min(self.win_left or 0, WINDOW_CAP), min(self.win_right or 0, WINDOW_CAP)
