"""configs.fit: a tile config that needs more shared memory than the device has is shrunk, not a crash."""

import logging

import pytest
import torch
from conftest import DEVICE
from triton.runtime.errors import OutOfResources

from tritonattn import configs
from tritonattn.configs import TileConfig as C


def _fake_run(limit_bytes, seen):
    """A launcher whose kernel needs (block_m + block_n) * 128 * 2 * stages bytes (a made-up model)."""

    def run(cfg):
        seen.append(cfg)
        need = (cfg.block_m + cfg.block_n) * 128 * 2 * cfg.num_stages
        if need > limit_bytes:
            raise OutOfResources(need, limit_bytes, "shared memory")

    return run


def test_fit_shrinks_step_by_step_and_remembers(caplog, monkeypatch):
    monkeypatch.setattr(configs, "_FITTED", {})
    seen = []
    run = _fake_run(60_000, seen)
    with caplog.at_level(logging.WARNING, logger="tritonattn"):
        got = configs.fit("fwd", C(128, 128, 8, 3), {"A": 1}, "bf16", run)
    # stages 3 -> 2, then halve the key block until it fits: (128+32)*256*2 = 81920 > 60000, (128+16) too
    assert seen[:3] == [C(128, 128, 8, 3), C(128, 128, 8, 2), C(128, 64, 8, 2)]
    assert got == seen[-1] and (got.block_m + got.block_n) * 256 * got.num_stages <= 60_000
    assert "does not fit" in caplog.text
    # the next call with the same flags starts from the config that fits: one launch
    seen.clear()
    assert configs.fit("fwd", C(128, 128, 8, 3), {"A": 1}, "bf16", run) == got and seen == [got]
    # other flags are a different kernel: searched again
    seen.clear()
    configs.fit("fwd", C(128, 128, 8, 3), {"A": 2}, "bf16", run)
    assert seen[0] == C(128, 128, 8, 3)


def test_fit_gives_up_with_the_error():
    with pytest.raises(OutOfResources):
        configs.fit("fwd", C(16, 16, 4, 1), {}, "bf16", _fake_run(10, []))


def test_fit_passes_other_errors_through():
    def run(cfg):
        raise ValueError("not a resource problem")

    with pytest.raises(ValueError, match="not a resource"):
        configs.fit("fwd", C(64, 64, 4, 2), {}, "bf16", run)


def test_launch_cache_key_of_arguments():
    """The launch cache's argument key: ints by what Triton specializes them on, tensors by dtype
    and 16-byte alignment (what Triton specializes pointers on), tensor subclasses like plain
    tensors, anything else by type."""
    import torch

    from tritonattn.kernels.launch import _args_key, _key_of, int_class

    t = torch.zeros(64)
    args = (t, t[1:], torch.nn.Parameter(torch.zeros(8, dtype=torch.float16)), 16, 1, 7, 2.5, None, True, 1 << 40)
    key = _args_key(args)
    assert key == tuple(map(_key_of, args))
    assert key[:6] == ((torch.float32, True), (torch.float32, False), (torch.float16, True), int_class(16),
                       int_class(1), int_class(7))
    assert key[6:9] == (float, None, bool)
    assert len({int_class(a) for a in (16, 1, 7, 1 << 40)}) == 4
    assert int_class(7) == int_class(1001) and int_class(16) == int_class(4096)  # a growing length: one kernel


def test_launch_cache_int_classes_follow_triton():
    """Two integers with one :func:`launch.int_class` must specialize alike in Triton (what it
    compiles a kernel for); each class Triton tells apart must be told apart here too, or a cached
    kernel would be launched with an integer it was not compiled for (a wrong 1-specialization or
    divisibility assumption, a 64-bit value in a 32-bit argument)."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    from tritonattn.kernels.launch import _args_key, int_class

    edges = [0, 1, 2, 15, 16, 17, 31, 32, 48, 4095, 4096, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16, 2**32,
             2**32 + 1, 2**63 - 16, 2**63 - 1, 2**63, 2**63 + 16, 2**64 - 1]
    values = sorted({s * v for v in edges for s in (1, -1) if -(2**63) <= s * v < 2**64} | set(range(-40, 70)))
    seen = {}
    for a in values:
        spec = native_specialize_impl(BaseBackend, a, False, True, True)
        assert _args_key((a,)) == (int_class(a),)
        assert seen.setdefault(int_class(a), spec) == spec, (a, spec, seen[int_class(a)])
    assert len(seen) == len(set(seen.values()))  # and no class split finer than Triton's


def test_launch_cache_tail_takes_defaults():
    """The launch cache hands the C launcher every parameter after the runtime arguments: from the
    launch's keywords, else the parameter's default; one with neither is a KeyError naming it (a
    constexpr left at its default once made every cached Gluon dK/dV launch raise KeyError)."""
    import triton
    import triton.language as tl

    from tritonattn.kernels.launch import tail_values

    @triton.jit
    def kern(X, n, A: tl.constexpr, B: tl.constexpr = 3, C: tl.constexpr = None):
        pass

    assert tail_values(kern, 2, {"A": 1, "num_warps": 4}) == (1, 3, None)
    assert tail_values(kern, 2, {"A": 1, "B": 5, "C": 7}) == (1, 5, 7)
    with pytest.raises(KeyError, match="A"):
        tail_values(kern, 2, {"B": 5})


def test_heads_first_rule(monkeypatch):
    """Heads-first program order: only for banded (causal / right-window) calls, forced by
    configs.HEADS_FIRST when set, else on a GPU when K and V of every head fit in L2."""
    from types import SimpleNamespace

    monkeypatch.setattr(configs, "_l2_bytes", lambda index: 50 * 2**20)

    def k_of(numel, elem=2, cuda=True):
        return SimpleNamespace(is_cuda=cuda, numel=lambda: numel, element_size=lambda: elem,
                               device=SimpleNamespace(index=0))

    llama_2048 = 4 * 2048 * 8 * 128  # B=4, S=2048, Hkv=8, D=128: K + V = 32 MiB in bf16
    monkeypatch.setattr(configs, "HEADS_FIRST", None)
    assert configs.heads_first(True, k_of(llama_2048), 128)
    assert not configs.heads_first(True, k_of(4 * llama_2048), 128)  # S=8192: 128 MiB
    assert not configs.heads_first(False, k_of(llama_2048), 128)  # no band: every block the same work
    assert not configs.heads_first(True, k_of(llama_2048, cuda=False), 128)
    monkeypatch.setattr(configs, "HEADS_FIRST", True)
    assert configs.heads_first(True, k_of(4 * llama_2048), 128) and not configs.heads_first(False, k_of(1), 128)
    monkeypatch.setattr(configs, "HEADS_FIRST", False)
    assert not configs.heads_first(True, k_of(llama_2048), 128)
    # more batch x heads than a grid's y axis holds: heads first whatever else holds
    assert configs.heads_first(False, k_of(1, cuda=False), 65536)
    assert not configs.heads_first(False, k_of(1, cuda=False), 65535)


def test_getenv_follows_os_environ(monkeypatch):
    """configs.getenv (the launchers' per-call read of their switches, without os.environ.get's cost
    for an unset name) sees what os.environ holds at each call: unset, set, changed, deleted,
    non-ASCII values, monkeypatch, and an os.environ that was replaced (then os.environ.get)."""
    import os

    name = "TRITONATTN_TEST_GETENV"
    monkeypatch.delenv(name, raising=False)
    assert configs.getenv(name) is None
    for value in ("1", "", " all ", "\u00e9t\u00e9"):
        monkeypatch.setenv(name, value)
        assert configs.getenv(name) == value == os.environ.get(name)
    os.environ[name] = "2"
    assert configs.getenv(name) == "2"
    del os.environ[name]
    assert configs.getenv(name) is None
    monkeypatch.setattr(os, "environ", {name: "replaced"})
    assert configs.getenv(name) == "replaced" and configs.env_flag(name)


def test_env_flag_spellings(monkeypatch):
    """Default-on switches (TRITONATTN_BWD_TMA) are turned off by the usual spellings of "off"."""
    for off in ("", "0", "false", "False", "OFF", "no", " 0 "):
        monkeypatch.setenv("TRITONATTN_TEST_FLAG", off)
        assert configs.env_flag("TRITONATTN_TEST_FLAG", default=True) is False
    for on in ("1", "true", "yes", "on"):
        monkeypatch.setenv("TRITONATTN_TEST_FLAG", on)
        assert configs.env_flag("TRITONATTN_TEST_FLAG") is True
    monkeypatch.delenv("TRITONATTN_TEST_FLAG")
    assert configs.env_flag("TRITONATTN_TEST_FLAG", default=True) is True


def test_dkdv_tile_depends_on_tma(monkeypatch):
    """The table's dK/dV tiles were tuned with TMA; a backward through pointers (a head dim that is
    not a power of two, TRITONATTN_BWD_TMA=0, another GPU) takes the pointer path's measured tile
    where it differs, with the same shared-memory caps for a bias / dropout."""
    monkeypatch.setattr(configs, "_on_device", lambda q: True)
    q = torch.empty(1, 1, 1, 96, dtype=torch.bfloat16)
    for causal in (False, True):
        with_tma = configs.backward_dkdv_config(q, causal, tma=True)
        without = configs.backward_dkdv_config(q, causal, tma=False)
        assert with_tma == configs.table_configs()["bwd_dkdv"][(128, 2, causal)]
        assert without == configs.table_configs(tma=False)["bwd_dkdv"][(128, 2, causal)]
    assert configs.backward_dkdv_config(q, True, tma=False) == configs._POINTER_DKDV[(128, True)]
    assert configs.backward_dkdv_config(q, True, tma=False) != configs.backward_dkdv_config(q, True, tma=True)
    assert configs.backward_dkdv_config(q, True, extra_smem=True, tma=False).num_stages <= 2
    q256 = torch.empty(1, 1, 1, 192, dtype=torch.float16)
    assert configs.backward_dkdv_config(q256, False, tma=False) == configs._POINTER_DKDV[(256, False)]
    assert configs.backward_dkdv_config(q256, False, extra_smem=True, tma=False).block_n <= 64
    # fp32 and forced configs do not use the pointer entries
    q32 = torch.empty(1, 1, 1, 128, dtype=torch.float32)
    assert configs.backward_dkdv_config(q32, True, tma=False) == configs.backward_dkdv_config(q32, True, tma=True)
    with configs.override(bwd_dkdv=configs.TileConfig(16, 32, 4, 1)):
        assert configs.backward_dkdv_config(q, True, tma=False) == configs.TileConfig(16, 32, 4, 1)


def test_short_causal_tiles(monkeypatch):
    """Causal calls of at most SHORT_SEQLEN queries and keys take the short-sequence tiles (forward at
    D=64 / 128, backward at D=128, measured at S=512 / 1024); longer ones, non-causal ones, fp32 and
    head dims without a measured entry keep the table's; a forced config and the shared-memory caps
    still win; backward tiles of calls without descriptors stay the pointer path's / the table's."""
    monkeypatch.setattr(configs, "_on_device", lambda q: True)
    tables = configs.table_configs()
    table = tables["fwd"]
    short = configs._SHORT_CAUSAL["fwd"][128]
    q = torch.empty(1, 1, 1, 96, dtype=torch.bfloat16)
    assert short != table[(128, 2, True)]
    assert configs.forward_config(q, True, seqlen=configs.SHORT_SEQLEN) == short
    assert configs.forward_config(q, True, seqlen=1) == short
    assert configs.forward_config(q, True, seqlen=configs.SHORT_SEQLEN + 1) == table[(128, 2, True)]
    assert configs.forward_config(q, True) == table[(128, 2, True)]  # length not given
    assert configs.forward_config(q, False, seqlen=512) == table[(128, 2, False)]
    assert configs.forward_config(q.float(), True, seqlen=512) == table[(128, 4, True)]
    q64 = q[..., :64]
    assert configs.forward_config(q64, True, seqlen=512) == configs._SHORT_CAUSAL["fwd"][64] != table[(64, 2, True)]
    q256 = torch.empty(1, 1, 1, 256, dtype=torch.float16)
    assert configs.forward_config(q256, True, seqlen=512) == table[(256, 2, True)]
    assert configs.forward_config(q, True, extra_smem=True, seqlen=512) == short
    assert table[(128, 2, True)].block_n == 128  # the long tile's key block is capped for a bias / dropout
    assert configs.forward_config(q, True, extra_smem=True, seqlen=2048) == table[(128, 2, True)]._replace(block_n=64)
    with configs.override(fwd=C(32, 32, 4, 1)):
        assert configs.forward_config(q, True, seqlen=512) == C(32, 32, 4, 1)
    # backward
    for mode, get in (("bwd_dkdv", configs.backward_dkdv_config), ("bwd_dq", configs.backward_dq_config)):
        short_b = configs._SHORT_CAUSAL[mode][128]
        assert short_b != tables[mode][(128, 2, True)]
        assert get(q, True, seqlen=1000) == short_b
        assert get(q, True, seqlen=1025) == tables[mode][(128, 2, True)]
        assert get(q, True) == tables[mode][(128, 2, True)]
        assert get(q, False, seqlen=512) == tables[mode][(128, 2, False)]
        assert get(q.float(), True, seqlen=512) == tables[mode][(128, 4, True)]
        assert get(q64, True, seqlen=512) == tables[mode][(64, 2, True)]
        assert get(q, True, extra_smem=True, seqlen=512) == short_b  # two stages already
        with configs.override(**{mode: C(16, 32, 4, 1)}):
            assert get(q, True, seqlen=512) == C(16, 32, 4, 1)
    assert configs.backward_dkdv_config(q, True, tma=False, seqlen=512) == configs._POINTER_DKDV[(128, True)]
    assert configs.backward_dkdv_config(q, True, atomic_dq=True, seqlen=512) == configs._ATOMIC_DKDV[128]
    monkeypatch.setattr(configs, "_on_device", lambda q: False)  # the interpreter's tile
    assert configs.forward_config(q, True, seqlen=512) == configs._INTERP["fwd"]
    assert configs.backward_dq_config(q, True, seqlen=512) == configs._INTERP["bwd_dq"]


def test_short_wide_forward_tile(monkeypatch):
    """Plain forwards (no causal mask, no variant, no kv cache) of at most SHORT_SEQLEN queries and keys with
    at least WIDE_PROGRAMS 128-row query tiles take their own tile; fewer tiles, longer, causal or
    not plain calls, fp32, other head dims and a forced config keep what they had."""
    monkeypatch.setattr(configs, "_on_device", lambda q: True)
    table = configs.table_configs()["fwd"]
    wide = configs._SHORT_WIDE_FWD[128]
    assert wide != table[(128, 2, False)]
    q = torch.empty(1, 1, 1, 128, dtype=torch.bfloat16).expand(32, 512, 16, 128)  # 2048 tiles

    def pick(q, causal=False, seqlen=512, plain=True, **kw):
        return configs.forward_config(q, causal, seqlen=seqlen, plain=plain, **kw)

    assert pick(q) == wide
    # one tile fewer than WIDE_PROGRAMS (2047 x 128 rows x 1 head / 128)
    assert pick(torch.empty(1, 1, 1, 128, dtype=torch.bfloat16).expand(2047, 128, 1, 128)) == table[(128, 2, False)]
    assert pick(q, plain=False) == table[(128, 2, False)]  # a variant or a kv cache
    assert pick(q, seqlen=configs.SHORT_SEQLEN + 1) == table[(128, 2, False)]
    assert pick(q, seqlen=0) == table[(128, 2, False)]  # length not given
    assert pick(q, causal=True) == configs._SHORT_CAUSAL["fwd"][128]
    assert pick(q.float()) == table[(128, 4, False)]
    assert pick(q[..., :64]) == table[(64, 2, False)]
    assert pick(q[..., :96]) == wide  # pads to 128
    with configs.override(fwd=C(32, 32, 4, 1)):
        assert pick(q) == C(32, 32, 4, 1)
    monkeypatch.setattr(configs, "_on_device", lambda q: False)
    assert pick(q) == configs._INTERP["fwd"]


def test_batch_invariant_switch_turns_off_the_length_tiles(monkeypatch):
    """TRITONATTN_BATCH_INVARIANT: no short or wide tile; every mode takes the table's tile."""
    monkeypatch.setattr(configs, "_on_device", lambda q: True)
    table = configs.table_configs()
    q = torch.empty(1, 1, 1, 128, dtype=torch.bfloat16).expand(32, 512, 16, 128)  # 2048 tiles
    assert configs.forward_config(q, False, seqlen=512, plain=True) == configs._SHORT_WIDE_FWD[128]
    assert configs.forward_config(q, True, seqlen=512) == configs._SHORT_CAUSAL["fwd"][128]
    assert configs.backward_dq_config(q, True, seqlen=512) == configs._SHORT_CAUSAL["bwd_dq"][128]
    monkeypatch.setattr(configs, "BATCH_INVARIANT", True)
    for causal in (False, True):
        assert configs.forward_config(q, causal, seqlen=512, plain=True) == table["fwd"][(128, 2, causal)]
        assert configs.backward_dq_config(q, causal, seqlen=512) == table["bwd_dq"][(128, 2, causal)]
        assert configs.backward_dkdv_config(q, causal, seqlen=512) == table["bwd_dkdv"][(128, 2, causal)]


def test_plain_variants():
    """Variants.plain (what the wide tile asks for) is False for every option but the scale and
    varlen's sequence offsets."""
    from tritonattn.kernels.variants import MASK_KEYS, Variants

    assert Variants(softmax_scale=0.1).plain
    t = torch.zeros(2, dtype=torch.int32)
    assert Variants(softmax_scale=0.1, cu_seqlens_q=t, cu_seqlens_k=t).plain
    for options in (dict(win_right=0), dict(win_left=8), dict(softcap=5.0), dict(alibi_slopes=torch.ones(2)),
                    dict(bias=torch.zeros(1)), dict(mask=t, mask_kind=MASK_KEYS), dict(dropout_p=0.1),
                    dict(kv_lens=t), dict(block_table=t), dict(cu_seqlens_q=t, cu_seqlens_k=t, block_table=t)):
        assert not Variants(softmax_scale=0.1, **options).plain, options


def test_forward_launcher_passes_plain(monkeypatch):
    """attention_forward tells forward_config whether the call is plain (what the wide short tile may
    take): dense calls of two or more sequences only, as the tile follows the call's tile count and a
    packed sequence must get what its own dense call of one sequence gets."""
    from tritonattn import flash_attn_func, flash_attn_varlen_func

    seen, real = [], configs.forward_config

    def spy(*args, **kwargs):
        seen.append(kwargs.get("plain"))
        return real(*args, **kwargs)

    monkeypatch.setattr(configs, "forward_config", spy)
    q = torch.randn(2, 20, 2, 16, dtype=torch.float16, device=DEVICE)
    flash_attn_func(q, q, q)
    flash_attn_func(q, q, q, causal=True)
    flash_attn_func(q, q, q, softcap=3.0)
    flash_attn_func(q[:1], q[:1], q[:1])  # one sequence
    cu = torch.tensor([0, 20, 40], dtype=torch.int32, device=DEVICE)
    qp = q.reshape(40, 2, 16)
    flash_attn_varlen_func(qp, qp, qp, cu, cu, 20, 20)  # varlen: a class's first and last length
    assert seen == [True, False, False, False, False, False]


def test_backward_launcher_passes_the_longest_length(monkeypatch):
    """The backward asks for its dK/dV and dQ tiles with max(seqlen_q, seqlen_k) (varlen: once per
    length class at its first and last length, here one class: 1 and the longest max_seqlen)."""
    from tritonattn import flash_attn_func, flash_attn_varlen_func

    seen = []
    for name in ("backward_dkdv_config", "backward_dq_config"):
        real = getattr(configs, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            seen.append((_name, kwargs.get("seqlen")))
            return _real(*args, **kwargs)

        monkeypatch.setattr(configs, name, spy)
    q = torch.randn(1, 37, 2, 16, dtype=torch.float16, device=DEVICE, requires_grad=True)
    k = torch.randn(1, 50, 1, 16, dtype=torch.float16, device=DEVICE, requires_grad=True)
    flash_attn_func(q, k, k, causal=True).sum().backward()
    assert sorted(seen) == [("backward_dkdv_config", 50), ("backward_dq_config", 50)]
    seen.clear()
    q2 = torch.randn(1, 61, 2, 16, dtype=torch.float16, device=DEVICE, requires_grad=True)  # more queries than keys
    flash_attn_func(q2, k, k).sum().backward()
    assert sorted(seen) == [("backward_dkdv_config", 61), ("backward_dq_config", 61)]
    seen.clear()
    cu = torch.tensor([0, 30, 37], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 20, 50], dtype=torch.int32, device=DEVICE)
    flash_attn_varlen_func(q[0], k[0], k[0], cu, cu_k, 30, 40, causal=True).sum().backward()
    assert sorted(seen) == [("backward_dkdv_config", 1), ("backward_dkdv_config", 40), ("backward_dq_config", 1),
                            ("backward_dq_config", 40)]


def test_forward_launcher_passes_the_longest_length(monkeypatch):
    """attention_forward asks for its tile with max(seqlen_q, seqlen_k): for varlen once per length
    class at its first and last length (here one class: 1 and the longest max_seqlen), the cache's
    capacity for a kv cache, the block table's span for a paged one (whose k is one page)."""
    from tritonattn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

    seen, real = [], configs.forward_config

    def spy(q, causal, extra_smem=False, seqlen=0, plain=False):
        seen.append((causal, seqlen))
        return real(q, causal, extra_smem, seqlen, plain)

    monkeypatch.setattr(configs, "forward_config", spy)
    q = torch.randn(1, 37, 2, 16, dtype=torch.float16, device=DEVICE)
    k = torch.randn(1, 50, 1, 16, dtype=torch.float16, device=DEVICE)
    flash_attn_func(q, k, k, causal=True)
    flash_attn_func(k.expand(1, 50, 2, 16), q[:, :, :1], q[:, :, :1])
    assert seen == [(True, 50), (False, 50)]
    seen.clear()
    cu = torch.tensor([0, 30, 37], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 20, 50], dtype=torch.int32, device=DEVICE)
    flash_attn_varlen_func(q[0], k[0], k[0], cu, cu_k, 30, 40, causal=True)  # max_seqlen_k above the longest
    assert seen == [(True, 1), (True, 40)]
    seen.clear()
    qd = torch.randn(2, 40, 2, 16, dtype=torch.float16, device=DEVICE)  # 80 query rows per kv head: the forward kernel
    cache = torch.randn(2, 300, 1, 16, dtype=torch.float16, device=DEVICE)
    flash_attn_with_kvcache(qd, cache, cache, cache_seqlens=250, causal=True)
    pages = torch.randn(12, 16, 1, 16, dtype=torch.float16, device=DEVICE)
    table = torch.arange(12, dtype=torch.int32, device=DEVICE).view(2, 6)
    flash_attn_with_kvcache(qd, pages, pages, cache_seqlens=90, block_table=table, causal=True)
    assert seen == [(True, 300), (True, 6 * 16)]
