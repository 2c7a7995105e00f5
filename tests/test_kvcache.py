"""flash_attn_with_kvcache: in-place append, rotary, contiguous and paged caches, against the reference."""

import pytest
import torch
from conftest import DEVICE, case_id, check_against_reference, to_paged

from tritonattn import configs, flash_attn_with_kvcache
from tritonattn.inference import apply_rotary

F16 = torch.float16


def _cache(Bc, S, Hkv, D, dtype=F16):
    return (torch.randn(Bc, S, Hkv, D, device=DEVICE).to(dtype), torch.randn(Bc, S, Hkv, D, device=DEVICE).to(dtype))


@pytest.mark.parametrize("Sq,new", [(1, 0), (1, 1), (5, 5), (3, 0), (16, 16)], ids=lambda x: str(x))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_kvcache_against_reference(Sq, new, causal, poison):
    torch.manual_seed(Sq * 10 + new)
    B, Hq, Hkv, D, S = 3, 8, 2, 64, 96
    q = torch.randn(B, Sq, Hq, D, device=DEVICE).to(F16)
    k_cache, v_cache = _cache(B, S, Hkv, D)
    seqlens = torch.tensor([0, 17, 70], dtype=torch.int32, device=DEVICE)
    k_new = torch.randn(B, new, Hkv, D, device=DEVICE).to(F16) if new else None
    v_new = torch.randn(B, new, Hkv, D, device=DEVICE).to(F16) if new else None
    before_k, before_v = k_cache.clone(), v_cache.clone()
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens, causal=causal,
                                       return_softmax_lse=True)
    for b in range(B):
        n = int(seqlens[b])
        if new:  # appended in place, element by element, and nothing else touched
            assert torch.equal(k_cache[b, n:n + new], k_new[b]) and torch.equal(v_cache[b, n:n + new], v_new[b])
        untouched = torch.ones(S, dtype=torch.bool, device=DEVICE)
        untouched[n:n + new] = False
        assert torch.equal(k_cache[b, untouched], before_k[b, untouched])
        assert torch.equal(v_cache[b, untouched], before_v[b, untouched])
        L = n + new
        if L == 0:
            assert torch.equal(out[b], torch.zeros_like(out[b]))
            continue
        check_against_reference(q[b:b + 1], k_cache[b:b + 1, :L], v_cache[b:b + 1, :L], out[b:b + 1],
                                lse[b:b + 1], None, None, causal)


@pytest.mark.parametrize("page_size", [16, 32])
def test_paged_equals_contiguous(page_size, poison):
    gen = torch.Generator().manual_seed(1)
    torch.manual_seed(1)
    B, Sq, Hq, Hkv, D, S = 3, 4, 4, 2, 64, 128
    q = torch.randn(B, Sq, Hq, D, device=DEVICE).to(F16)
    k_cache, v_cache = _cache(B, S, Hkv, D)
    kp, vp, table = to_paged(k_cache, v_cache, page_size, gen)
    seqlens = torch.tensor([5, 64, 100], dtype=torch.int32, device=DEVICE)
    k_new = torch.randn(B, Sq, Hkv, D, device=DEVICE).to(F16)
    v_new = torch.randn(B, Sq, Hkv, D, device=DEVICE).to(F16)
    out_c = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens, causal=True)
    out_p = flash_attn_with_kvcache(q, kp, vp, k_new, v_new, cache_seqlens=seqlens, causal=True, block_table=table)
    assert torch.equal(out_c, out_p)
    # the pages hold exactly what the contiguous cache holds, appended tokens included
    assert torch.equal(kp[table.long()].reshape(B, S, Hkv, D), k_cache)
    assert torch.equal(vp[table.long()].reshape(B, S, Hkv, D), v_cache)


@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "halves"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_rotary_batch_idx_and_leftpad(interleaved, causal, poison):
    torch.manual_seed(2)
    B, Sq, Hq, Hkv, D, S, rot = 2, 3, 4, 2, 64, 80, 32
    q = torch.randn(B, Sq, Hq, D, device=DEVICE).to(F16)
    k_cache, v_cache = _cache(4, S, Hkv, D)  # 4 cache rows, the batch uses rows 3 and 1
    batch_idx = torch.tensor([3, 1], dtype=torch.int32, device=DEVICE)
    leftpad = torch.tensor([0, 10], dtype=torch.int32, device=DEVICE)
    seqlens = torch.tensor([20, 50], dtype=torch.int32, device=DEVICE)
    k_new = torch.randn(B, Sq, Hkv, D, device=DEVICE).to(F16)
    v_new = torch.randn(B, Sq, Hkv, D, device=DEVICE).to(F16)
    angles = torch.rand(100, rot // 2, device=DEVICE) * 6
    cos, sin = angles.cos(), angles.sin()
    k0 = k_cache.clone()
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, rotary_cos=cos, rotary_sin=sin,
                                  cache_seqlens=seqlens, cache_batch_idx=batch_idx, cache_leftpad=leftpad,
                                  causal=causal, rotary_interleaved=interleaved)
    assert torch.equal(k_cache[0], k0[0]) and torch.equal(k_cache[2], k0[2])  # rows no batch uses
    for b in range(B):
        row, lp, n = int(batch_idx[b]), int(leftpad[b]), int(seqlens[b])
        pos = torch.arange(n - lp, n - lp + Sq, device=DEVICE)[None]
        k_rot = apply_rotary(k_new[b:b + 1], cos, sin, pos, interleaved)
        assert torch.equal(k_cache[row, n:n + Sq], k_rot[0])
        q_pos = pos if causal else torch.full_like(pos, n - lp)
        q_rot = apply_rotary(q[b:b + 1], cos, sin, q_pos, interleaved)
        check_against_reference(q_rot, k_cache[row:row + 1, lp:n + Sq], v_cache[row:row + 1, lp:n + Sq],
                                out[b:b + 1], None, None, None, causal)


def test_apply_rotary_matches_complex_rotation():
    torch.manual_seed(3)
    x = torch.randn(1, 5, 2, 8, dtype=torch.float64)
    angles = torch.rand(5, 4, dtype=torch.float64)
    pos = torch.arange(5)[None]
    got = apply_rotary(x, angles.cos(), angles.sin(), pos, interleaved=True)
    z = torch.view_as_complex(x.reshape(1, 5, 2, 4, 2).contiguous()) * torch.polar(torch.ones_like(angles), angles)[
        None, :, None]
    assert torch.allclose(got, torch.view_as_real(z).reshape(1, 5, 2, 8))


def _rounded(x: torch.Tensor, dtype) -> torch.Tensor:
    """``x.to(dtype)``, as a kernel rounds it: under the interpreter float32 -> bfloat16 truncates
    (Triton 3.6's interpreter; the GPU rounds to nearest even, as torch does)."""
    if dtype == torch.bfloat16 and DEVICE == "cpu":
        x = (x.float().contiguous().view(torch.int32) & ~0xFFFF).view(torch.float32)
    return x.to(dtype)


def _append_reference(q, k_new, v_new, k_cache, v_cache, cos, sin, lens, leftpad, batch_idx, table, interleaved,
                      local):
    """What flash_attn_with_kvcache did before its append kernel, in torch ops: q rotated, the new keys
    (rotated) and values written in place by advanced indexing. Returns q and the lengths after."""
    B, Sq = q.shape[:2]
    start = leftpad.long() if leftpad is not None else 0
    if cos is not None:
        base = (lens.long() - start)[:, None]
        pos_q = base + (torch.arange(Sq, device=q.device)[None, :] if local else 0)
        q = _rounded(apply_rotary(q.float(), cos, sin, pos_q.expand(B, Sq), interleaved), q.dtype)
    if k_new is None:
        return q, lens
    pos = lens.long()[:, None] + torch.arange(k_new.shape[1], device=q.device)[None, :]
    if cos is not None:
        k_new = _rounded(apply_rotary(k_new.float(), cos, sin, pos - (start[:, None] if leftpad is not None else 0),
                                      interleaved), k_new.dtype)
    if table is not None:
        page_size = k_cache.shape[1]
        pages = table.long().gather(1, pos // page_size)
        k_cache[pages, pos % page_size] = k_new
        v_cache[pages, pos % page_size] = v_new
    else:
        rows = (batch_idx.long() if batch_idx is not None else torch.arange(B, device=q.device))[:, None]
        k_cache[rows, pos] = k_new
        v_cache[rows, pos] = v_new
    return q, lens + k_new.shape[1]


@pytest.mark.parametrize("dtype", [F16, torch.float32, torch.bfloat16], ids=["fp16", "fp32", "bf16"])
@pytest.mark.parametrize("D,rot", [(64, 64), (40, 16), (80, 0)], ids=["D64-rot64", "D40-rot16", "D80-norot"])
@pytest.mark.parametrize("layout", ["contiguous", "batch-idx-leftpad", "paged16"])
@pytest.mark.parametrize("interleaved,local", [(True, True), (False, False)], ids=["interleaved-local", "halves"])
def test_cache_append_kernel_matches_torch_indexing(dtype, D, rot, layout, interleaved, local):
    """The append kernel (kernels/decode.py cache_append: rotary on q and the new keys, the new keys /
    values into the cache) against the torch ops it replaced: q, the whole cache and the lengths
    bitwise, with non-contiguous q / new tokens / rotary tables, 1 and 3 new tokens, and a query
    count (4) above the new tokens' (rotary q alone in the programs past them)."""
    from tritonattn.kernels.decode import cache_append

    gen = torch.Generator().manual_seed(D + rot)
    B, Hq, Hkv, S = 3, 6, 2, 64
    for n_new, Sq in ((1, 1), (3, 4)):
        q = torch.randn(B, Hq, Sq, D, generator=gen).to(DEVICE, dtype).transpose(1, 2)  # non-contiguous
        k_new = torch.randn(B, n_new, Hkv, 2 * D, generator=gen).to(DEVICE, dtype)[..., ::2]
        v_new = torch.randn(B, n_new, Hkv, D, generator=gen).to(DEVICE, dtype)
        cos = sin = None
        if rot:
            angles = torch.rand(rot, 90, generator=gen).to(DEVICE).t()[:, : rot // 2] * 6  # (90, rot / 2), strided
            cos, sin = angles.cos().to(dtype), angles.sin()
        lens = torch.tensor([0, 17, 60], dtype=torch.int32, device=DEVICE)
        leftpad = batch_idx = table = None
        if layout == "paged16":
            k_cache = torch.randn(B * S // 16 + 1, 16, Hkv, D, generator=gen).to(DEVICE, dtype)
            table = torch.randperm(B * S // 16, generator=gen).to(DEVICE, torch.int32).view(B, S // 16)
        else:
            k_cache = torch.randn(4, S, Hkv, D, generator=gen).to(DEVICE, dtype)
            if layout == "batch-idx-leftpad":
                batch_idx = torch.tensor([3, 0, 2], dtype=torch.int32, device=DEVICE)
                leftpad = torch.tensor([0, 5, 30], dtype=torch.int32, device=DEVICE)
        v_cache = torch.randn(k_cache.shape, generator=gen).to(DEVICE, dtype)
        kc, vc = k_cache.clone(), v_cache.clone()
        want_q, want_lens = _append_reference(q, k_new, v_new, kc, vc, cos, sin, lens, leftpad, batch_idx, table,
                                              interleaved, local)
        for _ in range(2):  # recorded, then replayed from the launch plan
            got_k, got_v = k_cache.clone(), v_cache.clone()
            got_q, got_lens = cache_append(q, k_new, v_new, got_k, got_v, cos, sin, lens, leftpad, batch_idx, table,
                                           interleaved, local)
            assert torch.equal(got_q, want_q) and torch.equal(got_lens, want_lens)
            assert torch.equal(got_k, kc) and torch.equal(got_v, vc)
            assert torch.equal(lens, torch.tensor([0, 17, 60], dtype=torch.int32, device=DEVICE))  # not touched


def test_cache_append_writes_nothing_outside_the_cache():
    """Rows past the cache's capacity, cache rows and pages out of range: not written (with
    TRITONATTN_DEBUG=1 such calls are errors before any launch; without it the append must not
    write out of bounds); rows in range are written as usual."""
    from tritonattn.kernels.decode import cache_append

    i32 = dict(dtype=torch.int32, device=DEVICE)
    k_cache, v_cache = _cache(3, 32, 2, 16)
    kn, vn = (torch.randn(3, 2, 2, 16, device=DEVICE).to(F16) for _ in range(2))
    q = torch.randn(3, 1, 4, 16, device=DEVICE).to(F16)
    kc, vc = k_cache.clone(), v_cache.clone()
    # batch row 0: rows 31 (written) and 32 (past the end); row 1: cache row 5 (none); row 2: row -1
    cache_append(q, kn, vn, kc, vc, None, None, torch.tensor([31, 3, -1], **i32), None,
                 torch.tensor([0, 5, 1], **i32), None, True, False)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want_k[0, 31], want_v[0, 31] = kn[0, 0], vn[0, 0]
    want_k[1, 0], want_v[1, 0] = kn[2, 1], vn[2, 1]  # row -1 + 1 = 0 of cache row 1
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
    pc, pv = _cache(4, 16, 2, 16)
    table = torch.tensor([[0, 9], [-3, 1], [2, 3]], **i32)
    kp, vp = pc.clone(), pv.clone()
    cache_append(q, kn, vn, kp, vp, None, None, torch.tensor([15, 0, 40], **i32), None, None, table, True, False)
    want_k, want_v = pc.clone(), pv.clone()
    want_k[0, 15], want_v[0, 15] = kn[0, 0], vn[0, 0]  # its next row is on page 9: none
    assert torch.equal(kp, want_k) and torch.equal(vp, want_v)


@pytest.mark.parametrize("layout", ["contiguous", "batch-idx-leftpad", "paged16"])
@pytest.mark.parametrize("rotary", ["interleaved", "halves", "none"])
@pytest.mark.parametrize("n_new", [0, 1, 3, 20])
def test_decoding_kernel_appends_as_the_append_kernel(layout, rotary, n_new, poison, monkeypatch):
    """Where the decoding kernel runs, it rotates q and writes the new keys / values itself (the
    program whose key split holds a new row). Against the other path (the append kernel, then the
    forward kernel: DECODE_MAX_ROWS 0; test_kvcache_against_reference and
    test_rotary_batch_idx_and_leftpad check both against the reference): the caches bitwise, the
    outputs within the kernels' rounding. num_splits 1, 3 and 7 over 64 rows: new rows at 15-17
    straddle a split's end, and one ends at the cache's last row (62 + 1); an empty row; rotary
    without new tokens rotates q alone."""
    from tritonattn import inference

    if rotary == "none" and n_new == 0:
        pytest.skip("nothing appended and nothing rotated: the plain decoding step (test_split_kv_decoding)")
    gen = torch.Generator().manual_seed(n_new)
    torch.manual_seed(n_new)
    B, Sq, Hq, Hkv, D, S = 3, 2, 4, 2, 40, 64
    q = torch.randn(B, Sq, Hq, D, device=DEVICE).to(F16)
    kw = dict(causal=True)
    if n_new:
        kw["k"] = torch.randn(B, n_new, Hkv, D, device=DEVICE).to(F16)
        kw["v"] = torch.randn(B, n_new, Hkv, D, device=DEVICE).to(F16)
    if rotary != "none":
        angles = torch.rand(S + 8, 8, device=DEVICE) * 6
        kw.update(rotary_cos=angles.cos(), rotary_sin=angles.sin(), rotary_interleaved=rotary == "interleaved")
    seqlens = torch.tensor([15, 0, 40 if n_new >= 3 else 62], dtype=torch.int32, device=DEVICE)
    k_cache, v_cache = _cache(B + 1, S, Hkv, D)
    if layout == "paged16":
        k_cache, v_cache, table = to_paged(k_cache[:B], v_cache[:B], 16, gen)
        kw["block_table"] = table
    elif layout == "batch-idx-leftpad":
        kw["cache_batch_idx"] = torch.tensor([3, 0, 1], dtype=torch.int32, device=DEVICE)
        kw["cache_leftpad"] = torch.tensor([4, 0, 9], dtype=torch.int32, device=DEVICE)
    kc, vc = k_cache.clone(), v_cache.clone()
    with monkeypatch.context() as m:
        m.setattr(inference, "DECODE_MAX_ROWS", 0)  # the append kernel, then the forward kernel
        ref = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, **kw)
    for splits in (1, 3, 7):
        kd, vd = k_cache.clone(), v_cache.clone()
        out = flash_attn_with_kvcache(q, kd, vd, cache_seqlens=seqlens, num_splits=splits, **kw)
        assert torch.equal(kd, kc) and torch.equal(vd, vc), splits
        assert not torch.isnan(out).any()
        assert (out.float() - ref.float()).abs().max().item() < 2e-3, splits


def test_checks_still_run_after_a_remembered_signature():
    """flash_attn_with_kvcache skips its checks for a signature that passed them before; an int
    cache_seqlens is still range-checked on every call, and options of another type get the checks."""
    q = torch.randn(2, 1, 4, 16, device=DEVICE).to(F16)
    kc, vc = _cache(2, 32, 2, 16)
    for n in (5, 6):  # the second call is remembered
        flash_attn_with_kvcache(q, kc, vc, cache_seqlens=n, num_splits=2)
    with pytest.raises(ValueError, match="cache_seqlens = 33 is outside"):
        flash_attn_with_kvcache(q, kc, vc, cache_seqlens=33, num_splits=2)
    with pytest.raises(ValueError, match="num_splits"):
        flash_attn_with_kvcache(q, kc, vc, cache_seqlens=5, num_splits=True)
    with pytest.raises(TypeError, match="softmax_scale"):
        flash_attn_with_kvcache(q, kc, vc, cache_seqlens=5, num_splits=2, softmax_scale=[1.0])
    with pytest.raises(TypeError, match="cache_seqlens must be an int32 tensor"):
        flash_attn_with_kvcache(q, kc, vc, cache_seqlens=True, num_splits=2)
    lens = torch.tensor([3, 20], dtype=torch.int32, device=DEVICE)
    flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, num_splits=2)
    with pytest.raises(ValueError, match="cache_seqlens"):  # contents: every call (CPU, TRITONATTN_DEBUG)
        flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens + 20, num_splits=2)


def test_kvcache_bad_input():
    q = torch.randn(2, 1, 4, 16, device=DEVICE).to(F16)
    kc, vc = _cache(2, 32, 2, 16)
    with pytest.raises(ValueError, match="cache_seqlens = 40 is outside"):
        flash_attn_with_kvcache(q, kc, vc, cache_seqlens=40)
    with pytest.raises(TypeError, match="cache_seqlens must be an int32 tensor"):
        flash_attn_with_kvcache(q, kc, vc, cache_seqlens=torch.zeros(2, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="block_table must be an int32 tensor"):
        flash_attn_with_kvcache(q, kc, vc, block_table=torch.zeros(3, 2, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="give both k and v"):
        flash_attn_with_kvcache(q, kc, vc, k=torch.randn(2, 1, 2, 16, device=DEVICE).to(F16))
    with pytest.raises(ValueError, match=r"cache_seqlens \(\+ 1 new tokens\) must lie in"):
        kn = torch.randn(2, 1, 2, 16, device=DEVICE).to(F16)
        flash_attn_with_kvcache(q, kc, vc, kn, kn.clone(), cache_seqlens=torch.tensor([3, 32], dtype=torch.int32,
                                                                                      device=DEVICE))
    with pytest.raises(ValueError, match="k_cache holds 1 rows, fewer than q's batch 2"):
        flash_attn_with_kvcache(q, *_cache(1, 32, 2, 16))


def test_cache_of_more_rows_than_the_batch(poison):
    """Without cache_batch_idx batch row b uses cache row b, in a cache of any number of rows >= the
    batch (flash-attn's; a serving engine's cache sized for its largest batch): the same output as
    the cache cut to the batch's rows, new tokens appended there and the other rows untouched."""
    torch.manual_seed(5)
    q = torch.randn(2, 1, 4, 16, device=DEVICE).to(F16)
    kc, vc = _cache(5, 32, 2, 16)
    kn, vn = (torch.randn(2, 1, 2, 16, device=DEVICE).to(F16) for _ in range(2))
    lens = torch.tensor([7, 20], dtype=torch.int32, device=DEVICE)
    k0, v0 = kc.clone(), vc.clone()
    kcut, vcut = kc[:2].clone(), vc[:2].clone()
    out = flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens)
    expected = flash_attn_with_kvcache(q, kcut, vcut, kn, vn, cache_seqlens=lens)
    assert torch.equal(out, expected)
    assert torch.equal(kc[:2], kcut) and torch.equal(vc[:2], vcut)
    assert torch.equal(kc[2:], k0[2:]) and torch.equal(vc[2:], v0[2:])


def test_kvcache_rows_and_pages_out_of_the_cache(monkeypatch):
    """cache_batch_idx rows and the block_table pages a call reads or writes must lie in the cache
    (else the kernel reads, and the append writes, out of bounds): checked on CPU tensors and with
    TRITONATTN_DEBUG=1, on remembered signatures too; pages a row does not use may hold anything."""
    monkeypatch.setenv("TRITONATTN_DEBUG", "1")
    i32 = dict(dtype=torch.int32, device=DEVICE)
    q = torch.randn(2, 1, 4, 16, device=DEVICE).to(F16)
    kc, vc = _cache(3, 32, 2, 16)
    for rows in ([0, 2], [2, 1]):  # in range: runs (the second call replays a remembered signature)
        flash_attn_with_kvcache(q, kc, vc, cache_seqlens=5, cache_batch_idx=torch.tensor(rows, **i32))
    for rows in ([0, 3], [-1, 1]):
        with pytest.raises(ValueError, match="cache_batch_idx must index rows of k_cache"):
            flash_attn_with_kvcache(q, kc, vc, cache_seqlens=5, cache_batch_idx=torch.tensor(rows, **i32))
    pc, pv = _cache(4, 16, 2, 16)  # 4 pages of 16 keys
    kn = torch.randn(2, 1, 2, 16, device=DEVICE).to(F16)
    lens = torch.tensor([16, 17], **i32)
    # row 0 reads page 0 only (16 keys); row 1 reads pages 2 and 3 (17 keys): the 99 is never read
    ok = torch.tensor([[0, 99], [2, 3]], **i32)
    for _ in range(2):
        flash_attn_with_kvcache(q, pc, pv, cache_seqlens=lens, block_table=ok)
    with pytest.raises(ValueError, match=r"block_table\[0, 1\] = 99 is not a page of k_cache \(num_blocks = 4\)"):
        # a new token at row 16 of sequence 0: its second page is written
        flash_attn_with_kvcache(q, pc, pv, kn, kn.clone(), cache_seqlens=lens, block_table=ok)
    with pytest.raises(ValueError, match=r"block_table\[1, 0\] = -2 is not a page"):
        flash_attn_with_kvcache(q, pc, pv, cache_seqlens=lens, block_table=torch.tensor([[0, 1], [-2, 3]], **i32))
    with pytest.raises(ValueError, match=r"block_table\[1, 1\] = 4 is not a page"):
        flash_attn_with_kvcache(q, pc, pv, cache_seqlens=lens, block_table=torch.tensor([[0, 1], [2, 4]], **i32))


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged16"])
@pytest.mark.parametrize("Sq,causal,extra", [(1, True, {}), (4, True, dict(softcap=15.0)), (2, False, dict(alibi=True)),
                                             (3, True, dict(window_size=(40, 0)))],
                         ids=["decode1", "spec4-softcap", "q2-alibi", "q3-window"])
def test_split_kv_decoding(paged, Sq, causal, extra, poison, monkeypatch):
    """The decoding kernel with num_splits 0 (picked), 1 (one split, the output written by the
    kernel itself), 3 and 7 against the forward kernel and the reference."""
    from tritonattn import inference

    gen = torch.Generator().manual_seed(5)
    torch.manual_seed(5)
    B, Hq, Hkv, D, S = 3, 8, 2, 64, 160
    q = torch.randn(B, Sq, Hq, D, device=DEVICE).to(F16)
    k_cache, v_cache = _cache(B, S, Hkv, D)
    seqlens = torch.tensor([0, 33, 150], dtype=torch.int32, device=DEVICE)
    kw = dict(extra)
    if kw.pop("alibi", False):
        kw["alibi_slopes"] = torch.rand(B, Hq, device=DEVICE)
    if paged:
        kc, vc, table = to_paged(k_cache, v_cache, 16, gen)
        kw["block_table"] = table
    else:
        kc, vc = k_cache, v_cache
    with monkeypatch.context() as m:
        m.setattr(inference, "DECODE_MAX_ROWS", 0)  # every call on the forward kernel
        ref, ref_lse = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, causal=causal,
                                               return_softmax_lse=True, **kw)
    for splits in (0, 1, 3, 7):
        out, lse = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, causal=causal, num_splits=splits,
                                           return_softmax_lse=True, **kw)
        assert not torch.isnan(out).any()
        assert (out.float() - ref.float()).abs().max().item() < 2e-3, splits
        fin = torch.isfinite(ref_lse)
        assert torch.equal(fin, torch.isfinite(lse)) and (lse[fin] - ref_lse[fin]).abs().max().item() < 1e-4
    for b in range(1, B):
        L = int(seqlens[b])
        rkw = {key: val for key, val in kw.items() if key in ("softcap", "window_size")}
        if "alibi_slopes" in kw:
            rkw["alibi_slopes"] = kw["alibi_slopes"][b:b + 1]
        check_against_reference(q[b:b + 1], k_cache[b:b + 1, :L], v_cache[b:b + 1, :L], out[b:b + 1],
                                lse[b:b + 1], None, None, causal, **rkw)
    assert torch.equal(out[0], torch.zeros_like(out[0]))  # an empty cache row


def test_which_kernel_decodes(monkeypatch):
    """A few query rows per kv head (seqlen_q x group <= 64) take the decoding kernel: with one split
    it writes the output itself, with more a combine launch merges the splits. More rows take the
    forward kernel whatever num_splits says (a hint there: the decoding kernel's tile holds every row,
    so 4 x 32 rows would not fit), with the same result for every num_splits."""
    from tritonattn.kernels import fwd, launch, plan

    seen, real = [], launch.launch

    def spy(fn, grid, args, kwargs):
        seen.append((fn.__name__, kwargs.get("DIRECT")))
        return real(fn, grid, args, kwargs)

    monkeypatch.setattr(launch, "launch", spy)
    torch.manual_seed(3)
    q = torch.randn(2, 1, 8, 32, device=DEVICE).to(F16)
    kc, vc = _cache(2, 400, 2, 32)
    for splits, kernels in (
            (1, [("_decode_split_kernel", True)]),
            (3, [("_decode_split_kernel", False), ("_decode_combine_kernel", None)])):
        seen.clear()
        plan.clear()  # on a GPU a replayed plan launches the compiled kernels without launch.launch
        flash_attn_with_kvcache(q, kc, vc, cache_seqlens=390, num_splits=splits)
        assert seen == kernels, (splits, seen)
    q_long = torch.randn(2, 20, 8, 32, device=DEVICE).to(F16)  # 80 rows per kv head
    outs = []
    for splits in (0, 1, 4):
        seen.clear()
        plan.clear()
        outs.append(flash_attn_with_kvcache(q_long, kc, vc, cache_seqlens=70, causal=True, num_splits=splits))
        assert seen == [(fwd._fwd_kernel.__name__, None)], (splits, seen)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_split_count_switch_and_cap(monkeypatch):
    """The decoding plan's key holds configs.DECODE_ONE_SPLIT_KEYS (a changed switch takes its own
    plan, not the recorded one's split count), and a user's num_splits is capped at 128 (the combine
    loads a row's splits at once); results against the reference."""
    from tritonattn.kernels import launch

    seen, real = [], launch.launch

    def spy(fn, grid, args, kwargs):
        seen.append((fn.__name__, tuple(grid)))
        return real(fn, grid, args, kwargs)

    monkeypatch.setattr(launch, "launch", spy)
    torch.manual_seed(9)
    q = torch.randn(1, 1, 2, 16, device=DEVICE).to(F16)
    kc, vc = _cache(1, 600, 1, 16)
    for keys, n in ((1024, 1), (0, 2)):  # (no plan.clear between them: the second is a new key)
        monkeypatch.setattr(configs, "DECODE_ONE_SPLIT_KEYS", keys)
        seen.clear()
        flash_attn_with_kvcache(q, kc, vc, cache_seqlens=500)
        assert len(seen) == n, (keys, seen)
    kc, vc = _cache(1, 129 * 128, 1, 16)
    seen.clear()
    out, lse = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=129 * 128 - 5, num_splits=129,
                                       return_softmax_lse=True)
    assert seen[0][0] == "_decode_split_kernel" and seen[0][1][0] <= 128, seen
    n = 129 * 128 - 5
    check_against_reference(q, kc[:, :n], vc[:, :n], out, lse, None, None, False)


@pytest.mark.parametrize("Sq,group,D,splits,dtype", [
    (1, 4, 64, 2, F16), (1, 4, 40, 7, F16), (4, 4, 128, 16, F16), (16, 4, 32, 3, torch.float32), (1, 1, 64, 33, F16),
], ids=lambda x: str(x).replace("torch.", ""))
def test_split_partials_kept_between_calls(Sq, group, D, splits, dtype, poison, monkeypatch):
    """The split-KV decoding's partials live in blocks kept per stream (kernels/kept.py): filled with
    NaN before the first call (a combine that read a partial no split wrote would fail), against the
    fp64 reference over caches of different lengths (splits with no keys among them, a batch row
    with none); a second call over the same, now written, blocks is bitwise the first."""
    from tritonattn.kernels import decode, kept, plan

    torch.manual_seed(splits * 10 + Sq)
    B, Hkv = 3, 2
    q = torch.randn(B, Sq, Hkv * group, D, device=DEVICE).to(dtype)
    kc, vc = _cache(B, 700, Hkv, D, dtype)
    seqlens = torch.tensor([700, 33, 0], dtype=torch.int32, device=DEVICE)
    stream = torch.cuda.current_stream().cuda_stream if q.is_cuda else None
    for name in ("_o_parts", "_lse_parts"):
        monkeypatch.setattr(decode, name, kept.Kept())
        getattr(decode, name).block(1 << 20, q.device, stream).fill_(255)  # (0xffffffff: a NaN)
    plan.clear()
    out, lse = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, causal=True, num_splits=splits,
                                       return_softmax_lse=True)
    for b in range(2):
        n = int(seqlens[b])
        check_against_reference(q[b:b + 1], kc[b:b + 1, :n], vc[b:b + 1, :n], out[b:b + 1], lse[b:b + 1], None,
                                None, True)
    assert torch.equal(out[2], torch.zeros_like(out[2])) and bool((lse[2] == float("-inf")).all())
    again = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, causal=True, num_splits=splits,
                                    return_softmax_lse=True)
    assert torch.equal(again[0], out) and torch.equal(again[1], lse)


def test_pick_num_splits(monkeypatch):
    """The split heuristic on an H200's 132 SMs: about one wave of (split, batch, kv head) programs,
    at least 2 splits of at least 256 keys; one split once batch x kv heads is two waves or more."""
    from tritonattn.kernels import decode

    monkeypatch.setattr(decode, "sm_count", lambda device: 132)
    cuda = torch.device("cuda", 0)
    assert decode.pick_num_splits(1, 8, 16384, cuda) == 16
    assert decode.pick_num_splits(1, 8, 1025, cuda) == 5  # splits of at least 256 keys
    assert decode.pick_num_splits(1, 8, 1024, cuda) == 1  # a short cache: one launch (DECODE_ONE_SPLIT_KEYS)
    assert decode.pick_num_splits(1, 8, 4096, cuda) == 16
    assert decode.pick_num_splits(8, 8, 16384, cuda) == 2
    assert decode.pick_num_splits(32, 8, 16384, cuda) == 2  # 256 programs: under two waves
    assert decode.pick_num_splits(33, 8, 16384, cuda) == 1
    assert decode.pick_num_splits(64, 8, 4096, cuda) == 1
    assert decode.pick_num_splits(1, 1, 100, cuda) == 1  # one split holds every key
    # paged: about two waves (block-table latency), the same caps
    assert decode.pick_num_splits(8, 8, 16384, cuda, paged=True) == 4
    assert decode.pick_num_splits(1, 8, 16384, cuda, paged=True) == 33
    assert decode.pick_num_splits(1, 8, 4096, cuda, paged=True) == 16  # splits of at least 256 keys
    assert decode.pick_num_splits(32, 8, 16384, cuda, paged=True) == 2
    assert decode.pick_num_splits(33, 8, 16384, cuda, paged=True) == 1


def test_kvcache_is_inference_only_with_inputs_that_require_grad(poison, monkeypatch):
    """Inputs that require grad: the step runs (no no_grad context needed) and its output has no
    autograd history, as flash-attn's (forward only), on both kernels' paths."""
    from tritonattn import inference

    q = torch.randn(2, 1, 4, 16, device=DEVICE).to(F16).requires_grad_()
    kc, vc = _cache(2, 32, 2, 16)
    kn = torch.randn(2, 1, 2, 16, device=DEVICE).to(F16).requires_grad_()
    for rows in (64, 0):  # the decoding kernel, then the append + forward kernels
        monkeypatch.setattr(inference, "DECODE_MAX_ROWS", rows)
        out = flash_attn_with_kvcache(q, kc, vc, kn, kn.detach().clone(), cache_seqlens=5, causal=True)
        assert not out.requires_grad and out.grad_fn is None and not kc.requires_grad


# Dense calls shaped like a decoding step (configs.dense_decode): flash_attn_func and the other dense
# entry points take the split-KV decoding kernel over all of k / v. ``splits``: more than one split
# and the combine (else these short caches take one split, configs.DECODE_ONE_SPLIT_KEYS).
DENSE_DECODE_CASES = [
    # B, Sq, Sk, Hq, Hkv, D, causal, dtype, options
    (2, 1, 300, 8, 2, 64, False, F16, {}),
    (1, 3, 700, 4, 4, 40, True, torch.float32, dict(splits=True)),
    (3, 2, 257, 6, 1, 128, True, torch.bfloat16, dict(window_size=(100, 0), softcap=5.0)),
    (2, 1, 300, 8, 2, 80, False, F16, dict(alibi=True, transposed=True)),
    (1, 16, 520, 8, 2, 64, True, F16, dict(window_size=(60, 3), splits=True)),  # 64 query rows per kv head: the limit
]


def _dense_decode_id(case):
    B, Sq, Sk, Hq, Hkv, D, causal, dtype, opts = case
    return case_id(B, Sq, Sk, Hq, Hkv, D, causal, dtype, "-".join(sorted(opts)))


def _decode_spy(monkeypatch):
    """The calls that reach kernels/decode.py's decode_forward."""
    from tritonattn.kernels import decode

    calls, real = [], decode.decode_forward

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(decode, "decode_forward", spy)
    return calls


def _decode_inputs(B, Sq, Sk, Hq, Hkv, D, dtype, opts, grad=False):
    q = torch.randn(B, Sq, Hq, D, device=DEVICE).to(dtype)
    if opts.get("transposed"):  # a (B, Hkv, S, D) cache seen as (B, S, Hkv, D), as transformers keeps it
        k, v = (torch.randn(B, Hkv, Sk, D, device=DEVICE).to(dtype).transpose(1, 2) for _ in range(2))
    else:
        k, v = (torch.randn(B, Sk, Hkv, D, device=DEVICE).to(dtype) for _ in range(2))
    if grad:
        q, k, v = (t.requires_grad_() for t in (q, k, v))
    kw = {name: opts[name] for name in ("window_size", "softcap") if name in opts}
    if opts.get("alibi"):
        kw["alibi_slopes"] = torch.rand(Hq, device=DEVICE) * 0.3
    return q, k, v, kw


@pytest.mark.parametrize("case", DENSE_DECODE_CASES, ids=_dense_decode_id)
def test_dense_decode_shapes_take_the_decoding_kernel(case, poison, monkeypatch):
    """flash_attn_func with a few queries per kv head over many keys goes to the decoding kernel:
    out, lse and (through the usual backward, from its lse) the gradients against the fp64
    reference; a second call replays the plan (linked for the inference calls) bitwise; with the
    route off (the forward kernel) the same within the tolerance rule."""
    from tritonattn import flash_attn_func
    from tritonattn.kernels import plan

    B, Sq, Sk, Hq, Hkv, D, causal, dtype, opts = case
    torch.manual_seed(Sk + Sq)
    if opts.get("splits"):
        monkeypatch.setattr(configs, "DECODE_ONE_SPLIT_KEYS", 0)
    calls = _decode_spy(monkeypatch)
    q, k, v, kw = _decode_inputs(B, Sq, Sk, Hq, Hkv, D, dtype, opts, grad=True)
    out, lse, _ = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True, **kw)
    assert calls == [q.shape], "a decode-shaped dense call did not take the decoding kernel"
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref_kw = dict(kw)
    check_against_reference(q, k, v, out, lse, grads, dout, causal, **ref_kw)
    # inference calls: the second replays the first's plan through the entry point's link
    with torch.no_grad():
        first = flash_attn_func(q, k, v, causal=causal, **kw)
        hits = plan.hits
        second = flash_attn_func(q, k, v, causal=causal, **kw)
    assert plan.hits == hits + 1 and torch.equal(first, second)
    assert torch.equal(first, out.detach()), "the inference call's result differs from the training call's"
    monkeypatch.setattr(configs, "DENSE_DECODE", False)
    n = len(calls)
    with torch.no_grad():
        off, off_lse, _ = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True, **kw)
    assert len(calls) == n
    check_against_reference(q, k, v, off, off_lse, None, None, causal, **ref_kw)


def test_dense_decode_route_limits(poison, monkeypatch):
    """What stays on the forward kernel: more than DENSE_DECODE_ROWS query rows per kv head, fewer
    than DENSE_DECODE_MIN_KEYS keys, a bias, a mask, dropout, batch invariance, packed (varlen)
    calls; the SDPA drop-in and `attention` take the route where flash_attn_func does."""
    from tritonattn import attention, flash_attn_func, flash_attn_varlen_func, scaled_dot_product_attention

    torch.manual_seed(5)
    calls = _decode_spy(monkeypatch)
    Hq, Hkv, D = 8, 2, 32
    q, k, v, _ = _decode_inputs(2, 16, 300, Hq, Hkv, D, F16, {})
    with torch.no_grad():
        flash_attn_func(q, k, v)  # 16 x 4 = 64 rows per kv head
        assert len(calls) == 1
        flash_attn_func(q[:, :1], k[:, :256], v[:, :256])  # the fewest keys
        assert len(calls) == 2
        out = scaled_dot_product_attention(q[:, :1].transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           enable_gqa=True)
        assert len(calls) == 3
        check_against_reference(q[:, :1], k, v, out.transpose(1, 2), None, None, None, False)
        attention(q[:, :2], k, v, causal=True)
        assert len(calls) == 4
        stay = [
            lambda: flash_attn_func(torch.cat([q, q[:, :1]], 1), k, v),  # 17 x 4 = 68 rows
            lambda: flash_attn_func(q[:, :1], k[:, :255], v[:, :255]),
            lambda: attention(q[:, :1], k, v, bias=torch.randn(300, device=DEVICE).to(F16)),
            lambda: attention(q[:, :1], k, v, key_padding_mask=torch.ones(2, 300, dtype=torch.bool, device=DEVICE)),
            lambda: flash_attn_func(q[:, :1], k, v, dropout_p=0.1),
            lambda: flash_attn_varlen_func(q[:, :1].reshape(2, Hq, D), k.reshape(600, Hkv, D), v.reshape(600, Hkv, D),
                                           torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE),
                                           torch.tensor([0, 300, 600], dtype=torch.int32, device=DEVICE), 1, 300),
        ]
        for i, call in enumerate(stay):
            call()
            assert len(calls) == 4, f"call {i} took the decoding kernel"
        monkeypatch.setattr(configs, "BATCH_INVARIANT", True)
        flash_attn_func(q[:, :1], k, v)
        assert len(calls) == 4
