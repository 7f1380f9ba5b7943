"""Our side of the parser side-by-side check (tools/parity): the generated corpus of MiniMax-M3
outputs through `m3serve parse-outputs` (whole text, the server's per-token pipeline, random text
chunkings) against the results known by construction. vLLM's side is not run in CI (the harness
takes a vLLM tree by path; docs/PARSERS.md has its numbers)."""

import json
import os
import subprocess
import sys

from conftest import REPO, find_binary

COMPARE = os.path.join(REPO, "tools", "parity", "compare.py")
DEMO = os.path.join(REPO, "models", "demo")


def test_corpus_matches_expected_results(tmp_path):
    r = subprocess.run([sys.executable, COMPARE, "--ours-only", "--m3serve", find_binary(),
                        "--model", DEMO, "--n", "2500", "--seed", "7", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    total = [l for l in r.stdout.splitlines() if l.startswith("| **all** |")]
    assert total, r.stdout
    cells = [c.strip() for c in total[0].strip("|").split("|")]
    n, agree, we_wrong = int(cells[1]), int(cells[2]), int(cells[4])
    assert n == 2500 and we_wrong == 0 and agree == n, total[0]
    assert (tmp_path / "report.md").exists()


def test_parse_outputs_reports_bad_lines_and_goes_on():
    lines = [
        "not json",
        json.dumps({"id": "a", "text": "<mm:think>r</mm:think>hi", "text_splits": [[3, 12]]}),
        json.dumps({"id": "b", "token_ids": [10 ** 9]}),
        json.dumps({"id": "c", "text": "x", "thinking_mode": "sometimes"}),
        json.dumps({"id": "d", "text": "abc", "text_splits": [[2, 1]]}),
        json.dumps({"id": "e"}),
    ]
    r = subprocess.run([find_binary(), "parse-outputs", "--model", DEMO],
                       input="\n".join(lines) + "\n", capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    out = [json.loads(l) for l in r.stdout.splitlines()]
    assert len(out) == 6
    assert "not JSON" in out[0]["error"]
    assert out[1]["whole"] == {"reasoning": "r", "content": "hi", "tool_calls": [],
                               "finish_reason": "stop"}
    assert out[1]["splits"] == [out[1]["whole"]]
    assert "vocabulary" in out[2]["error"] and out[2]["id"] == "b"
    assert "sometimes" in out[3]["error"]
    assert "rise" in out[4]["error"]
    assert "text" in out[5]["error"]


def test_parse_outputs_server_path_drops_eos_and_parses_calls():
    tok = json.load(open(os.path.join(DEMO, "tokenizer.json"), encoding="utf-8"))
    ids = {a["content"]: a["id"] for a in tok["added_tokens"]}
    text = ('</mm:think>]<]minimax[>[<tool_call>]<]minimax[>[<invoke name="get_time">'
            ']<]minimax[>[</invoke>]<]minimax[>[</tool_call>')
    enc = subprocess.run([find_binary(), "tokenize", "--model", DEMO, "--text", text],
                         capture_output=True, text=True, check=True)
    token_ids = json.loads(enc.stdout)["ids"] + [ids["[e~["]]
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {}}}]
    r = subprocess.run([find_binary(), "parse-outputs", "--model", DEMO],
                       input=json.dumps({"id": 1, "token_ids": token_ids, "tools": tools}) + "\n",
                       capture_output=True, text=True, check=True, timeout=60)
    o = json.loads(r.stdout)
    want = {"reasoning": "", "content": None,
            "tool_calls": [{"name": "get_time", "arguments": "{}"}], "finish_reason": "tool_calls"}
    assert o["server"] == want and o["whole"] == want
