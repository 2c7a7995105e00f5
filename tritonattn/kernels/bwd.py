"""FlashAttention-2 backward: delta preprocess, a dK/dV kernel and a dQ kernel.

No atomics: each program owns the rows of the gradient it writes, so reruns are bitwise equal.
The dK/dV program of a kv head walks the query heads of its GQA group itself, so dK/dV sum over
the group without an expanded K/V or a reduction pass.
"""

import torch
import triton
import triton.language as tl

from tritonattn import configs
from tritonattn.kernels.common import LOG2E, key_range, mma, query_range, score_mask


@triton.jit
def _load_lse2(p_lse, offs_m, m_ok):
    """LSE of the rows in the exp2 domain; +inf for rows past Sq or with no visible key, so that
    their probabilities exp2(s - lse2) are exactly 0."""
    lse = tl.load(p_lse + offs_m, mask=m_ok, other=float("inf"))
    return tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)


@triton.jit
def _bwd_preprocess_kernel(
    O, DO, DELTA,
    stride_ob, stride_om, stride_oh, stride_od,
    stride_dob, stride_dom, stride_doh, stride_dod,
    Hq, Sq,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """delta = rowsum(dO * O), float32 (B, Hq, Sq)."""
    off_bh = tl.program_id(1).to(tl.int64)
    off_b = off_bh // Hq
    off_h = off_bh % Hq
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m[:, None] < Sq) & (offs_d[None, :] < HEAD_DIM)
    rows = offs_m[:, None].to(tl.int64)
    o = tl.load(O + off_b * stride_ob + off_h * stride_oh + rows * stride_om + offs_d[None, :] * stride_od,
                mask=mask, other=0.0)
    do = tl.load(DO + off_b * stride_dob + off_h * stride_doh + rows * stride_dom + offs_d[None, :] * stride_dod,
                 mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + off_bh * Sq + offs_m, delta, mask=offs_m < Sq)


@triton.jit
def _bwd_dkdv_inner(
    dk, dv, k, v,
    p_q, p_do, p_lse, p_delta, stride_qm, stride_dom,
    offs_n, offs_mb, offs_d, lo, hi, Sq, Sk, qk_scale,
    MASK: tl.constexpr, IS_CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
):
    """Accumulate dK, dV of one key block over the query blocks [lo, hi) of one query head.

    Works on transposed scores (keys x queries) so that dV = P^T dO and dK = dS^T Q need no
    transpose of P. Keys past Sk are not masked outside the diagonal stage: their columns only
    feed their own dK/dV rows, which are never stored.
    """
    d_ok = offs_d < HEAD_DIM
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + offs_mb
        m_ok = offs_m < Sq
        qd_ok = m_ok[:, None] & d_ok[None, :]
        q = tl.load(p_q + offs_m[:, None].to(tl.int64) * stride_qm, mask=qd_ok, other=0.0)
        do = tl.load(p_do + offs_m[:, None].to(tl.int64) * stride_dom, mask=qd_ok, other=0.0)
        lse2 = _load_lse2(p_lse, offs_m, m_ok)
        delta = tl.load(p_delta + offs_m, mask=m_ok, other=0.0)
        s_t = mma(k, tl.trans(q), None, DOT_FP32, PRECISION) * qk_scale
        p_t = tl.math.exp2(s_t - lse2[None, :])
        if MASK:
            p_t = tl.where(score_mask(offs_m, offs_n, Sq, Sk, IS_CAUSAL, True), p_t, 0.0)
        dv = mma(p_t.to(do.dtype), do, dv, DOT_FP32, PRECISION)
        dp_t = mma(v, tl.trans(do), None, DOT_FP32, PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        dk = mma(ds_t.to(q.dtype), q, dk, DOT_FP32, PRECISION)
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
    Hq, Hkv, GROUP, Sq, Sk, sm_scale, qk_scale,
    IS_CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_n = tl.program_id(0)
    off_bhk = tl.program_id(1).to(tl.int64)
    off_b = off_bhk // Hkv
    off_hk = off_bhk % Hkv

    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_mb = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    kv_mask = (offs_n[:, None] < Sk) & (offs_d[None, :] < HEAD_DIM)
    rows_n = offs_n[:, None].to(tl.int64)
    k = tl.load(K + off_b * stride_kb + off_hk * stride_kh + rows_n * stride_kn + offs_d[None, :] * stride_kd,
                mask=kv_mask, other=0.0)
    v = tl.load(V + off_b * stride_vb + off_hk * stride_vh + rows_n * stride_vn + offs_d[None, :] * stride_vd,
                mask=kv_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)

    lo, full_lo = query_range(start_n, Sq, Sk, BLOCK_M, BLOCK_N, IS_CAUSAL)
    diag_hi = tl.minimum(full_lo, Sq)
    for g in range(GROUP):
        off_h = off_hk * GROUP + g
        p_q = Q + off_b * stride_qb + off_h * stride_qh + offs_d[None, :] * stride_qd
        p_do = DO + off_b * stride_dob + off_h * stride_doh + offs_d[None, :] * stride_dod
        p_lse = LSE + (off_b * Hq + off_h) * Sq
        p_delta = DELTA + (off_b * Hq + off_h) * Sq
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, p_q, p_do, p_lse, p_delta, stride_qm, stride_dom,
                                 offs_n, offs_mb, offs_d, lo, diag_hi, Sq, Sk, qk_scale,
                                 True, IS_CAUSAL, HEAD_DIM, BLOCK_M, DOT_FP32, PRECISION)
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, p_q, p_do, p_lse, p_delta, stride_qm, stride_dom,
                                 offs_n, offs_mb, offs_d, full_lo, Sq, Sq, Sk, qk_scale,
                                 False, IS_CAUSAL, HEAD_DIM, BLOCK_M, DOT_FP32, PRECISION)

    dk = dk * sm_scale
    tl.store(DK + off_b * stride_dkb + off_hk * stride_dkh + rows_n * stride_dkn + offs_d[None, :] * stride_dkd,
             dk.to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + off_b * stride_dvb + off_hk * stride_dvh + rows_n * stride_dvn + offs_d[None, :] * stride_dvd,
             dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _bwd_dq_inner(
    dq, q, do, lse2, delta,
    p_k, p_v, stride_kn, stride_vn,
    offs_m, offs_nb, offs_d, lo, hi, Sq, Sk, qk_scale,
    MASK: tl.constexpr, IS_CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
):
    """Accumulate dQ of one query block over the key blocks [lo, hi)."""
    d_ok = offs_d < HEAD_DIM
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_nb
        kv_ok = d_ok[None, :]
        if MASK:
            kv_ok = kv_ok & (offs_n[:, None] < Sk)
        k = tl.load(p_k + offs_n[:, None].to(tl.int64) * stride_kn, mask=kv_ok, other=0.0)
        v = tl.load(p_v + offs_n[:, None].to(tl.int64) * stride_vn, mask=kv_ok, other=0.0)
        s = mma(q, tl.trans(k), None, DOT_FP32, PRECISION) * qk_scale
        p = tl.math.exp2(s - lse2[:, None])
        if MASK:
            p = tl.where(score_mask(offs_m, offs_n, Sq, Sk, IS_CAUSAL), p, 0.0)
        dp = mma(do, tl.trans(v), None, DOT_FP32, PRECISION)
        ds = p * (dp - delta[:, None])
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
    Hq, GROUP, Sq, Sk, sm_scale, qk_scale,
    IS_CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0) if IS_CAUSAL else tl.program_id(0)
    off_bh = tl.program_id(1).to(tl.int64)
    off_b = off_bh // Hq
    off_h = off_bh % Hq
    off_hk = off_h // GROUP

    start_m = pid_m * BLOCK_M
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
    lse2 = _load_lse2(LSE + off_bh * Sq, offs_m, m_ok)
    delta = tl.load(DELTA + off_bh * Sq + offs_m, mask=m_ok, other=0.0)
    p_k = K + off_b * stride_kb + off_hk * stride_kh + offs_d[None, :] * stride_kd
    p_v = V + off_b * stride_vb + off_hk * stride_vh + offs_d[None, :] * stride_vd
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    full_hi, hi = key_range(start_m, Sq, Sk, BLOCK_M, BLOCK_N, IS_CAUSAL)
    dq = _bwd_dq_inner(dq, q, do, lse2, delta, p_k, p_v, stride_kn, stride_vn,
                       offs_m, offs_nb, offs_d, 0, full_hi, Sq, Sk, qk_scale,
                       False, IS_CAUSAL, HEAD_DIM, BLOCK_N, DOT_FP32, PRECISION)
    dq = _bwd_dq_inner(dq, q, do, lse2, delta, p_k, p_v, stride_kn, stride_vn,
                       offs_m, offs_nb, offs_d, full_hi, hi, Sq, Sk, qk_scale,
                       True, IS_CAUSAL, HEAD_DIM, BLOCK_N, DOT_FP32, PRECISION)
    dq = dq * sm_scale
    tl.store(DQ + off_b * stride_dqb + off_h * stride_dqh + rows_m * stride_dqm + offs_d[None, :] * stride_dqd,
             dq.to(DQ.dtype.element_ty), mask=qd_mask)


def attention_backward(do, q, k, v, out, lse, softmax_scale: float, causal: bool, dq=None, dk=None, dv=None):
    """Launch the backward. Gradients are written into dq/dk/dv when given (views of a packed
    gradient, any strides), else into new tensors shaped like q/k/v. Returns (dq, dk, dv)."""
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device) if dq is None else dq
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device) if dk is None else dk
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device) if dv is None else dv
    if q.numel() == 0 or k.numel() == 0:  # no query or no key: every gradient is 0
        for grad in (dq, dk, dv):
            grad.zero_()
        return dq, dk, dv

    block_d = configs.padded_head_dim(D)
    dot = dict(DOT_FP32=configs.dot_in_fp32(q.dtype), PRECISION=configs.dot_precision(q.dtype))
    strides = (*q.stride(), *k.stride(), *v.stride(), *do.stride())

    delta = torch.empty((B, Hq, Sq), dtype=torch.float32, device=q.device)
    pre = configs.preprocess_config(q)
    _bwd_preprocess_kernel[(triton.cdiv(Sq, pre.block_m), B * Hq)](
        out, do, delta, *out.stride(), *do.stride(), Hq, Sq,
        HEAD_DIM=D, BLOCK_D=block_d, BLOCK_M=pre.block_m, num_warps=pre.num_warps,
    )

    cfg = configs.backward_dkdv_config(q, causal)
    _bwd_dkdv_kernel[(triton.cdiv(Sk, cfg.block_n), B * Hkv)](
        q, k, v, do, lse, delta, dk, dv, *strides, *dk.stride(), *dv.stride(),
        Hq, Hkv, Hq // Hkv, Sq, Sk, softmax_scale, softmax_scale * LOG2E.value,
        IS_CAUSAL=causal, HEAD_DIM=D, BLOCK_D=block_d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        **dot, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )

    cfg = configs.backward_dq_config(q, causal)
    _bwd_dq_kernel[(triton.cdiv(Sq, cfg.block_m), B * Hq)](
        q, k, v, do, lse, delta, dq, *strides, *dq.stride(),
        Hq, Hq // Hkv, Sq, Sk, softmax_scale, softmax_scale * LOG2E.value,
        IS_CAUSAL=causal, HEAD_DIM=D, BLOCK_D=block_d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        **dot, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return dq, dk, dv
