#!/usr/bin/env python3
"""How far serving precisions move the golden models' logprobs (issue #15, item 6).

For every golden model directory (tests/golden/model/*: tiny random MiniMax-M3 checkpoints with
transformers' fp32 prompt logprobs in golden.json, made by make_model_goldens.py) this measures
the largest |logprob - fp32 logprob| over every prompt token of every case:

  --hf           transformers itself in bf16 (from_pretrained dtype=bfloat16, eager attention)
                 against transformers in fp32, both computed in this run (needs torch and
                 transformers with minimax_m3_vl: the GPU machine);
  --m3serve BIN  `m3serve generate --echo --json` under each serving precision (the default
                 bf16 GEMMs + bf16 KV, fp8 KV, fp8 KV + fp8 index-K, and the fp32 oracle mode)
                 against golden.json's fp32 values, on --device cpu or cuda.

Writes one JSON object (--out) and prints a markdown table. Usage:
  python3 tools/goldens/precision_drift.py --hf --m3serve build/gpu/bin/m3serve --device cuda \
      --out drift.json
  python3 tools/goldens/precision_drift.py --m3serve build/release/bin/m3serve --device cpu
"""

import argparse
import glob
import json
import os
import platform
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# name -> extra `m3serve generate` flags. The GPU defaults are bf16 GEMMs and a bf16 KV cache;
# on the CPU activations are always fp32, so there the KV formats are what differs.
MODES = {
    "default": [],
    "bf16_kv": ["--kv-cache-dtype", "bfloat16"],
    "fp8_kv": ["--kv-cache-dtype", "fp8"],
    "fp8_kv_fp8_index": ["--kv-cache-dtype", "fp8", "--indexer-kv-dtype", "fp8"],
    "fp32_oracle": ["--gemm-precision", "exact", "--kv-cache-dtype", "float32"],
}


def golden_dirs(root):
    return sorted(d for d in glob.glob(os.path.join(root, "*")) if os.path.exists(os.path.join(d, "golden.json")))


def max_drift(ref, got):
    """Largest |a - b| over positions where both have a value (entry 0 has none)."""
    worst = 0.0
    for a, b in zip(ref, got):
        if a is None or b is None:
            continue
        worst = max(worst, abs(float(a) - float(b)))
    return worst


def golden_lps(case):
    return [None if e is None else e["logprob"] for e in case["prompt_logprobs"]]


def m3serve_lps(binary, model_dir, ids, device, flags):
    cmd = [binary, "generate", "--model", model_dir, "--prompt-ids", ",".join(map(str, ids)),
           "--max-tokens", "0", "--echo", "--json", "--device", device] + flags
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed: {p.stderr.strip()[-500:]}")
    d = json.loads(p.stdout)
    return [None if e is None else e["logprob"] for e in d["prompt_logprobs"]]


def hf_drift(model_dir, cases):
    import torch
    from transformers import MiniMaxM3SparseForConditionalGeneration

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = {}
    lps = {}
    for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        m = MiniMaxM3SparseForConditionalGeneration.from_pretrained(
            model_dir, dtype=dt, attn_implementation="eager").to(device).eval()
        per_case = []
        with torch.no_grad():
            for c in cases:
                ids = c["prompt_ids"]
                x = torch.tensor([ids], dtype=torch.long, device=device)
                logits = m(input_ids=x, use_cache=False).logits[0].float()
                lsm = torch.log_softmax(logits, dim=-1)
                per_case.append([None] + [lsm[i - 1, ids[i]].item() for i in range(1, len(ids))])
        lps[name] = per_case
        del m
    out["hf_bf16_vs_hf_fp32"] = max(max_drift(a, b) for a, b in zip(lps["fp32"], lps["bf16"]))
    out["hf_fp32_vs_golden"] = max(max_drift(golden_lps(c), a) for c, a in zip(cases, lps["fp32"]))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--goldens", default=os.path.join(ROOT, "tests", "golden", "model"))
    ap.add_argument("--hf", action="store_true", help="measure transformers bf16 vs fp32")
    ap.add_argument("--m3serve", default=None, help="the m3serve binary to measure")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ",".join(MODES))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        if m not in MODES:
            raise SystemExit(f"unknown mode {m}; known: {', '.join(MODES)}")
    result = {"generator": "tools/goldens/precision_drift.py", "device": args.device,
              "python": platform.python_version(), "models": {}}
    if args.hf:
        import torch
        import transformers
        result["torch"] = torch.__version__
        result["transformers"] = transformers.__version__
        result["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    for d in golden_dirs(args.goldens):
        name = os.path.basename(d)
        g = json.load(open(os.path.join(d, "golden.json")))
        cases = g["cases"]
        r = {}
        if args.hf:
            r.update(hf_drift(d, cases))
        if args.m3serve:
            for m in modes:
                r["m3serve_" + m] = max(
                    max_drift(golden_lps(c), m3serve_lps(args.m3serve, d, c["prompt_ids"], args.device, MODES[m]))
                    for c in cases)
        result["models"][name] = r
        print(name, json.dumps(r), flush=True)
    cols = sorted({k for r in result["models"].values() for k in r})
    print("\n| model | " + " | ".join(cols) + " |")
    print("|---|" + "---|" * len(cols))
    for name, r in result["models"].items():
        print(f"| {name} | " + " | ".join(f"{r[c]:.4f}" if c in r else "" for c in cols) + " |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    sys.exit(main())
