"""Integration check on a GPU: torch.compile (inductor) and Hugging Face training against sdpa.

1. torch.compile, inductor, ``fullgraph=True``: a small attention block (q/k/v/o projections around
   ``tritonattn.flash_attn_func``, causal, GQA), and the same block around
   ``tritonattn.scaled_dot_product_attention``. Compiled vs eager: the output and the gradients of
   the projection weights (max abs diff, relative to the largest eager value), graph breaks (must
   be 0), graphs compiled, and the median time of a fwd+bwd step of each.
2. Convergence (needs transformers): a small Llama built from a config (random init, fixed seed)
   trained twice from the same init on the same synthetic data, with ``attn_implementation="sdpa"``
   and ``"tritonattn"``: the loss curves side by side, the final losses (mean of the last steps),
   their relative difference, and the median step time of each. Without transformers this part
   prints "skipped: transformers not installed" and the compile part still runs.

The data is a fixed random Markov chain (each token has 8 possible successors with random
probabilities); every sequence is a chain segment followed by a copy of itself, so the loss falls
as the chain is learnt and then further only with attention that can look back (the copy).
AdamW lr 1e-3 on the GPU shape: on CPU, a smaller Llama (hidden 128, 2 layers) on the same data
(vocab 8192, batch 8 x 512, 300 steps, fp32) went from 9.04 to 3.8 at lr 1e-3 but only to 6.85 at
3e-4; a curve that moves far is the more telling comparison.

On a GPU: bf16, shapes sized to finish in a few minutes. ``--tiny``: fp32, tiny shapes, for a CPU
under the Triton interpreter (a functional check; its timings are not speed figures). Markdown
goes to stdout and to ``$OUT/integration.md`` when OUT is set. Exit status 1 when a check fails.

    python scripts/integration_gpu.py                  # GPU
    TRITON_INTERPRET=1 python scripts/integration_gpu.py --tiny
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import statistics
import sys
import time
import traceback

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import triton  # noqa: E402

import tritonattn  # noqa: E402

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"

# Compiled vs eager, max |diff| / max |eager|. The attention kernel is the same call in both; what
# differs is the code around it (inductor's fused views/transposes, possibly another GEMM algorithm
# for the same matmul), so the results differ by rounding only: about one bf16 ulp (2^-8 = 3.9e-3
# relative) at worst, fp32 rounding (~1e-7) in tiny mode. Tolerances with margin:
COMPILE_TOL = {torch.bfloat16: 2e-2, torch.float32: 1e-4}
# Final loss (mean of the last steps), |tritonattn - sdpa| / sdpa.
# bf16 on the GPU: two bf16 runs drift apart by rounding noise that training amplifies (attention
# kernels differ in summation order, so the curves are not bit-equal); 2% is well above that noise
# and well below what a wrong attention does (the copy half of the data stays unlearned: a gap of
# tens of percent).
# fp32 in tiny mode (CPU interpreter, 20 steps): measured 1.7e-8 relative (largest per-step gap
# 2.4e-7) at the default lr 3e-3; 1.1e-6 / 2.0e-5 at lr 1e-2 / 2e-2, where training amplifies the
# rounding differences more. 1e-4 keeps a 5x margin over the worst of those and 4 orders of
# magnitude at the default, while a wrong gradient (e.g. a missing scale) shows up at >1e-2.
LOSS_TOL = {torch.bfloat16: 2e-2, torch.float32: 1e-4}


class Report:
    """Markdown lines printed as they come, and kept for $OUT/integration.md."""

    def __init__(self):
        self.lines: list[str] = []
        self.failures: list[str] = []

    def __call__(self, line: str = "") -> None:
        print(line, flush=True)
        self.lines.append(line)

    def fail(self, what: str) -> None:
        self.failures.append(what)


def sync() -> None:
    if GPU:
        torch.cuda.synchronize()


class StepTimer:
    """Per-step times in ms: CUDA events on a GPU (read once at the end), perf_counter on CPU."""

    def __init__(self):
        self.pairs: list = []

    def start(self):
        if GPU:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.pairs.append([e, None])
        else:
            self.pairs.append([time.perf_counter(), None])

    def stop(self):
        if GPU:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.pairs[-1][1] = e
        else:
            self.pairs[-1][1] = time.perf_counter()

    def times_ms(self) -> list[float]:
        sync()
        if GPU:
            return [a.elapsed_time(b) for a, b in self.pairs]
        return [(b - a) * 1e3 for a, b in self.pairs]


# ---------------------------------------------------------------------------------------------------
# 1. torch.compile


class FlashBlock(torch.nn.Module):
    """q/k/v/o projections around flash_attn_func: (batch, seqlen, heads, head_dim) layout."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int):
        super().__init__()
        self.h, self.hkv, self.d = heads, kv_heads, head_dim
        hidden = heads * head_dim
        self.q_proj = torch.nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = torch.nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = torch.nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = torch.nn.Linear(heads * head_dim, hidden, bias=False)

    def attend(self, q, k, v):
        return tritonattn.flash_attn_func(q, k, v, causal=True)

    def forward(self, x):
        B, S, _ = x.shape
        q = self.q_proj(x).view(B, S, self.h, self.d)
        k = self.k_proj(x).view(B, S, self.hkv, self.d)
        v = self.v_proj(x).view(B, S, self.hkv, self.d)
        return self.o_proj(self.attend(q, k, v).reshape(B, S, self.h * self.d))


class SdpaBlock(FlashBlock):
    """The same block around tritonattn.scaled_dot_product_attention: (batch, heads, seqlen, head_dim)."""

    def attend(self, q, k, v):
        out = tritonattn.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                      is_causal=True, enable_gqa=True)
        return out.transpose(1, 2)


def _rel_diff(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(max abs diff, that / max |b|)."""
    diff = (a.float() - b.float()).abs().max().item()
    return diff, diff / max(b.float().abs().max().item(), 1e-30)


def compile_check(report: Report, name: str, block_cls, shape: dict, dtype, steps: int) -> None:
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    B, S = shape["batch"], shape["seqlen"]
    block = block_cls(shape["heads"], shape["kv_heads"], shape["head_dim"]).to(DEVICE, dtype)
    hidden = shape["heads"] * shape["head_dim"]
    x = torch.randn(B, S, hidden, device=DEVICE, dtype=dtype)
    dout = torch.randn(B, S, hidden, device=DEVICE, dtype=dtype)
    weights = [block.q_proj.weight, block.k_proj.weight, block.v_proj.weight]

    def step(fn):
        out = fn(x)
        return out, torch.autograd.grad(out, weights, dout)

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(block, backend="inductor", fullgraph=True)
    error = None
    sync()
    t0 = time.perf_counter()
    try:
        out_c, g_c = step(compiled)
        sync()
    except Exception as e:  # a graph break raises under fullgraph=True
        error = _first_line(e)
    compile_s = time.perf_counter() - t0
    breaks = sum(counters["graph_break"].values())
    if error is not None:
        report(f"| {name} | compile failed: {error} | | | | | | | | FAIL |")
        report.fail(f"compile {name}: {error}")
        return
    out_e, g_e = step(block)
    tol = COMPILE_TOL[dtype]
    out_abs, out_rel = _rel_diff(out_c, out_e)
    grad_diffs = [_rel_diff(a, b) for a, b in zip(g_c, g_e)]
    grad_abs, grad_rel = max(d[0] for d in grad_diffs), max(d[1] for d in grad_diffs)

    times = {}
    for label, fn in (("eager", block), ("compiled", compiled)):
        step(fn)  # warm-up
        timer = StepTimer()
        for _ in range(steps):
            timer.start()
            step(fn)
            timer.stop()
        times[label] = statistics.median(timer.times_ms())
    graphs = counters["stats"]["unique_graphs"]
    breaks = sum(counters["graph_break"].values())
    ok = out_rel <= tol and grad_rel <= tol and breaks == 0
    if not ok:
        report.fail(f"compile {name}: out rel {out_rel:.2e}, grad rel {grad_rel:.2e} (tol {tol:.0e}), "
                    f"graph breaks {breaks}")
    report(f"| {name} | {out_abs:.3e} ({out_rel:.1e}) | {grad_abs:.3e} ({grad_rel:.1e}) | {tol:.0e} | {breaks} | "
           f"{graphs} | {compile_s:.1f} | {times['eager']:.3f} | {times['compiled']:.3f} | "
           f"{times['eager'] / times['compiled']:.2f}x | {'PASS' if ok else 'FAIL'} |")
    if graphs > 1:
        report(f"\nnote: {name} compiled {graphs} graphs for one input shape (recompilation?)\n")


def run_compile(report: Report, args, dtype) -> None:
    shape = (dict(batch=2, seqlen=32, heads=4, kv_heads=2, head_dim=16) if args.tiny
             else dict(batch=4, seqlen=2048, heads=16, kv_heads=4, head_dim=64))
    report("## 1. torch.compile (inductor, fullgraph=True) vs eager")
    report()
    report(f"Attention block: q/k/v/o projections, causal, GQA {shape['heads']}/{shape['kv_heads']}, "
           f"batch {shape['batch']}, seqlen {shape['seqlen']}, head_dim {shape['head_dim']}, {_dt(dtype)}. "
           f"Diffs: max abs (relative to max |eager|); grads: of the q/k/v projection weights. "
           f"Step: fwd+bwd, median of {args.compile_steps} after a warm-up.")
    report()
    report("| entry point | out diff | grad diff | tol | graph breaks | graphs | first call s | eager ms/step "
           "| compiled ms/step | speedup | result |")
    report("|---|---|---|---|---|---|---|---|---|---|---|")
    compile_check(report, "flash_attn_func", FlashBlock, shape, dtype, args.compile_steps)
    compile_check(report, "scaled_dot_product_attention", SdpaBlock, shape, dtype, args.compile_steps)
    report()


# ---------------------------------------------------------------------------------------------------
# 2. Convergence


def markov_data(n_seq: int, seqlen: int, vocab: int, seed: int, successors: int = 8):
    """``n_seq`` sequences: a chain segment of ``seqlen // 2`` tokens, then a copy of it (and one
    more chain token when seqlen is odd). Deterministic (CPU generator). Also returns the chain's
    mean transition entropy over the data (nats): the loss floor of a model that only learns the
    chain is about that; one that also copies reaches about half of it."""
    g = torch.Generator().manual_seed(seed)
    nxt = torch.randint(0, vocab, (vocab, successors), generator=g)
    probs = -torch.rand(vocab, successors, generator=g).clamp_min(1e-6).log()  # Dirichlet(1) weights
    probs = probs / probs.sum(-1, keepdim=True)
    half = seqlen // 2
    seg = torch.empty(n_seq, half + seqlen % 2, dtype=torch.long)
    seg[:, 0] = torch.randint(0, vocab, (n_seq,), generator=g)
    for t in range(1, seg.shape[1]):
        choice = torch.multinomial(probs[seg[:, t - 1]], 1, generator=g)[:, 0]
        seg[:, t] = nxt[seg[:, t - 1], choice]
    data = torch.cat([seg[:, :half], seg[:, :half], seg[:, half:]], dim=1)
    ent = -(probs * probs.log()).sum(-1)
    return data, ent[seg[:, :-1]].mean().item()


def train(transformers, attn: str, init_state: dict, config, data, args, dtype) -> tuple[list[float], list[float]]:
    model = transformers.LlamaForCausalLM(config)
    model.load_state_dict(init_state)
    model = model.to(DEVICE, torch.float32 if args.autocast else dtype)
    model.set_attn_implementation(attn)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, args.steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
    losses, timer = [], StepTimer()
    for s in range(args.steps):
        batch = data[s * args.batch:(s + 1) * args.batch]
        timer.start()
        with torch.autocast(DEVICE, dtype=dtype, enabled=args.autocast):
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        timer.stop()
        losses.append(loss.detach())
    times = timer.times_ms()
    losses = torch.stack(losses).float().cpu().tolist()
    del model, opt
    if GPU:
        torch.cuda.empty_cache()
    return losses, times


def run_convergence(report: Report, args, dtype) -> None:
    report("## 2. Convergence: Hugging Face Llama, sdpa vs tritonattn")
    report()
    try:
        import transformers
    except ImportError:
        report("skipped: transformers not installed")
        report()
        return
    import tritonattn.integrations.transformers  # noqa: F401 - registers attn_implementation="tritonattn"

    c = (dict(vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2) if args.tiny
         else dict(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                   num_attention_heads=8, num_key_value_heads=4))
    config = transformers.LlamaConfig(max_position_embeddings=max(args.seqlen, 64), attention_dropout=0.0, **c)
    torch.manual_seed(args.seed)
    init_state = copy.deepcopy(transformers.LlamaForCausalLM(config).state_dict())  # fp32, on CPU
    n_params = sum(t.numel() for t in init_state.values())
    data, chain_ent = markov_data(args.steps * args.batch, args.seqlen, c["vocab_size"], args.seed + 1)
    data = data.to(DEVICE)
    precision = (f"fp32 weights and AdamW state, {_dt(dtype)} autocast" if args.autocast
                 else f"weights and AdamW state in {_dt(dtype)}")
    report(f"Llama from config ({n_params / 1e6:.1f}M params: hidden {c['hidden_size']}, {c['num_hidden_layers']} "
           f"layers, heads {c['num_attention_heads']}/{c['num_key_value_heads']}, vocab {c['vocab_size']}), "
           f"seed {args.seed}, {precision} (AdamW lr {args.lr}, betas 0.9/0.95, "
           f"wd 0.1, warm-up {max(1, args.steps // 10)} steps, clip 1.0), batch {args.batch} x seqlen "
           f"{args.seqlen}, {args.steps} steps, no padding (causal). transformers {transformers.__version__}.")
    report(f"Data: Markov chain segment + its copy; loss at uniform {math.log(c['vocab_size']):.2f}, chain-only floor "
           f"~{chain_ent:.2f}, chain + copy floor ~{chain_ent / 2:.2f} nats.")
    report()

    curves, times = {}, {}
    for attn in ("sdpa", "tritonattn"):
        t0 = time.perf_counter()
        curves[attn], times[attn] = train(transformers, attn, init_state, config, data, args, dtype)
        print(f"[{attn}: {args.steps} steps in {time.perf_counter() - t0:.1f} s]", file=sys.stderr, flush=True)

    report("| step | sdpa loss | tritonattn loss | abs diff |")
    report("|---|---|---|---|")
    logged = sorted({*range(0, args.steps, args.log_every), args.steps - 1})
    for s in logged:
        a, b = curves["sdpa"][s], curves["tritonattn"][s]
        report(f"| {s + 1} | {a:.4f} | {b:.4f} | {abs(a - b):.2e} |")
    report()
    window = 20 if args.steps >= 80 else max(1, args.steps // 4)
    final = {k: statistics.mean(v[-window:]) for k, v in curves.items()}
    rel = abs(final["tritonattn"] - final["sdpa"]) / abs(final["sdpa"])
    max_diff = max(abs(a - b) for a, b in zip(curves["sdpa"], curves["tritonattn"]))
    finite = all(math.isfinite(x) for v in curves.values() for x in v)
    learned = final["tritonattn"] < 0.9 * curves["tritonattn"][0]
    tol = LOSS_TOL[dtype]
    report(f"| backend | first loss | final loss (mean of last {window}) | median step ms |")
    report("|---|---|---|---|")
    for attn in ("sdpa", "tritonattn"):
        report(f"| {attn} | {curves[attn][0]:.4f} | {final[attn]:.4f} | {statistics.median(times[attn]):.2f} |")
    report()
    ok = finite and learned and rel <= tol
    report(f"Final loss relative difference: {rel:.2e} (tolerance {tol:.0e}); largest per-step difference "
           f"{max_diff:.2e}; loss decreased: {learned}: **{'PASS' if ok else 'FAIL'}**")
    report()
    if not ok:
        report.fail(f"convergence: relative difference {rel:.2e} (tol {tol:.0e}), finite {finite}, learned {learned}")


def _first_line(e: BaseException) -> str:
    msg = str(e).strip()
    return f"{type(e).__name__}: {msg.splitlines()[0][:300] if msg else ''}"


def _dt(dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="tiny fp32 shapes (CPU under the Triton interpreter)")
    p.add_argument("--steps", type=int, help="training steps (default 300; tiny 20)")
    p.add_argument("--batch", type=int, help="training batch (default 8; tiny 2)")
    p.add_argument("--seqlen", type=int, help="training seqlen (default 512; tiny 32)")
    p.add_argument("--lr", type=float, help="AdamW lr (default 1e-3; tiny 3e-3)")
    p.add_argument("--log-every", type=int, help="loss rows every N steps (default 25; tiny 5)")
    p.add_argument("--compile-steps", type=int, help="timed fwd+bwd steps per compile case (default 20; tiny 3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--autocast", action="store_true",
                   help="train with fp32 weights under bf16 autocast instead of bf16 weights")
    p.add_argument("--skip-compile", action="store_true")
    p.add_argument("--skip-convergence", action="store_true")
    args = p.parse_args(argv)
    defaults = dict(steps=(20, 300), batch=(2, 8), seqlen=(32, 512), lr=(3e-3, 1e-3), log_every=(5, 25),
                    compile_steps=(3, 20))
    for key, (tiny, full) in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, tiny if args.tiny else full)
    if not GPU and not args.tiny:
        print("no CUDA device: run with --tiny (CPU, Triton interpreter)", file=sys.stderr)
        return 2
    dtype = torch.float32 if args.tiny else torch.bfloat16

    report = Report()
    t_start = time.perf_counter()
    report("# tritonattn integration check")
    report()
    where = torch.cuda.get_device_name() if GPU else "CPU (Triton interpreter)"
    report(f"{where}; torch {torch.__version__}, triton {triton.__version__}, mode {'tiny' if args.tiny else 'full'}, "
           f"{_dt(dtype)}")
    report()
    try:
        for skip, part in ((args.skip_compile, run_compile), (args.skip_convergence, run_convergence)):
            if skip:
                continue
            try:  # one part crashing still lets the other run (one GPU call gets both results)
                part(report, args, dtype)
            except Exception as e:
                traceback.print_exc()
                report(f"\n{part.__name__} crashed: {_first_line(e)}\n")
                report.fail(f"{part.__name__} crashed ({type(e).__name__})")
        report("## Result")
        report()
        for f in report.failures:
            report(f"- FAIL {f}")
        report(f"{'FAIL' if report.failures else 'PASS'} ({len(report.failures)} failure(s), "
               f"{time.perf_counter() - t_start:.0f} s)")
    finally:
        if os.environ.get("OUT"):
            os.makedirs(os.environ["OUT"], exist_ok=True)
            with open(os.path.join(os.environ["OUT"], "integration.md"), "w") as f:
                f.write("\n".join(report.lines) + "\n")
    return 1 if report.failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
