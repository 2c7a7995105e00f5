"""Launch plans (kernels/plan.py): a call whose signature was seen before replays the recorded
launches. Each case records a plan with one set of inputs, replays it with another, and compares
the replay bitwise with a fresh (unplanned) call on the same inputs; the plan counter proves that
the later calls replayed."""

import dataclasses

import pytest
import torch
from conftest import DEVICE, check_against_reference

import tritonattn
from tritonattn import configs, flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
from tritonattn.kernels import plan
from tritonattn.kernels.variants import Variants

F16 = torch.float16


def _randn(gen, *shape, dtype=F16):
    return torch.randn(*shape, generator=gen).to(device=DEVICE, dtype=dtype)


def _dense(extra):
    def make(seed):
        gen = torch.Generator().manual_seed(seed)
        q, k, v = _randn(gen, 2, 37, 4, 40), _randn(gen, 2, 53, 2, 40), _randn(gen, 2, 53, 2, 40)
        kw = dict(extra)
        if kw.pop("alibi", False):
            kw["alibi_slopes"] = torch.rand(2, 4, generator=gen).to(DEVICE)
        if kw.pop("kpm", False):
            kw["key_padding_mask"] = torch.rand(2, 53, generator=gen).to(DEVICE) > 0.3
        if kw.pop("bias", False):
            kw["bias"] = _randn(gen, 2, 1, 37, 53)
        return (q, k, v), kw

    def call(ins, kw):
        torch.manual_seed(0)  # dropout draws its seed from the default generator
        if {"key_padding_mask", "bias"} & set(kw):
            return tritonattn.attention(*ins, **kw)
        return flash_attn_func(*ins, return_attn_probs=True, **kw)[:2]

    return make, call


def _varlen(seed):
    gen = torch.Generator().manual_seed(seed)
    lens_q, lens_k = [5, 0, 17], [9, 3, 20]
    cu_q = torch.tensor([0, 5, 5, 22], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 9, 12, 32], dtype=torch.int32, device=DEVICE)
    q, k, v = _randn(gen, sum(lens_q), 4, 32), _randn(gen, sum(lens_k), 2, 32), _randn(gen, sum(lens_k), 2, 32)
    return (q, k, v, cu_q, cu_k, max(lens_q), max(lens_k)), dict(causal=True)


def _varlen_call(ins, kw):
    return flash_attn_varlen_func(*ins, return_attn_probs=True, **kw)[:2]


def _kvcache(extra):
    def make(seed):
        gen = torch.Generator().manual_seed(seed)
        B, Hq, Hkv, D, S = 3, 8, 2, 32, 96
        kw = dict(extra)
        q = _randn(gen, B, kw.pop("Sq", 1), Hq, D)
        kc, vc = _randn(gen, B, S, Hkv, D), _randn(gen, B, S, Hkv, D)
        seqlens = kw.pop("seqlens")
        kw["cache_seqlens"] = seqlens + seed if isinstance(seqlens, int) else \
            torch.tensor(seqlens, dtype=torch.int32, device=DEVICE) + seed
        if kw.pop("new", False):
            kw["k"], kw["v"] = _randn(gen, B, 1, Hkv, D), _randn(gen, B, 1, Hkv, D)
            kw["rotary_cos"] = torch.rand(S, 8, generator=gen).to(DEVICE, F16)
            kw["rotary_sin"] = torch.rand(S, 8, generator=gen).to(DEVICE, F16)
        if kw.pop("paged", False):
            perm = torch.randperm(B * S // 16, generator=gen).to(DEVICE)
            kw["block_table"] = perm.view(B, S // 16).to(torch.int32)
            kc, vc = kc.reshape(-1, 16, Hkv, D)[perm.argsort()].contiguous(), vc.reshape(-1, 16, Hkv, D)[
                perm.argsort()].contiguous()
        return (q, kc, vc), kw

    def call(ins, kw):
        q, kc, vc = ins
        kw = {key: (val.clone() if key in ("k", "v") else val) for key, val in kw.items()}
        return flash_attn_with_kvcache(q, kc.clone(), vc.clone(), return_softmax_lse=True, **kw)

    return make, call


def _train(make, api):
    """Forward and backward (the backward's launches are planned too); returns out and the grads."""
    def call(ins, kw):
        torch.manual_seed(0)
        leaves = [t.detach().clone().requires_grad_() if isinstance(t, torch.Tensor) and t.is_floating_point()
                  else t for t in ins]
        out = api(*leaves, **kw)
        out = out[0] if isinstance(out, tuple) else out
        dout = torch.ones_like(out).mul_(0.1).add_(out.detach())  # depends on the inputs
        grads = torch.autograd.grad(out, [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad], dout)
        return (out, *grads)

    return make, call


def _qkv_varlen(seed):
    (_, k, v, _, cu_k, _, mk), kw = _varlen(seed)
    qkv = torch.stack([v.flip(0), k, v], dim=1)  # (total, 3, H, D): self-attention, k's lengths
    return (qkv, cu_k, mk), kw


CASES = {
    "dense-causal-gqa": _dense(dict(causal=True)),
    "window-softcap-alibi": _dense(dict(window_size=(9, 3), softcap=20.0, alibi=True)),
    "dropout": _dense(dict(dropout_p=0.2, causal=True)),
    "key-padding-mask": _dense(dict(kpm=True)),
    "bias": _dense(dict(bias=True, causal=True)),
    "varlen": (_varlen, _varlen_call),
    "decode-split-int-seqlens": _kvcache(dict(seqlens=40, causal=True)),
    "decode-one-split": _kvcache(dict(seqlens=[3, 50, 70], num_splits=1)),
    "kvcache-forward-kernel": _kvcache(dict(seqlens=[3, 50, 70], Sq=17, causal=True)),  # 68 rows per kv head
    "decode-paged-append-rotary": _kvcache(dict(seqlens=[0, 33, 80], paged=True, new=True, causal=True)),
    "train-dense-causal-gqa": _train(_dense(dict(causal=True))[0], flash_attn_func),
    "train-dropout-window-softcap-alibi": _train(
        _dense(dict(dropout_p=0.1, window_size=(9, 3), softcap=20.0, alibi=True))[0], flash_attn_func),
    "train-varlen": _train(_varlen, flash_attn_varlen_func),
    "train-varlen-qkvpacked": _train(_qkv_varlen, tritonattn.flash_attn_varlen_qkvpacked_func),
}


@pytest.mark.parametrize("case", list(CASES))
def test_replay_equals_a_fresh_call(case):
    make, call = CASES[case]
    call(*make(1))  # records the plan(s)
    ins, kw = make(2)  # new tensors (and cache lengths), same signature
    hits = plan.hits
    replayed = call(ins, kw)
    again = call(ins, kw)  # on a GPU the second replay goes straight to the compiled kernels
    assert plan.hits >= hits + 2, "the calls with the same signature did not replay"
    plan.clear()
    fresh = call(ins, kw)
    for result in (replayed, again):
        for a, b in zip(result, fresh):
            assert torch.equal(a.nan_to_num(), b.nan_to_num()) and torch.equal(a.isnan(), b.isnan())


def test_one_tensor_in_several_roles_is_not_replayed_for_distinct_ones():
    """A plan recorded for f(x, x, x) must not bind q, k and v to one slot for a later f(q, k, v)."""
    gen = torch.Generator().manual_seed(0)
    x = _randn(gen, 1, 24, 2, 32)
    flash_attn_func(x, x, x, causal=True)
    hits = plan.hits
    flash_attn_func(x, x, x, causal=True)
    assert plan.hits == hits + 1  # the same roles shared: replayed
    q, k, v = _randn(gen, 1, 24, 2, 32), _randn(gen, 1, 24, 2, 32), _randn(gen, 1, 24, 2, 32)
    out = flash_attn_func(q, k, v, causal=True)
    assert plan.hits == hits + 1  # not replayed
    plan.clear()
    assert torch.equal(out, flash_attn_func(q, k, v, causal=True))


def test_forced_config_is_not_replayed_over():
    gen = torch.Generator().manual_seed(0)
    q, k, v = _randn(gen, 1, 40, 2, 32), _randn(gen, 1, 40, 2, 32), _randn(gen, 1, 40, 2, 32)
    flash_attn_func(q, k, v)
    hits = plan.hits
    with configs.override(fwd=configs.TileConfig(16, 16, 4, 1)):
        flash_attn_func(q, k, v)
    assert plan.hits == hits


def test_signature_covers_every_field():
    """Changing any field of Variants changes its signature or its tensors (a plan key that missed a
    field would replay one variant's launches for another); fast_key and free_key alone are not options."""
    base = Variants(softmax_scale=0.5)
    t = torch.zeros(3, dtype=torch.int32)
    other = {"softmax_scale": 0.25, "win_left": 4, "win_right": 0, "softcap": 3.0, "mask_kind": 1,
             "dropout_p": 0.1, "deterministic": True, "max_seqlen_q": 7, "max_seqlen_k": 9, "page_size": 16,
             "kv_page_strides": (1, 2), "need_lse": False}
    for f in dataclasses.fields(Variants):
        if f.name in ("fast_key", "free_key"):  # (not options: an entry point's keys that the launcher links)
            continue
        changed = dataclasses.replace(base, **{f.name: other.get(f.name, t)})
        assert (changed.signature() != base.signature()
                or any(a is not b for a, b in zip(changed.tensors(), base.tensors()))), f.name


def test_launches_of_a_failed_group_are_not_recorded(monkeypatch):
    """A config's launches that belong together (the dK/dV split's dV and dK launches) are recorded
    all or none: when the second raises (out of shared memory), configs.fit retries with another
    tile, and the plan must not keep the first launch of the failed try."""
    from tritonattn.kernels import launch

    def fake(fn, grid, args, kwargs):
        if kwargs.get("fail"):
            raise RuntimeError("out of resources")

    monkeypatch.setattr(launch, "launch", fake)
    x = torch.zeros(4)
    b = plan.Builder(("test-group",), (x,))
    b.launch("first", (1,), (x,), {})
    with pytest.raises(RuntimeError), b.all_or_none():
        b.launch("dv", (1,), (x,), {})
        b.launch("dk", (1,), (x,), {"fail": True})
    with b.all_or_none():
        b.launch("dv-small", (1,), (x,), {})
        b.launch("dk-small", (1,), (x,), {})
    assert [entry[0] for entry in b.launches] == ["first", "dv-small", "dk-small"]


@pytest.mark.parametrize("setting", ["addresses", "hooked", "pointers-off"])
def test_gpu_replay_passes_addresses(monkeypatch, setting):
    """A replay on a GPU (its branch run here with the launches faked): the first replay of an
    alignment launches the tensors and keeps the compiled entries; later replays pass each launch's
    arguments with every tensor replaced by its address (plan.POINTERS), on the plan's device, or
    the tensors where a launch hook (a profiler) is set or POINTERS is off. A misaligned input
    takes another entry."""
    from types import SimpleNamespace

    from tritonattn.kernels import launch

    gen = torch.Generator().manual_seed(0)
    q, k, v = _randn(gen, 2, 37, 4, 40), _randn(gen, 2, 53, 2, 40), _randn(gen, 2, 53, 2, 40)
    plan.clear()
    torch.manual_seed(0)
    flash_attn_func(q, k, v, causal=True, dropout_p=0.1)  # records the plan (the seed an input too)
    (p,) = plan._plans.values()
    # (the plan allocates on the recorded device, here the CPU: the fake device below allocates nowhere)
    device = SimpleNamespace(type="cuda", index=3)
    launched, cached = [], []
    monkeypatch.setattr(launch, "launch", lambda fn, grid, args, kwargs: launched.append((fn, grid, args, kwargs)))
    monkeypatch.setattr(launch, "cached", lambda fn, grid, args, kwargs: cached.append(fn) or ("entry", fn))
    monkeypatch.setattr(launch, "run_cached", lambda entry, grid, args, index=None: replayed.append(
        (entry, grid, args, index)))
    monkeypatch.setattr(launch, "hooked", lambda: setting == "hooked")
    monkeypatch.setattr(plan, "POINTERS", setting != "pointers-off")
    seed = torch.tensor([5], dtype=torch.int64)
    inputs = (q, k, v, None, None, None, seed, *[None] * 6)
    replayed: list = []
    out = p.run(inputs, device)
    assert len(launched) == len(p.launches) >= 1 and not replayed  # the first: Triton's path, kept
    assert all(isinstance(a, torch.Tensor) for _, _, args, _ in launched for a in args if not isinstance(
        a, (int, float, bool, type(None))))
    tensors_of = {id(t): t for t in (q, k, v, seed, *out)}
    for _, _, args, _ in launched:  # every tensor argument is an input or an output of the replay
        assert all(id(a) in tensors_of for a in args if isinstance(a, torch.Tensor))
    out2 = p.run(inputs, device)
    assert len(replayed) == len(launched)
    # what each tensor of the first replay stands for in the second: an input itself, an output
    # the second replay's own
    now = {id(t): t for t in (q, k, v, seed)}
    now.update({id(a): b for a, b in zip(out, out2)})
    for (fn, grid, args, _), (entry, grid2, args2, index) in zip(launched, replayed):
        assert entry == ("entry", fn) and grid2 == grid and index == 3 and len(args2) == len(args)
        for a, b in zip(args, args2):
            if not isinstance(a, torch.Tensor):
                assert type(a) is type(b) and a == b
            elif setting == "addresses":
                assert type(b) is int and b == now[id(a)].data_ptr()
            else:
                assert b is now[id(a)]
    # an input 2 bytes off 16: another compiled entry, taken through Triton's path first
    q_odd = torch.empty(q.numel() + 1, dtype=q.dtype)[1:].view(q.shape).copy_(q)
    n = len(launched)
    p.run((q_odd, *inputs[1:]), device)
    assert len(launched) == 2 * n and len(p.compiled) == 2


def test_inference_calls_replay_through_the_linked_plan(monkeypatch):
    """flash_attn_func's inference calls: the first call with a key (interface._fast_key) takes the
    checks and the launcher, which links the key to its plan; the next call with that key replays the
    plan alone (its checks would raise here). Each case differs from the one before in one part of
    the key only (an option, its type, the strides, the dtype): a key that missed it would replay the
    previous case's launches, which the comparison with a fresh call and the fp64 reference catches."""
    from tritonattn import interface
    from tritonattn.testing import attention_ref, check_close

    def make(seed, dtype=F16, transposed=False):
        gen = torch.Generator().manual_seed(seed)
        q = (_randn(gen, 2, 4, 37, 40, dtype=dtype).transpose(1, 2) if transposed
             else _randn(gen, 2, 37, 4, 40, dtype=dtype))
        return q, _randn(gen, 2, 53, 2, 40, dtype=dtype), _randn(gen, 2, 53, 2, 40, dtype=dtype)

    cases = [(dict(causal=True), {}), (dict(causal=False), {}), (dict(causal=True, window_size=(9, 3)), {}),
             (dict(causal=True, window_size=[9, 3]), {}), (dict(window_size=(9, -1)), {}),
             (dict(causal=True, softcap=5.0), {}), (dict(causal=True, softmax_scale=0.3), {}),
             (dict(causal=True), dict(transposed=True)), (dict(causal=True), dict(dtype=torch.float32))]
    plan.clear()
    results = []
    for i, (kw, how) in enumerate(cases):
        flash_attn_func(*make(i, **how), **kw)  # checks + launcher: records and links
        ins = make(100 + i, **how)
        hits = plan.hits
        with monkeypatch.context() as m:
            m.setattr(interface, "_validated", lambda *a: pytest.fail(f"case {i}: the linked call took the checks"))
            out = flash_attn_func(*ins, **kw)
        assert plan.hits == hits + 1, f"case {i} did not replay"
        results.append((ins, kw, out))
    assert len(plan._links) == len(cases) and len(plan._plans) == len(cases) - 1  # (a list window: the tuple's plan)
    for i, (ins, kw, out) in enumerate(results):
        plan.clear()
        fresh = flash_attn_func(*ins, **kw, return_attn_probs=True)[0]  # the full path
        assert torch.equal(out, fresh), f"case {i}: {kw}"
        ref_kw = dict(kw, window_size=tuple(kw.get("window_size", (-1, -1))))
        ref, _ = attention_ref(*ins, **ref_kw)
        same, _ = attention_ref(*ins, **ref_kw, upcast=False)
        check_close(f"case {i}", out, ref, same, 2)


def test_inference_link_keeps_the_checks_for_other_calls():
    """A linked key covers only calls that match it: another dtype or an option of another type
    takes the checks (which raise), a call that needs gradients takes autograd, and a call with
    one tensor in several roles (not the recorded call's) takes the launcher."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = _randn(gen, 1, 24, 2, 32), _randn(gen, 1, 24, 2, 32), _randn(gen, 1, 24, 2, 32)
    plan.clear()
    for _ in range(2):
        flash_attn_func(q, k, v, causal=True)
        flash_attn_func(q, k, v, softmax_scale=1)
    assert len(plan._links) == 2
    with pytest.raises(TypeError, match="softmax_scale"):  # True == 1, but not a scale
        flash_attn_func(q, k, v, softmax_scale=True)
    with pytest.raises(TypeError, match="dtype"):
        flash_attn_func(q, k.float(), v, causal=True)
    with pytest.raises((TypeError, ValueError), match="window_size"):
        flash_attn_func(q, k, v, causal=True, window_size=(-1, -1, 0))
    qg = q.clone().requires_grad_()
    out = flash_attn_func(qg, k, v, causal=True)
    out.float().sum().backward()
    assert qg.grad is not None and torch.isfinite(qg.grad).all()
    hits = plan.hits
    same = flash_attn_func(q, q, q, causal=True)  # the plan binds q, k and v to three slots: not this call
    assert torch.equal(same, flash_attn_func(q.clone(), q.clone(), q.clone(), causal=True))
    assert plan.hits >= hits


def test_training_calls_replay_through_the_linked_plan(monkeypatch):
    """flash_attn_func's calls that need gradients: the first call with a key (interface._fast_key's
    grad tag) takes the checks and the launcher, which links the key to its plan; the next call with
    that key reuses the first call's checked Variants (interface._GRAD_VARS: its checks would raise
    here), FlashAttnFunction.forward replays the linked plan (its full forward would raise) and the
    backward launcher the plan linked to the entry key and dO's layout (neither builds its key). Each
    case differs from the one before in one part of the key only; outputs and gradients are compared
    bitwise with a fresh full-path call, and with the fp64 reference."""
    from tritonattn import interface, ops

    def make(seed, dtype=F16, transposed=False):
        gen = torch.Generator().manual_seed(seed)
        q = (_randn(gen, 2, 4, 37, 40, dtype=dtype).transpose(1, 2) if transposed
             else _randn(gen, 2, 37, 4, 40, dtype=dtype))
        ins = (q, _randn(gen, 2, 53, 2, 40, dtype=dtype), _randn(gen, 2, 53, 2, 40, dtype=dtype))
        return [t.detach().requires_grad_() for t in ins], _randn(gen, 2, 37, 4, 40, dtype=dtype)

    def step(ins, dout, kw):
        out = flash_attn_func(*ins, **kw)
        return (out, *torch.autograd.grad(out, ins, dout))

    cases = [(dict(causal=True), {}), (dict(causal=False), {}), (dict(causal=True, window_size=(9, 3)), {}),
             (dict(causal=True, softcap=5.0), {}), (dict(causal=True, softmax_scale=0.3), {}),
             (dict(causal=True), dict(transposed=True)), (dict(causal=True), dict(dtype=torch.float32))]
    plan.clear()
    interface._GRAD_VARS.clear()
    results = []
    for i, (kw, how) in enumerate(cases):
        step(*make(i, **how), kw)  # checks + launcher: records and links
        ins, dout = make(100 + i, **how)
        hits = plan.hits
        with monkeypatch.context() as m:
            m.setattr(interface, "_validated", lambda *a: pytest.fail(f"case {i}: the linked call took the checks"))
            m.setattr(ops, "forward", lambda *a: pytest.fail(f"case {i}: the linked call took the launcher"))
            # (the launchers' keys hold it: the backward too replays the plan linked to the entry key)
            m.setattr(Variants, "signature", lambda *a: pytest.fail(f"case {i}: a launcher built its key"))
            got = step(ins, dout, kw)
        assert plan.hits == hits + 2, f"case {i}: the forward and the backward did not both replay"
        results.append((ins, dout, kw, got))
    assert len(interface._GRAD_VARS) == len(cases)
    for i, (ins, dout, kw, got) in enumerate(results):
        plan.clear()
        interface._GRAD_VARS.clear()
        fresh = step(ins, dout, kw)  # the full path
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, fresh):
            assert torch.equal(a, b), f"case {i} {name}: {kw}"
        ref_kw = dict(kw, window_size=tuple(kw.get("window_size", (-1, -1))))
        check_against_reference(*ins, got[0], None, got[1:], dout, **ref_kw)


def test_training_link_keeps_autograd_and_the_checks_for_other_calls():
    """A training call's remembered key covers calls that match it only, and the replay is a real
    autograd node: an input that does not require grad gets none, a dO of other strides takes its
    own backward plan, create_graph still raises, a call under no_grad or of another dtype takes its
    own path (the dtype's checks raise), a dropout call is never remembered (its seed is drawn per
    call)."""
    from tritonattn import interface

    gen = torch.Generator().manual_seed(5)
    q, k, v = (_randn(gen, 1, 24, 2, 32).requires_grad_() for _ in range(3))
    plan.clear()
    interface._GRAD_VARS.clear()
    for _ in range(3):
        out = flash_attn_func(q, k, v, causal=True)
    assert len(interface._GRAD_VARS) == 1 and out.grad_fn is not None
    k2 = k.detach()  # the same key (requires_grad is not in it): the remembered Variants
    out = flash_attn_func(q, k2, v, causal=True)
    dq, dv = torch.autograd.grad(out.float().sum(), (q, v))
    assert k2.grad is None and torch.isfinite(dq).all() and torch.isfinite(dv).all()
    # the backward's link holds dO's layout: a dO of other strides after a contiguous one
    out = flash_attn_func(q, k, v, causal=True)
    d1 = torch.randn_like(out)
    d2 = d1.transpose(1, 2).contiguous().transpose(1, 2)
    g1 = torch.autograd.grad(out, (q, k, v), d1, retain_graph=True)
    g2 = torch.autograd.grad(out, (q, k, v), d2)
    assert all(torch.equal(a, b) for a, b in zip(g1, g2))
    out = flash_attn_func(q, k, v, causal=True)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(out.float().sum(), (q,), create_graph=True)
    with torch.no_grad():
        assert flash_attn_func(q, k, v, causal=True).grad_fn is None
    with pytest.raises(TypeError, match="dtype"):
        flash_attn_func(q, k.detach().float().requires_grad_(), v, causal=True)
    torch.manual_seed(0)
    a = flash_attn_func(q, k, v, dropout_p=0.3)
    b = flash_attn_func(q, k, v, dropout_p=0.3)
    assert not torch.equal(a, b) and len(interface._GRAD_VARS) == 1


@pytest.mark.parametrize("hooked_first", [True, False], ids=["hooked-first", "plain-first"])
def test_training_link_follows_saved_tensor_hooks(hooked_first):
    """A saved-tensor hook (activation offloading: torch.autograd.graph.save_on_cpu, FSDP's offload)
    may give the backward copies of q, k, v of other strides than the forward's: calls with one
    entry key, some hooked, some not (q, k, v non-dense views of a packed projection, the hook's
    copies contiguous), give each the gradients of a fresh full-path call, bitwise (the backward's
    link holds the saved tensors' strides: without them one layout's plan replays on the other)."""
    from tritonattn import interface

    def step(seed, hooked):
        gen = torch.Generator().manual_seed(seed)
        qkv = _randn(gen, 1, 40, 3, 2, 16).requires_grad_()
        dout = _randn(gen, 1, 40, 2, 16)
        q, k, v = qkv.unbind(2)
        if hooked:
            with torch.autograd.graph.saved_tensors_hooks(lambda t: t.contiguous(), lambda t: t):
                out = flash_attn_func(q, k, v, causal=True)
        else:
            out = flash_attn_func(q, k, v, causal=True)
        return torch.autograd.grad(out, (qkv,), dout)[0]

    plan.clear()
    interface._GRAD_VARS.clear()
    order = [hooked_first] * 3 + [not hooked_first] * 2 + [hooked_first]
    got = [step(i, hooked) for i, hooked in enumerate(order)]
    for i, hooked in enumerate(order):
        plan.clear()
        interface._GRAD_VARS.clear()
        assert torch.equal(got[i], step(i, hooked)), f"call {i} (hooked: {hooked})"


def test_inference_lse_nobody_reads_goes_to_a_kept_buffer():
    """An inference call that does not return its lse writes it to one kept buffer (no allocation per
    call; fwd._discarded); a call that returns it gets its own, which later calls do not touch
    (Variants.need_lse is in the plan's key: without it the returning call would replay the kept
    buffer's plan, and the next call would overwrite the lse it returned)."""
    from tritonattn.kernels import fwd
    from tritonattn.testing import attention_ref

    gen = torch.Generator().manual_seed(3)
    q, q2 = _randn(gen, 2, 19, 4, 32), _randn(gen, 2, 19, 4, 32)
    k, v = _randn(gen, 2, 23, 2, 32), _randn(gen, 2, 23, 2, 32)
    plan.clear()
    fwd._discarded.views.clear()
    out = tritonattn.attention(q, k, v, causal=True)  # records the plan without an lse of its own
    assert len(fwd._discarded.views) == 1
    (kept,) = fwd._discarded.views.values()
    out_again, lse = tritonattn.attention(q, k, v, causal=True, return_lse=True)
    assert lse.data_ptr() != kept.data_ptr() and torch.equal(out, out_again)
    for _ in range(2):  # replayed through the kept buffer, with other queries
        flash_attn_func(q2, k, v, causal=True)
        tritonattn.attention(q2, k, v, causal=True)
    assert len(fwd._discarded.views) == 1
    ref_out, ref_lse = attention_ref(q, k, v, causal=True)
    assert torch.allclose(lse, ref_lse.float(), atol=2e-3, rtol=0)
    assert torch.allclose(out.double(), ref_out, atol=2e-3, rtol=0)


def test_unread_lse_buffers_stay_bounded(monkeypatch):
    """Inference calls of many lengths (prefills, varlen batches) share one kept block per stream for
    their unread lse (views of it), not a buffer per shape; a block grows by replacing the old one
    (whose views go); a result over the kept limit is not kept at all."""
    from tritonattn.kernels import fwd

    gen = torch.Generator().manual_seed(4)
    fwd._discarded.views.clear()
    fwd._discarded.blocks.clear()
    monkeypatch.setattr(fwd._discarded, "minimum", 64)  # (lse of 8 bytes per query row here: grows at S = 9, 17)
    for S in range(1, 21):
        x = _randn(gen, 1, S, 2, 8)
        flash_attn_func(x, x, x)
    assert len(fwd._discarded.blocks) == 1
    (base,) = fwd._discarded.blocks.values()
    assert base.numel() == 256 and len(fwd._discarded.views) == 4  # (blocks of 64, 128, 256: the last one's views)
    assert all(t.untyped_storage().data_ptr() == base.data_ptr() for t in fwd._discarded.views.values())
    monkeypatch.setattr(fwd._discarded, "limit", 1024)
    x = _randn(gen, 1, 300, 2, 8)
    views = len(fwd._discarded.views)
    out = flash_attn_func(x, x, x, causal=True)
    assert len(fwd._discarded.views) == views  # not kept
    assert fwd._discarded.blocks[next(iter(fwd._discarded.blocks))] is base
    assert torch.equal(out, flash_attn_func(x, x, x, causal=True, return_attn_probs=True)[0])


def test_masked_inference_calls_replay_through_the_linked_plan(monkeypatch):
    """`attention` with a bool mask or key padding mask, inference: the linked call lays the new mask
    out as the recorded call's was (its view's sizes and strides over the new mask's bytes, whatever
    its storage offset) and skips the checks; each case differs from the one before in the mask's
    role, shape, strides or offset, and is compared with a fresh call and the fp64 reference."""
    from tritonattn import interface
    from tritonattn.testing import attention_ref, check_close

    B, Sq, Sk, Hq, Hkv, D = 2, 21, 33, 4, 2, 16

    def masks(gen, kind):
        keep = lambda *shape: torch.rand(*shape, generator=gen) > 0.3  # noqa: E731
        if kind == "kpm":
            return dict(key_padding_mask=keep(B, Sk).to(DEVICE))
        if kind == "kpm-offset":  # a slice of a larger mask: its storage offset (1 or 2 rows) is not 0
            off = 1 + (gen.initial_seed() >= 100)
            return dict(key_padding_mask=keep(B + 2, Sk).to(DEVICE)[off:off + B])
        if kind == "keys":
            return dict(mask=keep(B, 1, 1, Sk).to(DEVICE))
        if kind == "tile":
            return dict(mask=keep(B, Hq, Sq, Sk).to(DEVICE))
        if kind == "tile-transposed":
            return dict(mask=keep(B, Hq, Sk, Sq).to(DEVICE).transpose(-1, -2))
        if kind == "broadcast":
            return dict(mask=keep(Sq, Sk).to(DEVICE))
        raise AssertionError(kind)

    def make(seed, kind):
        gen = torch.Generator().manual_seed(seed)
        q, k, v = _randn(gen, B, Sq, Hq, D), _randn(gen, B, Sk, Hkv, D), _randn(gen, B, Sk, Hkv, D)
        return (q, k, v), masks(gen, kind)

    cases = [("kpm", {}), ("kpm-offset", {}), ("kpm", dict(causal=True)), ("keys", dict(causal=True)),
             ("tile", dict(causal=True)), ("tile-transposed", dict(causal=True)), ("broadcast", dict(causal=True)),
             ("broadcast", dict(causal=True, window_size=(7, 2)))]
    plan.clear()
    results = []
    for i, (kind, kw) in enumerate(cases):
        ins, m = make(i, kind)
        tritonattn.attention(*ins, **m, **kw)
        ins, m = make(100 + i, kind)
        hits = plan.hits
        with monkeypatch.context() as mp:
            mp.setattr(interface, "_recall", lambda *a: pytest.fail(f"case {i}: the linked call took the checks"))
            out = tritonattn.attention(*ins, **m, **kw)
        assert plan.hits == hits + 1, f"case {i} did not replay"
        results.append((ins, m, kw, out))
    for i, (ins, m, kw, out) in enumerate(results):
        plan.clear()
        assert torch.equal(out, tritonattn.attention(*ins, **m, **kw, return_lse=True)[0]), f"case {i}"
        ref, _ = attention_ref(*ins, **m, **kw)
        same, _ = attention_ref(*ins, **m, **kw, upcast=False)
        check_close(f"case {i}", out, ref, same, 2)
    # a float mask (a bias) or a mask with both arguments: never linked; the checks still raise
    ins, m = make(0, "kpm")
    with pytest.raises(ValueError, match="not both"):
        tritonattn.attention(*ins, mask=m["key_padding_mask"][:, None, None, :], **m)
    with pytest.raises(TypeError, match="bool"):
        tritonattn.attention(*ins, key_padding_mask=m["key_padding_mask"].float())


def test_plan_recorded_at_the_second_call(monkeypatch):
    """The library's default (plan.RECORD_AT = 2): a signature's first call records nothing (no plan,
    no link), its second records (and links), its third replays; all three bitwise equal. The
    decoding route too (flash_attn_with_kvcache)."""
    monkeypatch.setattr(plan, "RECORD_AT", 2)
    gen = torch.Generator().manual_seed(4)
    q, k, v = _randn(gen, 2, 37, 4, 40), _randn(gen, 2, 53, 2, 40), _randn(gen, 2, 53, 2, 40)
    plan.clear()
    hits = plan.hits
    first = flash_attn_func(q, k, v, causal=True)
    assert not plan._plans and not plan._links and plan.hits == hits
    second = flash_attn_func(q, k, v, causal=True)
    assert len(plan._plans) == 1 and len(plan._links) == 1 and plan.hits == hits
    third = flash_attn_func(q, k, v, causal=True)
    assert plan.hits == hits + 1 and not plan._seen
    assert torch.equal(first, second) and torch.equal(first, third)
    q1 = _randn(gen, 2, 1, 4, 40)
    outs = [flash_attn_with_kvcache(q1, k, v, cache_seqlens=40, num_splits=3) for _ in range(3)]
    assert plan.hits == hits + 2 and all(torch.equal(outs[0], o) for o in outs)


@pytest.mark.parametrize("splits", [1, 2], ids=["one-split", "two-splits"])
@pytest.mark.parametrize("dense_decode", [True, False], ids=["decoding-kernel", "forward-kernel"])
def test_growing_shapes_keep_no_plans(dense_decode, splits, monkeypatch):
    """A generation loop's calls over a cache one row longer each step (every signature new) record
    no plan of their shape and link no shape, keeping a bounded set of seen keys. On the forward
    kernel no plan at all; on the decoding kernel (configs.dense_decode) one plan keyed without the
    cache's length (its length, k / v strides and split length are the plan's values), recorded at
    the second call and replayed from the third. Each result is bitwise the launcher's full path."""
    from tritonattn.kernels import decode

    monkeypatch.setattr(plan, "RECORD_AT", 2)
    monkeypatch.setattr(plan, "_MAX_SEEN", 8)
    monkeypatch.setattr(configs, "DENSE_DECODE", dense_decode)
    if splits > 1:  # (caches of up to DECODE_ONE_SPLIT_KEYS rows take one split)
        monkeypatch.setattr(configs, "DECODE_ONE_SPLIT_KEYS", 0)
    gen = torch.Generator().manual_seed(5)
    q = _randn(gen, 1, 1, 4, 32)
    kc, vc = _randn(gen, 1, 2, 300, 32), _randn(gen, 1, 2, 300, 32)  # (B, H, S, D), seen as (B, S, H, D)
    plan.clear()
    outs, hits = [], []
    lengths = range(257, 277)
    for n in lengths:
        hits.append(plan.hits)
        outs.append(flash_attn_func(q, kc[:, :, :n].transpose(1, 2), vc[:, :, :n].transpose(1, 2)))
        # no link of an exact shape; on the decoding kernel the length-free key's (decode.free_key) and
        # that key's with the split count
        assert all(type(key[0]) is tuple for key in plan._links) and len(plan._links) <= 2 * dense_decode
        assert len(plan._seen) <= 8 and len(plan._seen_links) <= 8
        kinds = [key[0] for key in plan._plans]
        assert kinds == (["decode-dense"] if dense_decode and n > lengths[0] else []), kinds
    if dense_decode:  # replayed from the third call, with the split count asked for
        assert hits[2] == hits[1] == hits[0] and hits[-1] == hits[2] + len(lengths) - 3, hits
        (key,) = plan._plans
        assert key[-2] == splits, key
        assert decode._splits(q, kc.transpose(1, 2), 300, 0, False)[0] == splits
    # the launcher's full path, every call
    monkeypatch.setattr(plan, "replay", lambda *args, **kwargs: None)
    monkeypatch.setattr(plan, "linked", lambda *args, **kwargs: None)
    for n, out in zip(lengths, outs):
        assert torch.equal(out, flash_attn_func(q, kc[:, :, :n].transpose(1, 2), vc[:, :, :n].transpose(1, 2))), n


def test_plan_with_values_linked_per_shape(monkeypatch):
    """The dense decoding route's plan (keyed without the cache's length) linked to the entry keys of
    two fixed shapes, called in turn: each linked replay takes its own shape's values (cache length,
    strides, split length), bitwise the full path's result; a third shape seen once links nothing."""
    from tritonattn.kernels import decode

    monkeypatch.setattr(plan, "RECORD_AT", 2)
    monkeypatch.setattr(configs, "DECODE_ONE_SPLIT_KEYS", 0)  # two splits: split_len a value too
    gen = torch.Generator().manual_seed(7)
    q = _randn(gen, 2, 1, 4, 32)
    kc, vc = _randn(gen, 2, 2, 700, 32), _randn(gen, 2, 2, 700, 32)
    shapes = (300, 500)  # two splits each, here and on a GPU; split lengths 160 / 256 under the interpreter

    def call(n):
        return flash_attn_func(q, kc[:, :, :n].transpose(1, 2), vc[:, :, :n].transpose(1, 2), causal=True)

    assert len({decode._splits(q, kc.transpose(1, 2), n, 0, False)[0] for n in (*shapes, 450)}) == 1
    plan.clear()
    outs = {n: [] for n in shapes}
    for _ in range(4):
        for n in shapes:
            outs[n].append(call(n))
    exact = [key for key in plan._links if key[0] == "dense"]  # (the others: the length-free key's links)
    assert len(exact) == 2 and len(plan._links) == 4 and len(plan._plans) == 1, (list(plan._links), list(plan._plans))
    hits = plan.hits
    for n in shapes:
        outs[n].append(call(n))
    assert plan.hits == hits + 2
    call(450)
    assert len(plan._links) == 4
    monkeypatch.setattr(plan, "replay", lambda *args, **kwargs: None)
    monkeypatch.setattr(plan, "linked", lambda *args, **kwargs: None)
    for n in shapes:
        full = call(n)
        assert all(torch.equal(full, out) for out in outs[n]), n


def test_growing_cache_takes_the_length_free_link(monkeypatch):
    """flash_attn_func over a cache one row longer each call (the decoding kernel's route): from the
    length-free plan's link on, calls skip the checks and the launchers (decode.free_key /
    replay_free), each with its own length, strides and split length; where the length changes the
    split count (2, 3, 4 here) one call takes the full path and the link follows the new plan. Every
    result is bitwise the full path's. k / v of different lengths, or q of another head dim, still
    get the checks' errors."""
    from tritonattn import interface

    monkeypatch.setattr(plan, "RECORD_AT", 2)
    monkeypatch.setattr(configs, "DECODE_ONE_SPLIT_KEYS", 0)
    checked = []
    real = interface._validated
    monkeypatch.setattr(interface, "_validated", lambda *a, **kw: checked.append(1) or real(*a, **kw))
    gen = torch.Generator().manual_seed(8)
    q = _randn(gen, 1, 1, 4, 32)  # one kv head: 2 / 3 / 4 splits for 257-512 / 513-768 / 769- keys
    kc, vc = _randn(gen, 1, 1, 1000, 32), _randn(gen, 1, 1, 1000, 32)

    def call(n, m=None):
        return flash_attn_func(q, kc[:, :, :n].transpose(1, 2), vc[:, :, :(m or n)].transpose(1, 2), causal=True)

    plan.clear()
    lengths = list(range(300, 901, 4))
    outs, checks = [], []
    for n in lengths:
        checks.append(len(checked))
        outs.append(call(n))
    per_call = [b - a for a, b in zip(checks, checks[1:] + [len(checked)])]
    # each split count: its first calls take the checks (the plan recorded at its second, linked at its
    # third), then none; never more than four full-path calls per split count
    assert sum(per_call) <= 12, per_call
    for lo, hi in ((360, 512), (580, 768), (840, 900)):
        assert not any(c for n, c in zip(lengths, per_call) if lo <= n <= hi), per_call
    assert sorted(key[-2] for key in plan._plans) == [2, 3, 4], list(plan._plans)
    with pytest.raises(ValueError, match="same"):
        call(700, 701)
    with pytest.raises(ValueError):
        flash_attn_func(q[..., :16], kc[:, :, :700].transpose(1, 2), vc[:, :, :700].transpose(1, 2), causal=True)
    monkeypatch.setattr(plan, "replay", lambda *args, **kwargs: None)
    monkeypatch.setattr(plan, "linked", lambda *args, **kwargs: None)
    for n, out in zip(lengths, outs):
        assert torch.equal(out, call(n)), n


def test_length_free_links_of_interleaved_caches_and_many_layers(monkeypatch):
    """Two generation loops interleaved whose caches take different split counts (1 and 2 here) each
    keep their length-free link (one per split count); and a loop over many layers, which links each
    step's exact shape from its second layer on, keeps them through a full link store (the oldest
    link goes, the ones in use are kept recent). After the first steps no call takes the checks;
    every result is bitwise the full path's."""
    from tritonattn import interface

    monkeypatch.setattr(plan, "RECORD_AT", 2)
    monkeypatch.setattr(plan, "_MAX_PLANS", 6)
    monkeypatch.setattr(configs, "DECODE_ONE_SPLIT_KEYS", 400)  # up to 400 keys: one split
    checked = []
    real = interface._validated
    monkeypatch.setattr(interface, "_validated", lambda *a, **kw: checked.append(1) or real(*a, **kw))
    gen = torch.Generator().manual_seed(9)
    q = _randn(gen, 1, 1, 4, 32)
    caches = [(_randn(gen, 1, 2, 700, 32), _randn(gen, 1, 2, 700, 32)) for _ in range(3)]  # three layers

    def call(layer, n):
        kc, vc = caches[layer]
        return flash_attn_func(q, kc[:, :, :n].transpose(1, 2), vc[:, :, :n].transpose(1, 2))

    plan.clear()
    outs, per_step = [], []
    for step in range(12):  # sequence a from 300 (one split), sequence b from 600 (two), three layers each
        before = len(checked)
        for start in (300, 600):
            for layer in range(3):
                outs.append(((layer, start + step), call(layer, start + step)))
        per_step.append(len(checked) - before)
        assert len(plan._links) <= 6
    assert sum(per_step[4:]) == 0, per_step
    splits = sorted(key[-2] for key in plan._plans)  # one split, and 2 (3 on 132 SMs)
    assert len(splits) == 2 and splits[0] == 1 < splits[1], list(plan._plans)
    monkeypatch.setattr(plan, "replay", lambda *args, **kwargs: None)
    monkeypatch.setattr(plan, "linked", lambda *args, **kwargs: None)
    for (layer, n), out in outs:
        assert torch.equal(out, call(layer, n)), (layer, n)


def test_training_plans_recorded_at_the_second_call(monkeypatch):
    """The library's default for a training loop: the forward's and the backward's plans recorded at
    their second step and replayed from the third, every step's output and gradients bitwise the
    first's."""
    monkeypatch.setattr(plan, "RECORD_AT", 2)
    gen = torch.Generator().manual_seed(6)
    q, k, v = (_randn(gen, 2, n, h, 40).requires_grad_() for n, h in ((37, 4), (53, 2), (53, 2)))
    dout = _randn(gen, 2, 37, 4, 40)
    plan.clear()
    steps, hits = [], []
    for _ in range(4):
        hits.append(plan.hits)
        out = flash_attn_func(q, k, v, causal=True)
        steps.append((out, *torch.autograd.grad(out, (q, k, v), dout)))
    assert hits[0] == hits[1] == hits[2] and hits[3] >= hits[2] + 2, hits  # both replayed from the third step
    assert {key[0] for key in plan._plans} >= {"fwd", "bwd"}, list(plan._plans)
    for later in steps[1:]:
        assert all(torch.equal(a, b) for a, b in zip(steps[0], later))
