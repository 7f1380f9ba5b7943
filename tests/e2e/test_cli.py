"""`m3serve tokenize` / `detokenize` / `generate` from the outside, against independent oracles:
HF `tokenizers` for ids and text, the jinja2-rendered template goldens for chat prompts, and the
transformers model goldens for generate."""

import json
import os
import subprocess

import pytest
from tokenizers import Tokenizer

from conftest import REPO

M3_TOK = os.path.join(REPO, "tests", "golden", "text", "m3_tokenizer", "tokenizer.json")
TEMPLATES = os.path.join(REPO, "tests", "golden", "text", "templates")
MODEL_GOLDENS = os.path.join(REPO, "tests", "golden", "model")


def run(binary, *args, ok=True):
    p = subprocess.run([binary, *args], capture_output=True, text=True, timeout=300)
    if ok:
        assert p.returncode == 0, p.stderr
        return json.loads(p.stdout)
    return p


TEXTS = ["Hello world", "  leading and trailing  ", "digits 1234567 and 3.14159", "tabs\tand\nnewlines\n\n",
         "CJK 你好世界 emoji 👩‍💻 café", "special ]~b]user inside <mm:think>text</mm:think>[e~[", ""]


@pytest.mark.parametrize("text", TEXTS)
def test_tokenize_text_matches_hf(binary, text):
    hf = Tokenizer.from_file(M3_TOK)
    got = run(binary, "tokenize", "--model", M3_TOK, "--text", text)
    assert got["ids"] == hf.encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("skip", [False, True])
def test_detokenize_matches_hf(binary, skip):
    hf = Tokenizer.from_file(M3_TOK)
    ids = hf.encode(TEXTS[5] + TEXTS[4], add_special_tokens=False).ids
    args = ["detokenize", "--model", M3_TOK, "--ids", ",".join(map(str, ids))]
    if skip:
        args.append("--skip-special-tokens")
    assert run(binary, *args)["text"] == hf.decode(ids, skip_special_tokens=skip)


def test_tokenize_chat_matches_jinja2_goldens(binary, tmp_path):
    goldens = json.load(open(os.path.join(TEMPLATES, "goldens.json")))
    cases = [c for c in goldens["chats"] if c["template"] == "minimax_m3" and "error" not in c][:8]
    assert cases, "no M3 chat goldens"
    # A model dir with the M3 test tokenizer and the built-in M3 template file.
    d = tmp_path / "m"
    d.mkdir()
    (d / "tokenizer.json").write_bytes(open(M3_TOK, "rb").read())
    hf = Tokenizer.from_file(M3_TOK)
    for c in cases:
        req = {"messages": c["messages"], "add_generation_prompt": c["add_generation_prompt"],
               "chat_template_kwargs": c["kwargs"]}
        if c["tools"] is not None:
            req["tools"] = c["tools"]
        f = tmp_path / "req.json"
        f.write_text(json.dumps(req))
        got = run(binary, "tokenize", "--model", str(d), "--chat", str(f),
                  "--chat-template", os.path.join(TEMPLATES, "minimax_m3.jinja"))
        assert got["prompt"] == c["expected"], c["name"]
        assert got["ids"] == hf.encode(c["expected"], add_special_tokens=False).ids, c["name"]


def test_bad_inputs_give_one_line_errors(binary, tmp_path):
    for args in (["tokenize", "--model", str(tmp_path), "--text", "x"],
                 ["detokenize", "--model", M3_TOK, "--ids", "1,x"],
                 ["detokenize", "--model", M3_TOK, "--ids", "99999999"],
                 ["generate", "--model", str(tmp_path), "--prompt-ids", "1"],
                 ["generate", "--model", os.path.join(MODEL_GOLDENS, "m3_ratio"), "--prompt-ids", "1,999999"],
                 ["generate", "--model", os.path.join(MODEL_GOLDENS, "m3_ratio"), "--prompt-ids", ""]):
        p = run(binary, *args, ok=False)
        assert p.returncode != 0, args
        lines = [l for l in p.stderr.splitlines() if l.strip()]
        assert len(lines) == 1 and lines[0].startswith("m3serve: error:"), (args, p.stderr)


def test_generate_matches_transformers_goldens(binary):
    """The stable `generate` interface on the golden checkpoints: greedy ids identical and
    logprobs within the tolerance derived in tests/model/model_golden_test.cpp (2e-3)."""
    for name in ("msa_small_blocks", "m3_ratio"):
        g = json.load(open(os.path.join(MODEL_GOLDENS, name, "golden.json")))
        c = max(g["cases"], key=lambda c: len(c["prompt_ids"]))
        n = min(8, len(c["greedy_ids"]))
        out = run(binary, "generate", "--model", os.path.join(MODEL_GOLDENS, name), "--prompt-ids",
                  ",".join(map(str, c["prompt_ids"])), "--max-tokens", str(n), "--temperature", "0",
                  "--logprobs", "5", "--echo", "--json", "--ignore-eos", "--prefill-chunk", "37")
        assert out["prompt_ids"] == c["prompt_ids"]
        assert out["output_ids"] == c["greedy_ids"][:n]
        assert out["prompt_logprobs"][0] is None
        for got, want in zip(out["prompt_logprobs"][1:], c["prompt_logprobs"][1:]):
            assert got["token"] == want["token"]
            assert abs(got["logprob"] - want["logprob"]) < 2e-3
            assert len(got["top"]) == 5
            assert [t[0] for t in got["top"]][:1] == [t[0] for t in want["top"]][:1]
        for got, want in zip(out["output_logprobs"], c["greedy_logprobs"]):
            assert abs(got["logprob"] - want["logprob"]) < 2e-3
