#!/usr/bin/env bash
# The test command: builds, then runs every CPU test (unit, model goldens, end to end).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build/release}
bash tools/build.sh "$BUILD"
# --repeat until-pass:2: a test that fails is run once more (the end-to-end suite drives a real
# server under load and was seen to fail once in ~10 runs without a reproducible cause; a real
# regression fails both times).
ctest --test-dir "$BUILD" -L cpu --output-on-failure -j "${M3_TEST_JOBS:-2}" --timeout 900 \
  --repeat until-pass:2
