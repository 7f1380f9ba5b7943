"""Prefill/decode disaggregation (issue #21 item 4): two m3serve processes on loopback with
`--kv-transfer-config` NixlConnector, a prefill worker (kv_producer) and a decode worker
(kv_consumer), speaking vLLM's kv_transfer_params protocol; the KV pages move over NIXL (the
`nixl-cu13` wheel's UCX backend, host memory). Greedy outputs through prefill + decode must equal
a single worker's, the decode worker must have read the prompt's KV (cached_tokens = prompt - 1,
its pd_kv_loads_total{outcome="ok"}), and the transferred pages must be what decoding uses (the
pages of another prompt give another output). A prefill worker that dies before the read makes
the decode worker recompute; unread prefills expire; no pages leak. Finally vllm-router's PD mode
(`--vllm-pd-disaggregation`) drives the pair unchanged. Skipped without NIXL
(`pip install nixl-cu13`)."""

import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request

import pytest

from conftest import MODEL_NAME, Server

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO = os.path.join(REPO, "models", "demo")
BS = 128

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("nixl_cu13") is None and importlib.util.find_spec("nixl_cu12") is None,
    reason="NIXL is not installed (pip install nixl-cu13)")


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def post(base, path, body, expect=200):
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            assert r.status == expect
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        assert e.code == expect, e.read().decode()
        return json.loads(e.read() or b"{}")


def metric(server, name, labels=""):
    with urllib.request.urlopen(server.base + "/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(f"m3:{name}{{") and labels in line:
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no m3:{name} {labels}")


def worker(binary, role, extra_env=None):
    env = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()), "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1"}
    env.update(extra_env or {})
    cfg = {"kv_connector": "NixlConnector", "kv_role": role}
    return Server(binary, DEMO, ["--max-model-len", "4096", "--kv-transfer-config", json.dumps(cfg)],
                  env=env)


@pytest.fixture(scope="module")
def pd(binary):
    servers = []
    try:
        servers.append(Server(binary, DEMO, ["--max-model-len", "4096"]))  # the single worker
        servers.append(worker(binary, "kv_producer", {"VLLM_NIXL_ABORT_REQUEST_TIMEOUT": "3"}))
        servers.append(worker(binary, "kv_consumer"))
        yield servers
    finally:
        for s in servers:
            s.stop()


PROMPTS = [
    "Once upon a time",  # one page
    "The pass key is 4471. Remember it. " * 20,  # about 200 tokens: two pages
    " ".join(f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(60)),  # ~6 pages
]


def prefill(p, body):
    out = post(p.base, "/v1/completions",
               dict(body, max_tokens=1, kv_transfer_params={
                   "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                   "remote_block_ids": None, "remote_host": None, "remote_port": None}))
    kv = out["kv_transfer_params"]
    assert kv["do_remote_prefill"] is True and kv["remote_host"] == "127.0.0.1", kv
    assert len(kv["remote_block_ids"]) == -(-out["usage"]["prompt_tokens"] // BS), (kv, out["usage"])
    return kv


def test_outputs_through_prefill_and_decode_equal_a_single_worker(pd):
    single, p, c = pd
    ok0 = metric(c, "pd_kv_loads_total", 'outcome="ok"')
    read0 = metric(p, "pd_released_requests_total", 'reason="read"')
    pages0 = metric(c, "pd_kv_pages_read_total")
    want_pages = 0
    for prompt in PROMPTS:
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 20, "temperature": 0,
                "return_token_ids": True}
        ref = post(single.base, "/v1/completions", body)
        kv = prefill(p, body)
        out = post(c.base, "/v1/completions", dict(body, kv_transfer_params=kv))
        assert out["choices"][0]["token_ids"] == ref["choices"][0]["token_ids"], prompt[:40]
        assert out["choices"][0]["text"] == ref["choices"][0]["text"]
        n = out["usage"]["prompt_tokens"]
        # The prompt's KV came from the prefill worker: only its last token was computed here.
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == n - 1, out["usage"]
        want_pages += -(-n // BS)
    assert metric(c, "pd_kv_loads_total", 'outcome="ok"') == ok0 + len(PROMPTS)
    assert metric(c, "pd_kv_pages_read_total") == pages0 + want_pages
    # Each read released its held pages on the prefill worker (NIXL's notification).
    deadline = time.time() + 10
    while metric(p, "pd_released_requests_total", 'reason="read"') < read0 + len(PROMPTS):
        assert time.time() < deadline, "the prefill worker never released the pages read"
        time.sleep(0.1)
    assert metric(p, "pd_held_requests") == 0
    # Chat goes the same way (the router forwards chat completions too).
    msgs = {"model": MODEL_NAME, "messages": [{"role": "user", "content": PROMPTS[1]}],
            "max_tokens": 16, "temperature": 0}
    ref = post(single.base, "/v1/chat/completions", msgs)
    pre = post(p.base, "/v1/chat/completions",
               dict(msgs, max_tokens=1, kv_transfer_params={"do_remote_decode": True}))
    out = post(c.base, "/v1/chat/completions", dict(msgs, kv_transfer_params=pre["kv_transfer_params"]))
    assert out["choices"][0]["message"] == ref["choices"][0]["message"]
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == out["usage"]["prompt_tokens"] - 1


def test_decode_worker_reads_only_what_it_does_not_cache(pd):
    """The same long prompt twice: the second time the decode worker holds its full pages in its
    own prefix cache and reads only the last page; the output still equals a single worker's."""
    single, p, c = pd
    text = " ".join(f"lanterns {i} over harbours" for i in range(90))
    body = {"model": MODEL_NAME, "prompt": text, "max_tokens": 10, "temperature": 0,
            "return_token_ids": True}
    ref = post(single.base, "/v1/completions", body)
    reads = []
    for _ in range(2):
        pages0 = metric(c, "pd_kv_pages_read_total")
        out = post(c.base, "/v1/completions", dict(body, kv_transfer_params=prefill(p, body)))
        assert out["choices"][0]["token_ids"] == ref["choices"][0]["token_ids"]
        n = out["usage"]["prompt_tokens"]
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == n - 1, out["usage"]
        reads.append(metric(c, "pd_kv_pages_read_total") - pages0)
    assert n > 2 * BS, n
    assert reads == [-(-n // BS), 1], (reads, n)


def test_decoding_uses_the_pages_read(pd):
    """Swap the page lists of two prompts of equal page count: the decode worker then reads the
    other prompt's KV, and its output departs from the single worker's. (A decode worker that
    recomputed, or ignored the pages read, would still match.)"""
    single, p, c = pd
    def tokens(text):
        return post(single.base, "/tokenize", {"model": MODEL_NAME, "prompt": text})["tokens"][:300]

    a = tokens(" ".join(f"apples {i} and pears" for i in range(80)))
    b = tokens(" ".join(f"rivers {i} under bridges" for i in range(80)))
    assert len(a) == len(b) == 300
    body = {"model": MODEL_NAME, "max_tokens": 12, "temperature": 0, "return_token_ids": True}
    kva, kvb = prefill(p, dict(body, prompt=a)), prefill(p, dict(body, prompt=b))
    kva["remote_block_ids"], kvb["remote_block_ids"] = kvb["remote_block_ids"], kva["remote_block_ids"]
    differ = 0
    for prompt, kv in ((a, kva), (b, kvb)):
        ref = post(single.base, "/v1/completions", dict(body, prompt=prompt))
        out = post(c.base, "/v1/completions", dict(body, prompt=prompt, kv_transfer_params=kv))
        differ += out["choices"][0]["token_ids"] != ref["choices"][0]["token_ids"]
    assert differ >= 1


def test_unread_prefill_expires_and_pages_come_back(pd):
    _, p, _ = pd
    exp0 = metric(p, "pd_released_requests_total", 'reason="expired"')
    prefill(p, {"model": MODEL_NAME, "prompt": "nobody reads this " * 30, "temperature": 0})
    assert metric(p, "pd_held_requests") == 1
    assert metric(p, "kv_cache_usage_perc") > 0
    deadline = time.time() + 15  # VLLM_NIXL_ABORT_REQUEST_TIMEOUT=3
    while metric(p, "pd_held_requests") > 0:
        assert time.time() < deadline, "held pages never expired"
        time.sleep(0.2)
    assert metric(p, "pd_released_requests_total", 'reason="expired"') == exp0 + 1
    assert metric(p, "kv_cache_usage_perc") == 0


def test_prefill_worker_gone_before_the_read_recomputes(pd, binary):
    single, _, c = pd
    gone = worker(binary, "kv_producer")
    try:
        body = {"model": MODEL_NAME, "prompt": PROMPTS[2] + " (again)", "max_tokens": 16,
                "temperature": 0, "return_token_ids": True}
        kv = prefill(gone, body)
    finally:
        gone.proc.send_signal(signal.SIGKILL)
        gone.proc.wait()
    failed0 = metric(c, "pd_kv_loads_total", 'outcome="failed"')
    ref = post(single.base, "/v1/completions", body)
    out = post(c.base, "/v1/completions", dict(body, kv_transfer_params=kv))
    assert out["choices"][0]["token_ids"] == ref["choices"][0]["token_ids"]
    # Computed here after the full pages this worker already cached of PROMPTS[2] (same start).
    cached = out["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached % BS == 0 and cached < out["usage"]["prompt_tokens"] - 1, out["usage"]
    assert metric(c, "pd_kv_loads_total", 'outcome="failed"') == failed0 + 1
    assert any("computing its prompt here" in line for line in c.log), "".join(c.log)[-2000:]
    assert metric(c, "kv_cache_usage_perc") == 0  # no pages left behind


def test_requests_a_worker_cannot_serve_are_refused(pd):
    single, p, c = pd
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}
    remote = {"do_remote_prefill": True, "remote_engine_id": "m3-x", "remote_request_id": "1",
              "remote_host": "127.0.0.1", "remote_port": 5600, "remote_block_ids": [0]}
    cases = [
        (p, {"do_remote_prefill": True, **remote}, "this one is not: start it with --kv-transfer-config"),
        (c, {"do_remote_decode": True}, "needs a prefill worker"),
        (single, {"do_remote_decode": True}, "kv_producer"),
        (c, dict(remote, remote_host=None), "needs remote_engine_id, remote_request_id, remote_host"),
        (c, dict(remote, remote_block_ids=[]), "remote_block_ids has 0 pages"),
    ]
    for server, kv, words in cases:
        err = post(server.base, "/v1/completions", dict(body, kv_transfer_params=kv), expect=400)
        assert words in err["error"]["message"], err
        assert err["error"]["param"] == "kv_transfer_params", err
    assert metric(c, "kv_cache_usage_perc") == 0


def test_vllm_router_pd_mode_drives_the_pair(pd):
    exe = shutil.which("vllm-router")
    if exe is None:
        pytest.skip("vllm-router is not installed (tools/setup.sh pip-installs it)")
    single, p, c = pd
    port = free_port()
    log_path = f"/tmp/m3-e2e-pd-router-{port}.log"
    log = open(log_path, "w")
    proc = subprocess.Popen([exe, "--host", "127.0.0.1", "--port", str(port), "--vllm-pd-disaggregation",
                             "--prefill", p.base, "--decode", c.base, "--kv-connector", "nixl",
                             "--health-check-interval-secs", "1", "--prometheus-port", str(free_port()),
                             "--disable-retries"], stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while True:
            assert proc.poll() is None, open(log_path).read()[-3000:]
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except Exception:
                pass
            assert time.time() < deadline, open(log_path).read()[-3000:]
            time.sleep(0.2)
        ok0 = metric(c, "pd_kv_loads_total", 'outcome="ok"')
        for prompt in PROMPTS[1:]:
            body = {"model": MODEL_NAME, "prompt": prompt + " router", "max_tokens": 16,
                    "temperature": 0}
            ref = post(single.base, "/v1/completions", body)
            out = post(base, "/v1/completions", body)
            assert out["choices"][0]["text"] == ref["choices"][0]["text"], open(log_path).read()[-3000:]
            # (The router reports the prefill worker's prompt_tokens_details, so the decode
            # worker's own counter shows that it read the KV.)
            ok0 += 1
            assert metric(c, "pd_kv_loads_total", 'outcome="ok"') == ok0
        msgs = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Tell me a story."}],
                "max_tokens": 16, "temperature": 0}
        ref = post(single.base, "/v1/chat/completions", msgs)
        out = post(base, "/v1/chat/completions", msgs)
        assert out["choices"][0]["message"]["content"] == ref["choices"][0]["message"]["content"]
        assert metric(c, "pd_kv_loads_total", 'outcome="ok"') == ok0 + 1
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        os.unlink(log_path)


def test_speculative_decoding_on_a_decode_worker_is_refused(binary):
    draft = os.path.join(REPO, "models", "demo-eagle3")
    if not os.path.isdir(draft):
        pytest.skip("models/demo-eagle3 is not there")
    spec = json.dumps({"method": "eagle3", "model": draft, "num_speculative_tokens": 3})
    cfg = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_consumer"})
    p = subprocess.run([binary, "serve", DEMO, "--port", "0", "--speculative-config", spec,
                        "--kv-transfer-config", cfg], capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    assert "--speculative-config on a P/D decode worker (kv_role kv_consumer)" in p.stderr + p.stdout
