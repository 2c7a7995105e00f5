"""Benchmark machinery: shapes, backends (tritonattn and its peers), timing, result rows, tables.

FLOPs follow the FlashAttention convention: forward 4*B*Hq*Sq*Sk*D (halved when causal),
backward 2.5x forward. Times are medians of CUDA-event timings (triton.testing.do_bench) after
warm-up, on random inputs.
"""

from __future__ import annotations

import glob
import hashlib
import math
import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from tritonattn import configs
from tritonattn.kernels import plan

DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
PEERS = ["sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "flex"]
# tritonattn with one variant on: their cost is reported as a ratio to plain tritonattn (same FLOPs counted)
VARIANTS = {
    "tritonattn+dropout": dict(dropout_p=0.1),
    "tritonattn+bias-grad": dict(bias="B1SS"),  # a (B, 1, Sq, Sk) bias that requires grad
    "tritonattn+window256": dict(window_size=(256, -1)),
    "tritonattn+softcap": dict(softcap=30.0),
    "tritonattn+alibi": dict(alibi_slopes="H"),
    "tritonattn+keypad": dict(key_padding_mask="BS"),
    # the opt-in non-deterministic backward (VARIANT_ENV set while these are measured): dQ tiles added
    # by TMA reductions (sm_90), or by one atomic per element
    "tritonattn+atomic-dq": dict(),
    "tritonattn+atomic-dq-pointer": dict(),
    # the Gluon dK/dV kernel computing dQ too, deterministic, at every length and mask
    # (TRITONATTN_BWD_FUSED_DQ=all while measured), and never (=0: the split dQ kernel)
    "tritonattn+fused-dq": dict(),
    "tritonattn+split-dq": dict(),
    # the Gluon dK/dV kernel's Q / dO read through one 3-d descriptor over the group's heads
    # (TRITONATTN_BWD_DESC_3D=1: no per-head rebuild and wait)
    "tritonattn+bwd-desc-3d": dict(),
    # the Gluon dK/dV kernel's products awaited one at a time (TRITONATTN_BWD_SPLIT_WAITS=1: P^T while
    # dP^T runs, dS^T while dV's product runs)
    "tritonattn+bwd-split-waits": dict(),
    # the ordered fused dQ's programs in sections of kv heads, key blocks outer inside each
    # (TRITONATTN_BWD_FUSED_SECTION=auto: bwd_sm90.section_order)
    "tritonattn+fused-sections": dict(),
    # the ordered fused dQ on the 2-d grid (TRITONATTN_BWD_FUSED_SECTION=0; sections are the default where
    # configs.fused_sections says)
    "tritonattn+fused-2d": dict(),
    # heads-first program order under a causal mask forced (configs.HEADS_FIRST = True while measured;
    # the default chooses it per call, configs.heads_first)
    "tritonattn+heads-first": dict(),
}
VARIANT_ENV = {
    "tritonattn+atomic-dq": {"TRITONATTN_ATOMIC_DQ": "1", "TRITONATTN_ATOMIC_DQ_TMA": "1"},
    "tritonattn+atomic-dq-pointer": {"TRITONATTN_ATOMIC_DQ": "1", "TRITONATTN_ATOMIC_DQ_TMA": "0"},
    "tritonattn+fused-dq": {"TRITONATTN_BWD_FUSED_DQ": "all"},
    "tritonattn+split-dq": {"TRITONATTN_BWD_FUSED_DQ": "0"},
    "tritonattn+bwd-desc-3d": {"TRITONATTN_BWD_DESC_3D": "1"},
    "tritonattn+bwd-split-waits": {"TRITONATTN_BWD_SPLIT_WAITS": "1"},
    "tritonattn+fused-sections": {"TRITONATTN_BWD_FUSED_SECTION": "auto"},
    "tritonattn+fused-2d": {"TRITONATTN_BWD_FUSED_SECTION": "0"},
}
ALL_BACKENDS = ["tritonattn", *PEERS, "sdpa-math", *VARIANTS]
MODES = ["fwd", "bwd", "fwd+bwd"]


@dataclass(frozen=True)
class Shape:
    grid: str
    batch: int
    heads: int
    kv_heads: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    causal: bool
    dtype: torch.dtype

    def label(self) -> str:
        s = f"S{self.seqlen_q}" if self.seqlen_q == self.seqlen_k else f"Sq{self.seqlen_q}-Sk{self.seqlen_k}"
        return (f"B{self.batch}-H{self.heads}/{self.kv_heads}-{s}-D{self.head_dim}-"
                f"{'causal' if self.causal else 'full'}-{DTYPE_NAMES[self.dtype]}")

    def kv_bytes(self) -> float:
        """Bytes of K and V a decoding step must read (the figure of merit when Sq is small)."""
        return 2.0 * self.batch * self.seqlen_k * self.kv_heads * self.head_dim * torch.finfo(self.dtype).bits / 8

    def flops(self, mode: str) -> float:
        f = 4.0 * self.batch * self.heads * self.seqlen_q * self.seqlen_k * self.head_dim
        if self.causal:
            f /= 2
        return f * {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}[mode]


def source_hash() -> str:
    """The first 10 hex digits of a SHA-256 over the package's Python sources (paths and contents):
    names the code that ran even where the commit cannot (a copy of a working tree whose .git is
    stale or absent: on 2026-12-02 a GPU copy's git named a commit two behind the code it ran)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    h = hashlib.sha256()
    for path in sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True)):
        h.update(os.path.relpath(path, root).encode())
        with open(path, "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:10]


def _git_commit() -> str:
    """HEAD of the package's checkout, ``+changes`` when the package differs from it."""
    cwd = os.path.dirname(os.path.abspath(__file__))
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=cwd,
                              check=False).stdout.strip()
        if not head:
            return "unknown"
        clean = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", ".."], cwd=cwd, check=False).returncode == 0
        return head if clean else head + "+changes"
    except OSError:
        return "unknown"


def environment() -> dict:
    """GPU, library versions, git commit and the sources' hash, recorded with every row."""
    commit = os.environ.get("TRITONATTN_COMMIT") or _git_commit()  # TRITONATTN_COMMIT: scripts/gpu_check.sh's
    import triton

    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu-interpreter",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cudnn": str(cudnn),
        "commit": commit,
        "source": source_hash(),
    }


def _sdpa_backend(name: str):
    from torch.nn.attention import SDPBackend

    return {
        "sdpa-flash": SDPBackend.FLASH_ATTENTION,
        "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION,
        "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION,
        "sdpa-math": SDPBackend.MATH,
    }[name]


_flex_compiled = None


def _flex():
    global _flex_compiled
    if _flex_compiled is None:
        import torch._dynamo
        from torch.nn.attention.flex_attention import flex_attention

        # every shape of a grid is a new graph: without this dynamo falls back to eager flex (~30x slower)
        torch._dynamo.config.cache_size_limit = 1000
        if hasattr(torch._dynamo.config, "recompile_limit"):
            torch._dynamo.config.recompile_limit = 1000
        _flex_compiled = torch.compile(flex_attention, dynamic=False)
    return _flex_compiled


def make_callable(backend: str, shape: Shape, device: str = "cuda"):
    """Inputs and a zero-argument forward for one backend. Returns (fn, inputs, note)."""
    from tritonattn import flash_attn_func

    B, Hq, Hkv, Sq, Sk, D = shape.batch, shape.heads, shape.kv_heads, shape.seqlen_q, shape.seqlen_k, shape.head_dim
    # drawn on the device: the decode grid's largest caches hold 4G elements, minutes of CPU randn
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*s):
        return torch.randn(*s, generator=gen, device=device, dtype=shape.dtype)

    if backend == "tritonattn" and shape.grid == "decode":
        from tritonattn import flash_attn_with_kvcache

        q, k, v = randn(B, Sq, Hq, D), randn(B, Sk, Hkv, D), randn(B, Sk, Hkv, D)
        return (lambda: flash_attn_with_kvcache(q, k, v, cache_seqlens=Sk, causal=shape.causal)), [q, k, v], ""
    if backend == "tritonattn":
        q, k, v = randn(B, Sq, Hq, D), randn(B, Sk, Hkv, D), randn(B, Sk, Hkv, D)
        ins = [t.requires_grad_() for t in (q, k, v)]
        return (lambda: flash_attn_func(*ins, causal=shape.causal)), ins, ""
    if backend in VARIANTS:
        from tritonattn import attention

        q, k, v = randn(B, Sq, Hq, D), randn(B, Sk, Hkv, D), randn(B, Sk, Hkv, D)
        ins = [t.requires_grad_() for t in (q, k, v)]
        kw = dict(VARIANTS[backend])
        if kw.get("bias") == "B1SS":
            kw["bias"] = randn(B, 1, Sq, Sk).requires_grad_()
            ins.append(kw["bias"])
        if kw.get("alibi_slopes") == "H":
            kw["alibi_slopes"] = torch.rand(Hq, device=device)
        if kw.get("key_padding_mask") == "BS":
            kpm = torch.ones(B, Sk, dtype=torch.bool, device=device)
            kpm[:, Sk - Sk // 8:] = False  # the last eighth of the keys is padding
            kw["key_padding_mask"] = kpm
        return (lambda: attention(q, k, v, causal=shape.causal, **kw)), ins, ""

    # PyTorch peers take (B, H, S, D)
    q, k, v = randn(B, Hq, Sq, D), randn(B, Hkv, Sk, D), randn(B, Hkv, Sk, D)
    note = ""
    if backend == "flex":
        from torch.nn.attention.flex_attention import create_block_mask

        flex = _flex()
        block_mask = None
        if shape.causal:
            off = Sk - Sq  # bottom-right, as tritonattn

            def causal_mod(b, h, qi, kj):
                return kj <= qi + off

            block_mask = create_block_mask(causal_mod, None, None, Sq, Sk, device=device)
        ins = [t.requires_grad_() for t in (q, k, v)]
        return (lambda: flex(*ins, block_mask=block_mask, enable_gqa=Hq != Hkv)), ins, note

    from torch.nn.attention import sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    be = _sdpa_backend(backend)
    if shape.causal and Sq != Sk:
        raise NotImplementedError("SDPA's causal mask is top-left aligned; benchmark shapes use Sq == Sk")
    gqa = Hq != Hkv
    inference = shape.grid == "decode"
    ins = [t.requires_grad_(not inference) for t in (q, k, v)]
    if gqa:
        try:
            with sdpa_kernel(be):
                sdpa(*ins, is_causal=shape.causal, enable_gqa=True)
        except RuntimeError:
            # this backend has no native GQA: give it expanded K/V (what users of it must do)
            k2, v2 = (t.detach().repeat_interleave(Hq // Hkv, dim=1).requires_grad_() for t in (k, v))
            ins = [ins[0], k2, v2]
            gqa = False
            note = "kv expanded"

    def fn():
        with sdpa_kernel(be):
            return sdpa(*ins, is_causal=shape.causal, enable_gqa=gqa)

    return fn, ins, note


def _bench(fn: Callable, grad_to_none=None, flush: str = "write", warmup: float = 25, rep: float = 100) -> float:
    """Median milliseconds: CUDA events on a GPU; a few wall-clock runs under the interpreter. The L2
    is flushed before each timed call: ``flush="write"`` as ``triton.testing.do_bench`` does (256 MB
    zeroed, which leaves the L2 full of dirty lines that a short call's reads must write back as they
    evict them), ``"read"`` by summing 256 MB (clean lines, as after a layer's weight reads). ``warmup`` /
    ``rep``: milliseconds of warm-up and of timed calls, as ``do_bench`` takes them."""
    if not torch.cuda.is_available():
        import statistics
        import time

        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    if flush == "read":
        return _bench_read_flush(fn, grad_to_none, warmup, rep)
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, grad_to_none=grad_to_none, return_mode="median")


def _bench_read_flush(fn: Callable, grad_to_none, warmup: float, rep: float) -> float:
    """Median CUDA-event milliseconds of ``fn`` with the L2 flushed by a 256 MB read before each call.
    As ``do_bench``, the warm-up and the timed calls fill about ``warmup`` / ``rep`` ms (5 to 100
    timed calls)."""
    buf = torch.ones(64 * 2**20, device="cuda")
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(5):
        fn()
    b.record()
    torch.cuda.synchronize()
    est = max(a.elapsed_time(b) / 5, 1e-3)
    for _ in range(max(1, int(warmup / est))):
        fn()
    events = []
    for _ in range(max(5, min(100, int(rep / est)))):
        for t in grad_to_none or ():
            t.grad = None
        buf.sum()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        events.append((a, b))
    torch.cuda.synchronize()
    ms = sorted(a.elapsed_time(b) for a, b in events)
    return ms[len(ms) // 2]


def host_us_per_call(fn: Callable, n: int = 300, warmup: int = 20) -> float:
    """Wall microseconds per call of ``fn`` called ``n`` times back to back (after ``warmup`` calls),
    synchronised before and after: for calls whose GPU work is shorter than their host work, the host
    time per call (scripts/overhead.py, benchmarks/experiments/decode_append.py)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def _out_error(backend_out: torch.Tensor, ins, shape: Shape, layout_bshd: bool) -> float:
    """Max abs error of one (batch 0, head 0) slice against fp32 math attention."""
    q, k, v = (t.detach() for t in ins)
    if layout_bshd:
        q, k, v, o = q[0, :, 0], k[0, :, 0], v[0, :, 0], backend_out[0, :, 0]
    else:
        q, k, v, o = q[0, 0], k[0, 0], v[0, 0], backend_out[0, 0]
    s = (q.float() @ k.float().T) / math.sqrt(shape.head_dim)
    if shape.causal:
        Sq, Sk = s.shape
        mask = torch.arange(Sk, device=s.device)[None, :] <= torch.arange(Sq, device=s.device)[:, None] + (Sk - Sq)
        s = s.masked_fill(~mask, float("-inf"))
    ref = torch.softmax(s, -1).nan_to_num(0.0) @ v.float()
    return (o.float() - ref).abs().max().item()


def _graphed(fn: Callable, mode: str | None = None, ins=None, dout: torch.Tensor | None = None) -> Callable:
    """A replay of one call captured in a CUDA graph (warmed up on a side stream first, as PyTorch
    asks): the kernels' time without the host's per-call work, which is how serving engines run their
    decoding steps. ``mode`` None: ``fn()`` as it is (a decoding step); a training grid's "fwd"
    (``fn`` without autograd), "bwd" (``autograd.grad`` of one recorded forward ``fn()`` into
    ``ins`` with ``dout``) or "fwd+bwd". Forward, warm-up and capture share the side stream:
    autograd runs a backward on the stream of its forward."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        if mode == "fwd":
            def step():
                with torch.no_grad():
                    fn()
        elif mode == "bwd":
            out = fn()

            def step():
                torch.autograd.grad(out, ins, dout, retain_graph=True)
        elif mode == "fwd+bwd":
            def step():
                torch.autograd.grad(fn(), ins, dout)
        else:
            step = fn
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        step()
    return graph.replay


def measure_shape(shape: Shape, backends, modes, env: dict | None = None, cuda_graphs: bool = False,
                  l2_flush: str = "write") -> list[dict]:
    """Time every backend on one shape; a backend that cannot run the shape gets a row with its error.
    ``cuda_graphs``: every call is timed as a CUDA graph replay (kernel time without host time): a
    decoding step, or a training grid's forward / backward (a backend or mode that cannot be captured
    gets a row with its error). ``l2_flush``: how the L2 is flushed before each timed call (``_bench``)."""
    env = env if env is not None else environment()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    for backend in backends:
        base = dict(env, **{k: v for k, v in asdict(shape).items() if k != "dtype"},
                    dtype=DTYPE_NAMES[shape.dtype], shape=shape.label(), backend=backend)
        env_vars = VARIANT_ENV.get(backend, {})
        saved_env = {name: os.environ.get(name) for name in env_vars}
        os.environ.update(env_vars)
        if env_vars:  # (a launch plan kept by an earlier backend must not stand in for the variant's calls)
            plan.clear()
        saved_heads_first = configs.HEADS_FIRST
        if backend == "tritonattn+heads-first":
            configs.HEADS_FIRST = True
        try:
            if device == "cuda":
                torch.cuda.empty_cache()
            fn, ins, note = make_callable(backend, shape, device)
            graphed = cuda_graphs and device == "cuda"
            note = "; ".join(n for n in (note, "CUDA graph" if graphed else "",
                                         "L2 flushed by a read" if l2_flush == "read" and device == "cuda" else "")
                             if n)
            if shape.grid == "decode":  # inference: forward only, bandwidth is the figure of merit
                with torch.no_grad():
                    fn()
                    ms = _bench(_graphed(fn) if graphed else fn, flush=l2_flush)
                rows.append(dict(base, mode="fwd", ms=ms, tflops=shape.flops("fwd") / ms * 1e-9, max_err=None,
                                 peak_mem_gb=None, gbps=shape.kv_bytes() / ms * 1e-6, note=note))
                continue
            # without autograd: a recorded forward kept alive would hold the inputs' AccumulateGrad nodes on
            # this stream, and a backward captured on the graph's side stream then syncs with it (the
            # capture fails, and the failed capture leaves the RNG state unusable for every later call)
            with torch.no_grad():
                out = fn()
            # variants compute another function than plain attention: no error figure for them
            err = None if backend in VARIANTS else _out_error(out, ins, shape, backend == "tritonattn")
            dout = torch.randn_like(out)
            for mode in modes:
                if graphed:
                    try:
                        ms = _bench(_graphed(fn, mode, ins, dout), flush=l2_flush)
                    except Exception as e:  # noqa: BLE001 - a call that cannot be captured is a result
                        rows.append(dict(base, mode=mode, ms=None, tflops=None, max_err=None, peak_mem_gb=None,
                                         note=f"CUDA graph: {type(e).__name__}: {str(e).splitlines()[0][:100]}"))
                        continue
                elif mode == "fwd":
                    ms = _bench(fn, flush=l2_flush)
                elif mode == "bwd":
                    out = fn()
                    ms = _bench(lambda: out.backward(dout, retain_graph=True), grad_to_none=ins, flush=l2_flush)
                else:
                    ms = _bench(lambda: fn().backward(dout), grad_to_none=ins, flush=l2_flush)
                rows.append(dict(base, mode=mode, ms=ms, tflops=shape.flops(mode) / ms * 1e-9, max_err=err,
                                 peak_mem_gb=None, note=note))
            if "fwd+bwd" in modes and device == "cuda":
                del out
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                start = torch.cuda.memory_allocated()
                fn().backward(dout)
                torch.cuda.synchronize()
                rows[-1]["peak_mem_gb"] = (torch.cuda.max_memory_allocated() - start) / 2**30
        except Exception as e:  # noqa: BLE001 - a peer lacking a shape is a result, not a crash
            msg = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
            for mode in modes:
                rows.append(dict(base, mode=mode, ms=None, tflops=None, max_err=None, peak_mem_gb=None, note=msg))
        finally:
            configs.HEADS_FIRST = saved_heads_first
            for name, value in saved_env.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
            if env_vars:
                plan.clear()
    return rows


def copy_bandwidth_gbps() -> float:
    """Device copy bandwidth (bytes read + written per second), measured now: the decoding ceiling.
    (1 GB each way: the L2's state before the copy, however flushed, is a rounding error.)"""
    x = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = _bench(lambda: y.copy_(x))
    return 2 * x.numel() / ms * 1e-6


def print_decode_table(rows: list[dict], file=None) -> None:
    """Decoding: GB/s of K/V read per backend, and tritonattn's share of the copy bandwidth."""
    import sys

    file = file or sys.stdout
    sel = [r for r in rows if r["grid"] == "decode"]
    if not sel:
        return
    ceiling = copy_bandwidth_gbps() if torch.cuda.is_available() else None
    backends = [b for b in ALL_BACKENDS if any(r["backend"] == b for r in sel)]
    how = "; each step a CUDA graph replay" if any("CUDA graph" in (r.get("note") or "") for r in sel) else ""
    if any("L2 flushed by a read" in (r.get("note") or "") for r in sel):
        how += "; the L2 flushed by a read before each step"
    print(f"\n[decoding: GB/s of K/V read{how}; device copy bandwidth measured now: "
          f"{ceiling:.0f} GB/s]" if ceiling else f"\n[decoding: GB/s of K/V read{how}]", file=file)
    print("| shape | " + " | ".join(backends) + " | tritonattn / copy bw | ratio to best peer |", file=file)
    print("|---|" + "---|" * (len(backends) + 2), file=file)
    for shape in dict.fromkeys(r["shape"] for r in sel):
        cell = {r["backend"]: r.get("gbps") for r in sel if r["shape"] == shape}
        ours = cell.get("tritonattn")
        peers = [g for b, g in cell.items() if b != "tritonattn" and g]
        share = f"{ours / ceiling:.0%}" if ours and ceiling else "-"
        ratio = f"{ours / max(peers):.2f}x" if ours and peers else "-"
        print(f"| {shape} | " + " | ".join(f"{cell[b]:.0f}" if cell.get(b) else "-" for b in backends)
              + f" | {share} | {ratio} |", file=file)


def print_table(rows: list[dict], file=None) -> None:
    """Markdown table: TFLOP/s per backend, and tritonattn's ratio to the best peer."""
    import sys

    file = file or sys.stdout
    backends = [b for b in ALL_BACKENDS if any(r["backend"] == b for r in rows)]
    keys = []
    for r in rows:
        key = (r["shape"], r["mode"])
        if key not in keys:
            keys.append(key)
    head = ["shape", "mode", *backends, "ratio to best peer"]
    if any("CUDA graph" in (r.get("note") or "") for r in rows):
        print("[each call timed as a CUDA graph replay: kernel time, without host time]", file=file)
    print("| " + " | ".join(head) + " |", file=file)
    print("|" + "---|" * len(head), file=file)
    for shape, mode in keys:
        cell = {r["backend"]: r for r in rows if r["shape"] == shape and r["mode"] == mode}
        vals = []
        for b in backends:
            t = cell.get(b, {}).get("tflops")
            vals.append("-" if not t else f"{t:.1f}" if t >= 1 else f"{t:.2g}")
        ours = cell.get("tritonattn", {}).get("tflops")
        peers = [cell[b]["tflops"] for b in backends if b in PEERS and cell.get(b, {}).get("tflops")]
        ratio = f"{ours / max(peers):.2f}x" if ours and peers else "-"
        print(f"| {shape} | {mode} | " + " | ".join(vals) + f" | {ratio} |", file=file)


def print_variant_costs(rows: list[dict], file=None) -> None:
    """Time of each tritonattn variant as a ratio to plain tritonattn on the same shape and mode."""
    import sys

    file = file or sys.stdout
    sel = [r for r in rows if r["backend"] in VARIANTS and r["ms"]]
    if not sel:
        return
    print("\n| shape | mode | variant | ms | plain ms | time ratio to plain |", file=file)
    print("|---|---|---|---|---|---|", file=file)
    for r in sel:
        plain = next((p for p in rows if p["backend"] == "tritonattn" and p["shape"] == r["shape"]
                      and p["mode"] == r["mode"] and p["ms"]), None)
        if plain:
            print(f"| {r['shape']} | {r['mode']} | {r['backend']} | {r['ms']:.3f} | {plain['ms']:.3f} | "
                  f"{r['ms'] / plain['ms']:.2f}x |", file=file)
