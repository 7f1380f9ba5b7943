#!/usr/bin/env python3
"""Time to first token of long prompts through `m3serve serve` (issue #16), never from the cache.

Starts `m3serve serve --model synthetic:layers=N --device cuda` (or connects to --url) and, for
each prompt length in --lengths, sends --repeat streaming /v1/completions requests one at a time,
each with its own random token ids (a different first token, so no prefix-cache block is shared),
max_tokens 1, and prints the TTFT of each beside the arithmetic the issue judges it by: the FLOPs
of the prompt (GEMMs per token, causal attention in the full-attention layers, MSA in the sparse
ones; M3's shapes as `synthetic:layers=N` builds them) at --tflops (600: about 77% of the bf16
GEMM ceiling measured on the H200).

With --decoders N it then measures what a long prompt does to streams already decoding (issue #16
item 4): N streaming requests decode (max_tokens large) while one prompt of the largest length
arrives; it prints the decoders' mean and largest gap between tokens before the prompt and while
it prefills (chunked by --max-num-batched-tokens).

Python standard library only: it runs on the GPU machine as is.
Example (GPU machine):
  python3 bench/bench_ttft.py --m3serve build/gpu/bin/m3serve --layers 4 --lengths 8192,32768,131072
"""
import argparse
import http.client
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_serve import wait_ready  # noqa: E402

# MiniMax-M3 shapes (m3-model.md §1-2), as `synthetic:layers=N` builds them.
H, NQ, NKV, D, E, TOPK, IE, ID, NI, DI, VOCAB = 6144, 64, 4, 128, 128, 4, 3072, 12288, 4, 128, 200064
DENSE_LAYERS = 3      # layers 0-2: full attention + dense MLP
MSA_KEYS = 16 * 128   # a sparse layer's query attends to at most 16 blocks of 128 tokens


def prompt_flops(layers, n):
    """FLOPs of one prefill of n tokens (no cache): 2 per multiply-add."""
    attn_proj = 2 * (2 * NQ * D * H + 2 * NKV * D * H)    # q, o, k, v
    index_proj = 2 * (NI + 1) * DI * H
    dense = 2 * 3 * ID * H
    moe = 2 * 3 * IE * H * (TOPK + 1) + 2 * E * H           # routed top-4 + shared + router
    total = 0.0
    for i in range(layers):
        total += n * attn_proj
        if i < DENSE_LAYERS:
            total += n * dense
            total += 2 * 2 * NQ * D * n * n / 2                 # causal QK^T and PV
        else:
            total += n * (index_proj + moe)
            total += 2 * NI * DI * n * n / 2                    # index scores (causal)
            total += n * 2 * 2 * NQ * D * min(n, MSA_KEYS)      # sparse attention
    return total


def ttft_once(host, port, model, ids, timeout):
    body = json.dumps({"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0,
                       "ignore_eos": True, "stream": True})
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    r = conn.getresponse()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {r.read()[:300]!r}")
    ttft = None
    while True:
        line = r.readline()
        if not line:
            break
        line = line.strip()
        if line.startswith(b"data:") and line[5:].strip() != b"[DONE]" and ttft is None:
            if json.loads(line[5:]).get("choices"):
                ttft = time.perf_counter() - t0
        if line == b"data: [DONE]":
            break
    conn.close()
    if ttft is None:
        raise RuntimeError("the stream ended without a token")
    return ttft


def decode_stream(host, port, model, ids, max_tokens, times, stop):
    """One streaming decoder: appends the arrival time of each token chunk to `times`."""
    body = json.dumps({"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True})
    conn = http.client.HTTPConnection(host, port, timeout=900)
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    r = conn.getresponse()
    while not stop.is_set():
        line = r.readline()
        if not line or line.strip() == b"data: [DONE]":
            break
        if line.startswith(b"data:"):
            times.append(time.perf_counter())
    conn.close()


def gaps(times, lo, hi):
    # Every gap that overlaps [lo, hi] (a stall longer than the window counts once).
    g = [b - a for a, b in zip(times, times[1:]) if a < hi and b > lo]
    return (1e3 * sum(g) / len(g), 1e3 * max(g)) if g else (float("nan"), float("nan"))


def decoders_during_prefill(host, port, model, n_dec, n_prompt, vocab, rng, timeout):
    stop = threading.Event()
    times = [[] for _ in range(n_dec)]
    threads = [threading.Thread(target=decode_stream,
                                args=(host, port, model, [rng.randrange(vocab) for _ in range(64)],
                                      4096, times[i], stop)) for i in range(n_dec)]
    for t in threads:
        t.start()
    time.sleep(3.0)  # steady decoding
    t0 = time.perf_counter()
    ttft = ttft_once(host, port, model, [rng.randrange(vocab) for _ in range(n_prompt)], timeout)
    t1 = t0 + ttft
    time.sleep(1.0)
    stop.set()
    for t in threads:
        t.join(timeout=120)
    before = [gaps(ts, t0 - 2.0, t0) for ts in times]
    during = [gaps(ts, t0, t1) for ts in times]
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    print(f"\n{n_dec} decoding streams while a {n_prompt}-token prompt prefills "
          f"(its TTFT {ttft:.3f} s):")
    print(f"  before: mean gap between tokens {mean([b[0] for b in before]):.2f} ms, "
          f"largest {max(b[1] for b in before):.2f} ms")
    print(f"  during: mean gap between tokens {mean([d[0] for d in during]):.2f} ms, "
          f"largest {max(d[1] for d in during):.2f} ms")
    return {"decoders": n_dec, "prompt": n_prompt, "ttft_s": ttft,
            "before_mean_ms": mean([b[0] for b in before]),
            "during_mean_ms": mean([d[0] for d in during]),
            "during_max_ms": max(d[1] for d in during)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", help="connect to a running server instead of starting one")
    ap.add_argument("--m3serve", default="build/gpu/bin/m3serve")
    ap.add_argument("--layers", type=int, default=4, help="synthetic:layers=N")
    ap.add_argument("--weights", default="bf16", choices=["bf16", "fp8", "mxfp8", "nvfp4", "mxfp4"],
                    help="synthetic:...,weights=W: the linears in a stored format")
    ap.add_argument("--port", type=int, default=8124)
    ap.add_argument("--lengths", default="8192,32768,131072", help="comma-separated prompt lengths")
    ap.add_argument("--repeat", type=int, default=2, help="requests per length (each its own prompt)")
    ap.add_argument("--tflops", type=float, default=600.0, help="the rate of the arithmetic column")
    ap.add_argument("--extra-args", default="", help="more m3serve serve flags")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--vocab", type=int, default=VOCAB, help="token ids are drawn below this")
    ap.add_argument("--decoders", type=int, default=0,
                    help="then: this many streams decode while the longest prompt prefills")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]

    proc = None
    host, port = "127.0.0.1", args.port
    if args.url:
        u = args.url.replace("http://", "").rstrip("/")
        host, port = u.split(":")[0], int(u.split(":")[1])
    else:
        # Room for the prompt and its output token, within M3's 1M positions.
        max_len = min(max(lengths) + 4096 + 128, 1 << 20)
        spec = f"synthetic:layers={args.layers}" + ("" if args.weights == "bf16" else f",weights={args.weights}")
        cmd = [args.m3serve, "serve", "--model", spec, "--device",
               "cuda", "--port", str(port), "--max-model-len", str(max_len)] + args.extra_args.split()
        print("starting:", " ".join(cmd), flush=True)
        proc = subprocess.Popen(cmd, stdout=sys.stderr, stderr=sys.stderr, start_new_session=True)
    results = []
    try:
        model = wait_ready(host, port, proc, 600)
        rng = random.Random(1)
        # A short request first: start-up work (graphs, pools) is not a prompt's TTFT.
        ttft_once(host, port, model, [rng.randrange(args.vocab) for _ in range(16)], args.timeout)
        print(f"\n{'tokens':>8} {'TTFT s':>9} {'arith s':>9} {'ratio':>6} {'TFLOP/s':>8}")
        for n in lengths:
            flops = prompt_flops(args.layers, n)
            arith = flops / (args.tflops * 1e12)
            for _ in range(args.repeat):
                ids = [rng.randrange(args.vocab) for _ in range(n)]
                t = ttft_once(host, port, model, ids, args.timeout)
                results.append({"tokens": n, "ttft_s": t, "arith_s": arith, "flops": flops})
                print(f"{n:>8} {t:>9.3f} {arith:>9.3f} {t / arith:>6.2f} {flops / t / 1e12:>8.1f}",
                      flush=True)
        if args.decoders:
            results.append(decoders_during_prefill(host, port, model, args.decoders, max(lengths),
                                                   args.vocab, rng, args.timeout))
    finally:
        if proc is not None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
    print(f"\narithmetic: FLOPs at {args.tflops:.0f} TFLOP/s; layers={args.layers} "
          f"({min(args.layers, DENSE_LAYERS)} full-attention dense + "
          f"{max(0, args.layers - DENSE_LAYERS)} MSA/MoE)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
