"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) with the official
`anthropic` client, and OpenAI's Responses API (/v1/responses) with the official `openai` client,
openai-agents (its default Responses model) and langchain-openai (use_responses_api), through
`m3serve serve` with the demo model (models/demo): thinking blocks / reasoning items from the
reasoning parser, tool calls and their results, streaming (Anthropic's event sequence; the
Responses events) equal to the whole answer, stop sequences, max_tokens, previous_response_id,
background responses (poll, cancel), DELETE, input_items, and errors in each API's shape. Greedy (the demo model's generation_config), so each answer is
fixed."""

import asyncio
import signal
import json
import os
import sys

import anthropic
import openai
import pytest

from conftest import API_KEY, REPO, Server, http

sys.path.insert(0, os.path.join(REPO, "tools", "demo_model"))
import tasks  # noqa: E402

DEMO = os.path.join(REPO, "models", "demo")
MATH = [{"role": "user", "content": "What is 23 + 19?"}]
TIMER = "Set a timer for 25 minutes for the tea."
FN = tasks.TOOLS["set_timer"]["function"]
A_TOOLS = [{"name": FN["name"], "description": FN["description"], "input_schema": FN["parameters"]}]
R_TOOLS = [{"type": "function", "name": FN["name"], "description": FN["description"],
            "parameters": FN["parameters"]}]


@pytest.fixture(scope="module")
def demo(binary):
    s = Server(binary, DEMO, [])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def ac(demo):
    return anthropic.Anthropic(base_url=demo.base, api_key="none", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def oc(demo):
    return openai.OpenAI(base_url=demo.base + "/v1", api_key="none", max_retries=0, timeout=300)


def blocks(msg, type_):
    return [b for b in msg.content if b.type == type_]


# ------------------------------------------------------------------------------ /v1/messages

def test_messages_thinking_and_text(ac):
    m = ac.messages.create(model="m3-e2e", max_tokens=120, messages=MATH,
                           thinking={"type": "enabled", "budget_tokens": 100})
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert "42" in blocks(m, "thinking")[0].thinking and "42" in blocks(m, "text")[0].text
    for tag in ("<mm:think>", "</mm:think>", "[e~["):
        assert tag not in blocks(m, "text")[0].text
    assert m.stop_reason == "end_turn" and m.stop_sequence is None and m.role == "assistant"
    assert m.id.startswith("msg_") and m.model == "m3-e2e"
    counted = ac.messages.count_tokens(model="m3-e2e", messages=MATH,
                                       thinking={"type": "enabled", "budget_tokens": 100})
    assert m.usage.input_tokens == counted.input_tokens > 0 and m.usage.output_tokens > 0
    off = ac.messages.create(model="m3-e2e", max_tokens=60, messages=MATH, thinking={"type": "disabled"},
                             system="You are a helpful assistant.")
    assert [b.type for b in off.content] == ["text"]


def test_messages_thinking_budget_is_applied(ac):
    m = ac.messages.create(model="m3-e2e", max_tokens=120, messages=MATH,
                           thinking={"type": "enabled", "budget_tokens": 3})
    full = ac.messages.create(model="m3-e2e", max_tokens=120, messages=MATH,
                              thinking={"type": "enabled", "budget_tokens": 100})
    assert len(blocks(m, "thinking")[0].thinking) < len(blocks(full, "thinking")[0].thinking)
    assert blocks(m, "text")[0].text


def test_messages_agent_loop_with_tool_use_and_results(ac):
    """An Anthropic-style agent loop: call tools until the model answers in text."""
    messages = [{"role": "user", "content": TIMER}]
    ran = []
    for _ in range(4):
        m = ac.messages.create(model="m3-e2e", max_tokens=120, messages=messages, tools=A_TOOLS,
                               thinking={"type": "disabled"})
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]})
        if m.stop_reason != "tool_use":
            break
        results = []
        for b in blocks(m, "tool_use"):
            ran.append((b.name, b.input))
            results.append({"type": "tool_result", "tool_use_id": b.id,
                            "content": json.dumps({"ok": True, "minutes": b.input["minutes"]})})
        messages.append({"role": "user", "content": results})
    assert ran == [("set_timer", {"minutes": 25, "label": "tea"})]
    assert m.stop_reason == "end_turn" and "25" in blocks(m, "text")[0].text


def test_messages_tool_choice_any_and_named(ac):
    for choice in ({"type": "any"}, {"type": "tool", "name": "set_timer"}):
        m = ac.messages.create(model="m3-e2e", max_tokens=120, messages=MATH, tools=A_TOOLS,
                               tool_choice=choice, thinking={"type": "disabled"})
        assert m.stop_reason == "tool_use" and blocks(m, "tool_use")[0].name == "set_timer"
    m = ac.messages.create(model="m3-e2e", max_tokens=120, messages=[{"role": "user", "content": TIMER}],
                           tools=A_TOOLS, tool_choice={"type": "none"}, thinking={"type": "disabled"})
    assert not blocks(m, "tool_use") and m.stop_reason != "tool_use"


def test_messages_stream_event_sequence_equals_the_whole_message(ac, demo):
    for kw in (dict(messages=MATH, thinking={"type": "enabled", "budget_tokens": 100}),
               dict(messages=[{"role": "user", "content": TIMER}], tools=A_TOOLS, thinking={"type": "disabled"})):
        whole = ac.messages.create(model="m3-e2e", max_tokens=120, **kw)
        with ac.messages.stream(model="m3-e2e", max_tokens=120, **kw) as s:
            types = [e.type for e in s]
            final = s.get_final_message()
        dump = lambda m: [{k: v for k, v in b.model_dump(exclude_none=True).items() if k != "id"}  # noqa: E731
                          for b in m.content]  # tool_use ids are fresh per request
        assert dump(final) == dump(whole) and final.stop_reason == whole.stop_reason
        assert final.usage.output_tokens == whole.usage.output_tokens
        # The raw event order: message_start, then per block start / delta* / stop, then
        # message_delta and message_stop.
        status, raw = http(demo, "POST", "/v1/messages", dict(model="m3-e2e", max_tokens=120, stream=True, **kw))
        assert status == 200
        names = [l[len("event: "):] for l in raw.splitlines() if l.startswith("event: ")]
        assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
        open_block = None
        n_blocks = 0
        for n in names[1:-2]:
            if n == "content_block_start":
                assert open_block is None
                open_block = n_blocks
                n_blocks += 1
            elif n == "content_block_delta":
                assert open_block is not None
            else:
                assert n == "content_block_stop" and open_block is not None
                open_block = None
        assert open_block is None and n_blocks == len(whole.content)
        assert "message_start" in types and "message_stop" in types


def test_messages_stop_sequences_and_max_tokens(ac):
    m = ac.messages.create(model="m3-e2e", max_tokens=60, messages=MATH, thinking={"type": "disabled"},
                           stop_sequences=["+"])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "+"
    assert "+" not in blocks(m, "text")[0].text
    m = ac.messages.create(model="m3-e2e", max_tokens=3, messages=MATH, thinking={"type": "disabled"})
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 3


def test_messages_errors_have_anthropics_shape(ac, demo):
    with pytest.raises(anthropic.BadRequestError) as e:
        ac.messages.create(model="m3-e2e", max_tokens=10, messages=[
            {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                        "data": "AAAA"}}]}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert "image" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        ac.messages.create(model="claude-nope", max_tokens=10, messages=MATH)
    status, body = http(demo, "POST", "/v1/messages", {"model": "m3-e2e", "messages": MATH})
    assert status == 400 and "max_tokens" in json.loads(body)["error"]["message"]
    status, body = http(demo, "POST", "/v1/messages", {"model": "m3-e2e", "max_tokens": 5,
                                                       "messages": [{"role": "system", "content": "x"}]})
    assert status == 400 and "system" in json.loads(body)["error"]["message"]


def test_messages_api_key_via_x_api_key(server):
    ok = anthropic.Anthropic(base_url=server.base, api_key=API_KEY, max_retries=0, timeout=120)
    m = ok.messages.create(model="m3-e2e", max_tokens=2, messages=MATH)
    assert m.usage.output_tokens <= 2 and m.type == "message"
    bad = anthropic.Anthropic(base_url=server.base, api_key="wrong", max_retries=0, timeout=120)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.create(model="m3-e2e", max_tokens=2, messages=MATH)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "authentication_error"


# ----------------------------------------------------------------------------- /v1/responses

def test_responses_reasoning_and_text(oc):
    r = oc.responses.create(model="m3-e2e", input="What is 23 + 19?", reasoning={"effort": "high"},
                            max_output_tokens=120, instructions="You are a helpful assistant.")
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert "42" in r.output[0].content[0].text and "42" in r.output_text
    assert r.status == "completed" and r.id.startswith("resp_") and r.model == "m3-e2e"
    assert r.usage.output_tokens_details.reasoning_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    off = oc.responses.create(model="m3-e2e", input="What is 23 + 19?", reasoning={"effort": "none"})
    assert [o.type for o in off.output] == ["message"]


def test_responses_function_call_then_output(oc):
    r = oc.responses.create(model="m3-e2e", input=TIMER, tools=R_TOOLS, reasoning={"effort": "none"})
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "set_timer"
    assert json.loads(calls[0].arguments) == {"minutes": 25, "label": "tea"}
    result = {"type": "function_call_output", "call_id": calls[0].call_id,
              "output": json.dumps({"ok": True, "minutes": 25})}
    # Continued by previous_response_id, and by sending the whole conversation: the same answer.
    by_id = oc.responses.create(model="m3-e2e", previous_response_id=r.id, input=[result], tools=R_TOOLS,
                                reasoning={"effort": "none"})
    whole = oc.responses.create(model="m3-e2e", tools=R_TOOLS, reasoning={"effort": "none"}, input=[
        {"role": "user", "content": TIMER}] + [o.model_dump(exclude_none=True) for o in r.output] + [result])
    assert "25" in by_id.output_text and by_id.output_text == whole.output_text
    assert by_id.previous_response_id == r.id


def test_responses_stream_equals_the_whole_response(oc, demo):
    for kw in (dict(input="What is 23 + 19?", reasoning={"effort": "high"}),
               dict(input=TIMER, tools=R_TOOLS, reasoning={"effort": "none"})):
        whole = oc.responses.create(model="m3-e2e", **kw)
        with oc.responses.stream(model="m3-e2e", **kw) as s:
            types = [e.type for e in s]
            final = s.get_final_response()
        strip = lambda items: [{k: v for k, v in o.model_dump(exclude_none=True).items()  # noqa: E731
                                if k not in ("id", "call_id")} for o in items]  # ids are fresh per request
        assert strip(final.output) == strip(whole.output)
        assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
        assert types.count("response.output_item.added") == types.count("response.output_item.done") == \
            len(whole.output)
        assert final.usage.output_tokens == whole.usage.output_tokens


def test_responses_store_limits_and_incomplete(oc):
    with pytest.raises(openai.NotFoundError) as e:
        oc.responses.create(model="m3-e2e", previous_response_id="resp_unknown", input="hi")
    assert e.value.body["param"] == "previous_response_id"
    kept = oc.responses.create(model="m3-e2e", input="What is 23 + 19?", reasoning={"effort": "none"})
    got = oc.responses.retrieve(kept.id)  # GET /v1/responses/{id}
    assert got.model_dump() == kept.model_dump()
    r = oc.responses.create(model="m3-e2e", input="What is 23 + 19?", store=False, reasoning={"effort": "none"})
    with pytest.raises(openai.NotFoundError):
        oc.responses.create(model="m3-e2e", previous_response_id=r.id, input="and 5 + 3?")
    with pytest.raises(openai.NotFoundError):
        oc.responses.retrieve(r.id)
    r = oc.responses.create(model="m3-e2e", input="What is 23 + 19?", max_output_tokens=3,
                            reasoning={"effort": "none"})
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        oc.responses.create(model="m3-e2e", input="hi", tools=[{"type": "web_search"}])
    assert e.value.body["param"] == "tools[0].type"
    for kw, param in ((dict(input=[{"type": "item_reference", "id": "x"}]), "input[0].type"),
                      (dict(input="hi", background=True, store=False), "background"),
                      (dict(input="hi", background=True, stream=True), "stream"),
                      (dict(input="hi", top_logprobs=2), "top_logprobs"),
                      (dict(input=[{"role": "tool", "content": "x"}]), "input[0].role")):
        with pytest.raises(openai.BadRequestError) as e:
            oc.responses.create(model="m3-e2e", **kw)
        assert e.value.body["param"] == param, kw


def wait_final(oc, rid, timeout=120):
    import time
    seen = []
    end = time.time() + timeout
    while time.time() < end:
        r = oc.responses.retrieve(rid)
        if not seen or seen[-1] != r.status:
            seen.append(r.status)
        if r.status not in ("queued", "in_progress"):
            return r, seen
        time.sleep(0.05)
    raise AssertionError(f"{rid} still {seen[-1]} after {timeout} s")


def test_responses_background_poll_cancel_delete(oc):
    sync = oc.responses.create(model="m3-e2e", input="What is 23 + 19?", reasoning={"effort": "none"})
    r = oc.responses.create(model="m3-e2e", input="What is 23 + 19?", reasoning={"effort": "none"},
                            background=True)
    assert r.status == "queued" and r.background is True and r.output == []
    final, seen = wait_final(oc, r.id)
    assert final.status == "completed" and final.output_text == sync.output_text, seen
    assert set(seen) <= {"queued", "in_progress", "completed"}
    assert final.usage.output_tokens == sync.usage.output_tokens
    # previous_response_id continues a background response like any stored one.
    nxt = oc.responses.create(model="m3-e2e", previous_response_id=r.id, input="And 5 + 3?",
                              reasoning={"effort": "none"})
    assert nxt.status == "completed"
    # Cancel a long one (a 3000-character string is required): it stops, and stays cancelled.
    long_fmt = {"format": {"type": "json_schema", "name": "s", "strict": True, "schema": {
        "type": "object", "properties": {"s": {"type": "string", "minLength": 3000}}, "required": ["s"]}}}
    big = oc.responses.create(model="m3-e2e", input="Write a long story.", reasoning={"effort": "none"},
                              text=long_fmt, max_output_tokens=8000, background=True)
    c = oc.responses.cancel(big.id)
    assert c.status == "cancelled" and c.id == big.id
    again, _ = wait_final(oc, big.id)
    assert again.status == "cancelled"
    assert oc.responses.cancel(big.id).status == "cancelled"  # idempotent
    with pytest.raises(openai.BadRequestError) as e:
        oc.responses.cancel(sync.id)  # not a background response
    assert e.value.body["param"] == "response_id"
    with pytest.raises(openai.NotFoundError):
        oc.responses.cancel("resp_unknown")
    # DELETE removes a stored response (a running one is stopped first).
    running = oc.responses.create(model="m3-e2e", input="Write a long story.", reasoning={"effort": "none"},
                                  text=long_fmt, max_output_tokens=8000, background=True)
    for rid in (sync.id, r.id, running.id):
        oc.responses.delete(rid)
        with pytest.raises(openai.NotFoundError):
            oc.responses.retrieve(rid)
        with pytest.raises(openai.NotFoundError):
            oc.responses.delete(rid)
    with pytest.raises(openai.NotFoundError):
        oc.responses.create(model="m3-e2e", previous_response_id=r.id, input="hi")


def test_responses_input_items(oc, demo):
    r = oc.responses.create(model="m3-e2e", input="What is 23 + 19?", reasoning={"effort": "none"})
    items = oc.responses.input_items.list(r.id)
    assert len(items.data) == 1 and items.data[0].type == "message" and items.data[0].role == "user"
    assert items.data[0].content[0].text == "What is 23 + 19?" and items.data[0].id
    conv = [{"role": "user", "content": TIMER},
            {"type": "function_call", "call_id": "c1", "name": "set_timer",
             "arguments": json.dumps({"minutes": 25, "label": "tea"})},
            {"type": "function_call_output", "call_id": "c1", "output": "ok"}]
    r2 = oc.responses.create(model="m3-e2e", input=conv, tools=R_TOOLS, reasoning={"effort": "none"})
    desc = oc.responses.input_items.list(r2.id)  # newest first, as OpenAI's default
    assert [i.type for i in desc.data] == ["function_call_output", "function_call", "message"]
    asc = oc.responses.input_items.list(r2.id, order="asc")
    assert [i.type for i in asc.data] == ["message", "function_call", "function_call_output"]
    assert asc.data[1].call_id == "c1" and asc.data[2].output == "ok"
    page = oc.responses.input_items.list(r2.id, order="asc", limit=1)
    assert len(page.data) == 1 and page.has_more
    rest = oc.responses.input_items.list(r2.id, order="asc", after=page.data[0].id)
    assert [i.type for i in rest.data] == ["function_call", "function_call_output"] and not rest.has_more
    all_ids = [i.id for i in oc.responses.input_items.list(r2.id, order="asc").data]  # paging is stable
    assert all_ids == [i.id for i in asc.data]
    status, text = http(demo, "GET", f"/v1/responses/{r2.id}/input_items?limit=0")
    assert status == 400 and json.loads(text)["error"]["param"] == "limit"
    with pytest.raises(openai.NotFoundError):
        oc.responses.input_items.list("resp_unknown")


def test_responses_json_schema_format(oc):
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
              "additionalProperties": False}
    r = oc.responses.create(model="m3-e2e", input="What is 23 + 19?", reasoning={"effort": "none"},
                            text={"format": {"type": "json_schema", "name": "a", "schema": schema, "strict": True}})
    assert isinstance(json.loads(r.output_text)["answer"], int)


def test_openai_agents_runs_a_turn_with_a_tool(demo):
    os.environ["OPENAI_AGENTS_DISABLE_TRACING"] = "1"
    from agents import Agent, Runner, function_tool, set_default_openai_client, set_tracing_disabled
    set_tracing_disabled(True)
    set_default_openai_client(openai.AsyncOpenAI(base_url=demo.base + "/v1", api_key="none", max_retries=0),
                              use_for_tracing=False)
    ran = []

    @function_tool
    def set_timer(minutes: int, label: str) -> str:
        """Set a timer.

        Args:
            minutes: Number of minutes
            label: What the timer is for
        """
        ran.append((minutes, label))
        return json.dumps({"ok": True, "minutes": minutes})

    agent = Agent(name="timer", instructions="You are a helpful assistant.", model="m3-e2e", tools=[set_timer])

    async def both():
        whole = await Runner.run(agent, TIMER)  # the default model: OpenAIResponsesModel
        assert ran == [(25, "tea")]
        streamed = Runner.run_streamed(agent, TIMER)
        async for _ in streamed.stream_events():
            pass
        return whole.final_output, streamed.final_output
    whole, streamed = asyncio.run(both())
    assert "25" in whole and streamed == whole and ran == [(25, "tea")] * 2


def test_langchain_openai_on_the_responses_api(demo):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def set_timer(minutes: int, label: str) -> str:
        """Set a timer for some minutes with a label."""
        return "ok"

    llm = ChatOpenAI(base_url=demo.base + "/v1", api_key="none", model="m3-e2e", use_responses_api=True,
                     max_retries=0, timeout=300)
    assert "42" in llm.invoke("What is 23 + 19?").text
    calls = llm.bind_tools([set_timer]).invoke(TIMER).tool_calls
    assert [(c["name"], c["args"]) for c in calls] == [("set_timer", {"minutes": 25, "label": "tea"})]
    streamed = "".join(ch.text for ch in llm.stream("What is 23 + 19?"))
    assert "42" in streamed


def test_shutdown_cancels_background_responses(binary):
    # A background response has no client to drain for: SIGTERM cancels it and the server exits
    # at once instead of generating thousands of tokens first.
    import time
    s = Server(binary, DEMO, [])
    try:
        oc = openai.OpenAI(base_url=s.base + "/v1", api_key="none", max_retries=0, timeout=60)
        fmt = {"format": {"type": "json_schema", "name": "s", "strict": True, "schema": {
            "type": "object", "properties": {"s": {"type": "string", "minLength": 20000}}, "required": ["s"]}}}
        r = oc.responses.create(model="m3-e2e", input="Write a long story.", reasoning={"effort": "none"},
                                text=fmt, max_output_tokens=12000, background=True)
        assert r.status == "queued"
        t0 = time.time()
        s.proc.send_signal(signal.SIGTERM)
        s.proc.wait(timeout=30)
        assert time.time() - t0 < 15 and s.proc.returncode == 0
    finally:
        s.stop()
