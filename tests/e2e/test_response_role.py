"""The chat reply's role, as vLLM sets it: --response-role after a generation prompt (default
assistant), else the final message's own role (add_generation_prompt false continues it); in the
whole response and in the first stream chunk."""

import json
import urllib.request

import pytest

from conftest import MODEL_NAME, Server


def post(base, body):
    req = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return r.read().decode()


@pytest.fixture(scope="module")
def bot(binary, model_dir):
    s = Server(binary, model_dir, ["--response-role", "narrator", "--max-model-len", "2048",
                                   "--kv-cache-memory-bytes", "64MiB"])
    yield s
    s.stop()


def test_response_role_sets_the_reply_role(bot):
    body = {"model": MODEL_NAME, "max_tokens": 3, "temperature": 0,
            "messages": [{"role": "user", "content": "hello"}]}
    out = json.loads(post(bot.base, body))
    assert out["choices"][0]["message"]["role"] == "narrator"
    stream = post(bot.base, dict(body, stream=True))
    first = json.loads(stream.split("\n\n")[0][len("data: "):])
    assert first["choices"][0]["delta"]["role"] == "narrator"


def test_without_a_generation_prompt_the_final_message_role_is_kept(bot):
    body = {"model": MODEL_NAME, "max_tokens": 3, "temperature": 0, "add_generation_prompt": False,
            "continue_final_message": True,
            "messages": [{"role": "user", "content": "hi"},
                         {"role": "assistant", "content": "The answer"}]}
    out = json.loads(post(bot.base, body))
    assert out["choices"][0]["message"]["role"] == "assistant"
