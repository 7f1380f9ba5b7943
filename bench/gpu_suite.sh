#!/usr/bin/env bash
# The GPU machine's whole measuring session in one command (docs/PERFORMANCE.md "How to rerun"):
# build, every GPU test, then the benches in order of importance, each started only while the
# elapsed time is under its share of LIM seconds (default 480), so one call of a time-limited
# device run ends in time with the most important numbers. Logs go to OUT (default
# build/gpu/suite); a `steps.txt` there says what ran when.
#
#   bash bench/gpu_suite.sh                      # all of it
#   LIM=300 SKIP_BUILD=1 bash bench/gpu_suite.sh # a warm machine whose build/gpu is current
#   VLLM_MSA_VENDOR=DIR bash bench/gpu_suite.sh  # also vLLM's Triton MSA ops (the anchor:
#                                                # ../shared/anchors/vllm_msa, get_vendor.sh DIR)
#
# Needs .gpu_deps/ (tools/gpu_deps.sh on the development machine; or its tarball, unpacked here
# when GPU_DEPS_TAR names it) and, for the FlashInfer prefill, .deps/flashinfer.tar.xz.
set -uo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
cd "$repo"
LIM=${LIM:-480}
OUT=${OUT:-$repo/build/gpu/suite}
mkdir -p "$OUT"
T0=$(date +%s)
el() { echo $(($(date +%s) - T0)); }
before() { [[ $(el) -lt $1 ]]; }  # start a step only before this many seconds
log() { echo "== [$(el)s] $*" | tee -a "$OUT/steps.txt"; }
B=build/gpu/bench

if [[ -n "${GPU_DEPS_TAR:-}" && ! -d .gpu_deps/include ]]; then tar -xJf "$GPU_DEPS_TAR"; fi
if [[ -z "${SKIP_BUILD:-}" ]]; then
  log build
  bash tools/gpu_build.sh > "$OUT/build.txt" 2>&1 || {
    grep -B2 -A12 "error" "$OUT/build.txt" | head -80
    exit 1
  }
  tail -1 "$OUT/build.txt"
fi
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$OUT/steps.txt"

log "ctest -L gpu"
ctest --test-dir build/gpu -L gpu -j4 --timeout 240 --output-on-failure > "$OUT/ctest.txt" 2>&1
grep -E "tests passed|\(Failed\)|Timeout|Exception" "$OUT/ctest.txt" | tail -12

if before $((LIM - 60)); then
  log "bench_msa_decode (bf16, fp8)"
  M3_BENCH_FORMATS=bfloat16,fp8_e4m3 M3_BENCH_CONTEXTS=8192,131072,1048576 \
    $B/bench_msa_decode 20 1048576 > "$OUT/msa_decode.txt" 2>&1
  grep -E "^[a-z0-9_]+/|^(bfloat16|fp8_e4m3) " "$OUT/msa_decode.txt"
fi
if before $((LIM - 40)); then
  log "bench_layer (decode, bf16)"
  $B/bench_layer 8192 10 bf16 bfloat16 bfloat16 bf16 0 > "$OUT/layer.txt" 2>&1
  tail -6 "$OUT/layer.txt"
fi
if before $((LIM - 40)); then
  log "bench_step (the whole decode step of synthetic:layers=4, 2K context)"
  $B/bench_step 4 2048 20 1,16,64 > "$OUT/step.txt" 2>&1
  tail -4 "$OUT/step.txt"
fi
if before $((LIM - 60)); then
  log "bench_serve.py"
  PYTHONUNBUFFERED=1 timeout 150 python3 bench/bench_serve.py --m3serve build/gpu/bin/m3serve \
    --layers 4 --concurrency 1,16,64 --max-tokens 128 > "$OUT/serve.txt" 2>&1
  tail -5 "$OUT/serve.txt"
fi
if before $((LIM - 60)); then
  log "bench_serve.py, 2K-token prompts (decode TPOT beside the mean)"
  PYTHONUNBUFFERED=1 timeout 100 python3 bench/bench_serve.py --m3serve build/gpu/bin/m3serve \
    --layers 4 --concurrency 1,16,64 --max-tokens 256 --prompt-len 2048 > "$OUT/serve2k.txt" 2>&1
  tail -4 "$OUT/serve2k.txt"
fi
if before $((LIM - 40)); then
  log "bench_msa_prefill"
  $B/bench_msa_prefill 3 8192,32768 > "$OUT/msa_prefill.txt" 2>&1
  tail -6 "$OUT/msa_prefill.txt"
fi
if before $((LIM - 50)); then
  log "bench_ttft.py"
  PYTHONUNBUFFERED=1 timeout 100 python3 bench/bench_ttft.py --m3serve build/gpu/bin/m3serve \
    --layers 4 --lengths 8192,32768,131072 --repeat 1 > "$OUT/ttft.txt" 2>&1
  tail -5 "$OUT/ttft.txt"
fi
if before $((LIM - 30)); then
  log "sdpa_reference.py"
  timeout 60 python3 bench/sdpa_reference.py 20 1048576 > "$OUT/sdpa.txt" 2>&1
  tail -9 "$OUT/sdpa.txt"
fi
if [[ -n "${VLLM_MSA_VENDOR:-}" ]] && before $((LIM - 60)); then
  log "vLLM's MSA ops (anchor)"
  anchor="${VLLM_MSA_ANCHOR:-$repo/../shared/anchors/vllm_msa}"
  timeout 100 python3 "$anchor/bench_vllm_msa.py" "$OUT/vllm.json" --batches 1,8 \
    --contexts 8192,131072,1048576 --prefill 32768 --layouts LBNHC --no-profile --budget-s 75 \
    > "$OUT/vllm.txt" 2>&1
  grep -E "DECODE|PREFILL|done" "$OUT/vllm.txt"
fi
if before $((LIM - 60)); then
  log "bench_quant_gemv --quick (with fp8_linear: FP8 activations)"
  timeout 90 $B/bench_quant_gemv --quick > "$OUT/quant_gemv.txt" 2>&1
  grep -E "^###|^\| (64|1024) \|" "$OUT/quant_gemv.txt" | head -24
fi
if before $((LIM - 60)); then
  log "bench_ttft.py, synthetic weights=fp8, bf16 vs FP8 activations"
  for a in 0 1; do
    M3_FP8_ACTIVATIONS=$a PYTHONUNBUFFERED=1 timeout 80 python3 bench/bench_ttft.py \
      --m3serve build/gpu/bin/m3serve --layers 4 --weights fp8 --lengths 8192,32768 --repeat 1 \
      > "$OUT/ttft_fp8_act$a.txt" 2>&1
    tail -3 "$OUT/ttft_fp8_act$a.txt"
  done
fi
if before $((LIM - 40)); then
  log "bench_gemm_moe"
  timeout 60 $B/bench_gemm_moe 10 quick > "$OUT/gemm_moe.txt" 2>&1
  tail -12 "$OUT/gemm_moe.txt"
fi
log done
