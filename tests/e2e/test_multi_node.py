"""Tensor parallel over processes (issue #22): `serve --nnodes 2` as two processes on this machine,
node 0 with the API server and node 1 `--headless`, their ranks' collectives over the TCP
communicator. Greedy output (text and logprobs, bit for bit) equals the single-process TP2 (and
TP4 for 2 nodes x 2 ranks), and the text equals TP1; stopping node 0 ends node 1 cleanly; a killed
node 1 fails node 0's requests with an error naming the lost rank and turns /health to 503, and
node 0 keeps running; mismatched nodes and an absent node 0 are refused with the flags named."""

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request

import pytest

from conftest import MODEL_NAME, REPO, Server

DEMO = os.path.join(REPO, "models", "demo")
PROMPTS = ["The capital of France is", "1, 2, 3, 4,"]
COMMON = ["--kv-cache-memory-bytes", "32MiB", "--max-model-len", "1024"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def completion(server, prompt, timeout=120):
    body = json.dumps({"model": MODEL_NAME, "prompt": prompt, "max_tokens": 16, "temperature": 0,
                       "logprobs": 1}).encode()
    req = urllib.request.Request(server.base + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())["choices"][0]


def answers(server):
    return [completion(server, p) for p in PROMPTS]


def single_process(binary, extra):
    s = Server(binary, DEMO, COMMON + extra)
    try:
        return answers(s)
    finally:
        s.stop()


def start_group(binary, tp, extra0=(), extra1=(), env=None):
    """Node 1 first (it retries until node 0 listens), then node 0, whose start-up line appears
    once node 1 has joined."""
    port = free_port()
    flags = ["--tensor-parallel-size", str(tp), "--nnodes", "2", "--master-addr", "127.0.0.1",
             "--master-port", str(port)]
    node1 = subprocess.Popen([binary, "serve", DEMO, *COMMON, *flags, "--node-rank", "1", "--headless",
                              *extra1], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             errors="replace", env=dict(os.environ, **(env or {})))
    try:
        node0 = Server(binary, DEMO, COMMON + flags + ["--node-rank", "0", *extra0], env=env)
    except Exception:
        node1.kill()
        raise
    return node0, node1


def test_two_processes_give_the_single_process_tokens(binary):
    want = {"tp1": single_process(binary, []), "tp2": single_process(binary, ["--tp", "2"])}
    node0, node1 = start_group(binary, 2)
    try:
        assert "2 nodes" in node0.startup_line and "TCP between nodes" in node0.startup_line, \
            node0.startup_line
        got = answers(node0)
    finally:
        node0.stop()
    # Stopping node 0 ends node 1 cleanly (the shutdown frame), within seconds.
    out, err = node1.communicate(timeout=30)
    assert node1.returncode == 0, err
    assert "node 0 shut down" in err, err
    for a, b in zip(got, want["tp2"]):
        assert a["text"] == b["text"]
        # The TCP communicator adds the ranks in the in-process one's order: bitwise the same.
        assert a["logprobs"]["token_logprobs"] == b["logprobs"]["token_logprobs"]
    for a, b in zip(got, want["tp1"]):
        assert a["text"] == b["text"]
        for x, y in zip(a["logprobs"]["token_logprobs"], b["logprobs"]["token_logprobs"]):
            assert abs(x - y) < 1e-3  # the sharded forward's tolerance (model_sharded_test.cpp)


def test_two_nodes_of_two_ranks_equal_tp4(binary):
    want = single_process(binary, ["--tp", "4", "--enable-expert-parallel"])
    node0, node1 = start_group(binary, 4, ["--enable-expert-parallel"], ["--enable-expert-parallel"])
    try:
        got = answers(node0)
    finally:
        node0.stop()
        node1.communicate(timeout=30)
    assert node1.returncode == 0
    for a, b in zip(got, want):
        assert a["text"] == b["text"]
        assert a["logprobs"]["token_logprobs"] == b["logprobs"]["token_logprobs"]


def test_a_lost_node_fails_requests_with_a_clear_error(binary):
    node0, node1 = start_group(binary, 2)
    try:
        completion(node0, PROMPTS[0])  # the group works
        node1.send_signal(signal.SIGKILL)
        node1.wait(timeout=10)
        # /health turns 503 without a request (the step connection is watched).
        deadline = time.time() + 10
        code = 200
        while time.time() < deadline and code == 200:
            try:
                with urllib.request.urlopen(node0.base + "/health", timeout=2) as r:
                    code = r.status
            except urllib.error.HTTPError as e:
                code = e.code
            time.sleep(0.1)
        assert code == 503
        t0 = time.time()
        with pytest.raises(urllib.error.HTTPError) as e:
            completion(node0, PROMPTS[1], timeout=30)
        assert time.time() - t0 < 10  # never a hang
        assert e.value.code in (500, 503)
        msg = e.value.read().decode()
        assert "node 1" in msg and "lost" in msg, msg
        assert node0.proc.poll() is None  # never a crash
    finally:
        node0.stop()
        if node1.poll() is None:
            node1.kill()
    assert node0.proc.returncode == 0


def test_mismatched_nodes_and_an_absent_node_zero_are_refused(binary):
    port = free_port()
    flags = ["--tensor-parallel-size", "2", "--nnodes", "2", "--master-addr", "127.0.0.1",
             "--master-port", str(port)]
    node1 = subprocess.Popen([binary, "serve", DEMO, *COMMON, *flags, "--node-rank", "1", "--headless",
                              "--enable-expert-parallel"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    node0 = subprocess.run([binary, "serve", DEMO, *COMMON, *flags, "--node-rank", "0", "--port", "0"],
                           capture_output=True, text=True, timeout=120)
    node1.communicate(timeout=30)
    assert node0.returncode != 0 and node1.returncode != 0
    err = [l for l in node0.stderr.splitlines() if l.startswith("m3serve: error:")]
    assert len(err) == 1 and "node 1 refused to join" in err[0] and "expert parallel" in err[0], \
        node0.stderr
    # No node 0: node 1 gives up at the deadline, naming the address and the flags.
    lone = subprocess.run([binary, "serve", DEMO, *COMMON, *flags, "--node-rank", "1", "--headless"],
                          capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, M3_DIST_TIMEOUT_S="1"))
    assert lone.returncode != 0
    err = [l for l in lone.stderr.splitlines() if l.startswith("m3serve: error:")]
    assert len(err) == 1 and f"127.0.0.1:{port}" in err[0] and "--master-addr" in err[0], lone.stderr


@pytest.mark.parametrize("args,says", [
    (["--nnodes", "2", "--tp", "3"], "does not split evenly"),
    (["--nnodes", "2", "--tp", "2", "--headless"], "node 0 runs the API server"),
    (["--nnodes", "2", "--node-rank", "1", "--tp", "2"], "add --headless"),
    (["--headless"], "--headless is for nodes"),
    (["--nnodes", "2", "--dp", "2"], "over several nodes"),
])
def test_multi_node_flag_errors_in_one_line(binary, args, says):
    p = subprocess.run([binary, "serve", DEMO, "--port", "0", *args], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode != 0
    err = [l for l in p.stderr.splitlines() if l.startswith("m3serve: error:")]
    assert len(err) == 1 and says in err[0], p.stderr


def test_speculative_decoding_over_nodes_is_refused_with_the_fix(binary):
    port = free_port()
    flags = ["--tensor-parallel-size", "2", "--nnodes", "2", "--master-addr", "127.0.0.1",
             "--master-port", str(port)]
    spec = json.dumps({"method": "eagle3", "model": os.path.join(REPO, "models", "demo-eagle3"),
                       "num_speculative_tokens": 3})
    node1 = subprocess.Popen([binary, "serve", DEMO, *COMMON, *flags, "--node-rank", "1", "--headless"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        node0 = subprocess.run([binary, "serve", DEMO, *COMMON, *flags, "--node-rank", "0", "--port",
                                "0", "--speculative-config", spec],
                               capture_output=True, text=True, timeout=120)
        node1.communicate(timeout=30)  # node 0's end reaches node 1: it exits, never hangs
    finally:
        if node1.poll() is None:
            node1.kill()
    assert node0.returncode != 0
    err = [l for l in node0.stderr.splitlines() if l.startswith("m3serve: error:")]
    assert len(err) == 1 and "speculative decoding over several nodes" in err[0] and \
        "on one node" in err[0], node0.stderr
