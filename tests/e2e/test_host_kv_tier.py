"""Host KV tier (issue #21 item 1) on the CPU backend: `--kv-transfer-config` with vLLM's
OffloadingConnector JSON (or `--kv-offloading-size`) gives the server a second, larger page pool
in host memory. Prefix-cache pages evicted from the device pool are copied there and come back on
a prefix hit: the re-sent prompt reports its full blocks as cached and generates exactly what the
first, fully computed run did; /metrics counts the offloaded and restored pages. The tier test
runs twice: with the synchronous loop and with --async-scheduling (steps with copies launched
like any other, engine/model_runner.h).
"""

import json
import time

import pytest

from conftest import MODEL_NAME, Server, http, metric
from test_kv_events import pool_bytes

BS = 128


def generate(server, prompt, n=8):
    status, body = http(server, "POST", "/v1/completions",
                        {"model": MODEL_NAME, "prompt": prompt, "max_tokens": n, "temperature": 0,
                         "logprobs": 1})
    assert status == 200, body
    d = json.loads(body)
    return (d["choices"][0]["logprobs"]["tokens"], d["choices"][0]["logprobs"]["token_logprobs"],
            d["usage"]["prompt_tokens_details"]["cached_tokens"])


def prompts():
    a = [100 + (i * 7) % 150 for i in range(300)]  # 2 full blocks + 44 tokens
    flood = [[(r * 37 + i * 13) % 250 + 3 for i in range(300)] for r in range(1, 5)]
    return a, flood


@pytest.fixture(scope="module", params=["sync", "async"])
def tier_server(request, binary, model_dir):
    cfg = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
           "kv_connector_extra_config": {"cpu_bytes_to_use": int(pool_bytes(model_dir, 32))}}
    # 6 device pages: two 3-page prompts fill them, so older prefixes are evicted at once.
    s = Server(binary, model_dir, ["--max-model-len", "512", "--max-num-seqs", "2",
                                   "--kv-cache-memory-bytes", pool_bytes(model_dir, 6),
                                   "--kv-transfer-config", json.dumps(cfg)]
               + (["--async-scheduling"] if request.param == "async" else []))
    s.mode = request.param
    yield s
    s.stop()


def test_evicted_prefix_is_restored_from_host(tier_server):
    s = tier_server
    assert any("host KV tier: 32 pages (4096 tokens)" in l for l in s.log), "".join(s.log)
    assert any("async scheduling on" in l for l in s.log) == (s.mode == "async"), "".join(s.log)
    assert metric(s, "vllm:host_kv_cache_pages") == 32
    a, flood = prompts()
    tokens, logprobs, cached = generate(s, a)
    assert cached == 0
    for p in flood:
        generate(s, p, n=1)
    offloaded = metric(s, "vllm:kv_offloaded_pages_total")
    assert offloaded >= 2, offloaded  # a's two full blocks left the 6-page device pool
    restored_before = metric(s, "vllm:kv_restored_pages_total")
    tokens2, logprobs2, cached2 = generate(s, a)
    assert cached2 == 2 * BS, cached2  # both full blocks came back from host memory
    assert metric(s, "vllm:kv_restored_pages_total") - restored_before == 2
    # The restored KV is the computed KV: the same greedy tokens, and logprobs equal up to the
    # fp32 rounding of a different chunking of the same attention sums (|diff| < 1e-4).
    assert tokens2 == tokens
    assert all(abs(x - y) < 1e-4 for x, y in zip(logprobs, logprobs2)), (logprobs, logprobs2)
    assert metric(s, "vllm:host_kv_cache_cached_pages") >= 2


def test_without_the_tier_the_prefix_is_recomputed(binary, model_dir):
    s = Server(binary, model_dir, ["--max-model-len", "512", "--max-num-seqs", "2",
                                   "--kv-cache-memory-bytes", pool_bytes(model_dir, 6)])
    try:
        a, flood = prompts()
        generate(s, a)
        for p in flood:
            generate(s, p, n=1)
        assert generate(s, a)[2] == 0  # evicted and nowhere else: recomputed
        assert metric(s, "vllm:kv_offloaded_pages_total") == 0
    finally:
        s.stop()


def test_short_spelling_and_bad_input(binary, model_dir):
    s = Server(binary, model_dir, ["--max-model-len", "512", "--kv-cache-memory-bytes",
                                   pool_bytes(model_dir, 6), "--kv-offloading-size", "0.001"])
    try:
        pages = metric(s, "vllm:host_kv_cache_pages")
        assert pages == (1 << 30) * 0.001 // int(pool_bytes(model_dir, 1)), pages
    finally:
        s.stop()
    tiny = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": 1000}}
    with pytest.raises(RuntimeError) as e:
        Server(binary, model_dir, ["--kv-transfer-config", json.dumps(tiny)])
    assert "smaller than one KV page" in str(e.value) and "cpu_bytes_to_use" in str(e.value)


def test_host_tier_kv_events(binary, model_dir):
    """With KV events on, the host tier publishes its own stores and removals with medium "CPU"
    (vLLM's offloading events: no tokens, no parent, block_size 0), decoded by vLLM's schema."""
    zmq = pytest.importorskip("zmq", reason="pyzmq is installed by tools/setup.sh")
    from test_kv_events import BlockRemoved, BlockStored, Subscriber, free_port
    port, replay = free_port(), free_port()
    ev = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}",
          "replay_endpoint": f"tcp://*:{replay}", "topic": "kv-events"}
    # A 2-page host tier: the third offloaded page pushes the first one out (a CPU removal).
    s = Server(binary, model_dir, ["--max-model-len", "512", "--max-num-seqs", "2",
                                   "--kv-cache-memory-bytes", pool_bytes(model_dir, 6),
                                   "--kv-offloading-size", str(int(pool_bytes(model_dir, 2)) / (1 << 30)),
                                   "--kv-events-config", json.dumps(ev)])
    sub = Subscriber(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay}")
    try:
        a, flood = prompts()
        for p in [a] + flood:
            generate(s, p, n=1)
        sub.settle(s)
        sub.batches.update(sub.replay(0))
        device, host, host_removed = set(), [], []
        for seq in sorted(sub.batches):
            for e in sub.batches[seq].events:
                if isinstance(e, BlockStored) and e.medium == "GPU":
                    device.update(e.block_hashes)
                elif isinstance(e, BlockStored):
                    assert e.medium == "CPU" and e.token_ids == [] and e.block_size == 0
                    assert e.parent_block_hash is None
                    host.extend(e.block_hashes)
                elif isinstance(e, BlockRemoved) and e.medium == "CPU":
                    host_removed.extend(e.block_hashes)
        assert host and set(host) <= device, "the host tier holds pages the device computed"
        # /metrics' engine counters refresh after the step that published the batch: wait.
        deadline = time.time() + 10
        while metric(s, "vllm:kv_offloaded_pages_total") != len(host) and time.time() < deadline:
            time.sleep(0.05)
        assert metric(s, "vllm:kv_offloaded_pages_total") == len(host)
        assert host_removed and set(host_removed) <= set(host)
        assert len(host) - len(host_removed) <= 2  # the tier's 2 pages
    finally:
        sub.close()
        s.stop()
