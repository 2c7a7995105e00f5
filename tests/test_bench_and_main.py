"""The benchmark harness and the main job run end to end (under the interpreter on CPU)."""

import csv
import os

import torch
from conftest import DEVICE

from tritonattn.bench.__main__ import grid_shapes, main
from tritonattn.bench.runner import Shape


def test_flops_convention():
    s = Shape("t", 2, 4, 2, 128, 256, 64, False, torch.float16)
    assert s.flops("fwd") == 4 * 2 * 4 * 128 * 256 * 64
    assert s.flops("bwd") == 2.5 * s.flops("fwd")
    assert s.flops("fwd+bwd") == 3.5 * s.flops("fwd")
    c = Shape("t", 2, 4, 2, 128, 128, 64, True, torch.float16)
    assert c.flops("fwd") == 2 * 4 * 128 * 128 * 64 * 4 / 2


def test_grids():
    llama = grid_shapes("llama")
    assert len(llama) == 40 and {s.seqlen_q for s in llama} == {2**i for i in range(5, 15)}
    assert all((s.batch, s.heads, s.kv_heads, s.head_dim) == (4, 32, 8, 128) for s in llama)
    fa = grid_shapes("fa")
    assert all(s.batch * s.seqlen_q == 16384 and s.heads * s.head_dim == 2048 for s in fa)
    assert len(grid_shapes("seed004")) == 20


def test_tiny_grid_end_to_end(tmp_path, capsys):
    # tritonattn only: on a GPU the default backends include the peers
    rc = main(["--grid", "tiny", "--seqlens", "40", "--modes", "fwd", "bwd", "--backends", "tritonattn", "--out",
               str(tmp_path)])
    assert rc == 0
    rows = list(csv.DictReader(open(tmp_path / "results.csv")))
    assert len(rows) == 4  # causal and not, fwd and bwd
    for r in rows:
        assert r["backend"] == "tritonattn" and float(r["ms"]) > 0 and float(r["tflops"]) > 0
        assert float(r["max_err"]) < 1e-2
        for key in ("gpu", "torch", "triton", "commit", "source", "shape", "mode", "peak_mem_gb"):
            assert key in r
    assert "| B1-H2/1-S40-D64-causal-fp16 | bwd |" in capsys.readouterr().out


def test_time_budget_stops_between_shapes(tmp_path, capsys):
    """--time-budget 0: the first shape is measured, no other; its rows are in the CSV and the table."""
    rc = main(["--grid", "tiny", "--seqlens", "40", "--modes", "fwd", "--time-budget", "0", "--backends", "tritonattn",
               "--out", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "time budget of 0 s spent: 1 of 2 shapes measured" in out
    rows = list(csv.DictReader(open(tmp_path / "results.csv")))
    assert len(rows) == 1 and float(rows[0]["ms"]) > 0
    assert f"| {rows[0]['shape']} | fwd |" in out


def test_variant_backends_report_their_cost(tmp_path, capsys):
    rc = main(["--grid", "tiny", "--seqlens", "40", "--causal", "yes", "--modes", "fwd", "--out", str(tmp_path),
               "--backends", "tritonattn", "tritonattn+window256", "tritonattn+bias-grad", "tritonattn+dropout"])
    assert rc == 0
    out = capsys.readouterr().out
    for variant in ("tritonattn+window256", "tritonattn+bias-grad", "tritonattn+dropout"):
        assert f"| {variant} |" in out  # a row of the time-ratio table


def test_grid_overrides():
    """--batches picks the llama / decode grids' batch sizes, --head-dims the fa grid's head dims."""
    dec = grid_shapes("decode", seqlens=[65536, 131072], batches=[64])
    assert [(s.batch, s.seqlen_k) for s in dec] == [(64, 65536), (64, 131072)]
    assert {s.batch for s in grid_shapes("llama", seqlens=[1024], batches=[1, 2])} == {1, 2}
    fa = grid_shapes("fa", seqlens=[16384], head_dims=[256], causal=True)
    assert [(s.head_dim, s.heads, s.causal) for s in fa] == [(256, 8, True)]


def test_decode_grid(capsys):
    from tritonattn.bench.runner import measure_shape, print_decode_table

    shapes = grid_shapes("decode")
    assert len(shapes) == 12 and all(s.seqlen_q == 1 and (s.heads, s.kv_heads, s.head_dim) == (32, 8, 128)
                                     for s in shapes)
    small = Shape("decode", 2, 4, 2, 1, 48, 32, False, torch.float16)  # the grid's code path, CPU-sized
    rows = measure_shape(small, ["tritonattn"], ["fwd"])
    assert len(rows) == 1 and rows[0]["gbps"] > 0 and rows[0]["mode"] == "fwd"
    assert rows[0]["gbps"] == small.kv_bytes() / rows[0]["ms"] * 1e-6
    print_decode_table(rows)
    assert "[decoding: GB/s of K/V read" in capsys.readouterr().out
    # --cuda-graphs: graph replays on a GPU (the rows say so); without one, the plain timing
    rows = measure_shape(small, ["tritonattn"], ["fwd"], cuda_graphs=True)
    assert ("CUDA graph" in rows[0]["note"]) == torch.cuda.is_available()
    print_decode_table([dict(rows[0], note="CUDA graph")])
    assert "each step a CUDA graph replay" in capsys.readouterr().out
    # --l2-flush read: the L2 flushed by a read before each timed step on a GPU (the rows say so)
    rows = measure_shape(small, ["tritonattn"], ["fwd"], l2_flush="read")
    assert ("L2 flushed by a read" in rows[0]["note"]) == torch.cuda.is_available() and rows[0]["gbps"] > 0
    print_decode_table([dict(rows[0], note="CUDA graph; L2 flushed by a read")])
    assert "the L2 flushed by a read before each step" in capsys.readouterr().out


def test_l2_flush_reaches_every_timing(monkeypatch, tmp_path):
    """--l2-flush: the option reaches measure_shape from the command line, and measure_shape hands it
    to every timing it makes (the decode step, the training modes)."""
    from tritonattn.bench import __main__ as bench_main
    from tritonattn.bench import runner

    flushes = []
    real = runner._bench

    def spy(fn, grad_to_none=None, flush="write"):
        flushes.append(flush)
        return real(fn, grad_to_none)

    monkeypatch.setattr(runner, "_bench", spy)
    runner.measure_shape(Shape("decode", 1, 2, 1, 1, 40, 16, False, torch.float16), ["tritonattn"], ["fwd"],
                         l2_flush="read")
    runner.measure_shape(Shape("tiny", 1, 2, 1, 24, 24, 16, True, torch.float16), ["tritonattn"],
                         ["fwd", "bwd", "fwd+bwd"], l2_flush="read")
    assert flushes == ["read"] * 4
    seen = []

    def fake_measure(shape, backends, modes, env, cuda_graphs=False, l2_flush="write"):
        seen.append(l2_flush)
        return []

    monkeypatch.setattr(bench_main, "measure_shape", fake_measure)
    for argv, want in ((["--l2-flush", "read"], "read"), ([], "write")):
        seen.clear()
        assert bench_main.main(["--grid", "tiny", "--out", str(tmp_path), *argv]) == 0
        assert seen and set(seen) == {want}


def test_main_job(capsys):
    from tritonattn.__main__ import main as run_main

    assert run_main(["--seqlen", "33", "--heads", "2", "--kv-heads", "1", "--head-dim", "32"]) == 0
    out = capsys.readouterr().out
    assert "max abs error vs fp64 reference" in out and "nan" not in out.lower()


def test_tuner_calls_and_error_check():
    """scripts/tune.py's timed call and its error check, dense and packed varlen (eager, no graphs):
    the error of the library's own forward is small, and the check sees a wrong output."""
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "scripts", "tune.py")
    spec = importlib.util.spec_from_file_location("tune_script", path)
    tune = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tune)
    for varlen in (False, True):
        fn, _, inputs = tune.make_call("fwd", 2, 40, 4, 2, 16, True, torch.float16, varlen=varlen, device=DEVICE)
        fn()
        assert inputs[0].shape == ((80, 4, 16) if varlen else (2, 40, 4, 16))
        assert tune.forward_error(*inputs, True, 40) < 5e-3
        q, k, v, forward = inputs
        assert tune.forward_error(q, k, v, lambda: forward() + 0.1, True, 40) > 0.09
        assert tune.forward_error(q, k, v, forward, False, 40) > 5e-3  # against the other mask
    fn, grads, _ = tune.make_call("bwd_dq", 1, 33, 2, 1, 16, False, torch.float16, varlen=True, device=DEVICE)
    fn()
    assert all(t.grad is not None for t in grads)


def test_source_hash_names_the_code(tmp_path, monkeypatch):
    """The sources' hash recorded with every row: the same for the same files, another when a file
    of the package changes (the bench's module path is redirected to a copy of the package)."""
    import shutil

    from tritonattn.bench import runner

    pkg = os.path.dirname(os.path.dirname(os.path.abspath(runner.__file__)))
    copy = tmp_path / "tritonattn"
    shutil.copytree(pkg, copy, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(runner, "__file__", str(copy / "bench" / "runner.py"))
    first = runner.source_hash()
    assert first == runner.source_hash() and len(first) == 10
    with open(copy / "kernels" / "common.py", "a") as f:
        f.write("# a change\n")
    assert runner.source_hash() != first
