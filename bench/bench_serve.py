#!/usr/bin/env python3
"""Serve benchmark: C concurrent streaming /v1/completions against `m3serve serve`.

Starts `m3serve serve --model synthetic:layers=N --device cuda` (or connects to --url), sends C
concurrent streaming requests of a fixed token-id prompt with max_tokens output tokens and
ignore_eos, for each C in --concurrency, and prints per C: output tokens/s over the whole run,
mean time per output token (TPOT, per request: (last token - first token) / (tokens - 1)), the
decode TPOT (the same over only the tokens that arrived after every stream of the level had its
first token: steps that carry no other stream's prompt; tokens counted by the running usage of
continuous_usage_stats; "nan" when fewer than 8 such tokens came per request), mean time to first token (TTFT), and the bandwidth ceiling of a decode step: the weight bytes one
step of C sequences must read (all non-expert weights + the expected distinct routed experts)
divided by the measured device copy bandwidth (torch, else bench_cuda_ops, else --bandwidth-gbs).

Python standard library only (http.client, threading): it runs on the GPU machine as is.
Example (GPU machine):
  python3 bench/bench_serve.py --m3serve build/gpu/bin/m3serve --layers 4 --concurrency 1,16,64
"""
import argparse
import http.client
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.parse

# MiniMax-M3 shapes (docs m3-model.md §1-2), as `synthetic:layers=N` builds them.
H, NQ, NKV, D, E, TOPK, IE, ID, NI, DI, VOCAB = 6144, 64, 4, 128, 128, 4, 3072, 12288, 4, 128, 200064
BF16 = 2


def step_bytes(layers, concurrency, context, kv_elem_bytes=2):
    """Bytes one decode step of `concurrency` sequences reads: every non-expert weight once, the
    expected distinct experts (uniform routing: E * (1 - (1 - k/E)^C)) per MoE layer, the
    embedding rows, and the KV cache (K, V, index-K of kv_elem_bytes each: 2 = the bf16 default)
    of `context` tokens per sequence."""
    attn = (2 * NQ * D * H + 2 * NKV * D * H + 2 * D + 2 * H) * BF16
    index = ((NI + 1) * DI * H + 2 * DI) * BF16
    dense = 3 * ID * H * BF16
    shared = 3 * IE * H * BF16
    router = E * H * 4 + E * 4
    expert = 3 * IE * H * BF16
    distinct = E * (1.0 - (1.0 - TOPK / E) ** concurrency)
    total = VOCAB * H * BF16 + H * BF16  # lm_head + final norm
    total += concurrency * H * BF16      # embedding rows
    kv = 0
    for i in range(layers):
        total += attn
        sparse = i >= 3
        kv_tok = (2 * NKV * D + (DI if sparse else 0)) * kv_elem_bytes
        # MSA reads at most top-16 blocks of 128 tokens per KV head.
        seen = min(context, 16 * 128) if sparse else context
        kv += concurrency * seen * kv_tok
        if sparse:
            total += index
        total += (router + shared + distinct * expert) if i >= 3 else dense
    return total + kv


def draft_step_bytes(kv_heads, concurrency, context):
    """Bytes one EAGLE-3 draft step of `concurrency` sequences reads, for the synthetic draft of
    M3's shapes (model/eagle3_draft.h synthetic_eagle3_config: hidden H, 48 heads x 128, kv_heads
    KV heads, MLP 4H, fc 3H -> H): its own bf16 weights, the shared LM head (the target's, read
    again every draft step), the embedding rows and its bf16 KV of `context` tokens per
    sequence."""
    q, kv = 48 * D, kv_heads * D
    own = (3 * H * H + (q + 2 * kv) * 2 * H + H * q + 3 * H * 4 * H) * BF16 + 4 * H * 4
    return own + VOCAB * H * BF16 + concurrency * H * BF16 + concurrency * context * 2 * kv * BF16


def spec_cycle_bytes(layers, concurrency, context, k, kv_heads):
    """Bytes of one speculation cycle: the target's verify step over C x (1 + K) tokens (the
    routed experts' distinct count grows with the rows) and K draft steps (the context pass
    over the verified positions and K - 1 one-token steps)."""
    return (step_bytes(layers, concurrency * (k + 1), context)
            - (concurrency * k) * H * BF16  # the verify rows share their sequences' KV reads
            + k * draft_step_bytes(kv_heads, concurrency, context))


def parse_spec(cfg):
    """(K, acceptance length, KV heads) of a --speculative-config JSON, or None."""
    if not cfg:
        return None
    j = json.loads(cfg)
    kv = {"synthetic:mha": 48, "synthetic:gqa": 3}.get(j.get("model", ""))
    return (int(j["num_speculative_tokens"]), float(j.get("synthetic_acceptance_length", 0)), kv)


def measure_bandwidth(bench_cuda_ops):
    """Device copy bandwidth in GB/s (read + write), and how it was measured."""
    try:
        import torch  # noqa: the GPU machine has torch; everything else here is stdlib

        if torch.cuda.is_available():
            n = 1 << 30
            a = torch.empty(n, dtype=torch.uint8, device="cuda")
            b = torch.empty_like(a)
            for _ in range(3):
                b.copy_(a)
            torch.cuda.synchronize()
            reps = 20
            t0 = time.perf_counter()
            for _ in range(reps):
                b.copy_(a)
            torch.cuda.synchronize()
            dt = (time.perf_counter() - t0) / reps
            del a, b
            torch.cuda.empty_cache()
            return 2 * n / dt / 1e9, "torch 1 GiB device copy"
    except Exception as e:  # no torch / no GPU: fall through
        print(f"bench_serve: torch bandwidth probe unavailable ({e})", file=sys.stderr)
    if bench_cuda_ops and os.path.exists(bench_cuda_ops):
        out = subprocess.run([bench_cuda_ops], capture_output=True, text=True, timeout=300).stdout
        m = re.search(r"ceiling: device copy (\d+(?:\.\d+)?) GB/s", out)
        if m:
            return float(m.group(1)), "bench_cuda_ops device copy"
    return None, None


class Result:
    def __init__(self):
        self.ttft = None
        self.token_times = []
        self.token_counts = []  # completion tokens so far at each of token_times (running usage)
        self.tokens = 0
        self.retries = 0
        self.error = None


def one_request(host, port, model, prompt_ids, max_tokens, res, t_start):
    body = json.dumps({"model": model, "prompt": prompt_ids, "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True,
                                          "continuous_usage_stats": True}})
    # A burst of connects can overflow the server's listen queue (cpp-httplib 0.11 listens with a
    # backlog of 5) and the kernel then resets some; such a request never reached the server, so
    # it is sent again, and the wait counts in its TTFT.
    for attempt in range(20):
        try:
            conn = http.client.HTTPConnection(host, port, timeout=600)
            conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            r = conn.getresponse()
            break
        except (ConnectionResetError, ConnectionRefusedError, BrokenPipeError,
                http.client.RemoteDisconnected) as e:
            res.retries += 1
            if attempt == 19:
                res.error = repr(e)
                return
            time.sleep(0.01 * (attempt + 1))
    try:
        if r.status != 200:
            res.error = f"HTTP {r.status}: {r.read()[:300]!r}"
            return
        while True:
            line = r.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            now = time.perf_counter()
            j = json.loads(data)
            if j.get("usage"):
                res.tokens = j["usage"]["completion_tokens"]
            if j.get("choices"):
                # A chunk per engine step that produced text for this request; its running usage
                # (continuous_usage_stats) says how many tokens have come, so steps whose text
                # was held back (an incomplete UTF-8 character) still count.
                if res.ttft is None:
                    res.ttft = now - t_start
                res.token_times.append(now)
                res.token_counts.append((j.get("usage") or {}).get("completion_tokens",
                                                                   len(res.token_times)))
        conn.close()
    except Exception as e:
        res.error = repr(e)


def stream_prompt(prompt_ids, i):
    """Stream i's prompt: its own random ids, so streams share no prefix-cache page and (greedy)
    decode different tokens, as different users would (identical prompts would route every
    sequence of a step to the same experts)."""
    if i == 0:
        return prompt_ids
    rng = random.Random(i)
    return [rng.randrange(10, 2610) for _ in prompt_ids]


def run_level(host, port, model, prompt_ids, max_tokens, c, first_stream=0):
    results = [Result() for _ in range(c)]
    t0 = time.perf_counter()
    threads = [threading.Thread(target=one_request,
                                args=(host, port, model,
                                      stream_prompt(prompt_ids, first_stream + i), max_tokens,
                                      results[i], t0))
               for i in range(c)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    errs = [r.error for r in results if r.error]
    if errs:
        raise RuntimeError(f"{len(errs)} of {c} requests failed, first: {errs[0]}")
    total = sum(r.tokens for r in results)
    tpots = []
    for r in results:
        if len(r.token_times) >= 2 and r.tokens >= 2:
            tpots.append((r.token_times[-1] - r.token_times[0]) / (r.tokens - 1))
    # Decode TPOT: the same per-request mean over only the tokens that arrived once every stream
    # had its first token, i.e. the steps with no prompt of this level left to prefill (the
    # mean TPOT above also counts the steps that carried other streams' prefill chunks).
    firsts = [r.token_times[0] for r in results if r.token_times]
    t_all = max(firsts) if len(firsts) == c else None
    dec = []
    for r in results:
        late = [(t, n) for t, n in zip(r.token_times, r.token_counts)
                if t_all is not None and t >= t_all]
        if len(late) >= 2 and late[-1][1] - late[0][1] >= 7:  # at least 7 token gaps
            dec.append((late[-1][0] - late[0][0]) / (late[-1][1] - late[0][1]))
    ttfts = [r.ttft for r in results if r.ttft is not None]
    return {"concurrency": c, "requests": c, "output_tokens": total, "wall_s": wall,
            "output_tok_per_s": total / wall,
            "mean_tpot_ms": 1e3 * sum(tpots) / len(tpots) if tpots else float("nan"),
            "decode_tpot_ms": 1e3 * sum(dec) / len(dec) if dec else float("nan"),
            "mean_ttft_ms": 1e3 * sum(ttfts) / len(ttfts) if ttfts else float("nan"),
            "connect_retries": sum(r.retries for r in results)}


def wait_ready(host, port, proc, timeout):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"m3serve exited with {proc.returncode} before it was ready")
        try:
            conn = http.client.HTTPConnection(host, port, timeout=5)
            conn.request("GET", "/v1/models")
            r = conn.getresponse()
            body = json.loads(r.read())
            conn.close()
            if r.status == 200:
                return body["data"][0]["id"]
        except (OSError, ValueError, KeyError, http.client.HTTPException):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"m3serve not ready after {timeout} s")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", help="connect to a running server (http://host:port) instead of starting one")
    ap.add_argument("--m3serve", default="build/gpu/bin/m3serve", help="m3serve binary to start")
    ap.add_argument("--layers", type=int, default=4, help="synthetic:layers=N")
    ap.add_argument("--model", help="model to serve instead of synthetic:layers=N (e.g. models/demo "
                    "with --device cpu, to try the script without a GPU)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--concurrency", default="1,16,64", help="comma-separated C values")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=32, help="prompt length in token ids")
    ap.add_argument("--warmup", type=int, default=1, help="warm-up requests before measuring")
    ap.add_argument("--warmup-levels", action="store_true",
                    help="before each level's measured run, one unmeasured run of the same C and "
                         "max tokens (other prompts, so no prefix-cache hits): steady-state "
                         "numbers, with the level's step shapes (GEMM plans, CUDA graphs) seen")
    ap.add_argument("--extra-args", default="", help="more m3serve serve flags")
    ap.add_argument("--bench-cuda-ops", default="build/gpu/bin/bench_cuda_ops",
                    help="fallback bandwidth probe when torch is missing")
    ap.add_argument("--bandwidth-gbs", type=float, help="copy bandwidth to use for the ceiling")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--ready-timeout", type=float, default=300)
    ap.add_argument("--speculative-config", action="append", default=[],
                    help="serve also with this --speculative-config JSON (repeatable; each is one "
                    "more server after the one without speculation), e.g. '{\"method\": "
                    "\"eagle3\", \"model\": \"synthetic:gqa\", \"num_speculative_tokens\": 3, "
                    "\"rejection_sample_method\": \"synthetic\", "
                    "\"synthetic_acceptance_length\": 2.78}'")
    ap.add_argument("--compare-async", action="store_true",
                    help="run every level twice, on a server with async scheduling (the default) "
                    "and on one with --no-async-scheduling, and print both")
    a = ap.parse_args()
    levels = [int(x) for x in a.concurrency.split(",") if x]

    bw, bw_how = (a.bandwidth_gbs, "--bandwidth-gbs") if a.bandwidth_gbs else (None, None)
    if bw is None and not a.url:
        bw, bw_how = measure_bandwidth(a.bench_cuda_ops)  # before the server takes the GPU

    variants = [("", a.extra_args, None)]
    if a.compare_async:
        if a.url:
            sys.exit("bench_serve: --compare-async starts its own servers; drop --url")
        variants = [("async scheduling (default)", a.extra_args, None),
                    ("--no-async-scheduling", (a.extra_args + " --no-async-scheduling").strip(),
                     None)]
    if a.speculative_config:
        if a.url:
            sys.exit("bench_serve: --speculative-config starts its own servers; drop --url")
        if not variants[0][0]:
            variants[0] = ("no speculation", a.extra_args, None)
        for cfg in a.speculative_config:
            variants.append((f"--speculative-config {cfg}", a.extra_args, cfg))
    tables = []
    for label, extra, spec in variants:
        tables.append((label, serve_levels(a, levels, bw, extra, spec)))
    print()
    served = a.model or f"synthetic:layers={a.layers}"
    print(f"m3serve serve --model {served} --device {a.device}: prompt {a.prompt_len} "
          f"token ids, {a.max_tokens} output tokens (ignore_eos), greedy")
    if bw:
        print(f"ceiling: weight + KV bytes per decode step / {bw:.0f} GB/s ({bw_how}); "
              f"routed experts read = expected distinct of C x top-4 under uniform routing")
    for label, rows in tables:
        if label:
            print(f"-- {label}")
        print(f"{'C':>4} {'out tok/s':>10} {'TPOT ms':>9} {'TTFT ms':>9} {'GB/cycle':>8} "
              f"{'ceil tok/s':>11} {'ceil TPOT ms':>13} {'TPOT/ceil':>10} {'dec TPOT':>9} "
              f"{'dec/ceil':>9} {'retries':>8}")
        for r in rows:
            ceil = r.get("ceiling_tpot_ms")
            ratio = r["mean_tpot_ms"] / ceil if ceil else float("nan")
            dratio = r["decode_tpot_ms"] / ceil if ceil else float("nan")
            print(f"{r['concurrency']:>4} {r['output_tok_per_s']:>10.1f} {r['mean_tpot_ms']:>9.2f} "
                  f"{r['mean_ttft_ms']:>9.1f} {r['step_gb']:>8.2f} "
                  f"{r.get('ceiling_tok_per_s', float('nan')):>11.1f} "
                  f"{r.get('ceiling_tpot_ms', float('nan')):>13.2f} {ratio:>10.2f} "
                  f"{r['decode_tpot_ms']:>9.2f} {dratio:>9.2f} {r['connect_retries']:>8}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"layers": a.layers, "bandwidth_gbs": bw,
                       "variants": [{"label": l, "rows": r} for l, r in tables],
                       "rows": tables[0][1]}, f, indent=1)


def serve_levels(a, levels, bw, extra_args, spec=None):
    """Starts a server (unless --url) with `extra_args` (and `spec` as its --speculative-config)
    and measures every level on it."""
    proc = None
    if a.url:
        u = urllib.parse.urlparse(a.url)
        host, port = u.hostname, u.port or 80
    else:
        host, port = "127.0.0.1", a.port
        served = a.model or f"synthetic:layers={a.layers}"
        cmd = [a.m3serve, "serve", "--model", served, "--device", a.device,
               "--host", host, "--port", str(port), "--max-num-seqs", str(max(levels)),
               "--max-model-len", str(a.prompt_len + a.max_tokens + 128)] + extra_args.split()
        if spec:
            cmd += ["--speculative-config", spec]
        print("bench_serve: starting", " ".join(cmd), flush=True)
        proc = subprocess.Popen(cmd)
    try:
        model = wait_ready(host, port, proc, a.ready_timeout)
        prompt_ids = [(1000 + 37 * i) % 2600 + 10 for i in range(a.prompt_len)]
        for _ in range(a.warmup):
            run_level(host, port, model, prompt_ids, 8, 1)
        rows = []
        for c in levels:
            if a.warmup_levels:
                run_level(host, port, model, prompt_ids, a.max_tokens, c, first_stream=100000)
            r = run_level(host, port, model, prompt_ids, a.max_tokens, c)
            ctx = a.prompt_len + a.max_tokens // 2  # mean context over the decode
            r["step_gb"] = step_bytes(a.layers, c, ctx) / 1e9
            tokens_per_step = 1.0
            sp = parse_spec(spec)
            if sp and sp[1] > 0 and sp[2]:
                # Speculation at a synthetic acceptance length L: one cycle (verify + K draft
                # steps) yields L tokens per sequence.
                k, length, kv_heads = sp
                r["step_gb"] = spec_cycle_bytes(a.layers, c, ctx, k, kv_heads) / 1e9
                tokens_per_step = length
            if bw:
                step_s = r["step_gb"] / bw
                r["ceiling_tpot_ms"] = 1e3 * step_s / tokens_per_step
                r["ceiling_tok_per_s"] = c * tokens_per_step / step_s
            rows.append(r)
            print(json.dumps(r), flush=True)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()

    return rows


if __name__ == "__main__":
    main()
