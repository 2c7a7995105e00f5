"""The opt-in persistent forward (TRITONATTN_FWD_PERSISTENT=N, kernels/fwd.py): plain dense calls
only, every program looping over several query tiles (the interpreter has 4 "SMs"), checked
against the fp64 reference, forward and backward (the backward reads its LSE)."""

import pytest
import torch
from conftest import DEVICE, case_id, check_against_reference

from tritonattn import configs, flash_attn_func
from tritonattn.kernels import fwd, launch, plan
from tritonattn.testing import random_qkv

CASES = [  # (B, Sq, Sk, Hq, Hkv, D): ragged ends, GQA, more tiles than programs, Sq != Sk, D padded
    (2, 70, 70, 4, 2, 64, False, torch.float16),
    (1, 129, 40, 2, 1, 32, False, torch.float16),
    (3, 17, 100, 4, 4, 40, False, torch.float32),
]


@pytest.fixture
def kernels(monkeypatch):
    """Turns the persistent forward on (one program per "SM") and records the kernels launched."""
    names, real = [], launch.launch

    def spy(fn, grid, args, kwargs):
        names.append(fn.fn.__name__ if hasattr(fn, "fn") else getattr(fn, "__name__", str(fn)))
        return real(fn, grid, args, kwargs)

    monkeypatch.setattr(fwd, "PERSISTENT", 1)
    monkeypatch.setattr(launch, "launch", spy)
    plan.clear()  # (replayed launches bypass launch.launch on a GPU; the key holds PERSISTENT anyway)
    yield names
    plan.clear()


@pytest.mark.parametrize("B,Sq,Sk,Hq,Hkv,D,causal,dtype", CASES, ids=[case_id(*c) for c in CASES])
def test_persistent_forward_matches_reference(B, Sq, Sk, Hq, Hkv, D, causal, dtype, kernels):
    torch.manual_seed(B + Sq + D)
    q, k, v = random_qkv(B, Sq, Sk, Hq, Hkv, D, dtype, DEVICE)
    out, lse, _ = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    assert "_fwd_persistent_kernel" in kernels and "_fwd_kernel" not in kernels, kernels
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    check_against_reference(q, k, v, out, lse, grads, dout, causal)


@pytest.mark.parametrize("options", [dict(causal=True), dict(softcap=5.0), dict(window_size=(8, 8)),
                                     dict(dropout_p=0.2)], ids=["causal", "softcap", "window", "dropout"])
def test_calls_with_a_variant_keep_the_tile_kernel(options, kernels):
    q, k, v = random_qkv(1, 40, 40, 2, 1, 32, torch.float16, DEVICE, requires_grad=False)
    flash_attn_func(q, k, v, **options)
    assert kernels == ["_fwd_kernel"], kernels


@pytest.mark.parametrize("per_sm", [2, 5])
def test_programs_per_sm_and_a_negative_scale(per_sm, kernels, monkeypatch):
    """Two or more programs per SM (fewer tiles each, or more programs than tiles), and a negative
    softmax scale (the general score path of the key loop)."""
    monkeypatch.setattr(fwd, "PERSISTENT", per_sm)
    q, k, v = random_qkv(2, 90, 77, 4, 2, 32, torch.float16, DEVICE)
    out, lse, _ = flash_attn_func(q, k, v, softmax_scale=-0.3, return_attn_probs=True)
    assert "_fwd_persistent_kernel" in kernels, kernels
    dout = torch.randn_like(out)
    check_against_reference(q, k, v, out, lse, torch.autograd.grad(out, (q, k, v), dout), dout, False,
                            softmax_scale=-0.3)


def test_switch_values(monkeypatch):
    for value, want in (("", 0), ("0", 0), ("off", 0), ("1", 1), ("on", 1), ("2", 2)):
        monkeypatch.setenv("TRITONATTN_FWD_PERSISTENT", value)
        assert configs.env_count("TRITONATTN_FWD_PERSISTENT") == want
    monkeypatch.setenv("TRITONATTN_FWD_PERSISTENT", "many")
    with pytest.raises(ValueError, match="TRITONATTN_FWD_PERSISTENT"):
        configs.env_count("TRITONATTN_FWD_PERSISTENT")


def test_persistent_forward_equals_the_tile_kernel(kernels, monkeypatch):
    """Same numbers as the tile kernel (the same key loop and epilogue), bitwise under the interpreter."""
    q, k, v = random_qkv(2, 100, 90, 4, 2, 64, torch.float16, DEVICE, requires_grad=False)
    persistent = flash_attn_func(q, k, v)
    monkeypatch.setattr(fwd, "PERSISTENT", 0)
    tile = flash_attn_func(q, k, v)
    assert kernels == ["_fwd_persistent_kernel", "_fwd_kernel"], kernels
    if DEVICE == "cpu":
        assert torch.equal(persistent, tile)
    else:
        torch.testing.assert_close(persistent, tile, atol=2e-3, rtol=0)
