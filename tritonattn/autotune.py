"""``TRITONATTN_AUTOTUNE=1``: time the tile candidates of a kernel on the call's own problem, keep
the fastest, and remember it on disk.

The default path never tunes: it picks from the measured table in ``configs.py``, so the first call
of a shape costs only compilation. With the variable set, the first call of a new key (GPU name,
Triton version, mode, padded head dim, dtype, causal, the variant flags, and the sequence lengths
rounded up to a power of two) runs each candidate of ``configs.CANDIDATES`` for that head dim once
to warm up and then a few timed repetitions (median of CUDA events), after pruning:

- block sizes larger than the (rounded) sequence length they tile are skipped (they only add masking);
- candidates that cannot launch (shared memory over the device limit, compilation errors) are skipped.

The winner is kept in memory and in ``$TRITONATTN_CACHE_DIR/autotune.json`` (default
``~/.cache/tritonattn``), so later processes do not tune again. Tuning runs the kernel several
times on the call's tensors: kernels are idempotent in their outputs (the atomic-dQ path zeroes its
accumulator before each run), so the final launch with the winner gives the result.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable

import torch

from tritonattn import configs
from tritonattn.configs import TileConfig
from tritonattn.kernels.launch import next_pow2

ENV = "TRITONATTN_AUTOTUNE"
_memory: dict[str, TileConfig] = {}
_lock = threading.Lock()


def env_enabled() -> bool:
    return configs.env_flag(ENV)


def enabled(q: torch.Tensor) -> bool:
    return q.is_cuda and env_enabled()


def cache_path() -> str:
    root = os.environ.get("TRITONATTN_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "tritonattn")
    return os.path.join(root, "autotune.json")


def make_key(mode: str, q: torch.Tensor, causal: bool, Sq: int, Sk: int, flags: dict) -> str:
    import triton

    dev = torch.cuda.get_device_name(q.device) if q.device.type == "cuda" else q.device.type
    variant = ",".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in sorted(flags.items()))
    return (f"{dev}|triton {triton.__version__}|{mode}|D{configs.padded_head_dim(q.shape[-1])}|{q.dtype}|"
            f"causal={int(bool(causal))}|Sq{next_pow2(Sq)}|Sk{next_pow2(Sk)}|{variant}")


def candidates(mode: str, head_dim: int, Sq: int, Sk: int, default: TileConfig) -> list[TileConfig]:
    """The table's config first, then the sweep's candidates that fit the sequence lengths."""
    pool = configs.CANDIDATES[max(64, configs.padded_head_dim(head_dim))][mode]
    out = [default]
    for cfg in pool:
        if cfg in out:
            continue
        if cfg.block_m > max(16, next_pow2(Sq)) or cfg.block_n > max(16, next_pow2(Sk)):
            continue
        out.append(cfg)
    return out


def _load_disk() -> dict:
    try:
        with open(cache_path()) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _save_disk(key: str, cfg: TileConfig) -> None:
    path = cache_path()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        data = _load_disk()
        data[key] = list(cfg)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)  # atomic: concurrent processes never read half a file
    except OSError:
        pass  # a read-only home: tuning still works, for this process only


def _time(fn: Callable[[], None]) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=5, rep=25, return_mode="median")


def pick(key: str, cands: list[TileConfig], run: Callable[[TileConfig], None],
         timer: Callable[[Callable[[], None]], float] | None = None) -> TileConfig:
    """The fastest of ``cands`` for ``key`` (from memory, disk, or by timing ``run(cfg)``)."""
    with _lock:
        if key in _memory:
            return _memory[key]
        stored = _load_disk().get(key)
        try:
            cfg = None if stored is None else TileConfig(*stored)
        except (TypeError, ValueError):  # written by another version of tritonattn: tuned again
            cfg = None
        if cfg is not None:
            _memory[key] = cfg
            return cfg
        timer = timer or _time
        best, best_ms = cands[0], float("inf")
        for cfg in cands:
            try:
                ms = timer(lambda cfg=cfg: run(cfg))
            except Exception:  # noqa: BLE001 - a candidate that cannot launch here is skipped
                continue
            if ms < best_ms:
                best, best_ms = cfg, ms
        _memory[key] = best
        _save_disk(key, best)
        return best


def tuned(mode: str, q: torch.Tensor, causal: bool, Sq: int, Sk: int, flags: dict, default: TileConfig,
          run: Callable[[TileConfig], None]) -> TileConfig:
    """``default`` unless autotuning is on (and no config is forced)."""
    if mode in configs._override or not enabled(q):
        return default
    # timed on the tensors' device (do_bench's events and syncs are on the current one)
    with torch.cuda.device(q.device):
        return pick(make_key(mode, q, causal, Sq, Sk, flags), candidates(mode, q.shape[-1], Sq, Sk, default), run)


def launch_tuned(mode: str, q: torch.Tensor, causal: bool, Sq: int, Sk: int, flags: dict, default: TileConfig,
                 run: Callable[[TileConfig], None]) -> TileConfig:
    """The launchers' entry: ``run`` with the table's config (or the autotuned one), shrunk by
    :func:`configs.fit` if it does not fit the device. Returns the config that ran."""
    return configs.fit(mode, tuned(mode, q, causal, Sq, Sk, flags, default, run), flags, q.dtype, run)
