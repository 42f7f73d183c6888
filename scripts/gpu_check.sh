#!/usr/bin/env bash
# On the H100 machine: build the extension there, run the GPU tests and a quick benchmark.
# Logs go to $OUT when set (the device tool brings that folder back), else /tmp/tk_jax_gpu.
# Usage: scripts/gpu_check.sh [extra pytest args]
set -uo pipefail
cd "$(dirname "$0")/.."
LOG="${OUT:-/tmp/tk_jax_gpu}"
mkdir -p "$LOG"
export PYTHONUNBUFFERED=1

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"

# Peers for the benchmark (FlashAttention-3 for JAX, fla): wheels carried in .whl/, never
# dependencies of the project.
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/tk_peers .whl/*.whl \
    && export PYTHONPATH="/tmp/tk_peers${PYTHONPATH:+:$PYTHONPATH}"
fi

# A warm device machine keeps build/ from the last call, while the working tree arrives with
# this machine's file times, older than those objects: ninja would keep stale kernels.
# No network there, so no build isolation: the build uses the headers of the jaxlib installed
# there, or those TK_JAX_FFI_INCLUDE_DIR names (e.g. a carried copy of the oldest supported
# jaxlib's, as the isolated build off the machine uses; a relative path is from the repo root).
rm -rf build
start=$(date +%s)
if ! python3 -m pip install --no-build-isolation --no-deps -e . >"$LOG/build.log" 2>&1; then
  tail -60 "$LOG/build.log"
  echo "BUILD FAILED"
  exit 1
fi
echo "build: $(($(date +%s) - start)) s"
python3 -m tk_jax info | grep -E "jaxlib|xla_ffi|have_kernels"

# The slowest tests are listed last: the whole GPU suite does not fit one device call, and
# TK_GPU_TESTS (a list of test files) splits it. Each test's time also goes to
# test_times.txt as it ends (conftest.py), which comes back when the call is cut short.
export TK_TEST_TIMES="$LOG/test_times.txt"
rm -f "$TK_TEST_TIMES"
python3 -m pytest -m gpu -q -p no:cacheprovider --durations=15 "$@" ${TK_GPU_TESTS:-tests} 2>&1 | tee "$LOG/gpu_tests.log"
tests_rc=${PIPESTATUS[0]}
python3 scripts/test_times.py "$TK_TEST_TIMES"

if [ "${TK_SANITIZE:-0}" = 1 ]; then
  for tool in memcheck racecheck synccheck; do
    # XLA's preallocated pool under the sanitizer can run out of memory: allocate on demand.
    XLA_PYTHON_CLIENT_PREALLOCATE=false compute-sanitizer --tool "$tool" --error-exitcode 3 \
      python3 scripts/sanitize_case.py >"$LOG/sanitize-$tool.log" 2>&1
    echo "compute-sanitizer $tool: exit $? ($(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$LOG/sanitize-$tool.log" | tr '\n' ' '))"
  done
fi

if [ "${TK_BENCH_ARGS:-}" != none ]; then
  python3 -m bench ${TK_BENCH_ARGS:-attention --quick} --out "$LOG" 2>&1 | tee "$LOG/bench.log"
fi

echo "gpu tests exit code: $tests_rc"
exit "$tests_rc"
