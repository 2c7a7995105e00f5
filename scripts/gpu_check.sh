#!/usr/bin/env bash
# One call on the GPU machine: environment, the whole test suite (GPU tier included), the main
# job, and the benchmark. Logs and results go to $OUT (the device tool brings them back).
#   scripts/gpu_check.sh                 tests + main job + benchmark (BENCH_ARGS, default: llama grid)
#   SKIP_TESTS=1 scripts/gpu_check.sh    benchmark only
#   SKIP_BENCH=1 scripts/gpu_check.sh    tests only
#   SKIP_EXTRA=1                         without scripts/overhead.py and scripts/integration_gpu.py
set -uo pipefail
OUT=${OUT:-/tmp/tritonattn-gpu}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
status=0

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv | tee "$OUT/env.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cudnn', torch.backends.cudnn.version())" | tee -a "$OUT/env.txt"
echo "commit ${TRITONATTN_COMMIT:-unknown}" | tee -a "$OUT/env.txt"

if [ -z "${SKIP_TESTS:-}" ]; then
  # -v: every result line names its test, so a run cut short still says what failed
  python3 -m pytest -v -rf -p no:cacheprovider -n ${PYTEST_WORKERS:-12} --timeout ${PYTEST_TIMEOUT:-600} \
    --maxfail=25 ${PYTEST_ARGS:-tests} 2>&1 | tee "$OUT/tests.log" | grep -E "FAILED|ERROR|passed|failed" | tail -40
  status=${PIPESTATUS[0]}
  python3 -m tritonattn 2>&1 | tee "$OUT/main.log"
fi

if [ -z "${SKIP_EXTRA:-}" ]; then
  # host time per call, and torch.compile (inductor) + bf16 convergence against sdpa
  python3 scripts/overhead.py 2>&1 | tee "$OUT/overhead.md"
  python3 scripts/integration_gpu.py 2>&1 | tee "$OUT/integration.log" | tail -25
fi

if [ -z "${SKIP_BENCH:-}" ]; then
  # shellcheck disable=SC2086
  python3 -m tritonattn.bench ${BENCH_ARGS:---grid llama} --out "$OUT/bench" 2>"$OUT/bench.err" | tee "$OUT/bench.md"
  tail -5 "$OUT/bench.err"
fi
exit $status
