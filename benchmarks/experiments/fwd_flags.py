"""The Gluon forward with experiment switches of tritonattn/kernels/fwd_sm90.py on and off (H200).

Each setting (a comma-separated list of module flags to set, FLAG or FLAG=int, "-" for none) runs every shape: its
output must equal the default's bitwise (the switches change the schedule, not the arithmetic),
then its time as the median of CUDA-event timings of CUDA-graph replays, the best of two alternating
rounds.
cuDNN beside. Shapes: the fa grid's (16k tokens, hidden 2048, MHA), the Gluon kernel forced.

    python benchmarks/experiments/fwd_flags.py --settings - O_SHFL Q_PREFETCH,O_SHFL \
        --head-dims 64 128 --seqlens 512 2048 [--causal no yes]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import tritonattn  # noqa: E402
from tritonattn import configs  # noqa: E402
from tritonattn.bench.runner import _bench, _graphed  # noqa: E402
from tritonattn.kernels import fwd_sm90, plan  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--settings", nargs="+", default=["-"])
    p.add_argument("--head-dims", type=int, nargs="+", default=[128])
    p.add_argument("--seqlens", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--causal", nargs="+", default=["no"], choices=["no", "yes"])
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args()
    flags = sorted({f.split("=")[0] for s in a.settings for f in s.split(",") if f != "-"})
    for D in a.head_dims:
        configs.GLUON_MIN_SEQLEN["fwd"][D] = (0, 0)
    print("| D | S | causal | setting | us | TFLOP/s | x default | x cuDNN |\n|---|---|---|---|---|---|---|---|")
    for D in a.head_dims:
        for S in a.seqlens:
            for causal in (c == "yes" for c in a.causal):
                H, B = 2048 // D, max(1, 16384 // S)
                q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                flops = 4 * B * H * S * S * D / (2 if causal else 1)
                times = {s: [] for s in a.settings}
                ref = None
                for _ in range(a.rounds):
                    for s in a.settings:
                        on = dict((f.split("=") + ["1"])[:2] for f in s.split(",") if f != "-")
                        for f in flags:
                            setattr(fwd_sm90, f, int(on.get(f, 0)))
                        plan.clear()
                        out = tritonattn.flash_attn_func(q, k, v, causal=causal)
                        if ref is None:
                            ref = out
                        elif not torch.equal(out, ref):
                            print(f"| {D} | {S} | {causal} | {s} | OUTPUT DIFFERS from the first setting's |")
                        times[s].append(_bench(_graphed(lambda: tritonattn.flash_attn_func(q, k, v, causal=causal),
                                                        "fwd")) * 1e3)
                for f in flags:
                    setattr(fwd_sm90, f, 0)
                plan.clear()
                qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

                def cud():
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                c = _bench(_graphed(cud, "fwd")) * 1e3
                base = min(times[a.settings[0]])
                for s in a.settings:
                    us = min(times[s])
                    print(f"| {D} | {S} | {causal} | {s} | {us:.1f} | {flops / us / 1e6:.0f} | {base / us:.3f} | "
                          f"{c / us:.3f} |", flush=True)


if __name__ == "__main__":
    main()
