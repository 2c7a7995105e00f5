"""The backward with environment switches on and off (H200): the backward's experiments are read from
the environment at each call (TRITONATTN_BWD_FUSED_SECTION, TRITONATTN_BWD_SPLIT_WAITS,
TRITONATTN_BWD_FUSED_DQ, TRITONATTN_ATOMIC_DQ, ...) and are in the launch plan's key, so settings can
alternate within one process.

Each setting is a list of NAME=VALUE parts joined by "+" (NAME without the TRITONATTN_ prefix is
taken with it), or "-" for none (the environment as the run started); a part
"configs.NAME[KEY]...=LITERAL" sets an attribute of tritonattn.configs instead (fwd_flags.set_attr),
e.g. configs.GLUON_MIN_SEQLEN[bwd_dkdv][128]=(512,512) (the Gluon dK/dV kernel with a causal mask
from 512) or configs.FUSED_SECTION_ROWS=16384. Each setting runs every shape,
in alternating rounds; its time is the best round's median of CUDA-event timings of CUDA-graph
replays of the backward alone (one recorded forward), with cuDNN's backward beside. Its gradients
must equal bitwise the first setting's unless a part turns the order of the dQ additions loose
(ATOMIC_DQ=1) or may change the kernels (BWD_FUSED_DQ, configs.*): a row then gives the largest
difference.
Shapes: the fa grid's (16k tokens, hidden 2048, MHA), or with --llama the llama grid's (B=4, Hq=32,
Hkv=8); --group N: the fa shape with H // N kv heads.

    python benchmarks/experiments/bwd_flags.py --settings - BWD_FUSED_SECTION=0 BWD_FUSED_SECTION=8 \
        --head-dims 128 --seqlens 2048 4096 --causal no yes [--llama] [--rounds 3]

("-": the defaults, sections of kv heads included where configs.fused_sections says; =0 the 2-d grid.)

(Written in the twenty-seventh session for the fused dQ's sections and the dK/dV kernel's split
waits; before it, profile_case.py ran one setting per process.)
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
from tritonattn.bench.runner import _bench, _graphed  # noqa: E402
from tritonattn.kernels import plan  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from fwd_flags import print_rows, set_attr, shape  # noqa: E402  (the same shapes and rows as the forward's)

from tritonattn import configs  # noqa: E402

# parts after which the gradients may differ from the first setting's (other kernels or another order)
LOOSE = ("TRITONATTN_ATOMIC_DQ", "TRITONATTN_BWD_FUSED_DQ", "TRITONATTN_BWD_KV_SPLIT", "configs.")


def _parts(setting: str) -> dict[str, str]:
    """A setting's NAME=VALUE parts, environment names with the TRITONATTN_ prefix, "configs.*"
    parts as they are ("-": none)."""
    env = {}
    for part in setting.split("+"):
        if part == "-":
            continue
        name, eq, value = part.partition("=")
        if not eq:
            raise ValueError(f"{part!r}: a setting's parts are NAME=VALUE")
        if name.startswith("configs."):
            env[name] = value
        else:
            env[name if name.startswith("TRITONATTN_") else "TRITONATTN_" + name] = value
    return env


def _apply(env: dict[str, str]) -> dict[str, object]:
    """Set ``env`` (the environment, and configs' attributes); returns the old values (None: unset)."""
    saved = {}
    for name, value in env.items():
        if name.startswith("configs."):
            attr, old = set_attr(configs, f"{name[len('configs.'):]}={value}")
            saved.setdefault("configs." + attr, old)
        else:
            saved[name] = os.environ.get(name)
            os.environ[name] = value
    return saved


def _restore(saved: dict[str, object]) -> None:
    for name, value in saved.items():
        if name.startswith("configs."):
            setattr(configs, name[len("configs."):], value)
        elif value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--settings", nargs="+", default=["-"])
    p.add_argument("--head-dims", type=int, nargs="+", default=[128])
    p.add_argument("--seqlens", type=int, nargs="+", default=[2048])
    p.add_argument("--causal", nargs="+", default=["no"], choices=["no", "yes"])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--llama", action="store_true", help="B=4, Hq=32, Hkv=8 instead of the fa shape")
    p.add_argument("--group", type=int, default=0,
                   help="query heads per kv head on the fa shape (Hkv = H // GROUP; 0: the shape's own)")
    p.add_argument("--batch", type=int, default=0, help="sequences per call (0: the shape's own)")
    p.add_argument("--packed", action="store_true",
                   help="the batch's sequences packed into one flash_attn_varlen_func call (cuDNN's column: dense)")
    a = p.parse_args()
    if a.group and (a.llama or a.group < 1):
        p.error("--group: a positive number of query heads per kv head, on the fa shape (not with --llama)")
    envs = {s: _parts(s) for s in a.settings}
    print("| D | S | causal | setting | us | TFLOP/s | x first | x cuDNN |\n|---|---|---|---|---|---|---|---|")
    for D in a.head_dims:
        for S in a.seqlens:
            for causal in (c == "yes" for c in a.causal):
                H, Hkv, B = shape(D, S, a.llama)
                if a.group:
                    if H % a.group:
                        raise SystemExit(f"--group {a.group}: the fa shape at D={D} has {H} heads")
                    Hkv = H // a.group
                B = a.batch or B
                torch.manual_seed(S + D)
                q = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                k, v = (torch.randn(B, S, Hkv, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                        for _ in range(2))
                dout = torch.randn_like(q)
                call = _call(B, S, causal, a.packed)
                flops = 2.5 * 4 * B * H * S * S * D / (2 if causal else 1)
                times = {s: [] for s in a.settings}
                ref = None
                for _ in range(a.rounds):
                    for s in a.settings:
                        saved = _apply(envs[s])
                        try:
                            plan.clear()
                            out = call(q, k, v)
                            grads = torch.autograd.grad(out, (q, k, v), dout)
                            if ref is None:
                                ref = grads
                            elif not all(torch.equal(x, y) for x, y in zip(grads, ref, strict=True)):
                                diff = max((x.float() - y.float()).abs().max().item()
                                           for x, y in zip(grads, ref, strict=True))
                                named = [n for n in envs[s] if n.startswith(LOOSE)]
                                loose = " (expected: " + ", ".join(named) + ")" if named else ""
                                print(f"| {D} | {S} | {causal} | {s} | GRADIENTS DIFFER from the first setting's "
                                      f"(max abs {diff:.2e}){loose} |")
                            # fresh leaves: the eager call's AccumulateGrad nodes (default stream) must
                            # not be reached from the capture on the side stream (a capture error)
                            del out, grads
                            qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
                            times[s].append(_bench(_graphed(lambda: call(qg, kg, vg), "bwd", (qg, kg, vg), dout))
                                            * 1e3)
                        finally:
                            _restore(saved)
                plan.clear()
                qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))

                def cud():
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=H != Hkv)
                print_rows(D, S, causal, times, flops,
                           _bench(_graphed(cud, "bwd", (qt, kt, vt), dout.transpose(1, 2))) * 1e3)


def _call(B: int, S: int, causal: bool, packed: bool):
    """The attention call timed: flash_attn_func on (B, S, H, D) tensors, or with ``packed`` their B
    sequences of S tokens as one flash_attn_varlen_func call (the same numbers, viewed packed)."""
    if not packed:
        return lambda q, k, v: tritonattn.flash_attn_func(q, k, v, causal=causal)
    cu = torch.arange(B + 1, device="cuda", dtype=torch.int32) * S

    def packed_call(q, k, v):
        out = tritonattn.flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu, S, S,
                                                causal=causal)
        return out.view(q.shape)
    return packed_call


if __name__ == "__main__":
    main()
