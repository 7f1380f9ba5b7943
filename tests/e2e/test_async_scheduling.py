"""`--async-scheduling` through `m3serve serve` on the demo model (CPU): the pipelined engine loop
gives the same completions as `--no-async-scheduling` and as the default: greedy text, stop
strings, max_tokens, seeded n > 1 choices, streamed chunks and usage, logprobs; a client that
drops its stream mid-way loses only its own request."""

import os

import openai
import pytest

from conftest import API_KEY, MODEL_NAME, REPO, Server

DEMO = os.path.join(REPO, "models", "demo")
PROMPTS = ["The capital of France is", "12 + 30 =", "Once upon a time", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def servers(binary):
    started = {}
    try:
        for name, args in (("async", ["--async-scheduling"]), ("sync", ["--no-async-scheduling"]),
                           ("default", [])):
            started[name] = Server(binary, DEMO, ["--api-key", API_KEY, "--max-num-seqs", "4"] + args)
        yield started
    finally:
        for s in started.values():
            s.stop()


def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def completions(server, stop=None):
    """Every request shape at once per prompt, as concurrent clients would send them."""
    c = client(server)
    out = []
    for p in PROMPTS:
        r = c.completions.create(model=MODEL_NAME, prompt=p, max_tokens=24, temperature=0,
                                 stop=stop, logprobs=2)
        out.append(("greedy", p, r.choices[0].text, r.choices[0].finish_reason,
                    r.choices[0].logprobs.tokens, [round(x, 5) for x in r.choices[0].logprobs.token_logprobs],
                    r.usage.completion_tokens))
        r = c.completions.create(model=MODEL_NAME, prompt=p, max_tokens=16, temperature=0.9,
                                 seed=11, n=3)
        out.append(("n3", p, sorted((ch.index, ch.text, ch.finish_reason) for ch in r.choices)))
        chunks = c.completions.create(model=MODEL_NAME, prompt=p, max_tokens=20, temperature=0,
                                      stream=True, stream_options={"include_usage": True})
        text, reasons, usage = "", [], None
        for ch in chunks:
            if ch.choices:
                text += ch.choices[0].text
                if ch.choices[0].finish_reason:
                    reasons.append(ch.choices[0].finish_reason)
            if ch.usage:
                usage = ch.usage.completion_tokens
        out.append(("stream", p, text, reasons, usage))
    return out


def test_async_sync_and_default_give_the_same_completions(servers):
    assert any("async scheduling on" in line for line in servers["async"].log)
    assert not any("async scheduling on" in line for line in servers["sync"].log)
    want = completions(servers["sync"])
    assert completions(servers["async"]) == want
    assert completions(servers["default"]) == want


def test_stop_strings_cut_the_same_place(servers):
    # A stop string taken from the middle of the greedy text: it ends each request early, and the
    # async loop (which learns tokens a step late) must stop where the synchronous one does.
    c = client(servers["sync"])
    base = c.completions.create(model=MODEL_NAME, prompt=PROMPTS[2], max_tokens=24,
                                temperature=0).choices[0].text
    assert len(base) > 8, base
    stop = base[len(base) // 2:len(base) // 2 + 3]
    want = completions(servers["sync"], stop=[stop])
    assert any(row[0] == "greedy" and row[3] == "stop" for row in want)
    assert completions(servers["async"], stop=[stop]) == want


def test_a_dropped_stream_costs_only_its_own_request(servers):
    s = servers["async"]
    c = client(s)
    want = c.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=24,
                                temperature=0).choices[0].text
    stream = c.completions.create(model=MODEL_NAME, prompt=PROMPTS[3], max_tokens=200,
                                  temperature=0, stream=True)
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()  # the server aborts it
    got = c.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=24,
                               temperature=0).choices[0].text
    assert got == want
