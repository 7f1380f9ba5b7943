"""The OpenAI surface of `m3serve serve`, driven by the official openai client."""

import json
import subprocess

import openai
import pytest

from conftest import API_KEY, MODEL_NAME, http, metric, metrics, wait_idle

USER = [{"role": "user", "content": "Tell me about the weather in Paris."}]


def generate_ids(binary, model_dir, prompt_ids, max_tokens):
    """Reference greedy continuation from `m3serve generate` (no server, no scheduler)."""
    out = subprocess.run([binary, "generate", "--model", model_dir, "--prompt-ids", ",".join(map(str, prompt_ids)),
                          "--max-tokens", str(max_tokens), "--temperature", "0", "--json"],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout)["output_ids"]


def tokenize(server, text):
    status, body = http(server, "POST", "/tokenize", {"prompt": text, "add_special_tokens": False})
    assert status == 200, body
    return json.loads(body)["tokens"]


def detokenize(server, ids):
    status, body = http(server, "POST", "/detokenize", {"tokens": ids})
    assert status == 200, body
    return json.loads(body)["prompt"]


# ------------------------------------------------------------------------------ basic endpoints

def test_models_health_version(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert models.data[0].max_model_len == 2048
    assert http(server, "GET", "/health")[0] == 200
    status, body = http(server, "GET", "/version")
    assert status == 200 and json.loads(body)["version"]
    assert http(server, "GET", "/no/such/route")[0] == 404


def test_metrics_names_present(server):
    m = metrics(server)
    names = {k.split("{")[0] for k in m}
    for n in ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
              "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:prompt_tokens_total",
              "vllm:generation_tokens_total", "vllm:request_success_total", "vllm:num_preemptions_total",
              "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
              "vllm:e2e_request_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_count",
              "vllm:request_queue_time_seconds_bucket", "vllm:request_prefill_time_seconds_bucket",
              "vllm:request_decode_time_seconds_bucket", "vllm:request_inference_time_seconds_bucket",
              "vllm:time_per_output_token_seconds_bucket", "vllm:request_time_per_output_token_seconds_bucket",
              "vllm:iteration_tokens_total_bucket", "vllm:request_prompt_tokens_bucket",
              "vllm:request_generation_tokens_bucket", "vllm:prompt_tokens_cached_total",
              "vllm:cache_config_info", "http_requests_total"]:
        assert n in names, n


def test_metrics_count_phases_and_http_requests(server, client):
    before_q = metric(server, "vllm:request_queue_time_seconds_count")
    before_http = sum(v for k, v in metrics(server).items()
                      if k.startswith("http_requests_total") and 'handler="/v1/completions"' in k
                      and 'status="2xx"' in k)
    client.completions.create(model=MODEL_NAME, prompt="hello there", max_tokens=4, temperature=0,
                              extra_body={"ignore_eos": True})
    assert metric(server, "vllm:request_queue_time_seconds_count") == before_q + 1
    assert metric(server, "vllm:request_decode_time_seconds_count") >= 1
    assert metric(server, "vllm:request_time_per_output_token_seconds_count") >= 1
    m = metrics(server)
    after_http = sum(v for k, v in m.items() if k.startswith("http_requests_total")
                     and 'handler="/v1/completions"' in k and 'status="2xx"' in k)
    assert after_http == before_http + 1
    info = [k for k in m if k.startswith("vllm:cache_config_info")]
    assert len(info) == 1 and 'block_size="128"' in info[0] and m[info[0]] == 1.0
    assert metric(server, "vllm:prompt_tokens_by_source_total", 'source="local_compute"') + \
        metric(server, "vllm:prompt_tokens_by_source_total", 'source="local_cache_hit"') == \
        metric(server, "vllm:prompt_tokens_total")
    assert metric(server, "vllm:prompt_tokens_by_source_total", 'source="local_cache_hit"') == \
        metric(server, "vllm:prompt_tokens_cached_total")
    # The bucket bounds print as vLLM's prometheus_client prints them.
    assert any('le="0.001"' in k for k in m if k.startswith("vllm:time_to_first_token_seconds_bucket"))
    assert any('le="1.0"' in k for k in m if k.startswith("vllm:request_prompt_tokens_bucket"))


def test_tokenize_detokenize_roundtrip(server):
    text = "Hello, world! Ünïcödé and 12345."
    ids = tokenize(server, text)
    assert len(ids) > 5
    assert detokenize(server, ids) == text
    status, body = http(server, "POST", "/tokenize", {"messages": USER})
    assert status == 200
    j = json.loads(body)
    assert j["count"] == len(j["tokens"]) and j["max_model_len"] == 2048
    assert http(server, "POST", "/detokenize", {"tokens": [-1]})[0] == 400


# ------------------------------------------------------------------------- greedy correctness

def test_completion_greedy_matches_generate(server, client, binary, model_dir):
    prompt_ids = tokenize(server, "The quick brown fox jumps over the lazy dog")
    ref = generate_ids(binary, model_dir, prompt_ids, 12)
    r = client.completions.create(model=MODEL_NAME, prompt=prompt_ids, max_tokens=12, temperature=0,
                                  extra_body={"skip_special_tokens": False})
    eos = 2715  # [e~[ in the M3 test tokenizer: hidden from the text when it ends the output
    ref_text_ids = ref[:-1] if ref and ref[-1] == eos and len(ref) < 12 else ref
    assert r.choices[0].text == detokenize(server, ref_text_ids)
    assert r.usage.prompt_tokens == len(prompt_ids)
    assert r.usage.completion_tokens == len(ref)
    assert r.usage.total_tokens == len(prompt_ids) + len(ref)
    assert r.choices[0].finish_reason == ("length" if len(ref) == 12 and ref[-1] != eos else "stop")


def test_chat_usage_and_shape(server, client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=10, temperature=0)
    assert r.object == "chat.completion"
    assert r.id.startswith("chatcmpl-")
    c = r.choices[0]
    assert c.message.role == "assistant"
    assert c.finish_reason in ("stop", "length")
    status, body = http(server, "POST", "/tokenize", {"messages": USER})
    assert r.usage.prompt_tokens == json.loads(body)["count"]
    assert 1 <= r.usage.completion_tokens <= 10
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    d = r.model_dump()
    assert "reasoning_tokens" in d["usage"]["completion_tokens_details"]
    assert "cached_tokens" in d["usage"]["prompt_tokens_details"]


def test_chat_stream_invariants(client):
    ref = client.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=16, temperature=0)
    stream = client.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    choice_chunks = [c for c in chunks if c.choices]
    finishes = [c.choices[0].finish_reason for c in choice_chunks]
    assert finishes[-1] in ("stop", "length") and all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert all(c.usage is None for c in chunks[:-1])
    content = "".join(c.choices[0].delta.content or "" for c in choice_chunks)
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in choice_chunks)
    assert content == (ref.choices[0].message.content or "")
    assert reasoning == (getattr(ref.choices[0].message, "reasoning_content", None) or "")
    assert chunks[-1].usage.completion_tokens == ref.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == ref.usage.prompt_tokens


def test_stream_continuous_usage_stats(client):
    # vLLM's stream_options.continuous_usage_stats: every chunk carries the running usage, the
    # completion count never decreases, and the final usage chunk has the whole count.
    for create, kw in ((client.chat.completions.create, dict(messages=USER)),
                       (client.completions.create, dict(prompt="Once upon a time"))):
        chunks = list(create(model=MODEL_NAME, max_tokens=12, temperature=0, stream=True,
                             stream_options={"include_usage": True, "continuous_usage_stats": True},
                             **kw))
        assert all(c.usage is not None for c in chunks)
        counts = [c.usage.completion_tokens for c in chunks]
        assert counts == sorted(counts)
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == counts[-1] > 0


def test_completion_stream_matches_nonstream(client):
    kw = dict(model=MODEL_NAME, prompt="Once upon a time", max_tokens=20, temperature=0)
    ref = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert len({c.id for c in chunks}) == 1
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == ref.choices[0].text
    assert [c for c in chunks if c.choices][-1].choices[0].finish_reason == ref.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == ref.usage.completion_tokens


def test_stop_string_is_trimmed(client):
    kw = dict(model=MODEL_NAME, prompt="Once upon a time", max_tokens=40, temperature=0)
    full = client.completions.create(**kw).choices[0].text
    assert len(full) > 10
    stop = full[len(full) // 2:len(full) // 2 + 3]
    expected = full[:full.index(stop)]
    r = client.completions.create(stop=[stop], **kw)
    assert r.choices[0].text == expected
    assert r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(stop=stop, stream=True, **kw) if c.choices)
    assert streamed == expected


def test_n_and_seed(client):
    kw = dict(model=MODEL_NAME, prompt="Random story:", max_tokens=12, temperature=1.0, seed=42, n=3)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) > 1  # distinct streams per choice
    assert a.usage.completion_tokens >= 3


def test_multiple_prompts_and_token_id_prompts(client):
    r = client.completions.create(model=MODEL_NAME, prompt=["a b c", "x y z"], max_tokens=4, temperature=0)
    assert sorted(c.index for c in r.choices) == [0, 1]
    r2 = client.completions.create(model=MODEL_NAME, prompt=[[100, 200, 300], [5, 6]], max_tokens=4, temperature=0)
    assert len(r2.choices) == 2
    assert r2.usage.prompt_tokens == 5


def test_echo_and_logprobs(client):
    r = client.completions.create(model=MODEL_NAME, prompt="Hello there friend", max_tokens=5, temperature=0,
                                  echo=True, logprobs=3)
    c = r.choices[0]
    assert c.text.startswith("Hello there friend")
    lp = c.logprobs
    assert lp.token_logprobs[0] is None
    n_prompt = r.usage.prompt_tokens
    assert len(lp.tokens) == n_prompt + r.usage.completion_tokens
    assert all(v <= 0 for v in lp.token_logprobs[1:])
    assert all(len(t) <= 3 + 1 for t in lp.top_logprobs[1:])
    assert lp.text_offset[0] == 0


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=6, temperature=0,
                                       logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) >= 1
    for t in content:
        assert t.logprob <= 0
        assert len(t.top_logprobs) == 2
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob


def test_sampling_params_accepted(client):
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=USER, max_completion_tokens=8, temperature=0.7, top_p=0.9,
        presence_penalty=0.5, frequency_penalty=0.5, seed=3,
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 4, "ignore_eos": True,
                    "stop_token_ids": [7], "priority": 1, "skip_special_tokens": True,
                    "chat_template_kwargs": {"thinking_mode": "disabled"}})
    assert r.usage.completion_tokens >= 4


def test_ignore_eos_runs_to_max_tokens(client):
    r = client.completions.create(model=MODEL_NAME, prompt="abc", max_tokens=30, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 30
    assert r.choices[0].finish_reason == "length"


def test_tools_request_is_accepted(client):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    r = client.chat.completions.create(model=MODEL_NAME, messages=USER, tools=tools, max_tokens=8, temperature=0)
    c = r.choices[0]
    # A random-weight model does not call tools; the shape must still be right.
    assert c.finish_reason in ("stop", "length", "tool_calls")
    if c.finish_reason == "tool_calls":
        assert c.message.tool_calls[0].id.startswith("call_")


# --------------------------------------------------------------------------------- prefix cache

def test_repeated_prompt_hits_prefix_cache(server, client):
    long_prompt = "The history of the world in many words. " * 40  # several 128-token pages
    before = metric(server, "vllm:prefix_cache_hits_total")
    a = client.completions.create(model=MODEL_NAME, prompt=long_prompt, max_tokens=10, temperature=0)
    b = client.completions.create(model=MODEL_NAME, prompt=long_prompt, max_tokens=10, temperature=0)
    after = metric(server, "vllm:prefix_cache_hits_total")
    assert a.choices[0].text == b.choices[0].text
    assert after - before >= 128
    assert b.usage.prompt_tokens_details.cached_tokens >= 128
    assert b.usage.prompt_tokens_details.cached_tokens % 128 == 0


# ---------------------------------------------------------------------------------- error cases

def error_of(status_body):
    status, body = status_body
    return status, json.loads(body)["error"]


def test_malformed_json_is_400(server):
    status, err = error_of(http(server, "POST", "/v1/chat/completions", raw=b"{not json"))
    assert status == 400
    assert set(err) >= {"message", "type", "param", "code"}
    assert "JSON" in err["message"]


@pytest.mark.parametrize("field,value,param", [
    ("temperature", "hot", "temperature"),
    ("max_tokens", "ten", "max_tokens"),
    ("n", 1.5, "n"),
    ("stream", "yes", "stream"),
    ("stop", 3, "stop"),
    ("messages", "hello", "messages"),
])
def test_wrong_types_are_400_naming_the_param(server, field, value, param):
    body = {"model": MODEL_NAME, "messages": USER, field: value}
    status, err = error_of(http(server, "POST", "/v1/chat/completions", body))
    assert status == 400
    assert err["param"] == param
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize("field,value", [
    ("temperature", -1), ("top_p", 1.5), ("top_k", -5), ("n", 0), ("max_tokens", 0),
    ("presence_penalty", 9), ("min_p", 2), ("top_logprobs", 50), ("max_tokens", 10 ** 12),
])
def test_out_of_range_values_are_400(client, field, value):
    extra = {field: value}
    if field == "top_logprobs":
        extra["logprobs"] = True
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL_NAME, messages=USER, extra_body=extra)
    assert e.value.status_code == 400
    assert e.value.body["param"] == field


def test_unknown_role_is_400(server):
    body = {"model": MODEL_NAME, "messages": [{"role": "wizard", "content": "hi"}]}
    status, err = error_of(http(server, "POST", "/v1/chat/completions", body))
    assert status == 400
    assert err["param"] == "messages[0].role"
    assert "wizard" in err["message"]


def test_completions_bad_prompts(client):
    for prompt, param in [("", "prompt"), ([], "prompt"), ([[1, 2], []], "prompt[1]"), ([1, 10 ** 9], "prompt")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2)
        assert e.value.body["param"] == param, prompt


def test_wrong_api_key_is_401(server):
    import openai as oa
    bad = oa.OpenAI(base_url=server.base + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(oa.AuthenticationError) as e:
        bad.models.list()
    assert e.value.status_code == 401
    status, err = error_of(http(server, "GET", "/v1/models", headers={"Authorization": ""}))
    assert status == 401 and err["code"] == "invalid_api_key"


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4", messages=USER, max_tokens=2)
    assert e.value.status_code == 404
    assert e.value.body["code"] == "model_not_found"
    assert e.value.body["param"] == "model"


def test_prompt_over_max_model_len_is_400_with_numbers(client):
    long = "word " * 3000
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL_NAME, prompt=long, max_tokens=5)
    assert e.value.body["code"] == "context_length_exceeded"
    assert "2048" in e.value.body["message"]
    # An explicit max_tokens past the room left is clamped to it, as vLLM does
    # (test_request_fields.py::test_max_tokens_is_clamped_to_the_room_left).


def test_bad_tool_choice_and_thinking_mode(client):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL_NAME, messages=USER, tools=tools,
                                       tool_choice={"type": "function", "function": {"name": "g"}})
    assert e.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL_NAME, messages=USER,
                                       extra_body={"chat_template_kwargs": {"thinking_mode": "maybe"}})
    assert e.value.body["param"] == "chat_template_kwargs.thinking_mode"


def test_server_idle_after_api_tests(server):
    assert wait_idle(server) == (0, 0, 0)
