"""Time tile-config candidates on the GPU, one kernel family at a time, for the tile table.

For each head dim and mode (fwd, bwd_dkdv, bwd_dq) it forces each candidate through
``configs.override`` and times the whole forward (mode fwd) or backward (the bwd modes; the other
backward kernel keeps its table config), median of CUDA events, on the llama shape by default.
Candidates that fail to launch (shared memory) are reported and skipped. Results: a table on
stdout, sorted, and a CSV under $OUT. Candidate lists were pre-filtered for register spills and
shared memory with ``scripts/compile_check.py`` (no GPU needed), see benchmarks/NOTES.md.

    python scripts/tune.py --head-dims 128 --modes fwd bwd_dkdv bwd_dq --causal yes
"""

from __future__ import annotations

import argparse
import csv
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
import triton.testing  # noqa: E402

from tritonattn import configs, flash_attn_func  # noqa: E402
from tritonattn.configs import TileConfig as C  # noqa: E402

CANDIDATES = {
    64: {
        "fwd": [C(128, 64, 8, 3), C(128, 128, 8, 3), C(128, 64, 4, 3), C(128, 128, 8, 2), C(64, 64, 4, 3)],
        "bwd_dkdv": [C(64, 128, 8, 2), C(32, 128, 8, 2), C(32, 128, 8, 3), C(16, 128, 8, 3), C(32, 64, 4, 3)],
        "bwd_dq": [C(128, 64, 8, 2), C(128, 64, 8, 3), C(128, 32, 8, 3), C(64, 64, 4, 3), C(128, 128, 8, 2)],
    },
    128: {
        "fwd": [C(128, 64, 8, 3), C(128, 128, 8, 2), C(128, 128, 8, 3), C(64, 64, 4, 3), C(128, 32, 4, 4)],
        "bwd_dkdv": [C(64, 128, 8, 2), C(32, 128, 8, 2), C(32, 128, 8, 3), C(16, 128, 8, 3), C(32, 64, 4, 3)],
        "bwd_dq": [C(128, 64, 8, 2), C(128, 64, 8, 3), C(128, 32, 8, 3), C(64, 64, 4, 3), C(64, 128, 8, 2)],
    },
    256: {
        "fwd": [C(64, 64, 4, 2), C(64, 64, 8, 2), C(64, 32, 4, 3), C(128, 32, 8, 2), C(64, 64, 4, 3)],
        "bwd_dkdv": [C(32, 64, 8, 1), C(16, 64, 4, 2), C(16, 128, 8, 2), C(32, 64, 8, 2), C(32, 32, 4, 2)],
        "bwd_dq": [C(64, 32, 8, 1), C(128, 32, 8, 3), C(64, 32, 4, 2), C(64, 64, 8, 2), C(32, 64, 4, 2)],
    },
}


def time_mode(mode: str, B, S, Hq, Hkv, D, causal, dtype) -> float:
    torch.manual_seed(0)
    q = torch.randn(B, S, Hq, D, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(B, S, Hkv, D, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(B, S, Hkv, D, device="cuda", dtype=dtype, requires_grad=True)
    if mode == "fwd":
        return triton.testing.do_bench(lambda: flash_attn_func(q, k, v, causal=causal), warmup=25, rep=100,
                                       return_mode="median")
    out = flash_attn_func(q, k, v, causal=causal)
    dout = torch.randn_like(out)
    return triton.testing.do_bench(lambda: out.backward(dout, retain_graph=True), warmup=25, rep=100,
                                   grad_to_none=[q, k, v], return_mode="median")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head-dims", type=int, nargs="+", default=[128], choices=sorted(CANDIDATES))
    p.add_argument("--modes", nargs="+", default=["fwd", "bwd_dkdv", "bwd_dq"])
    p.add_argument("--causal", choices=["yes", "no"], default="yes")
    p.add_argument("--seqlen", type=int, default=8192)
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    args = p.parse_args(argv)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    causal = args.causal == "yes"
    rows = []
    for D in args.head_dims:
        # llama shape for D=128; the FlashAttention papers' hidden 2048 otherwise
        B, Hq, Hkv = (4, 32, 8) if D == 128 else (max(1, 16384 // args.seqlen), 2048 // D, 2048 // D)
        for mode in args.modes:
            flops = 4.0 * B * Hq * args.seqlen * args.seqlen * D * (0.5 if causal else 1.0)
            flops *= 1.0 if mode == "fwd" else 2.5
            for cfg in CANDIDATES[D][mode]:
                with configs.override(**{mode: cfg}):
                    try:
                        ms = time_mode(mode, B, args.seqlen, Hq, Hkv, D, causal, dtype)
                        tf = flops / ms * 1e-9
                        note = ""
                    except Exception as e:  # noqa: BLE001 - a config that cannot launch is a result
                        ms, tf, note = float("nan"), 0.0, f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"
                torch.cuda.empty_cache()
                rows.append(dict(D=D, mode=mode, cfg=tuple(cfg), ms=ms, tflops=tf, note=note))
                print(f"D={D} {mode:9} {tuple(cfg)} {ms:8.3f} ms {tf:6.1f} TFLOP/s {note}", flush=True)
    print("\n| D | mode | best config (BLOCK_M, BLOCK_N, warps, stages) | TFLOP/s | table's config | TFLOP/s |")
    print("|---|---|---|---|---|---|")
    for D in args.head_dims:
        for mode in args.modes:
            sel = [r for r in rows if r["D"] == D and r["mode"] == mode and r["tflops"] > 0]
            if not sel:
                continue
            best = max(sel, key=lambda r: r["tflops"])
            table = configs.table_configs()[mode][(D, 2)]
            cur = next((r for r in sel if r["cfg"] == tuple(table)), None)
            print(f"| {D} | {mode} | {best['cfg']} | {best['tflops']:.1f} | {tuple(table)} | "
                  f"{cur['tflops'] if cur else float('nan'):.1f} |")
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, f"tune-{args.causal}.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
