#!/usr/bin/env bash
# Host time of this tree against earlier commits on one machine: scripts/overhead.py (this tree's
# copy, so every tree gets the same rows) run over each tree in turn, one round per process, the
# trees alternating round by round (a host's speed drifts within a call, by a third on the H100 host
# of 2026-12-07: trees measured one whole run after another are not comparable; forty-fourth
# session). The summary pairs each round's cells: a tree's time over HEAD's in the same round,
# median over the rounds, which a drift slower than a round cancels out of.
#
#   scripts/overhead_ab.sh prepare 0031f67 6171209   # here (needs git): each commit's tree under
#                                                    # _dev/trees/<commit> (untracked: it travels
#                                                    # with the checkout to the device machine)
#   scripts/overhead_ab.sh run                       # on the GPU machine: HEAD and every prepared
#                                                    # tree, AB_ROUNDS rounds (default 6), each tree
#                                                    # once per round (one overhead.py round of 200
#                                                    # calls per cell), the trees' order rotated each
#                                                    # round; tables under $OUT/overhead-ab/<round>-<tree>.md,
#                                                    # the paired summary in $OUT/overhead-ab/summary.md
#   scripts/overhead_ab.sh clean                     # here: remove _dev/trees
set -euo pipefail
cd "$(dirname "$0")/.."
trees=_dev/trees

case "${1:-}" in
  prepare)
    shift
    [[ $# -gt 0 ]] || { echo "prepare: name one or more commits" >&2; exit 2; }
    mkdir -p "$trees"
    for commit in "$@"; do
      git rev-parse --verify --quiet "$commit^{commit}" > /dev/null || { echo "prepare: no commit $commit" >&2; exit 2; }
      rm -rf "${trees:?}/$commit"
      mkdir -p "$trees/$commit"
      git archive "$commit" tritonattn scripts | tar -x -C "$trees/$commit"
      echo "$trees/$commit: $(git log -1 --format='%h %s' "$commit" | cut -c1-80)"
    done
    ;;
  run)
    out="${OUT:-.}/overhead-ab"
    mkdir -p "$out"
    shopt -s nullglob
    prepared=("$trees"/*)
    [[ ${#prepared[@]} -gt 0 ]] || { echo "run: nothing prepared under $trees (scripts/overhead_ab.sh prepare ...)" >&2; exit 2; }
    for tree in "${prepared[@]}"; do  # this tree's script in each, so every tree has the same rows
      cp scripts/overhead.py "$tree/scripts/overhead.py"
    done
    all=(. "${prepared[@]}")
    for round in $(seq "${AB_ROUNDS:-6}"); do
      n=${#all[@]}
      for i in $(seq 0 $((n - 1))); do
        tree=${all[$(( (i + round - 1) % n ))]}  # the order rotated each round
        name=$([[ $tree == . ]] && echo HEAD || basename "$tree")
        echo "== round $round: $name"
        mkdir -p "$out/$round-$name"
        OUT="$out/$round-$name" OVERHEAD_ROUNDS=1 python3 "$tree/scripts/overhead.py" \
          > "$out/$round-$name.md" 2>&1 || echo "(round $round, $name: exit $?)"
      done
    done
    python3 - "$out" <<'PY' | tee "$out/summary.md"
import glob, os, re, statistics, sys
out = sys.argv[1]
cells = {}  # (tree, row, column) -> {round: us}
columns = []
for path in glob.glob(os.path.join(out, "*-*.md")):
    m = re.fullmatch(r"(\d+)-(.+)\.md", os.path.basename(path))
    if not m:
        continue
    rnd, tree = int(m.group(1)), m.group(2)
    header = None
    for line in open(path):
        parts = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| entry point"):
            header = parts[1:]
            columns = columns or header
        elif header and line.startswith("| ") and not line.startswith("|---"):
            for col, v in zip(header, parts[1:]):
                try:
                    cells.setdefault((tree, parts[0], col), {})[rnd] = float(v)
                except ValueError:
                    pass
trees = sorted({t for t, _, _ in cells}, key=lambda t: (t != "HEAD", t))
rows = list(dict.fromkeys(r for _, r, _ in cells))
print("median us per call over the rounds; x HEAD: the median over the rounds of the tree's time over "
      "HEAD's in the same round (above 1: HEAD faster)\n")
head = "| row | column | " + " | ".join(trees) + " | " + " | ".join(f"{t} x HEAD" for t in trees[1:]) + " |"
print(head + "\n|" + "---|" * (head.count("|") - 1))
for row in rows:
    for col in columns:
        base = cells.get(("HEAD", row, col))
        if not base:
            continue
        med = [f"{statistics.median(cells[t, row, col].values()):.1f}" if (t, row, col) in cells else "-"
               for t in trees]
        ratios = []
        for t in trees[1:]:
            other = cells.get((t, row, col), {})
            paired = [other[r] / base[r] for r in base if r in other and base[r] > 0]
            ratios.append(f"{statistics.median(paired):.3f}" if paired else "-")
        print(f"| {row} | {col} | " + " | ".join(med) + " | " + " | ".join(ratios) + " |")
PY
    ;;
  clean)
    rm -rf "$trees"
    ;;
  *)
    echo "usage: scripts/overhead_ab.sh prepare COMMIT... | run | clean" >&2
    exit 2
    ;;
esac
