"""Autograd glue between the public API and the kernel launchers. Thin on purpose."""

from __future__ import annotations

import torch

from tritonattn.kernels.bwd import attention_backward, attention_probs
from tritonattn.kernels.fwd import attention_forward
from tritonattn.kernels.variants import Variants


class FlashAttnFunction(torch.autograd.Function):
    """Exact attention, O(S) memory. ``packing`` says how the inputs arrive:

    - ``"none"``: ``(q, k, v)``;
    - ``"kv"``: ``(q, kv, None)`` with kv ``(B, Sk, 2, Hkv, D)`` (varlen: ``(total_k, 2, Hkv, D)``);
    - ``"qkv"``: ``(qkv, None, None)`` with qkv ``(B, S, 3, H, D)`` (varlen: ``(total, 3, H, D)``).

    Packed inputs are read as strided views and their gradient is written into one packed
    tensor, so no concatenation copy is made in either direction. ``bias`` is the user's additive
    bias (any shape broadcastable to (B, Hq, Sq, Sk)); its gradient comes back in that shape.
    ``var`` carries the other options (its ``bias`` is filled here with the broadcast view).
    Returns ``(out, lse, probs)``; probs (flash-attn's S_dmask) only when ``return_probs``.
    """

    @staticmethod
    def forward(ctx, packing: str, var: Variants, return_probs: bool, t0, t1, t2, bias):
        tensors = (t0, t1, t2)
        q, k, v = _unpack(packing, tensors)
        if bias is not None:
            var.bias = bias.expand(q.shape[0], q.shape[2], q.shape[1], k.shape[1])
        out, lse = attention_forward(q, k, v, var)
        probs = attention_probs(q, k, v, lse, var) if return_probs else None
        ctx.save_for_backward(*[t for t in tensors if t is not None], out, lse)
        ctx.packing, ctx.var = packing, var
        ctx.bias_shape = bias.shape if bias is not None and bias.requires_grad else None
        ctx.bias_dtype = bias.dtype if bias is not None else None
        ctx.mark_non_differentiable(lse)
        if probs is not None:
            ctx.mark_non_differentiable(probs)
        return out, lse, probs

    @staticmethod
    def backward(ctx, dout: torch.Tensor, _dlse, _dprobs):
        if torch.is_grad_enabled():
            # create_graph=True: the gradients would need a graph of their own
            raise RuntimeError(
                "tritonattn: double backward is not supported (the attention backward is not "
                "differentiable); call backward/autograd.grad without create_graph=True"
            )
        *tensors, out, lse = ctx.saved_tensors
        q, k, v = _unpack(ctx.packing, tensors)
        var, bias_shape = ctx.var, ctx.bias_shape
        if ctx.packing == "qkv":
            dqkv = torch.empty_like(tensors[0])
            *_, dbias = attention_backward(dout, q, k, v, out, lse, var, dq=dqkv.select(-3, 0),
                                           dk=dqkv.select(-3, 1), dv=dqkv.select(-3, 2), bias_shape=bias_shape)
            grads = (dqkv, None, None)
        elif ctx.packing == "kv":
            dkv = torch.empty_like(tensors[1])
            dq, _, _, dbias = attention_backward(dout, q, k, v, out, lse, var, dk=dkv.select(-3, 0),
                                                 dv=dkv.select(-3, 1), bias_shape=bias_shape)
            grads = (dq, dkv, None)
        else:
            *grads, dbias = attention_backward(dout, q, k, v, out, lse, var, bias_shape=bias_shape)
        if dbias is not None:
            dbias = dbias.to(ctx.bias_dtype)
        return (None, None, None, *grads, dbias)


def _unpack(packing: str, tensors):
    # the packing dim is the third from the end: (B, S, 3, H, D) dense, (total, 3, H, D) varlen
    if packing == "qkv":
        qkv = tensors[0]
        return qkv.select(-3, 0), qkv.select(-3, 1), qkv.select(-3, 2)
    if packing == "kv":
        q, kv = tensors[0], tensors[1]
        return q, kv.select(-3, 0), kv.select(-3, 1)
    return tensors[:3]


# ---------------------------------------------------------------------------------------------
# torch.library ops: what torch.compile sees. Opaque to dynamo (no graph break), with fake
# implementations for tracing; the eager path above stays the default outside compilation
# (it also writes packed gradients without a copy).

def _variants(softmax_scale, win_left, win_right, softcap, dropout_p, mask_kind, alibi, mask, seed):
    var = Variants(softmax_scale=softmax_scale, win_left=win_left, win_right=win_right, softcap=softcap,
                   alibi_slopes=alibi, dropout_p=dropout_p, seed=seed)
    if mask is not None:
        var.mask, var.mask_kind = mask, mask_kind
    return var


@torch.library.custom_op("tritonattn::fwd", mutates_args=())
def attention_fwd_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, mask: torch.Tensor | None,
    alibi: torch.Tensor | None, seed: torch.Tensor | None, softmax_scale: float, win_left: int | None,
    win_right: int | None, softcap: float, dropout_p: float, mask_kind: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    var = _variants(softmax_scale, win_left, win_right, softcap, dropout_p, mask_kind, alibi, mask, seed)
    if bias is not None:
        var.bias = bias.expand(q.shape[0], q.shape[2], q.shape[1], k.shape[1])
    return attention_forward(q, k, v, var)


@attention_fwd_op.register_fake
def _(q, k, v, bias, mask, alibi, seed, softmax_scale, win_left, win_right, softcap, dropout_p, mask_kind):
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(
        (q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)


@torch.library.custom_op("tritonattn::bwd", mutates_args=())
def attention_bwd_op(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    bias: torch.Tensor | None, mask: torch.Tensor | None, alibi: torch.Tensor | None, seed: torch.Tensor | None,
    softmax_scale: float, win_left: int | None, win_right: int | None, softcap: float, dropout_p: float,
    mask_kind: int, bias_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    var = _variants(softmax_scale, win_left, win_right, softcap, dropout_p, mask_kind, alibi, mask, seed)
    if bias is not None:
        var.bias = bias.expand(q.shape[0], q.shape[2], q.shape[1], k.shape[1])
    dq, dk, dv, dbias = attention_backward(dout, q, k, v, out, lse, var,
                                           bias_shape=bias.shape if bias_grad else None)
    # a custom op returns tensors only: no bias gradient is an empty one
    return dq, dk, dv, dbias.to(bias.dtype) if dbias is not None else q.new_empty(0)


@attention_bwd_op.register_fake
def _(dout, q, k, v, out, lse, bias, mask, alibi, seed, softmax_scale, win_left, win_right, softcap, dropout_p,
      mask_kind, bias_grad):
    dbias = torch.empty_like(bias, memory_format=torch.contiguous_format) if bias_grad else q.new_empty(0)
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(k, memory_format=torch.contiguous_format),
            torch.empty_like(v, memory_format=torch.contiguous_format), dbias)


def _fwd_setup_context(ctx, inputs, output):
    q, k, v, bias, mask, alibi, seed, *options = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, bias, mask, alibi, seed)
    ctx.options = options
    ctx.bias_grad = bias is not None and bias.requires_grad
    ctx.mark_non_differentiable(lse)


def _fwd_backward(ctx, dout, _dlse):
    q, k, v, out, lse, bias, mask, alibi, seed = ctx.saved_tensors
    dq, dk, dv, dbias = attention_bwd_op(dout, q, k, v, out, lse, bias, mask, alibi, seed, *ctx.options,
                                         ctx.bias_grad)
    return dq, dk, dv, (dbias if ctx.bias_grad else None), None, None, None, None, None, None, None, None, None


attention_fwd_op.register_autograd(_fwd_backward, setup_context=_fwd_setup_context)


def apply_compiled(var: Variants, q, k, v, bias):
    """The dense, unpacked call through the torch.library ops (used while torch.compile traces)."""
    return attention_fwd_op(q, k, v, bias, var.mask, var.alibi_slopes, var.seed, var.softmax_scale, var.win_left,
                            var.win_right, var.softcap, var.dropout_p, var.mask_kind)
