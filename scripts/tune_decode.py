"""Sweep the split-KV decoding kernel: tile config x number of splits, in GB/s of K/V read.

For each (batch, cache length) of the decode grid's shape (Hq=32, Hkv=8, D=128, bf16, Sq=1) it
times ``flash_attn_with_kvcache`` with each candidate ``configs._DECODE`` entry forced and with
``num_splits`` = the heuristic's choice x 1/2, 1, 2, 4; and cuDNN / FA2 SDPA on the same shape for
the ratio. Median of ``triton.testing.do_bench`` (L2 flushed by a write; ``--flush read``: by a
read). A table on stdout, CSV under $OUT.
``--cuda-graphs`` times every step (peers too) as a CUDA graph replay: kernel time without the
host's per-call work, which bounds the short caches of eager calls (and a forced config takes the
launcher's full path, without its launch plan).

``--default-tile`` times only the table's tile, ``--splits`` given split counts (the table says how
many were taken: a split's keys are rounded up to the tile's BLOCK_N), ``--flush read``
flushes the L2 by a read (see ``bench``), ``--paged P`` reads the cache through a block table of
P-row pages in shuffled order (a serving engine's page pool after some traffic; the peers read the
contiguous cache). With ``--cuda-graphs`` the first rows are the floor: a
graph of one / two one-element kernels timed the same way.

    python scripts/tune_decode.py [--batches 1 8 64] [--lengths 16384 131072] [--cuda-graphs] [--pdl]
"""

from __future__ import annotations

import argparse
import csv
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

from tritonattn import configs, flash_attn_with_kvcache  # noqa: E402
from tritonattn.bench.runner import _bench, _graphed  # noqa: E402
from tritonattn.configs import TileConfig as C  # noqa: E402
from tritonattn.kernels.decode import _splits, pick_num_splits  # noqa: E402

CANDIDATES = [C(0, 128, 4, 3), C(0, 128, 4, 2), C(0, 64, 4, 3), C(0, 64, 4, 4), C(0, 64, 8, 3), C(0, 128, 8, 3),
              C(0, 32, 4, 4), C(0, 256, 8, 2)]


def bench(fn, flush: str = "write") -> float:
    """Median ms of ``fn`` with the L2 flushed before each call by a write or a read (``runner._bench``),
    over shorter warm-up and timing budgets than the harness's (10 / 40 ms)."""
    return _bench(fn, flush=flush, warmup=10, rep=40)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--lengths", type=int, nargs="+", default=[16384, 131072])
    p.add_argument("--cuda-graphs", action="store_true", help="time CUDA graph replays of one step")
    p.add_argument("--pdl", action="store_true",
                   help="also time each split candidate with the combine kernel launched through programmatic "
                        "dependent launch (TRITONATTN_DECODE_PDL)")
    p.add_argument("--default-tile", action="store_true", help="only the table's decode tile")
    p.add_argument("--splits", type=int, nargs="+", help="split counts (default: the heuristic's x 1/2, 1, 2, 4)")
    p.add_argument("--paged", type=int, default=0, help="pages of this many rows (0: a contiguous cache)")
    p.add_argument("--flush", choices=["write", "read"], default="write",
                   help="how the L2 is flushed before each timed call (see bench())")
    args = p.parse_args(argv)
    pdl_default = configs.DECODE_PDL

    def timed(fn) -> float:
        if args.cuda_graphs:
            fn = _graphed(fn)
        return bench(fn, args.flush)

    Hq, Hkv, D, dt = 32, 8, 128, torch.bfloat16
    rows = []
    if args.cuda_graphs:  # the floor: a replay of one / two one-element kernels, timed the same way
        x = torch.zeros(1, device="cuda")
        for n in (1, 2):
            ms = timed(lambda: [x.add_(1) for _ in range(n)])
            rows.append(dict(B=0, L=0, config=f"floor: {n} tiny kernel(s)", splits="", taken="", ms=ms, gbps=0.0))
            print(f"floor, a graph of {n} one-element kernel(s): {ms * 1e3:.2f} us")
    print("| B | L | config | splits asked -> taken | ms | GB/s | x cuDNN |\n|---|---|---|---|---|---|---|")
    for B in args.batches:
        for L in args.lengths:
            q = torch.randn(B, 1, Hq, D, device="cuda", dtype=dt)
            kc = torch.randn(B, L, Hkv, D, device="cuda", dtype=dt)
            vc = torch.randn(B, L, Hkv, D, device="cuda", dtype=dt)
            gbytes = 2 * kc.numel() * kc.element_size() / 1e9
            peers = {}
            qt, kt, vt = q.transpose(1, 2), kc.transpose(1, 2).contiguous(), vc.transpose(1, 2).contiguous()
            for name, be in (("cudnn", torch.nn.attention.SDPBackend.CUDNN_ATTENTION),
                             ("flash", torch.nn.attention.SDPBackend.FLASH_ATTENTION)):
                try:
                    with torch.nn.attention.sdpa_kernel(be):
                        peers[name] = timed(lambda: torch.nn.functional.scaled_dot_product_attention(
                            qt, kt, vt, enable_gqa=True))
                except RuntimeError as e:
                    print(f"peer {name}: {str(e).splitlines()[0]}", file=sys.stderr)
            kt = vt = None  # noqa: F841 - free the peers' copies before the sweep
            kw = {}
            if args.paged:  # the same cache in shuffled pages, read through a block table
                perm = torch.randperm(B * L // args.paged, device="cuda")
                kc, vc = (torch.empty_like(c).view(-1, args.paged, Hkv, D).index_copy_(
                    0, perm, c.view(-1, args.paged, Hkv, D)) for c in (kc, vc))
                kw["block_table"] = perm.view(B, L // args.paged).to(torch.int32)
            auto = pick_num_splits(B, Hkv, L, q.device, paged=bool(args.paged))
            ref = peers.get("cudnn") or min(peers.values())
            for name, ms in peers.items():
                rows.append(dict(B=B, L=L, config=f"sdpa-{name}", splits="", taken="", ms=ms, gbps=gbytes / ms * 1e3))
                print(f"| {B} | {L} | sdpa-{name} | | {ms:.4f} | {gbytes / ms * 1e3:.0f} | {ref / ms:.2f} |",
                      flush=True)
            tiles = [configs._DECODE[(128, 2)]] if args.default_tile else CANDIDATES
            for cfg in tiles:
                for splits in args.splits or sorted({max(1, auto // 2), auto, auto * 2, auto * 4}):
                    for pdl in (False, True) if args.pdl and splits > 1 else (False,):
                        configs.DECODE_PDL = pdl
                        with configs.override(decode=cfg):
                            taken = _splits(q, kc, L, splits, bool(args.paged))[0]  # after BLOCK_N's rounding
                            try:
                                ms = timed(lambda: flash_attn_with_kvcache(q, kc, vc, cache_seqlens=L,
                                                                           num_splits=splits, **kw))
                            except Exception as e:  # noqa: BLE001
                                print(f"{cfg} {splits}: {type(e).__name__}: {str(e).splitlines()[0][:120]}",
                                      file=sys.stderr)
                                continue
                        label = str(tuple(cfg)) + (" pdl" if pdl else "")
                        rows.append(dict(B=B, L=L, config=label, splits=splits, taken=taken, ms=ms,
                                         gbps=gbytes / ms * 1e3))
                        mark = " (default)" if cfg == configs._DECODE[(128, 2)] and splits == auto and not pdl else ""
                        print(f"| {B} | {L} | {label}{mark} | {splits} -> {taken} | {ms:.4f} | "
                              f"{gbytes / ms * 1e3:.0f} | {ref / ms:.2f} |", flush=True)
                    configs.DECODE_PDL = pdl_default
            q = kc = vc = None  # noqa: F841
            torch.cuda.empty_cache()
    name = ("tune-decode-cuda-graphs" if args.cuda_graphs else "tune-decode") + (
        f"-paged{args.paged}" if args.paged else "") + (
        "-read-flush.csv" if args.flush == "read" else ".csv")
    path = os.path.join(os.environ.get("OUT", "."), name)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
