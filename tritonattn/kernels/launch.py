"""Kernel launches with little host time.

``JITFunction.__getitem__(grid)(...)`` spends most of a small call's host time (about 40 of the
71 microseconds of a forward launch on the H200, scripts/overhead.py) binding and specializing
arguments before it reaches the C launcher. Here the compiled kernel of a call is cached under a key
that fixes Triton's specialization exactly: for each integer argument what Triton specializes it
on (== 1, divisibility by 16, its 32 / 64-bit type: :func:`int_class`), the dtype and 16-byte
alignment of each tensor (what Triton specializes pointers on), the type of the other arguments,
the constexprs and the launch options. A call whose integers specialize as an earlier call's did
(same flags; shapes and strides of the same classes: every training step, every decoding step, and
a generation loop whose key count grows by one each step) goes straight to the C launcher with its
own values; a new key takes Triton's own path once, which compiles if needed and returns the kernel
that is then cached.

Triton's launch hooks (profilers) are honoured as JITFunction.run honours them. Off under the
interpreter.
"""

from __future__ import annotations

import functools
import inspect

import torch
import triton

from tritonattn.kernels.common import LENGTH_CAP

ENABLED = True  # scripts/compile_check.py turns it off (it compiles without launching)
# False: a packed call launches each kernel once, with the longest sequence's tile (what the library
# did before length_classes; its sequences may then differ from their dense calls by rounding). For
# the Gluon tuners' timings of what the classes cost (benchmarks/experiments; they clear the plans)
LENGTH_CLASSES = True
_MAX_ENTRIES = 4096
_cache: dict = {}
_tail_params: dict = {}
_EMPTY = inspect.Parameter.empty


def cdiv(a: int, b: int) -> int:
    """Host-side ceil division. (``triton.cdiv`` is a constexpr function in Triton 3.6: a wrapper
    that costs microseconds per call on the host.)"""
    return -(-a // b)


def program_grid(blocks: int, heads: int, heads_first: bool) -> tuple[int, int]:
    """The grid of a kernel that reads its program with ``common.program_order``: (blocks, batch x
    heads), or (batch x heads, blocks) heads first."""
    return (heads, blocks) if heads_first else (blocks, heads)


def length_classes(route, longest: int, breaks, packed: bool = True) -> list[tuple[int, int, object]]:
    """The length classes of a packed (variable-length) call: maximal runs ``[lo, hi)`` of a
    sequence's longest side L (its query or key length, whichever is longer; 0 <= L <= ``longest``,
    the last run open to LENGTH_CAP) on which ``route(L)`` (what the dense call of such a sequence
    alone would take: a kernel and its tile) is the same, as ``(lo, hi, route)``. ``route`` may
    change only at the lengths in ``breaks`` (configs.length_breaks). Each class is one launch whose
    programs skip the other classes' sequences (common.seq_bounds), so that every sequence of a
    packed call gets bitwise what its own dense call gives, whichever tile its length picks.
    (The lengths are on the device: the host cannot split the batch without a sync.) Not
    ``packed`` (a dense call), or with LENGTH_CLASSES off: one class, ``route(longest)``."""
    if not packed or not LENGTH_CLASSES:
        return [(0, LENGTH_CAP, route(max(longest, 1)))]
    starts = [0, *sorted(b for b in set(breaks) if 0 < b <= longest)]
    classes: list[tuple[int, int, object]] = []
    for i, lo in enumerate(starts):
        r = route(max(lo, 1))
        hi = starts[i + 1] if i + 1 < len(starts) else LENGTH_CAP
        last = min(hi - 1, longest)
        if last > max(lo, 1) and route(last) != r:  # a rule that changes between breaks: say so, never guess
            raise RuntimeError(f"tritonattn: the tile changes between lengths {lo} and {last}, which "
                               "configs.length_breaks does not list")
        if classes and classes[-1][2] == r:
            classes[-1] = (classes[-1][0], hi, r)
        else:
            classes.append((lo, hi, r))
    return classes


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def int_class(a: int) -> int:
    """What Triton 3.6 specializes an integer argument on, as one int: -1 for the value 1 (a
    constexpr then), else divisibility by 16 (bit 0), the 32-bit range (bit 1, an i32 argument) and
    2^63 or more (bit 2, u64; otherwise i64). Never coarser than Triton's own key (tests/test_configs
    compares them): two integers of one class take the same compiled kernel."""
    return -1 if a == 1 else ((a & 15) == 0) + 2 * (-0x80000000 <= a <= 0x7FFFFFFF) + 4 * (a >= 1 << 63)


def _key_of(a):
    """What Triton specializes one argument on (see the module docstring)."""
    t = type(a)
    if t is int:
        return int_class(a)
    if t is torch.Tensor or isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() % 16 == 0
    if a is None:
        return None
    return t


_Tensor = torch.Tensor


def _args_key(args: tuple) -> tuple:
    """``tuple(map(_key_of, args))`` with the two common cases inlined (6 of 15 us at 56 arguments on
    a 2-core CPU); tensor subclasses and other types take ``_key_of``."""
    return tuple([(-1 if a == 1 else ((a & 15) == 0) + 2 * (-0x80000000 <= a <= 0x7FFFFFFF) + 4 * (a >= _U64))
                  if type(a) is int else (a.dtype, a.data_ptr() % 16 == 0) if type(a) is _Tensor else _key_of(a)
                  for a in args])


_U64 = 1 << 63


@functools.cache
def l2_bytes(device: torch.device) -> int:
    """L2 cache size of a GPU (50 MiB, an H100's / H200's, for CPU tensors)."""
    return torch.cuda.get_device_properties(device).L2_cache_size if device.type == "cuda" else 50 << 20


@functools.cache
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a GPU (4 under the interpreter: a few programs, each looping)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def _key(fn, grid, args: tuple, kwargs: dict) -> tuple:
    return fn, grid.__len__(), _args_key(args), tuple(kwargs.items()), args[0].device.index


def launch(fn, grid, args: tuple, kwargs: dict) -> None:
    """``fn[grid](*args, **kwargs)``: args are the runtime arguments in order, kwargs every
    constexpr plus num_warps / num_stages. On the device of ``args[0]``, which Triton (launching on
    the current device) would otherwise miss when it is not the current one."""
    if not args[0].is_cuda:  # CPU tensors: the interpreter
        fn[grid](*args, **kwargs)
        return
    _on_device(args[0].device.index, _launch_here, fn, grid, args, kwargs)


def _on_device(index: int, call, *call_args) -> None:
    """``call(*call_args)`` with device ``index`` current (entered only when it is not already)."""
    if index != torch._C._cuda_getDevice():
        with torch.cuda.device(index):
            call(*call_args)
    else:
        call(*call_args)


def _launch_here(fn, grid, args: tuple, kwargs: dict) -> None:
    """:func:`launch` on the current device (the device of the arguments)."""
    if not ENABLED:
        fn[grid](*args, **kwargs)
        return
    key = _key(fn, grid, args, kwargs)
    kernel = _cache.get(key)
    if kernel is None:
        kernel = fn[grid](*args, **kwargs)
        if hasattr(kernel, "result"):  # asynchronous compilation: keep the plain path
            return
        if len(_cache) >= _MAX_ENTRIES:
            _cache.clear()
        _cache[key] = (kernel, tail_values(fn, len(args), kwargs))
        return
    _run_here(kernel, grid, args, args[0].device.index)


def tail_values(fn, n_args: int, kwargs: dict) -> tuple:
    """The values of ``fn``'s parameters after its ``n_args`` runtime arguments (its constexprs), as
    the C launcher takes them: from ``kwargs``, else the parameter's default (a constexpr the library
    leaves at its default: without this a cached launch raised KeyError)."""
    params = _tail_params.get(fn)
    if params is None:
        f = fn.fn
        while not inspect.isfunction(f):  # a wrapper of a JITFunction: to the Python function
            f = f.fn
        tail = list(inspect.signature(f).parameters.values())[n_args:]
        params = _tail_params[fn] = tuple((p.name, p.default) for p in tail)
    return tuple(kwargs[name] if default is _EMPTY else kwargs.get(name, default) for name, default in params)


def cached(fn, grid, args: tuple, kwargs: dict):
    """The compiled entry :func:`launch` keeps for these arguments (None if it has none, or under
    the interpreter): launch plans (kernels/plan.py) keep it and call :func:`run_cached`."""
    if not ENABLED or not args[0].is_cuda:
        return None
    return _cache.get(_key(fn, grid, args, kwargs))


def run_cached(entry, grid, args: tuple, index: int | None = None) -> None:
    """Launch a cached entry: straight to Triton's C launcher (launch hooks honoured), on device
    ``index``, by default that of ``args[0]`` (the entry's kernel was loaded there: the cache key
    holds the device). Pointer arguments may be tensors or their addresses (ints; launch plans pass
    those where no hook is set: Triton's launcher takes an int as it is, and asks the driver about
    a tensor's pointer)."""
    if index is None:
        index = args[0].device.index
    _on_device(index, _run_here, entry, grid, args, index)


def hooked() -> bool:
    """Whether Triton's launch enter or exit hook (a profiler) is set: it gets each launch's
    metadata, built from the launch's arguments (tensors, then)."""
    hooks = triton.knobs.runtime
    return _hook(hooks.launch_enter_hook) is not None or _hook(hooks.launch_exit_hook) is not None


def _hook(h):
    """A launch hook, or None when it is an empty chain (Triton's default: calling it and building
    the launch metadata it would receive cost about 8 us per launch on the H200's host)."""
    return None if type(h) is _HookChain and not h.calls else h


_HookChain = getattr(triton.knobs, "HookChain", None)


def _run_here(entry, grid, args: tuple, index: int) -> None:
    kernel, tail = entry
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    stream = torch._C._cuda_getCurrentRawStream(index)
    hooks = triton.knobs.runtime
    enter, exit_ = _hook(hooks.launch_enter_hook), _hook(hooks.launch_exit_hook)
    meta = None if enter is None and exit_ is None else kernel.launch_metadata(grid, stream, *args, *tail)
    kernel.run(grid[0], g1, g2, stream, kernel.function, kernel.packed_metadata, meta, enter, exit_, *args, *tail)
