"""Test setup: without a GPU, kernels run on CPU tensors under the Triton interpreter.

TRITON_INTERPRET must be set before triton is imported, so it is set here, first.
"""

import os
import re

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# checks that need a device sync (cu_seqlens / cache_seqlens contents) are on in the tests, also on the
# GPU: without them a bad cache_seqlens indexes past the cache (a device assert that poisons the process)
os.environ.setdefault("TRITONATTN_DEBUG", "1")

import pytest  # noqa: E402

from tritonattn.testing import attention_ref, check_close  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def _compile_cost(item) -> int:
    """Rough rank of a test's compile time on the GPU: fp32 kernels at large head dims take
    200-265 s each on the H200 (ieee products unroll to FMA code), everything else seconds."""
    name = item.nodeid
    if "fp32" not in name:
        return 0
    dims = [int(m) for m in re.findall(r"-D(\d+)-", name)]
    return 2 if dims and max(dims) >= 160 else 1


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        # longest first: a dozen workers finish together instead of waiting on a late fp32 compile
        items.sort(key=lambda item: -_compile_cost(item))
        return
    skip = pytest.mark.skip(reason="GPU tier: needs a CUDA device (run scripts/gpu_check.sh on the H200)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _release_gpu_memory():
    """Each test starts without launch plans (kernels/plan.py: a test that patches the config tables
    must not replay another test's launches). After it, cached GPU memory is given back if much is
    reserved: a dozen pytest workers share one GPU, and each one's caching allocator would
    otherwise keep its peak."""
    from tritonattn.kernels import plan

    plan.clear()
    yield
    if torch.cuda.is_available() and torch.cuda.memory_reserved() > 2 * 2**30:
        torch.cuda.empty_cache()


@pytest.fixture(autouse=True)
def _plans_from_the_first_call(monkeypatch):
    """Launch plans recorded at a signature's first call (kernels/plan.py's RECORD_AT = 1): most
    tests check a replay after one recording call. The library's default (the second call) has
    tests of its own that set it back (test_plan.py's ``test_plan_recorded_at_the_second_call`` and
    the others that name RECORD_AT, test_gpu.py's graph capture at the recording call)."""
    from tritonattn.kernels import plan

    monkeypatch.setattr(plan, "RECORD_AT", 1)


def set_env(monkeypatch, name: str, value: str | None) -> None:
    """``name`` set to ``value`` for the test, or unset when ``value`` is None."""
    if value is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, value)


def case_id(B, Sq, Sk, Hq, Hkv, D, causal, dtype, extra=""):
    """Readable test id, e.g. ``B2-Sq17-Sk65-H4/2-D40-causal-fp16``."""
    parts = [f"B{B}", f"Sq{Sq}", f"Sk{Sk}", f"H{Hq}/{Hkv}", f"D{D}", "causal" if causal else "full",
             DTYPE_NAMES[dtype]]
    if extra:
        parts.append(extra)
    return "-".join(parts)


@pytest.fixture
def poison(monkeypatch):
    """Every buffer the library allocates starts as NaN, so an element the kernels fail to write
    shows up as NaN in the result (the checks reject NaN)."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def nan_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    def nan_empty_like(*args, **kwargs):
        t = real_empty_like(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", nan_empty)
    monkeypatch.setattr(torch, "empty_like", nan_empty_like)
    # buffers kept per stream across calls (kernels/kept.py) that kernels read: fresh ones, whose
    # (uint8) blocks start as 0xff bytes, a NaN in fp16 / bf16 / fp32 (an earlier call's values
    # would hide a missed write)
    from tritonattn.kernels import bwd, decode, kept

    def nan_block(shape, dtype, device):
        t = real_empty(shape, dtype=dtype, device=device)
        return t.fill_(255) if dtype == torch.uint8 else t.fill_(float("nan"))

    for module, name in ((bwd, "_deltas"), (decode, "_o_parts"), (decode, "_lse_parts")):
        buffers = kept.Kept()
        buffers._fresh = nan_block
        monkeypatch.setattr(module, name, buffers)


def check_against_reference(q, k, v, out, lse, grads, dout, causal, softmax_scale=None, bias=None, dbias=None,
                            **variants):
    """Check out, lse, (dq, dk, dv) and dbias against the fp64 reference with the tolerance rule.
    ``variants`` are passed to :func:`attention_ref` (window_size, softcap, alibi_slopes, mask, ...)."""
    def leaves():
        ts = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        if bias is not None:
            ts.append(bias.detach().clone().requires_grad_(dbias is not None))
        return ts

    ref_in, pt_in = leaves(), leaves()
    kw = dict(causal=causal, softmax_scale=softmax_scale, **variants)
    out_ref, lse_ref = attention_ref(*ref_in[:3], bias=ref_in[3] if bias is not None else None, **kw)
    out_pt, lse_pt = attention_ref(*pt_in[:3], bias=pt_in[3] if bias is not None else None, upcast=False, **kw)
    check_close("out", out, out_ref, out_pt, k=2)
    if lse is not None:
        check_close("lse", lse, lse_ref, lse_pt, k=2)
    if grads is None:
        return
    wrt = 4 if dbias is not None else 3
    g_ref = torch.autograd.grad(out_ref, ref_in[:wrt], dout.double())
    g_pt = torch.autograd.grad(out_pt, pt_in[:wrt], dout)
    magnitude = max(r.abs().max().item() if r.numel() else 0.0 for r in g_ref)
    names = ("dq", "dk", "dv", "dbias")
    mine = (*grads, dbias) if dbias is not None else grads
    for name, g, r, p in zip(names, mine, g_ref, g_pt):
        if name == "dbias":
            assert g.shape == bias.shape and g.dtype == bias.dtype, "dbias must come back in the bias's shape and dtype"
        check_close(name, g, r, p, k=3, magnitude=magnitude)


def check_varlen_against_reference(q, k, v, out, lse, grads, dout, cu_seqlens, causal):
    """Packed variable-length results (one ``cu_seqlens`` for queries and keys): each non-empty
    sequence against the reference on that sequence alone."""
    for a, z in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        if z > a:
            check_against_reference(q[a:z][None], k[a:z][None], v[a:z][None], out[a:z][None], lse[:, a:z][None],
                                    tuple(g[a:z][None] for g in grads), dout[a:z][None], causal)


def in_both_program_orders(monkeypatch, run):
    """``run()`` (a tuple of tensors) in the blocks-first program order, then heads first
    (configs.HEADS_FIRST; launch plans cleared before each, so the launchers really launch).
    Asserts the results are bitwise equal; returns (heads-first results, the grid each kernel was
    launched with heads first, by kernel name)."""
    from tritonattn import configs
    from tritonattn.kernels import launch, plan

    monkeypatch.setattr(configs, "HEADS_FIRST", False)
    plan.clear()
    base = run()
    monkeypatch.setattr(configs, "HEADS_FIRST", True)
    plan.clear()
    grids, real = {}, launch.launch

    def record(fn, grid, *args):
        grids.setdefault(fn.__name__, grid)
        real(fn, grid, *args)

    monkeypatch.setattr(launch, "launch", record)
    swapped = run()
    monkeypatch.setattr(launch, "launch", real)
    assert len(base) == len(swapped)
    for a, b in zip(base, swapped):
        assert torch.equal(a, b)
    return swapped, grids


def pytest_runtest_logreport(report):
    """With TRITONATTN_FAILURE_LOG set (scripts/gpu_check.sh sets it), append each failure's
    traceback to that file as it happens: a run stopped by a wall-clock limit then still says why
    its tests failed (pytest prints tracebacks only at the end of a session). A failure that is a
    CUDA out-of-memory error also goes to ``<that file>.oom``, one node id a line: a dozen workers
    share one GPU, and gpu_check.sh runs those tests again one at a time."""
    path = os.environ.get("TRITONATTN_FAILURE_LOG")
    if path and report.failed and not os.environ.get("PYTEST_XDIST_WORKER"):  # the controller writes once
        text = report.longreprtext
        with open(path, "a") as f:
            f.write(f"\n===== {report.nodeid} ({report.when})\n{text[-6000:]}\n")
        if "OutOfMemoryError" in text:
            with open(path + ".oom", "a") as f:
                f.write(report.nodeid + "\n")


def to_paged(k_cache, v_cache, page_size, gen):
    """The same cache laid out in shuffled pages (``gen``: a CPU generator, or None for the global
    one), with its block table."""
    B, S, H, D = k_cache.shape
    nb = S // page_size
    perm = torch.randperm(B * nb, generator=gen).to(DEVICE)
    kp = torch.empty(B * nb, page_size, H, D, dtype=k_cache.dtype, device=DEVICE)
    vp = torch.empty_like(kp)
    kp[perm] = k_cache.reshape(B * nb, page_size, H, D)
    vp[perm] = v_cache.reshape(B * nb, page_size, H, D)
    return kp, vp, perm.reshape(B, nb).to(torch.int32)
