"""Fixtures for the m3serve end-to-end tests: a tiny random M3 checkpoint made at test time and
`m3serve serve` processes on 127.0.0.1, driven by the official `openai` client.

The binary comes from $M3SERVE_BIN (set by the ctest registration) or build/*/bin/m3serve.
"""

import collections
import glob
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
API_KEY = "e2e-secret-key"
MODEL_NAME = "m3-e2e"


def find_binary():
    b = os.environ.get("M3SERVE_BIN")
    if b:
        return b
    cands = sorted(glob.glob(os.path.join(REPO, "build", "*", "bin", "m3serve")), key=os.path.getmtime)
    if not cands:
        pytest.skip("m3serve binary not found: set M3SERVE_BIN")
    return cands[-1]


class Server:
    """One `m3serve serve` process. Port 0 lets the server pick a free port; we read it from
    the start-up line."""

    def __init__(self, binary, model_dir, extra_args=(), env=None):
        self.binary = binary
        self.model_dir = model_dir
        args = [binary, "serve", model_dir, "--host", "127.0.0.1", "--port", "0",
                "--served-model-name", MODEL_NAME] + list(extra_args)
        # errors="replace": a log line with bytes that are not UTF-8 must not kill the reader
        # (the pipe would fill and block the server's next log write).
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     errors="replace", env=dict(os.environ, **(env or {})))
        # The server logs a line per request on stderr: read it continuously (a full pipe would
        # block the server) and keep the last lines for tests and failure messages.
        self.log = collections.deque(maxlen=2000)
        self._log_reader = threading.Thread(target=self._read_log, daemon=True)
        self._log_reader.start()
        self.startup_line = self.proc.stdout.readline()
        m = re.search(r"listening on http://[^:]+:(\d+)", self.startup_line)
        if not m:
            if not self.startup_line:  # stdout closed: the process is exiting; wait for its
                try:                   # last stderr lines (poll() may not see it gone yet)
                    self.proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    pass
            if self.proc.poll() is not None:
                self._log_reader.join(timeout=5)
            err = "".join(self.log)
            self.proc.kill()
            raise RuntimeError(f"m3serve did not start: {self.startup_line!r} {err}")
        self.port = int(m.group(1))
        self.base = f"http://127.0.0.1:{self.port}"
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except Exception:
                time.sleep(0.1)
        raise RuntimeError("m3serve /health never became ready")

    def _read_log(self):
        for line in self.proc.stderr:
            self.log.append(line)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="session")
def binary():
    return find_binary()


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("e2e_model"))
    subprocess.run([sys.executable, os.path.join(REPO, "tools", "make_e2e_model.py"), out, "--seed", "1234"],
                   check=True, stdout=subprocess.DEVNULL)
    return out


@pytest.fixture(scope="session")
def server(binary, model_dir):
    s = Server(binary, model_dir, ["--api-key", API_KEY, "--max-model-len", "2048", "--max-num-seqs", "64",
                                   "--max-queue-len", "512", "--kv-cache-memory-bytes", "64MiB"])
    yield s
    s.stop()


@pytest.fixture(scope="session")
def client(server):
    import openai
    return openai.OpenAI(base_url=server.base + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def http(server, method, path, body=None, headers=None, raw=None):
    """Plain HTTP (for error cases the client would refuse to send). Returns (status, text)."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    h = {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"}
    h.update(headers or {})
    req = urllib.request.Request(server.base + path, data=data, method=method, headers=h)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def metrics(server):
    status, text = http(server, "GET", "/metrics")
    assert status == 200
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name_labels, value = line.rsplit(" ", 1)
        out[name_labels] = float(value)
    return out


def parse_labels(text):
    """'a="x",b="y"' -> {"a": "x", "b": "y"} (values without escaped quotes, as in these tests)."""
    return dict(re.findall(r'(\w+)="([^"]*)"', text))


def metric(server, name, labels=""):
    """The value of series `name` with the model's labels (model_name, engine) plus `labels`."""
    want = {"model_name": MODEL_NAME, "engine": "0", **parse_labels(labels)}
    for key, value in metrics(server).items():
        n, _, rest = key.partition("{")
        if n == name and parse_labels(rest) == want:
            return value
    raise KeyError(f"{name} {want}")


def wait_idle(server, timeout=30):
    """Waits until nothing runs or waits and every KV page is free; returns the metrics."""
    deadline = time.time() + timeout
    while True:
        running = metric(server, "vllm:num_requests_running")
        waiting = metric(server, "vllm:num_requests_waiting")
        usage = metric(server, "vllm:kv_cache_usage_perc")
        if (running == 0 and waiting == 0 and usage == 0) or time.time() > deadline:
            return running, waiting, usage
        time.sleep(0.1)
