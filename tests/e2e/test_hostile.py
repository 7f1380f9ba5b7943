"""Hostile requests and clients (issue #13) against `m3serve serve`: every one is answered 4xx
(or costs nothing), the server stays up and serves others, and what hung-up clients held is freed.
The mutation fuzzer is in test_fuzz.py; the measured numbers are in docs/RELIABILITY.md."""

import concurrent.futures as cf
import gzip
import json
import socket
import subprocess
import time
import urllib.request

import pytest

from conftest import API_KEY, MODEL_NAME, Server, http, metric, wait_idle


def raw_request(port, data, timeout=30):
    """Sends raw bytes; returns (status, body) of the first response (status 0: none)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    try:
        s.sendall(data)
        out = b""
        while True:
            try:
                b = s.recv(65536)
            except (ConnectionResetError, socket.timeout):
                break
            if not b:
                break
            out += b
            head, sep, body = out.partition(b"\r\n\r\n")
            if sep and b"content-length:" in head.lower():
                n = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                if len(body) >= n:
                    break
    finally:
        s.close()
    if not out.startswith(b"HTTP/1.1 "):
        return 0, out
    return int(out[9:12]), out.partition(b"\r\n\r\n")[2].decode(errors="replace")


def post(port, path, body, extra_headers=b""):
    return raw_request(port, b"POST " + path + b" HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " +
                       API_KEY.encode() + b"\r\nContent-Type: application/json\r\n" + extra_headers +
                       b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


def deep(n):
    return "[" * n + "]" * n


@pytest.mark.parametrize("path,make", [
    (b"/tokenize", lambda d: {"messages": [{"role": "user", "content": "hi", "x": d}]}),
    (b"/tokenize", lambda d: {"prompt": "hi", "extra": d}),
    (b"/detokenize", lambda d: {"tokens": [1], "x": d}),
    (b"/v1/chat/completions", lambda d: {"messages": [{"role": "user", "content": "hi"}],
                                         "chat_template_kwargs": {"k": d}}),
    (b"/v1/chat/completions", lambda d: {"messages": [{"role": "user", "content": "hi"}],
                                         "tools": [{"type": "function", "function": {"name": "f", "parameters": {"x": d}}}]}),
    (b"/v1/chat/completions", lambda d: {"messages": [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"a":' + d + "}"}}]},
        {"role": "user", "content": "hi"}]}),
    (b"/v1/completions", lambda d: {"prompt": "hi", "stop": d}),
])
@pytest.mark.parametrize("depth", [20000, 200000])
def test_deep_nesting_is_400_not_a_crash(server, path, make, depth):
    body = json.dumps(make(deep(depth))).replace('"[[', "[[").replace(']]"', "]]").encode()
    if b"arguments" in body:  # keep the arguments a JSON string
        body = json.dumps(make(deep(depth))).encode()
    status, text = post(server.port, path, body)
    assert status == 400, text[:300]
    assert "levels deep" in text
    assert http(server, "GET", "/health")[0] == 200


def test_http_framing_errors_are_4xx(server):
    p = server.port
    # Two different Content-Length headers: request smuggling behind a proxy.
    st, text = raw_request(p, b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{} ")
    assert st == 400 and "Content-Length" in text
    st, _ = raw_request(p, b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
                           b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n")
    assert st == 400
    # Compressed bodies are refused (a 1 MB gzip inflating to 1 GiB was accepted before).
    bomb = gzip.compress(b'{"prompt": "' + b"a" * (4 << 20) + b'"}')
    st, text = post(p, b"/tokenize", bomb, b"Content-Encoding: gzip\r\n")
    assert st == 415 and "uncompressed" in text
    # Chunked bodies count against the same limit as Content-Length ones.
    st, text = raw_request(p, b"POST /tokenize HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                              b"7fffffff\r\n")
    assert st == 413
    st, _ = raw_request(p, b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999999\r\n\r\n")
    assert st == 413
    st, _ = raw_request(p, b"GET /health HTTP/1.1\r\n" + b"X-A: b\r\n" * 200 + b"\r\n")
    assert st == 431
    st, _ = raw_request(p, b"GARBAGE\r\n\r\n")
    assert st == 400
    # A chunked body that is well formed works.
    body = b'{"prompt": "hello"}'
    st, text = raw_request(p, b"POST /tokenize HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" +
                           b"%x\r\n" % 5 + body[:5] + b"\r\n" + b"%x\r\n" % (len(body) - 5) + body[5:] + b"\r\n0\r\n\r\n")
    assert st == 200 and json.loads(text)["count"] > 0


def test_wrong_method_is_405_with_allow(server):
    s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    s.sendall(b"GET /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + API_KEY.encode() + b"\r\n\r\n")
    head = s.recv(65536).decode()
    s.close()
    assert head.startswith("HTTP/1.1 405")
    assert "Allow: POST" in head
    assert http(server, "DELETE", "/health")[0] == 405
    assert http(server, "GET", "/no/such/route")[0] == 404


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {"prompt": "hi", "return_token_strs": "yes"}, "return_token_strs"),
    ("/tokenize", {"prompt": "hi", "model": 5}, "model"),
    ("/v1/completions", {"prompt": "hi", "n": 300}, "n"),
    ("/v1/completions", {"prompt": ["a"] * 100, "n": 100}, "n"),
    ("/v1/completions", {"prompt": "hi", "stop": ["s"] * 100}, "stop"),
    ("/v1/completions", {"prompt": "hi", "stop": "x" * 5000}, "stop"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}] * 10000}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function", "function": {"name": "f", "parameters": {
                                  "type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(100000)}}}}]},
     None),  # refused while parsing the body (an object of 100,000 keys costs seconds to parse)
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function", "function": {"name": f"f{i}", "parameters": {
                                  "type": "object", "properties": {f"p{k}": {"type": "string"} for k in range(100)}}}}
                                  for i in range(100)]},
     "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": 5}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
])
def test_field_caps_and_types_are_400_naming_the_field(server, path, body, param):
    status, text = http(server, "POST", path, body)
    assert status == 400, text[:300]
    assert json.loads(text)["error"]["param"] == param


def test_long_prompt_refused_before_tokenizing(server):
    # 8 MiB of text cannot fit --max-model-len 2048 whatever the tokenizer does: refused by its
    # size, and /tokenize (open without a key) too.
    text = "a" * (8 << 20)
    status, body = http(server, "POST", "/tokenize", {"prompt": text})
    assert status == 400 and "bytes per token" in body
    status, body = http(server, "POST", "/v1/completions", {"model": MODEL_NAME, "prompt": text, "max_tokens": 1})
    assert status == 400 and json.loads(body)["error"]["code"] == "context_length_exceeded"


def test_port_in_use_fails_with_address_in_use(binary, model_dir, server):
    p = subprocess.run([binary, "serve", model_dir, "--host", "127.0.0.1", "--port", str(server.port)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    assert "address in use" in p.stderr


def test_nonstreaming_hangup_is_aborted_and_freed(server):
    aborted = metric(server, "vllm:request_success_total", 'finished_reason="abort"')
    body = json.dumps({"model": MODEL_NAME, "prompt": "tell me a long story", "max_tokens": 1800,
                       "ignore_eos": True, "n": 4}).encode()
    s = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + API_KEY.encode() +
              b"\r\nContent-Type: application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    deadline = time.time() + 30
    while metric(server, "vllm:kv_cache_usage_perc") == 0 and time.time() < deadline:
        time.sleep(0.05)
    assert metric(server, "vllm:kv_cache_usage_perc") > 0  # the request runs
    s.close()  # the client goes away before the response
    assert wait_idle(server, timeout=30) == (0, 0, 0)
    assert metric(server, "vllm:request_success_total", 'finished_reason="abort"') >= aborted + 4
    assert metric(server, "m3:client_aborts_total") >= 1


def test_slow_clients_do_not_lock_others_out(binary, model_dir):
    s = Server(binary, model_dir, ["--max-model-len", "1024", "--request-header-timeout", "2",
                                   "--request-body-timeout", "2", "--http-threads", "4"])
    socks = []
    try:
        # More slow clients than workers: slowloris (headers never end) and slow bodies.
        for i in range(40):
            c = socket.create_connection(("127.0.0.1", s.port), timeout=10)
            if i % 2:
                c.sendall(b"POST /tokenize HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            else:
                c.sendall(b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n{\"prompt\": \"")
            socks.append(c)
        # Everyone else is served: health, metrics, generation.
        assert http(s, "GET", "/health")[0] == 200
        assert http(s, "GET", "/metrics")[0] == 200
        st, body = http(s, "POST", "/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 4})
        assert st == 200, body
        # Past their deadlines the slow ones are answered 408 and closed.
        statuses = []
        for c in socks:
            c.settimeout(30)
            try:
                data = c.recv(4096)
            except (ConnectionResetError, socket.timeout):
                data = b""
            statuses.append(data[:12])
        assert all(x == b"HTTP/1.1 408" for x in statuses), statuses
        assert metric(s, "m3:http_connection_timeouts_total") >= 40
    finally:
        for c in socks:
            c.close()
        s.stop()


def test_connection_cap_evicts_idle_and_slow_first(binary, model_dir):
    s = Server(binary, model_dir, ["--max-model-len", "1024", "--max-connections", "20",
                                   "--max-connections-per-client", "20"])
    socks = []
    try:
        for _ in range(60):  # three times the cap of connections that never send a request
            socks.append(socket.create_connection(("127.0.0.1", s.port), timeout=10))
            socks[-1].sendall(b"GET /health HTTP/1.1\r\n")
        # A real request still gets through: the oldest unfinished connections made room.
        assert http(s, "GET", "/health")[0] == 200
        assert metric(s, "m3:http_connections_open") <= 20
    finally:
        for c in socks:
            c.close()
        s.stop()


def test_max_queue_len_counts_only_requests_that_cannot_start(binary, model_dir):
    s = Server(binary, model_dir, ["--max-num-seqs", "2", "--max-queue-len", "2", "--max-model-len", "4096",
                                   "--kv-cache-memory-bytes", "16MiB"])
    try:
        body = {"model": MODEL_NAME, "prompt": "long " * 20, "max_tokens": 1500, "ignore_eos": True}
        with cf.ThreadPoolExecutor(10) as ex:
            futs = [ex.submit(http, s, "POST", "/v1/completions", body) for _ in range(10)]
            results = [f.result() for f in futs]
        statuses = sorted(r[0] for r in results)
        # 2 running + 2 waiting fit; the other 6 are refused with Retry-After.
        assert statuses.count(200) == 4, statuses
        assert statuses.count(429) == 6, statuses
    finally:
        s.stop()


def test_shutdown_timeout_aborts_what_is_left(binary, model_dir):
    s = Server(binary, model_dir, ["--max-model-len", "4096", "--shutdown-timeout", "1"])
    import openai
    client = openai.OpenAI(base_url=s.base + "/v1", api_key="none", max_retries=0, timeout=120)
    out = {}

    def long_request():
        chunks = list(client.completions.create(model=MODEL_NAME, prompt="never ends", max_tokens=4000,
                                                stream=True, extra_body={"ignore_eos": True}))
        out["finish"] = [c.choices[0].finish_reason for c in chunks if c.choices][-1]

    import threading
    t = threading.Thread(target=long_request)
    t.start()
    while metric(s, "vllm:num_requests_running") == 0:
        time.sleep(0.05)
    s.proc.send_signal(15)
    assert s.proc.wait(timeout=30) == 0  # well inside a 30 s grace period
    t.join(timeout=30)
    assert out.get("finish") == "abort"


def test_several_api_keys_ping_post_and_load(binary, model_dir):
    # vLLM's --api-key K1 K2: either key is admitted, any other is a 401; POST /ping is a health
    # probe as GET is; /load reports the requests in flight (0 when idle).
    s = Server(binary, model_dir, ["--api-key", "key-one", "key-two"])
    try:
        for key, want in (("key-one", 200), ("key-two", 200), ("key-three", 401), ("", 401)):
            st, _ = http(s, "GET", "/v1/models", headers={"Authorization": f"Bearer {key}"})
            assert st == want, (key, st)
        assert http(s, "POST", "/ping", raw=b"")[0] == 200
        assert http(s, "GET", "/ping")[0] == 200
        st, text = http(s, "GET", "/load")
        assert st == 200 and json.loads(text) == {"server_load": 0}
        st, _ = http(s, "PUT", "/ping", raw=b"")
        assert st == 405
    finally:
        s.stop()


def test_cors_with_allowed_origins(binary, model_dir):
    # --allowed-origins: an admitted Origin gets Access-Control-Allow-Origin on every route and a
    # preflight (OPTIONS) is answered without the API key; another origin gets no CORS header.
    s = Server(binary, model_dir, ["--api-key", "k", "--allowed-origins", '["https://app.example"]'])
    try:
        req = urllib.request.Request(s.base + "/v1/models", headers={
            "Origin": "https://app.example", "Authorization": "Bearer k"})
        with urllib.request.urlopen(req, timeout=30) as r:
            assert r.status == 200
            assert r.headers["Access-Control-Allow-Origin"] == "https://app.example"
        pre = urllib.request.Request(s.base + "/v1/chat/completions", method="OPTIONS", headers={
            "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"})
        with urllib.request.urlopen(pre, timeout=30) as r:
            assert r.status == 204
            assert "POST" in r.headers["Access-Control-Allow-Methods"]
            assert r.headers["Access-Control-Allow-Headers"] == "authorization, content-type"
        other = urllib.request.Request(s.base + "/v1/models", headers={
            "Origin": "https://evil.example", "Authorization": "Bearer k"})
        with urllib.request.urlopen(other, timeout=30) as r:
            assert r.headers.get("Access-Control-Allow-Origin") is None
    finally:
        s.stop()


def test_access_log_and_stats_lines(binary, model_dir):
    # vLLM's logs: one access line per answered request, and a stats line every
    # VLLM_LOG_STATS_INTERVAL seconds while there is work; --disable-uvicorn-access-log and
    # --disable-log-stats turn them off.
    s = Server(binary, model_dir, [], env={"VLLM_LOG_STATS_INTERVAL": "0.5"})
    try:
        st, _ = http(s, "POST", "/v1/completions",
                     {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 400, "ignore_eos": True})
        assert st == 200
        time.sleep(1.5)
        log = "".join(s.log)
        assert '"POST /v1/completions HTTP/1.1" 200' in log, log[-2000:]
        assert "Avg generation throughput" in log, log[-2000:]
    finally:
        s.stop()
    q = Server(binary, model_dir, ["--disable-uvicorn-access-log", "--disable-log-stats"],
               env={"VLLM_LOG_STATS_INTERVAL": "0.5"})
    try:
        http(q, "POST", "/v1/completions", {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 400,
                                            "ignore_eos": True})
        time.sleep(1.5)
        log = "".join(q.log)
        assert "HTTP/1.1\" 200" not in log and "Avg generation throughput" not in log, log[-2000:]
    finally:
        q.stop()


def test_access_log_escapes_the_clients_bytes(server):
    # A path with a byte that is not UTF-8 and a quote: answered, and logged as %XX, so the log
    # stays text (a log reader that decodes UTF-8 cannot be broken by a request).
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    try:
        sock.sendall(b'GET /no\xffsuch"path HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n')
        reply = sock.recv(4096)
    finally:
        sock.close()
    assert reply.startswith(b"HTTP/1.1 4"), reply[:100]
    deadline = time.time() + 10
    while time.time() < deadline and not any("/no%FFsuch%22path" in l for l in server.log):
        time.sleep(0.05)
    assert any("/no%FFsuch%22path" in l for l in server.log), list(server.log)[-3:]
    assert http(server, "GET", "/health")[0] == 200
