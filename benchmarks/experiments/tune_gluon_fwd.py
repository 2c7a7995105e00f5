"""The Gluon sm_90 forward (tritonattn/kernels/fwd_sm90.py: persistent, warp-specialized, ping-pong)
against the library's Triton forward and cuDNN, on the H200, by tile (BLOCK_N,STAGES,Q_BUFS,K_APART). The
first Gluon tries that lost (intra-warpgroup overlap, lazy rescaling; benchmarks/NOTES.md, tenth
session) are in git at 57d25c1 (benchmarks/experiments/gluon_fwd_sm90.py); the kernel before it
became persistent (one program per tile) at 9f458fb.

First checks it on odd shapes against the fp64 reference (the tolerance rule of the tests), then
times tiles of it beside the library's default forward and SDPA's cuDNN backend, each as the
median of CUDA-event timings of CUDA-graph replays (kernel time), llama shape (Hq=32, Hkv=8) at
16k tokens per batch, bf16.

    python benchmarks/experiments/tune_gluon_fwd.py [--seqlens 2048 8192] [--head-dims 64 128] \
        [--tiles 128,3,1 128,2,2] [--varlen]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.runtime.errors import OutOfResources  # noqa: E402

from tritonattn import flash_attn_func  # noqa: E402
from tritonattn.kernels import fwd, fwd_sm90  # noqa: E402
from tritonattn.kernels.common import LOG2E  # noqa: E402
from tritonattn.testing import attention_ref, check_close  # noqa: E402


def run(q, k, v, causal, tile, win_right=0, programs=None, poison=True):
    """tile: (BLOCK_N, STAGES, Q_BUFS, K_APART) of the library's Gluon forward (tritonattn/kernels/fwd_sm90.py;
    two consumers, the output stored from registers, no SPLIT_WAIT: the tile tuner of the
    tenth-twentieth sessions; the library's defaults since differ, fwd_sm90.TILES),
    on one program per SM or on ``programs``. ``poison``: out and lse start as NaN (the checks);
    timings pass False: in a graph replay the two fills are kernels too (9-11% of the forward at
    S=1024-2048, B=1-4, which the library's calls, timed beside it, do not pay; fourteenth session)."""
    B, Sq, Hq, D = q.shape
    if poison:
        out, lse = torch.full_like(q, float("nan")), torch.full((B, Hq, Sq), float("nan"), device=q.device)
    else:
        out, lse = torch.empty_like(q), torch.empty((B, Hq, Sq), device=q.device)
    fwd._need_allocator()
    bn, stages, q_bufs, k_apart = tile
    tiles = triton.cdiv(Sq, 2 * fwd_sm90.HALF.value) * B * Hq  # (the kernel's default: two consumers)
    programs = programs or torch.cuda.get_device_properties(q.device).multi_processor_count
    fwd_sm90._fwd_ws_kernel[(min(tiles, programs),)](
        *fwd_sm90.launch_args(q, k, v, out, lse, win_right, D ** -0.5 * LOG2E.value), CAUSAL=causal, HEAD_DIM=D,
        BLOCK_N=bn, STAGES=stages, V_STAGES=stages, Q_BUFS=q_bufs, num_warps=fwd_sm90.NUM_WARPS,
        maxnreg=fwd_sm90.MAXNREG, K_APART=bool(k_apart))
    return out, lse


def check(tiles, head_dims) -> int:
    """Each tile against the fp64 reference on the cases of ``head_dims`` (the library's tile for
    D=128 does not fit D=256's shared memory)."""
    failures = 0
    cases = [  # B, Sq, Sk, Hq, Hkv, D, causal
        (2, 1000, 1000, 4, 2, 128, False), (2, 1000, 1000, 4, 2, 128, True), (1, 77, 300, 4, 1, 128, True),
        (1, 300, 77, 4, 4, 128, True), (1, 300, 77, 4, 4, 64, False), (3, 129, 129, 2, 2, 64, True),
        (1, 1, 1, 2, 1, 128, False), (1, 1, 513, 2, 1, 64, True), (2, 2048, 2048, 8, 2, 128, True),
        (1, 17, 4096, 2, 2, 128, False), (1, 1000, 1000, 4, 2, 256, True), (2, 300, 777, 4, 4, 256, False),
    ]
    for tile in tiles:
        for B, Sq, Sk, Hq, Hkv, D, causal in cases:
            if D not in head_dims:
                continue
            torch.manual_seed(0)
            q = torch.randn(B, Sq, Hq, D, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(B, Sk, Hkv, D, device="cuda", dtype=torch.bfloat16)
            v = torch.randn(B, Sk, Hkv, D, device="cuda", dtype=torch.bfloat16)
            ref, ref_lse = attention_ref(q, k, v, causal=causal)
            same, same_lse = attention_ref(q, k, v, causal=causal, upcast=False)
            # one program per SM (132 give only the largest case several tiles each), and 5 programs:
            # many tiles each (ring, turns and Q buffers counted across tiles); causal, also sections
            # of 2 heads (the last one narrower when the heads are odd)
            for programs, sec in ((None, None), (5, None), (5, 2)):
                fwd_sm90.HEADS_PER_SECTION = sec
                label = (f"tile {tile} B{B}-Sq{Sq}-Sk{Sk}-H{Hq}/{Hkv}-D{D}{'-causal' if causal else ''}"
                         f" programs={programs or 'SMs'} section={sec or 'rule'}")
                try:
                    out, lse = run(q, k, v, causal, tile, programs=programs)
                except OutOfResources as e:  # a tile too large for this head dim
                    print("skip", label, str(e)[:80], flush=True)
                    break
                finally:
                    fwd_sm90.HEADS_PER_SECTION = None
                try:
                    check_close("out", out, ref, same, 2)
                    check_close("lse", lse, ref_lse, same_lse, 2)
                    print("ok  ", label, flush=True)
                except AssertionError as e:
                    failures += 1
                    print("FAIL", label, e, flush=True)
    return failures


@contextlib.contextmanager
def one_launch_per_kernel():
    """Packed calls as before the length classes (launch.LENGTH_CLASSES off: one launch per kernel,
    the longest sequence's tile), with the launch plans cleared on the way in and out."""
    from tritonattn.kernels import launch, plan

    launch.LENGTH_CLASSES = False
    plan.clear()
    try:
        yield
    finally:
        launch.LENGTH_CLASSES = True
        plan.clear()


def graph_time(fn) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return triton.testing.do_bench(g.replay, warmup=25, rep=100, return_mode="median")


def bench(seqlens, head_dims, tiles, tokens, sections, batches=None) -> None:
    gluon_default = fwd.GLUON
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    print("| D | S | B | causal | backend | ms | TFLOP/s | x cuDNN | x triton |")
    print("|---|---|---|---|---|---|---|---|---|")
    for D in head_dims:
        Hq, Hkv = (32, 8) if D == 128 else (2048 // D, 2048 // D // 4)
        for S, B in [(s, b) for s in seqlens for b in (batches or [max(1, tokens // s)])]:
            for causal in (False, True):
                q = torch.randn(B, S, Hq, D, device="cuda", dtype=torch.bfloat16)
                k = torch.randn(B, S, Hkv, D, device="cuda", dtype=torch.bfloat16)
                v = torch.randn(B, S, Hkv, D, device="cuda", dtype=torch.bfloat16)
                flops = 4 * B * Hq * S * S * D / (2 if causal else 1)
                qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
                times = {}

                def cudnn():
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        sdpa(qt, kt, vt, is_causal=causal, enable_gqa=True)

                times["cudnn"] = graph_time(cudnn)
                fwd.GLUON = False  # the library's Triton forward (the Gluon one now serves these calls)
                try:
                    times["triton"] = graph_time(lambda: flash_attn_func(q, k, v, causal=causal))
                finally:
                    fwd.GLUON = gluon_default
                # causal, also without pairs: a program per tile, heaviest first, dealt by the hardware as
                # SMs free up (only where the tiles outnumber the SMs: else it is the default launch)
                tiles_n = triton.cdiv(S, 2 * fwd_sm90.HALF.value) * B * Hq
                per_tile = causal and tiles_n > torch.cuda.get_device_properties(q.device).multi_processor_count
                rule = fwd_sm90.section_heads(B * Hq, Hq // Hkv, S, q)  # the default order's section
                runs = [(f"gluon {t}" + (f" section {rule}" if causal else ""), t, None, None) for t in tiles]
                runs += [(f"gluon {tiles[0]} section {n}", tiles[0], n, None) for n in sections if causal]
                runs += [(f"gluon {tiles[0]} program per tile", tiles[0], None, tiles_n)] if per_tile else []
                for name, tile, sec, programs in runs:
                    fwd_sm90.HEADS_PER_SECTION = sec
                    try:
                        times[name] = graph_time(
                            lambda tile=tile, programs=programs: run(q, k, v, causal, tile, programs=programs,
                                                                     poison=False))
                    except Exception as e:  # noqa: BLE001 (a tile that does not fit: reported, the sweep goes on)
                        why = str(e).splitlines()[0][:80].replace("|", "/") if str(e) else ""
                        print(f"| {D} | {S} | {B} | {causal} | {name} | {type(e).__name__}: {why} | | | |")
                    finally:
                        fwd_sm90.HEADS_PER_SECTION = None
                for name, ms in times.items():
                    print(f"| {D} | {S} | {B} | {causal} | {name} | {ms:.4f} | {flops / ms / 1e9:.1f} | "
                          f"{times['cudnn'] / ms:.2f} | {times['triton'] / ms:.2f} |", flush=True)


def packed_batches(seqlens, requires_grad: bool = False):
    """The varlen timings' batches (16k tokens, llama heads Hq=32 / Hkv=8, D=128, bf16): for each S,
    equal lengths S and ragged ones (S, S/2, 3S/2 repeated). Yields (S, n, kind, lens, cu, q, k, v),
    n the number of equal sequences, cu the int32 cu_seqlens of both queries and keys."""
    for S in seqlens:
        n = max(1, 16384 // S)
        for kind, lens in (("equal", [S] * n), ("ragged", ([S, S // 2, 3 * S // 2] * n)[:max(n, 3)])):
            cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device="cuda")
            q, k, v = (torch.randn(sum(lens), h, 128, device="cuda", dtype=torch.bfloat16,
                                   requires_grad=requires_grad) for h in (32, 8, 8))
            yield S, n, kind, lens, cu, q, k, v


def bench_varlen(seqlens) -> None:
    """Packed sequences (flash_attn_varlen_func, 16k tokens, llama heads, D=128, bf16): the Triton
    forward against the Gluon forward's varlen path (fwd.GLUON_VARLEN), the default (a launch per
    length class) against one launch with the longest sequence's kernel (launch.LENGTH_CLASSES
    off), and the dense Gluon call of the same work, as graph replays. Equal lengths S, and ragged
    ones (S, S/2, 3S/2 repeated)."""
    from tritonattn import flash_attn_varlen_func

    varlen_default = fwd.GLUON_VARLEN
    print("| S | lengths | causal | triton varlen ms | gluon varlen ms | x triton | one launch ms | gluon dense ms |")
    print("|---|---|---|---|---|---|---|---|")
    for S, n, kind, lens, cu, q, k, v in packed_batches(seqlens):
        for causal in (False, True):
            def call(q=q, k=k, v=v, cu=cu, lens=lens, causal=causal):
                flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=causal)

            times = []
            for on in (False, True):
                fwd.GLUON_VARLEN = on
                try:
                    times.append(graph_time(call))
                finally:
                    fwd.GLUON_VARLEN = varlen_default
            with one_launch_per_kernel():
                one = graph_time(call)
            dense = "-"
            if kind == "equal":
                qd, kd, vd = (t.view(n, S, *t.shape[1:]) for t in (q, k, v))
                dense = f"{graph_time(lambda: flash_attn_func(qd, kd, vd, causal=causal)):.4f}"
            print(f"| {S} | {kind} | {causal} | {times[0]:.4f} | {times[1]:.4f} | {times[0] / times[1]:.2f} | "
                  f"{one:.4f} | {dense} |", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqlens", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--head-dims", type=int, nargs="+", default=[128, 64])
    p.add_argument("--tiles", nargs="+", default=["128,3,1,0"],
                   help="BLOCK_N,STAGES,Q_BUFS[,K_APART] (K_APART 1: K slots released before their V; default 0)")
    p.add_argument("--tokens", type=int, default=16384, help="tokens per batch (B = tokens / S)")
    p.add_argument("--sections", type=int, nargs="*", default=[],
                   help="causal: also time the first tile with these heads per section (fwd_sm90.HEADS_PER_SECTION)")
    p.add_argument("--batches", type=int, nargs="+", help="these batch sizes at every S (instead of --tokens)")
    p.add_argument("--no-check", action="store_true")
    p.add_argument("--varlen", action="store_true", help="also time packed sequences through the varlen path")
    args = p.parse_args()
    tiles = [(tuple(int(x) for x in t.split(",")) + (0,))[:4] for t in args.tiles]
    failures = 0 if args.no_check else check(tiles, args.head_dims)
    bench(args.seqlens, args.head_dims, tiles, args.tokens, args.sections, args.batches)
    if args.varlen:
        bench_varlen(args.seqlens)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
