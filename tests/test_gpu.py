"""GPU tier: bf16 / fp16 / fp32, long sequences, every head dim and every config of the table.

Marked ``gpu``; needs a CUDA device (scripts/gpu_check.sh runs it on the H200). The tests of the
other files also run on the GPU when one is present.
"""

import math

import pytest
import torch
from conftest import (
    DEVICE,
    case_id,
    check_against_reference,
    check_varlen_against_reference,
    in_both_program_orders,
    set_env,
    to_paged,
)

from tritonattn import (
    configs,
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    scaled_dot_product_attention,
)
from tritonattn.kernels import bwd, fwd, launch, plan
from tritonattn.testing import random_qkv

pytestmark = pytest.mark.gpu

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
DTYPE_OF_SIZE = {2: (BF16, F16), 4: (F32,)}
# one head dim that maps to each padded head dim of the table, plus odd ones padded inside
HEAD_DIM_OF_BLOCK = {16: [8, 16], 32: [32], 64: [40, 64], 128: [80, 96, 128], 256: [160, 192, 256]}


def _cu_seqlens(lens):
    """cu_seqlens (int32, on the test device) of packed sequences of these lengths."""
    return torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=DEVICE)


def _table_cases():
    cases = []
    for block_d, elem, causal in sorted(configs.table_configs()["fwd"]):
        for dtype in DTYPE_OF_SIZE[elem]:
            for D in HEAD_DIM_OF_BLOCK[block_d]:
                cases.append((2, 1000, 1531, 8, 2, D, causal, dtype))
                cases.append((1, 1531, 777, 4, 1, D, causal, dtype))
    return cases


TABLE_CASES = _table_cases()
LONG_CASES = [
    (1, 8192, 8192, 4, 1, 128, True, BF16),
    (1, 8192, 8192, 2, 2, 64, False, BF16),
    (1, 4096, 4096, 4, 2, 256, True, BF16),
    (1, 8192, 8192, 2, 1, 128, True, F16),
    (2, 1, 8192, 8, 2, 128, False, BF16),
    (2, 8192, 1, 8, 2, 128, True, BF16),
    (2, 3000, 5000, 8, 8, 96, True, BF16),
    (2, 5000, 3000, 8, 4, 80, True, BF16),
]


def _run_and_check(B, Sq, Sk, Hq, Hkv, D, causal, dtype):
    torch.manual_seed(Sq + Sk + D)
    q, k, v = random_qkv(B, Sq, Sk, Hq, Hkv, D, dtype, DEVICE)
    out, lse, _ = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    check_against_reference(q, k, v, out, lse, grads, dout, causal)


@pytest.mark.parametrize("B,Sq,Sk,Hq,Hkv,D,causal,dtype", TABLE_CASES, ids=[case_id(*c) for c in TABLE_CASES])
def test_every_table_config(B, Sq, Sk, Hq, Hkv, D, causal, dtype, poison):
    _run_and_check(B, Sq, Sk, Hq, Hkv, D, causal, dtype)


# causal calls of at most configs.SHORT_SEQLEN queries and keys: the short-sequence tiles (forward
# at D=64 / 128, backward at D=128; D=80 / 96 pad to 128)
SHORT_CAUSAL_CASES = [(2, 1000, 1000, 8, 2, D, True, dtype) for D in (80, 128) for dtype in (BF16, F16)] + [
    (1, 513, 1024, 4, 4, 96, True, BF16),
    (3, 1024, 77, 8, 1, 128, True, BF16),
    (2, 1, 700, 8, 2, 128, True, F16),
    (2, 999, 1000, 4, 2, 64, True, BF16),
    (1, 700, 300, 4, 1, 48, True, F16),
]


def _spy_on_configs(monkeypatch) -> dict:
    """{mode: the tile the launchers last asked configs for} (fwd, bwd_dkdv, bwd_dq)."""
    picked = {}
    for mode, name in (("fwd", "forward_config"), ("bwd_dkdv", "backward_dkdv_config"),
                       ("bwd_dq", "backward_dq_config")):
        real = getattr(configs, name)

        def spy(*args, _real=real, _mode=mode, **kwargs):
            picked[_mode] = _real(*args, **kwargs)
            return picked[_mode]

        monkeypatch.setattr(configs, name, spy)
    return picked


@pytest.mark.parametrize("B,Sq,Sk,Hq,Hkv,D,causal,dtype", SHORT_CAUSAL_CASES,
                         ids=[case_id(*c) for c in SHORT_CAUSAL_CASES])
def test_short_causal_tiles(B, Sq, Sk, Hq, Hkv, D, causal, dtype, poison, monkeypatch):
    # the Triton kernels' short tiles (the Gluon kernels serve D=128 causal calls from their lengths
    # in configs.GLUON_MIN_SEQLEN on sm_90: test_gluon_forward)
    monkeypatch.setattr(fwd, "GLUON", False)
    monkeypatch.setattr(bwd, "GLUON", False)
    monkeypatch.setattr(configs, "DENSE_DECODE", False)  # (Sq=1: the forward's tile, not the decoding kernel)
    picked = _spy_on_configs(monkeypatch)
    _run_and_check(B, Sq, Sk, Hq, Hkv, D, causal, dtype)
    padded = configs.padded_head_dim(D)
    # the backward's short tiles need the default backward (the opt-in atomic dQ has its own dK/dV
    # tile and no dQ kernel), and dK/dV's also tensor descriptors (sm_90, power-of-two head dims)
    descriptors = D == padded and bwd.TMA and bwd._hopper(torch.cuda.current_device())
    for mode in ("fwd", "bwd_dkdv", "bwd_dq"):
        want = configs._SHORT_CAUSAL[mode].get(padded, configs.table_configs()[mode][(padded, 2, True)])
        if mode != "fwd" and bwd.atomic_dq_enabled() or mode == "bwd_dkdv" and not descriptors:
            continue
        assert picked[mode] == want, (mode, picked)


def test_short_causal_backward_through_pointers(poison, monkeypatch):
    """The backward through pointers (TRITONATTN_BWD_TMA=0): the short dQ tile, _POINTER_DKDV's dK/dV."""
    picked = _spy_on_configs(monkeypatch)
    monkeypatch.setattr(bwd, "TMA", False)
    monkeypatch.setattr(bwd, "GLUON", False)  # (TRITONATTN_BWD_TMA does not turn the Gluon dK/dV kernel off)
    _run_and_check(2, 1000, 999, 8, 2, 128, True, BF16)
    if not bwd.atomic_dq_enabled():
        assert picked["bwd_dq"] == configs._SHORT_CAUSAL["bwd_dq"][128], picked
        assert picked["bwd_dkdv"] == configs._POINTER_DKDV[(128, True)], picked


# forwards without causal masking, short and with many query tiles (configs.WIDE_PROGRAMS: B x Sq x Hq / 128
# >= 2048; 16 x 1000 x 16 / 128 is 2000, too few)
SHORT_WIDE_CASES = [(32, 512, 512, 16, 16, 128, False, BF16), (17, 1000, 1024, 16, 4, 96, False, F16),
                    (64, 300, 257, 16, 8, 128, False, BF16)]


@pytest.mark.parametrize("B,Sq,Sk,Hq,Hkv,D,causal,dtype", SHORT_WIDE_CASES, ids=[case_id(*c) for c in SHORT_WIDE_CASES])
def test_short_wide_forward_tile(B, Sq, Sk, Hq, Hkv, D, causal, dtype, poison, monkeypatch):
    """The Triton forward's wide short tile (on sm_90 the Gluon forward serves D=128 calls without a
    mask from configs.GLUON_MIN_SEQLEN's length: turned off here)."""
    monkeypatch.setattr(fwd, "GLUON", False)
    picked, real = [], configs.forward_config

    def spy(*args, **kwargs):
        picked.append(real(*args, **kwargs))
        return picked[-1]

    monkeypatch.setattr(configs, "forward_config", spy)
    _run_and_check(B, Sq, Sk, Hq, Hkv, D, causal, dtype)
    assert picked and picked[0] == configs._SHORT_WIDE_FWD[128], picked


@pytest.mark.parametrize("gluon", [True, False], ids=["default", "triton"])
@pytest.mark.parametrize("B,Sq,Sk,Hq,Hkv,D,causal,dtype", LONG_CASES, ids=[case_id(*c) for c in LONG_CASES])
def test_long_sequences(B, Sq, Sk, Hq, Hkv, D, causal, dtype, gluon, poison, monkeypatch):
    """Default: the D=128 cases take the Gluon forward and dK/dV kernels (kernels/fwd_sm90.py,
    bwd_sm90.py); triton: the Triton kernels serve them too (their path for varlen and the variants
    at these lengths)."""
    if not gluon:
        if D != 128:
            pytest.skip("the same path as the default")
        monkeypatch.setattr(fwd, "GLUON", False)
        monkeypatch.setattr(bwd, "GLUON", False)
    _run_and_check(B, Sq, Sk, Hq, Hkv, D, causal, dtype)


def _launched(monkeypatch) -> list:
    """The names of the kernels launched from now on (launch plans cleared: launchers really launch)."""
    names, real = [], launch.launch

    def record(fn, grid, *args):
        names.append(fn.__name__)
        real(fn, grid, *args)

    monkeypatch.setattr(launch, "launch", record)
    plan.clear()
    return names


# the Gluon kernels' calls: odd lengths from configs.GLUON_MIN_SEQLEN on, Sq != Sk both ways
# (causal rows that see no key), one query or one key, GQA / MQA / MHA, both 16-bit dtypes (keys
# that no query sees: test_gluon_forward_sdpa_top_left_causal)
GLUON_CASES = [
    (2, 2048, 2048, 8, 2, 128, False, BF16),
    (2, 2048, 2048, 8, 2, 128, True, F16),
    (1, 2049, 3001, 4, 1, 128, True, BF16),
    (1, 3001, 2049, 4, 4, 128, True, BF16),
    (2, 1, 4096, 8, 2, 128, True, BF16),
    (1, 4100, 1, 4, 1, 128, False, F16),
    (1, 5000, 5000, 2, 2, 128, True, BF16),
    (4, 1024, 1000, 8, 2, 128, False, BF16),  # the forward from 1024, without a mask and with one
    (2, 777, 700, 8, 2, 128, False, BF16),  # the Gluon dK/dV kernel without the fused dQ (512-1023, no mask)
    (1, 2100, 2000, 16, 2, 128, True, BF16),  # causal, 8 query heads per kv head: split dQ until 4096
    (9, 2100, 2000, 16, 2, 128, True, BF16),  # ... also at 2.2 waves (configs.FUSED_DQ_MASKED_WAVES off)
    (2, 1100, 1024, 8, 2, 128, True, BF16),
    (2, 700, 513, 4, 2, 128, True, BF16),  # causal, rows that see no key; below the dK/dV kernel's length
    (2, 511, 500, 4, 2, 128, True, BF16),  # one short of D=128's causal length: the Triton forward
    (1, 511, 511, 4, 1, 128, False, F16),  # the Gluon forward; one short of the dK/dV kernel's length (512)
    (1, 255, 255, 4, 1, 128, False, F16),  # the Gluon forward (from 128), not the dK/dV kernel
    (1, 127, 127, 4, 1, 128, False, F16),  # one short of D=128's length: neither
    # the forward's other head dims, from their own lengths (no Gluon dK/dV kernel there)
    (2, 1024, 1000, 4, 2, 256, False, BF16),
    (1, 4100, 4096, 2, 1, 256, True, BF16),
    (1, 511, 500, 4, 2, 256, True, F16),  # the Gluon forward (from 128), not the dK/dV kernel (512)
    (1, 127, 120, 4, 2, 256, True, F16),  # one short of D=256's forward length: the Triton forward
    (1, 127, 127, 4, 2, 256, False, BF16),  # the same without a mask
    (1, 8192, 8191, 4, 2, 64, True, F16),
    (1, 4095, 4095, 2, 2, 64, True, BF16),  # one short of D=64's causal length: the Triton forward
    (1, 4096, 4000, 4, 1, 64, False, BF16),
    (2, 2048, 2000, 8, 1, 64, False, F16),  # D=64's fused dQ from its length (no mask), 8 query heads per kv head
    (1, 2047, 2047, 2, 2, 64, False, BF16),  # three consumers (192-row tiles), a length no multiple of them
    (1, 511, 511, 2, 2, 64, False, BF16),  # one short of D=64's length: the Triton forward
    # the dK/dV kernel's other tiles: D=64 causal (its crossing blocks in loops of their own), D=256
    # (the consumers split by gradient), GQA / MQA / MHA, Sq != Sk both ways, one query
    (1, 1030, 2000, 4, 1, 64, True, BF16),
    (2, 1023, 1023, 4, 2, 64, True, BF16),  # one short of D=64's causal dK/dV length
    (2, 511, 500, 4, 2, 256, False, F16),  # one short of D=256's dK/dV length
    (1, 2049, 3001, 4, 1, 256, True, F16),
    (1, 3001, 1100, 4, 4, 256, True, BF16),
    (2, 1, 2048, 4, 2, 256, True, BF16),
    (1, 1100, 1030, 6, 2, 256, False, F16),
]


@pytest.mark.parametrize("B,Sq,Sk,Hq,Hkv,D,causal,dtype", GLUON_CASES, ids=[case_id(*c) for c in GLUON_CASES])
def test_gluon_forward(B, Sq, Sk, Hq, Hkv, D, causal, dtype, poison, monkeypatch):
    """The Gluon sm_90 forward and dK/dV kernels: taken (the dK/dV kernel from its own length),
    within the reference's tolerance (out, lse, dQ from the Triton dQ kernel or, from
    configs.FUSED_DQ_MIN_SEQLEN, the fused dQ, dK / dV), bitwise the same on a rerun."""
    if not fwd._on_sm90(torch.empty(0, device=DEVICE)):
        pytest.skip("the Gluon kernels run on sm_90 GPUs only")
    # one query row per kv head group would take the decoding kernel (configs.dense_decode: its own
    # tests); here the forward kernels' one-row case
    monkeypatch.setattr(configs, "DENSE_DECODE", False)
    names = _launched(monkeypatch)
    torch.manual_seed(Sq + Sk)
    q, k, v = random_qkv(B, Sq, Sk, Hq, Hkv, D, dtype, DEVICE)
    out, lse, _ = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    gluon_fwd = max(Sq, Sk) >= configs.GLUON_MIN_SEQLEN["fwd"][D][causal]
    assert ("_fwd_ws_kernel" in names) == gluon_fwd and ("_fwd_kernel" in names) != gluon_fwd, names
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    gluon_bwd = max(Sq, Sk) >= configs.GLUON_MIN_SEQLEN["bwd_dkdv"].get(D, (math.inf,) * 2)[causal]
    assert ("_bwd_dkdv_ws_kernel" in names) == gluon_bwd and ("_bwd_dkdv_kernel" in names) != gluon_bwd, names
    # the fused dQ (its buffer converted into dq) exactly where configs.fused_dq_serves routes it
    programs = -(-Sk // bwd.bwd_sm90.block_n(D)) * B * Hkv  # (the Gluon dK/dV launch: FUSED_DQ_MASKED_WAVES)
    sms = launch.sm_count(q.device)
    fused = gluon_bwd and configs.fused_dq_serves(D, causal, max(Sq, Sk), Hq // Hkv, programs, sms)
    # (a launch that splits its kv heads takes the split kernels: configs.KV_SPLIT_OVER_FUSED)
    split = bwd._kv_split(None, causal, Hq // Hkv, programs, sms, B, max(Sq, Sk), Hkv,
                          bwd.bwd_sm90.block_n(D)) if gluon_bwd else 1
    fused = fused and not (split > 1 and configs.KV_SPLIT_OVER_FUSED)
    assert ("_bwd_kv_sum_kernel" in names) == (gluon_bwd and not fused and split > 1), names
    assert ("_bwd_dq_convert_kernel" in names) == fused and ("_bwd_dq_kernel" in names) != fused, names
    check_against_reference(q, k, v, out, lse, grads, dout, causal)
    again, lse2, _ = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    assert torch.equal(out, again) and torch.equal(lse, lse2)
    for a, b in zip(grads, torch.autograd.grad(out, (q, k, v), dout), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("broadcast", ["batch", "heads"])
def test_gluon_forward_expanded_kv(broadcast, causal, poison, monkeypatch):
    """K / V broadcast along the batch (batch stride 0) or the kv heads (head stride 0), as
    ``expand`` gives them: the Gluon forward keeps its per-tile descriptors there (fwd_sm90.desc_once
    is False: a stride of 0 is folded into each tile's base address), and its results are within
    the reference's tolerance and bitwise those of the same call on materialized copies (which take
    the descriptors built once per program)."""
    if not fwd._on_sm90(torch.empty(0, device=DEVICE)):
        pytest.skip("the Gluon kernels run on sm_90 GPUs only")
    torch.manual_seed(7)
    B, S, Hq, Hkv, D = 2, 1500, 8, 2, 128
    q = torch.randn(B, S, Hq, D, device=DEVICE, dtype=BF16)
    if broadcast == "batch":
        k, v = (torch.randn(1, S, Hkv, D, device=DEVICE, dtype=BF16).expand(B, S, Hkv, D) for _ in range(2))
    else:
        k, v = (torch.randn(B, S, 1, D, device=DEVICE, dtype=BF16).expand(B, S, Hkv, D) for _ in range(2))
    seen, real = [], launch.launch

    def record(fn, grid, args, kwargs):
        seen.append((fn.__name__, kwargs.get("DESC_ONCE")))
        real(fn, grid, args, kwargs)

    monkeypatch.setattr(launch, "launch", record)
    plan.clear()
    out, lse, _ = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    assert seen == [("_fwd_ws_kernel", False)], seen
    del seen[:]
    ref, ref_lse, _ = flash_attn_func(q, k.contiguous(), v.contiguous(), causal=causal, return_attn_probs=True)
    assert seen == [("_fwd_ws_kernel", True)], seen
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    dout = torch.randn_like(out)
    kc, vc = k.contiguous().requires_grad_(), v.contiguous().requires_grad_()
    qg = q.clone().requires_grad_()
    out2, lse2, _ = flash_attn_func(qg, kc, vc, causal=causal, return_attn_probs=True)
    check_against_reference(qg, kc, vc, out, lse, torch.autograd.grad(out2, (qg, kc, vc), dout), dout, causal)


_PLAIN = dict(Q_BUFS=1, V_STAGES=3, O_TMA=False, SPLIT_WAIT=False)  # D=128's Gluon tile before the twenty-fifth session
_NC3 = dict(NC=3, Q_BUFS=2, O_TMA=True)  # D=64's without a mask
# the Gluon forward's tiles against a plainer one: name -> (head dim, BY_MASK of the reference, of the
# run; None: the default's)
_FWD_TILES = {
    "D128-default-vs-plain": (128, {(128, False): _PLAIN, (128, True): _PLAIN}, None),
    "D64-three-consumers-vs-two": (64, {}, {(64, False): _NC3, (64, True): _NC3}),
    # SPLIT_WAIT (the softmax while the last P V runs): the default at D=128 and D=256 against the
    # tile without it; at D=64 (off there) with it against the default
    "D128-split-wait": (128, {(128, False): dict(SPLIT_WAIT=False), (128, True): dict(SPLIT_WAIT=False)}, None),
    "D64-split-wait": (64, None, {(64, False): dict(_NC3, SPLIT_WAIT=True), (64, True): dict(SPLIT_WAIT=True)}),
    "D256-split-wait": (256, {(256, False): dict(SPLIT_WAIT=False), (256, True): dict(SPLIT_WAIT=False)}, None),
    # (fp16: the f16x2 rounding of P in both tiles)
    "D128-split-wait-fp16": (128, {(128, False): dict(SPLIT_WAIT=False), (128, True): dict(SPLIT_WAIT=False)}, None),
    # TREE_MAX (an experiment, off: the row max as a tree) against the default tile
    "D64-tree-max": (64, None, {(64, False): dict(_NC3, TREE_MAX=True), (64, True): dict(TREE_MAX=True)}),
    "D128-tree-max": (128, None, {(128, False): dict(TREE_MAX=True), (128, True): dict(TREE_MAX=True)}),
}


@pytest.mark.parametrize("tiles", list(_FWD_TILES))
@pytest.mark.parametrize("programs", [None, 7], ids=["per-SM", "7-programs"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gluon_forward_tiles_bitwise(tiles, causal, programs, poison, monkeypatch):
    """The Gluon forward's tiles (fwd_sm90.TILES, BY_MASK) against plainer ones, bitwise: at D=128 two
    Q buffers, two V slots and the output through the tile's Q buffer and a TMA store (O_TMA)
    against one Q buffer, three V slots and the output stored from registers; at D=64 three
    consumer warpgroups (192-row tiles) with O_TMA without a mask, and also with one, against two
    consumers; SPLIT_WAIT (the softmax of S_j while P_{j-1} V_{j-1} runs; the default at D=128 and
    D=256) against the tile without it, in fp16 too (a case named -fp16; the others bf16); TREE_MAX
    (the row max as a tree) against the default. A row's
    arithmetic is the same in all (the key blocks a larger tile visits past a row's diagonal add
    exact zeros). On one program per SM and on 7 (many tiles each: the Q buffers, the rings and the
    turns carry across tiles), dense (GQA, a length that is no multiple of the tile) and packed
    (per-tile descriptors; a sequence of one query and one of no key); the Gluon kernel at every
    length here (GLUON_MIN_SEQLEN 0), and both calls take the tile asked for."""
    if not fwd._on_sm90(torch.empty(0, device=DEVICE)):
        pytest.skip("the Gluon kernels run on sm_90 GPUs only")
    D, ref_tiles, run_tiles = _FWD_TILES[tiles]
    dtype = F16 if tiles.endswith("-fp16") else BF16
    monkeypatch.setattr(fwd.fwd_sm90, "PROGRAMS", programs)
    monkeypatch.setitem(configs.GLUON_MIN_SEQLEN["fwd"], D, (0, 0))
    torch.manual_seed(5)
    q = torch.randn(2, 1500, 8, D, device=DEVICE, dtype=dtype)
    k, v = (torch.randn(2, 1500, 2, D, device=DEVICE, dtype=dtype) for _ in range(2))
    lens_q, lens_k = [1300, 1, 1100, 900], [1300, 1100, 0, 2000]
    cu_q, cu_k = _cu_seqlens(lens_q), _cu_seqlens(lens_k)
    vq = torch.randn(sum(lens_q), 8, D, device=DEVICE, dtype=dtype)
    vk, vv = (torch.randn(sum(lens_k), 2, D, device=DEVICE, dtype=dtype) for _ in range(2))
    seen, real = [], launch.launch

    def record(fn, grid, args, kwargs):
        if fn.__name__ == "_fwd_ws_kernel":
            seen.append((kwargs["IS_VARLEN"], {name: kwargs[name] for name in fwd.fwd_sm90.tile(D, causal)}))
        real(fn, grid, args, kwargs)

    def both(by_mask):
        monkeypatch.setattr(fwd.fwd_sm90, "BY_MASK", by_mask)
        seen.clear()
        plan.clear()
        out = (flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)[:2]
               + flash_attn_varlen_func(vq, vk, vv, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                        return_attn_probs=True)[:2])
        want = fwd.fwd_sm90.tile(D, causal)
        assert sorted({varlen for varlen, _ in seen}) == [False, True] and all(t == want for _, t in seen), seen
        return out

    default = dict(fwd.fwd_sm90.BY_MASK)
    monkeypatch.setattr(launch, "launch", record)
    ref = both(default if ref_tiles is None else ref_tiles)
    ref_tile = seen[0][1]
    got = both(default if run_tiles is None else run_tiles)
    assert seen[0][1] != ref_tile, ("the case compares a tile with itself", ref_tile)
    for a, b in zip(got, ref, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("causal,section", [(False, None), (True, None), (True, 5)],
                         ids=["full", "causal", "causal-sections-of-5"])
def test_gluon_forward_few_programs(causal, section, poison, monkeypatch):
    """The Gluon forward's persistent grid on 7 programs (fwd_sm90.PROGRAMS), many tiles each, so
    that ring slots, turns and Q buffers carry across tiles of different lengths (causal) and
    heads; causal, also in sections of 5 of the 12 heads (the last one of 2): bitwise what one
    program per SM gives in the default order (a tile's arithmetic does not depend on the program
    that runs it nor on when), and within the reference's tolerance."""
    if not fwd._on_sm90(torch.empty(0, device=DEVICE)):
        pytest.skip("the Gluon forward runs on sm_90 GPUs only")
    torch.manual_seed(13)
    q, k, v = random_qkv(2, 1500, 1300, 6, 2, 128, BF16, DEVICE)
    names = _launched(monkeypatch)
    out, lse, _ = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    assert "_fwd_ws_kernel" in names, names
    monkeypatch.setattr(fwd.fwd_sm90, "PROGRAMS", 7)
    monkeypatch.setattr(fwd.fwd_sm90, "HEADS_PER_SECTION", section)
    plan.clear()
    few, lse_few, _ = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    assert torch.equal(out, few) and torch.equal(lse, lse_few)
    check_against_reference(q, k, v, few, lse_few, None, None, causal)


def test_gluon_dkdv_into_gradient_views(poison, monkeypatch):
    """dK / dV written by the Gluon kernel into views of one packed (B, S, 3, H, D) gradient (what
    flash_attn_qkvpacked_func's backward hands it), MHA, causal: against the reference."""
    if not fwd._on_sm90(torch.empty(0, device=DEVICE)):
        pytest.skip("the Gluon kernels run on sm_90 GPUs only")
    torch.manual_seed(7)
    qkv = torch.randn(2, 2304, 3, 4, 128, device=DEVICE, dtype=BF16, requires_grad=True)
    names = _launched(monkeypatch)
    out = flash_attn_qkvpacked_func(qkv, causal=True)
    dout = torch.randn_like(out)
    (dqkv,) = torch.autograd.grad(out, (qkv,), dout)
    assert "_bwd_dkdv_ws_kernel" in names, names
    q, k, v = (qkv[:, :, i].detach() for i in range(3))
    check_against_reference(q, k, v, out, None, dqkv.unbind(2), dout, True)


@pytest.mark.parametrize("right", [0, 700])
def test_gluon_forward_right_window_edge(right, poison, monkeypatch):
    """A window's right edge alone: the Gluon forward's causal mask shifted, against the reference."""
    if not fwd._on_sm90(torch.empty(0, device=DEVICE)):
        pytest.skip("the Gluon forward runs on sm_90 GPUs only")
    torch.manual_seed(5)
    q, k, v = random_qkv(1, 2500, 3100, 8, 2, 128, BF16, DEVICE)
    names = _launched(monkeypatch)
    out, lse, _ = flash_attn_func(q, k, v, window_size=(-1, right), return_attn_probs=True)
    assert "_fwd_ws_kernel" in names, names
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    check_against_reference(q, k, v, out, lse, grads, dout, False, window_size=(-1, right))


@pytest.mark.parametrize("Sq,Sk", [(2500, 3100), (2048, 4096)])
def test_gluon_forward_sdpa_top_left_causal(Sq, Sk, poison, monkeypatch):
    """SDPA's top-left causal mask with Sq < Sk, a right edge at Sq - Sk < 0 (which flash-attn's
    window_size cannot say), through both Gluon kernels: against the reference with that edge, and
    within bf16 rounding of PyTorch's SDPA in fp32. Keys past Sq are seen by no query: at 2048 /
    4096 whole dK/dV programs have no query block (their dK and dV must be 0). (The reference takes
    the mask as a boolean tile: its window_size reads a negative right edge as none.)"""
    if not fwd._on_sm90(torch.empty(0, device=DEVICE)):
        pytest.skip("the Gluon forward runs on sm_90 GPUs only")
    torch.manual_seed(6)
    q, k, v = random_qkv(1, Sq, Sk, 8, 2, 128, BF16, DEVICE)
    sdpa_q, sdpa_k, sdpa_v = (t.transpose(1, 2) for t in (q, k, v))
    names = _launched(monkeypatch)
    top_left = scaled_dot_product_attention(sdpa_q, sdpa_k, sdpa_v, is_causal=True, enable_gqa=True)
    assert "_fwd_ws_kernel" in names, names
    dout = torch.randn_like(top_left)
    grads = torch.autograd.grad(top_left, (q, k, v), dout)
    assert "_bwd_dkdv_ws_kernel" in names, names
    top_left_mask = torch.arange(Sk, device=DEVICE)[None, :] <= torch.arange(Sq, device=DEVICE)[:, None]
    check_against_reference(q, k, v, top_left.transpose(1, 2), None, grads, dout.transpose(1, 2), False,
                            mask=top_left_mask)
    assert not grads[1][:, Sq:].any() and not grads[2][:, Sq:].any()
    ref = torch.nn.functional.scaled_dot_product_attention(sdpa_q.float(), sdpa_k.float(), sdpa_v.float(),
                                                           is_causal=True, enable_gqa=True)
    torch.testing.assert_close(top_left.float(), ref, atol=2e-2, rtol=0)


def test_gluon_forward_not_taken(monkeypatch):
    """Calls the Gluon kernels do not serve take the Triton kernels, forward and dK/dV: D=64 causal
    under its lengths, a window's left edge, ALiBi, forced tiles, and
    TRITONATTN_BATCH_INVARIANT; a varlen call with TRITONATTN_FWD_GLUON_VARLEN=0 and
    TRITONATTN_BWD_GLUON_VARLEN=0 (and by default takes both Gluon kernels)."""
    if not fwd._on_sm90(torch.empty(0, device=DEVICE)):
        pytest.skip("off sm_90 no call takes the Gluon kernels (tests/test_gluon.py)")
    torch.manual_seed(0)
    q, k, v = random_qkv(1, 2048, 2048, 4, 2, 128, BF16, DEVICE)
    # D=64 causal one token under the first length of either Gluon kernel (configs.GLUON_MIN_SEQLEN)
    s64 = min(configs.GLUON_MIN_SEQLEN["fwd"][64][1], configs.GLUON_MIN_SEQLEN["bwd_dkdv"].get(64, (0, 4096))[1]) - 1
    q64, k64, v64 = random_qkv(1, s64, s64, 4, 2, 64, BF16, DEVICE)
    cu = torch.tensor([0, 2048], dtype=torch.int32, device=DEVICE)
    calls = [
        lambda: flash_attn_func(q64, k64, v64, causal=True),
        lambda: flash_attn_func(q, k, v, window_size=(100, 0)),
        lambda: flash_attn_func(q, k, v, causal=True, alibi_slopes=torch.rand(4, device=DEVICE)),
    ]
    varlen = lambda: flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 2048, 2048, causal=True)  # noqa: E731

    def forward_and_backward(call) -> list:
        names = _launched(monkeypatch)
        out = call()
        # a dense dO (``out.sum().backward()`` hands a stride-0 one, which no descriptor reads)
        out.backward(torch.randn_like(out))
        return names

    # the control: the plain causal call takes both Gluon kernels
    names = forward_and_backward(lambda: flash_attn_func(q, k, v, causal=True))
    assert "_fwd_ws_kernel" in names and "_bwd_dkdv_ws_kernel" in names, names
    for call in calls:
        names = forward_and_backward(call)
        assert "_fwd_kernel" in names and "_fwd_ws_kernel" not in names, names
        assert "_bwd_dkdv_kernel" in names and "_bwd_dkdv_ws_kernel" not in names, names
    # both Gluon kernels by default (beside the Triton launches of the shorter length classes, whose
    # programs find no sequence here); each off with its switch
    names = forward_and_backward(varlen)
    assert "_fwd_ws_kernel" in names and "_bwd_dkdv_ws_kernel" in names, names
    monkeypatch.setattr(fwd, "GLUON_VARLEN", False)
    monkeypatch.setattr(bwd, "GLUON_VARLEN", False)
    names = forward_and_backward(varlen)
    assert "_fwd_kernel" in names and "_fwd_ws_kernel" not in names, names
    assert "_bwd_dkdv_kernel" in names and "_bwd_dkdv_ws_kernel" not in names, names
    with configs.override(fwd=configs.forward_config(q, True), bwd_dkdv=configs.backward_dkdv_config(q, True)):
        names = forward_and_backward(lambda: flash_attn_func(q, k, v, causal=True))
        assert "_fwd_ws_kernel" not in names and "_bwd_dkdv_ws_kernel" not in names, names
    monkeypatch.setattr(configs, "BATCH_INVARIANT", True)
    names = forward_and_backward(lambda: flash_attn_func(q, k, v, causal=True))
    assert "_fwd_ws_kernel" not in names and "_bwd_dkdv_ws_kernel" not in names, names


def test_deterministic_at_scale():
    torch.manual_seed(0)
    q, k, v = random_qkv(2, 4096, 4096, 16, 4, 128, BF16, DEVICE)
    out = flash_attn_func(q, k, v, causal=True)
    dout = torch.randn_like(out)
    first = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    for _ in range(3):
        again = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        for a, b in zip(first, again, strict=False):
            assert torch.equal(a, b)


VARIANT_CASES = [
    # (name, B, S, Hq, Hkv, D, kwargs for attention())
    ("window256-causal", 1, 4096, 8, 2, 128, dict(causal=True, window_size=(256, -1))),
    ("window-both-sides", 1, 3000, 4, 4, 64, dict(window_size=(100, 37))),
    ("softcap-alibi", 2, 2048, 8, 2, 128, dict(causal=True, softcap=30.0, alibi="H")),
    ("bias-B1SS-grad", 2, 1024, 8, 2, 128, dict(causal=True, bias="B1SS")),
    ("bias-full-grad-D96", 1, 1000, 4, 1, 96, dict(bias="BHSS")),
    ("key-padding", 2, 2048, 8, 2, 128, dict(causal=True, keypad=True)),
    ("mask-tile", 1, 1500, 4, 2, 64, dict(mask=True)),
    ("dropout", 2, 1024, 8, 2, 128, dict(causal=True, dropout_p=0.15)),
    ("dropout-long", 1, 2048, 8, 2, 128, dict(causal=True, dropout_p=0.15)),  # past configs.SHORT_SEQLEN
    ("combined-D80", 1, 1531, 6, 2, 80, dict(causal=True, window_size=(300, -1), softcap=20.0, alibi="H",
                                             bias="B1SS", dropout_p=0.1)),
]


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name,B,S,Hq,Hkv,D,kw", VARIANT_CASES, ids=[c[0] for c in VARIANT_CASES])
def test_variants_on_gpu(name, B, S, Hq, Hkv, D, kw, dtype, poison):
    from tritonattn import attention

    torch.manual_seed(S + D)
    q, k, v = random_qkv(B, S, S, Hq, Hkv, D, dtype, DEVICE)
    kw = dict(kw)
    ref_kw = {key: kw[key] for key in ("window_size", "softcap") if key in kw}
    bias = None
    if kw.pop("alibi", None):
        kw["alibi_slopes"] = ref_kw["alibi_slopes"] = torch.rand(Hq, device=DEVICE)
    shape = {"B1SS": (B, 1, S, S), "BHSS": (B, Hq, S, S)}.get(kw.pop("bias", None))
    if shape:
        bias = kw["bias"] = torch.randn(shape, device=DEVICE, dtype=dtype).requires_grad_()
    if kw.pop("keypad", None):
        kpm = torch.rand(B, S, device=DEVICE) > 0.2
        kw["key_padding_mask"] = ref_kw["key_padding_mask"] = kpm
    if kw.pop("mask", None):
        kw["mask"] = ref_kw["mask"] = torch.rand(B, 1, S, S, device=DEVICE) > 0.5
    if kw.get("dropout_p"):
        # the keep pattern depends only on the seed and position: flash_attn_func's S_dmask gives it
        torch.manual_seed(7)
        fa_kw = {key: kw[key] for key in ("causal", "window_size", "softcap", "alibi_slopes") if key in kw}
        _, _, s_dmask = flash_attn_func(q, k, v, dropout_p=kw["dropout_p"], return_attn_probs=True, **fa_kw)
        ref_kw.update(dropout_p=kw["dropout_p"], dropout_mask=s_dmask >= 0)
        del s_dmask
        torch.manual_seed(7)
    out, lse = attention(q, k, v, return_lse=True, **kw)
    wrt = (q, k, v, bias) if bias is not None else (q, k, v)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, wrt, dout)
    check_against_reference(q, k, v, out, lse, grads[:3], dout, kw.get("causal", False), bias=bias,
                            dbias=grads[3] if bias is not None else None, **ref_kw)


def _packed_run(lens, Hq, Hkv, causal, seed, D=128):
    """A bf16 varlen forward + backward (head dim D) over sequences of ``lens`` (self-attention):
    ``(cu, (q, k, v), out, lse, dout, (dq, dk, dv))``."""
    from tritonattn import flash_attn_varlen_func

    torch.manual_seed(seed)
    cu = _cu_seqlens(lens)
    total = sum(lens)
    qkv = tuple(torch.randn(total, h, D, device=DEVICE, dtype=BF16, requires_grad=True) for h in (Hq, Hkv, Hkv))
    out, lse, _ = flash_attn_varlen_func(*qkv, cu, cu, max(lens), max(lens), causal=causal, return_attn_probs=True)
    dout = torch.randn_like(out)
    return cu, qkv, out, lse, dout, torch.autograd.grad(out, qkv, dout)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_on_gpu(causal, poison):
    cu, qkv, out, lse, dout, grads = _packed_run([4000, 1, 0, 2047, 3333, 129], 16, 4, causal, seed=1)
    check_varlen_against_reference(*qkv, out, lse, grads, dout, cu, causal)


@pytest.mark.parametrize("D,programs", [(128, None), (128, 5), (64, None), (256, 5)],
                         ids=["D128-per-SM", "D128-5-programs", "D64-per-SM", "D256-5-programs"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gluon_forward_varlen(causal, D, programs, poison, monkeypatch):
    """The Gluon kernels' variable-length paths (fwd.GLUON_VARLEN, bwd.GLUON_VARLEN), the forward on
    one program per SM and on 5 (many tiles each, tiles past a sequence skipped by every partition;
    causal, in sections of 3 heads): taken, each sequence within the reference's tolerance (out,
    lse, and the gradients: dQ from the Triton kernel, dK / dV from the Gluon one), Sq != Sk both
    ways, a sequence with queries and no key (out 0, lse -inf), one with keys and no query (dK, dV
    0), one query; and bitwise what the sequence's own dense call gives where that call takes the
    Gluon forward too. D=64 / 256: the forward's other tiles (D=64 causal is under its length: the
    Triton forward), and the dK/dV kernel's (D=64: 128 rows, causal blocks in two loops; D=256: the
    consumers split by gradient)."""
    from tritonattn import flash_attn_varlen_func

    if not fwd._on_sm90(torch.empty(0, device=DEVICE)):
        pytest.skip("the Gluon forward runs on sm_90 GPUs only")
    monkeypatch.setattr(fwd, "GLUON_VARLEN", True)
    monkeypatch.setattr(bwd, "GLUON_VARLEN", True)
    monkeypatch.setattr(fwd.fwd_sm90, "PROGRAMS", programs)
    # the sequences' own dense calls take the Gluon forward too, not the decoding kernel for the one
    # query (configs.dense_decode), so that they can be compared bitwise below
    monkeypatch.setattr(configs, "DENSE_DECODE", False)
    if programs and causal:  # and the causal order in sections of 3 of the 48 heads
        monkeypatch.setattr(fwd.fwd_sm90, "HEADS_PER_SECTION", 3)
    lens_q, lens_k = [2100, 5, 3000, 0, 1, 1300], [2100, 0, 2999, 7, 4095, 2500]
    torch.manual_seed(11)
    cu_q, cu_k = _cu_seqlens(lens_q), _cu_seqlens(lens_k)
    q = torch.randn(sum(lens_q), 8, D, device=DEVICE, dtype=BF16, requires_grad=True)
    k, v = (torch.randn(sum(lens_k), 2, D, device=DEVICE, dtype=BF16, requires_grad=True) for _ in range(2))
    names = _launched(monkeypatch)
    out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                         return_attn_probs=True)
    longest = max(*lens_q, *lens_k)
    gluon_fwd = longest >= configs.GLUON_MIN_SEQLEN["fwd"][D][causal]
    # what the case is for: D=64 causal under its Gluon length (the Triton forward), every other case over
    assert gluon_fwd == (D != 64 or not causal), "configs.GLUON_MIN_SEQLEN moved: change the lengths above"
    # a launch per length class: the class under the Gluon kernel's length takes the Triton kernel (with
    # one launch for the whole call, as before the classes, the Gluon kernel alone would run)
    assert ("_fwd_ws_kernel" in names) == gluon_fwd and "_fwd_kernel" in names, names
    dout = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    gluon_bwd = D in bwd.bwd_sm90.TILES and longest >= configs.GLUON_MIN_SEQLEN["bwd_dkdv"][D][causal]
    assert ("_bwd_dkdv_ws_kernel" in names) == gluon_bwd and "_bwd_dkdv_kernel" in names, names
    for b, (lq, lk) in enumerate(zip(lens_q, lens_k, strict=True)):
        qs, ks = slice(cu_q[b].item(), cu_q[b + 1].item()), slice(cu_k[b].item(), cu_k[b + 1].item())
        if lq == 0:  # keys that no query sees (their buffers start at 0: a result check)
            assert not dk[ks].any() and not dv[ks].any(), b
            continue
        if lk == 0:
            assert not out[qs].any() and torch.all(lse[:, qs] == float("-inf")), b
            continue
        check_against_reference(q[qs][None], k[ks][None], v[ks][None], out[qs][None], lse[:, qs][None],
                                (dq[qs][None], dk[ks][None], dv[ks][None]), dout[qs][None], causal)
        # bitwise what its own dense call gives, whichever kernel and tile its length picks
        qb, kb, vb = (t.detach()[sl][None].requires_grad_() for t, sl in ((q, qs), (k, ks), (v, ks)))
        ob, lseb, _ = flash_attn_func(qb, kb, vb, causal=causal, return_attn_probs=True)
        gq, gk, gv = torch.autograd.grad(ob, (qb, kb, vb), dout[qs][None])
        assert torch.equal(out[qs], ob[0]) and torch.equal(lse[:, qs], lseb[0]), b
        assert torch.equal(dq[qs], gq[0]) and torch.equal(dk[ks], gk[0]) and torch.equal(dv[ks], gv[0]), b


@pytest.mark.parametrize("invariant", [False, True], ids=["default", "batch-invariant"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_bitwise_equals_dense_on_gpu(causal, invariant, poison, monkeypatch):
    """A sequence of a packed batch gives bitwise what a dense call on it alone gives, where the
    lengths pick other kernels or tiles for the packed call's sequences: a short non-causal batch
    with many query tiles (the wide tile, dense calls only), and a causal batch longer than
    configs.SHORT_SEQLEN holding short sequences (the short tiles) and long ones (the Gluon
    kernels). By default through a launch per length class (launch.length_classes); with
    TRITONATTN_BATCH_INVARIANT through one tile for every length."""
    monkeypatch.setattr(configs, "BATCH_INVARIANT", invariant)
    plan.clear()
    lens = [2500, 700, 1, 1024, 333, 1500] * 2 if causal else [1000, 1, 777, 1024, 513, 300] * 5
    cu, (q, k, v), out, lse, dout, (dq, dk, dv) = _packed_run(lens, 32, 8, causal, seed=3)
    for b in range(6):
        s0, s1 = cu[b].item(), cu[b + 1].item()
        qb, kb, vb = (t.detach()[s0:s1][None].requires_grad_() for t in (q, k, v))
        ob, lseb, _ = flash_attn_func(qb, kb, vb, causal=causal, return_attn_probs=True)
        gq, gk, gv = torch.autograd.grad(ob, (qb, kb, vb), dout[s0:s1][None])
        assert torch.equal(out[s0:s1], ob[0]) and torch.equal(lse[:, s0:s1], lseb[0]), b
        assert torch.equal(dq[s0:s1], gq[0]) and torch.equal(dk[s0:s1], gk[0]) and torch.equal(dv[s0:s1], gv[0]), b


@pytest.mark.parametrize("D", [128, 64])
def test_varlen_fused_dq_bitwise_equals_dense_on_gpu(D, poison, monkeypatch):
    """A packed call without a mask whose sequences straddle the fused dQ's length
    (configs.FUSED_DQ_MIN_SEQLEN): the long ones through the Gluon kernel computing dQ too, the
    others through the dQ kernel and the Gluon / Triton dK/dV kernels; every sequence bitwise what
    its own dense call gives (which takes the same path), and within the reference's tolerance.
    No KV_SPLIT: a split call takes the split kernels over the fused dQ (configs.KV_SPLIT_OVER_FUSED),
    which these GQA 4 sequences would then all take."""
    monkeypatch.setenv("TRITONATTN_BWD_KV_SPLIT", "1")
    plan.clear()
    first = configs.FUSED_DQ_MIN_SEQLEN[D][0]
    lens = [first + 100, 700, 1, 2100, first, 0, 333, first - 1]
    cu, (q, k, v), out, lse, dout, (dq, dk, dv) = _packed_run(lens, 8, 2, False, seed=4, D=D)
    check_varlen_against_reference(q, k, v, out, lse, (dq, dk, dv), dout, cu, False)
    names = _launched(monkeypatch)
    for b, n in enumerate(lens):
        if n == 0:
            continue
        s0, s1 = cu[b].item(), cu[b + 1].item()
        qb, kb, vb = (t.detach()[s0:s1][None].requires_grad_() for t in (q, k, v))
        ob = flash_attn_func(qb, kb, vb)
        gq, gk, gv = torch.autograd.grad(ob, (qb, kb, vb), dout[s0:s1][None])
        assert torch.equal(dq[s0:s1], gq[0]) and torch.equal(dk[s0:s1], gk[0]) and torch.equal(dv[s0:s1], gv[0]), b
    assert "_bwd_preprocess_kernel" in names  # (the long sequences' dense calls took the fused path)


def test_wide_forward_tile_dense_only(poison, monkeypatch):
    """The wide short forward tile follows the call's tile count, so only dense calls take it: a
    short varlen call without causal masking and with many query tiles in all (ragged, an empty
    and a length-1 sequence; 13260 tokens x 32 heads / 128: 3315 tiles) takes, for each length
    class, the tile a dense call of one such sequence takes (the table's: one sequence has few
    tiles), and matches the reference; a dense batch with as many tiles takes the wide tile. The
    Gluon forward (which serves both by default on sm_90) is off here."""
    monkeypatch.setattr(fwd, "GLUON_VARLEN", False)
    monkeypatch.setattr(fwd, "GLUON", False)
    plan.clear()
    picked, real = [], configs.forward_config

    def spy(*args, **kwargs):
        picked.append(real(*args, **kwargs))
        return picked[-1]

    monkeypatch.setattr(configs, "forward_config", spy)
    wide = configs._SHORT_WIDE_FWD[128]
    cu, qkv, out, lse, dout, grads = _packed_run([1000, 1, 0, 777, 1024, 513] * 4, 32, 8, False, seed=2)
    check_varlen_against_reference(*qkv, out, lse, grads, dout, cu, False)
    assert picked and wide not in picked, picked
    del picked[:]
    q, k, v = random_qkv(32, 512, 512, 32, 8, 128, BF16, DEVICE)  # 4096 tiles
    flash_attn_func(q, k, v)
    assert picked == [wide], picked


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged16"])
@pytest.mark.parametrize("Sq", [1, 8])
def test_kvcache_on_gpu(paged, Sq, poison):
    from tritonattn import flash_attn_with_kvcache

    torch.manual_seed(2)
    B, Hq, Hkv, D, S = 4, 32, 8, 128, 8192
    q = torch.randn(B, Sq, Hq, D, device=DEVICE, dtype=BF16)
    k_cache = torch.randn(B, S, Hkv, D, device=DEVICE, dtype=BF16)
    v_cache = torch.randn(B, S, Hkv, D, device=DEVICE, dtype=BF16)
    seqlens = torch.tensor([1, 1000, 5000, S - Sq], dtype=torch.int32, device=DEVICE)
    k_new = torch.randn(B, Sq, Hkv, D, device=DEVICE, dtype=BF16)
    v_new = torch.randn(B, Sq, Hkv, D, device=DEVICE, dtype=BF16)
    kw = {}
    kc, vc = k_cache, v_cache
    if paged:
        kc, vc, kw["block_table"] = to_paged(k_cache, v_cache, 16, None)
    outs = [flash_attn_with_kvcache(q, kc.clone(), vc.clone(), k_new, v_new, cache_seqlens=seqlens, causal=True,
                                    num_splits=n, return_softmax_lse=True, **kw) for n in (1, 0)]
    flash_attn_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=seqlens, causal=True, **kw)  # append for the check
    if paged:
        kc = kc[kw["block_table"].long()].reshape(B, S, Hkv, D)
        vc = vc[kw["block_table"].long()].reshape(B, S, Hkv, D)
    for out, lse in outs:
        for b in range(B):
            L = int(seqlens[b]) + Sq
            check_against_reference(q[b:b + 1], kc[b:b + 1, :L], vc[b:b + 1, :L], out[b:b + 1], lse[b:b + 1],
                                    None, None, True)


def test_fast_launch_path_matches_plain_path(poison):
    """Repeated calls take the cached launch (tritonattn/kernels/launch.py); a misaligned view of the
    same shape and strides must not reuse the aligned kernel, and every result equals the plain path."""
    from tritonattn.kernels import launch

    torch.manual_seed(0)
    base = torch.randn(2, 300, 4, 65, device=DEVICE, dtype=BF16)
    aligned = base[..., :64]
    misaligned = base[..., 1:]  # data pointer 2 bytes off: Triton specializes pointer alignment
    k = torch.randn(2, 300, 2, 64, device=DEVICE, dtype=BF16)
    v = torch.randn(2, 300, 2, 64, device=DEVICE, dtype=BF16)
    outs = []
    for q in (aligned, misaligned, aligned, misaligned):
        launch.ENABLED = True
        fast = [flash_attn_func(q, k, v, causal=True) for _ in range(2)]
        launch.ENABLED = False
        plain = flash_attn_func(q, k, v, causal=True)
        launch.ENABLED = True
        assert torch.equal(fast[0], plain) and torch.equal(fast[1], plain)
        outs.append(plain)
    assert torch.equal(outs[0], outs[2]) and torch.equal(outs[1], outs[3])
    # and the misaligned view through the whole forward + backward, against the reference
    base = base.detach().requires_grad_()
    k, v = k.requires_grad_(), v.requires_grad_()
    q = base[..., 1:]
    for _ in range(2):  # the second call takes the cached launches
        out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        check_against_reference(q, k, v, out, lse, grads, dout, True)


@pytest.mark.parametrize("dense_decode", [True, False], ids=["decoding-kernel", "forward-kernel"])
def test_growing_key_count_takes_the_cached_kernels(dense_decode, poison, monkeypatch):
    """A generation loop over a growing cache (transformers' DynamicCache: Sk + 1 each step, strides
    of the full cache) launches with new integers every call; those that specialize as an earlier
    call's did (launch.int_class) take the cached kernel with their own values, and each step equals
    the plain path and the reference. A length that is a multiple of 16, or a stride, that changes
    class gets a kernel of its own. On both kernels that such a call may take (configs.dense_decode)."""
    from tritonattn.kernels import launch

    monkeypatch.setattr(configs, "DENSE_DECODE", dense_decode)
    torch.manual_seed(0)
    B, Hq, Hkv, D = 2, 8, 2, 64
    kc = torch.randn(B, Hkv, 400, D, device=DEVICE, dtype=BF16)
    vc = torch.randn(B, Hkv, 400, D, device=DEVICE, dtype=BF16)
    q = torch.randn(B, 1, Hq, D, device=DEVICE, dtype=BF16)
    plan.clear()
    entries = []
    for sk in (301, 302, 303, 304, 305, 320, 333):  # 304 / 320: divisible by 16
        k, v = kc[:, :, :sk].transpose(1, 2), vc[:, :, :sk].transpose(1, 2)
        before = len(launch._cache)
        out = flash_attn_func(q, k, v)
        entries.append(len(launch._cache) - before)
        launch.ENABLED = False
        try:
            plain = flash_attn_func(q, k, v)
        finally:
            launch.ENABLED = True
        assert torch.equal(out, plain), sk
        check_against_reference(q, k, v, out, None, None, None, False)
    # the first of each class compiles / caches; 302, 303, 305 and 333 reuse 301's, 320 304's
    assert entries[1] == entries[2] == entries[4] == entries[6] == 0, entries
    assert entries[0] > 0


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("D,tma", [(64, True), (96, True), (128, True), (256, True), (128, False)],
                         ids=["D64", "D96", "D128", "D256", "D128-pointer-atomics"])
def test_atomic_dq_on_gpu(D, tma, causal, monkeypatch, poison):
    """The opt-in atomic-dQ backward (TRITONATTN_ATOMIC_DQ=1) at the table's configs, bf16: dQ tiles
    added by TMA reductions (the default on sm_90; D=96 has padded columns the descriptor drops),
    and by per-element atomics (TRITONATTN_ATOMIC_DQ_TMA=0)."""
    from tritonattn.kernels import bwd

    monkeypatch.setenv("TRITONATTN_ATOMIC_DQ", "1")
    monkeypatch.setenv("TRITONATTN_ATOMIC_DQ_TMA", "1" if tma else "0")
    torch.manual_seed(D)
    q, k, v = random_qkv(2, 2000, 2000, 8, 2, D, BF16, DEVICE)
    assert bwd._dq_tma_ok(q) == (tma and torch.cuda.get_device_capability()[0] == 9)
    out, lse, _ = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    check_against_reference(q, k, v, out, lse, grads, dout, causal)


# the Gluon dK/dV kernel's fused dQ (FUSED_DQ): odd lengths, Sq != Sk both ways, GQA / MHA, fp16
FUSED_DQ_CASES = [
    (2, 2100, 2300, 8, 2, 128, True, BF16),
    (1, 3001, 2049, 4, 4, 128, True, F16),
    (2, 1000, 1500, 8, 1, 128, False, BF16),
    (1, 1, 4096, 8, 2, 128, True, BF16),
    (2, 1100, 1300, 8, 2, 64, False, BF16),
    (1, 2049, 3000, 4, 4, 64, False, F16),
]


@pytest.mark.parametrize("deterministic", [True, False], ids=["ordered", "atomic"])
@pytest.mark.parametrize("B,Sq,Sk,Hq,Hkv,D,causal,dtype", FUSED_DQ_CASES, ids=[case_id(*c) for c in FUSED_DQ_CASES])
def test_gluon_fused_dq_on_gpu(B, Sq, Sk, Hq, Hkv, D, causal, dtype, deterministic, monkeypatch, poison):
    """The Gluon dK/dV kernel computing dQ too (FUSED_DQ), its tiles added by TMA reductions, no dQ
    kernel: in a fixed order (semaphores, reruns bitwise equal; the default from
    configs.FUSED_DQ_MIN_SEQLEN, here at every length and with a mask) or in any
    (TRITONATTN_ATOMIC_DQ=1); against the reference."""
    if not bwd._on_sm90(torch.empty(0, device=DEVICE)):
        pytest.skip("the Gluon dK/dV kernel runs on sm_90 GPUs only")
    monkeypatch.setenv("TRITONATTN_BWD_FUSED_DQ" if deterministic else "TRITONATTN_ATOMIC_DQ", "1")
    monkeypatch.setenv("TRITONATTN_BWD_KV_SPLIT", "1")  # (a split launch would take the split kernels instead)
    # the ordered path wherever the Gluon kernel serves the call (by default only from its own
    # lengths, configs.FUSED_DQ_MIN_SEQLEN: here with a causal mask and shorter calls as well)
    monkeypatch.setitem(configs.FUSED_DQ_MIN_SEQLEN, D, (0, 0))
    torch.manual_seed(Sq)
    _check_fused_dq(*random_qkv(B, Sq, Sk, Hq, Hkv, D, dtype, DEVICE), causal, monkeypatch, 3 if deterministic else 0)


def _check_fused_dq(q, k, v, causal: bool, monkeypatch, reruns: int) -> None:
    """The backward of ``q, k, v`` takes the fused Gluon launch alone (after the delta preprocess),
    matches the reference, and ``reruns`` more backwards give it bitwise."""
    out, lse, _ = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    dout = torch.randn_like(out)
    names = _launched(monkeypatch)
    grads = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    assert names == ["_bwd_preprocess_kernel", "_bwd_dkdv_ws_kernel", "_bwd_dq_convert_kernel"], names
    check_against_reference(q, k, v, out, lse, grads, dout, causal)
    for _ in range(reruns):
        again = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        for a, b in zip(grads, again, strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("switch,D,S,hkv,causal", [
    ("TRITONATTN_BWD_DESC_3D", 128, 2048, 2, True), ("TRITONATTN_BWD_DESC_3D", 64, 4096, 2, True),
    ("TRITONATTN_BWD_DESC_3D", 256, 2048, 2, True), ("TRITONATTN_BWD_SPLIT_WAITS", 128, 1000, 2, False),
    ("TRITONATTN_BWD_SPLIT_WAITS", 64, 4096, 2, True), ("TRITONATTN_BWD_SPLIT_WAITS", 64, 2048, 2, False),
    ("TRITONATTN_BWD_SPLIT_WAITS", 128, 4096, 8, False), ("TRITONATTN_BWD_SPLIT_WAITS", 128, 4096, 8, True),
], ids=["desc-3d-D128", "desc-3d-D64", "desc-3d-D256", "split-waits-D128", "split-waits-D64-causal",
        "split-waits-D64-full", "split-waits-D128-MHA-full", "split-waits-D128-MHA-causal"])
def test_bwd_experiments_bitwise_on_gpu(switch, D, S, hkv, causal, monkeypatch, poison):
    """Experiments of the Gluon dK/dV kernel that keep its arithmetic, so the gradients are bitwise
    the default's: TRITONATTN_BWD_DESC_3D=1 (the producer reads Q / dO of the group's heads through
    one 3-d descriptor, the same loads in the same order), TRITONATTN_BWD_SPLIT_WAITS=1 (a step's
    products awaited one at a time). Odd query counts; GQA causal
    (D=64's causal loops split in two, D=256 split by gradient), D=64 without a mask, and MHA at
    4096 (the fused dQ; DESC_3D only acts without it, so its cases keep the split dQ), D=128 GQA at
    1000 without a mask (the Gluon kernel without the fused dQ)."""
    if not bwd._on_sm90(torch.empty(0, device=DEVICE)):
        pytest.skip("the Gluon dK/dV kernel runs on sm_90 GPUs only")
    if switch == "TRITONATTN_BWD_DESC_3D":
        monkeypatch.setenv("TRITONATTN_BWD_FUSED_DQ", "0")
    torch.manual_seed(D)
    q, k, v = random_qkv(2, S - 37, S, 8, hkv, D, BF16, DEVICE)
    out = flash_attn_func(q, k, v, causal=causal)
    dout = torch.randn_like(out)
    grads = []
    for env in ("0", "1"):
        monkeypatch.setenv(switch, env)
        names = _launched(monkeypatch)
        grads.append(torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))
        assert "_bwd_dkdv_ws_kernel" in names, names
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)


def test_gluon_fused_dq_varlen_on_gpu(monkeypatch, poison):
    """The fused dQ over packed sequences (one launch, the longest's route): a tile's rows past
    its sequence add exact zeros to the next sequence's rows; lengths 0 and 1, Sq != Sk."""
    from tritonattn import flash_attn_varlen_func

    if not bwd._on_sm90(torch.empty(0, device=DEVICE)):
        pytest.skip("the Gluon dK/dV kernel runs on sm_90 GPUs only")
    monkeypatch.setenv("TRITONATTN_ATOMIC_DQ", "1")
    lens_q, lens_k = [2100, 5, 0, 1, 1300, 77], [2100, 0, 7, 4095, 2500, 77]
    torch.manual_seed(5)
    cu_q, cu_k = _cu_seqlens(lens_q), _cu_seqlens(lens_k)
    q = torch.randn(sum(lens_q), 8, 128, device=DEVICE, dtype=BF16, requires_grad=True)
    k, v = (torch.randn(sum(lens_k), 2, 128, device=DEVICE, dtype=BF16, requires_grad=True) for _ in range(2))
    out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True,
                                         return_attn_probs=True)
    dout = torch.randn_like(out)
    names = _launched(monkeypatch)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    assert names == ["_bwd_preprocess_kernel", "_bwd_dkdv_ws_kernel", "_bwd_dq_convert_kernel"], names
    for b, (lq, lk) in enumerate(zip(lens_q, lens_k, strict=True)):
        qs, ks = slice(cu_q[b].item(), cu_q[b + 1].item()), slice(cu_k[b].item(), cu_k[b + 1].item())
        if lq == 0:
            assert not dk[ks].any() and not dv[ks].any(), b
            continue
        if lk == 0:
            assert not dq[qs].any(), b
            continue
        check_against_reference(q[qs][None], k[ks][None], v[ks][None], out[qs][None], lse[:, qs][None],
                                (dq[qs][None], dk[ks][None], dv[ks][None]), dout[qs][None], True)


def test_gluon_fused_dq_heads_first_on_gpu(monkeypatch, poison):
    """The ordered fused dQ on tensors laid out (B, H, S, D) and seen as (B, S, H, D) (what the SDPA
    drop-in passes): the producer's 3-d descriptor over the group's heads with a head stride that is
    not the head dim; causal, GQA, odd lengths, against the reference, reruns bitwise equal."""
    if not bwd._on_sm90(torch.empty(0, device=DEVICE)):
        pytest.skip("the Gluon dK/dV kernel runs on sm_90 GPUs only")
    monkeypatch.setenv("TRITONATTN_BWD_FUSED_DQ", "all")
    torch.manual_seed(11)
    # (the keys from the Gluon kernel's causal length on: configs.GLUON_MIN_SEQLEN)
    Sk = configs.GLUON_MIN_SEQLEN["bwd_dkdv"][128][1] + 251
    q = torch.randn(2, 8, Sk - 200, 128, device=DEVICE, dtype=BF16).transpose(1, 2).requires_grad_()
    k, v = (torch.randn(2, 2, Sk, 128, device=DEVICE, dtype=BF16).transpose(1, 2).requires_grad_()
            for _ in range(2))
    _check_fused_dq(q, k, v, True, monkeypatch, 1)


SPLIT_DIAG_CASES = [  # B, Sq, Sk, Hq, Hkv, D, fused dQ (ordered), right edge (0: causal; else a window (-1, it))
    (2, 1100, 1300, 8, 2, 64, False, 0),
    (1, 2049, 1500, 4, 4, 64, False, 0),
    (1, 1500, 1700, 4, 2, 64, False, 77),
    (2, 2100, 2300, 8, 2, 128, False, 0),
    (1, 3001, 2049, 4, 1, 128, False, 0),
    (2, 2100, 2300, 8, 2, 128, True, 0),
    (1, 1500, 3001, 4, 4, 128, True, 0),
    (1, 2000, 1800, 4, 2, 128, True, 300),
]


@pytest.mark.parametrize("B,Sq,Sk,Hq,Hkv,D,fused,right", SPLIT_DIAG_CASES,
                         ids=[f"B{c[0]}-Sq{c[1]}-Sk{c[2]}-H{c[3]}/{c[4]}-D{c[5]}" + ("-fused" if c[6] else "")
                              + (f"-right{c[7]}" if c[7] else "") for c in SPLIT_DIAG_CASES])
def test_gluon_split_diag_on_gpu(B, Sq, Sk, Hq, Hkv, D, fused, right, monkeypatch, poison):
    """The Gluon dK/dV kernel's causal steps in two loops (for tiles of bwd.SPLIT_DIAG_ROWS rows:
    the blocks that cross the diagonal masked, the others not tested): the same blocks in the same
    order as one loop testing each, so gradients bitwise equal to one loop's, and the reference's;
    D=64 (128-row tiles, where the default splits) and D=128 (where it does not), with the ordered
    fused dQ (lockstep order: the crossing blocks last) and without (first in each head), Sq != Sk
    both ways, GQA and MHA, causal and a window's right edge past the diagonal."""
    if not bwd._on_sm90(torch.empty(0, device=DEVICE)):
        pytest.skip("the Gluon dK/dV kernel runs on sm_90 GPUs only")
    monkeypatch.setitem(configs.GLUON_MIN_SEQLEN["bwd_dkdv"], D, (0, 0))
    monkeypatch.setenv("TRITONATTN_BWD_FUSED_DQ", "all" if fused else "0")
    torch.manual_seed(Sq + D)
    q, k, v = random_qkv(B, Sq, Sk, Hq, Hkv, D, BF16, DEVICE)
    window = (-1, right) if right else (-1, -1)
    out, lse, _ = flash_attn_func(q, k, v, causal=not right, window_size=window, return_attn_probs=True)
    dout = torch.randn_like(out)
    grads = []
    for rows in (10**9, 1):  # one loop, then two loops, whatever the tile
        monkeypatch.setattr(bwd, "SPLIT_DIAG_ROWS", rows)
        names = _launched(monkeypatch)
        grads.append(torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))
        assert "_bwd_dkdv_ws_kernel" in names and "_bwd_dkdv_kernel" not in names, names
        assert ("_bwd_dq_kernel" in names) != fused, names
    check_against_reference(q, k, v, out, lse, grads[1], dout, not right, window_size=window)
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gluon_fused_dq_more_programs_than_sms_on_gpu(causal, monkeypatch, poison):
    """The ordered fused dQ when a kv head has more key blocks (programs that wait on each other's
    additions) than the GPU has SMs: no deadlock (a program waits only on programs launched before
    it), reruns bitwise equal, and the gradients those of the split kernels up to the order of the
    additions (a reference at this length would need tens of GB)."""
    if not bwd._on_sm90(torch.empty(0, device=DEVICE)):
        pytest.skip("the Gluon dK/dV kernel runs on sm_90 GPUs only")
    sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    S = (sms + 50) * bwd.bwd_sm90.BLOCK_N + 37
    torch.manual_seed(S)
    q, k, v = random_qkv(1, S, S, 2, 1, 128, BF16, DEVICE)
    out = flash_attn_func(q, k, v, causal=causal)
    dout = torch.randn_like(out)
    grads = {}
    for mode in ("0", "all", "all"):
        monkeypatch.setenv("TRITONATTN_BWD_FUSED_DQ", mode)
        plan.clear()
        grads.setdefault(mode, []).append(torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))
    split, (fused, again) = grads["0"][0], grads["all"]
    for a, b, c in zip(split, fused, again, strict=True):
        assert torch.equal(b, c)
        torch.testing.assert_close(b.float(), a.float(), atol=2e-2, rtol=2e-2)


# (batch, queries, keys, query heads, kv heads, causal, TRITONATTN_BWD_FUSED_SECTION): a last section of
# fewer heads (3, 3, 2 of 8), one section of every head (1000), the rule, GQA, and a kv head with
# more key blocks than the GPU has SMs (None: that length), both heads in one section; unset (None):
# the default rule, here on (MHA, 2048 rows)
FUSED_SECTION_CASES = [
    (2, 1500, 1700, 16, 4, False, "3"), (2, 1700, 1500, 16, 4, True, "3"), (1, 2100, 2100, 8, 8, False, "1000"),
    (2, 3000, 3000, 8, 2, True, "auto"), (1, None, None, 4, 2, False, "2"), (2, 2048, 2000, 8, 8, True, None),
]


@pytest.mark.parametrize("B,Sq,Sk,Hq,Hkv,causal,section", FUSED_SECTION_CASES,
                         ids=[f"{c[6] or 'default'}-H{c[3]}-{c[4]}-{'causal' if c[5] else 'full'}"
                              for c in FUSED_SECTION_CASES])
def test_gluon_fused_dq_sections_on_gpu(B, Sq, Sk, Hq, Hkv, causal, section, monkeypatch, poison):
    """TRITONATTN_BWD_FUSED_SECTION (bwd_sm90.section_order; unset, its default rule): the ordered fused dQ's
    programs on a 1-d grid in sections of kv heads, key blocks outer inside each. Every program maps to
    one (key block, head) and adds in the same order as on the 2-d grid, so the gradients are bitwise
    those of the default order; no deadlock where a head's programs outnumber the SMs (a program
    waits only on lower key blocks of its head, launched before it in every section)."""
    if not bwd._on_sm90(torch.empty(0, device=DEVICE)):
        pytest.skip("the Gluon dK/dV kernel runs on sm_90 GPUs only")
    if Sq is None:
        Sq = Sk = (torch.cuda.get_device_properties(DEVICE).multi_processor_count + 50) * bwd.bwd_sm90.BLOCK_N + 37
    monkeypatch.setenv("TRITONATTN_BWD_FUSED_DQ", "all")
    monkeypatch.setitem(configs.GLUON_MIN_SEQLEN["bwd_dkdv"], 128, (0, 0))  # (the Gluon kernel at every length)
    torch.manual_seed(Sq + Hkv)
    q, k, v = random_qkv(B, Sq, Sk, Hq, Hkv, 128, BF16, DEVICE)
    out = flash_attn_func(q, k, v, causal=causal)
    dout = torch.randn_like(out)
    grads, grids = [], []
    real = launch.launch  # (taken once: a second wrapper must not call the first and record twice)
    for env in ("0", section):
        set_env(monkeypatch, "TRITONATTN_BWD_FUSED_SECTION", env)
        seen = []

        def record(fn, grid, args, kwargs, seen=seen, real=real):
            if fn.__name__ == "_bwd_dkdv_ws_kernel":
                seen.append((tuple(grid), kwargs["SECTION"], kwargs["FUSED_DQ"]))
            real(fn, grid, args, kwargs)

        monkeypatch.setattr(launch, "launch", record)
        plan.clear()
        grads.append(torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))
        grids.append(seen)
    (grid0, sec0, fused0), = grids[0]
    (grid1, sec1, fused1), = grids[1]
    assert fused0 and fused1 and sec0 == 0 and len(grid0) == 2, grids
    assert sec1 >= 1 and grid1 == (grid0[0] * grid0[1],), grids
    if section is not None and section.isdigit():
        assert sec1 == min(int(section), B * Hkv), grids
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)


# (batch, queries, keys, query heads, kv heads, head dim, the right edge (None: no mask, 0: causal),
# TRITONATTN_BWD_FUSED_SECTION, whether key block 0 stores): whole query blocks without and with a
# causal mask, GQA / MQA, on the 2-d grid and in sections, D=64 (128-row blocks); right edges past and
# before the first key with Sq != Sk; and calls where it must not: a partial last block (the launch
# assertion catches a wrong guard there: the stray rows it would write are mostly overwritten), a
# causal call with more queries than keys (rows no program reaches: NaN), D=64 with 64-row but not
# 128-row blocks
FIRST_STORE_CASES = [
    (2, 2048, 2048, 8, 2, 128, None, "0", True), (2, 2048, 2048, 8, 8, 128, 0, "0", True),
    (2, 2048, 3000, 16, 4, 128, 0, "3", True), (1, 4096, 4096, 8, 1, 128, None, None, True),
    (2, 2048, 1500, 8, 2, 128, 600, "0", True), (2, 2048, 2148, 8, 2, 128, -100, "0", True),
    (2, 2048, 2048, 8, 2, 64, 0, "0", True), (2, 2048, 1500, 8, 2, 128, None, "0", True),
    (2, 2000, 2000, 8, 2, 128, None, "0", False), (2, 2048, 1500, 8, 2, 128, 0, "0", False),
    (2, 2112, 2112, 8, 2, 64, None, "0", False),
]


@pytest.mark.parametrize("B,Sq,Sk,Hq,Hkv,D,right,section,first", FIRST_STORE_CASES,
                         ids=[f"{c[1]}x{c[2]}-H{c[3]}-{c[4]}-D{c[5]}-{'full' if c[6] is None else f'right{c[6]}'}-"
                              f"{c[7] or 'default'}" for c in FIRST_STORE_CASES])
def test_gluon_fused_dq_first_store_on_gpu(B, Sq, Sk, Hq, Hkv, D, right, section, first, monkeypatch, poison):
    """TRITONATTN_BWD_DQ_FIRST_STORE (an experiment, off by default): the ordered fused dQ's key block 0
    stores its tiles and the fp32 buffer starts unwritten (NaN under the poison fixture) where
    bwd._first_store_ok allows it; the gradients are those with the switch off, bitwise up to the
    sign of zeros (a store of -0.0 where 0 + -0.0 gives +0.0; torch.equal takes them as equal), with
    and without sections; and within the reference's tolerance."""
    if not bwd._on_sm90(torch.empty(0, device=DEVICE)):
        pytest.skip("the Gluon dK/dV kernel runs on sm_90 GPUs only")
    monkeypatch.setenv("TRITONATTN_BWD_FUSED_DQ", "all")
    set_env(monkeypatch, "TRITONATTN_BWD_FUSED_SECTION", section)
    monkeypatch.setitem(configs.GLUON_MIN_SEQLEN["bwd_dkdv"], D, (0, 0))  # (the Gluon kernel at every length)
    torch.manual_seed(Sq + Sk + Hkv + D)
    q, k, v = random_qkv(B, Sq, Sk, Hq, Hkv, D, BF16, DEVICE)
    window = (-1, -1) if right is None else (-1, right)
    if right is not None and right < 0:  # a right edge before the diagonal: the SDPA drop-in's top-left
        assert right == Sq - Sk  # causal mask with more keys than queries (win_right = Sq - Sk, shift 0)
        from tritonattn import scaled_dot_product_attention

        out = scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True, enable_gqa=True)
    else:
        out = flash_attn_func(q, k, v, window_size=window)
    dout = torch.randn_like(out)
    grads, stored = [], []
    real = launch.launch  # (taken once: a second wrapper must not call the first and record twice)
    for env in ("0", "1"):
        monkeypatch.setenv("TRITONATTN_BWD_DQ_FIRST_STORE", env)
        seen = []

        def record(fn, grid, args, kwargs, seen=seen, real=real):
            if fn.__name__ == "_bwd_dkdv_ws_kernel":
                seen.append((kwargs["FUSED_DQ"], kwargs["DETERMINISTIC"], kwargs.get("FIRST_STORE", False)))
            real(fn, grid, args, kwargs)

        monkeypatch.setattr(launch, "launch", record)
        plan.clear()
        grads.append(torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))
        stored.append(seen)
    assert stored == [[(True, True, False)], [(True, True, first)]], stored
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)
    if right is None or right >= 0:  # (flash_attn_func's windows: the reference's too)
        check_against_reference(q, k, v, out, None, grads[1], dout, False, window_size=window)


# (batch, length, query heads, kv heads, head dim, packed): the launches the rule serves: GQA 16 and
# 8 (KV_SPLIT's virtual heads by the default rule), MHA, D=64 / 256 (128-row blocks, the split by
# gradient), a packed call of two sequences
DKDV_SECTION_CASES = [(2, 2048, 16, 1, 128, False), (2, 2048, 16, 2, 128, False), (1, 3000, 8, 8, 128, False),
                      (2, 4096, 8, 2, 64, False), (2, 2048, 8, 2, 256, False), (2, 2048, 16, 1, 128, True)]


@pytest.mark.parametrize("B,S,Hq,Hkv,D,packed", DKDV_SECTION_CASES,
                         ids=[f"B{c[0]}-S{c[1]}-H{c[2]}-{c[3]}-D{c[4]}{'-packed' if c[5] else ''}"
                              for c in DKDV_SECTION_CASES])
def test_gluon_dkdv_sections_on_gpu(B, S, Hq, Hkv, D, packed, monkeypatch, poison):
    """configs.DKDV_SECTION_WAVES (an experiment, off by default): the causal Gluon dK/dV launch
    without the fused dQ (the split kernels, KV_SPLIT's partials) on a 1-d grid in sections of kv
    heads: every program computes what it computes on the 2-d grid, so the gradients are bitwise
    those of the 2-d grid; and within the reference's tolerance."""
    if not bwd._on_sm90(torch.empty(0, device=DEVICE)):
        pytest.skip("the Gluon dK/dV kernel runs on sm_90 GPUs only")
    monkeypatch.setenv("TRITONATTN_BWD_FUSED_DQ", "0")
    monkeypatch.setitem(configs.GLUON_MIN_SEQLEN["bwd_dkdv"], D, (0, 0))  # (the Gluon kernel at every length)
    torch.manual_seed(S + Hkv + D)
    q, k, v = random_qkv(B, S, S, Hq, Hkv, D, BF16, DEVICE)
    if packed:
        cu = torch.arange(B + 1, device=DEVICE, dtype=torch.int32) * S
        leaves = [t.detach().flatten(0, 1).requires_grad_() for t in (q, k, v)]
        out = flash_attn_varlen_func(*leaves, cu, cu, S, S, causal=True)
    else:
        leaves = (q, k, v)
        out = flash_attn_func(q, k, v, causal=True)
    dout = torch.randn_like(out)
    grads, sections = [], []
    real = launch.launch  # (taken once: a second wrapper must not call the first and record twice)
    for waves in (0, 1000):
        monkeypatch.setattr(configs, "DKDV_SECTION_WAVES", waves)
        seen = []

        def record(fn, grid, args, kwargs, seen=seen, real=real):
            if fn.__name__ == "_bwd_dkdv_ws_kernel":
                seen.append((kwargs["SECTION"], kwargs["FUSED_DQ"]))
            real(fn, grid, args, kwargs)

        monkeypatch.setattr(launch, "launch", record)
        plan.clear()
        grads.append(torch.autograd.grad(out, leaves, dout, retain_graph=True))
        sections.append(seen)
    assert sections[0] and all(sec == 0 and not fused for sec, fused in sections[0]), sections
    assert sections[1] and all(sec > 0 and not fused for sec, fused in sections[1]), sections
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)
    if not packed:
        check_against_reference(q, k, v, out, None, grads[1], dout, True)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("D", [64, 128, 256])
def test_kv_split_on_gpu(D, causal, monkeypatch, poison):
    """configs.kv_split (bwd_sm90 KV_SPLIT): a call whose Gluon dK/dV launch is under one wave (two
    sequences, 2 kv heads) splits each kv head's 8 query heads over programs writing fp32 partials,
    summed by _bwd_kv_sum_kernel: within the reference's tolerance, bitwise the same on a rerun, and
    close to the unsplit kernel's (TRITONATTN_BWD_KV_SPLIT=1); a packed dk / dv (kv-packed call)."""
    if not bwd._on_sm90(torch.empty(0, device=DEVICE)):
        pytest.skip("the Gluon dK/dV kernel runs on sm_90 GPUs only")
    monkeypatch.setenv("TRITONATTN_BWD_FUSED_DQ", "0")  # (the Gluon dK/dV kernel without the fused dQ)
    S = max(configs.GLUON_MIN_SEQLEN["bwd_dkdv"][D][causal], 600) + 37
    torch.manual_seed(S + D)
    q, k, v = random_qkv(2, S, S - 5, 16, 2, D, BF16, DEVICE)
    out, lse, _ = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    dout = torch.randn_like(out)
    runs = {}
    for env in (None, "1"):
        set_env(monkeypatch, "TRITONATTN_BWD_KV_SPLIT", env)
        names = _launched(monkeypatch)
        runs[env] = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        assert ("_bwd_dkdv_ws_kernel" in names) and ("_bwd_kv_sum_kernel" in names) == (env is None), names
        again = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        for a, b in zip(runs[env], again, strict=True):
            assert torch.equal(a, b)
    check_against_reference(q, k, v, out, lse, runs[None], dout, causal)
    for a, b in zip(runs[None][1:], runs["1"][1:], strict=True):  # dK, dV: fp32 sums against one program's
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(runs[None][0], runs["1"][0])  # (dQ: the same dQ kernel)
    # a kv-packed call: dk / dv strided views of one gradient, the sums written into them
    set_env(monkeypatch, "TRITONATTN_BWD_KV_SPLIT", None)
    kv = torch.stack((k, v), dim=2).detach().requires_grad_()
    qd = q.detach().requires_grad_()
    out2, lse2, _ = flash_attn_kvpacked_func(qd, kv, causal=causal, return_attn_probs=True)
    names = _launched(monkeypatch)
    dq2, dkv = torch.autograd.grad(out2, (qd, kv), dout)
    assert "_bwd_kv_sum_kernel" in names, names
    check_against_reference(q, k, v, out2, lse2, (dq2, dkv[:, :, 0], dkv[:, :, 1]), dout, causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("D", [128, 64, 256])
def test_kv_split_packed_bitwise_equals_dense_on_gpu(D, causal, poison, monkeypatch):
    """KV_SPLIT for one sequence alone and packed (configs.kv_split_alone): MQA with 16 query heads,
    sequences whose own Gluon dK/dV launch is under a wave split by their length (several length
    classes: a launch and a sum kernel each), others too short for the Gluon kernel or too long to
    split; every sequence bitwise what its own dense call gives, and the packed call within the
    reference's tolerance. The fused dQ off (TRITONATTN_BWD_FUSED_DQ=0), so the split applies at
    every Gluon length."""
    if not bwd._on_sm90(torch.empty(0, device=DEVICE)):
        pytest.skip("the Gluon dK/dV kernel runs on sm_90 GPUs only")
    monkeypatch.setenv("TRITONATTN_BWD_FUSED_DQ", "0")
    if configs.KV_SPLIT_ALONE_WAVES is None:  # (off by default: the rule's own waves, on)
        monkeypatch.setattr(configs, "KV_SPLIT_ALONE_WAVES", (1, 2))
    first = configs.GLUON_MIN_SEQLEN["bwd_dkdv"][D][causal]
    bn, sms = bwd.bwd_sm90.block_n(D), launch.sm_count(torch.device(DEVICE))
    # (lengths of splits 16 / 8 / ... where the SM count allows, one under the Gluon kernel's length)
    lens = [first + 37, 2 * first + 5, first - 3, 4 * first + 1, 300, 1, first]
    splits = {n: configs.kv_split_alone(causal, 16, n, 1, bn, sms) for n in lens if n >= first}
    assert max(splits.values()) > 1, splits
    names = _launched(monkeypatch)
    cu, (q, k, v), out, lse, dout, (dq, dk, dv) = _packed_run(lens, 16, 1, causal, seed=5, D=D)
    assert "_bwd_kv_sum_kernel" in names, names
    check_varlen_against_reference(q, k, v, out, lse, (dq, dk, dv), dout, cu, causal)
    for b in range(len(lens)):
        s0, s1 = cu[b].item(), cu[b + 1].item()
        qb, kb, vb = (t.detach()[s0:s1][None].requires_grad_() for t in (q, k, v))
        ob = flash_attn_func(qb, kb, vb, causal=causal)
        gq, gk, gv = torch.autograd.grad(ob, (qb, kb, vb), dout[s0:s1][None])
        assert torch.equal(dq[s0:s1], gq[0]) and torch.equal(dk[s0:s1], gk[0]) and torch.equal(dv[s0:s1], gv[0]), \
            (b, lens[b], splits.get(lens[b]))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("D", [64, 128, 256])
def test_backward_tma_on_gpu(D, causal, monkeypatch, poison):
    """The backward with Q / dO and K / V tiles read through tensor descriptors (kernels.bwd.TMA,
    the default on sm_90; TRITONATTN_BWD_TMA=0 turns it off) at the table's configs, bf16, GQA,
    ragged lengths: against the reference, and equal to the pointer path (with its own dK/dV
    tiles) up to the order of the arithmetic."""
    from tritonattn.kernels import bwd, plan

    torch.manual_seed(D)
    q, k, v = random_qkv(2, 1531, 1000, 8, 2, D, BF16, DEVICE)
    grads = []
    for tma in (False, True):
        monkeypatch.setattr(bwd, "TMA", tma)
        plan.clear()
        out, lse, _ = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
        dout = torch.randn(out.shape, generator=torch.Generator(DEVICE).manual_seed(1), device=DEVICE, dtype=BF16)
        grads.append(torch.autograd.grad(out, (q, k, v), dout))
    check_against_reference(q, k, v, out, lse, grads[1], dout, causal)
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, atol=2e-2, rtol=1e-2)


def test_atomic_dq_varlen_on_gpu(monkeypatch, poison):
    """TMA-reduced dQ over ragged sequences: each sequence's descriptor ends at its own length, so
    no tile spills into the next sequence's rows (lengths not multiples of the tile, 0 and 1)."""
    from tritonattn import flash_attn_varlen_func
    from tritonattn.kernels import bwd

    monkeypatch.setenv("TRITONATTN_ATOMIC_DQ", "1")
    monkeypatch.setenv("TRITONATTN_ATOMIC_DQ_TMA", "1")
    torch.manual_seed(3)
    lens = [700, 1, 0, 333, 129]
    cu = _cu_seqlens(lens)
    total = sum(lens)
    q = torch.randn(total, 8, 128, device=DEVICE, dtype=BF16, requires_grad=True)
    k = torch.randn(total, 2, 128, device=DEVICE, dtype=BF16, requires_grad=True)
    v = torch.randn(total, 2, 128, device=DEVICE, dtype=BF16, requires_grad=True)
    assert bwd._dq_tma_ok(q) == (torch.cuda.get_device_capability()[0] == 9)
    out, lse, _ = flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True, return_attn_probs=True)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    check_varlen_against_reference(q, k, v, out, lse, grads, dout, cu, True)


def test_tma_reduction_stays_inside_its_descriptor():
    """The atomic-dQ path relies on a descriptor's atomic_add dropping the parts of a tile outside
    the descriptor's shape (rows past a sequence's end, padded head-dim columns). Its kernel tiles
    add exact zeros there, so the attention tests cannot see a wrong bound; this adds ones and
    checks every element outside the box's in-bounds part is untouched."""
    import triton
    import triton.language as tl

    from tritonattn.kernels.fwd import _need_allocator

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("TMA reductions: sm_90")

    @triton.jit
    def add_ones(X, rows, row_stride, start, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
        desc = tl.make_tensor_descriptor(X + tl.program_id(0) * HEAD_DIM, shape=[rows, HEAD_DIM],
                                         strides=[row_stride, 1], block_shape=[BLOCK_M, BLOCK_D])
        desc.atomic_add([start, 0], tl.full([BLOCK_M, BLOCK_D], 1.0, tl.float32))

    _need_allocator()
    heads, D, rows, total = 3, 96, 70, 100
    x = torch.zeros(total, heads, D, device=DEVICE)  # (rows, heads, D) as dQ's buffer; 30 rows beyond
    add_ones[(heads,)](x, rows, heads * D, 32, HEAD_DIM=D, BLOCK_M=64, BLOCK_D=128)
    expect = torch.zeros_like(x)
    expect[32:rows] = 1.0  # rows 32..69 of every head, all 96 columns; nothing past row 70 or column 96
    assert torch.equal(x, expect)


@pytest.mark.parametrize("cfg", [c for c in configs.CANDIDATES[256]["bwd_dkdv"] if c.d_split > 1 or c.split_grads],
                         ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_dkdv_head_dim_split_on_gpu(cfg, causal, poison):
    """Every head-dim-split and gradient-split dK / dV candidate at D=256 (and 192, padded), bf16, GQA."""
    for D in (256, 192):
        torch.manual_seed(D)
        q, k, v = random_qkv(2, 1100, 1300, 8, 2, D, BF16, DEVICE)
        with configs.override(bwd_dkdv=cfg):
            out, lse, _ = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
            dout = torch.randn_like(out)
            grads = torch.autograd.grad(out, (q, k, v), dout)
        check_against_reference(q, k, v, out, lse, grads, dout, causal)


def test_autotune_end_to_end(tmp_path, monkeypatch, poison):
    """TRITONATTN_AUTOTUNE=1 on the GPU: every kernel family tuned on the call, results still right,
    the choice written to the disk cache and reused."""
    from tritonattn import autotune

    monkeypatch.setenv("TRITONATTN_AUTOTUNE", "1")
    monkeypatch.setenv("TRITONATTN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(autotune, "_memory", {})
    torch.manual_seed(0)
    q, k, v = random_qkv(1, 700, 900, 4, 2, 64, BF16, DEVICE)
    for _ in range(2):
        out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        check_against_reference(q, k, v, out, lse, grads, dout, True)
    import json

    modes = {key.split("|")[2] for key in json.loads((tmp_path / "autotune.json").read_text())}
    assert modes == {"fwd", "bwd_dkdv", "bwd_dq"}


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged16"])
@pytest.mark.parametrize("rotary", ["interleaved", "halves"])
@pytest.mark.parametrize("Sq", [1, 4])
def test_decode_append_rotary_on_gpu(paged, rotary, Sq, monkeypatch, poison):
    """A serving step at the llama decoding shape (Hq=32, Hkv=8, D=128, bf16, caches of 8192): the
    decoding kernel rotates q and writes the new rows (rotary on the keys) itself. Against the append
    kernel + forward kernel path (DECODE_MAX_ROWS 0): the caches bitwise (the rotary's products
    rounded one by one in both), the outputs against the reference on the rotated q and the cache
    after the step; num_splits 0 (picked) and 5."""
    from tritonattn import flash_attn_with_kvcache, inference

    torch.manual_seed(17)
    B, Hq, Hkv, D, S = 4, 32, 8, 128, 8192
    q = torch.randn(B, Sq, Hq, D, device=DEVICE, dtype=BF16)
    k_cache = torch.randn(B, S, Hkv, D, device=DEVICE, dtype=BF16)
    v_cache = torch.randn(B, S, Hkv, D, device=DEVICE, dtype=BF16)
    seqlens = torch.tensor([0, 1000, 4093, S - Sq], dtype=torch.int32, device=DEVICE)
    angles = torch.rand(S, D // 2, device=DEVICE) * 6
    kw = dict(k=torch.randn(B, Sq, Hkv, D, device=DEVICE, dtype=BF16),
              v=torch.randn(B, Sq, Hkv, D, device=DEVICE, dtype=BF16), rotary_cos=angles.cos().to(BF16),
              rotary_sin=angles.sin().to(BF16), rotary_interleaved=rotary == "interleaved", causal=True)
    kc, vc = k_cache, v_cache
    if paged:
        kc, vc, kw["block_table"] = to_paged(k_cache, v_cache, 16, None)
    k_ref, v_ref = kc.clone(), vc.clone()
    with monkeypatch.context() as m:
        m.setattr(inference, "DECODE_MAX_ROWS", 0)
        flash_attn_with_kvcache(q, k_ref, v_ref, cache_seqlens=seqlens, **kw)
    if paged:
        k_lin = k_ref[kw["block_table"].long()].reshape(B, S, Hkv, D)
        v_lin = v_ref[kw["block_table"].long()].reshape(B, S, Hkv, D)
    else:
        k_lin, v_lin = k_ref, v_ref
    q_pos = seqlens.long()[:, None] + torch.arange(Sq, device=DEVICE)[None, :]
    q_rot = inference.apply_rotary(q, kw["rotary_cos"], kw["rotary_sin"], q_pos, rotary == "interleaved")
    for splits in (0, 5):
        kd, vd = kc.clone(), vc.clone()
        out, lse = flash_attn_with_kvcache(q, kd, vd, cache_seqlens=seqlens, num_splits=splits,
                                           return_softmax_lse=True, **kw)
        assert torch.equal(kd, k_ref) and torch.equal(vd, v_ref), splits
        for b in range(B):
            L = int(seqlens[b]) + Sq
            check_against_reference(q_rot[b:b + 1], k_lin[b:b + 1, :L], v_lin[b:b + 1, :L], out[b:b + 1],
                                    lse[b:b + 1], None, None, True)


def test_kvcache_long_query_block_with_splits_on_gpu():
    """num_splits > 1 with 512 x 4 query rows per kv head (chunked prefill into a cache): the forward
    kernel runs it (the decoding kernel's tile would hold all 2048 rows), against the reference."""
    from tritonattn import flash_attn_with_kvcache

    torch.manual_seed(13)
    q = torch.randn(2, 512, 32, 128, device="cuda", dtype=BF16)
    kc, vc = (torch.randn(2, 2048, 8, 128, device="cuda", dtype=BF16) for _ in range(2))
    out, lse = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=1500, causal=True, num_splits=4,
                                       return_softmax_lse=True)
    check_against_reference(q, kc[:, :1500], vc[:, :1500], out, lse, None, None, True)


def test_decode_combine_with_pdl_on_gpu(monkeypatch, poison):
    """TRITONATTN_DECODE_PDL=1: the combine kernel launched through programmatic dependent launch
    waits for the split kernel on the device. Its results equal the plain launch's bit for bit
    (the same arithmetic), eagerly and over many CUDA-graph replays (a missing wait would show as
    a stale or partial result), at 16 and 4 splits, GQA, ragged cache lengths."""
    from tritonattn import flash_attn_with_kvcache
    from tritonattn.kernels import plan

    torch.manual_seed(5)
    for B, cap, splits in ((1, 4096, 16), (4, 1000, 4)):
        q = torch.randn(B, 1, 32, 128, device="cuda", dtype=BF16)
        kc, vc = (torch.randn(B, cap, 8, 128, device="cuda", dtype=BF16) for _ in range(2))
        lens = torch.randint(1, cap + 1, (B,), dtype=torch.int32, device="cuda")
        res = {}
        for pdl in (False, True):
            monkeypatch.setattr(configs, "DECODE_PDL", pdl)
            plan.clear()
            res[pdl] = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, num_splits=splits,
                                               return_softmax_lse=True)
        assert torch.equal(res[True][0], res[False][0]) and torch.equal(res[True][1], res[False][1])
        if B == 1:  # (ragged batches against the reference: the kv-cache tests)
            L = int(lens[0])
            check_against_reference(q, kc[:, :L], vc[:, :L], *res[False], None, None, False)
        # graph replays with PDL: new queries each time, compared with the eager plain launch
        monkeypatch.setattr(configs, "DECODE_PDL", True)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, num_splits=splits)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out_g = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, num_splits=splits)
        for _ in range(20):
            q.copy_(torch.randn_like(q))
            graph.replay()
            monkeypatch.setattr(configs, "DECODE_PDL", False)
            ref = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, num_splits=splits)
            monkeypatch.setattr(configs, "DECODE_PDL", True)
            torch.cuda.synchronize()
            assert torch.equal(out_g, ref)


def test_split_decoding_repeats_on_gpu(poison):
    """Split-KV decoding on the GPU, its partials in blocks kept per stream: 40 repeated calls and 20
    CUDA-graph replays (new queries each time, against eager calls sharing the eager blocks) bitwise
    equal, against the reference; dense decode-shaped calls too."""
    from tritonattn import flash_attn_with_kvcache

    torch.manual_seed(8)
    cases = ((1, 4096, 32, 8, 16), (1, 16384, 32, 8, 0), (1, 8192, 16, 1, 0), (4, 1000, 32, 8, 4))
    for B, cap, Hq, Hkv, splits in cases:
        q = torch.randn(B, 1, Hq, 128, device="cuda", dtype=BF16)
        kc, vc = (torch.randn(B, cap, Hkv, 128, device="cuda", dtype=BF16) for _ in range(2))
        lens = torch.randint(1, cap + 1, (B,), dtype=torch.int32, device="cuda")
        out, lse = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, num_splits=splits, return_softmax_lse=True)
        L = int(lens[0])
        check_against_reference(q[:1], kc[:1, :L], vc[:1, :L], out[:1], lse[:1], None, None, False)
        for _ in range(40):
            again = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, num_splits=splits, return_softmax_lse=True)
            assert torch.equal(again[0], out) and torch.equal(again[1], lse)
        dense = flash_attn_func(q[:1], kc[:1, :L], vc[:1, :L])  # the dense call's route (configs.dense_decode)
        check_against_reference(q[:1], kc[:1, :L], vc[:1, :L], dense, None, None, None, False)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, num_splits=splits)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out_g = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, num_splits=splits)
        for _ in range(20):
            q.copy_(torch.randn_like(q))
            graph.replay()
            ref = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, num_splits=splits)
            torch.cuda.synchronize()
            assert torch.equal(out_g, ref)


@pytest.mark.parametrize("record_at", [1, 2], ids=["plans-at-first-call", "plans-at-second-call"])
def test_training_step_in_a_cuda_graph(record_at, poison, monkeypatch):
    """Forward and backward captured in one CUDA graph (what takes host time out of short eager
    calls): replays with new inputs give bitwise what eager calls give. One warm-up step: with the
    library's default (plans recorded at a signature's second call) the captured step records the
    forward's and the backward's plans, which the eager steps after it replay."""
    from tritonattn.kernels import plan

    monkeypatch.setattr(plan, "RECORD_AT", record_at)
    torch.manual_seed(6)
    q = torch.randn(2, 300, 8, 128, device="cuda", dtype=BF16, requires_grad=True)
    k = torch.randn(2, 300, 2, 128, device="cuda", dtype=BF16, requires_grad=True)
    v = torch.randn(2, 300, 2, 128, device="cuda", dtype=BF16, requires_grad=True)
    dout = torch.randn_like(q)

    def step():
        out = flash_attn_func(q, k, v, causal=True)
        return (out, *torch.autograd.grad(out, (q, k, v), dout))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (compilation, launch plans) outside the capture
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for _ in range(3):
        with torch.no_grad():
            for t in (q, k, v, dout):
                t.copy_(torch.randn_like(t))
        graph.replay()
        eager = step()
        torch.cuda.synchronize()
        for name, g, e in zip(("out", "dq", "dk", "dv"), captured, eager):
            assert torch.equal(g, e), name


def test_inference_in_a_cuda_graph_beside_eager_calls(poison):
    """Inference calls that return no lse write it to a kept buffer per stream (fwd._discarded), but a
    captured call gets a fresh one from the graph's pool: graph replays and eager calls of the same
    signature interleaved give bitwise the same outputs, and the graph's lse buffer is not the kept one."""
    from tritonattn.kernels import fwd

    torch.manual_seed(7)
    q = torch.randn(2, 300, 8, 128, device="cuda", dtype=BF16)
    k, v = (torch.randn(2, 300, 2, 128, device="cuda", dtype=BF16) for _ in range(2))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (compilation, launch plans, the links) outside the capture
        for _ in range(2):
            flash_attn_func(q, k, v, causal=True)
    torch.cuda.current_stream().wait_stream(side)
    kept = {t.data_ptr() for t in fwd._discarded.views.values()}
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = flash_attn_func(q, k, v, causal=True)
    assert {t.data_ptr() for t in fwd._discarded.views.values()} == kept  # the capture kept nothing
    for _ in range(3):
        q.copy_(torch.randn_like(q))
        graph.replay()
        eager = flash_attn_func(q, k, v, causal=True)
        torch.cuda.synchronize()
        assert torch.equal(captured, eager)
        ref = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)[0]  # (its own lse)
        assert torch.equal(eager, ref)


@pytest.mark.parametrize("splits", [0, 4, 1], ids=["auto", "split-kv", "one-split"])
def test_decode_step_in_a_cuda_graph(splits, monkeypatch):
    """A decoding step (tensor cache_seqlens, new k / v appended in place) captured in a CUDA graph
    and replayed with new inputs equals the eager call: nothing in the path syncs with the host or
    keeps host-side state (what serving engines and torch.compile's "reduce-overhead" need). The
    content checks of TRITONATTN_DEBUG sync, so they are skipped while a graph is captured: the
    switch is on here (as in every test), and the capture must not break."""
    from tritonattn import flash_attn_with_kvcache
    from tritonattn.kernels import plan

    monkeypatch.setenv("TRITONATTN_DEBUG", "1")
    monkeypatch.setattr(plan, "RECORD_AT", 2)  # the library's default: one warm-up, the captured call records
    torch.manual_seed(11)
    B, Hq, Hkv, D, cap = 2, 8, 2, 64, 512
    cache0 = [torch.randn(B, cap, Hkv, D, device="cuda", dtype=BF16) for _ in range(2)]
    q, knew, vnew = (torch.randn(B, 1, h, D, device="cuda", dtype=BF16) for h in (Hq, Hkv, Hkv))
    seqlens = torch.tensor([100, 300], dtype=torch.int32, device="cuda")

    def step(kc, vc):
        return flash_attn_with_kvcache(q, kc, vc, knew, vnew, cache_seqlens=seqlens, causal=True,
                                       num_splits=splits)

    kc_g, vc_g = (c.clone() for c in cache0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (compilation, allocator) off the capture
        step(kc_g, vc_g)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_g = step(kc_g, vc_g)
    kc_e, vc_e = kc_g.clone(), vc_g.clone()  # the eager twin starts from the same cache
    for lens in ([57, 411], [0, 511]):
        q.copy_(torch.randn_like(q))
        knew.copy_(torch.randn_like(knew))
        vnew.copy_(torch.randn_like(vnew))
        seqlens.copy_(torch.tensor(lens, dtype=torch.int32))
        graph.replay()
        ref = step(kc_e, vc_e)
        torch.cuda.synchronize()
        assert torch.equal(out_g, ref), lens
        assert torch.equal(kc_g, kc_e) and torch.equal(vc_g, vc_e), lens


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two visible GPUs (tensors on a device that "
                    "is not the current one); the logic is also checked without a GPU in test_launch.py")
def test_tensors_on_a_device_that_is_not_current():
    """A model spread over two GPUs in one process (device_map="auto"): attention on cuda:1 while
    cuda:0 is current equals the same call made with cuda:1 current (forward, backward, decoding),
    and the current device is left as it was."""
    from tritonattn import flash_attn_with_kvcache

    torch.cuda.set_device(0)
    q, k, v = random_qkv(2, 300, 300, 8, 2, 128, BF16, "cuda:1", requires_grad=False,
                         generator=torch.Generator().manual_seed(5))
    dout = torch.randn_like(q)
    kc, vc = (torch.randn(2, 512, 2, 128, device="cuda:1", dtype=BF16) for _ in range(2))
    lens = torch.tensor([100, 400], dtype=torch.int32, device="cuda:1")

    def calls():
        qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
        out = flash_attn_func(qg, kg, vg, causal=True)
        grads = torch.autograd.grad(out, (qg, kg, vg), dout)
        dec = flash_attn_with_kvcache(q[:, :1], kc, vc, cache_seqlens=lens, causal=True)
        return (out, *grads, dec)

    for _ in range(2):  # the second time through the launch plans and cached kernels
        other = calls()
        torch.cuda.synchronize(1)
    assert torch.cuda.current_device() == 0
    with torch.cuda.device(1):
        same = calls()
        torch.cuda.synchronize()
    for a, b in zip(other, same):
        assert a.device == torch.device("cuda:1") and torch.equal(a, b)


def test_heads_first_order_on_gpu(monkeypatch, poison):
    """Heads-first program order (configs.HEADS_FIRST) at the table's causal configs, bf16 GQA:
    bitwise the default order's outputs and gradients, and within the reference's tolerance. (The
    Triton kernels' order: the Gluon ones, which would serve this call, have their own.)"""
    monkeypatch.setattr(fwd, "GLUON", False)
    monkeypatch.setattr(bwd, "GLUON", False)
    torch.manual_seed(11)
    q, k, v = random_qkv(2, 1500, 1700, 8, 2, 128, BF16, DEVICE)
    dout = torch.randn_like(q)

    def run():
        out = flash_attn_func(q, k, v, causal=True)
        return (out, *torch.autograd.grad(out, (q, k, v), dout))

    swapped, grids = in_both_program_orders(monkeypatch, run)
    assert grids["_fwd_kernel"][0] == grids["_bwd_dq_kernel"][0] == 16 and grids["_bwd_dkdv_kernel"][0] == 4, grids
    check_against_reference(q, k, v, swapped[0], None, swapped[1:], dout, True)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_more_heads_than_a_grid_axis_holds_on_gpu(causal, poison):
    """Batch x heads past CUDA's 65535 programs per grid y / z axis: forward, backward, decoding."""
    from tritonattn import flash_attn_with_kvcache

    torch.manual_seed(12)
    q, k, v = random_qkv(2049, 5, 7, 32, 8, 16, F16, DEVICE)  # 65568 query heads, 16392 kv heads
    out, lse, _ = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    check_against_reference(q, k, v, out, lse, grads, dout, causal)
    # decoding: 8200 x 8 kv heads on the split kernel's grid
    q1 = torch.randn(8200, 1, 32, 16, device=DEVICE, dtype=F16)
    kc = torch.randn(8200, 40, 8, 16, device=DEVICE, dtype=F16)
    vc = torch.randn_like(kc)
    out1 = flash_attn_with_kvcache(q1, kc, vc, cache_seqlens=33, causal=causal, num_splits=2)
    check_against_reference(q1, kc[:, :33], vc[:, :33], out1, None, None, None, causal)
