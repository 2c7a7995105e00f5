"""The Gluon forward's fixed cost per tile against its cost per key block, beside cuDNN's (H200).

Sq fixed (B=32 x 512 and B=8 x 2048 queries: 16k tokens, MHA, hidden 2048), Sk swept 128-4096,
non-causal, the Gluon kernel forced at every length, graph replays: a program's time is
tiles per program x (a + b x key blocks of 128), so the last column (us per tile x block, per
program) falls towards b as Sk grows and a is read from the short rows (benchmarks/NOTES.md,
twenty-second session: D=128 a = 3.2-3.5 us against cuDNN's ~1.0, b equal).

    python benchmarks/experiments/tile_cost.py [D]      # D = 64, 128 or 256 (default 128)
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
from tritonattn.kernels import plan  # noqa: E402

D = int(sys.argv[1]) if len(sys.argv) > 1 else 128
H = 2048 // D
configs.GLUON_MIN_SEQLEN["fwd"][D] = (0, 0)
plan.clear()
print(f"D={D} H={H}: | B | Sq | Sk | gluon us | cudnn us | gluon us per (tile x 128 keys) |")
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
        print(f"| {B} | {Sq} | {Sk} | {g:.1f} | {c:.1f} | {g / (tiles * Sk / 128) * 132:.3f} |", flush=True)
