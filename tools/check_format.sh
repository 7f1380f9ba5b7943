#!/usr/bin/env bash
# The style check CI runs (.ci/run): every C++ and CUDA source must be formatted as
# .clang-format says. Prints each file that is not, and how to fix it; exits 1 if any.
# Usage: tools/check_format.sh [--fix]   (--fix rewrites the files in place)
set -euo pipefail
cd "$(dirname "$0")/.."
CLANG_FORMAT=${CLANG_FORMAT:-clang-format}
# Tracked files and new ones not yet added (not ignored), so a new source is formatted before
# its first commit.
mapfile -t files < <(git ls-files --cached --others --exclude-standard 'src/*.h' 'src/*.cpp' \
                       'src/*.cu' 'src/*.cuh' 'tests/*.h' 'tests/*.cpp' 'bench/*.h' 'bench/*.cpp' \
                       'bench/*.cu')
if [[ "${1:-}" == --fix ]]; then
  "$CLANG_FORMAT" -i "${files[@]}"
  exit 0
fi
bad=0
for f in "${files[@]}"; do
  if ! "$CLANG_FORMAT" --dry-run --Werror "$f" >/dev/null 2>&1; then
    echo "not formatted: $f"
    bad=$((bad + 1))
  fi
done
echo "$("$CLANG_FORMAT" --version | head -1): ${#files[@]} files checked, $bad not formatted"
if [[ $bad -gt 0 ]]; then
  echo "run: bash tools/check_format.sh --fix" >&2
  exit 1
fi
