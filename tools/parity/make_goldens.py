#!/usr/bin/env python3
"""Golden parser cases from a side-by-side run: one case per class and kind of vLLM failure
where m3serve is right (tools/parity/compare.py --vllm ... --out DIR), written to
tests/golden/text/parsers/vllm_parity.json, which parser_golden_test checks whole and in every
streaming split.

  python3 tools/parity/make_goldens.py DIR [DIR2 ...]

The expected result of each case is m3serve's, which compare.py has already found equal to the
result known by construction; the description records what vLLM returned instead.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import compare  # noqa: E402
import corpus  # noqa: E402

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
OUT = os.path.join(REPO, "tests", "golden", "text", "parsers", "vllm_parity.json")


def short(r: dict) -> str:
    calls = ", ".join(f"{c['name']}({c['arguments']})" for c in r["tool_calls"])
    return (f"reasoning {json.dumps(r['reasoning'], ensure_ascii=False)}, content "
            f"{json.dumps(r['content'], ensure_ascii=False)}, calls [{calls}]")


def main() -> int:
    if len(sys.argv) < 2:
        print(__doc__)
        return 2
    cases, seen = [], set()
    for d in sys.argv[1:]:
        meta = open(os.path.join(d, "report.md"), encoding="utf-8").readline().strip()
        run = ("parity run: " + meta.split(" (", 1)[0].replace("Corpus: ", "") +
               ("; vLLM given no prompt ids" if "no prompt ids" in meta else
                "; vLLM given the rendered prompt"))
        for line in open(os.path.join(d, "diffs.jsonl"), encoding="utf-8"):
            x = json.loads(line)
            if x["verdict"] != "vLLM wrong, we right":
                continue
            v = x["vllm"]
            exp = x["expected"]
            whole_wrong = not _same(v["whole"], exp)
            kind = "whole" if whole_wrong else "stream"
            if (x["cls"], kind) in seen:
                continue
            seen.add((x["cls"], kind))
            got = v["whole"] if whole_wrong else next(s for s in v["streams"] if not _same(s, exp))
            ours = x["m3serve"]["whole"]
            rec = next(r for r in corpus.generate(x["id"] + 1, _seed(meta)) if r["id"] == x["id"])
            cases.append({
                "name": f"{x['cls']}_{kind}",
                "description": (f"vLLM 0.33 {'whole text' if whole_wrong else 'streamed'}: "
                                f"{short(got)} ({run})"),
                "tools": rec["toolset"],
                "thinking_mode": x["thinking_mode"],
                "input": x["text"],
                "expected": {"reasoning": ours["reasoning"], "content": ours["content"] or "",
                             "tool_calls": ours["tool_calls"]},
            })
    doc = {"description": "Outputs where vLLM 0.33's minimax_m3 parsers are wrong and m3serve's "
                          "are right, one per class and kind, from tools/parity/make_goldens.py "
                          "over tools/parity/compare.py runs (docs/PARSERS.md).",
           "tool_sets": {k: v for k, v in corpus.TOOLS.items()
                         if any(c["tools"] == k for c in cases)},
           "cases": sorted(cases, key=lambda c: c["name"])}
    with open(OUT, "w", encoding="utf-8") as f:
        json.dump(doc, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"{len(cases)} cases -> {OUT}")
    return 0


def _same(r: dict, exp: dict) -> bool:
    return compare.norm(r) == compare.norm(exp)


def _seed(meta: str) -> int:
    # "Corpus: N outputs, seed S (...)"
    return int(meta.split("seed ", 1)[1].split(" ", 1)[0])


if __name__ == "__main__":
    sys.exit(main())
