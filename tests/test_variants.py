"""Attention variants with their backward: window, softcap, ALiBi, bias (with gradient), masks,
dropout, alone and combined, against the fp64 reference."""

import pytest
import torch
from conftest import DEVICE, check_against_reference

from tritonattn import attention, flash_attn_func, flash_attn_qkvpacked_func
from tritonattn.testing import random_qkv

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
NAMES = {F16: "fp16", BF16: "bf16", F32: "fp32"}


def _grads(out, inputs):
    dout = torch.randn_like(out)
    return torch.autograd.grad(out, inputs, dout), dout


WINDOW_CASES = [
    # (Sq, Sk, window, causal, dtype)
    (65, 129, (16, 0), False, F16),
    (129, 65, (16, 0), False, F16),
    (100, 100, (8, 8), False, F32),
    (65, 129, (-1, 5), False, F16),
    (129, 65, (20, -1), False, F32),
    (127, 127, (40, -1), True, F16),
    (33, 200, (0, 0), False, F16),
    (200, 33, (3, 70), False, F16),
    (64, 64, (200, 200), False, F32),
]


@pytest.mark.parametrize("Sq,Sk,window,causal,dtype", WINDOW_CASES,
                         ids=[f"Sq{a}-Sk{b}-win{w[0]}_{w[1]}-{'causal' if c else 'full'}-{NAMES[d]}"
                              for a, b, w, c, d in WINDOW_CASES])
def test_sliding_window(Sq, Sk, window, causal, dtype, poison):
    torch.manual_seed(Sq + Sk)
    q, k, v = random_qkv(2, Sq, Sk, 4, 2, 40, dtype, DEVICE)
    out, lse, _ = flash_attn_func(q, k, v, causal=causal, window_size=window, return_attn_probs=True)
    grads, dout = _grads(out, (q, k, v))
    check_against_reference(q, k, v, out, lse, grads, dout, causal, window_size=window)


def test_window_edges_past_int32_mean_no_edge(poison):
    """Window edges as large as the API takes (2^31 - 2) leave every key in the window: the kernels
    add them to lengths in 32-bit integers, so they are capped (Variants.window_args), where they
    had wrapped round and masked every key."""
    torch.manual_seed(0)
    q, k, v = random_qkv(1, 70, 90, 2, 1, 32, torch.float16, DEVICE)
    dout = torch.randn_like(q)
    far = (2**31 - 2, 2**31 - 2)
    for causal in (False, True):
        ins = [t.clone().requires_grad_() for t in (q, k, v)]
        out = flash_attn_func(*ins, window_size=(far[0], 0 if causal else far[1]))
        grads = torch.autograd.grad(out, ins, dout)
        check_against_reference(q, k, v, out, None, grads, dout, causal)


@pytest.mark.parametrize("softcap", [5.0, 50.0])
@pytest.mark.parametrize("dtype", [F16, F32], ids=["fp16", "fp32"])
def test_softcap(softcap, dtype, poison):
    torch.manual_seed(11)
    q, k, v = random_qkv(2, 70, 90, 4, 1, 64, dtype, DEVICE)
    out, lse, _ = flash_attn_func(q * 4, k, v, causal=True, softcap=softcap, return_attn_probs=True)
    grads, dout = _grads(out, (q, k, v))
    # q * 4 makes the cap bite: scores reach ~tanh's flat part; the chain rule through q*4 is the reference's too
    check_against_reference(q * 4, k, v, out, lse, [grads[0] / 4, grads[1], grads[2]], dout, True, softcap=softcap)


@pytest.mark.parametrize("per_batch", [False, True], ids=["slopes-H", "slopes-BH"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_alibi(per_batch, causal, poison):
    torch.manual_seed(12)
    B, Hq = 2, 4
    q, k, v = random_qkv(B, 65, 97, Hq, 2, 32, F16, DEVICE)
    slopes = torch.rand(B, Hq) if per_batch else torch.rand(Hq)
    slopes = slopes.to(DEVICE)
    out, lse, _ = flash_attn_func(q, k, v, causal=causal, alibi_slopes=slopes, return_attn_probs=True)
    grads, dout = _grads(out, (q, k, v))
    check_against_reference(q, k, v, out, lse, grads, dout, causal, alibi_slopes=slopes)


BIAS_SHAPES = [(2, 4, 65, 97), (2, 1, 65, 97), (1, 4, 1, 97), (65, 97), (2, 4, 65, 1), (97,)]


@pytest.mark.parametrize("shape", BIAS_SHAPES, ids=["x".join(map(str, s)) for s in BIAS_SHAPES])
def test_bias_with_gradient(shape, poison):
    torch.manual_seed(13)
    q, k, v = random_qkv(2, 65, 97, 4, 2, 40, F16, DEVICE)
    bias = torch.randn(shape, device=DEVICE, dtype=F32).mul_(2).requires_grad_()
    out, lse = attention(q, k, v, bias=bias, causal=True, return_lse=True)
    (dq, dk, dv, dbias), dout = _grads(out, (q, k, v, bias))
    check_against_reference(q, k, v, out, lse, (dq, dk, dv), dout, True, bias=bias, dbias=dbias)


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
def test_bias_in_input_dtype_without_gradient(dtype, poison):
    torch.manual_seed(14)
    q, k, v = random_qkv(1, 50, 70, 2, 2, 64, dtype, DEVICE)
    bias = torch.randn(1, 2, 50, 70, device=DEVICE).to(dtype)
    out, lse = attention(q, k, v, bias=bias, return_lse=True)
    grads, dout = _grads(out, (q, k, v))
    check_against_reference(q, k, v, out, lse, grads, dout, False, bias=bias)


def test_boolean_mask_with_empty_rows(poison):
    torch.manual_seed(15)
    B, Sq, Sk = 2, 65, 97
    q, k, v = random_qkv(B, Sq, Sk, 4, 2, 40, F16, DEVICE)
    mask = torch.rand(B, 1, Sq, Sk, device=DEVICE) > 0.3
    mask[0, 0, :5] = False  # rows that keep no key: out 0, zero grads
    out, lse = attention(q, k, v, mask=mask, return_lse=True)
    grads, dout = _grads(out, (q, k, v))
    assert torch.equal(out[0, :5], torch.zeros_like(out[0, :5])) and torch.isneginf(lse[0, :, :5]).all()
    check_against_reference(q, k, v, out, lse, grads, dout, False, mask=mask)


@pytest.mark.parametrize("Sq", [40, 1], ids=["Sq40", "Sq1"])
@pytest.mark.parametrize("as_4d", [False, True], ids=["BxSk", "Bx1x1xSk"])
def test_key_padding_mask(as_4d, Sq, poison):
    torch.manual_seed(16)
    B, Sk = 3, 77
    q, k, v = random_qkv(B, Sq, Sk, 4, 1, 64, F16, DEVICE)
    kpm = torch.ones(B, Sk, dtype=torch.bool, device=DEVICE)
    kpm[0, 50:] = False
    kpm[1, :] = False  # a batch row with no key at all
    kwargs = dict(mask=kpm[:, None, None, :]) if as_4d else dict(key_padding_mask=kpm)
    out, lse = attention(q, k, v, causal=True, return_lse=True, **kwargs)
    grads, dout = _grads(out, (q, k, v))
    check_against_reference(q, k, v, out, lse, grads, dout, True, key_padding_mask=kpm)


def test_key_padding_takes_the_vector_path():
    from tritonattn.interface import _check_mask_and_bias, _check_options
    from tritonattn.kernels.variants import MASK_KEYS, MASK_TILE

    q, k, _ = random_qkv(2, 8, 9, 2, 2, 16, F16, DEVICE, requires_grad=False)
    var = _check_options(q, k, 0.0, None, False, (-1, -1), 0.0, None)
    _check_mask_and_bias(q, k, None, torch.ones(2, 1, 1, 9, dtype=torch.bool, device=DEVICE), None, var)
    assert var.mask_kind == MASK_KEYS and var.mask.shape == (2, 9)
    _check_mask_and_bias(q, k, None, torch.ones(1, 1, 8, 9, dtype=torch.bool, device=DEVICE), None, var)
    assert var.mask_kind == MASK_TILE and var.mask.stride()[:2] == (0, 0)
    # one query row (decoding): the unsqueezed query dim keeps a stride, and is still one row of keys
    q1 = q[:, :1]
    for m in (dict(mask=torch.ones(2, 9, dtype=torch.bool, device=DEVICE)[:, None, None, :]),
              dict(key_padding_mask=torch.ones(2, 9, dtype=torch.bool, device=DEVICE))):
        var = _check_options(q1, k, 0.0, None, False, (-1, -1), 0.0, None)
        _check_mask_and_bias(q1, k, None, m.get("mask"), m.get("key_padding_mask"), var)
        assert var.mask_kind == MASK_KEYS and var.mask.shape == (2, 9)


def _dropout_run(q, k, v, p, seed, **kwargs):
    torch.manual_seed(seed)
    out, lse, s_dmask = flash_attn_func(q, k, v, dropout_p=p, return_attn_probs=True, **kwargs)
    return out, lse, s_dmask


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [F16, F32], ids=["fp16", "fp32"])
def test_dropout_matches_reference_built_from_s_dmask(causal, dtype, poison):
    torch.manual_seed(17)
    q, k, v = random_qkv(2, 70, 90, 4, 2, 40, dtype, DEVICE)
    out, lse, s_dmask = _dropout_run(q, k, v, 0.3, seed=5, causal=causal)
    assert s_dmask.shape == (2, 4, 70, 90)
    grads, dout = _grads(out, (q, k, v))
    keep = s_dmask >= 0
    check_against_reference(q, k, v, out, lse, grads, dout, causal, dropout_p=0.3, dropout_mask=keep)
    # S_dmask's magnitudes are the attention probabilities
    Sq, Sk = 70, 90
    kr = k.detach().double().repeat_interleave(2, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.detach().double(), kr) / 40 ** 0.5
    if causal:
        visible = torch.arange(Sk, device=DEVICE)[None, :] <= torch.arange(Sq, device=DEVICE)[:, None] + Sk - Sq
        scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, -1)
    err = (s_dmask.abs().double() - probs).abs().max().item()
    assert err < (2e-3 if dtype == F16 else 1e-5), err


def test_dropout_reproducible_and_seed_dependent():
    q, k, v = random_qkv(1, 64, 64, 2, 2, 32, F16, DEVICE)
    out1, _, m1 = _dropout_run(q, k, v, 0.2, seed=1)
    out2, _, m2 = _dropout_run(q, k, v, 0.2, seed=1)
    out3, _, m3 = _dropout_run(q, k, v, 0.2, seed=2)
    assert torch.equal(out1, out2) and torch.equal(m1, m2)
    assert not torch.equal(out1, out3) and not torch.equal(m1 >= 0, m3 >= 0)
    dout = torch.randn_like(out1)
    g1 = torch.autograd.grad(out1, (q, k, v), dout)
    g2 = torch.autograd.grad(out2, (q, k, v), dout)
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)


def test_dropout_keep_rate():
    torch.manual_seed(18)
    p = 0.17
    q, k, v = random_qkv(2, 256, 256, 4, 4, 16, F16, DEVICE, requires_grad=False)
    _, _, s_dmask = flash_attn_func(q, k, v, dropout_p=p, return_attn_probs=True)
    rate = (s_dmask > 0).double().mean().item()  # every probability is > 0 here (no mask)
    assert abs(rate - (1 - p)) < 0.01, rate
    # rows are independent streams: different heads and batches do not share a pattern
    assert not torch.equal(s_dmask[0, 0] > 0, s_dmask[0, 1] > 0)
    assert not torch.equal(s_dmask[0, 0] > 0, s_dmask[1, 0] > 0)


def test_dropout_mask_is_the_documented_philox_stream():
    """The kept entries are exactly those of the documented counter scheme (recomputed in numpy),
    whatever the tiles: forward, S_dmask and the backward kernels use different block sizes."""
    from tritonattn import configs
    from tritonattn.testing import dropout_keep_reference

    q, k, v = random_qkv(2, 37, 75, 2, 1, 16, F16, DEVICE, requires_grad=False)
    torch.manual_seed(9)
    seed = int(torch.randint(0, 2**62, (1,), dtype=torch.int64, device=DEVICE))
    masks = []
    for tile in (None, configs.TileConfig(16, 16, 4, 1)):
        with configs.override(**({"tile": tile, "fwd": configs.TileConfig(16, 32, 4, 1)} if tile else {})):
            _, _, s_dmask = _dropout_run(q, k, v, 0.3, seed=9)
        masks.append(s_dmask.cpu() > 0)  # every probability is > 0 here (no mask)
    assert torch.equal(masks[0], masks[1])
    assert torch.equal(masks[0], dropout_keep_reference(seed, 2, 2, 37, 75, 0.3))


COMBOS = [
    # (B, Sq, Sk, Hq, Hkv, D, causal, window, softcap, alibi, dropout, bias_shape, dtype)
    (2, 65, 129, 4, 2, 40, True, (24, -1), 8.0, True, 0.2, (2, 1, 65, 129), F16),
    (1, 129, 65, 6, 2, 80, False, (10, 30), 30.0, True, 0.1, (1, 6, 129, 65), F32),
    (2, 33, 47, 4, 1, 96, True, (-1, -1), 0.0, False, 0.25, (47,), BF16),
    (1, 100, 100, 2, 2, 128, False, (5, 5), 4.0, True, 0.0, (1, 2, 100, 100), F16),
    # D=256 with every tile-sized extra at once: the tile configs must leave shared memory for them
    (1, 70, 90, 2, 1, 256, True, (30, -1), 10.0, True, 0.1, (1, 2, 70, 90), BF16),
]


@pytest.mark.parametrize("B,Sq,Sk,Hq,Hkv,D,causal,window,softcap,alibi,dropout,bias_shape,dtype", COMBOS,
                         ids=[f"B{c[0]}-Sq{c[1]}-Sk{c[2]}-H{c[3]}/{c[4]}-D{c[5]}-{NAMES[c[-1]]}" for c in COMBOS])
def test_combined_variants(B, Sq, Sk, Hq, Hkv, D, causal, window, softcap, alibi, dropout, bias_shape, dtype, poison):
    torch.manual_seed(Sq * Sk)
    q, k, v = random_qkv(B, Sq, Sk, Hq, Hkv, D, dtype, DEVICE)
    slopes = torch.rand(Hq, device=DEVICE) if alibi else None
    bias = torch.randn(bias_shape, device=DEVICE, dtype=F32).requires_grad_()
    kw = dict(causal=causal, window_size=window, softcap=softcap, alibi_slopes=slopes)
    keep = None
    if dropout > 0:
        torch.manual_seed(99)
        _, _, s_dmask = flash_attn_func(q, k, v, dropout_p=dropout, return_attn_probs=True, **kw)
        # the keep pattern depends only on the seed and the (batch, head, row, key) position, so the
        # same seed gives attention() below the same mask
        keep = s_dmask >= 0
    torch.manual_seed(99)
    out, lse = attention(q, k, v, bias=bias, dropout_p=dropout, return_lse=True, **kw)
    (dq, dk, dv, dbias), dout = _grads(out, (q, k, v, bias))
    check_against_reference(q, k, v, out, lse, (dq, dk, dv), dout, causal, bias=bias, dbias=dbias,
                            window_size=window, softcap=softcap, alibi_slopes=slopes, dropout_p=dropout,
                            dropout_mask=keep)


def test_qkvpacked_with_variants(poison):
    torch.manual_seed(19)
    qkv = torch.randn(2, 70, 3, 4, 40, dtype=F16, device=DEVICE, requires_grad=True)
    out = flash_attn_qkvpacked_func(qkv, causal=True, window_size=(10, 0), softcap=20.0)
    dout = torch.randn_like(out)
    (dqkv,) = torch.autograd.grad(out, (qkv,), dout)
    q, k, v = (qkv[:, :, i].detach().clone().requires_grad_() for i in range(3))
    check_against_reference(q, k, v, out, None, dqkv.unbind(2), dout, True, window_size=(10, 0), softcap=20.0)


@pytest.mark.parametrize("D,d_split,causal,varlen", [(40, 2, True, False), (96, 4, False, False), (64, 2, True, True)],
                         ids=["D40-split2-causal", "D96-split4-full", "D64-split2-varlen"])
def test_dkdv_head_dim_split(D, d_split, causal, varlen, poison, monkeypatch):
    """The dK / dV kernel with its head dim split over ``d_split`` programs per key block (each keeps
    D / d_split accumulator columns; padded columns past D included), and split by gradient (a dV
    launch and a dK launch, ``split_grads``), gives the gradients of the unsplit kernel, with GQA, a
    window, softcap, ALiBi, dropout and a bias with gradient."""
    from tritonattn import configs, flash_attn_varlen_func
    from tritonattn.configs import TileConfig as C

    torch.manual_seed(D + d_split)
    B, Sq, Sk, Hq, Hkv = 2, 45, 70, 4, 2
    q, k, v = random_qkv(B, Sq, Sk, Hq, Hkv, D, F16, DEVICE)
    kw = dict(causal=causal, window_size=(30, -1), softcap=15.0, alibi_slopes=torch.rand(Hq, device=DEVICE))
    from tritonattn.kernels import launch

    splits_run, real_launch = [], launch.launch

    def spy(fn, grid, args, kwargs):
        if "D_SPLIT" in kwargs:
            splits_run.append((kwargs["D_SPLIT"], kwargs["GRADS"]))
        return real_launch(fn, grid, args, kwargs)

    monkeypatch.setattr(launch, "launch", spy)  # every launcher reaches Triton through it
    grads = []
    for cfg in (C(16, 32, 4, 1), C(16, 32, 4, 1, d_split), C(16, 32, 4, 1, 1, True)):
        with configs.override(bwd_dkdv=cfg):
            torch.manual_seed(5)
            if varlen:
                cu_q = torch.tensor([0, 20, 45], dtype=torch.int32, device=DEVICE)
                cu_k = torch.tensor([0, 33, 70], dtype=torch.int32, device=DEVICE)
                qv, kv_, vv = (t.detach().reshape(-1, *t.shape[2:])[:n].clone().requires_grad_()
                               for t, n in ((q, 45), (k, 70), (v, 70)))
                out = flash_attn_varlen_func(qv, kv_, vv, cu_q, cu_k, 25, 37, dropout_p=0.1, **kw)
                wrt = (qv, kv_, vv)
            else:
                bias = torch.randn(1, Hq, Sq, Sk, device=DEVICE).requires_grad_()
                out = attention(q, k, v, bias=bias, dropout_p=0.1, **kw)
                wrt = (q, k, v, bias)
            torch.manual_seed(6)
            grads.append(_grads(out, wrt)[0])
    assert splits_run == [(1, 3), (d_split, 3), (1, 1), (1, 2)], splits_run
    for other in grads[1:]:
        for name, a, b in zip(("dq", "dk", "dv", "dbias"), grads[0], other):
            assert not torch.isnan(b).any(), name
            torch.testing.assert_close(b.float(), a.float(), rtol=2e-3, atol=2e-3, msg=name)
