#!/usr/bin/env python3
"""Dense decode attention with PyTorch SDPA on the GPU: the baseline for bench_msa_decode.

One query token per sequence, 64 q heads over 4 KV heads of 128 (GQA 16), bf16 K/V, contexts 8K
to 1M tokens, batch 1 and 8: the time of torch.nn.functional.scaled_dot_product_attention per call
(CUDA events, warm loop, the same method as bench_msa_decode) and the K/V bytes it reads as GB/s.
GQA runs through enable_gqa=True where the installed torch has it, else K/V are expanded with
repeat_interleave outside the timed region (the timed call then reads 16x the bytes).
Usage: python3 bench/sdpa_reference.py [iters=20] [max_context=1048576]
"""
import sys

import torch
import torch.nn.functional as F

HEADS, KV_HEADS, DIM = 64, 4, 128


def time_ms(fn, iters):
    fn()
    fn()
    a = torch.cuda.Event(enable_timing=True)
    b = torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / iters


def main():
    iters = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    max_ctx = int(sys.argv[2]) if len(sys.argv) > 2 else 1 << 20
    dev = torch.device("cuda")
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name(0)}; SDPA decode, "
          f"{HEADS} q / {KV_HEADS} kv heads x {DIM}, bf16")
    print(f"{'batch':>5} {'context':>8} | {'sdpa ms':>9} {'GB/s':>8} | mode")
    for batch in (1, 8):
        for ctx in (8192, 131072, 524288, 1048576):
            if ctx > max_ctx:
                continue
            q = torch.randn(batch, HEADS, 1, DIM, device=dev, dtype=torch.bfloat16)
            k = torch.randn(batch, KV_HEADS, ctx, DIM, device=dev, dtype=torch.bfloat16)
            v = torch.randn_like(k)
            mode = "enable_gqa"
            try:
                F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
                fn = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731
            except (TypeError, RuntimeError):
                mode = "repeat_interleave"
                try:
                    ke = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
                    ve = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
                except torch.OutOfMemoryError:
                    print(f"{batch:>5} {ctx:>8} | {'oom':>9} {'':>8} | {mode}")
                    continue
                fn = lambda: F.scaled_dot_product_attention(q, ke, ve)  # noqa: E731
            # A single query attends to every key: no causal mask is needed.
            ms = time_ms(fn, iters if ctx < 524288 else max(2, iters // 4))
            kv_bytes = 2 * batch * KV_HEADS * ctx * DIM * 2
            print(f"{batch:>5} {ctx:>8} | {ms:9.4f} {kv_bytes / ms / 1e6:8.0f} | {mode}")
            del q, k, v
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
