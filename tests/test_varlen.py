"""Variable-length batches: every sequence gives exactly what the dense call gives on it alone."""

import pytest
import torch
from conftest import DEVICE, check_against_reference

from tritonattn import (
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


CASES = [
    # (lens_q, lens_k, Hq, Hkv, D, kwargs)
    ([17, 1, 65, 0, 40], [30, 1, 65, 12, 40], 4, 2, 40, dict(causal=True)),
    ([65, 33], [17, 129], 4, 1, 64, dict()),
    ([1, 1, 1], [100, 7, 64], 8, 2, 64, dict(causal=True)),
    ([50, 0, 77], [50, 5, 77], 2, 2, 80, dict(window_size=(16, 0))),
    ([40, 90], [90, 40], 4, 2, 32, dict(causal=True, softcap=10.0, alibi=True)),
]


@pytest.mark.parametrize("lens_q,lens_k,Hq,Hkv,D,kw", CASES,
                         ids=[f"q{'_'.join(map(str, c[0]))}-k{'_'.join(map(str, c[1]))}-H{c[2]}/{c[3]}-D{c[4]}"
                              for c in CASES])
def test_varlen_equals_dense_per_sequence(lens_q, lens_k, Hq, Hkv, D, kw, poison):
    torch.manual_seed(sum(lens_q) + D)
    kw = dict(kw)
    if kw.pop("alibi", False):
        kw["alibi_slopes"] = torch.rand(len(lens_q), Hq, device=DEVICE)
    q, k, v = _ragged(lens_q, lens_k, Hq, Hkv, D, F16)
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    out, lse, s_dmask = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                               return_attn_probs=True, **kw)
    assert s_dmask is None and lse.shape == (Hq, sum(lens_q)) and out.shape == q.shape
    dout = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    for b, ((q0, q1), (k0, k1)) in enumerate(zip(zip(cu_q[:-1].tolist(), cu_q[1:].tolist()),
                                                  zip(cu_k[:-1].tolist(), cu_k[1:].tolist()))):
        if q1 == q0:
            continue
        qb, kb, vb = (t.detach()[a:z][None].clone().requires_grad_() for t, a, z in ((q, q0, q1), (k, k0, k1),
                                                                                      (v, k0, k1)))
        kwb = dict(kw)
        if "alibi_slopes" in kwb:
            kwb["alibi_slopes"] = kw["alibi_slopes"][b:b + 1]
        if k1 == k0:  # no key: out 0, lse -inf, zero grads
            assert torch.equal(out[q0:q1], torch.zeros_like(out[q0:q1])) and torch.isneginf(lse[:, q0:q1]).all()
            assert torch.equal(dq[q0:q1], torch.zeros_like(dq[q0:q1]))
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


def test_bad_max_seqlen_and_block_table(monkeypatch):
    monkeypatch.setenv("TRITONATTN_DEBUG", "1")
    q, k, v = _ragged([3, 5], [3, 5], 2, 2, 16, F16)
    cu = _cu([3, 5])
    with pytest.raises(ValueError, match="longer than max_seqlen_q = 4"):
        flash_attn_varlen_func(q, k, v, cu, cu, 4, 5)
    with pytest.raises(ValueError, match="max_seqlen_k must be an int >= 0"):
        flash_attn_varlen_func(q, k, v, cu, cu, 5, -1)
    with pytest.raises(NotImplementedError, match="block_table"):
        flash_attn_varlen_func(q, k, v, cu, cu, 5, 5, block_table=torch.zeros(2, 1, dtype=torch.int32))
