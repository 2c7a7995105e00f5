"""torch.compile: the torch.library ops trace with fake tensors, compile with fullgraph=True (no
graph break), and compiled results equal eager ones."""

import pytest
import torch
from conftest import DEVICE

from tritonattn import attention, flash_attn_func, scaled_dot_product_attention
from tritonattn.ops import attention_fwd_op

F16, F32 = torch.float16, torch.float32


def _inputs(dtype=F32):
    torch.manual_seed(0)
    q = torch.randn(2, 33, 4, 32, device=DEVICE, dtype=dtype, requires_grad=True)
    k = torch.randn(2, 40, 2, 32, device=DEVICE, dtype=dtype, requires_grad=True)
    v = torch.randn(2, 40, 2, 32, device=DEVICE, dtype=dtype, requires_grad=True)
    return q, k, v


def _eager_vs_compiled(fn, inputs):
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    out_e = fn(*inputs)
    g_e = torch.autograd.grad(out_e.float().sum(), inputs)
    out_c = compiled(*inputs)
    g_c = torch.autograd.grad(out_c.float().sum(), inputs)
    assert torch.equal(out_e, out_c)
    for a, b in zip(g_e, g_c):
        assert torch.equal(a, b)


def test_opcheck_forward_op():
    q, k, v = (t.detach().requires_grad_() for t in _inputs())
    args = (q, k, v, None, None, None, None, 32 ** -0.5, None, 0, 0.0, 0.0, 0)
    torch.library.opcheck(attention_fwd_op, args)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_flash_attn_func_compiles_fullgraph(causal):
    _eager_vs_compiled(lambda q, k, v: flash_attn_func(q, k, v, causal=causal, window_size=(8, -1), softcap=5.0),
                       _inputs())


def test_attention_with_bias_grad_compiles():
    q, k, v = _inputs()
    bias = torch.randn(2, 1, 33, 40, device=DEVICE, requires_grad=True)
    _eager_vs_compiled(lambda q, k, v, b: attention(q, k, v, bias=b, causal=True), (q, k, v, bias))


def test_sdpa_dropin_compiles():
    torch.manual_seed(1)
    q = torch.randn(2, 4, 20, 16, device=DEVICE, requires_grad=True)
    k = torch.randn(2, 2, 24, 16, device=DEVICE, requires_grad=True)
    v = torch.randn(2, 2, 24, 16, device=DEVICE, requires_grad=True)
    mask = torch.rand(2, 1, 20, 24, device=DEVICE) > 0.3
    _eager_vs_compiled(lambda q, k, v: scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=True,
                                                                    enable_gqa=True), (q, k, v))
