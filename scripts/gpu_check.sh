#!/usr/bin/env bash
# One call on the GPU machine: environment, the whole test suite (GPU tier included), the main
# job, and the benchmark. Logs and results go to $OUT (the device tool brings them back), also
# packed as $OUT/all.tar.gz (the device tool brings back at most 8 files).
#   scripts/gpu_check.sh                 tests + main job + benchmark (BENCH_ARGS, default: llama grid;
#                                        several bench runs separated by ';')
#   SKIP_TESTS=1 scripts/gpu_check.sh    benchmark only
#   SKIP_BENCH=1 scripts/gpu_check.sh    tests only
#   SKIP_EXTRA=1                         without the extras (EXTRAS="overhead integration example")
#   EXTRAS="overhead example"            only these extras: scripts/overhead.py, scripts/integration_gpu.py,
#                                        examples/hf_llama.py, and (only when named) profile:
#                                        scripts/profile_case.py $PROFILE_ARGS (per-kernel device times),
#                                        gluon-fwd / gluon-bwd (only when named): benchmarks/experiments/
#                                        tune_gluon_{fwd,bwd}.py $GLUON_FWD_ARGS / $GLUON_BWD_ARGS
#                                        (several runs separated by ';'),
#                                        bwd-flags (only when named): benchmarks/experiments/bwd_flags.py
#                                        $BWD_FLAGS_ARGS (several runs separated by ';'; bwd-flags.md,
#                                        bwd-flags1.md, ...; TUNE_WALL bounds each)
#   TUNE_ARGS="--modes fwd ...;..."      also run scripts/tune.py with these arguments (after the bench;
#                                        several runs separated by ';')
#   TUNE_DECODE_ARGS="--batches 64"      scripts/tune_decode.py with these arguments (before the tune runs)
#   TUNE_WALL=200                        stop each tuner run (and each Gluon tuner run) after this many seconds
#   TESTS_WALL=540                       stop the test run after this many seconds (SIGINT: pytest still
#                                        prints its summary; tracebacks also in test-failures.log)
#   RERUN_WALL=300                       bound on the rerun, one at a time, of the tests that failed with a CUDA
#                                        out-of-memory error beside the other workers (tests/conftest.py lists them)
#   PYTEST_ARGS="tests/a.py;tests/b.py"  two test groups: one per GPU on a two-GPU machine
#   PYTEST_WORKERS=12                    xdist workers per group (default 3/4 of the cores / groups)
#   TRITONATTN_COMMIT=abc1234            the commit recorded with the results: give it literally, from this
#                                        machine's git (`$(git rev-parse ...)` run on the device read an
#                                        older commit there on 2026-12-02); the bench also records a hash of
#                                        the package's sources (tritonattn.bench.runner.source_hash), which
#                                        names the code that ran whatever git says
# With two or more GPUs the tests run on the last one, in the background, while the main job,
# extras, bench and tune run on GPU 0, so one call does both.
set -uo pipefail
OUT=${OUT:-/tmp/tritonattn-gpu}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
# compiled kernels kept in the checkout (git-ignored): a later call on the same warm machine reuses them
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.triton-cache}
status=0

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv | tee "$OUT/env.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cudnn', torch.backends.cudnn.version())" | tee -a "$OUT/env.txt"
echo "commit ${TRITONATTN_COMMIT:-unknown}" | tee -a "$OUT/env.txt"
ngpu=$(nvidia-smi -L | grep -c "^GPU")

run_tests() {  # run_tests LOG PYTEST_ARGS WORKERS
  export TRITONATTN_FAILURE_LOG="$OUT/test-failures.log"
  # -v: every result line names its test, so a run cut short still says what failed.
  # The group's arguments are split as the shell would (quotes kept: -k 'a or b'; the text is the
  # caller's own, evaluated as shell words); a group that does not parse runs nothing
  local args
  if ! eval "args=($2)"; then
    echo "cannot parse the test group: $2" | tee "$OUT/$1"
    return 2
  fi
  local oom="$TRITONATTN_FAILURE_LOG.oom"
  rm -f "$oom"
  timeout -s INT -k 30 "${TESTS_WALL:-0}" python3 -m pytest -v -rf -p no:cacheprovider -n "$3" \
    --timeout "${PYTEST_TIMEOUT:-600}" --maxfail=25 --durations=25 "${args[@]}" >"$OUT/$1" 2>&1
  local rc=$?
  grep -E "FAILED|ERROR|passed|failed" "$OUT/$1" | tail -40
  # tests that failed with a CUDA out-of-memory error (the workers' tests together outgrew the card:
  # the tier's largest cases were sized on the H200's 139 GB) run again one at a time; the group then
  # passes only if those pass alone and nothing else failed (RERUN_WALL bounds the rerun)
  if [ -s "$oom" ]; then
    local ids other
    mapfile -t ids < <(sort -u "$oom")
    other=$(grep -E "^FAILED " "$OUT/$1" | grep -cvF -f <(printf '%s\n' "${ids[@]}"))
    echo "${#ids[@]} test(s) ran out of GPU memory beside the other workers; again, one at a time:"
    timeout -s INT -k 30 "${RERUN_WALL:-300}" python3 -m pytest -v -rf -p no:cacheprovider -n 0 \
      --timeout "${PYTEST_TIMEOUT:-600}" "${ids[@]}" >"$OUT/${1%.log}-oom-rerun.log" 2>&1
    local rerun=$?
    tail -1 "$OUT/${1%.log}-oom-rerun.log"
    [ "$rerun" -eq 0 ] && [ "$other" -eq 0 ] && [ "$rc" -eq 1 ] && rc=0
  fi
  return $rc
}

tests_pids=()
if [ -z "${SKIP_TESTS:-}" ]; then
  # PYTEST_ARGS may hold two groups separated by ';': with two GPUs each gets one (logs tests.log,
  # tests1.log), and the main job / bench / tune share GPU 0 with the second group
  IFS=';' read -ra groups <<< "${PYTEST_ARGS:-tests}"
  workers=${PYTEST_WORKERS:-$(( $(nproc) * 3 / 4 / ${#groups[@]} ))}
  for i in "${!groups[@]}"; do
    log=tests$( [ "$i" -gt 0 ] && echo "$i" ).log
    if [ "$ngpu" -ge 2 ]; then
      gpu=$(( (ngpu - 1 - i) % ngpu ))
      echo "tests group $i (${groups[$i]}) on GPU $gpu in the background"
      (export CUDA_VISIBLE_DEVICES=$gpu; run_tests "$log" "${groups[$i]}" "$workers") &
      tests_pids+=($!)
    else
      run_tests "$log" "${groups[$i]}" "$workers" || status=1
    fi
  done
  if [ "$ngpu" -ge 2 ]; then
    # the one test that needs two visible GPUs (each group above sees one): tensors on a device
    # that is not the current one
    python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k not_current >"$OUT/tests-two-gpus.log" 2>&1 \
      || status=1
    tail -1 "$OUT/tests-two-gpus.log"
    export CUDA_VISIBLE_DEVICES=0
  fi
  python3 -m tritonattn 2>&1 | tee "$OUT/main.log"
fi

if [ -z "${SKIP_EXTRA:-}" ]; then
  # host time per call, and torch.compile (inductor) + bf16 convergence against sdpa
  extras=" ${EXTRAS:-overhead integration example} "
  [[ $extras == *" overhead "* ]] && python3 scripts/overhead.py 2>&1 | tee "$OUT/overhead.md"
  [[ $extras == *" integration "* ]] && python3 scripts/integration_gpu.py 2>&1 | tee "$OUT/integration.log" | tail -25
  # shellcheck disable=SC2086
  [[ $extras == *" profile "* ]] && python3 scripts/profile_case.py ${PROFILE_ARGS:-} 2>&1 | tee "$OUT/profile.md"
  [[ $extras == *" example "* ]] && python3 examples/hf_llama.py 2>&1 | tee "$OUT/hf_llama-example.log" | tail -15
  # the Gluon tuners: several runs separated by ';' log to gluon-fwd.md, gluon-fwd1.md, ...
  if [[ $extras == *" bwd-flags "* ]]; then
    IFS=';' read -ra flag_runs <<< "${BWD_FLAGS_ARGS:-}"
    [ ${#flag_runs[@]} -eq 0 ] && flag_runs=("")
    for i in "${!flag_runs[@]}"; do
      log="$OUT/bwd-flags$( [ "$i" -gt 0 ] && echo "$i" ).md"
      # (the quoted settings of a run are split as the shell would: "configs.X[a][b]=(1,2)")
      eval "flag_args=(${flag_runs[$i]})" || { echo "cannot parse bwd-flags run $i"; status=1; continue; }
      timeout "${TUNE_WALL:-0}" python3 benchmarks/experiments/bwd_flags.py "${flag_args[@]}" 2>&1 \
        | tee "$log" | grep -v "(expected: " | tail -30
      rc=${PIPESTATUS[0]}
      [ "$rc" -ne 0 ] && { echo "bwd-flags run $i exited $rc"; status=1; }
      # a setting meant to keep the default's bits (no LOOSE part) whose gradients differ fails the call
      grep "GRADIENTS DIFFER" "$log" | grep -qv "(expected: " && { echo "bwd-flags run $i: unexpected gradient differences"; status=1; }
    done
  fi
  for mode in fwd bwd; do
    [[ $extras == *" gluon-$mode "* ]] || continue
    args_var=GLUON_${mode^^}_ARGS
    IFS=';' read -ra gluon_runs <<< "${!args_var:-}"
    [ ${#gluon_runs[@]} -eq 0 ] && gluon_runs=("")
    for i in "${!gluon_runs[@]}"; do
      log="$OUT/gluon-$mode$( [ "$i" -gt 0 ] && echo "$i" ).md"
      # shellcheck disable=SC2086
      timeout "${TUNE_WALL:-0}" python3 benchmarks/experiments/tune_gluon_$mode.py ${gluon_runs[$i]} 2>&1 \
        | tee "$log" | tail -30
      rc=${PIPESTATUS[0]}
      # the tuners check each kernel against the reference first (FAIL lines, exit 1)
      [ "$rc" -ne 0 ] && { echo "gluon-$mode run $i exited $rc"; grep -m 20 "^FAIL" "$log"; status=1; }
    done
  done
fi

if [ -z "${SKIP_BENCH:-}" ]; then
  # several runs separated by ';' go to bench, bench1, ...
  IFS=';' read -ra bench_runs <<< "${BENCH_ARGS:---grid llama}"
  for i in "${!bench_runs[@]}"; do
    dir=bench$( [ "$i" -gt 0 ] && echo "$i" )
    # shellcheck disable=SC2086
    python3 -m tritonattn.bench ${bench_runs[$i]} --out "$OUT/$dir" 2>"$OUT/$dir.err" | tee "$OUT/$dir.md"
    tail -5 "$OUT/$dir.err"
  done
fi

if [ -n "${TUNE_DECODE_ARGS:-}" ]; then
  # shellcheck disable=SC2086
  timeout "${TUNE_WALL:-0}" python3 scripts/tune_decode.py $TUNE_DECODE_ARGS 2>&1 | tee "$OUT/tune-decode.log" | tail -40
fi

if [ -n "${TUNE_ARGS:-}" ]; then
  # several runs separated by ';' log to tune.log, tune1.log, ...; TUNE_WALL bounds each
  IFS=';' read -ra tune_runs <<< "$TUNE_ARGS"
  for i in "${!tune_runs[@]}"; do
    # shellcheck disable=SC2086
    timeout "${TUNE_WALL:-0}" python3 scripts/tune.py ${tune_runs[$i]} 2>&1 \
      | tee "$OUT/tune$( [ "$i" -gt 0 ] && echo "$i" ).log" | tail -40
  done
fi

for pid in "${tests_pids[@]}"; do
  wait "$pid" || status=1
done
echo "tests exit status $status"
(cd "$OUT" && tar czf all.tar.gz --exclude=all.tar.gz .)
exit $status
