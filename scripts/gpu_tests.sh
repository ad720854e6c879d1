#!/usr/bin/env bash
# The GPU tests on the GPU machine, within a time limit that still leaves their results readable.
#
#   source .whl/env.sh && bash scripts/gpu_tests.sh "$OUT" 540 [pytest arguments, e.g. tests/test_gpu_exports.py]
#
# A device call has a hard limit; a pytest killed by it prints nothing about the tests that failed.
# Here pytest gets SIGINT at the limit instead (then SIGKILL 20 s later), so it still prints each
# failure's traceback, the short summary and the durations into OUT/gpu-tests.log, and writes
# OUT/gpu-tests.xml. Each test also has a limit of its own where pytest-timeout is installed
# (AUTOTUNE_GPU_TEST_TIMEOUT, default 300 s).
set -uo pipefail
out=${1:?usage: gpu_tests.sh OUT_DIR [SECONDS] [pytest args...]}
limit=${2:-540}
shift $(( $# >= 2 ? 2 : 1 ))
mkdir -p "$out"
per_test=()  # pytest-timeout, where installed (the GPU image has it)
python3 -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout="${AUTOTUNE_GPU_TEST_TIMEOUT:-300}")
timeout -s INT -k 20 "$limit" python3 -m pytest -m gpu -v -rA --tb=short --durations=0 -p no:cacheprovider \
  "${per_test[@]}" --junitxml="$out/gpu-tests.xml" "$@" > "$out/gpu-tests.log" 2>&1
rc=$?
grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|^tests/.*(PASSED|FAILED|ERROR|SKIPPED)|^=+ .*(passed|failed|error)" "$out/gpu-tests.log" | tail -80
echo "pytest exit status $rc (124 or 130: the ${limit}s limit stopped it; the log has what ran)"
exit $rc
