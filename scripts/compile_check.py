"""Compile every kernel for sm_90 on a machine without a GPU and report resources.

Runs the real host launchers on CPU tensors with Triton's driver replaced by one that reports an
sm_90 target and compiles instead of launching (``warmup``). For each compiled kernel it prints
registers, spilled bytes and shared memory (from the cubin, via the cuobjdump that ships with
Triton) and fails when a kernel does not compile or needs more shared memory than an H100/H200
block may have (232448 bytes). Saves GPU time: a kernel that does not build for Hopper is found here.

    python scripts/compile_check.py                 # every variant flag set, the llama shape's configs
    python scripts/compile_check.py --all-configs   # every entry of the sm90 tile table, plain flags
    python scripts/compile_check.py --only gluon-causal-D64 --dump /tmp/asm   # and each kernel's PTX and SASS
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from unittest import mock

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

SMEM_LIMIT = 232448
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


class _Sm90Driver:
    """Just enough of a driver for JITFunction.run to compile for sm_90."""

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


RESULTS: list[dict] = []
_real_run = JITFunction.run


def _compile_only(self, *args, grid, warmup, **kwargs):
    t0 = time.perf_counter()
    kernel = _real_run(self, *args, grid=grid, warmup=True, **kwargs)
    RESULTS.append(dict(name=self.__name__, kernel=kernel, seconds=time.perf_counter() - t0,
                        cfg={k: kwargs[k] for k in ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "GRADS", "TMA")
                             if k in kwargs and not (k == "GRADS" and kwargs[k] == 3)
                             and not (k == "TMA" and not kwargs[k])}))
    return kernel


def resources(kernel) -> tuple[int, int]:
    """(registers, spill bytes) of a compiled kernel, read from its cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run([CUOBJDUMP, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    regs = int(re.search(r"REG:(\d+)", out).group(1))
    stack = int(re.search(r"STACK:(\d+)", out).group(1))
    return regs, stack


def dump(kernel, stem: str) -> None:
    """The kernel's PTX and SASS (cuobjdump -sass of its cubin; its failure raises) as STEM.ptx and STEM.sass."""
    os.makedirs(os.path.dirname(stem), exist_ok=True)
    with open(stem + ".ptx", "w") as f:
        f.write(kernel.asm["ptx"])
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        sass = subprocess.run([CUOBJDUMP, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    with open(stem + ".sass", "w") as f:
        f.write(sass)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--all-configs", action="store_true")
    p.add_argument("--dtypes", nargs="+", default=["bf16"], choices=["bf16", "fp16", "fp32"])
    p.add_argument("--only", help="only the cases whose label contains this")
    p.add_argument("--split-head-dims", type=int, nargs="+", default=[256], choices=[64, 128, 256],
                   help="head dims whose dK/dV split candidates (head-dim or gradient split) are compiled")
    p.add_argument("--dump", metavar="DIR",
                   help="write each compiled kernel's PTX and SASS here (LABEL.N.KERNEL.ptx / .sass, N: its place "
                        "among the case's kernels)")
    args = p.parse_args(argv)

    driver.set_active(_Sm90Driver())
    JITFunction.run = _compile_only
    from tritonattn import configs
    from tritonattn.kernels import launch

    launch.ENABLED = False  # every call must reach JITFunction.run (replaced above)
    from tritonattn.kernels.bwd import attention_backward, attention_probs
    from tritonattn.kernels.decode import cache_append, decode_forward
    from tritonattn.kernels.fwd import attention_forward
    from tritonattn.kernels.variants import MASK_KEYS, MASK_TILE, Variants

    # the table's sm90 configs, as on a CUDA device
    configs._on_device = lambda q: True
    # the atomic-dQ path's TMA reductions (sm_90 only; TRITONATTN_ATOMIC_DQ_TMA=0 keeps per-element atomics)
    from tritonattn.kernels import bwd, decode, fwd, fwd_sm90
    bwd._dq_tma_ok = lambda q: q.shape[-1] % 4 == 0 and configs.env_flag("TRITONATTN_ATOMIC_DQ_TMA", default=True)

    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    # the Gluon forward's D=128 tile before the twenty-fifth session
    PLAIN = dict(Q_BUFS=1, V_STAGES=3, O_TMA=False, SPLIT_WAIT=False)
    NC3 = dict(NC=3, Q_BUFS=2, O_TMA=True)  # D=64's tile without a mask

    # the shapes a Gluon forward tile experiment compiles on: (head dim, causal, length, tile fields of the
    # shape: D=64 without a mask is three consumers)
    fwd_tile_shapes = {"causal-D64": (64, True, 8192, {}), "full-D64": (64, False, 4096, NC3),
                       "causal": (128, True, 2048, {}), "full": (128, False, 2048, {}),
                       "full-D256": (256, False, 2048, {})}

    def fwd_tile_cases(name, dt, fields, *shapes):
        """Cases gluon-NAME-SHAPE-DT: the Gluon forward alone with ``fields`` set in its tile."""
        cases = []
        for shape in shapes:
            D, causal, s, tile = fwd_tile_shapes[shape]
            cases.append((f"gluon-{name}-{shape}-{dt}", D, dtypes[dt], dict(win_right=0) if causal else {},
                          dict(s=s, gluon=True, fwd_only=True, fwd_tile=dict(tile, **fields))))
        return cases

    def run(D, dtype, var, dkdv=None, tma=True, pdl=False, gluon=False, split_diag=False, trace=False, fwd_tile=None,
            dkdv_sections=False, **kw):
        with contextlib.ExitStack() as stack:
            if fwd_tile:  # the Gluon forward with this tile at D, with a mask or without (fwd_sm90.BY_MASK)
                stack.enter_context(mock.patch.object(fwd_sm90, "BY_MASK", {(D, False): fwd_tile, (D, True): fwd_tile}))
            if trace:  # the Gluon forward with its cycle stamps (benchmarks/experiments/tile_trace.py)
                buf = torch.zeros(4, fwd_sm90.TRACE_TILES.value, fwd_sm90.TRACE_SLOTS.value, dtype=torch.int64)
                stack.enter_context(mock.patch.object(fwd_sm90, "TRACE_BUF", buf))
            if split_diag:  # the Gluon dK/dV kernel's causal steps in two loops, any tile, at every length
                stack.enter_context(mock.patch.object(bwd, "SPLIT_DIAG_ROWS", 1))
                stack.enter_context(mock.patch.dict(configs.GLUON_MIN_SEQLEN["bwd_dkdv"], {D: (0, 0)}))
            # the Gluon sm_90 forward and dK/dV kernels only where a case asks for them (the others
            # compile the Triton kernels)
            stack.enter_context(mock.patch.object(fwd, "_on_sm90", lambda q: gluon))
            stack.enter_context(mock.patch.object(bwd, "_on_sm90", lambda q: gluon))
            # and the Gluon kernels' varlen paths (fwd.GLUON_VARLEN, on by default; bwd.GLUON_VARLEN, off)
            stack.enter_context(mock.patch.object(fwd, "GLUON_VARLEN", gluon))
            stack.enter_context(mock.patch.object(bwd, "GLUON_VARLEN", gluon))
            if dkdv_sections:  # the dK/dV launch without the fused dQ in sections (configs.DKDV_SECTION_WAVES)
                stack.enter_context(mock.patch.object(configs, "DKDV_SECTION_WAVES", 1000))
            if dkdv is not None:  # a dK / dV config of its own (head-dim split candidates)
                stack.enter_context(configs.override(bwd_dkdv=dkdv))
            if not tma:  # the backward through pointers (TRITONATTN_BWD_TMA=0; its own dK/dV tiles)
                stack.enter_context(mock.patch.object(bwd, "TMA", False))
            if pdl:  # the decoding's combine launch through programmatic dependent launch (TRITONATTN_DECODE_PDL=1)
                stack.enter_context(mock.patch.object(configs, "DECODE_PDL", True))
                stack.enter_context(mock.patch.object(decode, "_pdl_ok", lambda q: True))
            run_case(D, dtype, var, **kw)

    def run_case(D, dtype, var, bias_grad=False, probs=False, varlen=False, atomic_dq=False, dq_tma=True, sq=None,
                 s=256, b=2, fused_dq=False, desc_3d=False, split_waits=None, section=None,
                 expand_kv=False, fwd_only=False, kv_split=None, first_store=False):
        # s: the sequence length (past configs.SHORT_SEQLEN a causal forward takes the table's tile);
        # b: the batch (enough rows x heads make a short forward without causal masking take its own tile)
        B, S, Hq, Hkv = b, s, 4, 2
        # sq: a query length of its own (1: Triton specializes the integer, the query loops fold away)
        shape_q, shape_k = ((B * S, Hq, D), (B * S, Hkv, D)) if varlen else ((B, sq or S, Hq, D), (B, S, Hkv, D))
        if varlen:
            var.cu_seqlens_q = var.cu_seqlens_k = torch.arange(B + 1, dtype=torch.int32) * S
            var.max_seqlen_q = var.max_seqlen_k = S
        q = torch.randn(shape_q).to(dtype)
        k = torch.randn(shape_k).to(dtype)
        v = torch.randn(shape_k).to(dtype)
        if expand_kv:  # K / V broadcast along the batch (stride 0): forward only, per-tile descriptors
            k, v, fwd_only = k[:1].expand(shape_k), v[:1].expand(shape_k), True
        if varlen and var.block_table is not None:  # paged varlen: forward only, the first page of 16 rows
            var.kv_page_strides = (16 * Hkv * D, 16 * Hkv * D)
            attention_forward(q, k.view(-1, 16, Hkv, D)[0], v.view(-1, 16, Hkv, D)[0], var)
            return
        if var.kv_lens is not None:  # inference: forward only, both the forward and the split-KV kernels
            attention_forward(q, k, v, var)
            decode_forward(q[:, :2], k, v, var, S, 4)
            decode_forward(q[:, :2], k, v, var, S, 1)  # one split: the kernel writes the output
            # a dense decode-shaped call (configs.dense_decode): the decoding kernel over all of k / v
            dense = Variants(var.softmax_scale, win_left=var.win_left, win_right=var.win_right, softcap=var.softcap,
                             alibi_slopes=var.alibi_slopes)
            decode_forward(q[:, :2], k, v, dense, S, 4)
            # the cache's step before attention: in the decoding kernel (rotary q, new rows written by
            # the split that holds them), and as its own kernel before the forward kernel
            k_new, v_new = k[:, :1].clone(), v[:, :1].clone()
            cos, sin = torch.rand(2 * S, D // 4), torch.rand(2 * S, D // 4)
            decode_forward(q[:, :2], k, v, var, S, 4, (k_new, v_new, cos, sin, True, True, B))
            paged = var.block_table is not None
            kc, vc = (k.view(-1, 16, Hkv, D), v.view(-1, 16, Hkv, D)) if paged else (k, v)
            cache_append(q, k_new, v_new, kc, vc, cos, sin, var.kv_lens, var.kv_leftpad, var.kv_batch_idx,
                         var.block_table, False, True)
            return
        out, lse = attention_forward(q, k, v, var)
        if fwd_only:
            return
        os.environ["TRITONATTN_ATOMIC_DQ"] = "1" if atomic_dq else "0"
        os.environ["TRITONATTN_ATOMIC_DQ_TMA"] = "1" if dq_tma else "0"
        os.environ["TRITONATTN_BWD_FUSED_DQ"] = {False: "0", True: "1"}.get(fused_dq, fused_dq)
        os.environ["TRITONATTN_BWD_DESC_3D"] = "1" if desc_3d else "0"
        if section is not None:
            os.environ["TRITONATTN_BWD_FUSED_SECTION"] = section
        if kv_split is not None:  # the Gluon dK/dV kernel's KV_SPLIT (configs.kv_split) forced
            os.environ["TRITONATTN_BWD_KV_SPLIT"] = kv_split
        if first_store:  # the ordered fused dQ's first addition a store (TRITONATTN_BWD_DQ_FIRST_STORE)
            os.environ["TRITONATTN_BWD_DQ_FIRST_STORE"] = "1"
        if split_waits is None:  # the library's default by head dim (configs.BWD_SPLIT_WAITS)
            os.environ.pop("TRITONATTN_BWD_SPLIT_WAITS", None)
        else:
            os.environ["TRITONATTN_BWD_SPLIT_WAITS"] = "1" if split_waits else "0"
        try:
            attention_backward(out, q, k, v, out, lse, var, bias_shape=(B, 1, S, S) if bias_grad else None)
        finally:
            os.environ.pop("TRITONATTN_ATOMIC_DQ")
            os.environ.pop("TRITONATTN_ATOMIC_DQ_TMA")
            os.environ.pop("TRITONATTN_BWD_FUSED_DQ")
            os.environ.pop("TRITONATTN_BWD_DESC_3D")
            os.environ.pop("TRITONATTN_BWD_SPLIT_WAITS", None)
            os.environ.pop("TRITONATTN_BWD_FUSED_SECTION", None)
            os.environ.pop("TRITONATTN_BWD_KV_SPLIT", None)
            os.environ.pop("TRITONATTN_BWD_DQ_FIRST_STORE", None)
        if probs:
            attention_probs(q, k, v, lse, var)

    failures = 0
    plans = []
    if args.all_configs:
        for dt in args.dtypes:
            for D in (16, 32, 64, 128, 256):
                for causal in (False, True):
                    # causal at both lengths: up to configs.SHORT_SEQLEN a short causal forward has its own tile
                    for s in (256, 2048) if causal else (256,):
                        plans.append((f"D{D}-{dt}-{'causal' if causal else 'full'}{'-long' if s > 256 else ''}", D,
                                      dtypes[dt], dict(win_right=0 if causal else None), dict(s=s)))
    else:
        S = 256
        bias = torch.randn(2, 1, S, S)
        keys = torch.ones(2, S, dtype=torch.uint8)
        tile = torch.ones(2, 4, S, S, dtype=torch.uint8)
        alibi = torch.rand(4)
        seed = torch.zeros(1, dtype=torch.int64)
        for dt in args.dtypes:
            base = dict(win_right=0)
            plans += [
                (f"plain-{dt}", 128, dtypes[dt], dict(base), {}),
                (f"plain-long-{dt}", 128, dtypes[dt], dict(base), dict(s=2048)),
                # the Gluon forward and dK/dV kernels (kernels/fwd_sm90.py, bwd_sm90.py: warp-specialized),
                # and with a window's right edge (SDPA's top-left causal mask when Sq != Sk)
                (f"gluon-causal-{dt}", 128, dtypes[dt], dict(base), dict(s=2048, gluon=True)),
                (f"gluon-full-{dt}", 128, dtypes[dt], {}, dict(s=2048, gluon=True)),
                (f"gluon-right-edge-{dt}", 128, dtypes[dt], dict(win_right=-300), dict(s=2048, gluon=True)),
                (f"gluon-varlen-causal-{dt}", 128, dtypes[dt], dict(base), dict(s=2048, gluon=True, varlen=True)),
                # the opt-in atomic dQ in the Gluon dK/dV kernel (FUSED_DQ: TMA reductions)
                (f"gluon-atomic-dq-causal-{dt}", 128, dtypes[dt], dict(base), dict(s=2048, gluon=True, atomic_dq=True)),
                (f"gluon-atomic-dq-full-{dt}", 128, dtypes[dt], {}, dict(s=2048, gluon=True, atomic_dq=True)),
                (f"gluon-atomic-dq-varlen-{dt}", 128, dtypes[dt], dict(base),
                 dict(s=2048, gluon=True, varlen=True, atomic_dq=True)),
                # and deterministic (the default from configs.FUSED_DQ_MIN_SEQLEN: additions ordered by
                # semaphores), dense and packed (a launch per length class: the fused one, the Gluon
                # dK/dV kernel without dQ, the Triton one)
                (f"gluon-fused-dq-full-{dt}", 128, dtypes[dt], {}, dict(s=4096, gluon=True, fused_dq=True)),
                # (its programs on the 2-d grid, the default where a program's steps are past the sections' rule)
                (f"gluon-fused-dq-2d-{dt}", 128, dtypes[dt], {}, dict(s=4096, gluon=True, fused_dq=True, section="0")),
                (f"gluon-fused-dq-varlen-{dt}", 128, dtypes[dt], {}, dict(s=4096, gluon=True, varlen=True,
                                                                          fused_dq=True)),
                # the experiment TRITONATTN_BWD_DQ_FIRST_STORE (key block 0 stores, no zero fill), both grids
                (f"gluon-fused-dq-first-store-{dt}", 128, dtypes[dt], {}, dict(s=4096, gluon=True, fused_dq=True,
                                                                               first_store=True)),
                (f"gluon-fused-dq-first-store-causal-2d-{dt}", 128, dtypes[dt], dict(base),
                 dict(s=4096, gluon=True, fused_dq="all", first_store=True, section="0")),
                # D=64 (128-row tiles; forced: no table entry there, the split dQ wins, NOTES twenty-seventh session)
                # and the experiment TRITONATTN_BWD_FUSED_SECTION (a 1-d grid in sections of kv heads)
                (f"gluon-fused-dq-sections-{dt}", 128, dtypes[dt], {}, dict(s=4096, gluon=True, fused_dq=True,
                                                                            section="3")),
                (f"gluon-fused-dq-sections-varlen-{dt}", 128, dtypes[dt], {},
                 dict(s=4096, gluon=True, varlen=True, fused_dq=True, section="3")),
                (f"gluon-fused-dq-full-D64-{dt}", 64, dtypes[dt], {}, dict(s=4096, gluon=True, fused_dq="all")),
                # the Gluon forward's other head dims (from their lengths), and the Gluon dK/dV kernel at D=64 (full)
                (f"gluon-causal-D64-{dt}", 64, dtypes[dt], dict(base), dict(s=8192, gluon=True)),
                # the Gluon forward with its cycle stamps (fwd_sm90.TRACE_BUF; forward only)
                (f"gluon-trace-causal-{dt}", 128, dtypes[dt], dict(base), dict(s=2048, gluon=True, trace=True,
                                                                              fwd_only=True)),
                # the Gluon forward's plain tile at D=128 (one Q buffer, 3 V slots, the output stored from
                # registers), and three consumers at D=64 with a causal mask (fwd_sm90.TILES, BY_MASK), dense and packed
                (f"gluon-plain-causal-{dt}", 128, dtypes[dt], dict(base), dict(s=2048, gluon=True, fwd_only=True,
                                                                              fwd_tile=PLAIN)),
                (f"gluon-plain-varlen-{dt}", 128, dtypes[dt], dict(base), dict(s=2048, gluon=True, varlen=True,
                                                                              fwd_only=True, fwd_tile=PLAIN)),
                (f"gluon-nc3-causal-D64-{dt}", 64, dtypes[dt], dict(base), dict(s=8192, gluon=True, fwd_tile=NC3,
                                                                              fwd_only=True)),
                (f"gluon-nc3-varlen-D64-{dt}", 64, dtypes[dt], dict(base), dict(s=8192, gluon=True, fwd_tile=NC3,
                                                                              varlen=True, fwd_only=True)),
                # tile experiments of the Gluon forward, on the shapes named in fwd_tile_cases: without
                # SPLIT_WAIT (the softmax while the last P V runs; the default at D=128 and D=256), with it at
                # D=64 (three consumers);
                *fwd_tile_cases("no-split-wait", dt, dict(SPLIT_WAIT=False), "full", "full-D256"),
                *fwd_tile_cases("split-wait", dt, dict(SPLIT_WAIT=True), "full-D64"),
                # TREE_MAX (the row max as a tree; an experiment): D=64 causal (two consumers) and full (three)
                *fwd_tile_cases("tree-max", dt, dict(TREE_MAX=True), "causal-D64", "full-D64"),
                # K / V broadcast along the batch: the Gluon forward's per-tile descriptors on a dense call
                (f"gluon-expanded-kv-causal-{dt}", 128, dtypes[dt], dict(base), dict(s=2048, gluon=True,
                                                                                    expand_kv=True)),
                # TRITONATTN_BWD_SPLIT_WAITS=1 (the default at D=64 only): the dK/dV consumers await a step's
                # products one at a time; causal (split dQ), the fused dQ forced (without a mask at 4096); and
                # =0 at D=64 causal
                (f"gluon-bwd-split-waits-causal-{dt}", 128, dtypes[dt], dict(base), dict(s=2048, gluon=True,
                                                                                        split_waits=True)),
                (f"gluon-bwd-split-waits-fused-{dt}", 128, dtypes[dt], {}, dict(s=4096, gluon=True, fused_dq=True,
                                                                               split_waits=True)),
                (f"gluon-bwd-no-split-waits-causal-D64-{dt}", 64, dtypes[dt], dict(base),
                 dict(s=8192, gluon=True, split_waits=False)),
                # KV_SPLIT (configs.kv_split: under one wave of programs; forced here): a kv head's query heads
                # over two programs, fp32 partials of dK / dV, then their sum kernel; D=64 / 128 / 256
                *((f"gluon-kv-split-causal-D{d}-{dt}", d, dtypes[dt], dict(base),
                   dict(s=8192 if d == 64 else 2048, gluon=True, kv_split="2")) for d in (64, 128, 256)),
                # packed: the kernel's IS_VARLEN with KV_SPLIT, the sum kernel's IS_VARLEN (by length class)
                (f"gluon-kv-split-varlen-causal-{dt}", 128, dtypes[dt], dict(base),
                 dict(s=2048, gluon=True, varlen=True, kv_split="2")),
                # and on a 1-d grid in sections of kv heads (configs.DKDV_SECTION_WAVES, an experiment)
                (f"gluon-kv-split-sections-causal-{dt}", 128, dtypes[dt], dict(base),
                 dict(s=2048, gluon=True, kv_split="2", dkdv_sections=True)),
                # the opt-in TRITONATTN_BWD_DESC_3D=1: the dK/dV producer's one 3-d Q / dO descriptor
                (f"gluon-bwd-desc-3d-causal-{dt}", 128, dtypes[dt], dict(base), dict(s=2048, gluon=True, desc_3d=True)),
                # with the D=64 causal split into two loops (SPLIT_DIAG), D=256's split by gradient, packed
                (f"gluon-bwd-desc-3d-causal-D64-{dt}", 64, dtypes[dt], dict(base), dict(s=8192, gluon=True,
                                                                                        desc_3d=True)),
                (f"gluon-bwd-desc-3d-causal-D256-{dt}", 256, dtypes[dt], dict(base), dict(s=8192, gluon=True,
                                                                                          desc_3d=True)),
                (f"gluon-bwd-desc-3d-varlen-{dt}", 128, dtypes[dt], dict(base), dict(s=2048, gluon=True, varlen=True,
                                                                                     desc_3d=True)),
                (f"gluon-atomic-dq-full-D64-{dt}", 64, dtypes[dt], {}, dict(s=8192, gluon=True, atomic_dq=True)),
                # D=256: the dK/dV kernel's consumers split by gradient (bwd_sm90 SPLIT_GRADS)
                (f"gluon-causal-D256-{dt}", 256, dtypes[dt], dict(base), dict(s=8192, gluon=True)),
                (f"gluon-full-D256-{dt}", 256, dtypes[dt], {}, dict(s=2048, gluon=True)),
                (f"gluon-varlen-causal-D256-{dt}", 256, dtypes[dt], dict(base), dict(s=2048, gluon=True, varlen=True)),
                # the Gluon dK/dV kernel's causal steps in two loops (bwd.SPLIT_DIAG_ROWS: D=64's 128-row
                # tiles, above), forced at D=128 with the ordered fused dQ
                (f"gluon-split-diag-fused-causal-{dt}", 128, dtypes[dt], dict(base),
                 dict(s=4096, gluon=True, split_diag=True, fused_dq="all")),
                # the long causal tile with its key block capped for a bias tile and dropout's bits
                (f"bias-dropout-long-{dt}", 128, dtypes[dt],
                 dict(base, dropout_p=0.1, seed=seed, bias=torch.randn(2048).expand(2, 4, 2048, 2048)), dict(s=2048)),
                # the short forward's tile for many query tiles (configs.WIDE_PROGRAMS; plain dense calls:
                # a packed sequence takes what its own dense call, of one sequence, takes)
                (f"full-wide-{dt}", 128, dtypes[dt], {}, dict(b=256)),
                (f"window-{dt}", 128, dtypes[dt], dict(win_left=64, win_right=0), {}),
                (f"softcap-alibi-{dt}", 128, dtypes[dt], dict(base, softcap=30.0, alibi_slopes=alibi), {}),
                (f"bias-grad-{dt}", 128, dtypes[dt], dict(base, bias=bias.expand(2, 4, S, S)), dict(bias_grad=True)),
                (f"masks-{dt}", 64, dtypes[dt], dict(mask=keys, mask_kind=MASK_KEYS), {}),
                (f"mask-tile-{dt}", 64, dtypes[dt], dict(mask=tile, mask_kind=MASK_TILE), {}),
                (f"dropout-{dt}", 128, dtypes[dt], dict(base, dropout_p=0.1, seed=seed), dict(probs=True)),
                (f"varlen-{dt}", 128, dtypes[dt], dict(base), dict(varlen=True)),
                (f"varlen-paged-{dt}", 128, dtypes[dt],
                 dict(base, block_table=torch.zeros(2, 16, dtype=torch.int32), page_size=16), dict(varlen=True)),
                (f"varlen-bias-grad-{dt}", 128, dtypes[dt], dict(base, bias=bias.expand(2, 4, S, S)),
                 dict(varlen=True, bias_grad=True)),
                (f"atomic-dq-{dt}", 128, dtypes[dt], dict(base), dict(atomic_dq=True)),
                (f"atomic-dq-full-{dt}", 64, dtypes[dt], {}, dict(atomic_dq=True)),
                (f"atomic-dq-pointer-{dt}", 128, dtypes[dt], dict(base), dict(atomic_dq=True, dq_tma=False)),
                (f"atomic-dq-varlen-{dt}", 128, dtypes[dt], dict(base), dict(atomic_dq=True, varlen=True)),
                (f"atomic-dq-D96-bias-{dt}", 96, dtypes[dt], dict(base, bias=bias.expand(2, 4, S, S)),
                 dict(atomic_dq=True, bias_grad=True)),
                (f"varlen-dropout-{dt}", 64, dtypes[dt], dict(win_left=32, dropout_p=0.1, seed=seed),
                 dict(varlen=True, probs=True)),
                (f"kvcache-paged-{dt}", 128, dtypes[dt],
                 dict(base, kv_lens=torch.full((2,), 200, dtype=torch.int32),
                      kv_leftpad=torch.zeros(2, dtype=torch.int32), block_table=torch.zeros(2, 16, dtype=torch.int32),
                      page_size=16, kv_page_strides=(16 * 2 * 128, 16 * 2 * 128)), {}),
                *[(f"all-variants-D{D}-{dt}", D, dtypes[dt],
                   dict(win_left=48, win_right=0, softcap=20.0, alibi_slopes=alibi, dropout_p=0.1, seed=seed,
                        bias=bias.expand(2, 4, S, S)), dict(bias_grad=True)) for D in (64, 96, 128, 256)],
                (f"dropout-key-bias-D96-{dt}", 96, dtypes[dt],
                 dict(base, dropout_p=0.25, seed=seed, bias=torch.randn(S).expand(2, 4, S, S)), dict(bias_grad=True)),
                # the backward through pointers at the power-of-two head dims (their pointer-path tiles)
                *[(f"pointer-bwd-D{D}-{'causal' if c else 'full'}-{dt}", D, dtypes[dt],
                   dict(win_right=0) if c else {}, dict(tma=False))
                  for D, c in ((64, True), (128, True), (256, False))],
                # one query row: the backward's query loops fold away (found on the H200 with TMA)
                (f"seqlen-q-1-{dt}", 128, dtypes[dt], {}, dict(sq=1)),
                (f"seqlen-q-1-causal-D256-{dt}", 256, dtypes[dt], dict(base), dict(sq=1)),
                (f"seqlen-q-1-atomic-dq-{dt}", 128, dtypes[dt], {}, dict(sq=1, atomic_dq=True)),
                (f"kvcache-pdl-{dt}", 128, dtypes[dt],
                 dict(kv_lens=torch.full((2,), 200, dtype=torch.int32)), dict(pdl=True)),
                (f"kvcache-batch-idx-{dt}", 128, dtypes[dt],
                 dict(kv_lens=torch.full((2,), 200, dtype=torch.int32), alibi_slopes=alibi, softcap=20.0,
                      kv_batch_idx=torch.zeros(2, dtype=torch.int32)), {}),
            ]
    # head-dim and gradient splits of the dK / dV kernel (candidates for D=256, where the unsplit
    # accumulators spill; others with --split-head-dims)
    for dt in args.dtypes:
        for D in args.split_head_dims:
            for cfg in configs.CANDIDATES[D]["bwd_dkdv"]:
                if cfg.d_split > 1 or cfg.split_grads:
                    name = "-".join(map(str, cfg[:5])) + ("-grads" if cfg.split_grads else "")
                    plans.append((f"dkdv-{name}-D{D}-{dt}", D, dtypes[dt], dict(win_right=0), dict(dkdv=cfg)))
    plans = [p for p in plans if not args.only or args.only in p[0]]
    print(f"{'case':28} {'kernel':24} {'config':34} {'regs':>5} {'spill':>6} {'smem':>7} {'compile s':>9}")
    for label, D, dtype, var_kw, run_kw in plans:
        start = len(RESULTS)
        try:
            run(D, dtype, Variants(softmax_scale=D ** -0.5, **var_kw), **run_kw)
        except Exception as e:  # noqa: BLE001
            failures += 1
            print(f"{label:28} FAILED TO COMPILE: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            if os.environ.get("COMPILE_CHECK_TRACE"):
                print(e, repr(e.__cause__), repr(e.__context__))
            continue
        # the Gluon dK / dV kernel where the table serves the case (never at D=64 with a mask)
        first = 0 if run_kw.get("split_diag") else \
            configs.GLUON_MIN_SEQLEN["bwd_dkdv"].get(D, (math.inf, math.inf))["win_right" in var_kw]
        # (a forward-only case: no backward kernel)
        backward = run_kw.get("s", 0) >= first and not (run_kw.get("expand_kv") or run_kw.get("fwd_only"))
        wanted = {"_fwd_ws_kernel"} | ({"_bwd_dkdv_ws_kernel"} if backward else set())
        missing = wanted - {r["name"] for r in RESULTS[start:]}
        if run_kw.get("gluon") and missing:
            failures += 1  # a Gluon case that compiled a Triton kernel instead (Gluon off, or refused)
            print(f"{label:28} FAILED: {', '.join(sorted(missing))} not compiled (TRITONATTN_FWD_GLUON / "
                  "TRITONATTN_BWD_GLUON / the GLUON_VARLEN switches, fwd._gluon_ok / bwd._gluon_ok)")
            continue
        for n, r in enumerate(RESULTS[start:]):
            regs, spill = resources(r["kernel"])
            smem = r["kernel"].metadata.shared
            cfg = " ".join(f"{k}={v}" for k, v in r["cfg"].items())
            flag = "  <-- over the shared-memory limit" if smem > SMEM_LIMIT else ("  <-- spills" if spill else "")
            failures += smem > SMEM_LIMIT
            print(f"{label:28} {r['name']:24} {cfg:34} {regs:5d} {spill:6d} {smem:7d} {r['seconds']:9.1f}{flag}",
                  flush=True)
            if args.dump:
                dump(r["kernel"], os.path.join(args.dump, f"{label}.{n}.{r['name']}"))
    print(f"\n{len(RESULTS)} kernels compiled for sm_90, {failures} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
