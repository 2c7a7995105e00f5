"""Bad input gets a clear error naming the argument; nothing crashes or returns garbage."""

import pytest
import torch
from conftest import DEVICE

from tritonattn import flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func


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
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v = (t.cpu() for t in _qkv())
    with pytest.raises(ValueError, match="q is on cpu; tritonattn needs CUDA tensors .*TRITON_INTERPRET=1"):
        flash_attn_func(q, k, v)


@pytest.mark.parametrize("kwargs,what", [
    (dict(dropout_p=0.1), "dropout_p"),
    (dict(window_size=(16, 0)), "window_size"),
    (dict(softcap=30.0), "softcap"),
    (dict(alibi_slopes=torch.ones(2)), "alibi_slopes"),
])
def test_variants_not_yet_supported(kwargs, what):
    q, k, v = _qkv()
    with pytest.raises(NotImplementedError, match=what):
        flash_attn_func(q, k, v, **kwargs)


@pytest.mark.parametrize("scale", ["0.1", float("nan"), True])
def test_bad_softmax_scale(scale):
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="softmax_scale"):
        flash_attn_func(q, k, v, softmax_scale=scale)


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
