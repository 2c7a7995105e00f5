"""The opt-in atomic-dQ backward (TRITONATTN_ATOMIC_DQ=1): dQ accumulated by the dK/dV kernel with
atomics, no dQ kernel. Same reference and tolerance rule as the default path; calls with
deterministic=True keep the default (split, bitwise reproducible) path."""

import pytest
import torch
from conftest import DEVICE, check_against_reference

from tritonattn import flash_attn_func, flash_attn_varlen_func
from tritonattn.kernels import bwd
from tritonattn.testing import random_qkv

F16, F32 = torch.float16, torch.float32


@pytest.fixture
def atomic(monkeypatch):
    monkeypatch.setenv("TRITONATTN_ATOMIC_DQ", "1")
    calls = []
    real = bwd._launch_dq
    monkeypatch.setattr(bwd, "_launch_dq", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    yield calls


CASES = [
    # (B, Sq, Sk, Hq, Hkv, D, causal, extra kwargs, dtype)
    (2, 70, 90, 4, 2, 40, True, {}, F32),
    (1, 129, 65, 4, 1, 64, False, {}, F16),
    (2, 65, 129, 4, 2, 32, True, dict(window_size=(24, -1), softcap=8.0), F32),
    (1, 33, 47, 2, 2, 16, False, dict(dropout_p=0.2), F32),
]


@pytest.mark.parametrize("B,Sq,Sk,Hq,Hkv,D,causal,kw,dtype", CASES)
def test_atomic_dq_matches_reference(B, Sq, Sk, Hq, Hkv, D, causal, kw, dtype, atomic, poison):
    torch.manual_seed(Sq + Sk)
    q, k, v = random_qkv(B, Sq, Sk, Hq, Hkv, D, dtype, DEVICE)
    out, lse, s_dmask = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True, **kw)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert not atomic, "the dQ kernel must not run on the atomic path"
    extra = dict(kw)
    if "dropout_p" in extra:
        extra["dropout_mask"] = s_dmask >= 0
    check_against_reference(q, k, v, out, lse, grads, dout, causal, **extra)


def test_atomic_dq_varlen(atomic, poison):
    lens = [17, 1, 0, 40]
    cu = torch.tensor([0, 17, 18, 18, 58], dtype=torch.int32, device=DEVICE)
    q = torch.randn(58, 4, 32, device=DEVICE, requires_grad=True)
    k = torch.randn(58, 2, 32, device=DEVICE, requires_grad=True)
    v = torch.randn(58, 2, 32, device=DEVICE, requires_grad=True)
    out = flash_attn_varlen_func(q, k, v, cu, cu, 40, 40, causal=True)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert not atomic
    start = 0
    for n in lens:
        sl = slice(start, start + n)
        start += n
        if n == 0:
            continue
        qi, ki, vi = (t.detach()[sl][None].requires_grad_() for t in (q, k, v))
        check_against_reference(qi, ki, vi, out[sl][None], None, tuple(g[sl][None] for g in grads),
                                dout[sl][None], True)


def test_deterministic_true_keeps_the_default_path(atomic, poison):
    q, k, v = random_qkv(1, 40, 40, 2, 1, 16, F32, DEVICE)
    out = flash_attn_func(q, k, v, causal=True, deterministic=True)
    g1 = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert atomic, "deterministic=True must run the dQ kernel"
    out = flash_attn_func(q, k, v, causal=True, deterministic=True)
    g2 = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert all(torch.equal(a, b) for a, b in zip(g1, g2))
