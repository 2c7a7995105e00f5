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


@dataclass
class Variants:
    softmax_scale: float
    win_left: int = -1  # -1: unbounded
    win_right: int = -1  # -1: unbounded; causal is 0
    softcap: float = 0.0
    alibi_slopes: torch.Tensor | None = None  # fp32 (Hq,) or (B, Hq)
    bias: torch.Tensor | None = None  # float, expanded (stride-0 views) to (B, Hq, Sq, Sk)
    mask: torch.Tensor | None = None  # uint8 view of a bool mask: (B, Hq, Sq, Sk) expanded, or (B, Sk) keys
    mask_kind: int = MASK_NONE
    dropout_p: float = 0.0
    seed: torch.Tensor | None = None  # int64 (1,) on the inputs' device

    @property
    def causal(self) -> bool:
        return self.win_right == 0

    def constexprs(self) -> dict:
        return dict(
            WIN_LEFT=self.win_left >= 0, WIN_RIGHT=self.win_right >= 0, SOFTCAP=self.softcap > 0,
            HAS_ALIBI=self.alibi_slopes is not None, HAS_BIAS=self.bias is not None,
            MASK_KIND=self.mask_kind, HAS_DROPOUT=self.dropout_p > 0,
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
        if self.alibi_slopes is None:
            alibi = (q, 0)
        else:
            alibi = (self.alibi_slopes, self.alibi_slopes.stride(0) if self.alibi_slopes.dim() == 2 else 0)
        seed = self.seed if self.seed is not None else q
        return (*bias, *mask, *alibi, seed, float(self.dropout_p))

    def scale_args(self) -> tuple:
        """qk_scale (exp2 domain), softcap_scale (softmax_scale / softcap), softcap_log2."""
        qk_scale = self.softmax_scale * LOG2E.value
        if self.softcap > 0:
            return qk_scale, self.softmax_scale / self.softcap, self.softcap * LOG2E.value
        return qk_scale, 0.0, 0.0

    def window_args(self) -> tuple:
        return max(self.win_left, 0), max(self.win_right, 0)
