#!/usr/bin/env python3
"""The demo model's passkeys (2K and 3K tokens of filler) and arithmetic through `m3serve serve`
under each KV cache format (bf16 default, fp8 KV, fp8 KV + fp8 index-K): what docs/PERFORMANCE.md
"Serving precision" reports for the GPU. Usage, from the repository root:
  python3 tools/demo_model/kv_formats_check.py [BINARY] [--device cuda|cpu]
"""
import argparse
import json
import subprocess
import sys
import urllib.request

ap = argparse.ArgumentParser()
ap.add_argument("binary", nargs="?", default="build/gpu/bin/m3serve")
ap.add_argument("--device", default="cuda")
args = ap.parse_args()
sys.path.insert(0, "tools/demo_model")
import tasks
from tokenizers import Tokenizer
tok = Tokenizer.from_file("models/demo/tokenizer.json")
items = tasks.eval_set(tasks.FillerLengths(tok))
pk = [it for it in items if it["kind"] == "passkey" and it["ctx"] in (2048, 3072)]
ar = [it for it in items if it["kind"] == "arith" and it["mode"] == "disabled"][:10]
for fmt in (["--kv-cache-dtype", "auto"], ["--kv-cache-dtype", "fp8"], ["--kv-cache-dtype", "fp8", "--attention_config.indexer_kv_dtype", "fp8"]):
    p = subprocess.Popen([args.binary, "serve", "models/demo", "--device", args.device, "--port", "18777", "--kv-cache-memory-bytes", "2GiB"] + fmt,
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = p.stdout.readline()
    print(fmt, line[line.find("KV cache"):line.find("| max")], flush=True)
    name = json.load(urllib.request.urlopen("http://127.0.0.1:18777/v1/models", timeout=30))["data"][0]["id"]
    ok = {"passkey": 0, "arith": 0}
    for it in pk + ar:
        body = json.dumps({"model": name, "messages": it["messages"], "temperature": 0, "max_tokens": 24,
                           "chat_template_kwargs": {"thinking_mode": "disabled"}}).encode()
        r = json.load(urllib.request.urlopen(urllib.request.Request("http://127.0.0.1:18777/v1/chat/completions", body, {"Content-Type": "application/json"}), timeout=120))
        ok[it["kind"]] += tasks.answer_correct(it, r["choices"][0]["message"]["content"])
    print(f"  passkey {ok['passkey']}/{len(pk)} arith {ok['arith']}/{len(ar)}", flush=True)
    p.terminate(); p.wait(timeout=60)
