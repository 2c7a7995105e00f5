"""Public API, flash-attn 2.x compatible: same names, argument order, defaults and semantics.

Layout is ``(batch, seqlen, nheads, headdim)``. Causal masks are aligned to the bottom-right
corner of the score matrix, as in flash-attn >= 2.1: with ``Sq != Sk``, query row ``i`` sees key
``j`` iff ``j <= i + Sk - Sq``. A query row that sees no key returns 0 (its lse is ``-inf``) and
gets zero gradients.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from tritonattn.configs import env_flag, interpreting
from tritonattn.kernels.decode import replay_free as _replay_free
from tritonattn.kernels.fwd import attention_forward, plan_flags, replay_linked
from tritonattn.kernels.variants import MASK_KEYS, MASK_TILE, Variants
from tritonattn.ops import FlashAttnFunction, apply_compiled, apply_compiled_packed
from tritonattn.ops import forward as ops_forward

MAX_HEAD_DIM = 256
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

Returned = torch.Tensor | tuple  # out, or (out, softmax_lse, S_dmask)


def _check_tensor(name: str, t, ndim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} has dtype {t.dtype}; expected torch.float16, torch.bfloat16 or torch.float32")
    if t.device.type != "cuda" and not (t.device.type == "cpu" and interpreting()):
        raise ValueError(
            f"{name} is on {t.device}; tritonattn needs CUDA tensors "
            "(or CPU tensors with TRITON_INTERPRET=1 set before triton is imported)"
        )


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, names=("q", "k", "v")) -> None:
    nq, nk, nv = names
    for name, t in ((nk, k), (nv, v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but {nq} has {q.dtype}; all inputs must share one dtype")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but {nq} is on {q.device}")
    B, _, Hq, D = q.shape
    if k.shape != v.shape:
        raise ValueError(f"{nk} and {nv} must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[0] != B:
        raise ValueError(f"{nk} has batch size {k.shape[0]} but {nq} has {B}")
    if k.shape[3] != D:
        raise ValueError(f"{nk} has head dim {k.shape[3]} but {nq} has {D}")
    if not 1 <= D <= MAX_HEAD_DIM:
        raise ValueError(f"head dim {D} is not supported; expected 1 <= head dim <= {MAX_HEAD_DIM}")
    Hkv = k.shape[2]
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(
            f"number of query heads ({Hq}) must be a multiple of the number of key/value heads ({Hkv})"
        )


def _check_options(q: torch.Tensor, k: torch.Tensor, dropout_p, softmax_scale, causal, window_size, softcap,
                   alibi_slopes, batch: int | None = None, deterministic: bool = False) -> Variants:
    """Validate the options shared by every entry point and turn them into kernel variants.
    q / k in (B, S, H, D); ``batch`` overrides B (variable length)."""
    B, Hq, D = q.shape[0] if batch is None else batch, q.shape[2], q.shape[3]
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be a float in [0, 1), got {dropout_p!r}")
    if softmax_scale is None:
        scale = 1.0 / math.sqrt(D)
    elif (isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float))
            or not math.isfinite(softmax_scale)):
        raise TypeError(f"softmax_scale must be a finite float or None, got {softmax_scale!r}")
    else:
        scale = float(softmax_scale)
    try:
        left, right = (int(w) for w in window_size)
        ok = left >= -1 and right >= -1 and all(float(w) == int(w) for w in window_size)
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"window_size must be two integers >= -1 (-1: unbounded), got {window_size!r}")
    for name, flag in (("causal", causal), ("deterministic", deterministic)):
        if flag not in (True, False):  # (1 / 0 and numpy bools pass: they equal one)
            raise TypeError(f"{name} must be a bool, got {flag!r}")
    if causal:
        right = 0  # flash-attn: causal is a window with no keys to the right of the diagonal
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not 0.0 <= softcap < math.inf:
        raise ValueError(f"softcap must be a finite float >= 0 (0: off), got {softcap!r}")
    if alibi_slopes is not None:
        if not isinstance(alibi_slopes, torch.Tensor):
            raise TypeError(f"alibi_slopes must be a torch.Tensor or None, got {type(alibi_slopes).__name__}")
        if alibi_slopes.dtype != torch.float32:
            raise TypeError(f"alibi_slopes must be float32, got {alibi_slopes.dtype}")
        if tuple(alibi_slopes.shape) not in ((Hq,), (B, Hq)):
            raise ValueError(f"alibi_slopes must have shape ({Hq},) or ({B}, {Hq}), got {tuple(alibi_slopes.shape)}")
        if alibi_slopes.device != q.device:
            raise ValueError(f"alibi_slopes is on {alibi_slopes.device} but q is on {q.device}")
        if alibi_slopes.stride(-1) != 1:
            alibi_slopes = alibi_slopes.contiguous()
    var = Variants(softmax_scale=scale, win_left=None if left == -1 else left,
                   win_right=None if right == -1 else right, softcap=float(softcap),
                   alibi_slopes=alibi_slopes, dropout_p=float(dropout_p), deterministic=bool(deterministic))
    if dropout_p > 0:
        var.seed = _dropout_seed(q.device)
    return var


def _dropout_seed(device) -> torch.Tensor:
    # drawn from the device's default generator, so torch.manual_seed makes runs reproducible;
    # kept on the device (the kernels load it): no host sync
    return torch.randint(0, 2**62, (1,), dtype=torch.int64, device=device)


# Signatures of flash_attn_func calls that passed every check: a repeated call (each training step,
# each layer) skips the checks, whose result depends only on what the key holds (see _signature).
# Not while torch.compile traces, not with ALiBi slopes (a tensor).
_VALIDATED: dict = {}
_Tensor = torch.Tensor
_PLAIN = (type(None), bool, int, float, str, type)


def _signature(tensors: tuple, options: tuple, tag: str | None = None, seq_free: bool = False) -> tuple | None:
    """Key of a call for remembered checks: type, shape, dtype and device of each tensor argument
    (None where absent) and the type and value of each option (types too, so that True is not taken
    for an accepted 1; a list or tuple option element by element). None when a tensor argument is
    not a plain tensor or an option (element) is not None, a bool, an int, a float, a string or a
    type (a 0-d tensor flag would hash by identity and may change in place): such calls take the
    checks, which name what is wrong. ``tag`` (the entry point, where it shares a store with others)
    leads the key. ``seq_free`` (flash_attn_func, ``tensors`` = (q, k, v), whose checks read no
    sequence length but for k / v having one shape): dim 1 of each shape stands as -1 in the key, and
    the key holds whether k's and v's dim 1 agree; a generation loop's calls, one key longer each
    step, then share one remembered signature."""
    key = [] if tag is None else [tag]
    for t in tensors:
        if t is None:
            key.append(None)
        elif type(t) is _Tensor and not t.is_nested:  # (a strided nested tensor has no shape)
            shape = t.shape
            if seq_free and len(shape) >= 2:
                shape = (shape[0], -1, *shape[2:])  # (-1: no real size; the number of dims kept)
            key.append((shape, t.dtype, t.device))
        else:
            return None
    if seq_free:  # (k / v: plain tensors or None here; None takes the checks, which name it)
        k, v = tensors[1], tensors[2]
        if k is None or v is None:
            return None
        key.append(k.dim() >= 2 and v.dim() >= 2 and k.shape[1] == v.shape[1])
    for o in options:
        if type(o) in (list, tuple):
            if any(type(x) not in _PLAIN for x in o):
                return None
            key.append(tuple((type(x), x) for x in o))
        elif type(o) in _PLAIN:
            key.append((type(o), o))
        else:
            return None
    return tuple(key)


def _remember(key, var: Variants, store: dict = _VALIDATED) -> None:
    """Keep the Variants fields of a signature that passed the checks (``store``: the entry
    point's own dict)."""
    if len(store) >= 4096:
        store.clear()
    store[key] = dict(softmax_scale=var.softmax_scale, win_left=var.win_left, win_right=var.win_right,
                      softcap=var.softcap, dropout_p=var.dropout_p, deterministic=var.deterministic)


def _recall(key, dropout_p, q: torch.Tensor, store: dict = _VALIDATED) -> Variants | None:
    """The Variants of a signature :func:`_remember` kept (with dropout, a seed of this call's own,
    on ``q``'s device), or None: the call takes the checks."""
    fields = None if key is None else store.get(key)
    if fields is None:
        return None
    var = Variants(**fields)
    if dropout_p > 0:
        var.seed = _dropout_seed(q.device)
    return var


def _validated(key, dropout_p, t: torch.Tensor, check, *args) -> Variants:
    """The Variants of a call: remembered for ``key`` (:func:`_recall`), or ``check(*args)``'s, which
    raises on bad input, kept for ``key`` when it is not None."""
    var = _recall(key, dropout_p, t)
    if var is None:
        var = check(*args)
        if key is not None:
            _remember(key, var)
    return var


def _options_key(tensors, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                 tag=None, lengths=(), seq_free=False):
    """:func:`_signature` of an entry point's call, or None (checks every call) while torch.compile
    traces or with ALiBi slopes (a tensor); ``lengths``: its max_seqlen ints."""
    if alibi_slopes is not None or torch.compiler.is_compiling():
        return None
    return _signature(tensors, (*lengths, dropout_p, softmax_scale, causal, window_size, softcap, deterministic), tag,
                      seq_free)


def _check_mask_and_bias(q, k, bias, mask, key_padding_mask, var: Variants) -> None:
    """Validate the bias / mask arguments, then store the masks in ``var`` (:func:`_lay_out_mask`;
    the bias goes through autograd). What the checks decide depends on the arguments' types, shapes,
    dtypes and devices and q / k's shapes (and ``var``'s lengths) only: a signature of those that
    passed may skip them (:func:`attention`). Variable length (``var``'s cu_seqlens set): laid out
    per sequence, (batch, nheads, max_seqlen_q, max_seqlen_k) in local indices."""
    full = var.score_shape(q, k)
    B, Sk = full[0], full[3]
    seq = "max_seqlen" if var.varlen else "seqlen"

    def broadcastable(name, t):
        if t.dim() > 4 or any(s != 1 and s != f for s, f in zip(reversed(t.shape), reversed(full))):
            raise ValueError(f"{name} of shape {tuple(t.shape)} does not broadcast to (batch, nheads, {seq}_q, "
                             f"{seq}_k) = {full}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")

    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"bias must be a torch.Tensor or None, got {type(bias).__name__}")
        if bias.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"bias has dtype {bias.dtype}; expected a float tensor (use mask= for booleans)")
        broadcastable("bias", bias)
    masks = [(n, m) for n, m in (("mask", mask), ("key_padding_mask", key_padding_mask)) if m is not None]
    if len(masks) == 2:
        raise ValueError("give mask or key_padding_mask, not both")
    if masks:
        name, m = masks[0]
        if not isinstance(m, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(m).__name__}")
        if m.dtype != torch.bool:
            raise TypeError(f"{name} must be a bool tensor (True = take part), got {m.dtype}; "
                            "an additive float mask is a bias")
        if name == "key_padding_mask":
            if tuple(m.shape) != (B, Sk):
                raise ValueError(f"key_padding_mask must have shape (batch, {seq}_k) = {(B, Sk)}, "
                                 f"got {tuple(m.shape)}")
            m = m[:, None, None, :]
        broadcastable(name, m)
    _lay_out_mask(q, k, mask, key_padding_mask, var, full)


def _lay_out_mask(q, k, mask, key_padding_mask, var: Variants, full=None) -> None:
    """The masks of a call whose mask arguments passed :func:`_check_mask_and_bias` (in this call,
    or in its signature's first) stored in ``var`` as the kernels read them: bytes (a free view in
    eager mode; inductor cannot lower a bool -> uint8 view, so while compiling the unexpanded mask is
    converted, which it fuses into its producer), one per key (``(batch, seqlen_k)``, MASK_KEYS: no
    S x S read) where the mask does not vary over heads and queries, else the mask broadcast to the
    score shape ``full`` (MASK_TILE)."""
    convert = torch.compiler.is_compiling()
    if key_padding_mask is not None:  # (batch, seqlen_k): already one boolean per key
        m = key_padding_mask
        var.mask, var.mask_kind = (m.to(torch.uint8) if convert else m.view(torch.uint8)), MASK_KEYS
        return
    if mask is None:
        return
    full = var.score_shape(q, k) if full is None else full
    m = (mask.to(torch.uint8) if convert else mask.view(torch.uint8)).expand(full)
    # a size-1 head or query dim (e.g. Sq = 1 when decoding) keeps the stride of the dim it was
    # unsqueezed next to, and is read at index 0 only
    if (m.stride(1) == 0 or full[1] == 1) and (m.stride(2) == 0 or full[2] == 1):
        var.mask, var.mask_kind = m[:, 0, 0, :], MASK_KEYS
    else:
        var.mask, var.mask_kind = m, MASK_TILE


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _finish(out: torch.Tensor, lse: torch.Tensor, probs, return_attn_probs: bool) -> Returned:
    return (out, lse, probs) if return_attn_probs else out


def _apply(packing: str, var: Variants, return_probs: bool, tensors: tuple, bias=None, keep_lse: bool = True) -> tuple:
    """``(out, lse, probs)`` through :class:`FlashAttnFunction`; while torch.compile traces, through
    the torch.library ops instead (no graph break; S_dmask, a testing aid, stays eager). Without
    ``keep_lse`` (the caller does not return it) an inference call's lse is written to a buffer that
    no one reads (``Variants.need_lse``; no allocation per call) and is not to be read."""
    if torch.compiler.is_compiling() and not return_probs:
        out, lse = apply_compiled_packed(packing, var, tensors, bias)
        return out, lse, None
    if not _needs_grad(*tensors, bias):  # inference: skip the autograd machinery (host time per call)
        if not (keep_lse or return_probs):  # (the probabilities are computed from the lse)
            var.need_lse = False
        # (dead functorch wrappers unwrapped, as Function.apply does below: they have no storage)
        tensors = tuple(None if t is None else _unwrap_if_dead(t) for t in tensors)
        return ops_forward(packing, var, return_probs, tensors, None if bias is None else _unwrap_if_dead(bias))
    if _functorch_active():  # vmap / grad / jvp: Function.apply routes through functorch
        return FlashAttnFunction.apply(packing, var, return_probs, *tensors, bias)
    # what Function.apply does without functorch transforms, less its Python: it binds the defaults
    # of forward (none here) and unwraps dead functorch wrappers (tensors leaked out of a transform)
    # over every argument, ~2.5 us a call on a 2-core host (thirty-third session)
    t0, t1, t2 = tensors  # (t0 is always a tensor: q, or the packed qkv)
    return _function_apply(packing, var, return_probs, _unwrap_if_dead(t0),
                           None if t1 is None else _unwrap_if_dead(t1), None if t2 is None else _unwrap_if_dead(t2),
                           None if bias is None else _unwrap_if_dead(bias))


_functorch_active = torch._C._are_functorch_transforms_active
_unwrap_if_dead = torch._C._functorch.unwrap_if_dead
# Function.apply's own ``super().apply``: the C entry into autograd, bound to FlashAttnFunction
_function_apply = super(torch.autograd.Function, FlashAttnFunction).apply


def _check_dense(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic):
    _check_tensor("q", q, 4)
    _check_tensor("k", k, 4)
    _check_tensor("v", v, 4)
    _check_qkv(q, k, v)
    return _check_options(q, k, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                          deterministic=deterministic)


def _check_kvpacked(q, kv, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic):
    _check_tensor("q", q, 4)
    _check_tensor("kv", kv, 5)
    if kv.shape[2] != 2:
        raise ValueError(f"kv must have shape (batch, seqlen_k, 2, nheads_k, headdim), got {tuple(kv.shape)}")
    _check_qkv(q, kv[:, :, 0], kv[:, :, 1], names=("q", "kv", "kv"))
    return _check_options(q, kv[:, :, 0], dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                          deterministic=deterministic)


def _check_qkvpacked(qkv, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic):
    _check_tensor("qkv", qkv, 5)
    if qkv.shape[2] != 3:
        raise ValueError(f"qkv must have shape (batch, seqlen, 3, nheads, headdim), got {tuple(qkv.shape)}")
    _check_qkv(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], names=("qkv", "qkv", "qkv"))
    return _check_options(qkv[:, :, 0], qkv[:, :, 1], dropout_p, softmax_scale, causal, window_size, softcap,
                          alibi_slopes, deterministic=deterministic)


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: Sequence[int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> Returned:
    """Exact scaled dot-product attention with O(seqlen) memory.

    Args:
        q: ``(batch, seqlen_q, nheads, headdim)``, float16 / bfloat16 / float32.
        k, v: ``(batch, seqlen_k, nheads_k, headdim)``; ``nheads % nheads_k == 0`` (GQA / MQA:
            query heads ``[g*r, (g+1)*r)`` use kv head ``g``, ``r = nheads / nheads_k``).
        dropout_p: dropout on the attention probabilities (scaled by 1 / (1 - p)), with a real
            backward; the keep-mask comes from Philox seeded by the device's default generator
            (``torch.manual_seed`` makes runs reproducible) and is regenerated, never stored.
        softmax_scale: defaults to ``1 / sqrt(headdim)``.
        causal: bottom-right aligned causal mask (see the module docstring).
        window_size: ``(left, right)``: query ``i`` sees keys ``j`` with
            ``i + Sk - Sq - left <= j <= i + Sk - Sq + right``; -1 leaves a side unbounded;
            ``causal`` sets ``right = 0``. Blocks outside the band are skipped.
        softcap: if > 0, scores become ``softcap * tanh(scores / softcap)`` (after scaling).
        alibi_slopes: float32 ``(nheads,)`` or ``(batch, nheads)``: adds
            ``-slope * |i + Sk - Sq - j|`` to the scores.
        deterministic: the backward is deterministic (bitwise equal reruns) by default; True also
            keeps it so when the opt-in non-deterministic backward (``TRITONATTN_ATOMIC_DQ=1``) is on.
        return_attn_probs: also return ``softmax_lse`` ``(batch, nheads, seqlen_q)`` float32
            (natural log) and ``S_dmask``: with dropout, the ``(batch, nheads, seqlen_q,
            seqlen_k)`` probabilities, negated where dropped (a testing aid, S x S memory);
            ``None`` without dropout, as flash-attn.

    Returns:
        ``out`` ``(batch, seqlen_q, nheads, headdim)`` in the input dtype, or
        ``(out, softmax_lse, S_dmask)`` when ``return_attn_probs``.
    """
    fast = None if return_attn_probs else _options_fast_key("dense", q, k, v, dropout_p, softmax_scale, causal,
                                                              window_size, softcap, alibi_slopes, (deterministic,),
                                                              grad=_DENSE_GRAD)
    free = None
    if fast is not None:
        if fast[0] is _DENSE_GRAD:  # a training call: the checked Variants of its key's first call, if kept
            var = _GRAD_VARS.get(fast)
            if var is not None:  # (FlashAttnFunction.forward replays the plan linked to the key)
                return _function_apply("none", var, False, _unwrap_if_dead(q), _unwrap_if_dead(k),
                                       _unwrap_if_dead(v), None)[0]
        else:  # an inference call with the key of an earlier one: its launch plan, replayed
            res = replay_linked(fast, q, k, v)
            if res is not None:
                return res[0]
            # a decoding step over a cache whose length changes every call: the length-free plan
            free, res = _replay_free(fast, q, k, v)
            if res is not None:
                return res[0]
    key = _options_key((q, k, v), dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                       seq_free=True)
    var = _validated(key, dropout_p, q, _check_dense, q, k, v, dropout_p, softmax_scale, causal, window_size,
                     softcap, alibi_slopes, deterministic)
    var.fast_key, var.free_key = fast, free  # (the launcher links them to its plan)
    out, lse, probs = _apply("none", var, return_attn_probs and dropout_p > 0, (q, k, v), keep_lse=return_attn_probs)
    if fast is not None and fast[0] is _DENSE_GRAD:  # (after the call: it raised nothing)
        _keep_grad_var(fast, var)
    return _finish(out, lse, probs, return_attn_probs)


# A training call's key (_fast_key's ``grad`` tag) -> the Variants its first call was checked into,
# shared by the later calls with that key (read only: such calls have no bias, the one field ops.forward
# writes, and the entry points set fast_key / free_key and masks on fresh objects only; ctx.var of each
# call's autograd node). Such a call skips the checks and FlashAttnFunction.forward replays the
# forward's plan linked to the key (fwd.replay_linked), as an inference call does.
_DENSE_GRAD = "dense-grad"
_GRAD_VARS: dict = {}


def _keep_grad_var(fast: tuple, var: Variants) -> None:
    if len(_GRAD_VARS) >= 4096:
        _GRAD_VARS.clear()
    _GRAD_VARS[fast] = var


_FAST_OPTION_TYPES = frozenset((type(None), bool, int, float, type))


def _options_fast_key(tag: str, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                      more: tuple, mask=None, grad: str | None = None):
    """:func:`_fast_key` of a call with flash_attn_func's options (the window as its type and two
    entries) and ``more`` (the entry point's own); None with ALiBi slopes (a tensor) or a window
    that is not a list or tuple of two."""
    if alibi_slopes is not None:
        return None
    tw = type(window_size)
    if (tw is not tuple and tw is not list) or len(window_size) != 2:
        return None
    left, right = window_size
    return _fast_key(tag, q, k, v, (dropout_p, softmax_scale, causal, tw, left, right, softcap, *more), mask, grad)


def _fast_key(tag: str, q, k, v, options: tuple, mask=None, grad: str | None = None):
    """Key of an entry point's (``tag``'s) call that needs no gradient and has no tensor option
    (ALiBi, bias) but a bool ``mask`` (its one mask argument, or None) and no dropout (``options[0]``,
    the dropout probability, is 0): the tensors' shapes, strides, dtypes and devices, whether q, k
    and v are 16-byte aligned, the options with their types, and the forward launcher's switches: all
    that the entry point's checks and its launch plan's key (kernels/fwd.py) are functions of. The
    first call with a key takes both, and the launcher links the key to its plan
    (``Variants.fast_key``); the next call with it replays the plan (``fwd.replay_linked``). None for
    any other call, which takes the full path (also while torch.compile traces and under functorch
    transforms). ``grad``: a tag for calls that need a gradient (no mask), whose keys it leads
    instead of ``tag`` (the entry point then replays through autograd); None: such calls get None."""
    if torch.compiler.is_compiling() or _functorch_active():
        return None
    types = tuple(map(type, options))
    if not _FAST_OPTION_TYPES.issuperset(types) or options[0]:
        return None
    if type(q) is not _Tensor or type(k) is not _Tensor or type(v) is not _Tensor:
        return None
    if q.is_nested or k.is_nested or v.is_nested:
        return None
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        if grad is None or mask is not None:
            return None
        tag = grad
    if mask is None:
        mask_key = None
    elif type(mask) is _Tensor and mask.dtype == torch.bool and not mask.is_nested:
        mask_key = (mask.shape, mask.stride(), mask.device)
    else:
        return None
    try:
        kv_ptrs = k.data_ptr() | v.data_ptr()
        q_ptr = q.data_ptr()
    except RuntimeError:  # a dead functorch wrapper (a tensor leaked out of a transform): no storage
        return None
    return (tag, q.shape, q.stride(), q.dtype, q.device, k.shape, k.stride(), k.dtype, k.device, v.shape, v.stride(),
            v.dtype, v.device, mask_key, types, options, (q_ptr | kv_ptrs) & 15 == 0, kv_ptrs & 15 == 0,
            plan_flags())


def flash_attn_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: Sequence[int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> Returned:
    """As :func:`flash_attn_func` with ``kv`` ``(batch, seqlen_k, 2, nheads_k, headdim)``.

    The gradient of ``kv`` is written packed, with no concatenation copy.
    """
    key = _options_key((q, kv), dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                       "kv")
    var = _validated(key, dropout_p, q, _check_kvpacked, q, kv, dropout_p, softmax_scale, causal, window_size,
                     softcap, alibi_slopes, deterministic)
    return_probs = return_attn_probs and dropout_p > 0
    out, lse, probs = _apply("kv", var, return_probs, (q, kv, None), keep_lse=return_attn_probs)
    return _finish(out, lse, probs, return_attn_probs)


def flash_attn_qkvpacked_func(
    qkv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: Sequence[int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> Returned:
    """As :func:`flash_attn_func` with ``qkv`` ``(batch, seqlen, 3, nheads, headdim)``.

    The gradient of ``qkv`` is written packed, with no concatenation copy.
    """
    key = _options_key((qkv,), dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                       "qkv")
    var = _validated(key, dropout_p, qkv, _check_qkvpacked, qkv, dropout_p, softmax_scale, causal, window_size,
                     softcap, alibi_slopes, deterministic)
    return_probs = return_attn_probs and dropout_p > 0
    out, lse, probs = _apply("qkv", var, return_probs, (qkv, None, None), keep_lse=return_attn_probs)
    return _finish(out, lse, probs, return_attn_probs)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    key_padding_mask: torch.Tensor | None = None,
    causal: bool = False,
    softmax_scale: float | None = None,
    dropout_p: float = 0.0,
    window_size: Sequence[int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    return_lse: bool = False,
) -> Returned:
    """:func:`flash_attn_func` plus arbitrary masks and an additive bias with gradient.

    Layout ``(batch, seqlen, nheads, headdim)`` as flash-attn. The score of query ``i`` and key
    ``j`` is ``softcap(q_i . k_j * softmax_scale) + alibi(i, j) + bias[b, h, i, j]``; pairs outside
    ``mask`` / ``key_padding_mask`` / the causal mask / the window take no part; a query that
    keeps no key outputs 0 with zero gradients.

    Args:
        bias: float tensor broadcastable to ``(batch, nheads, seqlen_q, seqlen_k)``; broadcast dims
            are read with stride 0, never expanded in memory. If it requires grad its gradient is
            returned in its own shape and dtype (summed over the broadcast dims).
        mask: bool tensor broadcastable the same way, True = take part (SDPA's convention).
        key_padding_mask: bool ``(batch, seqlen_k)``, True = real key: a fast path that reads one
            boolean per key instead of an S x S mask (a mask of shape (B, 1, 1, Sk) takes it too).
        causal, softmax_scale, dropout_p, window_size, softcap, alibi_slopes: as
            :func:`flash_attn_func` (causal bottom-right aligned).
        return_lse: also return the log-sum-exp ``(batch, nheads, seqlen_q)`` float32.

    For packed variable-length batches, see :func:`attention_varlen`.
    """
    fast = None
    if bias is None and not return_lse and (mask is None or key_padding_mask is None):
        one_mask = key_padding_mask if mask is None else mask
        fast = _options_fast_key("attention", q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                                 alibi_slopes, (mask is None, key_padding_mask is None), one_mask)
        if fast is not None:  # an inference call with the key of an earlier one: its launch plan, replayed
            res = replay_linked(fast, q, k, v, one_mask)
            if res is not None:
                return res[0]
    # the key covers the bias / mask arguments too: a repeated call (each layer of a padded batch)
    # skips their checks as well, and only lays its masks out
    key = _options_key((q, k, v, bias, mask, key_padding_mask), dropout_p, softmax_scale, causal, window_size,
                       softcap, alibi_slopes, False, "attention")
    var = _recall(key, dropout_p, q)
    if var is None:
        var = _check_dense(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, False)
        _check_mask_and_bias(q, k, bias, mask, key_padding_mask, var)
        if key is not None:
            _remember(key, var)
    else:
        _lay_out_mask(q, k, mask, key_padding_mask, var)
    var.fast_key = fast  # (the launcher links it to its plan)
    out, lse, _ = _apply("none", var, False, (q, k, v), bias, keep_lse=return_lse)
    return (out, lse) if return_lse else out


def _debug_checks() -> bool:
    """Checks that need a device sync (cu_seqlens contents) run on CPU tensors always, and on CUDA
    tensors only with TRITONATTN_DEBUG=1, and not while a CUDA graph is being captured (a sync
    there would invalidate the capture)."""
    return env_flag("TRITONATTN_DEBUG") and not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def _check_varlen(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, paged: bool = False) -> None:
    """``paged``: k is a paged cache, whose rows are not packed sequences (cu_seqlens_k[-1] is free)."""
    pairs = (("cu_seqlens_q", cu_seqlens_q, q.shape[0], "max_seqlen_q", max_seqlen_q),
             ("cu_seqlens_k", cu_seqlens_k, None if paged else k.shape[0], "max_seqlen_k", max_seqlen_k))
    for name, cu, _, max_name, max_len in pairs:
        if not isinstance(cu, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(cu).__name__}")
        if cu.dtype != torch.int32:
            raise TypeError(f"{name} must be int32, got {cu.dtype}")
        if cu.dim() != 1 or cu.shape[0] < 2:
            raise ValueError(f"{name} must have shape (batch + 1,) with batch >= 1, got {tuple(cu.shape)}")
        if cu.device != q.device:
            raise ValueError(f"{name} is on {cu.device} but q is on {q.device}")
        if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 0:
            raise ValueError(f"{max_name} must be an int >= 0, got {max_len!r}")
    if cu_seqlens_q.shape[0] != cu_seqlens_k.shape[0]:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k describe {cu_seqlens_q.shape[0] - 1} and "
                         f"{cu_seqlens_k.shape[0] - 1} sequences")
    if torch.compiler.is_compiling() or not (q.device.type == "cpu" or _debug_checks()):
        return  # contents: a device sync, and data-dependent control flow while torch.compile traces
    for name, cu, total, max_name, max_len in pairs:
        lens = cu[1:] - cu[:-1]
        if cu[0].item() != 0 or bool((lens < 0).any()):
            raise ValueError(f"{name} must start at 0 and never decrease, got {cu.tolist()}")
        if total is not None and cu[-1].item() != total:
            raise ValueError(f"{name}[-1] = {cu[-1].item()} but the packed tensor holds {total} tokens")
        longest = int(lens.max().item())
        if longest > max_len:
            raise ValueError(f"{name} has a sequence of {longest} tokens, longer than {max_name} = {max_len}")


def _check_varlen_call(q, kv, packing, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                       softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic) -> Variants:
    """The checks of flash_attn_varlen_func (``packing`` None: ``kv`` is ``(k, v)``), its kvpacked
    (``"kv"``: ``kv`` (total_k, 2, Hkv, D)) and qkvpacked (``"qkv"``: ``kv`` (total, 3, H, D), ``q``
    None) forms; their Variants."""
    if packing != "qkv":
        _check_tensor("q", q, 3)
    if packing is None:
        k, v = kv
        _check_tensor("k", k, 3)
        _check_tensor("v", v, 3)
        names = ("q", "k", "v")
    else:
        n = 2 if packing == "kv" else 3
        _check_tensor(packing, kv, 4)
        if kv.shape[1] != n:
            shape = "(total_k, 2, nheads_k, headdim)" if n == 2 else "(total, 3, nheads, headdim)"
            raise ValueError(f"{packing} must have shape {shape}, got {tuple(kv.shape)}")
        if q is None:
            q = kv[:, 0]
        k, v = kv[:, n - 2], kv[:, n - 1]
        names = ("q", "kv", "kv") if n == 2 else ("qkv", "qkv", "qkv")
    _check_qkv(q[None], k[None], v[None], names=names)
    _check_varlen(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return _check_options(q[None], k[None], dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                          batch=cu_seqlens_q.shape[0] - 1, deterministic=deterministic)


def _varlen_validated(tag, q, kv, packing, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                      softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic) -> Variants:
    """:func:`_validated` for the varlen entry points (arguments as :func:`_check_varlen_call`; ``tag``
    their key's). A remembered signature does not cover the contents of ``cu_seqlens``: where they are
    checked (CPU tensors; CUDA with TRITONATTN_DEBUG=1) a call of a remembered signature checks them
    first, before its dropout seed is drawn (as the full checks, which a signature's first call takes,
    raise before theirs: a rejected call leaves the random state alone)."""
    tensors = (q, *kv, cu_seqlens_q, cu_seqlens_k) if packing is None else (q, kv, cu_seqlens_q, cu_seqlens_k)
    lengths = (max_seqlen_q, max_seqlen_k)
    key = _options_key(tensors, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                       tag, lengths)
    tokens = kv if q is None else q  # (their first dims are the token counts; a packed tensor's its own)
    if key is not None and (tokens.device.type == "cpu" or _debug_checks()) and key in _VALIDATED:
        _check_varlen(tokens, kv[0] if packing is None else kv, cu_seqlens_q, cu_seqlens_k, *lengths)
    return _validated(key, dropout_p, tokens, _check_varlen_call, q, kv, packing, cu_seqlens_q, cu_seqlens_k,
                      *lengths, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic)


def _check_paged_cache(k, v) -> None:
    """k / v of flash_attn_varlen_func with a block_table: (num_blocks, page_size, nheads_k, headdim)."""
    for name, t in (("k", k), ("v", v)):
        if isinstance(t, torch.Tensor) and t.dim() != 4:
            raise ValueError(f"with block_table, {name} must be a paged cache (num_blocks, page_size, nheads_k, "
                             f"headdim), got shape {tuple(t.shape)}")
        _check_tensor(name, t, 4)
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[0] == 0 or k.shape[1] == 0:
        raise ValueError(f"the paged cache k of shape {tuple(k.shape)} holds no page: num_blocks and page_size "
                         "must be >= 1")


def _check_block_table(q, k, block_table, cu_seqlens_k) -> torch.Tensor:
    """Shape, dtype and device of a block table; its contents (pages of every sequence's keys inside
    the cache) on CPU tensors always, on CUDA tensors with TRITONATTN_DEBUG=1 (a device sync).
    Returns it with a unit stride along the pages (the kernel reads rows as contiguous)."""
    B = cu_seqlens_k.shape[0] - 1
    num_blocks, page_size = k.shape[0], k.shape[1]
    if not isinstance(block_table, torch.Tensor):
        raise TypeError(f"block_table must be a torch.Tensor or None, got {type(block_table).__name__}")
    if block_table.dtype != torch.int32:
        raise TypeError(f"block_table must be int32, got {block_table.dtype}")
    if block_table.dim() != 2 or block_table.shape[0] != B:
        raise ValueError(f"block_table must have shape (batch, max_blocks) = ({B}, max_blocks), got "
                         f"{tuple(block_table.shape)}")
    if block_table.device != q.device:
        raise ValueError(f"block_table is on {block_table.device} but q is on {q.device}")
    if not torch.compiler.is_compiling() and (q.device.type == "cpu" or _debug_checks()):
        lens = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).long()
        capacity = block_table.shape[1] * page_size
        if bool((lens > capacity).any()):
            raise ValueError(f"cu_seqlens_k has a sequence of {int(lens.max())} keys but a block_table row holds "
                             f"{block_table.shape[1]} pages of {page_size} = {capacity} keys")
        _check_pages(block_table, page_size, num_blocks, lens, "k")
    return block_table if block_table.stride(1) == 1 else block_table.contiguous()


def _check_pages(block_table, page_size: int, num_blocks: int, end, cache: str, start=None) -> None:
    """Raise unless every page holding rows ``[start[b], end[b])`` of batch row b (start 0 when
    None) is a page of the cache ``cache`` (``0 <= page < num_blocks``). Only the pages a row uses
    are read, and checked: the rest of a row may hold anything. A device sync on CUDA."""
    first = torch.arange(block_table.shape[1], device=block_table.device)[None, :] * page_size
    used = first < end[:, None]
    if start is not None:
        used &= first + page_size > start[:, None]
    bad = used & ((block_table < 0) | (block_table >= num_blocks))
    if bool(bad.any()):
        b, j = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"block_table[{b}, {j}] = {int(block_table[b, j])} is not a page of {cache} (num_blocks = "
                         f"{num_blocks})")


def _set_varlen(var: Variants, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> None:
    var.cu_seqlens_q, var.cu_seqlens_k = cu_seqlens_q, cu_seqlens_k
    var.max_seqlen_q, var.max_seqlen_k = int(max_seqlen_q), int(max_seqlen_k)


def _varlen_call(packing, var, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, return_attn_probs, tensors):
    _set_varlen(var, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return_probs = return_attn_probs and var.dropout_p > 0
    out, lse, probs = _apply(packing, var, return_probs, tensors, keep_lse=return_attn_probs)
    return _finish(out, lse, probs, return_attn_probs)


def _paged_varlen_call(var, q, k, v, block_table, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                       return_attn_probs):
    """Paged K/V (forward only, as flash-attn): the forward kernel reads each sequence's keys through
    its block table row (PAGED flag), starting at row 0 of its first page."""
    if _needs_grad(q, k, v):
        raise NotImplementedError("flash_attn_varlen_func with block_table (paged KV) is forward only, as in "
                                  "flash-attn: call it under torch.no_grad() / torch.inference_mode(), or with "
                                  "q, k, v that do not require grad")
    if return_attn_probs and var.dropout_p > 0:
        raise NotImplementedError("return_attn_probs with dropout (S_dmask) is not supported with block_table")
    _set_varlen(var, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    var.use_pages(block_table, k, v)
    if torch.compiler.is_compiling():  # the op gets the whole caches and sets the page fields again
        return _finish(*apply_compiled(var, q, k, v, None), None, return_attn_probs)
    out, lse = attention_forward(q, k[0], v[0], var)
    return _finish(out, lse, None, return_attn_probs)


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: Sequence[int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: torch.Tensor | None = None,
) -> Returned:
    """Attention over a batch of sequences of different lengths packed along the tokens.

    Args:
        q: ``(total_q, nheads, headdim)``; k, v: ``(total_k, nheads_k, headdim)``, or with
            ``block_table`` paged caches ``(num_blocks, page_size, nheads_k, headdim)`` (any page size >= 1).
        cu_seqlens_q, cu_seqlens_k: int32 ``(batch + 1,)``, the cumulative lengths (sequence ``b``
            is rows ``cu[b]:cu[b + 1]``); empty sequences are allowed. Their contents are checked
            on CPU tensors, and on CUDA tensors with ``TRITONATTN_DEBUG=1`` (a device sync).
            With ``block_table``, ``cu_seqlens_k`` gives only each sequence's key count.
        max_seqlen_q, max_seqlen_k: the longest sequence lengths (size the launch grid).
        block_table: int32 ``(batch, max_blocks)`` (flash-attn 2.x semantics): the keys / values of
            sequence ``b`` are rows ``0 .. len_b - 1`` of the pages ``block_table[b, 0], block_table[b, 1], ...``
            (``len_b = cu_seqlens_k[b + 1] - cu_seqlens_k[b]``); entries past a sequence's last page
            are never read. Forward only, as in flash-attn: inputs that require grad raise
            ``NotImplementedError``. Page indices are checked on CPU tensors, and on CUDA tensors with
            ``TRITONATTN_DEBUG=1``.
        The other arguments as :func:`flash_attn_func`; each sequence gives exactly what the
        dense call gives on that sequence alone (causal bottom-right within each sequence).
        For a bias or boolean mask per sequence, see :func:`attention_varlen`.

    Returns:
        ``out`` ``(total_q, nheads, headdim)``, or ``(out, softmax_lse, S_dmask)`` with lse
        ``(nheads, total_q)`` float32 and S_dmask ``(batch, nheads, max_seqlen_q, max_seqlen_k)``
        with dropout (``None`` without).
    """
    if block_table is not None:
        _check_tensor("q", q, 3)
        _check_paged_cache(k, v)
        _check_qkv(q[None], k[:1], v[:1])  # one page seen as a batch row: dtype, device, head dims
        _check_varlen(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, paged=True)
        var = _check_options(q[None], k[None], dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                             batch=cu_seqlens_q.shape[0] - 1, deterministic=deterministic)
        block_table = _check_block_table(q, k, block_table, cu_seqlens_k)
        return _paged_varlen_call(var, q, k, v, block_table, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  return_attn_probs)
    var = _varlen_validated("varlen", q, (k, v), None, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                            dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic)
    return _varlen_call("none", var, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, return_attn_probs,
                        (q, k, v))


def flash_attn_varlen_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: Sequence[int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> Returned:
    """As :func:`flash_attn_varlen_func` with ``kv`` ``(total_k, 2, nheads_k, headdim)``; the
    gradient of ``kv`` is written packed."""
    var = _varlen_validated("varlen-kv", q, kv, "kv", cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                            dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic)
    return _varlen_call("kv", var, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, return_attn_probs,
                        (q, kv, None))


def flash_attn_varlen_qkvpacked_func(
    qkv: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: Sequence[int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> Returned:
    """As :func:`flash_attn_varlen_func` with ``qkv`` ``(total, 3, nheads, headdim)`` and one
    ``cu_seqlens`` / ``max_seqlen`` for queries and keys; the gradient of ``qkv`` is written packed."""
    var = _varlen_validated("varlen-qkv", None, qkv, "qkv", cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                            dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic)
    return _varlen_call("qkv", var, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, return_attn_probs,
                        (qkv, None, None))


def attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    bias: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    key_padding_mask: torch.Tensor | None = None,
    causal: bool = False,
    softmax_scale: float | None = None,
    dropout_p: float = 0.0,
    window_size: Sequence[int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    return_lse: bool = False,
) -> Returned:
    """:func:`attention` for variable-length batches: :func:`flash_attn_varlen_func`'s packed layout
    plus a bias (with gradient) and boolean masks laid out per sequence.

    Each sequence gives what :func:`attention` gives on that sequence alone, with the sequence's
    slice ``[b, :, :len_q_b, :len_k_b]`` of the bias / mask.

    Args:
        q: ``(total_q, nheads, headdim)``; k, v: ``(total_k, nheads_k, headdim)``.
        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k: as :func:`flash_attn_varlen_func`.
        bias: float tensor broadcastable to ``(batch, nheads, max_seqlen_q, max_seqlen_k)``: entry
            ``[b, h, i, j]`` is added to the score of query ``i`` and key ``j`` of sequence ``b``
            (indices local to the sequence; entries past a sequence's lengths are never read).
            Broadcast dims are read with stride 0. If it requires grad its gradient is returned in
            its own shape and dtype (summed over broadcast dims; 0 past each sequence's lengths).
        mask: bool tensor broadcastable the same way, True = take part.
        key_padding_mask: bool ``(batch, max_seqlen_k)``, True = real key (one boolean per key).
        causal, softmax_scale, dropout_p, window_size, softcap, alibi_slopes: as
            :func:`flash_attn_func` (causal bottom-right within each sequence).
        return_lse: also return the log-sum-exp ``(nheads, total_q)`` float32.
    """
    var = _varlen_validated("attention-varlen", q, (k, v), None, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                            max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, False)
    _set_varlen(var, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    _check_mask_and_bias(q, k, bias, mask, key_padding_mask, var)
    out, lse, _ = _apply("none", var, False, (q, k, v), bias, keep_lse=return_lse)
    return (out, lse) if return_lse else out
