"""An experiment, not part of the library, written at the end of the tenth session and not yet run
on a GPU: the backward's dQ kernel in Gluon for sm_90, with the forward's structure
(tritonattn/kernels/fwd_sm90.py).

A program owns 128 query rows of one query head, in three partitions:
- a producer warp: the TMA loads of Q and dO (once, two 64-row halves each) and of K / V blocks
  into a ring of STAGES slots, each refilled once both consumers released it;
- two consumer warpgroups of 64 rows each: S = Q K^T and dP = dO V^T, P = exp2(S - lse),
  dS = P (dP - delta), dQ += dS K, accumulated in registers.
Deterministic. With gluon_bwd_dkdv.py beside this, the whole backward (after the preprocess that
makes delta). Plain or causal (a right edge), 16-bit, D = 128, dense (B, S, H, D) inputs readable
through tensor descriptors; lse and delta (B, Hq, Sq) float32. Checked and timed by
tune_gluon_bwd.py.
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

HALF = gl.constexpr(64)  # query rows per consumer warpgroup; 2 * HALF per program


@gluon.jit
def _producer(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, qdo_bar, ready_bars, empty_bars,
              start_m, n_blocks, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    mbarrier.expect(qdo_bar, 4 * q_desc.block_type.nbytes)
    for c in gl.static_range(2):
        tma.async_copy_global_to_shared(q_desc, [start_m + c * HALF, 0], qdo_bar, q_smem.index(c))
        tma.async_copy_global_to_shared(do_desc, [start_m + c * HALF, 0], qdo_bar, do_smem.index(c))
    for j in range(n_blocks):
        slot = j % STAGES
        mbarrier.wait(empty_bars.index(slot), ((j // STAGES) & 1) ^ 1)
        mbarrier.expect(ready_bars.index(slot), 2 * k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [j * BLOCK_N, 0], ready_bars.index(slot), k_smem.index(slot))
        tma.async_copy_global_to_shared(v_desc, [j * BLOCK_N, 0], ready_bars.index(slot), v_smem.index(slot))


@gluon.jit
def _consumer(WG: gl.constexpr, DQ, stride_dqm, LSE, DELTA, start_m, Sq, Sk, shift, n_blocks, qk_scale, sm_scale,
              q_smem, do_smem, k_smem, v_smem, qdo_bar, ready_bars, empty_bars, CAUSAL: gl.constexpr,
              HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_DIM, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    row0 = start_m + WG * HALF
    offs_m = row0 + gl.arange(0, HALF, layout=gl.SliceLayout(1, s_layout))
    offs_nb = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    m_ok = offs_m < Sq
    # rows past Sq or that saw no key: lse2 = +inf, so their probabilities are exactly 0
    lse = gl.load(LSE + offs_m, mask=m_ok, other=float("inf"))
    lse2 = gl.expand_dims(gl.where(lse == float("-inf"), float("inf"), lse * LOG2E), 1)
    delta = gl.expand_dims(gl.load(DELTA + offs_m, mask=m_ok, other=0.0), 1)
    zero_s = gl.zeros([HALF, BLOCK_N], gl.float32, s_layout)
    dq = gl.zeros([HALF, HEAD_DIM], gl.float32, acc_layout)
    q = q_smem.index(WG)
    do = do_smem.index(WG)
    mbarrier.wait(qdo_bar, 0)
    for j in range(n_blocks):
        slot = j % STAGES
        mbarrier.wait(ready_bars.index(slot), (j // STAGES) & 1)
        k = k_smem.index(slot)
        s = warpgroup_mma(q, k.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        dp = warpgroup_mma(do, v_smem.index(slot).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        s, dp = warpgroup_mma_wait(num_outstanding=0, deps=(s, dp))
        cols = j * BLOCK_N + offs_nb
        # keys past Sk (zero rows of K: their scores would be 0, their probabilities anything) and,
        # causal, past each row's diagonal; only the blocks that hold some
        if (j + 1) * BLOCK_N > Sk or (CAUSAL and (j + 1) * BLOCK_N - 1 > row0 + shift):
            seen = gl.expand_dims(cols < Sk, 0)
            if CAUSAL:
                seen = seen & (gl.expand_dims(cols, 0) <= gl.expand_dims(offs_m + shift, 1))
            s = gl.where(seen, s, float("-inf"))
        p = gl.exp2(s * qk_scale - lse2)
        ds = gl.convert_layout((p * (dp - delta)).to(dtype), a_layout)
        dq = warpgroup_mma(ds, k, dq, is_async=True)
        dq, ds = warpgroup_mma_wait(num_outstanding=0, deps=(dq, ds))
        mbarrier.arrive(empty_bars.index(slot))
    rows = row0 + gl.arange(0, HALF, layout=gl.SliceLayout(1, acc_layout))
    cols_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, acc_layout))
    p_dq = DQ + gl.expand_dims(rows.to(gl.int64) * stride_dqm, 1) + gl.expand_dims(cols_d, 0)
    gl.store(p_dq, (dq * sm_scale).to(DQ.dtype.element_ty), mask=gl.expand_dims(rows < Sq, 1))


@gluon.jit
def _bwd_dq_ws_kernel(
    Q, K, V, DO, LSE, DELTA, DQ,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_dob, stride_dom, stride_doh,
    stride_dqb, stride_dqm, stride_dqh,
    stride_lse_b, stride_lse_h,
    Hq, GROUP, Sq, Sk, win_right, qk_scale, sm_scale,
    CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    num_warps: gl.constexpr,
):
    gl.static_assert(num_warps == 4, "the default partition is one consumer warpgroup")
    dtype: gl.constexpr = Q.dtype.element_ty
    layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    pid_m = gl.program_id(0)
    bh = gl.program_id(1)
    if CAUSAL:  # the last query blocks have the most keys: launch them first
        pid_m = gl.num_programs(0) - 1 - pid_m
    off_b = (bh // Hq).to(gl.int64)
    off_h = (bh % Hq).to(gl.int64)
    off_hk = off_h // GROUP
    start_m = pid_m * (2 * HALF)

    q_desc = tma.make_tensor_descriptor(Q + off_b * stride_qb + off_h * stride_qh, [Sq, HEAD_DIM], [stride_qm, 1],
                                        [HALF, HEAD_DIM], layout)
    do_desc = tma.make_tensor_descriptor(DO + off_b * stride_dob + off_h * stride_doh, [Sq, HEAD_DIM],
                                         [stride_dom, 1], [HALF, HEAD_DIM], layout)
    k_desc = tma.make_tensor_descriptor(K + off_b * stride_kb + off_hk * stride_kh, [Sk, HEAD_DIM], [stride_kn, 1],
                                        [BLOCK_N, HEAD_DIM], layout)
    v_desc = tma.make_tensor_descriptor(V + off_b * stride_vb + off_hk * stride_vh, [Sk, HEAD_DIM], [stride_vn, 1],
                                        [BLOCK_N, HEAD_DIM], layout)
    q_smem = gl.allocate_shared_memory(dtype, [2, HALF, HEAD_DIM], layout)
    do_smem = gl.allocate_shared_memory(dtype, [2, HALF, HEAD_DIM], layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], layout)
    qdo_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(qdo_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready_bars.index(i), count=1)
        mbarrier.init(empty_bars.index(i), count=2)  # both consumers release a slot
    fence_async_shared()

    # keys [0, hi) are seen by some row of the program (causal: row i sees j <= i + shift)
    shift = Sk - Sq + win_right
    hi = Sk
    if CAUSAL:
        hi = gl.minimum(gl.maximum(start_m + 2 * HALF + shift, 0), Sk)
    n_blocks = gl.cdiv(hi, BLOCK_N)

    dq_base = DQ + off_b * stride_dqb + off_h * stride_dqh
    lse_base = LSE + off_b * stride_lse_b + off_h * stride_lse_h
    delta_base = DELTA + off_b * stride_lse_b + off_h * stride_lse_h
    gl.warp_specialize([
        (_consumer, (0, dq_base, stride_dqm, lse_base, delta_base, start_m, Sq, Sk, shift, n_blocks, qk_scale,
                     sm_scale, q_smem, do_smem, k_smem, v_smem, qdo_bar, ready_bars, empty_bars, CAUSAL, HEAD_DIM,
                     BLOCK_N, STAGES)),
        (_consumer, (1, dq_base, stride_dqm, lse_base, delta_base, start_m, Sq, Sk, shift, n_blocks, qk_scale,
                     sm_scale, q_smem, do_smem, k_smem, v_smem, qdo_bar, ready_bars, empty_bars, CAUSAL, HEAD_DIM,
                     BLOCK_N, STAGES)),
        (_producer, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, qdo_bar, ready_bars,
                     empty_bars, start_m, n_blocks, BLOCK_N, STAGES)),
    ], [4, 1], [240, 24])


def launch_args(q, k, v, do, lse, delta, dq, win_right: int, qk_scale: float, sm_scale: float) -> tuple:
    """q / do / dq (B, Sq, Hq, D), k / v (B, Sk, Hkv, D), unit dim stride; lse / delta (B, Hq, Sq)."""
    hq, hkv = q.shape[2], k.shape[2]
    return (q, k, v, do, lse, delta, dq, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3],
            *dq.stride()[:3], lse.stride(0), lse.stride(1), hq, hq // hkv, q.shape[1], k.shape[1], win_right,
            qk_scale, sm_scale)
