#!/usr/bin/env python3
"""The 60-layer MiniMax-M3 decode step per GPU under TP8 / TP8 + EP, extrapolated (issue #17 item 3).

No machine with more than two H200s has been lent, so this is arithmetic over measured inputs,
each a flag (defaults: docs/PERFORMANCE.md, the runs of 2026-12-01):
  --bw          copy bandwidth of one H200, GB/s (bench_layer / bench_serve measure it each run)
  --eff B:E,..  the fraction of that bandwidth a rank's decode step reaches at batch B (measured:
                bench_layer bf16 TP1 one layer 51.8% / 86.3% / 96.0% / 92.7% at 1 / 8 / 64 / 256;
                TP2 ranks reached 40-62% in bench_tp: --eff-scale applies that loss)
  --ar-us       one all-reduce of a step's hidden rows (measured at TP2: 10-17 us; NVLink
                all-reduce latency grows with the rank count: 2x assumed for 8 ranks)
Bytes per rank and layer come from M3's shapes (m3-model.md) as m3serve shards them
(model/shard.h): q / o projections and the shared expert split 8 ways, the 4 KV heads and the
index projections replicated (TP8 > KV heads), the router replicated (fp32); routed experts
sliced 8 ways (TP8: every rank reads 1/8 of each active expert) or 16 whole experts per rank
(EP: a rank reads the active experts it holds; the step waits for the busiest rank, taken as
the expected maximum under uniform routing, by simulation). KV bytes: bf16 K/V of the rank's KV
head for the 3 dense layers over the whole context, the 16 selected blocks + the index-K scan
for the 57 MSA layers. Two all-reduces per layer (attention out, MLP out) + the lm_head
all-gather. Prints ms per step and tokens/s per deployment.
Usage: python3 tools/perf/tp8_step.py [--context 8192] [--batches 1,8,64,256] [--format bf16]
"""
import argparse
import random

H, NQ, NKV, D = 6144, 64, 4, 128
E, TOPK, IE, ID = 128, 4, 3072, 12288
NI, DI, VOCAB = 4, 128, 200064
DENSE, MOE = 3, 57
BLOCK, TOPB = 128, 16
RANKS = 8
WBYTES = {"bf16": 2.0, "fp8": 1.0, "mxfp8": 1.0 + 1 / 32, "nvfp4": 0.5 + 1 / 16}


def expected_distinct(batch, rng, trials=2000):
    """Expected distinct experts hit by `batch` tokens x top-4, and the expected largest count
    of distinct active experts on one EP rank (16 experts each)."""
    tot = mx = 0.0
    for _ in range(trials):
        hit = set()
        for _ in range(batch):
            hit.update(rng.sample(range(E), TOPK))
        tot += len(hit)
        per = [0] * RANKS
        for e in hit:
            per[e // (E // RANKS)] += 1
        mx += max(per)
    return tot / trials, mx / trials


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--batches", default="1,8,64,256")
    ap.add_argument("--bw", type=float, default=4200.0)
    ap.add_argument("--eff", default="1:0.518,8:0.863,64:0.960,256:0.927")
    ap.add_argument("--eff-scale", type=float, default=0.40 / 0.52,
                    help="TP2 rank efficiency over TP1's at batch 1 (bench_tp: 40%% vs 52%%)")
    ap.add_argument("--ar-us", type=float, default=30.0)
    ap.add_argument("--format", default="bf16", choices=sorted(WBYTES))
    args = ap.parse_args()
    eff = {int(k): float(v) for k, v in (x.split(":") for x in args.eff.split(","))}
    wb = WBYTES[args.format]
    rng = random.Random(0)
    bw = args.bw * 1e9
    print(f"M3 60 layers, decode, {args.format} weights, bf16 KV, context {args.context}, "
          f"{RANKS} ranks; copy bandwidth {args.bw:.0f} GB/s; all-reduce {args.ar_us:.0f} us")
    print(f"{'deploy':>8} {'batch':>5} | {'MB/rank':>8} {'eff':>5} | {'ms/step':>8} "
          f"{'tok/s':>8} {'TPOT ms':>8}")
    for b in [int(x) for x in args.batches.split(",")]:
        distinct, ep_max = expected_distinct(b, rng)
        attn = (H * NQ * D / RANKS * 2          # q_proj slice + o_proj slice
                + H * D * 2                     # k, v: the rank's (replicated) KV head
                ) * wb
        index = (H * NI * DI + H * DI) * wb     # index q / k projections, replicated
        router = H * E * 4                      # fp32, replicated
        shared = 3 * H * IE / RANKS * wb
        dense_mlp = 3 * H * ID / RANKS * wb
        kv_dense = args.context * D * 2 * 2 * b              # K + V of one KV head
        kv_msa = (TOPB * BLOCK * D * 2 * 2 + args.context * DI * 2) * b  # blocks + index-K scan
        lm_head = VOCAB * H / RANKS * 2
        e_eff = eff.get(b) or eff[min(eff, key=lambda k: abs(k - b))]
        e_eff *= args.eff_scale
        for deploy in ("TP8", "TP8+EP"):
            if deploy == "TP8":
                experts = distinct * 3 * H * IE / RANKS * wb
            else:
                experts = ep_max * 3 * H * IE * wb
            moe_layer = attn + index + router + shared + experts + kv_msa
            dense_layer = attn + dense_mlp + kv_dense
            step_bytes = MOE * moe_layer + DENSE * dense_layer + lm_head
            t = step_bytes / (bw * e_eff) + (2 * (MOE + DENSE) + 1) * args.ar_us * 1e-6
            print(f"{deploy:>8} {b:5d} | {step_bytes / 1e6:8.0f} {e_eff:5.2f} | {t * 1e3:8.2f} "
                  f"{b / t:8.0f} {t * 1e3:8.2f}")


if __name__ == "__main__":
    main()
