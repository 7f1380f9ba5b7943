"""Generated corpus of MiniMax-M3 outputs for the parser side-by-side check (tools/parity).

Each record is one model output (the text the model generated, as the chat template's
`to_xml` macro writes tool calls, see shared docs m3-model.md section 6.3) together with what a
correct parser must return for it: the reasoning, the content and the tool calls with their
arguments as JSON values. The output is built from those values, so the expectation is known by
construction, not taken from either parser.

Classes (`cls`):
  wf_*  well-formed outputs: every parameter type of the schemas below, nesting up to 128
        levels, several invokes, content and reasoning around them, whitespace layouts, values
        with XML-like text, quoting styles of the invoke name.
  q_*   the quirk classes of issue #14 item 6 (real MiniMax-M3 outputs and the rules vLLM breaks):
        the first parameter's opening tag left out, a dropped closing tag of a nested element,
        closing tags without the namespace token, openers without it, output cut inside the
        opener, an opener that is not a call, junk between invokes, a parameter that runs into
        raw markup, whitespace-only content beside calls, enum without a type, integer written
        5.0.
A record whose expectation follows from a rule the issue states has `strict: true`; the others
(truncated outputs, which parsers may close differently) are compared and reported but not
classified as right or wrong.

Deterministic: `generate(n, seed)` gives the same records for the same arguments.
"""

from __future__ import annotations

import json
import random
from typing import Any

NS = "]<]minimax[>["
TC_OPEN = NS + "<tool_call>"
TC_CLOSE = NS + "</tool_call>"

# The tool sets. Every JSON Schema shape the parsers convert: string, integer, number, boolean,
# enum with and without a type, nullable unions, anyOf, arrays of scalars and of objects, objects
# with properties, free objects, and a parameter the schema does not know.
TOOLS: dict[str, list[dict[str, Any]]] = {
    "weather": [
        {"type": "function", "function": {
            "name": "get_weather", "description": "Weather for a city",
            "parameters": {"type": "object", "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "detailed": {"type": "boolean"},
            }, "required": ["city"]}}},
        {"type": "function", "function": {
            "name": "get_time", "description": "Current time",
            "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}}},
    ],
    "typed": [
        {"type": "function", "function": {
            "name": "compute", "description": "All scalar types",
            "parameters": {"type": "object", "properties": {
                "label": {"type": "string"},
                "count": {"type": "integer"},
                "ratio": {"type": "number"},
                "enabled": {"type": "boolean"},
                "level": {"enum": [1, 2, 3]},
                "mode": {"enum": ["fast", "slow"]},
                "limit": {"type": ["integer", "null"]},
                "score": {"anyOf": [{"type": "number"}, {"type": "string"}]},
                "tags": {"type": "array", "items": {"type": "string"}},
                "weights": {"type": "array", "items": {"type": "number"}},
            }}}},
    ],
    "order": [
        {"type": "function", "function": {
            "name": "create_order", "description": "Nested objects and arrays",
            "parameters": {"type": "object", "properties": {
                "user_id": {"type": "integer"},
                "items": {"type": "array", "items": {"type": "object", "properties": {
                    "sku": {"type": "string"}, "qty": {"type": "integer"},
                    "price": {"type": "number"}}}},
                "shipping": {"type": "object", "properties": {
                    "city": {"type": "string"}, "zip": {"type": "string"},
                    "express": {"type": "boolean"},
                    "address": {"type": "object", "properties": {
                        "line1": {"type": "string"}, "floor": {"type": "integer"}}}}},
                "note": {"type": "string"},
                "meta": {"type": "object"},
            }}}},
    ],
    "agent": [
        {"type": "function", "function": {
            "name": "search", "description": "Search",
            "parameters": {"type": "object", "properties": {
                "query": {"type": "string"}, "limit": {"type": "integer"}}}}},
        {"type": "function", "function": {
            "name": "save_file", "description": "Save a file",
            "parameters": {"type": "object", "properties": {
                "filename": {"type": "string"}, "content": {"type": "string"}}}}},
        {"type": "function", "function": {
            "name": "run_shell", "description": "Run a command",
            "parameters": {"type": "object", "properties": {
                "command": {"type": "string"}, "timeout": {"type": "number"},
                "env": {"type": "object"}}}}},
    ],
    "deep": [
        {"type": "function", "function": {
            "name": "store_tree", "description": "A free-form nested value",
            "parameters": {"type": "object", "properties": {
                "name": {"type": "string"}, "tree": {"type": "object"}}}}},
    ],
}

WORDS = ["Oslo", "Rome", "a.docx", "MiniMax M3", "x < y && z > 1", "line1\nline2", "  padded  ",
         "quote \"q\" and 'a'", "naïve café 東京", "<b>bold</b>", "{\"json\": [1, 2]}", "1+1=2",
         "tab\there", "", "-", "C:\\path\\file", "100%", "a/b?c=d&e=f"]
CONTENT = ["", "", "I'll check that.", "Let me look.\n", "Sure! ", "Calling the tool now:\n\n",
           "Plan: search, then save.", "Ответ: ", "x<y and a&b"]
REASONING = ["The user wants the weather.", "Need to call a tool.\nStep 1: search.",
             "Think about <tags> & such", "多步推理", "short"]


def schema_of(tools: list[dict], name: str) -> dict:
    for t in tools:
        if t["function"]["name"] == name:
            return t["function"]["parameters"]
    return {}


# ---- the template's to_xml (what the model is trained to write) ------------------------------

def xml_value(value: Any, sep: str) -> str:
    """The body of one element for `value` (objects as NS<key> children, lists as NS<item>)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "".join(f"{sep}{NS}<{k}>{xml_value(v, sep)}{NS}</{k}>" for k, v in value.items()
                       if v is not None) + sep
    if isinstance(value, list):
        return "".join(f"{sep}{NS}<item>{xml_value(v, sep)}{NS}</item>" for v in value) + sep
    if value is None:
        return "null"
    return str(value)


def number_text(v: Any) -> str:
    return json.dumps(v) if not isinstance(v, str) else v


def invoke_xml(name: str, args: dict, sep: str = "", quote: str = '"',
               written: dict[str, str] | None = None) -> str:
    """One invoke; `written` overrides the text of a top-level value (e.g. 5 written `5.0`)."""
    q = quote
    head = f"{NS}<invoke name={q}{name}{q}>"
    body = ""
    for k, v in args.items():
        text = written[k] if written and k in written else xml_value(v, sep)
        body += f"{sep}{NS}<{k}>{text}{NS}</{k}>"
    return head + body + sep + f"{NS}</invoke>"


def block(invokes: list[str], nl: str = "\n") -> str:
    return TC_OPEN + nl + nl.join(invokes) + nl + TC_CLOSE


def reasoning_wrap(rng: random.Random, mode: str, reasoning: str, content: str) -> tuple[str, str]:
    """Output prefix for a thinking mode; returns (text, expected reasoning)."""
    if mode == "enabled":
        return reasoning + "</mm:think>" + content, reasoning
    if mode == "disabled":
        return content, ""
    # adaptive: the model writes a whole block or the bare closer.
    if reasoning and rng.random() < 0.7:
        return "<mm:think>" + reasoning + "</mm:think>" + content, reasoning
    return "</mm:think>" + content, ""


def call(name: str, args: dict) -> dict:
    return {"name": name, "arguments": args}


# ---- random argument values -----------------------------------------------------------------

def rand_args(rng: random.Random, tool: str) -> dict:
    if tool == "get_weather":
        a = {"city": rng.choice(WORDS[:10])}
        if rng.random() < 0.7:
            a["days"] = rng.randint(-3, 30)
        if rng.random() < 0.5:
            a["unit"] = rng.choice(["celsius", "fahrenheit"])
        if rng.random() < 0.5:
            a["detailed"] = rng.random() < 0.5
        return a
    if tool == "get_time":
        return {"tz": "UTC"} if rng.random() < 0.5 else {}
    if tool == "compute":
        a: dict[str, Any] = {}
        pool = {
            "label": lambda: rng.choice(WORDS),
            "count": lambda: rng.randint(-1000, 10**6),
            "ratio": lambda: rng.choice([0.5, -2.25, 1e-3, 3.0, 12345.678, 0.0]),
            "enabled": lambda: rng.random() < 0.5,
            "level": lambda: rng.choice([1, 2, 3]),
            "mode": lambda: rng.choice(["fast", "slow"]),
            "limit": lambda: rng.choice([None, 5, 0]),
            "score": lambda: rng.choice([1.5, 7]),
            "tags": lambda: [rng.choice(WORDS[:12]) for _ in range(rng.randint(1, 4))],
            "weights": lambda: [rng.choice([0.1, 2, -3.5]) for _ in range(rng.randint(1, 3))],
        }
        for k in rng.sample(list(pool), rng.randint(1, len(pool))):
            a[k] = pool[k]()
        return a
    if tool == "create_order":
        a = {"user_id": rng.randint(1, 99999)}
        if rng.random() < 0.8:
            a["items"] = [{"sku": f"sku-{rng.randint(1, 999)}", "qty": rng.randint(1, 9),
                           "price": rng.choice([9.99, 10, 0.5])}
                          for _ in range(rng.randint(1, 3))]
        if rng.random() < 0.7:
            s: dict[str, Any] = {"city": rng.choice(WORDS[:4]), "zip": "0" + str(rng.randint(100, 999))}
            if rng.random() < 0.5:
                s["express"] = rng.random() < 0.5
            if rng.random() < 0.5:
                s["address"] = {"line1": "Main St 1", "floor": rng.randint(0, 9)}
            a["shipping"] = s
        if rng.random() < 0.4:
            a["note"] = rng.choice(WORDS)
        return a
    if tool == "search":
        a = {"query": rng.choice(WORDS[:12])}
        if rng.random() < 0.6:
            a["limit"] = rng.randint(1, 50)
        return a
    if tool == "save_file":
        return {"filename": rng.choice(["offerta.docx", "a.txt", "notes.md"]),
                "content": rng.choice(WORDS[:12])}
    if tool == "run_shell":
        a = {"command": rng.choice(["ls -la", "echo '<x>' && cat f", "grep -n \"a\" b"])}
        if rng.random() < 0.5:
            a["timeout"] = rng.choice([1.5, 30.0, 0.25])
        return a
    raise ValueError(tool)


TOOLSET_OF = {"get_weather": "weather", "get_time": "weather", "compute": "typed",
              "create_order": "order", "search": "agent", "save_file": "agent",
              "run_shell": "agent", "store_tree": "deep"}


def nested(depth: int, leaf: str) -> Any:
    v: Any = leaf
    for i in range(depth):
        v = {f"n{depth - i}": v}
    return v


# ---- record builders --------------------------------------------------------------------------

def rec(cls: str, toolset: str, mode: str, text: str, reasoning: str, content: str | None,
        calls: list[dict], strict: bool = True, finish: str = "stop") -> dict:
    return {"cls": cls, "toolset": toolset, "tools": TOOLS[toolset], "thinking_mode": mode,
            "text": text, "finish_reason": finish, "strict": strict,
            "expected": {"reasoning": reasoning, "content": content, "tool_calls": calls}}


def content_or_null(content: str, calls: list) -> str | None:
    """What a correct parser returns as content: null when empty or whitespace beside calls."""
    if calls and not content.strip():
        return None
    return content


def wf_calls(rng: random.Random, cls: str) -> dict:
    mode = rng.choice(["adaptive", "enabled", "disabled"])
    toolset = rng.choice(["weather", "typed", "order", "agent"])
    names = [t["function"]["name"] for t in TOOLS[toolset]]
    n = 1 if cls == "wf_single" else rng.randint(2, 4)
    calls, invokes = [], []
    sep = "" if cls != "wf_ws_layout" else rng.choice(["\n", "\n  ", " "])
    for _ in range(n):
        name = rng.choice(names)
        args = rand_args(rng, name)
        # `None` values are skipped by the template (except a nullable one written "null").
        written = {}
        for k, v in list(args.items()):
            if v is None:
                written[k] = "null"
            elif isinstance(v, float) and cls == "wf_ws_layout":
                written[k] = f"\n{number_text(v)}\n"
        quote = rng.choice(['"', "'", ""]) if cls == "wf_quotes" else '"'
        invokes.append(invoke_xml(name, args, sep, quote, written))
        calls.append(call(name, args))
    nl = "\n" if cls != "wf_ws_layout" else rng.choice(["\n", "", "\n\n", " \n"])
    content = rng.choice(CONTENT)
    reasoning = rng.choice(REASONING)
    text, exp_reasoning = reasoning_wrap(rng, mode, reasoning, content + block(invokes, nl))
    return rec(cls, toolset, mode, text, exp_reasoning, content_or_null(content, calls), calls)


def wf_no_call(rng: random.Random) -> dict:
    mode = rng.choice(["adaptive", "enabled", "disabled"])
    content = rng.choice(["The weather in Oslo is mild.", "a < b > c & d", "Use <invoke> tags",
                          "Hello!\n\nBye.", "<tool>not a call</tool>", "多语言 text 🚀"])
    reasoning = rng.choice(REASONING)
    text, exp_r = reasoning_wrap(rng, mode, reasoning, content)
    return rec("wf_no_call", "weather", mode, text, exp_r, content, [])


def wf_deep(rng: random.Random) -> dict:
    depth = rng.choice([1, 2, 5, 16, 64, 100, 127])  # + the parameter element = depth + 1 levels
    args = {"name": "t", "tree": nested(depth, "leaf")}
    text = "</mm:think>" + block([invoke_xml("store_tree", args)])
    return rec("wf_deep_nesting", "deep", "adaptive", text, "", None, [call("store_tree", args)])


def wf_unknown_param(rng: random.Random) -> dict:
    # A parameter the schema does not list stays a string; repeated children become a list.
    args = {"city": "Oslo", "extra": "42"}
    text = "</mm:think>" + block([invoke_xml("get_weather", args)])
    return rec("wf_unknown_param", "weather", "adaptive", text, "", None, [call("get_weather", args)])


def q_enum_untyped(rng: random.Random) -> dict:
    lv = rng.choice([1, 2, 3])
    args = {"level": lv, "mode": rng.choice(["fast", "slow"])}
    text = "</mm:think>" + block([invoke_xml("compute", args)])
    return rec("q_enum_without_type", "typed", "adaptive", text, "", None, [call("compute", args)])


def q_int_written_float(rng: random.Random) -> dict:
    v = rng.randint(0, 99)
    args = {"count": float(v)}
    text = "</mm:think>" + block([invoke_xml("compute", {"count": v}, written={"count": f"{v}.0"})])
    return rec("q_integer_written_5.0", "typed", "adaptive", text, "", None, [call("compute", args)])


def q_first_open_left_out(rng: random.Random) -> dict:
    fn = rng.choice(["offerta.docx", "a.txt"])
    body = rng.choice(["Ciao", "x < y"])
    with_ns = rng.random() < 0.5
    first = (NS if with_ns else "") + fn + f"{NS}</filename>"
    text = (TC_OPEN + "\n" + f'{NS}<invoke name="save_file">' + first +
            f"{NS}<content>{body}{NS}</content>{NS}</invoke>\n" + TC_CLOSE)
    return rec("q_first_param_open_tag_left_out", "agent", "disabled", text, "", None,
               [call("save_file", {"filename": fn, "content": body})])


def q_close_without_ns(rng: random.Random) -> dict:
    q = rng.choice(["MiniMax M3 serving", "q"])
    lim = rng.randint(1, 9)
    text = (TC_OPEN + "\n" + f'{NS}<invoke name="search">{NS}<query>{q}</query>'
            f"{NS}<limit>{lim}</limit>{NS}</invoke>\n" + TC_CLOSE)
    return rec("q_close_tags_without_namespace", "agent", "disabled", text, "", None,
               [call("search", {"query": q, "limit": lim})])


def q_opener_without_ns(rng: random.Random) -> dict:
    city = rng.choice(["Oslo", "Rome"])
    pre = rng.choice(["Checking.\n", ""])
    inv = f'{NS}<invoke name="get_weather">{NS}<city>{city}{NS}</city>{NS}</invoke>'
    if rng.random() < 0.5:
        text = pre + "<tool_call>\n" + inv + "\n" + TC_CLOSE
        sub = "q_tool_call_opener_without_namespace"
    else:
        text = pre + inv
        sub = "q_invoke_opener_without_block"
    return rec(sub, "weather", "disabled", text, "", content_or_null(pre, [1]),
               [call("get_weather", {"city": city})])


def q_cut_in_opener(rng: random.Random) -> dict:
    pre = rng.choice(["Let me check.", "Ok "])
    tail = rng.choice([TC_OPEN + "\n", TC_OPEN + "\n" + NS + "<inv", NS + '<invoke name="get_wea',
                       NS + "<tool_", TC_OPEN])
    return rec("q_output_cut_inside_opener", "weather", "disabled", pre + tail, "", pre, [],
               finish="length")


def q_opener_not_a_call(rng: random.Random) -> dict:
    opener = rng.choice([TC_OPEN, "<tool_call>"])
    after = rng.choice([" and then text", " tags are used for calls.", "\nplain words"])
    text = "See " + opener + after
    return rec("q_opener_not_a_call", "weather", "disabled", text, "", text, [])


def q_junk_between(rng: random.Random) -> dict:
    junk = rng.choice(["\nand the next one:", f"{NS}</city>\n", "\nstray text\n", f"{NS}\n"])
    a, b = rng.choice(["A", "Oslo"]), rng.choice(["B", "Rome"])
    inv1 = invoke_xml("get_weather", {"city": a})
    inv2 = invoke_xml("get_weather", {"city": b})
    text = TC_OPEN + "\n" + inv1 + junk + "\n" + inv2 + "\n" + TC_CLOSE
    return rec("q_junk_between_invokes", "weather", "disabled", text, "", None,
               [call("get_weather", {"city": a}), call("get_weather", {"city": b})])


def q_runs_into_markup(rng: random.Random) -> dict:
    # The closing tag of the first parameter is dropped: the value must not keep the markup.
    city = rng.choice(["Oslo", "Rome"])
    d = rng.randint(1, 9)
    text = (TC_OPEN + f'{NS}<invoke name="get_weather">{NS}<city>{city}'
            f"{NS}<days>{d}{NS}</days>{NS}</invoke>" + TC_CLOSE)
    return rec("q_param_runs_into_markup", "weather", "disabled", text, "", None,
               [call("get_weather", {"city": city, "days": d})])


def q_nested_close_dropped(rng: random.Random) -> dict:
    city, z = rng.choice(["Oslo", "Rome"]), "0" + str(rng.randint(100, 999))
    uid = rng.randint(1, 99)
    text = (TC_OPEN + f'{NS}<invoke name="create_order">{NS}<shipping>{NS}<city>{city}'
            f"{NS}<zip>{z}{NS}</zip>{NS}</shipping>{NS}<user_id>{uid}{NS}</user_id>{NS}</invoke>"
            + TC_CLOSE)
    return rec("q_nested_close_dropped", "order", "disabled", text, "", None,
               [call("create_order", {"shipping": {"city": city, "zip": z}, "user_id": uid})])


def q_whitespace_content(rng: random.Random) -> dict:
    ws = rng.choice(["\n", "\n\n", "  ", " \n "])
    inv = invoke_xml("get_time", {})
    text = "</mm:think>" + ws + block([inv])
    return rec("q_whitespace_only_content", "weather", "adaptive", text, "", None,
               [call("get_time", {})])


def wf_reasoning_cut(rng: random.Random) -> dict:
    # enabled: the output starts inside reasoning; cut (max_tokens) before the closer.
    r = rng.choice(REASONING)
    return rec("wf_reasoning_without_closer", "weather", "enabled", r, r, None, [],
               finish="length")


def wf_markup_in_reasoning(rng: random.Random) -> dict:
    # Tool markup inside reasoning is reasoning text, never a call.
    inner = block([invoke_xml("get_weather", {"city": "Oslo"})])
    answer = rng.choice(["It is sunny.", "Done."])
    text = "<mm:think>I might write " + inner + " later.</mm:think>" + answer
    return rec("wf_tool_markup_in_reasoning", "weather", "adaptive", text,
               "I might write " + inner + " later.", answer, [])


def q_mixed(rng: random.Random) -> dict:
    # Several quirks at once, as real outputs have them: per parameter its closing tag without NS,
    # its opening tag left out, or its closing tag dropped (the value runs into the next tag);
    # per call the invoke closer without NS; the block opener without NS.
    toolset = rng.choice(["weather", "agent"])
    names = {"weather": ["get_weather"], "agent": ["search", "save_file"]}[toolset]
    simple = ["Oslo", "Rome", "report.pdf", "MiniMax M3", "a b c", "x-1"]
    invokes, calls = [], []
    for _ in range(rng.randint(1, 3)):
        name = rng.choice(names)
        props = schema_of(TOOLS[toolset], name)["properties"]
        usable = [k for k, p in props.items() if p.get("type") in ("integer", "string")
                  and "enum" not in p]
        keys = [k for k in usable if rng.random() < 0.8] or usable[:1]
        args: dict[str, Any] = {k: rng.randint(1, 40) if props[k]["type"] == "integer"
                                else rng.choice(simple) for k in keys}
        body, last_q = "", "ok"
        for k, v in args.items():
            val = xml_value(v, "")
            prev_q = last_q
            last_q = rng.choice(["ok", "ok", "bare_close", "no_open", "no_close"])
            # Text with no tag before it after a value without its closing tag (or after a bare
            # one) would join that value: no parser can split them.
            if last_q == "no_open" and prev_q in ("no_close", "bare_close"):
                last_q = "ok"
            if last_q == "bare_close":
                body += f"{NS}<{k}>{val}</{k}>"
            elif last_q == "no_open":
                body += f"{NS}{val}{NS}</{k}>" if rng.random() < 0.5 else f"{val}{NS}</{k}>"
            elif last_q == "no_close":
                body += f"{NS}<{k}>{val}"
            else:
                body += f"{NS}<{k}>{val}{NS}</{k}>"
        # A value that runs into a bare </invoke> would be ambiguous: keep NS there.
        closer = "</invoke>" if last_q != "no_close" and rng.random() < 0.3 else f"{NS}</invoke>"
        invokes.append(f'{NS}<invoke name="{name}">' + body + closer)
        calls.append(call(name, args))
    opener = TC_OPEN if rng.random() < 0.7 else "<tool_call>"
    text = opener + "\n" + "\n".join(invokes) + "\n" + TC_CLOSE
    return rec("q_mixed_quirks", toolset, "disabled", text, "", None, calls)


def q_truncated(rng: random.Random) -> dict:
    # Cut (max_tokens) inside a call: parsers may close it differently; reported, not judged.
    full = block([invoke_xml("search", {"query": "MiniMax", "limit": 5})])
    cut = rng.randint(len(TC_OPEN) + 20, len(full) - 1)
    return rec("q_truncated_inside_call", "agent", "disabled", full[:cut], "", None, [],
               strict=False, finish="length")


BUILDERS = [
    (lambda r: wf_calls(r, "wf_single"), 14),
    (lambda r: wf_calls(r, "wf_multi"), 10),
    (lambda r: wf_calls(r, "wf_ws_layout"), 6),
    (lambda r: wf_calls(r, "wf_quotes"), 4),
    (wf_no_call, 5),
    (wf_deep, 4),
    (wf_unknown_param, 1),
    (q_enum_untyped, 3),
    (q_int_written_float, 3),
    (q_first_open_left_out, 4),
    (q_close_without_ns, 4),
    (q_opener_without_ns, 4),
    (q_cut_in_opener, 4),
    (q_opener_not_a_call, 3),
    (q_junk_between, 4),
    (q_runs_into_markup, 3),
    (q_nested_close_dropped, 3),
    (q_whitespace_content, 3),
    (q_truncated, 3),
    (wf_reasoning_cut, 2),
    (wf_markup_in_reasoning, 2),
    (q_mixed, 8),
]


def generate(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    fns = [f for f, _ in BUILDERS]
    weights = [w for _, w in BUILDERS]
    out = []
    # Every class at least once, then by weight.
    for i in range(n):
        f = fns[i] if i < len(fns) else rng.choices(fns, weights)[0]
        r = f(rng)
        r["id"] = i
        out.append(r)
    return out


def char_splits(rng: random.Random, text: str, k: int) -> list[list[int]]:
    """k random chunkings of text as rising UTF-8 byte offsets at character boundaries."""
    bounds, pos = [], 0
    for ch in text:
        pos += len(ch.encode("utf-8"))
        bounds.append(pos)
    out = []
    for j in range(k):
        if not bounds:
            out.append([])
            continue
        if j == 0:
            cuts = bounds[:-1]  # one character per piece
        else:
            cuts = sorted(rng.sample(bounds[:-1], min(len(bounds) - 1, rng.randint(1, 12))))
        out.append(cuts)
    return out
