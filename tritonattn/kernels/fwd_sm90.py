"""Hopper (sm_90) forward in Gluon: FlashAttention-3's schedule, which Triton's own compiler does not
produce from ``tl`` code (benchmarks/NOTES.md, tenth session).

Gluon (``triton.experimental.gluon``, shipped with Triton) makes the warpgroup MMAs, their waits,
the TMA loads, mbarriers and warp specialization explicit. The grid is persistent: one program per
SM walks tiles t = pid, pid + P, ... (a tile: 64 NC query rows of one head; order in _tile), and
runs three partitions:
- a producer warp: the TMA loads of each tile's Q and of its K / V blocks into a ring of STAGES
  slots, each slot refilled once every consumer has released it (an mbarrier with NC
  arrivals); it runs into the next tile while the consumers finish the current one. Dense calls
  read through descriptors over the whole tensors, built once per program (twenty-second session:
  +1-15% at S=512, where rebuilding them per tile stalled the producer at every tile boundary);
- NC consumer warpgroups (the default partition and workers) of 64 query rows each, over the
  same key blocks: two, or three at D=64 without a mask (TILES, BY_MASK). They take turns on the
  tensor cores ("ping-pong", round the consumers): a consumer waits for its turn, issues
  S_j = Q K_j^T and P_{j-1} V_{j-1}, hands the turn over, then waits for its products and runs its
  softmax while the other consumers' products run. The output goes out from registers, or (O_TMA,
  two Q buffers) through the consumer's part of the tile's Q buffer and a TMA store.
No CTA-wide barrier in the loop: partitions talk only through mbarriers.

Serves what it was measured on (``fwd._gluon_ok``): sm_90, Triton 3.6, 16-bit inputs, head dims in TILES,
dense calls with no variant but a causal mask or a window's right edge, K / V / Q readable through
tensor descriptors, and packed variable-length calls (IS_VARLEN: descriptors built per sequence
from ``cu_seqlens``, tiles past a sequence skipped; ``fwd.GLUON_VARLEN``). On the H200 (llama
shape, graph replays) it runs 1.32-1.40x the Triton kernel at S=512-1024 without a mask and
1.09-1.23x from 2048 (benchmarks/NOTES.md, twelfth session); one program per tile, it had been
0.86x at S=1024 causal. Every other call takes ``fwd._fwd_kernel``. The interpreter
cannot run Gluon: the CPU tier compiles this kernel for sm_90 (tests/test_compile_sm90.py) and
tests the eligibility rule; the GPU tier tests its results.
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

from tritonattn.kernels.common import LENGTH_CAP, LN2
from tritonattn.kernels.launch import l2_bytes, sm_count

# The tile by head dim, measured on the H200 (benchmarks/NOTES.md): BLOCK_N keys per block, STAGES K ring
# slots (V_STAGES V ring slots, else as many), Q_BUFS Q buffers, K_APART, O_TMA, NC consumer
# warpgroups of 64 query rows (the tile: block_m). D=128 (tenth session): 128-key blocks, 3 slots;
# 2 slots lost 6-11%, 64-key blocks 10-14%. D=64 and D=256 on the persistent grid (thirteenth
# session): D=64 4 slots (3 slots 1-2% less); D=256 64-key blocks and 2 slots, all that fits.
# K_APART: the K ring's slots released as soon as both S products that read them are done, a step
# before their V (twentieth session): at D=256 1.12-1.29x (2 slots: K_{j+1} had waited for step j);
# at D=128 / 64 (3 / 4 slots) -3..+2%, so they keep K and V released together.
# O_TMA (two Q buffers): the output through the consumer's part of the tile's Q buffer and a TMA
# store, the buffer released once the store has read it (twenty-fifth session, fa shape, graph
# replays, x one Q buffer and 3 V slots: D=128 +6% at S=512 without a mask, +0..+1.5% with one,
# 0..+0.7% from 2048; llama shape +9% / -1.5% at 512, +5.6% / +2.4% at 2048). At D=128 the second
# Q buffer fits where a third V slot was (V_STAGES 2).
# NC=3 (twenty-fifth session): 192-row tiles, a consumer's softmax hidden under two others'
# products. D=64 without a mask, with O_TMA: +7% at S=512, +10% at 2048, +12% at 8192; with a
# causal mask -11% / -15% / +3% at 512 / 2048 / 8192 (the diagonal blocks 1.5x as wide), so two.
# SPLIT_WAIT (twenty-sixth session): the softmax of S_j while P_{j-1} V_{j-1} runs (_consumer_steps).
# Forced-kernel A/B, graph replays, x without: D=256 +2..+8% from S=1024 (one cell of 12 -2%, in a run
# whose default cell was 9% off the other run's); D=128 +1..+4% from 1024 (one cell -2.7%, llama causal
# 2048), +-1% at 512; D=64 within +-1.3% (off there).
# P rounded to 16 bits by inline PTX (_to16; twenty-seventh session, bitwise the same output): forced-kernel
# A/B, graph replays, x .to(dtype): D=64 +2..+5% (one cell of 6 -1.9%, S=2048 full), D=128 causal
# +1.6..+4.9%, full +-0.7%, D=256 -0.8..+1.1%.
# (ROWSUM_MMA, the row sums by the tensor cores as P times a tile of ones, measured and removed in the
# twenty-seventh session: D=64 -6..+6%, flat from 2048 but for -6% at 2048 full; not the bitwise output.)
# A tile's first key block goes through the softmax without the mask where the whole tile sees all of
# its keys (n_full > 0), before the twenty-eighth session always masked (FIRST_UNMASKED, measured
# against that and made the only path; bitwise the same output): forced-kernel A/B, graph replays,
# causal D=64 +5.7 / +3.1 / +0.9% at S=512 / 2048 / 8192, D=128 +12.9% at 512, +0.8% at 2048, D=256
# +3.2% at 8192; every other cell within -1.7..+1.1%.
HALF = gl.constexpr(64)  # a consumer warpgroup's query rows (the tile: NC of them, block_m)
TILES = {
    64: dict(BLOCK_N=128, STAGES=4),
    128: dict(BLOCK_N=128, STAGES=3, V_STAGES=2, Q_BUFS=2, O_TMA=True, SPLIT_WAIT=True),
    256: dict(BLOCK_N=64, STAGES=2, K_APART=True, SPLIT_WAIT=True),
}
# (head dim, causal) -> what differs there from TILES[head dim]
BY_MASK = {(64, False): dict(NC=3, Q_BUFS=2, O_TMA=True)}
PROGRAMS = None  # the persistent grid's size: None, one program per SM (tests set a few)
HEADS_PER_SECTION = None  # the causal order's section: None, section_heads' rule (tests and the tuner set it)
NUM_WARPS = 4  # the default partition (one consumer); the workers add 4 (NC - 1) + 1 warps
# TRACE (benchmarks/experiments/tile_trace.py): an int64 tensor of (programs, TRACE_TILES, TRACE_SLOTS)
# that the kernel fills with cycle stamps (_stamp), or None (off: the kernel is compiled without them)
TRACE_BUF = None
TRACE_TILES = gl.constexpr(64)
TRACE_SLOTS = gl.constexpr(24)
MAXNREG = 168  # 12 warps x 168 registers fill the register file; setmaxnreg moves them to the consumers
# three consumers: 16 warps x 128 registers (setmaxnreg, read from the PTX: 168 to the default consumer's
# threads, 160 to the two worker consumers', 24 to the producer's: the whole register file)
MAXNREG_3 = 128


def tile(head_dim: int, causal: bool) -> dict:
    """The kernel's tile constexprs at ``head_dim``, with a causal mask or a window's right edge or
    without (TILES, BY_MASK)."""
    t = dict(Q_BUFS=1, K_APART=False, O_TMA=False, NC=2, SPLIT_WAIT=False, TREE_MAX=False)
    t.update(TILES[head_dim])
    t.update(BY_MASK.get((head_dim, causal), {}))
    t.setdefault("V_STAGES", t["STAGES"])
    return t


def block_m(head_dim: int, causal: bool) -> int:
    """Query rows per tile: 64 per consumer warpgroup."""
    return HALF.value * tile(head_dim, causal)["NC"]


def tile_flags(head_dim: int, causal: bool) -> dict:
    """The launch's tile constexprs (:func:`tile`), warps and register cap."""
    t = tile(head_dim, causal)
    return dict(t, num_warps=NUM_WARPS, maxnreg=MAXNREG if t["NC"] == 2 else MAXNREG_3)


@gluon.jit
def _to16(x, dtype: gl.constexpr):
    """fp32 ``x`` rounded to ``dtype`` (bf16 or fp16) by one cvt.rn.{bf16,f16}x2.f32 per pair of a
    thread's elements (inline PTX, the lower element in the lower half, as the wgmma's register
    operand takes them), the same rounding as ``x.to(dtype)``: where P is carried across the loop as
    16-bit values, ``x.to(dtype)`` left ptxas packing them into a register halves swapped and adding a
    PRMT per register before the P V product (32 per step at D=64 and 128, 16 at D=256;
    compile_check.py --dump); the pairs packed here come out in the wgmma's order."""
    if dtype == gl.bfloat16:
        return gl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,r,r", [x], dtype=gl.bfloat16,
                                         is_pure=True, pack=2)
    else:
        gl.static_assert(dtype == gl.float16, "P: bf16 or fp16")
        return gl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,r,r", [x], dtype=gl.float16,
                                         is_pure=True, pack=2)


@gluon.jit
def _row_max_tree(s):
    """``s`` ([rows, BLOCK_N]) with its columns halved four times (three at BLOCK_N 64), each column
    the larger of a pair (8 or fewer left; the caller's max over them is the row max). A row's maximum as a tree: the
    running max's chain of dependent FMNMX before the first exp2 goes from ~31 levels to ~6 (D=64's
    step is softmax-bound, the chain in series with the other consumer's products; a helper's SASS
    reading, forty-fourth session). Max is exact: the same value as gl.max(s, 1)."""
    ROWS: gl.constexpr = s.shape[0]
    W: gl.constexpr = s.shape[1]
    x = gl.max(gl.reshape(s, [ROWS, 2, W // 2]), 1)
    x = gl.max(gl.reshape(x, [ROWS, 2, W // 4]), 1)
    x = gl.max(gl.reshape(x, [ROWS, 2, W // 8]), 1)
    if W >= 128:  # (at BLOCK_N 64 a fourth halving crosses a lane bit: shuffles, compile_check, a review)
        x = gl.max(gl.reshape(x, [ROWS, 2, W // 16]), 1)
    return x


@gluon.jit
def _softmax_step(s, m_i, l_i, offs_m, offs_n, start_n, Sk, causal_shift, qk_scale,
                  MASKED: gl.constexpr, CAUSAL: gl.constexpr, TREE_MAX: gl.constexpr = False):
    """Online softmax of one block of raw scores ``s`` (exp2 domain, scale folded into one FMA).
    Returns the probabilities (fp32), the new running max and sum, and the rescale factor of the
    accumulator. MASKED: keys past Sk and, when CAUSAL, past each row's diagonal score -inf.
    TREE_MAX (a tile field, an experiment): the row max as a tree (_row_max_tree), the same value."""
    if MASKED:
        cols = start_n + offs_n
        keep = gl.expand_dims(cols < Sk, 0)
        if CAUSAL:
            keep = keep & (gl.expand_dims(cols, 0) <= gl.expand_dims(offs_m + causal_shift, 1))
        s = gl.where(keep, s, float("-inf"))
    if TREE_MAX:
        row_max = gl.convert_layout(gl.max(_row_max_tree(s), 1), m_i.type.layout)
    else:
        row_max = gl.max(s, 1)
    m_new = gl.maximum(m_i, row_max * qk_scale)
    m_sub = m_new
    if MASKED:  # a row that has seen no key yet keeps m = -inf: subtract 0 so exp2 gives 0, not NaN
        m_sub = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(s * qk_scale - gl.expand_dims(m_sub, 1))
    alpha = gl.exp2(m_i - m_sub)
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, m_new, l_i, alpha


@gluon.jit
def _tile(t, n_m, BH, SEC, Hq, GROUP, Sq, Sk, causal_shift, win_right, CU_Q, CU_K, LEN_LO, LEN_HI,
          CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, IS_VARLEN: gl.constexpr):
    """Tile t (BLOCK_M query rows of one sequence and query head): whether it is one (see _n_tiles), its
    first row, batch, head, kv head, first query and key token (0 but for IS_VARLEN), query and key
    lengths, causal shift, key blocks and unmasked key blocks. Without a mask: a head's query
    blocks one after the other. Causal: SEC heads at a time (a section: heads whose K / V fit in L2
    together, so that the programs running at once share them). With more tiles than programs, a
    program's turns 2k and 2k+1 run one pair of query blocks (i, n_m - 1 - i) of a head, heavy
    block first: every pair costs n_m + 1 key blocks, so the programs' loads differ by one pair at
    most (the heaviest-first order dealt by turns left programs up to 1.8x apart where a section's
    tiles were about as many as the programs: MHA, D=256, S=16384; and with fewer tiles than twice
    the programs a program's two tiles add to more than a pair). Otherwise (a tile per program):
    the query blocks with the most keys first, all the section's heads of a block together.
    IS_VARLEN: sequence b is rows [cu[b], cu[b + 1]) of the packed tensors and Sq / Sk are the
    longest (a tile past its sequence's queries is skipped by every partition, as are turns past
    the pairs), and a sequence whose longest side is not in [LEN_LO, LEN_HI) reads as having no
    query (another launch serves its length class: launch.length_classes)."""
    valid = True
    if CAUSAL:
        P = gl.num_programs(0)
        n_half = (n_m + 1) // 2
        if _pairs(n_m, BH):
            u = t % P + t // (2 * P) * P  # the pair (past the last: a turn with no tile, read as the last)
            uc = gl.minimum(u, n_half * BH - 1)
            first = uc // (n_half * SEC) * SEC  # the section's first head
            r = uc % (n_half * SEC)
            width = gl.minimum(SEC, BH - first)  # (the last section may hold fewer heads)
            i = r // width
            bh = first + r % width
            light = (t // P) % 2 == 1
            pid_m = gl.where(light, i, n_m - 1 - i)
            valid = (u < n_half * BH) & ~(light & (2 * i == n_m - 1))  # (an odd n_m's middle block: once)
        else:
            first = t // (n_m * SEC) * SEC
            r = t % (n_m * SEC)
            width = gl.minimum(SEC, BH - first)
            pid_m = n_m - 1 - r // width
            bh = first + r % width
    else:
        pid_m = t % n_m
        bh = t // n_m
    off_b = (bh // Hq).to(gl.int64)
    off_h = (bh % Hq).to(gl.int64)
    start_m = pid_m * BLOCK_M
    q_start = 0
    k_start = 0
    if IS_VARLEN:
        q_start = gl.load(CU_Q + off_b).to(gl.int64)
        k_start = gl.load(CU_K + off_b).to(gl.int64)
        Sq = (gl.load(CU_Q + off_b + 1) - q_start).to(gl.int32)
        Sk = (gl.load(CU_K + off_b + 1) - k_start).to(gl.int32)
        causal_shift = Sk - Sq + win_right
        longest = gl.maximum(Sq, Sk)
        Sq = gl.where((longest < LEN_LO) | (longest >= LEN_HI), 0, Sq)
    hi = Sk
    full_hi = Sk // BLOCK_N * BLOCK_N
    if CAUSAL:
        hi = gl.minimum(gl.maximum(start_m + BLOCK_M + causal_shift, 0), Sk)
        full_hi = gl.minimum(gl.maximum(start_m + causal_shift + 1, 0) // BLOCK_N * BLOCK_N, full_hi)
    return (valid, start_m, off_b, off_h, off_h // GROUP, q_start, k_start, Sq, Sk, causal_shift,
            gl.cdiv(hi, BLOCK_N), full_hi // BLOCK_N)


@gluon.jit
def _pairs(n_m, BH):
    """A causal order of pairs of query blocks (see _tile): more tiles than programs."""
    return n_m * BH > gl.num_programs(0)


@gluon.jit
def _n_tiles(n_m, BH, CAUSAL: gl.constexpr):
    """The turns of the persistent loop (see _tile): the tiles; causal with pairs, two turns per pair
    for every program, whole rounds."""
    n = n_m * BH
    if CAUSAL:
        P = gl.num_programs(0)
        n_pairs = (n_m + 1) // 2 * BH
        if _pairs(n_m, BH):
            n = 2 * P * gl.cdiv(n_pairs, P)
    return n


@gluon.constexpr_function
def _store_layout(rows, head_dim):
    """The O store's layout for a consumer's [rows, head_dim] tile (rows = 64, a warpgroup's): each
    thread holds 4 contiguous columns (an 8-byte store), a quad of lanes 16 columns of one row (a
    whole 32-byte sector), the lanes' other bits rows 1, 2, 4, and each warp the same 16 rows as in
    the wgmma accumulator (register bit: row 8). The accumulator converts into it with one round of
    warp shuffles, no shared memory (twenty-fourth session: straight from the accumulator, two bf16
    per thread and store, the second consumer's epilogue took 2.8 us per tile at D=128; 8 columns
    per thread needs a 2 KB shared scratch per consumer, which D=128 lacks, or two rounds, no
    faster)."""
    reg = [[0, 1], [0, 2], [8, 0]] + [[0, c] for c in (16, 32, 64, 128) if c < head_dim]
    return gl.DistributedLinearLayout(reg, [[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]], [[16, 0], [32, 0]], [],
                                      [rows, head_dim])


@gluon.jit
def _stamp(TRACE_BUF, i, slot: gl.constexpr, TRACE: gl.constexpr):
    """TRACE (a measurement, benchmarks/experiments/tile_trace.py): the SM's cycle counter at this
    point of this program's i-th tile, into TRACE_BUF[program, i, slot] (int64, TRACE_TILES tiles of
    TRACE_SLOTS slots per program; later tiles are not recorded). Nothing when TRACE is off."""
    if TRACE:
        now = gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r", [i], dtype=gl.int64, is_pure=False,
                                        pack=1)
        at = (gl.program_id(0) * TRACE_TILES + i) * TRACE_SLOTS + slot
        gl.store(TRACE_BUF + at, now, mask=i < TRACE_TILES)


@gluon.jit
def _producer(args, CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
              V_STAGES: gl.constexpr, Q_BUFS: gl.constexpr, NC: gl.constexpr, IS_VARLEN: gl.constexpr,
              DESC_ONCE: gl.constexpr, TRACE: gl.constexpr):
    """TMA loads, tile after tile: K block j into K ring slot (J + j) % STAGES once both consumers
    released the K block that was there, V block j likewise into the V ring of V_STAGES slots
    (block 0 always: the consumers read it even when no key is visible), and the tile's Q (NC
    pieces of 64 rows, a consumer's each) after its first K block, into a Q buffer every consumer
    is done with.
    K_APART: a K slot is released as soon as both S products that read it are done, a step before
    its V slot, so K block j + STAGES - 1 loads while step j runs (else with its V). Runs into the
    next tile while the consumers finish this one.

    DESC_ONCE (dense calls only): the descriptors span the whole tensors as (batch, head, row, dim),
    made once per program, and a tile's loads give its coordinates; else they are made per tile
    over its sequence and head, and a tile's first loads wait until every load through the last
    tile's descriptors has landed (their scratch is rewritten). ``args``: the kernel's runtime values
    (see _consumer)."""
    (Q, K, V, stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
     q_smem, k_smem, v_smem, q_bars, q_empty, k_bars, v_bars, k_empty, v_empty, n_tiles, n_m, BH, SEC, Hq, GROUP, Sq,
     Sk, causal_shift, win_right, CU_Q, CU_K, LEN_LO, LEN_HI, TRACE_BUF) = args
    BLOCK_M: gl.constexpr = NC * HALF
    layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    layout4: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=4)
    if DESC_ONCE:
        gl.static_assert(not IS_VARLEN, "a packed call's descriptors are per sequence")
        q_desc = tma.make_tensor_descriptor(Q, [BH // Hq, Hq, Sq, HEAD_DIM], [stride_qb, stride_qh, stride_qm, 1],
                                            [1, 1, HALF, HEAD_DIM], layout4)
        k_desc = tma.make_tensor_descriptor(K, [BH // Hq, Hq // GROUP, Sk, HEAD_DIM],
                                            [stride_kb, stride_kh, stride_kn, 1], [1, 1, BLOCK_N, HEAD_DIM], layout4)
        v_desc = tma.make_tensor_descriptor(V, [BH // Hq, Hq // GROUP, Sk, HEAD_DIM],
                                            [stride_vb, stride_vh, stride_vn, 1], [1, 1, BLOCK_N, HEAD_DIM], layout4)
    J = 0  # K / V blocks loaded so far (all tiles)
    i = 0  # this program's tiles so far
    for t in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
        live, start_m, off_b, off_h, off_hk, q_start, k_start, sq, sk, shift, n_blocks, n_full = _tile(
            t, n_m, BH, SEC, Hq, GROUP, Sq, Sk, causal_shift, win_right, CU_Q, CU_K, LEN_LO, LEN_HI, CAUSAL, BLOCK_M,
            BLOCK_N, IS_VARLEN)
        k_rows = sk
        if IS_VARLEN:
            live = live & (start_m < sq)
            # a sequence with no key: a one-row descriptor at the tensor's start (every key is masked)
            k_rows = gl.maximum(sk, 1)
            if sk == 0:
                k_start = k_start * 0
        if live:
            _stamp(TRACE_BUF, i, 16, TRACE)
            if not DESC_ONCE:
                if i > 0:  # the last tile's loads have landed: the descriptors' scratch can be rewritten
                    mbarrier.wait(q_bars.index((i - 1) % Q_BUFS), ((i - 1) // Q_BUFS) & 1)
                    for s in gl.static_range(STAGES):
                        back = gl.maximum(J - 1 - s, 0)
                        mbarrier.wait(k_bars.index(back % STAGES), (back // STAGES) & 1, pred=J - 1 - s >= 0)
                    for s in gl.static_range(V_STAGES):
                        back = gl.maximum(J - 1 - s, 0)
                        mbarrier.wait(v_bars.index(back % V_STAGES), (back // V_STAGES) & 1, pred=J - 1 - s >= 0)
                q_desc = tma.make_tensor_descriptor(Q + off_b * stride_qb + q_start * stride_qm + off_h * stride_qh,
                                                    [sq, HEAD_DIM], [stride_qm, 1], [HALF, HEAD_DIM], layout)
                k_desc = tma.make_tensor_descriptor(K + off_b * stride_kb + k_start * stride_kn + off_hk * stride_kh,
                                                    [k_rows, HEAD_DIM], [stride_kn, 1], [BLOCK_N, HEAD_DIM], layout)
                v_desc = tma.make_tensor_descriptor(V + off_b * stride_vb + k_start * stride_vn + off_hk * stride_vh,
                                                    [k_rows, HEAD_DIM], [stride_vn, 1], [BLOCK_N, HEAD_DIM], layout)
            b32 = off_b.to(gl.int32)
            h32 = off_h.to(gl.int32)
            hk32 = off_hk.to(gl.int32)
            nb = gl.maximum(n_blocks, 1)
            for j in range(0, nb):
                jj = J + j
                slot = jj % STAGES
                # first use of a slot: parity 1 passes at once (an mbarrier starts as if phase -1 completed)
                mbarrier.wait(k_empty.index(slot), ((jj // STAGES) & 1) ^ 1)
                if j == 0:
                    _stamp(TRACE_BUF, i, 17, TRACE)
                mbarrier.expect(k_bars.index(slot), k_desc.block_type.nbytes)
                _load_tile(k_desc, b32, hk32, j * BLOCK_N, k_bars.index(slot), k_smem.index(slot), DESC_ONCE)
                if j == 0:  # Q after the first K block: its buffer frees up last
                    qb = i % Q_BUFS
                    mbarrier.wait(q_empty.index(qb), ((i // Q_BUFS) & 1) ^ 1)
                    _stamp(TRACE_BUF, i, 18, TRACE)
                    mbarrier.expect(q_bars.index(qb), NC * q_desc.block_type.nbytes)
                    for c in gl.static_range(NC):
                        _load_tile(q_desc, b32, h32, start_m + c * HALF, q_bars.index(qb), q_smem.index(NC * qb + c),
                                   DESC_ONCE)
                v_slot = jj % V_STAGES
                mbarrier.wait(v_empty.index(v_slot), ((jj // V_STAGES) & 1) ^ 1)
                mbarrier.expect(v_bars.index(v_slot), v_desc.block_type.nbytes)
                _load_tile(v_desc, b32, hk32, j * BLOCK_N, v_bars.index(v_slot), v_smem.index(v_slot), DESC_ONCE)
            _stamp(TRACE_BUF, i, 19, TRACE)
            J += nb
            i += 1


@gluon.jit
def _load_tile(desc, b, h, row, bar, dst, DESC_ONCE: gl.constexpr):
    """``dst`` (rows x head dim) from row ``row`` on: through the whole tensor's descriptor at batch
    ``b`` and head ``h`` (DESC_ONCE), else through the tile's own 2-d descriptor."""
    if DESC_ONCE:
        tma.async_copy_global_to_shared(desc, [b, h, row, 0], bar, dst.reshape([1, 1, dst.shape[0], dst.shape[1]]))
    else:
        tma.async_copy_global_to_shared(desc, [row, 0], bar, dst)


@gluon.jit
def _consumer_steps(lo, hi, J, T, WG: gl.constexpr, NC: gl.constexpr, q, k_smem, v_smem, k_bars, v_bars, k_empty,
                    v_empty, turn_bars, acc, p, m_i, l_i, s_zero, offs_m, offs_n, Sk, causal_shift, qk_scale,
                    MASKED: gl.constexpr, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                    V_STAGES: gl.constexpr,
                    K_APART: gl.constexpr, o_layout: gl.constexpr, p_layout: gl.constexpr,
                    SPLIT_WAIT: gl.constexpr = False, TREE_MAX: gl.constexpr = False):
    """Key blocks [lo, hi) of one consumer: its turn (step j is the consumer's j-th turn), S_j and
    P_{j-1} V_{j-1} issued, the turn handed over, both products awaited, the softmax of S_j, the
    rescale; V block j-1's slot released, and K block j's (K_APART) or j-1's. The K ring has STAGES
    slots, the V ring V_STAGES. The rings' blocks and the turns count from J and T (0 here; a
    program that walks several tiles passes what its earlier tiles used).

    SPLIT_WAIT (D=128 and D=256, twenty-sixth session; FlashAttention-3's intra-warpgroup overlap): the
    softmax of S_j starts once S_j is done, while P_{j-1} V_{j-1} still runs (awaited before the
    rescale); the K slot is released after the first wait, the V slot after the second. The same
    arithmetic (bitwise the default)."""
    FIRST: gl.constexpr = 1 if WG == 0 else 0
    for j in range(lo, hi):
        slot = (J + j) % STAGES
        prev = (J + j - 1) % STAGES
        v_prev = (J + j - 1) % V_STAGES
        mbarrier.wait(k_bars.index(slot), ((J + j) // STAGES) & 1)
        mbarrier.wait(v_bars.index(v_prev), ((J + j - 1) // V_STAGES) & 1)
        # turn k of consumer c waits for phase k of its barrier (consumer c - 1's turn k); consumer 0's
        # for phase k - 1 (consumer NC - 1's turn k - 1: the first passes at once)
        mbarrier.wait(turn_bars.index(WG), ((T + j) & 1) ^ FIRST)
        s = warpgroup_mma(q, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        acc = warpgroup_mma(p, v_smem.index(v_prev), acc, is_async=True)
        mbarrier.arrive(turn_bars.index((WG + 1) % NC))
        if SPLIT_WAIT:
            s = warpgroup_mma_wait(num_outstanding=1, deps=(s, ))
        else:
            s, acc, p = warpgroup_mma_wait(num_outstanding=0, deps=(s, acc, p))
        if K_APART:
            mbarrier.arrive(k_empty.index(slot))
        else:
            mbarrier.arrive(k_empty.index(prev))
        if not SPLIT_WAIT:
            mbarrier.arrive(v_empty.index(v_prev))
        p32, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, offs_m, offs_n, j * BLOCK_N, Sk, causal_shift, qk_scale,
                                             MASKED, CAUSAL, TREE_MAX)
        if SPLIT_WAIT:  # P_{j-1} V_{j-1}, which ran through the softmax
            acc, p = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p))
            mbarrier.arrive(v_empty.index(v_prev))
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
        p = gl.convert_layout(_to16(p32, k_smem.dtype), p_layout)
    return acc, p, m_i, l_i


@gluon.jit
def _consumer(WG: gl.constexpr, args, CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
              STAGES: gl.constexpr, V_STAGES: gl.constexpr, Q_BUFS: gl.constexpr, NC: gl.constexpr,
              IS_VARLEN: gl.constexpr, K_APART: gl.constexpr, TRACE: gl.constexpr, DESC_ONCE: gl.constexpr,
              O_TMA: gl.constexpr, SPLIT_WAIT: gl.constexpr, TREE_MAX: gl.constexpr):
    """Query rows [start_m + 64 WG, + 64) of each of the program's tiles over the tile's key blocks,
    then their output and lse. Ring slots, turns and Q buffers are counted across tiles. ``args``:
    the kernel's runtime values the consumers share (one tuple: a tuple assigned to a name in
    Gluon code turns its constexprs into tensors, so those come apart).

    O_TMA (two Q buffers only): the output goes through the consumer's own half of the
    tile's Q buffer, free once its S products are done, and a TMA store; the buffer is released
    for a later tile's Q once the store has read it, not after the loops (the other buffer holds
    the next tile's Q meanwhile). DESC_ONCE: one descriptor over the whole output, as the
    producer's; else one per tile over its sequence and head."""
    (O, LSE, stride_ob, stride_om, stride_oh, stride_lse_b, stride_lse_h, q_smem, k_smem, v_smem, q_bars, q_empty,
     k_bars, v_bars, k_empty, v_empty, turn_bars, n_tiles, n_m, BH, SEC, Hq, GROUP, Sq, Sk, causal_shift, win_right,
     CU_Q, CU_K, LEN_LO, LEN_HI, qk_scale, TRACE_BUF) = args
    BLOCK_M: gl.constexpr = NC * HALF
    FIRST: gl.constexpr = 1 if WG == 0 else 0
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    s_zero = gl.zeros([HALF, BLOCK_N], gl.float32, s_layout)
    if O_TMA:
        gl.static_assert(Q_BUFS == 2, "O_TMA stores through the tile's Q buffer: the next tile's Q needs the other")
        if DESC_ONCE:
            o_desc = tma.make_tensor_descriptor(
                O, [BH // Hq, Hq, Sq, HEAD_DIM], [stride_ob, stride_oh, stride_om, 1], [1, 1, HALF, HEAD_DIM],
                gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=4))
    J = 0  # K / V blocks consumed so far (all tiles)
    T = 0  # turns taken so far
    i = 0
    for t in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
        live, start_m, off_b, off_h, off_hk, q_start, k_start, sq, sk, shift, n_blocks, n_full = _tile(
            t, n_m, BH, SEC, Hq, GROUP, Sq, Sk, causal_shift, win_right, CU_Q, CU_K, LEN_LO, LEN_HI, CAUSAL, BLOCK_M,
            BLOCK_N, IS_VARLEN)
        if IS_VARLEN:
            live = live & (start_m < sq)
        if live:
            _stamp(TRACE_BUF, i, 8 * WG, TRACE)
            row0 = start_m + WG * HALF
            offs_m = row0 + gl.arange(0, HALF, layout=gl.SliceLayout(1, s_layout))
            m_i = gl.full([HALF], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
            l_i = gl.zeros([HALF], gl.float32, gl.SliceLayout(1, s_layout))
            acc = gl.zeros([HALF, HEAD_DIM], gl.float32, o_layout)
            qb = i % Q_BUFS
            q = q_smem.index(NC * qb + WG)

            # block 0 (without the mask where the whole tile needs none: n_full > 0)
            mbarrier.wait(q_bars.index(qb), (i // Q_BUFS) & 1)
            _stamp(TRACE_BUF, i, 8 * WG + 1, TRACE)
            mbarrier.wait(k_bars.index(J % STAGES), (J // STAGES) & 1)
            mbarrier.wait(turn_bars.index(WG), (T & 1) ^ FIRST)
            _stamp(TRACE_BUF, i, 8 * WG + 2, TRACE)
            s = warpgroup_mma(q, k_smem.index(J % STAGES).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            mbarrier.arrive(turn_bars.index((WG + 1) % NC))
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
            if K_APART:
                mbarrier.arrive(k_empty.index(J % STAGES))
            if n_full > 0:
                p32, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, offs_m, offs_n, 0, sk, shift, qk_scale, False,
                                                     CAUSAL, TREE_MAX)
            else:
                p32, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, offs_m, offs_n, 0, sk, shift, qk_scale, True,
                                                     CAUSAL, TREE_MAX)
            p = gl.convert_layout(_to16(p32, dtype), p_layout)

            acc, p, m_i, l_i = _consumer_steps(1, gl.maximum(n_full, 1), J, T, WG, NC, q, k_smem, v_smem, k_bars,
                                               v_bars, k_empty, v_empty, turn_bars, acc, p, m_i, l_i, s_zero, offs_m,
                                               offs_n, sk, shift, qk_scale, False, CAUSAL, BLOCK_N, STAGES, V_STAGES,
                                               K_APART, o_layout, p_layout, SPLIT_WAIT, TREE_MAX)
            acc, p, m_i, l_i = _consumer_steps(gl.maximum(n_full, 1), n_blocks, J, T, WG, NC, q, k_smem, v_smem, k_bars,
                                               v_bars, k_empty, v_empty, turn_bars, acc, p, m_i, l_i, s_zero, offs_m,
                                               offs_n, sk, shift, qk_scale, True, CAUSAL, BLOCK_N, STAGES, V_STAGES,
                                               K_APART, o_layout, p_layout, SPLIT_WAIT, TREE_MAX)
            if not O_TMA:  # every S of the tile is done: its Q buffer can take a later tile's Q
                mbarrier.arrive(q_empty.index(qb))
            # the last block's P V, in turn
            _stamp(TRACE_BUF, i, 8 * WG + 3, TRACE)
            nb = gl.maximum(n_blocks, 1)
            last = J + nb - 1
            mbarrier.wait(v_bars.index(last % V_STAGES), (last // V_STAGES) & 1)
            mbarrier.wait(turn_bars.index(WG), ((T + nb) & 1) ^ FIRST)
            acc = warpgroup_mma(p, v_smem.index(last % V_STAGES), acc, is_async=True)
            mbarrier.arrive(turn_bars.index((WG + 1) % NC))
            acc, p = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p))
            _stamp(TRACE_BUF, i, 8 * WG + 4, TRACE)
            mbarrier.arrive(v_empty.index(last % V_STAGES))
            if not K_APART:
                mbarrier.arrive(k_empty.index(last % STAGES))

            # rows that saw no key: output 0, lse -inf
            seen = l_i > 0.0
            l_safe = gl.where(seen, l_i, 1.0)
            lse = gl.where(seen, (m_i + gl.log2(l_safe)) * LN2, float("-inf"))
            gl.store(LSE + off_b * stride_lse_b + off_h * stride_lse_h + q_start + offs_m, lse, mask=offs_m < sq)
            inv = gl.convert_layout(1.0 / l_safe, gl.SliceLayout(1, o_layout))
            out = (acc * gl.expand_dims(inv, 1)).to(dtype)
            o_base = O + off_b * stride_ob + q_start * stride_om + off_h * stride_oh  # the tile's sequence and head
            if O_TMA:
                q.store(out)
                fence_async_shared()
                gl.thread_barrier()  # the warpgroup's four warps have written their rows
                if DESC_ONCE:
                    tma.async_copy_shared_to_global(o_desc, [off_b.to(gl.int32), off_h.to(gl.int32), row0, 0],
                                                    q.reshape([1, 1, HALF, HEAD_DIM]))
                else:
                    o_tile = tma.make_tensor_descriptor(o_base, [sq, HEAD_DIM], [stride_om, 1], [HALF, HEAD_DIM],
                                                        q_smem.type.layout)
                    tma.async_copy_shared_to_global(o_tile, [row0, 0], q)
                tma.store_wait(0)
                gl.thread_barrier()  # both warps' stores (a box of 64 columns each at D=128) have read it
                mbarrier.arrive(q_empty.index(qb))
            else:
                st_layout: gl.constexpr = _store_layout(HALF, HEAD_DIM)
                out = gl.convert_layout(out, st_layout)  # 8-byte stores of whole sectors (_store_layout)
                o_rows = row0 + gl.arange(0, HALF, layout=gl.SliceLayout(1, st_layout))
                o_cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, st_layout))
                p_o = o_base + gl.expand_dims(o_rows.to(gl.int64) * stride_om, 1) + gl.expand_dims(o_cols, 0)
                gl.store(p_o, out, mask=gl.expand_dims(o_rows < sq, 1))
            _stamp(TRACE_BUF, i, 8 * WG + 5, TRACE)
            J += nb
            T += nb + 1
            i += 1


@gluon.jit
def _fwd_ws_kernel(
    Q, K, V, O, LSE, CU_Q, CU_K, LEN_LO, LEN_HI,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_ob, stride_om, stride_oh,
    stride_lse_b, stride_lse_h,
    Hq, GROUP, Sq, Sk, win_right, qk_scale, BH, SEC, TRACE_BUF,
    CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, V_STAGES: gl.constexpr,
    Q_BUFS: gl.constexpr, num_warps: gl.constexpr, IS_VARLEN: gl.constexpr = False, K_APART: gl.constexpr = False,
    DESC_ONCE: gl.constexpr = False, TRACE: gl.constexpr = False, O_TMA: gl.constexpr = False, NC: gl.constexpr = 2,
    SPLIT_WAIT: gl.constexpr = False, TREE_MAX: gl.constexpr = False,
):
    gl.static_assert(num_warps == 4, "the default partition is one consumer warpgroup")
    gl.static_assert((NC == 2) | (NC == 3), "two or three consumer warpgroups")
    gl.static_assert((NC == 2) | (not TRACE), "the trace's slots are laid out for two consumers")
    BLOCK_M: gl.constexpr = NC * HALF
    dtype: gl.constexpr = Q.dtype.element_ty
    tile_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    n_m = gl.cdiv(Sq, BLOCK_M)
    n_tiles = _n_tiles(n_m, BH, CAUSAL)
    causal_shift = Sk - Sq + win_right  # (IS_VARLEN: per sequence, in _tile)

    q_smem = gl.allocate_shared_memory(dtype, [NC * Q_BUFS, HALF, HEAD_DIM], tile_layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], tile_layout)
    v_smem = gl.allocate_shared_memory(dtype, [V_STAGES, BLOCK_N, HEAD_DIM], tile_layout)
    q_bars = gl.allocate_shared_memory(gl.int64, [Q_BUFS, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [Q_BUFS, 1], mbarrier.MBarrierLayout())
    k_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_bars = gl.allocate_shared_memory(gl.int64, [V_STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [V_STAGES, 1], mbarrier.MBarrierLayout())
    turn_bars = gl.allocate_shared_memory(gl.int64, [NC, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(Q_BUFS):
        mbarrier.init(q_bars.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=NC)  # every consumer is done with the buffer
    for i in gl.static_range(STAGES):
        mbarrier.init(k_bars.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=NC)  # every consumer releases a slot
    for i in gl.static_range(V_STAGES):
        mbarrier.init(v_bars.index(i), count=1)
        mbarrier.init(v_empty.index(i), count=NC)
    for i in gl.static_range(NC):
        mbarrier.init(turn_bars.index(i), count=1)
    fence_async_shared()

    args = (O, LSE, stride_ob, stride_om, stride_oh, stride_lse_b, stride_lse_h, q_smem, k_smem, v_smem, q_bars,
            q_empty, k_bars, v_bars, k_empty, v_empty, turn_bars, n_tiles, n_m, BH, SEC, Hq, GROUP, Sq, Sk,
            causal_shift, win_right, CU_Q, CU_K, LEN_LO, LEN_HI, qk_scale, TRACE_BUF)
    pargs = (Q, K, V, stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
             q_smem, k_smem, v_smem, q_bars, q_empty, k_bars, v_bars, k_empty, v_empty, n_tiles, n_m, BH, SEC, Hq,
             GROUP, Sq, Sk, causal_shift, win_right, CU_Q, CU_K, LEN_LO, LEN_HI, TRACE_BUF)
    if NC == 2:
        gl.warp_specialize([
            (_consumer, (0, args, CAUSAL, HEAD_DIM, BLOCK_N, STAGES, V_STAGES, Q_BUFS, NC, IS_VARLEN, K_APART, TRACE,
                         DESC_ONCE, O_TMA, SPLIT_WAIT, TREE_MAX)),
            (_consumer, (1, args, CAUSAL, HEAD_DIM, BLOCK_N, STAGES, V_STAGES, Q_BUFS, NC, IS_VARLEN, K_APART, TRACE,
                         DESC_ONCE, O_TMA, SPLIT_WAIT, TREE_MAX)),
            (_producer, (pargs, CAUSAL, HEAD_DIM, BLOCK_N, STAGES, V_STAGES, Q_BUFS, NC, IS_VARLEN, DESC_ONCE, TRACE))],
            [4, 1], [240, 24])
    else:  # the registers of 16 warps x MAXNREG_3 (128): 160 per consumer thread, 24 per producer thread
        gl.warp_specialize([
            (_consumer, (0, args, CAUSAL, HEAD_DIM, BLOCK_N, STAGES, V_STAGES, Q_BUFS, NC, IS_VARLEN, K_APART, TRACE,
                         DESC_ONCE, O_TMA, SPLIT_WAIT, TREE_MAX)),
            (_consumer, (1, args, CAUSAL, HEAD_DIM, BLOCK_N, STAGES, V_STAGES, Q_BUFS, NC, IS_VARLEN, K_APART, TRACE,
                         DESC_ONCE, O_TMA, SPLIT_WAIT, TREE_MAX)),
            (_consumer, (2, args, CAUSAL, HEAD_DIM, BLOCK_N, STAGES, V_STAGES, Q_BUFS, NC, IS_VARLEN, K_APART, TRACE,
                         DESC_ONCE, O_TMA, SPLIT_WAIT, TREE_MAX)),
            (_producer, (pargs, CAUSAL, HEAD_DIM, BLOCK_N, STAGES, V_STAGES, Q_BUFS, NC, IS_VARLEN, DESC_ONCE, TRACE))],
            [4, 4, 1], [160, 160, 24])


def grid(q, n_tiles: int) -> tuple[int]:
    """One program per SM (``PROGRAMS`` when set: tests run many tiles per program), at most one per tile."""
    return (min(n_tiles, PROGRAMS or sm_count(q.device)),)


def section_heads(bh: int, group: int, keys: int, q) -> int:
    """Heads per section of the causal order (see _tile): the query heads of as many kv heads as
    fill half of L2 with their K and V (``keys`` keys each), whole groups, at least one group;
    ``HEADS_PER_SECTION`` when set. (A section of all ``bh`` heads is the order by query block
    alone: at S=16384, B=4, its programs shared little K / V, 8% below one program per tile.)"""
    if HEADS_PER_SECTION:
        return min(HEADS_PER_SECTION, bh)
    kv_heads = l2_bytes(q.device) // 2 // max(1, 2 * keys * q.shape[-1] * q.element_size())
    return min(bh, max(1, kv_heads) * group)


def desc_once(q, k, v, varlen: bool) -> bool:
    """The producer's DESC_ONCE: a dense call whose batch and head strides are not 0 (an expanded
    tensor keeps the per-tile descriptors, which fold those strides into the base address)."""
    return not varlen and all(t.stride(0) != 0 and t.stride(2) != 0 for t in (q, k, v))


def _trace_buf(lse):
    """The kernel's TRACE_BUF: :data:`TRACE_BUF` when set, else ``lse`` (not read: TRACE is off)."""
    return lse if TRACE_BUF is None else TRACE_BUF


def launch_args(q, k, v, out, lse, win_right: int, qk_scale: float, cu_seqlens=None, max_seqlens=None,
                lengths=(0, LENGTH_CAP)) -> tuple:
    """Runtime arguments of :func:`_fwd_ws_kernel`: q / out (B, Sq, Hq, D), k / v (B, Sk, Hkv, D)
    with unit dim stride, lse (B, Hq, Sq) contiguous; ``win_right``: query i sees keys
    j <= i + Sk - Sq + win_right when the kernel's CAUSAL is set (0: flash-attn's causal).
    Variable length (the kernel's IS_VARLEN): ``cu_seqlens`` (cu_q, cu_k) int32 (B + 1,),
    ``max_seqlens`` (max_q, max_k); q / out (total_q, Hq, D), k / v (total_k, Hkv, D), lse (Hq, total_q);
    ``lengths`` (lo, hi): the launch serves the sequences whose longest side is in [lo, hi) (a
    length class, launch.length_classes). Then B x Hq (with the longest query length, the number
    of tiles), the causal order's heads per section (:func:`section_heads`) and the trace buffer
    (:func:`_trace_buf`)."""
    if cu_seqlens is None:
        hq, hkv = q.shape[2], k.shape[2]
        bh = q.shape[0] * hq
        return (q, k, v, out, lse, q, q, *lengths, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3],
                lse.stride(0), lse.stride(1), hq, hq // hkv, q.shape[1], k.shape[1], win_right, qk_scale,
                bh, section_heads(bh, hq // hkv, k.shape[1], q), _trace_buf(lse))
    hq, hkv = q.shape[1], k.shape[1]
    bh = (cu_seqlens[0].shape[0] - 1) * hq
    return (q, k, v, out, lse, *cu_seqlens, *lengths, 0, *q.stride()[:2], 0, *k.stride()[:2], 0, *v.stride()[:2],
            0, *out.stride()[:2], 0, lse.stride(0), hq, hq // hkv, *max_seqlens, win_right, qk_scale,
            bh, section_heads(bh, hq // hkv, max_seqlens[1], q), _trace_buf(lse))
