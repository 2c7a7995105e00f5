"""A serving engine's decoding step: flash_attn_with_kvcache with the new token's key / value appended
to the cache (and rotary applied to q and the new key), against the same step that only reads.

The append (and the rotary) ran as torch ops until the thirty-fifth session (advanced indexing into the
cache, about ten small kernels for rotary); now they are one kernel (kernels/decode.py cache_append).
Each row times the step two ways: called eagerly, back to back (microseconds of wall time per call:
the host's work, since these steps are host-bound), and as a CUDA graph replay (the kernels alone,
median of CUDA-event timings with the L2 flushed by a read, as serving engines run their steps).
Run it on two trees in one call for a before / after (the package is imported from PYTHONPATH):

    PYTHONPATH=. python benchmarks/experiments/decode_append.py [--batches 1 8 64] [--caches 4096 16384]

Hq=32, Hkv=8, D=128, bf16 (the issue's decoding shape), causal, one new token per row, cache rows
filled to the cache's length less 16.
"""

from __future__ import annotations

import argparse
import statistics

import torch

import tritonattn
from tritonattn.bench.runner import _bench, _graphed, host_us_per_call


def cases(B: int, L: int, dev="cuda", dt=torch.bfloat16) -> dict:
    Hq, Hkv, D = 32, 8, 128
    q = torch.randn(B, 1, Hq, D, device=dev, dtype=dt)
    kc = torch.randn(B, L, Hkv, D, device=dev, dtype=dt)
    vc = torch.randn_like(kc)
    kn = torch.randn(B, 1, Hkv, D, device=dev, dtype=dt)
    vn = torch.randn_like(kn)
    lens = torch.full((B,), L - 16, dtype=torch.int32, device=dev)
    angles = torch.rand(L, D // 2, device=dev) * 6
    cos, sin = angles.cos().to(dt), angles.sin().to(dt)
    page = 16
    kp, vp = kc.reshape(B * L // page, page, Hkv, D), vc.reshape(B * L // page, page, Hkv, D)
    table = torch.arange(B * L // page, dtype=torch.int32, device=dev).view(B, L // page)
    call = tritonattn.flash_attn_with_kvcache
    return {
        "read only": lambda: call(q, kc, vc, cache_seqlens=lens, causal=True),
        "append": lambda: call(q, kc, vc, kn, vn, cache_seqlens=lens, causal=True),
        "append + rotary": lambda: call(q, kc, vc, kn, vn, cos, sin, cache_seqlens=lens, causal=True),
        "paged 16, append + rotary": lambda: call(q, kp, vp, kn, vn, cos, sin, cache_seqlens=lens, block_table=table,
                                                  causal=True),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--caches", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    print(f"tritonattn from {tritonattn.__file__}; {torch.cuda.get_device_name()}")
    print("| B | cache | step | eager us per call | graph replay us |")
    print("|---|---|---|---|---|")
    for B in a.batches:
        for L in a.caches:
            fns = cases(B, L)
            eager = {n: [] for n in fns}
            graphs = {n: [] for n in fns}
            replays = {n: _graphed(f) for n, f in fns.items()}
            for _ in range(a.rounds):  # interleaved rounds: the host's speed drifts within a run
                for n, f in fns.items():
                    eager[n].append(host_us_per_call(f, n=200, warmup=10))
                    graphs[n].append(_bench(replays[n], flush="read") * 1e3)
            for n in fns:
                print(f"| {B} | {L} | {n} | {statistics.median(eager[n]):.1f} | {min(graphs[n]):.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
