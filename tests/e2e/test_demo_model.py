"""The embedded demo model (models/demo, a small trained MiniMax-M3-architecture model) through
the real server and the official openai client: reasoning split off from content (streaming and
not), thinking disabled gives no reasoning, a tool call parsed with schema-typed arguments and a
follow-up with the tool result that gets a final answer. Greedy, so each answer is fixed."""

import json
import os
import sys

import openai
import pytest

from conftest import REPO, Server

sys.path.insert(0, os.path.join(REPO, "tools", "demo_model"))
import tasks  # noqa: E402

DEMO = os.path.join(REPO, "models", "demo")


@pytest.fixture(scope="module")
def demo(binary):
    if not os.path.exists(os.path.join(DEMO, "model.safetensors")):
        pytest.fail("models/demo is missing")
    s = Server(binary, DEMO, ["--tool-call-parser", "minimax_m3", "--reasoning-parser", "minimax_m3",
                              "--enable-auto-tool-choice"])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(demo):
    return openai.OpenAI(base_url=demo.base + "/v1", api_key="none")


def extra(msg, key):
    return (getattr(msg, "model_extra", None) or {}).get(key)


def chat(client, messages, mode, **kw):
    return client.chat.completions.create(model="m3-e2e", messages=messages, temperature=0,
                                          max_tokens=kw.pop("max_tokens", 96),
                                          extra_body={"chat_template_kwargs": {"thinking_mode": mode}}, **kw)


Q = [{"role": "user", "content": "What is 23 + 19?"}]


def test_thinking_enabled_splits_reasoning_from_content(client):
    r = chat(client, Q, "enabled")
    m = r.choices[0].message
    reasoning = extra(m, "reasoning")
    assert reasoning and reasoning.strip(), "no reasoning returned"
    assert extra(m, "reasoning_content") == reasoning
    assert m.content and m.content.strip()
    for tag in ("<mm:think>", "</mm:think>", "[e~["):
        assert tag not in m.content and tag not in reasoning
    assert r.usage.completion_tokens_details.reasoning_tokens > 0
    assert r.choices[0].finish_reason == "stop"


def test_thinking_enabled_streaming_equals_non_streaming(client):
    whole = chat(client, Q, "enabled").choices[0].message
    reasoning, content, finish = "", "", None
    for chunk in chat(client, Q, "enabled", stream=True):
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        reasoning += extra(d, "reasoning") or ""
        content += d.content or ""
        finish = chunk.choices[0].finish_reason or finish
    assert reasoning == extra(whole, "reasoning")
    assert content == whole.content
    assert finish == "stop"


def test_thinking_disabled_returns_no_reasoning(client):
    m = chat(client, Q, "disabled").choices[0].message
    assert not extra(m, "reasoning")
    assert m.content and m.content.strip()
    assert "</mm:think>" not in m.content


def test_tool_call_with_typed_arguments_then_final_answer(client):
    tools = [tasks.TOOLS["set_timer"], tasks.TOOLS["get_weather"]]
    messages = [{"role": "user", "content": "Set a timer for 25 minutes for the tea."}]
    r = chat(client, messages, "disabled", tools=tools)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls"
    calls = c.message.tool_calls
    assert calls and calls[0].function.name == "set_timer"
    args = json.loads(calls[0].function.arguments)
    assert args.get("minutes") == 25 and isinstance(args["minutes"], int)  # typed by the schema
    assert args.get("label") == "tea"
    # Follow-up with the tool result: the model answers in text.
    messages += [{"role": "assistant", "content": None,
                  "tool_calls": [{"id": calls[0].id, "type": "function",
                                  "function": {"name": "set_timer", "arguments": calls[0].function.arguments}}]},
                 {"role": "tool", "tool_call_id": calls[0].id, "content": json.dumps({"ok": True, "minutes": 25})}]
    r2 = chat(client, messages, "disabled", tools=tools)
    c2 = r2.choices[0]
    assert c2.finish_reason == "stop"
    assert not c2.message.tool_calls
    assert c2.message.content and "25" in c2.message.content


def test_tool_call_streams_incrementally(client):
    tools = [tasks.TOOLS["set_timer"]]
    messages = [{"role": "user", "content": "Set a timer for 25 minutes for the tea."}]
    name, args, n_arg_chunks = None, "", 0
    for chunk in chat(client, messages, "disabled", tools=tools, stream=True):
        if not chunk.choices:
            continue
        for tc in chunk.choices[0].delta.tool_calls or []:
            if tc.function.name:
                name = tc.function.name
            if tc.function.arguments:
                args += tc.function.arguments
                n_arg_chunks += 1
    assert name == "set_timer"
    assert json.loads(args) == {"minutes": 25, "label": "tea"}
    assert n_arg_chunks >= 2, "arguments arrived in one piece"


def test_terminal_chat_runs_a_conversation(binary):
    import subprocess
    p = subprocess.run([binary, "chat", "--thinking-mode", "enabled"],
                       input="What is 23 + 19?\n/think disabled\nWhat is 5 + 3?\n/quit\n",
                       capture_output=True, text=True, timeout=300, env=dict(os.environ, M3SERVE_MODELS_DIR=os.path.join(REPO, "models")))
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert "[thinking]" in out                      # reasoning shown for the first answer
    assert "(thinking mode: disabled)" in out
    assert out.count("> ") >= 3
    assert "<mm:think>" not in out and "[e~[" not in out


def test_passkey_past_the_top_k_coverage(client):
    """A number hidden in ~2000 tokens of filler: 4 blocks x 128 tokens cover 512, so only the
    indexer's block choice can find it (the same eval items transformers scores in
    tools/demo_model/results/hf_eval.json, all correct there)."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(DEMO, "tokenizer.json"))
    cfg = json.load(open(os.path.join(DEMO, "config.json")))
    tc = cfg.get("text_config", cfg)
    coverage = tc["index_topk_blocks"] * tc["index_block_size"]
    items = [it for it in tasks.eval_set(tasks.FillerLengths(tok)) if it["kind"] == "passkey" and it["ctx"] == 2048]
    for it in items[:4]:
        r = client.chat.completions.create(model="m3-e2e", messages=it["messages"], temperature=0, max_tokens=12,
                                           extra_body={"chat_template_kwargs": {"thinking_mode": "disabled"}})
        assert r.usage.prompt_tokens > 3 * coverage, "prompt must exceed what the top-k blocks cover"
        assert tasks.answer_correct(it, r.choices[0].message.content), (it["id"], it["expect"], r.choices[0].message.content)
