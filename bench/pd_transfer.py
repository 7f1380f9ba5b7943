#!/usr/bin/env python3
"""Prefill/decode disaggregation over NIXL (issue #21 item 4): what the decode worker's first token
costs when the prompt's KV is read from a prefill worker, against computing the prompt itself.

Starts three `m3serve serve` processes on the given model: a single worker, a prefill worker
(kv_producer) and a decode worker (kv_consumer). For each repeat (a fresh prompt each time, so no
prefix cache helps) it times, with max_tokens 1:
  single   the whole prompt computed on one worker (its TTFT)
  prefill  the prefill worker's request (the prompt computed there, pages held)
  decode   the decode worker's request: read every page over NIXL + compute the last token
and checks that the decode worker read the pages (cached_tokens = prompt - 1). Prints one line per
repeat, the medians, the KV bytes moved per request and the read rate they imply. Usage:
  python3 bench/pd_transfer.py [--bin build/release/bin/m3serve] [--model models/demo]
      [--prompt-tokens 2048] [--repeats 3]
Needs NIXL (pip install --no-deps nixl-cu13).
"""
import argparse
import json
import re
import socket
import statistics
import subprocess
import time
import urllib.request


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def start(binary, model, args, env=None):
    import os
    p = subprocess.Popen([binary, "serve", model, "--host", "127.0.0.1", "--port", "0",
                          "--served-model-name", "m"] + args,
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                         env=dict(os.environ, **(env or {})))
    line = p.stdout.readline()
    m = re.search(r"listening on http://[^:]+:(\d+)", line)
    if not m:
        p.kill()
        raise SystemExit(f"m3serve did not start: {line!r}")
    bpt = int(re.search(r"(\d+) B/token", line).group(1))
    return p, f"http://127.0.0.1:{m.group(1)}", bpt


def timed(base, body):
    req = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        out = json.loads(r.read())
    return time.perf_counter() - t0, out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="build/release/bin/m3serve")
    ap.add_argument("--model", default="models/demo")
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    pd_cfg = lambda role: ["--kv-transfer-config",  # noqa: E731
                           json.dumps({"kv_connector": "NixlConnector", "kv_role": role})]
    side = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1"}
    procs = []
    try:
        single = start(a.bin, a.model, [])
        procs.append(single[0])
        prod = start(a.bin, a.model, pd_cfg("kv_producer"),
                     dict(side, VLLM_NIXL_SIDE_CHANNEL_PORT=str(free_port())))
        procs.append(prod[0])
        cons = start(a.bin, a.model, pd_cfg("kv_consumer"),
                     dict(side, VLLM_NIXL_SIDE_CHANNEL_PORT=str(free_port())))
        procs.append(cons[0])
        bpt = single[2]
        rows = []
        for r in range(a.repeats):
            # Token-id prompts of exactly --prompt-tokens (a distinct first token per repeat).
            prompt = [(7 * i + 13 * r + 5) % 2000 + 10 for i in range(a.prompt_tokens)]
            prompt[0] = 100 + r
            body = {"model": "m", "prompt": prompt, "max_tokens": 1, "temperature": 0}
            t_single, ref = timed(single[1], body)
            t_pre, pre = timed(prod[1], dict(body, kv_transfer_params={"do_remote_decode": True}))
            t_dec, dec = timed(cons[1], dict(body, kv_transfer_params=pre["kv_transfer_params"]))
            assert dec["usage"]["prompt_tokens_details"]["cached_tokens"] == a.prompt_tokens - 1, dec
            assert dec["choices"][0]["text"] == ref["choices"][0]["text"]
            rows.append((t_single, t_pre, t_dec))
            print(f"repeat {r}: single {t_single * 1e3:9.1f} ms   prefill {t_pre * 1e3:9.1f} ms   "
                  f"decode (read + last token) {t_dec * 1e3:8.1f} ms")
        med = [statistics.median(x[i] for x in rows) for i in range(3)]
        pages = -(-a.prompt_tokens // 128)
        moved = pages * 128 * bpt
        print(f"median over {a.repeats}: single {med[0] * 1e3:.1f} ms, prefill {med[1] * 1e3:.1f} ms, "
              f"decode {med[2] * 1e3:.1f} ms; {pages} pages = {moved / 2**20:.1f} MiB of KV read per "
              f"request ({moved / med[2] / 2**30:.2f} GiB/s counting the whole decode request)")
    finally:
        for p in procs:
            p.terminate()
            p.wait(timeout=30)


if __name__ == "__main__":
    main()
