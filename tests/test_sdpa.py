"""The SDPA drop-in against PyTorch's own scaled_dot_product_attention."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE

import tritonattn
from tritonattn import patch_sdpa, scaled_dot_product_attention
from tritonattn.testing import check_close

F16, F32 = torch.float16, torch.float32
TORCH_SDPA = F.scaled_dot_product_attention


def _compare(q, k, v, **kw):
    """Output and gradients (q, k, v and a float mask) against torch's SDPA in fp64 (reference) and
    in the inputs' dtype (its own error), with the tolerance rule."""
    leaves = [q, k, v] + ([kw["attn_mask"]] if kw.get("attn_mask") is not None and kw["attn_mask"].requires_grad
                          else [])
    out = scaled_dot_product_attention(q, k, v, **kw)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, dout)

    def torch_run(dtype):
        ls = [t.detach().to(dtype).requires_grad_(t.requires_grad) for t in leaves]
        kw2 = dict(kw)
        if len(ls) == 4:
            kw2["attn_mask"] = ls[3]
        o = TORCH_SDPA(*[t.cpu() for t in ls[:3]], **{n: (t.cpu() if isinstance(t, torch.Tensor) else t)
                                                      for n, t in kw2.items()})
        return o, torch.autograd.grad(o, ls, dout.cpu().to(dtype))

    out_ref, g_ref = torch_run(torch.float64)
    out_pt, g_pt = torch_run(q.dtype)
    check_close("out", out, out_ref, out_pt, k=2)
    magnitude = max(g.abs().max().item() for g in g_ref)
    for name, g, r, p in zip(("dq", "dk", "dv", "dmask"), grads, g_ref, g_pt):
        assert g.shape == r.shape
        check_close(name, g, r, p, k=3, magnitude=magnitude)
    return out


def _qkv(B, Hq, Hkv, Sq, Sk, D, dtype=F16, lead=()):
    def t(*shape):
        return torch.randn(*lead, *shape, device=DEVICE).to(dtype).requires_grad_()
    return t(B, Hq, Sq, D), t(B, Hkv, Sk, D), t(B, Hkv, Sk, D)


@pytest.mark.parametrize("Sq,Sk", [(33, 33), (20, 50), (50, 20)])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal-top-left"])
def test_matches_torch(Sq, Sk, is_causal, poison):
    torch.manual_seed(Sq + Sk)
    _compare(*_qkv(2, 4, 4, Sq, Sk, 64), is_causal=is_causal)


def test_bool_mask_and_causal_together(poison):
    torch.manual_seed(1)
    q, k, v = _qkv(2, 2, 2, 40, 60, 32, F32)
    mask = torch.rand(2, 1, 40, 60, device=DEVICE) > 0.4
    _compare(q, k, v, attn_mask=mask)
    _compare(q, k, v, attn_mask=mask, is_causal=True)


def test_float_mask_is_differentiable(poison):
    torch.manual_seed(2)
    q, k, v = _qkv(2, 4, 4, 30, 45, 40, F32)
    bias = torch.randn(1, 4, 30, 45, device=DEVICE, requires_grad=True)
    _compare(q, k, v, attn_mask=bias, scale=0.3)


def test_gqa_and_leading_dims(poison):
    torch.manual_seed(3)
    q, k, v = _qkv(2, 8, 2, 25, 25, 64, lead=(3,))
    _compare(q, k, v, is_causal=True, enable_gqa=True)
    mask = torch.rand(2, 1, 25, 25, device=DEVICE) > 0.3  # broadcasts over the extra leading dim
    _compare(q, k, v, attn_mask=mask, enable_gqa=True)
    with pytest.raises(RuntimeError, match="enable_gqa"):
        scaled_dot_product_attention(q, k, v)
    q1, k1, v1 = _qkv(1, 4, 1, 10, 12, 16)  # one kv head broadcasts, as in PyTorch
    _compare(q1, k1, v1)


def test_fallback_warns_once_and_matches_torch():
    q = torch.randn(1, 2, 8, 16, dtype=torch.float64)
    tritonattn.integrations.sdpa._warned.discard("dtype torch.float64")
    with pytest.warns(UserWarning, match="falling back to torch's scaled_dot_product_attention"):
        out = scaled_dot_product_attention(q, q, q, is_causal=True)
    assert torch.equal(out, TORCH_SDPA(q, q, q, is_causal=True))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scaled_dot_product_attention(q, q, q)  # same reason: no second warning


def test_patch_sdpa_routes_and_undoes():
    calls = []
    real = tritonattn.integrations.sdpa.scaled_dot_product_attention

    with patch_sdpa():
        assert F.scaled_dot_product_attention is real
        q, k, v = _qkv(1, 2, 2, 8, 8, 16)
        F.scaled_dot_product_attention(q, k, v)
        calls.append(1)
    assert F.scaled_dot_product_attention is TORCH_SDPA
    handle = patch_sdpa()
    assert F.scaled_dot_product_attention is real
    handle.undo()
    assert F.scaled_dot_product_attention is TORCH_SDPA and calls


def test_dropout_runs_and_is_seeded():
    q, k, v = _qkv(1, 2, 2, 32, 32, 16)
    torch.manual_seed(4)
    a = scaled_dot_product_attention(q, k, v, dropout_p=0.3)
    torch.manual_seed(4)
    b = scaled_dot_product_attention(q, k, v, dropout_p=0.3)
    assert torch.equal(a, b) and not torch.equal(a, scaled_dot_product_attention(q, k, v))


def test_remembered_signature_matches_and_checks_still_run(poison):
    """A call whose signature passed the checks skips them the next time (host
    time): the same result, a fresh dropout seed per call, and other signatures still checked."""
    from tritonattn.integrations import sdpa
    from tritonattn.interface import _signature

    q, k, v = _qkv(2, 4, 2, 37, 29, 16)
    first = scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    sig = _signature((q, k, v, None), (0.0, True, None, True))
    assert sig in sdpa._VALIDATED
    real = sdpa._fallback_reason
    sdpa._fallback_reason = None  # the remembered path must not call it (nor any check)
    try:
        again = scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    finally:
        sdpa._fallback_reason = real
    assert torch.equal(first, again)
    _compare(q, k, v, is_causal=True, enable_gqa=True)  # remembered, with gradients, against torch
    # a leading dim that does not flatten into a view (the remembered path copies as the checked one)
    q5 = torch.randn(3, 2, 4, 8, 16, dtype=F16, device=DEVICE).transpose(0, 1)
    k5 = torch.randn(3, 2, 2, 8, 16, dtype=F16, device=DEVICE).transpose(0, 1)
    want = scaled_dot_product_attention(q5, k5, k5, enable_gqa=True)
    assert torch.equal(scaled_dot_product_attention(q5, k5, k5, enable_gqa=True), want)
    # dropout: a seed drawn per call on the remembered path too
    torch.manual_seed(5)
    a = scaled_dot_product_attention(q, k, v, dropout_p=0.3, enable_gqa=True)
    b = scaled_dot_product_attention(q, k, v, dropout_p=0.3, enable_gqa=True)
    torch.manual_seed(5)
    assert torch.equal(scaled_dot_product_attention(q, k, v, dropout_p=0.3, enable_gqa=True), a)
    assert not torch.equal(a, b)
    # calls with attn_mask: remembered by the mask's shape, dtype and device, each call laying out its
    # own mask (other values, other strides: against torch, gradients too)
    full = scaled_dot_product_attention(q, k, v, enable_gqa=True)
    size = len(sdpa._VALIDATED)
    mask = torch.ones(37, 29, dtype=torch.bool, device=DEVICE).tril()
    scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    float_mask = torch.randn(37, 29, device=DEVICE).to(F16)
    scaled_dot_product_attention(q, k, v, attn_mask=float_mask, enable_gqa=True)
    assert len(sdpa._VALIDATED) == size + 2
    mask2 = torch.rand(29, 37, device=DEVICE).t() > 0.5  # (a transposed view)
    mask2[:, 0] = True
    _compare(q, k, v, attn_mask=mask2, enable_gqa=True)
    _compare(q, k, v, attn_mask=torch.randn(37, 29, device=DEVICE).to(F16).requires_grad_(), enable_gqa=True)
    assert len(sdpa._VALIDATED) == size + 2
    # with an option that is not a plain value: never remembered
    size = len(sdpa._VALIDATED)
    flag = torch.tensor(False)
    assert torch.equal(scaled_dot_product_attention(q, k, v, is_causal=flag, enable_gqa=True), full)
    flag.fill_(True)  # the same tensor object, now true: the causal result
    assert torch.equal(scaled_dot_product_attention(q, k, v, is_causal=flag, enable_gqa=True), first)
    assert len(sdpa._VALIDATED) == size
    # other signatures: checked
    with pytest.raises(RuntimeError, match="enable_gqa"):
        scaled_dot_product_attention(q, k, v, is_causal=True)
    with pytest.raises(RuntimeError, match="do not match"):
        scaled_dot_product_attention(q, k[:1], v[:1], is_causal=True, enable_gqa=True)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_signature_refuses_nested_tensors_and_tensor_options():
    """A strided nested tensor has no shape, and a tensor option hashes by identity (its value may
    change in place): no remembered signature, the checks run. Plain values and types are kept."""
    from tritonattn.interface import _signature

    nt = torch.nested.nested_tensor([torch.zeros(2, 3), torch.zeros(3, 3)])
    assert _signature((nt,), ()) is None
    t = torch.zeros(2)
    assert _signature((t,), (torch.tensor(True),)) is None
    assert _signature((t,), ((1, torch.tensor(2)),)) is None
    assert _signature((t,), (None, True, 1, 0.5, "x", int, (-1, 0))) is not None


def test_inference_calls_replay_through_the_linked_plan(monkeypatch):
    """4-d calls without a mask that need no gradient: the first call with a key (interface._fast_key,
    tagged "sdpa") takes the checks and links the key to its launch plan; the next call replays the
    plan alone (the checks would fail here). Cases differ from the one before in one part of the key
    (is_causal, lengths, scale, GQA, strides): each result against a fresh call and torch in fp64."""
    from tritonattn import interface
    from tritonattn.integrations import sdpa
    from tritonattn.kernels import plan

    def make(seed, Sq, Sk, Hkv, transposed=False):
        gen = torch.Generator().manual_seed(seed)
        q = torch.randn(2, 4, Sq, 16, generator=gen)
        if transposed:
            q = q.transpose(1, 2).contiguous().transpose(1, 2)
        k, v = (torch.randn(2, Hkv, Sk, 16, generator=gen) for _ in range(2))
        return [t.to(device=DEVICE, dtype=F16) for t in (q, k, v)]

    cases = [((37, 37, 4), dict(is_causal=True)), ((37, 37, 4), dict(is_causal=False)),
             ((20, 45, 4), dict(is_causal=True)), ((20, 45, 4), dict(is_causal=True, scale=0.3)),
             ((20, 45, 2), dict(is_causal=True, enable_gqa=True)),
             ((20, 45, 2), dict(is_causal=True, enable_gqa=True, transposed=True))]
    plan.clear()
    results = []
    for i, (dims, kw) in enumerate(cases):
        kw = dict(kw)
        how = dict(transposed=kw.pop("transposed", False))
        scaled_dot_product_attention(*make(i, *dims, **how), **kw)
        ins = make(100 + i, *dims, **how)
        hits = plan.hits
        with monkeypatch.context() as m:
            m.setattr(sdpa, "_fallback_reason", None)
            m.setattr(interface, "_check_qkv", None)
            out = scaled_dot_product_attention(*ins, **kw)
        assert plan.hits == hits + 1, f"case {i} did not replay"
        results.append((ins, kw, out))
    for i, (ins, kw, out) in enumerate(results):
        plan.clear()
        with torch.no_grad():
            assert torch.equal(out, scaled_dot_product_attention(*[t.clone() for t in ins], **kw)), f"case {i}"
        ref = TORCH_SDPA(*[t.cpu().double() for t in ins], **kw)
        same = TORCH_SDPA(*[t.cpu() for t in ins], **kw)
        check_close(f"case {i}", out.cpu(), ref, same, k=2)
    # a call that matches a linked key but for an option or its type takes the checks
    q, k, v = make(0, 20, 45, 2)
    scaled_dot_product_attention(q, k, v, scale=1, enable_gqa=True)
    scaled_dot_product_attention(q, k, v, scale=1, enable_gqa=True)
    with pytest.raises(TypeError, match="scale"):
        scaled_dot_product_attention(q, k, v, scale=True, enable_gqa=True)
    with pytest.raises(RuntimeError, match="enable_gqa"):
        scaled_dot_product_attention(q, k, v, scale=1)


def test_training_calls_replay_through_the_linked_plan(monkeypatch):
    """4-d calls without a mask that need gradients: the first call with a key (tagged "sdpa-grad")
    takes the checks and links the key to its launch plan; the next call reuses its checked Variants
    (the checks and the remembered checks' key would fail) and replays the plan (the full forward
    would fail), then the backward. Outputs and gradients against a fresh full-path call (bitwise)
    and torch in fp64; a float mask (a bias) or a bool mask takes the full path."""
    from tritonattn import interface, ops
    from tritonattn.integrations import sdpa
    from tritonattn.kernels import plan
    from tritonattn.kernels.variants import Variants

    def make(seed, Sq, Sk, Hkv):
        gen = torch.Generator().manual_seed(seed)
        q = torch.randn(2, 4, Sq, 16, generator=gen)
        k, v = (torch.randn(2, Hkv, Sk, 16, generator=gen) for _ in range(2))
        dout = torch.randn(2, 4, Sq, 16, generator=gen).to(device=DEVICE, dtype=F16)
        return [t.to(device=DEVICE, dtype=F16).requires_grad_() for t in (q, k, v)], dout

    def step(ins, dout, kw):
        out = scaled_dot_product_attention(*ins, **kw)
        return (out, *torch.autograd.grad(out, ins, dout))

    cases = [((37, 37, 4), dict(is_causal=True)), ((20, 45, 4), dict(is_causal=True)),
             ((20, 45, 2), dict(is_causal=False, enable_gqa=True, scale=0.3))]
    plan.clear()
    interface._GRAD_VARS.clear()
    results = []
    for i, (dims, kw) in enumerate(cases):
        step(*make(i, *dims), kw)
        ins, dout = make(100 + i, *dims)
        hits = plan.hits
        with monkeypatch.context() as m:
            m.setattr(sdpa, "_fallback_reason", None)
            m.setattr(interface, "_check_qkv", None)
            m.setattr(interface, "_signature", None)  # (the remembered checks' key)
            m.setattr(ops, "forward", None)
            m.setattr(Variants, "signature", None)  # (the launchers' keys: both passes replay linked plans)
            got = step(ins, dout, kw)
        assert plan.hits == hits + 2, f"case {i}: the forward and the backward did not both replay"
        results.append((ins, dout, kw, got))
    for i, (ins, dout, kw, got) in enumerate(results):
        plan.clear()
        interface._GRAD_VARS.clear()
        fresh = step(ins, dout, kw)
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, fresh):
            assert torch.equal(a, b), f"case {i} {name}"
        for dtype, ref in ((torch.float64, True), (F16, False)):
            leaves = [t.detach().cpu().to(dtype).requires_grad_() for t in ins]
            o = TORCH_SDPA(*leaves, **kw)
            grads = torch.autograd.grad(o, leaves, dout.cpu().to(dtype))
            if ref:
                want = (o, *grads)
            else:
                for j, name in enumerate(("out", "dq", "dk", "dv")):
                    check_close(f"case {i} {name}", got[j].cpu(), want[j], (o, *grads)[j], k=3)
    gen = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(1, 2, 9, 16, generator=gen).to(DEVICE).requires_grad_() for _ in range(3))
    bias = torch.randn(9, 9, generator=gen).to(DEVICE)
    for mask in (bias, bias > 0):
        before = len(interface._GRAD_VARS)
        for _ in range(2):
            scaled_dot_product_attention(q, k, v, attn_mask=mask)
        assert len(interface._GRAD_VARS) == before


def test_tensor_like_arguments_go_to_torch():
    """Arguments that are not tensors but follow __torch_function__ take torch's SDPA, as before the
    drop-in's fast path (which must not call a tensor method on them first)."""

    class Wrapped:
        def __init__(self, t):
            self.t = t

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            unwrap = lambda x: x.t if isinstance(x, Wrapped) else x  # noqa: E731
            return func(*[unwrap(a) for a in args], **{n: unwrap(a) for n, a in (kwargs or {}).items()})

    q, k, v = (torch.randn(1, 2, 9, 16, dtype=F32) for _ in range(3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = scaled_dot_product_attention(Wrapped(q), Wrapped(k), Wrapped(v), is_causal=True)
    assert torch.allclose(out, TORCH_SDPA(q, k, v, is_causal=True))


def test_masked_inference_calls_replay_through_the_linked_plan(monkeypatch):
    """4-d inference calls with a bool attn_mask replay the linked plan with their own mask laid out
    as the recorded one (the checks would fail here); a float mask (a bias) is never linked."""
    from tritonattn import interface
    from tritonattn.integrations import sdpa
    from tritonattn.kernels import plan

    B, H, Sq, Sk = 2, 4, 19, 27

    def make(seed, mask_shape):
        gen = torch.Generator().manual_seed(seed)
        q, k, v = (torch.randn(B, H, S, 16, generator=gen).to(device=DEVICE, dtype=F16) for S in (Sq, Sk, Sk))
        mask = torch.rand(*mask_shape, generator=gen) > 0.3
        mask[..., 0] = True  # (torch's SDPA gives NaN for a row that keeps no key)
        return (q, k, v), mask.to(DEVICE)

    cases = [((Sq, Sk), {}), ((B, 1, 1, Sk), {}), ((B, H, Sq, Sk), {}), ((B, 1, Sq, Sk), dict(scale=0.2))]
    plan.clear()
    results = []
    for i, (shape, kw) in enumerate(cases):
        ins, mask = make(i, shape)
        scaled_dot_product_attention(*ins, attn_mask=mask, **kw)
        ins, mask = make(100 + i, shape)
        hits = plan.hits
        with monkeypatch.context() as m:
            m.setattr(sdpa, "_fallback_reason", None)
            m.setattr(interface, "_check_qkv", None)
            out = scaled_dot_product_attention(*ins, attn_mask=mask, **kw)
        assert plan.hits == hits + 1, f"case {i} did not replay"
        results.append((ins, mask, kw, out))
    for i, (ins, mask, kw, out) in enumerate(results):
        plan.clear()
        assert torch.equal(out, scaled_dot_product_attention(*ins, attn_mask=mask.clone(), **kw)), f"case {i}"
        ref = TORCH_SDPA(*[t.cpu().double() for t in ins], attn_mask=mask.cpu(), **kw)
        same = TORCH_SDPA(*[t.cpu() for t in ins], attn_mask=mask.cpu(), **kw)
        check_close(f"case {i}", out.cpu(), ref, same, k=2)
    ins, mask = make(0, (Sq, Sk))
    bias = torch.where(mask, 0.0, -1e4).to(F16)
    links = len(plan._links)
    for _ in range(2):
        out = scaled_dot_product_attention(*ins, attn_mask=bias)
    assert len(plan._links) == links
    check_close("bias", out.cpu(), TORCH_SDPA(*[t.cpu().double() for t in ins], attn_mask=bias.cpu().double()),
                TORCH_SDPA(*[t.cpu() for t in ins], attn_mask=bias.cpu()), k=2)


def test_growing_cache_takes_the_length_free_link(monkeypatch):
    """The drop-in's decoding step over a cache one row longer each call (no mask, is_causal False,
    as transformers' sdpa path calls it): from the length-free plan's link on (decode.free_key), no
    check runs; every result is bitwise the full path's and within the tolerance of torch's SDPA.
    is_causal=True (a top-left window that follows the lengths) and a mask take the full path."""
    from tritonattn import configs
    from tritonattn.integrations import sdpa
    from tritonattn.kernels import plan

    monkeypatch.setattr(plan, "RECORD_AT", 2)
    monkeypatch.setattr(configs, "DECODE_ONE_SPLIT_KEYS", 0)
    checked = []
    real = sdpa._fallback_reason
    monkeypatch.setattr(sdpa, "_fallback_reason", lambda *a: checked.append(1) or real(*a))
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 1, 32, generator=gen).to(DEVICE, F16)
    kc, vc = (torch.randn(2, 2, 700, 32, generator=gen).to(DEVICE, F16) for _ in range(2))
    lengths = range(300, 340)

    def call(n, **kw):
        return scaled_dot_product_attention(q, kc[:, :, :n], vc[:, :, :n], enable_gqa=True, **kw)

    plan.clear()
    outs, per_call = [], []
    for n in lengths:
        before = len(checked)
        outs.append(call(n))
        per_call.append(len(checked) - before)
    assert sum(per_call[4:]) == 0 and sum(per_call) <= 4, per_call
    # is_causal: a length called again and again (its plan and links made), then others
    causal_lengths = (400, 400, 400, 400, 401, 402)
    causal = [call(n, is_causal=True) for n in causal_lengths]
    before = len(checked)
    mask = torch.ones(1, 500, dtype=torch.bool, device=DEVICE)
    masked = [call(500, attn_mask=mask), call(501, attn_mask=torch.ones(1, 501, dtype=torch.bool, device=DEVICE))]
    assert len(checked) - before == 2  # each a new signature, checked
    for n, out in zip(causal_lengths, causal):
        want = TORCH_SDPA(q.double(), kc[:, :, :n].double(), vc[:, :, :n].double(), is_causal=True, enable_gqa=True)
        assert (out.double() - want).abs().max() < 2e-3
    monkeypatch.setattr(plan, "replay", lambda *args, **kwargs: None)
    monkeypatch.setattr(plan, "linked", lambda *args, **kwargs: None)
    for n, out in zip(lengths, outs):
        assert torch.equal(out, call(n)), n
    assert torch.equal(masked[0], call(500, attn_mask=mask))
    want = TORCH_SDPA(q.double(), kc[:, :, :339].double(), vc[:, :, :339].double(), enable_gqa=True)
    assert (outs[-1].double() - want).abs().max() < 2e-3
