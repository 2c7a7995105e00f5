"""torch.compile: the torch.library ops trace with fake tensors, compile with fullgraph=True (no
graph break), and compiled results equal eager ones: dense, packed, variable-length and kv-cache calls."""

import pytest
import torch
from conftest import DEVICE, check_against_reference

from tritonattn import (
    attention,
    attention_varlen,
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
    scaled_dot_product_attention,
)
from tritonattn.inference import kvcache_fwd_op
from tritonattn.ops import attention_fwd_op

F16, F32 = torch.float16, torch.float32
# fp32 on CPU (exact under the interpreter); fp16 on a GPU, where fp32's ieee products compile for minutes
# and this file is about tracing, not precision
DEFAULT = F32 if DEVICE == "cpu" else F16


def _inputs(dtype=DEFAULT):
    torch.manual_seed(0)
    q = torch.randn(2, 33, 4, 32, device=DEVICE, dtype=dtype, requires_grad=True)
    k = torch.randn(2, 40, 2, 32, device=DEVICE, dtype=dtype, requires_grad=True)
    v = torch.randn(2, 40, 2, 32, device=DEVICE, dtype=dtype, requires_grad=True)
    return q, k, v


def _compiled(fn, ops_seen=None):
    """fn under torch.compile(fullgraph=True, backend="aot_eager"); ``ops_seen`` collects the targets
    of the graph dynamo hands to the backend (to check that the tritonattn op is in it)."""
    def backend(gm, example_inputs):
        if ops_seen is not None:
            ops_seen.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, backend=backend)


def _eager_vs_compiled(fn, inputs, op="tritonattn.fwd"):
    """fn returns out or (out, lse, ...): compiled outputs and input gradients (of out) equal eager's
    bitwise, and the graph holds ``op``."""
    seen = set()
    compiled = _compiled(fn, seen)
    outs = []
    for f in (fn, compiled):
        res = f(*inputs)
        res = res if isinstance(res, tuple) else (res,)
        outs.append((res, torch.autograd.grad(res[0].float().sum(), inputs)))
    (res_e, g_e), (res_c, g_c) = outs
    assert any(op in target for target in seen), seen
    for a, b in zip(res_e, res_c):
        assert (a is None and b is None) or torch.equal(a, b)
    for a, b in zip(g_e, g_c):
        assert torch.equal(a, b)


def test_opcheck_forward_op():
    q, k, v = (t.detach().requires_grad_() for t in _inputs())
    args = (q, k, v, None, None, None, None, 32 ** -0.5, None, 0, 0.0, 0.0, 0)
    torch.library.opcheck(attention_fwd_op, args)


def test_ops_replay_the_plans_linked_to_their_keys(monkeypatch):
    """The ops' dense calls without tensor options (what a compiled flash_attn_func / SDPA calls at
    run time) link a key of their arguments to the launchers' plans (ops._op_key): a later call with
    that key replays them without building a Variants (forward) or the launchers' keys (both), and
    gives bitwise a fresh call's results; a call that differs in an option, or the backward's out of
    other strides, takes its own plan."""
    from tritonattn import ops
    from tritonattn.kernels import plan
    from tritonattn.kernels.variants import Variants
    from tritonattn.ops import attention_bwd_op

    q, k, v = (t.detach() for t in _inputs())
    options = [(32 ** -0.5, None, 0, 0.0, 0.0, 0), (0.3, 5, 0, 0.0, 0.0, 0), (0.3, None, None, 4.0, 0.0, 0)]
    plan.clear()
    runs = []
    for opts in options:
        out, lse = attention_fwd_op(q, k, v, None, None, None, None, *opts)  # records and links
        dout = torch.randn_like(out)
        attention_bwd_op(dout, q, k, v, out, lse, None, None, None, None, *opts, False)
        hits = plan.hits
        with monkeypatch.context() as m:
            m.setattr(Variants, "signature", lambda *a: pytest.fail("a launcher built its key"))
            m.setattr(ops, "_variants", lambda *a: pytest.fail("the forward took its full path"))
            got = attention_fwd_op(q, k, v, None, None, None, None, *opts)
        with monkeypatch.context() as m:
            m.setattr(Variants, "signature", lambda *a: pytest.fail("a launcher built its key"))
            grads = attention_bwd_op(dout, q, k, v, *got, None, None, None, None, *opts, False)
        assert plan.hits == hits + 2
        runs.append((opts, dout, got, grads))
    for opts, dout, got, grads in runs:
        plan.clear()
        fresh = attention_fwd_op(q, k, v, None, None, None, None, *opts)
        fresh_grads = attention_bwd_op(dout, q, k, v, *fresh, None, None, None, None, *opts, False)
        assert all(torch.equal(a, b) for a, b in zip((*got, *grads[:3]), (*fresh, *fresh_grads[:3]))), opts
        out_t = fresh[0].transpose(1, 2).contiguous().transpose(1, 2)  # out of other strides, same values
        again = attention_bwd_op(dout, q, k, v, out_t, fresh[1], None, None, None, None, *opts, False)
        assert all(torch.equal(a, b) for a, b in zip(again[:3], fresh_grads[:3])), opts
    # and the replays are right: the first option set (the default scale, win_right 0: causal) against
    # the fp64 reference with the suite's tolerance rule (a fixed atol failed fp16 on the GPU)
    _, dout, got, grads = runs[0]
    check_against_reference(q, k, v, got[0], got[1], grads[:3], dout, causal=True)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_flash_attn_func_compiles_fullgraph(causal):
    _eager_vs_compiled(lambda q, k, v: flash_attn_func(q, k, v, causal=causal, window_size=(8, -1), softcap=5.0),
                       _inputs())


def test_attention_with_bias_grad_compiles():
    q, k, v = _inputs()
    bias = torch.randn(2, 1, 33, 40, device=DEVICE, dtype=DEFAULT, requires_grad=True)
    _eager_vs_compiled(lambda q, k, v, b: attention(q, k, v, bias=b, causal=True), (q, k, v, bias))


def test_sdpa_dropin_compiles():
    torch.manual_seed(1)
    q = torch.randn(2, 4, 20, 16, device=DEVICE, dtype=DEFAULT, requires_grad=True)
    k = torch.randn(2, 2, 24, 16, device=DEVICE, dtype=DEFAULT, requires_grad=True)
    v = torch.randn(2, 2, 24, 16, device=DEVICE, dtype=DEFAULT, requires_grad=True)
    mask = torch.rand(2, 1, 20, 24, device=DEVICE) > 0.3
    _eager_vs_compiled(lambda q, k, v: scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=True,
                                                                    enable_gqa=True), (q, k, v))


# --- packed, variable-length and kv-cache entry points ------------------------------------------

def _cu(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)


LENS_Q, LENS_K = [5, 0, 9, 1], [7, 3, 9, 4]  # an empty query sequence, Sq < Sk and Sq > Sk
CU_Q, CU_K = _cu(LENS_Q), _cu(LENS_K)


def _leaf(*shape, dtype=DEFAULT):
    return torch.randn(*shape, device=DEVICE, dtype=dtype).requires_grad_()


def test_opcheck_forward_op_varlen():
    torch.manual_seed(4)
    q, k, v = _leaf(15, 4, 16), _leaf(23, 2, 16), _leaf(23, 2, 16)
    args = (q, k, v, None, None, None, None, 0.25, None, 0, 0.0, 0.0, 0, CU_Q, CU_K, 9, 9)
    torch.library.opcheck(attention_fwd_op, args)


@pytest.mark.parametrize("packing", ["none", "kv", "qkv"])
def test_varlen_compiles_fullgraph(packing):
    torch.manual_seed(5)
    opts = dict(causal=True, window_size=(4, -1), softcap=6.0, return_attn_probs=True)
    if packing == "none":
        inputs = (_leaf(15, 4, 16), _leaf(23, 2, 16), _leaf(23, 2, 16))
        fn = lambda q, k, v: flash_attn_varlen_func(q, k, v, CU_Q, CU_K, 9, 9, **opts)  # noqa: E731
    elif packing == "kv":
        inputs = (_leaf(15, 4, 16), _leaf(23, 2, 2, 16))
        fn = lambda q, kv: flash_attn_varlen_kvpacked_func(q, kv, CU_Q, CU_K, 9, 9, **opts)  # noqa: E731
    else:
        inputs = (_leaf(23, 3, 2, 16),)
        fn = lambda qkv: flash_attn_varlen_qkvpacked_func(qkv, CU_K, 9, **opts)  # noqa: E731
    _eager_vs_compiled(fn, inputs)  # out, lse (H, total_q), S_dmask (None) and the packed gradients


def test_attention_varlen_bias_grad_compiles():
    torch.manual_seed(8)
    q, k, v = _leaf(15, 4, 16), _leaf(23, 2, 16), _leaf(23, 2, 16)
    bias = _leaf(4, 1, 9, 9)  # per sequence, (B, 1, max_seqlen_q, max_seqlen_k), with its gradient
    _eager_vs_compiled(lambda q, k, v, b: attention_varlen(q, k, v, CU_Q, CU_K, 9, 9, bias=b, causal=True,
                                                           return_lse=True), (q, k, v, bias))


def test_paged_varlen_compiles_fullgraph():
    """flash_attn_varlen_func over paged caches (forward only): the block table goes to the op."""
    torch.manual_seed(9)
    q = torch.randn(15, 4, 16, device=DEVICE, dtype=DEFAULT)
    k_pages, v_pages = (torch.randn(12, 4, 2, 16, device=DEVICE, dtype=DEFAULT) for _ in range(2))
    table = torch.randperm(12).reshape(4, 3).to(torch.int32).to(DEVICE)  # 3 pages of 4 keys each
    fn = lambda q, kp, vp: flash_attn_varlen_func(q, kp, vp, CU_Q, CU_K, 9, 9, causal=True,  # noqa: E731
                                                  return_attn_probs=True, block_table=table)
    seen = set()
    out_e, lse_e, _ = fn(q, k_pages, v_pages)
    out_c, lse_c, _ = _compiled(fn, seen)(q, k_pages, v_pages)
    assert any("tritonattn.fwd" in target for target in seen), seen
    assert torch.equal(out_e, out_c) and torch.equal(lse_e, lse_c)


@pytest.mark.parametrize("packing", ["kv", "qkv"])
def test_packed_compiles_fullgraph(packing):
    torch.manual_seed(6)
    if packing == "kv":
        fn = lambda q, kv: flash_attn_kvpacked_func(q, kv, causal=True, return_attn_probs=True)  # noqa: E731
        inputs = (_leaf(2, 9, 4, 16, dtype=F16), _leaf(2, 13, 2, 2, 16, dtype=F16))
    else:
        slopes = torch.rand(2, device=DEVICE)
        fn = lambda qkv: flash_attn_qkvpacked_func(qkv, causal=True, alibi_slopes=slopes)  # noqa: E731
        inputs = (_leaf(2, 11, 3, 2, 16, dtype=F16),)
    _eager_vs_compiled(fn, inputs)


def _kvcache_case(paged: bool):
    torch.manual_seed(7)
    B, S, Hq, Hkv, D = 2, 24, 4, 2, 16
    k_cache, v_cache = (torch.randn(B, S, Hkv, D, device=DEVICE, dtype=DEFAULT) for _ in range(2))
    extra = {}
    if paged:  # pages of 8 rows, shuffled
        perm = torch.randperm(B * 3).to(DEVICE)
        kp, vp = (torch.empty(B * 3, 8, Hkv, D, device=DEVICE, dtype=DEFAULT) for _ in range(2))
        kp[perm], vp[perm] = k_cache.reshape(B * 3, 8, Hkv, D), v_cache.reshape(B * 3, 8, Hkv, D)
        k_cache, v_cache, extra["block_table"] = kp, vp, perm.reshape(B, 3).to(torch.int32)
    q = torch.randn(B, 3, Hq, D, device=DEVICE, dtype=DEFAULT)
    k_new, v_new = (torch.randn(B, 3, Hkv, D, device=DEVICE, dtype=DEFAULT) for _ in range(2))
    cos, sin = torch.rand(S, 4, device=DEVICE), torch.rand(S, 4, device=DEVICE)
    seqlens = torch.tensor([4, 17], dtype=torch.int32, device=DEVICE)
    return (q, k_cache, v_cache, k_new, v_new, cos, sin, seqlens), extra


def test_opcheck_kvcache_op():
    (q, k_cache, v_cache, k_new, v_new, cos, sin, seqlens), _ = _kvcache_case(paged=False)
    args = (q, k_cache, v_cache, k_new, v_new, cos, sin, seqlens, -1, None, None, None, None, True, -1, 0, 0.0,
            True, None, 1)
    torch.library.opcheck(kvcache_fwd_op, args)


@pytest.mark.parametrize("paged,num_splits", [(False, 0), (False, 1), (True, 0)],
                         ids=["split-kv", "no-split", "paged"])
def test_kvcache_compiles_fullgraph(paged, num_splits):
    """The new keys / values land in the caches in place, compiled as eager; out and lse equal."""
    inputs, extra = _kvcache_case(paged)

    def fn(q, k_cache, v_cache, k, v, cos, sin, seqlens):
        return flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos=cos, rotary_sin=sin,
                                       cache_seqlens=seqlens, causal=True, window_size=(6, -1),
                                       num_splits=num_splits, return_softmax_lse=True, **extra)

    seen = set()
    compiled = _compiled(fn, seen)
    eager_in = [t.clone() for t in inputs]
    out_e, lse_e = fn(*eager_in)
    out_c, lse_c = compiled(*inputs)
    assert any("tritonattn.fwd_kvcache" in target for target in seen), seen
    assert torch.equal(out_e, out_c) and torch.equal(lse_e, lse_c)
    assert torch.equal(eager_in[1], inputs[1]) and torch.equal(eager_in[2], inputs[2])  # the caches
    assert not torch.equal(inputs[1], _kvcache_case(paged)[0][1])  # (the call did write into them)


def test_kvcache_int_seqlens_compiles():
    (q, k_cache, v_cache, *_), _ = _kvcache_case(paged=False)
    fn = lambda q, kc, vc: flash_attn_with_kvcache(q, kc, vc, cache_seqlens=11, causal=True)  # noqa: E731
    assert torch.equal(fn(q, k_cache, v_cache), _compiled(fn)(q, k_cache, v_cache))
