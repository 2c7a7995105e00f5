"""Where the time of one attention call goes on the GPU: per call, the CUDA-event time (what the
benchmark reports), the summed device time of the kernels it launched (torch.profiler), and each
kernel's own time. A call whose event time is far above its kernel time is host-bound or has gaps
between launches; a slow kernel shows in the per-kernel rows.

    python scripts/profile_case.py --seqlens 512 2048 --causal yes no      # llama shape, bf16

``--decode 1:16384 8:4096`` profiles decoding steps instead (Sq=1, cache of B:L, the heads and head
dim above): eager and CUDA-graph event times, each kernel's device time, GB/s of K/V read by the
kernels' time, tritonattn beside cuDNN and FA2.

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
    p.add_argument("--decode", nargs="+", metavar="B:L", help="profile decoding steps (batch:cache length)")
    args = p.parse_args(argv)
    dev, dt = "cuda", torch.bfloat16
    B, (Hq, Hkv), D = args.batch, args.heads, args.head_dim
    if args.decode:
        return profile_decode(args.decode, Hq, Hkv, D, args.iters)
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
            peers = (("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa-flash", SDPBackend.FLASH_ATTENTION))
            for name, backend in peers:
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
                tflops = flops * mult / ms / 1e9
                print(f"| {S} | {c} | {name} | {mode} | {ms:.4f} | {total:.4f} | {tflops:.1f} | {detail} |", flush=True)
    return 0


def profile_decode(cases: list[str], Hq: int, Hkv: int, D: int, iters: int) -> int:
    """Decoding steps: where a short step's time goes (launches, each kernel, the gaps). Every
    timed step comes after an L2 flush (a 16.8 MB cache would otherwise be read from the L2): event
    times as the benchmark takes them (``runner._bench``), kernel times with a 256 MB zeroing before
    each step, left out of the per-kernel rows (its fill kernel, "FillFunc" in the name)."""
    from tritonattn.bench.runner import _bench, _graphed

    flush = torch.empty(64 * 2**20, device="cuda")

    def flushed(fn):
        def run():
            flush.zero_()
            fn()
        return run

    print(f"# decode profile: Sq=1 Hq={Hq} Hkv={Hkv} D={D} bf16, {torch.cuda.get_device_name()}\n")
    print("| B | L | backend | eager event us | graph event us | kernels us | GB/s (kernels) | kernel: us per call |")
    print("|---|---|---|---|---|---|---|---|")
    for case in cases:
        B, L = (int(x) for x in case.split(":"))
        q = torch.randn(B, 1, Hq, D, device="cuda", dtype=torch.bfloat16)
        kc, vc = (torch.randn(B, L, Hkv, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        qt, kt, vt = q.transpose(1, 2), kc.transpose(1, 2).contiguous(), vc.transpose(1, 2).contiguous()
        gbytes = 2 * kc.numel() * kc.element_size() / 1e9
        steps = [("tritonattn", lambda: tritonattn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=L))]
        for name, backend in (("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa-flash", SDPBackend.FLASH_ATTENTION)):
            def step(backend=backend):
                with sdpa_kernel(backend):
                    F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
            steps.append((name, step))
        for name, fn in steps:
            try:
                with torch.no_grad():
                    eager = _bench(fn) * 1e3
                    graph = _bench(_graphed(fn)) * 1e3
                    ks = {k: t for k, t in kernel_us(flushed(fn), iters).items() if "FillFunc" not in k}
            except RuntimeError as e:  # a peer that cannot serve the shape
                print(f"| {B} | {L} | {name} | - | - | - | - | {str(e)[:60]} |")
                continue
            total = sum(ks.values())
            detail = "; ".join(f"{k}: {t:.1f}" for k, t in sorted(ks.items(), key=lambda kv: -kv[1]))
            print(f"| {B} | {L} | {name} | {eager:.1f} | {graph:.1f} | {total:.1f} | {gbytes / total * 1e6:.0f} | "
                  f"{detail} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
