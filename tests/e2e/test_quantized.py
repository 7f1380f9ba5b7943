"""The demo model in quantized weight formats through the real server (issue #18): the MXFP8 and
NVFP4 checkpoints tools/quant/quantize_checkpoint.py makes of models/demo (at test time, into a
temporary directory), and `--quantization fp8_per_channel` of models/demo itself. Each starts,
says at start-up which formats it holds and their bytes, and answers: arithmetic (greedy,
thinking disabled) scores within one item of the bf16 model on the same items, tool calls parse
to the right function, a streamed answer arrives. A --quantization that does not match the
checkpoint exits at once naming both."""

import os
import subprocess
import sys

import openai
import pytest

from conftest import REPO, Server

sys.path.insert(0, os.path.join(REPO, "tools", "demo_model"))
import tasks  # noqa: E402

DEMO = os.path.join(REPO, "models", "demo")
SCRIPT = os.path.join(REPO, "tools", "quant", "quantize_checkpoint.py")
N_ARITH = 6
N_TOOL = 3


@pytest.fixture(scope="module")
def items():
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(DEMO, "tokenizer.json"))
    ev = tasks.eval_set(tasks.FillerLengths(tok), n_passkey=0)
    arith = [it for it in ev if it["kind"] == "arith" and it["mode"] == "disabled"][:N_ARITH]
    tool = [it for it in ev if it["kind"] == "tool" and it["mode"] == "disabled"][:N_TOOL]
    return arith, tool


@pytest.fixture(scope="module")
def quant_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant_demo")
    out = {}
    for fmt in ("mxfp8", "nvfp4", "nvfp4-ct"):
        d = str(root / fmt)
        subprocess.run([sys.executable, SCRIPT, DEMO, d, "--format", fmt], check=True,
                       stdout=subprocess.DEVNULL)
        out[fmt] = d
    return out


def ask(client, it, **kw):
    return client.chat.completions.create(
        model="m3-e2e", messages=it["messages"], temperature=0, max_tokens=48,
        extra_body={"chat_template_kwargs": {"thinking_mode": "disabled"}}, **kw)


def scores(server, items):
    arith, tool = items
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="none")
    a = sum(tasks.answer_correct(it, ask(client, it).choices[0].message.content) for it in arith)
    names = []
    for it in tool:
        r = ask(client, it, tools=it["tools"])
        calls = r.choices[0].message.tool_calls or []
        names.append(calls[0].function.name if calls else None)
    return a, names, client


@pytest.fixture(scope="module")
def bf16_scores(binary, items):
    s = Server(binary, DEMO, ["--tool-call-parser", "minimax_m3", "--enable-auto-tool-choice"])
    try:
        a, names, _ = scores(s, items)
    finally:
        s.stop()
    return a, names


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4", "nvfp4-ct", "fp8_per_channel"])
def test_quantized_demo_serves_and_keeps_its_answers(binary, items, quant_dirs, bf16_scores, fmt):
    model = DEMO if fmt == "fp8_per_channel" else quant_dirs[fmt]
    flags = ["--tool-call-parser", "minimax_m3", "--enable-auto-tool-choice"]
    if fmt == "fp8_per_channel":
        flags += ["--quantization", "fp8_per_channel"]
    s = Server(binary, model, flags)
    try:
        log = "".join(s.log)
        if fmt == "fp8_per_channel":
            assert "--quantization fp8_per_channel: 106 fp8_per_channel linears" in log, log
            assert "were 13.98 MiB" in log, log
        elif fmt == "mxfp8":
            assert "weights kept as stored (quant_method mxfp8): 106 mxfp8 linears" in log, log
        elif fmt == "nvfp4-ct":
            assert "(quant_method compressed-tensors): 106 nvfp4 linears" in log, log
        else:
            assert "(quant_method modelopt): 34 mxfp8, 72 nvfp4 linears" in log, log
        # NVFP4 checkpoints carry activation scales (W4A4), the compressed-tensors one declares
        # them in its config group: the log says they are not used.
        assert ("NVFP4 linears run weight-only" in log) == (fmt == "nvfp4"), log
        assert ("group 'group_0' declares quantized input activations" in log) == (fmt == "nvfp4-ct"), log
        a, names, client = scores(s, items)
        want_a, want_names = bf16_scores
        assert abs(a - want_a) <= 1, f"{fmt}: arithmetic {a}/{N_ARITH}, bf16 {want_a}/{N_ARITH}"
        expected = [it["expect"]["name"] for it in items[1]]
        assert sum(n == e for n, e in zip(names, expected)) >= sum(
            n == e for n, e in zip(want_names, expected)) - 1, (fmt, names, want_names)
        chunks = list(ask(client, items[0][0], stream=True))
        text = "".join((c.choices[0].delta.content or "") for c in chunks if c.choices)
        assert text.strip(), f"{fmt}: empty streamed answer"
    finally:
        s.stop()


def test_quantization_flag_must_match_the_checkpoint(binary, quant_dirs):
    p = subprocess.run([binary, "serve", quant_dirs["nvfp4"], "--port", "0", "--quantization", "mxfp8"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    assert "--quantization mxfp8 does not match the checkpoint" in p.stderr, p.stderr
    assert "'modelopt'" in p.stderr, p.stderr
    p = subprocess.run([binary, "serve", quant_dirs["mxfp8"], "--port", "0", "--quantization",
                        "fp8_per_channel"], capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "already quantized" in p.stderr, p.stderr
