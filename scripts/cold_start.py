"""Cold-start seconds: the first call of the llama shape in a fresh process with an empty Triton cache.

The default path has no autotuning, so a new shape costs compilation only. This starts a child
process per case with ``TRITON_CACHE_DIR`` pointing at an empty folder and reports, in seconds,
the first forward, the first backward, and a second (warm) forward + backward for comparison.

    python scripts/cold_start.py [--seqlen 4096] [--dtype bf16]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import json, sys, time, torch
sys.path.insert(0, {root!r})
t0 = time.perf_counter()
import tritonattn
from tritonattn import flash_attn_func
t_import = time.perf_counter() - t0
dt = getattr(torch, {dtype!r})
B, S, Hq, Hkv, D = 4, {seqlen}, 32, 8, 128
q = torch.randn(B, S, Hq, D, device="cuda", dtype=dt, requires_grad=True)
k = torch.randn(B, S, Hkv, D, device="cuda", dtype=dt, requires_grad=True)
v = torch.randn(B, S, Hkv, D, device="cuda", dtype=dt, requires_grad=True)
torch.cuda.synchronize()
res = dict(import_s=t_import)
for rnd in ("first", "second"):
    t = time.perf_counter()
    out = flash_attn_func(q, k, v, causal={causal})
    torch.cuda.synchronize()
    res[rnd + "_fwd_s"] = time.perf_counter() - t
    t = time.perf_counter()
    out.backward(torch.ones_like(out))
    torch.cuda.synchronize()
    res[rnd + "_bwd_s"] = time.perf_counter() - t
print(json.dumps(res))
"""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqlen", type=int, default=4096)
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args(argv)
    root = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
    print("| case | import s | first fwd s | first bwd s | warm fwd s | warm bwd s |\n|---|---|---|---|---|---|")
    for causal in (True, False):
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, TRITON_CACHE_DIR=cache)
            code = CHILD.format(root=root, dtype=args.dtype, seqlen=args.seqlen, causal=causal)
            proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
            if proc.returncode:
                print(proc.stderr[-2000:], file=sys.stderr)
                return 1
            r = json.loads(proc.stdout.strip().splitlines()[-1])
        name = f"llama B4 S{args.seqlen} {args.dtype} {'causal' if causal else 'full'}"
        print(f"| {name} | {r['import_s']:.2f} | {r['first_fwd_s']:.2f} | {r['first_bwd_s']:.2f} | "
              f"{r['second_fwd_s']:.4f} | {r['second_bwd_s']:.4f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
