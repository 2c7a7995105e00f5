"""An experiment, not part of the library (eleventh session, not yet run on a GPU): the Gluon sm_90
forward (tritonattn/kernels/fwd_sm90.py) on a persistent grid, FlashAttention-3's way, for the
cells where a program's fill and drain weigh: S=2048 causal read 0.77x cuDNN, S=1024 0.70x.

One program per SM walks tiles t = pid, pid + P, ... (a tile is 128 query rows of one (batch,
head); causal: the query blocks with the most keys first, all heads of a block together). The
producer warp runs ahead into the next tile: it waits until the last K / V loads of the tile have
landed (the descriptors built in the kernel share one scratch per call site), builds the next
tile's descriptors, loads its first K / V block and, once both consumers are done with the Q
buffer it reuses (an mbarrier per Q buffer), its Q. Ring slots, turns and Q buffers are counted
across tiles. Q_BUFS=2 double-buffers Q (with 2 K / V slots: 192 KB); Q_BUFS=1 keeps 3 slots.

Reuses the library's softmax step and consumer steps (with the ring and turn offsets J, T).
Checked and timed by tune_gluon_fwd.py (tiles pws:BLOCK_N,STAGES,Q_BUFS).
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

from tritonattn.kernels.common import LN2
from tritonattn.kernels.fwd_sm90 import BLOCK_M, MAXNREG, NUM_WARPS, _consumer_steps, _softmax_step  # noqa: F401


@gluon.jit
def _tile(t, n_m, BH, Hq, GROUP, Sq, Sk, causal_shift, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr):
    """Tile t's (start_m, b, h, kv head, key blocks, unmasked key blocks)."""
    if CAUSAL:  # the query blocks with the most keys first
        pid_m = n_m - 1 - t // BH
        bh = t % BH
    else:
        pid_m = t % n_m
        bh = t // n_m
    off_b = (bh // Hq).to(gl.int64)
    off_h = (bh % Hq).to(gl.int64)
    start_m = pid_m * BLOCK_M
    hi = Sk
    full_hi = Sk // BLOCK_N * BLOCK_N
    if CAUSAL:
        hi = gl.minimum(gl.maximum(start_m + BLOCK_M + causal_shift, 0), Sk)
        full_hi = gl.minimum(gl.maximum(start_m + causal_shift + 1, 0) // BLOCK_N * BLOCK_N, full_hi)
    return start_m, off_b, off_h, off_h // GROUP, gl.cdiv(hi, BLOCK_N), full_hi // BLOCK_N


@gluon.jit
def _producer(Q, K, V, stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn,
              stride_vh, q_smem, k_smem, v_smem, q_bars, q_empty, k_bars, v_bars, empty_bars, n_tiles, n_m, BH, Hq,
              GROUP, Sq, Sk, causal_shift, CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
              STAGES: gl.constexpr, Q_BUFS: gl.constexpr):
    HALF: gl.constexpr = BLOCK_M // 2
    layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    J = 0  # K / V blocks loaded so far (all tiles)
    i = 0  # this program's tiles so far
    for t in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
        start_m, off_b, off_h, off_hk, n_blocks, n_full = _tile(t, n_m, BH, Hq, GROUP, Sq, Sk, causal_shift,
                                                                CAUSAL, BLOCK_N)
        if i > 0:  # the last tile's loads have landed: its descriptors' scratch can be rewritten
            mbarrier.wait(q_bars.index((i - 1) % Q_BUFS), ((i - 1) // Q_BUFS) & 1)
            for s in gl.static_range(STAGES):
                back = gl.maximum(J - 1 - s, 0)
                mbarrier.wait(k_bars.index(back % STAGES), (back // STAGES) & 1, pred=J - 1 - s >= 0)
                mbarrier.wait(v_bars.index(back % STAGES), (back // STAGES) & 1, pred=J - 1 - s >= 0)
        q_desc = tma.make_tensor_descriptor(Q + off_b * stride_qb + off_h * stride_qh, [Sq, HEAD_DIM],
                                            [stride_qm, 1], [HALF, HEAD_DIM], layout)
        k_desc = tma.make_tensor_descriptor(K + off_b * stride_kb + off_hk * stride_kh, [Sk, HEAD_DIM],
                                            [stride_kn, 1], [BLOCK_N, HEAD_DIM], layout)
        v_desc = tma.make_tensor_descriptor(V + off_b * stride_vb + off_hk * stride_vh, [Sk, HEAD_DIM],
                                            [stride_vn, 1], [BLOCK_N, HEAD_DIM], layout)
        nb = gl.maximum(n_blocks, 1)
        for j in range(0, nb):
            jj = J + j
            slot = jj % STAGES
            mbarrier.wait(empty_bars.index(slot), ((jj // STAGES) & 1) ^ 1)
            mbarrier.expect(k_bars.index(slot), k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [j * BLOCK_N, 0], k_bars.index(slot), k_smem.index(slot))
            if j == 0:  # Q after the first K block: its buffer frees up last
                qb = i % Q_BUFS
                mbarrier.wait(q_empty.index(qb), ((i // Q_BUFS) & 1) ^ 1)
                mbarrier.expect(q_bars.index(qb), 2 * q_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(q_desc, [start_m, 0], q_bars.index(qb), q_smem.index(2 * qb))
                tma.async_copy_global_to_shared(q_desc, [start_m + HALF, 0], q_bars.index(qb),
                                                q_smem.index(2 * qb + 1))
            mbarrier.expect(v_bars.index(slot), v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(v_desc, [j * BLOCK_N, 0], v_bars.index(slot), v_smem.index(slot))
        J += nb
        i += 1


@gluon.jit
def _consumer(WG: gl.constexpr, O, LSE, stride_ob, stride_om, stride_oh, stride_lse_b, stride_lse_h, q_smem, k_smem,
              v_smem, q_bars, q_empty, k_bars, v_bars, empty_bars, turn_bars, n_tiles, n_m, BH, Hq, GROUP, Sq, Sk,
              causal_shift, qk_scale, CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
              STAGES: gl.constexpr, Q_BUFS: gl.constexpr):
    HALF: gl.constexpr = BLOCK_M // 2
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    s_zero = gl.zeros([HALF, BLOCK_N], gl.float32, s_layout)
    J = 0  # K / V blocks consumed so far (all tiles)
    T = 0  # turns taken so far
    i = 0
    for t in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
        start_m, off_b, off_h, off_hk, n_blocks, n_full = _tile(t, n_m, BH, Hq, GROUP, Sq, Sk, causal_shift,
                                                                CAUSAL, BLOCK_N)
        row0 = start_m + WG * HALF
        offs_m = row0 + gl.arange(0, HALF, layout=gl.SliceLayout(1, s_layout))
        m_i = gl.full([HALF], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([HALF], gl.float32, gl.SliceLayout(1, s_layout))
        acc = gl.zeros([HALF, HEAD_DIM], gl.float32, o_layout)
        qb = i % Q_BUFS
        q = q_smem.index(2 * qb + WG)

        # block 0 (always, masked)
        mbarrier.wait(q_bars.index(qb), (i // Q_BUFS) & 1)
        mbarrier.wait(k_bars.index(J % STAGES), (J // STAGES) & 1)
        mbarrier.wait(turn_bars.index(WG), (T & 1) ^ (1 - WG))
        s = warpgroup_mma(q, k_smem.index(J % STAGES).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        mbarrier.arrive(turn_bars.index(1 - WG))
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
        p32, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, offs_m, offs_n, 0, Sk, causal_shift, qk_scale, True,
                                             CAUSAL)
        p = gl.convert_layout(p32.to(dtype), p_layout)

        acc, p, m_i, l_i = _consumer_steps(1, gl.maximum(n_full, 1), J, T, WG, q, k_smem, v_smem, k_bars, v_bars,
                                           empty_bars, turn_bars, acc, p, m_i, l_i, s_zero, offs_m, offs_n, Sk,
                                           causal_shift, qk_scale, False, CAUSAL, BLOCK_N, STAGES, o_layout, p_layout)
        acc, p, m_i, l_i = _consumer_steps(gl.maximum(n_full, 1), n_blocks, J, T, WG, q, k_smem, v_smem, k_bars,
                                           v_bars, empty_bars, turn_bars, acc, p, m_i, l_i, s_zero, offs_m, offs_n,
                                           Sk, causal_shift, qk_scale, True, CAUSAL, BLOCK_N, STAGES, o_layout,
                                           p_layout)
        # every S of the tile is done: its Q buffer can take a later tile's Q
        mbarrier.arrive(q_empty.index(qb))
        nb = gl.maximum(n_blocks, 1)
        last = J + nb - 1
        mbarrier.wait(v_bars.index(last % STAGES), (last // STAGES) & 1)
        mbarrier.wait(turn_bars.index(WG), ((T + nb) & 1) ^ (1 - WG))
        acc = warpgroup_mma(p, v_smem.index(last % STAGES), acc, is_async=True)
        mbarrier.arrive(turn_bars.index(1 - WG))
        acc, p = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p))
        mbarrier.arrive(empty_bars.index(last % STAGES))  # the last block's slot (the library's kernel ends here)

        seen = l_i > 0.0
        l_safe = gl.where(seen, l_i, 1.0)
        lse = gl.where(seen, (m_i + gl.log2(l_safe)) * LN2, float("-inf"))
        gl.store(LSE + off_b * stride_lse_b + off_h * stride_lse_h + offs_m, lse, mask=offs_m < Sq)
        inv = gl.convert_layout(1.0 / l_safe, gl.SliceLayout(1, o_layout))
        out = (acc * gl.expand_dims(inv, 1)).to(dtype)
        o_rows = row0 + gl.arange(0, HALF, layout=gl.SliceLayout(1, o_layout))
        o_cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
        p_o = (O + off_b * stride_ob + off_h * stride_oh + gl.expand_dims(o_rows.to(gl.int64) * stride_om, 1)
               + gl.expand_dims(o_cols, 0))
        gl.store(p_o, out, mask=gl.expand_dims(o_rows < Sq, 1))
        J += nb
        T += nb + 1
        i += 1


@gluon.jit
def _fwd_persistent_kernel(
    Q, K, V, O, LSE,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_ob, stride_om, stride_oh,
    stride_lse_b, stride_lse_h,
    Hq, GROUP, Sq, Sk, win_right, qk_scale, BH,
    CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    Q_BUFS: gl.constexpr, num_warps: gl.constexpr,
):
    gl.static_assert(num_warps == 4, "the default partition is one consumer warpgroup")
    HALF: gl.constexpr = BLOCK_M // 2
    dtype: gl.constexpr = Q.dtype.element_ty
    tile_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    n_m = gl.cdiv(Sq, BLOCK_M)
    n_tiles = n_m * BH
    causal_shift = Sk - Sq + win_right

    q_smem = gl.allocate_shared_memory(dtype, [2 * Q_BUFS, HALF, HEAD_DIM], tile_layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], tile_layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], tile_layout)
    q_bars = gl.allocate_shared_memory(gl.int64, [Q_BUFS, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [Q_BUFS, 1], mbarrier.MBarrierLayout())
    k_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(Q_BUFS):
        mbarrier.init(q_bars.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=2)  # both consumers are done with the buffer
    for i in gl.static_range(STAGES):
        mbarrier.init(k_bars.index(i), count=1)
        mbarrier.init(v_bars.index(i), count=1)
        mbarrier.init(empty_bars.index(i), count=2)
    for i in gl.static_range(2):
        mbarrier.init(turn_bars.index(i), count=1)
    fence_async_shared()

    gl.warp_specialize([
        (_consumer, (0, O, LSE, stride_ob, stride_om, stride_oh, stride_lse_b, stride_lse_h, q_smem, k_smem, v_smem,
                     q_bars, q_empty, k_bars, v_bars, empty_bars, turn_bars, n_tiles, n_m, BH, Hq, GROUP, Sq, Sk,
                     causal_shift, qk_scale, CAUSAL, HEAD_DIM, BLOCK_N, STAGES, Q_BUFS)),
        (_consumer, (1, O, LSE, stride_ob, stride_om, stride_oh, stride_lse_b, stride_lse_h, q_smem, k_smem, v_smem,
                     q_bars, q_empty, k_bars, v_bars, empty_bars, turn_bars, n_tiles, n_m, BH, Hq, GROUP, Sq, Sk,
                     causal_shift, qk_scale, CAUSAL, HEAD_DIM, BLOCK_N, STAGES, Q_BUFS)),
        (_producer, (Q, K, V, stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn,
                     stride_vh, q_smem, k_smem, v_smem, q_bars, q_empty, k_bars, v_bars, empty_bars, n_tiles, n_m,
                     BH, Hq, GROUP, Sq, Sk, causal_shift, CAUSAL, HEAD_DIM, BLOCK_N, STAGES, Q_BUFS)),
    ], [4, 1], [240, 24])


def launch_args(q, k, v, out, lse, win_right: int, qk_scale: float) -> tuple:
    """As fwd_sm90.launch_args, plus B * Hq (the grid is the number of SMs, at most the tiles)."""
    hq, hkv = q.shape[2], k.shape[2]
    return (q, k, v, out, lse, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3],
            lse.stride(0), lse.stride(1), hq, hq // hkv, q.shape[1], k.shape[1], win_right, qk_scale,
            q.shape[0] * hq)
