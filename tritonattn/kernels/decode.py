"""Split-KV decoding (flash-decoding) for a few new queries over a KV cache.

Decoding is memory-bound: what counts is reading each K/V tile once. So one program owns a
(split of the keys, batch row, kv head) and packs every query of the kv head's GQA group (group
size x seqlen_q rows) into its query tile: each K/V tile is read once per kv head, not once per
query head. Splits along the keys give the grid enough programs to fill the GPU at small batch;
a combine kernel merges the splits by their log-sum-exp. With a single split the program writes
the output itself (no partial buffers, no combine launch). The score math (softcap, ALiBi, window /
causal masks) and the paged-cache addressing are the shared helpers of the forward kernel.
"""

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from tritonattn import configs
from tritonattn.kernels import kept, plan
from tritonattn.kernels.common import LN2, LOG2E, mma, program_order, scores_log2
from tritonattn.kernels.fwd import _NO_TENSOR_OPTIONS, _discarded, _hopper, _kv_rows
from tritonattn.kernels.launch import cdiv, next_pow2, program_grid, sm_count
from tritonattn.kernels.variants import Variants


@triton.jit
def _append_rows(K_NEW, V_NEW, K_CACHE, V_CACHE, COS, SIN, p_bt, off_b, cb, off_hk, t, take, row0, start,
                 stride_knb, stride_knn, stride_knh, stride_knd, stride_vnb, stride_vnn, stride_vnh, stride_vnd,
                 stride_kcb, stride_kcn, stride_kch, stride_kcd, stride_vcb, stride_vcn, stride_vch, stride_vcd,
                 stride_cos_m, stride_cos_d, stride_sin_m, stride_sin_d,
                 rot_half, rot_rows, capacity, cache_rows, page_size, offs_d, d_ok,
                 ROTARY: tl.constexpr, INTERLEAVED: tl.constexpr, PAGED: tl.constexpr, PTX: tl.constexpr):
    """New keys / values ``t`` (a vector of indices into K_NEW / V_NEW (B, n_new, Hkv, D); ``take``:
    those this program writes) of batch row ``off_b`` and kv head ``off_hk``, written into the cache at
    rows ``row0 + t`` (``row0``: the cache's old length): in cache row ``cb`` (stride_kcb / stride_vcb
    between cache rows), or through the row's block table ``p_bt`` (PAGED; the strides' first is
    between pages). ROTARY: each key rotated at its row less the left pad ``start``. Rows past
    ``capacity``, cache rows or pages outside ``cache_rows`` are not written. The append kernel's and
    the decoding kernel's one code for this step, so the two write the same caches."""
    row = row0 + t
    ok = take & (row >= 0) & (row < capacity)
    if PAGED:
        slot = tl.load(p_bt + row // page_size, mask=ok, other=-1).to(tl.int64)
        ok = ok & (slot >= 0) & (slot < cache_rows)
        base_k = slot * stride_kcb + (row % page_size).to(tl.int64) * stride_kcn
        base_v = slot * stride_vcb + (row % page_size).to(tl.int64) * stride_vcn
    else:
        cb = cb.to(tl.int64)
        ok = ok & (cb >= 0) & (cb < cache_rows)
        base_k = cb * stride_kcb + row.to(tl.int64) * stride_kcn
        base_v = cb * stride_vcb + row.to(tl.int64) * stride_vcn
    off_b = off_b.to(tl.int64)
    tile_ok = take[:, None] & d_ok[None, :]
    p_kn = K_NEW + off_b * stride_knb + t[:, None].to(tl.int64) * stride_knn + off_hk * stride_knh
    k = tl.load(p_kn + offs_d[None, :] * stride_knd, mask=tile_ok, other=0.0)
    if ROTARY:
        pos = row - start
        pos_ok = (pos >= 0) & (pos < rot_rows)
        pos = tl.where(pos_ok, pos, 0).to(tl.int64)[:, None]
        k = _rotated(k.to(tl.float32), p_kn, offs_d[None, :], stride_knd, tile_ok, COS + pos * stride_cos_m,
                     SIN + pos * stride_sin_m, stride_cos_d, stride_sin_d, tl.where(pos_ok, rot_half, 0)[:, None],
                     INTERLEAVED, PTX)
    k = k.to(K_CACHE.dtype.element_ty)
    v = tl.load(V_NEW + off_b * stride_vnb + t[:, None].to(tl.int64) * stride_vnn + off_hk * stride_vnh
                + offs_d[None, :] * stride_vnd, mask=tile_ok, other=0.0).to(V_CACHE.dtype.element_ty)
    store_ok = ok[:, None] & d_ok[None, :]
    tl.store(K_CACHE + base_k[:, None] + off_hk * stride_kch + offs_d[None, :] * stride_kcd, k, mask=store_ok)
    tl.store(V_CACHE + base_v[:, None] + off_hk * stride_vch + offs_d[None, :] * stride_vcd, v, mask=store_ok)


@triton.jit
def _decode_split_kernel(
    Q, K, V, O_PART, LSE_PART,
    stride_qb, stride_qm, stride_qh, stride_qd,
    stride_ob, stride_om, stride_oh, stride_od,
    stride_kb, stride_kn, stride_kh, stride_kd,
    stride_vb, stride_vn, stride_vh, stride_vd,
    ALIBI, stride_alibi_b,
    KV_LENS, KV_LEFTPAD, KV_BATCH_IDX, BLOCK_TABLE, stride_bt_b, page_size, stride_kpage, stride_vpage,
    Hq, Hkv, GROUP, Sq, split_len, qk_scale, softcap_scale, softcap_log2, win_left, win_right,
    K_NEW, V_NEW, COS, SIN,
    stride_knb, stride_knn, stride_knh, stride_knd,
    stride_vnb, stride_vnn, stride_vnh, stride_vnd,
    stride_cos_m, stride_cos_d, stride_sin_m, stride_sin_d,
    n_new, rot_half, rot_rows, capacity, cache_rows,
    WIN_LEFT: tl.constexpr, WIN_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_LEFTPAD: tl.constexpr, HAS_BATCH_IDX: tl.constexpr, PAGED: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, HEADS_FIRST: tl.constexpr, DIRECT: tl.constexpr,
    PDL: tl.constexpr, APPEND: tl.constexpr, ROTARY: tl.constexpr, INTERLEAVED: tl.constexpr,
    LOCAL: tl.constexpr, PTX: tl.constexpr, BLOCK_NEW: tl.constexpr, HAS_LENS: tl.constexpr = True,
):
    """Partial attention of one key split: O_PART (splits, B, Hq, Sq, D) fp32 normalised by the
    split's own softmax, LSE_PART (splits, B, Hq, Sq) fp32 (-inf for a split with no visible key).
    DIRECT (one split covers every key): O_PART is the output itself (B, Sq, Hq, D) in q's dtype
    with strides ``stride_o*``, LSE_PART the lse (B, Hq, Sq). PDL (sm_90, programmatic dependent
    launch): the combine kernel may be launched at once, to wait on the device for this grid.
    The cache's step before attention (``cache_append``'s work, done here where this kernel runs):
    ROTARY: the q tile rotated on load, row (head, i) at ``KV_LENS[b] - leftpad`` (+ i if LOCAL);
    APPEND: ``n_new`` new keys / values (K_NEW / V_NEW (B, n_new, Hkv, D)) follow the cache's
    ``KV_LENS[b]`` rows; the program whose split holds new rows writes them (keys rotated at their
    row less the left pad under ROTARY) into the cache for its kv head, in tiles of BLOCK_NEW rows
    (``_append_rows``, the append kernel's code), before its loop reads them back. Rows past ``capacity``,
    cache rows or pages out of ``cache_rows`` are not written. Not HAS_LENS (a dense call: KV_LENS
    unread): each batch row's keys are all ``capacity`` rows."""
    if PDL:
        gdc_launch_dependents()
    pid_s, _n_splits, bhk, n_bhk = program_order(HEADS_FIRST)  # heads first only past the grid's y limit
    off_bhk = bhk.to(tl.int64)
    off_b = off_bhk // Hkv
    off_hk = off_bhk % Hkv

    # rows of the query tile: (query head of the group, query position)
    offs_r = tl.arange(0, BLOCK_M)
    head = off_hk * GROUP + offs_r // Sq
    qi = offs_r % Sq
    r_ok = offs_r < GROUP * Sq
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM

    k_start = 0
    if HAS_LEFTPAD:
        k_start = tl.load(KV_LEFTPAD + off_b).to(tl.int64)
    if HAS_LENS:
        lens = tl.load(KV_LENS + off_b)
    else:  # a dense call (fwd.attention_forward): every key of the cache
        lens = (capacity + 0 * off_b).to(tl.int32)
    if APPEND:
        lens += n_new
    Sk = lens - k_start
    off_bk = off_b
    if HAS_BATCH_IDX:
        off_bk = tl.load(KV_BATCH_IDX + off_b).to(tl.int64)
    p_bt = BLOCK_TABLE
    if PAGED:
        p_bt = BLOCK_TABLE + off_b * stride_bt_b
    K0 = K  # (the cache's row 0: where _append_rows counts rows from)
    V0 = V
    if not PAGED:
        K += k_start * stride_kn
        V += k_start * stride_vn

    p_q = Q + off_b * stride_qb + head[:, None].to(tl.int64) * stride_qh + qi[:, None].to(tl.int64) * stride_qm
    q_ok = r_ok[:, None] & d_ok[None, :]
    q = tl.load(p_q + offs_d[None, :] * stride_qd, mask=q_ok, other=0.0)
    if ROTARY:  # at the position of the row's query: the cache's old length (+ i), less the left pad
        pos = qi * 0 + (Sk - n_new)
        if LOCAL:
            pos += qi
        pos_ok = (pos >= 0) & (pos < rot_rows)
        pos = tl.where(pos_ok, pos, 0).to(tl.int64)[:, None]
        q = _rotated(q.to(tl.float32), p_q, offs_d[None, :], stride_qd, q_ok, COS + pos * stride_cos_m,
                     SIN + pos * stride_sin_m, stride_cos_d, stride_sin_d, tl.where(pos_ok, rot_half, 0)[:, None],
                     INTERLEAVED, PTX).to(Q.dtype.element_ty)
    slope2 = 0.0
    if HAS_ALIBI:
        slope2 = tl.load(ALIBI + off_b * stride_alibi_b + head, mask=r_ok, other=0.0).to(tl.float32)[:, None] * LOG2E
    p_k = K + off_bk * stride_kb + off_hk * stride_kh + offs_d[None, :] * stride_kd
    p_v = V + off_bk * stride_vb + off_hk * stride_vh + offs_d[None, :] * stride_vd

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo = pid_s * split_len
    hi = tl.minimum(lo + split_len, Sk)
    if APPEND:  # the split's new rows, written into the cache before the loop reads them
        old = Sk - n_new  # new row t sits at old + t, counted from the left pad
        t_hi = tl.minimum(hi - old, n_new)
        for t0 in range(tl.maximum(lo - old, 0), t_hi, BLOCK_NEW):
            t = t0 + tl.arange(0, BLOCK_NEW)
            _append_rows(
                K_NEW, V_NEW, K0, V0, COS, SIN, p_bt, off_b, off_bk, off_hk, t, t < t_hi, old + k_start, k_start,
                stride_knb, stride_knn, stride_knh, stride_knd, stride_vnb, stride_vnn, stride_vnh, stride_vnd,
                stride_kpage if PAGED else stride_kb, stride_kn, stride_kh, stride_kd,
                stride_vpage if PAGED else stride_vb, stride_vn, stride_vh, stride_vd,
                stride_cos_m, stride_cos_d, stride_sin_m, stride_sin_d,
                rot_half, rot_rows, capacity, cache_rows, page_size, offs_d, d_ok, ROTARY, INTERLEAVED, PAGED, PTX)
        tl.debug_barrier()  # the rows written above, seen by every thread of the program
    for start_n in range(lo, hi, BLOCK_N):
        cur_n = start_n + tl.arange(0, BLOCK_N)
        kv_ok = (cur_n[:, None] < hi) & d_ok[None, :]
        k = tl.load(p_k + _kv_rows(cur_n, k_start, p_bt, page_size, stride_kpage, stride_kn, Sk, PAGED)[:, None],
                    mask=kv_ok, other=0.0)
        qk = mma(q, tl.trans(k), None, DOT_FP32, PRECISION)
        s, _ = scores_log2(qk, qi[:, None], cur_n[None, :], Sq, Sk, qk_scale, softcap_scale, softcap_log2, slope2,
                           p_k, 0, 0, p_k, 0, 0, win_left, win_right, True, WIN_LEFT, WIN_RIGHT, SOFTCAP,
                           HAS_ALIBI, False, 0, PRECISION)
        s = tl.where(cur_n[None, :] < hi, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_sub[:, None])
        alpha = tl.math.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(p_v + _kv_rows(cur_n, k_start, p_bt, page_size, stride_vpage, stride_vn, Sk, PAGED)[:, None],
                    mask=kv_ok, other=0.0)
        acc = mma(p.to(v.dtype), v, acc * alpha[:, None], DOT_FP32, PRECISION)
        m_i = m_new

    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    acc = acc / l_safe[:, None]
    lse = tl.where(seen, (m_i + tl.math.log2(l_safe)) * LN2, float("-inf"))
    # partial buffers are contiguous (splits, B, Hq, Sq[, D]); with one split, lse's layout too
    row = ((pid_s * (n_bhk // Hkv) + off_b) * Hq + head) * Sq + qi
    tl.store(LSE_PART + row, lse, mask=r_ok)
    if DIRECT:
        tl.store(O_PART + off_b * stride_ob + head[:, None].to(tl.int64) * stride_oh
                 + qi[:, None].to(tl.int64) * stride_om + offs_d[None, :] * stride_od,
                 acc.to(O_PART.dtype.element_ty), mask=r_ok[:, None] & d_ok[None, :])
    else:
        tl.store(O_PART + row[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=r_ok[:, None] & d_ok[None, :])


@triton.jit
def _decode_combine_kernel(
    O_PART, LSE_PART, O, LSE, n_splits, rows_per_split, Hq, Sq,
    stride_ob, stride_om, stride_oh, stride_od,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr,
):
    """out = sum_s exp(lse_s - lse) * o_s with lse = logsumexp_s lse_s, one program per query row
    (a row's splits at once: as many programs as rows, the parallelism a batch of 1 needs; a merge
    by fewer, wider programs was 2.6x slower at B=1, benchmarks/NOTES.md, fortieth session).
    PDL: launched before the split kernel ended; ``gdc_wait`` holds it until that grid has completed
    and its writes are visible."""
    if PDL:
        gdc_wait()
    row = tl.program_id(0).to(tl.int64)  # (b, h, i) flattened
    off_b = row // (Hq * Sq)
    off_h = (row // Sq) % Hq
    off_i = row % Sq
    offs_s = tl.arange(0, BLOCK_S)
    s_ok = offs_s < n_splits
    lse_s = tl.load(LSE_PART + offs_s * rows_per_split + row, mask=s_ok, other=float("-inf"))
    m = tl.max(lse_s, 0)
    m_sub = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse_s - m_sub)
    total = tl.sum(w, 0)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    o_s = tl.load(O_PART + (offs_s[:, None] * rows_per_split + row) * HEAD_DIM + offs_d[None, :],
                  mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    seen = total > 0.0
    out = tl.sum(o_s * w[:, None], 0) / tl.where(seen, total, 1.0)
    tl.store(LSE + row, tl.where(seen, m_sub + tl.log(tl.where(seen, total, 1.0)), float("-inf")))
    tl.store(O + off_b * stride_ob + off_h * stride_oh + off_i * stride_om + offs_d * stride_od,
             out.to(O.dtype.element_ty), mask=d_ok)


@triton.jit
def _mul_rn(a, b, PTX: tl.constexpr):
    """``a * b`` in float32, rounded by itself: ``mul.rn`` is never contracted with a later add into
    an FMA, so sums of products round as torch's eager ops round them. PTX off: the interpreter,
    which computes op by op anyway."""
    if PTX:
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return a * b


@triton.jit
def _rotated(x, p_x, offs_d, stride_d, x_ok, p_cos, p_sin, stride_cos_d, stride_sin_d, rot_half,
             INTERLEAVED: tl.constexpr, PTX: tl.constexpr):
    """``x`` (float32, loaded from ``p_x + offs_d * stride_d`` where ``x_ok``) with the rotary
    embedding on its first ``2 * rot_half`` dims: interleaved pairs (2i, 2i + 1) or the halves
    (i, i + rot_half) turn by angle i of the row's position (``p_cos`` / ``p_sin``: that position's
    table row). A row (1-d) or a tile of rows (``p_x``, ``p_cos``, ``p_sin``, ``rot_half`` per row,
    ``offs_d`` a row vector); ``rot_half`` 0 leaves a row as it is. Rounded as torch's
    ``inference.apply_rotary`` (each product, then the sum): bitwise equal."""
    rot = offs_d < 2 * rot_half
    if INTERLEAVED:
        first = (offs_d % 2) == 0
        partner = offs_d ^ 1
        i = offs_d // 2
    else:
        first = offs_d < rot_half
        partner = tl.where(first, offs_d + rot_half, offs_d - rot_half)
        i = tl.where(first, offs_d, offs_d - rot_half)
    rot_ok = rot & x_ok
    x_p = tl.load(p_x + partner * stride_d, mask=rot_ok, other=0.0).to(tl.float32)
    c = tl.load(p_cos + i * stride_cos_d, mask=rot_ok, other=1.0).to(tl.float32)
    s = tl.load(p_sin + i * stride_sin_d, mask=rot_ok, other=0.0).to(tl.float32)
    a = _mul_rn(x, c, PTX)
    b = _mul_rn(x_p, s, PTX)
    return tl.where(rot, tl.where(first, a - b, a + b), x)


@triton.jit
def _cache_append_kernel(
    Q, Q_OUT, K_NEW, V_NEW, K_CACHE, V_CACHE, COS, SIN, KV_LENS, LENS_OUT, KV_LEFTPAD, KV_BATCH_IDX, BLOCK_TABLE,
    stride_qb, stride_qm, stride_qh, stride_qd,
    stride_ob, stride_om, stride_oh, stride_od,
    stride_kb, stride_kn, stride_kh, stride_kd,
    stride_vb, stride_vn, stride_vh, stride_vd,
    stride_kcb, stride_kcn, stride_kch, stride_kcd,
    stride_vcb, stride_vcn, stride_vch, stride_vcd,
    stride_cos_m, stride_cos_d, stride_sin_m, stride_sin_d, stride_bt_b,
    n_tiles, Sq, n_new, q_heads, rot_half, rot_rows, capacity, cache_rows, page_size,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr, ROTARY: tl.constexpr,
    INTERLEAVED: tl.constexpr, LOCAL: tl.constexpr, HAS_LEFTPAD: tl.constexpr, HAS_BATCH_IDX: tl.constexpr,
    PAGED: tl.constexpr, WRITE_LENS: tl.constexpr, PTX: tl.constexpr,
):
    """The KV cache's step before attention, in one launch: program (b * n_tiles + tile, head), rows
    t of the tile's BLOCK_T. Heads below ``q_heads`` (rotary only): queries t of batch row b rotated
    at their positions into Q_OUT. The others, kv head ``head - q_heads``: new keys / values t
    written into the cache at rows ``kv_lens[b] + t`` (``_append_rows``). Rows, pages and table
    positions out of the cache are not written (bad ``cache_seqlens`` are an error under
    TRITONATTN_DEBUG; here they must not write outside the cache). WRITE_LENS: LENS_OUT[b] =
    kv_lens[b] + n_new, the lengths attention then reads."""
    pid = tl.program_id(0)
    head = tl.program_id(1)
    off_b = pid // n_tiles
    t = (pid % n_tiles) * BLOCK_T + tl.arange(0, BLOCK_T)
    start = 0
    if HAS_LEFTPAD:
        start = tl.load(KV_LEFTPAD + off_b)
    lens = tl.load(KV_LENS + off_b)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    if head < q_heads:
        pos = lens - start + t * 0
        if LOCAL:  # causal or windowed: query t sits at its own position
            pos += t
        pos_ok = (pos >= 0) & (pos < rot_rows)
        pos = tl.where(pos_ok, pos, 0).to(tl.int64)[:, None]
        q_ok = (t < Sq)[:, None] & d_ok[None, :]
        p_q = Q + off_b.to(tl.int64) * stride_qb + t[:, None].to(tl.int64) * stride_qm + head * stride_qh
        x = tl.load(p_q + offs_d[None, :] * stride_qd, mask=q_ok, other=0.0).to(tl.float32)
        x = _rotated(x, p_q, offs_d[None, :], stride_qd, q_ok, COS + pos * stride_cos_m, SIN + pos * stride_sin_m,
                     stride_cos_d, stride_sin_d, tl.where(pos_ok, rot_half, 0)[:, None], INTERLEAVED, PTX)
        tl.store(Q_OUT + off_b.to(tl.int64) * stride_ob + t[:, None].to(tl.int64) * stride_om + head * stride_oh
                 + offs_d[None, :] * stride_od, x.to(Q_OUT.dtype.element_ty), mask=q_ok)
    else:
        off_hk = head - q_heads
        cb = off_b
        if HAS_BATCH_IDX:
            cb = tl.load(KV_BATCH_IDX + off_b)
        if (pid % n_tiles) * BLOCK_T < n_new:
            _append_rows(K_NEW, V_NEW, K_CACHE, V_CACHE, COS, SIN, BLOCK_TABLE + off_b.to(tl.int64) * stride_bt_b,
                         off_b, cb, off_hk, t, t < n_new, lens, start,
                         stride_kb, stride_kn, stride_kh, stride_kd, stride_vb, stride_vn, stride_vh, stride_vd,
                         stride_kcb, stride_kcn, stride_kch, stride_kcd, stride_vcb, stride_vcn, stride_vch, stride_vcd,
                         stride_cos_m, stride_cos_d, stride_sin_m, stride_sin_d,
                         rot_half, rot_rows, capacity, cache_rows, page_size, offs_d, d_ok, ROTARY, INTERLEAVED, PAGED,
                         PTX)
        if WRITE_LENS:
            if (pid % n_tiles == 0) & (off_hk == 0):
                tl.store(LENS_OUT + off_b, lens + n_new)


# The most key splits a call takes, the heuristic's or a user's num_splits: the combine kernel loads
# a query row's splits at once (a (splits, head dim) fp32 tile per program).
MAX_SPLITS = 128


def pick_num_splits(batch: int, kv_heads: int, capacity: int, device: torch.device, paged: bool = False) -> int:
    """About one wave of programs (SMs // (batch x kv heads) splits), at least 2, and splits of at
    least 256 keys. Measured on the H200 (scripts/tune_decode.py, benchmarks/NOTES.md 2026-11-30):
    a partial second wave costs up to 12% (batch 8: 5 splits 0.88x cuDNN, 2 splits 1.01x), and
    one wave of long splits reads K/V at 3.9-4.5 TB/s. With two waves or more of (batch, kv head)
    programs, one split (the kernel writes the output, no combine): batch 64 x 8 kv heads, 0.99x /
    1.01x cuDNN at 4096 / 16384 keys against 0.96x / 1.00x with two (sixth session).
    ``paged`` (a block table): about two waves. Each key tile's rows come from block-table loads,
    latency that a lone program per SM shows and a second one hides: 16-row pages on an H100 at
    batch 8, 16384 / 4096 keys, 4 splits 1.39x / 1.30x the 2 of one wave (0.97x / 0.95x cuDNN on
    the contiguous cache); batch 1 / 16384, 32 splits 1.21x the 16 (thirty-fifth session,
    ``results/2026-12-06/tune-decode-paged16-62fdb9f-h100.md``); the contiguous cache loses 1-9% there.
    Caches of at most ``configs.DECODE_ONE_SPLIT_KEYS`` rows: one split (one launch; see there)."""
    if capacity <= configs.DECODE_ONE_SPLIT_KEYS:
        return 1
    sms = sm_count(device)
    if batch * kv_heads >= 2 * sms:
        return 1
    want = max(2, (2 if paged else 1) * sms // (batch * kv_heads))
    return max(1, min(want, cdiv(capacity, 256), MAX_SPLITS))


def decode_forward(q, k, v, var: Variants, capacity: int, num_splits: int, new: tuple | None = None):
    """Split-KV attention of q (B, Sq, Hq, D) over the cache described by ``var`` (kv_lens, leftpad,
    batch index, block table). k / v as the forward kernel takes them. Returns (out, lse).
    ``new``: the cache's step before attention, done by the kernel (see ``cache_append``):
    ``(k_new, v_new, cos, sin, interleaved, local, cache_rows)``, the new tokens (or None) appended
    after ``var.kv_lens`` rows, rotary tables (or None) applied to q and the new keys, and the cache's
    rows (pages when paged). Without ``var.kv_lens`` (a dense call routed here by
    fwd.attention_forward, configs.dense_decode), every batch row's keys are the ``capacity`` rows of
    k / v, and an entry point's key (``var.fast_key``) is linked to the plan as the forward's is.

    Such a call's plan is keyed without the cache's length: its length, the strides of k / v and the
    split length are the plan's values (plan.py), so a generation loop over a cache one row longer
    at every call (transformers' DynamicCache) replays one plan per split count."""
    inputs = (q, k, v, *var.tensors(), *(new[:4] if new else ()))
    splits, split_len = _splits(q, k, capacity, num_splits, var.block_table is not None)
    if var.kv_lens is None and var.block_table is None and new is None:  # every row's keys: the whole cache
        values = _dense_values(k, v, split_len, capacity)
        key = ("decode-dense", q.shape, q.stride(), k.shape[0], k.shape[2:], v.shape[0], v.shape[2:], q.dtype,
               q.device, var.signature(), splits, configs.DECODE_PDL)
    else:
        values = ()
        key = ("decode", q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, q.device,
               var.signature(), capacity, splits, configs.DECODE_PDL,
               new and (*((None if t is None else (t.shape, t.stride(), t.dtype)) for t in new[:4]), *new[4:]))
    res = plan.replay(key, inputs, q.device, values)
    if res is None:  # a new signature (else the same as an earlier call's, every step of a decoding loop)
        res = _record(key, inputs, q, k, v, var, capacity, splits, split_len, new, values)
    if var.fast_key is not None:  # (no tensor descriptors here: Triton's allocator is not needed)
        plan.link(var.fast_key, key, (False, None, values))
        if values and var.free_key is not None:
            # the length-free key (its checks passed) and, with the split count, its plan (replay_free)
            plan.link(var.free_key, key)
            plan.link((var.free_key, splits), key)
    return res


def free_key(fast: tuple, q, k, v) -> tuple | None:
    """The key of a dense call (an entry point's ``fast`` key, interface._fast_key) without its k / v
    length and strides, when the call takes the decoding kernel (configs.dense_decode), else None.
    A generation loop over a growing cache (transformers' DynamicCache: one row more each call,
    never a key seen before) reaches the length-free plan through it (:func:`replay_free`), not
    through the checks and the launchers. It holds what the entry point's remembered checks are a
    function of (interface._signature's seq_free: the shapes less dim 1, k and v of one length) and
    all of the plan's key but the split count (a function of the length: a plan is linked per split
    count, under ``(free key, splits)``)."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return None
    Sq, Hq = q.shape[1], q.shape[2]
    Sk, Hkv = k.shape[1], k.shape[2]
    if Sk != v.shape[1] or not Hkv or not configs.dense_decode(Sq, Sk, Hq, Hkv):
        return None
    # _fast_key's layout: tag, q's shape / strides / dtype / device, k's shape, strides, dtype, device,
    # v's, then the mask, options and alignment flags and the launchers' switches
    return fast[:5], k.shape[0], k.shape[2:], fast[7:9], v.shape[0], v.shape[2:], fast[11:]


def replay_free(fast: tuple, q, k, v) -> tuple:
    """``(free, res)`` for an entry point's call whose key ``fast`` has no link: its
    :func:`free_key` (None when the call does not take the decoding kernel; the launcher links it,
    ``Variants.free_key``) and ``(out, lse)`` through the plan linked to that key and this length's
    split count, with this call's values (k's and v's strides, the split length, the cache's
    length), or None: no link (the call takes the full path, which links it). The split count is
    computed only once the free key is linked (a call with it passed the checks: its shapes are
    valid). The call's own key ``fast`` is linked to the plan with these values at its second call
    (a shape called again and again then takes the shorter way, fwd.replay_linked)."""
    free = free_key(fast, q, k, v)
    if free is None or plan.linked(free) is None:
        return free, None
    capacity = k.shape[1]
    splits, split_len = _splits(q, k, capacity, 0, False)
    part = (free, splits)
    entry = plan.linked(part)
    if entry is None:
        return free, None
    p = entry[0]
    values = _dense_values(k, v, split_len, capacity)
    res = p.run((q, k, v, *_NO_TENSOR_OPTIONS), q.device, values)
    if res is not None:
        plan.refresh(free)
        plan.refresh(part)
        plan.link_plan(fast, p, (False, None, values))
    return free, res


def _dense_values(k, v, split_len: int, capacity: int) -> tuple:
    """The length-free plan's values, in the order :func:`_record` names them: k's and v's strides,
    the split length, the cache's length."""
    return (*k.stride(), *v.stride(), split_len, capacity)


def _splits(q, k, capacity: int, num_splits: int, paged: bool) -> tuple[int, int]:
    """``(splits, split_len)``: how many key splits a call takes (``num_splits``, capped at
    MAX_SPLITS, or the heuristic's for 0) and the keys of each, a multiple of the tile's BLOCK_N
    (a finer multiple, measured on the GPU, loses: benchmarks/NOTES.md, forty-fourth session)."""
    B, _, Hq, _ = q.shape
    Hkv = k.shape[2]
    if num_splits > 0:
        splits = min(num_splits, MAX_SPLITS)
    else:
        splits = pick_num_splits(B, Hkv, capacity, q.device, paged)
    block_n = configs.decode_config(q).block_n
    split_len = cdiv(cdiv(capacity, splits), block_n) * block_n
    return cdiv(capacity, split_len), split_len


def _record(key, inputs, q, k, v, var: Variants, capacity: int, splits: int, split_len: int, new: tuple | None,
            values: tuple):
    """:func:`decode_forward`'s full path, recorded as the launch plan of ``key``; ``values`` (when
    given): k's and v's strides, ``split_len`` and ``capacity``, the plan's values."""
    b = plan.Builder(key, inputs, len(values))
    B, Sq, Hq, D = q.shape
    Hkv = k.shape[2]
    group = Hq // Hkv
    cfg = configs.decode_config(q)
    block_m = max(16, next_pow2(group * Sq))
    direct = splits == 1  # one split: the kernel writes out / lse itself
    pdl = configs.DECODE_PDL and not direct and _pdl_ok(q)
    out = b.alloc(torch.empty, q.shape, q.dtype, q.device)  # contiguous (empty_like would copy q's strides)
    lse = b.alloc(torch.empty if var.need_lse else _discarded, (B, Hq, Sq), torch.float32, q.device)
    # the partials live within the call: kept per stream, no allocation
    o_part = out if direct else b.alloc(_o_parts, (splits, B, Hq, Sq, D), torch.float32, q.device)
    lse_part = lse if direct else b.alloc(_lse_parts, (splits, B, Hq, Sq), torch.float32, q.device)
    c = var.constexprs()
    cache = var.cache_args(q)
    wide = configs.heads_first(False, k, B * Hkv)  # only past the grid's y limit
    k_new, v_new, cos, sin, interleaved, local, cache_rows = new or (None, None, None, None, True, False, 0)
    append, rotary = k_new is not None, cos is not None
    kn, vn = (k_new, v_new) if append else (q, q)  # (placeholders, never read)
    head = (q, k, v, o_part, lse_part, *q.stride(), *out.stride())
    mid = (*k.stride(), *v.stride(), *var.alibi_args(q), *cache, Hq, Hkv, group, Sq)
    tail = (split_len, *var.scale_args(), *var.window_args(),
            kn, vn, cos if rotary else q, sin if rotary else q, *kn.stride(), *vn.stride(),
            *(cos.stride() if rotary else (0, 0)), *(sin.stride() if rotary else (0, 0)),
            k_new.shape[1] if append else 0, cos.shape[1] if rotary else 0, cos.shape[0] if rotary else 0)
    args = (*head, *mid, *tail, capacity, cache_rows)
    # the plan's values: k's and v's strides (after head), split_len (after mid), capacity (after tail)
    at = (*range(len(head), len(head) + 8), len(head) + len(mid), len(head) + len(mid) + len(tail))
    b.launch(_decode_split_kernel, program_grid(splits, B * Hkv, wide), args, dict(
        WIN_LEFT=c["WIN_LEFT"], WIN_RIGHT=c["WIN_RIGHT"], SOFTCAP=c["SOFTCAP"], HAS_ALIBI=c["HAS_ALIBI"],
        HAS_LEFTPAD=var.kv_leftpad is not None, HAS_BATCH_IDX=var.kv_batch_idx is not None,
        PAGED=var.block_table is not None,
        HEAD_DIM=D, BLOCK_D=configs.padded_head_dim(D), BLOCK_M=block_m, BLOCK_N=cfg.block_n,
        DOT_FP32=configs.dot_in_fp32(q.dtype), PRECISION=configs.dot_precision(q.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, HEADS_FIRST=wide, DIRECT=direct, PDL=pdl,
        APPEND=append, ROTARY=rotary, INTERLEAVED=interleaved, LOCAL=local, PTX=not configs.interpreting(),
        BLOCK_NEW=min(next_pow2(k_new.shape[1]), 16) if append else 1, HAS_LENS=var.kv_lens is not None,
    ), tuple(zip(at, range(len(values)))))
    assert not values or tuple(args[i] for i in at) == values  # (the positions above name the values)
    if direct:
        return b.finish((out, lse))
    b.launch(_decode_combine_kernel, (B * Hq * Sq,), (
        o_part, lse_part, out, lse, splits, B * Hq * Sq, Hq, Sq, *out.stride(),
    ), dict(
        HEAD_DIM=D, BLOCK_D=configs.padded_head_dim(D), BLOCK_S=max(2, next_pow2(splits)), PDL=pdl,
        **({"launch_pdl": True} if pdl else {}),
    ))
    return b.finish((out, lse))


_o_parts, _lse_parts = kept.Kept(), kept.Kept()


def _pdl_ok(q) -> bool:
    """Programmatic dependent launch: an NVIDIA sm_90 GPU (not the interpreter)."""
    return q.is_cuda and _hopper(q.device.index)


def cache_append(q, k_new, v_new, k_cache, v_cache, cos, sin, kv_lens, leftpad, batch_idx, block_table,
                 interleaved: bool, local: bool):
    """The KV cache's step before attention as one kernel (``_cache_append_kernel``): new keys /
    values (``k_new`` / ``v_new`` (B, n_new, Hkv, D), or None) written into the cache at each row's
    ``kv_lens`` (int32 (B,)), the keys rotated when ``cos`` / ``sin`` are given, and q rotated too
    (``local``: query t at its own position, else every query at the row's last). The cache is
    contiguous (B_cache, capacity, Hkv, D) with ``batch_idx``, or paged (num_blocks, page_size, Hkv,
    D) through ``block_table``. Returns ``(q, lens)``: q rotated (a new tensor) or q itself, and the
    lengths attention reads, ``kv_lens + n_new`` (a new tensor) or ``kv_lens``. Replays a launch
    plan from the second call of a signature (every decoding step)."""
    rotary = cos is not None
    n_new = 0 if k_new is None else k_new.shape[1]
    if not rotary and n_new == 0:
        return q, kv_lens
    k_in, v_in = (k_new, v_new) if n_new else (k_cache, v_cache)  # (placeholders: no program reads them)
    cos_in, sin_in = (cos, sin) if rotary else (kv_lens, kv_lens)
    inputs = (q, k_in, v_in, k_cache, v_cache, cos_in, sin_in, kv_lens, leftpad, batch_idx, block_table)
    key = ("append", *((None if t is None else (t.shape, t.stride(), t.dtype)) for t in inputs), q.device,
           interleaved, local)
    res = plan.replay(key, inputs, q.device)
    if res is not None:
        return res
    b = plan.Builder(key, inputs)
    B, Sq, Hq, D = q.shape
    q_out = b.alloc(torch.empty, q.shape, q.dtype, q.device) if rotary else q
    lens = b.alloc(torch.empty, kv_lens.shape, kv_lens.dtype, q.device) if n_new else kv_lens
    paged = block_table is not None
    capacity = block_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1]
    T = max(n_new, Sq if rotary else 0)
    block_t = min(next_pow2(T), 16)
    n_tiles = cdiv(T, block_t)
    q_heads = Hq if rotary else 0
    two_d = (0, 0)
    b.launch(_cache_append_kernel, (B * n_tiles, q_heads + k_cache.shape[2]), (  # (b, tile of rows), head
        q, q_out, k_in, v_in, k_cache, v_cache, cos_in, sin_in, kv_lens, lens,
        leftpad if leftpad is not None else kv_lens, batch_idx if batch_idx is not None else kv_lens,
        block_table if paged else kv_lens,
        *q.stride(), *q_out.stride(), *k_in.stride(), *v_in.stride(), *k_cache.stride(), *v_cache.stride(),
        *(cos.stride() if rotary else two_d), *(sin.stride() if rotary else two_d),
        block_table.stride(0) if paged else 0,
        n_tiles, Sq, n_new, q_heads, cos.shape[1] if rotary else 0, cos.shape[0] if rotary else 0, capacity,
        k_cache.shape[0], k_cache.shape[1] if paged else 1,
    ), dict(
        HEAD_DIM=D, BLOCK_D=configs.padded_head_dim(D), BLOCK_T=block_t, ROTARY=rotary, INTERLEAVED=interleaved,
        LOCAL=local,
        HAS_LEFTPAD=leftpad is not None, HAS_BATCH_IDX=batch_idx is not None, PAGED=paged, WRITE_LENS=n_new > 0,
        PTX=not configs.interpreting(), num_warps=4 if block_t >= 8 else 1,
    ))
    return b.finish((q_out, lens))

