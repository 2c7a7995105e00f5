"""Hopper (sm_90) dK / dV kernel of the backward in Gluon, with the forward's structure
(kernels/fwd_sm90.py: a TMA producer warp and two consumer warpgroups, no CTA-wide barrier in the
loop).

A program owns 128 keys of one kv head (64 with SPLIT_GRADS), in three partitions:
- a producer warp: the TMA loads of K / V (once) and, for every query head of the group and every
  query block of BLOCK_M rows, of the Q and dO tiles into a ring of STAGES slots, each refilled
  once both consumers released it;
- two consumer warpgroups of 64 keys each: S^T = K Q^T and dP^T = V dO^T, P^T = exp2(S^T - lse),
  dS^T = P^T (dP^T - delta), then dV += P^T dO and dK += dS^T Q, accumulated in registers.
  From head dim 256 (SPLIT_GRADS) a program owns 64 keys and the consumers split the work by
  gradient instead: one computes P^T and dV, handing P^T to the other through shared memory,
  which computes dP^T, dS^T and dK (one 64 x D fp32 accumulator each; nineteenth session).
The producer also writes each query block's lse2 and delta to shared memory next to its Q / dO
slot, which the consumers read after their products: a load after an mbarrier wait cannot be
hoisted above it, so they are not live during the products (spills per consumer thread 32 / 80
bytes, plain / causal, from 72 / 128 when the consumers loaded them from global memory; that
kernel was 1-4% slower on the H200, NOTES twelfth session). The kernel is built from per-tile
helpers (_load_kv, _load_query_blocks, _accumulate, _store_dkdv) that a persistent experiment
(benchmarks/experiments/gluon_bwd_persistent.py) calls once per tile.
Deterministic. dQ and delta (rowsum(dO * O)) stay with the Triton dQ kernel, which runs first (a
Gluon dQ kernel of the same structure was measured at 0.91-1.03x it, NOTES, eleventh session),
except with FUSED_DQ: a writer warp (_dq_writer) adds the consumers' dQ tiles to an fp32 buffer
with TMA bulk reductions, in a fixed order per query block with DETERMINISTIC (the default where
configs.fused_dq_serves), in any order for the opt-in TRITONATTN_ATOMIC_DQ=1 (NOTES, sixteenth
session).

Serves what ``bwd._gluon_ok`` admits: sm_90, Triton 3.6, 16-bit, head dims in TILES, dense, no
variant but a causal mask or a window's right edge, Q / K / V / dO readable through tensor
descriptors, lse / delta (B, Hq, Sq) with unit stride along the queries, dK / dV with unit stride
along the head dim. IS_VARLEN (packed sequences: descriptors per sequence from ``cu_seqlens``,
programs past a sequence's keys exit) with ``bwd.GLUON_VARLEN`` (on by default,
TRITONATTN_BWD_GLUON_VARLEN=0 turns it off): the whole varlen backward 1.09-1.32x with it
(thirteenth session). On the H200 (llama shape, S=512-16384) it ran 1.06-1.24x the Triton dK / dV
kernel dense. The interpreter
cannot run Gluon: the CPU tier compiles it for sm_90 (scripts/compile_check.py) and tests the
eligibility rule; the GPU tier tests its gradients.
"""

from __future__ import annotations

import torch
from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.language.core import builtin

from tritonattn import configs
from tritonattn.kernels.common import LENGTH_CAP, LOG2E
from tritonattn.kernels.fwd_sm90 import _store_layout
from tritonattn.kernels.launch import sm_count

HALF = gl.constexpr(64)  # keys per consumer warpgroup; BLOCK_N = 2 * HALF keys per program
BLOCK_N = 2 * HALF.value  # the launcher's
# by head dim: (query rows per step, Q / dO slots), H200, llama shape (NOTES, eleventh session):
# D=128 with 64 rows and 2 slots 1.06-1.24x the Triton kernel at S=512-16384 (3 or 4 slots: within
# a few percent of it, lower in most cells); 32 rows and 4 slots 0.81-0.88x. D=64 (eighteenth
# session, 2026-12-02, the kernel alone, Hq=32, Hkv=8, 16k tokens): without a mask 128 rows and 2
# slots 1.15-1.19x the Triton kernel at S=1024-16384 (64 rows: 1.02-1.08x, with 3 slots 1.06-1.11x);
# with a causal mask 0.93-1.06x at best with one loop testing each block (64 rows, 3 slots; 128
# rows 0.48-0.55x, 312 bytes of spills), 1.08-1.22x with 128 rows and the crossing blocks in loops
# of their own (SPLIT_DIAG, which the launcher sets for tiles of 128 rows; nineteenth session)
# D=256 (nineteenth session, 2026-12-02, the kernel alone, Hq=32, Hkv=8, 16k tokens): the consumers
# split by gradient (SPLIT_GRADS below), 64 rows and 2 slots: 1.95-2.04x the Triton dK / dV
# kernels without a mask, 1.73-2.02x with one, at S=1024-16384 (P^T recomputed by the dK consumer
# instead of handed over: 1.59-1.87x)
TILES = {128: (64, 2), 64: (128, 2), 256: (64, 2)}
NUM_WARPS = 4  # the default partition (one consumer); the workers add 4 + 1 warps
SPLIT_GRADS_FROM = gl.constexpr(256)  # head dims from here: a program owns 64 keys, its consumers split by gradient


def block_n(head_dim: int) -> int:
    """Keys per program: 2 x 64, or 64 where the consumers split by gradient (SPLIT_GRADS)."""
    return HALF.value if head_dim >= SPLIT_GRADS_FROM.value else BLOCK_N


def fuses_dq(head_dim: int) -> bool:
    """The kernel can compute dQ too (FUSED_DQ) at this head dim: not where it splits by gradient."""
    return head_dim < SPLIT_GRADS_FROM.value
MAXNREG = 168  # as the forward's: setmaxnreg moves the producer's registers to the consumers


@gluon.jit
def _producer(K, V, Q, DO, stride_kn, stride_vn, stride_qm, stride_qh, stride_dom, stride_doh, off_hk, start_n,
              Sq, q_rows, Sk, GROUP, lo_blk, n_m, k_smem, v_smem, q_smem, do_smem, kv_bar, ready_bars, empty_bars,
              LSE, DELTA, stride_lse_h, rows_smem, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
              STAGES: gl.constexpr, LOCKSTEP: gl.constexpr, HALVES: gl.constexpr = 2,
              DESC_3D: gl.constexpr = False):
    _load_kv(K, V, stride_kn, stride_vn, start_n, Sk, k_smem, v_smem, 0, kv_bar, HEAD_DIM, HALVES)
    _load_query_blocks(0, Q, DO, stride_qm, stride_qh, stride_dom, stride_doh, off_hk, Sq, q_rows, GROUP, lo_blk,
                       n_m, q_smem, do_smem, ready_bars, empty_bars, LSE, DELTA, stride_lse_h, rows_smem, HEAD_DIM,
                       BLOCK_M, STAGES, LOCKSTEP, DESC_3D)


@gluon.jit
def _load_kv(K, V, stride_kn, stride_vn, start_n, Sk, k_smem, v_smem, buf, kv_bar, HEAD_DIM: gl.constexpr,
             HALVES: gl.constexpr = 2):
    """TMA loads of the program's 128 keys of K and V, as two 64-key halves each (smem slots
    2 buf, 2 buf + 1 of ``k_smem`` / ``v_smem``), arriving on ``kv_bar``; with HALVES=1 its 64 keys
    (slot buf)."""
    layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    k_desc = tma.make_tensor_descriptor(K, [Sk, HEAD_DIM], [stride_kn, 1], [HALF, HEAD_DIM], layout)
    v_desc = tma.make_tensor_descriptor(V, [Sk, HEAD_DIM], [stride_vn, 1], [HALF, HEAD_DIM], layout)
    mbarrier.expect(kv_bar, 2 * HALVES * k_desc.block_type.nbytes)
    for c in gl.static_range(HALVES):
        tma.async_copy_global_to_shared(k_desc, [start_n + c * HALF, 0], kv_bar, k_smem.index(HALVES * buf + c))
        tma.async_copy_global_to_shared(v_desc, [start_n + c * HALF, 0], kv_bar, v_smem.index(HALVES * buf + c))


@gluon.jit
def _load_query_blocks(t, Q, DO, stride_qm, stride_qh, stride_dom, stride_doh, off_hk, Sq, q_rows, GROUP, lo_blk,
                       n_m, q_smem, do_smem, ready_bars, empty_bars, LSE, DELTA, stride_lse_h, rows_smem,
                       HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
                       LOCKSTEP: gl.constexpr = False, DESC_3D: gl.constexpr = False):
    """For each step (query head g of the group, query block blk) in _step's order over the
    blocks lo_blk .. lo_blk + n_m - 1: the block's lse2 / delta into the slot's rows, then its Q and
    dO tiles, into ring slot t % STAGES once both consumers released it (t counts the ring's blocks:
    0 here; a program that walks several key blocks passes what it loaded before). Returns t.

    Heads one after the other (not LOCKSTEP): a descriptor per head, every load through a head's
    descriptors landed when the next head's are built and when this returns. LOCKSTEP (heads
    inside blocks), or DESC_3D with the heads one after the other (an experiment,
    TRITONATTN_BWD_DESC_3D=1: no wait for a head's loads before the next head's): one 3-d descriptor
    over the group's heads (any head stride), whose last loads may still be in flight when this
    returns. The descriptors span ``q_rows`` rows (Sq, or 1 for a packed sequence with no query,
    which loads none)."""
    t = gl.to_tensor(t)  # (a loop-carried count, also when the caller passes a constant)
    h0 = off_hk * GROUP
    if LOCKSTEP or DESC_3D:
        layout3: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=3)
        q_desc = tma.make_tensor_descriptor(Q + h0 * stride_qh, [GROUP, q_rows, HEAD_DIM], [stride_qh, stride_qm, 1],
                                            [1, BLOCK_M, HEAD_DIM], layout3)
        do_desc = tma.make_tensor_descriptor(DO + h0 * stride_doh, [GROUP, q_rows, HEAD_DIM],
                                             [stride_doh, stride_dom, 1], [1, BLOCK_M, HEAD_DIM], layout3)
        for j in range(GROUP * n_m):
            g, blk = _step(j, GROUP, lo_blk, n_m, LOCKSTEP)
            slot = t % STAGES
            _load_block(q_desc, do_desc, [g, blk * BLOCK_M, 0], q_smem.index(slot).reshape([1, BLOCK_M, HEAD_DIM]),
                        do_smem.index(slot).reshape([1, BLOCK_M, HEAD_DIM]), LSE + (h0 + g) * stride_lse_h,
                        DELTA + (h0 + g) * stride_lse_h, blk * BLOCK_M, Sq, t, ready_bars, empty_bars, rows_smem,
                        BLOCK_M, STAGES)
            t += 1
    else:
        layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        for g in range(GROUP):
            q_desc = tma.make_tensor_descriptor(Q + (h0 + g) * stride_qh, [q_rows, HEAD_DIM], [stride_qm, 1],
                                                [BLOCK_M, HEAD_DIM], layout)
            do_desc = tma.make_tensor_descriptor(DO + (h0 + g) * stride_doh, [q_rows, HEAD_DIM], [stride_dom, 1],
                                                 [BLOCK_M, HEAD_DIM], layout)
            for i in range(n_m):
                slot = t % STAGES
                row = (lo_blk + i) * BLOCK_M
                _load_block(q_desc, do_desc, [row, 0], q_smem.index(slot), do_smem.index(slot),
                            LSE + (h0 + g) * stride_lse_h, DELTA + (h0 + g) * stride_lse_h, row, Sq, t, ready_bars,
                            empty_bars, rows_smem, BLOCK_M, STAGES)
                t += 1
            # the next head's descriptors reuse this one's scratch: let every load through it land first
            for s in gl.static_range(STAGES):
                back = gl.maximum(t - 1 - s, 0)
                mbarrier.wait(ready_bars.index(back % STAGES), (back // STAGES) & 1, pred=t - 1 - s >= 0)
    return t


@gluon.jit
def _load_block(q_desc, do_desc, coord, q_dst, do_dst, p_lse, p_delta, row, Sq, t, ready_bars, empty_bars, rows_smem,
                BLOCK_M: gl.constexpr, STAGES: gl.constexpr):
    """Ring block t: the lse2 / delta of query rows [row, row + BLOCK_M) (loaded before the wait
    for the slot, stored after it), then the Q and dO tiles at ``coord`` into ``q_dst`` / ``do_dst``."""
    slot = t % STAGES
    vec: gl.constexpr = gl.BlockedLayout(size_per_thread=[BLOCK_M // 32], threads_per_warp=[32],
                                         warps_per_cta=[1], order=[0])
    lse2, delta = _load_rows(p_lse, p_delta, row + gl.arange(0, BLOCK_M, layout=vec), Sq)
    mbarrier.wait(empty_bars.index(slot), ((t // STAGES) & 1) ^ 1)
    rows_smem.index(2 * slot).store(lse2)
    rows_smem.index(2 * slot + 1).store(delta)
    gl.thread_barrier()  # every lane's stores before the one lane's arrival below
    mbarrier.expect(ready_bars.index(slot), 2 * q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, coord, ready_bars.index(slot), q_dst)
    tma.async_copy_global_to_shared(do_desc, coord, ready_bars.index(slot), do_dst)


@gluon.jit
def _step(j, GROUP, lo_blk, n_m, LOCKSTEP: gl.constexpr):
    """Step j's (query head of the group, query block) of a program whose blocks are lo_blk ..
    lo_blk + n_m - 1. Not LOCKSTEP: the heads one after the other, blocks ascending. LOCKSTEP (the
    fused dQ): blocks descending from the last, the group's heads inside each, so every program of
    a kv head (causal or not) is at the same (head, block) at the same step, whatever its first
    block: the order in which _dq_writer adds their dQ tiles (key blocks ascending) costs them only
    a skew, and the longest programs can be launched first."""
    if LOCKSTEP:
        return j % GROUP, lo_blk + n_m - 1 - j // GROUP
    else:
        return j // n_m, lo_blk + j % n_m


@gluon.jit
def _load_rows(p_lse, p_delta, offs, Sq):
    """lse2 (exp2 domain) and delta of query rows ``offs``. Rows past Sq or that saw no key:
    lse2 = +inf, so their probabilities are exactly 0."""
    ok = offs < Sq
    lse = gl.load(p_lse + offs, mask=ok, other=float("inf"))
    return gl.where(lse == float("-inf"), float("inf"), lse * LOG2E), gl.load(p_delta + offs, mask=ok, other=0.0)


@gluon.jit
def _consumer(WG: gl.constexpr, DK, DV, stride_dkn, stride_dvn, start_n, Sk, GROUP, lo_blk, n_m, shift, qk_scale,
              sm_scale, k_smem, v_smem, q_smem, do_smem, kv_bar, ready_bars, empty_bars, rows_smem, ds_smem, ds_bars,
              dq_stage, dq_full, dq_empty, CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
              STAGES: gl.constexpr, FUSED_DQ: gl.constexpr, SPLIT_DIAG: gl.constexpr, SPLIT_WAITS: gl.constexpr):
    key0 = start_n + WG * HALF
    mbarrier.wait(kv_bar, 0)
    if FUSED_DQ:  # this consumer's half of the dQ columns, handed to the writer partition
        dk, dv, t = _accumulate(0, key0, k_smem.index(WG), v_smem.index(WG), q_smem, do_smem, ready_bars,
                                empty_bars, rows_smem, GROUP, lo_blk, n_m, shift, qk_scale, CAUSAL, HEAD_DIM, BLOCK_M,
                                STAGES, True, WG, k_smem, ds_smem, ds_bars, dq_stage.index(WG), dq_full.index(WG),
                                dq_empty.index(WG), sm_scale, SPLIT_DIAG, SPLIT_WAITS)
    else:
        dk, dv, t = _accumulate(0, key0, k_smem.index(WG), v_smem.index(WG), q_smem, do_smem, ready_bars,
                                empty_bars, rows_smem, GROUP, lo_blk, n_m, shift, qk_scale, CAUSAL, HEAD_DIM, BLOCK_M,
                                STAGES, SPLIT_DIAG=SPLIT_DIAG, SPLIT_WAITS=SPLIT_WAITS)
    _store_dkdv(DK, DV, stride_dkn, stride_dvn, key0, Sk, dk, dv, sm_scale)


@gluon.jit
def _split_consumer_p(DV, stride_dvn, start_n, Sk, GROUP, lo_blk, n_m, shift, qk_scale, k_smem, q_smem, do_smem,
                      kv_bar, ready_bars, empty_bars, rows_smem, p_smem, p_full, p_empty, CAUSAL: gl.constexpr,
                      HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr):
    """SPLIT_GRADS, consumer P (the default partition): S^T = K Q^T and P^T of each step, handed to
    consumer dS through ``p_smem`` (fp32, buffer step % 2: ``p_full`` / ``p_empty``), and
    dV += P^T dO of the program's 64 keys."""
    dtype: gl.constexpr = k_smem.dtype
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, BLOCK_M, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_DIM, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    offs_n = start_n + gl.arange(0, HALF, layout=gl.SliceLayout(1, st_layout))
    offs_mb = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, st_layout))
    zero_st = gl.zeros([HALF, BLOCK_M], gl.float32, st_layout)
    k = k_smem.index(0)
    dv = gl.zeros([HALF, HEAD_DIM], gl.float32, acc_layout)
    mbarrier.wait(kv_bar, 0)
    for j in range(GROUP * n_m):
        _g, blk = _step(j, GROUP, lo_blk, n_m, False)
        slot = j % STAGES
        mbarrier.wait(ready_bars.index(slot), (j // STAGES) & 1)
        st = warpgroup_mma(k, q_smem.index(slot).permute((1, 0)), zero_st, use_acc=False, is_async=True)
        st = warpgroup_mma_wait(num_outstanding=0, deps=(st, ))
        lse2 = rows_smem.index(2 * slot).load(gl.SliceLayout(0, st_layout))
        if CAUSAL:  # key j is seen by query i when j <= i + shift; a test per step
            if blk * BLOCK_M + shift < start_n + HALF - 1:
                offs_m = blk * BLOCK_M + offs_mb
                st = gl.where(gl.expand_dims(offs_n, 1) <= gl.expand_dims(offs_m + shift, 0), st, float("-inf"))
        pt = gl.exp2(st * qk_scale - gl.expand_dims(lse2, 0))
        # into buffer j % 2 once consumer dS has read what was there two steps ago
        buf = j % 2
        mbarrier.wait(p_empty.index(buf), ((j // 2) & 1) ^ 1)
        p_smem.index(buf).store(pt)
        gl.thread_barrier()  # every lane's part of the tile before the arrival
        mbarrier.arrive(p_full.index(buf))
        pt16 = gl.convert_layout(pt.to(dtype), a_layout)
        dv = warpgroup_mma(pt16, do_smem.index(slot), dv, is_async=True)
        dv, pt16 = warpgroup_mma_wait(num_outstanding=0, deps=(dv, pt16))
        mbarrier.arrive(empty_bars.index(slot))
    _store_rows(DV, stride_dvn, start_n, Sk, dv, 1.0)


@gluon.jit
def _split_consumer_ds(DK, stride_dkn, start_n, Sk, GROUP, lo_blk, n_m, sm_scale, v_smem, q_smem, do_smem, kv_bar,
                       ready_bars, empty_bars, rows_smem, p_smem, p_full, p_empty, HEAD_DIM: gl.constexpr,
                       BLOCK_M: gl.constexpr, STAGES: gl.constexpr):
    """SPLIT_GRADS, consumer dS (a worker warpgroup): dP^T = V dO^T, P^T from consumer P,
    dS^T = P^T (dP^T - delta), and dK += dS^T Q of the program's 64 keys."""
    dtype: gl.constexpr = v_smem.dtype
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, BLOCK_M, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_DIM, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    zero_st = gl.zeros([HALF, BLOCK_M], gl.float32, st_layout)
    v = v_smem.index(0)
    dk = gl.zeros([HALF, HEAD_DIM], gl.float32, acc_layout)
    mbarrier.wait(kv_bar, 0)
    for j in range(GROUP * n_m):
        slot = j % STAGES
        mbarrier.wait(ready_bars.index(slot), (j // STAGES) & 1)
        q = q_smem.index(slot)
        dpt = warpgroup_mma(v, do_smem.index(slot).permute((1, 0)), zero_st, use_acc=False, is_async=True)
        dpt = warpgroup_mma_wait(num_outstanding=0, deps=(dpt, ))
        buf = j % 2
        mbarrier.wait(p_full.index(buf), (j // 2) & 1)
        pt = p_smem.index(buf).load(st_layout)
        gl.thread_barrier()  # every lane has read the tile before the buffer goes back
        mbarrier.arrive(p_empty.index(buf))
        delta = rows_smem.index(2 * slot + 1).load(gl.SliceLayout(0, st_layout))
        dst16 = gl.convert_layout((pt * (dpt - gl.expand_dims(delta, 0))).to(dtype), a_layout)
        dk = warpgroup_mma(dst16, q, dk, is_async=True)
        dk, dst16 = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dst16))
        mbarrier.arrive(empty_bars.index(slot))
    _store_rows(DK, stride_dkn, start_n, Sk, dk, sm_scale)


@gluon.jit
def _dq_writer(DQA, dqa_rows, dqa_row0, dqa_head_rows, SEM, sem0, sem_head, GROUP, lo_blk, n_m, key_blk, dq_stage,
               dq_full, dq_empty, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, DETERMINISTIC: gl.constexpr,
               FIRST_STORE: gl.constexpr = False):
    """FUSED_DQ's writer warp: for every step (query head g of the group, query block blk, in
    _step's LOCKSTEP order) it adds both consumers' staged dQ tiles to the fp32 buffer with TMA
    reductions (rows ``dqa_row0 + g * dqa_head_rows + blk * BLOCK_M``) and hands the staging tiles
    back once read.

    DETERMINISTIC: the programs of a kv head add into a query block in a fixed order, key blocks
    ascending (the semaphore ``SEM[sem0 + g * sem_head + blk]`` counts the additions done; program
    ``key_blk`` waits until key_blk of them are, adds, waits for its additions to complete and
    counts itself). Every key block that sees a query block is one of 0 .. some last one, so the
    count at a program's turn is its key block. The launch runs the key blocks first first, so a
    program waits only on programs started before it, and in LOCKSTEP order it waits on a program
    at the same step: the programs of a head are skewed by one addition each, once. Without it,
    the additions land in any order.

    FIRST_STORE (with DETERMINISTIC; TRITONATTN_BWD_DQ_FIRST_STORE): key block 0, first in every
    query block's order, stores its tiles instead of adding them, so the buffer needs no zero fill
    (the launcher allocates it unwritten only where key block 0's program reaches every query block
    of every head: bwd._first_store_ok)."""
    DQ_COLS: gl.constexpr = HEAD_DIM // 2
    layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
    dq_desc = tma.make_tensor_descriptor(DQA, [dqa_rows, HEAD_DIM], [HEAD_DIM, 1], [BLOCK_M, DQ_COLS], layout)
    for t in range(GROUP * n_m):
        g, blk = _step(t, GROUP, lo_blk, n_m, True)
        if DETERMINISTIC:
            p_sem = SEM + sem0 + g * sem_head + blk
            while gl.atomic_add(p_sem, 0, sem="acquire") != key_blk:
                pass
            _fence_proxy_async_global()  # the others' additions before ours
        row = dqa_row0 + g * dqa_head_rows + blk * BLOCK_M
        for wg in gl.static_range(2):
            mbarrier.wait(dq_full.index(wg), t & 1)
            if FIRST_STORE:
                if key_blk == 0:  # the block's first writer: a store (its completion tracked the same way)
                    tma.async_copy_shared_to_global(dq_desc, [row, wg * DQ_COLS], dq_stage.index(wg))
                else:
                    _tma_reduce_add(dq_desc, [row, wg * DQ_COLS], dq_stage.index(wg))
            else:
                _tma_reduce_add(dq_desc, [row, wg * DQ_COLS], dq_stage.index(wg))
        tma.store_wait(pendings=0)  # the staging tiles are read: back to the consumers
        mbarrier.arrive(dq_empty.index(0))
        mbarrier.arrive(dq_empty.index(1))
        if DETERMINISTIC:
            _wait_bulk_complete()  # our additions are done before the next program's start
            gl.thread_barrier()
            gl.atomic_add(p_sem, 1, sem="release")
    tma.store_wait(pendings=0)


@gluon.jit
def _fence_proxy_async_global():
    gl.inline_asm_elementwise("fence.proxy.async.global; mov.u32 $0, 0;", "=r", [], dtype=gl.int32, is_pure=False,
                              pack=1)


@gluon.jit
def _wait_bulk_complete():
    """This thread's bulk (TMA) operations complete, their writes done (tma.store_wait waits only
    until they have read shared memory), and ordered before later generic accesses."""
    gl.inline_asm_elementwise("cp.async.bulk.wait_group 0; fence.proxy.async.global; mov.u32 $0, 0;", "=r", [],
                              dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _accumulate(t, key0, k, v, q_smem, do_smem, ready_bars, empty_bars, rows_smem, GROUP, lo_blk, n_m, shift,
                qk_scale, CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                STAGES: gl.constexpr, FUSED_DQ: gl.constexpr = False, WG: gl.constexpr = 0, k_all=None,
                ds_smem=None, ds_bars=None, dq_stage=None, dq_full=None, dq_empty=None, sm_scale=1.0,
                SPLIT_DIAG: gl.constexpr = False, SPLIT_WAITS: gl.constexpr = False):
    """dK (unscaled) and dV of keys [key0, key0 + 64) (their K / V tiles ``k``, ``v`` in shared
    memory) over the ring's query blocks t, t + 1, ... that the producer's _load_query_blocks
    loads, each slot released after its products. Returns dk, dv and the ring's next block.

    CAUSAL: a block whose rows cross the keys' diagonal gets the mask. SPLIT_DIAG (which the
    launcher sets for 128-row tiles, bwd.SPLIT_DIAG_ROWS): those blocks in loops of their own (the
    first blocks of each head, or the last steps in LOCKSTEP order), the others in loops without the
    mask, instead of one loop that tests each block (whose branch spilled 312 bytes at D=64 with 128
    rows, 0 with the split, and ran at half the speed; see _steps).

    FUSED_DQ (consumer ``WG`` of the two): also this program's share of dQ, FlashAttention-3's way.
    Each consumer writes its dS^T tile to ``ds_smem`` (slot 2 (step parity) + WG) and arrives on
    ``ds_bars`` (step parity); once both halves are there it computes dQ's columns
    [WG * D/2, (WG + 1) * D/2) of the block over all 128 keys (dS ``k_all``, scaled by ``sm_scale``)
    and stages them in ``dq_stage`` (fp32) for the writer partition (_dq_writer): it waits on
    ``dq_empty`` (the writer read the last tile) and arrives on ``dq_full``."""
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_DIM, 16])
    dk = gl.zeros([HALF, HEAD_DIM], gl.float32, acc_layout)
    dv = gl.zeros([HALF, HEAD_DIM], gl.float32, acc_layout)
    t = gl.to_tensor(t)  # (a loop-carried count, also when the caller passes a constant)
    # (the arguments written out in each call: WG passed in a tuple would reach _steps as a runtime
    # value, and it slices K's columns)
    if CAUSAL and SPLIT_DIAG:
        # the blocks lo_blk .. lo_blk + n_diag - 1 cross the diagonal: some row i of theirs misses a
        # key j of this half (j > i + shift), i.e. blk * BLOCK_M + shift < key0 + HALF - 1
        edge = gl.maximum(key0 + HALF - 1 - shift, 0)
        n_diag = gl.minimum(gl.maximum((edge + BLOCK_M - 1) // BLOCK_M - lo_blk, 0), n_m)
        if FUSED_DQ:  # LOCKSTEP order: blocks descending, so the crossing ones are the last steps
            split = GROUP * (n_m - n_diag)
            dk, dv, t = _steps(0, split, t, dk, dv, key0, k, v, q_smem, do_smem, ready_bars, empty_bars, rows_smem,
                               GROUP, lo_blk, n_m, shift, qk_scale, 0, HEAD_DIM, BLOCK_M, STAGES, True, WG, k_all,
                               ds_smem, ds_bars, dq_stage, dq_full, dq_empty, sm_scale, SPLIT_WAITS=SPLIT_WAITS)
            dk, dv, t = _steps(split, GROUP * n_m, t, dk, dv, key0, k, v, q_smem, do_smem, ready_bars, empty_bars,
                               rows_smem, GROUP, lo_blk, n_m, shift, qk_scale, 1, HEAD_DIM, BLOCK_M, STAGES, True, WG,
                               k_all, ds_smem, ds_bars, dq_stage, dq_full, dq_empty, sm_scale, SPLIT_WAITS=SPLIT_WAITS)
        else:  # heads one after the other, blocks ascending: the crossing ones first in each head
            for g in range(GROUP):
                j0 = g * n_m
                dk, dv, t = _steps(j0, j0 + n_diag, t, dk, dv, key0, k, v, q_smem, do_smem, ready_bars, empty_bars,
                                   rows_smem, GROUP, lo_blk, n_m, shift, qk_scale, 1, HEAD_DIM, BLOCK_M, STAGES,
                                   SPLIT_WAITS=SPLIT_WAITS)
                dk, dv, t = _steps(j0 + n_diag, j0 + n_m, t, dk, dv, key0, k, v, q_smem, do_smem, ready_bars,
                                   empty_bars, rows_smem, GROUP, lo_blk, n_m, shift, qk_scale, 0, HEAD_DIM, BLOCK_M,
                                   STAGES, SPLIT_WAITS=SPLIT_WAITS)
    elif FUSED_DQ:
        dk, dv, t = _steps(0, GROUP * n_m, t, dk, dv, key0, k, v, q_smem, do_smem, ready_bars, empty_bars, rows_smem,
                           GROUP, lo_blk, n_m, shift, qk_scale, 2 if CAUSAL else 0, HEAD_DIM, BLOCK_M, STAGES, True,
                           WG, k_all, ds_smem, ds_bars, dq_stage, dq_full, dq_empty, sm_scale, SPLIT_WAITS=SPLIT_WAITS)
    else:
        dk, dv, t = _steps(0, GROUP * n_m, t, dk, dv, key0, k, v, q_smem, do_smem, ready_bars, empty_bars, rows_smem,
                           GROUP, lo_blk, n_m, shift, qk_scale, 2 if CAUSAL else 0, HEAD_DIM, BLOCK_M, STAGES,
                           SPLIT_WAITS=SPLIT_WAITS)
    return dk, dv, t


@gluon.jit
def _steps(j0, j1, t, dk, dv, key0, k, v, q_smem, do_smem, ready_bars, empty_bars, rows_smem, GROUP, lo_blk, n_m,
           shift, qk_scale, MASK: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
           FUSED_DQ: gl.constexpr = False, WG: gl.constexpr = 0, k_all=None, ds_smem=None, ds_bars=None,
           dq_stage=None, dq_full=None, dq_empty=None, sm_scale=1.0, SPLIT_WAITS: gl.constexpr = False):
    """_accumulate's steps j0 .. j1 - 1 (each a (query head of the group, query block) in _step's
    order, ring block t on). MASK: 0 none, 1 the causal mask on every step, 2 on the steps whose
    block crosses the keys' diagonal (a test per step).

    SPLIT_WAITS (an experiment, twenty-fifth session): the step's products awaited one at a time, as
    FlashAttention-3's backward does: P^T computed once S^T is done while dP^T is still running, dV's
    product issued before dP^T is awaited, dS^T computed while it runs, then dK's. The same
    arithmetic in the same order (bitwise the default); the consumer's own products overlap its
    elementwise work instead of only the other consumer's. (D=256's consumers split by gradient,
    _split_consumer_p / _ds, do not take it.)"""
    dtype: gl.constexpr = k.dtype
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, BLOCK_M, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_DIM, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    offs_n = key0 + gl.arange(0, HALF, layout=gl.SliceLayout(1, st_layout))
    offs_mb = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, st_layout))
    zero_st = gl.zeros([HALF, BLOCK_M], gl.float32, st_layout)
    if FUSED_DQ:
        DQ_COLS: gl.constexpr = HEAD_DIM // 2
        dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, DQ_COLS, 16])
    for j in range(j0, j1):
        _g, blk = _step(j, GROUP, lo_blk, n_m, FUSED_DQ)
        slot = t % STAGES
        offs_m = blk * BLOCK_M + offs_mb
        mbarrier.wait(ready_bars.index(slot), (t // STAGES) & 1)
        q = q_smem.index(slot)
        do = do_smem.index(slot)
        st = warpgroup_mma(k, q.permute((1, 0)), zero_st, use_acc=False, is_async=True)
        dpt = warpgroup_mma(v, do.permute((1, 0)), zero_st, use_acc=False, is_async=True)
        if SPLIT_WAITS:
            st = warpgroup_mma_wait(num_outstanding=1, deps=(st, ))
        else:
            st, dpt = warpgroup_mma_wait(num_outstanding=0, deps=(st, dpt))
        # lse2 and delta from the slot, after the products (short live ranges)
        lse2 = rows_smem.index(2 * slot).load(gl.SliceLayout(0, st_layout))
        # key j is seen by query i when j <= i + shift
        if MASK == 1:
            st = gl.where(gl.expand_dims(offs_n, 1) <= gl.expand_dims(offs_m + shift, 0), st, float("-inf"))
        elif MASK == 2:
            if blk * BLOCK_M + shift < key0 + HALF - 1:
                st = gl.where(gl.expand_dims(offs_n, 1) <= gl.expand_dims(offs_m + shift, 0), st, float("-inf"))
        pt = gl.exp2(st * qk_scale - gl.expand_dims(lse2, 0))
        if SPLIT_WAITS:  # dV's product while dP^T finishes and dS^T is computed
            pt16 = gl.convert_layout(pt.to(dtype), a_layout)
            dv = warpgroup_mma(pt16, do, dv, is_async=True)
            dpt = warpgroup_mma_wait(num_outstanding=1, deps=(dpt, ))
        delta = rows_smem.index(2 * slot + 1).load(gl.SliceLayout(0, st_layout))
        dst = pt * (dpt - gl.expand_dims(delta, 0))
        if FUSED_DQ:  # dS^T of this consumer's keys into its half of buffer t % 2
            buf = t % 2
            ds_smem.index(buf * 2 + WG).store(dst.to(dtype))
            fence_async_shared()
            gl.thread_barrier()  # every lane's part of the tile before the arrival
            # (a buffer is rewritten two steps later, after both consumers passed the next
            # step's barrier, i.e. finished this step's dQ products)
            mbarrier.arrive(ds_bars.index(buf))
        if not SPLIT_WAITS:
            pt16 = gl.convert_layout(pt.to(dtype), a_layout)
        dst16 = gl.convert_layout(dst.to(dtype), a_layout)
        if not SPLIT_WAITS:
            dv = warpgroup_mma(pt16, do, dv, is_async=True)
        dk = warpgroup_mma(dst16, q, dk, is_async=True)
        dv, dk, pt16, dst16 = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk, pt16, dst16))
        mbarrier.arrive(empty_bars.index(slot))
        if FUSED_DQ:
            mbarrier.wait(ds_bars.index(buf), (t // 2) & 1)
            zero_dq = gl.zeros([BLOCK_M, DQ_COLS], gl.float32, dq_layout)
            dq = warpgroup_mma(ds_smem.index(buf * 2).permute((1, 0)),
                               k_all.index(0).slice(WG * DQ_COLS, DQ_COLS, dim=1), zero_dq, use_acc=False,
                               is_async=True)
            dq = warpgroup_mma(ds_smem.index(buf * 2 + 1).permute((1, 0)),
                               k_all.index(1).slice(WG * DQ_COLS, DQ_COLS, dim=1), dq, is_async=True)
            dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq, ))
            mbarrier.wait(dq_empty, (t & 1) ^ 1)  # the writer has read the last step's tile
            dq_stage.store(dq * sm_scale)
            fence_async_shared()
            gl.thread_barrier()  # the whole tile before the arrival
            mbarrier.arrive(dq_full)
        t += 1
    return dk, dv, t


@builtin
def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """global[box at ``coord``] += shared ``src`` (``cp.reduce.async.bulk.tensor`` .add, completion
    tracked as a TMA store's: tma.store_wait). Gluon 3.6's hopper ``tma`` module has no wrapper for
    it; its builder has the op (``create_async_tma_reduce``, as Triton's descriptor ``atomic_add``)."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


@gluon.jit
def _store_dkdv(DK, DV, stride_dkn, stride_dvn, key0, Sk, dk, dv, sm_scale):
    """dK (scaled by sm_scale) and dV of keys [key0, key0 + 64), rows past Sk left alone."""
    _store_rows(DK, stride_dkn, key0, Sk, dk, sm_scale)
    _store_rows(DV, stride_dvn, key0, Sk, dv, 1.0)


@gluon.jit
def _store_rows(PTR, stride_n, key0, Sk, acc, scale):
    """``acc * scale`` into rows [key0, key0 + 64) of PTR, rows past Sk left alone; stored as the
    forward stores O (8-byte vectors of whole sectors after a round of shuffles: _store_layout)."""
    st_layout: gl.constexpr = _store_layout(HALF, acc.shape[1])
    val = gl.convert_layout((acc * scale).to(PTR.dtype.element_ty), st_layout)
    rows = key0 + gl.arange(0, HALF, layout=gl.SliceLayout(1, st_layout))
    cols = gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, st_layout))
    r64 = gl.expand_dims(rows.to(gl.int64), 1)
    gl.store(PTR + r64 * stride_n + gl.expand_dims(cols, 0), val, mask=gl.expand_dims(rows < Sk, 1))


@gluon.jit
def _bwd_dkdv_ws_kernel(
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
    num_warps: gl.constexpr, IS_VARLEN: gl.constexpr = False, FUSED_DQ: gl.constexpr = False,
    DETERMINISTIC: gl.constexpr = False, SPLIT_DIAG: gl.constexpr = False, DESC_3D: gl.constexpr = False,
    SPLIT_WAITS: gl.constexpr = False, SECTION: gl.constexpr = 0, KV_SPLIT: gl.constexpr = 1,
    FIRST_STORE: gl.constexpr = False,
):
    gl.static_assert(num_warps == 4, "the default partition is one consumer warpgroup")
    gl.static_assert(not FIRST_STORE or (FUSED_DQ and DETERMINISTIC), "a first store needs the ordered fused dQ")
    # KV_SPLIT > 1 (bwd.py, configs.kv_split): each real kv head's query heads are split over KV_SPLIT
    # programs ("virtual" kv heads: Hkv and GROUP here are the virtual ones), which read the same K / V
    # and write partial dK / dV (fp32) of their heads into DK / DV, which have Hkv virtual heads; the
    # launcher sums them in a fixed order
    gl.static_assert(not (FUSED_DQ and KV_SPLIT > 1), "the fused dQ's order is per real kv head")
    # SPLIT_GRADS (head dims from SPLIT_GRADS_FROM): a program owns 64 keys and its two consumers
    # split the work by gradient, each with one 64 x D accumulator (two per consumer would not fit
    # the registers at D=256): _split_consumer_p (S^T, P^T, dV += P^T dO) hands P^T through shared
    # memory to _split_consumer_ds (dP^T, dS^T, dK += dS^T Q), four products per step in all
    SPLIT_GRADS: gl.constexpr = HEAD_DIM >= SPLIT_GRADS_FROM
    KV_HALVES: gl.constexpr = 1 if SPLIT_GRADS else 2
    gl.static_assert(not (SPLIT_GRADS and FUSED_DQ), "no fused dQ where the consumers split by gradient")
    gl.static_assert(2 * KV_HALVES * HALF * HEAD_DIM * 2 + STAGES * BLOCK_M * (4 * HEAD_DIM + 8)
                     + SPLIT_GRADS * 2 * HALF * BLOCK_M * 4 <= 232448 - 1024, "the tile does not fit in shared memory")
    dtype: gl.constexpr = Q.dtype.element_ty
    layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    if SECTION > 0:  # a 1-d grid in sections of SECTION kv heads, key blocks outer inside each (section_order)
        pid_n, bh = _section_program(gl.program_id(0), gl.num_programs(0), gl.cdiv(Sk, KV_HALVES * HALF), SECTION)
    else:
        pid_n = gl.program_id(0)
        bh = gl.program_id(1)
    off_b = (bh // Hkv).to(gl.int64)
    off_hk = (bh % Hkv).to(gl.int64)
    # variable length (IS_VARLEN): sequence off_b is rows [cu[b], cu[b + 1]) of the packed (total, H, D)
    # tensors (batch strides 0), Sq / Sk the longest; lse / delta (Hq, total_q) with a batch stride of 0
    q_start = 0
    k_start = 0
    q_rows = Sq
    if IS_VARLEN:
        q_start = gl.load(CU_Q + off_b).to(gl.int64)
        k_start = gl.load(CU_K + off_b).to(gl.int64)
        Sq = (gl.load(CU_Q + off_b + 1) - q_start).to(gl.int32)
        Sk = (gl.load(CU_K + off_b + 1) - k_start).to(gl.int32)
        longest = gl.maximum(Sq, Sk)
        # past this sequence's keys, or a sequence of another length class (launch.length_classes)
        if (pid_n * (KV_HALVES * HALF) >= Sk) | (longest < LEN_LO) | (longest >= LEN_HI):
            return
        # a sequence with no query: its keys' dK / dV are 0 (no block loaded); a one-row descriptor
        q_rows = gl.maximum(Sq, 1)
        if Sq == 0:
            q_start = q_start * 0

    # the program's key block (FUSED_DQ with DETERMINISTIC: its rank in _dq_writer's order)
    key_blk = pid_n
    start_n = key_blk * (KV_HALVES * HALF)

    # queries [lo_blk * BLOCK_M, Sq) see some key of the block (causal: query i sees j <= i + shift)
    shift = Sk - Sq + win_right
    lo_blk = 0
    if CAUSAL:
        lo_blk = gl.minimum(gl.maximum(start_n - shift, 0), Sq) // BLOCK_M
    n_m = gl.cdiv(Sq, BLOCK_M) - lo_blk

    k_smem = gl.allocate_shared_memory(dtype, [KV_HALVES, HALF, HEAD_DIM], layout)
    v_smem = gl.allocate_shared_memory(dtype, [KV_HALVES, HALF, HEAD_DIM], layout)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], layout)
    # each slot's lse2 and delta rows, written by the producer
    rows_smem = gl.allocate_shared_memory(gl.float32, [2 * STAGES, BLOCK_M],
                                          gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0]))
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready_bars.index(i), count=1)
        mbarrier.init(empty_bars.index(i), count=2)  # both consumers release a slot
    if FUSED_DQ:
        # dS^T tiles by (step parity, consumer), 4 x 8 KB, a barrier per parity (both consumers
        # arrive), and each consumer's fp32 dQ tile for the writer, 2 x 16 KB, with a full and an
        # empty barrier each (without FUSED_DQ the partitions get other buffers in their place, unread)
        ds_smem = gl.allocate_shared_memory(dtype, [4, HALF, BLOCK_M], layout)
        ds_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        # (the consumers' 8-byte stores from the wgmma accumulator have 2-way bank conflicts under
        # this 128-byte swizzle; a 32-byte one has none but gives the writer 4x the TMA reductions:
        # 0.86x, twenty-ninth session)
        dq_stage = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M, HEAD_DIM // 2],
                                             gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2))
        dq_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        dq_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(ds_bars.index(i), count=2)
            mbarrier.init(dq_full.index(i), count=1)
            mbarrier.init(dq_empty.index(i), count=1)
    if SPLIT_GRADS:  # P^T from consumer P to consumer dS: two fp32 buffers, a full and an empty barrier each
        p_smem = gl.allocate_shared_memory(gl.float32, [2, HALF, BLOCK_M],
                                           gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2))
        p_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        p_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(p_full.index(i), count=1)
            mbarrier.init(p_empty.index(i), count=1)
    fence_async_shared()

    q_base = Q + off_b * stride_qb + q_start * stride_qm
    do_base = DO + off_b * stride_dob + q_start * stride_dom
    k_base = K + off_b * stride_kb + k_start * stride_kn + (off_hk // KV_SPLIT) * stride_kh
    v_base = V + off_b * stride_vb + k_start * stride_vn + (off_hk // KV_SPLIT) * stride_vh
    dk_base = DK + off_b * stride_dkb + k_start * stride_dkn + off_hk * stride_dkh
    dv_base = DV + off_b * stride_dvb + k_start * stride_dvn + off_hk * stride_dvh
    lse_base = LSE + off_b * stride_lse_b + q_start
    delta_base = DELTA + off_b * stride_lse_b + q_start
    # (the partitions' argument lists are written out in both calls: passed as tuples, the constexprs
    # among them, FUSED_DQ above all, reach the partitions as runtime values and both branches compile)
    if FUSED_DQ:
        # the buffer's rows, and the semaphores, of this batch entry's first query head of the group
        dqa_row0 = (off_b * dqa_batch_rows + off_hk * GROUP * dqa_head_rows + q_start).to(gl.int32)
        sem0 = off_b * sem_batch + off_hk * GROUP * sem_head
        if IS_VARLEN:  # (a sequence's blocks: from its first row's block + its index, see launch_args)
            sem0 += q_start // BLOCK_M + off_b
        gl.warp_specialize([
            (_consumer, (0, dk_base, dv_base, stride_dkn, stride_dvn, start_n, Sk, GROUP, lo_blk, n_m, shift, qk_scale,
                         sm_scale, k_smem, v_smem, q_smem, do_smem, kv_bar, ready_bars, empty_bars, rows_smem, ds_smem,
                         ds_bars, dq_stage, dq_full, dq_empty, CAUSAL, HEAD_DIM, BLOCK_M, STAGES, True, SPLIT_DIAG,
                         SPLIT_WAITS)),
            (_consumer, (1, dk_base, dv_base, stride_dkn, stride_dvn, start_n, Sk, GROUP, lo_blk, n_m, shift, qk_scale,
                         sm_scale, k_smem, v_smem, q_smem, do_smem, kv_bar, ready_bars, empty_bars, rows_smem, ds_smem,
                         ds_bars, dq_stage, dq_full, dq_empty, CAUSAL, HEAD_DIM, BLOCK_M, STAGES, True, SPLIT_DIAG,
                         SPLIT_WAITS)),
            (_producer, (k_base, v_base, q_base, do_base, stride_kn, stride_vn, stride_qm, stride_qh, stride_dom,
                         stride_doh, off_hk, start_n, Sq, q_rows, Sk, GROUP, lo_blk, n_m, k_smem, v_smem, q_smem,
                         do_smem, kv_bar, ready_bars, empty_bars, lse_base, delta_base, stride_lse_h, rows_smem,
                         HEAD_DIM, BLOCK_M, STAGES, True)),
            (_dq_writer, (DQA, dqa_rows, dqa_row0, dqa_head_rows, SEM, sem0, sem_head, GROUP, lo_blk, n_m, key_blk,
                          dq_stage, dq_full, dq_empty, HEAD_DIM, BLOCK_M, DETERMINISTIC, FIRST_STORE)),
        ], [4, 1, 1], [240, 24, 24])
    elif SPLIT_GRADS:
        gl.warp_specialize([
            (_split_consumer_p, (dv_base, stride_dvn, start_n, Sk, GROUP, lo_blk, n_m, shift, qk_scale, k_smem, q_smem,
                                 do_smem, kv_bar, ready_bars, empty_bars, rows_smem, p_smem, p_full, p_empty, CAUSAL,
                                 HEAD_DIM, BLOCK_M, STAGES)),
            (_split_consumer_ds, (dk_base, stride_dkn, start_n, Sk, GROUP, lo_blk, n_m, sm_scale, v_smem, q_smem,
                                  do_smem, kv_bar, ready_bars, empty_bars, rows_smem, p_smem, p_full, p_empty,
                                  HEAD_DIM, BLOCK_M, STAGES)),
            (_producer, (k_base, v_base, q_base, do_base, stride_kn, stride_vn, stride_qm, stride_qh, stride_dom,
                         stride_doh, off_hk, start_n, Sq, q_rows, Sk, GROUP, lo_blk, n_m, k_smem, v_smem, q_smem,
                         do_smem, kv_bar, ready_bars, empty_bars, lse_base, delta_base, stride_lse_h, rows_smem,
                         HEAD_DIM, BLOCK_M, STAGES, False, 1, DESC_3D)),
        ], [4, 1], [240, 24])
    else:
        gl.warp_specialize([
            (_consumer, (0, dk_base, dv_base, stride_dkn, stride_dvn, start_n, Sk, GROUP, lo_blk, n_m, shift, qk_scale,
                         sm_scale, k_smem, v_smem, q_smem, do_smem, kv_bar, ready_bars, empty_bars, rows_smem, k_smem,
                         kv_bar, k_smem, kv_bar, kv_bar, CAUSAL, HEAD_DIM, BLOCK_M, STAGES, False, SPLIT_DIAG,
                         SPLIT_WAITS)),
            (_consumer, (1, dk_base, dv_base, stride_dkn, stride_dvn, start_n, Sk, GROUP, lo_blk, n_m, shift, qk_scale,
                         sm_scale, k_smem, v_smem, q_smem, do_smem, kv_bar, ready_bars, empty_bars, rows_smem, k_smem,
                         kv_bar, k_smem, kv_bar, kv_bar, CAUSAL, HEAD_DIM, BLOCK_M, STAGES, False, SPLIT_DIAG,
                         SPLIT_WAITS)),
            (_producer, (k_base, v_base, q_base, do_base, stride_kn, stride_vn, stride_qm, stride_qh, stride_dom,
                         stride_doh, off_hk, start_n, Sq, q_rows, Sk, GROUP, lo_blk, n_m, k_smem, v_smem, q_smem,
                         do_smem, kv_bar, ready_bars, empty_bars, lse_base, delta_base, stride_lse_h, rows_smem,
                         HEAD_DIM, BLOCK_M, STAGES, False, 2, DESC_3D)),
        ], [4, 1], [240, 24])


@gluon.jit
def _section_program(pid, n_programs, n_kb, SECTION: gl.constexpr):
    """(key block, batch x kv head) of program ``pid`` of a 1-d grid of ``n_kb`` key blocks x the kv
    heads, in sections of SECTION kv heads (the last one may have fewer), key blocks outer inside a
    section: every head's key block 0, then every head's key block 1, ... (section_order)."""
    per = n_kb * SECTION
    sec = pid // per
    r = pid - sec * per
    heads = gl.minimum(n_programs // n_kb - sec * SECTION, SECTION)  # this section's heads
    return r // heads, sec * SECTION + r % heads


def section_order(value: str | None, n_kb: int, heads: int, q: torch.Tensor, group: int, longest: int,
                  head_dim: int) -> int:
    """The ordered fused dQ's programs in sections of kv heads, key blocks outer inside each, instead
    of a head's key blocks one after the other (twenty-seventh session; the default since the
    twenty-eighth where configs.fused_sections says). Returns SECTION, the kv heads per section (0:
    the 2-d grid). ``value``: TRITONATTN_BWD_FUSED_SECTION as the launcher read it for its plan key:
    unset, the default rule; "auto", the rule's size wherever the fused dQ runs; a number, that many
    kv heads; "0" (or off), never.

    Why: a program adds its dQ tile to a query block after the key blocks before it have (_dq_writer,
    DETERMINISTIC). A head's key blocks launched together wait on each other once, one link each
    (the turn's round trip), and a head whose key blocks straddle a wave waits on its latest start:
    measured 16% of the fused kernel's time at MHA S=2048 (1499 against 1289 us unordered, NOTES,
    twenty-seventh session). Key blocks outer, a key block starts about a wave after the one before
    it of its head, which is ahead by then. Sections keep a section's Q / dO and fp32 dQ rows in L2
    (every head at once would send the reductions' read-modify-write to HBM): a wave of programs,
    SMs // key blocks heads, at least configs.FUSED_SECTION_MIN_HEADS. The same additions in the same
    order: bitwise the same gradients."""
    text = (value or "").strip().lower()
    if value is not None and text in configs._OFF:
        return 0
    if text and text != "auto" and not (text.isascii() and text.isdigit()):
        raise ValueError(f"TRITONATTN_BWD_FUSED_SECTION={value!r}: a number of kv heads per section, 'auto' or 0")
    if text.isdigit():
        return min(heads, int(text))
    if value is None and not configs.fused_sections(head_dim, group, longest, n_kb * heads, sm_count(q.device)):
        return 0
    return configs.section_heads(n_kb, heads, sm_count(q.device))


def launch_args(q, k, v, do, lse, delta, dk, dv, win_right: int, qk_scale: float, sm_scale: float,
                cu_seqlens=None, max_seqlens=None, lengths=(0, LENGTH_CAP), dqa=None, sem=None,
                kv_split: int = 1) -> tuple:
    """q / do (B, Sq, Hq, D), k / v / dk / dv (B, Sk, Hkv, D), unit dim stride; lse / delta (B, Hq, Sq).
    Variable length (the kernel's IS_VARLEN): ``cu_seqlens`` (cu_q, cu_k) int32 (B + 1,),
    ``max_seqlens`` (max_q, max_k); q / do (total_q, Hq, D), k / v / dk / dv (total_k, Hkv, D),
    lse / delta (Hq, total_q); ``lengths`` (lo, hi): the launch serves the sequences whose longest
    side is in [lo, hi) (a length class, launch.length_classes). ``dqa`` (the kernel's FUSED_DQ):
    the contiguous fp32 buffer that dQ (scaled) is added to, (B, Hq, Sq, D), or (Hq, total_q, D)
    packed, zeroed by the caller; ``sem`` (DETERMINISTIC): int32 zeros, ``sem_blocks(q, cu_seqlens)``
    of them. ``kv_split`` (the kernel's KV_SPLIT): dk / dv are fp32 partials with at least kv_split x k's
    kv heads, (B, Sk, Hkv * n, D) with n >= kv_split (the kernel writes the first Hkv * kv_split), and
    the kernel gets the virtual heads' count and group."""
    dense = cu_seqlens is None
    hq, hkv = (q.shape[2], k.shape[2]) if dense else (q.shape[1], k.shape[1])
    assert (hq // hkv) % kv_split == 0, (hq, hkv, kv_split)
    assert dk.shape[-2] == dv.shape[-2] and (dk.shape[-2] == hkv if kv_split == 1 else
                                             dk.shape[-2] % hkv == 0 and dk.shape[-2] >= hkv * kv_split), \
        (dk.shape, hkv, kv_split)
    hkv *= kv_split
    if dqa is None:
        fused = (q, 0, 0, 0, q, 0, 0)
    else:
        assert dqa.is_contiguous() and dqa.dtype == torch.float32 and dqa.shape[-1] == q.shape[-1]
        head_rows = dqa.shape[-2]
        fused = (dqa, dqa.numel() // dqa.shape[-1], hq * head_rows if dense else 0, head_rows)
        if sem is None:
            fused += (q, 0, 0)
        else:
            assert sem.dtype == torch.int32 and sem.numel() == sem_blocks(q, cu_seqlens)
            per_head = sem.numel() // (hq * q.shape[0]) if dense else sem.numel() // hq
            fused += (sem, per_head * hq if dense else 0, per_head)
    if dense:
        return (q, k, v, do, lse, delta, dk, dv, q, q, *lengths, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
                *do.stride()[:3], *dk.stride()[:3], *dv.stride()[:3], lse.stride(0), lse.stride(1), hkv, hq // hkv,
                q.shape[1], k.shape[1], win_right, qk_scale, sm_scale, *fused)
    packed = (x for t in (q, k, v, do, dk, dv) for x in (0, *t.stride()[:2]))  # (batch 0, row, head) strides
    return (q, k, v, do, lse, delta, dk, dv, *cu_seqlens, *lengths, *packed, 0, lse.stride(0), hkv, hq // hkv,
            *max_seqlens, win_right, qk_scale, sm_scale, *fused)


def sem_blocks(q, cu_seqlens=None) -> int:
    """How many semaphores FUSED_DQ with DETERMINISTIC counts with: one per (batch entry, query head,
    query block). Packed: per head, cdiv(total_q, BLOCK_M) + B, sequence b's block i at
    ``cu_q[b] // BLOCK_M + b + i`` (distinct across sequences: floor(a / m) + ceil(l / m) <=
    floor((a + l) / m) + 1)."""
    block_m = TILES[q.shape[-1]][0]
    if cu_seqlens is None:
        return q.shape[0] * q.shape[2] * -(-q.shape[1] // block_m)
    return q.shape[1] * (-(-q.shape[0] // block_m) + cu_seqlens[0].shape[0] - 1)
