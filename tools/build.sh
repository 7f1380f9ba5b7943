#!/usr/bin/env bash
# Builds m3serve (CPU backend; the CUDA backend is added when nvcc is found and M3_CUDA is not
# OFF). Usage: tools/build.sh [build-dir]. Output: <build-dir>/bin/m3serve.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build/release}
JOBS=${M3_JOBS:-$(nproc)}
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DM3_CUDA=${M3_CUDA:-OFF} >/dev/null
cmake --build "$BUILD" -j "$JOBS"
