"""An experiment, not part of the library (written in the eleventh session, not yet run on a GPU):
the library's Gluon dK/dV kernel (tritonattn/kernels/bwd_sm90.py, copied here) with a FUSED_DQ
switch that also computes dQ, FlashAttention-3's way: 5 matrix products per tile instead of the
split backward's 7 (the Triton dQ kernel recomputes S and dP).

Per step (a block of BLOCK_M queries against the program's 128 keys), with FUSED_DQ:
- each consumer writes its dS^T tile (64 keys x BLOCK_M queries, 16-bit) to shared memory, double
  buffered by step parity, and arrives on that buffer's mbarrier (two arrivals);
- after dV / dK, each consumer computes its half of the columns of dQ = dS K over all 128 keys
  (two products of 64 keys, A = the two dS^T tiles transposed, B = a 64-column slice of each K
  half), writes it (fp32) to shared memory, and adds it to the fp32 buffer DQA in chunks of 8 rows,
  4 adjacent columns per thread (atom.add.v4.f32; the MMA layout's own atomics spilled 456 bytes).
Not deterministic (atomics), like the library's TRITONATTN_ATOMIC_DQ=1 path it would serve; the
caller zeroes DQA, computes delta first (the library's preprocess kernel) and scales dQ at the end.

Compiled for sm_90 here: FUSED_DQ=0 is the library kernel (72 / 112 bytes of spills, plain / causal);
FUSED_DQ=1 spills 272 / 168 bytes and takes 197 KB of shared memory. Checked and timed by
tune_gluon_bwd.py --fused (against the fp64 reference, and against the library's Gluon dK/dV
plus Triton dQ kernels).
Prediction (NOTES, eleventh session): the backward's dK/dV + dQ kernel time -15..-25% at S=8192.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from tritonattn.kernels.common import LOG2E

HALF = gl.constexpr(64)  # keys per consumer warpgroup; BLOCK_N = 2 * HALF keys per program
BLOCK_N = 2 * HALF.value  # the launcher's
# by head dim: (query rows per step, Q / dO slots), H200, llama shape (NOTES, eleventh session):
# D=128 with 64 rows and 2 slots 1.07-1.24x the Triton kernel at S=512-16384 (3 or 4 slots: within
# a few percent of it, lower in most cells); 32 rows and 4 slots 0.81-0.88x
TILES = {128: (64, 2)}
NUM_WARPS = 4  # the default partition (one consumer); the workers add 4 + 1 warps
MAXNREG = 168  # as the forward's: setmaxnreg moves the producer's registers to the consumers


@gluon.jit
def _producer(K, V, Q, DO, stride_kn, stride_vn, stride_qm, stride_qh, stride_dom, stride_doh, off_hk, start_n,
              Sq, Sk, GROUP, lo_blk, n_m, k_smem, v_smem, q_smem, do_smem, kv_bar, ready_bars, empty_bars,
              HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr):
    layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    k_desc = tma.make_tensor_descriptor(K, [Sk, HEAD_DIM], [stride_kn, 1], [HALF, HEAD_DIM], layout)
    v_desc = tma.make_tensor_descriptor(V, [Sk, HEAD_DIM], [stride_vn, 1], [HALF, HEAD_DIM], layout)
    mbarrier.expect(kv_bar, 4 * k_desc.block_type.nbytes)
    for c in gl.static_range(2):
        tma.async_copy_global_to_shared(k_desc, [start_n + c * HALF, 0], kv_bar, k_smem.index(c))
        tma.async_copy_global_to_shared(v_desc, [start_n + c * HALF, 0], kv_bar, v_smem.index(c))
    t = 0
    for g in range(GROUP):
        h = off_hk * GROUP + g
        q_desc = tma.make_tensor_descriptor(Q + h * stride_qh, [Sq, HEAD_DIM], [stride_qm, 1], [BLOCK_M, HEAD_DIM],
                                            layout)
        do_desc = tma.make_tensor_descriptor(DO + h * stride_doh, [Sq, HEAD_DIM], [stride_dom, 1],
                                             [BLOCK_M, HEAD_DIM], layout)
        for i in range(n_m):
            slot = t % STAGES
            mbarrier.wait(empty_bars.index(slot), ((t // STAGES) & 1) ^ 1)
            mbarrier.expect(ready_bars.index(slot), 2 * q_desc.block_type.nbytes)
            row = (lo_blk + i) * BLOCK_M
            tma.async_copy_global_to_shared(q_desc, [row, 0], ready_bars.index(slot), q_smem.index(slot))
            tma.async_copy_global_to_shared(do_desc, [row, 0], ready_bars.index(slot), do_smem.index(slot))
            t += 1
        # the next head's descriptors reuse this one's scratch: let every load through it land first
        for s in gl.static_range(STAGES):
            back = gl.maximum(t - 1 - s, 0)
            mbarrier.wait(ready_bars.index(back % STAGES), (back // STAGES) & 1, pred=t - 1 - s >= 0)


@gluon.jit
def _consumer(WG: gl.constexpr, DK, DV, stride_dkn, stride_dvn, LSE, DELTA, stride_lse_h, DQA, stride_dqam,
              stride_dqah, off_hk, start_n, Sq, Sk, GROUP, lo_blk, n_m, shift, qk_scale, sm_scale, k_smem, v_smem,
              q_smem, do_smem, ds_smem, dq_smem, kv_bar, ready_bars, empty_bars, ds_bars, CAUSAL: gl.constexpr,
              HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, FUSED_DQ: gl.constexpr):
    dtype: gl.constexpr = k_smem.dtype
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, BLOCK_M, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_DIM, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    # FUSED_DQ: this consumer's share of dQ = dS K, the columns [WG * DQ_COLS, + DQ_COLS) over all
    # 128 keys of the program (both consumers' dS through shared memory)
    DQ_COLS: gl.constexpr = HEAD_DIM // 2
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, DQ_COLS, 16])
    DQ_CHUNK: gl.constexpr = 8
    chunk_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 4], threads_per_warp=[2, 16],
                                                  warps_per_cta=[4, 1], order=[1, 0])
    key0 = start_n + WG * HALF
    offs_n = key0 + gl.arange(0, HALF, layout=gl.SliceLayout(1, st_layout))
    offs_mb = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, st_layout))
    zero_st = gl.zeros([HALF, BLOCK_M], gl.float32, st_layout)
    dk = gl.zeros([HALF, HEAD_DIM], gl.float32, acc_layout)
    dv = gl.zeros([HALF, HEAD_DIM], gl.float32, acc_layout)
    k = k_smem.index(WG)
    v = v_smem.index(WG)
    mbarrier.wait(kv_bar, 0)
    t = 0
    for g in range(GROUP):
        h = off_hk * GROUP + g
        p_lse = LSE + h * stride_lse_h
        p_delta = DELTA + h * stride_lse_h
        for i in range(n_m):
            slot = t % STAGES
            offs_m = (lo_blk + i) * BLOCK_M + offs_mb
            m_ok = offs_m < Sq
            mbarrier.wait(ready_bars.index(slot), (t // STAGES) & 1)
            q = q_smem.index(slot)
            do = do_smem.index(slot)
            st = warpgroup_mma(k, q.permute((1, 0)), zero_st, use_acc=False, is_async=True)
            dpt = warpgroup_mma(v, do.permute((1, 0)), zero_st, use_acc=False, is_async=True)
            # loaded while the products run (short live ranges: the consumers are at 240 registers).
            # Rows past Sq or that saw no key: lse2 = +inf, so their probabilities are exactly 0
            lse = gl.load(p_lse + offs_m, mask=m_ok, other=float("inf"))
            lse2 = gl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
            delta = gl.load(p_delta + offs_m, mask=m_ok, other=0.0)
            st, dpt = warpgroup_mma_wait(num_outstanding=0, deps=(st, dpt))
            if CAUSAL:  # key j is seen by query i when j <= i + shift
                if (lo_blk + i) * BLOCK_M + shift < key0 + HALF - 1:
                    seen = gl.expand_dims(offs_n, 1) <= gl.expand_dims(offs_m + shift, 0)
                    st = gl.where(seen, st, float("-inf"))
            pt = gl.exp2(st * qk_scale - gl.expand_dims(lse2, 0))
            dst = pt * (dpt - gl.expand_dims(delta, 0))
            if FUSED_DQ:  # dS^T of this consumer's keys into its half of buffer t % 2
                buf = t % 2
                ds_smem.index(buf * 2 + WG).store(dst.to(dtype))
            pt16 = gl.convert_layout(pt.to(dtype), a_layout)
            dst16 = gl.convert_layout(dst.to(dtype), a_layout)
            dv = warpgroup_mma(pt16, do, dv, is_async=True)
            dk = warpgroup_mma(dst16, q, dk, is_async=True)
            if FUSED_DQ:
                # both halves of dS written (each consumer arrives once per step; a buffer is
                # rewritten two steps later, after both consumers passed this barrier in between)
                fence_async_shared()
                mbarrier.arrive(ds_bars.index(buf))
                # dV / dK first: their register operands are free before dQ's accumulator is live
                dv, dk, pt16, dst16 = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk, pt16, dst16))
                mbarrier.arrive(empty_bars.index(slot))
                mbarrier.wait(ds_bars.index(buf), (t // 2) & 1)
                zero_dq = gl.zeros([BLOCK_M, DQ_COLS], gl.float32, dq_layout)
                dq = warpgroup_mma(ds_smem.index(buf * 2).permute((1, 0)),
                                   k_smem.index(0).slice(WG * DQ_COLS, DQ_COLS, dim=1), zero_dq, use_acc=False,
                                   is_async=True)
                dq = warpgroup_mma(ds_smem.index(buf * 2 + 1).permute((1, 0)),
                                   k_smem.index(1).slice(WG * DQ_COLS, DQ_COLS, dim=1), dq, is_async=True)
                dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq, ))
                # added to the fp32 buffer (scaled by the caller) through shared memory, DQ_CHUNK rows
                # at a time with 4 adjacent columns per thread (few live addresses: the consumers
                # are at their register limit)
                dq_tile = dq_smem.index(WG)
                dq_tile.store(dq)
                for c in gl.static_range(BLOCK_M // DQ_CHUNK):
                    part = dq_tile.slice(c * DQ_CHUNK, DQ_CHUNK, dim=0).load(chunk_layout)
                    dq_rows = (lo_blk + i) * BLOCK_M + c * DQ_CHUNK + gl.arange(0, DQ_CHUNK,
                                                                                layout=gl.SliceLayout(1, chunk_layout))
                    dq_cols = WG * DQ_COLS + gl.arange(0, DQ_COLS, layout=gl.SliceLayout(0, chunk_layout))
                    p_dq = (DQA + h * stride_dqah + gl.expand_dims(dq_rows.to(gl.int64) * stride_dqam, 1)
                            + gl.expand_dims(dq_cols, 0))
                    gl.atomic_add(p_dq, part, mask=gl.expand_dims(dq_rows < Sq, 1), sem="relaxed")
            else:
                dv, dk, pt16, dst16 = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk, pt16, dst16))
                mbarrier.arrive(empty_bars.index(slot))
            t += 1
    rows = key0 + gl.arange(0, HALF, layout=gl.SliceLayout(1, acc_layout))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, acc_layout))
    ok = gl.expand_dims(rows < Sk, 1)
    r64 = gl.expand_dims(rows.to(gl.int64), 1)
    gl.store(DK + r64 * stride_dkn + gl.expand_dims(cols, 0), (dk * sm_scale).to(dtype), mask=ok)
    gl.store(DV + r64 * stride_dvn + gl.expand_dims(cols, 0), dv.to(dtype), mask=ok)


@gluon.jit
def _bwd_dkdv_ws_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, DQA,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_dob, stride_dom, stride_doh,
    stride_dkb, stride_dkn, stride_dkh,
    stride_dvb, stride_dvn, stride_dvh,
    stride_lse_b, stride_lse_h,
    stride_dqab, stride_dqam, stride_dqah,
    Hkv, GROUP, Sq, Sk, win_right, qk_scale, sm_scale,
    CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
    FUSED_DQ: gl.constexpr, num_warps: gl.constexpr,
):
    gl.static_assert(num_warps == 4, "the default partition is one consumer warpgroup")
    dtype: gl.constexpr = Q.dtype.element_ty
    layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    pid_n = gl.program_id(0)
    bh = gl.program_id(1)
    off_b = (bh // Hkv).to(gl.int64)
    off_hk = (bh % Hkv).to(gl.int64)
    start_n = pid_n * (2 * HALF)

    # queries [lo_blk * BLOCK_M, Sq) see some key of the block (causal: query i sees j <= i + shift)
    shift = Sk - Sq + win_right
    lo_blk = 0
    if CAUSAL:
        lo_blk = gl.minimum(gl.maximum(start_n - shift, 0), Sq) // BLOCK_M
    n_m = gl.cdiv(Sq, BLOCK_M) - lo_blk

    k_smem = gl.allocate_shared_memory(dtype, [2, HALF, HEAD_DIM], layout)
    v_smem = gl.allocate_shared_memory(dtype, [2, HALF, HEAD_DIM], layout)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready_bars.index(i), count=1)
        mbarrier.init(empty_bars.index(i), count=2)  # both consumers release a slot
    if FUSED_DQ:  # dS^T tiles by (step parity, consumer), 4 x 8 KB, and a barrier per parity
        ds_smem = gl.allocate_shared_memory(dtype, [4, HALF, BLOCK_M], layout)
        ds_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        # each consumer's fp32 dQ tile on its way to the atomics, 2 x 16 KB
        dq_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M, HEAD_DIM // 2],
                                            gl.SwizzledSharedLayout(vec=4, per_phase=1, max_phase=8, order=[1, 0]))
        for i in gl.static_range(2):
            mbarrier.init(ds_bars.index(i), count=2)  # both consumers wrote their dS half
    else:  # (not read)
        ds_smem = k_smem
        ds_bars = kv_bar
        dq_smem = k_smem
    fence_async_shared()

    q_base = Q + off_b * stride_qb
    do_base = DO + off_b * stride_dob
    k_base = K + off_b * stride_kb + off_hk * stride_kh
    v_base = V + off_b * stride_vb + off_hk * stride_vh
    dk_base = DK + off_b * stride_dkb + off_hk * stride_dkh
    dv_base = DV + off_b * stride_dvb + off_hk * stride_dvh
    lse_base = LSE + off_b * stride_lse_b
    delta_base = DELTA + off_b * stride_lse_b
    dqa_base = DQA + off_b * stride_dqab
    gl.warp_specialize([
        (_consumer, (0, dk_base, dv_base, stride_dkn, stride_dvn, lse_base, delta_base, stride_lse_h, dqa_base,
                     stride_dqam, stride_dqah, off_hk, start_n, Sq, Sk, GROUP, lo_blk, n_m, shift, qk_scale, sm_scale,
                     k_smem, v_smem, q_smem, do_smem, ds_smem, dq_smem, kv_bar, ready_bars, empty_bars, ds_bars, CAUSAL,
                     HEAD_DIM, BLOCK_M, STAGES, FUSED_DQ)),
        (_consumer, (1, dk_base, dv_base, stride_dkn, stride_dvn, lse_base, delta_base, stride_lse_h, dqa_base,
                     stride_dqam, stride_dqah, off_hk, start_n, Sq, Sk, GROUP, lo_blk, n_m, shift, qk_scale, sm_scale,
                     k_smem, v_smem, q_smem, do_smem, ds_smem, dq_smem, kv_bar, ready_bars, empty_bars, ds_bars, CAUSAL,
                     HEAD_DIM, BLOCK_M, STAGES, FUSED_DQ)),
        (_producer, (k_base, v_base, q_base, do_base, stride_kn, stride_vn, stride_qm, stride_qh, stride_dom,
                     stride_doh, off_hk, start_n, Sq, Sk, GROUP, lo_blk, n_m, k_smem, v_smem, q_smem, do_smem, kv_bar,
                     ready_bars, empty_bars, HEAD_DIM, BLOCK_M, STAGES)),
    ], [4, 1], [240, 24])


def launch_args(q, k, v, do, lse, delta, dk, dv, win_right: int, qk_scale: float, sm_scale: float,
                dqa=None) -> tuple:
    """q / do (B, Sq, Hq, D), k / v / dk / dv (B, Sk, Hkv, D), unit dim stride; lse / delta (B, Hq, Sq).
    ``dqa``: with FUSED_DQ, the fp32 buffer (B, Sq, Hq, D), unit dim stride, that dS K is added to."""
    hq, hkv = q.shape[2], k.shape[2]
    dqa_args = (dqa, *dqa.stride()[:3]) if dqa is not None else (q, 0, 0, 0)
    return (q, k, v, do, lse, delta, dk, dv, dqa_args[0], *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
            *do.stride()[:3], *dk.stride()[:3], *dv.stride()[:3], lse.stride(0), lse.stride(1), *dqa_args[1:],
            hkv, hq // hkv, q.shape[1], k.shape[1], win_right, qk_scale, sm_scale)
