"""Host-side (Python) overhead per call, on the GPU: tiny problems whose GPU work takes a few
microseconds, called back to back; the wall time per call is then the host time. The forward is
also timed in parts (with its launch stubbed: its Python and allocations; its cached launch alone;
its allocations alone), and a cProfile breakdown of the slowest entry points places the cost.

    python scripts/overhead.py            # table on stdout, profile under $OUT/overhead-profile.txt

Each cell is the median of interleaved rounds (OVERHEAD_ROUNDS, default 7): the host's speed drifts
within a run, so cells measured one after another are not comparable.
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import tritonattn  # noqa: E402
from tritonattn.bench.runner import host_us_per_call  # noqa: E402

per_call_us = host_us_per_call


def main() -> int:
    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(1, 128, 4, 64, device=dev, dtype=dt)
    k = torch.randn(1, 128, 2, 64, device=dev, dtype=dt)
    v = torch.randn(1, 128, 2, 64, device=dev, dtype=dt)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    dout = torch.randn_like(q)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    kc = torch.randn(1, 1024, 2, 64, device=dev, dtype=dt)
    vc = torch.randn(1, 1024, 2, 64, device=dev, dtype=dt)
    q1 = torch.randn(1, 1, 4, 64, device=dev, dtype=dt)
    seqlens = torch.full((1,), 1000, dtype=torch.int32, device=dev)
    k1, v1 = (torch.randn(1, 1, 2, 64, device=dev, dtype=dt) for _ in range(2))  # a new token's key / value
    cos, sin = (torch.rand(1100, 32, device=dev, dtype=dt) for _ in range(2))  # rotary tables
    qkv = torch.randn(1, 128, 3, 4, 64, device=dev, dtype=dt)
    cu = torch.tensor([0, 50, 128], dtype=torch.int32, device=dev)  # two packed sequences
    padding = torch.ones(1, 128, dtype=torch.bool, device=dev)  # a padded batch's key padding mask
    padding[:, :7] = False

    # a generate step over a growing cache (transformers' DynamicCache: flash_attn_func with Sq=1
    # over a cache one row longer at every call, so never a shape seen before) and the same step
    # over a fixed cache; B=1, Llama-3 8B heads (Hq=32, Hkv=8, D=128). Lengths start above
    # configs.DECODE_ONE_SPLIT_KEYS and the cache holds every call's (no length is seen twice)
    rounds = int(os.environ.get("OVERHEAD_ROUNDS", "7"))
    start = 1100
    qd = torch.randn(1, 1, 32, 128, device=dev, dtype=dt)
    kd, vd = (torch.randn(1, start + 240 * rounds + 64, 8, 128, device=dev, dtype=dt) for _ in range(2))
    grown = [start]

    def decode_growing():
        grown[0] += 1
        n = min(grown[0], kd.shape[1])  # (past the end: repeats, recorded as a fixed shape)
        return tritonattn.flash_attn_func(qd, kd[:, :n], vd[:, :n], causal=True)

    def fwd_bwd():
        out = tritonattn.flash_attn_func(qg, kg, vg, causal=True)
        torch.autograd.grad(out, (qg, kg, vg), dout)

    def sdpa_fwd_bwd():
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            out = F.scaled_dot_product_attention(qt.detach().requires_grad_(), kt.detach().requires_grad_(),
                                                 vt.detach().requires_grad_(), is_causal=True, enable_gqa=True)
        out.backward(dout.transpose(1, 2))

    def dropin_fwd_bwd():  # the drop-in, called as the peer's row calls torch's SDPA
        out = tritonattn.scaled_dot_product_attention(qt.detach().requires_grad_(), kt.detach().requires_grad_(),
                                                      vt.detach().requires_grad_(), is_causal=True, enable_gqa=True)
        out.backward(dout.transpose(1, 2))

    cases = {
        "flash_attn_func fwd (no grad)": lambda: tritonattn.flash_attn_func(q, k, v, causal=True),
        "flash_attn_func fwd+bwd": fwd_bwd,
        "flash_attn_func fwd (inputs require grad, no backward)": lambda: tritonattn.flash_attn_func(
            qg, kg, vg, causal=True),
        "flash_attn_qkvpacked_func fwd (no grad)": lambda: tritonattn.flash_attn_qkvpacked_func(qkv, causal=True),
        "flash_attn_varlen_func fwd (no grad, 2 sequences)": lambda: tritonattn.flash_attn_varlen_func(
            q[0], k[0], v[0], cu, cu, 78, 78, causal=True),
        "flash_attn_with_kvcache (Sq=1, int seqlens)": lambda: tritonattn.flash_attn_with_kvcache(
            q1, kc, vc, cache_seqlens=1000),
        "flash_attn_with_kvcache (Sq=1, tensor seqlens)": lambda: tritonattn.flash_attn_with_kvcache(
            q1, kc, vc, cache_seqlens=seqlens),
        "flash_attn_with_kvcache (Sq=1, append + rotary)": lambda: tritonattn.flash_attn_with_kvcache(
            q1, kc, vc, k1, v1, cos, sin, cache_seqlens=seqlens, causal=True),
        "flash_attn_func decode step, fixed cache (Sq=1, 1100 keys, Hq 32 / Hkv 8, D 128)": lambda: (
            tritonattn.flash_attn_func(qd, kd[:, :start], vd[:, :start], causal=True)),
        "flash_attn_func decode step, growing cache (one key more per call)": decode_growing,
        "tritonattn.scaled_dot_product_attention": lambda: tritonattn.scaled_dot_product_attention(
            qt, kt, vt, is_causal=True, enable_gqa=True),
        "tritonattn.scaled_dot_product_attention fwd+bwd": dropin_fwd_bwd,
        "tritonattn.scaled_dot_product_attention, bool mask (B, 1, 1, Sk)": lambda: (
            tritonattn.scaled_dot_product_attention(qt, kt, vt, attn_mask=padding[:, None, None, :], enable_gqa=True)),
        "tritonattn.attention, key_padding_mask, causal": lambda: tritonattn.attention(
            q, k, v, key_padding_mask=padding, causal=True),
        "torch SDPA flash fwd (peer)": lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True,
                                                                               enable_gqa=True),
        "torch SDPA flash fwd+bwd (peer)": sdpa_fwd_bwd,
        # each call waits for its kernels: host and device time in series (against the row above
        # without the wait: whether the tiny kernels' device time, not the host, bounds fwd+bwd)
        "flash_attn_func fwd+bwd, synchronised after each call": lambda: (fwd_bwd(), torch.cuda.synchronize()),
        "torch SDPA flash fwd+bwd (peer), synchronised after each call": lambda: (
            sdpa_fwd_bwd(), torch.cuda.synchronize()),
    }
    class _Floor(torch.autograd.Function):
        """The autograd engine's floor with a Python backward on CUDA tensors: one copy forward, the
        gradient passed through backward (no kernel)."""

        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            return grad

    def floor_fwd_bwd():
        torch.autograd.grad(_Floor.apply(qg), (qg,), dout)

    def clone_fwd_bwd():  # the same without a Python backward (torch's own CloneBackward)
        torch.autograd.grad(qg.clone(), (qg,), dout)

    cases["autograd floor: Function (clone, Python backward) fwd+bwd"] = floor_fwd_bwd
    cases["autograd floor: clone fwd+bwd (C++ backward)"] = clone_fwd_bwd
    from tritonattn.interface import _check_options
    from tritonattn.kernels.bwd import attention_backward
    from tritonattn.kernels.fwd import attention_forward

    var = _check_options(q, k, 0.0, None, True, (-1, -1), 0.0, None)
    o, lse = attention_forward(q, k, v, var)
    cases["attention_backward launcher alone (no autograd)"] = lambda: attention_backward(dout, q, k, v, o, lse, var)
    cases["attention_forward launcher alone"] = lambda: attention_forward(q, k, v, var)
    import contextlib
    import functools
    import statistics
    from unittest import mock

    from tritonattn.kernels import launch, plan

    def swapped(obj, name: str, value):
        """A setting: ``obj.name`` replaced by ``value`` while it is on."""
        return functools.partial(mock.patch.object, obj, name, value)

    # as before the thirty-third session: a replay passes the tensors to Triton's launcher, not
    # their addresses (plan.POINTERS)
    tensors_passed = swapped(plan, "POINTERS", False)
    # every call takes the launchers' full path, as before the launch plans (kernels/plan.py): no
    # replay by the launchers' keys, nor by the entry points' links (which also replay)
    replay_off = swapped(plan, "replay", lambda key, inputs, device, values=(): None)
    links_off = swapped(plan, "linked", lambda entry_key: None)

    @contextlib.contextmanager
    def plans_off():
        with replay_off(), links_off():
            yield
    # a replayed call's cached launches do nothing: what is left is its Python and allocations
    launch_stubbed = swapped(launch, "run_cached", lambda entry, grid, args, index=None: None)

    # the forward's parts beside it: its cached launch alone, replayed with the arguments a replay
    # passed (Triton's C launcher and the driver), and its two allocations alone
    for _ in range(3):  # the plan, then its compiled entries (kept from the second replay on)
        tritonattn.flash_attn_func(q, k, v, causal=True)
    real_run = launch.run_cached
    kept = []  # the recorded calls' outputs, alive while their addresses are launched into

    def record(pointers: bool) -> list:
        recorded = []
        launch.run_cached = lambda entry, grid, args, index=None: recorded.append((entry, grid, args, index))
        try:
            with mock.patch.object(plan, "POINTERS", pointers):
                kept.append(tritonattn.flash_attn_func(q, k, v, causal=True))
        finally:
            launch.run_cached = real_run
        return recorded

    for pointers, row in ((True, "addresses"), (False, "tensors")):
        recorded = record(pointers)
        if len(recorded) == 1:
            cases[f"flash_attn_func fwd: its cached launch alone (C launcher, driver; {row})"] = (
                functools.partial(real_run, *recorded[0]))
        else:
            print(f"{len(recorded)} cached launches recorded for the forward (expected 1): no launch-alone row")
    lse_shape = (q.shape[0], q.shape[2], q.shape[1])
    cases["flash_attn_func fwd: its two allocations alone (out, lse)"] = lambda: (
        torch.empty_like(q), torch.empty(lse_shape, device=dev))

    settings = {"default": contextlib.nullcontext, "tensors passed": tensors_passed,
                "launch plans off": plans_off, "launch stubbed": launch_stubbed}
    only = {"launch stubbed": ("flash_attn_func fwd (no grad)", "attention_forward launcher alone"),
            "tensors passed": ("flash_attn_func fwd (no grad)", "flash_attn_func fwd+bwd",
                                         "flash_attn_with_kvcache (Sq=1, int seqlens)",
                                         "attention_backward launcher alone (no autograd)",
                                         "attention_forward launcher alone"),
            "launch plans off": ("flash_attn_func fwd (no grad)", "flash_attn_func fwd+bwd",
                                 "flash_attn_with_kvcache (Sq=1, int seqlens)", "attention_forward launcher alone")}
    # interleaved rounds, median per cell: the host's speed drifts by 30% within a run (a case
    # measured first, alone, read 65 us and 41 us a minute later), so every cell samples the
    # whole run
    samples: dict = {}
    for _ in range(rounds):
        for setting, ctx in settings.items():
            for name, fn in cases.items():
                if setting in only and name not in only[setting]:
                    continue
                with ctx():
                    samples.setdefault((name, setting), []).append(per_call_us(fn, n=200))
    print(f"median of {rounds} interleaved rounds of 200 calls each\n")
    print("| entry point | " + " | ".join(settings) + " |\n|---|" + "---|" * len(settings))
    for name in cases:
        cells = [f"{statistics.median(samples[name, st]):.1f}" if (name, st) in samples else "-" for st in settings]
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
    # the backward launcher's own time inside the engine's device thread (cProfile below sees the
    # main thread only): wall time of ops.attention_backward during fwd+bwd calls
    from tritonattn import ops

    inner, real_bwd = [], ops.attention_backward

    def timed_bwd(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return real_bwd(*args, **kwargs)
        finally:
            inner.append(time.perf_counter() - t0)

    ops.attention_backward = timed_bwd
    try:
        whole = statistics.median(per_call_us(fwd_bwd, n=200) for _ in range(5))
    finally:
        ops.attention_backward = real_bwd
    print(f"\nfwd+bwd {whole:.1f} us per call; attention_backward inside the engine's thread: median "
          f"{statistics.median(inner) * 1e6:.1f} us of {len(inner)} calls")
    import triton

    hook = triton.knobs.runtime.launch_enter_hook
    print(f"\ncached launches: {len(launch._cache)}; Triton launch_enter_hook: {type(hook).__name__} "
          f"with {len(getattr(hook, 'calls', []))} hook(s); launch plans kept: {len(plan._plans)}")
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "overhead-profile.txt"), "w") as f:
        for name in ("flash_attn_func fwd (no grad)", "flash_attn_with_kvcache (Sq=1, int seqlens)",
                     "attention_backward launcher alone (no autograd)", "flash_attn_func fwd+bwd"):
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(200):
                cases[name]()
            prof.disable()
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
            f.write(f"## {name} (200 calls)\n{s.getvalue()}\n")
        # the backward launcher inside the engine's device thread (the profile above sees the main thread)
        prof = cProfile.Profile()

        def profiled_bwd(*args, **kwargs):
            prof.enable()
            try:
                return real_bwd(*args, **kwargs)
            finally:
                prof.disable()

        ops.attention_backward = profiled_bwd
        try:
            for _ in range(200):
                fwd_bwd()
        finally:
            ops.attention_backward = real_bwd
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
        f.write(f"## attention_backward in the engine's thread, flash_attn_func fwd+bwd (200 calls)\n{s.getvalue()}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
