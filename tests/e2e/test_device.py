"""`--device` on the engine-backed commands (`serve`, `chat`): asking for the GPU where none can
be used (a build without CUDA, or a machine without a GPU) exits non-zero at once with one clear
`m3serve: error:` line that names `--device cpu`, before any model file is read."""

import os
import shutil
import subprocess

import pytest

from conftest import REPO

MODEL = os.path.join(REPO, "tests", "golden", "model", "m3_ratio")


def gpu_present():
    smi = shutil.which("nvidia-smi")
    if not smi:
        return False
    p = subprocess.run([smi, "-L"], capture_output=True, text=True)
    return p.returncode == 0 and "GPU" in p.stdout


def run(binary, *args):
    return subprocess.run([binary, *args], capture_output=True, text=True, timeout=60,
                          stdin=subprocess.DEVNULL)


def one_error_line(p):
    lines = [l for l in p.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("m3serve: error:"), p.stderr
    return lines[0]


@pytest.mark.parametrize("cmd", [["serve", MODEL, "--host", "127.0.0.1", "--port", "0"], ["chat", MODEL]])
def test_cuda_without_a_gpu_is_one_clear_line(binary, cmd):
    if gpu_present():
        pytest.skip("a GPU is present: --device cuda would start")
    p = run(binary, *cmd, "--device", "cuda")
    assert p.returncode != 0
    line = one_error_line(p)
    assert "--device cuda" in line and "--device cpu" in line, line
    assert p.stdout == "", "nothing may start before the device is refused"


@pytest.mark.parametrize("value", ["0", "1.5", "-0.2"])
def test_gpu_memory_utilization_outside_0_1_is_refused(binary, value):
    p = run(binary, "serve", MODEL, "--port", "0", "--device", "cuda", "--gpu-memory-utilization", value)
    assert p.returncode != 0
    assert "--gpu-memory-utilization" in one_error_line(p)


def test_unknown_device_is_refused(binary):
    p = run(binary, "serve", MODEL, "--port", "0", "--device", "tpu")
    assert p.returncode != 0
    assert "--device" in p.stderr
