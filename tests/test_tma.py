"""The forward's tensor-descriptor path (kernels.fwd.TMA: K / V tiles through TMA descriptors, rows
past a sequence's end read as zeros) and its warp-specialized loop (kernels.fwd.WS) give what the
pointer path gives, for dense, variable-length and kv-cache calls with ragged lengths; and the
launcher takes that path only where the layout allows it."""

import pytest
import torch
from conftest import DEVICE

import tritonattn
from tritonattn.kernels import fwd, plan
from tritonattn.kernels.variants import Variants


def _randn(gen, *shape, dtype):
    return torch.randn(*shape, generator=gen).to(device=DEVICE, dtype=dtype)


def _dense(gen, dtype, **kw):
    q, k, v = _randn(gen, 2, 45, 4, 64, dtype=dtype), _randn(gen, 2, 77, 2, 64, dtype=dtype), \
        _randn(gen, 2, 77, 2, 64, dtype=dtype)
    if kw.pop("alibi", False):
        kw["alibi_slopes"] = torch.rand(4, generator=gen).to(DEVICE)
    return lambda: tritonattn.flash_attn_func(q, k, v, return_attn_probs=True, **kw)[:2], (q, k, v)


def _bias(gen, dtype):
    q, k, v = _randn(gen, 1, 33, 2, 32, dtype=dtype), _randn(gen, 1, 70, 2, 32, dtype=dtype), \
        _randn(gen, 1, 70, 2, 32, dtype=dtype)
    bias = _randn(gen, 1, 2, 33, 70, dtype=dtype)
    return lambda: tritonattn.attention(q, k, v, bias=bias, causal=True), (q, k, v)


def _varlen(gen, dtype, D=32, empty_keys=False):
    """Sequence 2 has no query (or, with ``empty_keys``, 7 queries and no key: a descriptor over 0 rows)."""
    cu_q = torch.tensor([0, 5, 12 if empty_keys else 5, 40], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 19, 19 if empty_keys else 22, 91], dtype=torch.int32, device=DEVICE)
    q, k, v = _randn(gen, 40, 4, D, dtype=dtype), _randn(gen, 91, 2, D, dtype=dtype), \
        _randn(gen, 91, 2, D, dtype=dtype)
    return lambda: tritonattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 35, 72, causal=True,
                                                     return_attn_probs=True)[:2], (q, k, v)


def _kvcache(gen, dtype):
    q = _randn(gen, 3, 17, 8, 64, dtype=dtype)  # 68 query rows per kv head: the forward kernel
    kc, vc = _randn(gen, 3, 96, 2, 64, dtype=dtype), _randn(gen, 3, 96, 2, 64, dtype=dtype)
    lens = torch.tensor([4, 50, 91], dtype=torch.int32, device=DEVICE)
    leftpad = torch.tensor([0, 7, 30], dtype=torch.int32, device=DEVICE)
    return lambda: tritonattn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, cache_leftpad=leftpad,
                                                      causal=True, num_splits=1, return_softmax_lse=True), (q, kc, vc)


CASES = {
    "dense-causal-gqa": lambda gen, dt: _dense(gen, dt, causal=True),
    "dense-full": lambda gen, dt: _dense(gen, dt),
    "window-softcap-alibi": lambda gen, dt: _dense(gen, dt, window_size=(20, 5), softcap=15.0, alibi=True),
    "dropout": lambda gen, dt: _dense(gen, dt, dropout_p=0.25, causal=True),
    "bias": _bias,
    "varlen": _varlen,
    "varlen-empty-keys-D128": lambda gen, dt: _varlen(gen, dt, D=128, empty_keys=True),
    "kvcache-leftpad": _kvcache,
}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("ws", [False, True], ids=["tma", "tma+ws"])
def test_descriptor_path_equals_pointer_path(monkeypatch, case, dtype, ws):
    call, (q, k, v) = CASES[case](torch.Generator().manual_seed(0), dtype)
    assert fwd._tma_ok(q, k, v, Variants(softmax_scale=1.0))
    results = []
    for tma in (False, True):
        monkeypatch.setattr(fwd, "TMA", tma)
        monkeypatch.setattr(fwd, "WS", ws and tma)
        plan.clear()
        torch.manual_seed(0)  # dropout's seed
        results.append(call())
    # the same values loaded either way: equal up to the order the compiler gives the arithmetic
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=2e-3 if a.dtype == torch.float32 else 4e-3, rtol=0)


def test_descriptor_path_only_where_the_layout_allows():
    var = Variants(softmax_scale=1.0)
    q = torch.zeros(1, 8, 2, 64, dtype=torch.float16, device=DEVICE)
    kv = torch.zeros(1, 8, 2, 64, dtype=torch.float16, device=DEVICE)
    assert fwd._tma_ok(q, kv, kv, var)
    assert not fwd._tma_ok(q.float(), kv.float(), kv.float(), var)  # fp32: the pointer path
    odd = torch.zeros(1, 8, 2, 80, dtype=torch.float16, device=DEVICE)
    assert not fwd._tma_ok(odd, odd, odd, var)  # padded head dim
    wide = torch.zeros(1, 8, 2, 128, dtype=torch.float16, device=DEVICE)[..., ::2]
    assert not fwd._tma_ok(q, wide, wide, var)  # dim stride 2
    unaligned = torch.zeros(1 * 8 * 2 * 64 + 1, dtype=torch.float16, device=DEVICE)[1:].view(1, 8, 2, 64)
    assert not fwd._tma_ok(q, unaligned, kv, var)  # base not 16-byte aligned
    rows = torch.zeros(1, 8, 2 * 64 + 4, dtype=torch.float16, device=DEVICE)[..., :128].view(1, 8, 2, 64)
    assert not fwd._tma_ok(q, rows, rows, var)  # row stride 132 elements: not a multiple of 16 bytes
    broadcast = torch.zeros(1, 1, 2, 64, dtype=torch.float16, device=DEVICE).expand(1, 8, 2, 64)
    assert not fwd._tma_ok(q, broadcast, broadcast, var)  # row stride 0
    paged = Variants(softmax_scale=1.0)
    paged.block_table = torch.zeros(1, 1, dtype=torch.int32, device=DEVICE)
    assert not fwd._tma_ok(q, kv, kv, paged)


BWD_CASES = ["dense-causal-gqa", "window-softcap-alibi", "dropout", "varlen", "varlen-empty-keys-D128", "dense-full"]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", BWD_CASES)
def test_backward_descriptor_path_equals_pointer_path(monkeypatch, case, dtype):
    """The backward with Q / dO (dK/dV kernel) and K / V (dQ kernel) read through tensor descriptors
    (kernels.bwd.TMA) gives the pointer path's gradients. "dense-full" runs with the dK/dV kernel
    split by gradient and the head dim split in two (each split reads Q / dO the same way)."""
    from tritonattn import configs
    from tritonattn.configs import TileConfig as C
    from tritonattn.kernels import bwd, launch

    call, ins = CASES[case](torch.Generator().manual_seed(1), dtype)
    for t in ins:
        t.requires_grad_()
    taken, real = [], launch.launch

    def spy(fn, grid, args, kwargs):
        if fn in (bwd._bwd_dq_kernel, bwd._bwd_dkdv_kernel):
            taken.append(kwargs["TMA"])
        return real(fn, grid, args, kwargs)

    monkeypatch.setattr(launch, "launch", spy)
    cfgs = [None, C(16, 32, 4, 1, 1, True), C(16, 32, 4, 1, 2)] if case == "dense-full" else [None]
    for cfg in cfgs:
        results = []
        for tma in (False, True):
            monkeypatch.setattr(bwd, "TMA", tma)
            plan.clear()
            torch.manual_seed(0)  # dropout's seed
            with configs.override(**({"bwd_dkdv": cfg} if cfg else {})):
                out, _ = call()
                dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(out)
                results.append(torch.autograd.grad(out, ins, dout))
        for name, a, b in zip(("dq", "dk", "dv"), *results):
            assert not torch.isnan(b).any(), name
            torch.testing.assert_close(a, b, atol=5e-3, rtol=0, msg=f"{name} {cfg}")
    assert True in taken and False in taken  # both paths ran


def test_backward_takes_the_descriptor_path_when_switched_on(monkeypatch):
    """With the switch on and a layout that allows it, both backward kernels get TMA=True; a dO
    with an odd head stride, or one that is not 16-byte aligned (same shape and strides as an
    earlier call's: the launch plan must not replay that call's descriptors), takes the pointer path."""
    from tritonattn.kernels import bwd, launch

    seen = []
    real = launch.launch

    def spy(fn, grid, args, kwargs):
        if fn in (bwd._bwd_dq_kernel, bwd._bwd_dkdv_kernel):
            seen.append(kwargs["TMA"])
        return real(fn, grid, args, kwargs)

    monkeypatch.setattr(launch, "launch", spy)
    monkeypatch.setattr(bwd, "TMA", True)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (_randn(gen, 1, 20, 2, 32, dtype=torch.float16).requires_grad_() for _ in range(3))
    for make_do, expect in ((lambda o: torch.ones_like(o), True),
                            (lambda o: torch.ones(1, 20, 2, 36, dtype=o.dtype, device=o.device)[..., :32], False),
                            # the first layout again (a replayed plan), then the same shape and strides
                            # at a base 2 bytes off 16-byte alignment: a new plan, the pointer path
                            (lambda o: torch.ones_like(o), True),
                            (lambda o: torch.ones(o.numel() + 1, dtype=o.dtype, device=o.device)[1:].view(o.shape),
                             False)):
        seen.clear()
        out = tritonattn.flash_attn_func(q, k, v, causal=True)
        torch.autograd.grad(out, (q, k, v), make_do(out))
        assert seen == [expect, expect], (seen, expect)
