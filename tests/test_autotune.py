"""TRITONATTN_AUTOTUNE: pruning, picking the fastest, the disk cache. The timing is injected here
(the interpreter has no timings worth the name); tests/test_gpu.py runs it for real."""

import json

import pytest
import torch

from tritonattn import autotune, configs
from tritonattn.configs import TileConfig as C


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITONATTN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(autotune, "_memory", {})
    return tmp_path


def test_off_without_cuda(monkeypatch):
    monkeypatch.setenv("TRITONATTN_AUTOTUNE", "1")
    assert not autotune.enabled(torch.zeros(1))
    default = C(64, 32, 4, 1)
    assert autotune.tuned("fwd", torch.zeros(1, 8, 2, 64), True, 8, 8, {}, default, lambda cfg: 1 / 0) == default


def test_candidates_are_pruned_to_the_sequence_lengths():
    default = C(128, 128, 8, 3)
    cands = autotune.candidates("fwd", 128, 40, 60, default)
    assert cands[0] == default  # the table's choice always competes
    assert all(c.block_m <= 64 and c.block_n <= 64 for c in cands[1:])
    assert len(cands) > 2
    assert len(autotune.candidates("fwd", 100, 8192, 8192, default)) == len(set(configs.CANDIDATES[128]["fwd"])
                                                                          | {default})


def test_pick_times_every_candidate_skips_failures_and_caches_on_disk(cache_dir):
    cands = [C(128, 64, 8, 3), C(64, 64, 4, 3), C(32, 32, 4, 1), C(16, 16, 4, 1)]
    ran = []

    def run(cfg):
        ran.append(cfg)
        if cfg.block_m == 32:
            raise RuntimeError("out of shared memory")  # a candidate that cannot launch

    def timer(fn):
        fn()
        return {128: 3.0, 64: 1.5, 16: 2.0}[ran[-1].block_m]

    best = autotune.pick("key-a", cands, run, timer)
    assert best == C(64, 64, 4, 3) and ran == cands
    data = json.loads((cache_dir / "autotune.json").read_text())
    assert data == {"key-a": [64, 64, 4, 3, 1, False]}  # (block_m, block_n, warps, stages, d_split, split_grads)
    # a new process (empty memory) reads the disk cache and runs nothing
    autotune._memory.clear()
    assert autotune.pick("key-a", cands, lambda cfg: 1 / 0, lambda fn: 1 / 0) == best
    # another key is tuned separately and added to the same file
    assert autotune.pick("key-b", cands[2:], lambda cfg: None, lambda fn: 1.0) == cands[2]
    assert set(json.loads((cache_dir / "autotune.json").read_text())) == {"key-a", "key-b"}
    # a file written before TileConfig had d_split (4 numbers) still loads, with d_split = 1
    (cache_dir / "autotune.json").write_text(json.dumps({"key-c": [128, 32, 8, 3]}))
    autotune._memory.clear()
    assert autotune.pick("key-c", cands, lambda cfg: 1 / 0, lambda fn: 1 / 0) == C(128, 32, 8, 3, 1)
    # one written by a later version (a field this one does not know) is tuned again, not a crash
    (cache_dir / "autotune.json").write_text(json.dumps({"key-d": [64, 64, 4, 3, 1, False, 7]}))
    autotune._memory.clear()
    ran.clear()
    assert autotune.pick("key-d", cands, run, timer) == C(64, 64, 4, 3) and ran == cands


def test_key_names_what_changes_the_best_config():
    q = torch.zeros(1, 8, 2, 96, dtype=torch.float16)
    k1 = autotune.make_key("fwd", q, True, 1000, 3000, {"SOFTCAP": False})
    assert "D128" in k1 and "Sq1024" in k1 and "Sk4096" in k1 and "causal=1" in k1 and "float16" in k1
    assert k1 != autotune.make_key("fwd", q, False, 1000, 3000, {"SOFTCAP": False})
    assert k1 != autotune.make_key("fwd", q, True, 1000, 3000, {"SOFTCAP": True})
    assert k1 != autotune.make_key("bwd_dq", q, True, 1000, 3000, {"SOFTCAP": False})
    assert k1 == autotune.make_key("fwd", q, True, 1023, 2049, {"SOFTCAP": False})
