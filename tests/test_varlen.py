"""Variable-length batches: every sequence gives exactly what the dense call gives on it alone."""

import pytest
import torch
from conftest import DEVICE, check_against_reference

from tritonattn import (
    attention,
    attention_varlen,
    flash_attn_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)

F16, F32 = torch.float16, torch.float32


def _cu(lens):
    return torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=DEVICE)


def _ragged(lens_q, lens_k, Hq, Hkv, D, dtype):
    q = torch.randn(sum(lens_q), Hq, D, device=DEVICE).to(dtype).requires_grad_()
    k = torch.randn(sum(lens_k), Hkv, D, device=DEVICE).to(dtype).requires_grad_()
    v = torch.randn(sum(lens_k), Hkv, D, device=DEVICE).to(dtype).requires_grad_()
    return q, k, v


def _sequence(q, k, v, kw, b, q0, q1, k0, k1):
    """Sequence b of a packed batch as a dense batch of one (fresh leaves), with its kwargs."""
    qb, kb, vb = (t.detach()[a:z][None].clone().requires_grad_() for t, a, z in ((q, q0, q1), (k, k0, k1),
                                                                                  (v, k0, k1)))
    kwb = dict(kw)
    if "alibi_slopes" in kwb:
        kwb["alibi_slopes"] = kw["alibi_slopes"][b:b + 1]
    return qb, kb, vb, kwb


def _assert_keyless(out, lse, dq, q0, q1):
    """A sequence with no key: out 0, lse -inf, zero dq."""
    assert torch.equal(out[q0:q1], torch.zeros_like(out[q0:q1])) and torch.isneginf(lse[:, q0:q1]).all()
    assert torch.equal(dq[q0:q1], torch.zeros_like(dq[q0:q1]))


CASES = [
    # (lens_q, lens_k, Hq, Hkv, D, kwargs)
    ([17, 1, 65, 0, 40], [30, 1, 65, 12, 40], 4, 2, 40, dict(causal=True)),
    ([65, 33], [17, 129], 4, 1, 64, dict()),
    ([1, 1, 1], [100, 7, 64], 8, 2, 64, dict(causal=True)),
    ([50, 0, 77], [50, 5, 77], 2, 2, 80, dict(window_size=(16, 0))),
    ([40, 90], [90, 40], 4, 2, 32, dict(causal=True, softcap=10.0, alibi=True)),
    ([35, 10, 50, 38], [35, 10, 50, 20], 4, 2, 32, dict()),  # length_tiles: the wide tile's row counts
]


SHORT = 40  # length_tiles: calls of at most this many tokens take other tiles


@pytest.fixture(params=[False, True], ids=["one-tile", "length-tiles"])
def length_tiles(request, monkeypatch):
    """True: tiles picked by a call's length here too, as the GPU's short tiles are (the
    interpreter's table has one tile per kernel): causal calls of at most SHORT tokens take 16 x 16
    tiles in the forward, dQ and dK/dV kernels, and plain forwards of at most SHORT tokens with at
    least 128 rows x heads a 32 x 16 tile (the wide tile's rule, WIDE_PROGRAMS = 1: dense calls of
    two or more sequences only, so neither a packed call nor a one-sequence call takes it). Launch
    plans are cleared around the test (their keys do not hold the tables)."""
    from tritonattn import configs
    from tritonattn.kernels import plan

    if request.param:
        dims = (16, 32, 64, 128, 256)
        small = configs.C(16, 16, 4, 1)
        monkeypatch.setattr(configs, "SHORT_SEQLEN", SHORT)
        monkeypatch.setattr(configs, "WIDE_PROGRAMS", 1)
        monkeypatch.setattr(configs, "_short", lambda mode, q, seqlen: 0 < seqlen <= SHORT and mode not in
                            configs._override)
        monkeypatch.setattr(configs, "_SHORT_CAUSAL", {m: dict.fromkeys(dims, small)
                                                       for m in ("fwd", "bwd_dkdv", "bwd_dq")})
        monkeypatch.setattr(configs, "_SHORT_WIDE_FWD", dict.fromkeys(dims, configs.C(32, 16, 4, 1)))
    plan.clear()
    yield request.param
    plan.clear()


@pytest.mark.parametrize("lens_q,lens_k,Hq,Hkv,D,kw", CASES,
                         ids=[f"q{'_'.join(map(str, c[0]))}-k{'_'.join(map(str, c[1]))}-H{c[2]}/{c[3]}-D{c[4]}"
                              for c in CASES])
def test_varlen_equals_dense_per_sequence(lens_q, lens_k, Hq, Hkv, D, kw, poison, length_tiles, monkeypatch):
    """Each sequence of a packed call gets bitwise the out, lse and gradients of its own dense call;
    with length_tiles also where the sequences' lengths pick different tiles: the packed call then
    launches each kernel once per length class (launch.length_classes)."""
    from tritonattn.kernels import launch

    torch.manual_seed(sum(lens_q) + D)
    kw = dict(kw)
    if kw.pop("alibi", False):
        kw["alibi_slopes"] = torch.rand(len(lens_q), Hq, device=DEVICE)
    q, k, v = _ragged(lens_q, lens_k, Hq, Hkv, D, F16)
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    names, real = [], launch.launch
    monkeypatch.setattr(launch, "launch", lambda fn, *a: names.append(fn.__name__) or real(fn, *a))
    out, lse, s_dmask = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                               return_attn_probs=True, **kw)
    longest = [max(a, b) for a, b in zip(lens_q, lens_k)]
    if length_tiles and kw.get("causal") and min(longest) <= SHORT < max(longest):
        assert names.count("_fwd_kernel") == 2, names  # the short sequences' class, and the others'
    elif not kw:  # no length rule for plain packed calls here (the wide tile: dense only)
        assert names.count("_fwd_kernel") == 1, names
    assert s_dmask is None and lse.shape == (Hq, sum(lens_q)) and out.shape == q.shape
    dout = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    for b, ((q0, q1), (k0, k1)) in enumerate(zip(zip(cu_q[:-1].tolist(), cu_q[1:].tolist()),
                                                  zip(cu_k[:-1].tolist(), cu_k[1:].tolist()))):
        if q1 == q0:
            continue
        qb, kb, vb, kwb = _sequence(q, k, v, kw, b, q0, q1, k0, k1)
        if k1 == k0:
            _assert_keyless(out, lse, dq, q0, q1)
            continue
        ob, lseb, _ = flash_attn_func(qb, kb, vb, return_attn_probs=True, **kwb)
        gq, gk, gv = torch.autograd.grad(ob, (qb, kb, vb), dout[q0:q1][None])
        # same kernels, same tiles, same arithmetic: bitwise equal
        assert torch.equal(out[q0:q1], ob[0]), f"sequence {b}: out"
        assert torch.equal(lse[:, q0:q1], lseb[0]), f"sequence {b}: lse"
        assert torch.equal(dq[q0:q1], gq[0]) and torch.equal(dk[k0:k1], gk[0]) and torch.equal(dv[k0:k1], gv[0])
    # and against the fp64 reference, sequence 0
    q0, q1, k0, k1 = 0, lens_q[0], 0, lens_k[0]
    kwr = {key: val for key, val in kw.items() if key != "causal"}
    if "alibi_slopes" in kwr:
        kwr["alibi_slopes"] = kw["alibi_slopes"][:1]
    check_against_reference(q[q0:q1][None], k[k0:k1][None], v[k0:k1][None], out[q0:q1][None], lse[:, q0:q1][None],
                            (dq[q0:q1][None], dk[k0:k1][None], dv[k0:k1][None]), dout[q0:q1][None],
                            kw.get("causal", False), **kwr)


def test_varlen_dropout_matches_reference(poison):
    torch.manual_seed(3)
    lens = [33, 1, 70]
    q, k, v = _ragged(lens, lens, 4, 2, 40, F32)
    cu = _cu(lens)
    torch.manual_seed(11)
    out, lse, s_dmask = flash_attn_varlen_func(q, k, v, cu, cu, 70, 70, dropout_p=0.2, causal=True,
                                               return_attn_probs=True)
    assert s_dmask.shape == (3, 4, 70, 70)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    for b, (a, z) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        n = z - a
        keep = (s_dmask[b:b + 1, :, :n, :n] >= 0)
        check_against_reference(q[a:z][None], k[a:z][None], v[a:z][None], out[a:z][None], lse[:, a:z][None],
                                tuple(g[a:z][None] for g in grads), dout[a:z][None], True, dropout_p=0.2,
                                dropout_mask=keep)
    # the padding of S_dmask past each sequence is zero
    assert torch.equal(s_dmask[1, :, 1:], torch.zeros_like(s_dmask[1, :, 1:]))


def test_varlen_packed(poison):
    torch.manual_seed(4)
    lens = [20, 45]
    cu = _cu(lens)
    qkv = torch.randn(65, 3, 2, 64, device=DEVICE, dtype=F16, requires_grad=True)
    out = flash_attn_varlen_qkvpacked_func(qkv, cu, 45, causal=True)
    q, k, v = (qkv[:, i].detach().clone().requires_grad_() for i in range(3))
    ref = flash_attn_varlen_func(q, k, v, cu, cu, 45, 45, causal=True)
    assert torch.equal(out, ref)
    dout = torch.randn_like(out)
    (dqkv,) = torch.autograd.grad(out, (qkv,), dout)
    grads = torch.autograd.grad(ref, (q, k, v), dout)
    for i in range(3):
        assert torch.equal(dqkv[:, i], grads[i])
    kv = torch.stack([k.detach(), v.detach()], 1).requires_grad_()
    out_kv = flash_attn_varlen_kvpacked_func(q, kv, cu, cu, 45, 45, causal=True)
    assert torch.equal(out_kv, ref)
    _, dkv = torch.autograd.grad(out_kv, (q, kv), dout)
    assert torch.equal(dkv[:, 0], grads[1]) and torch.equal(dkv[:, 1], grads[2])


def test_max_seqlen_one():
    lens = [1, 1, 1, 1]
    q, k, v = _ragged(lens, lens, 2, 1, 16, F16)
    cu = _cu(lens)
    out = flash_attn_varlen_func(q, k, v, cu, cu, 1, 1, causal=True)
    # one key per sequence: out is v (expanded over the GQA group)
    assert torch.equal(out, v.detach().repeat_interleave(2, dim=1))


@pytest.mark.parametrize("change,error,what", [
    (lambda cu: cu.long(), TypeError, "cu_seqlens_q must be int32"),
    (lambda cu: cu[:-1], ValueError, "describe"),
    (lambda cu: cu.flip(0), ValueError, "must start at 0 and never decrease"),
    (lambda cu: cu * 2, ValueError, r"cu_seqlens_q\[-1\] = .* but the packed tensor holds"),
    (lambda cu: cu[None], ValueError, r"must have shape \(batch \+ 1,\)"),
])
def test_bad_cu_seqlens(change, error, what, monkeypatch):
    monkeypatch.setenv("TRITONATTN_DEBUG", "1")  # the content checks that need a device sync
    q, k, v = _ragged([3, 5], [3, 5], 2, 2, 16, F16)
    cu = _cu([3, 5])
    with pytest.raises(error, match=what):
        flash_attn_varlen_func(q, k, v, change(cu), cu, 5, 5)


def test_bad_max_seqlen(monkeypatch):
    monkeypatch.setenv("TRITONATTN_DEBUG", "1")
    q, k, v = _ragged([3, 5], [3, 5], 2, 2, 16, F16)
    cu = _cu([3, 5])
    with pytest.raises(ValueError, match="longer than max_seqlen_q = 4"):
        flash_attn_varlen_func(q, k, v, cu, cu, 4, 5)
    with pytest.raises(ValueError, match="max_seqlen_k must be an int >= 0"):
        flash_attn_varlen_func(q, k, v, cu, cu, 5, -1)


# ---------------------------------------------------------------------------------------------
# Paged K/V (block_table): forward only; bitwise what the contiguous packed call gives


def _to_pages(k, v, lens_k, page_size, packed, gen):
    """Copy the packed keys / values of each sequence into pages of a cache, in a random page order;
    rows and pages no sequence uses hold NaN, block-table entries past a sequence's pages hold -1.
    ``packed``: k / v are views of one (num_blocks, page_size, 2, Hkv, D) cache (non-contiguous)."""
    Hkv, D = k.shape[1], k.shape[2]
    n_pages = [-(-n // page_size) for n in lens_k]
    num_blocks = sum(n_pages) + 3
    cache = torch.full((num_blocks, page_size, 2, Hkv, D), float("nan"), dtype=k.dtype, device=DEVICE)
    kc, vc = (cache[:, :, 0], cache[:, :, 1]) if packed else (cache[:, :, 0].clone(), cache[:, :, 1].clone())
    order = torch.randperm(num_blocks, generator=gen).tolist()
    table = torch.full((len(lens_k), max(n_pages) + 1), -1, dtype=torch.int32)
    start = 0
    for b, n in enumerate(lens_k):
        for j in range(n_pages[b]):
            page = order.pop()
            table[b, j] = page
            rows = min(page_size, n - j * page_size)
            kc[page, :rows] = k[start + j * page_size:start + j * page_size + rows]
            vc[page, :rows] = v[start + j * page_size:start + j * page_size + rows]
        start += n
    return kc, vc, table.to(DEVICE)


PAGED_CASES = [
    # (lens_q, lens_k, Hq, Hkv, D, dtype, kwargs)
    ([17, 1, 3, 40, 0, 1], [30, 1, 0, 40, 9, 50], 4, 2, 40, F16, dict(causal=True)),
    ([1, 1, 1, 1], [100, 7, 0, 16], 8, 1, 64, F16, dict(causal=True)),
    ([50, 0, 77], [50, 5, 77], 4, 2, 32, F16, dict(window_size=(16, 0))),
    ([20, 33], [33, 20], 2, 2, 16, F32, dict(window_size=(5, 3), softcap=10.0, alibi=True)),
]


@pytest.mark.parametrize("page_size", [16, 3], ids=["page16", "page3"])
@pytest.mark.parametrize("lens_q,lens_k,Hq,Hkv,D,dtype,kw", PAGED_CASES,
                         ids=[f"q{'_'.join(map(str, c[0]))}-k{'_'.join(map(str, c[1]))}-H{c[2]}/{c[3]}-D{c[4]}-"
                              f"{'fp16' if c[5] == F16 else 'fp32'}" for c in PAGED_CASES])
def test_paged_varlen_equals_contiguous(lens_q, lens_k, Hq, Hkv, D, dtype, kw, page_size, poison):
    torch.manual_seed(sum(lens_k) + page_size)
    gen = torch.Generator().manual_seed(page_size)
    kw = dict(kw)
    if kw.pop("alibi", False):
        kw["alibi_slopes"] = torch.rand(len(lens_q), Hq, device=DEVICE)
    q, k, v = (t.detach() for t in _ragged(lens_q, lens_k, Hq, Hkv, D, dtype))
    kc, vc, table = _to_pages(k, v, lens_k, page_size, packed=page_size == 3, gen=gen)
    args = (_cu(lens_q), _cu(lens_k), max(lens_q), max(lens_k))
    out, lse, _ = flash_attn_varlen_func(q, k, v, *args, return_attn_probs=True, **kw)
    out_p, lse_p, _ = flash_attn_varlen_func(q, kc, vc, *args, return_attn_probs=True, block_table=table, **kw)
    # same kernel, same tiles: only the addressing of the keys differs
    assert torch.equal(out_p, out) and torch.equal(lse_p, lse)


def test_paged_varlen_errors(monkeypatch):
    monkeypatch.setenv("TRITONATTN_DEBUG", "1")  # the page-index checks need a device sync on CUDA
    lens = [3, 5]
    q, k, v = (t.detach() for t in _ragged(lens, lens, 2, 2, 16, F16))
    cu = _cu(lens)
    kc, vc, table = _to_pages(k, v, lens, 4, packed=False, gen=torch.Generator().manual_seed(0))

    def call(q=q, kc=kc, vc=vc, table=table, **kw):
        return flash_attn_varlen_func(q, kc, vc, cu, cu, 5, 5, block_table=table, **kw)

    qg = q.clone().requires_grad_()
    with pytest.raises(NotImplementedError, match=r"block_table \(paged KV\) is forward only"):
        call(q=qg)
    with torch.no_grad():
        assert torch.equal(call(q=qg), flash_attn_varlen_func(q, k, v, cu, cu, 5, 5))
    with pytest.raises(TypeError, match="block_table must be int32"):
        call(table=table.long())
    with pytest.raises(ValueError, match=r"block_table must have shape \(batch, max_blocks\) = \(2, max_blocks\)"):
        call(table=table[:1])
    with pytest.raises(ValueError, match=r"block_table must have shape"):
        call(table=table[0])
    for bad in (kc.shape[0], -1):
        t = table.clone()
        t[1, 1] = bad  # the second page of the 5-key sequence
        what = rf"block_table\[1, 1\] = {bad} is not a page of k \(num_blocks = {kc.shape[0]}\)"
        with pytest.raises(ValueError, match=what):
            call(table=t)
    with pytest.raises(ValueError, match="a block_table row holds 1 pages of 4 = 4 keys"):
        call(table=table[:, :1])
    with pytest.raises(ValueError, match="with block_table, k must be a paged cache"):
        call(kc=k)
    with pytest.raises(ValueError, match="k and v must have the same shape"):
        call(vc=vc[:-1])
    with pytest.raises(ValueError, match="holds no page"):
        call(kc=kc[:0], vc=vc[:0])
    with pytest.raises(NotImplementedError, match="S_dmask"):
        call(dropout_p=0.1, return_attn_probs=True)


# ---------------------------------------------------------------------------------------------
# attention_varlen: bias (with gradient) and boolean masks laid out per sequence

LENS_Q, LENS_K = [17, 1, 0, 40, 6], [30, 1, 9, 40, 0]
BIAS_CASES = [
    # (what, shape, dtype, kwargs); "B1" = (B, 1, Mq, Mk), "1H" = (1, H, Mq, Mk), "BH1K" = (B, H, 1, Mk)
    ("bias", "B1", F32, dict(causal=True)),
    ("bias", "B1", F16, dict(window_size=(12, 4))),
    ("bias", "1H", F32, dict()),
    ("bias", "1H", F16, dict(causal=True)),
    ("bias", "BH", F16, dict(causal=True, softcap=20.0, alibi=True)),
    ("bias", "BH1K", F32, dict()),
    ("mask", "B1", F16, dict(causal=True)),
    ("key_padding_mask", "BK", F32, dict(window_size=(20, -1))),
]


@pytest.mark.parametrize("what,shape,dtype,kw", BIAS_CASES,
                         ids=[f"{c[0]}-{c[1]}-{'fp16' if c[2] == F16 else 'fp32'}-{'_'.join(c[3]) or 'full'}"
                              for c in BIAS_CASES])
def test_varlen_bias_and_masks_equal_dense_per_sequence(what, shape, dtype, kw, poison):
    torch.manual_seed(len(shape) + len(kw) + (dtype == F16))
    B, Hq, Hkv, D, Mq, Mk = len(LENS_Q), 4, 2, 40, max(LENS_Q), max(LENS_K)
    kw = dict(kw)
    if kw.pop("alibi", False):
        kw["alibi_slopes"] = torch.rand(B, Hq, device=DEVICE)
    q, k, v = _ragged(LENS_Q, LENS_K, Hq, Hkv, D, dtype)
    cu_q, cu_k = _cu(LENS_Q), _cu(LENS_K)
    extra = {}
    if what == "bias":
        sizes = {"B1": (B, 1, Mq, Mk), "1H": (1, Hq, Mq, Mk), "BH": (B, Hq, Mq, Mk), "BH1K": (B, Hq, 1, Mk)}[shape]
        # a bias broadcast over the batch sums its gradient over sequences: fp32, so the sum can be redone exactly
        bias_dtype = F32 if shape == "1H" else dtype
        extra["bias"] = torch.randn(sizes, device=DEVICE).mul_(2).to(bias_dtype).requires_grad_()
    elif what == "mask":
        mask = torch.rand(B, 1, Mq, Mk, device=DEVICE) > 0.3
        mask[0, 0, :3] = False  # rows that keep no key
        extra["mask"] = mask
    else:
        kpm = torch.rand(B, Mk, device=DEVICE) > 0.2
        kpm[3] = False  # a sequence with no key left
        extra["key_padding_mask"] = kpm
    out, lse = attention_varlen(q, k, v, cu_q, cu_k, Mq, Mk, return_lse=True, **extra, **kw)
    assert out.shape == q.shape and lse.shape == (Hq, sum(LENS_Q))
    dout = torch.randn_like(out)
    wrt = (q, k, v, extra["bias"]) if what == "bias" else (q, k, v)
    dq, dk, dv, *dbias = torch.autograd.grad(out, wrt, dout)
    dbias = dbias[0] if dbias else None
    if dbias is not None:
        assert dbias.shape == extra["bias"].shape and dbias.dtype == extra["bias"].dtype
    summed = torch.zeros(1, Hq, Mq, Mk, dtype=F32, device=DEVICE)  # the "1H" bias gradient, redone
    for b in range(B):
        q0, q1, k0, k1 = cu_q[b].item(), cu_q[b + 1].item(), cu_k[b].item(), cu_k[b + 1].item()
        lq, lk = q1 - q0, k1 - k0
        if lq == 0:  # no query: the sequence's keys get no gradient
            assert torch.equal(dk[k0:k1], torch.zeros_like(dk[k0:k1]))
            assert torch.equal(dv[k0:k1], torch.zeros_like(dv[k0:k1]))
            continue
        if lk == 0:
            _assert_keyless(out, lse, dq, q0, q1)
            continue
        qb, kb, vb, kwb = _sequence(q, k, v, kw, b, q0, q1, k0, k1)
        extra_b, wrt_b = {}, (qb, kb, vb)
        for name, t in extra.items():
            sel = t[b:b + 1] if t.shape[0] > 1 else t[:1]
            sel = sel[..., :lk] if name == "key_padding_mask" else sel[:, :, :lq, :lk]
            extra_b[name] = sel.detach().clone().requires_grad_(t.requires_grad)
            if t.requires_grad:
                wrt_b = (*wrt_b, extra_b[name])
        ob, lseb = attention(qb, kb, vb, return_lse=True, **extra_b, **kwb)
        gq, gk, gv, *gb = torch.autograd.grad(ob, wrt_b, dout[q0:q1][None])
        assert torch.equal(out[q0:q1], ob[0]), f"sequence {b}: out"
        assert torch.equal(lse[:, q0:q1], lseb[0]), f"sequence {b}: lse"
        assert torch.equal(dq[q0:q1], gq[0]), f"sequence {b}: dq"
        assert torch.equal(dk[k0:k1], gk[0]) and torch.equal(dv[k0:k1], gv[0]), f"sequence {b}: dk / dv"
        mine = None
        if shape == "1H":
            summed[:, :, :lq, :lk] += gb[0]
        elif dbias is not None:
            mine = dbias[b:b + 1, :, :lq, :lk]
            if shape == "BH1K":  # torch sums the broadcast query dim: over Mq (zeros past lq) here, lq there
                torch.testing.assert_close(mine, gb[0], rtol=1e-5, atol=1e-6)
            else:
                assert torch.equal(mine, gb[0]), f"sequence {b}: dbias"
                assert not dbias[b, :, lq:].any(), f"sequence {b}: dbias past the queries"
            assert not dbias[b, :, :, lk:].any(), f"sequence {b}: dbias past the keys"
        if b == 3:  # the longest sequence, against the fp64 reference too
            check_against_reference(qb, kb, vb, ob, lseb, (gq, gk, gv), dout[q0:q1][None], kw.get("causal", False),
                                    dbias=mine, **extra_b, **{n: x for n, x in kwb.items() if n != "causal"})
    if shape == "1H":  # the same fp32 sum over sequences; the GPU kernel may round the order differently
        torch.testing.assert_close(dbias, summed, rtol=1e-5, atol=1e-6)
    elif dbias is not None:  # sequences without a query or a key contribute nothing
        assert not dbias[2].any() and not dbias[4].any()


def test_varlen_bias_errors():
    lens = [3, 5]
    q, k, v = _ragged(lens, lens, 2, 2, 16, F16)
    cu = _cu(lens)
    with pytest.raises(ValueError, match=r"does not broadcast to \(batch, nheads, max_seqlen_q, max_seqlen_k\)"):
        attention_varlen(q, k, v, cu, cu, 5, 5, bias=torch.zeros(2, 2, 6, 5, device=DEVICE))
    with pytest.raises(ValueError, match=r"key_padding_mask must have shape \(batch, max_seqlen_k\) = \(2, 5\)"):
        attention_varlen(q, k, v, cu, cu, 5, 5, key_padding_mask=torch.ones(2, 8, dtype=torch.bool, device=DEVICE))
    with pytest.raises(TypeError, match="mask must be a bool tensor"):
        attention_varlen(q, k, v, cu, cu, 5, 5, mask=torch.ones(2, 1, 5, 5, device=DEVICE))
