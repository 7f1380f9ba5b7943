#!/usr/bin/env python3
"""Acceptance length of the demo's EAGLE-3 draft (models/demo-eagle3) by task, measured the way
vLLM's benchmarks do: deltas of the /metrics counters vllm:spec_decode_num_drafts_total and
vllm:spec_decode_num_accepted_tokens_total around each task's requests (acceptance length =
1 + accepted / drafts). Starts two `m3serve serve` processes on the demo model (CPU), one with
--speculative-config, sends both the same greedy requests (the demo's evaluation prompts,
tasks.eval_set, passkeys included) and also counts how many answers are byte-identical.

    python3 tools/demo_model/eagle3_acceptance.py --bin build/release/bin/m3serve [--k 3]

Needs the `openai` package (as the e2e tests)."""
import argparse
import json
import os
import re
import subprocess
import sys
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import tasks  # noqa: E402


def start(binary, extra):
    args = [binary, "serve", os.path.join(REPO, "models", "demo"), "--host", "127.0.0.1", "--port",
            "0", "--served-model-name", "demo", "--reasoning-parser", "minimax_m3",
            "--tool-call-parser", "minimax_m3", "--enable-auto-tool-choice"] + extra
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = p.stdout.readline()
    m = re.search(r"listening on http://[^:]+:(\d+)", line)
    if not m:
        p.kill()
        raise SystemExit(f"m3serve did not start: {line!r}")
    return p, f"http://127.0.0.1:{m.group(1)}", line


def counters(base):
    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        text = r.read().decode()
    get = lambda n: float(re.search(r"^vllm:spec_decode_%s_total\{[^}]*\} (\S+)$" % n, text, re.M).group(1))
    return get("num_drafts"), get("num_accepted_tokens")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=os.path.join(REPO, "build", "release", "bin", "m3serve"))
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--n-task", type=int, default=20)
    ap.add_argument("--n-tool", type=int, default=20)
    ap.add_argument("--n-passkey", type=int, default=2)
    args = ap.parse_args()
    from openai import OpenAI

    draft = os.path.join(REPO, "models", "demo-eagle3")
    spec_cfg = json.dumps({"method": "eagle3", "model": draft, "num_speculative_tokens": args.k})
    plain_p, plain, _ = start(args.bin, [])
    spec_p, spec, line = start(args.bin, ["--speculative-config", spec_cfg])
    try:
        cp = OpenAI(base_url=plain + "/v1", api_key="none")
        cs = OpenAI(base_url=spec + "/v1", api_key="none")
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(os.path.join(REPO, "models", "demo", "tokenizer.json"))
        flen = tasks.FillerLengths(tok)
        items = tasks.eval_set(flen, n_task=args.n_task, n_tool=args.n_tool, n_passkey=args.n_passkey)
        rows = {}
        for it in items:
            key = (it["kind"], it["mode"])
            d0, a0 = counters(spec)
            outs = []
            t = {}
            for name, c in (("plain", cp), ("spec", cs)):
                t0 = time.time()
                r = c.chat.completions.create(
                    model="demo", messages=it["messages"], tools=it["tools"], temperature=0,
                    max_tokens=96, extra_body={"chat_template_kwargs": {"thinking_mode": it["mode"]}})
                t[name] = time.time() - t0
                m = r.choices[0].message
                outs.append((m.content, (m.model_extra or {}).get("reasoning"),
                             [(x.function.name, x.function.arguments) for x in (m.tool_calls or [])],
                             r.usage.completion_tokens))
            d1, a1 = counters(spec)
            row = rows.setdefault(key, dict(n=0, same=0, drafts=0, accepted=0, tokens=0, t_plain=0, t_spec=0))
            row["n"] += 1
            row["same"] += outs[0] == outs[1]
            row["drafts"] += d1 - d0
            row["accepted"] += a1 - a0
            row["tokens"] += outs[1][3]
            row["t_plain"] += t["plain"]
            row["t_spec"] += t["spec"]
        print(line.strip())
        print(f"\n| task | thinking | requests | identical text | output tokens | drafts | "
              f"acceptance length (K={args.k}) | seconds without / with drafts |")
        print("|---|---|---|---|---|---|---|---|")
        tot = dict(n=0, same=0, drafts=0, accepted=0, tokens=0, t_plain=0, t_spec=0)
        for (kind, mode), r in sorted(rows.items()):
            al = 1 + r["accepted"] / r["drafts"] if r["drafts"] else float("nan")
            print(f"| {kind} | {mode} | {r['n']} | {r['same']}/{r['n']} | {r['tokens']} | "
                  f"{int(r['drafts'])} | {al:.2f} | {r['t_plain']:.1f} / {r['t_spec']:.1f} |")
            for k in tot:
                tot[k] += r[k]
        print(f"| all | | {tot['n']} | {tot['same']}/{tot['n']} | {tot['tokens']} | {int(tot['drafts'])} | "
              f"{1 + tot['accepted'] / tot['drafts']:.2f} | {tot['t_plain']:.1f} / {tot['t_spec']:.1f} |")
    finally:
        for p in (plain_p, spec_p):
            p.terminate()
            p.wait(timeout=30)


if __name__ == "__main__":
    main()
