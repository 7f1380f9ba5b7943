"""Measures the numbers in docs/RELIABILITY.md against a fresh `m3serve serve` on 127.0.0.1 (the
e2e checkpoint, CPU). Not a test (no assertions on timings); run it by hand:

    python3 tests/e2e/reliability_probe.py [--streams 1000]

Bounded: every phase has a count and a deadline, and the server is stopped at the end."""

import argparse
import concurrent.futures as cf
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from conftest import MODEL_NAME, REPO, Server, find_binary, http, metric, wait_idle  # noqa: E402


def rss_mb(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def health_ms(s):
    t = time.time()
    with urllib.request.urlopen(s.base + "/health", timeout=30) as r:
        r.read()
    return (time.time() - t) * 1000


def stream_one(s, max_tokens, ttft):
    body = json.dumps({"model": MODEL_NAME, "prompt": "count with me", "max_tokens": max_tokens,
                       "ignore_eos": True, "stream": True}).encode()
    sock = socket.create_connection(("127.0.0.1", s.port), timeout=300)
    t0 = time.time()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: " +
                 str(len(body)).encode() + b"\r\n\r\n" + body)
    data, first = b"", None
    while b"[DONE]" not in data:
        b = sock.recv(65536)
        if not b:
            break
        if first is None and b"\"text\"" in data + b:
            first = time.time() - t0
        data += b
    sock.close()
    status = int(data[9:12]) if data.startswith(b"HTTP/1.1") else 0
    if first is not None:
        ttft.append(first)
    return status, b"[DONE]" in data


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=1000)
    args = ap.parse_args()
    binary = find_binary()
    model_dir = tempfile.mkdtemp(prefix="m3probe_")
    subprocess.run([sys.executable, os.path.join(REPO, "tools", "make_e2e_model.py"), model_dir, "--seed", "1234"],
                   check=True, stdout=subprocess.DEVNULL)
    s = Server(binary, model_dir, ["--max-model-len", "2048", "--max-num-seqs", "64", "--max-queue-len", "2000",
                                   "--kv-cache-memory-bytes", "256MiB", "--request-header-timeout", "10"])
    out = {}
    try:
        out["rss_idle_mb"] = rss_mb(s.proc.pid)
        # 1. N concurrent streams, /health sampled meanwhile.
        ttft, hl = [], []
        stop = threading.Event()

        def sample_health():
            while not stop.is_set():
                hl.append(health_ms(s))
                time.sleep(0.05)

        th = threading.Thread(target=sample_health)
        th.start()
        t0 = time.time()
        peak = [0.0]

        def watch_rss():
            while not stop.is_set():
                peak[0] = max(peak[0], rss_mb(s.proc.pid))
                time.sleep(0.2)

        tr = threading.Thread(target=watch_rss)
        tr.start()
        with cf.ThreadPoolExecutor(args.streams) as ex:
            res = list(ex.map(lambda _: stream_one(s, 32, ttft), range(args.streams)))
        stop.set()
        th.join()
        tr.join()
        out["streams"] = {"n": args.streams, "completed": sum(1 for st, done in res if st == 200 and done),
                          "429": sum(1 for st, _ in res if st == 429), "wall_s": round(time.time() - t0, 1),
                          "ttft_p50_s": round(statistics.median(ttft), 2),
                          "ttft_p99_s": round(sorted(ttft)[int(len(ttft) * 0.99) - 1], 2),
                          "health_ms_max": round(max(hl), 1), "health_ms_p50": round(statistics.median(hl), 1),
                          "health_samples": len(hl), "rss_peak_mb": round(peak[0]),
                          "idle_after": wait_idle(s, 60), "rss_after_mb": round(rss_mb(s.proc.pid))}
        # 2. Slow clients: 300 slowloris + 300 slow bodies held open; /health and a completion.
        socks = []
        for i in range(600):
            c = socket.create_connection(("127.0.0.1", s.port), timeout=30)
            c.sendall(b"POST /tokenize HTTP/1.1\r\nHost: x\r\n" +
                      (b"X-Slow: a" if i % 2 else b"Content-Length: 100000\r\n\r\n{\"prompt\": \""))
            socks.append(c)
        hs = [health_ms(s) for _ in range(20)]
        t = time.time()
        st, _ = http(s, "POST", "/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 8})
        out["slow_clients"] = {"held": len(socks), "health_ms_max": round(max(hs), 1),
                               "completion_status": st, "completion_s": round(time.time() - t, 2)}
        t = time.time()
        closed = 0
        for c in socks:
            c.settimeout(30)
            try:
                closed += c.recv(16).startswith(b"HTTP/1.1 408")
            except OSError:
                pass
            c.close()
        out["slow_clients"]["answered_408"] = closed
        out["slow_clients"]["all_closed_after_s"] = round(time.time() - t, 1)
        # 3. Hang-ups: 50 non-streaming and 50 streaming clients leave after 1 s.
        aborted0 = metric(s, "vllm:request_success_total", 'finished_reason="abort"')
        hang = []
        for stream in (False, True):
            for _ in range(50):
                body = json.dumps({"model": MODEL_NAME, "prompt": "go", "max_tokens": 1900, "ignore_eos": True,
                                   "stream": stream}).encode()
                c = socket.create_connection(("127.0.0.1", s.port), timeout=30)
                c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: " + str(len(body)).encode() +
                          b"\r\n\r\n" + body)
                hang.append(c)
        time.sleep(1.0)
        t = time.time()
        for c in hang:
            c.close()
        idle = wait_idle(s, 60)
        out["hangups"] = {"clients": len(hang), "idle": idle, "freed_after_s": round(time.time() - t, 2),
                          "aborts": metric(s, "vllm:request_success_total", 'finished_reason="abort"') - aborted0}
        # 4. Hostile bodies: status, time, RSS after.
        hostile = {
            "nest_20k_tokenize": ("/tokenize", ('{"messages":[{"role":"user","content":"x","k":' + "[" * 20000 + "]" * 20000 + "}]}").encode()),
            "nest_200k_detokenize": ("/detokenize", ("{\"tokens\":[1],\"x\":" + "[" * 200000 + "]" * 200000 + "}").encode()),
            "messages_100k": ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "x"}] * 100000}).encode()),
            "tool_100k_props": ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(100000)}}}}]}).encode()),
            "prompt_30MB_tokenize": ("/tokenize", json.dumps({"prompt": "a" * (30 << 20)}).encode()),
            "prompt_30MB_completion": ("/v1/completions", json.dumps({"prompt": "ab " * (10 << 20), "max_tokens": 1}).encode()),
            "body_40MB": ("/tokenize", json.dumps({"prompt": "a" * (40 << 20)}).encode()),
        }
        out["hostile"] = {}
        for name, (path, body) in hostile.items():
            t = time.time()
            st, text = http(s, "POST", path, raw=body)
            out["hostile"][name] = {"status": st, "s": round(time.time() - t, 2), "rss_mb": round(rss_mb(s.proc.pid))}
        for _ in range(28):
            http(s, "POST", "/v1/chat/completions", raw=hostile["messages_100k"][1])
        out["hostile"]["rss_after_28_x_messages_100k_mb"] = round(rss_mb(s.proc.pid))
        # 5. SIGTERM with 20 streams in flight.
        res = []

        def long_stream():
            res.append(stream_one(s, 200, []))

        ts = [threading.Thread(target=long_stream) for _ in range(20)]
        for t_ in ts:
            t_.start()
        time.sleep(1.0)
        t = time.time()
        s.proc.send_signal(signal.SIGTERM)
        rc = s.proc.wait(timeout=60)
        for t_ in ts:
            t_.join()
        out["sigterm"] = {"streams": 20, "completed": sum(1 for st, done in res if done), "exit": rc,
                          "exit_after_s": round(time.time() - t, 1)}
    finally:
        s.stop()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
