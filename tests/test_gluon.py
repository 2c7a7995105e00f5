"""Which calls the Gluon sm_90 kernels serve: the forward (kernels.fwd._gluon_ok) and the backward's
dK/dV kernel (kernels.bwd._gluon_ok), decided on CPU tensors as if they were on an sm_90 GPU. The
interpreter cannot run Gluon: the kernels' sm_90 compile is checked by test_compile_sm90.py, their
results by the GPU tier (test_gpu.py::test_gluon_*)."""

import functools
import math

import pytest
import torch
from conftest import DEVICE, set_env

from tritonattn import configs
from tritonattn.kernels import bwd, fwd
from tritonattn.kernels.variants import MASK_KEYS, Variants

SCALE = 128 ** -0.5


def qkv(B=2, Sq=2048, Sk=2048, Hq=8, Hkv=2, D=128, dtype=torch.bfloat16):
    return (torch.empty(B, Sq, Hq, D, dtype=dtype), torch.empty(B, Sk, Hkv, D, dtype=dtype),
            torch.empty(B, Sk, Hkv, D, dtype=dtype))


MODES = {"fwd": fwd, "bwd_dkdv": bwd}  # the configs mode of each kernel, and the module that launches it
TILES = {"fwd": fwd.fwd_sm90.TILES, "bwd_dkdv": bwd.bwd_sm90.TILES}  # the head dims each kernel has tiles for


@pytest.fixture(params=list(MODES))
def gluon(request, monkeypatch):
    """The rule of one Gluon kernel: ok(q, k, v, var, sm90); the backward's dO, lse, dK and dV are
    fresh tensors of the usual layouts (test_dkdv_refuses_layouts varies them)."""
    mode = request.param
    monkeypatch.setattr(MODES[mode], "GLUON", True)
    monkeypatch.setattr(configs, "BATCH_INVARIANT", False)

    def ok(q, k, v, var=None, sm90=True):
        var = var or Variants(softmax_scale=SCALE)
        if mode == "fwd":
            return fwd._gluon_ok(q, k, v, var, sm90)
        B, Sq, Hq = (q.shape[0], q.shape[1], q.shape[2]) if q.dim() == 4 else (1, q.shape[0], q.shape[1])
        return bwd._gluon_ok(q, k, v, torch.empty_like(q), torch.empty(B, Hq, Sq), torch.empty_like(k),
                             torch.empty_like(v), var, sm90)

    ok.mode = mode
    return ok


def test_serves_plain_causal_and_right_edges(gluon):
    assert gluon(*qkv())
    assert gluon(*qkv(dtype=torch.float16))
    for right in (0, -300, 700):  # causal, SDPA's top-left causal with Sq < Sk, a right edge past the diagonal
        assert gluon(*qkv(Sk=3000), Variants(softmax_scale=SCALE, win_right=right))
    assert gluon(*qkv(Sq=1, Sk=4096))  # one query against a long cache, dense
    assert gluon(*qkv(Sq=4096, Sk=1, Hkv=1))
    # from configs.GLUON_MIN_SEQLEN[mode][head dim]: (without, with) a mask, for each head dim of the
    # kernel's tiles (and only those)
    lengths = configs.GLUON_MIN_SEQLEN[gluon.mode]
    assert set(lengths) == set(TILES[gluon.mode])
    for D, (full, masked) in lengths.items():
        assert gluon(*qkv(Sq=full, Sk=full, D=D)), D
        assert not gluon(*qkv(Sq=full - 1, Sk=full - 1, D=D)), D
        if masked == math.inf:  # never with a mask (the dK / dV kernel at D=64): not even at 8192
            assert not gluon(*qkv(Sq=8192, Sk=8192, D=D), Variants(softmax_scale=SCALE, win_right=0)), D
            continue
        assert gluon(*qkv(Sq=masked, Sk=masked, D=D), Variants(softmax_scale=SCALE, win_right=0)), D
        assert not gluon(*qkv(Sq=masked - 1, Sk=masked - 1, D=D), Variants(softmax_scale=SCALE, win_right=0)), D


@pytest.mark.parametrize("case", ["cpu", "off", "batch-invariant", "forced-tile", "D64", "D96", "D256", "fp32", "short",
                                  "short-causal", "no-keys", "left-edge", "softcap", "alibi", "bias", "mask",
                                  "dropout", "varlen", "kvcache", "misaligned-rows", "negative-scale"])
def test_refuses(gluon, monkeypatch, case):
    q, k, v = qkv()
    var = Variants(softmax_scale=SCALE)
    sm90 = True
    if case == "cpu":
        sm90 = False
    elif case == "off":
        monkeypatch.setattr(MODES[gluon.mode], "GLUON", False)
    elif case == "batch-invariant":
        monkeypatch.setattr(configs, "BATCH_INVARIANT", True)
    elif case == "forced-tile":
        monkeypatch.setitem(configs._override, gluon.mode, configs.TileConfig(128, 64, 8, 2))
    elif case in ("D64", "D96", "D256"):  # a head dim without a tile; with one, one key short of its length
        D = int(case[1:])
        S = configs.GLUON_MIN_SEQLEN[gluon.mode].get(D, (2049,))[0] - 1
        q, k, v = qkv(Sq=S, Sk=S, D=D)
    elif case == "fp32":
        q, k, v = qkv(dtype=torch.float32)
    elif case == "short":
        full = configs.GLUON_MIN_SEQLEN[gluon.mode][128][0]
        q, k, v = qkv(Sq=full - 1, Sk=full - 1)
    elif case == "short-causal":
        masked = configs.GLUON_MIN_SEQLEN[gluon.mode][128][1]
        q, k, v = qkv(Sq=masked - 1, Sk=masked - 1)
        var.win_right = 0
    elif case == "no-keys":
        q, k, v = qkv(Sk=0)
    elif case == "left-edge":
        var.win_left, var.win_right = 100, 0
    elif case == "softcap":
        var.softcap = 30.0
    elif case == "alibi":
        var.alibi_slopes = torch.rand(8)
    elif case == "bias":
        var.bias = torch.empty(1).expand(2, 8, 2048, 2048)
    elif case == "mask":
        var.mask, var.mask_kind = torch.ones(2, 2048, dtype=torch.uint8), MASK_KEYS
    elif case == "dropout":
        var.dropout_p = 0.1
    elif case == "varlen":  # with the kernel's varlen switch off
        monkeypatch.setattr(MODES[gluon.mode], "GLUON_VARLEN", False)
        var.cu_seqlens_q = var.cu_seqlens_k = torch.tensor([0, 2048, 4096], dtype=torch.int32)
        var.max_seqlen_q = var.max_seqlen_k = 2048
        q, k, v = (t.reshape(-1, *t.shape[2:]) for t in (q, k, v))
    elif case == "kvcache":
        var.kv_lens = torch.full((2,), 2048, dtype=torch.int32)
    elif case == "misaligned-rows":  # a head stride of 130 elements: not a multiple of 16 bytes
        q = torch.empty(2, 2048, 8, 130, dtype=torch.bfloat16)[..., :128]
    elif case == "negative-scale":
        var.softmax_scale = -SCALE
    assert not gluon(q, k, v, var, sm90)


@pytest.mark.parametrize("case", ["misaligned-do", "lse-stride", "dk-stride", "dv-stride"])
def test_dkdv_refuses_layouts(monkeypatch, case):
    """The backward's own tensors: a dO not readable through descriptors, lse (and so delta) not
    contiguous along the queries, dK / dV views with the head dim not innermost."""
    monkeypatch.setattr(bwd, "GLUON", True)
    monkeypatch.setattr(configs, "BATCH_INVARIANT", False)
    q, k, v = qkv()
    t = dict(do=torch.empty_like(q), lse=torch.empty(2, 8, 2048), dk=torch.empty_like(k), dv=torch.empty_like(v))
    assert bwd._gluon_ok(q, k, v, *t.values(), Variants(softmax_scale=SCALE), True)
    if case == "misaligned-do":
        t["do"] = torch.empty(2, 2048, 8, 130, dtype=torch.bfloat16)[..., :128]
    elif case == "lse-stride":  # (B, Hq, Sq) with the queries outermost
        t["lse"] = torch.empty(2048, 2, 8).permute(1, 2, 0)
    else:  # views of a gradient with the head dim not innermost
        t[case[:2]] = torch.empty(2, 2048, 128, 2, dtype=torch.bfloat16).transpose(2, 3)
    assert not bwd._gluon_ok(q, k, v, *t.values(), Variants(softmax_scale=SCALE), True)


def _misaligned(t):
    """t's shape and strides, 2 bytes past a 16-byte boundary."""
    off = torch.empty(t.numel() + 1, dtype=t.dtype)[1:].view(t.shape)
    assert off.stride() == t.stride() and off.data_ptr() % 16
    return off


@pytest.mark.parametrize("mode", ["fwd", "bwd"])
def test_dispatch_alignment_and_replay_in_another_thread(monkeypatch, mode):
    """The launchers with a Gluon kernel taken (CPU tensors as if on sm_90; launches recorded, not
    run). The forward: the Gluon forward. The backward: the Triton dQ kernel first (it writes
    delta), then the Gluon dK/dV kernel; with TRITONATTN_ATOMIC_DQ=1 the delta preprocess, then the
    Gluon dK/dV kernel with its fused dQ.
    Either way, the same call with an input 2 bytes off a 16-byte boundary (same shapes and strides:
    the plan key holds the alignment) takes the Triton kernel, and a plan replayed in a thread that
    never set Triton's allocator still launches with one (the descriptors need it)."""
    import threading

    from triton.runtime import _allocation

    from tritonattn.kernels import launch, plan

    monkeypatch.setattr(fwd, "GLUON", True)
    monkeypatch.setattr(bwd, "GLUON", True)
    monkeypatch.setattr(fwd, "_on_sm90", lambda q: True)
    monkeypatch.setattr(bwd, "_on_sm90", lambda q: True)
    monkeypatch.setattr(configs, "BATCH_INVARIANT", False)
    seen = []

    def record(fn, grid, args, kwargs):
        launch.tail_values(fn, len(args), kwargs)  # what the launch cache passes the C launcher (raises if short)
        seen.append((fn.__name__, _allocation._allocator.get() is not _allocation._NULL_ALLOCATOR))

    monkeypatch.setattr(launch, "launch", record)
    monkeypatch.setenv("TRITONATTN_BWD_FUSED_DQ", "0")  # (the split kernels: a Gluon and a Triton one)
    plan.clear()
    var = Variants(softmax_scale=SCALE, win_right=0)
    q, k, v = qkv()
    if mode == "fwd":
        def call(q=q):
            fwd.attention_forward(q, k, v, var)

        gluon, triton_path, misaligned = ["_fwd_ws_kernel"], ["_fwd_kernel"], dict(q=_misaligned(q))
    else:
        do, out, lse = torch.empty_like(q), torch.empty_like(q), torch.empty(2, 8, 2048)

        def call(do=do):
            bwd.attention_backward(do, q, k, v, out, lse, var)

        gluon, triton_path = ["_bwd_dq_kernel", "_bwd_dkdv_ws_kernel"], ["_bwd_dq_kernel", "_bwd_dkdv_kernel"]
        misaligned = dict(do=_misaligned(do))
    call()
    assert seen == [(name, True) for name in gluon], seen
    del seen[:]
    call(**misaligned)
    assert [name for name, _ in seen] == triton_path, seen
    if mode == "bwd":
        del seen[:]
        with monkeypatch.context() as m:
            m.setenv("TRITONATTN_ATOMIC_DQ", "1")
            call()
        # the Gluon dK/dV kernel with its fused dQ (FUSED_DQ)
        assert [name for name, _ in seen] == ["_bwd_preprocess_kernel", "_bwd_dkdv_ws_kernel",
                                              "_bwd_dq_convert_kernel"], seen

    def worker():
        _allocation._allocator.set(_allocation._NULL_ALLOCATOR)  # a thread that never set one
        call()

    hits = plan.hits
    del seen[:]
    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert plan.hits == hits + 1, "the aligned call's plan was not replayed"
    assert seen == [(name, True) for name in gluon], seen


def test_grid_limit_counts_the_heads_each_kernel_has_programs_for(gluon, monkeypatch):
    """The dK/dV kernel has a program per kv head on a grid axis: with 4 kv heads in all, a limit of
    3 programs per axis refuses it, 4 does not. The forward's persistent grid is 1-D: no such limit."""
    monkeypatch.setattr(configs, "MAX_GRID_YZ", 4)
    assert gluon(*qkv(B=2, Hq=8, Hkv=2))
    monkeypatch.setattr(configs, "MAX_GRID_YZ", 3)
    assert gluon(*qkv(B=2, Hq=8, Hkv=2)) == (gluon.mode == "fwd")


def test_varlen_with_its_switch(gluon, monkeypatch):
    """Packed variable-length calls take a Gluon kernel only with its module's GLUON_VARLEN (both on
    by default; TRITONATTN_FWD_GLUON_VARLEN=0 / TRITONATTN_BWD_GLUON_VARLEN=0 turn them off),
    judged here by max_seqlen (the rule for one length class)."""
    var = Variants(softmax_scale=SCALE, win_right=0)
    var.cu_seqlens_q = var.cu_seqlens_k = torch.tensor([0, 100, 2148], dtype=torch.int32)
    var.max_seqlen_q = var.max_seqlen_k = 2048
    q, k, v = (t.reshape(-1, *t.shape[2:])[:2148] for t in qkv())
    assert fwd.GLUON_VARLEN == configs.env_flag("TRITONATTN_FWD_GLUON_VARLEN", default=True)
    assert bwd.GLUON_VARLEN == configs.env_flag("TRITONATTN_BWD_GLUON_VARLEN", default=True)
    monkeypatch.setattr(MODES[gluon.mode], "GLUON_VARLEN", False)
    assert not gluon(q, k, v, var)
    monkeypatch.setattr(MODES[gluon.mode], "GLUON_VARLEN", True)
    assert gluon(q, k, v, var)
    var.max_seqlen_q = var.max_seqlen_k = configs.GLUON_MIN_SEQLEN[gluon.mode][128][1] - 1
    assert not gluon(q, k, v, var)


def _recorded_varlen_call(monkeypatch, module):
    """``module``'s Gluon kernel and its varlen path on, CPU tensors as if on sm_90, launches recorded
    (name, grid, args, kwargs) and not run; a packed causal batch of two sequences: 3000 and 1
    queries, 2500 and 100 keys, 8 query and 2 kv heads, D=128, bf16."""
    from tritonattn.kernels import launch, plan

    monkeypatch.setattr(module, "GLUON", True)
    monkeypatch.setattr(module, "GLUON_VARLEN", True)
    monkeypatch.setattr(module, "_on_sm90", lambda q: True)
    monkeypatch.setattr(configs, "BATCH_INVARIANT", False)
    seen = []
    monkeypatch.setattr(launch, "launch", lambda fn, grid, args, kwargs: seen.append((fn.__name__, grid, args, kwargs)))
    plan.clear()
    cu_q = torch.tensor([0, 3000, 3001], dtype=torch.int32)
    cu_k = torch.tensor([0, 2500, 2600], dtype=torch.int32)
    q = torch.empty(3001, 8, 128, dtype=torch.bfloat16)
    k, v = (torch.empty(2600, 2, 128, dtype=torch.bfloat16) for _ in range(2))
    var = Variants(softmax_scale=SCALE, win_right=0, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=3000,
                   max_seqlen_k=2500)
    return seen, cu_q, cu_k, (q, k, v), var


def _after(args: tuple, tensor, skip: int, n: int) -> tuple:
    """The ``n`` arguments ``skip`` places after ``tensor`` (found by identity) in a launch's ``args``."""
    i = next(i for i, a in enumerate(args) if a is tensor)
    return tuple(args[i + skip:i + skip + n])


def test_trace_buffer_reaches_the_launch(monkeypatch):
    """fwd_sm90.TRACE_BUF (tile_trace.py's cycle stamps; CPU tensors as if on sm_90, launches
    recorded): a dense Gluon forward passes it as the kernel's last argument with TRACE on, even
    where a plan for the same call was recorded untraced (the switch is in the plan's key); unset,
    the launch is the untraced one again (lse in that slot, TRACE off)."""
    from tritonattn.kernels import fwd_sm90, launch, plan

    monkeypatch.setattr(fwd, "GLUON", True)
    monkeypatch.setattr(fwd, "_on_sm90", lambda q: True)
    monkeypatch.setattr(configs, "BATCH_INVARIANT", False)
    seen = []
    monkeypatch.setattr(launch, "launch", lambda fn, grid, args, kwargs: seen.append((fn.__name__, args, kwargs)))
    plan.clear()
    q, k, v = qkv()
    var = Variants(softmax_scale=SCALE, win_right=0)
    buf = torch.zeros(4, fwd_sm90.TRACE_TILES.value, fwd_sm90.TRACE_SLOTS.value, dtype=torch.int64)
    for traced in (False, False, True, False):
        monkeypatch.setattr(fwd_sm90, "TRACE_BUF", buf if traced else None)
        del seen[:]
        _, lse = fwd.attention_forward(q, k, v, var)
        ((name, args, kwargs),) = seen
        assert name == "_fwd_ws_kernel" and kwargs["TRACE"] == traced, kwargs
        assert args[-1] is (buf if traced else lse)


def test_varlen_launch(monkeypatch):
    """A varlen forward through the Gluon kernel (CPU tensors as if on sm_90; launches recorded), a
    launch per length class: the sequences under the Gluon forward's causal length (here the one of
    100 keys) through the Triton kernel, on a grid of no more query blocks than that length has;
    the others through the Gluon kernel: IS_VARLEN, a persistent grid (tiles: the longest
    sequence's query blocks by batch x heads), the cu_seqlens tensors, the class's lengths and the
    packed layout's strides (batch stride 0, lse (Hq, total) with batch stride 0)."""
    from tritonattn.kernels import fwd_sm90
    from tritonattn.kernels.common import LENGTH_CAP

    monkeypatch.setattr(fwd_sm90, "PROGRAMS", 10**6)
    seen, cu_q, cu_k, (q, k, v), var = _recorded_varlen_call(monkeypatch, fwd)
    out, lse = fwd.attention_forward(q, k, v, var)
    assert lse.shape == (8, 3001)
    first = configs.GLUON_MIN_SEQLEN["fwd"][128][1]
    (short, s_grid, s_args, s_kwargs), (name, grid, args, kwargs) = seen
    assert short == "_fwd_kernel" and s_kwargs["IS_VARLEN"], short
    assert _after(s_args, cu_k, 3, 2) == (0, first)  # after cu_q, cu_k and the lse strides
    assert s_grid[0] == -(-(first - 1) // s_kwargs["BLOCK_M"]), s_grid
    assert name == "_fwd_ws_kernel" and kwargs["IS_VARLEN"] and kwargs["CAUSAL"], kwargs
    assert not kwargs["DESC_ONCE"]  # a packed call's descriptors are per sequence
    # the persistent grid: one program per SM (fwd_sm90.PROGRAMS, here more than the tiles), at
    # most one per tile: the longest sequence's query blocks x sequences x heads
    assert grid == (-(-3000 // fwd_sm90.block_m(128, True)) * 2 * 8,), grid
    # then B x Hq, the causal order's heads per section and the trace buffer (off: lse, not read)
    assert args[-3] == 2 * 8 and args[-2] == fwd_sm90.section_heads(16, 4, 2500, q) == 16
    assert args[-1] is lse and not kwargs["TRACE"]
    assert args[5] is cu_q and args[6] is cu_k and args[7:9] == (first, LENGTH_CAP)
    assert args[9:12] == (0, 8 * 128, 128) and args[21:23] == (0, 3001)  # q (batch, row, head), lse (batch, head)
    assert args[23:27] == (8, 4, 3000, 2500)  # Hq, GROUP, longest query and key sequences


def test_causal_section_heads():
    """The Gluon forward's causal order takes heads in sections whose K and V fill half of L2 (50 MiB
    for CPU tensors): whole GQA groups, at least one, at most every head; HEADS_PER_SECTION overrides."""
    from tritonattn.kernels import fwd_sm90

    q = torch.empty(1, 1, 1, 128, dtype=torch.bfloat16)
    assert fwd_sm90.section_heads(128, 4, 16384, q) == 12  # 8 MiB of K / V per kv head: 3 kv heads
    assert fwd_sm90.section_heads(128, 4, 4096, q) == 48
    assert fwd_sm90.section_heads(128, 4, 1024, q) == 128  # all fit
    assert fwd_sm90.section_heads(8, 8, 1 << 20, q) == 8  # one group, even when it does not fit
    fwd_sm90.HEADS_PER_SECTION = 5
    try:
        assert fwd_sm90.section_heads(128, 4, 16384, q) == 5 and fwd_sm90.section_heads(3, 1, 64, q) == 3
    finally:
        fwd_sm90.HEADS_PER_SECTION = None


def test_varlen_dkdv_launch(monkeypatch):
    """A varlen backward through the Gluon dK/dV kernel (bwd.GLUON_VARLEN; CPU tensors as if on
    sm_90; launches recorded): the Triton dQ kernel first (one length class: the interpreter's tile
    at every length), then a dK/dV launch per length class: the Triton kernel for the sequences
    under the Gluon kernel's causal length, on no more key blocks than that length has, and the
    Gluon kernel with IS_VARLEN, a grid of the longest sequence's key blocks by sequences x kv
    heads, the cu_seqlens tensors, the class's lengths and the packed layout's strides (batch
    stride 0; lse / delta (Hq, total_q))."""
    from tritonattn.kernels import bwd_sm90, launch
    from tritonattn.kernels.common import LENGTH_CAP

    seen, cu_q, cu_k, (q, k, v), var = _recorded_varlen_call(monkeypatch, bwd)
    # (the split dQ: from 2048 a causal call fuses it, test_fused_dq_varlen_classes)
    monkeypatch.setenv("TRITONATTN_BWD_FUSED_DQ", "0")
    do, out, lse = torch.empty_like(q), torch.empty_like(q), torch.empty(8, 3001)
    bwd.attention_backward(do, q, k, v, out, lse, var)
    assert [name for name, *_ in seen] == ["_bwd_dq_kernel", "_bwd_dkdv_kernel", "_bwd_dkdv_ws_kernel"], seen
    first = configs.GLUON_MIN_SEQLEN["bwd_dkdv"][128][1]
    _, dq_grid, dq_args, dq_kwargs = seen[0]
    assert _after(dq_args, cu_k, 3, 2) == (0, LENGTH_CAP)
    assert dq_grid[0] == -(-3000 // dq_kwargs["BLOCK_M"]), dq_grid
    _, t_grid, t_args, t_kwargs = seen[1]
    assert _after(t_args, cu_k, 3, 2) == (0, first)
    assert t_grid[0] == -(-(first - 1) // t_kwargs["BLOCK_N"]), t_grid
    _, grid, args, kwargs = seen[2]
    assert len(args) == 46  # the kernel's runtime arguments, then its constexprs from the keywords
    launch.tail_values(bwd_sm90._bwd_dkdv_ws_kernel, len(args), kwargs)
    assert kwargs["IS_VARLEN"] and kwargs["CAUSAL"], kwargs
    assert grid == (-(-2500 // bwd_sm90.BLOCK_N), 2 * 2), grid
    assert args[8] is cu_q and args[9] is cu_k and args[10:12] == (first, LENGTH_CAP)
    assert args[12:15] == (0, 8 * 128, 128) and args[15:18] == (0, 2 * 128, 128)  # q, k (batch, row, head)
    assert args[30:32] == (0, 3001)  # lse / delta (batch, head)
    assert args[32:36] == (2, 4, 3000, 2500)  # Hkv, GROUP, longest query and key sequences
    assert not kwargs.get("FUSED_DQ") and args[39:] == (q, 0, 0, 0, q, 0, 0)  # no fused dQ (buffers unused)
    assert args[36] == 0 and args[38] == SCALE  # the causal edge, and the softmax scale for dK


@pytest.mark.parametrize("section,heads", [(None, 5), ("0", 0), ("3", 3), ("100", 8), ("auto", 5)])
def test_fused_dq_section_launch(monkeypatch, section, heads):
    """TRITONATTN_BWD_FUSED_SECTION (bwd_sm90.section_order): the ordered fused dQ's Gluon launch on a
    1-d grid of the same programs with SECTION kv heads per section (at most the call's 2 x 4), the
    rule's when unset (this call's 2 query heads per kv head x its length are within
    configs.FUSED_SECTION_ROWS) or "auto": a wave of programs, here 5 of 8 with 36 SMs and 7 key
    blocks; 0 the 2-d grid. Only the ordered fused dQ takes it: the split dQ's dK/dV launch keeps
    its grid."""
    from tritonattn.kernels import launch, plan

    if section is not None:
        monkeypatch.setenv("TRITONATTN_BWD_FUSED_SECTION", section)
    monkeypatch.setenv("TRITONATTN_BWD_FUSED_DQ", "all")
    monkeypatch.setattr(bwd, "GLUON", True)
    monkeypatch.setattr(bwd, "_on_sm90", lambda q: True)
    monkeypatch.setattr(bwd.bwd_sm90, "sm_count", lambda device: 36)
    monkeypatch.setattr(configs, "BATCH_INVARIANT", False)
    seen = []
    monkeypatch.setattr(launch, "launch", lambda fn, grid, args, kwargs: seen.append((fn.__name__, grid, kwargs)))
    S = 7 * bwd.bwd_sm90.BLOCK_N - 5  # 7 key blocks
    assert S >= configs.GLUON_MIN_SEQLEN["bwd_dkdv"][128][0] and configs.fused_sections(128, 2, S)
    assert configs.FUSED_SECTION_MIN_HEADS < 5, "the rule's floor moved: change the SMs above"
    q, k, v = qkv(Sq=S, Sk=S, Hkv=4)
    do, out, lse = torch.empty_like(q), torch.empty_like(q), torch.empty(2, 8, S)
    plan.clear()  # (once: the later calls replay their plans, which must follow the switch: it is in the key)
    launches = []
    for env in (section, "0", section):
        set_env(monkeypatch, "TRITONATTN_BWD_FUSED_SECTION", env)
        del seen[:]
        bwd.attention_backward(do, q, k, v, out, lse, Variants(softmax_scale=SCALE))
        (grid, kwargs), = [(g, kw) for name, g, kw in seen if name == "_bwd_dkdv_ws_kernel"]
        assert kwargs["FUSED_DQ"] and kwargs["DETERMINISTIC"]
        launches.append((kwargs["SECTION"], tuple(grid)))
    on = (heads, (7 * 2 * 4,) if heads else (7, 2 * 4))
    assert launches == [on, (0, (7, 2 * 4)), on], launches
    monkeypatch.setenv("TRITONATTN_BWD_FUSED_DQ", "0")  # the split dQ: the dK/dV launch keeps the 2-d grid
    monkeypatch.setenv("TRITONATTN_BWD_FUSED_SECTION", "3")
    plan.clear()
    del seen[:]
    bwd.attention_backward(do, q, k, v, out, lse, Variants(softmax_scale=SCALE))
    (grid, kwargs), = [(g, kw) for name, g, kw in seen if name == "_bwd_dkdv_ws_kernel"]
    assert kwargs["SECTION"] == 0 and tuple(grid) == (7, 2 * 4) and not kwargs["FUSED_DQ"]


@pytest.mark.parametrize("case,first", [("full", True), ("causal", True), ("causal-fewer-keys", False),
                                        ("partial-block", False), ("switch-off", False), ("atomic", False),
                                        ("varlen", False), ("D64", True), ("D64-half-block", False)])
def test_fused_dq_first_store_launch(monkeypatch, case, first, poison):
    """TRITONATTN_BWD_DQ_FIRST_STORE (an experiment, off by default): the ordered fused dQ's launch
    gets FIRST_STORE, and its fp32 buffer is left unwritten (NaN: the poison fixture) instead of
    zeroed, exactly where key block 0's program writes every row block first (bwd._first_store_ok):
    dense calls with whole
    query blocks (D=64: of 128 rows), causal ones whose first query sees the first key; not for a
    partial last block (D=64: 64 rows past whole 128-row blocks), a causal call with more queries than
    keys, the atomic dQ (no order), packed sequences, or with the switch off. The switch is in the
    plan's key (the second call of each case replays)."""
    from tritonattn.kernels import bwd_sm90, launch, plan

    monkeypatch.setenv("TRITONATTN_BWD_FUSED_DQ", "all")
    if case != "switch-off":
        monkeypatch.setenv("TRITONATTN_BWD_DQ_FIRST_STORE", "1")
    if case == "atomic":
        monkeypatch.setenv("TRITONATTN_ATOMIC_DQ", "1")
    monkeypatch.setattr(bwd, "GLUON", True)
    monkeypatch.setattr(bwd, "GLUON_VARLEN", True)
    monkeypatch.setattr(bwd, "_on_sm90", lambda q: True)
    monkeypatch.setattr(configs, "BATCH_INVARIANT", False)
    seen = []
    monkeypatch.setattr(launch, "launch", lambda fn, grid, args, kwargs: seen.append((fn.__name__, args, kwargs)))
    D = 64 if case.startswith("D64") else 128
    block_m = bwd_sm90.TILES[D][0]
    assert D == 128 or block_m > 64, "D=64's dK/dV query block moved: change the half-block case"
    monkeypatch.setitem(configs.GLUON_MIN_SEQLEN["bwd_dkdv"], D, (0, 0))  # (the Gluon kernel at every length)
    S = 16 * block_m
    if case == "varlen":
        cu = torch.tensor([0, S, 2 * S], dtype=torch.int32)
        q = torch.empty(2 * S, 8, 128, dtype=torch.bfloat16)
        k, v = (torch.empty(2 * S, 2, 128, dtype=torch.bfloat16) for _ in range(2))
        var = Variants(softmax_scale=SCALE, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=S, max_seqlen_k=S)
        lse = torch.empty(8, 2 * S)
    else:
        Sq, Sk = {"partial-block": (S - 5, S - 5), "causal-fewer-keys": (S, S - block_m),
                  "D64-half-block": (S + 64, S + 64)}.get(case, (S, S))
        q, k, v = qkv(Sq=Sq, Sk=Sk, D=D)
        causal = case.startswith("causal")
        var = Variants(softmax_scale=SCALE, win_right=0 if causal else None)
        lse = torch.empty(2, 8, Sq)
    do, out = torch.empty_like(q), torch.empty_like(q)
    plan.clear()
    # recorded, then replayed (the plan allocates as the recorded call did; under the interpreter a
    # replay launches through launch.launch too), and for "full" once more with the switch off
    for expect in (first, first, *((False,) if case == "full" else ())):
        if not expect and case == "full":
            monkeypatch.delenv("TRITONATTN_BWD_DQ_FIRST_STORE")
        del seen[:]
        hits = plan.hits
        bwd.attention_backward(do, q, k, v, out, lse, var)
        (kwargs,) = [kw for name, _, kw in seen if name == "_bwd_dkdv_ws_kernel"]
        assert kwargs["FUSED_DQ"] and kwargs["DETERMINISTIC"] == (case != "atomic"), kwargs
        assert kwargs.get("FIRST_STORE", False) == expect, (case, kwargs.get("FIRST_STORE"), plan.hits - hits)
        if case != "atomic":  # (the atomic path converts its buffer otherwise)
            (dqa,) = [args[0] for name, args, _ in seen if name == "_bwd_dq_convert_kernel"]
            assert bool(dqa.isnan().all()) == expect and bool((dqa == 0).all()) != expect, case
    assert bwd._first_store_ok(Variants(softmax_scale=SCALE, win_left=100), 1024, 1024, block_m) is False
    assert bwd._first_store_ok(Variants(softmax_scale=SCALE, win_right=-1), 1024, 1024, block_m) is False
    assert bwd._first_store_ok(Variants(softmax_scale=SCALE, win_right=64), 1024, 1000, block_m) is True
    assert bwd._first_store_ok(Variants(softmax_scale=SCALE, win_right=-24), 1024, 1048, block_m) is True


@pytest.mark.parametrize("case", ["split", "no-split", "full", "over-waves", "off", "varlen", "atomic"])
def test_dkdv_section_launch(monkeypatch, case):
    """configs.DKDV_SECTION_WAVES (an experiment, off by default): the Gluon dK/dV launch without the
    fused dQ, causal, of at most that many waves of programs, runs on a 1-d grid in sections of kv
    heads (a wave's worth: SMs // key blocks, at least FUSED_SECTION_MIN_HEADS), KV_SPLIT's virtual
    heads counted (here 36 SMs, 7 key blocks: 5 heads, or all 4); packed calls too; not without a
    mask, past the waves, with it off, or for the opt-in atomic dQ's fused launch (the 2-d grid)."""
    from tritonattn.kernels import bwd_sm90, launch, plan

    monkeypatch.setenv("TRITONATTN_BWD_FUSED_DQ", "0")
    monkeypatch.setattr(configs, "DKDV_SECTION_WAVES", {"off": 0, "over-waves": 1}.get(case, 4))
    monkeypatch.setenv("TRITONATTN_BWD_KV_SPLIT", "2" if case == "split" else "1")  # (forced: the rule's is 4 here)
    if case == "atomic":
        monkeypatch.setenv("TRITONATTN_ATOMIC_DQ", "1")
    sms = 20 if case == "over-waves" else 36  # (over-waves: 28 programs past one wave of 20)
    monkeypatch.setattr(bwd.bwd_sm90, "sm_count", lambda device: sms)
    monkeypatch.setitem(configs.GLUON_MIN_SEQLEN["bwd_dkdv"], 128, (0, 0))
    if case == "varlen":  # 20 key blocks x 2 sequences x 2 kv heads: 80 programs, sections of all 4 heads
        seen, _, _, (q, k, v), var = _recorded_varlen_call(monkeypatch, bwd)
        lse = torch.empty(8, 3001)
        want = (4, (80,))
    else:
        monkeypatch.setattr(bwd, "GLUON", True)
        monkeypatch.setattr(bwd, "_on_sm90", lambda q: True)
        monkeypatch.setattr(configs, "BATCH_INVARIANT", False)
        seen = []
        monkeypatch.setattr(launch, "launch",
                            lambda fn, grid, args, kwargs: seen.append((fn.__name__, grid, args, kwargs)))
        S = 7 * bwd_sm90.BLOCK_N - 5  # 7 key blocks
        q, k, v = qkv(Sq=S, Sk=S, Hkv=2)
        var = Variants(softmax_scale=SCALE, win_right=None if case == "full" else 0)
        lse = torch.empty(2, 8, S)
        heads = 2 * 2 * (2 if case == "split" else 1)
        want = {"split": (5, (7 * 8,)), "no-split": (4, (7 * 4,))}.get(case, (0, (7, heads)))
    do, out = torch.empty_like(q), torch.empty_like(q)
    plan.clear()
    for _ in range(2):  # recorded, then replayed
        del seen[:]
        bwd.attention_backward(do, q, k, v, out, lse, var)
        (grid, kwargs), = [(g, kw) for name, g, _, kw in seen if name == "_bwd_dkdv_ws_kernel"]
        assert kwargs["FUSED_DQ"] == (case == "atomic") and kwargs.get("KV_SPLIT", 1) == (2 if case == "split" else 1)
        assert (kwargs["SECTION"], tuple(grid)) == want, (case, kwargs["SECTION"], grid)


@pytest.mark.parametrize("value", ["x", "-2", "1.5"])
def test_fused_dq_section_bad_value(value):
    """A TRITONATTN_BWD_FUSED_SECTION that is no count, 'auto' or 0: an error naming the variable."""
    with pytest.raises(ValueError, match="TRITONATTN_BWD_FUSED_SECTION"):
        bwd.bwd_sm90.section_order(value, 7, 8, torch.empty(0), 1, 1000, 128)


def test_fused_dq_section_rule(monkeypatch):
    """The sections' default (section_order unset): on where GROUP x longest is within
    configs.FUSED_SECTION_ROWS (few steps per program), a wave's worth of kv heads (SMs // key
    blocks) but at least FUSED_SECTION_MIN_HEADS and at most the call's heads; off past it, where
    "auto" and a number still set them."""
    monkeypatch.setattr(bwd.bwd_sm90, "sm_count", lambda device: 132)
    rows, floor, cpu = configs.FUSED_SECTION_ROWS[128], configs.FUSED_SECTION_MIN_HEADS, torch.empty(0)
    order = functools.partial(bwd.bwd_sm90.section_order, head_dim=128)
    assert order(None, 16, 128, cpu, 1, 2048) == 132 // 16  # fa D=128 S=2048: 8 heads a section
    assert order(None, 16, 128, cpu, rows // 2048, 2048) == 8  # (the group's edge: still on)
    assert order(None, 16, 128, cpu, 2 * rows // 2048, 2048) == 0  # past it: the 2-d grid
    assert order("auto", 16, 128, cpu, 2 * rows // 2048, 2048) == 8 and order("5", 16, 128, cpu, 16, 2048) == 5
    assert order(None, 64, 128, cpu, 1, 8192) == max(floor, 132 // 64)  # the floor
    assert order(None, 16, 3, cpu, 1, 2048) == 3 and order(None, 200, 128, cpu, 1, 100) == floor
    assert order("off", 16, 128, cpu, 1, 2048) == 0 and order("", 16, 128, cpu, 1, 2048) == 0
    # past the rows but few programs (configs.FUSED_SECTION_WAVES): on (GQA 8, 2 x 2 kv heads at 8192)
    waves = configs.FUSED_SECTION_WAVES
    assert order(None, 64, 4, cpu, 8, 8192) == 4 and 64 * 4 <= waves * 132
    most = waves * 132 // 64  # kv heads at most, with 64 key blocks
    assert order(None, 64, most, cpu, 8, 8192) > 0 and order(None, 64, most + 1, cpu, 8, 8192) == 0
    # D=64 (its fused dQ without a mask): sections at every group and length
    assert configs.FUSED_SECTION_ROWS[64] == math.inf
    assert bwd.bwd_sm90.section_order(None, 64, 32, cpu, 16, 8192, 64) == max(floor, 132 // 64)


@pytest.mark.parametrize("env", [None, "0", "all"], ids=["default", "off", "all"])
def test_fused_dq_launches(monkeypatch, env):
    """The backward's fused dQ (configs.FUSED_DQ_MIN_SEQLEN, bwd.fused_dq_mode; CPU tensors as if
    on sm_90, launches recorded): a dense call without a mask from the fused length takes the delta
    preprocess and the Gluon dK/dV kernel with FUSED_DQ and DETERMINISTIC (no dQ kernel), its fp32
    buffer heads before rows and a semaphore per (batch, head, query block); with a causal mask
    likewise from its own (longer) length, or from FUSED_DQ_GRID_FIRST's where the group's
    programs would have too many steps for sections there; its programs in sections where
    configs.fused_sections says; the dQ kernel and the Gluon dK/dV kernel without it under those
    lengths or with TRITONATTN_BWD_FUSED_DQ=0; with TRITONATTN_BWD_FUSED_DQ=all, the fused
    kernel at every length the Gluon kernel serves, masked or not."""
    from tritonattn.kernels import launch, plan

    if env is not None:
        monkeypatch.setenv("TRITONATTN_BWD_FUSED_DQ", env)
    monkeypatch.setattr(bwd, "GLUON", True)
    monkeypatch.setattr(bwd, "_on_sm90", lambda q: True)
    monkeypatch.setattr(configs, "BATCH_INVARIANT", False)
    seen = []
    monkeypatch.setattr(launch, "launch", lambda fn, grid, args, kwargs: seen.append((fn.__name__, grid, args, kwargs)))
    full, masked = configs.FUSED_DQ_MIN_SEQLEN[128]
    gluon_full, gluon_masked = configs.GLUON_MIN_SEQLEN["bwd_dkdv"][128]
    assert gluon_full < full < masked and gluon_masked <= masked, \
        "configs.FUSED_DQ_MIN_SEQLEN / GLUON_MIN_SEQLEN moved: change the cases below"
    # (causal, S, kv heads of the 8 query heads, fused by default): without a mask from its length
    # (under it the Gluon kernel without dQ), with one from its own, for every group
    grid_full, grid_masked = configs.FUSED_DQ_GRID_FIRST[128]
    sections = functools.partial(configs.fused_sections, 128)
    assert sections(4, masked) and not sections(8, masked) and grid_masked > masked
    assert sections(8, full) and not sections(16, full) and grid_full > full
    # (8 query heads per kv head: too many steps for sections at the masked length, so from grid_masked;
    # without a mask that takes 16, more than these calls' 8 query heads: test_length_breaks covers it)
    for causal, S, Hkv, default in ((False, full, 2, True), (False, full - 1, 8, False), (True, masked, 2, True),
                                    (False, full, 8, True), (True, masked, 8, True), (True, masked, 1, False),
                                    (True, grid_masked, 1, True), (False, full, 1, True)):
        q, k, v = qkv(Sq=S, Sk=S, Hkv=Hkv)
        do, out, lse = torch.empty_like(q), torch.empty_like(q), torch.empty(2, 8, S)
        plan.clear()
        del seen[:]
        bwd.attention_backward(do, q, k, v, out, lse, Variants(softmax_scale=SCALE, win_right=0 if causal else None))
        fused = env == "all" or (default and env is None)
        names = [name for name, *_ in seen]
        assert names == (["_bwd_preprocess_kernel", "_bwd_dkdv_ws_kernel", "_bwd_dq_convert_kernel"] if fused else
                         ["_bwd_dq_kernel", "_bwd_dkdv_ws_kernel"]), (causal, S, Hkv, names)
        _, grid, args, kwargs = seen[1]
        assert kwargs["FUSED_DQ"] == fused and kwargs["DETERMINISTIC"] == fused, kwargs
        # (the ordered fused dQ in sections of kv heads where configs.fused_sections says: a 1-d grid)
        n_kb = -(-S // bwd.bwd_sm90.block_n(128))  # (sections: few steps, or few programs on the 4 "SMs" here)
        sections_on = configs.fused_sections(128, 8 // Hkv, S, n_kb * 2 * Hkv, bwd.bwd_sm90.sm_count(q.device))
        assert (kwargs["SECTION"] > 0) == (fused and sections_on), (causal, S, Hkv, kwargs)
        assert len(grid) == (1 if kwargs["SECTION"] else 2)
        if fused:
            dqa, rows, batch_rows, head_rows, sem, sem_batch, sem_head = args[-7:]
            assert dqa.shape == (2, 8, S, 128) and dqa.dtype == torch.float32 and not dqa.any()
            assert (rows, batch_rows, head_rows) == (2 * 8 * S, 8 * S, S)
            blocks = -(-S // bwd.bwd_sm90.TILES[128][0])
            assert sem.dtype == torch.int32 and sem.numel() == 2 * 8 * blocks and not sem.any()
            assert (sem_batch, sem_head) == (8 * blocks, blocks)
            # the convert kernel reads that buffer into dq
            assert seen[2][2][0] is dqa and seen[2][1] == (-(-S // configs.DQ_CONVERT.block_m), 2 * 8)
            # a repeated call replays the recorded plan: the same launches, with a new buffer and new
            # semaphores that the plan allocates zeroed (torch.zeros, what a replay calls again), the
            # conversion reading the new buffer
            (recorded,) = plan._plans.values()
            assert (torch.zeros, tuple(dqa.shape), torch.float32, dqa.device) in recorded.allocs, recorded.allocs
            assert (torch.zeros, tuple(sem.shape), torch.int32, sem.device) in recorded.allocs, recorded.allocs
            hits = plan.hits
            del seen[:]
            bwd.attention_backward(do, q, k, v, out, lse,
                                   Variants(softmax_scale=SCALE, win_right=0 if causal else None))
            assert plan.hits == hits + 1 and [name for name, *_ in seen] == names
            again, again_sem = seen[1][2][-7], seen[1][2][-3]
            assert again is not dqa and again.shape == dqa.shape and not again.any()
            assert again_sem is not sem and again_sem.shape == sem.shape and not again_sem.any()
            assert seen[2][2][0] is again


def test_fused_dq_launches_d64(monkeypatch):
    """D=64's fused dQ (configs.FUSED_DQ_MIN_SEQLEN[64]): without a mask from its length at every
    group, its programs in sections at every group and length (FUSED_SECTION_ROWS[64]); one short
    of it, and with a causal mask at any length, the split kernels (the dQ kernel, the Gluon dK/dV
    kernel with its split waits)."""
    from tritonattn.kernels import launch, plan

    monkeypatch.setattr(bwd, "GLUON", True)
    monkeypatch.setattr(bwd, "_on_sm90", lambda q: True)
    monkeypatch.setattr(configs, "BATCH_INVARIANT", False)
    seen = []
    monkeypatch.setattr(launch, "launch", lambda fn, grid, args, kwargs: seen.append((fn.__name__, grid, kwargs)))
    full, masked = configs.FUSED_DQ_MIN_SEQLEN[64]
    assert masked is None and full >= configs.GLUON_MIN_SEQLEN["bwd_dkdv"][64][0]
    for causal, S, Hkv, fused in ((False, full, 2, True), (False, full - 1, 2, False), (False, 2 * full, 1, True),
                                  (True, 2 * full, 2, False), (True, 4 * full, 8, False)):
        q, k, v = qkv(Sq=S - 3, Sk=S, Hkv=Hkv, D=64)
        do, out, lse = torch.empty_like(q), torch.empty_like(q), torch.empty(2, 8, S - 3)
        plan.clear()
        del seen[:]
        bwd.attention_backward(do, q, k, v, out, lse, Variants(softmax_scale=SCALE, win_right=0 if causal else None))
        names = [name for name, *_ in seen]
        assert names == (["_bwd_preprocess_kernel", "_bwd_dkdv_ws_kernel", "_bwd_dq_convert_kernel"] if fused else
                         ["_bwd_dq_kernel", "_bwd_dkdv_ws_kernel"]), (causal, S, Hkv, names)
        _, grid, kwargs = seen[1]
        assert kwargs["FUSED_DQ"] == fused and kwargs["DETERMINISTIC"] == fused, (causal, S, Hkv)
        assert (kwargs["SECTION"] > 0) == fused and len(grid) == (1 if fused else 2), (causal, S, Hkv, kwargs)
        assert kwargs["SPLIT_WAITS"] == (not fused)  # (configs.BWD_SPLIT_WAITS: the split dK/dV kernel only)


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_fused_dq_masked_waves(monkeypatch, varlen):
    """configs.FUSED_DQ_MASKED_WAVES: a causal D=128 call whose group has too many steps for sections
    at the masked fused length (FUSED_DQ_MIN_SEQLEN) takes the fused dQ from that length anyway where
    its Gluon dK/dV launch (key blocks x batch x kv heads) has one to FUSED_SECTION_WAVES waves of
    programs on the device's SMs, in sections; under one wave, past the waves, or with the switch
    off, the split kernels until FUSED_DQ_GRID_FIRST's length. Packed sequences: the launch of the
    longest (max_seqlen_k's key blocks x sequences x kv heads, launch_gluon's grid), so every length
    class of one call sees the same launch: the long sequence's class fused, the short one's split."""
    from tritonattn.kernels import launch, plan

    monkeypatch.setattr(bwd, "GLUON", True)
    monkeypatch.setattr(bwd, "_on_sm90", lambda q: True)
    monkeypatch.setattr(configs, "BATCH_INVARIANT", False)
    if varlen:  # (a packed sequence's own launch is under a wave here: KV_SPLIT would take the split kernels)
        monkeypatch.setenv("TRITONATTN_BWD_KV_SPLIT", "1")
    seen = []
    monkeypatch.setattr(launch, "launch", lambda fn, grid, args, kwargs: seen.append((fn.__name__, grid, kwargs)))
    masked = configs.FUSED_DQ_MIN_SEQLEN[128][1]
    group = 8  # (too many steps for sections at the masked length: the rule applies)
    assert not configs.fused_sections(128, group, masked) and configs.FUSED_DQ_GRID_FIRST[128][1] > masked
    S = masked + 5  # 17 key blocks x 2 sequences x 1 kv head: 34 programs
    programs = -(-S // bwd.bwd_sm90.block_n(128)) * 2
    waves = configs.FUSED_SECTION_WAVES
    for sms, switch, fused in ((programs, True, True), (-(-programs // waves), True, True),
                               (programs + 1, True, False), (programs // waves - 1, True, False),
                               (programs, False, False)):
        monkeypatch.setattr(configs, "FUSED_DQ_MASKED_WAVES", switch)
        monkeypatch.setattr(bwd.bwd_sm90, "sm_count", lambda device, sms=sms: sms)
        if varlen:  # a long sequence and a short one (under every fused length: the split kernels' class)
            lens = torch.tensor([S, 300])
            cu = torch.nn.functional.pad(lens.cumsum(0), (1, 0)).to(torch.int32)
            total = int(lens.sum())
            q, k, v = (torch.empty(total, h, 128, dtype=torch.float16) for h in (8, 1, 1))
            var = Variants(softmax_scale=SCALE, win_right=0, cu_seqlens_q=cu, cu_seqlens_k=cu,
                           max_seqlen_q=S, max_seqlen_k=S)
            lse = torch.empty(8, total)
        else:
            q, k, v = qkv(Sq=S, Sk=S, Hkv=1)
            var = Variants(softmax_scale=SCALE, win_right=0)
            lse = torch.empty(2, 8, S)
        do, out = torch.empty_like(q), torch.empty_like(q)
        plan.clear()
        del seen[:]
        bwd.attention_backward(do, q, k, v, out, lse, var)
        names = [name for name, *_ in seen]
        dkdv = [(grid, kwargs) for name, grid, kwargs in seen if name == "_bwd_dkdv_ws_kernel"]
        assert any(kw["FUSED_DQ"] for _, kw in dkdv) == fused, (sms, switch, names)
        if not varlen:
            # (the split kernels under one wave: the kv heads' query heads split, configs.kv_split)
            split = ["_bwd_kv_sum_kernel"] if configs.kv_split(True, group, programs, sms) > 1 else []
            assert names == (["_bwd_preprocess_kernel", "_bwd_dkdv_ws_kernel", "_bwd_dq_convert_kernel"] if fused
                             else ["_bwd_dq_kernel", "_bwd_dkdv_ws_kernel", *split]), (sms, switch, names)
        for grid, kw in dkdv:
            assert kw["DETERMINISTIC"] == kw["FUSED_DQ"]
            assert (kw["SECTION"] > 0) == kw["FUSED_DQ"] and len(grid) == (1 if kw["FUSED_DQ"] else 2), (sms, kw)


def test_kv_split_rule(monkeypatch):
    """configs.kv_split: 1 from one wave of programs up; under it the largest power of two dividing the
    group that keeps the launch within a wave (no mask) or KV_SPLIT_WAVES[True] waves (causal).
    kv_split_alone with KV_SPLIT_ALONE_WAVES (set to (1, 2) here), and 1 with it None (off)."""
    monkeypatch.setattr(configs, "KV_SPLIT_ALONE_WAVES", (1, 2))
    waves = configs.KV_SPLIT_WAVES[True]
    assert configs.kv_split(True, 16, 132, 132) == 1 and configs.kv_split(False, 16, 500, 132) == 1
    assert configs.kv_split(False, 16, 128, 132) == 1  # (two would make 256 > 132)
    assert configs.kv_split(False, 16, 16, 132) == 8  # 128 programs
    assert configs.kv_split(True, 16, 128, 132) == max(n for n in (1, 2, 4, 8, 16) if 128 * n <= waves * 132)
    assert configs.kv_split(True, 12, 16, 132) == 4  # (12: at most 4, its largest power-of-two divisor)
    assert configs.kv_split(True, 1, 16, 132) == 1 and configs.kv_split(True, 3, 16, 132) == 1
    for group in (1, 2, 4, 6, 8, 16, 32):
        for programs in (1, 16, 100, 131):
            for causal in (False, True):
                n = configs.kv_split(causal, group, programs, 132)
                assert group % n == 0 and n & (n - 1) == 0 and (n == 1 or programs * n <= waves * 132)
    # a sequence alone (and packed): its own launch, KV_SPLIT_ALONE_WAVES; non-increasing in the length,
    # changing exactly at kv_split_breaks
    waves1 = configs.KV_SPLIT_ALONE_WAVES[True]
    assert configs.kv_split_alone(True, 16, 2048, 1, 128, 132) == max(
        n for n in (1, 2, 4, 8, 16) if 16 * n <= waves1 * 132)
    assert configs.kv_split_alone(False, 8, 8192, 1, 128, 132) == 2  # 64 programs: 128 within a wave
    assert configs.kv_split_alone(True, 4, 2048, 8, 128, 132) == (2 if waves1 >= 2 else 1)  # (128 programs)
    assert configs.kv_split_alone(False, 16, 16384, 2, 128, 132) == 1  # (256 programs: past a wave)
    for causal in (False, True):
        for group, heads in ((16, 1), (8, 2), (4, 8), (6, 3)):
            breaks = configs.kv_split_breaks(causal, group, heads, 128, 132)
            splits = [configs.kv_split_alone(causal, group, n, heads, 128, 132) for n in range(1, 20000, 7)]
            assert splits == sorted(splits, reverse=True), (causal, group)
            for n in range(2, 20000):
                change = configs.kv_split_alone(causal, group, n, heads, 128, 132) != \
                    configs.kv_split_alone(causal, group, n - 1, heads, 128, 132)
                assert change == (n in breaks), (causal, group, heads, n)
    # the environment's override: the largest power of two up to N dividing the group; bad values named
    assert bwd._kv_split("3", True, 16, 128, 132) == 2 and bwd._kv_split("8", False, 12, 500, 132) == 4
    assert bwd._kv_split("1", True, 16, 16, 132) == 1 and bwd._kv_split("off", True, 16, 16, 132) == 1
    assert bwd._kv_split("0", True, 16, 16, 132) == 1 and bwd._kv_split("", True, 16, 16, 132, 2) > 1
    assert bwd._kv_split(None, True, 16, 999, 132, 1, 2048, 1, 128) == configs.kv_split_alone(True, 16, 2048, 1, 128,
                                                                                              132)
    for bad in ("-2", "two"):
        with pytest.raises(ValueError, match="TRITONATTN_BWD_KV_SPLIT"):
            bwd._kv_split(bad, True, 16, 16, 132)
    monkeypatch.setattr(configs, "KV_SPLIT_ALONE_WAVES", None)
    assert configs.kv_split_alone(True, 16, 2048, 1, 128, 132) == 1 and not configs.kv_split_breaks(True, 16, 1,
                                                                                                      128, 132)
    assert bwd._kv_split("4", True, 16, 16, 132, 1, 2048, 1, 128) == 4  # (forced: any call)


@pytest.mark.parametrize("env", [None, "1", "2"], ids=["default", "off", "forced-2"])
def test_kv_split_launch(monkeypatch, env):
    """A dense causal call whose Gluon dK/dV launch (without the fused dQ) is under one wave of
    programs: its kv heads' query heads split over configs.kv_split programs (KV_SPLIT, the virtual
    heads' count and group in the arguments, fp32 partials of Hkv x split heads), then one sum kernel
    into dk / dv (a strided view here: a packed dkv's), in that order; TRITONATTN_BWD_KV_SPLIT forces
    the split (1: none). One sequence alone splits by its own launch (configs.kv_split_alone), and so
    does that sequence in a packed call (its dense call's bits): the sum kernel then by length class."""
    from tritonattn.kernels import launch, plan

    if env is not None:
        monkeypatch.setenv("TRITONATTN_BWD_KV_SPLIT", env)
    monkeypatch.setenv("TRITONATTN_BWD_FUSED_DQ", "0")  # (the split route: the Gluon kernel without dQ)
    monkeypatch.setattr(bwd, "GLUON", True)
    monkeypatch.setattr(bwd, "_on_sm90", lambda q: True)
    monkeypatch.setattr(configs, "BATCH_INVARIANT", False)
    monkeypatch.setattr(bwd.bwd_sm90, "sm_count", lambda device: 64)
    monkeypatch.setattr(configs, "KV_SPLIT_ALONE_WAVES", (1, 2))  # (the rule's arithmetic, whatever the default)
    seen = []
    monkeypatch.setattr(launch, "launch", lambda fn, grid, args, kwargs: seen.append((fn.__name__, grid, args, kwargs)))
    B, S, Hq, Hkv = 2, 2048 + 7, 16, 1
    n_kb = -(-S // bwd.bwd_sm90.block_n(128))  # 17 x 2 programs on 64 "SMs": under a wave
    # one sequence alone: its own launch's split (17 programs), or the environment's
    alone = {None: configs.kv_split_alone(True, Hq // Hkv, S, Hkv, bwd.bwd_sm90.block_n(128), 64), "1": 1,
             "2": 2}[env]
    assert env is not None or alone > 1
    q1, k1, v1 = qkv(B=1, Sq=S, Sk=S, Hq=Hq, Hkv=Hkv)
    plan.clear()
    bwd.attention_backward(torch.empty_like(q1), q1, k1, v1, torch.empty_like(q1), torch.empty(1, Hq, S),
                           Variants(softmax_scale=SCALE, win_right=0))
    assert ("_bwd_kv_sum_kernel" in [name for name, *_ in seen]) == (alone > 1), seen
    assert [kw.get("KV_SPLIT", 1) for name, _, _, kw in seen if name == "_bwd_dkdv_ws_kernel"] == [alone]
    del seen[:]
    q, k, v = qkv(B=B, Sq=S, Sk=S, Hq=Hq, Hkv=Hkv)
    do, out, lse = torch.empty_like(q), torch.empty_like(q), torch.empty(B, Hq, S)
    split = {None: configs.kv_split(True, Hq // Hkv, n_kb * B * Hkv, 64), "1": 1, "2": 2}[env]
    assert env is not None or split > 1
    dkv = torch.empty(B, S, 2, Hkv, 128, dtype=q.dtype)
    plan.clear()
    bwd.attention_backward(do, q, k, v, out, lse, Variants(softmax_scale=SCALE, win_right=0),
                           dk=dkv.select(2, 0), dv=dkv.select(2, 1))
    names = [name for name, *_ in seen]
    assert names == ["_bwd_dq_kernel", "_bwd_dkdv_ws_kernel"] + (["_bwd_kv_sum_kernel"] if split > 1 else []), names
    _, grid, args, kwargs = seen[1]
    assert kwargs.get("KV_SPLIT", 1) == split and not kwargs["FUSED_DQ"]
    assert grid == (n_kb, B * Hkv * split)
    gk, gv = args[6], args[7]
    # (Hkv, GROUP: the virtual heads', after 12 tensors / lengths, 18 strides and lse's 2: launch_args)
    assert args[32:34] == (Hkv * split, Hq // (Hkv * split)), args[32:34]
    if split > 1:
        assert gk.dtype == gv.dtype == torch.float32 and gk.shape == (B, S, Hkv * split, 128) and gk is not gv
        _, sgrid, sargs, skw = seen[2]
        assert sargs[0] is gk and sargs[1] is gv and sargs[2].data_ptr() == dkv.data_ptr()
        assert sargs[3].data_ptr() == dkv.select(2, 1).data_ptr() and skw["SPLIT"] == split
        assert sgrid == (-(-S // skw["BLOCK_N"]), B * Hkv)
    else:
        assert gk.data_ptr() == dkv.data_ptr()
    # the call kept a launch plan (the partials are its recorded buffers): the next call replays it
    hits, n = plan.hits, len(seen)
    bwd.attention_backward(do, q, k, v, out, lse, Variants(softmax_scale=SCALE, win_right=0),
                           dk=dkv.select(2, 0), dv=dkv.select(2, 1))
    assert plan.hits == hits + 1 and [name for name, *_ in seen[n:]] == names
    # the sequence packed: the split of its dense call alone, the sum kernel on its length class
    del seen[:]
    plan.clear()
    cu = torch.tensor([0, S], dtype=torch.int32)
    qp, kp, vp = q[0], k[0], v[0]
    bwd.attention_backward(torch.empty_like(qp), qp, kp, vp, torch.empty_like(qp), torch.empty(Hq, S),
                           Variants(softmax_scale=SCALE, win_right=0, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                    max_seqlen_q=S, max_seqlen_k=S))
    # (a launch per length class, the classes breaking where a sequence's split changes: each class's
    # split is its lengths' own, its sum kernel on the same class; the class holding S has S's split)
    launches = [(args[10:12], kw.get("KV_SPLIT", 1)) for name, _, args, kw in seen if name == "_bwd_dkdv_ws_kernel"]
    sums = [(args[6:8], kw["SPLIT"]) for name, _, args, kw in seen if name == "_bwd_kv_sum_kernel"]
    assert plan._plans, "the packed call with split classes kept no plan"
    assert [(lo, hi) for (lo, hi), _ in launches if lo <= S < hi] and sums == [c for c in launches if c[1] > 1]
    for (lo, hi), split in launches:
        if env is None:
            assert split == configs.kv_split_alone(True, Hq // Hkv, max(lo, 1), Hkv, 128, 64) == \
                configs.kv_split_alone(True, Hq // Hkv, min(hi - 1, S), Hkv, 128, 64), (lo, hi, split)
        if lo <= S < hi:
            assert split == alone and all(kw["IS_VARLEN"] for name, _, _, kw in seen if name == "_bwd_kv_sum_kernel")


@pytest.mark.parametrize("causal,over_fused,batch", [(True, True, 2), (True, False, 2), (False, True, 2),
                                                    (False, True, 1), (False, False, 1)],
                         ids=["causal", "causal-fused", "full", "full-alone", "full-alone-fused"])
def test_kv_split_over_fused(monkeypatch, causal, over_fused, batch):
    """configs.KV_SPLIT_OVER_FUSED: a call the table fuses (GROUP 16 past FUSED_DQ_GRID_FIRST's length)
    whose launch splits its kv heads takes the split kernels, KV_SPLIT on the Gluon dK/dV kernel: causal,
    2 sequences x 33 key blocks on 128 "SMs" (under one wave); without a mask one sequence alone (33
    programs: kv_split_alone splits them within one wave), while 2 sequences (66 programs) do not split
    without a mask and keep the fused dQ. With the switch off, the fused dQ (no split: the fused dQ's
    order is per kv head)."""
    from tritonattn.kernels import launch, plan

    monkeypatch.setattr(configs, "KV_SPLIT_OVER_FUSED", over_fused)
    monkeypatch.setattr(configs, "KV_SPLIT_ALONE_WAVES", (1, 1))
    monkeypatch.setattr(bwd, "GLUON", True)
    monkeypatch.setattr(bwd, "_on_sm90", lambda q: True)
    monkeypatch.setattr(configs, "BATCH_INVARIANT", False)
    monkeypatch.setattr(bwd.bwd_sm90, "sm_count", lambda device: 128)
    seen = []
    monkeypatch.setattr(launch, "launch", lambda fn, grid, args, kwargs: seen.append((fn.__name__, kwargs)))
    S = configs.FUSED_DQ_GRID_FIRST[128][1] + 7
    assert configs.fused_dq_serves(128, causal, S, 16)
    q, k, v = qkv(B=batch, Sq=S, Sk=S, Hq=16, Hkv=1)
    plan.clear()
    bwd.attention_backward(torch.empty_like(q), q, k, v, torch.empty_like(q), torch.empty(batch, 16, S),
                           Variants(softmax_scale=SCALE, win_right=0 if causal else None))
    names = [name for name, _ in seen]
    blocks = -(-S // bwd.bwd_sm90.block_n(128))
    want = (configs.kv_split(causal, 16, blocks * batch, 128) if batch > 1 else
            configs.kv_split_alone(causal, 16, S, 1, bwd.bwd_sm90.block_n(128), 128))
    assert (want > 1) == (batch == 1 or causal), want
    split = over_fused and want > 1
    assert names == (["_bwd_dq_kernel", "_bwd_dkdv_ws_kernel", "_bwd_kv_sum_kernel"] if split else
                     ["_bwd_preprocess_kernel", "_bwd_dkdv_ws_kernel", "_bwd_dq_convert_kernel"]), names
    kw = seen[1][1]
    assert kw["FUSED_DQ"] != split and kw.get("KV_SPLIT", 1) == (want if split else 1)


def test_backward_without_gluon_module(monkeypatch):
    """Where Gluon does not import (bwd.bwd_sm90 is None: an older Triton), the backward's launcher
    still runs (its Triton kernels; no KV_SPLIT or fused dQ arithmetic on the missing module)."""
    from tritonattn.kernels import launch, plan

    monkeypatch.setattr(bwd, "bwd_sm90", None)
    seen = []
    monkeypatch.setattr(launch, "launch", lambda fn, grid, args, kwargs: seen.append(fn.__name__))
    q, k, v = qkv(B=2, Sq=300, Sk=300, Hq=8, Hkv=2)
    plan.clear()
    bwd.attention_backward(torch.empty_like(q), q, k, v, torch.empty_like(q), torch.empty(2, 8, 300),
                           Variants(softmax_scale=SCALE, win_right=0))
    assert "_bwd_dq_kernel" in seen and "_bwd_dkdv_kernel" in seen, seen


def test_kv_split_forced_within_grid_limit(monkeypatch):
    """A forced TRITONATTN_BWD_KV_SPLIT halves until batch x kv heads x split fits the grid's y limit
    (configs.MAX_GRID_YZ; lowered here)."""
    from tritonattn.kernels import launch, plan

    monkeypatch.setenv("TRITONATTN_BWD_KV_SPLIT", "8")
    monkeypatch.setenv("TRITONATTN_BWD_FUSED_DQ", "0")
    monkeypatch.setattr(bwd, "GLUON", True)
    monkeypatch.setattr(bwd, "_on_sm90", lambda q: True)
    monkeypatch.setattr(configs, "BATCH_INVARIANT", False)
    monkeypatch.setattr(configs, "MAX_GRID_YZ", 2 * 2 * 2)  # 2 sequences x 2 kv heads: a split of 2 fits
    seen = []
    monkeypatch.setattr(launch, "launch", lambda fn, grid, args, kwargs: seen.append((fn.__name__, grid, kwargs)))
    S = 2048 + 7
    q, k, v = qkv(B=2, Sq=S, Sk=S, Hq=16, Hkv=2)
    plan.clear()
    bwd.attention_backward(torch.empty_like(q), q, k, v, torch.empty_like(q), torch.empty(2, 16, S),
                           Variants(softmax_scale=SCALE, win_right=0))
    (grid, kw), = [(grid, kw) for name, grid, kw in seen if name == "_bwd_dkdv_ws_kernel"]
    assert kw["KV_SPLIT"] == 2 and grid[1] == 2 * 2 * 2, (grid, kw)


def check_kv_sum(device, dtype, packed: bool = False) -> None:
    """bwd._bwd_kv_sum_kernel through bwd._launch_kv_sum: dk / dv = the sums of their fp32 partials'
    virtual heads in order (bitwise torch's left-to-right sum cast to the dtype), into strided views (a
    packed dkv's), rows past a block (77 of 64-row blocks), a head dim that is not a power of two (40:
    masked columns). Packed sequences (lengths 77, 20, 0, 50; queries 60, 20, 31, 50) summed for one
    length class, [31, 100) by the longer side: sequences 0, 2 (no key) and 3; the rows of sequence 1
    (another class's) are left as they were."""
    from tritonattn.kernels import launch

    torch.manual_seed(0)
    B, Sk, Hkv, split, D = 2, 77, 3, 4, 40
    if packed:
        lens_k, lens_q = torch.tensor([77, 20, 0, 50]), torch.tensor([60, 20, 31, 50])
        cu_k, cu_q = (torch.nn.functional.pad(t.cumsum(0), (1, 0)).to(torch.int32).to(device) for t in (lens_k, lens_q))
        total = int(lens_k.sum())
        var = Variants(softmax_scale=SCALE, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=60, max_seqlen_k=77)
        lead, shape = (total,), (total, Hkv * split, D)
    else:
        var, lead, shape = Variants(softmax_scale=SCALE), (B, Sk), (B, Sk, Hkv * split, D)
    pk, pv = (torch.randn(shape, device=device) for _ in range(2))
    dkv = torch.full((*lead, 2, Hkv, D), float("nan"), dtype=dtype, device=device)
    dk, dv = dkv.select(-3, 0), dkv.select(-3, 1)
    bwd._launch_kv_sum(pk, pv, dk, dv, split, var, (31, 100) if packed else (0, 1 << 30), launch.launch)
    for got, p in ((dk, pk), (dv, pv)):
        parts = p.view(*lead, Hkv, split, D)
        want = parts[..., 0, :]
        for i in range(1, split):
            want = want + parts[..., i, :]
        want = want.to(dtype)
        if packed:  # sequence 1's rows (77 .. 96): another class's, untouched
            assert got[77:97].isnan().all()
            got, want = torch.cat([got[:77], got[97:]]), torch.cat([want[:77], want[97:]])
        assert torch.equal(got, want), (got.float() - want.float()).abs().max()


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["f16", "f32"])
def test_kv_sum_kernel(dtype, packed):
    """On CPU tensors under the interpreter; on the GPU, compiled."""
    check_kv_sum(DEVICE, dtype, packed)


def check_dq_convert(device, packed: bool, dtype) -> None:
    """The fused dQ's float32 buffer (heads before rows) into dq through bwd._convert_dq: bitwise the
    transposing torch copy it replaces, into a contiguous dq and into a strided view (a (B, H, S, D)
    tensor seen as (B, S, H, D)); rows past a block (77 of 64-row blocks), a head dim that is not a
    power of two (40: masked columns), 3 heads; packed sequences: (Hq, total_q, D) into (total_q, Hq, D).
    Under the interpreter float32 -> bfloat16 truncates (Triton 3.6's interpreter; the GPU rounds to
    nearest even, as torch does): there the expected values are truncated too."""
    from tritonattn.kernels import launch

    torch.manual_seed(0)
    B, S, H, D = 2, 77, 3, 40
    if packed:
        dqa = torch.randn(H, B * S, D, device=device)
        cu = torch.tensor([0, S, 2 * S], dtype=torch.int32, device=device)
        var = Variants(softmax_scale=SCALE, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=S, max_seqlen_k=S)
        ref, shapes = dqa.transpose(0, 1), ((B * S, H, D), (H, B * S, D))
    else:
        dqa = torch.randn(B, H, S, D, device=device)
        var = Variants(softmax_scale=SCALE)
        ref, shapes = dqa.transpose(1, 2), ((B, S, H, D), (B, H, S, D))
    if dtype == torch.bfloat16 and device == "cpu":  # the interpreter's cast: drop the low 16 bits
        ref = (ref.contiguous().view(torch.int32) & ~0xFFFF).view(torch.float32)
    want = ref.to(dtype)
    for i, shape in enumerate(shapes):
        dq = torch.full(shape, float("nan"), dtype=dtype, device=device)
        dq = dq if i == 0 else dq.transpose(0, 1) if packed else dq.transpose(1, 2)
        bwd._convert_dq(dqa, dq, var, launch.launch)
        assert torch.equal(dq, want), (i, (dq.float() - want.float()).abs().max())


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_dq_convert_kernel(packed, dtype):
    """On CPU tensors under the interpreter; on the GPU, compiled (bf16 rounded to nearest even there)."""
    check_dq_convert(DEVICE, packed, dtype)


def test_fused_dq_varlen_classes(monkeypatch):
    """A packed call without a mask whose sequences straddle the fused dQ's length (CPU tensors as
    if on sm_90, launches recorded): the delta preprocess, the fused Gluon launch for the class from
    that length (its buffer (Hq, total_q, D), a semaphore per (head, block) with a sequence's blocks
    from cu_q[b] // BLOCK_M + b), then the dQ kernel for the shorter classes only, then their dK/dV
    launches (the Gluon kernel without dQ, the Triton one): each sequence as its own dense call."""
    from tritonattn.kernels.common import LENGTH_CAP

    seen, *_ = _recorded_varlen_call(monkeypatch, bwd)
    first = configs.FUSED_DQ_MIN_SEQLEN[128][0]
    lens = [first, 700, 100]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    total = sum(lens)
    q = torch.empty(total, 8, 128, dtype=torch.bfloat16)
    k, v = (torch.empty(total, 2, 128, dtype=torch.bfloat16) for _ in range(2))
    var = Variants(softmax_scale=SCALE, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=first, max_seqlen_k=first)
    bwd.attention_backward(torch.empty_like(q), q, k, v, torch.empty_like(q), torch.empty(8, total), var)
    names = [name for name, *_ in seen]
    assert names[:3] == ["_bwd_preprocess_kernel", "_bwd_dkdv_ws_kernel", "_bwd_dq_convert_kernel"], names
    _, _, args, kwargs = seen[1]
    assert kwargs["FUSED_DQ"] and kwargs["DETERMINISTIC"] and kwargs["IS_VARLEN"]
    assert _after(args, cu, 2, 2) == (first, LENGTH_CAP)  # (cu_q, cu_k, LEN_LO, LEN_HI)
    dqa, rows, batch_rows, head_rows, sem, sem_batch, sem_head = args[-7:]
    assert dqa.shape == (8, total, 128) and (rows, batch_rows, head_rows) == (8 * total, 0, total)
    block_m = bwd.bwd_sm90.TILES[128][0]
    assert sem.numel() == 8 * (-(-total // block_m) + 3) and (sem_batch, sem_head) == (0, sem.numel() // 8)
    rest = seen[3:]
    at = bwd._bwd_dq_kernel.arg_names.index("LEN_LO")
    dq_launches = [tuple(a[at:at + 2]) for n, _, a, _ in rest if n == "_bwd_dq_kernel"]
    assert dq_launches and all(hi <= first for _, hi in dq_launches), dq_launches
    assert [n for n, *_ in rest if n != "_bwd_dq_kernel"] == ["_bwd_dkdv_kernel", "_bwd_dkdv_ws_kernel"], names
    gluon = next(kw for n, _, _, kw in rest if n == "_bwd_dkdv_ws_kernel")
    assert not gluon["FUSED_DQ"]
    # the dQ kernel launches after the fused one's buffer was copied into dq: none before it
    assert names.index("_bwd_dq_kernel") > 1


@pytest.mark.parametrize("env", [None, "all", "atomic"], ids=["default", "fused-all", "atomic-dq"])
@pytest.mark.parametrize("D", [64, 128, 256])
def test_dkdv_launch_by_head_dim(monkeypatch, D, env):
    """The Gluon dK/dV kernel's launch by head dim (CPU tensors as if on sm_90, launches recorded),
    causal from its causal length: 128 keys per program at D=64 / 128 and 64 at D=256 (the consumers
    split by gradient, bwd_sm90 SPLIT_GRADS), the causal blocks in two loops for D=64's 128-row
    tiles only (bwd.SPLIT_DIAG_ROWS). D=256 has no fused dQ: with TRITONATTN_BWD_FUSED_DQ=all the
    dQ kernel and the Gluon dK/dV kernel without it, and with the opt-in atomic dQ (which the
    dK/dV kernel must compute) the Triton dK/dV kernel."""
    from tritonattn.kernels import launch, plan

    if env == "atomic":
        monkeypatch.setenv("TRITONATTN_ATOMIC_DQ", "1")
    elif env is not None:
        monkeypatch.setenv("TRITONATTN_BWD_FUSED_DQ", env)
    monkeypatch.setattr(bwd, "GLUON", True)
    monkeypatch.setattr(bwd, "_on_sm90", lambda q: True)
    monkeypatch.setattr(configs, "BATCH_INVARIANT", False)
    seen = []
    monkeypatch.setattr(launch, "launch", lambda fn, grid, args, kwargs: seen.append((fn.__name__, grid, args, kwargs)))
    S = max(configs.GLUON_MIN_SEQLEN["bwd_dkdv"][D][1], 1000) + 37
    q, k, v = qkv(Sq=S - 5, Sk=S, D=D)
    do, out, lse = torch.empty_like(q), torch.empty_like(q), torch.empty(2, 8, S - 5)
    plan.clear()
    bwd.attention_backward(do, q, k, v, out, lse, Variants(softmax_scale=SCALE, win_right=0))
    names = [name for name, *_ in seen]
    if D == 256 and env == "atomic":
        assert "_bwd_dkdv_ws_kernel" not in names and "_bwd_dkdv_kernel" in names, names
        return
    _, grid, args, kwargs = next(s for s in seen if s[0] == "_bwd_dkdv_ws_kernel")
    n_kb = -(-S // (64 if D == 256 else 128))
    # (the ordered fused dQ in sections of kv heads where configs.fused_sections says: a 1-d grid)
    sec = kwargs["SECTION"]
    sections_on = configs.fused_sections(D, 4, S, n_kb * 2 * 2, 4)  # (4 "SMs" on the CPU)
    assert (sec > 0) == (kwargs["FUSED_DQ"] and kwargs["DETERMINISTIC"] and sections_on), kwargs
    assert grid == ((n_kb * 2 * 2,) if sec else (n_kb, 2 * 2)), grid
    assert bwd.bwd_sm90.block_n(D) == (64 if D == 256 else 128)
    assert kwargs["SPLIT_DIAG"] == (D == 64) and kwargs["BLOCK_M"] == bwd.bwd_sm90.TILES[D][0], kwargs
    if D == 256:
        assert not kwargs["FUSED_DQ"] and names == ["_bwd_dq_kernel", "_bwd_dkdv_ws_kernel"], (kwargs, names)


@pytest.mark.parametrize("switch,flag", [("TRITONATTN_BWD_DESC_3D", "DESC_3D"),
                                         ("TRITONATTN_BWD_SPLIT_WAITS", "SPLIT_WAITS")])
def test_dkdv_experiment_switch_is_in_the_plan_key(monkeypatch, switch, flag):
    """TRITONATTN_BWD_DESC_3D and TRITONATTN_BWD_SPLIT_WAITS (experiments the bench times as
    variants in the same process as the default): a call after one with the same signature but the
    other setting takes its own plan, so the switch reaches the launch (a replay of the first call's
    plan would time the default twice)."""
    from tritonattn.kernels import launch, plan

    monkeypatch.setattr(bwd, "GLUON", True)
    monkeypatch.setattr(bwd, "_on_sm90", lambda q: True)
    monkeypatch.setattr(configs, "BATCH_INVARIANT", False)
    seen = []
    monkeypatch.setattr(launch, "launch", lambda fn, grid, args, kwargs: seen.append((fn.__name__, kwargs)))
    S = configs.GLUON_MIN_SEQLEN["bwd_dkdv"][128][1] + 37
    q, k, v = qkv(Sq=S, Sk=S, D=128)
    do, out, lse = torch.empty_like(q), torch.empty_like(q), torch.empty(2, 8, S)
    plan.clear()
    flags = []
    for env in (None, "1", None):
        set_env(monkeypatch, switch, env)
        seen.clear()
        bwd.attention_backward(do, q, k, v, out, lse, Variants(softmax_scale=SCALE, win_right=0))
        flags.append([kw[flag] for name, kw in seen if name == "_bwd_dkdv_ws_kernel"])
    assert flags == [[False], [True], [False]], flags


@pytest.mark.parametrize("D", [64, 128])
def test_dkdv_split_waits_by_head_dim(monkeypatch, D):
    """The dK/dV kernel's SPLIT_WAITS by default where configs.BWD_SPLIT_WAITS has the head dim (D=64,
    measured to gain there; D=128 lost), and TRITONATTN_BWD_SPLIT_WAITS=0 / 1 over it either way."""
    from tritonattn.kernels import launch, plan

    monkeypatch.setattr(bwd, "GLUON", True)
    monkeypatch.setattr(bwd, "_on_sm90", lambda q: True)
    monkeypatch.setattr(configs, "BATCH_INVARIANT", False)
    seen = []
    monkeypatch.setattr(launch, "launch", lambda fn, grid, args, kwargs: seen.append((fn.__name__, kwargs)))
    S = configs.GLUON_MIN_SEQLEN["bwd_dkdv"][D][1] + 37
    q, k, v = qkv(Sq=S, Sk=S, D=D)
    do, out, lse = torch.empty_like(q), torch.empty_like(q), torch.empty(2, 8, S)
    plan.clear()
    flags = []
    for env in (None, "0", "1"):
        set_env(monkeypatch, "TRITONATTN_BWD_SPLIT_WAITS", env)
        seen.clear()
        bwd.attention_backward(do, q, k, v, out, lse, Variants(softmax_scale=SCALE, win_right=0))
        flags.append([kw["SPLIT_WAITS"] for name, kw in seen if name == "_bwd_dkdv_ws_kernel"])
    assert flags == [[D in configs.BWD_SPLIT_WAITS], [False], [True]], flags
    assert (D == 64) == (D in configs.BWD_SPLIT_WAITS)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("D", [64, 128, 256])
def test_forward_launch_by_head_dim(monkeypatch, D, causal):
    """A dense forward from the Gluon kernel's first length (CPU tensors as if on sm_90; the launch
    recorded) takes its head dim's tile from fwd_sm90.TILES and BY_MASK: key block, slots, Q buffers,
    K_APART (the K ring released before V: D=256 only, where it was measured to gain), O_TMA and the
    consumers, and one length short of it the Triton kernel."""
    from tritonattn.kernels import launch, plan

    monkeypatch.setattr(fwd, "GLUON", True)
    monkeypatch.setattr(fwd, "_on_sm90", lambda q: True)
    monkeypatch.setattr(configs, "BATCH_INVARIANT", False)
    seen = []
    monkeypatch.setattr(launch, "launch", lambda fn, grid, args, kwargs: seen.append((fn.__name__, kwargs)))
    first = configs.GLUON_MIN_SEQLEN["fwd"][D][causal]
    var = Variants(softmax_scale=D ** -0.5, win_right=0 if causal else None)
    launched = {}
    for S, kernel in ((first, "_fwd_ws_kernel"), (first - 1, "_fwd_kernel")):
        seen.clear()
        plan.clear()
        fwd.attention_forward(*qkv(B=1, Sq=S, Sk=S, D=D), var)
        assert [name for name, _ in seen] == [kernel], (S, seen)
        launched[S] = seen[0][1]
    kwargs = launched[first]
    tile = fwd.fwd_sm90.tile(D, causal)
    assert {name: kwargs[name] for name in tile} == tile, kwargs
    assert kwargs["K_APART"] == (D == 256) and kwargs["CAUSAL"] == causal and kwargs["HEAD_DIM"] == D, kwargs
    # the output through a TMA store from two Q buffers at D=128, and at D=64 without a mask with
    # three consumer warpgroups (192-row tiles), with their register cap
    assert kwargs["O_TMA"] == (D == 128 or (D, causal) == (64, False)) and kwargs["Q_BUFS"] == 1 + kwargs["O_TMA"]
    assert kwargs["NC"] == (3 if (D, causal) == (64, False) else 2), kwargs
    assert kwargs["maxnreg"] == (fwd.fwd_sm90.MAXNREG_3 if kwargs["NC"] == 3 else fwd.fwd_sm90.MAXNREG), kwargs
    # dense: descriptors over the whole tensors, built once per program (DESC_ONCE)
    assert kwargs["DESC_ONCE"], kwargs


def test_forward_descriptors_once_only_where_dense_and_strided():
    """fwd_sm90.desc_once: the producer's descriptors over (batch, head, row, dim) of the whole
    tensors for dense calls; packed calls (bounds per sequence) and tensors expanded along the batch
    or the heads (a zero stride, folded into the base address by per-tile descriptors) keep the
    per-tile descriptors."""
    from tritonattn.kernels import fwd_sm90

    q, k, v = qkv(B=2, Sq=64, Sk=64, D=64)
    assert fwd_sm90.desc_once(q, k, v, varlen=False)
    assert not fwd_sm90.desc_once(q, k, v, varlen=True)
    heads = k[:, :, :1].expand(k.shape)  # the kv heads broadcast: head stride 0
    batch = v[:1].expand(v.shape)  # the batch broadcast: batch stride 0
    assert heads.stride(2) == 0 and batch.stride(0) == 0
    assert not fwd_sm90.desc_once(q, heads, v, varlen=False)
    assert not fwd_sm90.desc_once(q, k, batch, varlen=False)
