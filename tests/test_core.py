"""Forward and backward against the fp64 reference (CPU interpreter tier; the same tests run on a GPU)."""

import pytest
import torch
from conftest import DEVICE, case_id, check_against_reference, in_both_program_orders

import tritonattn
from tritonattn import flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func
from tritonattn.testing import random_qkv

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
SEQLENS = [(1, 1), (17, 17), (63, 63), (64, 64), (65, 65), (127, 127), (129, 129),
           (17, 65), (65, 17), (1, 129), (129, 1), (63, 127), (127, 63), (64, 129), (129, 64)]
HEAD_DIMS = [16, 40, 64, 80, 96, 128, 256]
HEADS = [(4, 4), (4, 2), (8, 2), (4, 1)]  # GQA ratios 1, 2, 4 and MQA


def _cases():
    cases = []
    i = 0
    # every sequence-length pair, causal and not, fp16 and fp32; head dims and GQA ratios cycle
    for Sq, Sk in SEQLENS:
        for causal in (False, True):
            for dtype in (F16, F32):
                Hq, Hkv = HEADS[i % len(HEADS)]
                D = HEAD_DIMS[(i // 2) % len(HEAD_DIMS)]
                B = 1 if D >= 128 else 2
                cases.append((B, Sq, Sk, Hq, Hkv, D, causal, dtype))
                i += 1
    # every head dim (and odd ones) at an unequal, ragged shape, both directions
    for D in HEAD_DIMS + [1, 8, 100, 192]:
        cases.append((1, 65, 129, 4, 2, D, True, F16))
        cases.append((1, 129, 65, 2, 1, D, False, F32))
    # bf16 works under the interpreter too (dot operands upcast; see kernels/common.py)
    for Sq, Sk, causal in ((65, 129, True), (129, 63, False), (127, 17, True)):
        cases.append((2, Sq, Sk, 4, 2, 64, causal, BF16))
    return cases


CASES = _cases()


def _run(q, k, v, causal, softmax_scale=None):
    out, lse, s_dmask = flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal, return_attn_probs=True)
    assert s_dmask is None
    assert out.dtype == q.dtype and out.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    return out, lse, grads, dout


@pytest.mark.parametrize("B,Sq,Sk,Hq,Hkv,D,causal,dtype", CASES, ids=[case_id(*c) for c in CASES])
def test_forward_backward(B, Sq, Sk, Hq, Hkv, D, causal, dtype, poison):
    torch.manual_seed(Sq * 1000 + Sk + D)
    q, k, v = random_qkv(B, Sq, Sk, Hq, Hkv, D, dtype, DEVICE)
    out, lse, grads, dout = _run(q, k, v, causal)
    check_against_reference(q, k, v, out, lse, grads, dout, causal)


@pytest.mark.parametrize("layout", ["strided", "transposed"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_non_contiguous_inputs(layout, causal, poison):
    torch.manual_seed(1)
    q, k, v = random_qkv(2, 65, 80, 4, 2, 40, F16, DEVICE, layout=layout)
    assert not q.is_contiguous()
    out, lse, grads, dout = _run(q, k, v, causal)
    check_against_reference(q, k, v, out, lse, grads, dout, causal)


def test_non_contiguous_grad_output(poison):
    torch.manual_seed(2)
    q, k, v = random_qkv(2, 33, 47, 2, 2, 64, F16, DEVICE)
    out = flash_attn_func(q, k, v, causal=True)
    dout = torch.randn(2, 2, 33, 64, dtype=F16, device=DEVICE).transpose(1, 2)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    check_against_reference(q, k, v, out, None, grads, dout, causal=True)


@pytest.mark.parametrize("softmax_scale", [0.05, 1.0, 0.0, -0.3])  # <= 0: the general score path
def test_softmax_scale(softmax_scale, poison):
    torch.manual_seed(3)
    q, k, v = random_qkv(1, 40, 70, 2, 1, 32, F32, DEVICE)
    out, lse, grads, dout = _run(q, k, v, True, softmax_scale)
    check_against_reference(q, k, v, out, lse, grads, dout, True, softmax_scale)


@pytest.mark.parametrize("dtype", [F16, F32], ids=["fp16", "fp32"])
def test_fully_masked_rows(dtype, poison):
    """Causal with Sq > Sk: the first Sq - Sk rows see no key: out 0, lse -inf, zero grads."""
    torch.manual_seed(4)
    Sq, Sk = 129, 40
    q, k, v = random_qkv(2, Sq, Sk, 4, 2, 64, dtype, DEVICE)
    out, lse, grads, dout = _run(q, k, v, True)
    empty = Sq - Sk
    assert torch.equal(out[:, :empty], torch.zeros_like(out[:, :empty]))
    assert torch.isneginf(lse[:, :, :empty]).all() and torch.isfinite(lse[:, :, empty:]).all()
    assert torch.equal(grads[0][:, :empty], torch.zeros_like(grads[0][:, :empty]))
    check_against_reference(q, k, v, out, lse, grads, dout, True)


def test_all_rows_masked(poison):
    """Sk = 1 causal with Sq = 64: only the last row sees the key."""
    torch.manual_seed(5)
    q, k, v = random_qkv(1, 64, 1, 2, 2, 16, F16, DEVICE)
    out, lse, grads, dout = _run(q, k, v, True)
    assert torch.isneginf(lse[:, :, :63]).all()
    check_against_reference(q, k, v, out, lse, grads, dout, True)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_qkvpacked(causal, poison):
    torch.manual_seed(6)
    qkv = torch.randn(2, 70, 3, 4, 40, dtype=F16, device=DEVICE, requires_grad=True)
    out = flash_attn_qkvpacked_func(qkv, causal=causal)
    dout = torch.randn_like(out)
    (dqkv,) = torch.autograd.grad(out, (qkv,), dout)
    assert dqkv.shape == qkv.shape
    q, k, v = (qkv[:, :, i].detach().clone().requires_grad_() for i in range(3))
    check_against_reference(q, k, v, out, None, dqkv.unbind(2), dout, causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_kvpacked(causal, poison):
    torch.manual_seed(7)
    q = torch.randn(2, 50, 4, 64, dtype=F16, device=DEVICE, requires_grad=True)
    kv = torch.randn(2, 90, 2, 2, 64, dtype=F16, device=DEVICE, requires_grad=True)
    out = flash_attn_kvpacked_func(q, kv, causal=causal)
    dout = torch.randn_like(out)
    dq, dkv = torch.autograd.grad(out, (q, kv), dout)
    assert dkv.shape == kv.shape
    k, v = (kv[:, :, i].detach().clone().requires_grad_() for i in range(2))
    check_against_reference(q, k, v, out, None, (dq, *dkv.unbind(2)), dout, causal)


def test_packed_matches_unpacked():
    """The packed entry points compute exactly what the plain one does (same kernels, same inputs)."""
    torch.manual_seed(8)
    qkv = torch.randn(1, 33, 3, 2, 64, dtype=F16, device=DEVICE, requires_grad=True)
    out_p = flash_attn_qkvpacked_func(qkv, causal=True)
    q, k, v = (qkv[:, :, i].detach().clone().requires_grad_() for i in range(3))
    out_u = flash_attn_func(q, k, v, causal=True)
    assert torch.equal(out_p, out_u)
    dout = torch.randn_like(out_p)
    (dqkv,) = torch.autograd.grad(out_p, (qkv,), dout)
    grads = torch.autograd.grad(out_u, (q, k, v), dout)
    for i in range(3):
        assert torch.equal(dqkv[:, :, i], grads[i])


@pytest.mark.parametrize("Hq,Hkv", [(4, 4), (8, 2)], ids=["MHA", "GQA4"])
def test_deterministic_backward(Hq, Hkv):
    torch.manual_seed(9)
    q, k, v = random_qkv(2, 129, 100, Hq, Hkv, 64, F16, DEVICE)
    out = flash_attn_func(q, k, v, causal=True)
    dout = torch.randn_like(out)
    first = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    second = torch.autograd.grad(out, (q, k, v), dout)
    for a, b in zip(first, second, strict=False):
        assert torch.equal(a, b)
    out2 = flash_attn_func(q, k, v, causal=True)
    assert torch.equal(out, out2)


def test_default_scale_is_inverse_sqrt_head_dim():
    torch.manual_seed(10)
    q, k, v = random_qkv(1, 20, 20, 2, 2, 64, F32, DEVICE, requires_grad=False)
    assert torch.equal(flash_attn_func(q, k, v), flash_attn_func(q, k, v, softmax_scale=64 ** -0.5))
    assert not torch.equal(flash_attn_func(q, k, v), flash_attn_func(q, k, v, softmax_scale=0.3))


def test_empty_key_sequence():
    """Sk = 0: every row sees no key, so out is 0 and lse is -inf; gradients are 0."""
    q = torch.randn(1, 5, 2, 16, dtype=F16, device=DEVICE, requires_grad=True)
    k = torch.randn(1, 0, 2, 16, dtype=F16, device=DEVICE, requires_grad=True)
    v = torch.randn(1, 0, 2, 16, dtype=F16, device=DEVICE, requires_grad=True)
    out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert torch.equal(dq, torch.zeros_like(dq)) and dk.shape == k.shape


def test_version_and_exports():
    assert tritonattn.__version__
    assert set(tritonattn.__all__) >= {"flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func"}


@pytest.mark.parametrize("kw", [dict(causal=True), dict(window_size=(24, 0)), dict(causal=True, varlen=True)],
                         ids=["causal", "window-right-edge", "varlen-causal"])
def test_heads_first_program_order_changes_nothing(kw, monkeypatch, poison):
    """configs.HEADS_FIRST (TRITONATTN_HEADS_FIRST=1) only reorders the programs of the forward,
    dQ and dK/dV kernels under a causal mask / right window edge: each program computes what it
    did, so outputs and gradients are bitwise those of the default order, and match the reference."""
    kw = dict(kw)
    varlen = kw.pop("varlen", False)
    torch.manual_seed(5)
    q, k, v = random_qkv(2, 97, 131, 4, 2, 32, F32, DEVICE)
    dout = torch.randn_like(q)

    def run():
        if varlen:  # two sequences of each batch row's length, packed
            cu_q = torch.tensor([0, 97, 194], dtype=torch.int32, device=DEVICE)
            cu_k = torch.tensor([0, 131, 262], dtype=torch.int32, device=DEVICE)
            out = tritonattn.flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_q, cu_k,
                                                    97, 131, **kw).view_as(q)
        else:
            out = flash_attn_func(q, k, v, **kw)
        return (out, *torch.autograd.grad(out, (q, k, v), dout))

    swapped, grids = in_both_program_orders(monkeypatch, run)
    # heads first: batch x query heads (8) or x kv heads (4) on the grid's first axis
    assert grids["_fwd_kernel"][0] == grids["_bwd_dq_kernel"][0] == 8 and grids["_bwd_dkdv_kernel"][0] == 4, grids
    if not varlen:
        check_against_reference(q, k, v, swapped[0], None, swapped[1:], dout, kw.get("causal", False),
                                window_size=kw.get("window_size", (-1, -1)))


def test_more_heads_than_a_grid_axis_holds(monkeypatch, poison):
    """CUDA grids hold at most 65535 programs on y and z: batch x heads past that go on the grid's
    x axis (forward, dQ, dK/dV, delta preprocess, split-KV decoding, probabilities / dBias tiles).
    Run here with the limit lowered to 3 (batch x heads = 8): bitwise what the usual layout gives."""
    from tritonattn import configs, flash_attn_with_kvcache
    from tritonattn.kernels import launch as launch_mod
    from tritonattn.kernels import plan

    torch.manual_seed(9)
    B, S, Hq, Hkv, D = 2, 45, 4, 2, 32
    q, k, v = random_qkv(B, S, S, Hq, Hkv, D, F32, DEVICE)
    bias = torch.randn(B, Hq, S, S, device=DEVICE, requires_grad=True)
    dout = torch.randn_like(q)
    k_cache, v_cache = (t.detach().clone() for t in (k, v))

    def run():
        out, lse, probs = flash_attn_func(q, k, v, dropout_p=0.2, return_attn_probs=True)
        res = [out, lse, probs, *torch.autograd.grad(out, (q, k, v), dout)]
        out = tritonattn.attention(q, k, v, bias=bias, causal=True)
        res += [out, *torch.autograd.grad(out, (q, k, v, bias), dout)]
        with monkeypatch.context() as m:  # the atomic path's delta preprocess; its dQ sums in program
            m.setenv("TRITONATTN_ATOMIC_DQ", "1")  # order, so only dK / dV are compared bitwise
            out = flash_attn_func(q, k, v, causal=True)
            res += torch.autograd.grad(out, (k, v), dout)
        res.append(flash_attn_with_kvcache(q[:, :1], k_cache, v_cache, cache_seqlens=40, num_splits=3))
        return res

    torch.manual_seed(1)
    base = run()
    monkeypatch.setattr(configs, "MAX_GRID_YZ", 3)
    plan.clear()
    grids = []
    real = launch_mod.launch
    monkeypatch.setattr(launch_mod, "launch", lambda fn, grid, *a: grids.append((fn.__name__, grid)) or
                        real(fn, grid, *a))
    monkeypatch.setattr(tritonattn.kernels.bwd, "launch", launch_mod.launch)  # the tile kernel's import
    torch.manual_seed(1)
    wide = run()
    for name, grid in grids:  # no grid axis past x holds more than the (lowered) limit
        assert all(n <= 3 for n in grid[1:]), (name, grid)
    assert {n for n, _ in grids} >= {"_fwd_kernel", "_bwd_dq_kernel", "_bwd_dkdv_kernel", "_bwd_preprocess_kernel",
                                     "_decode_split_kernel", "_tile_kernel"}
    for a, b in zip(base, wide):
        assert torch.equal(a, b)
