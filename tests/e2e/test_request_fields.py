"""vLLM's request fields beyond OpenAI's, through `m3serve serve` with the demo model (models/demo)
and the official openai client: include_reasoning, thinking_token_budget, truncate_prompt_tokens,
prompt_logprobs, return_token_ids, return_tokens_as_token_ids, chat echo, skip_special_tokens,
stop_reason, max_tokens clamped to the room the prompt leaves, tool_choice "none" (no tool markup
in the content), use_beam_search refused by name; and the serve flags --max-logprobs, --seed and
--enable-log-requests. Greedy unless a test says otherwise, so each answer is fixed."""

import json
import subprocess
import os
import sys
import time

import openai
import pytest

from conftest import REPO, Server, http

sys.path.insert(0, os.path.join(REPO, "tools", "demo_model"))
import tasks  # noqa: E402

DEMO = os.path.join(REPO, "models", "demo")
MAX_LEN = 1024
Q = [{"role": "user", "content": "What is 23 + 19?"}]
TIMER = [{"role": "user", "content": "Set a timer for 25 minutes for the tea."}]


@pytest.fixture(scope="module")
def demo(binary):
    s = Server(binary, DEMO, ["--max-model-len", str(MAX_LEN), "--max-logprobs", "5",
                              "--enable-log-requests"])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(demo):
    return openai.OpenAI(base_url=demo.base + "/v1", api_key="none", max_retries=0, timeout=300)


def extra(obj, key):
    return (getattr(obj, "model_extra", None) or {}).get(key)


def chat(client, messages=Q, mode="enabled", **kw):
    body = kw.pop("extra_body", {})
    body.setdefault("chat_template_kwargs", {"thinking_mode": mode})
    kw.setdefault("max_tokens", 96)
    return client.chat.completions.create(model="m3-e2e", messages=messages, temperature=0,
                                          extra_body=body, **kw)


def tokenize(demo, text):
    status, body = http(demo, "POST", "/tokenize", {"prompt": text, "add_special_tokens": False})
    assert status == 200, body
    return json.loads(body)["tokens"]


def test_include_reasoning_false_drops_the_reasoning(client):
    full = chat(client).choices[0].message
    assert extra(full, "reasoning"), "the demo model reasons when thinking is enabled"
    m = chat(client, extra_body={"include_reasoning": False}).choices[0].message
    assert extra(m, "reasoning") is None and extra(m, "reasoning_content") is None
    assert m.content == full.content  # the same answer, reasoning parsed out and not returned
    streamed = ""
    for ch in chat(client, stream=True, extra_body={"include_reasoning": False}):
        if ch.choices:
            assert not extra(ch.choices[0].delta, "reasoning")
            streamed += ch.choices[0].delta.content or ""
    assert streamed == full.content


def test_thinking_token_budget_forces_the_end_of_reasoning(client, demo):
    free = chat(client)
    free_tokens = free.usage.completion_tokens_details.reasoning_tokens
    assert free_tokens > 6, "the unbudgeted reasoning must be longer than the budget tested"
    for budget in (0, 3):
        r = chat(client, extra_body={"thinking_token_budget": budget})
        m = r.choices[0].message
        # `budget` tokens inside the block plus the forced </mm:think> itself.
        assert r.usage.completion_tokens_details.reasoning_tokens == budget + 1
        reasoning = extra(m, "reasoning") or ""
        assert len(tokenize(demo, reasoning) if reasoning else []) <= budget
        assert m.content and "</mm:think>" not in m.content
        assert r.choices[0].finish_reason == "stop"
    # Adaptive: the model opens the block itself (<mm:think>); the count starts there.
    r = chat(client, mode="adaptive", extra_body={"thinking_token_budget": 2,
                                                 "chat_template_kwargs": {"thinking_mode": "adaptive"}})
    assert chat(client, mode="adaptive").usage.completion_tokens_details.reasoning_tokens > 6
    assert r.usage.completion_tokens_details.reasoning_tokens == 3
    assert r.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, extra_body={"thinking_token_budget": -5})
    assert e.value.body["param"] == "thinking_token_budget"


def test_max_tokens_is_clamped_to_the_room_left(client):
    # vLLM's rule: max_tokens = min(request's max_tokens, max_model_len - prompt tokens).
    prompt = [300] * (MAX_LEN - 10)
    r = client.completions.create(model="m3-e2e", prompt=prompt, max_tokens=500, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens == MAX_LEN - 10
    assert r.usage.completion_tokens == 10 and r.choices[0].finish_reason == "length"
    r = chat(client, mode="disabled", max_tokens=100000, extra_body={"ignore_eos": True,
                                                                    "chat_template_kwargs": {"thinking_mode": "disabled"}})
    assert r.usage.prompt_tokens + r.usage.completion_tokens == MAX_LEN
    with pytest.raises(openai.BadRequestError) as e:  # a prompt that leaves no room is still refused
        client.completions.create(model="m3-e2e", prompt=[300] * MAX_LEN, max_tokens=5)
    assert e.value.body["code"] == "context_length_exceeded"


def test_truncate_prompt_tokens_keeps_the_last_tokens(client, demo):
    ids = tokenize(demo, "one two three four five six seven eight nine ten eleven twelve")
    assert len(ids) > 6
    r = client.completions.create(model="m3-e2e", prompt="one two three four five six seven eight nine ten "
                                  "eleven twelve", max_tokens=2, echo=True, temperature=0,
                                  extra_body={"truncate_prompt_tokens": 4, "return_token_ids": True})
    c = r.choices[0]
    assert r.usage.prompt_tokens == 4 and extra(c, "prompt_token_ids") == ids[-4:]
    status, body = http(demo, "POST", "/detokenize", {"tokens": ids[-4:]})
    kept = json.loads(body)["prompt"]
    assert kept and "eleven" not in kept and c.text.startswith(kept)  # echo shows what the model saw
    r = chat(client, mode="disabled", max_tokens=2, extra_body={"truncate_prompt_tokens": 8,
                                                                "chat_template_kwargs": {"thinking_mode": "disabled"}})
    assert r.usage.prompt_tokens == 8
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="m3-e2e", prompt="x", max_tokens=2,
                                  extra_body={"truncate_prompt_tokens": MAX_LEN + 1})
    assert e.value.body["param"] == "truncate_prompt_tokens" and "max_model_len" in e.value.body["message"]


def test_prompt_logprobs(client, demo):
    text = "What is 23 + 19?"
    ids = tokenize(demo, text)
    r = client.completions.create(model="m3-e2e", prompt=text, max_tokens=1, temperature=0,
                                  extra_body={"prompt_logprobs": 2, "add_special_tokens": False})
    pl = extra(r.choices[0], "prompt_logprobs")
    n = r.usage.prompt_tokens
    assert len(pl) == n and pl[0] is None
    for entry in pl[1:]:
        assert 1 <= len(entry) <= 3
        for tid, v in entry.items():
            assert int(tid) >= 0 and v["logprob"] <= 0 and v["rank"] >= 1 and isinstance(v["decoded_token"], str)
        assert sorted(v["rank"] for v in entry.values())[0] == 1 or len(entry) == 1
    # The prompt's own token is in each entry.
    assert all(str(t) in e for t, e in zip(ids[-(n - 1):], pl[1:]))
    r = chat(client, max_tokens=1, extra_body={"prompt_logprobs": 0})
    top = extra(r, "prompt_logprobs")
    assert len(top) == r.usage.prompt_tokens and top[0] is None and all(len(e) == 1 for e in top[1:])
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, max_tokens=1, stream=True, extra_body={"prompt_logprobs": 1})
    assert e.value.body["param"] == "prompt_logprobs"


def test_return_token_ids_streamed_and_not(client, demo):
    r = chat(client, extra_body={"return_token_ids": True})
    c = r.choices[0]
    assert len(extra(c, "token_ids")) == r.usage.completion_tokens
    assert len(extra(r, "prompt_token_ids")) == r.usage.prompt_tokens
    ids, prompt_ids = [], None
    for ch in chat(client, stream=True, extra_body={"return_token_ids": True}):
        prompt_ids = extra(ch, "prompt_token_ids") or prompt_ids
        if ch.choices:
            ids += extra(ch.choices[0], "token_ids") or []
    assert ids == extra(c, "token_ids") and prompt_ids == extra(r, "prompt_token_ids")
    cr = client.completions.create(model="m3-e2e", prompt="What is", max_tokens=6, temperature=0,
                                   extra_body={"return_token_ids": True})
    ids, prompt_ids = [], None
    for ch in client.completions.create(model="m3-e2e", prompt="What is", max_tokens=6, temperature=0,
                                        stream=True, extra_body={"return_token_ids": True}):
        prompt_ids = extra(ch.choices[0], "prompt_token_ids") or prompt_ids
        ids += extra(ch.choices[0], "token_ids") or []
    assert ids == extra(cr.choices[0], "token_ids") and len(ids) == 6
    assert prompt_ids == extra(cr.choices[0], "prompt_token_ids")


def test_return_tokens_as_token_ids(client):
    r = client.completions.create(model="m3-e2e", prompt="What is", max_tokens=4, temperature=0, logprobs=2,
                                  extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True})
    c = r.choices[0]
    assert c.logprobs.tokens == [f"token_id:{t}" for t in extra(c, "token_ids")]
    assert all(k.startswith("token_id:") for top in c.logprobs.top_logprobs for k in top)
    r = chat(client, logprobs=True, top_logprobs=1, max_tokens=4,
             extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True})
    assert [t.token for t in r.choices[0].logprobs.content] == \
        [f"token_id:{t}" for t in extra(r.choices[0], "token_ids")]


def test_stop_reason_names_the_string_or_the_token(client):
    base = client.completions.create(model="m3-e2e", prompt="What is 23 + 19?", max_tokens=12, temperature=0,
                                     extra_body={"return_token_ids": True})
    c = base.choices[0]
    assert extra(c, "stop_reason") is None
    text = c.text
    assert len(text) > 6, text
    stop = text[3:6]
    r = client.completions.create(model="m3-e2e", prompt="What is 23 + 19?", max_tokens=12, temperature=0,
                                  stop=[stop])
    assert r.choices[0].finish_reason == "stop" and extra(r.choices[0], "stop_reason") == stop
    tid = extra(c, "token_ids")[2]
    r = client.completions.create(model="m3-e2e", prompt="What is 23 + 19?", max_tokens=12, temperature=0,
                                  extra_body={"stop_token_ids": [tid]})
    assert r.choices[0].finish_reason == "stop" and extra(r.choices[0], "stop_reason") == tid
    last = None
    for ch in client.completions.create(model="m3-e2e", prompt="What is 23 + 19?", max_tokens=12,
                                        temperature=0, stop=[stop], stream=True):
        if ch.choices and ch.choices[0].finish_reason:
            last = ch.choices[0]
    assert extra(last, "stop_reason") == stop
    last = None
    for ch in chat(client, mode="disabled", stream=True, stop=["+"],
                   extra_body={"chat_template_kwargs": {"thinking_mode": "disabled"}}):
        if ch.choices and ch.choices[0].finish_reason:
            last = ch.choices[0]
    assert last.finish_reason == "stop" and extra(last, "stop_reason") == "+"


def test_chat_echo_prepends_the_final_message(client):
    msgs = Q + [{"role": "assistant", "content": "23 + 19"}]
    kw = dict(mode="disabled", max_tokens=8,
              extra_body={"echo": True, "add_generation_prompt": False, "continue_final_message": True,
                          "chat_template_kwargs": {"thinking_mode": "disabled"}})
    r = chat(client, msgs, **kw)
    assert r.choices[0].message.content.startswith("23 + 19")
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chat(client, msgs, stream=True, **kw)
                       if ch.choices)
    assert streamed == r.choices[0].message.content
    # With a generation prompt the reply is a new assistant turn: a final user message is not echoed.
    r = chat(client, Q, mode="disabled", max_tokens=8, extra_body={"echo": True, "chat_template_kwargs":
                                                                   {"thinking_mode": "disabled"}})
    assert not r.choices[0].message.content.startswith(Q[0]["content"])


def test_skip_special_tokens(client, demo):
    think = tokenize(demo, "<mm:think>")
    assert len(think) == 1
    kw = dict(model="m3-e2e", prompt="What is", max_tokens=2, temperature=0)
    shown = client.completions.create(**kw, extra_body={"allowed_token_ids": think, "skip_special_tokens": False,
                                                        "ignore_eos": True})
    hidden = client.completions.create(**kw, extra_body={"allowed_token_ids": think, "ignore_eos": True})
    assert shown.choices[0].text == "<mm:think><mm:think>"
    assert hidden.choices[0].text == ""


def test_tool_choice_none_leaves_no_tool_markup(client):
    tools = [tasks.TOOLS["set_timer"]]
    auto = chat(client, TIMER, "disabled", tools=tools).choices[0]
    assert auto.finish_reason == "tool_calls", "the demo model calls set_timer for this prompt"
    for stream in (False, True):
        if stream:
            content, calls = "", []
            for ch in chat(client, TIMER, "disabled", tools=tools, tool_choice="none", stream=True):
                if ch.choices:
                    content += ch.choices[0].delta.content or ""
                    calls += ch.choices[0].delta.tool_calls or []
        else:
            c = chat(client, TIMER, "disabled", tools=tools, tool_choice="none").choices[0]
            content, calls = c.message.content or "", c.message.tool_calls or []
            assert c.finish_reason != "tool_calls"
        assert not calls
        for tag in ("]<]minimax[>[", "<tool_call>", "<invoke", "</invoke>"):
            assert tag not in content, content


def test_use_beam_search_and_logprob_limits_are_refused_by_name(client):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, extra_body={"use_beam_search": True})
    assert e.value.body["param"] == "use_beam_search"
    chat(client, max_tokens=2, logprobs=True, top_logprobs=5)  # --max-logprobs 5
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, max_tokens=2, logprobs=True, top_logprobs=6)
    assert e.value.body["param"] == "top_logprobs"
    assert "greater than max allowed: 5" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="m3-e2e", prompt="x", max_tokens=1, logprobs=6)
    assert "greater than max allowed: 5" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="m3-e2e", prompt="x", max_tokens=1, extra_body={"prompt_logprobs": 6})
    assert e.value.body["param"] == "prompt_logprobs"


def test_enable_log_requests_logs_id_params_and_prompt_length(client, demo):
    r = client.completions.create(model="m3-e2e", prompt="What is", max_tokens=3, temperature=0.5, seed=77)
    deadline = time.time() + 10
    while time.time() < deadline:
        lines = [l for l in demo.log if f"Received request {r.id}:" in l]
        if lines:
            break
        time.sleep(0.05)
    assert lines, list(demo.log)[-5:]
    line = lines[0]
    assert "prompt_tokens: [2]" in line and "temperature=0.5" in line and "seed=77" in line
    assert "max_tokens=3" in line
    assert "What is" not in line  # never the prompt's text


def sample_twice(binary, args):
    s = Server(binary, DEMO, args)
    try:
        c = openai.OpenAI(base_url=s.base + "/v1", api_key="none", max_retries=0, timeout=120)
        return [c.completions.create(model="m3-e2e", prompt="What is", max_tokens=12, temperature=1.0).choices[0].text
                for _ in range(2)]
    finally:
        s.stop()


def test_serve_seed_makes_unseeded_requests_reproducible(binary):
    a = sample_twice(binary, ["--seed", "11"])
    b = sample_twice(binary, ["--seed", "11"])
    c = sample_twice(binary, ["--seed", "12"])
    assert a == b, "the same --seed and the same requests must sample the same tokens"
    assert a[0] != a[1], "two requests under one --seed still draw differently"
    assert c != a


def test_stream_interval_batches_chunks(binary):
    # --stream-interval 4: a stream's first token alone, then chunks of 4 tokens, the rest at the
    # end; the text and ids are those of the whole answer (chat, with reasoning, and completions).
    s = Server(binary, DEMO, ["--max-model-len", str(MAX_LEN), "--stream-interval", "4"])
    try:
        c = openai.OpenAI(base_url=s.base + "/v1", api_key="none", max_retries=0, timeout=300)
        body = {"return_token_ids": True, "ignore_eos": True}
        whole = chat(c, max_tokens=19, extra_body=dict(body))
        sizes, ids, content, reasoning = [], [], "", ""
        for ch in chat(c, max_tokens=19, stream=True, extra_body=dict(body)):
            if not ch.choices:
                continue
            got = extra(ch.choices[0], "token_ids") or []
            if got:
                sizes.append(len(got))
            ids += got
            content += ch.choices[0].delta.content or ""
            reasoning += extra(ch.choices[0].delta, "reasoning") or ""
        assert sizes == [1, 4, 4, 4, 4, 2], sizes
        assert ids == extra(whole.choices[0], "token_ids")
        m = whole.choices[0].message
        assert content == (m.content or "") and reasoning == (extra(m, "reasoning") or "")
        sizes = [len(extra(ch.choices[0], "token_ids") or [])
                 for ch in c.completions.create(model="m3-e2e", prompt="What is", max_tokens=10,
                                                temperature=0, stream=True, extra_body=dict(body))
                 if ch.choices]
        assert [n for n in sizes if n] == [1, 4, 4, 1], sizes
    finally:
        s.stop()
    # Refused at start-up with the range.
    bad = subprocess.run([binary, "serve", DEMO, "--port", "0", "--stream-interval", "0"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "--stream-interval '0' must be a token count" in bad.stderr
