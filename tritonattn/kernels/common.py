"""Shared @triton.jit helpers: matrix products, masks and the block ranges of causal attention.

Conventions used by every kernel:
- scores live in the exp2 domain: ``s2 = (q . k) * softmax_scale * log2(e)``;
- the softmax log-sum-exp ``lse`` is stored in natural log, float32, shape ``(B, Hq, Sq)``;
  a row that sees no key has ``lse = -inf`` and output 0;
- causal attention is aligned bottom-right: query row ``i`` sees key ``j`` iff ``j <= i + Sk - Sq``.
"""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def mma(a, b, acc, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr):
    """``acc + a @ b`` accumulated in fp32.

    DOT_FP32 upcasts the operands first: the Triton interpreter computes ``tl.dot`` on bf16
    operands wrongly (seen with triton 3.6 and 3.9), so under the interpreter bf16 products are
    done in fp32. On the GPU it is off and the tensor cores take the 16-bit operands directly.
    PRECISION is "ieee" for fp32 inputs (no silent tf32) and ignored for 16-bit operands.
    """
    if DOT_FP32:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def score_mask(offs_m, offs_n, Sq, Sk, IS_CAUSAL: tl.constexpr, TRANSPOSED: tl.constexpr = False):
    """Boolean [BLOCK_M, BLOCK_N] (or [BLOCK_N, BLOCK_M] when TRANSPOSED): which (query, key)
    pairs take part: the key is in range and, when causal, not after the query."""
    if TRANSPOSED:
        n = offs_n[:, None]
        m = offs_m[None, :]
    else:
        n = offs_n[None, :]
        m = offs_m[:, None]
    valid = n < Sk
    if IS_CAUSAL:
        valid = valid & (n <= m + (Sk - Sq))
    return valid


@triton.jit
def key_range(start_m, Sq, Sk, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr):
    """Key blocks a query block [start_m, start_m + BLOCK_M) must visit.

    Returns ``(full_hi, hi)``: keys in ``[0, full_hi)`` are visible to every row of the block
    and need no mask (full_hi is a multiple of BLOCK_N); keys in ``[full_hi, hi)`` need the mask
    (causal diagonal and the ragged end of the keys). Blocks past ``hi`` are skipped entirely.
    """
    if IS_CAUSAL:
        # row start_m sees keys j <= start_m + Sk - Sq; the last row sees j <= start_m + BLOCK_M - 1 + Sk - Sq
        hi = tl.minimum(tl.maximum(start_m + BLOCK_M + Sk - Sq, 0), Sk)
        full_hi = tl.maximum(start_m + 1 + Sk - Sq, 0)
        full_hi = tl.minimum(full_hi, Sk) // BLOCK_N * BLOCK_N
    else:
        hi = Sk
        full_hi = Sk // BLOCK_N * BLOCK_N
    return full_hi, hi


@triton.jit
def query_range(start_n, Sq, Sk, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr):
    """Query blocks a key block [start_n, start_n + BLOCK_N) must visit (for dK/dV).

    Returns ``(lo, full_lo)``: query rows in ``[lo, full_lo)`` need the causal mask, rows in
    ``[full_lo, Sq)`` see every key of the block. Both are multiples of BLOCK_M (full_lo may pass
    Sq). Rows past Sq need no mask: their lse is +inf, so their probabilities are 0.
    """
    if IS_CAUSAL:
        # key j is seen by rows i >= j - (Sk - Sq)
        lo = tl.maximum(start_n + Sq - Sk, 0) // BLOCK_M * BLOCK_M
        full_lo = tl.maximum(start_n + BLOCK_N - 1 + Sq - Sk, 0)
        full_lo = tl.cdiv(full_lo, BLOCK_M) * BLOCK_M
        full_lo = tl.maximum(full_lo, lo)
    else:
        lo = 0
        full_lo = 0
    return lo, full_lo
