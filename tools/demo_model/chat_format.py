"""M3 chat-format helpers for the demo model: render with the shipped chat_template.jinja the way
transformers' apply_chat_template does (jinja2 sandbox, trim/lstrip blocks, transformers' tojson),
build the assistant completion text that follows a generation prompt, and parse M3 tool calls /
reasoning out of raw generated text (for scoring transformers' outputs; m3serve parses its own).
Used by make_data.py, train.py and eval.py. No torch here.
"""

import json
import os
import re

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
MODEL_DIR = os.path.join(REPO, "models", "demo")
TEMPLATE_PATH = os.path.join(MODEL_DIR, "chat_template.jinja")

NS = "]<]minimax[>["
BOD = "]~!b["
BOS = "]~b]"
EOS = "[e~["
PAD = "]!p~["
THINK_BEGIN = "<mm:think>"
THINK_END = "</mm:think>"
TOOL_BEGIN = NS + "<tool_call>"
TOOL_END = NS + "</tool_call>"

# M3's special tokens in id order (m3-model.md section 6.1: ids 200000..200060). The demo
# tokenizer appends them after its ordinary BPE tokens in this same order.
SPECIAL_TOKENS = [
    "]!p~[", "<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>", "<reponame>",
    "<filename>", "<gh_stars>", "<issue_start>", "<issue_comment>", "<issue_closed>",
    "<jupyter_start>", "<jupyter_text>", "<jupyter_code>", "<jupyter_output>", "<empty_output>",
    "<commit_before>", "<commit_msg>", "<commit_after>", "]~b]", "[e~[", "]!d~[",
    "<function_call>", "<code_interpreter>", "]<]speech[>[", "]<]image[>[", "]<]video[>[",
    "]<]start of speech[>[", "]<]end of speech[>[", "]<]start of image[>[", "]<]end of image[>[",
    "]<]start of video[>[", "]<]end of video[>[", "]<]vision pad[>[", "]~!b[", "<jupyter_error>",
    "<add_file>", "<delete_file>", "<rename_file>", "<edit_file>", "<commit_message>",
    "<empty_source_file>", "<repo_struct>", "<code_context>", "<file_content>", "<source_files>",
    "<pr_start>", "<review_comment>", "<filepath>", "<file_sep>", "<think>", "</think>",
    "<tool_call>", "</tool_call>", "]<]frame[>[", "]<]start of frame[>[", "]<]end of frame[>[",
    "<|content_altered_placeholder|>", "]<]minimax[>[", "<mm:think>", "</mm:think>",
]
assert len(SPECIAL_TOKENS) == 61


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers replaces jinja2's HTML-escaping tojson with plain json.dumps.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


class ChatTemplate:
    def __init__(self, path=TEMPLATE_PATH):
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        from jinja2.ext import loopcontrols

        with open(path, encoding="utf-8") as f:
            self.source = f.read()

        def raise_exception(msg):
            raise ValueError(msg)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = raise_exception
        self.template = env.from_string(self.source)

    def render(self, messages, tools=None, add_generation_prompt=True, thinking_mode=None):
        kw = {}
        if thinking_mode is not None:
            kw["thinking_mode"] = thinking_mode
        return self.template.render(messages=messages, tools=tools,
                                    add_generation_prompt=add_generation_prompt, **kw)


# ------------------------------------------------------------------------------------------
# Completions (the text the model must produce after the generation prompt)
# ------------------------------------------------------------------------------------------


def to_xml(value):
    """Python mirror of the template's to_xml macro (m3-model.md section 6.3)."""
    if isinstance(value, dict):
        return "".join(f"{NS}<{k}>{to_xml(v)}{NS}</{k}>" for k, v in value.items() if v is not None)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "".join(f"{NS}<item>{to_xml(v)}{NS}</item>" for v in value)
    if value is None:
        return ""
    return str(value)


def tool_block(calls):
    """calls: list of (name, arguments dict)."""
    body = ""
    for name, args in calls:
        body += f'{NS}<invoke name="{name}">'
        for k, v in args.items():
            if v is not None:
                body += f"{NS}<{k}>{to_xml(v)}{NS}</{k}>"
        body += f"{NS}</invoke>\n"
    return f"{TOOL_BEGIN}\n{body}{TOOL_END}"


def completion_text(mode, reasoning, content, calls=None):
    """What follows the generation prompt for thinking_mode `mode`, up to and including EOS.
    enabled: the prompt ends with <mm:think>; disabled: with </mm:think>; adaptive: with `ai\\n`."""
    tail = content + (tool_block(calls) if calls else "") + EOS
    if mode == "enabled":
        return reasoning + THINK_END + tail
    if mode == "disabled":
        return tail
    if reasoning:
        return THINK_BEGIN + reasoning + THINK_END + tail
    return THINK_END + tail


# ------------------------------------------------------------------------------------------
# Parsing raw generated text (used to score transformers' generations)
# ------------------------------------------------------------------------------------------


def split_reasoning(text, mode):
    """Returns (reasoning, rest). Follows the M3 reasoning-parser rules (section 6.5)."""
    if mode == "enabled" and THINK_BEGIN not in text:
        if THINK_END in text:
            r, rest = text.split(THINK_END, 1)
            return r, rest
        return text, ""
    if THINK_BEGIN in text:
        pre, post = text.split(THINK_BEGIN, 1)
        if THINK_END in post:
            r, rest = post.split(THINK_END, 1)
            return r, pre + rest
        return post, pre
    if text.startswith(THINK_END):
        return "", text[len(THINK_END):]
    return "", text


_INVOKE_RE = re.compile(re.escape(NS) + r'<invoke\s+name=["\']?([^"\'>]*)["\']?>(.*?)' +
                        re.escape(NS) + r"</invoke>", re.S)


def _parse_elements(body):
    """Parse NS<k>...NS</k> sequences into a dict (nested -> dict / list of item)."""
    out = {}
    pos = 0
    while pos < len(body):
        if not body.startswith(NS + "<", pos):
            if body[pos:].strip() == "":
                break
            raise ValueError(f"junk in invoke body at {pos}: {body[pos:pos + 30]!r}")
        m = re.match(re.escape(NS) + r"<([^<>/\s]+)>", body[pos:])
        if not m:
            raise ValueError(f"bad element at {pos}: {body[pos:pos + 30]!r}")
        key = m.group(1)
        start = pos + m.end()
        close = NS + f"</{key}>"
        # find the matching close, honouring nesting of the same tag
        depth, scan = 1, start
        while True:
            nxt_open = body.find(NS + f"<{key}>", scan)
            nxt_close = body.find(close, scan)
            if nxt_close < 0:
                raise ValueError(f"unclosed <{key}>")
            if 0 <= nxt_open < nxt_close:
                depth += 1
                scan = nxt_open + 1
                continue
            depth -= 1
            if depth == 0:
                break
            scan = nxt_close + 1
        inner = body[start:nxt_close]
        if inner.startswith(NS + "<"):
            sub = _parse_elements(inner)
            value = sub["item"] if list(sub.keys()) == ["item"] else sub
        else:
            value = inner
        if key in out:
            if not isinstance(out[key], list) or key != "item":
                out[key] = [out[key]] if not isinstance(out[key], list) else out[key]
            out[key].append(value)
        else:
            out[key] = [value] if key == "item" else value
        pos = nxt_close + len(close)
    return out


def coerce(value, schema):
    t = (schema or {}).get("type")
    try:
        if t == "integer":
            return int(value)
        if t == "number":
            v = float(value)
            return int(v) if v.is_integer() and "." not in str(value) else v
        if t == "boolean":
            return {"true": True, "false": False}[str(value).strip().lower()]
    except (ValueError, KeyError):
        return value
    return value


def parse_tool_calls(text, tools=None):
    """Returns (content_before, [ {name, arguments} ]) or raises ValueError if a tool block is
    present but malformed. No block -> (text, [])."""
    if TOOL_BEGIN not in text:
        return text, []
    before, block = text.split(TOOL_BEGIN, 1)
    if TOOL_END not in block:
        raise ValueError("tool block not closed")
    block = block.split(TOOL_END, 1)[0]
    schemas = {}
    for t in tools or []:
        fn = t.get("function", t)
        schemas[fn["name"]] = fn.get("parameters", {}).get("properties", {})
    calls = []
    consumed = _INVOKE_RE.sub("", block)
    if consumed.strip():
        raise ValueError(f"junk in tool block: {consumed.strip()[:40]!r}")
    for m in _INVOKE_RE.finditer(block):
        name = m.group(1).strip()
        args = _parse_elements(m.group(2))
        props = schemas.get(name, {})
        args = {k: coerce(v, props.get(k)) if isinstance(v, str) else v for k, v in args.items()}
        calls.append(dict(name=name, arguments=args))
    if not calls:
        raise ValueError("tool block without invokes")
    return before, calls
