"""Experiment (eighteenth session): a Gluon sm_90 dK/dV kernel for head dim 256, the gradients split
between the two consumer warpgroups instead of the keys.

The library's Gluon dK/dV kernel (tritonattn/kernels/bwd_sm90.py) gives each consumer warpgroup 64
keys and both of their gradients: at D=256 that is two 64 x 256 fp32 accumulators, 256 registers
per thread before anything else, so D=256 keeps the Triton kernel (split by gradient into a dV and
a dK launch, 5 products per tile; 0.82-0.87x cuDNN at S=16384). Here a program owns 64 keys and
the consumers split the work by gradient, each with one 128-register accumulator:

- consumer P (the default partition): S^T = K Q^T, the causal mask, P^T = exp2(S^T * scale - lse);
  hands P^T (fp32, through shared memory, two buffers) to consumer K; dV += P^T dO;
- consumer K (a 4-warp worker): dP^T = V dO^T; takes P^T; dS^T = P^T * (dP^T - delta);
  dK += dS^T Q;
- the producer warp: K and V once, then the Q / dO / lse / delta ring (the library's
  _load_query_blocks, heads one after the other).

Four products per tile, two per consumer (the Triton split launches run five). EXCHANGE=False (tile
``r:`` in the tuner): consumer K computes P^T itself (a third product for it, no handoff, no
barriers between the consumers). Shared memory, bf16:
K and V 32 KB each, Q and dO 2 slots x 32 KB each, P^T 2 x 16 KB: 224 KB of the 227 KB. Dense
calls only (no varlen, no fused dQ); causal and a window's right edge as the library's kernel.
Takes the library kernel's arguments (bwd_sm90.launch_args) on a grid of (cdiv(Sk, 64), B * Hkv).

Checked against the reference and timed beside the library's Triton dK/dV kernels by
tune_gluon_bwd.py (tiles ``d:BLOCK_M,STAGES`` and ``r:BLOCK_M,STAGES``, with ``--head-dim 256``).
Shared memory holds 64-row steps in 2 slots (``d:64,2``) or 32-row steps in up to 4 (``d:32,4``).
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

from tritonattn.kernels.bwd_sm90 import HALF, _load_query_blocks, _step

BLOCK_N = HALF.value  # keys per program
MAXNREG = 168


def grid(k):
    """(key blocks, batch x kv heads) for k (B, Sk, Hkv, D)."""
    return ((k.shape[1] + BLOCK_N - 1) // BLOCK_N, k.shape[0] * k.shape[2])


@gluon.jit
def _producer(K, V, Q, DO, stride_kn, stride_vn, stride_qm, stride_qh, stride_dom, stride_doh, off_hk, start_n,
              Sq, q_rows, Sk, GROUP, lo_blk, n_m, k_smem, v_smem, q_smem, do_smem, kv_bar, ready_bars, empty_bars,
              LSE, DELTA, stride_lse_h, rows_smem, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
              STAGES: gl.constexpr):
    layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    k_desc = tma.make_tensor_descriptor(K, [Sk, HEAD_DIM], [stride_kn, 1], [HALF, HEAD_DIM], layout)
    v_desc = tma.make_tensor_descriptor(V, [Sk, HEAD_DIM], [stride_vn, 1], [HALF, HEAD_DIM], layout)
    mbarrier.expect(kv_bar, 2 * k_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [start_n, 0], kv_bar, k_smem)
    tma.async_copy_global_to_shared(v_desc, [start_n, 0], kv_bar, v_smem)
    _load_query_blocks(0, Q, DO, stride_qm, stride_qh, stride_dom, stride_doh, off_hk, Sq, q_rows, GROUP, lo_blk,
                       n_m, q_smem, do_smem, ready_bars, empty_bars, LSE, DELTA, stride_lse_h, rows_smem, HEAD_DIM,
                       BLOCK_M, STAGES, False)


@gluon.jit
def _consumer_p(DV, stride_dvn, start_n, Sk, GROUP, lo_blk, n_m, shift, qk_scale, k_smem, q_smem, do_smem, kv_bar,
                ready_bars, empty_bars, rows_smem, p_smem, p_full, p_empty, CAUSAL: gl.constexpr,
                HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, EXCHANGE: gl.constexpr):
    """P^T of each step (to consumer K through ``p_smem`` with EXCHANGE) and dV of the program's keys."""
    dtype: gl.constexpr = k_smem.dtype
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, BLOCK_M, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_DIM, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    offs_n = start_n + gl.arange(0, HALF, layout=gl.SliceLayout(1, st_layout))
    offs_mb = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, st_layout))
    zero_st = gl.zeros([HALF, BLOCK_M], gl.float32, st_layout)
    dv = gl.zeros([HALF, HEAD_DIM], gl.float32, acc_layout)
    mbarrier.wait(kv_bar, 0)
    for j in range(GROUP * n_m):
        _g, blk = _step(j, GROUP, lo_blk, n_m, False)
        slot = j % STAGES
        mbarrier.wait(ready_bars.index(slot), (j // STAGES) & 1)
        q = q_smem.index(slot)
        do = do_smem.index(slot)
        st = warpgroup_mma(k_smem, q.permute((1, 0)), zero_st, use_acc=False, is_async=True)
        st = warpgroup_mma_wait(num_outstanding=0, deps=(st, ))
        pt = _probs_t(st, rows_smem.index(2 * slot), blk, offs_n, offs_mb, start_n, shift, qk_scale, CAUSAL, BLOCK_M)
        if EXCHANGE:  # P^T for consumer K, into buffer j % 2 once it has read what was there two steps ago
            buf = j % 2
            mbarrier.wait(p_empty.index(buf), ((j // 2) & 1) ^ 1)
            p_smem.index(buf).store(pt)
            gl.thread_barrier()  # every lane's part of the tile before the arrival
            mbarrier.arrive(p_full.index(buf))
        pt16 = gl.convert_layout(pt.to(dtype), a_layout)
        dv = warpgroup_mma(pt16, do, dv, is_async=True)
        dv, pt16 = warpgroup_mma_wait(num_outstanding=0, deps=(dv, pt16))
        mbarrier.arrive(empty_bars.index(slot))
    _store_rows(DV, stride_dvn, start_n, Sk, dv, 1.0)


@gluon.jit
def _consumer_k(DK, stride_dkn, start_n, Sk, GROUP, lo_blk, n_m, shift, qk_scale, sm_scale, k_smem, v_smem, q_smem,
                do_smem, kv_bar, ready_bars, empty_bars, rows_smem, p_smem, p_full, p_empty, CAUSAL: gl.constexpr,
                HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, EXCHANGE: gl.constexpr):
    """dK of the program's keys, from consumer P's P^T of each step (EXCHANGE), or from P^T computed
    here again (a third product per step, no handoff)."""
    dtype: gl.constexpr = v_smem.dtype
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, BLOCK_M, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_DIM, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    offs_n = start_n + gl.arange(0, HALF, layout=gl.SliceLayout(1, st_layout))
    offs_mb = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, st_layout))
    zero_st = gl.zeros([HALF, BLOCK_M], gl.float32, st_layout)
    dk = gl.zeros([HALF, HEAD_DIM], gl.float32, acc_layout)
    mbarrier.wait(kv_bar, 0)
    for j in range(GROUP * n_m):
        _g, blk = _step(j, GROUP, lo_blk, n_m, False)
        slot = j % STAGES
        mbarrier.wait(ready_bars.index(slot), (j // STAGES) & 1)
        q = q_smem.index(slot)
        do = do_smem.index(slot)
        dpt = warpgroup_mma(v_smem, do.permute((1, 0)), zero_st, use_acc=False, is_async=True)
        if EXCHANGE:
            dpt = warpgroup_mma_wait(num_outstanding=0, deps=(dpt, ))
            buf = j % 2
            mbarrier.wait(p_full.index(buf), (j // 2) & 1)
            pt = p_smem.index(buf).load(st_layout)
            gl.thread_barrier()  # every lane has read the tile before the buffer goes back
            mbarrier.arrive(p_empty.index(buf))
        else:
            st = warpgroup_mma(k_smem, q.permute((1, 0)), zero_st, use_acc=False, is_async=True)
            dpt, st = warpgroup_mma_wait(num_outstanding=0, deps=(dpt, st))
            pt = _probs_t(st, rows_smem.index(2 * slot), blk, offs_n, offs_mb, start_n, shift, qk_scale, CAUSAL,
                          BLOCK_M)
        delta = rows_smem.index(2 * slot + 1).load(gl.SliceLayout(0, st_layout))
        dst = pt * (dpt - gl.expand_dims(delta, 0))
        dst16 = gl.convert_layout(dst.to(dtype), a_layout)
        dk = warpgroup_mma(dst16, q, dk, is_async=True)
        dk, dst16 = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dst16))
        mbarrier.arrive(empty_bars.index(slot))
    _store_rows(DK, stride_dkn, start_n, Sk, dk, sm_scale)


@gluon.jit
def _probs_t(st, lse2_row, blk, offs_n, offs_mb, start_n, shift, qk_scale, CAUSAL: gl.constexpr,
             BLOCK_M: gl.constexpr):
    """P^T of the 64 keys from ``start_n`` against query block ``blk``: S^T ``st`` (in the layout of
    ``offs_n`` / ``offs_mb``), masked where the block crosses the causal diagonal (key j is seen by
    query i when j <= i + shift), then exp2(S^T * qk_scale - lse2), lse2 from the ring's row buffer."""
    lse2 = lse2_row.load(offs_mb.type.layout)
    if CAUSAL:
        if blk * BLOCK_M + shift < start_n + HALF - 1:
            offs_m = blk * BLOCK_M + offs_mb
            st = gl.where(gl.expand_dims(offs_n, 1) <= gl.expand_dims(offs_m + shift, 0), st, float("-inf"))
    return gl.exp2(st * qk_scale - gl.expand_dims(lse2, 0))


@gluon.jit
def _store_rows(PTR, stride_n, key0, Sk, acc, scale):
    """``acc * scale`` into rows [key0, key0 + 64) of PTR, rows past Sk left alone."""
    acc_layout: gl.constexpr = acc.type.layout
    rows = key0 + gl.arange(0, HALF, layout=gl.SliceLayout(1, acc_layout))
    cols = gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, acc_layout))
    r64 = gl.expand_dims(rows.to(gl.int64), 1)
    gl.store(PTR + r64 * stride_n + gl.expand_dims(cols, 0), (acc * scale).to(PTR.dtype.element_ty),
             mask=gl.expand_dims(rows < Sk, 1))


@gluon.jit
def _bwd_dkdv_d256_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, CU_Q, CU_K, LEN_LO, LEN_HI,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_dob, stride_dom, stride_doh,
    stride_dkb, stride_dkn, stride_dkh,
    stride_dvb, stride_dvn, stride_dvh,
    stride_lse_b, stride_lse_h,
    Hkv, GROUP, Sq, Sk, win_right, qk_scale, sm_scale,
    DQA, dqa_rows, dqa_batch_rows, dqa_head_rows, SEM, sem_batch, sem_head,
    CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
    num_warps: gl.constexpr, EXCHANGE: gl.constexpr = True,
):
    gl.static_assert(num_warps == 4, "the default partition is one consumer warpgroup")
    # K, V (64 keys), the Q / dO ring, its lse / delta rows and P^T's two buffers in the 232,448 bytes
    gl.static_assert(2 * HALF * HEAD_DIM * 2 + STAGES * BLOCK_M * (4 * HEAD_DIM + 8) + 2 * HALF * BLOCK_M * 4
                     <= 232448 - 1024, "the tile does not fit in shared memory")
    dtype: gl.constexpr = Q.dtype.element_ty
    layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    start_n = gl.program_id(0) * HALF
    bh = gl.program_id(1)
    off_b = (bh // Hkv).to(gl.int64)
    off_hk = (bh % Hkv).to(gl.int64)
    shift = Sk - Sq + win_right
    lo_blk = 0
    if CAUSAL:  # queries [lo_blk * BLOCK_M, Sq) see some key of the block (query i sees j <= i + shift)
        lo_blk = gl.minimum(gl.maximum(start_n - shift, 0), Sq) // BLOCK_M
    n_m = gl.cdiv(Sq, BLOCK_M) - lo_blk

    k_smem = gl.allocate_shared_memory(dtype, [HALF, HEAD_DIM], layout)
    v_smem = gl.allocate_shared_memory(dtype, [HALF, HEAD_DIM], layout)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], layout)
    rows_smem = gl.allocate_shared_memory(gl.float32, [2 * STAGES, BLOCK_M],
                                          gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0]))
    # (without EXCHANGE a stand-in of one row, unread)
    p_smem = gl.allocate_shared_memory(gl.float32, [2, HALF if EXCHANGE else 1, BLOCK_M],
                                       gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2))
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    p_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    p_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready_bars.index(i), count=1)
        mbarrier.init(empty_bars.index(i), count=2)  # both consumers release a slot
    for i in gl.static_range(2):
        mbarrier.init(p_full.index(i), count=1)
        mbarrier.init(p_empty.index(i), count=1)
    fence_async_shared()

    q_base = Q + off_b * stride_qb
    do_base = DO + off_b * stride_dob
    k_base = K + off_b * stride_kb + off_hk * stride_kh
    v_base = V + off_b * stride_vb + off_hk * stride_vh
    dk_base = DK + off_b * stride_dkb + off_hk * stride_dkh
    dv_base = DV + off_b * stride_dvb + off_hk * stride_dvh
    lse_base = LSE + off_b * stride_lse_b
    delta_base = DELTA + off_b * stride_lse_b
    gl.warp_specialize([
        (_consumer_p, (dv_base, stride_dvn, start_n, Sk, GROUP, lo_blk, n_m, shift, qk_scale, k_smem, q_smem, do_smem,
                       kv_bar, ready_bars, empty_bars, rows_smem, p_smem, p_full, p_empty, CAUSAL, HEAD_DIM, BLOCK_M,
                       STAGES, EXCHANGE)),
        (_consumer_k, (dk_base, stride_dkn, start_n, Sk, GROUP, lo_blk, n_m, shift, qk_scale, sm_scale, k_smem,
                       v_smem, q_smem, do_smem, kv_bar, ready_bars, empty_bars, rows_smem, p_smem, p_full, p_empty,
                       CAUSAL, HEAD_DIM, BLOCK_M, STAGES, EXCHANGE)),
        (_producer, (k_base, v_base, q_base, do_base, stride_kn, stride_vn, stride_qm, stride_qh, stride_dom,
                     stride_doh, off_hk, start_n, Sq, Sq, Sk, GROUP, lo_blk, n_m, k_smem, v_smem, q_smem, do_smem,
                     kv_bar, ready_bars, empty_bars, lse_base, delta_base, stride_lse_h, rows_smem, HEAD_DIM, BLOCK_M,
                     STAGES)),
    ], [4, 1], [240, 24])
