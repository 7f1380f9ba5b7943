"""KV events (issue #21 item 2): `--kv-events-config` publishes vLLM's KV event stream over
ZeroMQ; a pyzmq subscriber decodes it with vLLM's event schema and checks it against what the
requests did.

The schema below is written from vLLM 0.33's vllm/distributed/kv_events.py (KVEventBatch is an
array-like msgspec Struct [ts, events, data_parallel_rank]; the events are map-encoded Structs
tagged by class name under "type"; block hashes are unsigned 64-bit ints by default,
VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1). `forbid_unknown_fields` is ours: it makes the decode
stricter than vLLM's, so a misspelled key fails here.
"""

import json
import re
import socket
import time

import pytest

from conftest import MODEL_NAME, Server, http, metric

zmq = pytest.importorskip("zmq", reason="pyzmq is installed by tools/setup.sh")
msgspec = pytest.importorskip("msgspec", reason="msgspec is installed by tools/setup.sh")

ExternalBlockHash = int | bytes


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False,
                 forbid_unknown_fields=True):
    ts: float
    events: list
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True, forbid_unknown_fields=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)
BS = 128
TOPIC = b"kv-events"


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def wait_log(server, pattern, timeout=30):
    deadline = time.time() + timeout
    while time.time() < deadline:
        for line in list(server.log):
            m = re.search(pattern, line)
            if m:
                return m
        time.sleep(0.05)
    raise AssertionError(f"no log line matching {pattern!r}: {''.join(server.log)}")


class Subscriber:
    """SUB on the stream plus a DEALER for replays; keeps every batch by sequence number."""

    def __init__(self, endpoint, replay_endpoint):
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
        self.sub.connect(endpoint)
        self.replay_endpoint = replay_endpoint
        self.batches = {}  # seq -> KVEventBatch

    def poll(self, timeout_ms):
        got = 0
        while self.sub.poll(timeout_ms):
            topic, seq, payload = self.sub.recv_multipart()
            assert topic == TOPIC
            self.batches[int.from_bytes(seq, "big", signed=True)] = DECODER.decode(payload)
            got += 1
            timeout_ms = 0
        return got

    def replay(self, start):
        d = self.ctx.socket(zmq.DEALER)
        d.connect(self.replay_endpoint)
        d.send_multipart([b"", start.to_bytes(8, "big")])
        out = {}
        while True:
            assert d.poll(10000), "replay timed out"
            empty, topic, seq, payload = d.recv_multipart()
            seq = int.from_bytes(seq, "big", signed=True)
            if seq == -1:
                assert (empty, topic, payload) == (b"", b"", b"")
                break
            assert topic == TOPIC
            out[seq] = DECODER.decode(payload)
        d.close()
        return out

    def settle(self, server, timeout=20):
        """Reads until every batch the server counts as sent has arrived."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            self.poll(50)
            sent = metric(server, "vllm:kv_event_batches_published_total")
            if self.batches and max(self.batches) + 1 == sent:
                return
        raise AssertionError(f"server sent {sent} batches, subscriber has {sorted(self.batches)[-3:]}")

    def close(self):
        self.sub.close()
        self.ctx.term()


class CacheModel:
    """The prefix cache as the event stream describes it: hash -> the whole token prefix it
    stands for (checked against the prompts sent), and the set of hashes held now."""

    def __init__(self, prompts):
        self.prompts = prompts
        self.prefix_of = {}
        self.live = set()
        self.stored = 0
        self.removed = 0

    def apply(self, batch):
        assert batch.data_parallel_rank == 0
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                assert ev.block_size == BS and ev.medium == "GPU"
                assert ev.lora_id is None and ev.lora_name is None
                assert len(ev.token_ids) == BS * len(ev.block_hashes)
                if ev.parent_block_hash is None:
                    prefix = ()
                else:
                    assert ev.parent_block_hash in self.prefix_of, "parent never stored"
                    prefix = self.prefix_of[ev.parent_block_hash]
                for i, h in enumerate(ev.block_hashes):
                    assert isinstance(h, int) and 0 <= h < 2**64
                    prefix = prefix + tuple(ev.token_ids[i * BS:(i + 1) * BS])
                    # Every stored block is a full block of a prompt some request sent.
                    assert any(tuple(p[:len(prefix)]) == prefix for p in self.prompts.values()), \
                        "stored tokens match no request's prompt"
                    assert h not in self.live, "stored twice without a removal"
                    self.prefix_of[h] = prefix
                    self.live.add(h)
                    self.stored += 1
            elif isinstance(ev, BlockRemoved):
                assert ev.medium == "GPU"
                for h in ev.block_hashes:
                    assert h in self.live, "removed a block that is not stored"
                    self.live.discard(h)
                    self.removed += 1
            else:
                self.live.clear()

    def expected_hit(self, prompt):
        """Tokens a prefix hit must give: the longest chain of live full blocks, one block
        short of the whole prompt at most (the last token is always computed)."""
        live_prefixes = {self.prefix_of[h] for h in self.live}
        n = 0
        for k in range(1, (len(prompt) - 1) // BS + 1):
            if tuple(prompt[:k * BS]) not in live_prefixes:
                break
            n = k
        return n * BS


def complete(server, prompt):
    status, body = http(server, "POST", "/v1/completions",
                        {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0})
    assert status == 200, body
    return json.loads(body)["usage"]["prompt_tokens_details"]["cached_tokens"]


def pool_bytes(model_dir, pages):
    """--kv-cache-memory-bytes for `pages` pages of the CPU's fp32 cache (docs/KV_CACHE.md):
    K and V per layer, plus the fp32 index-K of each sparse layer, per token."""
    with open(f"{model_dir}/config.json") as f:
        t = json.load(f)["text_config"]
    kv = len(t["layer_types"]) * 2 * t["num_key_value_heads"] * t["head_dim"] * 4
    ik = sum(lt != "full_attention" for lt in t["layer_types"]) * t["index_head_dim"] * 4
    return str(pages * BS * (kv + ik))


@pytest.fixture(scope="module")
def events_server(binary, model_dir):
    port, replay_port = free_port(), free_port()
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}",
           "replay_endpoint": f"tcp://*:{replay_port}", "topic": "kv-events", "buffer_steps": 1000}
    # 12 pages of 128 tokens: a handful of 3-page prompts fills it, so pages get evicted.
    s = Server(binary, model_dir, ["--api-key", "e2e-secret-key", "--max-model-len", "1024",
                                   "--max-num-seqs", "4", "--kv-cache-memory-bytes",
                                   pool_bytes(model_dir, 12), "--kv-events-config", json.dumps(cfg)])
    assert "(12 pages of 128" in s.startup_line, s.startup_line
    yield s, port, replay_port
    s.stop()


def test_kv_events_match_the_requests(events_server):
    server, port, replay_port = events_server
    m = wait_log(server, r"KV events \(data-parallel rank 0\) on (\S+), replay on (\S+)")
    assert m.group(1).endswith(f":{port}") and m.group(2).endswith(f":{replay_port}")
    prompts = {}
    # Request 0 runs before anyone subscribes: its batches come back only through the replay.
    prompts[0] = [100 + (i * 7) % 150 for i in range(300)]
    assert complete(server, prompts[0]) == 0
    # The response can come back before its step's batch is sent: wait until it was.
    deadline = time.time() + 10
    while metric(server, "vllm:kv_event_batches_published_total") < 1 and time.time() < deadline:
        time.sleep(0.02)
    sub = Subscriber(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}")
    model = CacheModel(prompts)
    try:
        time.sleep(0.3)  # the subscription has to reach the publisher before it sends
        # Request 1 shares request 0's first block and adds its own second one.
        prompts[1] = prompts[0][:BS] + [120 + (i * 11) % 130 for i in range(200)]
        assert complete(server, prompts[1]) == BS
        sub.settle(server)
        first_live = min(sub.batches)
        assert first_live > 0, "request 0's batches were sent before the subscription"
        missed = sub.replay(0)
        assert set(range(first_live)) <= set(missed), (sorted(missed), first_live)
        for seq, batch in missed.items():
            if seq in sub.batches:
                assert msgspec.msgpack.encode(batch) == msgspec.msgpack.encode(sub.batches[seq])
        sub.batches.update(missed)
        for seq in sorted(sub.batches):
            model.apply(sub.batches[seq])
        assert len(model.live) == 3  # request 0: 2 blocks; request 1: 1 new block
        assert model.expected_hit(prompts[1]) == 2 * BS
        # More distinct prompts than the 12 pages hold: the oldest blocks are evicted.
        applied = max(sub.batches)
        for r in range(2, 9):
            prompts[r] = [(r * 37 + i * 13) % 250 + 3 for i in range(300)]
            want = model.expected_hit(prompts[r])
            assert complete(server, prompts[r]) == want
            sub.settle(server)
            for seq in range(applied + 1, max(sub.batches) + 1):
                assert seq in sub.batches, f"batch {seq} missing"
                model.apply(sub.batches[seq])
            applied = max(sub.batches)
        assert model.removed > 0, "the small pool never evicted a block"
        # Re-send every prompt: each hit is exactly what the event stream says is cached.
        hits = []
        for r in sorted(prompts, reverse=True):  # newest first: those are still cached
            want = model.expected_hit(prompts[r])
            got = complete(server, prompts[r])
            assert got == want, (r, got, want)
            hits.append(got)
            sub.settle(server)
            for seq in range(applied + 1, max(sub.batches) + 1):
                model.apply(sub.batches[seq])
            applied = max(sub.batches)
        assert 0 in hits and 2 * BS in hits, hits  # some evicted, some still cached
    finally:
        sub.close()


def test_busy_kv_events_endpoint_is_refused(binary, model_dir, events_server):
    _, port, _ = events_server
    cfg = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}"}
    with pytest.raises(RuntimeError) as e:
        Server(binary, model_dir, ["--kv-events-config", json.dumps(cfg)])
    msg = str(e.value)
    assert f"--kv-events-config endpoint 'tcp://*:{port}' cannot be bound" in msg, msg
    assert "free port" in msg


def test_kv_events_need_prefix_caching(binary, model_dir):
    cfg = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{free_port()}"}
    with pytest.raises(RuntimeError) as e:
        Server(binary, model_dir, ["--no-enable-prefix-caching", "--kv-events-config", json.dumps(cfg)])
    assert "drop --no-enable-prefix-caching" in str(e.value)
