"""Autograd glue between the public API and the kernel launchers. Thin on purpose."""

from __future__ import annotations

import torch

from tritonattn.kernels.bwd import attention_backward, attention_probs
from tritonattn.kernels.fwd import attention_forward, plan_flags, replay_linked
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
        # a training call with an entry point's key (flash_attn_func's and the SDPA drop-in's calls that
        # need a gradient, unpacked, without bias or probabilities: the only ones that carry one here):
        # the plan its launcher linked to it, once linked
        res = None
        if var.fast_key is not None and packing == "none" and bias is None and not return_probs:
            res = replay_linked(var.fast_key, t0, t1, t2)
        if res is None:
            out, lse, probs = forward(packing, var, return_probs, tensors, bias)
        else:
            (out, lse), probs = res, None
        ctx.save_for_backward(*[t for t in tensors if t is not None], out, lse)
        ctx.packing, ctx.var = packing, var
        ctx.bias_shape = bias.shape if bias is not None and bias.requires_grad else None
        ctx.bias_dtype = bias.dtype if bias is not None else None
        ctx.mark_non_differentiable(lse)
        if probs is not None:
            ctx.mark_non_differentiable(probs)
        # no zero gradient made for lse (non-differentiable, but autograd would still pass a zeros
        # tensor of its shape: an allocation and a fill kernel per backward, thirtieth session), nor for
        # out when the loss does not use it (backward then returns no gradients)
        ctx.set_materialize_grads(False)
        return out, lse, probs

    @staticmethod
    def backward(ctx, dout: torch.Tensor | None, _dlse, _dprobs):
        if dout is None:  # out took no part in what is differentiated: every gradient is zero
            return (None,) * 7
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


def forward(packing: str, var: Variants, return_probs: bool, tensors: tuple, bias):
    """``(out, lse, probs)``: the forward of :class:`FlashAttnFunction`, also called directly when no
    input needs a gradient (no autograd machinery: host time per call)."""
    q, k, v = _unpack(packing, tensors)
    if bias is not None:
        var.bias = bias.expand(var.score_shape(q, k))  # varlen: (B, Hq, max_seqlen_q, max_seqlen_k)
    out, lse = attention_forward(q, k, v, var)
    probs = attention_probs(q, k, v, lse, var) if return_probs else None
    return out, lse, probs


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
# (it also writes packed gradients without a copy). Dense and variable-length calls share the ops:
# cu_seqlens_q / cu_seqlens_k (None: dense) and the longest lengths come last, with defaults, then
# (forward only) a varlen block_table: k / v are then paged caches (num_blocks, page_size, Hkv, D).
# Packed calls (qkv / kv) reach them as select views of the packed tensor, unpacked while tracing.

def _variants(softmax_scale, win_left, win_right, softcap, dropout_p, mask_kind, alibi, mask, seed,
              cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0, deterministic=False):
    var = Variants(softmax_scale=softmax_scale, win_left=win_left, win_right=win_right, softcap=softcap,
                   alibi_slopes=alibi, dropout_p=dropout_p, seed=seed, deterministic=deterministic)
    if mask is not None:
        var.mask, var.mask_kind = mask, mask_kind
    if cu_seqlens_q is not None:
        var.cu_seqlens_q, var.cu_seqlens_k = cu_seqlens_q, cu_seqlens_k
        var.max_seqlen_q, var.max_seqlen_k = max_seqlen_q, max_seqlen_k
    return var


def _op_key(tag: str, q, k, v, options: tuple, tensor_options: tuple) -> tuple | None:
    """Key of an op's dense call without tensor options (the ops' arguments are typed by their
    schema): the tensors' shapes, strides, dtypes and devices, whether they are 16-byte aligned, the
    options and the forward launcher's switches, all that its launchers' keys are functions of (as
    interface._fast_key's for the eager entry points). None when a tensor option (``tensor_options``:
    bias, mask, ALiBi, seed, cu_seqlens, block table) is given, or for tensors without storage."""
    for t in tensor_options:
        if t is not None:
            return None
    try:
        kv_ptrs = k.data_ptr() | v.data_ptr()
        q_ptr = q.data_ptr()
    except RuntimeError:
        return None
    return (tag, q.shape, q.stride(), q.dtype, q.device, k.shape, k.stride(), k.dtype, k.device, v.shape, v.stride(),
            v.dtype, v.device, options, (q_ptr | kv_ptrs) & 15 == 0, kv_ptrs & 15 == 0, plan_flags())


@torch.library.custom_op("tritonattn::fwd", mutates_args=())
def attention_fwd_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, mask: torch.Tensor | None,
    alibi: torch.Tensor | None, seed: torch.Tensor | None, softmax_scale: float, win_left: int | None,
    win_right: int | None, softcap: float, dropout_p: float, mask_kind: int,
    cu_seqlens_q: torch.Tensor | None = None, cu_seqlens_k: torch.Tensor | None = None, max_seqlen_q: int = 0,
    max_seqlen_k: int = 0, deterministic: bool = False, block_table: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    # a dense call without tensor options: the plan linked to its key
    key = _op_key("op-fwd", q, k, v, (softmax_scale, win_left, win_right, softcap, dropout_p, mask_kind, deterministic),
                  (bias, mask, alibi, seed, cu_seqlens_q, block_table))
    res = None if key is None else replay_linked(key, q, k, v)
    if res is not None:
        return res
    var = _variants(softmax_scale, win_left, win_right, softcap, dropout_p, mask_kind, alibi, mask, seed,
                    cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, deterministic)
    var.fast_key = key  # (the launcher links it to its plan)
    if block_table is not None:  # the kernel addresses pages itself: it gets the first page of each cache
        var.use_pages(block_table, k, v)
        k, v = k[0], v[0]
    if bias is not None:
        var.bias = bias.expand(var.score_shape(q, k))
    return attention_forward(q, k, v, var)


@attention_fwd_op.register_fake
def _(q, k, v, bias, mask, alibi, seed, softmax_scale, win_left, win_right, softcap, dropout_p, mask_kind,
      cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0, deterministic=False, block_table=None):
    # dense: out (B, Sq, Hq, D), lse (B, Hq, Sq); variable length: out (total_q, Hq, D), lse (Hq, total_q)
    lse_shape = (q.shape[1], q.shape[0]) if cu_seqlens_q is not None else (q.shape[0], q.shape[2], q.shape[1])
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            q.new_empty(lse_shape, dtype=torch.float32))


@torch.library.custom_op("tritonattn::bwd", mutates_args=())
def attention_bwd_op(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    bias: torch.Tensor | None, mask: torch.Tensor | None, alibi: torch.Tensor | None, seed: torch.Tensor | None,
    softmax_scale: float, win_left: int | None, win_right: int | None, softcap: float, dropout_p: float,
    mask_kind: int, bias_grad: bool, cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None, max_seqlen_q: int = 0, max_seqlen_k: int = 0,
    deterministic: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    var = _variants(softmax_scale, win_left, win_right, softcap, dropout_p, mask_kind, alibi, mask, seed,
                    cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, deterministic)
    # a dense call without tensor options: the backward launcher's link (its key with dO's layout)
    # holds this key, which holds out's and lse's layouts too (the graph passes them)
    key = _op_key("op-bwd", q, k, v, (softmax_scale, win_left, win_right, softcap, dropout_p, mask_kind, deterministic),
                  (bias, mask, alibi, seed, cu_seqlens_q))
    var.fast_key = None if key is None else (key, out.shape, out.stride(), lse.shape, lse.stride())
    if bias is not None:
        var.bias = bias.expand(var.score_shape(q, k))
    dq, dk, dv, dbias = attention_backward(dout, q, k, v, out, lse, var,
                                           bias_shape=bias.shape if bias_grad else None)
    # a custom op returns tensors only: no bias gradient is an empty one
    return dq, dk, dv, dbias.to(bias.dtype) if dbias is not None else q.new_empty(0)


@attention_bwd_op.register_fake
def _(dout, q, k, v, out, lse, bias, mask, alibi, seed, softmax_scale, win_left, win_right, softcap, dropout_p,
      mask_kind, bias_grad, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0,
      deterministic=False):
    dbias = torch.empty_like(bias, memory_format=torch.contiguous_format) if bias_grad else q.new_empty(0)
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(k, memory_format=torch.contiguous_format),
            torch.empty_like(v, memory_format=torch.contiguous_format), dbias)


_N_OPTIONS = 6  # softmax_scale, win_left, win_right, softcap, dropout_p, mask_kind


def _fwd_setup_context(ctx, inputs, output):
    # inputs: q, k, v, bias, mask, alibi, seed, the options, cu_q, cu_k, max_q, max_k, deterministic,
    # block_table (paged: forward only, the public functions refuse inputs that require grad)
    q, k, v, bias, mask, alibi, seed = inputs[:7]
    options, (cu_q, cu_k, max_q, max_k, deterministic, _) = inputs[7:7 + _N_OPTIONS], inputs[7 + _N_OPTIONS:]
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, bias, mask, alibi, seed, cu_q, cu_k)
    ctx.options, ctx.varlen_options = options, (max_q, max_k, deterministic)
    ctx.bias_grad = bias is not None and bias.requires_grad
    ctx.mark_non_differentiable(lse)


def _fwd_backward(ctx, dout, _dlse):
    q, k, v, out, lse, bias, mask, alibi, seed, cu_q, cu_k = ctx.saved_tensors
    max_q, max_k, deterministic = ctx.varlen_options
    dq, dk, dv, dbias = attention_bwd_op(dout, q, k, v, out, lse, bias, mask, alibi, seed, *ctx.options,
                                         ctx.bias_grad, cu_q, cu_k, max_q, max_k, deterministic)
    n_rest = 3 + _N_OPTIONS + 6  # mask / alibi / seed, the options, the varlen inputs and block_table
    return dq, dk, dv, (dbias if ctx.bias_grad else None), *([None] * n_rest)


attention_fwd_op.register_autograd(_fwd_backward, setup_context=_fwd_setup_context)


def apply_compiled(var: Variants, q, k, v, bias):
    """The unpacked call (dense, variable length, or variable length over paged caches k / v with
    ``var.block_table``) through the torch.library ops, used while torch.compile traces. Returns
    ``(out, lse)``."""
    return attention_fwd_op(q, k, v, bias, var.mask, var.alibi_slopes, var.seed, var.softmax_scale, var.win_left,
                            var.win_right, var.softcap, var.dropout_p, var.mask_kind, var.cu_seqlens_q,
                            var.cu_seqlens_k, var.max_seqlen_q, var.max_seqlen_k, var.deterministic,
                            var.block_table)


def apply_compiled_packed(packing: str, var: Variants, tensors, bias=None):
    """As :func:`apply_compiled` for packed inputs (``packing`` and ``tensors`` as
    :class:`FlashAttnFunction`): q / k / v are select views of the packed tensors (the gradients
    flow back through the views into one packed gradient)."""
    q, k, v = _unpack(packing, tensors)
    return apply_compiled(var, q, k, v, bias)
