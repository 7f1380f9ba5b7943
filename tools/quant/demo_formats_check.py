#!/usr/bin/env python3
"""The demo model (models/demo) served by `m3serve serve` in each weight format: bf16 as shipped,
`--quantization fp8_per_channel`, and the MXFP8 / NVFP4 (ModelOpt) / MXFP4 (Quark) / MXFP4 and
NVFP4 (compressed-tensors) checkpoints tools/quant/quantize_checkpoint.py makes of it. Scores, greedy,
thinking disabled: arithmetic, lookup (docs/DEMO_MODEL.md's tasks), tool calls (exact name and
arguments) and passkeys at 1K tokens of filler; prints one markdown row per format with the
weight bytes the server reports at start-up (what docs/QUANTIZATION.md quotes).

Usage, from the repository root:
  python3 tools/quant/demo_formats_check.py [BINARY] [--device cpu|cuda] [--n 20] [--work DIR]
      [--formats bf16,nvfp4-ct,...]
"""
import argparse
import json
import os
import re
import subprocess
import sys
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "tools", "demo_model"))
import tasks  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("binary", nargs="?", default=os.path.join(REPO, "build", "release", "bin", "m3serve"))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--n", type=int, default=20, help="items per task kind")
    ap.add_argument("--work", default="/tmp/m3_demo_formats")
    ap.add_argument("--port", type=int, default=18779)
    ap.add_argument("--formats", default="bf16,fp8_per_channel,mxfp8,nvfp4,mxfp4,mxfp4-ct,nvfp4-ct",
                    help="comma-separated subset")
    args = ap.parse_args()
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(REPO, "models", "demo", "tokenizer.json"))
    items = tasks.eval_set(tasks.FillerLengths(tok))
    pick = {}
    for it in items:
        key = it["kind"] + ("" if it["kind"] != "passkey" else str(it["ctx"]))
        if it["mode"] != "disabled" or key not in ("arith", "lookup", "tool", "passkey1024"):
            continue
        if len(pick.setdefault(key, [])) < args.n:
            pick[key].append(it)
    demo = os.path.join(REPO, "models", "demo")
    wanted = args.formats.split(",")
    runs = [("bf16", demo, [])] + [("fp8_per_channel", demo, ["--quantization", "fp8_per_channel"])]
    runs = [r for r in runs if r[0] in wanted]
    for fmt in ("mxfp8", "nvfp4", "mxfp4", "mxfp4-ct", "nvfp4-ct"):
        if fmt not in wanted:
            continue
        out = os.path.join(args.work, fmt)
        subprocess.run([sys.executable, os.path.join(REPO, "tools", "quant", "quantize_checkpoint.py"),
                        demo, out, "--format", fmt], check=True, stdout=subprocess.DEVNULL)
        runs.append((fmt, out, []))
    print("| weights | start-up line | " + " | ".join(pick) + " |")
    print("|---|---|" + "---|" * len(pick))
    base = f"http://127.0.0.1:{args.port}/v1"
    for name, model, flags in runs:
        p = subprocess.Popen([args.binary, "serve", model, "--device", args.device, "--port", str(args.port),
                              "--tool-call-parser", "minimax_m3", "--enable-auto-tool-choice"] + flags,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = p.stdout.readline()
        if "listening" not in line:
            p.wait(timeout=60)
            raise SystemExit(f"{name}: did not start: {p.stderr.read()[-800:]}")
        model_id = json.load(urllib.request.urlopen(base + "/models", timeout=30))["data"][0]["id"]
        score = {}
        for kind, its in pick.items():
            ok = 0
            for it in its:
                body = {"model": model_id, "messages": it["messages"], "temperature": 0, "max_tokens": 72,
                        "chat_template_kwargs": {"thinking_mode": "disabled"}}
                if it["tools"]:
                    body["tools"] = it["tools"]
                req = urllib.request.Request(base + "/chat/completions", json.dumps(body).encode(),
                                             {"Content-Type": "application/json"})
                msg = json.load(urllib.request.urlopen(req, timeout=300))["choices"][0]["message"]
                if kind == "tool":
                    calls = [{"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}
                             for c in (msg.get("tool_calls") or [])]
                    ok += tasks.tool_call_correct(it, calls)
                else:
                    ok += tasks.answer_correct(it, msg.get("content"))
            score[kind] = f"{ok}/{len(its)}"
        p.terminate()
        _, err = p.communicate(timeout=60)
        weights = re.findall(r"(weights kept as stored.*|--quantization fp8_per_channel:.*)", err)
        print(f"| {name} | {weights[0].strip() if weights else 'bf16 as shipped'} | "
              + " | ".join(score[k] for k in pick) + " |", flush=True)


if __name__ == "__main__":
    main()
