"""The Gluon forward with experiment switches of tritonattn/kernels/fwd_sm90.py on and off (H200).

Each setting is a list of parts joined by "+": NAME (set to 1), NAME=LITERAL or NAME[KEY]=LITERAL
(an entry of a dict attribute) of tritonattn/kernels/fwd_sm90.py, "-" for none, and "table" for the
library's routing (configs.GLUON_MIN_SEQLEN) instead of the Gluon kernel forced. Each setting runs
every shape. Its output must equal bitwise the first setting's of the same routing (the switches
change the schedule, not the arithmetic). Its time is the median of CUDA-event timings of CUDA-graph
replays, the best of two alternating rounds, with cuDNN beside. Shapes: the fa grid's (16k tokens,
hidden 2048, MHA), or with --llama the llama grid's (B=4, Hq=32, Hkv=8).

    python benchmarks/experiments/fwd_flags.py --settings table - \
        "TILES[128][O_TMA]=False+TILES[128][Q_BUFS]=1" --head-dims 128 --seqlens 512 2048 [--causal no yes] [--llama]

(Switches measured with it: twenty-fourth session, O_SHFL, the O store's layouts, now the kernel's
only store; Q_PREFETCH, removed; twenty-fifth session, V_STAGES / Q_BUFS / O_TMA and NC, now in TILES
and BY_MASK; twenty-sixth session, SPLIT_WAIT, now on at D=128 / 256, and EXP_POLY (exp2 partly on
the FMA pipe), removed: -3..-13%; twenty-seventh session, P_CVT (P rounded by inline PTX), now the
only rounding, and ROWSUM_MMA (row sums by the tensor cores), removed. A setting whose output
differs from the first's, as EXP_POLY's and ROWSUM_MMA's did, gets a row with the largest difference.)
"""

from __future__ import annotations

import argparse
import ast
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


def _key(text: str):
    """A key of NAME[KEY]: a Python literal, else the text (a field name such as O_TMA)."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def set_attr(module, part: str) -> tuple[str, object]:
    """Set NAME (= 1), NAME=LITERAL or NAME[KEY]...[KEY]=LITERAL (an entry of a dict attribute, nested
    dicts copied on the way, so the module's own dicts are left alone) on ``module``; returns
    (NAME, its old value) for the caller to put back."""
    target, _, value = part.partition("=")
    value = ast.literal_eval(value) if value else 1
    name, *keys = target.rstrip("]").replace("][", "[").split("[")
    old = getattr(module, name)
    top = value
    if keys:
        top = dict(old)
        d = top
        for k in keys[:-1]:
            d[_key(k)] = dict(d.get(_key(k), {}))
            d = d[_key(k)]
        d[_key(keys[-1])] = value
    setattr(module, name, top)
    return name, old


def _apply(parts: list[str]) -> dict:
    """Set a setting's parts on fwd_sm90 (set_attr: TILES[128][O_TMA]=False,
    BY_MASK[(64,True)]={'NC':3}); returns the attributes' old values."""
    saved = {}
    for part in parts:
        if part in ("-", "table"):
            continue
        target = part.partition("=")[0]
        name, *keys = target.rstrip("]").replace("][", "[").split("[")
        if name == "TILES" and keys and _key(keys[0]) not in fwd_sm90.TILES:
            raise ValueError(f"fwd_sm90.TILES has no head dim {keys[0]}")
        if name in ("TILES", "BY_MASK") and len(keys) == 2 and keys[1] not in fwd_sm90.tile(128, False):
            raise ValueError(f"{part}: a tile has no field {keys[1]} (fields: {sorted(fwd_sm90.tile(128, False))})")
        if name == "TILES" and len(keys) == 2:
            shadowed = [m for m in (False, True) if keys[1] in fwd_sm90.BY_MASK.get((_key(keys[0]), m), {})]
            if shadowed:
                print(f"note: {part} is overridden by BY_MASK where causal is {shadowed}")
        name, old = set_attr(fwd_sm90, part)
        saved.setdefault(name, old)
    return saved


def shape(D: int, S: int, llama: bool) -> tuple[int, int, int]:
    """(query heads, kv heads, batch): the llama grid's (32, 8, 4), else the fa grid's (hidden 2048,
    MHA, 16k tokens)."""
    return (32, 8, 4) if llama else (2048 // D, 2048 // D, max(1, 16384 // S))


def print_rows(D: int, S: int, causal: bool, times: dict, flops: float, cudnn_us: float) -> None:
    """A row per setting: its best round's microseconds, TFLOP/s, x the first setting, x cuDNN."""
    base = min(next(iter(times.values())))
    for s, ts in times.items():
        us = min(ts)
        print(f"| {D} | {S} | {causal} | {s} | {us:.1f} | {flops / us / 1e6:.0f} | {base / us:.3f} | "
              f"{cudnn_us / us:.3f} |", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--settings", nargs="+", default=["-"])
    p.add_argument("--head-dims", type=int, nargs="+", default=[128])
    p.add_argument("--seqlens", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--causal", nargs="+", default=["no"], choices=["no", "yes"])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--llama", action="store_true", help="B=4, Hq=32, Hkv=8 instead of the fa shape")
    a = p.parse_args()
    table = dict(configs.GLUON_MIN_SEQLEN["fwd"])
    print("| D | S | causal | setting | us | TFLOP/s | x default | x cuDNN |\n|---|---|---|---|---|---|---|---|")
    for D in a.head_dims:
        for S in a.seqlens:
            for causal in (c == "yes" for c in a.causal):
                H, Hkv, B = shape(D, S, a.llama)
                q = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16)
                k, v = (torch.randn(B, S, Hkv, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
                flops = 4 * B * H * S * S * D / (2 if causal else 1)
                times = {s: [] for s in a.settings}
                ref = {}  # the first output of each routing (table or forced): bitwise per routing
                for _ in range(a.rounds):
                    for s in a.settings:
                        parts = s.split("+")
                        configs.GLUON_MIN_SEQLEN["fwd"][D] = table[D] if "table" in parts else (0, 0)
                        saved = _apply(parts)
                        plan.clear()
                        out = tritonattn.flash_attn_func(q, k, v, causal=causal)
                        routing = "table" in parts
                        if routing not in ref:
                            ref[routing] = out
                        elif not torch.equal(out, ref[routing]):
                            diff = (out.float() - ref[routing].float()).abs().max().item()
                            print(f"| {D} | {S} | {causal} | {s} | OUTPUT DIFFERS from the first setting's "
                                  f"(max abs {diff:.2e}) |")
                        times[s].append(_bench(_graphed(lambda: tritonattn.flash_attn_func(q, k, v, causal=causal),
                                                        "fwd")) * 1e3)
                        for name, value in saved.items():
                            setattr(fwd_sm90, name, value)
                configs.GLUON_MIN_SEQLEN["fwd"][D] = table[D]
                plan.clear()
                qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

                def cud():
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=H != Hkv)
                print_rows(D, S, causal, times, flops, _bench(_graphed(cud, "fwd")) * 1e3)


if __name__ == "__main__":
    main()
