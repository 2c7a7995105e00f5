"""Autograd glue between the public API and the kernel launchers. Thin on purpose."""

from __future__ import annotations

import torch

from tritonattn.kernels.bwd import attention_backward
from tritonattn.kernels.fwd import attention_forward


class FlashAttnFunction(torch.autograd.Function):
    """Exact attention, O(S) memory. ``packing`` says how the inputs arrive:

    - ``"none"``: ``(q, k, v)``;
    - ``"kv"``: ``(q, kv)`` with kv ``(B, Sk, 2, Hkv, D)``;
    - ``"qkv"``: ``(qkv,)`` with qkv ``(B, S, 3, H, D)``.

    Packed inputs are read as strided views and their gradient is written into one packed
    tensor, so no concatenation copy is made in either direction.
    """

    @staticmethod
    def forward(ctx, packing: str, softmax_scale: float, causal: bool, *tensors: torch.Tensor):
        q, k, v = _unpack(packing, tensors)
        out, lse = attention_forward(q, k, v, softmax_scale, causal)
        ctx.save_for_backward(*tensors, out, lse)
        ctx.packing, ctx.softmax_scale, ctx.causal = packing, softmax_scale, causal
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout: torch.Tensor, _dlse: torch.Tensor):
        if torch.is_grad_enabled():
            # create_graph=True: the gradients would need a graph of their own
            raise RuntimeError(
                "tritonattn: double backward is not supported (the attention backward is not "
                "differentiable); call backward/autograd.grad without create_graph=True"
            )
        *tensors, out, lse = ctx.saved_tensors
        q, k, v = _unpack(ctx.packing, tensors)
        if ctx.packing == "qkv":
            dqkv = torch.empty_like(tensors[0])
            attention_backward(dout, q, k, v, out, lse, ctx.softmax_scale, ctx.causal,
                               dq=dqkv[:, :, 0], dk=dqkv[:, :, 1], dv=dqkv[:, :, 2])
            grads = (dqkv,)
        elif ctx.packing == "kv":
            dkv = torch.empty_like(tensors[1])
            dq, _, _ = attention_backward(dout, q, k, v, out, lse, ctx.softmax_scale, ctx.causal,
                                          dk=dkv[:, :, 0], dv=dkv[:, :, 1])
            grads = (dq, dkv)
        else:
            grads = attention_backward(dout, q, k, v, out, lse, ctx.softmax_scale, ctx.causal)
        return (None, None, None, *grads)


def _unpack(packing: str, tensors):
    if packing == "qkv":
        (qkv,) = tensors
        return qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    if packing == "kv":
        q, kv = tensors
        return q, kv[:, :, 0], kv[:, :, 1]
    return tensors
