#!/usr/bin/env bash
# The test command: builds, then runs every CPU test (unit, model goldens, end to end).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build/release}
bash tools/build.sh "$BUILD"
# No retries: a test that fails once is a bug in the test or the code.
ctest --test-dir "$BUILD" -L cpu --output-on-failure -j "${M3_TEST_JOBS:-2}" --timeout 900
