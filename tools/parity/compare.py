#!/usr/bin/env python3
"""Side-by-side check of m3serve's minimax_m3 parsers (reasoning + tool calls) against vLLM's own.

  python3 tools/parity/compare.py --vllm /path/to/vllm-tree --m3serve build/release/bin/m3serve \
      [--model models/demo] [--n 3000] [--seed 0] [--out /tmp/parity]
  python3 tools/parity/compare.py --ours-only --m3serve build/release/bin/m3serve   (CI: no vLLM)

--vllm is a folder that holds vLLM's `vllm` package: a git checkout of vllm-project/vllm at the
release to compare, or the wheel unpacked (`pip download vllm==0.33.0 --no-deps` then unzip).
vLLM is never copied into this repository; see vllm_side.py for what is stubbed to import it.

For each generated output (corpus.py: well-formed calls of every parameter type, nesting to 128
levels, the quirk classes of issue #14 item 6) both sides parse it
  * whole: vLLM's `Parser.parse` + `assemble_chat_message_fields`; m3serve's ChatOutputParser;
  * streamed: vLLM's `ChatStreamProcessor.step` over token chunkings (one token per delta and two
    random groupings, incremental detokenization); m3serve's server pipeline (ChoiceOutput, one
    engine output per token, EOS id at the end) and ChatOutputParser over three text chunkings
    (one character per piece and two random ones).
Every result is compared with the record's expected reasoning / content / tool calls (known by
construction) and each side's streams with its own whole result. A record is classified:
  agree                 both sides return the expected result, streamed and whole
  vLLM wrong, we right  m3serve right everywhere, vLLM not (whole or a stream)
  we wrong              m3serve wrong somewhere (whatever vLLM does)
  no ground truth       a truncated output (not strict): reported when the sides differ
Exit status: 1 if any record is "we wrong", else 0. --out writes report.md and diffs.jsonl.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import corpus  # noqa: E402

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def canon(v):
    """JSON value for comparison: numbers by value (bool apart), objects without key order."""
    if isinstance(v, bool) or v is None or isinstance(v, str):
        return (type(v).__name__, v)
    if isinstance(v, (int, float)):
        return ("num", float(v))
    if isinstance(v, list):
        return ("list", tuple(canon(x) for x in v))
    if isinstance(v, dict):
        return ("obj", tuple(sorted((k, canon(x)) for k, x in v.items())))
    return ("other", repr(v))


def norm(result: dict) -> tuple:
    content = result.get("content")
    if content == "":
        content = None
    calls = []
    for c in result.get("tool_calls") or []:
        args = c.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                args = ("invalid JSON", args)
        calls.append((c.get("name"), canon(args)))
    return (result.get("reasoning") or "", content, tuple(calls))


def show(result: dict) -> dict:
    return {"reasoning": result.get("reasoning") or "", "content": result.get("content"),
            "tool_calls": result.get("tool_calls") or []}


def token_chunks(tok, ids: list[int], sizes: list[int], eos: bool) -> list[tuple[str, list[int]]]:
    """Engine outputs of `sizes` tokens with the text vLLM's incremental detokenizer gives them
    (text held while it ends in an incomplete UTF-8 character; the EOS id carries no text)."""
    text_ids = ids[:-1] if eos else ids
    out, pos, shown = [], 0, ""
    for n in sizes:
        group = ids[pos:pos + n]
        pos += n
        upto = min(pos, len(text_ids))
        full = tok.decode(text_ids[:upto], skip_special_tokens=False)
        if full.endswith("\ufffd") and upto < len(text_ids):
            delta = ""
        else:
            delta = full[len(shown):]
            shown = full
        out.append((delta, group))
    return out


def random_sizes(rng: random.Random, n: int) -> list[int]:
    sizes = []
    while n > 0:
        k = min(n, rng.choice([1, 1, 2, 3, 5, 8]))
        sizes.append(k)
        n -= k
    return sizes


def prompt_ids(m3serve: str, model: str, mode: str, tools: list) -> list[int]:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"messages": [{"role": "user", "content": "hi"}], "tools": tools,
                   "chat_template_kwargs": {"thinking_mode": mode}}, f)
    try:
        r = subprocess.run([m3serve, "tokenize", "--model", model, "--chat", f.name],
                           capture_output=True, text=True, check=True)
    finally:
        os.unlink(f.name)
    return json.loads(r.stdout)["ids"]


def run_ours(m3serve: str, model: str, records: list[dict]) -> dict:
    lines = []
    for r in records:
        lines.append(json.dumps({"id": r["id"], "text": r["text"], "token_ids": r["ids"],
                                 "tools": r["tools"], "thinking_mode": r["thinking_mode"],
                                 "finish_reason": r["finish_reason"],
                                 "text_splits": r["text_splits"]}, ensure_ascii=False))
    p = subprocess.run([m3serve, "parse-outputs", "--model", model], input="\n".join(lines) + "\n",
                       capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"m3serve parse-outputs failed ({p.returncode}): {p.stderr}")
    out = {}
    for line in p.stdout.splitlines():
        o = json.loads(line)
        if "error" in o:
            raise SystemExit(f"m3serve parse-outputs: {o['error']}")
        out[o["id"]] = o
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--vllm", help="folder holding vLLM's `vllm` package (checkout or wheel)")
    ap.add_argument("--ours-only", action="store_true", help="check m3serve against the expected "
                    "results only (no vLLM)")
    ap.add_argument("--m3serve", default=os.path.join(REPO, "build/release/bin/m3serve"))
    ap.add_argument("--model", default=os.path.join(REPO, "models/demo"),
                    help="model folder whose tokenizer.json (M3's special tokens) both sides use")
    ap.add_argument("--n", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="folder for report.md and diffs.jsonl")
    ap.add_argument("--no-prompt", action="store_true", help="give vLLM no prompt token ids (the "
                    "rendered prompt's thinking instructions hold both reasoning markers, which "
                    "vLLM's streaming reads as reasoning already ended: vLLM #50549)")
    a = ap.parse_args()
    if not a.ours_only and not a.vllm:
        ap.error("give --vllm PATH (or --ours-only)")

    rng = random.Random(a.seed + 1)
    records = corpus.generate(a.n, a.seed)
    tok_path = os.path.join(a.model, "tokenizer.json") if os.path.isdir(a.model) else a.model
    from vllm_side import HFTokenizer
    tok = HFTokenizer(tok_path)
    for r in records:
        ids = tok.encode(r["text"])
        if tok.decode(ids) != r["text"]:
            raise SystemExit(f"record {r['id']}: the tokenizer does not round-trip its text")
        r["ids"] = ids + ([tok.eos_token_id] if r["finish_reason"] == "stop" else [])
        r["text_splits"] = corpus.char_splits(rng, r["text"], 3)
        r["token_sizes"] = [[1] * len(r["ids"]), random_sizes(rng, len(r["ids"])),
                            random_sizes(rng, len(r["ids"]))]
    ours = run_ours(a.m3serve, a.model, records)

    vl = None
    prompts: dict = {}
    if not a.ours_only:
        from vllm_side import VllmParsers
        vl = VllmParsers(a.vllm, tok)

    table: dict = collections.defaultdict(collections.Counter)
    kinds: dict = collections.defaultdict(collections.Counter)
    diffs = []
    for r in records:
        exp = norm(r["expected"])
        o = ours[r["id"]]
        o_whole = norm(o["whole"])
        o_streams = [norm(o["server"])] + [norm(s) for s in o["splits"]]
        ours_ok = o_whole == exp and all(s == o_whole for s in o_streams)
        ours_consistent = all(s == o_whole for s in o_streams)
        v_whole = v_streams = None
        if vl is not None:
            key = (r["thinking_mode"], r["toolset"])
            if key not in prompts:
                prompts[key] = [] if a.no_prompt else prompt_ids(a.m3serve, a.model,
                                                                 r["thinking_mode"], r["tools"])
            eos = r["finish_reason"] == "stop"
            try:
                vw = vl.whole(r, r["text"], r["ids"], prompts[key])
            except Exception as e:  # a parser exception is vLLM's answer too (a 500)
                vw = {"reasoning": "", "content": f"<exception {type(e).__name__}: {e}>",
                      "tool_calls": []}
            v_whole = norm(vw)
            v_streams = []
            vs_raw = []
            for sizes in r["token_sizes"]:
                chunks = token_chunks(tok, r["ids"], sizes, eos)
                try:
                    vs = vl.stream(r, chunks, "stop" if eos else "length", prompts[key])
                except Exception as e:
                    vs = {"reasoning": "", "content": f"<exception {type(e).__name__}: {e}>",
                          "tool_calls": []}
                vs_raw.append(vs)
                v_streams.append(norm(vs))
        cls = r["cls"]
        if r["strict"]:
            if not ours_ok:
                verdict = "we wrong"
            elif vl is None or (v_whole == exp and all(s == v_whole for s in v_streams)):
                verdict = "agree"
            else:
                verdict = "vLLM wrong, we right"
                if v_whole != exp:
                    kinds[cls]["vLLM whole wrong"] += 1
                if any(s != v_whole for s in v_streams):
                    kinds[cls]["vLLM stream != whole"] += 1
        else:
            if not ours_consistent:
                verdict = "we wrong"
            elif vl is None or (v_whole == o_whole and all(s == o_whole for s in v_streams)):
                verdict = "agree"
            else:
                verdict = "no ground truth"
        table[cls][verdict] += 1
        if verdict != "agree":
            d = {"id": r["id"], "cls": cls, "verdict": verdict, "thinking_mode": r["thinking_mode"],
                 "text": r["text"], "expected": r["expected"] if r["strict"] else None,
                 "m3serve": {"whole": show(o["whole"]), "server": show(o["server"]),
                             "splits": [show(s) for s in o["splits"]]}}
            if vl is not None:
                d["vllm"] = {"whole": show(vw), "streams": [show(s) for s in vs_raw]}
            diffs.append(d)

    cols = ["agree", "vLLM wrong, we right", "we wrong", "no ground truth"]
    lines = []
    who = "m3serve vs expected" if vl is None else f"m3serve vs vLLM {vl.version}"
    lines.append(f"Corpus: {a.n} outputs, seed {a.seed} ({who}; tokenizer {tok_path}"
                 + ("; vLLM given no prompt ids" if a.no_prompt and vl is not None else "") + ")")
    if vl is not None:
        lines.append(f"Stubbed for import: {', '.join(vl.stubbed)}")
    lines.append("")
    lines.append("| class | n | " + " | ".join(cols) + " |")
    lines.append("|---|---:|" + "---:|" * len(cols))
    total: collections.Counter = collections.Counter()
    for cls in sorted(table):
        n = sum(table[cls].values())
        total.update(table[cls])
        lines.append(f"| {cls} | {n} | " + " | ".join(str(table[cls][c]) for c in cols) + " |")
    lines.append(f"| **all** | {sum(total.values())} | " +
                 " | ".join(str(total[c]) for c in cols) + " |")
    if kinds:
        lines.append("")
        lines.append("vLLM failures by kind (a record can have both):")
        for cls in sorted(kinds):
            lines.append(f"- {cls}: " + ", ".join(f"{k} {v}" for k, v in sorted(kinds[cls].items())))
    report = "\n".join(lines)
    print(report)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "report.md"), "w", encoding="utf-8") as f:
            f.write(report + "\n")
        with open(os.path.join(a.out, "diffs.jsonl"), "w", encoding="utf-8") as f:
            for d in diffs:
                f.write(json.dumps(d, ensure_ascii=False) + "\n")
    we_wrong = [d for d in diffs if d["verdict"] == "we wrong"]
    for d in we_wrong[:5]:
        print("\nwe wrong:", json.dumps({k: d[k] for k in ("id", "cls", "text", "expected")},
                                         ensure_ascii=False), "\n  m3serve:",
              json.dumps(d["m3serve"]["whole"], ensure_ascii=False), file=sys.stderr)
    return 1 if we_wrong else 0


if __name__ == "__main__":
    sys.exit(main())
