#!/usr/bin/env bash
# The full build (m3serve and every test, CUDA on) on the GPU machine, whose missing Debian
# libraries come from .gpu_deps/ (filled by tools/gpu_deps.sh on the development machine and
# carried over by the `run` tool: carry [".gpu_deps"]). Run from anywhere; builds in build/gpu
# (or $1). Then: build/gpu/bin/m3serve, `ctest --test-dir build/gpu -L gpu`.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
build="${1:-$repo/build/gpu}"
if [[ ! -d "$repo/.gpu_deps/include" ]]; then
  echo "gpu_build.sh: $repo/.gpu_deps is missing; run tools/gpu_deps.sh on the development machine" \
       "and carry .gpu_deps to this one" >&2
  exit 1
fi
# FlashInfer's headers (tools/flashinfer_deps.sh), when their archive was carried.
if [[ -f "$repo/.deps/flashinfer.tar.xz" && ! -d "$repo/.deps/flashinfer/include" ]]; then
  tar -C "$repo/.deps" -xJf "$repo/.deps/flashinfer.tar.xz"
fi
cmake -S "$repo" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DM3_CUDA=ON
cmake --build "$build" -j"$(nproc)"
