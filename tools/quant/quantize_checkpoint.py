#!/usr/bin/env python3
"""Quantize a bf16 MiniMax-M3 checkpoint into the stored formats m3serve reads (issue #18).

The formats are made by their definitions (docs/QUANTIZATION.md, m3-model.md §2.6-2.8), with the
real tensor names, dtypes, scale shapes and quantization_config of the published checkpoints:

  mxfp8      every quantized linear (attention q/k/v/o, index q/k, dense MLP, shared and routed
             experts) as float8_e4m3fn `weight` + uint8 E8M0 `weight_scale_inv` [out, ceil(in/32)];
             config.json quantization_config {quant_method: mxfp8, weight_block_size: [1, 32]}.
  nvfp4      ModelOpt mixed precision: routed experts NVFP4 (uint8 `weight` [out, in/2], two E2M1
             codes per byte, low nibble = even column; float8_e4m3fn `weight_scale` [out, in/16];
             f32 `weight_scale_2` []; f32 `input_scale` []), the other linears MXFP8;
             hf_quant_config.json + quantization_config {quant_method: modelopt}.
  mxfp4      AMD Quark: routed experts MXFP4 (uint8 `weight` [out, in/2] + uint8 E8M0
             `weight_scale` [out, ceil(in/32)]), the rest bf16; quant_method quark.
  mxfp4-ct   compressed-tensors: routed experts MXFP4 (format mxfp4-pack-quantized:
             `weight_packed` + uint8 E8M0 `weight_scale`), the other linears MXFP8 (format
             mxfp8-quantized: float8_e4m3fn `weight` + uint8 E8M0 `weight_scale`);
             quant_method compressed-tensors.
  nvfp4-ct   compressed-tensors NVFP4 (llm-compressor's NVFP4 scheme, format
             nvfp4-pack-quantized) on every quantized linear: `weight_packed`, float8_e4m3fn
             `weight_scale` [out, in/16], f32 `weight_global_scale` [1] = 448 * 6 / amax (the
             reciprocal of ModelOpt's weight_scale_2: W = e2m1 * fp8(s) / global), f32
             `input_global_scale` [1].
  fp8-channel  what `--quantization fp8_per_channel` makes at load (every linear, e4m3 with one
             f32 scale per output row: scale = amax_row / 448 in float32, 1 for a zero row,
             codes e4m3(w / scale)): only its --dequant-out reference is meaningful (m3serve
             quantizes the bf16 checkpoint itself); OUT gets compressed-tensors' per-channel fp8
             form (F8_E4M3 `weight` + F32 `weight_scale` [out, 1]).

Scale rules (no value saturates):
  nvfp4-ct             global = f32(448 * 6 / amax), shared (the smallest) by q | k | v and by
                       gate | up as llm-compressor does; block scale fp8(amax_block / 6 * global);
                       codes e2m1(w / (fp8(s) / global)); m3serve holds the global scale as
                       f32(1 / global), so the dequantised reference is e2m1 * (fp8(s) * that).
  E8M0 block exponent  e = clamp(ceil(log2(amax / emax)), -127, 127), stored e + 127, with emax
                       448 (e4m3) or 6 (e2m1); an all-zero block stores 127 (scale 1).
  NVFP4                weight_scale_2 = amax(tensor) / (448 * 6); block scale
                       fp8(amax_block / 6 / weight_scale_2); codes e2m1(w / (fp8(s) * g)) with
                       fp8(s) * g computed in float32 (a zero block scale gives zero codes).
  Element rounding     to nearest, ties to the even code, saturating (e4m3: 448, e2m1: 6).

--dequant-out also writes the same checkpoint with every quantized linear replaced by its exact
dequantisation in float32 (W = code * scale, computed in float32 in the order above): the
reference the golden tests compare m3serve's quantized forward against.

Usage: python3 tools/quant/quantize_checkpoint.py SRC_DIR OUT_DIR
           --format mxfp8|nvfp4|mxfp4|mxfp4-ct|nvfp4-ct|fp8-channel [--dequant-out DIR]
Needs numpy only (safetensors is read and written by hand: numpy has no bfloat16 or fp8).
"""

import argparse
import json
import os
import platform
import re
import shutil
import struct
import sys

import numpy as np

FORMATS = ("mxfp8", "nvfp4", "mxfp4", "mxfp4-ct", "nvfp4-ct", "fp8-channel")

# ---- safetensors by hand ----

DT_NP = {"F32": np.float32, "F16": np.float16, "U8": np.uint8, "I8": np.int8, "I32": np.int32,
         "I64": np.int64, "F64": np.float64, "BOOL": np.bool_}


def read_safetensors(path):
    """{name: (dtype_str, shape, raw bytes)} in file order, plus the metadata."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    meta = header.pop("__metadata__", None)
    out = {}
    for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        a, b = info["data_offsets"]
        out[name] = (info["dtype"], info["shape"], data[a:b])
    return out, meta


def write_safetensors(path, tensors, meta=None):
    header, offset, blobs = {}, 0, []
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
        blobs.append(raw)
    if meta:
        header["__metadata__"] = meta
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def to_f32(dtype, shape, raw):
    if dtype == "BF16":
        u = np.frombuffer(raw, dtype=np.uint16).astype(np.uint32) << 16
        return u.view(np.float32).reshape(shape)
    return np.frombuffer(raw, dtype=DT_NP[dtype]).astype(np.float32).reshape(shape)


# ---- element formats ----

def e4m3_value(code):
    """float32 value of an E4M3 ("fn") byte, 0..255 (NaN for S.1111.111)."""
    s, e, m = code >> 7, (code >> 3) & 15, code & 7
    if e == 15 and m == 7:
        v = float("nan")
    elif e == 0:
        v = m / 8.0 * 2.0 ** -6
    else:
        v = (1 + m / 8.0) * 2.0 ** (e - 7)
    return -v if s else v


E4M3_POS = np.array([e4m3_value(c) for c in range(127)], dtype=np.float32)  # codes 0..126 (<= 448)
E2M1_POS = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=np.float32)


def round_to_codes(x, table):
    """Codes of `x` (float32 array) in a sign-magnitude format whose non-negative values are
    `table` (ascending, code = index): nearest, ties to the even code, saturating at the top.
    Returns (codes with the sign bit set for negatives, sign bit value)."""
    a = np.abs(x)
    hi = np.searchsorted(table, a, side="left")            # first table value >= a
    hi = np.clip(hi, 0, len(table) - 1)
    lo = np.clip(hi - 1, 0, len(table) - 1)
    exact_or_top = table[hi] <= a                          # a equals table[hi], or a is beyond the top
    d_lo, d_hi = a - table[lo], table[hi] - a
    pick = np.where(d_lo < d_hi, lo, np.where(d_hi < d_lo, hi, np.where(lo % 2 == 0, lo, hi)))
    code = np.where(exact_or_top, hi, pick).astype(np.uint8)
    return code, np.signbit(x)


def to_e4m3(x):
    code, neg = round_to_codes(x.astype(np.float32), E4M3_POS)
    return (code | (neg.astype(np.uint8) << 7)).astype(np.uint8)


def e4m3_to_f32(codes):
    table = np.array([e4m3_value(c) for c in range(256)], dtype=np.float32)
    return table[codes]


def to_e2m1(x):
    code, neg = round_to_codes(x.astype(np.float32), E2M1_POS)
    return (code | (neg.astype(np.uint8) << 3)).astype(np.uint8)


def e2m1_to_f32(codes):
    table = np.concatenate([E2M1_POS, -E2M1_POS]).astype(np.float32)
    return table[codes & 15]


def blocks(w, size):
    """w [rows, cols] -> [rows, nblk, size] zero-padded, and nblk."""
    rows, cols = w.shape
    nblk = -(-cols // size)
    p = np.zeros((rows, nblk * size), dtype=np.float32)
    p[:, :cols] = w
    return p.reshape(rows, nblk, size), nblk


def e8m0_exponents(amax, emax):
    """Stored E8M0 bytes (e + 127) with e = ceil(log2(amax / emax)), zero blocks -> 127."""
    with np.errstate(divide="ignore"):
        e = np.ceil(np.log2(amax.astype(np.float64) / emax))
    e = np.where(amax > 0, e, 0)
    return (np.clip(e, -127, 127) + 127).astype(np.uint8)


def e8m0_to_f32(s):
    return np.ldexp(np.float32(1), s.astype(np.int32) - 127).astype(np.float32)


def quant_mx(w, elem):
    """MXFP8 (elem 'e4m3') or MXFP4 (elem 'e2m1'): (codes, scales, dequantised f32)."""
    emax = 448.0 if elem == "e4m3" else 6.0
    b, nblk = blocks(w, 32)
    s = e8m0_exponents(np.abs(b).max(axis=2), emax)        # [rows, nblk]
    sc = e8m0_to_f32(s)[:, :, None]
    scaled = (b / sc).astype(np.float32)                     # exact: division by a power of two
    if elem == "e4m3":
        q = to_e4m3(scaled)
        deq = e4m3_to_f32(q) * sc
    else:
        q = to_e2m1(scaled)
        deq = e2m1_to_f32(q) * sc
    rows, cols = w.shape
    q = q.reshape(rows, -1)[:, :cols]
    deq = deq.reshape(rows, -1)[:, :cols].astype(np.float32)
    return q, s, deq


def quant_fp8_channel(w):
    """(codes, f32 scales [rows, 1], dequantised f32)."""
    amax = np.abs(w).max(axis=1).astype(np.float32)
    sc = np.where(amax > 0, amax / np.float32(448.0), np.float32(1.0)).astype(np.float32)[:, None]
    q = to_e4m3((w / sc).astype(np.float32))
    return q, sc, (e4m3_to_f32(q) * sc).astype(np.float32)


def quant_nvfp4(w):
    """(packed codes, fp8 block scales, global scale, dequantised f32)."""
    rows, cols = w.shape
    amax = float(np.abs(w).max())
    g = np.float32(amax / (448.0 * 6.0)) if amax > 0 else np.float32(1.0)
    b, nblk = blocks(w, 16)
    s = to_e4m3((np.abs(b).max(axis=2) / np.float32(6.0) / g).astype(np.float32))  # [rows, nblk]
    bs = (e4m3_to_f32(s) * g).astype(np.float32)[:, :, None]  # the block's scale, float32
    with np.errstate(divide="ignore", invalid="ignore"):
        scaled = np.where(bs > 0, b / np.where(bs > 0, bs, 1), 0).astype(np.float32)
    q = to_e2m1(scaled)
    deq = (e2m1_to_f32(q) * bs).astype(np.float32)
    q = q.reshape(rows, -1)[:, :cols]
    deq = deq.reshape(rows, -1)[:, :cols]
    return pack_e2m1(q), s, g, deq


def nvfp4_ct_global(w):
    amax = np.float32(np.abs(w).max())
    return np.float32(np.float32(448.0 * 6.0) / amax) if amax > 0 else np.float32(1.0)


def quant_nvfp4_ct(w, G):
    """compressed-tensors' NVFP4 with global scale G: (packed codes, fp8 block scales, G, the
    dequantised f32 as m3serve reads it: e2m1 * (fp8(s) * f32(1 / G)))."""
    rows, cols = w.shape
    b, nblk = blocks(w, 16)
    s = to_e4m3((np.abs(b).max(axis=2) / np.float32(6.0) * G).astype(np.float32))
    bs = (e4m3_to_f32(s) / G).astype(np.float32)[:, :, None]  # what the codes are made against
    with np.errstate(divide="ignore", invalid="ignore"):
        scaled = np.where(bs > 0, b / np.where(bs > 0, bs, 1), 0).astype(np.float32)
    q = to_e2m1(scaled)
    g_held = np.float32(np.float32(1.0) / G)
    deq = (e2m1_to_f32(q) * (e4m3_to_f32(s) * g_held).astype(np.float32)[:, :, None]).astype(np.float32)
    q = q.reshape(rows, -1)[:, :cols]
    deq = deq.reshape(rows, -1)[:, :cols]
    return pack_e2m1(q), s, G, deq


# llm-compressor gives the linears vLLM fuses one global scale (the smallest, i.e. that of the
# largest amax): q | k | v of an attention, gate | up of an MLP. The MSA index projections and
# the routed experts (w1 / w3) keep their own.
FUSED_GLOBAL = re.compile(r"^(.*\.)(self_attn\.(q|k|v)_proj|"
                          r"(mlp|block_sparse_moe|block_sparse_moe\.shared_experts)\.(gate|up)_proj)\.weight$")


def nvfp4_ct_globals(tensors):
    own = {n: nvfp4_ct_global(to_f32(*tensors[n])) for n in tensors if kind_of(n, "nvfp4-ct")}
    group = {}
    for n in own:
        m = FUSED_GLOBAL.match(n)
        key = (m.group(1) + ("attn" if m.group(2).startswith("self_attn") else m.group(4))) if m else n
        group.setdefault(key, []).append(n)
    out = {}
    for names in group.values():
        g = min(own[n] for n in names)
        for n in names:
            out[n] = g
    return out


def pack_e2m1(q):
    """[rows, cols] codes -> [rows, cols / 2] bytes, low nibble = even column."""
    assert q.shape[1] % 2 == 0, "4-bit formats need an even number of columns"
    return (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8)


# ---- which tensors ----

LINEAR = re.compile(
    r"^(language_model\.)?model\.layers\.\d+\.(self_attn\.(q|k|v|o|index_q|index_k)_proj|"
    r"(mlp|block_sparse_moe)\.(gate|up|down)_proj|"
    r"block_sparse_moe\.shared_experts\.(gate|up|down)_proj|"
    r"block_sparse_moe\.experts\.\d+\.w[123])\.weight$")
EXPERT = re.compile(r"block_sparse_moe\.experts\.\d+\.w[123]\.weight$")


def kind_of(name, fmt):
    """How `name` is stored in `fmt`: None (as is), 'mxfp8', 'mxfp8-ct', 'nvfp4', 'nvfp4-ct',
    'mxfp4', 'mxfp4-ct', 'fp8-channel'."""
    if not LINEAR.search(name):
        return None
    expert = bool(EXPERT.search(name))
    if fmt == "mxfp8":
        return "mxfp8"
    if fmt == "nvfp4":
        return "nvfp4" if expert else "mxfp8"
    if fmt == "mxfp4":
        return "mxfp4" if expert else None
    if fmt == "fp8-channel":
        return "fp8-channel"
    if fmt == "nvfp4-ct":
        return "nvfp4-ct"
    return "mxfp4-ct" if expert else "mxfp8-ct"


def quant_config(fmt, names, root):
    if fmt == "fp8-channel":
        return {"quant_method": "compressed-tensors", "format": "float-quantized",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                    "num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True}}},
                "ignore": [root + "lm_head", root + "model.embed_tokens"]}
    ignored = [root + "lm_head", root + "model.embed_tokens", "vision_tower", "multi_modal_projector",
               "patch_merge_mlp"] + sorted(
        {n[: -len(".weight")] for n in names if n.endswith("block_sparse_moe.gate.weight")})
    if fmt == "mxfp8":
        return {"quant_method": "mxfp8", "activation_scheme": "dynamic",
                "weight_block_size": [1, 32], "ignored_layers": ignored}
    if fmt == "nvfp4":
        return {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION"}
    if fmt == "mxfp4":
        mx = {"dtype": "fp4", "qscheme": "per_group", "group_size": 32, "scale_format": "e8m0",
              "is_dynamic": False}
        return {"quant_method": "quark", "export": {"pack_method": "reorder", "weight_format": "real_quantized"},
                "global_quant_config": {"weight": mx, "input_tensors": None, "output_tensors": None},
                "layer_quant_config": {}, "exclude": ignored + ["*self_attn*", "*mlp*", "*shared_experts*"]}
    if fmt == "nvfp4-ct":
        fp4 = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16,
               "symmetric": True, "dynamic": False, "observer": "minmax"}
        return {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
                "quantization_status": "compressed",
                "config_groups": {"group_0": {
                    "format": "nvfp4-pack-quantized", "targets": ["Linear"], "weights": fp4,
                    "input_activations": dict(fp4, dynamic="local")}},
                "ignore": ignored}
    return {"quant_method": "compressed-tensors", "format": "mixed-precision",
            "quantization_status": "compressed",
            "config_groups": {
                "group_0": {"format": "mxfp4-pack-quantized", "targets": ["re:.*experts\\.\\d+\\.w[123]$"],
                            "weights": {"num_bits": 4, "type": "float", "strategy": "group",
                                        "group_size": 32, "symmetric": True, "scale_dtype": "uint8"}},
                "group_1": {"format": "mxfp8-quantized", "targets": ["Linear"],
                            "weights": {"num_bits": 8, "type": "float", "strategy": "group",
                                        "group_size": 32, "symmetric": True, "scale_dtype": "uint8"}}},
            "ignore": ignored}


def hf_quant_config(names):
    layers = {}
    for n in names:
        k = kind_of(n, "nvfp4")
        if k:
            m = n[: -len(".weight")]
            layers[m] = {"quant_algo": "NVFP4", "group_size": 16} if k == "nvfp4" else {"quant_algo": "MXFP8"}
    return {"producer": {"name": "modelopt", "version": "m3serve tools/quant/quantize_checkpoint.py"},
            "quantization": {"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": None,
                             "quantized_layers": layers}}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("src")
    ap.add_argument("out")
    ap.add_argument("--format", required=True, choices=FORMATS)
    ap.add_argument("--dequant-out", default="")
    args = ap.parse_args()

    files = sorted(f for f in os.listdir(args.src) if f.endswith(".safetensors"))
    assert files == ["model.safetensors"], f"one model.safetensors expected in {args.src}, found {files}"
    tensors, meta = read_safetensors(os.path.join(args.src, "model.safetensors"))
    root = "language_model." if any(n.startswith("language_model.") for n in tensors) else ""

    out, deq_out = {}, {}
    counts = {}
    ct_globals = nvfp4_ct_globals(tensors) if args.format == "nvfp4-ct" else {}
    for name, (dtype, shape, raw) in tensors.items():
        kind = kind_of(name, args.format)
        if kind is None:
            out[name] = deq_out[name] = (dtype, shape, raw)
            continue
        counts[kind] = counts.get(kind, 0) + 1
        w = to_f32(dtype, shape, raw)
        base = name[: -len(".weight")]
        if kind in ("mxfp8", "mxfp8-ct"):
            q, s, deq = quant_mx(w, "e4m3")
            out[name] = ("F8_E4M3", shape, q.tobytes())
            key = base + ".weight_scale" if kind == "mxfp8-ct" else name + "_scale_inv"
            out[key] = ("U8", list(s.shape), s.tobytes())
        elif kind == "fp8-channel":
            q, sc, deq = quant_fp8_channel(w)
            out[name] = ("F8_E4M3", shape, q.tobytes())
            out[base + ".weight_scale"] = ("F32", list(sc.shape), sc.tobytes())
        elif kind in ("mxfp4", "mxfp4-ct"):
            q, s, deq = quant_mx(w, "e2m1")
            p = pack_e2m1(q)
            key = base + (".weight_packed" if kind == "mxfp4-ct" else ".weight")
            out[key] = ("U8", list(p.shape), p.tobytes())
            out[base + ".weight_scale"] = ("U8", list(s.shape), s.tobytes())
        elif kind == "nvfp4-ct":
            p, s, G, deq = quant_nvfp4_ct(w, ct_globals[name])
            out[base + ".weight_packed"] = ("U8", list(p.shape), p.tobytes())
            out[base + ".weight_scale"] = ("F8_E4M3", list(s.shape), s.tobytes())
            out[base + ".weight_global_scale"] = ("F32", [1], np.float32(G).tobytes())
            out[base + ".input_global_scale"] = ("F32", [1], np.float32(1.0).tobytes())
        else:
            p, s, g, deq = quant_nvfp4(w)
            out[name] = ("U8", list(p.shape), p.tobytes())
            out[base + ".weight_scale"] = ("F8_E4M3", list(s.shape), s.tobytes())
            out[base + ".weight_scale_2"] = ("F32", [], np.float32(g).tobytes())
            out[base + ".input_scale"] = ("F32", [], np.float32(1.0).tobytes())
        deq_out[name] = ("F32", shape, deq.astype(np.float32).tobytes())

    provenance = {"script": "tools/quant/quantize_checkpoint.py", "format": args.format,
                  "source": os.path.basename(os.path.normpath(args.src)), "counts": counts,
                  "versions": {"python": platform.python_version(), "numpy": np.__version__}}
    for d, ts, quantized in ((args.out, out, True), (args.dequant_out, deq_out, False)):
        if not d:
            continue
        os.makedirs(d, exist_ok=True)
        for f in os.listdir(args.src):
            if f.endswith(".safetensors") or f in ("golden.json", "tensors.txt"):
                continue
            if os.path.isfile(os.path.join(args.src, f)):
                shutil.copy(os.path.join(args.src, f), os.path.join(d, f))
        write_safetensors(os.path.join(d, "model.safetensors"), ts, meta)
        if quantized:
            cfg_path = os.path.join(d, "config.json")
            with open(cfg_path) as f:
                cfg = json.load(f)
            cfg["quantization_config"] = quant_config(args.format, list(tensors), root)
            with open(cfg_path, "w") as f:
                json.dump(cfg, f, indent=2)
            if args.format == "nvfp4":
                with open(os.path.join(d, "hf_quant_config.json"), "w") as f:
                    json.dump(hf_quant_config(list(tensors)), f, indent=2)
        with open(os.path.join(d, "quant_fixture.json"), "w") as f:
            json.dump(dict(provenance, dequantised=not quantized), f, indent=2)
    print(f"{args.format}: {counts} -> {args.out}" + (f" (+ dequantised {args.dequant_out})" if args.dequant_out else ""))


if __name__ == "__main__":
    sys.exit(main())
