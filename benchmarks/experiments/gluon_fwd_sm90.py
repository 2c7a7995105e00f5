"""An experiment, not part of the library: a Hopper (sm_90) forward in Gluon
(``triton.experimental.gluon``, shipped with Triton 3.6), the plain and causal forward with
FlashAttention-3's intra-warpgroup pipelining (the softmax of key block j meant to overlap the
tensor cores' P_{j-1} V_{j-1}) and, with LAZY, FlashAttention-4's lazy rescaling.

Correct on the H200 (fp64 reference, the tests' rule, odd shapes) but not faster than the library's
Triton forward: 0.95-1.03x at D=128 without LAZY, 0.87-0.96x with it (benchmarks/NOTES.md, tenth
session, and the SASS findings there: ptxas hoists the wait on P V above the softmax, and the
compiler puts a CTA barrier before every mbarrier wait and TMA issue). Kept as the starting point
for the warp-specialized, ping-pong version that is now the library's sm_90 forward at D=128
(tritonattn/kernels/fwd_sm90.py); measured with tune_gluon_fwd.py beside this.
Dense inputs (B, S, H, D) with unit dim stride and TMA-aligned strides, 16-bit, D = 64 / 128.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)

from tritonattn.kernels.common import LN2
from tritonattn.kernels.fwd_sm90 import _softmax_step


@gluon.jit
def _load_block(j, n_blocks, desc, smem, bars, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """Start the TMA load of key or value block ``j`` into its ring slot (none past the last block;
    block 0 always, which the kernel reads even when no key is visible)."""
    slot = j % STAGES
    ok = (j < n_blocks) | (j == 0)
    mbarrier.expect(bars.index(slot), desc.block_type.nbytes, pred=ok)
    tma.async_copy_global_to_shared(desc, [j * BLOCK_N, 0], bars.index(slot), smem.index(slot), pred=ok)


@gluon.jit
def _kv_block(j, n_blocks, k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, BLOCK_N: gl.constexpr,
              STAGES: gl.constexpr):
    """Key and value block ``j``."""
    _load_block(j, n_blocks, k_desc, k_smem, k_bars, BLOCK_N, STAGES)
    _load_block(j, n_blocks, v_desc, v_smem, v_bars, BLOCK_N, STAGES)


@gluon.jit
def _block_loop(lo, hi, n_blocks, q_smem, k_smem, v_smem, k_bars, v_bars, k_desc, v_desc, acc, p, m_i, l_i,
                s_zero, offs_m, offs_n, Sk, causal_shift, qk_scale,
                MASKED: gl.constexpr, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                o_layout: gl.constexpr, p_layout: gl.constexpr):
    """Key blocks [lo, hi), each: S_j = Q K_j^T issued, then acc += P_{j-1} V_{j-1} issued behind it;
    the softmax of S_j runs while the tensor cores do P_{j-1} V_{j-1}."""
    for j in range(lo, hi):
        slot = j % STAGES
        mbarrier.wait(k_bars.index(slot), (j // STAGES) & 1)
        s = warpgroup_mma(q_smem, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        prev = (j - 1) % STAGES
        mbarrier.wait(v_bars.index(prev), ((j - 1) // STAGES) & 1)
        acc = warpgroup_mma(p, v_smem.index(prev), acc, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s, ))
        p32, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, offs_m, offs_n, j * BLOCK_N, Sk, causal_shift, qk_scale,
                                             MASKED, CAUSAL)
        # the probabilities pass through the wait: without them, ptxas scheduled the wait before
        # the exponentials, and the softmax no longer overlapped P_{j-1} V_{j-1} (read in the SASS)
        acc, p, p32, l_i = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p, p32, l_i))
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
        p = gl.convert_layout(p32.to(k_smem.dtype), p_layout)
        # both warpgroups are done with slot `prev` (K_{j-1} and V_{j-1}): refill it
        gl.thread_barrier()
        _kv_block(j - 1 + STAGES, n_blocks, k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, BLOCK_N, STAGES)
    return acc, p, m_i, l_i


@gluon.jit
def _block_loop_lazy(lo, hi, n_blocks, q_smem, k_smem, v_smem, k_bars, v_bars, k_desc, v_desc, acc, p, p_fly,
                     m_i, l_i, s_zero, offs_m, offs_n, Sk, causal_shift, qk_scale,
                     MASKED: gl.constexpr, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                     o_layout: gl.constexpr, p_layout: gl.constexpr):
    """As :func:`_block_loop`, with FlashAttention-4's lazy rescaling: the running max moves only when
    some row's max grew by more than 2^8, so most blocks never wait for P_{j-1} V_{j-1} and the
    next block's P V chains onto it in the tensor cores. ``p_fly``: the probabilities P_{j-2} V_{j-2}
    reads, kept alive until that product is known done."""
    for j in range(lo, hi):
        slot = j % STAGES
        mbarrier.wait(k_bars.index(slot), (j // STAGES) & 1)
        s = warpgroup_mma(q_smem, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        prev = (j - 1) % STAGES
        mbarrier.wait(v_bars.index(prev), ((j - 1) // STAGES) & 1)
        acc = warpgroup_mma(p, v_smem.index(prev), acc, is_async=True)
        # S_j done, and with it every older product (P_{j-2} V_{j-2}: p_fly is free)
        s, p_fly = warpgroup_mma_wait(num_outstanding=1, deps=(s, p_fly))
        p_fly = p
        if MASKED:
            cols = j * BLOCK_N + offs_n
            keep = gl.expand_dims(cols < Sk, 0)
            if CAUSAL:
                keep = keep & (gl.expand_dims(cols, 0) <= gl.expand_dims(offs_m + causal_shift, 1))
            s = gl.where(keep, s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
        if gl.max((m_new > m_i + 8.0).to(gl.int32), 0) > 0:
            acc, p_fly = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p_fly))
            m_sub = gl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = gl.exp2(m_i - m_sub)
            acc = warpgroup_mma_init(acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1))
            l_i = l_i * alpha
            m_i = m_new
        m_sub = m_i
        if MASKED:
            m_sub = gl.where(m_i == float("-inf"), 0.0, m_i)
        p32 = gl.exp2(s * qk_scale - gl.expand_dims(m_sub, 1))
        l_i = l_i + gl.sum(p32, 1)
        p = gl.convert_layout(p32.to(k_smem.dtype), p_layout)
        # K_{j-1} (read by S_{j-1}) and V_{j-2} (read by P_{j-2} V_{j-2}) are free in both warpgroups
        gl.thread_barrier()
        _load_block(j - 1 + STAGES, n_blocks, k_desc, k_smem, k_bars, BLOCK_N, STAGES)
        if j >= 2:
            _load_block(j - 2 + STAGES, n_blocks, v_desc, v_smem, v_bars, BLOCK_N, STAGES)
    return acc, p, p_fly, m_i, l_i


@gluon.jit
def _fwd_sm90_kernel(
    Q, K, V, O, LSE,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_ob, stride_om, stride_oh,
    stride_lse_b, stride_lse_h,
    Hq, GROUP, Sq, Sk, win_right, qk_scale,
    CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, LAZY: gl.constexpr, num_warps: gl.constexpr,
):
    dtype: gl.constexpr = Q.dtype.element_ty
    # wgmma accumulators: every warp owns 16 rows (BLOCK_M = 16 * num_warps)
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    tile_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)

    pid_m = gl.program_id(0)
    bh = gl.program_id(1)
    if CAUSAL:  # the last query blocks have the most keys: launch them first
        pid_m = gl.num_programs(0) - 1 - pid_m
    off_b = (bh // Hq).to(gl.int64)
    off_h = (bh % Hq).to(gl.int64)
    off_hk = off_h // GROUP
    start_m = pid_m * BLOCK_M

    # one descriptor per program over this head's rows (rows past the end read as zeros)
    q_desc = tma.make_tensor_descriptor(Q + off_b * stride_qb + off_h * stride_qh, [Sq, HEAD_DIM], [stride_qm, 1],
                                        [BLOCK_M, HEAD_DIM], tile_layout)
    k_desc = tma.make_tensor_descriptor(K + off_b * stride_kb + off_hk * stride_kh, [Sk, HEAD_DIM], [stride_kn, 1],
                                        [BLOCK_N, HEAD_DIM], tile_layout)
    v_desc = tma.make_tensor_descriptor(V + off_b * stride_vb + off_hk * stride_vh, [Sk, HEAD_DIM], [stride_vn, 1],
                                        [BLOCK_N, HEAD_DIM], tile_layout)

    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], tile_layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], tile_layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], tile_layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_bars.index(i), count=1)
        mbarrier.init(v_bars.index(i), count=1)
    fence_async_shared()

    # keys [0, hi) are visible to some row of the block, [0, full_hi) to every row; CAUSAL: query i
    # sees keys j <= i + causal_shift (flash-attn's bottom-right causal when win_right = 0)
    causal_shift = Sk - Sq + win_right
    hi = Sk
    full_hi = Sk // BLOCK_N * BLOCK_N
    if CAUSAL:
        hi = gl.minimum(gl.maximum(start_m + BLOCK_M + causal_shift, 0), Sk)
        full_hi = gl.minimum(gl.maximum(start_m + causal_shift + 1, 0) // BLOCK_N * BLOCK_N, full_hi)
    n_blocks = gl.cdiv(hi, BLOCK_N)
    n_full = full_hi // BLOCK_N

    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [start_m, 0], q_bar, q_smem)
    for i in gl.static_range(STAGES - 1):
        _kv_block(i, n_blocks, k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, BLOCK_N, STAGES)

    offs_m = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)

    # block 0 (always run, masked: a program whose rows see no key gets zeros and lse -inf)
    mbarrier.wait(q_bar, 0)
    mbarrier.wait(k_bars.index(0), 0)
    s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
    p32, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, offs_m, offs_n, 0, Sk, causal_shift, qk_scale, True, CAUSAL)
    p = gl.convert_layout(p32.to(dtype), p_layout)
    _kv_block(STAGES - 1, n_blocks, k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, BLOCK_N, STAGES)
    if LAZY:
        p_fly = p
        acc = warpgroup_mma_init(acc)  # carried as a product in flight
        acc, p, p_fly, m_i, l_i = _block_loop_lazy(
            1, gl.maximum(n_full, 1), n_blocks, q_smem, k_smem, v_smem, k_bars, v_bars, k_desc, v_desc, acc, p,
            p_fly, m_i, l_i, s_zero, offs_m, offs_n, Sk, causal_shift, qk_scale, False, CAUSAL, BLOCK_N, STAGES,
            o_layout, p_layout)
        acc, p, p_fly, m_i, l_i = _block_loop_lazy(
            gl.maximum(n_full, 1), n_blocks, n_blocks, q_smem, k_smem, v_smem, k_bars, v_bars, k_desc, v_desc, acc,
            p, p_fly, m_i, l_i, s_zero, offs_m, offs_n, Sk, causal_shift, qk_scale, True, CAUSAL, BLOCK_N, STAGES,
            o_layout, p_layout)
    else:
        # blocks every row sees in full, then the diagonal and the ragged end
        acc, p, m_i, l_i = _block_loop(1, gl.maximum(n_full, 1), n_blocks, q_smem, k_smem, v_smem, k_bars, v_bars,
                                       k_desc, v_desc, acc, p, m_i, l_i, s_zero, offs_m, offs_n, Sk, causal_shift,
                                       qk_scale, False, CAUSAL, BLOCK_N, STAGES, o_layout, p_layout)
        acc, p, m_i, l_i = _block_loop(gl.maximum(n_full, 1), n_blocks, n_blocks, q_smem, k_smem, v_smem, k_bars,
                                       v_bars, k_desc, v_desc, acc, p, m_i, l_i, s_zero, offs_m, offs_n, Sk,
                                       causal_shift, qk_scale, True, CAUSAL, BLOCK_N, STAGES, o_layout, p_layout)
        p_fly = p
    last = gl.maximum(n_blocks, 1) - 1
    mbarrier.wait(v_bars.index(last % STAGES), (last // STAGES) & 1)
    acc = warpgroup_mma(p, v_smem.index(last % STAGES), acc, is_async=True)
    acc, p, p_fly = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p, p_fly))

    mbarrier.invalidate(q_bar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(k_bars.index(i))
        mbarrier.invalidate(v_bars.index(i))

    # rows that saw no key: output 0, lse -inf
    seen = l_i > 0.0
    l_safe = gl.where(seen, l_i, 1.0)
    lse = gl.where(seen, (m_i + gl.log2(l_safe)) * LN2, float("-inf"))
    gl.store(LSE + off_b * stride_lse_b + off_h * stride_lse_h + offs_m, lse, mask=offs_m < Sq)
    inv = gl.convert_layout(1.0 / l_safe, gl.SliceLayout(1, o_layout))
    out = (acc * gl.expand_dims(inv, 1)).to(dtype)
    o_rows = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
    o_cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    p_o = (O + off_b * stride_ob + off_h * stride_oh + gl.expand_dims(o_rows.to(gl.int64) * stride_om, 1)
           + gl.expand_dims(o_cols, 0))
    gl.store(p_o, out, mask=gl.expand_dims(o_rows < Sq, 1))

