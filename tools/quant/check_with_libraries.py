#!/usr/bin/env python3
"""Reads the quantized fixtures with the formats' own libraries and scores them with transformers
(issue #18: an independent reference for the loaders and for the drift of each format).

tools/quant/quantize_checkpoint.py writes the fixtures from the formats' definitions, and m3serve
reads them; if both misread a format the same way (a nibble order, a scale's sign or exponent
bias, a config group's format), the golden tests still pass. This script closes that loop:

 1. For each golden model and format it makes the fixture and its exact dequantisation (the
    reference m3serve's CPU forward equals bit for bit: tests/model/quant_golden_test).
 2. It dequantises every quantized linear of the fixture with the library that owns the format:
      compressed-tensors (mxfp4-ct, nvfp4-ct, fp8-channel): the config's quantization_config is
        parsed by compressed_tensors.QuantizationConfig, each module's scheme is found by the
        library's own target matching, and its compressor (by the group's format) decompresses
        the module's tensors (weight_packed / weight / weight_scale / weight_global_scale);
      Quark (mxfp4): amd-quark's Pack_fp4 unpacks the E2M1 codes, the E8M0 scales are decoded by
        torch's float8_e8m0fnu;
      ModelOpt (nvfp4): modelopt's NVFP4QTensor dequantises codes, block scales and the global
        scale (torch's e4m3 / e8m0 dtypes for the MXFP8 linears);
      mxfp8 (vLLM's quant_method, no Python library of its own): torch's float8_e4m3fn and
        float8_e8m0fnu dtypes.
    and compares them with the reference: equal, or within a few f32 roundings where the library
    forms a product in another order (compressed-tensors' NVFP4 divides by its global scale,
    m3serve multiplies by the reciprocal). compressed-tensors' NVFP4 compressor rounds its
    result to bf16: that result must lie within one bf16 ulp of the reference, and its own
    steps run in f32 (unpack_fp4_from_uint8 and dequantize) give the reading transformers runs.
 3. transformers (fp32, eager, CPU) runs the golden prompts over the library-dequantised weights:
    its logprobs against m3serve's on the stored fixture (`m3serve generate --echo --json
    --device cpu`), and both against the golden fp32 logprobs of the bf16 model (each format's
    drift, transformers' and m3serve's).

Needs torch, transformers (with minimax_m3_vl), safetensors, compressed-tensors; amd-quark and
nvidia-modelopt where present (else the step is reported as skipped, never silently replaced).
Usage (from the repository root):
  python3 tools/quant/check_with_libraries.py --m3serve build/release/bin/m3serve --out r.json
"""

import argparse
import collections
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import torch
from safetensors.torch import load_file, save_file

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FORMATS = ("mxfp8", "nvfp4", "mxfp4", "mxfp4-ct", "nvfp4-ct", "fp8-channel")
MODELS = ("msa_small_blocks", "m3_ratio")
SCALE_NAMES = (".weight_scale", ".weight_scale_inv", ".weight_packed")
F32_TOL = 2.0**-21  # a few f32 roundings, relative
BF16_ULP = 2.0**-7  # one bf16 ulp, relative (at most)


def module_tensors(sd, module):
    p = module + "."
    return {k[len(p):]: v for k, v in sd.items() if k.startswith(p) and "." not in k[len(p):]}


def quantized_modules(sd):
    mods = set()
    for k in sd:
        for suf in SCALE_NAMES:
            if k.endswith(suf):
                mods.add(k[: -len(suf)])
    return sorted(mods)


def e8m0(scale_u8):
    return scale_u8.view(torch.float8_e8m0fnu).float()


def mx8_weight(t):
    """MXFP8 by torch's dtypes: e4m3 codes x 2^(s - 127) per 1x32 block."""
    w = t["weight"].float()
    s = t["weight_scale_inv"] if "weight_scale_inv" in t else t["weight_scale"]
    return w * e8m0(s).repeat_interleave(32, dim=1)[:, : w.shape[1]]


def ct_weights(sd, qc):
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization.lifecycle.forward import dequantize
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.utils.match import match_name, match_targets

    cfg = QuantizationConfig.model_validate(qc)
    target_to_scheme = collections.OrderedDict()
    for scheme in cfg.config_groups.values():
        for t in scheme.targets:
            target_to_scheme[t] = scheme
    linear = torch.nn.Linear(1, 1)
    out, formats, rounded = {}, collections.Counter(), {}
    for m in quantized_modules(sd):
        if any(match_name(m, ign) for ign in (cfg.ignore or [])):
            raise SystemExit(f"{m} is quantized but the config ignores it")
        targets = match_targets(m, linear, target_to_scheme)
        if not targets:
            raise SystemExit(f"{m} is quantized but no config group targets it")
        scheme = target_to_scheme[targets[0]]
        fmt = scheme.format or cfg.format
        comp = BaseCompressor.get_value_from_registry(fmt)
        local = {k: v for k, v in module_tensors(sd, m).items() if k != "input_global_scale"}
        # compressed-tensors groups whole column blocks only; a width off the group grid (the
        # golden m3_ratio's 24-wide expert w2; M3's widths are all multiples of 32) is padded
        # with zero codes up to the scales' last block, and the result cut back.
        key = "weight_packed" if "weight_packed" in local else "weight"
        per_byte = 2 if key == "weight_packed" else 1
        cols = local[key].shape[1] * per_byte
        g = scheme.weights.group_size or cols
        if scheme.weights.strategy in ("group", "tensor_group") and cols % g:
            pad = torch.zeros(local[key].shape[0], (g - cols % g) // per_byte, dtype=torch.uint8)
            local[key] = torch.cat([local[key].view(torch.uint8), pad], 1).view(local[key].dtype)
            formats["padded to the group"] += 1
        w = comp.decompress(dict(local), scheme)["weight"].float()[:, :cols]
        if fmt == "nvfp4-pack-quantized":
            # The compressor returns bf16 (it unpacks to bf16 and rounds e2m1 * s / global);
            # that result must lie within one bf16 rounding of the reference, and the f32
            # reading (the compressor's own steps, unpacked to f32) is what transformers runs.
            rounded[m] = w
            packed = local["weight_packed"]
            x = unpack_fp4_from_uint8(packed, packed.shape[0], packed.shape[1] * 2, dtype=torch.float32)
            w = dequantize(x_q=x, scale=local["weight_scale"].float(), args=scheme.weights,
                           global_scale=local["weight_global_scale"], dtype=torch.float32)[:, :cols]
        out[m] = w
        formats[fmt] += 1
    return out, dict(formats), rounded


def quark_weights(sd):
    from quark.torch.utils.pack import create_pack_method

    pack = create_pack_method("per_group", "fp4")
    out = {}
    for m in quantized_modules(sd):
        t = module_tensors(sd, m)
        if t["weight"].dtype == torch.uint8:
            codes = pack.unpack(t["weight"], reorder=True)  # E2M1 values, f32
            out[m] = codes * e8m0(t["weight_scale"]).repeat_interleave(32, dim=1)[:, : codes.shape[1]]
        else:
            out[m] = mx8_weight(t)
    return out, {"quark Pack_fp4": sum(1 for t in out.values())}, {}


def modelopt_weights(sd):
    from modelopt.torch.quantization.qtensor import NVFP4QTensor

    out = {}
    for m in quantized_modules(sd):
        t = module_tensors(sd, m)
        if t["weight"].dtype == torch.uint8:
            packed = t["weight"]
            cols = packed.shape[1] * 2
            if cols % 16:  # whole blocks only: zero codes up to the scales' last block, cut back
                packed = torch.cat([packed, torch.zeros(packed.shape[0], (16 - cols % 16) // 2,
                                                        dtype=torch.uint8)], 1)
            q = NVFP4QTensor(torch.Size([packed.shape[0], packed.shape[1] * 2]), torch.float32, packed)
            out[m] = q.dequantize(dtype=torch.float32, scale=t["weight_scale"],
                                  double_scale=t["weight_scale_2"], block_sizes={-1: 16}).float()[:, :cols]
        else:
            out[m] = mx8_weight(t)
    return out, {"modelopt NVFP4QTensor": sum(1 for t in out.values())}, {}


def library_weights(fmt, qdir):
    sd = load_file(os.path.join(qdir, "model.safetensors"))
    qc = json.load(open(os.path.join(qdir, "config.json")))["quantization_config"]
    method = qc["quant_method"]
    if method == "compressed-tensors":
        return "compressed-tensors", *ct_weights(sd, qc)
    if method == "quark":
        return "amd-quark", *quark_weights(sd)
    if method == "modelopt":
        return "nvidia-modelopt", *modelopt_weights(sd)
    out = {m: mx8_weight(module_tensors(sd, m)) for m in quantized_modules(sd)}
    return "torch dtypes", out, {"mxfp8": len(out)}, {}


def bf16(x):
    return x.to(torch.bfloat16).float()


def compare(lib, ref, rel):
    """(#modules equal, #modules within `rel` of the reference elementwise, the largest
    elementwise |lib - ref| / |ref|)."""
    exact = within = 0
    worst = 0.0
    for m, w in lib.items():
        r = ref[m + ".weight"].float()
        assert w.shape == r.shape, (m, w.shape, r.shape)
        d = (w - r).abs()
        exact += bool(torch.equal(w, r))
        within += bool((d <= rel * r.abs()).all())
        nz = r != 0
        if (d[~nz] > 0).any():
            worst = math.inf
        elif nz.any():
            worst = max(worst, (d[nz] / r[nz].abs()).max().item())
    return exact, within, worst


def transformers_lps(model_dir, cases):
    from transformers import MiniMaxM3SparseForConditionalGeneration

    m = MiniMaxM3SparseForConditionalGeneration.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    out = []
    with torch.no_grad():
        for c in cases:
            ids = c["prompt_ids"]
            logits = m(input_ids=torch.tensor([ids]), use_cache=False).logits[0].double()
            lsm = torch.log_softmax(logits, dim=-1)
            out.append([None] + [lsm[i - 1, ids[i]].item() for i in range(1, len(ids))])
    return out


def m3serve_lps(binary, model_dir, cases):
    out = []
    for c in cases:
        cmd = [binary, "generate", "--model", model_dir, "--prompt-ids", ",".join(map(str, c["prompt_ids"])),
               "--max-tokens", "0", "--echo", "--json", "--device", "cpu"]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if p.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed: {p.stderr.strip()[-800:]}")
        out.append([None if e is None else e["logprob"] for e in json.loads(p.stdout)["prompt_logprobs"]])
    return out


def diffs(a, b):
    d = [abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb) if x is not None and y is not None]
    return (sum(d) / len(d), max(d)) if d else (0.0, 0.0)


def check(model, fmt, work, m3serve):
    src = os.path.join(ROOT, "tests", "golden", "model", model)
    qdir, ddir = os.path.join(work, model, fmt), os.path.join(work, model, fmt + "-deq")
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", "quant", "quantize_checkpoint.py"), src, qdir,
                    "--format", fmt, "--dequant-out", ddir], check=True, capture_output=True)
    library, lib, formats, rounded = library_weights(fmt, qdir)
    ref = load_file(os.path.join(ddir, "model.safetensors"))
    # f32 readings may differ from the reference by the order of one product (s / global vs
    # s * (1 / global)): a few f32 roundings.
    exact, within, worst = compare(lib, ref, F32_TOL)
    r = {"library": library, "modules": len(lib), "formats": formats, "exact": exact,
         "within_f32_rounding": within, "max_rel_diff": worst}
    if rounded:
        _, r["bf16_result_within_one_bf16_ulp"], r["bf16_result_max_rel_diff"] = compare(rounded, ref, BF16_ULP)
    # transformers over the library's reading: the bf16 checkpoint with each quantized linear
    # replaced by the library's dequantised weight.
    tdir = os.path.join(work, model, fmt + "-lib")
    os.makedirs(tdir, exist_ok=True)
    sd = load_file(os.path.join(src, "model.safetensors"))
    for m, w in lib.items():
        assert m + ".weight" in sd, m
        sd[m + ".weight"] = w.contiguous()
    save_file(sd, os.path.join(tdir, "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(os.path.join(src, "config.json"), tdir)
    cases = json.load(open(os.path.join(src, "golden.json")))["cases"]
    gold = [[None if e is None else e["logprob"] for e in c["prompt_logprobs"]] for c in cases]
    hf = transformers_lps(tdir, cases)
    r["transformers_drift_mean"], r["transformers_drift_max"] = diffs(gold, hf)
    if m3serve:
        # fp8-channel's stored form is compressed-tensors' per-channel fp8, which m3serve reads
        # as it holds --quantization fp8_per_channel of the bf16 checkpoint.
        ours = m3serve_lps(m3serve, qdir, cases)
        r["m3serve_drift_mean"], r["m3serve_drift_max"] = diffs(gold, ours)
        r["m3serve_vs_transformers_mean"], r["m3serve_vs_transformers_max"] = diffs(hf, ours)
    return r


def versions():
    v = {"python": platform.python_version(), "torch": torch.__version__, "numpy": np.__version__}
    for mod, name in (("transformers", "transformers"), ("compressed_tensors", "compressed-tensors"),
                      ("safetensors", "safetensors"), ("quark", "amd-quark"), ("modelopt", "nvidia-modelopt")):
        try:
            v[name] = __import__(mod).__version__
        except Exception as e:  # reported, and the format that needs it fails loudly below
            v[name] = f"not importable ({type(e).__name__})"
    return v


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--m3serve", default="", help="m3serve binary (adds m3serve's logprobs)")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    result = {"generator": "tools/quant/check_with_libraries.py", "versions": versions(), "results": {}}
    print(json.dumps(result["versions"]), flush=True)
    work = tempfile.mkdtemp(prefix="m3_quant_libcheck_")
    failed = False
    try:
        for model in args.models.split(","):
            for fmt in args.formats.split(","):
                r = check(model, fmt, work, args.m3serve)
                result["results"][f"{model}/{fmt}"] = r
                print(f"{model}/{fmt}: {json.dumps(r)}", flush=True)
                if r["within_f32_rounding"] != r["modules"] or r.get(
                        "bf16_result_within_one_bf16_ulp", r["modules"]) != r["modules"]:
                    failed = True
    finally:
        shutil.rmtree(work, ignore_errors=True)
    cols = ["library", "modules", "exact", "within_f32_rounding", "max_rel_diff", "transformers_drift_mean",
            "transformers_drift_max", "m3serve_drift_mean", "m3serve_drift_max", "m3serve_vs_transformers_max"]
    print("\n| model/format | " + " | ".join(cols) + " |\n|---|" + "---|" * len(cols))
    for k, r in result["results"].items():
        cells = [(f"{r[c]:.3g}" if isinstance(r.get(c), float) else str(r.get(c, ""))) for c in cols]
        print(f"| {k} | " + " | ".join(cells) + " |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
    if failed:
        print("FAILED: a library reads a fixture differently from m3serve's reference", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
