"""An experiment, not part of the library (twelfth session, not yet run on a GPU): the Gluon sm_90
dK/dV kernel (tritonattn/kernels/bwd_sm90.py) on a persistent grid, as the forward became in the
twelfth session (+8..+31% at S=1024-2048 there).

Why: the library's kernel has one program per (128 keys, kv head). Causal calls load those
programs unevenly (the first key blocks see every query, the last ones few): at S=1024, B=4 its 256
programs made the whole backward 14% slower than the Triton kernel, so causal calls take it only
from 2048 tokens. Here one program per SM walks tiles t = pid, pid + P, ...: without a mask a kv
head's key blocks one after the other (they share Q / dO through L2); causal, the key blocks that
see the most queries first, SEC kv heads at a time (sections whose Q and dO fill half of L2, as the
forward's K / V), so that a program's light tiles follow its heavy ones.

The producer warp loads a tile's K / V into one of KV_BUFS buffers once both consumers are done
with it (an mbarrier per buffer, two arrivals), then the tile's Q / dO blocks into the ring, whose
count t carries across tiles; with KV_BUFS=2 the next tile's K / V load while the consumers finish
this one. The consumers accumulate each tile's dK / dV with the library's _accumulate, release the
K / V buffer, then store.

Checked and timed by tune_gluon_bwd.py (tiles p:BLOCK_M,STAGES,KV_BUFS).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from tritonattn.kernels import bwd_sm90
from tritonattn.kernels.bwd_sm90 import HALF, _accumulate, _load_kv, _load_query_blocks, _store_dkdv
from tritonattn.kernels.launch import l2_bytes

HEADS_PER_SECTION = None  # the causal order's section (kv heads): None, section_heads' rule


@gluon.jit
def _pairs(n_n, BH, CAUSAL: gl.constexpr, PAIRS: gl.constexpr):
    """Causal with PAIRS and more tiles than programs: pairs of key blocks (i, n_n - 1 - i)."""
    on = False
    if CAUSAL and PAIRS:
        on = n_n * BH > gl.num_programs(0)
    return on


@gluon.jit
def _n_tiles(n_n, BH, CAUSAL: gl.constexpr, PAIRS: gl.constexpr):
    """The persistent loop's turns: the tiles, or with pairs two turns per pair for every program
    in whole rounds (the turns past the last pair come last, and do nothing)."""
    n = n_n * BH
    if _pairs(n_n, BH, CAUSAL, PAIRS):
        P = gl.num_programs(0)
        n = 2 * P * gl.cdiv((n_n + 1) // 2 * BH, P)
    return n


@gluon.jit
def _tile(t, n_n, BH, SEC, Hkv, Sq, shift, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, PAIRS: gl.constexpr):
    """Tile t (128 keys of one kv head): whether the turn has one, its batch, kv head, first key,
    first query block that sees a key of it, and number of query blocks. Causal: SEC kv heads at a
    time (a section); with pairs (the forward's fix of its causal order, thirteenth session) a
    program's turns 2k and 2k+1 run key blocks i and n_n - 1 - i of one kv head, the heavy one
    first, so that every pair costs the same (an odd n_n's middle block runs twice: the same
    dK / dV stored twice); otherwise the key blocks with the most queries first, dealt by turns."""
    valid = True
    if CAUSAL:
        if _pairs(n_n, BH, CAUSAL, PAIRS):
            P = gl.num_programs(0)
            n_half = (n_n + 1) // 2
            u = t % P + t // (2 * P) * P  # the pair (past the last: no tile, read as the last)
            uc = gl.minimum(u, n_half * BH - 1)
            first = uc // (n_half * SEC) * SEC
            r = uc % (n_half * SEC)
            width = gl.minimum(SEC, BH - first)
            i = r // width
            bh = first + r % width
            pid_n = gl.where((t // P) % 2 == 1, n_n - 1 - i, i)
            valid = u < n_half * BH
        else:
            first = t // (n_n * SEC) * SEC
            r = t % (n_n * SEC)
            width = gl.minimum(SEC, BH - first)
            pid_n = r // width
            bh = first + r % width
    else:
        pid_n = t % n_n
        bh = t // n_n
    start_n = pid_n * (2 * HALF)
    lo_blk = 0
    if CAUSAL:  # queries [lo_blk * BLOCK_M, Sq) see some key of the block (query i sees j <= i + shift)
        lo_blk = gl.minimum(gl.maximum(start_n - shift, 0), Sq) // BLOCK_M
    return valid, (bh // Hkv).to(gl.int64), (bh % Hkv).to(gl.int64), start_n, lo_blk, gl.cdiv(Sq, BLOCK_M) - lo_blk


@gluon.jit
def _producer(Q, K, V, DO, LSE, DELTA, stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh, stride_vb,
              stride_vn, stride_vh, stride_dob, stride_dom, stride_doh, stride_lse_b, stride_lse_h, n_tiles, n_n, BH,
              SEC, Hkv, GROUP, Sq, Sk, shift, k_smem, v_smem, q_smem, do_smem, kv_bars, kv_empty, ready_bars,
              empty_bars, rows_smem, CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
              STAGES: gl.constexpr, KV_BUFS: gl.constexpr, PAIRS: gl.constexpr):
    t = 0  # the ring's query blocks so far (all tiles)
    i = 0  # this program's tiles so far
    for tile in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
        valid, off_b, off_hk, start_n, lo_blk, n_m = _tile(tile, n_n, BH, SEC, Hkv, Sq, shift, CAUSAL, BLOCK_M,
                                                           PAIRS)
        if valid:  # (turns without a tile come after every tile of the program)
            kb = i % KV_BUFS
            mbarrier.wait(kv_empty.index(kb), ((i // KV_BUFS) & 1) ^ 1)
            if i > 0:  # the last tile's K / V landed: its descriptors' scratch can be rewritten
                mbarrier.wait(kv_bars.index((i - 1) % KV_BUFS), ((i - 1) // KV_BUFS) & 1)
            _load_kv(K + off_b * stride_kb + off_hk * stride_kh, V + off_b * stride_vb + off_hk * stride_vh,
                     stride_kn, stride_vn, start_n, Sk, k_smem, v_smem, kb, kv_bars.index(kb), HEAD_DIM)
            t = _load_query_blocks(t, Q + off_b * stride_qb, DO + off_b * stride_dob, stride_qm, stride_qh,
                                   stride_dom, stride_doh, off_hk, Sq, Sq, GROUP, lo_blk, n_m, q_smem, do_smem,
                                   ready_bars, empty_bars, LSE + off_b * stride_lse_b, DELTA + off_b * stride_lse_b,
                                   stride_lse_h, rows_smem, HEAD_DIM, BLOCK_M, STAGES)
            i += 1


@gluon.jit
def _consumer(WG: gl.constexpr, DK, DV, stride_dkb, stride_dkn, stride_dkh, stride_dvb, stride_dvn, stride_dvh,
              n_tiles, n_n, BH, SEC, Hkv, GROUP, Sq, Sk, shift, qk_scale, sm_scale, k_smem, v_smem, q_smem, do_smem,
              kv_bars, kv_empty, ready_bars, empty_bars, rows_smem, CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr,
              BLOCK_M: gl.constexpr, STAGES: gl.constexpr, KV_BUFS: gl.constexpr, PAIRS: gl.constexpr):
    t = 0
    pid = gl.program_id(0)
    P = gl.num_programs(0)
    for tile in range(pid, n_tiles, P):
        valid, _b, _h, start_n, lo_blk, n_m = _tile(tile, n_n, BH, SEC, Hkv, Sq, shift, CAUSAL, BLOCK_M, PAIRS)
        if valid:
            # this program's tiles before this one (fewer registers than a count; the turns without
            # a tile are the last ones)
            i = (tile - pid) // P
            kb = i % KV_BUFS
            key0 = start_n + WG * HALF
            mbarrier.wait(kv_bars.index(kb), (i // KV_BUFS) & 1)
            dk, dv, t = _accumulate(t, key0, k_smem.index(2 * kb + WG), v_smem.index(2 * kb + WG), q_smem, do_smem,
                                    ready_bars, empty_bars, rows_smem, GROUP, lo_blk, n_m, shift, qk_scale, CAUSAL,
                                    HEAD_DIM, BLOCK_M, STAGES)
            mbarrier.arrive(kv_empty.index(kb))  # the products are done: the K / V buffer can take a later tile's
            _v, off_b, off_hk, start_n, _lo, _n = _tile(tile, n_n, BH, SEC, Hkv, Sq, shift, CAUSAL, BLOCK_M, PAIRS)
            _store_dkdv(DK + off_b * stride_dkb + off_hk * stride_dkh, DV + off_b * stride_dvb + off_hk * stride_dvh,
                        stride_dkn, stride_dvn, start_n + WG * HALF, Sk, dk, dv, sm_scale)


@gluon.jit
def _bwd_dkdv_persistent_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_dob, stride_dom, stride_doh,
    stride_dkb, stride_dkn, stride_dkh,
    stride_dvb, stride_dvn, stride_dvh,
    stride_lse_b, stride_lse_h,
    Hkv, GROUP, Sq, Sk, win_right, qk_scale, sm_scale, BH, SEC,
    CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
    KV_BUFS: gl.constexpr, num_warps: gl.constexpr, PAIRS: gl.constexpr = True,
):
    gl.static_assert(num_warps == 4, "the default partition is one consumer warpgroup")
    dtype: gl.constexpr = Q.dtype.element_ty
    layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    n_n = gl.cdiv(Sk, 2 * HALF)
    n_tiles = _n_tiles(n_n, BH, CAUSAL, PAIRS)
    shift = Sk - Sq + win_right

    k_smem = gl.allocate_shared_memory(dtype, [2 * KV_BUFS, HALF, HEAD_DIM], layout)
    v_smem = gl.allocate_shared_memory(dtype, [2 * KV_BUFS, HALF, HEAD_DIM], layout)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], layout)
    rows_smem = gl.allocate_shared_memory(gl.float32, [2 * STAGES, BLOCK_M],
                                          gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0]))
    kv_bars = gl.allocate_shared_memory(gl.int64, [KV_BUFS, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [KV_BUFS, 1], mbarrier.MBarrierLayout())
    ready_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for b in gl.static_range(KV_BUFS):
        mbarrier.init(kv_bars.index(b), count=1)
        mbarrier.init(kv_empty.index(b), count=2)  # both consumers are done with the buffer
    for s in gl.static_range(STAGES):
        mbarrier.init(ready_bars.index(s), count=1)
        mbarrier.init(empty_bars.index(s), count=2)
    fence_async_shared()

    gl.warp_specialize([
        (_consumer, (0, DK, DV, stride_dkb, stride_dkn, stride_dkh, stride_dvb, stride_dvn, stride_dvh, n_tiles, n_n,
                     BH, SEC, Hkv, GROUP, Sq, Sk, shift, qk_scale, sm_scale, k_smem, v_smem, q_smem, do_smem,
                     kv_bars, kv_empty, ready_bars, empty_bars, rows_smem, CAUSAL, HEAD_DIM, BLOCK_M, STAGES,
                     KV_BUFS, PAIRS)),
        (_consumer, (1, DK, DV, stride_dkb, stride_dkn, stride_dkh, stride_dvb, stride_dvn, stride_dvh, n_tiles, n_n,
                     BH, SEC, Hkv, GROUP, Sq, Sk, shift, qk_scale, sm_scale, k_smem, v_smem, q_smem, do_smem,
                     kv_bars, kv_empty, ready_bars, empty_bars, rows_smem, CAUSAL, HEAD_DIM, BLOCK_M, STAGES,
                     KV_BUFS, PAIRS)),
        (_producer, (Q, K, V, DO, LSE, DELTA, stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh,
                     stride_vb, stride_vn, stride_vh, stride_dob, stride_dom, stride_doh, stride_lse_b, stride_lse_h,
                     n_tiles, n_n, BH, SEC, Hkv, GROUP, Sq, Sk, shift, k_smem, v_smem, q_smem, do_smem, kv_bars,
                     kv_empty, ready_bars, empty_bars, rows_smem, CAUSAL, HEAD_DIM, BLOCK_M, STAGES, KV_BUFS,
                     PAIRS)),
    ], [4, 1], [240, 24])


def section_heads(bh: int, q, sq: int, group: int) -> int:
    """kv heads per section of the causal order: as many as fill half of L2 with their Q and dO
    (``group`` query heads of ``sq`` rows each); HEADS_PER_SECTION when set."""
    if HEADS_PER_SECTION:
        return min(HEADS_PER_SECTION, bh)
    per_kv_head = 2 * group * sq * q.shape[-1] * q.element_size()
    return min(bh, max(1, l2_bytes(q.device) // 2 // max(1, per_kv_head)))


def launch_args(q, k, v, do, lse, delta, dk, dv, win_right: int, qk_scale: float, sm_scale: float) -> tuple:
    """bwd_sm90.launch_args, then B x Hkv (with the key blocks, the number of tiles) and the causal
    order's kv heads per section."""
    bh, group = k.shape[0] * k.shape[2], q.shape[2] // k.shape[2]
    args = bwd_sm90.launch_args(q, k, v, do, lse, delta, dk, dv, win_right, qk_scale, sm_scale)
    # (without the cu_seqlens and the length class)
    return (*args[:8], *args[12:], bh, section_heads(bh, q, q.shape[1], group))


def grid(k, programs: int) -> tuple[int]:
    """One program per SM (``programs``), at most one per tile."""
    return (min(-(-k.shape[1] // (2 * HALF.value)) * k.shape[0] * k.shape[2], programs),)
