"""The Gluon dK/dV kernel (tritonattn/kernels/bwd_sm90.py) by tile, against the fp64 reference and
the library's Triton dK/dV kernel, on the H200.

First checks dK / dV on odd shapes with the tests' tolerance rule (lse from the library's forward,
delta = rowsum(dO * O)) for every tile; then times each tile (CUDA-graph replays of the kernel
alone) beside the Triton dK/dV kernel, whose time is read from the profiler over whole backwards
with the Gluon kernel off (llama shape, Hq=32, Hkv=8, D=128, 16k tokens per batch, bf16).
The first session's Gluon dQ kernel lost (0.91-1.03x the Triton one): in git at 4f07f6c
(benchmarks/experiments/gluon_bwd_dq.py).

    python benchmarks/experiments/tune_gluon_bwd.py [--seqlens 512 2048] [--tiles 64,2 p:64,2,2] \
        [--tokens 16384] [--sections 1 2 4]

A tile ``BLOCK_M,STAGES`` is the library's kernel (with ``--head-dim 256`` its consumers split by
gradient; the eighteenth session's D=256 experiment, gluon_bwd_d256.py, became that, and its
variant recomputing P^T, tile ``r:``, lost: in git at b1f6575), its causal blocks in two loops for
tiles of bwd.SPLIT_DIAG_ROWS rows; ``s:BLOCK_M,STAGES`` in two loops at any tile. A tile ``p:BLOCK_M,STAGES,KV_BUFS`` is
the persistent experiment (gluon_bwd_persistent.py beside this; causal with pairs of key blocks,
``h:...`` the same with the twelfth session's heaviest-first order, which lost 15-35% causal in the
thirteenth), checked on one program per SM, on 5 programs (many tiles each), and causal on 5
programs in sections of one kv head; ``--sections`` also times it (causal) with these kv heads per
section.

The eleventh session's Gluon dK/dV kernel with dQ fused (fp32 atomics) lost 2x: in git at 07734a4
(benchmarks/experiments/gluon_bwd_fused_dq.py, run with this script's --fused there).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))

import gluon_bwd_persistent  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
from tune_gluon_fwd import graph_time, one_launch_per_kernel, packed_batches  # noqa: E402

from tritonattn import flash_attn_func  # noqa: E402
from tritonattn.kernels import bwd, bwd_sm90, fwd  # noqa: E402
from tritonattn.kernels.common import LOG2E  # noqa: E402
from tritonattn.testing import attention_ref, check_close  # noqa: E402


def delta_of(out, do):
    return (out.float() * do.float()).sum(-1).transpose(1, 2).contiguous()


def run(q, k, v, out, lse, do, causal, tile, delta=None, grads=None, programs=None):
    """dK, dV from a Gluon kernel: tile (BLOCK_M, STAGES) the library's, ("p", BLOCK_M, STAGES,
    KV_BUFS) the persistent experiment on one program per SM (or ``programs``). The timed calls
    pass ``delta`` and the output buffers (``grads``), so that only the kernel is timed."""
    D = q.shape[-1]
    delta = delta_of(out, do) if delta is None else delta
    dk, dv = grads if grads is not None else (torch.full_like(k, float("nan")), torch.full_like(v, float("nan")))
    fwd._need_allocator()
    scales = (0, D ** -0.5 * LOG2E.value, D ** -0.5)
    if tile[0] in ("p", "h"):
        kind, block_m, stages, kv_bufs = tile
        programs = programs or torch.cuda.get_device_properties(q.device).multi_processor_count
        gluon_bwd_persistent._bwd_dkdv_persistent_kernel[gluon_bwd_persistent.grid(k, programs)](
            *gluon_bwd_persistent.launch_args(q, k, v, do, lse, delta, dk, dv, *scales), CAUSAL=causal, HEAD_DIM=D,
            BLOCK_M=block_m, STAGES=stages, KV_BUFS=kv_bufs, PAIRS=kind == "p", num_warps=bwd_sm90.NUM_WARPS,
            maxnreg=bwd_sm90.MAXNREG)
        return dk, dv
    forced = tile[0] == "s"  # two causal loops whatever the tile (else the launcher's rule)
    block_m, stages = tile[1:] if forced else tile
    split_diag = forced or block_m >= bwd.SPLIT_DIAG_ROWS
    grid = (triton.cdiv(k.shape[1], bwd_sm90.block_n(D)), k.shape[0] * k.shape[2])
    bwd_sm90._bwd_dkdv_ws_kernel[grid](
        *bwd_sm90.launch_args(q, k, v, do, lse, delta, dk, dv, *scales), CAUSAL=causal, HEAD_DIM=D, BLOCK_M=block_m,
        STAGES=stages, num_warps=bwd_sm90.NUM_WARPS, maxnreg=bwd_sm90.MAXNREG, SPLIT_DIAG=split_diag)
    return dk, dv


def check(tiles, D=128) -> int:
    failures = 0
    cases = [  # B, Sq, Sk, Hq, Hkv, causal
        (2, 1000, 1000, 4, 2, False), (2, 1000, 1000, 4, 2, True), (1, 77, 300, 4, 1, True),
        (1, 300, 77, 4, 4, True), (1, 1, 513, 2, 1, True), (2, 2048, 2048, 8, 2, True), (1, 17, 4096, 2, 2, False),
    ]
    runs = []  # (tile, programs, kv heads per section)
    for tile in tiles:
        runs += [(tile, None, None)] + ([(tile, 5, None), (tile, 5, 1)] if tile[0] in ("p", "h") else [])
    for tile, programs, sec in runs:
        for B, Sq, Sk, Hq, Hkv, causal in cases:
            if sec and not causal:  # (sections order causal tiles only)
                continue
            torch.manual_seed(0)
            q, k, v = (torch.randn(B, s, h, D, device="cuda", dtype=torch.bfloat16)
                       for s, h in ((Sq, Hq), (Sk, Hkv), (Sk, Hkv)))
            out, lse, _ = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
            do = torch.randn_like(out)
            ins = [t.detach().double().requires_grad_() for t in (q, k, v)]
            ref = attention_ref(*ins, causal=causal)[0]
            rq, rk, rv = torch.autograd.grad(ref, ins, do.double())
            pt = [t.detach().clone().requires_grad_() for t in (q, k, v)]
            same = attention_ref(*pt, causal=causal, upcast=False)[0]
            sq, sk, sv = torch.autograd.grad(same, pt, do)
            magnitude = max(r.abs().max().item() for r in (rq, rk, rv))
            label = (f"dkdv {tile} B{B}-Sq{Sq}-Sk{Sk}-H{Hq}/{Hkv}{'-causal' if causal else ''}"
                     f"{f' programs={programs}' if programs else ''}{f' section={sec}' if sec else ''}")
            gluon_bwd_persistent.HEADS_PER_SECTION = sec
            try:
                dk, dv = run(q, k, v, out, lse, do, causal, tile, programs=programs)
                check_close("dk", dk, rk, sk, 3, magnitude=magnitude)
                check_close("dv", dv, rv, sv, 3, magnitude=magnitude)
                print("ok  ", label, flush=True)
            except AssertionError as e:
                failures += 1
                print("FAIL", label, e, flush=True)
            finally:
                gluon_bwd_persistent.HEADS_PER_SECTION = None
    return failures


def library_ms(q, k, v, do, causal, name: str) -> float:
    """The library's kernels whose names hold ``name`` ("_bwd_dkdv_kernel", "_bwd_dq"), ms per
    backward, from the profiler over 5 backwards, with the Gluon dK/dV kernel off."""
    from torch.profiler import ProfilerActivity, profile

    gluon, bwd.GLUON = bwd.GLUON, False
    try:
        return _profiled_ms(q, k, v, do, causal, name, profile, ProfilerActivity)
    finally:
        bwd.GLUON = gluon


def _profiled_ms(q, k, v, do, causal, name, profile, ProfilerActivity) -> float:
    out = flash_attn_func(q, k, v, causal=causal)
    torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
        torch.cuda.synchronize()
    us = sum(e.device_time_total for e in prof.key_averages() if name in e.key)
    return us / 5 / 1e3


def llama_inputs(B, S, causal, D=128):
    """q, k, v (llama heads, bf16, requiring grad), dO, the kernels' arguments (with the library
    forward's out and lse) and delta."""
    q, k, v = (torch.randn(B, S, h, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for h in (32, 8, 8))
    do = torch.randn_like(q)
    out, lse, _ = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    args = (q.detach(), k.detach(), v.detach(), out.detach(), lse, do, causal)
    return q, k, v, do, args, delta_of(out.detach(), do)


def bench(seqlens, tiles, tokens=16384, sections=(), D=128) -> None:
    print("| S | causal | kernel | ms | TFLOP/s of its products | x library |")
    print("|---|---|---|---|---|---|")
    for S in seqlens:
        B = max(1, tokens // S)
        for causal in (False, True):
            q, k, v, do, args, delta = llama_inputs(B, S, causal, D)
            product = 2 * B * 32 * S * S * D / (2 if causal else 1)
            buffers = (torch.empty_like(k), torch.empty_like(v))
            base = library_ms(q, k, v, do, causal, "_bwd_dkdv_kernel")
            flops = 4 * product
            print(f"| {S} | {causal} | triton dK/dV | {base:.4f} | {flops / base / 1e9:.1f} | 1.00 |", flush=True)
            persistent = [t for t in tiles if t[0] in ("p", "h")]
            runs = [(t, None) for t in tiles]
            if causal and persistent:
                runs += [(persistent[0], n) for n in sections]
            for tile, sec in runs:
                gluon_bwd_persistent.HEADS_PER_SECTION = sec
                try:
                    ms = graph_time(lambda tile=tile: run(*args, tile, delta, buffers))
                finally:
                    gluon_bwd_persistent.HEADS_PER_SECTION = None
                name = f"gluon dK/dV {tile}" + (f" section {sec}" if sec else "")
                print(f"| {S} | {causal} | {name} | {ms:.4f} | {flops / ms / 1e9:.1f} | {base / ms:.2f} |", flush=True)


def bench_varlen(seqlens) -> None:
    """Packed sequences (flash_attn_varlen_func, 16k tokens, llama heads, D=128, bf16): the Triton
    dK/dV kernel against the Gluon one's varlen path (bwd.GLUON_VARLEN), and the default (a launch
    per length class, every sequence bitwise its dense call) against one launch with the longest
    sequence's tiles (launch.LENGTH_CLASSES off: what the classes cost, forward and backward). Each
    graph captures the forward and the backward (a backward captured alone would wait on the eager
    forward's stream, which a capture may not do); the forward alone is timed too and subtracted.
    Equal lengths S, and ragged ones (S, S/2, 3S/2 repeated)."""
    from tritonattn import flash_attn_varlen_func

    varlen_default = bwd.GLUON_VARLEN
    print("| S | lengths | causal | forward ms | backward, Triton dK/dV ms | Gluon dK/dV ms | x Triton | "
          "one launch: forward ms | backward ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for S, _, kind, lens, cu, q, k, v in packed_batches(seqlens, requires_grad=True):
        do = torch.randn_like(q)
        for causal in (False, True):
            def forward(q=q, k=k, v=v, cu=cu, lens=lens, causal=causal):
                return flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=causal)

            def both_ms(forward=forward, q=q, k=k, v=v, do=do) -> float:
                """The forward + backward's time (a graph of both)."""
                return graph_time(lambda: torch.autograd.grad(forward(), (q, k, v), do))

            fwd_ms = graph_time(forward)
            times = []
            for on in (False, True):
                bwd.GLUON_VARLEN = on
                try:
                    times.append(both_ms() - fwd_ms)
                finally:
                    bwd.GLUON_VARLEN = varlen_default
            with one_launch_per_kernel():
                one_fwd = graph_time(forward)
                one_bwd = both_ms() - one_fwd
            print(f"| {S} | {kind} | {causal} | {fwd_ms:.4f} | {times[0]:.4f} | {times[1]:.4f} | "
                  f"{times[0] / times[1]:.2f} | {one_fwd:.4f} | {one_bwd:.4f} |", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqlens", type=int, nargs="+", default=[512, 1024, 2048, 8192])
    p.add_argument("--tiles", nargs="+", default=["64,2", "p:64,2,1", "p:64,2,2"],
                   help="BLOCK_M,STAGES (the library's kernel; s:BLOCK_M,STAGES: with SPLIT_DIAG at any tile) or "
                        "p:BLOCK_M,STAGES,KV_BUFS (persistent; h: its heaviest-first causal order)")
    p.add_argument("--tokens", type=int, default=16384, help="tokens per batch (B = tokens / S)")
    p.add_argument("--sections", type=int, nargs="*", default=[],
                   help="causal: also time the first persistent tile with these kv heads per section")
    p.add_argument("--head-dim", type=int, default=128, help="the llama heads (Hq=32, Hkv=8) at this head dim")
    p.add_argument("--no-check", action="store_true")
    p.add_argument("--varlen", action="store_true", help="also time packed backwards through the varlen path")
    args = p.parse_args()
    tiles = [(t[0], *(int(x) for x in t[2:].split(","))) if t[:2] in ("p:", "h:", "s:", "d:", "r:")
             else tuple(int(x) for x in t.split(",")) for t in args.tiles]
    failures = 0 if args.no_check else check(tiles, args.head_dim)
    bench(args.seqlens, tiles, args.tokens, args.sections, args.head_dim)
    if args.varlen:
        bench_varlen(args.seqlens)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
