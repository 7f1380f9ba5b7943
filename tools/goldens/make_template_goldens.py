#!/usr/bin/env python3
"""Make the chat-template goldens for tests/unit/text/jinja (m3serve's C++ Jinja renderer).

Renders with Python jinja2 through transformers' own code, exactly as
`tokenizer.apply_chat_template(..., tokenize=False)` does:
  * the environment is transformers.utils.chat_template_utils._compile_jinja_template
    (ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks, loopcontrols, transformers' tojson,
    raise_exception, strftime_now, namespace, dict);
  * chat cases go through _normalize_chat_messages (drops None-valued keys) and
    render_jinja_template (reasoning-field aliasing, tools, documents=None), with the special
    tokens of the model's tokenizer_config.json as template variables, overridden by kwargs
    (template_kwargs = {**special_tokens_map, **kwargs}, as apply_chat_template does).

Usage:  python3 tools/goldens/make_template_goldens.py   (from the repo root; needs
        `pip install transformers jinja2`; torch is not needed)
Writes: tests/golden/text/templates/goldens.json
The Qwen3 cases read the real template from /work/shared/fixtures/qwen3-tokenizer (not copied
into the repo); the C++ test reads it from the same place and skips those cases when absent.
"""
import copy
import json
import os
import sys
import traceback

import jinja2
import transformers
from transformers.utils.chat_template_utils import (
    _compile_jinja_template,
    _normalize_chat_messages,
    render_jinja_template,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TPL_DIR = os.path.join(ROOT, "tests", "golden", "text", "templates")
QWEN3_DIR = os.environ.get("M3_QWEN3_FIXTURE", "/work/shared/fixtures/qwen3-tokenizer")
SPECIAL_TOKEN_KEYS = ["bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"]


def special_tokens_of(tokenizer_config):
    """transformers' special_tokens_map: the named tokens that are set, as strings."""
    out = {}
    for key in SPECIAL_TOKEN_KEYS:
        value = tokenizer_config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if value is not None:
            out[key] = str(value)
    return out


def vllm_parse_arguments(messages):
    """vLLM (chat_utils._postprocess_messages) parses assistant tool_call arguments given as JSON
    strings into dicts before rendering, and turns empty/None arguments into {}; the C++
    ChatTemplate::render does the same, so every chat case goes through it here too."""
    messages = copy.deepcopy(messages)
    for m in messages:
        if m.get("role") != "assistant" or not isinstance(m.get("tool_calls"), list):
            continue
        for call in m["tool_calls"]:
            fn = call.get("function", {})
            args = fn.get("arguments")
            if args:
                if not isinstance(args, (dict, list)):
                    fn["arguments"] = json.loads(args)
            else:
                fn["arguments"] = {}
    return messages


def render_chat(template, special_tokens, messages, tools, add_generation_prompt, kwargs):
    conversations = [_normalize_chat_messages(copy.deepcopy(messages))]
    template_kwargs = {**special_tokens, **kwargs}
    rendered, _ = render_jinja_template(
        conversations=conversations,
        tools=copy.deepcopy(tools),
        documents=None,
        chat_template=template,
        add_generation_prompt=add_generation_prompt,
        **template_kwargs,
    )
    return rendered[0]


def error_line(exc):
    if getattr(exc, "lineno", None):
        return exc.lineno
    line = None
    for frame in traceback.extract_tb(exc.__traceback__):
        if frame.filename == "<template>":
            line = frame.lineno
    return line


# ---- Chat conversations -------------------------------------------------------------------------

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city. Unicode: température °C",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer"},
            },
            "required": ["city"],
        },
    },
}
CALENDAR_TOOL = {
    "type": "function",
    "function": {
        "name": "create_events",
        "description": "Create calendar events",
        "parameters": {
            "type": "object",
            "properties": {
                "events": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {"title": {"type": "string"}, "minutes": {"type": "number"}},
                    },
                },
                "notify": {"type": "boolean"},
                "meta": {"type": "object"},
            },
        },
    },
}

SIMPLE = [{"role": "user", "content": "Hello! What can you do?"}]
WITH_SYSTEM = [
    {"role": "system", "content": "You are a terse assistant.\nAnswer in one line."},
    {"role": "user", "content": "Say hi."},
]
MULTI_TURN_REASONING = [
    {"role": "system", "content": "Be precise."},
    {"role": "user", "content": "What is 17 * 23?"},
    {"role": "assistant", "content": "17 * 23 = 391.", "reasoning_content": "17*20=340, 17*3=51, 340+51=391."},
    {"role": "user", "content": "And divided by 2?"},
    {"role": "assistant", "content": "195.5", "reasoning_content": None},
    {"role": "user", "content": "Thanks <b>&</b> bye"},
]
INLINE_THINK = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "<mm:think>\nThe user greets me.\n</mm:think>\n\nHello there!"},
    {"role": "user", "content": "Again"},
]
TOOL_FLOW = [
    {"role": "system", "content": "Use tools when useful."},
    {"role": "user", "content": "Weather in Paris and Tokyo for 3 days, then book a review."},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "Two cities, call the tool twice.",
        "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3, "unit": None}}},
            {"id": "call_2", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Tokyo", "days": 3, "unit": "celsius"}}},
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "Paris: 18C, cloudy"},
    {"role": "tool", "tool_call_id": "call_2", "content": "Tokyo: 24C, <sunny> & humid"},
    {
        "role": "assistant",
        "content": "Booking it now.",
        "tool_calls": [
            {"id": "call_3", "type": "function",
             "function": {"name": "create_events", "arguments": {
                 "events": [{"title": "Review", "minutes": 45.5, "tags": ["a", None, "b"]},
                            {"title": "Standup", "minutes": 15, "remote": True}],
                 "notify": False,
                 "meta": {"owner": {"name": "Ana", "id": 7}, "note": "line1\nline2 <x>"},
                 "skip": None,
                 "ratio": 1.0,
                 "big": 1e20,
             }}},
        ],
    },
    {"role": "tool", "tool_call_id": "call_3", "content": "{\"ok\": true}"},
]
STRING_ARGS = [
    {"role": "user", "content": "Weather?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\": \"Zürich\", \"days\": 2}"}}]},
    {"role": "tool", "content": "cold"},
]
ROOT_IDENTITY = [
    {"role": "root", "content": "You are Mimi, a custom deployment."},
    {"role": "developer", "content": "Developer instructions here."},
    {"role": "user", "content": [{"type": "text", "text": "Describe "}, {"type": "image_url", "image_url": {"url": "x"}},
                                 {"type": "text", "text": " and "}, {"type": "video"}]},
]
LATE_SYSTEM = [
    {"role": "user", "content": "a"},
    {"role": "assistant", "content": "b"},
    {"role": "system", "content": "Late system note."},
    {"role": "user", "content": "c"},
]
BAD_ROLE = [{"role": "narrator", "content": "x"}]

M3_SPECIAL = {"bos_token": "]~b]", "eos_token": "[e~[", "unk_token": "]!d~["}


def chat_cases():
    cases = []

    def add(name, template_id, messages, tools=None, add_generation_prompt=True, kwargs=None,
            special=None):
        cases.append(dict(name=name, template=template_id, messages=messages, tools=tools,
                          add_generation_prompt=add_generation_prompt, kwargs=kwargs or {},
                          special_tokens=special or {}))

    # Built-in MiniMax-M3 template.
    m3 = "minimax_m3"
    add("m3_simple_adaptive", m3, SIMPLE, special=M3_SPECIAL)
    add("m3_simple_enabled", m3, SIMPLE, kwargs={"thinking_mode": "enabled"}, special=M3_SPECIAL)
    add("m3_simple_disabled", m3, SIMPLE, kwargs={"thinking_mode": "disabled"}, special=M3_SPECIAL)
    add("m3_enable_thinking_true", m3, SIMPLE, kwargs={"enable_thinking": True}, special=M3_SPECIAL)
    add("m3_enable_thinking_false", m3, SIMPLE, kwargs={"enable_thinking": False}, special=M3_SPECIAL)
    add("m3_no_generation_prompt", m3, WITH_SYSTEM, add_generation_prompt=False, special=M3_SPECIAL)
    add("m3_system", m3, WITH_SYSTEM, special=M3_SPECIAL)
    add("m3_multi_turn_reasoning", m3, MULTI_TURN_REASONING, kwargs={"thinking_mode": "enabled"}, special=M3_SPECIAL)
    add("m3_inline_think", m3, INLINE_THINK, special=M3_SPECIAL)
    add("m3_tools_flow", m3, TOOL_FLOW, tools=[WEATHER_TOOL, CALENDAR_TOOL], special=M3_SPECIAL)
    add("m3_tools_flow_no_prompt", m3, TOOL_FLOW, tools=[WEATHER_TOOL, CALENDAR_TOOL], add_generation_prompt=False,
        kwargs={"thinking_mode": "disabled"}, special=M3_SPECIAL)
    add("m3_tools_only_in_system", m3, SIMPLE, tools=[WEATHER_TOOL], special=M3_SPECIAL)
    add("m3_string_arguments", m3, STRING_ARGS, tools=[WEATHER_TOOL], special=M3_SPECIAL)
    add("m3_root_identity_multimodal", m3, ROOT_IDENTITY, special=M3_SPECIAL)
    add("m3_late_system", m3, LATE_SYSTEM, special=M3_SPECIAL)
    add("m3_bad_role", m3, BAD_ROLE, special=M3_SPECIAL)
    add("m3_bad_mode", m3, SIMPLE, kwargs={"thinking_mode": "sometimes"}, special=M3_SPECIAL)

    # MiniMax-M2-style template (ours).
    m2 = "minimax_m2_style"
    add("m2_simple", m2, SIMPLE, special=M3_SPECIAL)
    add("m2_tools_flow", m2, TOOL_FLOW, tools=[WEATHER_TOOL, CALENDAR_TOOL], special=M3_SPECIAL)
    add("m2_multi_turn", m2, MULTI_TURN_REASONING, add_generation_prompt=False, special=M3_SPECIAL)
    add("m2_late_system_error", m2, LATE_SYSTEM, special=M3_SPECIAL)

    # Qwen3's real template (read from the fixture).
    q = "qwen3"
    add("qwen3_simple", q, SIMPLE)
    add("qwen3_system_no_think", q, WITH_SYSTEM, kwargs={"enable_thinking": False})
    add("qwen3_multi_turn_reasoning", q, MULTI_TURN_REASONING)
    add("qwen3_inline_think", q, [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>\nGreeting.\n</think>\n\nHello!"},
    ], add_generation_prompt=False)
    add("qwen3_tools_flow", q, TOOL_FLOW, tools=[WEATHER_TOOL, CALENDAR_TOOL])
    add("qwen3_string_arguments", q, STRING_ARGS, tools=[WEATHER_TOOL])
    add("qwen3_string_arguments_with_content", q, [dict(m, content=m["content"] or "") for m in STRING_ARGS],
        tools=[WEATHER_TOOL])
    add("qwen3_tool_response_multi_step", q, [
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "rain"},
        {"role": "assistant", "content": "It rains.", "reasoning_content": "Tool said rain."},
    ], add_generation_prompt=False)
    return cases


# ---- Feature templates (one Jinja feature each) -------------------------------------------------

FEATURES = [
    ("print_types", "{{ 1 }}|{{ 1.0 }}|{{ 2.5e-7 }}|{{ 1e16 }}|{{ 123456789.125 }}|{{ true }}|{{ none }}|{{ 'x' }}|{{ [1, 'a', none, true, 1.5] }}|{{ {'k': [1, (2, 3)], 'q': \"it's\"} }}|{{ (1,) }}", {}),
    ("print_vars", "{{ s }}|{{ i }}|{{ f }}|{{ b }}|{{ n }}|{{ l }}|{{ d }}|{{ missing }}|", {"s": "héllo", "i": -3, "f": 0.1, "b": False, "n": None, "l": [1, "two", None], "d": {"a": 1, "b": [True]}}),
    ("comments", "a{# comment #}b\n{# line comment #}\nc {#- trimmed -#} d", {}),
    ("whitespace_control", "x  {{- 'y' -}}  z\n  {%- if true %}  A  {% endif -%}\n  B", {}),
    ("trim_lstrip_blocks", "<ul>\n  {% for i in [1, 2] %}\n    <li>{{ i }}</li>\n  {% endfor %}\n</ul>\n", {}),
    ("lstrip_plus", "  {%+ if true %}kept{% endif %}\n  {% if true +%}\nnext{% endif %}", {}),
    ("trailing_newline", "line\n\n", {}),
    ("crlf_source", "a\r\nb {% if true %}\r\nc{% endif %}\r\n", {}),
    ("raw_block", "{% raw %}{{ not parsed }} {% if %}{% endraw %}|  {%- raw -%}  x  {%- endraw %}", {}),
    ("if_elif_else", "{% for v in [0, 1, 2, 3] %}{% if v == 0 %}zero{% elif v == 1 %}one{% elif v is even %}even{% else %}odd{% endif %},{% endfor %}", {}),
    ("for_loop_vars", "{% for x in 'abc' %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}{{ loop.revindex0 }}{{ loop.first }}{{ loop.last }}{{ loop.length }}[{{ loop.previtem }}|{{ loop.nextitem }}]{{ loop.cycle('o', 'e') }};{% endfor %}", {}),
    ("for_else", "{% for x in [] %}x{% else %}empty{% endfor %}|{% for x in [1] %}{{ x }}{% else %}no{% endfor %}", {}),
    ("for_filter", "{% for x in range(10) if x is odd %}{{ x }}{{ ',' if not loop.last }}{% endfor %}", {}),
    ("for_unpack_dict", "{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}{% for k in d %}{{ k }}{% endfor %}", {"d": {"z": 1, "a": [2], "m": None}}),
    ("for_nested_loop", "{% for a in [1, 2] %}{% set outer = loop %}{% for b in [3, 4] %}{{ outer.index }}{{ loop.index }} {% endfor %}{% endfor %}", {}),
    ("loopcontrols", "{% for i in range(10) %}{% if i == 2 %}{% continue %}{% endif %}{% if i > 5 %}{% break %}{% endif %}{{ i }}{% endfor %}", {}),
    ("set_scoping", "{% set x = 1 %}{% for i in [1, 2] %}{{ x }}{% set x = i * 10 %}{{ x }} {% endfor %}{{ x }}{% if true %}{% set y = 5 %}{% endif %}{{ y }}", {}),
    ("set_tuple", "{% set a, b = [1, 2] %}{{ a }}{{ b }}{% set c, d = 'xy' %}{{ d }}{{ c }}", {}),
    ("set_block", "{% set block %}  Hello {{ name }}!  {% endset %}[{{ block }}]{% set up | upper | trim %} shout {% endset %}[{{ up }}]", {"name": "Bob"}),
    ("namespace", "{% set ns = namespace(count=0, names=[]) %}{% for m in ms %}{% if m.role == 'user' %}{% set ns.count = ns.count + 1 %}{% set ns.last = m.content %}{% endif %}{% endfor %}{{ ns.count }} {{ ns.last }} {{ ns.names }}", {"ms": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]}),
    ("macro_defaults", "{% macro greet(name, greeting='Hello', punct='!') %}{{ greeting }}, {{ name }}{{ punct }}{% endmacro %}{{ greet('Ann') }} {{ greet('Bo', 'Hi') }} {{ greet('Cy', punct='?') }} {{ greet(name='Di', greeting='Yo') }}", {}),
    ("macro_recursive", "{% macro walk(v) %}{% if v is mapping %}{% for k, x in v.items() %}<{{ k }}>{{ walk(x) }}</{{ k }}>{% endfor %}{% elif v is iterable and v is not string %}{% for x in v %}[{{ walk(x) }}]{% endfor %}{% else %}{{ v }}{% endif %}{% endmacro %}{{ walk(d) }}", {"d": {"a": {"b": [1, 2.0, {"c": None}]}, "s": "t"}}),
    ("macro_scope", "{% set z = 1 %}{% macro m() %}{{ z }}{% endmacro %}{% set z = 3 %}{{ m() }}{% for i in [7] %}{% set z = 8 %}{{ m() }}{% endfor %}", {}),
    ("call_block", "{% macro box(title) %}[{{ title }}: {{ caller() }}]{% endmacro %}{% call box('T') %}inside {{ 1 + 1 }}{% endcall %}", {}),
    ("filter_block", "{% filter upper %}shout {{ 'this' }}{% endfilter %}", {}),
    ("with_block", "{% with a = 1, b = 'x' %}{{ a }}{{ b }}{% endwith %}[{{ a }}]", {}),
    ("generation_tag", "{% for m in ms %}{% generation %}{{ m }}{% endgeneration %}{% endfor %}", {"ms": ["a", "b"]}),
    ("arithmetic", "{{ 7 + 3 }} {{ 7 - 10 }} {{ 7 * 3 }} {{ 7 / 2 }} {{ 8 / 2 }} {{ 7 // 2 }} {{ -7 // 2 }} {{ 7 % 3 }} {{ -7 % 3 }} {{ 7.5 % 2 }} {{ 2 ** 10 }} {{ 2 ** -1 }} {{ 1 + 2.0 }} {{ 0.1 + 0.2 }} {{ -(3) }} {{ +4 }} {{ 10 - 2 - 3 }} {{ 2 * 3 + 4 * 5 }} {{ 2 ** 3 ** 2 }} {{ true + 1 }}", {}),
    ("string_ops", "{{ 'a' + 'b' }} {{ 'ab' * 3 }} {{ 3 * 'x' }} {{ [1] * 2 }} {{ [1] + [2] }} {{ 'n=' ~ 5 ~ none ~ true }} {{ 'x' ~ missing ~ 'y' }} {{ '%s-%d' % ('a', 3) }} {{ '%.2f' % 3.14159 }}", {}),
    ("comparisons", "{{ 1 == 1.0 }} {{ 1 != 2 }} {{ 1 < 2 < 3 }} {{ 3 > 2 > 2 }} {{ 'a' < 'b' }} {{ [1, 2] < [1, 3] }} {{ 2 >= 2 }} {{ 1 <= 0 }} {{ none == none }} {{ 'a' == 'a' }} {{ true == 1 }} {{ [1] == [1] }} {{ {'a': 1} == {'a': 1} }}", {}),
    ("logic", "{{ true and false }} {{ true or false }} {{ not true }} {{ 0 or 'x' }} {{ '' and 'y' }} {{ none or [] or 'z' }} {{ not [] }} {{ 1 and 2 }}", {}),
    ("membership", "{{ 'a' in 'cat' }} {{ 'z' not in 'cat' }} {{ 2 in [1, 2] }} {{ 'k' in {'k': 1} }} {{ 3 not in [1] }} {{ 'x' in missing }}", {}),
    ("ternary", "{{ 'yes' if true else 'no' }} {{ 'yes' if false else 'no' }} [{{ 'only' if false }}] {{ 1 if 0 else 2 if 0 else 3 }}", {}),
    ("slicing", "{{ s[1:3] }} {{ s[::-1] }} {{ s[-2:] }} {{ s[:-2] }} {{ l[::2] }} {{ l[1:] }} {{ l[-1] }} {{ l[:0] }} {{ s[::2] }} {{ l[5:1:-2] }} {{ s[1] }} {{ s[-1] }}", {"s": "héllo wörld", "l": [0, 1, 2, 3, 4, 5, 6]}),
    ("attribute_subscript", "{{ d.a }} {{ d['a'] }} {{ d.b.c }} {{ d['b']['c'] }} {{ l.0 }} {{ l[1].x }} [{{ d.nope }}] [{{ l[9] }}] {{ d.get('a') }} {{ d.get('zz', 'dflt') }} {{ d.items() | list | length }}", {"d": {"a": 1, "b": {"c": "deep"}}, "l": ["first", {"x": "X"}]}),
    ("dict_methods", "{% for k, v in d.items() %}{{ k }}{{ v }}{% endfor %} {{ d.keys() | list }} {{ d.values() | list }} {{ d.get('b') }} {{ d.get('q') }}", {"d": {"b": 2, "a": 1}}),
    ("string_methods", "{{ s.strip() }}|{{ s.lstrip() }}|{{ s.rstrip() }}|{{ 'xxhixx'.strip('x') }}|{{ s.split() }}|{{ 'a,b,,c'.split(',') }}|{{ 'a b c'.split(' ', 1) }}|{{ 'a,b,c'.rsplit(',', 1) }}|{{ s.upper() }}|{{ 'HeLLo'.lower() }}|{{ 'hello big world'.title() }}|{{ 'hello'.capitalize() }}|{{ 'abc'.startswith('ab') }}|{{ 'abc'.endswith(('x', 'c')) }}|{{ 'aaa'.replace('a', 'b', 2) }}|{{ 'hello'.find('l') }}|{{ 'hello'.count('l') }}|{{ '-'.join(['a', 'b']) }}|{{ 'a\\nb\\r\\nc'.splitlines() }}|{{ '42'.isdigit() }}|{{ '{} and {}'.format('x', 1) }}|{{ '{0}{name}'.format('a', name='b') }}", {"s": "  Hello World  "}),
    ("filters_basic", "{{ '  hi  ' | trim }}|{{ 'xhix' | trim('x') }}|{{ 'abc' | upper }}|{{ 'ABC' | lower }}|{{ 'hello world-foo' | title }}|{{ 'hELLO' | capitalize }}|{{ 'aXbX' | replace('X', '-') }}|{{ [1, 2, 3] | length }}|{{ 'héllo' | length }}|{{ {'a': 1} | count }}|{{ [3, 1, 2] | first }}|{{ [3, 1, 2] | last }}|{{ 'abc' | list }}|{{ 42 | string }}|{{ [1, 2] | join(', ') }}|{{ [1, 2] | join }}|{{ '<a href=\"x\">&</a>' | escape }}|{{ '<b>' | safe }}|{{ -3 | abs }}|{{ [3, 1, 2] | sort }}|{{ [3, 1, 2] | sort(reverse=true) }}|{{ 'abc' | reverse }}|{{ [1, 2] | reverse | list }}", {}),
    ("filter_default", "{{ missing | default('dflt') }}|{{ missing | d('d2') }}|{{ '' | default('empty') }}|{{ '' | default('empty', true) }}|{{ none | default('n') }}|{{ 0 | default(5, boolean=true) }}|{{ 'set' | default('x') }}", {}),
    ("filter_int_float", "{{ '42' | int }} {{ '4.7' | int }} {{ 'x' | int }} {{ 'x' | int(7) }} {{ 3.9 | int }} {{ '0x1A' | int(0, 16) }} {{ '3.5' | float }} {{ 'bad' | float }} {{ 2 | float }} {{ true | int }}", {}),
    ("filter_round", "{{ 2.5 | round }} {{ 3.5 | round }} {{ 2.675 | round(2) }} {{ 1.234 | round(1, 'floor') }} {{ 1.231 | round(2, 'ceil') }} {{ 7 | round }}", {}),
    ("filter_items_dictsort", "{% for k, v in d | items %}{{ k }}{{ v }}{% endfor %} {% for k, v in d | dictsort %}{{ k }}{{ v }}{% endfor %} {% for k, v in d | dictsort(by='value', reverse=true) %}{{ k }}{% endfor %}", {"d": {"b": 2, "C": 3, "a": 1}}),
    ("filter_select_map", "{{ users | selectattr('active') | map(attribute='name') | join(',') }}|{{ users | rejectattr('active') | map(attribute='name') | list }}|{{ users | selectattr('role', 'equalto', 'admin') | list | length }}|{{ users | selectattr('age', 'gt', 30) | map(attribute='name') | first }}|{{ [1, 2, 3, 4] | select('odd') | list }}|{{ [1, 2, 3, 4] | reject('even') | list }}|{{ ['a', 'b'] | map('upper') | join }}|{{ users | map(attribute='missing', default='?') | join }}|{{ users | map(attribute='info.city') | list }}", {"users": [{"name": "ann", "active": True, "role": "admin", "age": 41, "info": {"city": "Oslo"}}, {"name": "bob", "active": False, "role": "user", "age": 25, "info": {"city": "Rome"}}, {"name": "cy", "active": True, "role": "admin", "age": 33, "info": {"city": "Lima"}}]}),
    ("filter_tojson", "{{ d | tojson }}|{{ d | tojson(indent=2) }}|{{ d | tojson(sort_keys=true) }}|{{ d | tojson(separators=(',', ':')) }}|{{ 'é\"\\n\\t<>&\\u2028' | tojson }}|{{ d | tojson(ensure_ascii=true) }}|{{ [] | tojson(indent=2) }}|{{ [1.0, 1e20, 0.1, -0.0, 123456789012] | tojson }}|{{ none | tojson }}|{{ (1, 2) | tojson }}", {"d": {"z": [1, {"y": None, "x": True}], "a": "ünï 😀", "e": {}, "n": 2.5}}),
    ("filter_indent", "{{ 'a\\nb\\n\\nc' | indent }}|{{ 'a\\nb' | indent(2, true) }}|{{ 'a\\n\\nb' | indent(2, blank=true) }}|{{ 'x\\ny' | indent('> ') }}", {}),
    ("filter_misc", "{{ [1, 2, 2, 'a', 'A'] | unique | list }}|{{ [3, 1, 2] | min }}|{{ [3, 1, 2] | max }}|{{ [1, 2, 3] | sum }}|{{ users | sum(attribute='n') }}|{{ 'hello world foo' | wordcount }}|{{ '%s=%s' | format('k', 'v') }}|{{ [1, 2, 3, 4, 5] | batch(2) | list }}|{{ users | map(attribute='n') | list }}|{{ d | attr('x') }}", {"users": [{"n": 1}, {"n": 5}], "d": {"x": 1}}),
    ("tests_types", "{% for v in vals %}{{ v is defined }}{{ v is none }}{{ v is string }}{{ v is mapping }}{{ v is iterable }}{{ v is sequence }}{{ v is number }}{{ v is integer }}{{ v is float }}{{ v is boolean }}{{ v is true }}{{ v is false }};{% endfor %}{{ missing is defined }}{{ missing is undefined }}{{ missing is iterable }}", {"vals": [None, "s", {"a": 1}, [1], 1, 1.5, True, False]}),
    ("tests_compare", "{{ 3 is odd }}{{ 4 is even }}{{ 9 is divisibleby 3 }}{{ 9 is divisibleby(4) }}{{ 'a' is equalto 'a' }}{{ 1 is eq 1 }}{{ 2 is ne 1 }}{{ 1 is lt 2 }}{{ 2 is gt 1 }}{{ 2 is ge 2 }}{{ 1 is le 0 }}{{ 1 is in [1, 2] }}{{ 'x' is not in 'abc' }}{{ 'abc' is lower }}{{ 'ABC' is upper }}{{ none is sameas none }}{{ range is callable }}{{ x is not defined }}", {}),
    ("range_global", "{{ range(5) | list }} {{ range(2, 6) | list }} {{ range(10, 0, -3) | list }} {{ range(0) | list }}", {}),
    ("dict_global", "{% set d = dict(a=1, b='x') %}{{ d }} {{ dict([('k', 2)]) }} {{ dict(d, c=3) }}", {}),
    ("list_literals", "{{ [1, [2, [3]], {'a': (4, 5)}] }} {{ {'x': 1, 'x': 2} }} {{ () }} {{ (1, 2) }} {{ [] }} {{ {} }} {{ 'con' 'cat' }}", {}),
    ("string_escapes", "{{ 'tab\\there' }}|{{ \"quote\\\"s\" }}|{{ 'uni\\u00e9\\x41\\101' }}|{{ 'back\\\\slash' }}|{{ 'keep\\d' }}|{{ 'it\\'s' }}", {}),
    ("number_literals", "{{ 1_000 }} {{ 0x1f }} {{ 0o17 }} {{ 0b101 }} {{ 1.5e3 }} {{ 1E-2 }} {{ 12.0 }}", {}),
    ("undefined_attr_chain", "[{{ d.missing }}][{{ d.missing | default('x') }}][{{ d.missing is defined }}]", {"d": {}}),
    ("none_attr", "[{{ n.x }}][{{ n.x is defined }}]", {"n": None}),
    ("messages_like_qwen", "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}\n{%- for message in messages[::-1] %}\n    {%- set index = (messages|length - 1) - loop.index0 %}\n    {%- if ns.multi_step_tool and message.role == \"user\" and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}\n        {%- set ns.multi_step_tool = false %}\n        {%- set ns.last_query_index = index %}\n    {%- endif %}\n{%- endfor %}\n{{- ns.last_query_index }}", {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "<tool_response>x</tool_response>"}]}),
    ("strftime_literal", "{{ strftime_now is defined }}", {}),
    ("unicode_text", "{{ s | upper }}|{{ s | length }}|{{ s[2:5] }}|{{ s | reverse }}|{{ s.split('😀') }}|{{ s | title }}", {"s": "naïve café 😀 straße ÉCOLE"}),
    ("long_loop", "{% set ns = namespace(t=0) %}{% for i in range(2000) %}{% set ns.t = ns.t + i %}{% endfor %}{{ ns.t }}", {}),
]

ERRORS = [
    ("err_unclosed_if", "line1\n{% if true %}\nbody\n", {}),
    ("err_unknown_tag", "a\nb\n  {% frobnicate %}", {}),
    ("err_bad_expr", "{{ 1 + }}", {}),
    ("err_unclosed_var", "ok\n{{ x ", {}),
    ("err_unclosed_comment", "{# never closed", {}),
    ("err_unbalanced", "{{ (1 + 2 }}", {}),
    ("err_endfor_mismatch", "{% for x in y %}\n{% endif %}", {}),
    ("err_undefined_attr", "line1\nline2 {{ foo.bar }}", {}),
    ("err_undefined_chain", "{{ d.a.b }}", {"d": {}}),
    ("err_raise_exception", "{% if true %}\n\n{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}", {}),
    ("err_div_zero", "{{ 1 // 0 }}", {}),
    ("err_add_types", "\n\n{{ 'a' + 1 }}", {}),
    ("err_unknown_filter", "{{ x | nosuchfilter }}", {"x": 1}),
    ("err_unknown_test", "{{ x is nosuchtest }}", {"x": 1}),
    ("err_call_non_callable", "{{ x() }}", {"x": 1}),
    ("err_ns_assign_non_ns", "{% set d = {} %}{% set d.x = 1 %}", {}),
    ("err_list_append", "{% set l = [] %}{{ l.append(1) }}", {}),
    ("err_range_too_big", "{{ range(1000000) | length }}", {}),
    ("err_tojson_undefined", "{{ missing | tojson }}", {}),
    ("err_unpack", "{% set a, b = [1, 2, 3] %}", {}),
    ("err_iterate_int", "{% for x in 5 %}{% endfor %}", {}),
    ("err_ns_underscore", "{% set ns = namespace(_x=1) %}", {}),
]


def main():
    env_template = lambda src: _compile_jinja_template(src)  # noqa: E731
    out = {
        "generator": "tools/goldens/make_template_goldens.py",
        "jinja2_version": jinja2.__version__,
        "transformers_version": transformers.__version__,
        "python_version": sys.version.split()[0],
        "features": [],
        "errors": [],
        "chats": [],
    }
    for name, src, variables in FEATURES:
        expected = env_template(src).render(**copy.deepcopy(variables))
        out["features"].append({"name": name, "template": src, "vars": variables, "expected": expected})
    for name, src, variables in ERRORS:
        try:
            env_template(src).render(**copy.deepcopy(variables))
        except Exception as exc:  # noqa: BLE001 - we record every jinja2 failure kind
            out["errors"].append({"name": name, "template": src, "vars": variables,
                                  "error_type": type(exc).__name__, "message": str(exc), "line": error_line(exc)})
            continue
        raise SystemExit(f"error case {name} rendered without error")

    templates = {}
    for tid in ("minimax_m3", "minimax_m2_style"):
        with open(os.path.join(TPL_DIR, tid + ".jinja"), encoding="utf-8") as f:
            templates[tid] = f.read()
    qwen_cfg_path = os.path.join(QWEN3_DIR, "tokenizer_config.json")
    qwen_special = {}
    if os.path.exists(qwen_cfg_path):
        with open(qwen_cfg_path, encoding="utf-8") as f:
            qwen_cfg = json.load(f)
        templates["qwen3"] = qwen_cfg["chat_template"]
        qwen_special = special_tokens_of(qwen_cfg)
    for case in chat_cases():
        tid = case["template"]
        if tid not in templates:
            print(f"skipping {case['name']}: template {tid} not available", file=sys.stderr)
            continue
        special = case["special_tokens"] if tid != "qwen3" else qwen_special
        case["special_tokens"] = special
        messages = vllm_parse_arguments(case["messages"])
        try:
            case["expected"] = render_chat(templates[tid], special, messages, case["tools"],
                                           case["add_generation_prompt"], case["kwargs"])
        except jinja2.exceptions.TemplateError as exc:
            case["error"] = str(exc)
            case["error_line"] = error_line(exc)
        out["chats"].append(case)

    path = os.path.join(TPL_DIR, "goldens.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"wrote {path}: {len(out['features'])} feature, {len(out['errors'])} error, {len(out['chats'])} chat cases")


if __name__ == "__main__":
    main()
