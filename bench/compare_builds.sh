#!/usr/bin/env bash
# Runs the regression benchmarks of two GPU builds in one sitting on the GPU machine, each
# benchmark for A then B back to back, so both see the same GPU state (clocks, temperature,
# neighbours). For "before and after" of a change: build the old tree in one folder and the new
# in another (tools/gpu_build.sh DIR), then
#   bench/compare_builds.sh OLD_BUILD NEW_BUILD OUTDIR [serve]
# Writes OUTDIR/<bench>.<A|B>.txt and prints each benchmark's summary lines. `serve` also runs
# bench/bench_serve.py (synthetic:layers=4, 1/16/64 streams) against each build's m3serve.
set -uo pipefail
A=$1
B=$2
OUT=$3
WITH_SERVE=${4:-}
here="$(cd "$(dirname "$0")" && pwd)"
mkdir -p "$OUT"
run_pair() {  # run_pair NAME CMD... (CMD relative to a build dir; @ is replaced by it)
  local name=$1
  shift
  for tag in A B; do
    local dir=${!tag}
    local cmd=("${@//@/$dir}")
    echo "== $name [$tag: $dir]"
    timeout 240 "${cmd[@]}" > "$OUT/$name.$tag.txt" 2>&1
    echo "   rc=$? ($(wc -l < "$OUT/$name.$tag.txt") lines)"
  done
}
run_pair layer_exact @/bench/bench_layer 8192 10 exact
run_pair layer_bf16 @/bench/bench_layer 8192 10 bf16
run_pair gemm_moe @/bench/bench_gemm_moe 10 quick
run_pair msa_decode @/bench/bench_msa_decode 10
if [[ "$WITH_SERVE" == serve ]]; then
  run_pair serve python3 "$here/bench_serve.py" --m3serve @/bin/m3serve --layers 4 \
    --concurrency 1,16,64 --max-tokens 128
fi
