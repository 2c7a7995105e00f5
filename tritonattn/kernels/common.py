"""Shared @triton.jit helpers: matrix products, score variants, dropout and block ranges.

Conventions used by every kernel:
- scores live in the exp2 domain: ``s2 = score * log2(e)`` where
  ``score = softcap(q . k * softmax_scale) + alibi + bias``, ``-inf`` where masked;
- the softmax log-sum-exp ``lse`` is stored in natural log, float32, shape ``(B, Hq, Sq)``;
  a row that sees no key has ``lse = -inf`` and output 0;
- with ``d = Sk - Sq``, query row ``i`` sees key ``j`` iff ``j < Sk`` and
  ``i + d - win_left <= j <= i + d + win_right``; causal is ``win_right = 0``; an unbounded side
  has its WIN_* flag off (bottom-right alignment, as flash-attn >= 2.1).

Orientation: the helpers take query indices ``i`` and key indices ``j`` already shaped to broadcast
against the score tile, so the same code serves [BLOCK_M, BLOCK_N] tiles (forward, dQ) and the
transposed [BLOCK_N, BLOCK_M] tiles of the dK/dV kernel.
"""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
# the upper bound of the last length class of a packed call (seq_bounds' LEN_HI default)
LENGTH_CAP = 2**31 - 1


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
def row_tiles(A, B, stride_a, stride_b, rows, p_a, p_b, HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr,
              BLOCK_D: tl.constexpr, TMA: tl.constexpr):
    """With TMA: tensor descriptors over two ``[rows, HEAD_DIM]`` row-major blocks starting at ``A``
    and ``B`` (K and V, or Q and dO, of one head), read as ``[BLOCK_R, BLOCK_D]`` tiles, rows past
    ``rows`` as zeros (the host checked: unit dim stride, 16-byte aligned bases and row strides).
    Without: the pointers ``p_a`` / ``p_b``, unchanged."""
    a = p_a
    b = p_b
    if TMA:
        a = tl.make_tensor_descriptor(A, shape=[rows, HEAD_DIM], strides=[stride_a, 1], block_shape=[BLOCK_R, BLOCK_D])
        b = tl.make_tensor_descriptor(B, shape=[rows, HEAD_DIM], strides=[stride_b, 1], block_shape=[BLOCK_R, BLOCK_D])
    return a, b


@triton.jit
def load_row_pair(a_desc, b_desc, p_a, p_b, stride_a, stride_b, start, offs, mask, TMA: tl.constexpr):
    """The two tiles of rows ``offs`` (from ``start``) of the blocks :func:`row_tiles` described: through
    the descriptors with TMA, else through the pointers ``p_a`` / ``p_b`` (row strides ``stride_a`` /
    ``stride_b``), ``mask``-ed, zeros elsewhere."""
    if TMA:  # descriptor offsets are 32-bit
        a = a_desc.load([tl.cast(start, tl.int32), 0])
        b = b_desc.load([tl.cast(start, tl.int32), 0])
    else:
        rows = offs[:, None].to(tl.int64)
        a = tl.load(p_a + rows * stride_a, mask=mask, other=0.0)
        b = tl.load(p_b + rows * stride_b, mask=mask, other=0.0)
    return a, b


@triton.jit
def tanh(x, PRECISE: tl.constexpr):
    # 1 - 2 / (e^{2x} + 1): exact limits +-1 for large |x| (exp2 overflows to inf or underflows to 0),
    # but near 0 it subtracts two numbers near 1: an absolute error of fp32's eps, eps / |x| relative
    # (the softcap multiplies it by the cap: with cap 50 the fp32 dK was 4.4x torch's error). PRECISE
    # (fp32 inputs): below |x| = 1/4 the odd Taylor series to x^9 instead (relative error under 1e-8
    # there). 16-bit inputs keep the one formula: its error is far below their resolution, and the
    # series cost the softcap path 15-19% of its speed on the H200 (twentieth session).
    t = 1.0 - 2.0 / (tl.math.exp2(x * (2.0 * LOG2E)) + 1.0)
    if PRECISE:
        x2 = x * x
        series = x + x * x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0 + x2 * (62.0 / 2835.0))))
        t = tl.where(tl.abs(x) < 0.25, series, t)
    return t


@triton.jit
def head_setup(off_b, off_h, off_bh,
               BIAS, stride_bias_b, stride_bias_h, MASK, stride_mask_b, stride_mask_h,
               ALIBI, stride_alibi_b, SEED,
               HAS_BIAS: tl.constexpr, MASK_KIND: tl.constexpr, HAS_ALIBI: tl.constexpr,
               HAS_DROPOUT: tl.constexpr):
    """Per (batch, query head) state of the variants: bias / mask base pointers, the ALiBi slope
    (exp2 domain) and the dropout key. Unused ones are returned as harmless placeholders."""
    p_bias = BIAS
    if HAS_BIAS:
        p_bias = BIAS + off_b * stride_bias_b + off_h * stride_bias_h
    p_mask = MASK
    if MASK_KIND != 0:
        p_mask = MASK + off_b * stride_mask_b + off_h * stride_mask_h
    slope2 = 0.0
    if HAS_ALIBI:
        slope2 = tl.load(ALIBI + off_b * stride_alibi_b + off_h).to(tl.float32) * LOG2E
    seed = 0
    if HAS_DROPOUT:
        # one Philox key per (batch, head): the counters (i * Sk + j) then only need 32 bits per head
        seed = tl.load(SEED) + off_bh * 1000003
    return p_bias, p_mask, slope2, seed


@triton.jit
def in_bounds(i, j, Sq, Sk, win_left, win_right, WIN_LEFT: tl.constexpr, WIN_RIGHT: tl.constexpr):
    """Key ``j`` exists and lies in query ``i``'s window (causal is ``win_right = 0``)."""
    valid = j < Sk
    if WIN_RIGHT:
        valid = valid & (j <= i + (Sk - Sq) + win_right)
    if WIN_LEFT:
        valid = valid & (j >= i + (Sk - Sq) - win_left)
    return valid


@triton.jit
def scores_log2(qk, i, j, Sq, Sk, qk_scale, softcap_scale, softcap_log2, slope2,
                p_bias, stride_bias_m, stride_bias_n, p_mask, stride_mask_m, stride_mask_n,
                win_left, win_right,
                BOUNDS: tl.constexpr, WIN_LEFT: tl.constexpr, WIN_RIGHT: tl.constexpr,
                SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_BIAS: tl.constexpr,
                MASK_KIND: tl.constexpr, PRECISION: tl.constexpr):
    """Scores of a tile in the exp2 domain, ``-inf`` where masked, and the softcap's tanh (for the
    backward; ``qk`` itself when there is no softcap). PRECISION: the products' (configs.dot_precision);
    "ieee" (fp32 inputs) takes the precise tanh.

    ``qk`` is the raw q . k tile; ``i`` / ``j`` are query / key indices broadcastable to it.
    BOUNDS applies the key-range and window (causal) masks: off for blocks every row sees in full.
    MASK_KIND: 0 none, 1 key-padding vector (one boolean per key), 2 boolean tile.
    """
    if SOFTCAP:
        t = tanh(qk * softcap_scale, PRECISION == "ieee")
        s = t * softcap_log2
    else:
        t = qk
        s = qk * qk_scale
    if HAS_ALIBI:
        s = s - slope2 * tl.abs(i + (Sk - Sq) - j).to(tl.float32)
    if HAS_BIAS:
        b = tl.load(p_bias + i.to(tl.int64) * stride_bias_m + j.to(tl.int64) * stride_bias_n,
                    mask=(i < Sq) & (j < Sk), other=0.0)
        s = s + b.to(tl.float32) * LOG2E
    if BOUNDS:
        s = tl.where(in_bounds(i, j, Sq, Sk, win_left, win_right, WIN_LEFT, WIN_RIGHT), s, float("-inf"))
    if MASK_KIND == 1:
        keep = tl.load(p_mask + j.to(tl.int64) * stride_mask_n, mask=j < Sk, other=0)
        s = tl.where(keep != 0, s, float("-inf"))
    if MASK_KIND == 2:
        keep = tl.load(p_mask + i.to(tl.int64) * stride_mask_m + j.to(tl.int64) * stride_mask_n,
                       mask=(i < Sq) & (j < Sk), other=0)
        s = tl.where(keep != 0, s, float("-inf"))
    return s, t


@triton.jit
def dropout_keep(seed, offs_m, start_n, BLOCK_N: tl.constexpr, dropout_p, TRANS: tl.constexpr):
    """Which probabilities of a tile survive dropout: queries ``offs_m`` x keys
    ``start_n .. start_n + BLOCK_N`` (``start_n`` a multiple of 8), ``[BLOCK_M, BLOCK_N]`` or, with
    TRANS, ``[BLOCK_N, BLOCK_M]``.

    One Philox-4x32-10 call, keyed by ``seed`` (per batch and head), with counters
    (key // 8, query, 0, 0), gives 4 x 32 random bits: eight 16-bit uniforms for keys 8g .. 8g + 7
    of one query row. A score is kept when its uniform is >= round(p * 65536), so the drop
    probability is p to within 2^-17. The bits depend only on (seed, batch, head, query, key), not on
    the tiling, so the forward and every backward kernel regenerate the same mask; nothing S x S is
    stored.
    """
    G: tl.constexpr = BLOCK_N // 8
    zero = tl.zeros([offs_m.shape[0], G], tl.uint32)
    c0 = zero + (start_n // 8 + tl.arange(0, G)).to(tl.uint32)[None, :]
    c1 = zero + offs_m.to(tl.uint32)[:, None]
    r0, r1, r2, r3 = tl.philox(seed, c0, c1, zero, zero)
    thr = ((tl.zeros([], tl.float32) + dropout_p) * 65536.0 + 0.5).to(tl.uint32)
    k0 = (r0 & 0xFFFF) >= thr
    k1 = (r0 >> 16) >= thr
    k2 = (r1 & 0xFFFF) >= thr
    k3 = (r1 >> 16) >= thr
    k4 = (r2 & 0xFFFF) >= thr
    k5 = (r2 >> 16) >= thr
    k6 = (r3 & 0xFFFF) >= thr
    k7 = (r3 >> 16) >= thr
    # key 8g + 4a + 2b + c takes k_{4a+2b+c}: join adds a last axis, so the last join is the lowest bit
    keep = tl.join(tl.join(tl.join(k0, k4), tl.join(k2, k6)), tl.join(tl.join(k1, k5), tl.join(k3, k7)))
    keep = tl.reshape(keep, [offs_m.shape[0], BLOCK_N])
    if TRANS:
        keep = tl.trans(keep)
    return keep


@triton.jit
def program_order(HEADS_FIRST: tl.constexpr):
    """``(block, number of blocks, batch x head, number of batch x heads)`` of this program. The grid
    is (blocks, batch x heads), or with HEADS_FIRST (batch x heads, blocks): see
    ``launch.program_grid``. The hardware starts programs in grid order,
    x fastest, so heads-first starts block i of every head before block i + 1 of any: with the
    kernels' heaviest-first block order (causal), the longest programs of all heads start first
    and the short ones fill the tail, instead of the last heads' longest programs starting last."""
    if HEADS_FIRST:
        blk = tl.program_id(1)
        n_blk = tl.num_programs(1)
        bh = tl.program_id(0)
        n_bh = tl.num_programs(0)
    else:
        blk = tl.program_id(0)
        n_blk = tl.num_programs(0)
        bh = tl.program_id(1)
        n_bh = tl.num_programs(1)
    return blk, n_blk, bh, n_bh


@triton.jit
def seq_bounds(CU_Q, CU_K, off_b, Sq, Sk, IS_VARLEN: tl.constexpr, LEN_LO=0, LEN_HI=2147483647):
    """Where batch row ``off_b`` starts in the token dimension and how long it is.

    Dense inputs: (0, Sq, 0, Sk). Variable length (``cu_seqlens``, int32 (B + 1,)): the row's slice
    of the packed ``(total, H, D)`` tensors; a sequence whose longest side (queries or keys) is not
    in [LEN_LO, LEN_HI) reads as empty (0, 0): the launch serves one length class of a packed call,
    and another launch that sequence's (see kernels/launch.py, length_classes)."""
    q_start = 0
    k_start = 0
    if IS_VARLEN:  # one return statement: the compiler wants one return type
        q_start = tl.load(CU_Q + off_b)
        k_start = tl.load(CU_K + off_b)
        Sq = tl.load(CU_Q + off_b + 1) - q_start
        Sk = tl.load(CU_K + off_b + 1) - k_start
        longest = tl.maximum(Sq, Sk)
        other = (longest < LEN_LO) | (longest >= LEN_HI)
        Sq = tl.where(other, 0, Sq)
        Sk = tl.where(other, 0, Sk)
        q_start = q_start.to(tl.int64)
        k_start = k_start.to(tl.int64)
    return q_start, Sq, k_start, Sk


@triton.jit
def key_range(start_m, Sq, Sk, win_left, win_right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              WIN_LEFT: tl.constexpr, WIN_RIGHT: tl.constexpr):
    """Key blocks a query block [start_m, start_m + BLOCK_M) visits, as three stages:

    ``[lo, min(full_lo, hi))`` masked (left edge of the window), ``[full_lo, full_hi)`` unmasked
    (every row sees every key), ``[max(full_hi, full_lo), hi)`` masked (diagonal / right edge and
    the ragged end of the keys). lo, full_lo and full_hi are multiples of BLOCK_N; blocks outside
    [lo, hi) are skipped entirely.
    """
    d = Sk - Sq
    if WIN_RIGHT:
        hi = tl.minimum(tl.maximum(start_m + BLOCK_M + d + win_right, 0), Sk)
        full_hi = tl.minimum(tl.maximum(start_m + 1 + d + win_right, 0), Sk)
    else:
        hi = Sk
        full_hi = Sk
    full_hi = tl.minimum(full_hi, Sk // BLOCK_N * BLOCK_N) // BLOCK_N * BLOCK_N
    if WIN_LEFT:
        lo = tl.minimum(tl.maximum(start_m + d - win_left, 0), Sk) // BLOCK_N * BLOCK_N
        full_lo = tl.cdiv(tl.minimum(tl.maximum(start_m + BLOCK_M - 1 + d - win_left, 0), Sk), BLOCK_N) * BLOCK_N
    else:
        lo = 0
        full_lo = 0
    return lo, full_lo, full_hi, hi


@triton.jit
def query_range(start_n, Sq, Sk, win_left, win_right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                WIN_LEFT: tl.constexpr, WIN_RIGHT: tl.constexpr):
    """Query blocks a key block [start_n, start_n + BLOCK_N) visits (for dK/dV), as three stages:

    ``[lo, min(full_lo, hi))`` masked (diagonal / window's right edge), ``[full_lo, full_hi)``
    unmasked, ``[max(full_hi, full_lo), hi)`` masked (window's left edge). lo, full_lo and full_hi
    are multiples of BLOCK_M. Rows past Sq need no mask (their lse is +inf, their probabilities 0),
    and keys past Sk only feed their own dK/dV rows, which are never stored.
    """
    d = Sk - Sq
    if WIN_RIGHT:  # row i sees key j only if i >= j - d - win_right
        lo = tl.minimum(tl.maximum(start_n - d - win_right, 0), Sq) // BLOCK_M * BLOCK_M
        full_lo = tl.cdiv(tl.minimum(tl.maximum(start_n + BLOCK_N - 1 - d - win_right, 0), Sq), BLOCK_M) * BLOCK_M
    else:
        lo = 0
        full_lo = 0
    if WIN_LEFT:  # row i sees key j only if i <= j - d + win_left
        hi = tl.minimum(tl.maximum(start_n + BLOCK_N - d + win_left, 0), Sq)
        full_hi = tl.minimum(tl.maximum(start_n + 1 - d + win_left, 0), Sq) // BLOCK_M * BLOCK_M
    else:
        hi = Sq
        full_hi = Sq
    return lo, full_lo, full_hi, hi


@triton.jit
def tile_visible(start_m, start_n, Sq, Sk, win_left, win_right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 WIN_LEFT: tl.constexpr, WIN_RIGHT: tl.constexpr):
    """Whether the tile [start_m, start_m + BLOCK_M) x [start_n, start_n + BLOCK_N) holds a (query, key)
    pair inside the causal / window band; a tile starting past Sq or Sk holds none."""
    d = Sk - Sq
    visible = (start_m < Sq) & (start_n < Sk)
    if WIN_RIGHT:
        visible = visible & (start_n <= start_m + BLOCK_M - 1 + d + win_right)
    if WIN_LEFT:
        visible = visible & (start_n + BLOCK_N - 1 >= start_m + d - win_left)
    return visible
