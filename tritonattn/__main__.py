"""``python -m tritonattn``: run forward + backward on a representative shape, check it against
the fp64 reference, and print the errors and timings (with PyTorch's SDPA backends beside it on a GPU).

Without a GPU it runs a small shape under the Triton interpreter.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _errors(q, k, v, out, lse, grads, dout, causal):
    from tritonattn.testing import attention_ref

    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out_ref, lse_ref = attention_ref(*leaves, causal=causal)
    g_ref = torch.autograd.grad(out_ref, leaves, dout.double())
    rows = [("out", out, out_ref), ("lse", lse, lse_ref)] + list(zip(("dq", "dk", "dv"), grads, g_ref, strict=False))
    result = {}
    for name, a, r in rows:
        fin = torch.isfinite(r)
        result[name] = (a.double()[fin] - r[fin]).abs().max().item()
    return result


def main(argv=None) -> int:
    from tritonattn import flash_attn_func
    from tritonattn.testing import random_qkv

    on_gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(prog="python -m tritonattn", description=__doc__)
    p.add_argument("--batch", type=int, default=4 if on_gpu else 1)
    p.add_argument("--seqlen", type=int, default=4096 if on_gpu else 128)
    p.add_argument("--heads", type=int, default=32 if on_gpu else 4)
    p.add_argument("--kv-heads", type=int, default=8 if on_gpu else 2)
    p.add_argument("--head-dim", type=int, default=128 if on_gpu else 64)
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16" if on_gpu else "fp16")
    p.add_argument("--no-causal", action="store_true")
    args = p.parse_args(argv)

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    device = "cuda" if on_gpu else "cpu"
    causal = not args.no_causal
    B, S, Hq, Hkv, D = args.batch, args.seqlen, args.heads, args.kv_heads, args.head_dim
    where = torch.cuda.get_device_name() if on_gpu else "CPU (Triton interpreter)"
    print(f"tritonattn on {where}: B={B} S={S} Hq={Hq} Hkv={Hkv} D={D} {args.dtype} causal={causal}")

    # correctness: the fp64 reference materialises S x S, so check on one batch row and two kv groups
    torch.manual_seed(0)
    Hc, Hkvc = min(Hq, 2 * (Hq // Hkv)), min(Hkv, 2)
    q, k, v = random_qkv(1, S, S, Hc, Hkvc, D, dtype, device)
    out, lse, _ = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    errs = _errors(q, k, v, out, lse, grads, dout, causal)
    print(f"max abs error vs fp64 reference (B=1, Hq={Hc}, Hkv={Hkvc}): "
          + ", ".join(f"{n} {e:.2e}" for n, e in errs.items()))
    if any(e != e for e in errs.values()):
        print("NaN in the result", file=sys.stderr)
        return 1

    if not on_gpu:
        import time

        t0 = time.perf_counter()
        out = flash_attn_func(q, k, v, causal=causal)
        torch.autograd.grad(out, (q, k, v), dout)
        print(f"fwd+bwd under the interpreter: {time.perf_counter() - t0:.2f} s (CPU emulation, not a speed figure)")
        return 0

    from tritonattn.bench.runner import Shape, measure_shape, print_table

    shape = Shape("main", B, Hq, Hkv, S, S, D, causal, dtype)
    rows = measure_shape(shape, backends=["tritonattn", "sdpa-flash", "sdpa-cudnn"], modes=["fwd", "bwd"])
    print_table(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
