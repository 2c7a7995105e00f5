"""The fused dQ backward's ordering, an experiment (sixteenth session): the whole backward (eager,
median of CUDA-event timings) of the llama shape, bf16, with the split kernels (default), the
atomic fused dQ (TRITONATTN_ATOMIC_DQ=1) and the deterministic fused dQ (TRITONATTN_BWD_FUSED_DQ=1)
with each setting of bwd_sm90.DQ_SPT (key blocks launched last first) and DQ_WAIT_WRITES (the
writer waits for its additions to be written before counting itself). Each row also says whether
three reruns gave bitwise equal gradients, and the largest difference of dQ from the split's.

    python benchmarks/experiments/fused_dq_order.py --seqlens 4096 16384
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch  # noqa: E402

from tritonattn import configs, flash_attn_func  # noqa: E402
from tritonattn.kernels import bwd_sm90  # noqa: E402

FUSED = {"TRITONATTN_BWD_FUSED_DQ": "1"}
VARIANTS = [  # name, env, module switches of bwd_sm90 (FUSED_DQ_MIN_SEQLEN: every length, with a mask too)
    ("split", {"TRITONATTN_BWD_FUSED_DQ": "0"}, {}),
    ("atomic", {"TRITONATTN_ATOMIC_DQ": "1"}, {}),
    ("ordered spt wait", FUSED, {}),
    ("ordered spt read", FUSED, dict(DQ_WAIT_WRITES=False)),
    ("ordered lpt wait", FUSED, dict(DQ_SPT=False)),
    ("spt, no turn wait (unordered)", FUSED, dict(DQ_SPIN=False)),
    ("spt, no turn wait, no count (unordered)", FUSED, dict(DQ_SPIN=False, DQ_RELEASE=False)),
    ("lpt, no turn wait, no count (unordered)", FUSED, dict(DQ_SPT=False, DQ_SPIN=False, DQ_RELEASE=False)),
]
SWITCHES = dict(DQ_SPT=True, DQ_WAIT_WRITES=True, DQ_SPIN=True, DQ_RELEASE=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqlens", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--reps", type=int, default=15)
    args = p.parse_args(argv)
    configs.FUSED_DQ_MIN_SEQLEN[128] = (0, 0)
    print("| S | causal | variant | ms | x split | reruns equal | max abs dQ - split's |")
    print("|---|---|---|---|---|---|---|")
    for S in args.seqlens:
        for causal in (False, True):
            torch.manual_seed(0)
            q = torch.randn(args.batch, S, 32, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            k = torch.randn(args.batch, S, 8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            v = torch.randn(args.batch, S, 8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            out = flash_attn_func(q, k, v, causal=causal)
            dout = torch.randn_like(out)
            base_ms = base_dq = None
            for name, env, switches in VARIANTS:
                saved = {key: os.environ.get(key) for key in env}
                os.environ.update(env)
                for key, val in dict(SWITCHES, **switches).items():
                    setattr(bwd_sm90, key, val)
                try:
                    grads = [torch.autograd.grad(out, (q, k, v), dout, retain_graph=True) for _ in range(3)]
                    equal = all(torch.equal(a, b) for g in grads[1:] for a, b in zip(grads[0], g, strict=True))
                    times = []
                    for _ in range(args.reps):
                        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        start.record()
                        torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
                        end.record()
                        torch.cuda.synchronize()
                        times.append(start.elapsed_time(end))
                finally:
                    for key, val in saved.items():
                        if val is None:
                            os.environ.pop(key, None)
                        else:
                            os.environ[key] = val
                    for key, val in SWITCHES.items():
                        setattr(bwd_sm90, key, val)
                ms = sorted(times)[len(times) // 2]
                dq = grads[0][0].float()
                if base_ms is None:
                    base_ms, base_dq = ms, dq
                diff = (dq - base_dq).abs().max().item()
                print(f"| {S} | {causal} | {name} | {ms:.3f} | {base_ms / ms:.3f} | {equal} | {diff:.3g} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
