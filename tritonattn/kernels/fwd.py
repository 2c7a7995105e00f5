"""FlashAttention-2 forward: online softmax in the exp2 domain, writes O and the LSE."""

import functools

import torch
import triton
import triton.language as tl
from triton.runtime import _allocation

from tritonattn import autotune, configs
from tritonattn.kernels import kept, plan
from tritonattn.kernels.common import (
    LN2,
    dropout_keep,
    head_setup,
    in_bounds,
    key_range,
    mma,
    program_order,
    row_tiles,
    scores_log2,
    seq_bounds,
)
from tritonattn.kernels.launch import cdiv, length_classes, program_grid
from tritonattn.kernels.variants import Variants

try:  # Gluon ships with Triton, as an experimental API
    from tritonattn.kernels import fwd_sm90
except Exception:  # noqa: BLE001 (a Triton without Gluon, or with another Gluon API: the Triton kernel serves all)
    fwd_sm90 = None


@triton.jit
def _kv_rows(cur_n, k_start, p_bt, page_size, stride_page, stride_row, Sk, PAGED: tl.constexpr):
    """Element offsets (int64) of key / value rows ``cur_n`` of the sequence.

    Contiguous caches: the sequence start is already in the base pointer. Paged caches
    (``(num_blocks, page_size, H, D)`` with a block table): row ``k_start + n`` of the sequence lives
    in page ``block_table[(k_start + n) // page_size]`` at ``(k_start + n) % page_size``."""
    if PAGED:
        rows = cur_n + k_start
        page = tl.load(p_bt + rows // page_size, mask=cur_n < Sk, other=0).to(tl.int64)
        return page * stride_page + (rows % page_size).to(tl.int64) * stride_row
    return cur_n.to(tl.int64) * stride_row


@triton.jit
def _fwd_inner(
    acc, l_i, m_i, q,
    p_k, p_v, stride_kn, stride_vn, p_bt, page_size, stride_kpage, stride_vpage, k_start, k_desc, v_desc,
    offs_m, offs_n, offs_d, lo, hi, Sq, Sk,
    qk_scale, softcap_scale, softcap_log2, slope2,
    p_bias, stride_bias_m, stride_bias_n, p_mask, stride_mask_m, stride_mask_n,
    win_left, win_right, seed, dropout_p,
    BOUNDS: tl.constexpr, WIN_LEFT: tl.constexpr, WIN_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_BIAS: tl.constexpr, MASK_KIND: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, PAGED: tl.constexpr, SCALE_POS: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
    TMA: tl.constexpr, WS: tl.constexpr,
):
    """One stage of key blocks [lo, hi). BOUNDS=False for blocks every row sees in full.

    TMA: K / V tiles come through tensor descriptors (``k_desc`` / ``v_desc``, rows past Sk read as
    zeros); WS: the unmasked stage's loop is warp-specialized (Triton's producer / consumer warps)."""
    PLAIN: tl.constexpr = SCALE_POS and not (SOFTCAP or HAS_ALIBI or HAS_BIAS or MASK_KIND != 0)
    WS_LOOP: tl.constexpr = WS and not BOUNDS
    d_ok = offs_d < HEAD_DIM
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WS_LOOP):
        cur_n = start_n + offs_n
        kv_ok = d_ok[None, :]
        if BOUNDS:
            kv_ok = kv_ok & (cur_n[:, None] < Sk)
        if TMA:  # descriptor offsets are 32-bit (start_n is 64-bit when the key range came from a kv cache)
            k = k_desc.load([tl.cast(start_n, tl.int32), 0])
        else:
            k = tl.load(p_k + _kv_rows(cur_n, k_start, p_bt, page_size, stride_kpage, stride_kn, Sk, PAGED)[:, None],
                        mask=kv_ok, other=0.0)
        qk = mma(q, tl.trans(k), None, DOT_FP32, PRECISION)
        if PLAIN:
            # scores are q.k * qk_scale only (qk_scale > 0): take the row max of the raw products and
            # fold scale and max into one multiply-add per score
            if BOUNDS:
                qk = tl.where(in_bounds(offs_m[:, None], cur_n[None, :], Sq, Sk, win_left, win_right,
                                        WIN_LEFT, WIN_RIGHT), qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            m_sub = m_new
            if BOUNDS:  # a row that has seen no key yet keeps m = -inf: subtract 0 so exp2 gives 0, not NaN
                m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(qk * qk_scale - m_sub[:, None])
        else:
            s, _ = scores_log2(qk, offs_m[:, None], cur_n[None, :], Sq, Sk, qk_scale, softcap_scale, softcap_log2,
                               slope2, p_bias, stride_bias_m, stride_bias_n, p_mask, stride_mask_m, stride_mask_n,
                               win_left, win_right, BOUNDS, WIN_LEFT, WIN_RIGHT, SOFTCAP, HAS_ALIBI, HAS_BIAS,
                               MASK_KIND, PRECISION)
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # a row that has seen no key yet keeps m = -inf; subtract 0 instead so exp2 gives 0, not NaN
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(s - m_sub[:, None])
        alpha = tl.math.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)
        if HAS_DROPOUT:
            p = tl.where(dropout_keep(seed, offs_m, start_n, BLOCK_N, dropout_p, False), p, 0.0)
        if TMA:
            v = v_desc.load([tl.cast(start_n, tl.int32), 0])
        else:
            v = tl.load(p_v + _kv_rows(cur_n, k_start, p_bt, page_size, stride_vpage, stride_vn, Sk, PAGED)[:, None],
                        mask=kv_ok, other=0.0)
        acc = mma(p.to(v.dtype), v, acc * alpha[:, None], DOT_FP32, PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _fwd_kernel(
    Q, K, V, O, LSE,
    stride_qb, stride_qm, stride_qh, stride_qd,
    stride_kb, stride_kn, stride_kh, stride_kd,
    stride_vb, stride_vn, stride_vh, stride_vd,
    stride_ob, stride_om, stride_oh, stride_od,
    BIAS, stride_bias_b, stride_bias_h, stride_bias_m, stride_bias_n,
    MASK, stride_mask_b, stride_mask_h, stride_mask_m, stride_mask_n,
    ALIBI, stride_alibi_b, SEED, dropout_p,
    CU_Q, CU_K, stride_lse_b, stride_lse_h, LEN_LO, LEN_HI,
    KV_LENS, KV_LEFTPAD, KV_BATCH_IDX, BLOCK_TABLE, stride_bt_b, page_size, stride_kpage, stride_vpage,
    Hq, GROUP, Sq, Sk, qk_scale, softcap_scale, softcap_log2, win_left, win_right,
    WIN_LEFT: tl.constexpr, WIN_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_BIAS: tl.constexpr, MASK_KIND: tl.constexpr, HAS_DROPOUT: tl.constexpr, IS_VARLEN: tl.constexpr,
    KV_CACHE: tl.constexpr, HAS_LEFTPAD: tl.constexpr, HAS_BATCH_IDX: tl.constexpr, PAGED: tl.constexpr,
    SCALE_POS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, TMA: tl.constexpr, WS: tl.constexpr,
    HEADS_FIRST: tl.constexpr,
):
    # causal: the last query blocks have the most keys; launch them first for a better tail
    pid, n_pid, bh, _n_bh = program_order(HEADS_FIRST)
    pid_m = n_pid - 1 - pid if WIN_RIGHT else pid
    off_bh = bh.to(tl.int64)
    off_b = off_bh // Hq
    off_h = off_bh % Hq
    off_hk = off_h // GROUP

    start_m = pid_m * BLOCK_M
    q_start, Sq, k_start, Sk = seq_bounds(CU_Q, CU_K, off_b, Sq, Sk, IS_VARLEN, LEN_LO, LEN_HI)
    if IS_VARLEN:
        # past this sequence's end (the grid covers the longest), or another length class's sequence
        if start_m >= Sq:
            return
    off_bk = off_b
    p_bt = BLOCK_TABLE
    if KV_CACHE:
        # keys are rows [leftpad, lens) of the batch row's cache (with the new tokens appended)
        if HAS_LEFTPAD:
            k_start = tl.load(KV_LEFTPAD + off_b).to(tl.int64)
        Sk = tl.load(KV_LENS + off_b) - k_start
        if HAS_BATCH_IDX:
            off_bk = tl.load(KV_BATCH_IDX + off_b).to(tl.int64)
    if PAGED:
        p_bt = BLOCK_TABLE + off_b * stride_bt_b
        if IS_VARLEN:  # paged varlen: cu_seqlens_k gives the length; the keys start at row 0 of the pages
            k_start = 0
    Q += q_start * stride_qm
    O += q_start * stride_om
    if not PAGED:
        K += k_start * stride_kn
        V += k_start * stride_vn
    LSE += off_b * stride_lse_b + off_h * stride_lse_h + q_start
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    m_ok = offs_m < Sq

    p_q = Q + off_b * stride_qb + off_h * stride_qh + offs_d[None, :] * stride_qd
    q = tl.load(p_q + offs_m[:, None].to(tl.int64) * stride_qm, mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    p_k = K + off_bk * stride_kb + off_hk * stride_kh + offs_d[None, :] * stride_kd
    p_v = V + off_bk * stride_vb + off_hk * stride_vh + offs_d[None, :] * stride_vd
    tl.static_assert(not (TMA and PAGED), "paged keys are read row by row")
    k_desc, v_desc = row_tiles(K + off_bk * stride_kb + off_hk * stride_kh, V + off_bk * stride_vb + off_hk * stride_vh,
                               stride_kn, stride_vn, Sk, p_k, p_v, HEAD_DIM, BLOCK_N, BLOCK_D, TMA)
    p_bias, p_mask, slope2, seed = head_setup(off_b, off_h, off_bh, BIAS, stride_bias_b, stride_bias_h,
                                              MASK, stride_mask_b, stride_mask_h, ALIBI, stride_alibi_b, SEED,
                                              HAS_BIAS, MASK_KIND, HAS_ALIBI, HAS_DROPOUT)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    lo, full_lo, full_hi, hi = key_range(start_m, Sq, Sk, win_left, win_right, BLOCK_M, BLOCK_N, WIN_LEFT, WIN_RIGHT)
    if WIN_LEFT:  # masked: the window's left edge
        acc, l_i, m_i = _fwd_inner(
            acc, l_i, m_i, q, p_k, p_v, stride_kn, stride_vn, p_bt, page_size, stride_kpage, stride_vpage, k_start,
            k_desc, v_desc,
            offs_m, offs_n, offs_d, lo, tl.minimum(full_lo, hi),
            Sq, Sk, qk_scale, softcap_scale, softcap_log2, slope2, p_bias, stride_bias_m, stride_bias_n,
            p_mask, stride_mask_m, stride_mask_n, win_left, win_right, seed, dropout_p,
            True, WIN_LEFT, WIN_RIGHT, SOFTCAP, HAS_ALIBI, HAS_BIAS, MASK_KIND, HAS_DROPOUT, PAGED, SCALE_POS,
            HEAD_DIM, BLOCK_N, DOT_FP32, PRECISION, TMA, WS)
    # unmasked: every row sees every key
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, p_k, p_v, stride_kn, stride_vn, p_bt, page_size, stride_kpage, stride_vpage, k_start,
            k_desc, v_desc,
            offs_m, offs_n, offs_d, full_lo, full_hi,
        Sq, Sk, qk_scale, softcap_scale, softcap_log2, slope2, p_bias, stride_bias_m, stride_bias_n,
        p_mask, stride_mask_m, stride_mask_n, win_left, win_right, seed, dropout_p,
        False, WIN_LEFT, WIN_RIGHT, SOFTCAP, HAS_ALIBI, HAS_BIAS, MASK_KIND, HAS_DROPOUT, PAGED, SCALE_POS,
        HEAD_DIM, BLOCK_N, DOT_FP32, PRECISION, TMA, WS)
    # masked: the diagonal / the window's right edge, and the ragged end of the keys
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, p_k, p_v, stride_kn, stride_vn, p_bt, page_size, stride_kpage, stride_vpage, k_start,
            k_desc, v_desc,
            offs_m, offs_n, offs_d, tl.maximum(full_hi, full_lo), hi,
        Sq, Sk, qk_scale, softcap_scale, softcap_log2, slope2, p_bias, stride_bias_m, stride_bias_n,
        p_mask, stride_mask_m, stride_mask_n, win_left, win_right, seed, dropout_p,
        True, WIN_LEFT, WIN_RIGHT, SOFTCAP, HAS_ALIBI, HAS_BIAS, MASK_KIND, HAS_DROPOUT, PAGED, SCALE_POS,
        HEAD_DIM, BLOCK_N, DOT_FP32, PRECISION, TMA, WS)

    # rows that saw no key: output 0, lse -inf
    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    acc = acc / l_safe[:, None]
    if HAS_DROPOUT:
        acc = acc * (1.0 / (1.0 - dropout_p))
    lse = tl.where(seen, (m_i + tl.math.log2(l_safe)) * LN2, float("-inf"))
    tl.store(LSE + offs_m, lse, mask=m_ok)
    p_o = O + off_b * stride_ob + off_h * stride_oh + offs_d[None, :] * stride_od
    tl.store(p_o + offs_m[:, None].to(tl.int64) * stride_om, acc.to(O.dtype.element_ty),
             mask=m_ok[:, None] & d_ok[None, :])


# K / V through tensor descriptors (TMA) when the layout allows (see _tma_ok), and the unmasked loop
# warp-specialized: switches of the launcher (tests and scripts/tune.py --fwd-variants set them; the
# defaults are the measured choice, benchmarks/NOTES.md)
TMA = configs.env_flag("TRITONATTN_FWD_TMA")
WS = configs.env_flag("TRITONATTN_FWD_WS")


# The Gluon sm_90 forward (kernels/fwd_sm90.py) for the calls _gluon_ok admits: on by default with the
# Triton it was written and measured with (3.6; Gluon's API is experimental); TRITONATTN_FWD_GLUON=0
# turns it off, =1 turns it on with other Triton versions.
_GLUON_ENV = configs.env_flag("TRITONATTN_FWD_GLUON", default=None)
GLUON = fwd_sm90 is not None and (triton.__version__.startswith("3.6.") if _GLUON_ENV is None else _GLUON_ENV)
# Variable-length calls through the Gluon forward too (its IS_VARLEN path: per-sequence descriptors
# from cu_seqlens, tiles past a sequence skipped): 1.00-1.24x the Triton varlen forward on the H200
# (twelfth session), and a sequence gets bitwise what its own dense call gives where both take the
# Gluon forward. On wherever the Gluon forward is; TRITONATTN_FWD_GLUON_VARLEN=0 turns it off.
GLUON_VARLEN = configs.env_flag("TRITONATTN_FWD_GLUON_VARLEN", default=True)


GLUON_ROUTE = "gluon"  # a length class served by the Gluon forward (attention_forward's route)


def _gluon_ok(q, k, v, var: Variants, sm90: bool, longest: int | None = None) -> bool:
    """The Gluon forward serves the call (``sm90``: q is on an NVIDIA sm_90 GPU): see
    :func:`gluon_serves`. From the lengths in configs.GLUON_MIN_SEQLEN, measured on the H200
    (benchmarks/NOTES.md, graph replays, x the Triton kernel; the measurements in configs.py): D=128
    from 128 / 512 without / with a mask, D=64 from 512 / 4096, D=256 from 128 (twenty-sixth
    session)."""
    return GLUON and gluon_serves(q, k, v, var, sm90, "fwd", fwd_sm90.TILES, varlen=GLUON_VARLEN, longest=longest)


def gluon_serves(q, k, v, var: Variants, sm90: bool, mode: str, tiles: dict, *more, varlen: bool = False,
                 longest: int | None = None) -> bool:
    """The rule the Gluon kernels share (``mode``: "fwd" or "bwd_dkdv", each with its switch
    checked by its caller): an sm_90 GPU, a head dim in ``tiles``, 16-bit, dense (or variable
    length when the caller passes ``varlen``, judged by ``longest``: the longest side of the
    sequences of one length class, default the call's), no variant but a causal mask or a
    window's right edge, queries or keys at least ``configs.GLUON_MIN_SEQLEN`` long, Q / K / V
    (and ``more``) readable through tensor descriptors (see _tma_ok), not
    TRITONATTN_BATCH_INVARIANT (the length rule would pick different kernels for a packed
    sequence and its own dense call), and no tile of this mode forced (``configs.override``: the
    tests and the tuner time the Triton kernels')."""
    if not sm90 or configs.BATCH_INVARIANT or mode in configs._override or q.shape[-1] not in tiles \
            or (var.varlen and not varlen):
        return False
    if not var.right_edge_only or var.softmax_scale <= 0:
        return False
    B, Sq, Sk, Hq, Hkv, _ = var.dims(q, k)
    shortest = configs.GLUON_MIN_SEQLEN[mode][q.shape[-1]][var.win_right is not None]
    if Sk == 0 or (max(Sq, Sk) if longest is None else longest) < shortest:
        return False
    # the forward's grid is persistent (1-D, its tiles counted in int32); the dK / dV kernel has a
    # program per kv head on the grid's y axis
    if mode == "fwd":
        if cdiv(Sq, fwd_sm90.block_m(q.shape[-1], var.win_right is not None)) * B * Hq >= 2**31:
            return False
    elif B * Hkv > configs.MAX_GRID_YZ:
        return False
    return _tma_ok(q, k, v, var, q, *more)


def _on_sm90(q) -> bool:
    """q is on an NVIDIA sm_90 GPU (scripts/compile_check.py says yes for CPU tensors)."""
    return q.is_cuda and _hopper(q.device.index)


@functools.cache
def _hopper(index: int) -> bool:
    """An NVIDIA sm_90 GPU (ROCm reports major 9 for MI200 / MI300 too)."""
    return torch.version.hip is None and torch.cuda.get_device_capability(index)[0] == 9


def _tma_ok(q, k, v, var: Variants, *more) -> bool:
    """Tensor descriptors can read K / V (and the tensors ``more``, e.g. the backward's Q and dO):
    an sm_90 GPU (the one measured; or the interpreter), 16-bit elements, a power-of-two head dim
    (no padded columns), unit dim stride, 16-byte aligned base and row / head / batch strides, a
    row stride that is not 0 (no keys broadcast along the sequence), keys not paged. (Asked by a
    backward without a plan, and by forwards with TRITONATTN_FWD_TMA: plain loops.)"""
    if q.element_size() != 2 or var.block_table is not None or q.shape[-1] != configs.padded_head_dim(q.shape[-1]):
        return False
    if q.is_cuda and not _hopper(q.device.index):
        return False
    for t in (k, v, *more):
        st = t.stride()
        if st[-1] != 1 or st[-3] == 0 or t.data_ptr() % 16:
            return False
        for x in st[:-1]:
            if x % 8:
                return False
    return True


_SCRATCH_KEPT = 8 << 20  # bytes: a larger request is allocated fresh, not kept
_descriptor_scratch = kept.Kept(limit=_SCRATCH_KEPT)
_cuda_devices: dict = {}  # index -> torch.device (made once)


def _scratch(size: int, alignment: int, stream):
    """Global scratch for descriptors created inside kernels (128 bytes per program), which Triton's
    launcher asks for at every launch of such a kernel: a block kept per (device, stream)
    (kernels/kept.py), not an allocation per launch (4.5 us on the main thread, ~11 in the autograd
    engine's; thirtieth session); under CUDA graph capture, or over _SCRATCH_KEPT bytes, a fresh tensor."""
    if size > _SCRATCH_KEPT or torch.cuda.is_current_stream_capturing():  # (large grids: their time dwarfs it)
        return torch.empty(size, dtype=torch.int8, device="cuda")
    index = torch._C._cuda_getDevice()
    device = _cuda_devices.get(index)
    if device is None:
        device = _cuda_devices[index] = torch.device("cuda", index)
    return _descriptor_scratch.block(size, device, stream)


# A result no one reads (the lse of an inference call that does not return it: Variants.need_lse),
# as a launch plan's allocation factory: a view of a block kept per device and stream (the launches
# of a stream write it one after another, no launch reads it), up to 8 MB. Saves an allocation per call.
_discarded = kept.Kept()


def _need_allocator() -> None:
    """Kernels that build tensor descriptors need Triton's allocator (a context variable: set per
    thread, and only where the caller has not set one of its own)."""
    if _allocation._allocator.get() is _allocation._NULL_ALLOCATOR:
        triton.set_allocator(_scratch)


def attention_forward(q, k, v, var: Variants):
    """Launch the forward. Dense: q (B, Sq, Hq, D), k/v (B, Sk, Hkv, D); variable length
    (``var.cu_seqlens_q`` set): q (total_q, Hq, D), k/v (total_k, Hkv, D), or with ``var.block_table``
    the first page (page_size, Hkv, D) of a paged cache whose page stride is in ``var.kv_page_strides``
    (sequence b's keys are rows 0 .. len_b - 1 of its block table row). Any strides.

    Returns ``(out, lse)``: out like q's shape and dtype; lse float32, (B, Hq, Sq) dense or
    (Hq, total_q) variable length, contiguous.
    """
    if (not var.varlen and var.kv_lens is None and var.block_table is None and var.bias is None and var.mask is None
            and var.dropout_p == 0 and configs.dense_decode(q.shape[1], k.shape[1], q.shape[2], k.shape[2])):
        # shaped like a decoding step: the split-KV decoding kernel, over all of k / v
        return _decode().decode_forward(q, k, v, var, k.shape[1], 0)
    inputs = (q, k, v, *var.tensors())
    tma = TMA and _tma_ok(q, k, v, var)
    # the Gluon kernel's choice also depends on the inputs' 16-byte alignment (its descriptors)
    aligned = GLUON and ((q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15) == 0
    if tma or aligned:  # descriptors need Triton's allocator, a per-thread setting: also for a replay
        _need_allocator()
    key = ("fwd", q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, q.device, var.signature(),
           tma, aligned, plan_flags())
    # (heads_first's other inputs are in the key; MAX_GRID_YZ and fwd_sm90's PROGRAMS,
    # HEADS_PER_SECTION, TILES and BY_MASK are constants, changed only by tests, the tuner and the
    # experiment scripts, which clear the plans)
    res = plan.replay(key, inputs, q.device)
    if res is None:  # a new signature: recorded
        res = _record(key, inputs, q, k, v, var, tma, aligned)
    if var.fast_key is not None:
        # with the mask's layout: the entry point's key holds the user's mask's shape and strides, of
        # which the laid-out view's (var.mask) are a function
        layout = None if var.mask is None else (var.mask.size(), var.mask.stride())
        plan.link(var.fast_key, key, (tma or aligned, layout, ()))
    return res


def plan_flags() -> tuple:
    """This module's switches that a forward's launch plan depends on (in its key; an entry point's
    key for :func:`replay_linked` holds them too)."""
    # (a traced launch passes a buffer no plan holds: never replayed)
    return (TMA, WS, configs.HEADS_FIRST, configs.BATCH_INVARIANT, GLUON, GLUON_VARLEN, fwd_sm90.TRACE_BUF is not None,
            configs.DENSE_DECODE, configs.DENSE_DECODE_ROWS, configs.DENSE_DECODE_MIN_KEYS,
            configs.DECODE_PDL, configs.DECODE_ONE_SPLIT_KEYS)


def _decode():
    """kernels/decode.py (which imports this module: imported at the first call that needs it)."""
    from tritonattn.kernels import decode

    return decode


_NO_TENSOR_OPTIONS = (None,) * len(Variants(0.0).tensors())
_MASK_SLOT = 2  # Variants.tensors()'s mask
assert Variants(0.0, mask=torch.empty(0)).tensors()[_MASK_SLOT] is not None


def replay_linked(entry_key, q, k, v, mask=None) -> tuple | None:
    """``(out, lse)`` of a call without tensor options (no ALiBi, bias, dropout, lengths or cache)
    but a bool ``mask`` (the user's mask or key padding mask, or None) through the launch plan that
    an earlier :func:`attention_forward` linked to ``entry_key`` (``Variants.fast_key``; plan.link),
    or None: no such plan, or the inputs do not share the tensors the recorded call shared. The
    entry point's key holds all the launcher's key is made of; the mask is laid out as the recorded
    call's was (its bytes, with the recorded view's sizes and strides), and a plan that takes values
    (the dense decoding route's) gets those of the linked call (its shapes: the entry key's)."""
    entry = plan.linked(entry_key)
    if entry is None:
        return None
    p, (allocator, layout, values) = entry
    if allocator:
        _need_allocator()
    if layout is None:
        return p.run((q, k, v, *_NO_TENSOR_OPTIONS), q.device, values)
    options = list(_NO_TENSOR_OPTIONS)
    options[_MASK_SLOT] = mask.view(torch.uint8).as_strided(*layout)
    return p.run((q, k, v, *options), q.device, values)


def _record(key, inputs, q, k, v, var: Variants, tma: bool, aligned: bool) -> tuple:
    """:func:`attention_forward`'s full path, recorded as the launch plan of ``key``."""
    b = plan.Builder(key, inputs)
    B, Sq, Sk, Hq, Hkv, D = var.dims(q, k)
    # variable length: token rows outside every sequence get no program, so start from zeros
    alloc = torch.zeros if var.varlen else torch.empty
    out = b.alloc(alloc, q.shape, q.dtype, q.device)
    lse = b.alloc(alloc if var.need_lse else _discarded, var.lse_shape(q), torch.float32, q.device)
    if out.numel() == 0 or Sq == 0:
        return b.finish((out, lse))
    sm90 = aligned and _on_sm90(q)
    # the keys' length for the tile (and the autotuner's key): a paged cache (not varlen) passes one
    # page as k, its keys span the block table
    keys = Sk if var.block_table is None or var.varlen else var.block_table.shape[1] * var.page_size

    def route(longest: int):
        """What a dense call whose longest side is ``longest`` takes: the Gluon forward, or the Triton
        one with this tile. The wide short tile (configs._short_wide: it follows the call's tile
        count) goes to dense calls of two or more sequences only: a packed sequence gets what its
        own dense call, of one sequence, gets, and a packed call's length classes cannot count one
        sequence's query tiles (by its longer side alone, ``longest``)."""
        if sm90 and _gluon_ok(q, k, v, var, True, longest=longest):
            return GLUON_ROUTE
        return configs.forward_config(q, var.causal, extra_smem=var.extra_smem, seqlen=longest,
                                      plain=var.plain and not var.varlen and B > 1)

    # packed sequences: a launch per length class (launch.length_classes), each sequence bitwise what
    # its own dense call gives
    longest = max(Sq, keys)
    classes = length_classes(route, longest, configs.length_breaks(), packed=var.varlen)
    flags = None
    for lo, hi, cfg in classes:
        if cfg == GLUON_ROUTE:
            seqs = dict(cu_seqlens=(var.cu_seqlens_q, var.cu_seqlens_k), max_seqlens=(Sq, Sk),
                        lengths=(lo, hi)) if var.varlen else {}
            causal = var.win_right is not None
            b.launch(fwd_sm90._fwd_ws_kernel, fwd_sm90.grid(q, cdiv(Sq, fwd_sm90.block_m(D, causal)) * B * Hq),
                     fwd_sm90.launch_args(q, k, v, out, lse, var.window_args()[1], var.scale_args()[0], **seqs),
                     dict(CAUSAL=causal, HEAD_DIM=D, **fwd_sm90.tile_flags(D, causal), IS_VARLEN=var.varlen,
                          DESC_ONCE=fwd_sm90.desc_once(q, k, v, var.varlen),
                          TRACE=fwd_sm90.TRACE_BUF is not None))
            continue
        if flags is None:
            heads_first = configs.heads_first(var.win_right is not None, k, B * Hq)
            flags = dict(**var.constexprs(), **var.cache_constexprs(), SCALE_POS=var.softmax_scale > 0, HEAD_DIM=D,
                         BLOCK_D=configs.padded_head_dim(D), DOT_FP32=configs.dot_in_fp32(q.dtype),
                         PRECISION=configs.dot_precision(q.dtype), TMA=tma, HEADS_FIRST=heads_first)
        # a class's sequences are shorter than hi: its grid covers no more rows
        sq = min(Sq, hi - 1)

        def run(cfg, lo=lo, hi=hi, sq=sq):
            b.launch(_fwd_kernel, program_grid(cdiv(sq, cfg.block_m), B * Hq, flags["HEADS_FIRST"]), (
                q, k, v, out, lse,
                *var.bshd_strides(q), *var.bshd_strides(k), *var.bshd_strides(v), *var.bshd_strides(out),
                *var.kernel_args(q), *var.seq_args(q, lse), lo, hi, *var.cache_args(q),
                Hq, Hq // Hkv, Sq, Sk, *var.scale_args(), *var.window_args(),
            ), dict(**flags, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps,
                    num_stages=cfg.num_stages,
                    # Triton 3.6's warp specialization failed to compile 4-warp tiles (benchmarks/NOTES.md)
                    WS=WS and tma and cfg.num_warps >= 8))

        autotune.launch_tuned("fwd", q, var.causal, sq, min(keys, hi - 1), flags, cfg, run)
    return b.finish((out, lse))
