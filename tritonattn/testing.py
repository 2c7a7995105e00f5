"""Reference attention, input generators and the tolerance rule, shipped for users and benchmarks.

The tolerance rule (flash-attn's): against an fp64 reference, tritonattn's error may be at most
``k`` times the error of PyTorch's own attention computed in the same dtype, plus a small floor
(the rounding error of the dtype at the reference's magnitude, plus ``REL_FLOOR`` of it).
k = 2 for out / lse, 3 for grads.
"""

from __future__ import annotations

import math

import torch


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    softmax_scale: float | None = None,
    upcast: bool = True,
    window_size=(-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    key_padding_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    dropout_mask: torch.Tensor | None = None,
):
    """Plain attention with tritonattn's semantics, materialising the S x S scores.

    q ``(B, Sq, Hq, D)``, k/v ``(B, Sk, Hkv, D)``. Scores ``softcap(q.k * scale) + alibi + bias``;
    causal / window aligned bottom-right; ``mask`` (bool, True = take part) broadcast to
    ``(B, Hq, Sq, Sk)``; ``key_padding_mask`` ``(B, Sk)``; dropout applied with the given
    ``dropout_mask`` (True = kept) and scaled by ``1 / (1 - dropout_p)``. Rows that keep no key
    give 0 with lse ``-inf``. ``upcast=True`` computes in float64 (the reference);
    ``upcast=False`` in the input dtype (PyTorch's own error in that dtype).
    Returns ``(out, lse)``: out in q's dtype (float64 when upcast), lse ``(B, Hq, Sq)``.
    """
    if upcast:
        q, k, v = q.double(), k.double(), v.double()
        bias = bias.double() if bias is not None else None
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(D) if softmax_scale is None else softmax_scale
    if Hq != Hkv:
        k = k.repeat_interleave(Hq // Hkv, dim=2)
        v = v.repeat_interleave(Hq // Hkv, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q * scale, k)
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    rows = torch.arange(Sq, device=q.device)[:, None]
    cols = torch.arange(Sk, device=q.device)[None, :]
    diag = rows + (Sk - Sq)
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(scores.dtype).reshape(-1, Hq, 1, 1)  # (Hq,) or (B, Hq)
        scores = scores - slopes * (diag - cols).abs().to(scores.dtype)
    if bias is not None:
        scores = scores + bias.to(scores.dtype)
    left, right = window_size
    if causal:
        right = 0
    visible = torch.ones(1, 1, Sq, Sk, dtype=torch.bool, device=q.device)
    if right >= 0:
        visible = visible & (cols <= diag + right)
    if left >= 0:
        visible = visible & (cols >= diag - left)
    if mask is not None:
        visible = visible & mask
    if key_padding_mask is not None:
        visible = visible & key_padding_mask[:, None, None, :]
    visible = visible.expand(B, Hq, Sq, Sk)
    empty = ~visible.any(-1, keepdim=True)
    scores = scores.masked_fill(~visible, float("-inf")).masked_fill(empty, 0.0)
    lse = torch.logsumexp(scores if upcast else scores.float(), dim=-1).masked_fill(empty[..., 0], float("-inf"))
    p = torch.softmax(scores, dim=-1).masked_fill(empty, 0.0)
    if dropout_p > 0:
        p = p.masked_fill(~dropout_mask, 0.0) / (1 - dropout_p)
    out = torch.einsum("bhqk,bkhd->bqhd", p, v)
    return out, lse


def random_qkv(
    B: int, Sq: int, Sk: int, Hq: int, Hkv: int, D: int,
    dtype: torch.dtype = torch.float16,
    device: str = "cuda",
    layout: str = "contiguous",
    requires_grad: bool = True,
    generator: torch.Generator | None = None,
):
    """Random normal q, k, v in flash-attn layout.

    layout: ``contiguous``; ``strided`` (views into a wider buffer: a slice of the head dim of a
    packed tensor); ``transposed`` (``(B, H, S, D)`` storage viewed as ``(B, S, H, D)``).
    """
    def make(S, H):
        def randn(*shape):  # drawn in fp32 on the CPU (same numbers on every device), then cast
            return torch.randn(*shape, dtype=torch.float32, generator=generator).to(device=device, dtype=dtype)

        if layout == "contiguous":
            t = randn(B, S, H, D)
        elif layout == "strided":
            t = randn(B, S, H, D + 8)[..., 3:3 + D]
        elif layout == "transposed":
            t = randn(B, H, S, D).transpose(1, 2)
        else:
            raise ValueError(f"layout must be contiguous, strided or transposed, got {layout!r}")
        return t.requires_grad_(requires_grad)

    return make(Sq, Hq), make(Sk, Hkv), make(Sk, Hkv)


# fp32-accumulation part of the floor, relative to the size of the problem's values (for grads:
# the largest reference gradient of q, k, v). It covers quantities that are 0 by cancellation:
# with a single visible key dq and dk are exactly 0 and PyTorch's softmax backward gets exactly 0
# (p * (g - p * g)), while FlashAttention's dS = P (dP - rowsum(dO * O)) subtracts two fp32 dot
# products and leaves ~1e-5 at D=256 or Sq=129 for gradients of size ~30, and 2.3e-5 on an fp32 dBias
# of a row with 5 visible keys, gradients of size ~13 (test_combined_variants' fp32 case, whose
# rows' errors move with the last bits of tanh: benchmarks/NOTES.md, twentieth session). 2e-6
# relative is ~16 fp32 ulps and 500x below fp16's resolution, so no real error hides under it.
REL_FLOOR = 2e-6


def rounding_floor(ref: torch.Tensor, dtype: torch.dtype) -> float:
    """Rounding error of ``dtype`` at the magnitude of ``ref`` (flash-attn's atol term)."""
    r = ref.detach().to(dtype)
    finite = r[torch.isfinite(r)]
    if finite.numel() == 0:
        return 0.0
    return 2.0 * (finite + 0.3 - 0.3 - finite).abs().max().item()


def check_close(name: str, actual: torch.Tensor, ref: torch.Tensor, same_dtype: torch.Tensor, k: float,
                magnitude: float | None = None) -> None:
    """Assert the tolerance rule: ``err(actual) <= k * err(same_dtype) + floor``, errors against
    the fp64 ``ref``; the floor is the rounding error of ``actual``'s dtype at the reference's
    magnitude, plus ``REL_FLOOR * magnitude`` (default: the largest finite ``|ref|``).
    Infinities (lse of rows with no key) must sit at the same places. NaN fails."""
    dtype = actual.dtype
    actual = actual.detach().double().cpu()
    ref = ref.detach().double().cpu()
    same_dtype = same_dtype.detach().double().cpu()
    assert actual.shape == ref.shape, f"{name}: shape {tuple(actual.shape)} != reference {tuple(ref.shape)}"
    assert not torch.isnan(actual).any(), f"{name}: NaN in result"
    inf_ref = torch.isinf(ref)
    assert torch.equal(torch.isinf(actual), inf_ref), f"{name}: infinities differ from the reference"
    assert torch.equal(actual[inf_ref], ref[inf_ref]), f"{name}: infinities of the wrong sign"
    fin = ~inf_ref
    if fin.sum() == 0:
        return
    err = (actual[fin] - ref[fin]).abs().max().item()
    base = (same_dtype[fin] - ref[fin]).abs().max().item()
    if magnitude is None:
        magnitude = ref[fin].abs().max().item()
    floor = rounding_floor(ref[fin], dtype) + REL_FLOOR * magnitude
    bound = k * base + floor
    assert err <= bound, f"{name}: max error {err:.3e} > {k} x torch's {base:.3e} + floor {floor:.3e}"


def dropout_keep_reference(seed: int, B: int, H: int, Sq: int, Sk: int, dropout_p: float) -> torch.Tensor:
    """The dropout keep-mask ``(B, H, Sq, Sk)`` that the kernels draw, recomputed with numpy from the
    documented scheme (tritonattn/kernels/common.py, ``dropout_keep``): Philox-4x32-10 keyed by
    ``seed + (b * H + h) * 1000003``, counters (key // 8, query, 0, 0); key 8g + s takes the 16-bit
    half s % 2 (low first) of word s // 2; kept when >= round(p * 65536)."""
    import numpy as np

    M = np.uint64(0xFFFFFFFF)
    thr = int(np.float32(dropout_p) * np.float32(65536.0) + np.float32(0.5))
    i = np.arange(Sq, dtype=np.uint64)[:, None]
    g = np.arange((Sk + 7) // 8, dtype=np.uint64)[None, :]
    out = np.zeros((B, H, Sq, Sk), dtype=bool)
    for bh in range(B * H):
        key = (seed + bh * 1000003) & 0xFFFFFFFFFFFFFFFF
        k0, k1 = np.uint64(key & 0xFFFFFFFF), np.uint64(key >> 32)
        c0, c1 = g + np.zeros_like(i), i + np.zeros_like(g)
        c2, c3 = np.zeros_like(c0), np.zeros_like(c0)
        for _ in range(10):
            p0, p1 = np.uint64(0xCD9E8D57) * c2, np.uint64(0xD2511F53) * c0
            c0, c1, c2, c3 = (p0 >> np.uint64(32)) ^ c1 ^ k0, p0 & M, (p1 >> np.uint64(32)) ^ c3 ^ k1, p1 & M
            k0, k1 = (k0 + np.uint64(0x9E3779B9)) & M, (k1 + np.uint64(0xBB67AE85)) & M
        halves = [w >> np.uint64(sh) & np.uint64(0xFFFF) for w in (c0, c1, c2, c3) for sh in (0, 16)]
        bits = np.stack(halves, axis=-1).reshape(Sq, -1)[:, :Sk]  # key 8g + s -> halves[s]
        out[bh // H, bh % H] = bits >= thr
    return torch.from_numpy(out)
