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
):
    """Plain attention with tritonattn's semantics, materialising the S x S scores.

    q ``(B, Sq, Hq, D)``, k/v ``(B, Sk, Hkv, D)``; causal aligned bottom-right; rows that see no
    key give 0 with lse ``-inf``. ``upcast=True`` computes in float64 (the reference);
    ``upcast=False`` computes in the input dtype (PyTorch's own error in that dtype).
    Returns ``(out, lse)``: out in q's dtype (float64 when upcast), lse ``(B, Hq, Sq)``.
    """
    if upcast:
        q, k, v = q.double(), k.double(), v.double()
    Sq, Hq, D = q.shape[1], q.shape[2], q.shape[3]
    Sk, Hkv = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(D) if softmax_scale is None else softmax_scale
    if Hq != Hkv:
        k = k.repeat_interleave(Hq // Hkv, dim=2)
        v = v.repeat_interleave(Hq // Hkv, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q * scale, k)
    if causal:
        rows = torch.arange(Sq, device=q.device)[:, None]
        cols = torch.arange(Sk, device=q.device)[None, :]
        visible = cols <= rows + (Sk - Sq)
        empty = ~visible.any(-1, keepdim=True)
        scores = scores.masked_fill(~visible, float("-inf")).masked_fill(empty, 0.0)
    else:
        empty = torch.zeros(Sq, 1, dtype=torch.bool, device=q.device) if Sk > 0 else torch.ones(
            Sq, 1, dtype=torch.bool, device=q.device)
    if Sk == 0:
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:1] + (Hq, Sq), float("-inf"), dtype=torch.float32 if not upcast else q.dtype,
                         device=q.device)
        return out, lse
    lse = torch.logsumexp(scores.float() if not upcast else scores, dim=-1).masked_fill(empty[:, 0], float("-inf"))
    p = torch.softmax(scores, dim=-1).masked_fill(empty, 0.0)
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
# products and leaves ~1e-5 at D=256 or Sq=129 for gradients of size ~30. 1e-6 relative is ~8 fp32
# ulps and 1000x below fp16's resolution, so no real error hides under it.
REL_FLOOR = 1e-6


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
