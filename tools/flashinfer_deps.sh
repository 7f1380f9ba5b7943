#!/usr/bin/env bash
# Unpacks the headers of FlashInfer's Hopper prefill kernel (kernels/cuda/attn_flash.cu; its
# CUTLASS also builds the wgmma grouped MoE GEMM, kernels/cuda/moe_grouped_sm90*.cu) into
# .deps/flashinfer (git-ignored) from the flashinfer-python wheel on PyPI: its include/, the
# CUTLASS it bundles (include/ and tools/util/include) and its libcu++ (newer than CUDA 13.0's),
# and packs them as .deps/flashinfer.tar.xz (~3 MB) for the GPU machine, where
# tools/gpu_build.sh unpacks it (carry [".gpu_deps", ".deps/flashinfer.tar.xz"]). Nothing of
# FlashInfer is committed. Usage: tools/flashinfer_deps.sh (on a machine that reaches PyPI).
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
ver=0.7.2.post1
dest="$repo/.deps/flashinfer"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --quiet --no-deps --only-binary=:all: "flashinfer-python==$ver" -d "$tmp"
( cd "$tmp" && python3 -m zipfile -e flashinfer_python-*.whl x >/dev/null )
d="$tmp/x/flashinfer/data"
rm -rf "$dest"
mkdir -p "$dest/cutlass/tools/util" "$dest/cccl"
cp -r "$d/include" "$dest/"
cp -r "$d/cutlass/include" "$dest/cutlass/"
cp -r "$d/cutlass/tools/util/include" "$dest/cutlass/tools/util/"
cp -r "$d/cccl/libcudacxx/include" "$dest/cccl/libcudacxx"
echo "flashinfer-python $ver (PyPI wheel): include/, cutlass/include, cutlass/tools/util/include, cccl/libcudacxx/include" > "$dest/VERSION"
tar -C "$repo/.deps" -cJf "$repo/.deps/flashinfer.tar.xz" flashinfer
echo "flashinfer_deps.sh: $(du -sh "$dest" | cut -f1) in $dest; $(du -h "$repo/.deps/flashinfer.tar.xz" | cut -f1) archive"
