"""The Gluon forward's fixed cost per tile against its cost per key block, beside cuDNN's (H200).

Sq fixed (B=32 x 512 and B=8 x 2048 queries: 16k tokens, MHA, hidden 2048), Sk swept 128-4096,
non-causal, the Gluon kernel forced at every length, graph replays: a program's time is
tiles per program x (a + b x key blocks of 128), so the last column (us per tile x block, per
program) falls towards b as Sk grows and a is read from the short rows (benchmarks/NOTES.md,
twenty-second session: D=128 a = 3.2-3.5 us against cuDNN's ~1.0, b equal).

    python benchmarks/experiments/tile_cost.py [D] [--early-q]   # D = 64, 128 or 256 (default 128)

--early-q: also the kernel with fwd_sm90.EARLY_Q (each tile's Q buffer released after its last S
product, not its last softmax), timed beside the default on the same inputs, outputs compared bitwise.
"""
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

args = [a for a in sys.argv[1:] if not a.startswith("--")]
EARLY = "--early-q" in sys.argv
D = int(args[0]) if args else 128
H = 2048 // D
configs.GLUON_MIN_SEQLEN["fwd"][D] = (0, 0)
plan.clear()
early_col = " early-q us | early / default |" if EARLY else ""
print(f"D={D} H={H}: | B | Sq | Sk | gluon us | cudnn us | gluon us per (tile x 128 keys) |{early_col}")
for B, Sq in ((32, 512), (8, 2048)):
    for Sk in (128, 256, 512, 1024, 2048, 4096):
        q = torch.randn(B, Sq, H, D, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(B, Sk, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        g = _bench(_graphed(lambda: tritonattn.flash_attn_func(q, k, v), "fwd")) * 1e3
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

        def cud():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                F.scaled_dot_product_attention(qt, kt, vt)
        c = _bench(_graphed(cud, "fwd")) * 1e3
        tiles = B * H * Sq // 128
        row = f"| {B} | {Sq} | {Sk} | {g:.1f} | {c:.1f} | {g / (tiles * Sk / 128) * 132:.3f} |"
        if EARLY:
            ref = tritonattn.flash_attn_func(q, k, v)
            fwd_sm90.EARLY_Q = True
            plan.clear()
            e = _bench(_graphed(lambda: tritonattn.flash_attn_func(q, k, v), "fwd")) * 1e3
            same = torch.equal(tritonattn.flash_attn_func(q, k, v), ref)
            fwd_sm90.EARLY_Q = False
            plan.clear()
            g2 = _bench(_graphed(lambda: tritonattn.flash_attn_func(q, k, v), "fwd")) * 1e3  # default again
            row += f" {e:.1f} | {2 * e / (g + g2):.3f}{'' if same else ' NOT BITWISE'} |"
        print(row, flush=True)
