"""Time tile-config candidates on the GPU, one kernel family at a time, for the tile table.

For each head dim, causal setting and mode (fwd, bwd_dkdv, bwd_dq) it forces each candidate
through ``configs.override`` and times the whole forward (mode fwd) or backward (the bwd modes; the
other backward kernel keeps its table config), median of CUDA events, on the llama shape for D=128
and the FlashAttention papers' shape (16k tokens, hidden 2048) otherwise.

Compilation dominates a sweep, so every candidate is first compiled by a pool of worker processes
(``--workers``, each runs a small problem with the same kernel specialization, filling Triton's disk
cache); the timing pass then only loads the cached binaries. Candidates that fail to compile or
launch (shared memory) are reported and skipped. Results: a table on stdout and a CSV under $OUT.
``--fwd-variants plain tma tma+ws`` times each forward candidate also with K / V read through tensor
descriptors (``tma``) and with the unmasked loop warp-specialized (``ws``): the launcher's switches
``kernels.fwd.TMA`` / ``WS``. ``--bwd-variants tma plain`` (default ``tma``, the library's default on
sm_90) times the backward candidates through descriptors and through pointers (``kernels.bwd.TMA``).
``--cuda-graphs`` times each call as a CUDA graph replay: a forced config takes the launcher's full
path (no launch plan), whose host time bounds the short sequences (S <= 1024) of eager calls. Every
forward candidate's output is also compared with an fp32 reference (``max_err`` column).

    python scripts/tune.py --head-dims 128 --causal yes no --modes fwd bwd_dkdv bwd_dq
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

from tritonattn import configs  # noqa: E402
from tritonattn.configs import TileConfig as C  # noqa: E402

CANDIDATES = configs.CANDIDATES
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def shape_for(D: int, S: int, shape: str = "auto", batch: int = 0):
    """(B, Hq, Hkv): ``llama`` (B=4, 32 / 8 heads), ``fa`` (the FlashAttention papers' 16k tokens x
    hidden 2048, no GQA), ``auto``: llama for D=128, fa otherwise; ``batch``: B instead of the shape's."""
    if shape == "llama" or (shape == "auto" and D == 128):
        return batch or 4, 32, 8
    return batch or max(1, 16384 // S), 2048 // D, 2048 // D


def make_call(mode, B, S, Hq, Hkv, D, causal, dtype, graphs=False, varlen=False, device="cuda"):
    """(call, tensors whose grads to reset, inputs). ``graphs``: the call as a CUDA graph replay (the
    backward through autograd.grad, which accumulates nothing). ``varlen``: the B sequences packed
    (flash_attn_varlen_func, equal lengths: the dense call's work)."""
    from tritonattn import flash_attn_func, flash_attn_varlen_func
    from tritonattn.bench.runner import _graphed

    torch.manual_seed(0)
    lead = (B * S,) if varlen else (B, S)
    q = torch.randn(*lead, Hq, D, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(*lead, Hkv, D, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(*lead, Hkv, D, device=device, dtype=dtype, requires_grad=True)
    cu = torch.arange(0, B + 1, device=device, dtype=torch.int32) * S

    def forward():
        if varlen:
            return flash_attn_varlen_func(q, k, v, cu, cu, S, S, causal=causal)
        return flash_attn_func(q, k, v, causal=causal)

    if mode == "fwd":
        def fn():
            with torch.no_grad():
                return forward()
        return (_graphed(fn) if graphs else fn), None, (q, k, v, forward)
    dout = torch.randn_like(q)  # the output's shape
    if graphs:
        return _graphed(forward, "bwd", (q, k, v), dout), None, (q, k, v, forward)
    out = forward()
    return (lambda: out.backward(dout, retain_graph=True)), [q, k, v], (q, k, v, forward)


def forward_error(q, k, v, forward, causal: bool, S: int) -> float:
    """Largest |out - reference| of the forced forward config (fp32 reference, GQA by repetition);
    packed varlen inputs are compared as (B, S, H, D)."""
    with torch.no_grad():
        out = forward().float()
        if q.dim() == 3:
            q, k, v, out = (t.view(-1, S, *t.shape[1:]) for t in (q, k, v, out))
        g = q.shape[2] // k.shape[2]
        qf, kf, vf = (t.float().transpose(1, 2) for t in (q, k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)))
        ref = torch.nn.functional.scaled_dot_product_attention(qf, kf, vf, is_causal=causal).transpose(1, 2)
    return (out - ref).abs().max().item()


def _set_variant(variant: str, mode: str = "fwd") -> None:
    """Forward: ``tma`` / ``ws`` switches. Backward: ``tma`` (Q / dO and K / V tiles through tensor
    descriptors) and ``ms<N>`` (the dK/dV kernel's masked loop pipelined N deep), joined by ``+``.
    (The fwd mode times no backward: the backward switch is left as it is.)"""
    from tritonattn.kernels import bwd, fwd

    parts = variant.split("+")
    fwd.TMA, fwd.WS = mode == "fwd" and "tma" in parts, mode == "fwd" and "ws" in parts
    if mode != "fwd":
        bwd.TMA = "tma" in parts
    stages = [int(p[2:]) for p in parts if p.startswith("ms")]
    configs.DKDV_MASKED_STAGES = stages[0] if stages else None


def _compile_jobs(jobs) -> list[str]:
    """Worker: run each (mode, cfg, D, causal, dtype, variant) once on a small problem with the same
    specialization as the timed one (sizes and strides divisible by 16), so Triton caches it."""
    notes = []
    for mode, cfg, D, causal, dt, variant, shape, varlen in jobs:
        B, Hq, Hkv = shape_for(D, 8192, shape)
        _set_variant(variant, mode)
        t0 = time.perf_counter()
        try:
            with configs.override(**{mode: C(*cfg)}):
                fn, _, _ = make_call(mode, 1, 256, Hq, Hkv, D, causal, DTYPES[dt], varlen=varlen)
                fn()
                torch.cuda.synchronize()
            notes.append(f"compiled {mode} {variant} {cfg} D={D} causal={causal} in {time.perf_counter() - t0:.1f} s")
        except Exception as e:  # noqa: BLE001 - reported by the timing pass too
            notes.append(f"FAILED {mode} {variant} {cfg} D={D} causal={causal}: {type(e).__name__}: {str(e)[:120]}")
    return notes


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head-dims", type=int, nargs="+", default=[128], choices=sorted(CANDIDATES))
    p.add_argument("--modes", nargs="+", default=["fwd", "bwd_dkdv", "bwd_dq"])
    p.add_argument("--causal", nargs="+", choices=["yes", "no"], default=["yes"])
    p.add_argument("--seqlen", type=int, default=8192)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    p.add_argument("--fwd-variants", nargs="+", default=["plain"], choices=["plain", "tma", "tma+ws"])
    p.add_argument("--bwd-variants", nargs="+", default=["tma"], metavar="plain|tma|msN|tma+msN",
                   help="backward candidates with Q / dO and K / V read through tensor descriptors (tma, the "
                        "library's default on sm_90) or pointers (plain), and (bwd_dkdv) its masked loop "
                        "pipelined N deep (ms1: not pipelined)")
    p.add_argument("--configs", nargs="+", metavar="M,N,WARPS,STAGES",
                   help="time only these candidates, the same list for every mode given (for bwd_dkdv "
                        "N is the key block a program owns; a 5th number is d_split, a 6th 1 for a split "
                        "by gradient); default: the candidate list of configs.py")
    p.add_argument("--atomic-dq", action="store_true",
                   help="tune the opt-in atomic-dQ backward (TRITONATTN_ATOMIC_DQ=1)")
    p.add_argument("--shape", choices=["auto", "llama", "fa"], default="auto",
                   help="llama: B=4, Hq=32, Hkv=8; fa: 16k tokens x hidden 2048 without GQA; auto: llama at "
                        "D=128, fa otherwise")
    p.add_argument("--batch", type=int, default=0, help="the batch size instead of the shape's")
    p.add_argument("--varlen", action="store_true",
                   help="the batch's sequences packed, through flash_attn_varlen_func (equal lengths)")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="time CUDA graph replays (kernel time without the host's per-call work)")
    args = p.parse_args(argv)
    if args.atomic_dq:
        os.environ["TRITONATTN_ATOMIC_DQ"] = "1"  # inherited by the compile workers
    import triton.testing

    dtype = DTYPES[args.dtype]
    def candidates(D, mode):
        if args.configs:
            return [C(*map(int, c.split(","))) for c in args.configs]
        return CANDIDATES[D][mode]

    def variants(mode):
        if mode == "fwd":
            return args.fwd_variants
        if mode == "bwd_dq":  # the masked-loop stages are the dK/dV kernel's: one row per TMA setting
            return list(dict.fromkeys("+".join(p for p in v.split("+") if not p.startswith("ms")) or "plain"
                                      for v in args.bwd_variants))
        return args.bwd_variants

    plan = [(mode, tuple(cfg), D, c == "yes", args.dtype, variant, args.shape, args.varlen) for D in args.head_dims
            for c in args.causal
            for mode in args.modes for cfg in candidates(D, mode)
            for variant in variants(mode)]
    t0 = time.perf_counter()
    if args.workers > 1:
        chunks = [plan[i::args.workers] for i in range(args.workers)]
        ctx = __import__("multiprocessing").get_context("spawn")
        with ProcessPoolExecutor(args.workers, mp_context=ctx) as ex:
            for notes in ex.map(_compile_jobs, chunks):
                for n in notes:
                    print(n, flush=True)
    print(f"# precompiled {len(plan)} candidates in {time.perf_counter() - t0:.0f} s", flush=True)

    rows = []
    for mode, cfg, D, causal, _, variant, _, _ in plan:
        _set_variant(variant, mode)
        B, Hq, Hkv = shape_for(D, args.seqlen, args.shape, args.batch)
        flops = 4.0 * B * Hq * args.seqlen * args.seqlen * D * (0.5 if causal else 1.0)
        flops *= 1.0 if mode == "fwd" else 2.5
        with configs.override(**{mode: C(*cfg)}):
            try:
                fn, grads, inputs = make_call(mode, B, args.seqlen, Hq, Hkv, D, causal, dtype, args.cuda_graphs,
                                              args.varlen)
                ms = triton.testing.do_bench(fn, warmup=25, rep=100, grad_to_none=grads, return_mode="median")
                tf, note = flops / ms * 1e-9, ""
            except Exception as e:  # noqa: BLE001 - a config that cannot launch is a result
                ms, tf, inputs = float("nan"), 0.0, None
                note = f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"
            err = float("nan")
            if mode == "fwd" and inputs is not None:
                try:  # (the reference can run out of memory where the kernel did not)
                    err = forward_error(*inputs, causal, args.seqlen)
                except Exception as e:  # noqa: BLE001
                    note = f"no error check: {type(e).__name__}"
        torch.cuda.empty_cache()
        rows.append(dict(D=D, causal=causal, mode=mode, variant=variant, cfg=cfg, ms=ms, tflops=tf, max_err=err,
                         note=note))
        print(f"D={D} causal={causal:d} {mode:9} {variant:7} {cfg} {ms:8.3f} ms {tf:6.1f} TFLOP/s err {err:.1e} {note}",
              flush=True)
    _set_variant("plain")

    batch = f" B={args.batch}" if args.batch else ""
    print(f"\n{args.dtype}, S={args.seqlen}, shape {args.shape}{batch}, {torch.cuda.get_device_name()}"
          f"{', CUDA graph replays' if args.cuda_graphs else ''}")
    print("| D | causal | mode | variant | best config (BLOCK_M, BLOCK_N, warps, stages) | TFLOP/s | table's config "
          "| TFLOP/s |")
    print("|---|---|---|---|---|---|---|---|")
    for D in args.head_dims:
        for c in args.causal:
            for mode in args.modes:
                for variant in variants(mode):
                    sel = [r for r in rows if r["D"] == D and r["causal"] == (c == "yes") and r["mode"] == mode
                           and r["variant"] == variant and r["tflops"] > 0]
                    if not sel:
                        continue
                    best = max(sel, key=lambda r: r["tflops"])
                    # the library's pick for this call (short sequences have tiles of their own, and a
                    # short plain forward one by its number of query tiles: q's real shape)
                    B, Hq, _ = shape_for(D, args.seqlen, args.shape, args.batch)
                    probe = torch.empty(1, 1, 1, D, dtype=dtype, device="cuda").expand(B, args.seqlen, Hq, D)
                    tma = "tma" in variant.split("+")
                    if mode == "fwd":
                        table = tuple(configs.forward_config(probe, c == "yes", seqlen=args.seqlen,
                                                             plain=c == "no"))
                    elif mode == "bwd_dq":
                        table = tuple(configs.backward_dq_config(probe, c == "yes", seqlen=args.seqlen))
                    else:
                        table = tuple(configs.backward_dkdv_config(probe, c == "yes", tma=tma, seqlen=args.seqlen,
                                                                   atomic_dq=args.atomic_dq))
                    cur = next((r["tflops"] for r in sel if r["cfg"] == table), float("nan"))
                    print(f"| {D} | {c} | {mode} | {variant} | {best['cfg']} | {best['tflops']:.1f} | {table} "
                          f"| {cur:.1f} |")
    out = os.environ.get("OUT", ".")
    tag = ("-atomic-dq" if args.atomic_dq else "") + "".join(
        "-" + "-".join(v) for v, default in ((args.fwd_variants, ["plain"]), (args.bwd_variants, ["tma"]))
        if v != default)
    # (several runs of one call differ in modes, length or candidates: each keeps its own file)
    name = (f"tune-{args.dtype}{tag}-D{'-'.join(map(str, args.head_dims))}-causal{'-'.join(args.causal)}"
            f"-{'-'.join(args.modes)}-S{args.seqlen}{'-configs' if args.configs else ''}"
            f"{'' if args.shape == 'auto' else '-' + args.shape}{f'-B{args.batch}' if args.batch else ''}"
            f"{'-varlen' if args.varlen else ''}"
            f"{'-graphs' if args.cuda_graphs else ''}.csv")
    with open(os.path.join(out, name), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
