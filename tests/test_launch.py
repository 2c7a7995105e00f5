"""Kernel launches go to the device of their tensors: Triton launches on the current CUDA device,
so a call on tensors of another device (a model spread over GPUs in one process, as Hugging Face's
``device_map="auto"`` does) must make that device current for the launch. Checked here with the
CUDA device calls replaced (no GPU needed); test_gpu.py runs it for real where two GPUs are visible."""

import contextlib
import functools
import math
from types import SimpleNamespace

import pytest
import torch

from tritonattn import configs
from tritonattn.kernels import launch


class _FakeCuda:
    """The current device and the stack of ``torch.cuda.device`` contexts, as plain Python."""

    def __init__(self, current):
        self.current, self.entered = current, []

    def get(self):
        return self.current

    @contextlib.contextmanager
    def device(self, index):
        saved, self.current = self.current, index
        self.entered.append(index)
        try:
            yield
        finally:
            self.current = saved


def _tensor_on(index):
    return SimpleNamespace(is_cuda=True, device=SimpleNamespace(index=index))


@pytest.mark.parametrize("current,target", [(1, 0), (0, 1), (0, 0)])
@pytest.mark.parametrize("entry", ["launch", "run_cached"])
def test_launch_runs_on_the_tensors_device(monkeypatch, current, target, entry):
    fake = _FakeCuda(current)
    seen = []
    # (the fakes undone at the test's end, before other fixtures' teardown calls into torch.cuda:
    # conftest's memory release on a GPU met the fake torch.cuda.device)
    with monkeypatch.context() as m:
        m.setattr(torch._C, "_cuda_getDevice", fake.get, raising=False)  # absent from CPU builds
        m.setattr(torch.cuda, "device", fake.device)
        m.setattr(launch, "_launch_here", lambda fn, grid, args, kwargs: seen.append(fake.current))
        m.setattr(launch, "_run_here", lambda e, grid, args, index: seen.append((fake.current, index)))
        args = (_tensor_on(target), 3)
        if entry == "launch":
            launch.launch(None, (1,), args, {})
        else:
            launch.run_cached(None, (1,), args)
    assert seen == ([target] if entry == "launch" else [(target, target)])
    # a context only when the tensors' device is not the current one, and the current one restored
    assert fake.entered == ([] if current == target else [target])
    assert fake.current == current


@pytest.mark.parametrize("hooked", [False, True, "exit-only"])
def test_cached_launch_skips_empty_hook_chains_and_honours_real_hooks(monkeypatch, hooked):
    """Triton's default hooks are empty chains: a cached launch passes None (no metadata built);
    a profiler's hook added to a chain is still called with the launch's metadata."""
    import triton

    seen = []
    chain_in, chain_out = triton.knobs.HookChain(), triton.knobs.HookChain(reversed=True)
    if hooked is True:
        chain_in.add(lambda meta: seen.append(("enter", meta)))
    elif hooked == "exit-only":
        chain_out.add(lambda meta: seen.append(("exit", meta)))
    monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", chain_in)
    monkeypatch.setattr(triton.knobs.runtime, "launch_exit_hook", chain_out)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 7, raising=False)
    runs = []
    kernel = SimpleNamespace(function=1, packed_metadata=2, launch_metadata=lambda grid, stream, *a: {"grid": grid},
                             run=lambda *a: runs.append(a))
    launch._run_here((kernel, (4,)), (3, 2), ("x", 5), 0)
    (call,) = runs
    assert call[:5] == (3, 2, 1, 7, 1) and call[-3:] == ("x", 5, 4)
    meta, enter, exit_ = call[6:9]
    if hooked is True:
        assert meta == {"grid": (3, 2)} and enter is chain_in and exit_ is None
        enter(meta)
        assert seen == [("enter", meta)]
    elif hooked == "exit-only":  # the exit hook still gets the metadata
        assert meta == {"grid": (3, 2)} and enter is None and exit_ is chain_out
        exit_(meta)
        assert seen == [("exit", meta)]
    else:
        assert meta is None and enter is None and exit_ is None


def test_length_classes():
    """A packed call's length classes: maximal runs of the longest side on which the route is the
    same, from 0; breaks past the call's longest sequence dropped, the last class open to LENGTH_CAP."""
    from tritonattn.kernels.common import LENGTH_CAP
    from tritonattn.kernels.launch import length_classes

    def route(n):
        return "short" if n <= 1024 else "gluon" if n >= 2048 else "table"

    breaks = {1025, 2048, 512, 32768}
    assert length_classes(route, 5000, breaks) == [(0, 1025, "short"), (1025, 2048, "table"),
                                                   (2048, LENGTH_CAP, "gluon")]
    assert length_classes(route, 1500, breaks) == [(0, 1025, "short"), (1025, LENGTH_CAP, "table")]
    assert length_classes(route, 700, breaks) == [(0, LENGTH_CAP, "short")]
    assert length_classes(route, 0, breaks) == [(0, LENGTH_CAP, "short")]
    # equal neighbours merge; equal routes apart stay apart
    assert length_classes(lambda n: "a", 5000, breaks) == [(0, LENGTH_CAP, "a")]
    assert length_classes(lambda n: "w" if 32 <= n < 41 else "t", 100, {32, 41, 50}) == [
        (0, 32, "t"), (32, 41, "w"), (41, LENGTH_CAP, "t")]
    # a rule changing where no break says so: an error, not a class with a wrong tile
    with pytest.raises(RuntimeError, match="between lengths 1025 and 5000"):
        length_classes(route, 5000, {1025})


@pytest.mark.parametrize("masked_waves", [False, True], ids=["default", "masked-waves"])
def test_length_breaks(monkeypatch, masked_waves):
    """Where a call's tiles may change with its length (configs): past SHORT_SEQLEN, at each Gluon
    kernel's first lengths (not "never", math.inf), and at the fused dQ's, the masked one for every
    group."""
    monkeypatch.setattr(configs, "FUSED_DQ_MASKED_WAVES", masked_waves)
    breaks = configs.length_breaks()
    assert configs.SHORT_SEQLEN + 1 in breaks and math.inf not in breaks
    for lengths in configs.GLUON_MIN_SEQLEN.values():
        for pair in lengths.values():
            assert {n for n in pair if n != math.inf} <= breaks
    for head_dim, pair in configs.FUSED_DQ_MIN_SEQLEN.items():
        assert {n for n in pair if n is not None} <= breaks
        for group in range(1, 17):
            for mask in (False, True):
                table = pair[mask]
                grid = configs.FUSED_DQ_GRID_FIRST.get(head_dim, (None, None))[mask]
                if table is None:  # never fused with this mask at this head dim
                    assert not any(configs.fused_dq_serves(head_dim, mask, n, group) for n in (1, 2**12, 2**20))
                    continue
                sections = configs.fused_sections(head_dim, group, table)
                if not sections and grid is None:  # sections don't serve the group, and no 2-d grid length
                    assert not configs.fused_dq_serves(head_dim, mask, 2**20, group), (head_dim, group, mask)
                    continue
                first = next(n for n in range(1, 2**16) if configs.fused_dq_serves(head_dim, mask, n, group))
                assert first in breaks, (group, mask)
                # monotone: fused at every length from the first (length classes rely on it)
                assert all(configs.fused_dq_serves(head_dim, mask, n, group) for n in range(first, 2**15, 61))
                # the table's first length where sections serve it, else the 2-d grid's
                assert first == (table if sections else max(table, grid)), (head_dim, group, mask)
                # a launch of one to FUSED_SECTION_WAVES waves (masked: FUSED_DQ_MASKED_WAVES) takes the
                # table's length; one under a wave or past the waves the group's; monotone for each
                waves = configs.FUSED_SECTION_WAVES
                for programs, few in ((132, True), (waves * 132, True), (131, False), (waves * 132 + 1, False)):
                    serves = functools.partial(configs.fused_dq_serves, head_dim, mask, group=group,
                                               programs=programs, sms=132)
                    first_here = next(n for n in range(1, 2**16) if serves(n))
                    assert all(serves(n) for n in range(first_here, 2**15, 61)), (head_dim, group, mask, programs)
                    assert first_here == (table if few and mask and configs.FUSED_DQ_MASKED_WAVES else first), \
                        (head_dim, group, mask, programs)


def test_length_classes_off(monkeypatch):
    """launch.LENGTH_CLASSES off (the tuners' baseline): one class, the longest sequence's route."""
    from tritonattn.kernels.common import LENGTH_CAP
    from tritonattn.kernels.launch import length_classes

    monkeypatch.setattr(launch, "LENGTH_CLASSES", False)
    assert length_classes(lambda n: "short" if n <= 1024 else "long", 5000, {1025}) == [(0, LENGTH_CAP, "long")]
    assert length_classes(lambda n: "short" if n <= 1024 else "long", 0, {1025}) == [(0, LENGTH_CAP, "short")]


def test_descriptor_scratch_kept_per_stream(monkeypatch):
    """fwd._scratch (Triton's allocator for in-kernel descriptors): outside graph capture one buffer per
    (device, stream), reused by the next launch on that stream and grown when a launch needs more;
    under capture a fresh tensor every time (the graph's pool)."""
    from tritonattn.kernels import fwd, kept

    # the patches (torch.empty, the current device among them) are undone when the body ends: an autouse
    # fixture's teardown that asks torch about the current device must not see device 1 (GPU run, 2026-12-07)
    with monkeypatch.context() as m:
        made, real_empty = [], torch.empty

        def empty(size, dtype, device):
            made.append(size)
            return real_empty(size, dtype=dtype)  # (CPU stand-ins)

        capturing = [False]
        m.setattr(fwd.torch, "empty", empty)
        m.setattr(fwd.torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
        m.setattr(fwd.torch._C, "_cuda_getDevice", lambda: 0, raising=False)  # (CPU builds lack it)
        m.setattr(fwd, "_descriptor_scratch", kept.Kept(limit=fwd._SCRATCH_KEPT))
        a = fwd._scratch(4096, 128, 7)
        assert fwd._scratch(1000, 128, 7) is a and a.numel() >= 4096  # the same stream: reused
        b = fwd._scratch(4096, 128, 8)
        assert b is not a  # another stream: its own
        big = fwd._scratch(a.numel() + 1, 128, 7)
        assert big is not a and big.numel() > a.numel() and fwd._scratch(10, 128, 7) is big  # grown, then kept
        m.setattr(fwd.torch._C, "_cuda_getDevice", lambda: 1, raising=False)
        assert fwd._scratch(10, 128, 7) is not big  # the same stream handle on another device
        n = len(made)
        huge = fwd._SCRATCH_KEPT + 1  # a large request: fresh each time, not kept
        kept = fwd._scratch(10, 128, 7)  # (device 1's, kept above)
        assert fwd._scratch(huge, 128, 7) is not fwd._scratch(huge, 128, 7) and fwd._scratch(10, 128, 7) is kept
        assert len(made) == n + 2
        n = len(made)
        capturing[0] = True
        c, d = fwd._scratch(10, 128, 7), fwd._scratch(10, 128, 7)
        assert c is not d and len(made) == n + 2 and c.numel() == 10  # under capture: fresh, exact
