#!/usr/bin/env bash
# Fills the ignored folder .gpu_deps/ (.gitignore) with the third-party headers and
# libraries the full build needs but the GPU machine (Ubuntu 24.04, no internet, no apt) lacks,
# copied from this development machine's Debian packages (tools/setup.sh installs them).
# cmake/deps.cmake takes them from there when the system has no package, and the `run` tool
# carries the folder to the GPU machine (carry: [".gpu_deps"]). Keeps it small (about 12 MB):
# headers and static .a archives.
# Usage: tools/gpu_deps.sh [DEST]   (DEST defaults to <repo>/.gpu_deps)
set -euo pipefail

repo="$(cd "$(dirname "$0")/.." && pwd)"
dest="${1:-$repo/.gpu_deps}"
inc=/usr/include
lib=/usr/lib/x86_64-linux-gnu
mkdir -p "$dest/include" "$dest/lib"

need() { [[ -e "$1" ]] || { echo "gpu_deps.sh: $1 is missing; run tools/setup.sh (apt packages) first" >&2; exit 1; }; }
copy_inc() {  # copy_inc PATH...: files or folders under /usr/include, dereferenced
  for p in "$@"; do
    need "$inc/$p"
    mkdir -p "$dest/include/$(dirname "$p")"
    cp -rL "$inc/$p" "$dest/include/$(dirname "$p")/"
  done
}
copy_lib() {  # copy_lib NAME...: files in the multiarch lib folder, dereferenced (soname kept)
  for n in "$@"; do
    need "$lib/$n"
    cp -L "$lib/$n" "$dest/lib/$n"
  done
}

# Header-only libraries: tl-expected, nlohmann-json, CLI11.
copy_inc tl/expected.hpp nlohmann CLI
# gtest (static libraries; Debian builds them into libgtest.a / libgtest_main.a).
copy_inc gtest
copy_lib libgtest.a libgtest_main.a
# PCRE2 (8-bit), utf8proc, xxhash: headers + static archives.
copy_inc pcre2.h utf8proc.h xxhash.h xxh3.h
copy_lib libpcre2-8.a libutf8proc.a libxxhash.a
# KV events: cppzmq and msgpack-cxx headers, libzmq as the shared library (its static archive
# needs Kerberos and ICU archives Debian does not ship) with the libraries it needs that Ubuntu
# 24.04 does not have by default; cmake/deps.cmake links them with an inherited RPATH.
copy_inc zmq.h zmq.hpp zmq_addon.hpp msgpack.hpp msgpack
copy_lib libzmq.so.5 libsodium.so.23 libpgm-5.3.so.0 libnorm.so.1
# Image decoders (src/vision): libjpeg-turbo, libpng (+ zlib), libwebp headers + static archives.
copy_inc jpeglib.h jmorecfg.h jerror.h png.h pngconf.h pnglibconf.h zlib.h zconf.h webp
copy_lib libjpeg.a libpng16.a libz.a libwebp.a
# Video decoding (libavformat/libavcodec/libswscale) is not copied: those shared libraries pull in
# every codec library Debian links them with (tens of MB). The GPU build has no video input and
# answers video_url parts with a 400 that says so (cmake/deps.cmake, M3_HAVE_LIBAV=0).
need "$inc/x86_64-linux-gnu/jconfig.h"  # multiarch header: into the include root
cp -L "$inc/x86_64-linux-gnu/jconfig.h" "$dest/include/jconfig.h"
# xgrammar's sources (structured outputs), from the sdist tools/setup.sh unpacked into .deps/:
# only what its static library's build reads (about 2 MB).
xg=xgrammar-0.2.8
need "$repo/.deps/$xg/CMakeLists.txt"
rm -rf "$dest/$xg"
mkdir -p "$dest/$xg/3rdparty"
cp -r "$repo/.deps/$xg/CMakeLists.txt" "$repo/.deps/$xg/cmake" "$repo/.deps/$xg/cpp" \
  "$repo/.deps/$xg/include" "$dest/$xg/"
cp -r "$repo/.deps/$xg/3rdparty/picojson" "$repo/.deps/$xg/3rdparty/dlpack" "$dest/$xg/3rdparty/"

{
  echo "# Filled by tools/gpu_deps.sh on $(date -u +%Y-%m-%dT%H:%M:%SZ) from these Debian packages:"
  dpkg-query -W -f '${Package} ${Version}\n' libtl-expected-dev nlohmann-json3-dev libcli11-dev \
    libgtest-dev libpcre2-dev libutf8proc-dev libxxhash-dev libzmq3-dev cppzmq-dev \
    libmsgpack-cxx-dev libjpeg62-turbo-dev libpng-dev zlib1g-dev libwebp-dev 2>/dev/null || true
  echo "$xg (PyPI sdist)"
} > "$dest/VERSIONS"
echo "gpu_deps.sh: $(du -sh "$dest" | cut -f1) in $dest"
