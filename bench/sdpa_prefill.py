#!/usr/bin/env python3
"""Dense causal prefill attention with PyTorch SDPA: the anchor for bench_prefill_attn.

The same shapes: 64 q heads over 4 KV heads of 128 (GQA 16), bf16, one sequence; a prefill from
scratch of N tokens (is_causal) and the last 8192-token chunk of an N-token prompt over its
prefix (an explicit bottom-right causal mask is what that shape needs; SDPA's is_causal is
top-left, so the chunk runs with attn_mask = the causal band, which takes a slower backend than
the unmasked from-scratch shape). TFLOP/s by the same count as bench_prefill_attn (4 x heads x 128 x
the keys each query attends to). Usage: python3 bench/sdpa_prefill.py [iters=5]
[lengths=8192,32768,131072]
"""
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sdpa_reference import time_ms  # noqa: E402  (the same warm loop and CUDA events)

HEADS, KV_HEADS, DIM, CHUNK = 64, 4, 128, 8192


def main():
    iters = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    lengths = [int(x) for x in sys.argv[2].split(",")] if len(sys.argv) > 2 else [8192, 32768,
                                                                                  131072]
    dev = torch.device("cuda")
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name(0)}; SDPA causal prefill, "
          f"{HEADS} q / {KV_HEADS} kv heads x {DIM}, bf16, enable_gqa")
    print(f"{'shape':>7} {'context':>8} {'queries':>7} | {'sdpa ms':>9} {'TFLOP/s':>8}")
    for n in lengths:
        k = torch.randn(1, KV_HEADS, n, DIM, device=dev, dtype=torch.bfloat16)
        v = torch.randn(1, KV_HEADS, n, DIM, device=dev, dtype=torch.bfloat16)
        for shape in ("scratch", "chunk"):
            nq = n if shape == "scratch" else min(CHUNK, n)
            if shape == "chunk" and nq == n:
                continue
            first = n - nq
            q = torch.randn(1, HEADS, nq, DIM, device=dev, dtype=torch.bfloat16)
            flops = 4.0 * HEADS * DIM * sum(first + i + 1 for i in range(nq))
            it = max(1, iters // 2) if n >= 131072 else iters
            if shape == "scratch":
                fn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                            enable_gqa=True)
            else:
                rows = torch.arange(first, n, device=dev)[:, None]
                cols = torch.arange(n, device=dev)[None, :]
                mask = (cols <= rows)[None, None]
                fn = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                            enable_gqa=True)
            try:
                ms = time_ms(fn, it)
                print(f"{shape:>7} {n:8d} {nq:7d} | {ms:9.3f} {flops / ms / 1e9:8.1f}")
            except RuntimeError as e:  # e.g. out of memory for a masked backend
                print(f"{shape:>7} {n:8d} {nq:7d} | failed: {str(e).splitlines()[0]}")
            del q
        del k, v
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
