#!/usr/bin/env python3
"""Checks that each src/ folder includes only the folders below it (docs/ARCHITECTURE.md).

The CMake link graph is the dependency rule; this check keeps the #include lines honest with it,
since every library shares the src/ include root. Exit status 1 lists each violation.
"""
import pathlib
import re
import sys

# folder -> folders it may include (besides itself)
ALLOWED = {
    "core": set(),
    "gpu": {"core"},
    "kernels": {"gpu", "core"},
    "dist": {"gpu", "core"},  # gpu only for the NCCL communicator
    "model": {"kernels", "dist", "gpu", "core"},
    "runtime": {"model", "kernels", "dist", "gpu", "core"},
    "sched": {"core"},
    "engine": {"sched", "runtime", "model", "kernels", "dist", "gpu", "core"},
    "text": {"core"},
    "vision": {"core"},
    "server": {"text", "vision", "engine", "core"},
    "app": {"server", "text", "vision", "engine", "sched", "runtime", "model", "kernels", "dist", "gpu",
            "core"},
}
# server talks to the engine only through engine/engine.h (and the plain types it includes)
SERVER_ENGINE_HEADERS = {"engine/engine.h", "engine/sampling_params.h", "engine/kv_transfer.h"}

# Sub-folders that pull in CUDA: only app/ (and the folders they belong to) may include them, so
# the engine, scheduler and server build and run without the CUDA toolkit.
CUDA_ONLY = ("model/cuda/", "runtime/cuda/", "kernels/cuda/", "gpu/", "dist/nccl_communicator.h")
CUDA_ALLOWED = {"app", "runtime", "model", "kernels", "dist", "gpu"}

INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def main() -> int:
    src = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "src")
    bad = []
    for path in sorted(src.rglob("*")):
        if path.suffix not in {".h", ".cpp", ".cu", ".cuh", ".hpp"}:
            continue
        folder = path.relative_to(src).parts[0]
        if folder not in ALLOWED:
            bad.append(f"{path}: folder '{folder}' is not in the layer map of tools/check_layers.py")
            continue
        for inc in INCLUDE.findall(path.read_text(errors="replace")):
            top = inc.split("/")[0]
            if top not in ALLOWED or "/" not in inc:
                continue  # a local or third-party header
            if top != folder and top not in ALLOWED[folder]:
                bad.append(f"{path}: includes {inc}, but {folder}/ may not depend on {top}/")
            if inc.startswith(CUDA_ONLY) and folder not in CUDA_ALLOWED:
                bad.append(f"{path}: includes {inc}; {folder}/ must build without CUDA (only app/ wires the GPU in)")
            if folder == "server" and top == "engine" and inc not in SERVER_ENGINE_HEADERS:
                bad.append(f"{path}: server/ may use the engine only through engine/engine.h, not {inc}")
    for b in bad:
        print(b)
    print(f"{len(bad)} layer violations")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
