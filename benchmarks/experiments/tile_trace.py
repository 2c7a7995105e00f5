"""Where a Gluon forward tile's time goes, from cycle stamps the kernel writes (fwd_sm90.TRACE_BUF,
H200). It reads the tile boundary that tile_cost.py found costly (benchmarks/NOTES.md, twenty-second
session: 3.2-3.5 us per 128-row tile at D=128, against cuDNN's ~1 us).

Each consumer warpgroup stamps, per tile: its start (s0), its Q landed (s1), K_0 landed and its
turn (s2), the loops over the key blocks done (s3), the last P V done (s4), O stored (s5). The
producer stamps its tile start (p0), K_0 issued (p1), Q's buffer free and Q issued (p2), and the
tile's last load issued (p3). Stamps are SM cycles (%clock64, one counter per SM, so they are only
compared within a program), printed in ns at the SM clock that the run's own time gives. The
first tile of each program and tiles past TRACE_TILES are left out.

    python benchmarks/experiments/tile_trace.py [D] [Sq] [Sk] [--causal] [--set=PART ...]  # default D=128, Sq=Sk=512

--set=PART sets an experiment switch of fwd_sm90 for both runs, a part as fwd_flags.py takes it
(NAME, NAME=LITERAL or NAME[KEY]...[KEY]=LITERAL). The stamps' slots are laid out for two consumers:
a tile of three (D=64 without a mask) is traced with two (a note says so).
"""
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch  # noqa: E402

import tritonattn  # noqa: E402
from tritonattn import configs  # noqa: E402
from tritonattn.bench.runner import _bench  # noqa: E402
from tritonattn.kernels import fwd_sm90, plan  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from fwd_flags import _apply  # noqa: E402  (a setting's parts, as fwd_flags.py takes them)

args = [a for a in sys.argv[1:] if not a.startswith("--")]
causal = "--causal" in sys.argv
_apply([a[len("--set="):] for a in sys.argv[1:] if a.startswith("--set=")])
D = int(args[0]) if args else 128
Sq = int(args[1]) if len(args) > 1 else 512
Sk = int(args[2]) if len(args) > 2 else Sq
H = 2048 // D
B = max(1, 16384 // Sq)
configs.GLUON_MIN_SEQLEN["fwd"][D] = (0, 0)  # the Gluon forward at every length
if fwd_sm90.tile(D, causal)["NC"] != 2:
    print(f"note: the D={D} tile has {fwd_sm90.tile(D, causal)['NC']} consumers; traced with two")
    fwd_sm90.BY_MASK = {**fwd_sm90.BY_MASK, (D, causal): {**fwd_sm90.BY_MASK.get((D, causal), {}), "NC": 2}}
q = torch.randn(B, Sq, H, D, device="cuda", dtype=torch.bfloat16)
k, v = (torch.randn(B, Sk, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))


def run():
    return tritonattn.flash_attn_func(q, k, v, causal=causal)


plan.clear()
ref = run()
plain_ms = _bench(run)
programs = fwd_sm90.grid(q, -(-Sq // fwd_sm90.block_m(D, causal)) * B * H)[0]
trace = torch.zeros(programs, fwd_sm90.TRACE_TILES.value, fwd_sm90.TRACE_SLOTS.value, dtype=torch.int64,
                    device="cuda")
fwd_sm90.TRACE_BUF = trace
plan.clear()
try:
    out = run()
    torch.cuda.synchronize()
    traced_ms = _bench(run)
    same = torch.equal(out, ref)  # the stamps change no result
finally:
    fwd_sm90.TRACE_BUF = None
    plan.clear()
t = trace.cpu()
# the SM clock: program 0's span of stamps (all its tiles) against the kernel's time, as an upper bound
n_tiles = int((t[:, :, 16] != 0).sum(1).max())
span = [int(row[row != 0].max() - row[row != 0].min()) for row in t if (row != 0).any()]
ghz = statistics.median(span) / (traced_ms * 1e6) if span else 1.0
ghz = min(max(ghz, 1.0), 2.0)  # (the stamps cover most of the kernel; the H200 runs its SMs at 1.0-1.98 GHz)
print(f"D={D} B={B} H={H} Sq={Sq} Sk={Sk} causal={causal}: {programs} programs, up to {n_tiles} tiles each; "
      f"{plain_ms * 1e3:.1f} us untraced, {traced_ms * 1e3:.1f} us traced (outputs equal: {same}); "
      f"stamps read at {ghz:.2f} cycles per ns")


def ns(a, b, back=0):
    """Median over programs and tiles of stamp b of tile i minus stamp a of tile i - back (cycles
    to ns; tile 0 of each program left out)."""
    vals = []
    for row in t:
        for i in range(1 + back, min(n_tiles, fwd_sm90.TRACE_TILES.value)):
            if row[i - back, a] != 0 and row[i, b] != 0:
                vals.append(int(row[i, b] - row[i - back, a]) / ghz)
    return statistics.median(vals) if vals else float("nan")


print("| interval | consumer 0 ns | consumer 1 ns |\n|---|---|---|")
for name, a, b in (("start -> Q landed", 0, 1), ("Q -> K_0 and turn", 1, 2), ("the key blocks' loops", 2, 3),
                   ("last P V", 3, 4), ("epilogue (lse, O store)", 4, 5), ("whole tile", 0, 5)):
    print(f"| {name} | {ns(a, b):.0f} | {ns(8 + a, 8 + b):.0f} |")
for name, a, b in (("O stored -> next tile's start", 5, 0), ("last P V -> next tile's Q landed", 4, 1)):
    print(f"| {name} | {ns(a, b, 1):.0f} | {ns(8 + a, 8 + b, 1):.0f} |")
print("\n| producer interval | ns |\n|---|---|")
for name, a, b in (("tile start -> K_0 issued", 16, 17), ("K_0 issued -> Q issued (q_empty wait)", 17, 18),
                   ("Q issued -> last load issued", 18, 19)):
    print(f"| {name} | {ns(a, b):.0f} |")
for name, a, b in (("consumer 1's loops done (tile i-1) -> Q issued (tile i)", 11, 18),
                   ("consumer 0's loops done (tile i-1) -> Q issued (tile i)", 3, 18)):
    print(f"| {name} | {ns(a, b, 1):.0f} |")
print(f"| Q issued -> consumer 0's Q landed (same tile) | {ns(18, 1):.0f} |")
