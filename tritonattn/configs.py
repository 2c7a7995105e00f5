"""Tile configurations: the one place that decides block sizes, warps and pipelining depth.

Keyed by (arch, mode, padded head dim, element size). The measurement behind each sm90 entry is
in benchmarks/NOTES.md. No autotuning on the default path: the first call of a shape costs
only compilation.
"""

from __future__ import annotations

import functools
import logging
import math
import os
from contextlib import contextmanager
from typing import NamedTuple

import torch
from triton.runtime.errors import OutOfResources

_log = logging.getLogger("tritonattn")


class TileConfig(NamedTuple):
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    # dK / dV kernel only: programs per key block, each accumulating head_dim / d_split columns
    d_split: int = 1
    # dK / dV kernel only: one launch for dV, one for dK, each over all of D (5 products per tile
    # where the head-dim split in two runs 6; half the accumulators of an unsplit program). Not
    # with d_split > 1 (split_grads wins); the atomic-dQ path ignores both
    split_grads: bool = False


_OFF = ("", "0", "false", "off", "no")


class _EncodedKeys(dict):
    """Environment variable names as os.environ stores them (encoded once, not at every read)."""

    def __missing__(self, name: str):
        key = self[name] = _ENVIRON.encodekey(name)
        return key


_ENVIRON = os.environ
_ENV_DATA = getattr(_ENVIRON, "_data", None)  # CPython's store behind os.environ: {encoded name: encoded value}
_ENV_KEYS = _EncodedKeys()


def getenv(name: str) -> str | None:
    """``os.environ.get(name)``, read at every call as that is, in a fifth of its time when the
    variable is unset (0.22 against 1.3 us on a 2-core host: Mapping.get encodes the name and
    raises and catches a KeyError for a miss). The launchers read several switches per call (the
    backward 8; twenty-eighth session). Falls back to os.environ.get where os.environ has been
    replaced or is not CPython's."""
    if os.environ is _ENVIRON and _ENV_DATA is not None:
        value = _ENV_DATA.get(_ENV_KEYS[name])
        return None if value is None else _ENVIRON.decodevalue(value)
    return os.environ.get(name)


def env_flag(name: str, default: bool | None = False) -> bool | None:
    """An on/off environment switch: "", "0", "false", "off" and "no" (any case) are off, anything
    else on; unset: ``default``."""
    value = getenv(name)
    return default if value is None else value.strip().lower() not in _OFF


def interpreting() -> bool:
    """True when Triton kernels run on the CPU through the interpreter (TRITON_INTERPRET=1)."""
    return env_flag("TRITON_INTERPRET")


def padded_head_dim(head_dim: int) -> int:
    """Head dims that are not powers of two are padded inside the kernel (masked loads)."""
    return max(16, 1 << (head_dim - 1).bit_length())


def dot_in_fp32(dtype: torch.dtype) -> bool:
    """Upcast bf16 dot operands under the interpreter, whose bf16 tl.dot is wrong."""
    return dtype == torch.bfloat16 and interpreting()


def dot_precision(dtype: torch.dtype) -> str:
    """Products of fp32 inputs are full fp32 ("ieee": no silent tf32). Ignored for 16-bit operands.

    "tf32x3" (three tf32 tensor-core products) compiled 3x faster on the H200 but missed the
    tolerance rule once (dv error 7.2e-7 against a bound of 5.3e-7, 2026-11-29), so it is not used.
    """
    return "ieee" if dtype == torch.float32 else "tf32"


C = TileConfig

# Program order of the forward, dQ and dK/dV kernels under a causal mask (or a window's right
# edge): heads first (every head's heaviest block before any head's next one) or blocks first
# (one head's blocks, then the next head's). None: chosen per call by heads_first(); True / False:
# forced (TRITONATTN_HEADS_FIRST=1 / 0, read once here; the tests and the benchmark set it).
HEADS_FIRST: bool | None = env_flag("TRITONATTN_HEADS_FIRST", default=None)


@functools.cache
def _l2_bytes(index: int) -> int:
    return torch.cuda.get_device_properties(index).L2_cache_size


# Software pipelining of the dK/dV kernel's masked (diagonal) query loop: None (the tile's
# num_stages, as the unmasked loop) or a stage count (TRITONATTN_DKDV_MASKED_STAGES, read once here;
# 1 = not pipelined, which frees registers: an experiment, benchmarks/NOTES.md).
DKDV_MASKED_STAGES: int | None = max(1, int(os.environ["TRITONATTN_DKDV_MASKED_STAGES"])) \
    if os.environ.get("TRITONATTN_DKDV_MASKED_STAGES") else None

# Batch invariance (TRITONATTN_BATCH_INVARIANT=1, read once here): no tile chosen by the call's
# lengths or size (the short and wide tiles below), so a sequence's result is bitwise the same
# whatever else the batch holds, dense or varlen, forward and backward (packed sequences match their
# own dense calls by default too, through length classes: launch.length_classes): every tile then depends only
# on the GPU, head dim, dtype, causal mask and kernel (and the bias / dropout caps). Off by default:
# those tiles gained 3-21% at S <= 1024 (benchmarks/NOTES.md).
BATCH_INVARIANT: bool = env_flag("TRITONATTN_BATCH_INVARIANT")

# Dense calls shaped like a decoding step (a few queries per kv head over many keys: transformers'
# generate calls flash_attn_func with one query over its whole cache each step) take the split-KV
# decoding kernel (kernels/decode.py: a kv head's GQA group of queries in one tile, the keys split
# over the SMs) instead of the forward kernel (a program per query head, whose one query row fills a
# 64-128-row tile, and only B x Hq programs). Up to DENSE_DECODE_ROWS query rows (Sq x group) per kv
# head, from DENSE_DECODE_MIN_KEYS keys; not with a bias, a mask, dropout or BATCH_INVARIANT (the
# decoding kernel's splits follow the batch). TRITONATTN_DENSE_DECODE=0 (read once here) keeps
# every dense call on the forward kernel. Such a call is then within rounding, not bitwise, of the
# same sequence inside a packed (varlen) call, which keeps the forward kernel.
DENSE_DECODE: bool = env_flag("TRITONATTN_DENSE_DECODE", default=True)
DENSE_DECODE_ROWS = 64
DENSE_DECODE_MIN_KEYS = 256


def dense_decode(Sq: int, Sk: int, Hq: int, Hkv: int) -> bool:
    """Whether a dense call of these sizes (with no bias, mask or dropout) takes the decoding kernel
    (see :data:`DENSE_DECODE`)."""
    return (DENSE_DECODE and not BATCH_INVARIANT and 0 < Sq * (Hq // Hkv) <= DENSE_DECODE_ROWS
            and Sk >= DENSE_DECODE_MIN_KEYS)


# Split-KV decoding (kernels/decode.py, num_splits=0) over a cache of at most this many rows: one
# split, whose program writes the output (one launch, no combine). An eager decoding step is host
# bound there, and a second launch costs more than the split saves on the device. H100, bf16, Hq=32
# Hkv=8 D=128, L2 flushed by a read (fortieth session, benchmarks/NOTES.md): eager, B=1 / 1024 keys
# 16.7 us with one split against 26.3-27.6 with 2-16; B=4 / 1024 17.2 against 25.3-26.2; at 2048
# keys even (28.4 / 29.2 against 25.7-28.1), at 4096 splits win (51 against 26-30). As CUDA graph
# replays one split costs more (B=1 / 1024: 17.9 against 11.1-12.3 us; B=4: 18.5 against 15.3):
# graphs of short caches lose that much, eager steps gain more.
DECODE_ONE_SPLIT_KEYS: int = 1024

# Split-KV decoding's combine kernel (kernels/decode.py) through programmatic dependent launch
# (sm_90): it is launched while the split kernel runs and waits for it on the device (griddepcontrol),
# instead of starting after the split grid's end; for the short decoding steps where a launch gap is
# a sizeable share of the time. TRITONATTN_DECODE_PDL=1, read once here (tests and
# scripts/tune_decode.py set the switch). Off by default: as CUDA graph replays on the H200 it
# gained nothing (-6% to +0.3% at batch 1 / 8, caches of 4096 / 16384; benchmarks/NOTES.md,
# 2026-11-30, seventh session).
DECODE_PDL: bool = env_flag("TRITONATTN_DECODE_PDL")


# CUDA's limit on a grid's y and z sizes (x may hold 2^31 - 1 programs)
MAX_GRID_YZ = 65535


def heads_first(banded: bool, k: torch.Tensor, heads: int) -> bool:
    """Heads-first program order (batch x heads on the grid's x axis) for a call whose blocks
    differ in work (``banded``: a causal mask or a window's right edge), when K and V of every head
    fit in the GPU's L2 cache: measured on the H200 (llama bf16 causal, 2026-11-30,
    benchmarks/NOTES.md), heads first took 5-18% off the backward and 1-5% off the forward while
    K / V fit in the 50 MB L2 (B=4 S<=2048, B=1 S=8192), and cost 2-6% once they did not (every
    head's K / V streamed at once). Off on CPU tensors. Always when ``heads`` (batch x heads) is
    more than a grid's y axis may hold."""
    if heads > MAX_GRID_YZ:
        return True
    if not banded:
        return False
    if HEADS_FIRST is not None:
        return HEADS_FIRST
    return k.is_cuda and 2 * k.numel() * k.element_size() <= _l2_bytes(k.device.index)
# mode -> {(padded head dim, element bytes, causal): config}. Modes: fwd, bwd_dkdv, bwd_dq.
# bf16 / fp16 (element bytes 2): the fastest candidate of scripts/tune.py on the H200, S=8192, bf16
# (llama shape at D=128, 16k tokens x hidden 2048 at D=64 / 256), 2026-11-29; figures in
# benchmarks/NOTES.md. D=16 / 32 take D=64's entries (not measured separately).
# fp32 (element bytes 4) uses 32x32 tiles: its ieee dots compile to unrolled FMA code, and 64x32
# tiles took 100-200 s to compile per head dim on the H200; fp32 is the accuracy path, not the fast one.
# From D=128 on, 8 warps: with 4, every D=256 kernel spilled (dK/dV 17-18 KB per thread) and the forward
# and dQ kernels at D=128 spilled too; 8 warps spill nothing at D=256 and compile 3.3x faster (78 -> 22 s
# for the three kernels on a 2-core CPU, scripts/compile_check.py, benchmarks/NOTES.md).
_MEASURED = {
    # D: {mode: (non-causal config, causal config)}
    64: {"fwd": (C(128, 64, 8, 3), C(128, 64, 8, 3)),
         # causal (32, 128, 4, 3) with the backward's TMA: 363.3 TFLOP/s against 320.1 for the (32, 128, 4, 4)
         # that was fastest on the pointer path (344.1 there), 2026-11-30 (sixth session)
         "bwd_dkdv": (C(32, 128, 4, 3), C(32, 128, 4, 3)),
         "bwd_dq": (C(128, 64, 8, 3), C(128, 64, 8, 3))},
    128: {"fwd": (C(128, 128, 8, 3), C(128, 128, 8, 3)),
          # causal (64, 128, 8, 3): measured with the backward's TMA (the default), 421.9 TFLOP/s against
          # 390.4 for the (32, 64, 4, 3) it replaced (which is faster on the pointer path: 359.9 / 339.9),
          # 2026-11-30 (sixth session)
          "bwd_dkdv": (C(64, 128, 8, 3), C(64, 128, 8, 3)),
          "bwd_dq": (C(128, 64, 8, 3), C(128, 64, 8, 3))},
    256: {"fwd": (C(128, 64, 8, 2), C(128, 64, 8, 2)),
          # split by gradient (a dV launch and a dK launch): 2026-11-30 (fifth session), whole backward
          # 273.8 / 266.1 TFLOP/s (full / causal, S=8192) against 245.2 / ~250 for the head dim split in
          # two (32, 128, 8, 2, 2), which beat the best unsplit tiles by 12-13% (benchmarks/NOTES.md).
          # With the backward's TMA (sixth session) the 32-query tile, pipelined 2 deep, wins:
          # 292.3 / 299.6 against 270.8 / 278.2 for the fifth session's (64, 128, 8, 1, 1, True)
          "bwd_dkdv": (C(32, 128, 8, 2, 1, True), C(32, 128, 8, 2, 1, True)),
          "bwd_dq": (C(128, 32, 8, 3), C(128, 32, 8, 3))},
}


def _fp32_warps(padded_d: int) -> int:
    """Warps of every fp32 kernel (see above): 8 from D=128 on, where 4 spilled."""
    return 8 if padded_d >= 128 else 4


_FP32 = {d: C(32, 32, _fp32_warps(d), 1) for d in (16, 32, 64, 128, 256)}
_SM90 = {
    mode: {
        **{(d, 2, causal): _MEASURED[max(d, 64)][mode][causal] for d in (16, 32, 64, 128, 256)
           for causal in (False, True)},
        **{(d, 4, causal): _FP32[d] for d in (16, 32, 64, 128, 256) for causal in (False, True)},
    }
    for mode in ("fwd", "bwd_dkdv", "bwd_dq")
}
# Under the interpreter: unequal block sizes (so block-range arithmetic that assumes
# BLOCK_M == BLOCK_N fails the tests) and few enough iterations to keep CI fast.
_INTERP = {
    "fwd": C(64, 32, 4, 1),
    "bwd_dkdv": C(32, 64, 4, 1),
    "bwd_dq": C(64, 32, 4, 1),
}
_PREPROCESS = C(64, 0, 4, 1)
# the fused dQ's float32 buffer into dq (bwd._bwd_dq_convert_kernel): 64 rows of 128 x 4 bytes per program
DQ_CONVERT = C(64, 0, 4, 1)
# probabilities / dBias tiles (a testing aid and the bias-gradient pass): one tile per program
_TILE = {2: C(64, 64, 4, 2), 4: C(32, 32, 4, 1)}
_TILE_INTERP = C(32, 64, 4, 1)
# split-KV decoding: BLOCK_N keys per step (BLOCK_M is the packed GQA group x seqlen_q).
# Memory-bound: long key tiles and deep pipelining. Swept on the H200 (8 tiles x split counts, B = 1 / 8 /
# 64, 16k / 128k keys; scripts/tune_decode.py, benchmarks/NOTES.md 2026-11-30): (0, 128, 4, 3) within 1% of
# the best tile everywhere; the split count is what matters (kernels/decode.py pick_num_splits).
_DECODE = {(16, 2): C(0, 128, 4, 3), (32, 2): C(0, 128, 4, 3), (64, 2): C(0, 128, 4, 3), (128, 2): C(0, 128, 4, 3),
           (256, 2): C(0, 64, 4, 3)}
_DECODE_FP32 = C(0, 32, 4, 1)
_DECODE_INTERP = C(0, 32, 4, 1)

# Candidates of the sweep (scripts/tune.py) and of TRITONATTN_AUTOTUNE, by padded head dim (16 and 32
# use 64's). (BLOCK_M, BLOCK_N, num_warps, num_stages); for bwd_dkdv BLOCK_N is the key block the
# program owns.
_FWD = [C(128, 64, 8, 3), C(128, 64, 8, 4), C(128, 128, 8, 2), C(128, 128, 8, 3), C(128, 64, 4, 3),
        C(64, 64, 4, 3), C(64, 128, 4, 3), C(128, 32, 4, 4), C(128, 32, 8, 4), C(64, 32, 4, 4),
        C(64, 64, 4, 2), C(128, 64, 4, 2)]  # (the short tiles, _SHORT_CAUSAL / _SHORT_WIDE_FWD)
_DKDV = [C(64, 128, 8, 2), C(32, 128, 8, 2), C(32, 128, 8, 3), C(16, 128, 8, 3), C(32, 128, 4, 3),
         C(32, 128, 4, 4), C(64, 64, 4, 3), C(64, 64, 8, 3), C(32, 64, 4, 3), C(16, 64, 4, 4), C(64, 128, 8, 3),
         C(64, 64, 4, 2)]
_DQ = [C(128, 64, 8, 2), C(128, 64, 8, 3), C(128, 32, 8, 3), C(128, 32, 4, 3), C(64, 64, 4, 3),
       C(64, 32, 4, 4), C(128, 128, 8, 2), C(64, 128, 8, 2), C(128, 32, 8, 4), C(64, 64, 4, 2)]
CANDIDATES = {
    64: {"fwd": _FWD, "bwd_dkdv": _DKDV, "bwd_dq": _DQ},
    128: {"fwd": _FWD, "bwd_dq": _DQ,
          # with the head dim split in two (no gain at D=128, 2026-11-30)
          # ((128, 128, 8, 2, 2) needs 263 KB of shared memory: dropped)
          "bwd_dkdv": _DKDV + [C(64, 128, 8, 2, 2), C(64, 128, 8, 3, 2), C(64, 64, 4, 3, 2), C(32, 128, 4, 3, 2),
                               # split by gradient (unmeasured at D=128)
                               C(64, 128, 8, 3, 1, True), C(128, 128, 8, 2, 1, True), C(64, 64, 4, 3, 1, True),
                               C(128, 64, 8, 3, 1, True)]},
    256: {
        "fwd": [C(64, 64, 4, 2), C(64, 64, 8, 2), C(64, 32, 4, 3), C(128, 32, 8, 2), C(64, 64, 4, 3),
                C(128, 64, 8, 2), C(64, 32, 4, 2), C(128, 32, 8, 3)],
        "bwd_dkdv": [C(32, 64, 8, 1), C(16, 64, 4, 2), C(16, 128, 8, 2), C(32, 64, 8, 2), C(32, 32, 4, 2),
                     C(16, 64, 8, 2), C(32, 64, 4, 2), C(64, 64, 8, 1), C(16, 32, 4, 3),
                     # head dim split in two: half the accumulators (64 x 64, 64 x 128, 32 x 256 and
                     # 3 stages of 32 x 128 need more than 227 KB of shared memory, compile_check.py)
                     C(32, 64, 4, 2, 2), C(32, 64, 8, 2, 2), C(32, 128, 8, 2, 2), C(16, 128, 8, 2, 2),
                     C(32, 128, 4, 2, 2), C(32, 128, 8, 1, 2), C(16, 128, 4, 3, 2), C(32, 128, 8, 2, 4),
                     # split by gradient (a dV launch, then a dK launch; 5 products where d_split=2 runs 6)
                     C(32, 128, 8, 2, 1, True), C(16, 128, 8, 2, 1, True), C(32, 128, 8, 1, 1, True),
                     C(32, 64, 4, 2, 1, True), C(64, 128, 8, 1, 1, True)],
        "bwd_dq": [C(64, 32, 8, 1), C(128, 32, 8, 3), C(64, 32, 4, 2), C(64, 64, 8, 2), C(32, 64, 4, 2),
                   C(64, 32, 8, 2), C(128, 32, 8, 2), C(64, 16, 4, 3)],
    },
}

_override: dict[str, TileConfig] = {}


@contextmanager
def override(**modes: TileConfig):
    """Force configs for some modes (fwd=..., bwd_dkdv=..., bwd_dq=...): for tests and tuning."""
    saved = dict(_override)
    _override.update(modes)
    try:
        yield
    finally:
        _override.clear()
        _override.update(saved)


# dK/dV tiles of calls whose backward reads through pointers (kernels.bwd.TMA off, or a layout the
# descriptors cannot read: head dims that are not powers of two, misaligned strides, GPUs other
# than sm_90), where they differ from the table's TMA-tuned entries: the pointer path's fastest
# tiles on the H200 (2026-11-30, fifth and sixth sessions, scripts/tune.py, benchmarks/NOTES.md).
# With pointers the larger TMA tiles spill more (D=96 all variants: 2872 bytes and 172544 bytes of
# shared memory at (64, 128, 8, 3), 1576 / 76032 at (32, 64, 4, 3); compile_check.py).
# (padded head dim, causal) -> config, 16-bit.
_POINTER_DKDV = {
    (64, True): C(32, 128, 4, 4),  # 344.1 TFLOP/s; the TMA tile (32, 128, 4, 3) was picked with TMA only
    (128, True): C(32, 64, 4, 3),  # 359.9 against 339.9 for the TMA tile (64, 128, 8, 3) through pointers
    (256, False): C(64, 128, 8, 1, 1, True),  # the fifth session's entry, 273.8
    (256, True): C(64, 128, 8, 1, 1, True),  # 266.1
}


def table_configs(tma: bool = True) -> dict[str, dict[tuple[int, int, bool], TileConfig]]:
    """Every config of the GPU table for backwards with (``tma``) or without tensor descriptors (the
    GPU test tier runs each of them: power-of-two head dims take the descriptor path there, the
    others pointers). Short calls' tiles (:data:`_SHORT_CAUSAL`, :data:`_SHORT_WIDE_FWD`) are not in
    it: their own GPU tests run them."""
    if tma:
        return _SM90
    dkdv = dict(_SM90["bwd_dkdv"])
    dkdv.update({(d, 2, causal): cfg for (d, causal), cfg in _POINTER_DKDV.items()})
    return dict(_SM90, bwd_dkdv=dkdv)


def _on_device(q: torch.Tensor) -> bool:
    """The GPU tables apply (not the interpreter's small tiles); scripts/compile_check.py makes
    this True for CPU tensors to compile the GPU configs for sm_90."""
    return q.device.type == "cuda"


def _lookup(mode: str, q: torch.Tensor, causal: bool) -> TileConfig:
    if mode in _override:
        return _override[mode]
    if not _on_device(q):
        return _INTERP[mode]
    # sm90 table; other arches use it too until they have measurements of their own
    return _SM90[mode][(padded_head_dim(q.shape[-1]), q.element_size(), bool(causal))]


# Causal calls whose queries and keys are all at most SHORT_SEQLEN long, 16-bit, on the GPU: mode ->
# {padded head dim: config}. Kernel time of CUDA graph replays on the H200 (scripts/tune.py
# --cuda-graphs, bf16, benchmarks/NOTES.md, seventh and eighth sessions, 2026-11-30):
# - forward, D=128: the table's (128, 128, 8, 3) holds one program per SM (~224 KB of shared memory),
#   so each program's pipeline fill and output store are exposed, and with few key blocks per program
#   they weigh; two 4-warp (64, 64) programs per SM overlap them. llama shape: S=512 196.7 against 162.0
#   TFLOP/s, S=1024 292.7 against 268.3 (fa shape: 209.7 / 276.4 against 181.1 / 270.9); at S=2048 the
#   table's tile is faster (369.8 against 342.7). D=64 (fa shape): (64, 64, 4, 3) 214.1 against 199.7
#   at S=512, 282.7 against 274.7 at S=1024. D=256: the table's tile is the best (no entry).
# - backward, D=128, llama shape (whole backward, one kernel's tile changed): the table's 128-key dK/dV
#   tile makes B * Hkv * 4 = 128 programs at S=512 for 132 SMs; (64, 64, 4, 2) makes 256:
#   0.139 against 0.156 ms at S=512, 0.324 against 0.351 at S=1024. dQ (64, 64, 4, 2): 0.149 against
#   0.156 ms, 0.344 against 0.352; with K / V through pointers (TRITONATTN_BWD_TMA=0) 0.139 against
#   0.145 ms at S=512 (ninth session). Through pointers the dK/dV kernel keeps _POINTER_DKDV's
#   (32, 64, 4, 3): 0.145 ms against 0.171 for (64, 64, 4, 2) (ninth session).
# - forward without causal masking, D=128: (128, 64, 4, 2), two 4-warp programs per SM, wins where
#   the call has many query tiles (rows x heads / 128 >= WIDE_PROGRAMS) and loses where it has few
#   (eighth session, TFLOP/s against the table's (128, 128, 8, 3)):
#     fa B=32 S=512 (2048 tiles) 328.5 / 288.1, fa B=16 S=1024 (2048) 398.9 / 372.6,
#     llama B=16 S=512 (2048) 392.7 / 366.8; llama B=4 S=512 (512) 258.1 / 275.3,
#     llama B=4 S=1024 (1024) 324.4 / 372.1, fa B=8 S=1024 (1024, K/V 64 MB) 285.2 / 298.3.
#   The K/V bytes against L2 do not separate these; the count does. At S=2048 (llama B=4, 2048 tiles)
#   the table's tile was 16% faster (seventh session): this tile is for short calls only. It spills
#   120 bytes per thread plain and 624 with a bias tile (scripts/compile_check.py), and it was measured
#   on plain calls only: dense, and varlen (ninth session, fa shape packed, 16k tokens: 315.4 / 271.3
#   at S=512, 405.3 / 356.3 at S=1024); calls with any variant (window, softcap, ALiBi, bias, mask,
#   dropout) and kv-cache or paged calls keep the table's (Variants.plain).
SHORT_SEQLEN = 1024
# The Gluon sm_90 kernels serve calls whose queries or keys reach these lengths, by mode, head dim
# and (without, with) a causal mask or a window's right edge (H200, llama shape, benchmarks/NOTES.md).
# The forward (kernels/fwd_sm90.py, twelfth session, on a persistent grid, graph replays): without
# a mask from 512 (1.32x the Triton kernel at 512, 1.40x at 1024), with one from 1024 (0.94x at
# 512, 1.12x at 1024, 1.18x at 2048; one program per tile had been 0.86x at 1024 causal). The
# dK / dV kernel (kernels/bwd_sm90.py, eleventh session), 128 keys per program: without a mask from
# 512 (the whole backward +5..+7% at 512-2048, graph replays, B=4); with one from 2048, where its
# programs are enough for the causal imbalance (B=4: +0% at 2048, +4..+9% from 4096, but -14% at
# 1024 with 256 programs; alone 1.07-1.08x at 512 / 1024 with B=32 / 16)
# The forward at D=64 (128-key blocks, 4 slots) and D=256 (64-key blocks, 2 slots), x the Triton
# kernel (without / with a mask), fifteenth session (the tuner's Gluon timings no longer pay two
# fills per replay; fa shape, 16k tokens): D=64 0.99x / 0.82x at 1024, 1.03x / 0.94x at 2048,
# 1.07x / 1.01x at 4096, 1.06x / 1.01x at 8192; D=256 1.13x / 1.10x at 1024, 1.16x / 1.09x at
# 2048, 1.18x / 1.10x at 4096. D=128 remeasured the same way (B=1, 2, 4, 16-32) kept its lengths:
# causal 0.89-0.97x at 512, 1.04-1.17x at 1024 (S=1536 B=1, 192 pairs on 132 programs: 0.97x);
# without a mask 0.95x at 512 B=1, 1.11-1.47x at B >= 2, 1.16-1.47x from 1024.
# D=256 from 512 since its K slots are released apart (fwd_sm90.TILES, twentieth session; x the
# Triton kernel at S=512, without / with a mask): B=32 1.27x / 1.20x, B=8 1.15x / 1.03x, B=4
# 1.08x / 1.12x.
# Twenty-fifth session (fwd_sm90 TILES / BY_MASK: D=128 O_TMA, D=64 three consumers without a mask;
# benchmarks/experiments/fwd_flags.py "table" against the Gluon kernel forced, graph replays,
# results/2026-12-03/fwd-flags-routing-*-570ced4.md): D=64 without a mask from 512 (1.17x the
# Triton kernel at 512, 1.12x at 1024; fa shape); D=128 without one from 256 (llama shape 1.24x at
# 256) and with one from 512 (fa 1.24x, llama 1.10x at 512; llama 0.87x at 256). D=64 causal keeps
# 4096 (0.66x / 0.88x at 512 / 1024, 1.01x at 2048).
# Twenty-sixth session (SPLIT_WAIT at D=128 / 256; the same A/B, results/2026-12-03/
# fwd-flags-routing-*-bb779ab.md; fa / llama shape): D=256 from 128 (S=128 1.39x / 1.06x without a mask,
# 1.37x / 1.03x with one; S=256 1.60x / 1.44x and 1.29x / 1.30x); D=128 without a mask from 128 (S=128
# 1.44x / 0.975x: the llama shape's 128 tiles leave SMs idle); D=128 causal keeps 512 (S=256 1.06x /
# 0.87x, S=128 1.12x / 0.77x); D=64 keeps its lengths (the Triton kernel 1.14-1.56x at S=128 / 256).
# The dK / dV kernel at D=64 (its tile in bwd_sm90.TILES; eighteenth session, the kernel alone,
# Hq=32, Hkv=8, 16k tokens): without a mask 1.15x at 1024, 1.17x at 2048, 1.16x at 4096, 1.19x at
# 16384; with one (nineteenth session, its crossing blocks in loops of their own: bwd.SPLIT_DIAG_ROWS)
# 1.12x, 1.10x, 1.08x, 1.22x. At D=256 (the consumers split by gradient, bwd_sm90 SPLIT_GRADS,
# nineteenth session, same shape): 1.96x / 2.02x at 1024, 1.95x / 1.82x at 4096, 2.04x / 1.73x at
# 16384 (without / with a mask). D=256 from 512 (nineteenth session, the tuner at S=512, B=32:
# 1.95x / 2.12x; the fa grid's whole backward (MHA, B=32) 0.83x / 0.78x cuDNN -> 1.10x / 0.97x).
# D=64 from 512 was 1.08x / 1.14x in the tuner (GQA, 4 heads per program) but took the fa grid's
# MHA backward at 512 from 0.96x / 0.99x cuDNN to 0.84x / 0.86x (programs of one head, 4 query
# blocks: fill and drain), so D=64 keeps 1024.
# Head dims whose Gluon dK/dV kernel awaits a step's products one at a time (bwd_sm90._steps
# SPLIT_WAITS: P^T while dP^T runs, dS^T while dV's product runs; bitwise the same gradients).
# TRITONATTN_BWD_SPLIT_WAITS=0 / 1 overrides. H200, D=64 (MHA, 32 heads, B=4, S=4096, two runs each,
# the kernel's time): 1.01-1.02x without a mask, 1.08-1.10x causal (twenty-seventh session); whole
# backward 1.01-1.03x (twenty-fifth). D=128: 0.93-1.00x (off). Not with the fused dQ (opt-in or
# forced at D=64: not measured there).
BWD_SPLIT_WAITS = frozenset({64})
GLUON_MIN_SEQLEN = {
    "fwd": {64: (512, 4096), 128: (128, 512), 256: (128, 128)},
    "bwd_dkdv": {128: (512, 2048), 64: (1024, 1024), 256: (512, 512)},
}
# The backward's dQ computed by the Gluon dK/dV kernel itself (kernels/bwd_sm90.py FUSED_DQ,
# its tiles added in a fixed order: bwd.fused_dq_mode), by head dim: (without, with a mask) the
# first length, None for never. H200, llama shape, the whole backward's time against the split
# kernels. Seventeenth session (programs in lockstep: query blocks descending with the group's
# heads inside, key blocks launched first first; measured 2026-12-02): without a mask 0.94x at
# 2048, 1.00x at 4096 (0.91x the split), 0.97x at 8192 (0.75x), 0.93x at 16384 (0.87x); with
# one 1.02x at 2048, 0.90x at 4096, 0.87x at 8192, 0.89x at 16384. (Sixteenth session, heads
# first: the masked order was 1.09-1.17x, the semaphores serialising a head's staggered programs.)
# Twenty-eighth session: with the ordered fused dQ's programs in sections (FUSED_SECTION_ROWS below)
# the fused kernel beats the split ones from 1024 without a mask and from 2048 with one (before:
# 2048, and 4096 with GROUP x longest >= 8192 under a mask). bwd_flags.py, the
# backward's kernels in graph replays, speed-ups over the split / the 2-d fused default, D=128, two
# rounds: fa (MHA, 16 heads) without a mask 1.07x at 1024, 1.07-1.08x at 2048 (already fused), 1.03x
# at 4096; causal 0.99x at 1024 (so 2048), 1.11x at 2048, 1.16x at 4096, 1.10x at 8192 (already
# fused); llama (GQA 32 / 8) causal 1.10-1.15x at 2048 (the masked cells over 8192 group rows were
# fused already, where sections are off). A call whose programs have more steps at that first length
# than the sections serve (GROUP x first > FUSED_SECTION_ROWS) starts at FUSED_DQ_GRID_FIRST's length
# instead, on the 2-d grid, as before the sections (seventeenth / eighteenth sessions: llama causal
# 1.02x the split's time at 2048, 0.90x at 4096; without a mask 0.94x at 2048).
# D=64 without a mask from 2048 (twenty-ninth session, bwd_flags.py, the backward's kernels, sections
# at every group: D=64's row of FUSED_SECTION_ROWS): fa (MHA, 32 heads) 1.00x at 1024, 1.04-1.06x at
# 2048, 1.05-1.07x at 4096, 1.07-1.08x at 8192; llama (GQA 32 / 8) 0.98x at 1024, 1.02-1.04x at 2048,
# 1.04x at 4096, 1.05x at 8192; GQA 8 (fa, 4 kv heads) 1.02x at 2048, 1.03x at 4096. Not with a mask
# (0.82-0.92x at 2048, twenty-eighth session).
FUSED_DQ_MIN_SEQLEN = {128: (1024, 2048), 64: (2048, None)}
FUSED_DQ_GRID_FIRST = {128: (2048, 4096)}
# The ordered fused dQ's programs in sections of kv heads, key blocks outer inside each
# (bwd_sm90.section_order), where a program's steps are few: GROUP x longest <= FUSED_SECTION_ROWS.
# A head's programs wait on each other's turns at each query block (the deterministic order); with
# few steps per program that one-time skew is a large part of the kernel (16% at fa D=128 S=2048,
# twenty-seventh session), and key blocks outer start a program after the ones it waits on. With
# many steps the skew is spread and sections only cost L2 reuse: llama (GROUP 4) 0.96-1.02x at 4096
# (16384 group rows) and 0.87-0.99x at 8192; at the edge, fa (GROUP 1) 8192 (sections on) 0.99-1.01x
# without a mask and 1.10x causal.
# By head dim. D=64 (fused without a mask only) at every length: sections against the 2-d grid
# 1.04x at llama 4096 (16384 group rows), 1.01x at 8192, 1.00-1.02x at GQA 8 2048 / 4096 (twenty-
# ninth session).
# FUSED_SECTION_MIN_HEADS: the section's kv heads are a wave's worth of programs (SMs // key blocks),
# at least this many (4 and 8 measured alike at fa 8192; 8 best at fa 2048, 16 at llama causal 2048).
FUSED_SECTION_ROWS = {64: math.inf, 128: 8192}
# Also where the launch has at most this many waves of programs (key blocks x batch x kv heads <=
# FUSED_SECTION_WAVES x SMs), whatever the steps (twenty-ninth session, bwd_flags.py --group, D=128
# causal, sections against the default): GQA 4 (fa shape, 512 programs) 1.08x at 4096 and 8192; GQA 8
# (256 programs) 1.09-1.10x at 2048 (against the split), 1.12x at 4096, 1.22x at 8192; without a mask
# GQA 8 1.01x at 2048 / 4096. Not past it: llama (GQA 4, B=4 x 8 kv heads: 1024 / 2048 programs)
# 0.97x at 4096 / 8192 causal, 0.98-0.99x at 8192 without a mask (twenty-eighth session). This
# changes the grid of a fused call; the length it fuses from changes with the launch only where
# FUSED_DQ_MASKED_WAVES says.
FUSED_SECTION_WAVES = 4
# With a mask, the fused dQ also from FUSED_DQ_MIN_SEQLEN's length (not FUSED_DQ_GRID_FIRST's) where
# its launch has one to FUSED_SECTION_WAVES waves of programs, which run in sections then
# (thirtieth session): GQA 8 causal at 2048 (fa shape, 256 programs on 132 SMs) measured 1.098x the
# split kernels with sections (twenty-ninth session, bwd-flags-g88-51cb319.md). Under one wave
# (GQA 16 there, 128 programs) the split kernels stay: the fused dQ measured 0.93x at 2048. Not
# without a mask: GROUP > 8 at 1024-2047 is not measured. Off (an experiment): on an H100 the same
# cell measured 0.93x (thirtieth session, bwd-flags-g8-masked-waves-ad95e14.md), and it routes by
# the launch's size, so a sequence alone and in a packed call (launched with the others) could take
# different kernels (packed calls promise their sequences' dense bits).
FUSED_DQ_MASKED_WAVES = False
FUSED_SECTION_MIN_HEADS = 4
# The Gluon dK/dV launch without the fused dQ (the split kernels, KV_SPLIT's partials included) in
# sections of kv heads, key blocks outer, where it is causal and has at most this many waves of
# programs (key blocks x batch x kv heads x KV_SPLIT): a head-major grid of a few waves leaves its
# last heads' long programs (the first key blocks, which see every query block) running alone at the
# end (a helper's model, forty-fourth session: the SMs 78-81% busy at GQA 16 split 4, 62% at GQA 8
# 2048, 97-99% key blocks first). Each program computes what it computes on the 2-d grid: bitwise the
# same gradients. 0: off (not yet measured; bwd_flags.py "configs.DKDV_SECTION_WAVES=4").
DKDV_SECTION_WAVES = 0
WIDE_PROGRAMS = 2048
_SHORT_WIDE_FWD = {128: C(128, 64, 4, 2)}
_SHORT_CAUSAL = {
    "fwd": {64: C(64, 64, 4, 3), 128: C(64, 64, 4, 2)},
    "bwd_dkdv": {128: C(64, 64, 4, 2)},
    "bwd_dq": {128: C(64, 64, 4, 2)},
}


def _short(mode: str, q: torch.Tensor, seqlen: int) -> bool:
    """A 16-bit call on the GPU of at most SHORT_SEQLEN queries and keys (``seqlen``: its longest
    length, 0 when not known) whose ``mode`` config is not forced, without BATCH_INVARIANT: the
    short tiles may apply."""
    return (0 < seqlen <= SHORT_SEQLEN and mode not in _override and not BATCH_INVARIANT and q.element_size() == 2
            and _on_device(q))


def _short_causal(mode: str, q: torch.Tensor, causal: bool, seqlen: int) -> TileConfig | None:
    """The :data:`_SHORT_CAUSAL` entry of a call, or None."""
    if not causal or not _short(mode, q, seqlen):
        return None
    return _SHORT_CAUSAL[mode].get(padded_head_dim(q.shape[-1]))


def _short_wide(q: torch.Tensor, causal: bool, seqlen: int) -> TileConfig | None:
    """:data:`_SHORT_WIDE_FWD`'s entry for a plain forward (no causal mask, see forward_config's
    ``plain``) of at most SHORT_SEQLEN queries and keys and at least WIDE_PROGRAMS 128-row query tiles
    (``q``'s rows x heads), or None."""
    if causal or not _short("fwd", q, seqlen):
        return None
    tiles = q.numel() // max(1, q.shape[-1]) // 128
    return _SHORT_WIDE_FWD.get(padded_head_dim(q.shape[-1])) if tiles >= WIDE_PROGRAMS else None


def fused_dq_serves(head_dim: int, masked: bool, longest: int, group: int, programs: float = math.inf,
                    sms: int = 0) -> bool:
    """The Gluon dK/dV kernel of a call (of this head dim, with a causal mask or a window's right edge
    or not, whose longest side is ``longest``, with ``group`` query heads per kv head) computes dQ
    too: from :data:`FUSED_DQ_MIN_SEQLEN`'s length, or from :data:`FUSED_DQ_GRID_FIRST`'s where the
    group's programs at that length would have too many steps for sections (fused_sections), unless
    the call has a mask and its launch (``programs`` dK/dV programs on ``sms`` SMs, where the
    launcher knows them) has one to :data:`FUSED_SECTION_WAVES` waves (:data:`FUSED_DQ_MASKED_WAVES`).
    Monotone in ``longest`` for every group and launch (the first length depends on those only;
    a varlen call's launch is the same for all its length classes)."""
    first = FUSED_DQ_MIN_SEQLEN.get(head_dim, (None, None))[masked]
    if first is None:
        return False
    few = masked and FUSED_DQ_MASKED_WAVES and sms <= programs <= FUSED_SECTION_WAVES * sms
    if not (few or fused_sections(head_dim, group, first)):
        grid = FUSED_DQ_GRID_FIRST.get(head_dim, (None, None))[masked]
        if grid is None:
            return False
        first = max(first, grid)
    return longest >= first


def section_heads(n_kb: int, heads: int, sms: int) -> int:
    """Kv heads per section of a Gluon dK/dV launch on a 1-d grid of ``heads`` kv heads of ``n_kb``
    key blocks each: a wave's worth of programs (``sms`` // key blocks), at least
    :data:`FUSED_SECTION_MIN_HEADS`, at most the launch's heads."""
    return max(1, min(heads, max(FUSED_SECTION_MIN_HEADS, sms // n_kb)))


def dkdv_sections(causal: bool, n_kb: int, heads: int, sms: int) -> int:
    """Kv heads per section of the Gluon dK/dV launch without the fused dQ (:data:`DKDV_SECTION_WAVES`;
    ``heads``: batch x kv heads x KV_SPLIT, ``n_kb`` key blocks each, on ``sms`` SMs): section_heads,
    or 0 (the 2-d grid)."""
    if not (causal and DKDV_SECTION_WAVES and n_kb * heads <= DKDV_SECTION_WAVES * sms):
        return 0
    return section_heads(n_kb, heads, sms)


def fused_sections(head_dim: int, group: int, longest: int, programs: float = math.inf, sms: int = 0) -> bool:
    """The ordered fused dQ's programs of a call of this head dim with ``group`` query heads per kv
    head and longest side ``longest`` run in sections of kv heads: few steps per program
    (:data:`FUSED_SECTION_ROWS`), or, where the launch is known (``programs`` of it on ``sms``
    SMs), few programs (:data:`FUSED_SECTION_WAVES`)."""
    return group * longest <= FUSED_SECTION_ROWS.get(head_dim, 0) or programs <= FUSED_SECTION_WAVES * sms


# The Gluon dK/dV kernel without the fused dQ, on a dense call whose launch (key blocks x batch x kv
# heads) is under one wave of programs: each kv head's query heads split over KV_SPLIT programs that
# write partial dK / dV in fp32, summed after in a fixed order (bwd_sm90 KV_SPLIT; deterministic).
# Under one wave the SMs idle, and with a causal mask the programs of the first key blocks, which see
# every query block, set the time (GQA 16 causal at the fa shape: 128 programs, 0.62-0.72x cuDNN).
# The split: the largest power of two dividing the group that keeps the launch within
# KV_SPLIT_WAVES[causal] waves (causal: more programs than SMs, so that the short ones fill in).
# This rule is for dense calls of two or more sequences, whose launch the launcher knows. One
# sequence alone and packed sequences split by kv_split_alone instead (a packed call must give each
# sequence its dense call's bits: bwd._kv_split).
KV_SPLIT_WAVES = (1, 4)
# kv_split_alone's waves (no mask, causal): those of one sequence's own launch, which a packed call
# repeats for each of its sequences, so fewer than KV_SPLIT_WAVES: a packed call of many sequences
# already fills the SMs, and its sequences' partials cost traffic (predicted in benchmarks/NOTES.md,
# thirty-first session: B=1 GQA 16 causal 2048 2-4x on the dK/dV kernel, packed calls within -3%).
# None: off (one sequence alone and packed sequences never split unless TRITONATTN_BWD_KV_SPLIT says).
# Measured (thirty-first session, H100, bwd_flags.py --group 16 fa shape D=128, backward graph replays,
# x off): B=1 causal 2048 (1,2) 2.86x, (1,1) 3.76x; B=1 causal 8192 (1,2) 2.53x, (1,1) 2.09x; packed
# 8 x 2048 causal (1,2) 0.86x, (1,1) 1.05x; non-causal unchanged then (the fused dQ served; since
# KV_SPLIT_OVER_FUSED holds without a mask too, the split kernels serve). (1,1): no packed call
# loses, and the short sequence alone gains most.
KV_SPLIT_ALONE_WAVES: tuple[int, int] | None = (1, 1)
# A call whose kv heads split takes the split kernels (the dQ kernel, the Gluon dK/dV kernel with
# KV_SPLIT) even where fused_dq_serves says the fused dQ: under one wave the fused dQ's programs leave
# SMs idle (and with a mask have the same imbalance), and the fused dQ does not split (its order is per
# kv head). Thirtieth session, H100, bwd_flags.py --group 16 causal, fa shape: the split kernels with
# KV_SPLIT 1.35x / 1.36x the fused dQ at 4096 / 8192, and 1.08x without KV_SPLIT; KV_SPLIT itself
# 1.19x at 2048, where the split kernels served already. Thirty-first session, H100, one sequence
# alone without a mask (GQA 16, 2048 / 8192): the split kernels with KV_SPLIT_ALONE_WAVES (1,1)
# 4.76x / 1.60x the fused dQ (until then the switch held with a mask only).
KV_SPLIT_OVER_FUSED = True


def kv_split(causal: bool, group: int, programs: int, sms: int, waves: tuple[int, int] | None = None) -> int:
    """How many programs share each kv head's query heads in the Gluon dK/dV kernel (1: none) for a
    dense call with ``group`` query heads per kv head whose launch has ``programs`` programs on
    ``sms`` SMs (:data:`KV_SPLIT_WAVES`, or ``waves``)."""
    limit = (KV_SPLIT_WAVES if waves is None else waves)[causal] * sms
    split = 1
    if programs < sms:
        while group % (2 * split) == 0 and programs * 2 * split <= limit:
            split *= 2
    return split


def kv_split_alone(causal: bool, group: int, longest: int, kv_heads: int, block_n: int, sms: int) -> int:
    """:func:`kv_split` for one sequence whose longest side (queries or keys) is ``longest``, as the
    Gluon dK/dV kernel's launch of it alone would have (``longest`` / ``block_n`` key blocks x
    ``kv_heads``; :data:`KV_SPLIT_ALONE_WAVES`): the split of a dense call of one sequence, and of
    that sequence in a packed call (its length class's). Non-increasing in ``longest``. 1 where
    :data:`KV_SPLIT_ALONE_WAVES` is None (off)."""
    if KV_SPLIT_ALONE_WAVES is None:
        return 1
    return kv_split(causal, group, -(-max(longest, 1) // block_n) * kv_heads, sms, KV_SPLIT_ALONE_WAVES)


def kv_split_breaks(causal: bool, group: int, kv_heads: int, block_n: int, sms: int) -> set[int]:
    """The lengths at which :func:`kv_split_alone` changes (a packed call's length classes break
    there too, launch.length_classes): n key blocks' last length + 1 wherever n + 1 blocks split
    differently. Past ``sms`` // ``kv_heads`` blocks nothing splits."""
    out = set()
    for n in range(1, sms // max(kv_heads, 1) + 1):
        if kv_split_alone(causal, group, n * block_n, kv_heads, block_n, sms) != \
                kv_split_alone(causal, group, n * block_n + 1, kv_heads, block_n, sms):
            out.add(n * block_n + 1)
    return out


def length_breaks() -> set[int]:
    """The lengths at which the tile or kernel of a call may change with its longest side
    (launch.length_classes): past SHORT_SEQLEN, the Gluon kernels' first lengths, and the fused dQ's."""
    gluon = {n for lengths in GLUON_MIN_SEQLEN.values() for pair in lengths.values() for n in pair if n != math.inf}
    fused = {n for table in (FUSED_DQ_MIN_SEQLEN, FUSED_DQ_GRID_FIRST) for pair in table.values() for n in pair
             if n is not None}
    return {SHORT_SEQLEN + 1, *gluon, *fused}


def forward_config(q: torch.Tensor, causal: bool, extra_smem: bool = False, seqlen: int = 0,
                   plain: bool = False) -> TileConfig:
    """``seqlen``: the longest query or key length of the call (varlen: of a length class's
    sequences, launch.length_classes); causal
    calls up to :data:`SHORT_SEQLEN` take :data:`_SHORT_CAUSAL`'s entry where it has one, and
    ``plain`` calls (:attr:`Variants.plain`: dense or varlen, no mask of any kind, no other variant,
    no kv cache) with many query tiles :data:`_SHORT_WIDE_FWD`'s (the launcher asks so for dense
    calls of two or more sequences only: see attention_forward).

    ``extra_smem``: a bias or boolean mask tile is read next to each score tile, or dropout
    reshapes its random bits through shared memory; with 128-key blocks these need more shared
    memory than an H200 block may have (360 KB with a bias, 240 KB with dropout at D=128, found by
    scripts/compile_check.py), so the key block is capped at 64."""
    cfg = _lookup("fwd", q, causal)
    if "fwd" in _override:
        return cfg
    cfg = _short_causal("fwd", q, causal, seqlen) or (_short_wide(q, causal, seqlen) if plain else None) or cfg
    if extra_smem:
        # D=256: 64-key blocks with every variant still need 237568 bytes (scripts/compile_check.py)
        cap = 32 if padded_head_dim(q.shape[-1]) >= 256 else 64
        if cfg.block_n > cap:
            cfg = cfg._replace(block_n=cap)
    return cfg


def _backward_config(mode: str, q: torch.Tensor, causal: bool, extra_smem: bool,
                     base: TileConfig | None = None) -> TileConfig:
    """``extra_smem`` as for :func:`forward_config`: a bias / mask tile and dropout's bits next to
    each score tile. A third pipeline stage then no longer fits in an H200 block's shared memory
    (dQ with a bias and dropout at D=128: 237568 bytes of 232448, found on the H200 and by
    scripts/compile_check.py's combined cases), so those run two stages. ``base``: the entry to
    start from instead of the table's."""
    cfg = base or _lookup(mode, q, causal)
    if extra_smem and mode not in _override:
        if cfg.num_stages > 2:
            cfg = cfg._replace(num_stages=2)
        if padded_head_dim(q.shape[-1]) >= 256 and cfg.block_n > 64:
            # D=256 dK/dV's 128-key split tile with a bias tile and dropout: 250112 bytes (compile_check)
            cfg = cfg._replace(block_n=64)
    return cfg


# The opt-in atomic-dQ backward (TRITONATTN_ATOMIC_DQ=1): its dK/dV program also computes dS K, so
# it has its own best tile; by padded head dim, bf16 / fp16 (scripts/tune.py --atomic-dq on the H200,
# S=8192, llama shape: (64, 128, 8, 3) was fastest, causal and not, both with per-element atomics and
# with TMA reductions, 2026-11-30). Head dims padded to 128 (65-128) use it too, unmeasured; on a
# shared-memory overflow configs.fit shrinks it. D=256: the tile it took before the table's entry
# became a gradient split (which the atomic path cannot use: its dQ needs dS in the dK program);
# tested on the H200, not tuned. Other head dims take the table's dK/dV entry.
_ATOMIC_DKDV = {128: C(64, 128, 8, 3), 256: C(32, 128, 8, 2)}


def backward_dkdv_config(q: torch.Tensor, causal: bool, extra_smem: bool = False,
                         atomic_dq: bool = False, tma: bool = True, seqlen: int = 0) -> TileConfig:
    """``tma``: the call's Q / dO tiles come through tensor descriptors (the table's entries and
    the short causal tile were tuned that way); without, :data:`_POINTER_DKDV` where it has an
    entry (also the fastest through pointers at S=512). ``seqlen`` as for :func:`forward_config`."""
    d = padded_head_dim(q.shape[-1])
    tables = "bwd_dkdv" not in _override and q.element_size() == 2 and _on_device(q)
    if atomic_dq and d in _ATOMIC_DKDV and tables:
        cfg = _ATOMIC_DKDV[d]
        return cfg._replace(num_stages=2) if extra_smem else cfg
    if tma:
        base = _short_causal("bwd_dkdv", q, causal, seqlen)
    else:
        base = _POINTER_DKDV.get((d, bool(causal))) if tables else None
    return _backward_config("bwd_dkdv", q, causal, extra_smem, base)


def backward_dq_config(q: torch.Tensor, causal: bool, extra_smem: bool = False, seqlen: int = 0) -> TileConfig:
    """``seqlen`` as for :func:`forward_config` (the short causal tile: faster with K / V through
    descriptors and through pointers)."""
    return _backward_config("bwd_dq", q, causal, extra_smem, _short_causal("bwd_dq", q, causal, seqlen))


def preprocess_config(q: torch.Tensor) -> TileConfig:
    return _PREPROCESS


def decode_config(q: torch.Tensor) -> TileConfig:
    if "decode" in _override:
        return _override["decode"]
    if not _on_device(q):
        return _DECODE_INTERP
    if q.element_size() == 4:  # (4 warps spilled 160-256 bytes at D=128)
        return _DECODE_FP32._replace(num_warps=_fp32_warps(padded_head_dim(q.shape[-1])))
    return _DECODE[(padded_head_dim(q.shape[-1]), 2)]


def tile_config(q: torch.Tensor) -> TileConfig:
    if "tile" in _override:
        return _override["tile"]
    if not _on_device(q):
        return _TILE_INTERP
    cfg = _TILE[q.element_size()]
    if padded_head_dim(q.shape[-1]) >= 256 and cfg.block_n > 32:  # D=256: 278528 bytes at 64 x 64
        cfg = cfg._replace(block_n=32)
    if q.element_size() == 4:  # (4 warps spilled 16 KB at D=256)
        cfg = cfg._replace(num_warps=_fp32_warps(padded_head_dim(q.shape[-1])))
    return cfg


def _smaller(cfg: TileConfig) -> TileConfig | None:
    """The next config to try when ``cfg`` needs more shared memory than the device has: fewer
    pipeline stages (down to 2), then half the key block, half the query block, one stage."""
    if cfg.num_stages > 2:
        return cfg._replace(num_stages=cfg.num_stages - 1)
    if cfg.block_n > 16:
        return cfg._replace(block_n=cfg.block_n // 2)
    if cfg.block_m > 16:
        return cfg._replace(block_m=cfg.block_m // 2)
    if cfg.num_stages > 1:
        return cfg._replace(num_stages=1)
    return None


_FITTED: dict[tuple, TileConfig] = {}


def fit(mode: str, cfg: TileConfig, flags: dict, dtype: torch.dtype, run) -> TileConfig:
    """Launch ``run(cfg)``; if the kernel needs more shared memory than the device has (a variant
    combination the table's entry was not measured with), shrink the config step by step
    (:func:`_smaller`), log it once, and remember the config that fits for these flags."""
    key, first = None, cfg
    if _FITTED:  # empty unless some config did not fit: no key to build on the usual path
        key = (mode, cfg, dtype, tuple(sorted(flags.items())))
        cfg = _FITTED.get(key, cfg)
    while True:
        try:
            run(cfg)
            return cfg
        except OutOfResources as e:
            smaller = _smaller(cfg)
            if smaller is None:
                raise
            _log.warning(
                "%s tile config %s does not fit (%s); using %s", mode, tuple(cfg), e, tuple(smaller))
            key = key or (mode, first, dtype, tuple(sorted(flags.items())))
            _FITTED[key] = cfg = smaller
