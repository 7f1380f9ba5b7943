#!/usr/bin/env python3
"""One decode step of bench_layer per kernel, from Nsight Compute: runs ncu over the NVTX range
`decode b=B` of `bench_layer` (or reads a saved ncu --csv file) and prints a markdown table of
each kernel of one step (the second step in the range, so the first graph replay's warm-up is
left out): grid, time, DRAM bytes read + written and their rate against a given copy bandwidth.

  python3 bench/ncu_step.py --bench build/gpu/bench/bench_layer [--batch 1] [--bw 4180]
  python3 bench/ncu_step.py --bench build/gpu/bench/bench_step --args "4 2048 6 1" \
      --launch-count 160      # the whole step of synthetic:layers=4 (LM head, sampling)
  python3 bench/ncu_step.py --csv saved.csv [--bw 4180]

ncu's times are per kernel alone with the caches flushed between kernels (its default), so the
small kernels read from DRAM what a graph replay finds in L2; compare the sum with the step time
bench_layer prints without the profiler.
"""
import argparse
import csv
import io
import re
import subprocess
import sys

METRICS = ("gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,"
           "launch__grid_size,launch__block_size")


LAYER_ARGS = "8192 10 bf16 bfloat16 bfloat16 bf16 0"  # bench_layer: decode only, bf16


def run_ncu(bench, batch, ncu, args, count):
    cmd = [ncu, "--nvtx", "--nvtx-include", f"decode b={batch}/", "--launch-count", str(count),
           "--clock-control", "none", "--metrics", METRICS, "--csv", bench] + args.split()
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def kernels(text):
    lines = text.splitlines()
    head = [i for i, l in enumerate(lines) if l.startswith('"ID"')]
    if not head:
        sys.exit("ncu_step.py: no ncu rows in the input (did the NVTX range match?)")
    rows = csv.DictReader(io.StringIO("\n".join(l for l in lines[head[0]:] if l.startswith('"'))))
    out, seen = [], {}
    for r in rows:
        k = seen.get(r["ID"])
        if k is None:
            k = seen[r["ID"]] = {"name": r["Kernel Name"]}
            out.append(k)
        k[r["Metric Name"]] = float(r["Metric Value"].replace(",", ""))
    return out


def short(name):
    name = re.sub(r"\(anonymous namespace\)::|<?unnamed>::|m3::kernels::cuda::", "", name)
    return name.split("(")[0].replace("void ", "")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench", help="bench_layer binary (runs ncu)")
    ap.add_argument("--csv", help="a saved `ncu --csv` output instead")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--bw", type=float, default=4180.0, help="copy bandwidth, GB/s")
    ap.add_argument("--ncu", default="ncu")
    ap.add_argument("--args", default=LAYER_ARGS, help="the bench's arguments")
    ap.add_argument("--launch-count", type=int, default=80, help="kernels ncu profiles")
    a = ap.parse_args()
    if bool(a.bench) == bool(a.csv):
        sys.exit("ncu_step.py: give one of --bench or --csv")
    text = open(a.csv).read() if a.csv else run_ncu(a.bench, a.batch, a.ncu, a.args, a.launch_count)
    ks = kernels(text)
    # A step starts at the embedding; take the second one in the range.
    starts = [i for i, k in enumerate(ks) if "embedding" in k["name"]]
    if len(starts) < 2:
        sys.exit("ncu_step.py: fewer than two steps captured; raise --launch-count")
    step = ks[starts[1]:starts[2] if len(starts) > 2 else len(ks)]
    print("| # | kernel | grid x block | us | DRAM MB | GB/s | of copy bw |")
    print("|---|---|---|---|---|---|---|")
    tt = tb = 0.0
    for j, k in enumerate(step):
        t = k["gpu__time_duration.sum"] / 1e3
        b = (k["dram__bytes_read.sum"] + k["dram__bytes_write.sum"]) / 1e6
        tt, tb = tt + t, tb + b
        rate = b / t * 1e3 if t else 0.0
        print(f"| {j} | `{short(k['name'])}` | {int(k['launch__grid_size'])} x "
              f"{int(k['launch__block_size'])} | {t:.1f} | {b:.2f} | {rate:.0f} | "
              f"{100 * rate / a.bw:.0f}% |")
    rate = tb / tt * 1e3
    print(f"| | **step ({len(step)} launches)** | | **{tt:.1f}** | **{tb:.1f}** | {rate:.0f} | "
          f"{100 * rate / a.bw:.0f}% |")


if __name__ == "__main__":
    main()
