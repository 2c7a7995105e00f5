"""Whether each attention backend's backward gives bitwise equal gradients on reruns (llama heads,
bf16, B=4, S=2048, causal and not): five reruns of the same inputs against the first.

    python scripts/peer_determinism.py       # a markdown table; needs a CUDA GPU
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from tritonattn import flash_attn_func  # noqa: E402


def grads(fn, q, k, v, dout):
    out = fn(q, k, v)
    return torch.autograd.grad(out, (q, k, v), dout)


def main() -> int:
    torch.manual_seed(0)
    B, S, Hq, Hkv, D = 4, 2048, 32, 8, 128
    print("| backend | causal | reruns bitwise equal to the first (dq, dk, dv) |")
    print("|---|---|---|")
    for causal in (False, True):
        q = torch.randn(B, S, Hq, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(B, S, Hkv, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(B, S, Hkv, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dout = torch.randn(B, S, Hq, D, device="cuda", dtype=torch.bfloat16)

        def sdpa(backend):
            def fn(q, k, v):
                with sdpa_kernel(backend):
                    return torch.nn.functional.scaled_dot_product_attention(
                        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal,
                        enable_gqa=True).transpose(1, 2)
            return fn

        backends = {
            "tritonattn": lambda q, k, v: flash_attn_func(q, k, v, causal=causal),
            "sdpa-cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
            "sdpa-flash": sdpa(SDPBackend.FLASH_ATTENTION),
            "sdpa-efficient": sdpa(SDPBackend.EFFICIENT_ATTENTION),
        }
        for name, fn in backends.items():
            try:
                first = grads(fn, q, k, v, dout)
                same = [all(torch.equal(a, b) for a, b in zip(first, grads(fn, q, k, v, dout), strict=True))
                        for _ in range(5)]
                print(f"| {name} | {causal} | {sum(same)} of 5 |")
            except Exception as e:  # noqa: BLE001 (a backend that refuses the shape)
                print(f"| {name} | {causal} | not run: {type(e).__name__}: {str(e).splitlines()[0][:80]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
