"""Bad input gets a clear error naming the argument; nothing crashes or returns garbage."""

import pytest
import torch
from conftest import DEVICE

import tritonattn
from tritonattn import attention, flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func


def _qkv(B=1, Sq=8, Sk=8, Hq=2, Hkv=2, D=16, dtype=torch.float16):
    q = torch.randn(B, Sq, Hq, D, device=DEVICE).to(dtype)
    k = torch.randn(B, Sk, Hkv, D, device=DEVICE).to(dtype)
    v = torch.randn(B, Sk, Hkv, D, device=DEVICE).to(dtype)
    return q, k, v


def test_not_a_tensor():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="k must be a torch.Tensor"):
        flash_attn_func(q, k.tolist(), v)


def test_wrong_ndim():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="q must have 4 dimensions"):
        flash_attn_func(q[0], k, v)


@pytest.mark.parametrize("dtype", [torch.int32, torch.float64, torch.float8_e4m3fn, torch.bool])
def test_bad_dtype(dtype):
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="q has dtype"):
        flash_attn_func(q.to(dtype), k, v)


def test_mixed_dtypes():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="v has dtype torch.float32 but q has torch.float16"):
        flash_attn_func(q, k, v.float())


def test_batch_mismatch():
    q, _, _ = _qkv(B=2)
    _, k, v = _qkv(B=3)
    with pytest.raises(ValueError, match="k has batch size 3 but q has 2"):
        flash_attn_func(q, k, v)


def test_head_dim_mismatch():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="k has head dim 32 but q has 16"):
        flash_attn_func(q, torch.cat([k, k], -1), torch.cat([v, v], -1))


def test_k_v_shape_mismatch():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="k and v must have the same shape"):
        flash_attn_func(q, k, v[:, :4])


def test_heads_not_divisible():
    q, k, v = _qkv(Hq=6, Hkv=4)
    with pytest.raises(ValueError, match=r"query heads \(6\) must be a multiple of .* key/value heads \(4\)"):
        flash_attn_func(q, k, v)


def test_head_dim_too_large():
    q, k, v = _qkv(D=264)
    with pytest.raises(ValueError, match="head dim 264 is not supported"):
        flash_attn_func(q, k, v)


def test_cpu_tensors_without_interpreter(monkeypatch):
    from tritonattn import interface

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    # (the switch is read by the checks, not held in remembered signatures: in a process it does not
    # change, triton reads it once at import; another test's call of these shapes is forgotten here)
    interface._VALIDATED.clear()
    q, k, v = (t.cpu() for t in _qkv())
    with pytest.raises(ValueError, match="q is on cpu; tritonattn needs CUDA tensors .*TRITON_INTERPRET=1"):
        flash_attn_func(q, k, v)


@pytest.mark.parametrize("kwargs,error,what", [
    (dict(dropout_p=1.0), ValueError, r"dropout_p must be a float in \[0, 1\)"),
    (dict(dropout_p=-0.1), ValueError, "dropout_p"),
    (dict(window_size=(-2, 0)), ValueError, "window_size must be two integers >= -1"),
    (dict(window_size=(4,)), ValueError, "window_size"),
    (dict(window_size=(1.5, 2)), ValueError, "window_size"),
    (dict(softcap=-1.0), ValueError, "softcap must be a finite float >= 0"),
    (dict(alibi_slopes=torch.ones(2, dtype=torch.float16)), TypeError, "alibi_slopes must be float32"),
    (dict(alibi_slopes=torch.ones(3)), ValueError, r"alibi_slopes must have shape \(2,\) or \(1, 2\)"),
    (dict(alibi_slopes=[1.0, 2.0]), TypeError, "alibi_slopes must be a torch.Tensor"),
    (dict(causal="no"), TypeError, "causal must be a bool, got 'no'"),  # (a truthy string: causal)
    (dict(causal=2), TypeError, "causal must be a bool"),
    (dict(deterministic=None), TypeError, "deterministic must be a bool, got None"),
])
def test_bad_variant_options(kwargs, error, what):
    q, k, v = _qkv()
    if isinstance(kwargs.get("alibi_slopes"), torch.Tensor):
        kwargs = dict(alibi_slopes=kwargs["alibi_slopes"].to(DEVICE))
    with pytest.raises(error, match=what):
        flash_attn_func(q, k, v, **kwargs)


@pytest.mark.parametrize("kwargs,error,what", [
    (dict(bias=torch.zeros(3, 8, 8)), ValueError, r"bias of shape \(3, 8, 8\) does not broadcast"),
    (dict(bias=torch.zeros(8, 8, dtype=torch.int32)), TypeError, "bias has dtype torch.int32"),
    (dict(mask=torch.ones(8, 8)), TypeError, "mask must be a bool tensor"),
    (dict(mask=torch.ones(2, 1, 8, 8, dtype=torch.bool)), ValueError, "mask of shape .* does not broadcast"),
    (dict(key_padding_mask=torch.ones(1, 7, dtype=torch.bool)), ValueError, "key_padding_mask must have shape"),
    (dict(mask=torch.ones(8, 8, dtype=torch.bool), key_padding_mask=torch.ones(1, 8, dtype=torch.bool)),
     ValueError, "not both"),
])
def test_bad_mask_and_bias(kwargs, error, what):
    q, k, v = _qkv()
    kwargs = {n: t.to(DEVICE) for n, t in kwargs.items()}
    with pytest.raises(error, match=what):
        attention(q, k, v, **kwargs)


@pytest.mark.parametrize("scale", ["0.1", float("nan"), True])
def test_bad_softmax_scale(scale):
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="softmax_scale"):
        flash_attn_func(q, k, v, softmax_scale=scale)


def test_checks_still_run_after_a_remembered_signature():
    """flash_attn_func skips its checks for a signature that passed them before (host time); options
    equal in value but not in type, other shapes or dtypes, or unhashable options still get them."""
    q, k, v = _qkv()
    flash_attn_func(q, k, v, softmax_scale=1, window_size=[3, -1], softcap=0.0, dropout_p=0.0)
    flash_attn_func(q, k, v, softmax_scale=1, window_size=[3, -1], softcap=0.0, dropout_p=0.0)  # remembered
    with pytest.raises(TypeError, match="softmax_scale"):
        flash_attn_func(q, k, v, softmax_scale=True, window_size=[3, -1])
    with pytest.raises(ValueError, match="dropout_p"):
        flash_attn_func(q, k, v, softmax_scale=1, window_size=[3, -1], dropout_p=True)
    with pytest.raises(ValueError, match="window_size"):
        flash_attn_func(q, k, v, softmax_scale=1, window_size=[3, [-1]])
    with pytest.raises(TypeError, match="softmax_scale"):
        flash_attn_func(q, k, v, softmax_scale=[1.0])
    with pytest.raises(TypeError, match="k has dtype"):
        flash_attn_func(q, k.float(), v, softmax_scale=1, window_size=[3, -1])
    with pytest.raises(ValueError, match="k has head dim"):
        flash_attn_func(q, k[..., :8], v[..., :8], softmax_scale=1, window_size=[3, -1])


def test_remembered_signature_spans_sequence_lengths():
    """flash_attn_func's checks read no sequence length (but for k and v having one shape), so one
    remembered signature covers calls whose q / k / v lengths change (a generation loop's cache, one
    key longer each step): one key for all, each result bitwise the checked call's. k and v of
    different lengths, or a tensor with another number of dims, still get the checks."""
    from tritonattn import interface

    interface._VALIDATED.clear()
    outs = []
    for sq, sk in ((1, 20), (1, 21), (3, 22), (1, 37)):
        q, k, v = _qkv(B=2, Sq=sq, Sk=sk, Hq=4, Hkv=2)
        outs.append((q, k, v, flash_attn_func(q, k, v)))
    assert len(interface._VALIDATED) == 1
    for q, k, v, out in outs:
        interface._VALIDATED.clear()  # the full checks again
        assert torch.equal(flash_attn_func(q, k, v), out)
    q, k, v = _qkv(B=2, Sq=1, Sk=24, Hq=4, Hkv=2)
    with pytest.raises(ValueError, match="k and v must have the same shape"):
        flash_attn_func(q, k, v[:, :23])
    with pytest.raises(ValueError, match="q must have 4 dimensions"):
        flash_attn_func(q[:, 0], k, v)
    with pytest.raises(ValueError, match="k has batch size"):
        flash_attn_func(q, k[:1], v[:1])
    with pytest.raises(TypeError, match="k must be a torch.Tensor"):
        flash_attn_func(q, None, v)
    with pytest.raises(TypeError, match="v must be a torch.Tensor"):
        flash_attn_func(q, k, None)


def test_packed_entry_points_remember_signatures_and_checks_still_run():
    """The kv- / qkv-packed and varlen entry points skip their checks for a signature that passed them
    (host time), as flash_attn_func does, each in its own part of the store: their results equal the
    checked call's, and other shapes, dtypes, options or cu_seqlens contents still get the checks.
    On CPU tensors the contents of cu_seqlens are checked on every call (a remembered signature holds
    their shape only)."""
    from tritonattn import (
        flash_attn_varlen_func,
        flash_attn_varlen_kvpacked_func,
        flash_attn_varlen_qkvpacked_func,
        interface,
    )

    q, k, v = _qkv(B=2, Sq=8, Sk=8, Hq=4, Hkv=2)
    kv = torch.stack([k, v], 2)
    qkv = torch.stack([q, q.clone(), q.clone()], 2)
    interface._VALIDATED.clear()
    first = flash_attn_kvpacked_func(q, kv, causal=True)
    assert len(interface._VALIDATED) == 1
    assert torch.equal(flash_attn_kvpacked_func(q, kv, causal=True), first)  # remembered
    assert torch.equal(first, flash_attn_func(q, k, v, causal=True))
    first = flash_attn_qkvpacked_func(qkv, softcap=2.0)
    assert torch.equal(flash_attn_qkvpacked_func(qkv, softcap=2.0), first)
    assert len(interface._VALIDATED) == 3  # flash_attn_func's, kv's and qkv's: three keys
    with pytest.raises(ValueError, match="kv must have shape"):
        flash_attn_kvpacked_func(q, torch.stack([k, v, v], 2), causal=True)
    with pytest.raises(TypeError, match="kv has dtype"):
        flash_attn_kvpacked_func(q, kv.float(), causal=True)
    with pytest.raises(TypeError, match="causal must be a bool"):
        flash_attn_kvpacked_func(q, kv, causal="yes")
    with pytest.raises(ValueError, match="qkv must have shape"):
        flash_attn_qkvpacked_func(qkv[:, :, :2], softcap=2.0)
    with pytest.raises(ValueError, match="softcap"):
        flash_attn_qkvpacked_func(qkv, softcap=-2.0)

    # varlen: two sequences of 3 and 5 tokens
    qp, kp, vp = q[0], k[0], v[0]
    cu = torch.tensor([0, 3, 8], dtype=torch.int32, device=DEVICE)
    kvp = torch.stack([kp, vp], 1)
    qkvp = qkv[0]
    calls = (lambda c, m=5: flash_attn_varlen_func(qp, kp, vp, c, c, m, m, causal=True),
             lambda c, m=5: flash_attn_varlen_kvpacked_func(qp, kvp, c, c, m, m, causal=True),
             lambda c, m=5: flash_attn_varlen_qkvpacked_func(qkvp, c, m, causal=True))
    for call in calls:
        first = call(cu)
        size = len(interface._VALIDATED)
        assert torch.equal(call(cu), first)  # remembered
        assert len(interface._VALIDATED) == size
        # the same shapes, other contents: checked on every call
        with pytest.raises(ValueError, match="never decrease"):
            call(torch.tensor([0, 6, 8], dtype=torch.int32, device=DEVICE).flip(0))
        with pytest.raises(ValueError, match="longer than max_seqlen"):
            call(torch.tensor([0, 1, 8], dtype=torch.int32, device=DEVICE))
        with pytest.raises(ValueError, match="holds 8 tokens"):
            call(torch.tensor([0, 3, 7], dtype=torch.int32, device=DEVICE))
        with pytest.raises(TypeError, match="must be int32"):
            call(cu.long())
        with pytest.raises(ValueError, match="max_seqlen"):
            call(cu, True)
    assert torch.equal(calls[1](cu), calls[0](cu))
    # with dropout, a remembered signature's rejected call draws no seed (the random state is left
    # as the full checks leave it: they raise before the seed is drawn)
    drop = lambda c: flash_attn_varlen_func(qp, kp, vp, c, c, 5, 5, dropout_p=0.5)  # noqa: E731
    drop(cu)
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    with pytest.raises(ValueError, match="holds 8 tokens"):
        drop(torch.tensor([0, 3, 7], dtype=torch.int32, device=DEVICE))
    assert torch.equal(torch.rand(3), expected)
    with pytest.raises(ValueError, match="kv must have shape"):
        flash_attn_varlen_kvpacked_func(qp, torch.stack([kp, vp, vp], 1), cu, cu, 5, 5, causal=True)


def test_attention_entry_points_remember_signatures_and_checks_still_run():
    """attention remembers the checks of q, k, v, the options and its bias / mask arguments (a tagged
    key of their shapes, dtypes and devices), and lays out each call's own mask; attention_varlen
    those of q, k, v and the options (its bias and mask checks run on every call), and cu_seqlens
    contents checks run on every call on CPU."""
    from tritonattn import attention_varlen, interface
    from tritonattn.testing import attention_ref

    q, k, v = _qkv(B=2, Sq=8, Sk=8, Hq=4, Hkv=2)
    bias = torch.randn(2, 4, 8, 8, device=DEVICE)
    interface._VALIDATED.clear()
    first = attention(q, k, v, bias=bias, causal=True)
    assert len(interface._VALIDATED) == 1
    assert torch.equal(attention(q, k, v, bias=bias, causal=True), first)  # remembered
    assert len(interface._VALIDATED) == 1
    # a remembered signature with other values of its bias / masks (and other strides): this call's own
    kpm = torch.rand(2, 8, device=DEVICE) > 0.4
    kpm[:, -1] = True
    attention(q, k, v, key_padding_mask=kpm, causal=True)
    mask = torch.rand(8, 8, device=DEVICE).t() > 0.5  # (a transposed view: other strides than the next)
    mask[:, 0] = True
    attention(q, k, v, mask=mask)
    assert len(interface._VALIDATED) == 3
    for _ in range(2):
        kpm2 = torch.rand(4, 16, device=DEVICE)[::2, ::2] > 0.4  # (strided)
        kpm2[:, -1] = True
        mask2 = torch.rand(8, 8, device=DEVICE) > 0.5
        mask2[:, 0] = True
        bias2 = torch.randn(2, 4, 8, 8, device=DEVICE)
        for out, ref in ((attention(q, k, v, key_padding_mask=kpm2, causal=True),
                          attention_ref(q, k, v, causal=True, key_padding_mask=kpm2)[0]),
                         (attention(q, k, v, mask=mask2), attention_ref(q, k, v, mask=mask2)[0]),
                         (attention(q, k, v, bias=bias2, causal=True),
                          attention_ref(q, k, v, causal=True, bias=bias2)[0])):
            assert (out.double() - ref).abs().max().item() < 2e-3
    assert len(interface._VALIDATED) == 3
    with pytest.raises(ValueError, match="key_padding_mask must have shape"):
        attention(q, k, v, key_padding_mask=kpm[:, :5], causal=True)
    with pytest.raises(TypeError, match="key_padding_mask must be a bool tensor"):
        attention(q, k, v, key_padding_mask=kpm.float(), causal=True)
    with pytest.raises(ValueError, match="give mask or key_padding_mask, not both"):
        attention(q, k, v, mask=mask, key_padding_mask=kpm)
    assert len(interface._VALIDATED) == 3
    with pytest.raises(ValueError, match="bias of shape"):
        attention(q, k, v, bias=bias[:, :, :3, :5], causal=True)
    with pytest.raises(TypeError, match="mask must be a bool tensor"):
        attention(q, k, v, mask=bias, causal=True)
    with pytest.raises(TypeError, match="causal must be a bool"):
        attention(q, k, v, causal=None)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32, device=DEVICE)
    qp, kp, vp = q[0], k[0], v[0]
    vbias = bias[:, :, :5, :5]  # (batch, nheads, max_seqlen_q, max_seqlen_k)
    first = attention_varlen(qp, kp, vp, cu, cu, 5, 5, bias=vbias, causal=True)
    size = len(interface._VALIDATED)
    assert torch.equal(attention_varlen(qp, kp, vp, cu, cu, 5, 5, bias=vbias, causal=True), first)
    assert len(interface._VALIDATED) == size == 4
    with pytest.raises(ValueError, match="longer than max_seqlen"):
        attention_varlen(qp, kp, vp, torch.tensor([0, 1, 8], dtype=torch.int32, device=DEVICE), cu, 5, 5,
                         bias=vbias, causal=True)
    with pytest.raises(ValueError, match="key_padding_mask must have shape"):
        attention_varlen(qp, kp, vp, cu, cu, 5, 5, key_padding_mask=torch.ones(2, 4, dtype=torch.bool),
                         causal=True)


def test_packed_shapes():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="qkv must have shape"):
        flash_attn_qkvpacked_func(torch.stack([q, k], 2))
    with pytest.raises(ValueError, match="kv must have shape"):
        flash_attn_kvpacked_func(q, torch.stack([k, v, v], 2))
    with pytest.raises(ValueError, match="kv must have 5 dimensions"):
        flash_attn_kvpacked_func(q, k)


def test_double_backward_raises():
    q, k, v = (t.requires_grad_() for t in _qkv())
    out = flash_attn_func(q, k, v)
    with pytest.raises(RuntimeError, match="double backward is not supported"):
        torch.autograd.grad(out.sum(), (q,), create_graph=True)


def test_backward_gets_no_zero_gradients(monkeypatch):
    """The eager Function does not have autograd make zero gradients (set_materialize_grads(False)):
    lse's (non-differentiable) arrives as None, not a zeros tensor made and filled every backward, and a
    backward whose out gradient is None returns no gradients; the real backward still runs and is
    right (out's gradient, q / k / v gradients of the reference's shape)."""
    from tritonattn import ops

    seen, real = [], ops.FlashAttnFunction.backward

    def spy(ctx, dout, dlse, dprobs):
        seen.append((dout is None, dlse, dprobs))
        return real(ctx, dout, dlse, dprobs)

    monkeypatch.setattr(ops.FlashAttnFunction, "backward", staticmethod(spy))
    q, k, v = (t.requires_grad_() for t in _qkv())
    out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    grads = torch.autograd.grad((out * 2).sum() + lse.sum().detach(), (q, k, v))
    assert seen == [(False, None, None)], seen
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape] and all(g.abs().sum() > 0 for g in grads)
    assert real(None, None, None, None) == (None,) * 7


def test_autograd_entry_without_and_with_functorch(monkeypatch):
    """The eager call enters autograd through Function.apply's C entry (host time), with what
    Function.apply does first kept: a dead functorch wrapper (a tensor leaked out of a transform)
    is unwrapped, and its call gives the plain tensor's output and gradients. Under a functorch
    transform the call goes through Function.apply, which says what the Function lacks there."""
    from tritonattn import interface, ops

    q, k, v = _qkv()
    leaked = []
    torch.func.grad(lambda x: leaked.append(x) or x.sum())(q.clone().requires_grad_())
    (dead,) = leaked
    assert torch._C._functorch.is_functorch_wrapped_tensor(dead)
    k1, k2 = k.clone().requires_grad_(), k.clone().requires_grad_()
    out_dead = flash_attn_func(dead, k1, v, causal=True)
    out = flash_attn_func(q, k2, v, causal=True)
    assert torch.equal(out_dead, out)
    out_dead.sum().backward()
    out.sum().backward()
    assert torch.equal(k1.grad, k2.grad)
    with torch.no_grad():  # an inference call (its key and its full path) with the dead wrapper
        for _ in range(2):
            assert torch.equal(flash_attn_func(dead, k, v, causal=True), out)
            assert torch.equal(tritonattn.scaled_dot_product_attention(
                dead.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True),
                out.transpose(1, 2))

    applied = []
    real = ops.FlashAttnFunction.apply
    monkeypatch.setattr(ops.FlashAttnFunction, "apply", lambda *a: applied.append(1) or real(*a))
    flash_attn_func(q, k2, v, causal=True)
    assert applied == []  # eager: the C entry
    with pytest.raises(RuntimeError, match="setup_context"):
        torch.func.grad(lambda x: flash_attn_func(x, k, v, causal=True).sum())(q)
    assert applied == [1]
    assert interface._function_apply.__self__ is ops.FlashAttnFunction
