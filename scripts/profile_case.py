"""Where the time of one attention call goes on the GPU: per call, the CUDA-event time (what the
benchmark reports), the summed device time of the kernels it launched (torch.profiler), and each
kernel's own time. A call whose event time is far above its kernel time is host-bound or has gaps
between launches; a slow kernel shows in the per-kernel rows.

    python scripts/profile_case.py --seqlens 512 2048 --causal yes no      # llama shape, bf16

``--only-tritonattn N`` runs N tritonattn forward+backward calls and nothing else: a target for
Nsight Compute, e.g.
    ncu --clock-control none --set full -k regex:_bwd_dkdv --launch-skip 1 --launch-count 1 \
        python3 scripts/profile_case.py --seqlens 8192 --causal yes --only-tritonattn 2
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import tritonattn  # noqa: E402


def event_ms(fn, iters: int) -> float:
    """Median CUDA-event time of one call."""
    for _ in range(5):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def kernel_us(fn, iters: int) -> dict[str, float]:
    """Device time per call of each kernel ``fn`` launches (microseconds, mean over ``iters``)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    per = defaultdict(float)
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            per[evt.name[:70]] += evt.device_time / iters
    return dict(per)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqlens", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--causal", nargs="+", choices=["yes", "no"], default=["yes", "no"])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, nargs=2, default=[32, 8], metavar=("HQ", "HKV"))
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--only-tritonattn", type=int, default=0, metavar="N",
                   help="only run N tritonattn forward+backward calls per shape (a target for ncu)")
    args = p.parse_args(argv)
    dev, dt = "cuda", torch.bfloat16
    B, (Hq, Hkv), D = args.batch, args.heads, args.head_dim
    print(f"# profile: B={B} Hq={Hq} Hkv={Hkv} D={D} bf16, {torch.cuda.get_device_name()}\n")
    print("| S | causal | backend | mode | event ms | kernels ms | TFLOP/s (event) | kernel: us per call |")
    print("|---|---|---|---|---|---|---|---|")
    for S in args.seqlens:
        for c in args.causal:
            causal = c == "yes"
            q = torch.randn(B, S, Hq, D, device=dev, dtype=dt, requires_grad=True)
            k = torch.randn(B, S, Hkv, D, device=dev, dtype=dt, requires_grad=True)
            v = torch.randn(B, S, Hkv, D, device=dev, dtype=dt, requires_grad=True)
            do = torch.randn_like(q)
            qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
            flops = 4 * B * Hq * S * S * D / (2 if causal else 1)

            def tri_fwd():
                with torch.no_grad():
                    tritonattn.flash_attn_func(q, k, v, causal=causal)

            out = tritonattn.flash_attn_func(q, k, v, causal=causal)

            def tri_bwd():
                torch.autograd.grad(out, (q, k, v), do, retain_graph=True)

            if args.only_tritonattn:
                for _ in range(args.only_tritonattn):
                    tri_fwd()
                    tri_bwd()
                torch.cuda.synchronize()
                continue
            cases = [("tritonattn", "fwd", tri_fwd, 1.0), ("tritonattn", "bwd", tri_bwd, 2.5)]
            for name, backend in (("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa-flash", SDPBackend.FLASH_ATTENTION)):
                def sdpa_fwd(backend=backend):
                    with torch.no_grad(), sdpa_kernel(backend):
                        F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=True)

                def sdpa_bwd(backend=backend, memo={}):  # noqa: B006 - the forward, made on first use
                    if "out" not in memo:  # inside the timing's try: a backend that cannot serve the shape
                        with sdpa_kernel(backend):
                            memo["out"] = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal,
                                                                         enable_gqa=True)
                    torch.autograd.grad(memo["out"], (qt, kt, vt), do.transpose(1, 2), retain_graph=True)

                cases += [(name, "fwd", sdpa_fwd, 1.0), (name, "bwd", sdpa_bwd, 2.5)]
            for name, mode, fn, mult in cases:
                try:
                    ms = event_ms(fn, args.iters)
                    ks = kernel_us(fn, args.iters)
                except RuntimeError as e:  # a peer that cannot serve the shape
                    print(f"| {S} | {c} | {name} | {mode} | - | - | - | {str(e)[:60]} |")
                    continue
                total = sum(ks.values()) / 1e3
                detail = "; ".join(f"{k}: {t:.1f}" for k, t in sorted(ks.items(), key=lambda kv: -kv[1]))
                print(f"| {S} | {c} | {name} | {mode} | {ms:.4f} | {total:.4f} | {flops * mult / ms / 1e9:.1f} | {detail} |",
                      flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
