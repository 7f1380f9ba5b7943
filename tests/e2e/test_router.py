"""Behind a real router (issue #21 item 3): two m3serve workers on loopback behind the routers
users run in front of vLLM and SGLang (`vllm-router` and `sglang-router` from PyPI, Rust binary
wheels; tools/setup.sh installs them), with their prefix-aware policies. Requests that share a long prefix must land on the worker that holds the
prefix: each repeat reports cached tokens in `usage`, and the worker's own counters show it
served them.

- kv_aware: the router subscribes to each worker's KV event stream (--kv-events-config), asks the
  worker's /tokenize for the request's token ids, and scores workers by the cached blocks the
  events announced.
- cache_aware (both routers): the router's own approximate radix tree over request text (no
  events).
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from conftest import MODEL_NAME, Server

BS = 128


def router_command(name):
    """The router's launch command, or None when its package is not installed."""
    if name == "vllm-router":
        exe = shutil.which("vllm-router")
        return [exe] if exe else None
    try:
        import sglang_router  # noqa: F401
    except ImportError:
        return None
    return [sys.executable, "-m", "sglang_router.launch_router"]


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def post(base, path, body):
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def prompt_tokens_served(worker):
    """The worker's vllm:prompt_tokens_total: what it prefilled, i.e. which requests it ran."""
    with urllib.request.urlopen(worker.base + "/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("vllm:prompt_tokens_total{"):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no vllm:prompt_tokens_total")


class Router:
    def __init__(self, command, workers, policy, events):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        args = command + ["--host", "127.0.0.1", "--port", str(self.port), "--policy", policy,
                "--worker-urls", *[w.base for w in workers], "--health-check-interval-secs", "1",
                "--prometheus-port", str(free_port()),
                "--log-level", "debug", "--disable-retries"]
        if policy == "cache_aware":
            # Route by prefix whenever any of it matches (the default needs 30% of the text).
            args += ["--cache-threshold", "0.1"]
        for w, (port, replay) in zip(workers, events):
            if port:
                args += ["--kv-event-source", f"{w.base}=tcp://127.0.0.1:{port}",
                         "--kv-event-replay-source", f"{w.base}=tcp://127.0.0.1:{replay}",
                         "--kv-event-block-size", str(BS), "--kv-event-model", MODEL_NAME]
        self.log_path = f"/tmp/m3-e2e-router-{self.port}.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 60
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm-router exited: {self.tail()}")
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except Exception:
                time.sleep(0.2)
        raise RuntimeError(f"vllm-router never became healthy: {self.tail()}")

    def tail(self):
        self.log.flush()
        with open(self.log_path) as f:
            return f.read()[-4000:]

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        os.unlink(self.log_path)


@pytest.fixture(scope="module")
def workers(binary, model_dir):
    out = []
    events = []
    try:
        for _ in range(2):
            port, replay = free_port(), free_port()
            cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}",
                   "replay_endpoint": f"tcp://*:{replay}"}
            out.append(Server(binary, model_dir, ["--max-model-len", "4096", "--kv-cache-memory-bytes",
                                                  "64MiB", "--kv-events-config", json.dumps(cfg)]))
            events.append((port, replay))
        yield out, events
    finally:
        for w in out:
            w.stop()


@pytest.mark.parametrize("router_name,policy", [("vllm-router", "kv_aware"),
                                                ("vllm-router", "cache_aware"),
                                                ("sglang-router", "cache_aware")])
def test_shared_prefix_lands_on_the_worker_that_holds_it(workers, router_name, policy):
    command = router_command(router_name)
    if command is None:
        pytest.skip(f"{router_name} is not installed (tools/setup.sh pip-installs it)")
    ws, events = workers
    router = Router(command, ws, policy, events if policy == "kv_aware" else [(None, None)] * 2)
    try:
        # Two long prefixes (about 1,900 tokens each) with distinct words; a tag per policy keeps
        # the two runs from sharing cache entries.
        prefixes = [" ".join(f"{router_name} {policy} doc{d} w{(i * (d + 3)) % 41} v{i % 13}"
                             for i in range(140))
                    for d in range(2)]
        home = {}
        # An order no load-only policy follows by chance (round robin alternates workers).
        order = [0, 1, 0, 0, 1, 1, 0, 1, 1, 0, 0]
        for n, d in enumerate(order):
            prefix = prefixes[d]
            before = [prompt_tokens_served(w) for w in ws]
            u = post(router.base, "/v1/completions",
                     {"model": MODEL_NAME, "prompt": f"{prefix} question {n}", "max_tokens": 2,
                      "temperature": 0})["usage"]
            after = [prompt_tokens_served(w) for w in ws]
            served = [i for i in range(2) if after[i] > before[i]]
            assert len(served) == 1, (before, after)
            cached = u["prompt_tokens_details"]["cached_tokens"]
            if d not in home:
                home[d] = served[0]
                assert cached == 0, u  # a new prefix: nothing cached anywhere yet
                if policy == "kv_aware":
                    time.sleep(0.5)  # the stored-block events reach the router's index
                continue
            assert served[0] == home[d], (policy, n, d, home, router.tail())
            # Every full block of the shared prefix is reused (only the question differs).
            assert cached >= (u["prompt_tokens"] - 16) // BS * BS - BS, u
            assert cached > 0 and cached % BS == 0, u
        if policy == "kv_aware":
            log = router.tail()
            assert "credited_prefix_tokens" in log, log  # the router scored our cached blocks
    finally:
        router.stop()


def test_router_replays_kv_events_it_missed(workers):
    """A prefix a worker cached before the router started: the router learns it from the
    worker's replay endpoint once it sees a gap in the sequence numbers, and routes the prefix
    there (vllm-router's kv_aware with --kv-event-replay-source)."""
    command = router_command("vllm-router")
    if command is None:
        pytest.skip("vllm-router is not installed (tools/setup.sh pip-installs it)")
    ws, events = workers
    prefix = " ".join(f"replay w{(i * 7) % 43} v{i % 17}" for i in range(140))
    body = {"model": MODEL_NAME, "max_tokens": 1, "temperature": 0}
    assert post(ws[1].base, "/v1/completions", dict(body, prompt=prefix + " first"))["usage"][
        "prompt_tokens_details"]["cached_tokens"] == 0
    router = Router(command, ws, "kv_aware", events)
    try:
        time.sleep(1)  # the router's subscriptions reach the workers
        # A later batch from worker 1 (a prompt of full blocks) shows the router the gap.
        post(ws[1].base, "/v1/completions",
             dict(body, prompt=" ".join(f"other u{i % 23}" for i in range(200))))
        deadline = time.time() + 20
        while "replay sequence advanced" not in router.tail() and time.time() < deadline:
            time.sleep(0.2)
        assert "replay sequence advanced" in router.tail(), router.tail()
        before = [prompt_tokens_served(w) for w in ws]
        u = post(router.base, "/v1/completions", dict(body, prompt=prefix + " second"))["usage"]
        after = [prompt_tokens_served(w) for w in ws]
        assert after[1] > before[1] and after[0] == before[0], (before, after)
        assert u["prompt_tokens_details"]["cached_tokens"] > 0, u
    finally:
        router.stop()
