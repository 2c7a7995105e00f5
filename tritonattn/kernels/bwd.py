"""FlashAttention-2 backward: a dQ kernel that also computes delta = rowsum(dO * O), then a dK/dV
kernel that reads it, and (for a bias that requires grad) a dBias kernel; plus the probability
kernel behind ``return_attn_probs``. (The opt-in atomic-dQ path: a delta preprocess kernel, then a
dK/dV kernel that also adds dQ.) Under a causal mask the programs may start heads first
(``configs.heads_first``).

On sm_90 the dK/dV kernel of the calls ``_gluon_ok`` admits is the Gluon one
(kernels/bwd_sm90.py); the dQ kernel stays this module's, except where that Gluon kernel computes
dQ too (configs.fused_dq_serves: a delta preprocess, then the Gluon kernel adding its dQ tiles to an
fp32 buffer by TMA reductions in a fixed order, then a copy into dQ).

Deterministic: each program owns the rows of the gradient it writes, or (the fused dQ) adds them in
an order fixed by semaphores, so reruns are bitwise equal.
The dK/dV program of a kv head walks the query heads of its GQA group itself, so dK/dV sum over
the group without an expanded K/V or a reduction pass. With dropout, dS = P * (dP * Z - delta)
where Z = keep / (1 - p) is regenerated from the same Philox counters as the forward.
"""


import torch
import triton
import triton.language as tl

from tritonattn import autotune, configs
from tritonattn.kernels import kept, plan
from tritonattn.kernels.common import (
    LENGTH_CAP,
    LOG2E,
    dropout_keep,
    head_setup,
    key_range,
    load_row_pair,
    mma,
    program_order,
    query_range,
    row_tiles,
    scores_log2,
    seq_bounds,
    tile_visible,
)
from tritonattn.kernels.fwd import GLUON_ROUTE, _hopper, _need_allocator, _on_sm90, _tma_ok, gluon_serves
from tritonattn.kernels.launch import cdiv, launch, length_classes, program_grid
from tritonattn.kernels.variants import Variants

try:  # Gluon ships with Triton, as an experimental API
    from tritonattn.kernels import bwd_sm90
except Exception:  # noqa: BLE001 (a Triton without Gluon, or with another Gluon API: the Triton kernel serves all)
    bwd_sm90 = None


@triton.jit
def _load_lse2(p_lse, offs_m, m_ok):
    """LSE of the rows in the exp2 domain; +inf for rows past Sq or with no visible key, so that
    their probabilities exp2(s - lse2) are exactly 0."""
    lse = tl.load(p_lse + offs_m, mask=m_ok, other=float("inf"))
    return tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)


@triton.jit
def _grad_scores(p, dp, delta, t, keep, dropout_p, SOFTCAP: tl.constexpr, HAS_DROPOUT: tl.constexpr):
    """From P and dP = dO V^T: ``ds`` (gradient of the final scores: dBias) and ``ds_qk`` (of the
    raw q.k, without the softmax scale), and P with dropout applied (for dV). ``keep``: the
    dropout mask of the tile (ignored without dropout)."""
    if HAS_DROPOUT:
        rescale = 1.0 / (1.0 - dropout_p)
        p_drop = tl.where(keep, p * rescale, 0.0)
        ds = p * (tl.where(keep, dp * rescale, 0.0) - delta)
    else:
        p_drop = p
        ds = p * (dp - delta)
    ds_qk = ds
    if SOFTCAP:
        ds_qk = ds * (1.0 - t * t)
    return ds, ds_qk, p_drop


@triton.jit
def _bwd_preprocess_kernel(
    O, DO, DELTA,
    stride_ob, stride_om, stride_oh, stride_od,
    stride_dob, stride_dom, stride_doh, stride_dod,
    CU_Q, stride_lse_b, stride_lse_h, Hq, Sq,
    IS_VARLEN: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    HEADS_FIRST: tl.constexpr,
):
    """delta = rowsum(dO * O), float32, laid out like the lse."""
    pid, _n_blocks, bh, _n_bh = program_order(HEADS_FIRST)
    off_bh = bh.to(tl.int64)
    off_b = off_bh // Hq
    off_h = off_bh % Hq
    q_start, Sq, _, _ = seq_bounds(CU_Q, CU_Q, off_b, Sq, Sq, IS_VARLEN)
    O += q_start * stride_om
    DO += q_start * stride_dom
    DELTA += off_b * stride_lse_b + off_h * stride_lse_h + q_start
    offs_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m[:, None] < Sq) & (offs_d[None, :] < HEAD_DIM)
    rows = offs_m[:, None].to(tl.int64)
    o = tl.load(O + off_b * stride_ob + off_h * stride_oh + rows * stride_om + offs_d[None, :] * stride_od,
                mask=mask, other=0.0)
    do = tl.load(DO + off_b * stride_dob + off_h * stride_doh + rows * stride_dom + offs_d[None, :] * stride_dod,
                 mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + offs_m, delta, mask=offs_m < Sq)


@triton.jit
def _bwd_dq_convert_kernel(
    DQA, DQ,
    stride_ab, stride_ah, stride_am,
    stride_qb, stride_qm, stride_qh, stride_qd,
    Hq, rows,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, HEADS_FIRST: tl.constexpr,
):
    """dQ in its dtype and layout from the fused dQ's float32 buffer (heads before rows, unit dim
    stride): ``rows`` rows of each (batch, head), BLOCK_M of them per program, both sides read and
    written whole rows at a time (a transposing torch copy took the slow strided path)."""
    pid, _n_blocks, bh, _n_bh = program_order(HEADS_FIRST)
    off_bh = bh.to(tl.int64)
    off_b = off_bh // Hq
    off_h = off_bh % Hq
    offs_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m[:, None] < rows) & (offs_d[None, :] < HEAD_DIM)
    r = offs_m[:, None].to(tl.int64)
    x = tl.load(DQA + off_b * stride_ab + off_h * stride_ah + r * stride_am + offs_d[None, :], mask=mask)
    tl.store(DQ + off_b * stride_qb + off_h * stride_qh + r * stride_qm + offs_d[None, :] * stride_qd,
             x.to(DQ.dtype.element_ty), mask=mask)


def _convert_dq(dqa: torch.Tensor, dq: torch.Tensor, var: Variants, launch_fn) -> None:
    """``dq`` (q's layout, any strides) = the fused dQ's float32 buffer ``dqa``: (B, Hq, Sq, D), or
    (Hq, total_q, D) for packed sequences, contiguous; through ``launch_fn`` (a plan's)."""
    if var.varlen:
        hq, rows, d = dqa.shape
        batch, a_strides = 1, (0, dqa.stride(0), dqa.stride(1))
    else:
        batch, hq, rows, d = dqa.shape
        a_strides = (dqa.stride(0), dqa.stride(1), dqa.stride(2))
    cfg = configs.DQ_CONVERT
    wide = batch * hq > configs.MAX_GRID_YZ  # heads on the grid's x axis only past the y limit
    launch_fn(_bwd_dq_convert_kernel, program_grid(cdiv(rows, cfg.block_m), batch * hq, wide),
              (dqa, dq, *a_strides, *var.bshd_strides(dq), hq, rows),
              dict(HEAD_DIM=d, BLOCK_D=configs.padded_head_dim(d), BLOCK_M=cfg.block_m, num_warps=cfg.num_warps,
                   HEADS_FIRST=wide))


@triton.jit
def _bwd_kv_sum_kernel(
    PK, PV, DK, DV,
    CU_Q, CU_K, LEN_LO, LEN_HI,
    stride_pb, stride_pn, stride_ph,
    stride_kb, stride_kn, stride_kh, stride_kd,
    stride_vb, stride_vn, stride_vh, stride_vd,
    Hkv, Sk,
    SPLIT: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_VARLEN: tl.constexpr = False,
):
    """dK / dV (their dtype, any strides) of kv head h = the sum of the SPLIT fp32 partials of its
    virtual heads h * SPLIT .. h * SPLIT + SPLIT - 1 (bwd_sm90 KV_SPLIT; PK / PV share their
    strides, unit dim stride), added in that order: the same bits on every run. IS_VARLEN: sequence
    b is rows [CU_K[b], CU_K[b + 1]) (batch strides 0, Sk the longest), and only the sequences whose
    longest side is in [LEN_LO, LEN_HI) (the length class the partials are of) are summed."""
    pid = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    off_b = bh // Hkv
    off_h = bh % Hkv
    start = 0
    if IS_VARLEN:
        start = tl.load(CU_K + off_b).to(tl.int64)
        Sk = (tl.load(CU_K + off_b + 1) - start).to(tl.int32)
        longest = tl.maximum(Sk, tl.load(CU_Q + off_b + 1) - tl.load(CU_Q + off_b))
        if (pid * BLOCK_N >= Sk) | (longest < LEN_LO) | (longest >= LEN_HI):
            return
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_n[:, None] < Sk) & (offs_d[None, :] < HEAD_DIM)
    r = start + offs_n[:, None].to(tl.int64)
    p = off_b * stride_pb + off_h * SPLIT * stride_ph + r * stride_pn + offs_d[None, :]
    dk = tl.load(PK + p, mask=mask, other=0.0)
    dv = tl.load(PV + p, mask=mask, other=0.0)
    for i in tl.static_range(1, SPLIT):
        dk += tl.load(PK + p + i * stride_ph, mask=mask, other=0.0)
        dv += tl.load(PV + p + i * stride_ph, mask=mask, other=0.0)
    tl.store(DK + off_b * stride_kb + off_h * stride_kh + r * stride_kn + offs_d[None, :] * stride_kd,
             dk.to(DK.dtype.element_ty), mask=mask)
    tl.store(DV + off_b * stride_vb + off_h * stride_vh + r * stride_vn + offs_d[None, :] * stride_vd,
             dv.to(DV.dtype.element_ty), mask=mask)


@triton.jit
def _bwd_dkdv_inner(
    dk, dv, k, v,
    p_q, p_do, p_lse, p_delta, stride_qm, stride_dom, p_dqa, stride_dqam,
    start_n, offs_n, offs_mb, offs_d, lo, hi, Sq, Sk,
    p_qa, p_doa, offs_da,
    qk_scale, softcap_scale, softcap_log2, slope2,
    p_bias, stride_bias_m, stride_bias_n, p_mask, stride_mask_m, stride_mask_n,
    win_left, win_right, seed, dropout_p,
    BOUNDS: tl.constexpr, WIN_LEFT: tl.constexpr, WIN_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_BIAS: tl.constexpr, MASK_KIND: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr, ATOMIC_DQ: tl.constexpr, D_SPLIT: tl.constexpr, DQ_TMA: tl.constexpr,
    LOOP_STAGES: tl.constexpr, GRADS: tl.constexpr, q_desc, do_desc, TMA: tl.constexpr,
):
    """Accumulate dK, dV of one key block over the query blocks [lo, hi) of one query head.

    Works on transposed scores (keys x queries) so that dV = P^T dO and dK = dS^T Q need no
    transpose of P. ATOMIC_DQ (opt-in, not deterministic): also add this key block's share of dQ,
    dS K, into the fp32 buffer at ``p_dqa`` with atomics, so the backward needs no dQ kernel (5
    matrix products per tile instead of 7); with DQ_TMA the tile is added by one bulk TMA reduction
    through the descriptor ``p_dqa`` (sm_90) instead of an atomic per element. D_SPLIT > 1: dK / dV
    hold only the head-dim columns ``offs_da`` (Q / dO columns read through ``p_qa`` / ``p_doa``);
    the scores still use all of D. LOOP_STAGES: the loop's software-pipelining depth (None: the
    kernel's num_stages). GRADS: 3 both gradients, 1 dV only (no dO V^T, no delta), 2 dK only.
    TMA: Q / dO tiles through the tensor descriptors ``q_desc`` / ``do_desc`` (rows past Sq read as
    zeros; no per-element address registers).
    """
    d_ok = offs_d < HEAD_DIM
    da_ok = offs_da < HEAD_DIM
    for start_m in tl.range(lo, hi, BLOCK_M, num_stages=LOOP_STAGES):
        offs_m = start_m + offs_mb
        m_ok = offs_m < Sq
        qd_ok = m_ok[:, None] & d_ok[None, :]
        q, do = load_row_pair(q_desc, do_desc, p_q, p_do, stride_qm, stride_dom, start_m, offs_m, qd_ok, TMA)
        lse2 = _load_lse2(p_lse, offs_m, m_ok)
        if GRADS & 2:
            delta = tl.load(p_delta + offs_m, mask=m_ok, other=0.0)
        else:
            delta = tl.zeros([BLOCK_M], tl.float32)
        qk_t = mma(k, tl.trans(q), None, DOT_FP32, PRECISION)
        s_t, t_t = scores_log2(qk_t, offs_m[None, :], offs_n[:, None], Sq, Sk, qk_scale, softcap_scale,
                               softcap_log2, slope2, p_bias, stride_bias_m, stride_bias_n, p_mask, stride_mask_m,
                               stride_mask_n, win_left, win_right, BOUNDS, WIN_LEFT, WIN_RIGHT, SOFTCAP, HAS_ALIBI,
                               HAS_BIAS, MASK_KIND, PRECISION)
        p_t = tl.math.exp2(s_t - lse2[None, :])
        if GRADS & 2:
            dp_t = mma(v, tl.trans(do), None, DOT_FP32, PRECISION)
        else:  # dV only: dS is not needed (its code is dropped)
            dp_t = p_t
        keep_t = 0
        if HAS_DROPOUT:
            keep_t = dropout_keep(seed, offs_m, start_n, BLOCK_N, dropout_p, True)
        _, ds_t, p_t = _grad_scores(p_t, dp_t, delta[None, :], t_t, keep_t, dropout_p, SOFTCAP, HAS_DROPOUT)
        if D_SPLIT == 1:
            q_acc, do_acc = q, do
        else:  # this program's columns of Q and dO (the rows were just read: cache hits)
            qa_ok = m_ok[:, None] & da_ok[None, :]
            q_acc = tl.load(p_qa + offs_m[:, None].to(tl.int64) * stride_qm, mask=qa_ok, other=0.0)
            do_acc = tl.load(p_doa + offs_m[:, None].to(tl.int64) * stride_dom, mask=qa_ok, other=0.0)
        if GRADS & 1:
            dv = mma(p_t.to(do.dtype), do_acc, dv, DOT_FP32, PRECISION)
        ds_lo = ds_t.to(q.dtype)
        if GRADS & 2:
            dk = mma(ds_lo, q_acc, dk, DOT_FP32, PRECISION)
        if ATOMIC_DQ:
            dq_part = mma(tl.trans(ds_lo), k, None, DOT_FP32, PRECISION)
            if DQ_TMA:  # rows past Sq and columns past HEAD_DIM fall outside the descriptor: dropped
                p_dqa.atomic_add([tl.cast(start_m, tl.int32), 0], dq_part)
            else:
                tl.atomic_add(p_dqa + offs_m[:, None].to(tl.int64) * stride_dqam, dq_part, mask=qd_ok,
                              sem="relaxed")
    return dk, dv


@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV,
    stride_qb, stride_qm, stride_qh, stride_qd,
    stride_kb, stride_kn, stride_kh, stride_kd,
    stride_vb, stride_vn, stride_vh, stride_vd,
    stride_dob, stride_dom, stride_doh, stride_dod,
    stride_dkb, stride_dkn, stride_dkh, stride_dkd,
    stride_dvb, stride_dvn, stride_dvh, stride_dvd,
    DQA, stride_dqab, stride_dqam, stride_dqah, stride_dqad,
    BIAS, stride_bias_b, stride_bias_h, stride_bias_m, stride_bias_n,
    MASK, stride_mask_b, stride_mask_h, stride_mask_m, stride_mask_n,
    ALIBI, stride_alibi_b, SEED, dropout_p,
    CU_Q, CU_K, stride_lse_b, stride_lse_h, LEN_LO, LEN_HI,
    Hq, Hkv, GROUP, Sq, Sk, sm_scale, qk_scale, softcap_scale, softcap_log2, win_left, win_right,
    WIN_LEFT: tl.constexpr, WIN_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_BIAS: tl.constexpr, MASK_KIND: tl.constexpr, HAS_DROPOUT: tl.constexpr, IS_VARLEN: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, ATOMIC_DQ: tl.constexpr, D_SPLIT: tl.constexpr,
    BLOCK_DA: tl.constexpr, DQ_TMA: tl.constexpr, HEADS_FIRST: tl.constexpr, MASKED_STAGES: tl.constexpr,
    GRADS: tl.constexpr, TMA: tl.constexpr,
):
    # GRADS: 3 dK and dV; 1 dV only, 2 dK only (the split-gradient launches of TileConfig.split_grads)
    # D_SPLIT programs share a key block, each accumulating BLOCK_DA = BLOCK_D / D_SPLIT columns of
    # dK / dV (smaller accumulators: D=256 fits larger key blocks); all recompute the scores
    pid, _n_blocks, bh, _n_bh = program_order(HEADS_FIRST)  # causal: key block 0 sees the most queries and goes first
    pid_n = pid // D_SPLIT
    d_part = pid % D_SPLIT
    off_bhk = bh.to(tl.int64)
    off_b = off_bhk // Hkv
    off_hk = off_bhk % Hkv

    start_n = pid_n * BLOCK_N
    q_start, Sq, k_start, Sk = seq_bounds(CU_Q, CU_K, off_b, Sq, Sk, IS_VARLEN, LEN_LO, LEN_HI)
    if IS_VARLEN:
        # past this sequence's end (the grid covers the longest), or another length class's sequence
        if start_n >= Sk:
            return
    Q += q_start * stride_qm
    DO += q_start * stride_dom
    DQA += q_start * stride_dqam
    K += k_start * stride_kn
    V += k_start * stride_vn
    DK += k_start * stride_dkn
    DV += k_start * stride_dvn
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_mb = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    kv_mask = (offs_n[:, None] < Sk) & (offs_d[None, :] < HEAD_DIM)
    rows_n = offs_n[:, None].to(tl.int64)
    k = tl.load(K + off_b * stride_kb + off_hk * stride_kh + rows_n * stride_kn + offs_d[None, :] * stride_kd,
                mask=kv_mask, other=0.0)
    if GRADS & 2:
        v = tl.load(V + off_b * stride_vb + off_hk * stride_vh + rows_n * stride_vn + offs_d[None, :] * stride_vd,
                    mask=kv_mask, other=0.0)
    else:  # dV only: V is not read
        v = k
    offs_da = d_part * BLOCK_DA + tl.arange(0, BLOCK_DA)
    dk = tl.zeros([BLOCK_N, BLOCK_DA], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DA], tl.float32)

    lo, full_lo, full_hi, hi = query_range(start_n, Sq, Sk, win_left, win_right, BLOCK_M, BLOCK_N,
                                           WIN_LEFT, WIN_RIGHT)
    # not software-pipelined: when the query loop inside folds away (Sq=1, specialized by Triton), this
    # loop is the innermost, and the pipeliner cannot predicate the descriptor creation in it
    for g in tl.range(GROUP, num_stages=1):
        off_h = off_hk * GROUP + g
        off_bh = off_b * Hq + off_h
        p_q = Q + off_b * stride_qb + off_h * stride_qh + offs_d[None, :] * stride_qd
        p_do = DO + off_b * stride_dob + off_h * stride_doh + offs_d[None, :] * stride_dod
        p_lse = LSE + off_b * stride_lse_b + off_h * stride_lse_h + q_start
        p_delta = DELTA + off_b * stride_lse_b + off_h * stride_lse_h + q_start
        p_dqa = DQA + off_b * stride_dqab + off_h * stride_dqah + offs_d[None, :] * stride_dqad
        if DQ_TMA:  # (the host checked: sm_90, contiguous fp32 buffer, 16-byte aligned rows)
            p_dqa = tl.make_tensor_descriptor(DQA + off_b * stride_dqab + off_h * stride_dqah, shape=[Sq, HEAD_DIM],
                                              strides=[stride_dqam, 1], block_shape=[BLOCK_M, BLOCK_D])
        q_desc, do_desc = row_tiles(Q + off_b * stride_qb + off_h * stride_qh,
                                    DO + off_b * stride_dob + off_h * stride_doh,
                                    stride_qm, stride_dom, Sq, p_q, p_do, HEAD_DIM, BLOCK_M, BLOCK_D, TMA)
        p_qa = Q + off_b * stride_qb + off_h * stride_qh + offs_da[None, :] * stride_qd
        p_doa = DO + off_b * stride_dob + off_h * stride_doh + offs_da[None, :] * stride_dod
        p_bias, p_mask, slope2, seed = head_setup(off_b, off_h, off_bh, BIAS, stride_bias_b, stride_bias_h,
                                                  MASK, stride_mask_b, stride_mask_h, ALIBI, stride_alibi_b, SEED,
                                                  HAS_BIAS, MASK_KIND, HAS_ALIBI, HAS_DROPOUT)
        if WIN_RIGHT:  # masked: the diagonal / the window's right edge
            dk, dv = _bwd_dkdv_inner(
                dk, dv, k, v, p_q, p_do, p_lse, p_delta, stride_qm, stride_dom, p_dqa, stride_dqam, start_n, offs_n,
                offs_mb, offs_d,
                lo, tl.minimum(full_lo, hi), Sq, Sk, p_qa, p_doa, offs_da,
                qk_scale, softcap_scale, softcap_log2, slope2,
                p_bias, stride_bias_m, stride_bias_n, p_mask, stride_mask_m, stride_mask_n,
                win_left, win_right, seed, dropout_p,
                True, WIN_LEFT, WIN_RIGHT, SOFTCAP, HAS_ALIBI, HAS_BIAS, MASK_KIND, HAS_DROPOUT,
                HEAD_DIM, BLOCK_M, BLOCK_N, DOT_FP32, PRECISION, ATOMIC_DQ, D_SPLIT, DQ_TMA, MASKED_STAGES, GRADS,
                q_desc, do_desc, TMA)
        # unmasked (keys past Sk need no mask here: they only feed their own, unstored, dK/dV rows)
        dk, dv = _bwd_dkdv_inner(
            dk, dv, k, v, p_q, p_do, p_lse, p_delta, stride_qm, stride_dom, p_dqa, stride_dqam, start_n, offs_n,
                offs_mb, offs_d,
            full_lo, full_hi, Sq, Sk, p_qa, p_doa, offs_da, qk_scale, softcap_scale, softcap_log2, slope2,
            p_bias, stride_bias_m, stride_bias_n, p_mask, stride_mask_m, stride_mask_n,
            win_left, win_right, seed, dropout_p,
            False, WIN_LEFT, WIN_RIGHT, SOFTCAP, HAS_ALIBI, HAS_BIAS, MASK_KIND, HAS_DROPOUT,
            HEAD_DIM, BLOCK_M, BLOCK_N, DOT_FP32, PRECISION, ATOMIC_DQ, D_SPLIT, DQ_TMA, None, GRADS,
            q_desc, do_desc, TMA)
        if WIN_LEFT:  # masked: the window's left edge
            dk, dv = _bwd_dkdv_inner(
                dk, dv, k, v, p_q, p_do, p_lse, p_delta, stride_qm, stride_dom, p_dqa, stride_dqam, start_n, offs_n,
                offs_mb, offs_d,
                tl.maximum(full_hi, full_lo), hi, Sq, Sk, p_qa, p_doa, offs_da,
                qk_scale, softcap_scale, softcap_log2, slope2,
                p_bias, stride_bias_m, stride_bias_n, p_mask, stride_mask_m, stride_mask_n,
                win_left, win_right, seed, dropout_p,
                True, WIN_LEFT, WIN_RIGHT, SOFTCAP, HAS_ALIBI, HAS_BIAS, MASK_KIND, HAS_DROPOUT,
                HEAD_DIM, BLOCK_M, BLOCK_N, DOT_FP32, PRECISION, ATOMIC_DQ, D_SPLIT, DQ_TMA, MASKED_STAGES, GRADS,
                q_desc, do_desc, TMA)

    out_mask = (offs_n[:, None] < Sk) & (offs_da[None, :] < HEAD_DIM)
    if GRADS & 2:
        dk = dk * sm_scale
        tl.store(DK + off_b * stride_dkb + off_hk * stride_dkh + rows_n * stride_dkn + offs_da[None, :] * stride_dkd,
                 dk.to(DK.dtype.element_ty), mask=out_mask)
    if GRADS & 1:
        tl.store(DV + off_b * stride_dvb + off_hk * stride_dvh + rows_n * stride_dvn + offs_da[None, :] * stride_dvd,
                 dv.to(DV.dtype.element_ty), mask=out_mask)


@triton.jit
def _bwd_dq_inner(
    dq, q, do, lse2, delta,
    p_k, p_v, stride_kn, stride_vn,
    offs_m, offs_nb, offs_d, lo, hi, Sq, Sk,
    qk_scale, softcap_scale, softcap_log2, slope2,
    p_bias, stride_bias_m, stride_bias_n, p_mask, stride_mask_m, stride_mask_n,
    win_left, win_right, seed, dropout_p,
    BOUNDS: tl.constexpr, WIN_LEFT: tl.constexpr, WIN_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_BIAS: tl.constexpr, MASK_KIND: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
    k_desc, v_desc, TMA: tl.constexpr,
):
    """Accumulate dQ of one query block over the key blocks [lo, hi). TMA: K / V tiles through the
    descriptors ``k_desc`` / ``v_desc`` (rows past Sk read as zeros)."""
    d_ok = offs_d < HEAD_DIM
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_nb
        kv_ok = d_ok[None, :]
        if BOUNDS:
            kv_ok = kv_ok & (offs_n[:, None] < Sk)
        k, v = load_row_pair(k_desc, v_desc, p_k, p_v, stride_kn, stride_vn, start_n, offs_n, kv_ok, TMA)
        qk = mma(q, tl.trans(k), None, DOT_FP32, PRECISION)
        s, t = scores_log2(qk, offs_m[:, None], offs_n[None, :], Sq, Sk, qk_scale, softcap_scale, softcap_log2,
                           slope2, p_bias, stride_bias_m, stride_bias_n, p_mask, stride_mask_m, stride_mask_n,
                           win_left, win_right, BOUNDS, WIN_LEFT, WIN_RIGHT, SOFTCAP, HAS_ALIBI, HAS_BIAS,
                           MASK_KIND, PRECISION)
        p = tl.math.exp2(s - lse2[:, None])
        dp = mma(do, tl.trans(v), None, DOT_FP32, PRECISION)
        keep = 0
        if HAS_DROPOUT:
            keep = dropout_keep(seed, offs_m, start_n, BLOCK_N, dropout_p, False)
        _, ds, _ = _grad_scores(p, dp, delta[:, None], t, keep, dropout_p, SOFTCAP, HAS_DROPOUT)
        dq = mma(ds.to(k.dtype), k, dq, DOT_FP32, PRECISION)
    return dq


@triton.jit
def _bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ,
    stride_qb, stride_qm, stride_qh, stride_qd,
    stride_kb, stride_kn, stride_kh, stride_kd,
    stride_vb, stride_vn, stride_vh, stride_vd,
    stride_dob, stride_dom, stride_doh, stride_dod,
    stride_dqb, stride_dqm, stride_dqh, stride_dqd,
    O, stride_ob, stride_om, stride_oh, stride_od,
    BIAS, stride_bias_b, stride_bias_h, stride_bias_m, stride_bias_n,
    MASK, stride_mask_b, stride_mask_h, stride_mask_m, stride_mask_n,
    ALIBI, stride_alibi_b, SEED, dropout_p,
    CU_Q, CU_K, stride_lse_b, stride_lse_h, LEN_LO, LEN_HI,
    Hq, GROUP, Sq, Sk, sm_scale, qk_scale, softcap_scale, softcap_log2, win_left, win_right,
    WIN_LEFT: tl.constexpr, WIN_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_BIAS: tl.constexpr, MASK_KIND: tl.constexpr, HAS_DROPOUT: tl.constexpr, IS_VARLEN: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, HEADS_FIRST: tl.constexpr, TMA: tl.constexpr,
):
    """dQ of one query block of one head. It also computes this block's delta = rowsum(dO * O) from
    O and stores it (the dK/dV kernel, launched after, reads it): no preprocess kernel. Each (query
    block, head) has exactly one program, so each delta is written once."""
    pid, n_pid, bh, _n_bh = program_order(HEADS_FIRST)
    pid_m = n_pid - 1 - pid if WIN_RIGHT else pid
    off_bh = bh.to(tl.int64)
    off_b = off_bh // Hq
    off_h = off_bh % Hq
    off_hk = off_h // GROUP

    start_m = pid_m * BLOCK_M
    q_start, Sq, k_start, Sk = seq_bounds(CU_Q, CU_K, off_b, Sq, Sk, IS_VARLEN, LEN_LO, LEN_HI)
    if IS_VARLEN:  # past this sequence's end, or another length class's sequence
        if start_m >= Sq:
            return
    Q += q_start * stride_qm
    DO += q_start * stride_dom
    DQ += q_start * stride_dqm
    K += k_start * stride_kn
    V += k_start * stride_vn
    LSE += off_b * stride_lse_b + off_h * stride_lse_h + q_start
    DELTA += off_b * stride_lse_b + off_h * stride_lse_h + q_start
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_nb = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < Sq
    qd_mask = m_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    rows_m = offs_m[:, None].to(tl.int64)
    q = tl.load(Q + off_b * stride_qb + off_h * stride_qh + rows_m * stride_qm + offs_d[None, :] * stride_qd,
                mask=qd_mask, other=0.0)
    do = tl.load(DO + off_b * stride_dob + off_h * stride_doh + rows_m * stride_dom + offs_d[None, :] * stride_dod,
                 mask=qd_mask, other=0.0)
    lse2 = _load_lse2(LSE, offs_m, m_ok)
    o = tl.load(O + q_start * stride_om + off_b * stride_ob + off_h * stride_oh + rows_m * stride_om
                + offs_d[None, :] * stride_od, mask=qd_mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + offs_m, delta, mask=m_ok)
    p_k = K + off_b * stride_kb + off_hk * stride_kh + offs_d[None, :] * stride_kd
    p_v = V + off_b * stride_vb + off_hk * stride_vh + offs_d[None, :] * stride_vd
    k_desc, v_desc = row_tiles(K + off_b * stride_kb + off_hk * stride_kh, V + off_b * stride_vb + off_hk * stride_vh,
                               stride_kn, stride_vn, Sk, p_k, p_v, HEAD_DIM, BLOCK_N, BLOCK_D, TMA)
    p_bias, p_mask, slope2, seed = head_setup(off_b, off_h, off_bh, BIAS, stride_bias_b, stride_bias_h,
                                              MASK, stride_mask_b, stride_mask_h, ALIBI, stride_alibi_b, SEED,
                                              HAS_BIAS, MASK_KIND, HAS_ALIBI, HAS_DROPOUT)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    lo, full_lo, full_hi, hi = key_range(start_m, Sq, Sk, win_left, win_right, BLOCK_M, BLOCK_N, WIN_LEFT, WIN_RIGHT)
    if WIN_LEFT:
        dq = _bwd_dq_inner(
            dq, q, do, lse2, delta, p_k, p_v, stride_kn, stride_vn, offs_m, offs_nb, offs_d,
            lo, tl.minimum(full_lo, hi), Sq, Sk, qk_scale, softcap_scale, softcap_log2, slope2,
            p_bias, stride_bias_m, stride_bias_n, p_mask, stride_mask_m, stride_mask_n,
            win_left, win_right, seed, dropout_p,
            True, WIN_LEFT, WIN_RIGHT, SOFTCAP, HAS_ALIBI, HAS_BIAS, MASK_KIND, HAS_DROPOUT,
            HEAD_DIM, BLOCK_N, DOT_FP32, PRECISION, k_desc, v_desc, TMA)
    dq = _bwd_dq_inner(
        dq, q, do, lse2, delta, p_k, p_v, stride_kn, stride_vn, offs_m, offs_nb, offs_d,
        full_lo, full_hi, Sq, Sk, qk_scale, softcap_scale, softcap_log2, slope2,
        p_bias, stride_bias_m, stride_bias_n, p_mask, stride_mask_m, stride_mask_n,
        win_left, win_right, seed, dropout_p,
        False, WIN_LEFT, WIN_RIGHT, SOFTCAP, HAS_ALIBI, HAS_BIAS, MASK_KIND, HAS_DROPOUT,
        HEAD_DIM, BLOCK_N, DOT_FP32, PRECISION, k_desc, v_desc, TMA)
    dq = _bwd_dq_inner(
        dq, q, do, lse2, delta, p_k, p_v, stride_kn, stride_vn, offs_m, offs_nb, offs_d,
        tl.maximum(full_hi, full_lo), hi, Sq, Sk, qk_scale, softcap_scale, softcap_log2, slope2,
        p_bias, stride_bias_m, stride_bias_n, p_mask, stride_mask_m, stride_mask_n,
        win_left, win_right, seed, dropout_p,
        True, WIN_LEFT, WIN_RIGHT, SOFTCAP, HAS_ALIBI, HAS_BIAS, MASK_KIND, HAS_DROPOUT,
        HEAD_DIM, BLOCK_N, DOT_FP32, PRECISION, k_desc, v_desc, TMA)
    dq = dq * sm_scale
    tl.store(DQ + off_b * stride_dqb + off_h * stride_dqh + rows_m * stride_dqm + offs_d[None, :] * stride_dqd,
             dq.to(DQ.dtype.element_ty), mask=qd_mask)


@triton.jit
def _tile_probs(
    Q, K, V, DO, LSE, DELTA, off_b, off_h, off_hk, offs_m, start_n, offs_n, offs_d,
    stride_qb, stride_qm, stride_qh, stride_qd,
    stride_kb, stride_kn, stride_kh, stride_kd,
    stride_vb, stride_vn, stride_vh, stride_vd,
    stride_dob, stride_dom, stride_doh, stride_dod,
    BIAS, stride_bias_b, stride_bias_h, stride_bias_m, stride_bias_n,
    MASK, stride_mask_b, stride_mask_h, stride_mask_m, stride_mask_n,
    ALIBI, stride_alibi_b, SEED, dropout_p,
    Hq, Sq, Sk, qk_scale, softcap_scale, softcap_log2, win_left, win_right,
    WIN_LEFT: tl.constexpr, WIN_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_BIAS: tl.constexpr, MASK_KIND: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, WITH_GRAD: tl.constexpr, DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """P (and, WITH_GRAD, dS) of one [BLOCK_M, BLOCK_N] tile of one (batch, head), recomputed
    from Q, K (V, dO) and the LSE. Returns (p, ds, keep)."""
    off_bh = off_b * Hq + off_h
    m_ok = offs_m < Sq
    d_ok = offs_d < HEAD_DIM
    q = tl.load(Q + off_b * stride_qb + off_h * stride_qh + offs_m[:, None].to(tl.int64) * stride_qm
                + offs_d[None, :] * stride_qd, mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    kv_ok = (offs_n[:, None] < Sk) & d_ok[None, :]
    k = tl.load(K + off_b * stride_kb + off_hk * stride_kh + offs_n[:, None].to(tl.int64) * stride_kn
                + offs_d[None, :] * stride_kd, mask=kv_ok, other=0.0)
    p_bias, p_mask, slope2, seed = head_setup(off_b, off_h, off_bh, BIAS, stride_bias_b, stride_bias_h,
                                              MASK, stride_mask_b, stride_mask_h, ALIBI, stride_alibi_b, SEED,
                                              HAS_BIAS, MASK_KIND, HAS_ALIBI, HAS_DROPOUT)
    qk = mma(q, tl.trans(k), None, DOT_FP32, PRECISION)
    s, t = scores_log2(qk, offs_m[:, None], offs_n[None, :], Sq, Sk, qk_scale, softcap_scale, softcap_log2,
                       slope2, p_bias, stride_bias_m, stride_bias_n, p_mask, stride_mask_m, stride_mask_n,
                       win_left, win_right, True, WIN_LEFT, WIN_RIGHT, SOFTCAP, HAS_ALIBI, HAS_BIAS, MASK_KIND,
                       PRECISION)
    lse2 = _load_lse2(LSE, offs_m, m_ok)
    p = tl.math.exp2(s - lse2[:, None])
    keep = p == p  # all True
    if HAS_DROPOUT:
        keep = dropout_keep(seed, offs_m, start_n, BLOCK_N, dropout_p, False)
    ds = p
    if WITH_GRAD:
        v = tl.load(V + off_b * stride_vb + off_hk * stride_vh + offs_n[:, None].to(tl.int64) * stride_vn
                    + offs_d[None, :] * stride_vd, mask=kv_ok, other=0.0)
        do = tl.load(DO + off_b * stride_dob + off_h * stride_doh + offs_m[:, None].to(tl.int64) * stride_dom
                     + offs_d[None, :] * stride_dod, mask=m_ok[:, None] & d_ok[None, :], other=0.0)
        delta = tl.load(DELTA + offs_m, mask=m_ok, other=0.0)
        dp = mma(do, tl.trans(v), None, DOT_FP32, PRECISION)
        ds, _, _ = _grad_scores(p, dp, delta[:, None], t, keep, dropout_p, SOFTCAP, HAS_DROPOUT)
    return p, ds, keep


@triton.jit
def _tile_kernel(
    Q, K, V, DO, LSE, DELTA, OUT,
    stride_qb, stride_qm, stride_qh, stride_qd,
    stride_kb, stride_kn, stride_kh, stride_kd,
    stride_vb, stride_vn, stride_vh, stride_vd,
    stride_dob, stride_dom, stride_doh, stride_dod,
    stride_ob, stride_oh, stride_om, stride_on,
    BIAS, stride_bias_b, stride_bias_h, stride_bias_m, stride_bias_n,
    MASK, stride_mask_b, stride_mask_h, stride_mask_m, stride_mask_n,
    ALIBI, stride_alibi_b, SEED, dropout_p,
    CU_Q, CU_K, stride_lse_b, stride_lse_h,
    Hq, GROUP, Sq, Sk, qk_scale, softcap_scale, softcap_log2, win_left, win_right,
    SUM_B, SUM_H, OUT_H,
    WIN_LEFT: tl.constexpr, WIN_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_BIAS: tl.constexpr, MASK_KIND: tl.constexpr, HAS_DROPOUT: tl.constexpr, IS_VARLEN: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    WITH_GRAD: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, O_FIRST: tl.constexpr,
):
    """Writes one [BLOCK_M, BLOCK_N] tile of an S x S result, for a program per (tile, out b, out h):

    - WITH_GRAD=False: the attention probabilities, negated where dropout dropped them
      (flash-attn's ``S_dmask`` convention), for ``return_attn_probs``;
    - WITH_GRAD=True: dBias = dS summed over the SUM_B x SUM_H (batch, head) pairs that a
      broadcast bias entry feeds, in a fixed order (deterministic, no atomics).

    Tiles outside the causal / window band (variable length: or past the sequence's end) are
    written as zeros without computing.
    """
    pid_n = tl.program_id(1)
    if O_FIRST:  # more (batch, head) outputs than a grid's z axis may hold: they go on x
        pid_m = tl.program_id(2)
        off_o = tl.program_id(0).to(tl.int64)
    else:
        pid_m = tl.program_id(0)
        off_o = tl.program_id(2).to(tl.int64)
    out_b = off_o // OUT_H
    out_h = off_o % OUT_H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    # dense: every summed (batch, head) pair has the same bounds, so the band test is made once, around
    # the loop (a test inside it keeps the compiler from pipelining the loop: 88 bytes of spills at
    # D=128 bf16 on sm_90); variable length: tile indices are local to each sequence and a broadcast
    # bias entry sums sequences of different lengths, so the test is made per summed batch row
    visible = True
    if not IS_VARLEN:
        visible = tile_visible(pid_m * BLOCK_M, pid_n * BLOCK_N, Sq, Sk, win_left, win_right, BLOCK_M, BLOCK_N,
                               WIN_LEFT, WIN_RIGHT)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if visible:
        for i in range(SUM_B * SUM_H):
            off_b = out_b * SUM_B + i // SUM_H
            off_h = out_h * SUM_H + i % SUM_H
            q_start, seq_q, k_start, seq_k = seq_bounds(CU_Q, CU_K, off_b, Sq, Sk, IS_VARLEN)
            visible_b = True
            if IS_VARLEN:
                visible_b = tile_visible(pid_m * BLOCK_M, pid_n * BLOCK_N, seq_q, seq_k, win_left, win_right,
                                         BLOCK_M, BLOCK_N, WIN_LEFT, WIN_RIGHT)
            if visible_b:
                lse_off = off_b * stride_lse_b + off_h * stride_lse_h + q_start
                p, ds, keep = _tile_probs(
                    Q + q_start * stride_qm, K + k_start * stride_kn, V + k_start * stride_vn,
                    DO + q_start * stride_dom, LSE + lse_off, DELTA + lse_off, off_b, off_h, off_h // GROUP,
                    offs_m, pid_n * BLOCK_N, offs_n, offs_d,
                    stride_qb, stride_qm, stride_qh, stride_qd, stride_kb, stride_kn, stride_kh, stride_kd,
                    stride_vb, stride_vn, stride_vh, stride_vd, stride_dob, stride_dom, stride_doh, stride_dod,
                    BIAS, stride_bias_b, stride_bias_h, stride_bias_m, stride_bias_n,
                    MASK, stride_mask_b, stride_mask_h, stride_mask_m, stride_mask_n,
                    ALIBI, stride_alibi_b, SEED, dropout_p,
                    Hq, seq_q, seq_k, qk_scale, softcap_scale, softcap_log2, win_left, win_right,
                    WIN_LEFT, WIN_RIGHT, SOFTCAP, HAS_ALIBI, HAS_BIAS, MASK_KIND, HAS_DROPOUT,
                    HEAD_DIM, BLOCK_N, WITH_GRAD, DOT_FP32, PRECISION)
                if WITH_GRAD:
                    acc += ds
                else:
                    acc += tl.where(keep, p, -p)
    # every entry of the (B_out, H_out, Sq, Sk) result is written (variable length: Sq / Sk are the
    # longest lengths; entries past a sequence's end are 0)
    mask = (offs_m[:, None] < Sq) & (offs_n[None, :] < Sk)
    tl.store(OUT + out_b * stride_ob + out_h * stride_oh + offs_m[:, None].to(tl.int64) * stride_om
             + offs_n[None, :].to(tl.int64) * stride_on, acc.to(OUT.dtype.element_ty), mask=mask)


def _dot_args(q):
    return dict(DOT_FP32=configs.dot_in_fp32(q.dtype), PRECISION=configs.dot_precision(q.dtype))


def _launch_tiles(q, k, v, do, lse, delta, out, var: Variants, sum_b: int, sum_h: int, with_grad: bool):
    """Fill ``out`` ((B_out, H_out, Sq, Sk), any strides) with probabilities or dBias tiles."""
    _, Sq, Sk, Hq, Hkv, D = var.dims(q, k)
    n_out = out.shape[0] * out.shape[1]
    flags = dict(**var.constexprs(), HEAD_DIM=D, BLOCK_D=configs.padded_head_dim(D), WITH_GRAD=with_grad,
                 **_dot_args(q), O_FIRST=n_out > configs.MAX_GRID_YZ)

    def run(cfg):
        m_blocks = cdiv(Sq, cfg.block_m)
        grid = (n_out, cdiv(Sk, cfg.block_n), m_blocks) if flags["O_FIRST"] else \
            (m_blocks, cdiv(Sk, cfg.block_n), n_out)
        launch(_tile_kernel, grid, (
            q, k, v, do, lse, delta, out,
            *var.bshd_strides(q), *var.bshd_strides(k), *var.bshd_strides(v), *var.bshd_strides(do), *out.stride(),
            *var.kernel_args(q), *var.seq_args(q, lse),
            Hq, Hq // Hkv, Sq, Sk, *var.scale_args(), *var.window_args(), sum_b, sum_h, out.shape[1],
        ), dict(
            **flags, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        ))

    configs.fit("tile", configs.tile_config(q), flags, q.dtype, run)


def attention_probs(q, k, v, lse, var: Variants):
    """(B, Hq, Sq, Sk) probabilities in q's dtype, negative where dropout dropped them (testing aid).
    Variable length: (B, Hq, max_seqlen_q, max_seqlen_k), zero past each sequence's end."""
    B, Sq, Sk, Hq, _, _ = var.dims(q, k)
    out = torch.empty((B, Hq, Sq, Sk), dtype=q.dtype, device=q.device)  # every entry is written
    if out.numel():
        _launch_tiles(q, k, v, q, lse, lse, out, var, 1, 1, with_grad=False)
    return out


# the backward's delta = rowsum(dO * O): written and read within one call's launches (see kernels/kept.py)
_deltas = kept.Kept()


def _first_store_ok(var: Variants, Sq: int, Sk: int, block_m: int) -> bool:
    """Whether the ordered fused dQ's first addition into every row block of its fp32 buffer may be a
    store (FIRST_STORE), so that the buffer needs no zero fill: key block 0's program, first in each
    block's order, must reach every query block of every head, and its stores must stay in their own
    rows. So a dense call with whole query blocks (neither the heads' rows nor a packed call's
    sequences are padded to a block: a partial last block's store would overwrite the next head's or
    sequence's first rows, to which the reductions only add zeros), no left window (key 0 then leaves
    the later queries' band) and, with a right edge (causal), query 0 seeing key 0."""
    return (not var.varlen and Sq % block_m == 0 and var.win_left is None
            and (var.win_right is None or Sk - Sq + var.win_right >= 0))


def attention_backward(do, q, k, v, out, lse, var: Variants, dq=None, dk=None, dv=None, bias_shape=None):
    """Launch the backward. Gradients are written into dq/dk/dv when given (views of a packed
    gradient, any strides), else into new tensors shaped like q/k/v. ``bias_shape`` (the shape of
    the user's bias, when it requires grad) asks for dBias as well. Layouts as attention_forward.

    Returns (dq, dk, dv, dbias) with dbias float32 in ``bias_shape`` (or None).
    """
    atomic_dq = atomic_dq_enabled() and not var.deterministic
    fused_mode = fused_dq_mode()  # the ordered fused dQ where configs.fused_dq_serves, or everywhere
    desc_3d = configs.env_flag("TRITONATTN_BWD_DESC_3D")  # (experiments: in the plan's key too)
    split_waits = configs.env_flag("TRITONATTN_BWD_SPLIT_WAITS", default=None)  # None: configs.BWD_SPLIT_WAITS
    section = configs.getenv("TRITONATTN_BWD_FUSED_SECTION")  # (bwd_sm90.section_order)
    kv_split_env = configs.getenv("TRITONATTN_BWD_KV_SPLIT")  # (configs.kv_split; N forces N, 1 off)
    first_store = configs.env_flag("TRITONATTN_BWD_DQ_FIRST_STORE")  # (the ordered fused dQ: _first_store_ok)
    inputs = (do, q, k, v, out, lse, dq, dk, dv, *var.tensors())
    # descriptors (fwd._tma_ok): everything they depend on is in the plan's key but the tensors'
    # 16-byte alignment, which the key gets as one bit, so a replay needs no _tma_ok (9 us on a 2-core
    # CPU); the allocator is set for a replay that may use them
    aligned = (TMA or GLUON) and (q.data_ptr() | k.data_ptr() | v.data_ptr() | do.data_ptr()) % 16 == 0
    if aligned:
        _need_allocator()
    key = link = None  # no plan for dBias or the atomic dQ path (torch ops between the launches)
    if bias_shape is None and not atomic_dq:
        # this module's switches and the alignment bit, in both keys below
        # (heads_first's other inputs are in the keys; MAX_GRID_YZ: see fwd.py)
        switches = (aligned, configs.HEADS_FIRST, TMA, GLUON, GLUON_VARLEN, configs.DKDV_MASKED_STAGES,
                    configs.BATCH_INVARIANT, fused_mode, SPLIT_DIAG_ROWS, desc_3d, split_waits, section, kv_split_env,
                    first_store)
        if var.fast_key is not None and dq is None and dk is None and dv is None:
            # a training call with an entry point's key (interface._fast_key's grad tags), which holds
            # the options, shapes and dtypes of the key below: the plan linked to it with the rest, the
            # strides of the saved tensors (a saved-tensor hook, e.g. activation offloading, may give
            # back copies of other strides than the forward's), dO's layout and the switches
            link = (var.fast_key, q.stride(), k.stride(), v.stride(), out.stride(), lse.stride(), do.shape,
                    do.stride(), switches)
            entry = plan.linked(link)
            if entry is not None:
                res = entry[0].run(inputs, q.device)
                if res is not None:
                    return (*res, None)
        key = ("bwd", do.shape, do.stride(), q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(),
               out.shape, out.stride(), lse.shape, lse.stride(), q.dtype, q.device, var.signature(), switches,
               *(None if g is None else (g.shape, g.stride()) for g in (dq, dk, dv)))
        res = plan.replay(key, inputs, q.device)
        if res is not None:  # the same signature as an earlier call (every training step): replayed
            if link is not None:
                plan.link(link, key)
            return (*res, None)
    b = plan.Builder(key, inputs)
    tma = TMA and aligned and _tma_ok(q, k, v, var, q, do)
    B, Sq, Sk, Hq, Hkv, D = var.dims(q, k)
    # variable length: rows of q / k / v that belong to no sequence get no program, so start from 0
    zeros = var.varlen and Sq > 0 and Sk > 0
    dq = b.alloc(torch.zeros if zeros else torch.empty, q.shape, q.dtype, q.device) if dq is None else b.zero(dq, zeros)
    dk = b.alloc(torch.zeros if zeros else torch.empty, k.shape, k.dtype, k.device) if dk is None else b.zero(dk, zeros)
    dv = b.alloc(torch.zeros if zeros else torch.empty, v.shape, v.dtype, v.device) if dv is None else b.zero(dv, zeros)
    if q.numel() == 0 or k.numel() == 0 or Sq == 0 or Sk == 0:  # no query or no key: every gradient is 0
        for grad in (dq, dk, dv):
            grad.zero_()
        dbias = None if bias_shape is None else torch.zeros(bias_shape, dtype=torch.float32, device=q.device)
        return dq, dk, dv, dbias

    block_d = configs.padded_head_dim(D)
    strides = (*var.bshd_strides(q), *var.bshd_strides(k), *var.bshd_strides(v), *var.bshd_strides(do))
    var_args = (*var.kernel_args(q), *var.seq_args(q, lse))
    flags = dict(var.constexprs(), HEAD_DIM=D, BLOCK_D=block_d, **_dot_args(q),
                 HEADS_FIRST=configs.heads_first(var.win_right is not None, k, B * Hq), TMA=tma)
    scales = (var.softmax_scale, *var.scale_args(), *var.window_args())

    sm90 = aligned and _on_sm90(q)

    def dq_route(longest: int):
        """The dQ tile of a dense call whose longest side is ``longest``."""
        return configs.backward_dq_config(q, var.causal, var.extra_smem, seqlen=longest)

    # the Gluon dK/dV launch's key blocks and programs (launch_gluon's grid; varlen: of the longest
    # sequence, the same for every length class of a call, so the route stays monotone in the length),
    # and its KV_SPLIT where it runs without the fused dQ (_kv_split: a dense batch's by its launch,
    # one sequence alone or packed ones by each sequence's own, so that a packed sequence gets its
    # dense call's bits; non-increasing in the length). (bwd_sm90 is None where Gluon does not import.)
    n_kb, dkdv_programs, sms, bn = 0, 0, 0, 1
    if sm90 and bwd_sm90 is not None:
        bn = bwd_sm90.block_n(D)
        n_kb = cdiv(Sk, bn)
        dkdv_programs = n_kb * B * Hkv
        sms = bwd_sm90.sm_count(q.device)

    def kv_split_of(longest: int) -> int:
        """The Gluon dK/dV kernel's KV_SPLIT for a dense call (or a length class) whose longest side is
        ``longest``, within the grid's y limit (a forced split, or a packed call of very many sequences)."""
        if not (sm90 and bwd_sm90 is not None):
            return 1
        split = _kv_split(kv_split_env, var.causal, Hq // Hkv, dkdv_programs, sms, 1 if var.varlen else B,
                          longest, Hkv, bn)
        while split > 1 and B * Hkv * split > configs.MAX_GRID_YZ:
            split //= 2
        return split

    def dkdv_route(longest: int):
        """What the dK/dV step of such a dense call takes: the Gluon kernel, or the Triton one's tile."""
        if sm90 and _gluon_ok(q, k, v, do, lse, dk, dv, var, True, longest=longest):
            if not bwd_sm90.fuses_dq(D):  # (the atomic path's dQ comes from the Triton dK/dV kernel there)
                if not atomic_dq:
                    split = kv_split_of(longest)
                    return GLUON_ROUTE if split == 1 else (GLUON_ROUTE, split)
            elif atomic_dq or fused_mode == "all" or (
                    fused_mode and configs.fused_dq_serves(D, var.win_right is not None, longest, Hq // Hkv,
                                                           dkdv_programs, sms)
                    # a launch that splits its kv heads takes the split kernels (configs.KV_SPLIT_OVER_FUSED)
                    and not (kv_split_of(longest) > 1 and configs.KV_SPLIT_OVER_FUSED)):
                return GLUON_FUSED_ROUTE
            else:
                split = kv_split_of(longest)
                return GLUON_ROUTE if split == 1 else (GLUON_ROUTE, split)
        return configs.backward_dkdv_config(q, var.causal, var.extra_smem, atomic_dq=atomic_dq, tma=tma,
                                            seqlen=longest)

    # packed calls: their length classes also break where a sequence's own KV_SPLIT changes
    breaks = configs.length_breaks()
    if var.varlen and sm90 and bwd_sm90 is not None and not atomic_dq:
        breaks |= configs.kv_split_breaks(var.causal, Hq // Hkv, Hkv, bn, sms)

    def classes(route):
        """Packed sequences: a launch per length class (launch.length_classes), each sequence bitwise what
        its own dense call gives; not on the atomic-dQ path (one dQ accumulator, and no such promise)."""
        return length_classes(route, max(Sq, Sk), breaks, packed=var.varlen and not atomic_dq)

    # delta shares lse's strides (the kernels index both with them); it lives within the call: kept
    # per stream (kernels/kept.py), no allocation
    delta = b.alloc(_deltas, lse.shape, torch.float32, lse.device) if lse.is_contiguous() else \
        b.unplanned(torch.empty_like(lse))
    dkdv_classes = classes(dkdv_route)
    # the classes whose Gluon dK/dV kernel computes dQ too (FUSED_DQ): the longest ones (the route is
    # monotone in the length), so the dQ kernel serves the sequences shorter than the first
    fused = [(lo, hi) for lo, hi, cfg in dkdv_classes if cfg == GLUON_FUSED_ROUTE]
    split_below = fused[0][0] if fused else LENGTH_CAP
    assert all(cfg == GLUON_FUSED_ROUTE for lo, _, cfg in dkdv_classes if lo >= split_below), dkdv_classes
    if atomic_dq or fused:  # delta for the kernels that have no dQ kernel to compute it on its way
        cu_q, _, stride_lb, stride_lh = var.seq_args(q, lse)
        pre = configs.preprocess_config(q)
        wide = configs.heads_first(False, k, B * Hq)  # only past the grid's y limit
        b.launch(_bwd_preprocess_kernel, program_grid(cdiv(Sq, pre.block_m), B * Hq, wide), (
            out, do, delta, *var.bshd_strides(out), *var.bshd_strides(do), cu_q, stride_lb, stride_lh, Hq, Sq,
        ), dict(
            IS_VARLEN=var.varlen, HEAD_DIM=D, BLOCK_D=block_d, BLOCK_M=pre.block_m, num_warps=pre.num_warps,
            HEADS_FIRST=wide,
        ))

    # the fp32 partials of the classes with KV_SPLIT (one pair, for the largest split: each class's
    # launches, its sum kernel's included, are done before the next class's on the stream)
    partials = []

    def launch_gluon(lo, hi, dqa=None, sem=None, split=1, first=False):
        """The Gluon dK/dV kernel on the length class [lo, hi); FUSED_DQ into ``dqa`` (with ``sem``:
        ordered; ``first``: key block 0 stores, FIRST_STORE), or with ``split`` > 1 (KV_SPLIT) into fp32
        partials, summed into dk / dv after."""
        block_m, stages = bwd_sm90.TILES[D]
        gk, gv = dk, dv
        if split > 1:
            # (B, Sk, Hkv x most, D), or packed (total_k, Hkv x most, D), for the call's largest split
            # (a class of a smaller split writes and sums its first Hkv x split heads; the tensors
            # themselves, not views of them, are the launches' arguments, so the plan keeps them)
            if not partials:
                most = max(_split_of(cfg) for _, _, cfg in dkdv_classes)
                partials.extend(b.alloc(torch.empty, (*k.shape[:-2], Hkv * most, D), torch.float32, q.device)
                                for _ in range(2))
            gk, gv = partials
        seqs = dict(cu_seqlens=(var.cu_seqlens_q, var.cu_seqlens_k), max_seqlens=(Sq, Sk),
                    lengths=(lo, hi)) if var.varlen else {}
        # the ordered fused dQ's programs in sections of kv heads, key blocks outer (section_order); without
        # it, a causal launch of a few waves (configs.dkdv_sections, off by default)
        if sem is not None:
            sec = bwd_sm90.section_order(section, n_kb, B * Hkv, q, Hq // Hkv, max(Sq, Sk), D)
        elif dqa is None:
            sec = configs.dkdv_sections(var.win_right is not None, n_kb, B * Hkv * split, sms)
        else:  # (the opt-in atomic dQ's fused launch: the 2-d grid)
            sec = 0
        b.launch(bwd_sm90._bwd_dkdv_ws_kernel, (n_kb * B * Hkv * split,) if sec else (n_kb, B * Hkv * split),
                 bwd_sm90.launch_args(q, k, v, do, lse, delta, gk, gv, var.window_args()[1], var.scale_args()[0],
                                      var.softmax_scale, dqa=dqa, sem=sem, kv_split=split, **seqs),
                 dict(CAUSAL=var.win_right is not None, HEAD_DIM=D, BLOCK_M=block_m, STAGES=stages,
                      num_warps=bwd_sm90.NUM_WARPS, maxnreg=bwd_sm90.MAXNREG, IS_VARLEN=var.varlen,
                      FUSED_DQ=dqa is not None, DETERMINISTIC=sem is not None,
                      SPLIT_DIAG=block_m >= SPLIT_DIAG_ROWS,
                      DESC_3D=desc_3d,
                      SPLIT_WAITS=(D in configs.BWD_SPLIT_WAITS and dqa is None) if split_waits is None
                      else split_waits, SECTION=sec, **({"KV_SPLIT": split} if split > 1 else {}),
                      **({"FIRST_STORE": True} if first else {})))
        if split > 1:
            _launch_kv_sum(gk, gv, dk, dv, split, var, (lo, hi), b.launch)

    dqa = None
    if fused:
        # the fused classes first. Their fp32 dQ buffer has heads before rows (the TMA reductions
        # address it as one matrix of rows) and gets dQ scaled; with the semaphores that order the
        # additions unless the call opted into atomics. Its conversion into dq writes the other classes'
        # rows as zeros, which the dQ kernel (after) overwrites with theirs
        # (TRITONATTN_BWD_DQ_FIRST_STORE, off by default: the ordered additions' first one a store, and the
        # buffer unwritten where that first one reaches every row, _first_store_ok)
        first = first_store and not atomic_dq and _first_store_ok(var, Sq, Sk, bwd_sm90.TILES[D][0])
        dqa = b.alloc(torch.empty if first else torch.zeros, (Hq, q.shape[0], D) if var.varlen else (B, Hq, Sq, D),
                      torch.float32, q.device)
        cu = (var.cu_seqlens_q, var.cu_seqlens_k) if var.varlen else None
        sem = None if atomic_dq else b.alloc(torch.zeros, (bwd_sm90.sem_blocks(q, cu),), torch.int32, q.device)
        for lo, hi in fused:
            launch_gluon(lo, hi, dqa, sem, first=first)
        _convert_dq(dqa, dq, var, b.launch)
    if not atomic_dq and split_below > 0:
        # dQ before dK / dV (its programs compute delta, rowsum(dO * O), for the dK/dV kernels)
        dq_classes = [(lo, min(hi, split_below), cfg) for lo, hi, cfg in classes(dq_route) if lo < split_below]
        _launch_dq(q, k, v, do, lse, delta, dq, out, var, strides, var_args, scales, flags, b.launch, dq_classes)

    # the atomic path's fp32 dQ for the Triton dK/dV kernel, q-shaped, zeroed (rows of no sequence stay 0)
    if atomic_dq and not fused:
        dqa = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dq_tma = atomic_dq and _dq_tma_ok(q)
    if dq_tma:
        _need_allocator()
    dkdv_flags = dict(flags, ATOMIC_DQ=atomic_dq, **({"DQ_TMA": dq_tma} if atomic_dq else {}))

    for lo, hi, cfg in dkdv_classes:
        if cfg == GLUON_FUSED_ROUTE:
            continue
        if _split_of(cfg):
            launch_gluon(lo, hi, split=_split_of(cfg))
            continue
        sk = min(Sk, hi - 1)  # a class's sequences are shorter than hi: its grid covers no more keys

        def run_dkdv(cfg, lo=lo, hi=hi, sk=sk):
            if atomic_dq:
                dqa.zero_()  # a rerun (autotuning) must not add dQ twice (the atomic path has one class)
            # the atomic dQ path adds dS K over all of D once; a split keeps >= 16 columns (the MMA's minimum)
            split_grads = cfg.split_grads and not atomic_dq  # (the atomic path's dQ needs dS: one launch)
            d_split = 1 if atomic_dq or split_grads else max(1, min(cfg.d_split, block_d // 16))
            blocks = cdiv(sk, cfg.block_n) * d_split
            with b.all_or_none():  # split: dV, then dK, each over all of D (configs.fit may retry both)
                for grads in ((1, 2) if split_grads else (3,)):
                    b.launch(_bwd_dkdv_kernel, program_grid(blocks, B * Hkv, flags["HEADS_FIRST"]), (
                        q, k, v, do, lse, delta, dk, dv, *strides, *var.bshd_strides(dk), *var.bshd_strides(dv),
                        *((dqa, *var.bshd_strides(dqa)) if atomic_dq else (q, 0, 0, 0, 0)), *var_args, lo, hi,
                        Hq, Hkv, Hq // Hkv, Sq, Sk, *scales,
                    ), dict(
                        **flags, ATOMIC_DQ=atomic_dq, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                        num_warps=cfg.num_warps, num_stages=cfg.num_stages, D_SPLIT=d_split,
                        BLOCK_DA=block_d // d_split, DQ_TMA=dq_tma, MASKED_STAGES=configs.DKDV_MASKED_STAGES,
                        GRADS=grads,
                    ))

        autotune.launch_tuned("bwd_dkdv", q, var.causal, min(Sq, hi - 1), sk, dkdv_flags, cfg, run_dkdv)

    if atomic_dq and not fused:
        dq.copy_(dqa.mul_(var.softmax_scale))
    if key is not None:
        res = b.finish((dq, dk, dv))
        if link is not None:  # (once recorded: plan.link links only a kept plan)
            plan.link(link, key)
        return (*res, None)

    dbias = None
    if bias_shape is not None:
        dbias = _bias_grad(q, k, v, do, lse, delta, var, bias_shape)
    return dq, dk, dv, dbias


# Q / dO (dK/dV kernel) and K / V (dQ kernel) through tensor descriptors (TMA) where the layout
# allows it (fwd._tma_ok on q, k, v and do: sm_90 or the interpreter, 16-bit, power-of-two head dim,
# 16-byte aligned strides); elsewhere the pointer path. On by default since 2026-11-30 (sixth
# session): the whole llama backward at S=8192 ran +8.4% (full) and +8.5% (causal, table tiles;
# +17% with the causal dK/dV tile retuned) on the H200, benchmarks/NOTES.md. TRITONATTN_BWD_TMA=0
# turns it off; read once here (tests and scripts/tune.py set the module switch).
TMA = configs.env_flag("TRITONATTN_BWD_TMA", default=True)


# The Gluon sm_90 dK/dV kernel (kernels/bwd_sm90.py) for the calls _gluon_ok admits: on by default
# with the Triton it was written and measured with (3.6; Gluon's API is experimental);
# TRITONATTN_BWD_GLUON=0 turns it off, =1 turns it on with other Triton versions.
GLUON = bwd_sm90 is not None and configs.env_flag("TRITONATTN_BWD_GLUON",
                                                  default=triton.__version__.startswith("3.6."))
# Variable-length calls through the Gluon dK/dV kernel too (its IS_VARLEN path: per-sequence
# descriptors from cu_seqlens, programs past a sequence's keys exit): the whole varlen backward
# 1.09-1.32x with it on the H200 (thirteenth session, 16k tokens from S=2048, equal and ragged
# lengths). On wherever the Gluon dK/dV kernel is; TRITONATTN_BWD_GLUON_VARLEN=0 turns it off.
GLUON_VARLEN = configs.env_flag("TRITONATTN_BWD_GLUON_VARLEN", default=True)
# The Gluon dK/dV kernel runs its causal steps in two loops, the blocks that cross the diagonal
# (masked) and the others (no mask, no test), instead of one loop testing each block
# (bwd_sm90._accumulate SPLIT_DIAG), for tiles of at least this many query rows (D=64's 128):
# spills of its causal kernel 312 -> 0 bytes, and 1.08-1.22x the Triton dK/dV kernel at
# S=1024-16384 where one loop was 0.48-0.55x (H200, nineteenth session, benchmarks/NOTES.md). At
# D=128 (64 rows) it removes no spill (32 -> 32 bytes), so one loop stays there.
SPLIT_DIAG_ROWS = 128


def _kv_split(env: str | None, causal: bool, group: int, programs: int, sms: int, batch: int = 2,
              longest: int = 0, kv_heads: int = 1, block_n: int = 128) -> int:
    """The Gluon dK/dV kernel's KV_SPLIT without the fused dQ: for a dense call of ``batch`` >= 2
    sequences whose launch has ``programs`` programs, configs.kv_split; for one sequence alone
    (``batch`` 1, and each length class of a packed call, which the launcher passes as 1), the
    sequence's own (configs.kv_split_alone of its ``longest`` side, ``kv_heads``, ``block_n`` keys
    per program), so that a packed sequence gets its dense call's bits; or TRITONATTN_BWD_KV_SPLIT=N
    for any (the largest power of two up to N that divides the group; 1 or 0 / off turns it off;
    empty: unset)."""
    if env is None or env.strip() == "":
        if batch >= 2:
            return configs.kv_split(causal, group, programs, sms)
        return configs.kv_split_alone(causal, group, longest, kv_heads, block_n, sms)
    if env.strip().lower() in ("0", "off", "false", "no"):
        return 1
    try:
        n = int(env)
    except ValueError:
        raise ValueError(f"TRITONATTN_BWD_KV_SPLIT={env!r}: expected a positive integer (or 0 / off)") from None
    if n < 1:
        raise ValueError(f"TRITONATTN_BWD_KV_SPLIT={env!r}: expected a positive integer (or 0 / off)")
    split = 1
    while 2 * split <= n and group % (2 * split) == 0:
        split *= 2
    return split


def _split_of(route) -> int:
    """The KV_SPLIT of a dK/dV route of attention_backward's: > 0 for the Gluon kernel without the fused
    dQ (GLUON_ROUTE: 1; (GLUON_ROUTE, n): n), 0 for the others."""
    if route == GLUON_ROUTE:
        return 1
    if type(route) is tuple and route[0] == GLUON_ROUTE:
        return route[1]
    return 0


def _launch_kv_sum(gk, gv, dk, dv, split: int, var: Variants, lengths: tuple[int, int], launch_fn) -> None:
    """dk / dv from the fp32 partials ``gk`` / ``gv`` of the Gluon dK/dV kernel with KV_SPLIT ``split``
    (_bwd_kv_sum_kernel); packed: the sequences of the length class ``lengths`` only (the other
    classes' rows of the partials hold nothing of theirs)."""
    D = dk.shape[-1]
    block_d = configs.padded_head_dim(D)
    rows = max(16, 4096 // block_d)  # (two fp32 tiles of 4096 elements: 64 registers a thread)
    if var.varlen:
        hkv, sk, n_seq = dk.shape[1], var.max_seqlen_k, var.cu_seqlens_k.shape[0] - 1
        grid = (cdiv(sk, rows), n_seq * hkv)
        seqs = (var.cu_seqlens_q, var.cu_seqlens_k, *lengths)
        strides = (0, *gk.stride()[:2], 0, *dk.stride(), 0, *dv.stride())
    else:
        hkv, sk = dk.shape[2], dk.shape[1]
        grid = (cdiv(sk, rows), dk.shape[0] * hkv)
        seqs = (gk, gk, 0, LENGTH_CAP)
        strides = (*gk.stride()[:3], *dk.stride(), *dv.stride())
    launch_fn(_bwd_kv_sum_kernel, grid, (gk, gv, dk, dv, *seqs, *strides, hkv, sk),
              dict(SPLIT=split, HEAD_DIM=D, BLOCK_D=block_d, BLOCK_N=rows, IS_VARLEN=var.varlen, num_warps=4))


def _gluon_ok(q, k, v, do, lse, dk, dv, var: Variants, sm90: bool, longest: int | None = None) -> bool:
    """The Gluon dK/dV kernel serves the call (``sm90``: q is on an NVIDIA sm_90 GPU): the rule it
    shares with the Gluon forward (fwd.gluon_serves, dO readable through descriptors too), plus the
    layouts its plain loads and stores take: lse (and delta, which shares its strides) with unit
    stride along the queries, dK / dV with unit stride along the head dim. Measured on the H200
    (benchmarks/NOTES.md, eleventh session): 1.06-1.24x the Triton dK/dV kernel at S=512-16384 with
    enough programs (configs.GLUON_MIN_SEQLEN)."""
    return (GLUON and gluon_serves(q, k, v, var, sm90, "bwd_dkdv", bwd_sm90.TILES, do, varlen=GLUON_VARLEN,
                                      longest=longest)
            and lse.stride(-1) == 1 and dk.stride(-1) == 1 and dv.stride(-1) == 1)


def fused_dq_mode() -> str | None:
    """TRITONATTN_BWD_FUSED_DQ: where the Gluon dK/dV kernel serves every length class of the call
    it may compute dQ too (FUSED_DQ: 5 matrix products per tile, not the split's 7), its tiles
    added to an fp32 buffer by TMA reductions in a fixed order (DETERMINISTIC: semaphores), so
    reruns stay bitwise equal. Unset or on ("1"): from the lengths of
    configs.FUSED_DQ_MIN_SEQLEN ("table"); "all": at every length, masked or not (for
    measurements); off ("0"): never (None)."""
    value = configs.getenv("TRITONATTN_BWD_FUSED_DQ")
    if value is not None and value.strip().lower() == "all":
        return "all"
    return "table" if configs.env_flag("TRITONATTN_BWD_FUSED_DQ", default=FUSED_DQ) else None


# the default of TRITONATTN_BWD_FUSED_DQ (measured in benchmarks/NOTES.md, sixteenth to eighteenth sessions)
FUSED_DQ = True
GLUON_FUSED_ROUTE = "gluon-fused"  # a length class whose Gluon dK/dV kernel computes dQ too


def atomic_dq_enabled() -> bool:
    """TRITONATTN_ATOMIC_DQ=1: the opt-in, non-deterministic backward (dQ accumulated with atomics
    by the dK/dV kernel; no dQ kernel). Calls with ``deterministic=True`` keep the default path."""
    return configs.env_flag("TRITONATTN_ATOMIC_DQ")


def _dq_tma_ok(q) -> bool:
    """The atomic path adds each dQ tile with one TMA reduction (``cp.reduce.async.bulk``, as
    FlashAttention-3 does) instead of an atomic per element: on an sm_90 GPU (the interpreter has
    no descriptor reductions), unless TRITONATTN_ATOMIC_DQ_TMA=0. The fp32 buffer is q-shaped and
    contiguous: rows and heads start 16-byte aligned when the head dim is a multiple of 4."""
    return (q.is_cuda and not configs.interpreting() and _hopper(q.device.index) and q.shape[-1] % 4 == 0
            and configs.env_flag("TRITONATTN_ATOMIC_DQ_TMA", default=True))


def _launch_dq(q, k, v, do, lse, delta, dq, out, var: Variants, strides, var_args, scales, flags, launch_fn,
               classes):
    """The dQ kernel, a launch per length class ``(lo, hi, tile)`` (see attention_backward); it also
    writes ``delta`` (rowsum(dO * O)), which the dK/dV kernel reads."""
    B, Sq, Sk, Hq, Hkv, D = var.dims(q, k)
    for lo, hi, cfg in classes:
        sq = min(Sq, hi - 1)  # a class's sequences are shorter than hi: its grid covers no more rows

        def run(cfg, lo=lo, hi=hi, sq=sq):
            launch_fn(_bwd_dq_kernel, program_grid(cdiv(sq, cfg.block_m), B * Hq, flags["HEADS_FIRST"]), (
                q, k, v, do, lse, delta, dq, *strides, *var.bshd_strides(dq), out, *var.bshd_strides(out), *var_args,
                lo, hi, Hq, Hq // Hkv, Sq, Sk, *scales,
            ), dict(
                **flags, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps,
                num_stages=cfg.num_stages,
            ))

        autotune.launch_tuned("bwd_dq", q, var.causal, sq, min(Sk, hi - 1), flags, cfg, run)


def _bias_grad(q, k, v, do, lse, delta, var: Variants, bias_shape):
    """dBias in the bias's own (broadcast) shape: a kernel sums dS over broadcast batch / head
    dims into (Bb, Hb, Sq, Sk); broadcast query / key dims are then summed by torch."""
    B, Sq, Sk, Hq, _, _ = var.dims(q, k)
    shape4 = (1,) * (4 - len(bias_shape)) + tuple(bias_shape)
    Bb, Hb = shape4[0], shape4[1]
    buf = torch.empty((Bb, Hb, Sq, Sk), dtype=torch.float32, device=q.device)
    _launch_tiles(q, k, v, do, lse, delta, buf, var, B // Bb, Hq // Hb, with_grad=True)
    dims = [i for i in (2, 3) if shape4[i] == 1]
    if dims:
        buf = buf.sum(dim=dims, keepdim=True)
    return buf.reshape(bias_shape)
