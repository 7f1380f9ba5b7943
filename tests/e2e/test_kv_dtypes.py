"""The KV cache's element formats through `m3serve serve` on the CPU (docs/KV_CACHE.md): the
start-up line and /metrics name the KV and index-K formats and their capacity (bf16 holds 2x and
fp8 about 4x the tokens of fp32 in the same --kv-cache-memory-bytes), and the demo model still
finds passkeys hidden past the top-k coverage, and answers its arithmetic, with every format."""

import json
import os
import re
import sys
import urllib.request

import openai
import pytest

from conftest import REPO, Server

sys.path.insert(0, os.path.join(REPO, "tools", "demo_model"))
import tasks  # noqa: E402

DEMO = os.path.join(REPO, "models", "demo")
POOL = ["--kv-cache-memory-bytes", "64MiB"]

# (KV format flag, index-K format flag or None, names the start-up line shows)
FORMATS = [
    ("float32", None, ("float32", "float32")),
    ("bfloat16", None, ("bfloat16", "bfloat16")),
    ("fp8", None, ("fp8_e4m3", "bfloat16")),
    ("fp8", "fp8", ("fp8_e4m3", "fp8_e4m3")),
    ("bfloat16", "fp8", ("bfloat16", "fp8_e4m3")),
]


def start(binary, kv, index, extra=()):
    args = POOL + ["--kv-cache-dtype", kv] + list(extra)
    if index:
        args += ["--attention_config.indexer_kv_dtype", index]
    return Server(binary, DEMO, args)


def kv_line(s):
    m = re.search(r"KV cache: (\d+) tokens \(\d+ pages of \d+, (\w+), index-K (\w+), (\d+) B/token\)",
                  s.startup_line)
    assert m, s.startup_line
    return int(m.group(1)), m.group(2), m.group(3), int(m.group(4))


def test_startup_line_and_metrics_show_the_format_and_its_capacity(binary):
    tokens = {}
    for kv, index, (kv_name, ik_name) in FORMATS:
        s = start(binary, kv, index)
        try:
            n, got_kv, got_ik, per_token = kv_line(s)
            assert (got_kv, got_ik) == (kv_name, ik_name)
            tokens[(kv_name, ik_name)] = (n, per_token)
            with urllib.request.urlopen(s.base + "/metrics", timeout=30) as r:
                text = r.read().decode()
            # Labels are sorted by name (as prometheus_client writes them); values print as floats.
            cap = re.search(r'^vllm:kv_cache_capacity_tokens\{([^}]*)\} (\S+)', text, re.M)
            assert cap, text[:2000]
            labels = dict(re.findall(r'(\w+)="([^"]*)"', cap.group(1)))
            assert (labels["kv_cache_dtype"], labels["index_cache_dtype"], float(cap.group(2))) == \
                (kv_name, ik_name, n), text[:2000]
            assert f'cache_dtype="{kv_name}"' in text
        finally:
            s.stop()
    f32 = tokens[("float32", "float32")][0]
    # Pages are whole, so the ratios are a page or so off the byte ratios.
    assert tokens[("bfloat16", "bfloat16")][0] >= 2 * f32 - 256
    fp8_n, fp8_bytes = tokens[("fp8_e4m3", "fp8_e4m3")]
    assert fp8_n >= 3.9 * f32, (fp8_n, f32)
    assert tokens[("float32", "float32")][1] == 2 * tokens[("bfloat16", "bfloat16")][1]


@pytest.mark.parametrize("kv,index", [("bfloat16", None), ("fp8", None), ("fp8", "fp8")],
                         ids=["bf16", "fp8_kv", "fp8_kv_fp8_index"])
def test_passkeys_and_arithmetic_with_each_format(binary, kv, index):
    """The demo's long-context retrieval (a number hidden in ~2000 tokens: 4 blocks x 128 tokens
    cover 512, so only the indexer's block choice can find it) and its arithmetic, as in
    test_demo_model.py with the fp32 cache: every item still right."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(DEMO, "tokenizer.json"))
    s = start(binary, kv, index)
    try:
        client = openai.OpenAI(base_url=s.base + "/v1", api_key="none")
        items = tasks.eval_set(tasks.FillerLengths(tok))
        passkeys = [it for it in items if it["kind"] == "passkey" and it["ctx"] == 2048][:3]
        arith = [it for it in items if it["kind"] == "arith" and it["mode"] == "disabled"][:3]
        assert passkeys and arith
        for it in passkeys + arith:
            r = client.chat.completions.create(
                model="m3-e2e", messages=it["messages"], temperature=0, max_tokens=24,
                extra_body={"chat_template_kwargs": {"thinking_mode": "disabled"}})
            assert tasks.answer_correct(it, r.choices[0].message.content), (
                kv, index, it["id"], it["expect"], r.choices[0].message.content)
    finally:
        s.stop()


def test_bad_formats_are_refused_with_the_choices(binary):
    import subprocess
    for args in (["--kv-cache-dtype", "fp16"], ["--kv-cache-dtype", "int8"],
                 ["--attention-config", json.dumps({"indexer_kv_dtype": "fp4"})],
                 ["--attention-config", json.dumps({"indexer_dtype": "fp8"})]):
        p = subprocess.run([binary, "serve", DEMO, "--port", "0"] + args, capture_output=True,
                           text=True, timeout=60)
        assert p.returncode != 0
        assert "accepted: auto, bfloat16, fp8" in p.stderr or "known keys" in p.stderr, p.stderr
