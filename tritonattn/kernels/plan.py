"""Launch plans: what a launcher did for one call signature, replayed for the next call with it.

A launcher (``attention_forward``, ``decode_forward``) spends most of a small call's host time in
Python that depends only on the call's signature: shapes, strides, dtype and device of its tensors
and the variant options. Picking the tile config, building the constexpr flags and the 40-60
kernel arguments give the same result every time for the same signature. So the first call of a
signature records, through a :class:`Builder`, the buffers it allocates and the kernels it launches,
with every tensor argument replaced by a slot (an input of the call or one of its buffers); the
plan is kept under the signature, and a later call with the same signature only allocates the
buffers and replays the launches with its own tensors: on a GPU straight to the compiled kernels
(kept per plan by the tensors' 16-byte alignment, the one property of theirs that the key leaves
out and Triton specializes on), under the interpreter through :func:`launch.launch`.

Replaying is exact: the same kernels with the same scalar arguments. A plan is kept only when it is
safe to replay:
- every tensor argument of every launch is an input slot or a recorded buffer (else not kept);
- a tensor in two input roles (``f(x, x, x)``, or varlen's one ``cu_seqlens`` for q and k) is bound
  to its first slot, so the plan replays only calls with the same roles shared (:meth:`Plan.run`
  returns None for the others, which take the launcher's full path);
- no tile config is forced (``configs.override``), autotuning is off, and launches are real
  (``launch.ENABLED``): those change what a launch does without changing the signature.

An entry point may also reach a plan without its launcher (:func:`link`, :func:`linked`): a key of
its own, built from its arguments, that names everything the launcher's key is made of, for calls
that passed its checks once (the inference calls of flash_attn_func and the SDPA drop-in:
interface._fast_key).

A plan may also take integer *values* at replay (:meth:`Builder.launch`'s ``values``): arguments
that the launcher computes from the call's shapes and strides, left out of the plan's key. The
dense decoding route keys its plan without the cache's length (kernels/decode.py), so that a
generation loop over a cache one row longer at every step (a new shape each call) replays one plan
with that step's length, strides and split length. The compiled kernels a replay takes are then
kept by those values' integer classes too (what Triton specializes an integer on: launch.int_class).

A signature's plan is recorded at its second call (:data:`RECORD_AT`), not its first: calls whose
shapes change at every step (a generation loop over a cache that grows by one row, as transformers'
DynamicCache does) never replay, and recording them cost about a third of their host time and
filled the plan store with plans never used. The keys of signatures seen once are kept in a bounded
dict; a signature's second call records, its third and later replay.

``clear()`` drops every plan, link and seen key (the tests do between tests that patch the config
tables).
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from operator import itemgetter

import torch

from tritonattn import autotune, configs
from tritonattn.kernels import launch as _launch

_plans: dict = {}
_links: dict = {}  # an entry point's key of a call -> (the plan its launcher keeps for it, extra)
_MAX_PLANS = 4096
_seen: dict = {}  # keys of signatures called once, not recorded yet (RECORD_AT = 2)
_seen_links: dict = {}  # entry keys seen once whose plan takes values (link_plan)
_MAX_SEEN = 1024
# the call of a signature that records its plan: 2, the second (1: the first, as before the fortieth
# session; tests that need a plan from one call set it)
RECORD_AT = 2
hits = 0  # replayed calls (the tests read it)
# a replayed launch passes its tensors' addresses (ints) to Triton's C launcher, which checks every
# tensor argument's pointer with the driver (cuPointerGetAttribute) and takes an int as it is: the
# plan's key already fixes the device, dtypes and alignment those checks would guard.
# False: the tensors (as before; scripts/overhead.py compares)
POINTERS = True


def clear() -> None:
    _plans.clear()
    _links.clear()
    _seen.clear()
    _seen_links.clear()


def _record_now(key, seen: dict = _seen) -> bool:
    """Whether this call of ``key``'s signature records its plan (:data:`RECORD_AT`): with 2, not
    the first call, whose key is kept in ``seen`` (bounded: cleared when full) for the second."""
    if key is None:
        return False
    if RECORD_AT <= 1 or seen.pop(key, False):
        return True
    if len(seen) >= _MAX_SEEN:
        seen.clear()
    seen[key] = True
    return False


def link(entry_key, key, extra=None) -> None:
    """Let ``entry_key`` reach the plan kept under the launcher's ``key`` (if one is kept), with
    ``extra`` (what the launcher does besides the plan, e.g. setting Triton's allocator). The entry
    point's key must determine the launcher's: it holds all that the launcher's key is made of (or
    what that is a function of), and the link is made only for calls that passed the entry point's
    checks."""
    p = _plans.get(key)
    if p is not None:
        link_plan(entry_key, p, extra)


def link_plan(entry_key, p: Plan, extra=None) -> None:
    """:func:`link` to the plan ``p`` itself."""
    # a plan that takes values (keyed without the lengths) serves calls of many entry keys: a growing
    # cache's calls, each key seen once, link nothing (as a signature seen once records nothing)
    if p.n_values and entry_key not in _links and not _record_now(entry_key, _seen_links):
        return
    if len(_links) >= _MAX_PLANS:  # the oldest link goes (a link in use is kept recent: refresh)
        del _links[next(iter(_links))]
    _links[entry_key] = (p, extra)


def refresh(entry_key) -> None:
    """Make ``entry_key``'s link the most recent (the last that :func:`link_plan` drops when the
    store is full): for links that serve every call of a loop that links a new key at each call
    (a many-layer generation loop over a growing cache links each step's shape from its second layer)."""
    if 2 * len(_links) < _MAX_PLANS:  # nothing is dropped before the store is full: refreshed from half full
        return
    entry = _links.pop(entry_key, None)
    if entry is not None:
        _links[entry_key] = entry


def linked(entry_key) -> tuple | None:
    """``(plan, extra)`` linked to ``entry_key`` (:func:`link`), or None (none, or replaying is off:
    see :func:`replay`)."""
    return _links.get(entry_key) if _replayable() else None


def replay(key, inputs: tuple, device, values: tuple = ()) -> tuple | None:
    """The outputs of the plan kept for ``key`` replayed on ``inputs`` (and ``values``, the integers
    the plan takes at replay), or None (no plan, the inputs do not share the tensors the recorded
    call shared, a config is forced or autotuning is on): the launcher then takes its full path
    through a :class:`Builder`."""
    p = _plans.get(key)
    if p is None or not _replayable():
        return None
    return p.run(inputs, device, values)


def _replayable() -> bool:
    return _launch.ENABLED and not configs._override and not autotune.env_enabled()


class Plan:
    __slots__ = ("aliases", "allocs", "zeros", "launches", "outputs", "compiled", "used", "n_values", "makers")

    def __init__(self, aliases, allocs, zeros, launches, outputs, n_inputs: int, n_values: int = 0):
        self.aliases, self.allocs, self.zeros, self.outputs = aliases, allocs, zeros, outputs
        self.n_values = n_values
        # each buffer's allocation as one call with its arguments bound (the plan's key fixes the
        # device): torch's factories take the sizes unpacked, which they parse faster than a tuple
        # (2-core CPU: torch.empty 1.4 against 2.2 us)
        self.makers = tuple(functools.partial(f, *shape, dtype=dtype, device=device)
                            if f in (torch.empty, torch.zeros) and shape else
                            functools.partial(f, shape, dtype=dtype, device=device)
                            for f, shape, dtype, device in allocs)
        n_pool = n_inputs + len(allocs) + n_values
        # each launch's arguments in one C call: an itemgetter over the call's buffers, then its
        # values, then the launch's constant arguments (a slot's buffer where the recorded call had
        # a tensor, a value's index where it had a value)
        self.launches = []
        used = set()
        for fn, grid, consts, slots, kwargs, value_slots in launches:
            where = [n_pool + i for i in range(len(consts))]
            for i, s in slots:
                where[i] = s
                used.add(s)
            for i, j in value_slots:
                where[i] = n_pool - n_values + j
            self.launches.append((fn, grid, list(consts), _getter(where), kwargs))
        self.used = tuple(sorted(used))  # the buffers the launches take (tensors at every replay)
        # on a GPU: the compiled kernel of each launch, by the 16-byte alignment of the tensors (the
        # one thing about them that can change the kernel and is not in the plan's key)
        self.compiled: dict = {}

    def run(self, inputs: tuple, device, values: tuple = ()) -> tuple | None:
        """The outputs of the replayed call, or None (nothing done) when ``inputs`` do not share
        the tensors the recorded call shared. ``values``: the plan's :attr:`n_values` integers."""
        for i, j in self.aliases:
            if inputs[i] is not inputs[j]:
                return None
        bufs = list(inputs)
        for make in self.makers:
            bufs.append(make())
        for s in self.zeros:
            bufs[s].zero_()
        if values:
            bufs += values
        if device.type != "cuda":  # the interpreter
            for fn, grid, consts, getter, kwargs in self.launches:
                _launch.launch(fn, grid, getter(bufs + consts), kwargs)
        else:
            ptrs = bufs[:]
            for s in self.used:
                ptrs[s] = bufs[s].data_ptr()
            aligned = tuple([ptrs[s] % 16 == 0 for s in self.used])
            if values:  # (the compiled kernel follows the values' integer classes too)
                aligned += _launch._args_key(values)
            entries = self.compiled.get(aligned)
            if entries is None:
                launches = [(fn, grid, getter(bufs + consts), kwargs)
                            for fn, grid, consts, getter, kwargs in self.launches]
                for fn, grid, args, kwargs in launches:
                    _launch.launch(fn, grid, args, kwargs)
                entries = [_launch.cached(fn, grid, args, kwargs) for fn, grid, args, kwargs in launches]
                if None not in entries:
                    self.compiled[aligned] = entries
            else:
                # the addresses, not the tensors, unless a launch hook (a profiler) wants the
                # launch's metadata: Triton's launcher asks the driver about a tensor's pointer
                # (cuPointerGetAttribute) at every launch, and takes an int as it is
                pool = ptrs if POINTERS and not _launch.hooked() else bufs
                index = device.index
                for (_, grid, consts, getter, _), entry in zip(self.launches, entries):
                    _launch.run_cached(entry, grid, getter(pool + consts), index)
        global hits
        hits += 1
        return tuple(bufs[i] for i in self.outputs)


def _getter(where: list):
    """``lambda pool: tuple(pool[i] for i in where)``, as one C call."""
    if len(where) == 1:
        i = where[0]
        return lambda pool: (pool[i],)
    return itemgetter(*where)


class Builder:
    """Runs a launcher's allocations and launches, and records them as a plan."""

    def __init__(self, key, inputs: tuple, n_values: int = 0):
        self.key = key
        self.n_values = n_values
        self.ok = _replayable() and _record_now(key)
        self.slot: dict[int, int] = {}
        self.aliases: list = []
        for i, t in enumerate(inputs if self.ok else ()):  # (a call that records nothing maps nothing)
            if t is not None:
                if id(t) in self.slot:  # one tensor in two roles
                    self.aliases.append((self.slot[id(t)], i))
                else:
                    self.slot[id(t)] = i
        self.n_inputs = len(inputs)
        self.allocs: list = []
        self.bufs: list = []  # kept alive so that their ids stay theirs while recording
        self.zeros: list = []
        self.launches: list = []

    def zero(self, t: torch.Tensor, zero: bool) -> torch.Tensor:
        """An input the launches write into, zeroed first when ``zero`` (replayed before the launches)."""
        if zero:
            t.zero_()
            if not self.ok:
                return t
            s = self.slot.get(id(t))
            if s is None:
                self.ok = False
            else:
                self.zeros.append(s)
        return t

    def unplanned(self, t: torch.Tensor) -> torch.Tensor:
        """A tensor made outside the recorded buffers: this call keeps no plan."""
        self.ok = False
        return t

    def alloc(self, factory, shape, dtype, device) -> torch.Tensor:
        t = factory(shape, dtype=dtype, device=device)
        if not self.ok:
            return t
        self.slot[id(t)] = self.n_inputs + len(self.allocs)
        self.allocs.append((factory, tuple(shape), dtype, device))
        self.bufs.append(t)
        return t

    @contextmanager
    def all_or_none(self):
        """Launches that belong together (a config's dV and dK launches): if one raises (out of
        shared memory, and configs.fit retries with a smaller tile), none of them stays recorded."""
        mark = len(self.launches)
        try:
            yield
        except BaseException:
            del self.launches[mark:]
            raise

    def launch(self, fn, grid, args: tuple, kwargs: dict, values: tuple = ()) -> None:
        """Launch, and record the launch. ``values``: ``(position, index)`` pairs, the arguments at
        those positions are the plan's value ``index`` (given again at each replay, :meth:`Plan.run`)."""
        _launch.launch(fn, grid, args, kwargs)  # raises (e.g. out of shared memory) before recording
        if not self.ok:
            return
        consts, slots = list(args), []
        for i, _ in values:
            consts[i] = None
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                s = self.slot.get(id(a))
                if s is None:  # a tensor the call's signature does not account for
                    self.ok = False
                    return
                slots.append((i, s))
                consts[i] = None
        self.launches.append((fn, tuple(grid), tuple(consts), tuple(slots), dict(kwargs), tuple(values)))

    def finish(self, outputs: tuple) -> tuple:
        """Keep the plan (when replayable) and return ``outputs``."""
        if self.ok and self.key is not None:
            slots = tuple(self.slot.get(id(t)) for t in outputs)
            if None not in slots:
                if len(_plans) >= _MAX_PLANS:
                    _plans.clear()
                _plans[self.key] = Plan(tuple(self.aliases), tuple(self.allocs), tuple(self.zeros),
                                       tuple(self.launches), slots, self.n_inputs, self.n_values)
        return outputs
