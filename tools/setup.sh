#!/usr/bin/env bash
# Installs every package the build and the tests need (Debian 12 + PyPI). Idempotent.
set -euo pipefail
SUDO=""
if [ "$(id -u)" != "0" ]; then SUDO="sudo"; fi
need_apt=0
for p in cmake ninja-build g++ pkg-config python3 python3-pip nlohmann-json3-dev \
         libcli11-dev libexpected-dev libpcre2-dev libutf8proc-dev libxxhash-dev libgtest-dev \
         libgmock-dev ccache curl clang-format libzmq3-dev cppzmq-dev libmsgpack-cxx-dev libjpeg62-turbo-dev libpng-dev zlib1g-dev libwebp-dev \
         libavformat-dev libavcodec-dev libswscale-dev libavutil-dev libgif-dev; do
  dpkg -s "$p" >/dev/null 2>&1 || need_apt=1
done
if [ "$need_apt" = 1 ]; then
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
    cmake ninja-build g++ pkg-config python3 python3-pip nlohmann-json3-dev \
    libcli11-dev libexpected-dev libpcre2-dev libutf8proc-dev libxxhash-dev libgtest-dev \
    libgmock-dev ccache curl clang-format libzmq3-dev cppzmq-dev libmsgpack-cxx-dev libjpeg62-turbo-dev \
    libpng-dev zlib1g-dev libwebp-dev libavformat-dev libavcodec-dev libswscale-dev libavutil-dev libgif-dev \
    >/dev/null
fi
# Python oracles and the real OpenAI / Anthropic clients and openai-agents for the tests (no
# torch: the model goldens are committed, made by tools/goldens/make_model_goldens.py on the GPU
# machine).
python3 -m pip install -q --disable-pip-version-check tokenizers jinja2 openai pytest numpy \
  safetensors jsonschema langchain-openai anthropic openai-agents pyzmq msgspec 2>&1 | grep -v -i "warning: running pip as" || true
# The routers users run in front of vLLM and SGLang (Rust binary wheels): tests/e2e/test_router.py
# runs two workers behind vllm-router (kv_aware on our KV events, cache_aware) and sglang-router.
python3 -m pip install -q --disable-pip-version-check "vllm-router==0.1.17" "sglang-router==0.3.2" 2>&1 \
  | grep -v -i "warning: running pip as" || true
# NIXL, the transfer engine of prefill/decode disaggregation (--kv-transfer-config NixlConnector,
# tests/e2e/test_pd_disagg.py): m3serve dlopens the wheel's libnixl_capi.so and its UCX plugin at
# run time. --no-deps: its Python dependencies (torch, the CUDA wheels) are not needed for that.
python3 -m pip install -q --disable-pip-version-check --no-deps "nixl-cu13==1.5.1" 2>&1 \
  | grep -v -i "warning: running pip as" || true
# xgrammar (structured outputs): its PyPI sdist carries the C++ library, which cmake/deps.cmake
# builds with the Python bindings off. Only xgrammar itself is taken as source (pip builds the
# sdist's metadata with its build backend from wheels); the sources stay in the ignored .deps/.
XGRAMMAR_VERSION=0.2.8
repo="$(cd "$(dirname "$0")/.." && pwd)"
if [ ! -f "$repo/.deps/xgrammar-$XGRAMMAR_VERSION/CMakeLists.txt" ]; then
  mkdir -p "$repo/.deps"
  python3 -m pip download -q --disable-pip-version-check --no-deps --no-binary xgrammar \
    "xgrammar==$XGRAMMAR_VERSION" -d "$repo/.deps" 2>&1 | grep -v -i "warning: running pip as" || true
  tar -xzf "$repo/.deps/xgrammar-$XGRAMMAR_VERSION.tar.gz" -C "$repo/.deps"
fi
# aiperf (NVIDIA's serving benchmark, what users point at vLLM's server) in a venv of its own, so
# its ~80 pinned dependencies stay out of the system Python: tests/e2e/test_aiperf.py.
AIPERF_VERSION=0.13.0
if [ ! -x "$repo/.deps/aiperf-venv/bin/aiperf" ]; then
  mkdir -p "$repo/.deps"
  python3 -m venv --system-site-packages "$repo/.deps/aiperf-venv" &&
    "$repo/.deps/aiperf-venv/bin/pip" install -q --disable-pip-version-check \
      "aiperf==$AIPERF_VERSION" 2>&1 | grep -v -i "warning: running pip as" || true
fi
