#!/usr/bin/env python3
"""TTFT of a re-sent long prefix: restored from the host KV tier vs recomputed (issue #21).

Starts `m3serve serve` twice on the given model (CPU by default): once with a small device pool
and a host tier (--kv-offloading-size), once with the same pool and no tier. Each run sends the
prefix once, floods the device pool with other prompts so the prefix is evicted, then re-sends
the prefix (a different last token) and times the first streamed token. Prints one line per run
and the ratio. Usage:
  python3 bench/host_tier_ttft.py [--bin build/release/bin/m3serve] [--model models/demo]
      [--prefix-tokens 8192] [--repeats 3] [--device cpu|cuda] [-- extra serve flags]
On the H200 (issue #21's numbers): --model synthetic:layers=4 --device cuda --prefix-tokens 32768
(the prompts' token ids stay below 2010, inside every model's vocabulary).
"""
import argparse
import json
import re
import statistics
import subprocess
import time
import urllib.request


def start(binary, model, args):
    p = subprocess.Popen([binary, "serve", model, "--host", "127.0.0.1", "--port", "0",
                          "--served-model-name", "m"] + args,
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = p.stdout.readline()
    m = re.search(r"listening on http://[^:]+:(\d+)", line)
    if not m:
        p.kill()
        raise SystemExit(f"m3serve did not start: {line!r}")
    bpt = int(re.search(r"(\d+) B/token", line).group(1))
    page = int(re.search(r"pages of (\d+)", line).group(1))
    return p, f"http://127.0.0.1:{m.group(1)}", bpt, page


def ttft(base, prompt):
    body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": 1, "temperature": 0,
                       "stream": True, "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(base + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    first = None
    cached = None
    with urllib.request.urlopen(req, timeout=600) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            d = json.loads(line[6:])
            if first is None and d.get("choices") and d["choices"][0].get("text") is not None:
                first = time.perf_counter() - t0
            if d.get("usage"):
                cached = d["usage"]["prompt_tokens_details"]["cached_tokens"]
    return first, cached


def run(binary, model, n, repeats, tier, extra):
    # Probe the bytes per token, then size the device pool to hold the prefix once plus a little.
    p, base, bpt, bs = start(binary, model, ["--max-model-len", str(n + 256)] + extra)
    p.terminate()
    p.wait()
    pages = (n + 256 + bs - 1) // bs
    args = ["--max-model-len", str(n + 256), "--kv-cache-memory-bytes", str(pages * bs * bpt)]
    if tier:
        args += ["--kv-offloading-size", str(4 * pages * bs * bpt / (1 << 30))]
    p, base, _, _ = start(binary, model, args + extra)
    try:
        times = []
        for rep in range(repeats):
            prefix = [(rep * 131 + i * 7) % 2000 + 10 for i in range(n)]
            ttft(base, prefix + [5])
            for f in range(2):  # two other prompts of the same length evict the prefix
                ttft(base, [(rep * 17 + f * 53 + i * 11) % 2000 + 10 for i in range(n)] + [5])
            t, cached = ttft(base, prefix + [6])
            times.append(t)
            print(f"  {'host tier' if tier else 'recompute'} rep {rep}: TTFT {t * 1000:.1f} ms, "
                  f"cached_tokens {cached}")
        return statistics.median(times)
    finally:
        p.terminate()
        p.wait()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="build/release/bin/m3serve")
    ap.add_argument("--model", default="models/demo")
    ap.add_argument("--prefix-tokens", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default=None, help="serve --device (cpu, cuda); default serve's")
    ap.add_argument("extra", nargs="*")
    a = ap.parse_args()
    extra = (["--device", a.device] if a.device else []) + a.extra
    restored = run(a.bin, a.model, a.prefix_tokens, a.repeats, True, extra)
    recomputed = run(a.bin, a.model, a.prefix_tokens, a.repeats, False, extra)
    print(f"re-sent {a.prefix_tokens}-token prefix{' on ' + a.device if a.device else ''}, "
          f"median TTFT: restored from host "
          f"{restored * 1000:.1f} ms, recomputed {recomputed * 1000:.1f} ms "
          f"({recomputed / restored:.1f}x)")


if __name__ == "__main__":
    main()
