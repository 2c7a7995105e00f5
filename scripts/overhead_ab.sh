#!/usr/bin/env bash
# Host time of this tree against earlier commits on one machine: scripts/overhead.py (this tree's
# copy, so every tree gets the same rows) run over each tree in turn, rounds interleaved (a host's
# speed drifts within a call: cells measured one after another are not comparable).
#
#   scripts/overhead_ab.sh prepare 0031f67 6171209   # here (needs git): each commit's tree under
#                                                    # _dev/trees/<commit> (untracked: it travels
#                                                    # with the checkout to the device machine)
#   scripts/overhead_ab.sh run                       # on the GPU machine: HEAD and every prepared
#                                                    # tree, AB_RUNS times (default 2), each run with
#                                                    # OVERHEAD_ROUNDS (default 3); tables under
#                                                    # $OUT/overhead-ab/<run>-<tree>.md
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
    for run in $(seq "${AB_RUNS:-2}"); do
      for tree in . "${prepared[@]}"; do
        name=$([[ $tree == . ]] && echo HEAD || basename "$tree")
        echo "== run $run: $name"
        mkdir -p "$out/$run-$name"
        OUT="$out/$run-$name" OVERHEAD_ROUNDS="${OVERHEAD_ROUNDS:-3}" python3 "$tree/scripts/overhead.py" \
          > "$out/$run-$name.md" 2>&1 || echo "(run $run, $name: exit $?)"
        grep -E "^\| (flash_attn_func fwd|flash_attn_func fwd\+bwd|attention_backward|tritonattn.scaled|torch SDPA flash fwd)" \
          "$out/$run-$name.md" | cut -c1-110 || true
      done
    done
    ;;
  clean)
    rm -rf "$trees"
    ;;
  *)
    echo "usage: scripts/overhead_ab.sh prepare COMMIT... | run | clean" >&2
    exit 2
    ;;
esac
