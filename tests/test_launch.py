"""Kernel launches go to the device of their tensors: Triton launches on the current CUDA device,
so a call on tensors of another device (a model spread over GPUs in one process, as Hugging Face's
``device_map="auto"`` does) must make that device current for the launch. Checked here with the
CUDA device calls replaced (no GPU needed); test_gpu.py runs it for real where two GPUs are visible."""

import contextlib
from types import SimpleNamespace

import pytest
import torch

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
    monkeypatch.setattr(torch._C, "_cuda_getDevice", fake.get, raising=False)  # absent from CPU builds
    monkeypatch.setattr(torch.cuda, "device", fake.device)
    seen = []
    monkeypatch.setattr(launch, "_launch_here", lambda fn, grid, args, kwargs: seen.append(fake.current))
    monkeypatch.setattr(launch, "_run_here", lambda e, grid, args, index: seen.append((fake.current, index)))
    args = (_tensor_on(target), 3)
    if entry == "launch":
        launch.launch(None, (1,), args, {})
        assert seen == [target]
    else:
        launch.run_cached(None, (1,), args)
        assert seen == [(target, target)]
    # a context only when the tensors' device is not the current one, and the current one restored
    assert fake.entered == ([] if current == target else [target])
    assert fake.current == current
