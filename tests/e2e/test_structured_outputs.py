"""Structured outputs and token controls through `m3serve serve` with the demo model (models/demo)
and the official openai client: response_format json_schema / json_object, structured_outputs
{json, regex, choice, grammar (EBNF or Lark), structural_tag}, response_format structural_tag
(both of vLLM's forms) and the guided_* aliases (chat and completions, streamed and not),
each after the model's reasoning when the reasoning parser is on; tool_choice "required" and a
named function always give a parsed tool call; logit_bias, allowed_token_ids and bad_words change
the tokens drawn; invalid schemas / regexes / grammars are 400s naming the field; a constrained
request batched with plain ones leaves their greedy answers unchanged. The demo model is weak,
so every check is on the shape the grammar guarantees, over several seeds."""

import concurrent.futures
import json
import os
import re
import sys

import openai
import pytest

from conftest import REPO, Server, http

sys.path.insert(0, os.path.join(REPO, "tools", "demo_model"))
import tasks  # noqa: E402

DEMO = os.path.join(REPO, "models", "demo")
SEEDS = [1, 2, 3, 4, 5]

TRIP = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "sunny": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["city", "days", "sunny"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Plan a short trip for me and answer in JSON."}]


@pytest.fixture(scope="module")
def demo(binary):
    s = Server(binary, DEMO, ["--tool-call-parser", "minimax_m3", "--reasoning-parser", "minimax_m3",
                              "--enable-auto-tool-choice"])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(demo):
    return openai.OpenAI(base_url=demo.base + "/v1", api_key="none", max_retries=0, timeout=300)


def validate(obj, schema):
    try:
        import jsonschema
    except ImportError:  # a hand check of TRIP's rules
        assert set(obj) <= set(schema["properties"]) and set(schema["required"]) <= set(obj)
        assert obj["city"] in ("Paris", "Rome", "Oslo") and isinstance(obj["sunny"], bool)
        assert isinstance(obj["days"], int) and 1 <= obj["days"] <= 14
        return
    jsonschema.validate(obj, schema)


def chat(client, mode="disabled", messages=ASK, **kw):
    extra = kw.pop("extra_body", {})
    extra.setdefault("chat_template_kwargs", {"thinking_mode": mode})
    kw.setdefault("max_tokens", 400)
    return client.chat.completions.create(model="m3-e2e", messages=messages, extra_body=extra, **kw)


@pytest.mark.parametrize("mode", ["disabled", "adaptive", "enabled"])
def test_json_schema_output_parses_and_validates(client, mode):
    rf = {"type": "json_schema", "json_schema": {"name": "trip", "schema": TRIP, "strict": True}}
    for seed in SEEDS:
        c = chat(client, mode, response_format=rf, temperature=1.0, seed=seed).choices[0]
        assert c.finish_reason == "stop", (seed, c.message.content)
        validate(json.loads(c.message.content), TRIP)


def test_json_schema_streamed_equals_a_valid_document(client):
    rf = {"type": "json_schema", "json_schema": {"name": "trip", "schema": TRIP}}
    for seed in SEEDS[:3]:
        text, finish = "", None
        for ch in chat(client, response_format=rf, temperature=1.0, seed=seed, stream=True):
            if ch.choices and ch.choices[0].delta.content:
                text += ch.choices[0].delta.content
            if ch.choices and ch.choices[0].finish_reason:
                finish = ch.choices[0].finish_reason
        assert finish == "stop"
        validate(json.loads(text), TRIP)


def test_json_object_gives_an_object(client):
    for seed in SEEDS:
        c = chat(client, response_format={"type": "json_object"}, temperature=0.8, seed=seed,
                 max_tokens=600).choices[0]
        if c.finish_reason == "stop":  # an unbounded object may run to max_tokens
            assert isinstance(json.loads(c.message.content), dict)
        else:
            assert c.message.content.lstrip().startswith("{")


def test_regex_choice_and_grammar(client):
    pattern = r"[A-Z][a-z]{2,6}-[0-9]{2,4}"
    for seed in SEEDS:
        for body in ({"structured_outputs": {"regex": pattern}}, {"guided_regex": pattern}):
            c = chat(client, temperature=1.0, seed=seed, extra_body=dict(body)).choices[0]
            assert c.finish_reason == "stop" and re.fullmatch(pattern, c.message.content), c.message.content
        choices = ["red", "green", "light blue"]
        for body in ({"structured_outputs": {"choice": choices}}, {"guided_choice": choices}):
            c = chat(client, temperature=1.0, seed=seed, extra_body=dict(body)).choices[0]
            assert c.message.content in choices
        ebnf = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
        c = chat(client, temperature=1.0, seed=seed, extra_body={"structured_outputs": {"grammar": ebnf}}).choices[0]
        assert c.finish_reason == "stop" and re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", c.message.content)


def test_lark_grammar(client):
    # vLLM takes Lark as well as EBNF for xgrammar; the same language as the EBNF case above.
    lark = '// sums\nstart: "(" num ("+" num)* ")"\nnum: /[1-9][0-9]?/\n'
    for seed in SEEDS[:3]:
        for body in ({"structured_outputs": {"grammar": lark}}, {"guided_grammar": lark}):
            c = chat(client, temperature=1.0, seed=seed, extra_body=dict(body)).choices[0]
            assert c.finish_reason == "stop" and re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)",
                                                              c.message.content), c.message.content


def test_structural_tag_response_format(client):
    # xgrammar's format (vLLM's `format` form), after the reasoning in every thinking mode, and
    # through structured_outputs.structural_tag as JSON text; then the legacy form (free text,
    # then tags opened by a trigger: the text outside tags is free, each tag's body is its schema).
    fmt = {"type": "sequence", "elements": [{"type": "const_string", "value": "City: "},
                                            {"type": "regex", "pattern": "(Paris|Rome|Oslo)"}]}
    rf = {"type": "structural_tag", "format": fmt}
    for mode in ("disabled", "adaptive", "enabled"):
        for seed in SEEDS[:2]:
            c = chat(client, mode, response_format=rf, temperature=1.0, seed=seed).choices[0]
            assert c.finish_reason == "stop" and re.fullmatch(r"City: (Paris|Rome|Oslo)", c.message.content), \
                (mode, c.message.content)
    c = chat(client, temperature=1.0, seed=3,
             extra_body={"structured_outputs": {"structural_tag": json.dumps(rf)}}).choices[0]
    assert re.fullmatch(r"City: (Paris|Rome|Oslo)", c.message.content), c.message.content
    legacy = {"type": "structural_tag", "triggers": ["<trip>"],
              "structures": [{"begin": "<trip>", "schema": TRIP, "end": "</trip>"}]}
    for seed in SEEDS:
        c = chat(client, response_format=legacy, temperature=1.0, seed=seed, max_tokens=300).choices[0]
        for body in re.findall(r"<trip>(.*?)</trip>", c.message.content, re.S):
            validate(json.loads(body), TRIP)
        # an opened tag is always finished (or the output was cut by max_tokens)
        assert c.message.content.count("<trip>") == c.message.content.count("</trip>") or \
            c.finish_reason == "length", c.message.content


def test_format_applies_after_the_reasoning(client):
    c = chat(client, "enabled", temperature=0, extra_body={"structured_outputs": {"choice": ["yes", "no"]}}).choices[0]
    assert c.message.content in ("yes", "no")
    assert (c.message.model_extra or {}).get("reasoning_content")  # the model reasoned first, freely


def test_completions_endpoint(client):
    for seed in SEEDS[:3]:
        r = client.completions.create(model="m3-e2e", prompt="The answer is", max_tokens=50, temperature=1.0,
                                      seed=seed, extra_body={"structured_outputs": {"regex": "[0-9]{1,3}!"}})
        assert re.fullmatch("[0-9]{1,3}!", r.choices[0].text), r.choices[0].text
        r = client.completions.create(model="m3-e2e", prompt="Colour:", max_tokens=50, temperature=1.0, seed=seed,
                                      n=2, extra_body={"guided_choice": ["cyan", "magenta"]})
        assert all(c.text in ("cyan", "magenta") for c in r.choices)


TOOLS = [tasks.TOOLS["get_weather"], tasks.TOOLS["set_timer"]]


def check_call(call, tools):
    fn = next(t["function"] for t in tools if t["function"]["name"] == call.function.name)
    validate_args = json.loads(call.function.arguments)
    assert isinstance(validate_args, dict)
    for k in fn["parameters"].get("required", []):
        assert k in validate_args, (call.function.name, validate_args)


@pytest.mark.parametrize("mode", ["disabled", "adaptive"])
def test_tool_choice_required_always_calls(client, mode):
    # A question the model answers in text with tool_choice "auto": "required" forces a call.
    q = [{"role": "user", "content": "What is 23 + 19?"}]
    for seed in SEEDS:
        c = chat(client, mode, messages=q, tools=TOOLS, tool_choice="required", temperature=1.0, seed=seed).choices[0]
        assert c.finish_reason == "tool_calls", c.message
        assert c.message.tool_calls
        for call in c.message.tool_calls:
            check_call(call, TOOLS)


def test_named_tool_choice_calls_that_function(client):
    q = [{"role": "user", "content": "Set a timer for 25 minutes for the tea."}]
    for seed in SEEDS:
        choice = {"type": "function", "function": {"name": "get_weather"}}
        c = chat(client, messages=q, tools=TOOLS, tool_choice=choice, temperature=1.0, seed=seed).choices[0]
        assert [t.function.name for t in c.message.tool_calls] == ["get_weather"]
        check_call(c.message.tool_calls[0], TOOLS)
        args = json.loads(c.message.tool_calls[0].function.arguments)
        assert args["unit"] in ("celsius", "fahrenheit")  # the enum holds


def test_required_tool_call_streamed(client):
    q = [{"role": "user", "content": "Hello there!"}]
    names, finish = [], None
    for ch in chat(client, messages=q, tools=TOOLS, tool_choice="required", temperature=0, stream=True):
        if not ch.choices:
            continue
        for tc in ch.choices[0].delta.tool_calls or []:
            if tc.function and tc.function.name:
                names.append(tc.function.name)
        finish = ch.choices[0].finish_reason or finish
    assert names and finish == "tool_calls"


def token_ids(demo, text):
    status, body = http(demo, "POST", "/tokenize", {"model": "m3-e2e", "prompt": text, "add_special_tokens": False})
    assert status == 200, body
    return json.loads(body)["tokens"]


def complete(client, prompt="The old clock", **kw):
    kw.setdefault("max_tokens", 12)
    kw.setdefault("temperature", 0)
    return client.completions.create(model="m3-e2e", prompt=prompt, **kw).choices[0]


def test_logit_bias_and_allowed_token_ids(client, demo):
    base = complete(client).text
    [z] = token_ids(demo, "Z")
    forced = complete(client, logit_bias={str(z): 100}).text
    assert forced == "Z" * 12 and forced != base
    banned = complete(client, logit_bias={str(t): -100 for t in token_ids(demo, base)[:1]}).text
    assert banned != base
    ab = token_ids(demo, "x") + token_ids(demo, "y")
    only = complete(client, temperature=1.0, seed=7, extra_body={"allowed_token_ids": ab}).text
    assert only and set(only) <= {"x", "y"}, only


def contains(seq, sub):
    return any(seq[i:i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


def bad_word_sequences(demo, word):
    """vLLM's rule: the word, and the word after a space when that is as many tokens."""
    plain = token_ids(demo, word.lstrip())
    spaced = token_ids(demo, " " + word.lstrip())
    return [plain] + ([spaced] if len(spaced) == len(plain) and spaced[0] != plain[0] else [])


def test_bad_words_are_never_produced(client, demo):
    used = 0
    for prompt in ("The old clock", "Once upon a time", "The road winds", "My favourite colour is"):
        base = complete(client, prompt, max_tokens=24).text
        base_ids = token_ids(demo, base)
        # Words of the greedy answer whose banned sequences it contains: banning them must bite.
        words = [w for w in dict.fromkeys(re.findall(r"[A-Za-z]{3,}", base))
                 if any(contains(base_ids, s) for s in bad_word_sequences(demo, w))][:2]
        if not words:
            continue
        used += 1
        out = complete(client, prompt, max_tokens=24, extra_body={"bad_words": words}).text
        assert out != base
        out_ids = token_ids(demo, out)
        for w in words:
            for s in bad_word_sequences(demo, w):
                assert not contains(out_ids, s), (w, out)
    assert used, "no prompt gave a bannable word"


def test_invalid_formats_are_400s_naming_the_field(demo):
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
         "response_format.json_schema.schema"),
        ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex"),
        ({"guided_grammar": "root ::= ("}, "guided_grammar"),
        ({"structured_outputs": {"choice": "red"}}, "structured_outputs.choice"),
        ({"logit_bias": {"999999": 1}}, "logit_bias"),
        ({"allowed_token_ids": [999999]}, "allowed_token_ids"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
        ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs.grammar"),
        ({"response_format": {"type": "structural_tag"}}, "response_format"),
        ({"response_format": {"type": "structural_tag", "format": {"type": "regex", "pattern": "[a-"}}},
         "response_format"),
        ({"structured_outputs": {"structural_tag": "not json"}}, "structured_outputs.structural_tag"),
    ]
    for extra, param in cases:
        body = {"model": "m3-e2e", "messages": ASK, "max_tokens": 5, **extra}
        status, text = http(demo, "POST", "/v1/chat/completions", body)
        assert status == 400, (extra, status, text)
        err = json.loads(text)["error"]
        assert err["param"] == param and param in err["message"], err


def test_constrained_requests_leave_batch_neighbours_unchanged(client):
    plain = [[{"role": "user", "content": q}] for q in ("What is 23 + 19?", "Name a colour.", "Hi!")]
    alone = [chat(client, messages=m, temperature=0, max_tokens=40).choices[0].message.content for m in plain]
    rf = {"type": "json_schema", "json_schema": {"name": "trip", "schema": TRIP}}
    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        cons = [ex.submit(chat, client, response_format=rf, temperature=1.0, seed=s) for s in SEEDS]
        outs = [ex.submit(lambda m: chat(client, messages=m, temperature=0, max_tokens=40), m) for m in plain]
        got = [f.result().choices[0].message.content for f in outs]
        for f in cons:
            validate(json.loads(f.result().choices[0].message.content), TRIP)
    assert got == alone


def test_langchain_with_structured_output(demo):
    lc = pytest.importorskip("langchain_openai")  # tools/setup.sh installs it
    from typing import Literal

    from pydantic import BaseModel, Field

    class Trip(BaseModel):
        """A short trip."""
        city: Literal["Paris", "Rome", "Oslo"]
        days: int = Field(ge=1, le=14)
        sunny: bool

    llm = lc.ChatOpenAI(base_url=demo.base + "/v1", api_key="none", model="m3-e2e", temperature=0,
                        max_tokens=400, max_retries=0,
                        extra_body={"chat_template_kwargs": {"thinking_mode": "disabled"}})
    for method in ("json_schema", "function_calling"):
        out = llm.with_structured_output(Trip, method=method).invoke("Plan a short trip for me.")
        assert isinstance(out, Trip), (method, out)
