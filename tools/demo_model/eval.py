#!/usr/bin/env python3
"""Evaluate the demo model served by m3serve (or any OpenAI-compatible server) on the same
prompts that train.py scores with transformers, and print a JSON summary.

  m3serve serve &            # serves models/demo when no model is given
  python3 tools/demo_model/eval.py --base-url http://127.0.0.1:8000/v1 \
      [--hf-json hf_eval.json] [--markdown] [--limit N]

Metrics: passkey accuracy by context length (thinking disabled), tool-call parse rate and
exact-call accuracy (thinking enabled / disabled), arithmetic and lookup accuracy with thinking
enabled and disabled. Requests are greedy (temperature 0) with chat_template_kwargs
{"thinking_mode": ...}. With --hf-json (train.py's output) it also prints both engines side by
side. Needs the `openai` and `tokenizers` packages, no torch.
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tasks  # noqa: E402
from chat_format import MODEL_DIR, parse_tool_calls, split_reasoning  # noqa: E402

MAX_TOKENS = {"arith": {"enabled": 72, "disabled": 24}, "lookup": {"enabled": 72, "disabled": 24},
              "tool": {"enabled": 96, "disabled": 72}, "passkey": {"disabled": 12}}


def load_items(limit):
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(MODEL_DIR, "tokenizer.json"))
    items = tasks.eval_set(tasks.FillerLengths(tok))
    if limit:
        by, keep = {}, []
        for it in items:
            key = (it["kind"], it.get("ctx"))
            by[key] = by.get(key, 0) + 1
            if by[key] <= limit:
                keep.append(it)
        items = keep
    return items


def ask(client, model, item):
    kw = dict(model=model, messages=item["messages"], temperature=0,
              max_tokens=MAX_TOKENS[item["kind"]][item["mode"]],
              extra_body={"chat_template_kwargs": {"thinking_mode": item["mode"]}})
    if item["tools"]:
        kw["tools"] = item["tools"]
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message
    extra = getattr(msg, "model_extra", None) or {}
    reasoning = extra.get("reasoning_content") or extra.get("reasoning") or ""
    content = msg.content or ""
    rec = dict(id=item["id"], kind=item["kind"], mode=item["mode"], ctx=item.get("ctx"),
               content=content, reasoning=reasoning, finish_reason=r.choices[0].finish_reason,
               prompt_tokens=getattr(r.usage, "prompt_tokens", None) if r.usage else None)
    if item["kind"] == "tool":
        calls, ok = [], False
        if msg.tool_calls:
            try:
                calls = [dict(name=tc.function.name, arguments=json.loads(tc.function.arguments))
                         for tc in msg.tool_calls]
                ok = all(isinstance(c["arguments"], dict) for c in calls)
            except (json.JSONDecodeError, TypeError) as e:
                rec["parse_error"] = str(e)
        else:
            # a server without tool parsing returns the raw block in content
            try:
                _, calls = parse_tool_calls(split_reasoning(content, item["mode"])[1], item["tools"])
                ok = bool(calls)
                rec["parsed_client_side"] = ok
            except ValueError as e:
                rec["parse_error"] = str(e)
        rec.update(parsed=ok, calls=calls, correct=ok and tasks.tool_call_correct(item, calls))
    else:
        rec["correct"] = tasks.answer_correct(item, content)
    return rec


def summarize(items):
    s = {"passkey_by_ctx": {}, "tasks": {}, "tools": {}}
    for L in tasks.PASSKEY_EVAL_LENGTHS:
        pk = [r for r in items if r["kind"] == "passkey" and r["ctx"] == L]
        if pk:
            row = dict(accuracy=sum(r["correct"] for r in pk) / len(pk), n=len(pk))
            pt = [r["prompt_tokens"] for r in pk if r.get("prompt_tokens")]
            if pt:
                row["prompt_tokens"] = round(sum(pt) / len(pt))
            s["passkey_by_ctx"][str(L)] = row
    for kind in ("arith", "lookup"):
        for mode in ("enabled", "disabled"):
            rr = [r for r in items if r["kind"] == kind and r["mode"] == mode]
            if rr:
                s["tasks"][f"{kind}_thinking_{mode}"] = dict(
                    accuracy=sum(r["correct"] for r in rr) / len(rr), n=len(rr))
    for mode in ("enabled", "disabled"):
        rr = [r for r in items if r["kind"] == "tool" and r["mode"] == mode]
        if rr:
            s["tools"][f"thinking_{mode}"] = dict(parse_rate=sum(r["parsed"] for r in rr) / len(rr),
                                                  correct_call=sum(r["correct"] for r in rr) / len(rr),
                                                  n=len(rr))
    return s


def markdown(m3, hf):
    lines = ["| metric | m3serve | transformers |", "|---|---|---|"]

    def pct(x):
        return "-" if x is None else f"{100 * x:.0f}%"

    for L, row in m3["passkey_by_ctx"].items():
        h = (hf or {}).get("passkey_by_ctx", {}).get(L, {})
        lines.append(f"| passkey, ~{L} filler tokens | {pct(row['accuracy'])} | {pct(h.get('indexer'))} |")
    for k, row in m3["tasks"].items():
        h = (hf or {}).get("tasks", {}).get(k, {})
        lines.append(f"| {k} | {pct(row['accuracy'])} | {pct(h.get('accuracy'))} |")
    for k, row in m3["tools"].items():
        h = (hf or {}).get("tools", {}).get(k, {})
        lines.append(f"| tool-call parse rate, {k} | {pct(row['parse_rate'])} | {pct(h.get('parse_rate'))} |")
        lines.append(f"| exact tool call, {k} | {pct(row['correct_call'])} | {pct(h.get('correct_call'))} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--model", default=None, help="model id (default: the first of /v1/models)")
    ap.add_argument("--api-key", default="none")
    ap.add_argument("--limit", type=int, default=0, help="items per (kind, length); 0 = all")
    ap.add_argument("--hf-json", default=None, help="train.py's hf_eval.json for a side-by-side table")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--out", default=None, help="write per-item results here")
    args = ap.parse_args()

    from openai import OpenAI
    client = OpenAI(base_url=args.base_url, api_key=args.api_key, timeout=600)
    model = args.model or client.models.list().data[0].id
    items = load_items(args.limit)
    t0 = time.time()
    results = []
    for it in items:
        try:
            results.append(ask(client, model, it))
        except Exception as e:  # noqa: BLE001 - a failed request counts as wrong, and is reported
            results.append(dict(id=it["id"], kind=it["kind"], mode=it["mode"], ctx=it.get("ctx"),
                                error=f"{type(e).__name__}: {e}", correct=False, parsed=False))
    summary = summarize(results)
    summary["requests"] = len(results)
    summary["errors"] = sum(1 for r in results if "error" in r)
    summary["seconds"] = round(time.time() - t0, 1)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(summary=summary, items=results), f, indent=1)
    print(json.dumps(summary, indent=1))
    if args.markdown or args.hf_json:
        hf = None
        if args.hf_json:
            with open(args.hf_json) as f:
                hf = json.load(f)["summary"]
        print(markdown(summary, hf))


if __name__ == "__main__":
    main()
