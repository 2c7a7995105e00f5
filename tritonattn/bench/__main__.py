"""``python -m tritonattn.bench``: tritonattn against PyTorch's attention backends, in one run.

Grids (``--grid``, several allowed):
- ``llama``: the seed PR's, B=4, Hq=32, Hkv=8, D=128, S = 2^5 .. 2^14, fp16 and bf16, causal and not;
- ``fa``: the FlashAttention papers', 16k tokens per batch, hidden 2048, D = 64, 128, 256,
  S = 512 .. 16384, causal and not (bf16 unless ``--dtypes``);
- ``seed004``: the 20 shapes ``[dtype, B, H, S, D]`` of the ROCm backward issue, printed in its
  table form (forward in microseconds, forward+backward in milliseconds);
- ``decode``: one new query over a KV cache (flash_attn_with_kvcache), B = 1, 8, 64, Hq=32, Hkv=8,
  D=128, cache lengths 4096 .. 131072, bf16; reported as GB/s of K/V read against the device's
  copy bandwidth measured in the same run;
- ``tiny``: a small grid that runs under the Triton interpreter without a GPU (what CI runs).

Variant backends (``--backends tritonattn tritonattn+dropout tritonattn+bias-grad
tritonattn+window256 ...``) report their cost as a time ratio to plain tritonattn.

Writes a long-format CSV (one row per shape, backend and mode), a markdown table on stdout
(TFLOP/s and the ratio to the best peer) and PNG plots (TFLOP/s vs sequence length).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import sys
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tritonattn.bench.runner import (  # noqa: E402
    ALL_BACKENDS,
    DTYPE_NAMES,
    MODES,
    PEERS,
    Shape,
    environment,
    measure_shape,
    print_decode_table,
    print_table,
    print_variant_costs,
)

DTYPES = {v: k for k, v in DTYPE_NAMES.items()}
SEED004 = [(B, H, S, D) for (B, H, S) in [(12, 64, 256), (16, 64, 256), (16, 64, 576), (16, 128, 256),
                                          (16, 128, 784)] for D in (64, 128)]


def grid_shapes(grid: str, seqlens=None, dtypes=None, causal=None, batches=None, head_dims=None) -> list[Shape]:
    """The grid's shapes; ``batches`` overrides the batch sizes of the llama and decode grids, and
    ``head_dims`` the fa grid's head dims."""
    causals = [False, True] if causal is None else [causal]
    shapes = []
    if grid == "llama":
        for dt in dtypes or ["fp16", "bf16"]:
            for c in causals:
                for S in seqlens or [2**i for i in range(5, 15)]:
                    for B in batches or [4]:
                        shapes.append(Shape("llama", B, 32, 8, S, S, 128, c, DTYPES[dt]))
    elif grid == "fa":
        for dt in dtypes or ["bf16"]:
            for D in head_dims or (64, 128, 256):
                for c in causals:
                    for S in seqlens or [512, 1024, 2048, 4096, 8192, 16384]:
                        shapes.append(Shape("fa", max(1, 16384 // S), 2048 // D, 2048 // D, S, S, D, c, DTYPES[dt]))
    elif grid == "seed004":
        for dt in dtypes or ["fp16", "bf16"]:
            for B, H, S, D in SEED004:
                shapes.append(Shape("seed004", B, H, H, S, S, D, False, DTYPES[dt]))
    elif grid == "decode":
        for dt in dtypes or ["bf16"]:
            for B in batches or (1, 8, 64):
                for L in seqlens or [4096, 16384, 65536, 131072]:
                    shapes.append(Shape("decode", B, 32, 8, 1, L, 128, False, DTYPES[dt]))
    elif grid == "tiny":
        for c in causals:
            for S in seqlens or [64, 128]:
                shapes.append(Shape("tiny", 1, 2, 1, S, S, 64, c, DTYPES[(dtypes or ["fp16"])[0]]))
    else:
        raise ValueError(f"unknown grid {grid!r}; expected llama, fa, seed004, decode or tiny")
    return shapes


def print_seed004(rows, file=sys.stdout) -> None:
    """The ROCm issue's layout: one row per [dtype, B, H, S, D], one column per backend."""
    backends = [b for b in ALL_BACKENDS if any(r["backend"] == b and r["grid"] == "seed004" for r in rows)]
    for mode, unit, scale in (("fwd", "us", 1e3), ("fwd+bwd", "ms", 1.0)):
        sel = [r for r in rows if r["grid"] == "seed004" and r["mode"] == mode]
        if not sel:
            continue
        print(f"\n[{'Forward' if mode == 'fwd' else 'Forward+backward'}, times in {unit}]", file=file)
        print("| [dtype, B, H, S, D] | " + " | ".join(backends) + " |", file=file)
        print("|---|" + "---|" * len(backends), file=file)
        keys = []
        for r in sel:
            k = (r["dtype"], r["batch"], r["heads"], r["seqlen_q"], r["head_dim"])
            if k not in keys:
                keys.append(k)
        for k in keys:
            cells = []
            for b in backends:
                r = next((r for r in sel if r["backend"] == b and
                          (r["dtype"], r["batch"], r["heads"], r["seqlen_q"], r["head_dim"]) == k), None)
                cells.append(f"{r['ms'] * scale:.1f}" if r and r["ms"] else "-")
            print(f"| [{', '.join(map(str, k))}] | " + " | ".join(cells) + " |", file=file)


def write_csv(rows, path) -> None:
    fields = []
    for r in rows:
        for k in r:
            if k not in fields:
                fields.append(k)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)


def plot(rows, path) -> bool:
    """TFLOP/s vs sequence length, one line per backend, a panel per (grid, head dim, dtype, causal, mode)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return False
    panels = []
    for r in rows:
        if r["grid"] in ("seed004", "decode") or not r["tflops"]:
            continue
        key = (r["grid"], r["head_dim"], r["dtype"], r["causal"], r["mode"])
        if key not in panels:
            panels.append(key)
    if not panels:
        return False
    cols = min(3, len(panels))
    nrows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(5.5 * cols, 3.8 * nrows), squeeze=False)
    for ax, key in zip(axes.flat, panels, strict=False):
        grid, D, dt, causal, mode = key
        for b in ALL_BACKENDS:
            pts = sorted((r["seqlen_q"], r["tflops"]) for r in rows if r["backend"] == b and r["tflops"]
                         and (r["grid"], r["head_dim"], r["dtype"], r["causal"], r["mode"]) == key)
            if pts:
                ax.plot(*zip(*pts, strict=False), marker="o", label=b, linewidth=2.5 if b == "tritonattn" else 1.2)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{grid} D={D} {dt} {'causal' if causal else 'full'} {mode}", fontsize=9)
        ax.set_xlabel("sequence length")
        ax.set_ylabel("TFLOP/s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(f"{rows[0]['gpu']}, torch {rows[0]['torch']}, triton {rows[0]['triton']}, commit {rows[0]['commit']}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main(argv=None) -> int:
    on_gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(prog="python -m tritonattn.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--grid", nargs="+", default=["llama"] if on_gpu else ["tiny"])
    p.add_argument("--seqlens", type=int, nargs="+", help="override the grid's sequence lengths")
    p.add_argument("--dtypes", nargs="+", choices=list(DTYPES), help="override the grid's dtypes")
    p.add_argument("--batches", type=int, nargs="+", help="override the llama / decode grids' batch sizes")
    p.add_argument("--head-dims", type=int, nargs="+", help="override the fa grid's head dims")
    p.add_argument("--causal", choices=["yes", "no"], help="only causal or only non-causal shapes")
    p.add_argument("--modes", nargs="+", choices=MODES, default=MODES)
    p.add_argument("--backends", nargs="+", choices=ALL_BACKENDS,
                   default=["tritonattn", *PEERS] if on_gpu else ["tritonattn"])
    p.add_argument("--cuda-graphs", action="store_true",
                   help="time every call as a CUDA graph replay (kernel time without host time): each "
                        "backend's decoding step, as serving engines run it, and the training grids' forward "
                        "and backward (what the kernels do at short sequences, where eager calls measure the "
                        "host); no effect without a GPU")
    p.add_argument("--l2-flush", choices=["write", "read"], default="write",
                   help="how the L2 is flushed before each timed call: write (256 MB zeroed, as "
                        "triton.testing.do_bench: dirty lines that short calls must write back) or read (256 MB "
                        "summed: clean lines, as after a layer's weight reads); no effect without a GPU")
    p.add_argument("--out", default=None, help="folder for results.csv and plots (default: benchmarks/results/<date>)")
    p.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                   help="measure no new shape after this many seconds; the tables cover what was measured")
    args = p.parse_args(argv)

    if not on_gpu and any(not b.startswith("tritonattn") for b in args.backends):
        print("no GPU: only tritonattn and its variants run (under the Triton interpreter)", file=sys.stderr)
        args.backends = [b for b in args.backends if b.startswith("tritonattn")] or ["tritonattn"]
    causal = None if args.causal is None else args.causal == "yes"
    shapes = [s for g in args.grid for s in grid_shapes(g, args.seqlens, args.dtypes, causal, args.batches,
                                                                    args.head_dims)]
    env = environment()
    print(f"# {env['gpu']} | torch {env['torch']} | triton {env['triton']} | cuDNN {env['cudnn']} | "
          f"commit {env['commit']} | source {env['source']} | {datetime.date.today()}", flush=True)
    out = args.out or os.path.join("benchmarks", "results", str(datetime.date.today()))
    os.makedirs(out, exist_ok=True)
    rows = []
    start = time.monotonic()
    for i, shape in enumerate(shapes):
        if args.time_budget is not None and i and time.monotonic() - start > args.time_budget:
            print(f"time budget of {args.time_budget:g} s spent: {i} of {len(shapes)} shapes measured", flush=True)
            break
        got = measure_shape(shape, args.backends, args.modes, env, cuda_graphs=args.cuda_graphs,
                            l2_flush=args.l2_flush)
        rows += got
        summary = " ".join(f"{r['backend']}:{r['mode']}={r['tflops']:.3g}" for r in got if r["tflops"])
        print(f"  {shape.label()}: {summary}", file=sys.stderr, flush=True)
        write_csv(rows, os.path.join(out, "results.csv"))  # after every shape: a run cut short keeps its rows

    print_table([r for r in rows if r["grid"] not in ("seed004", "decode")])
    print_decode_table(rows)
    print_seed004(rows)
    print_variant_costs(rows)
    failures = sorted({(r["backend"], r["note"]) for r in rows if r["ms"] is None})
    for backend, note in failures:
        print(f"- {backend} could not run some shapes: {note}")
    if plot(rows, os.path.join(out, "tflops.png")):
        print(f"\nwrote {out}/results.csv and {out}/tflops.png")
    else:
        print(f"\nwrote {out}/results.csv")
    return 1 if any(r["backend"] == "tritonattn" and r["ms"] is None for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
