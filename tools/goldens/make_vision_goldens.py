#!/usr/bin/env python3
"""Make the vision-input goldens of m3serve (issue #20) from HF transformers' `minimax_m3_vl`.

Writes into --out (tests/golden/vision):

  images/              small test images (JPEG, PNG in RGB/RGBA/grey/palette, WebP lossy and
                       lossless), made with PIL only when --make-images is given (their bytes
                       depend on the encoder, so they are committed and then kept)
  processor.json       per image: the HF MiniMaxM3VLImageProcessor's grid and resized size, and
                       XXH64 hashes of PIL's decoded RGB bytes, of the uint8 image after the
                       processor's resize, and of the float32 pixel_values (little-endian); plus
                       the first pixel values and their sum for a readable diff
  model/               a tiny MiniMax-M3-VL checkpoint (random weights given real values; the
                       demo model's tokenizer and chat template, so `serve` can run it)
  model/golden.json    per case: the prompt ids (image placeholders expanded as the HF processor
                       does), the images it uses, the tower's last hidden state and the projected
                       + merged image embeddings, prompt logprobs and a greedy continuation; the
                       tower also once more in the reference layout (Automodel / SGLang: 3-D RoPE
                       over t, h, w on the first 2*floor(head_dim/6)*3 dims, one image per
                       attention block), from an independent float64 numpy forward

The model is scored RELOADED from disk in fp32 (eager attention, TF32 off), as
make_model_goldens.py does. transformers 5.17's vision RoPE rotates all head dims by the (t, h)
positions only and attends across every image of a forward; the checkpoint's config written by
transformers (vision_config.model_type "minimax_m3_vl_vision") is what tells m3serve to follow
that layout (src/model/vision_config.cpp).

Usage (torch + transformers 5.17 + torchvision + Pillow + xxhash; CPU is enough, a GPU is used
when present):
  python3 tools/goldens/make_vision_goldens.py --out tests/golden/vision [--make-images]
"""

import argparse
import io
import json
import math
import os
import platform
import shutil
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_model_goldens as mg  # noqa: E402  (config helpers, weight init, logprob entries)

GENERATOR = "tools/goldens/make_vision_goldens.py"
REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
DEMO = os.path.join(REPO, "models", "demo")
SEED = 20261201

# The tiny model: the demo tokenizer's vocabulary (2688 rows; ]<]image[>[ = 2641), one dense
# full-attention layer and one MoE + MSA layer with 8-token blocks, a 2-layer vision tower.
VISION = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_channels=3,
    image_size=56,
    patch_size=14,
    temporal_patch_size=2,
    spatial_merge_size=2,
    hidden_act="gelu",
    layer_norm_eps=1e-5,
)
TEXT = dict(
    name="vision_tiny",
    vocab_size=2688,
    hidden_size=64,
    num_layers=2,
    first_dense=1,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    partial_rotary_factor=0.5,
    index_heads=2,
    index_head_dim=16,
    block_size=8,
    topk_blocks=2,
    local_blocks=1,
    use_sparse=True,
    num_experts=4,
    experts_per_tok=2,
    intermediate_size=32,
    shared_intermediate_size=32,
    dense_intermediate_size=96,
    routed_scaling_factor=2.0,
    rope_theta=1.0e4,
    swiglu_alpha=1.702,
    swiglu_limit=7.0,
    projector_hidden_size=48,
)
IMAGE_TOKEN, VIDEO_TOKEN = 2641, 2642
START_IMAGE, END_IMAGE = 2645, 2646

# name -> how to draw it (make_images). Sizes cover: upscaling to min_pixels, shrinking to
# max_pixels, no resize (a multiple of 28), extreme aspect, one-axis-only resize.
IMAGES = [
    ("grad_small.png", "RGB", (40, 30)),
    ("shapes_rgba.png", "RGBA", (150, 97)),
    ("gray.png", "L", (64, 200)),
    ("palette.png", "P", (90, 90)),
    ("photo.jpg", "RGB", (800, 600)),
    ("gray.jpg", "L", (123, 77)),
    ("lossy.webp", "RGB", (333, 222)),
    ("lossless.webp", "RGBA", (56, 56)),
    ("wide.png", "RGB", (1000, 60)),
    ("exact.png", "RGB", (112, 84)),
]

# 16-bit PNGs (written by write_png16, deterministic, when missing): PIL opens grey as "I;16"
# (convert("RGB") clips to 255) and RGB/RGBA/grey+alpha keeping the high byte.
IMAGES16 = [
    ("gray16.png", 0, (57, 83), 65536),
    ("gray16_low.png", 0, (60, 40), 256),
    ("graya16.png", 4, (45, 70, 2), 65536),
    ("rgb16.png", 2, (50, 64, 3), 65536),
    ("rgba16.png", 6, (77, 33, 4), 65536),
]

CASES = [
    dict(name="one_image", images=["grad_small.png"], text="What is in this picture?"),
    dict(name="two_images", images=["grad_small.png", "lossless.webp"],
         text="Compare the two images."),
    dict(name="bigger_image", images=["shapes_rgba.png"], text="Describe it."),
]
GREEDY = 8


def xxh64(b):
    import xxhash

    return xxhash.xxh64(b, seed=0).hexdigest()


def write_png16(path, arr, color_type):
    import struct
    import zlib

    h, w = arr.shape[:2]
    raw = b"".join(b"\x00" + arr[y].astype(">u2").tobytes() for y in range(h))

    def chunk(t, d):
        return struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", w, h, 16, color_type, 0, 0, 0)
    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw, 9))
                + chunk(b"IEND", b""))


def make_png16(img_dir):
    rng = np.random.default_rng(SEED + 16)
    for name, color_type, shape, hi in IMAGES16:
        path = os.path.join(img_dir, name)
        if not os.path.exists(path):
            write_png16(path, rng.integers(0, hi, shape, dtype=np.uint32).astype(np.uint16), color_type)


def make_images(img_dir):
    from PIL import Image, ImageDraw

    os.makedirs(img_dir, exist_ok=True)
    rng = np.random.default_rng(SEED)
    for name, mode, (w, h) in IMAGES:
        yy, xx = np.mgrid[0:h, 0:w].astype(np.float64)
        base = np.stack([
            255 * xx / max(w - 1, 1),
            255 * yy / max(h - 1, 1),
            127 + 127 * np.sin(xx / 7.0 + yy / 11.0),
        ], axis=-1)
        base += rng.normal(0, 12, base.shape)  # texture so every resize tap matters
        img = Image.fromarray(np.clip(base, 0, 255).astype(np.uint8), "RGB")
        d = ImageDraw.Draw(img)
        for _ in range(6):
            x0, y0 = int(rng.integers(0, w)), int(rng.integers(0, h))
            x1, y1 = x0 + int(rng.integers(2, max(3, w // 3))), y0 + int(rng.integers(2, max(3, h // 3)))
            col = tuple(int(c) for c in rng.integers(0, 256, 3))
            (d.ellipse if rng.random() < 0.5 else d.rectangle)([x0, y0, x1, y1], fill=col)
        if mode == "RGBA":
            a = np.clip(64 + 191 * (xx / max(w - 1, 1)), 0, 255).astype(np.uint8)
            img = Image.fromarray(np.dstack([np.asarray(img), a]), "RGBA")
        elif mode == "L":
            img = img.convert("L")
        elif mode == "P":
            img = img.convert("P", palette=Image.ADAPTIVE, colors=64)
        path = os.path.join(img_dir, name)
        if name.endswith(".jpg"):
            img.save(path, quality=90)
        elif name.endswith(".webp"):
            img.save(path, lossless=name.startswith("lossless"), quality=80)
        else:
            img.save(path)
        print(f"image {name}: {img.mode} {img.size} {os.path.getsize(path)} bytes", flush=True)


def make_fuzz_images(img_dir, n, seed):
    """n random images (sizes 1..1400 px a side, aspect up to ~60, every format and mode) for a
    wider processor check than the committed set: `--fuzz N --out DIR`, then
    M3_VISION_GOLDEN_DIR=DIR build/release/tests/unit/vision/vision_processor_test."""
    from PIL import Image

    os.makedirs(img_dir, exist_ok=True)
    rng = np.random.default_rng(seed)
    names = []
    for i in range(n):
        w = int(rng.integers(1, 1400))
        h = int(max(1, min(1400, round(w * float(np.exp(rng.uniform(-3.5, 3.5)))))))
        if max(w, h) / min(w, h) > 190:
            h = max(1, w // 100)
        arr = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        if rng.random() < 0.5:  # smooth content too, not only noise
            yy, xx = np.mgrid[0:h, 0:w]
            arr = ((np.stack([xx * 7, yy * 5, xx + yy], -1) + arr // 4) % 256).astype(np.uint8)
        img = Image.fromarray(arr, "RGB")
        kind = ["png", "jpg", "webp", "png_rgba", "png_l", "jpg_l", "png_p", "webp_lossless"][i % 8]
        if kind in ("png_l", "jpg_l"):
            img = img.convert("L")
        elif kind == "png_rgba":
            img = img.convert("RGBA")
        elif kind == "png_p":
            img = img.convert("P", palette=Image.ADAPTIVE, colors=32)
        ext = kind.split("_")[0]
        name = f"fuzz{i:04d}.{ext}"
        path = os.path.join(img_dir, name)
        if ext == "jpg":
            img.save(path, quality=int(rng.integers(50, 98)))
        elif ext == "webp":
            img.save(path, lossless=kind == "webp_lossless", quality=80)
        else:
            img.save(path)
        names.append((name, img.mode, (w, h)))
    return names


def processor_goldens(img_dir, images=None):
    import torch
    from PIL import Image
    from torchvision.transforms.v2 import functional as tvF
    from transformers.models.minimax_m3_vl.image_processing_minimax_m3_vl import (
        MiniMaxM3VLImageProcessor,
        smart_resize,
    )

    proc = MiniMaxM3VLImageProcessor()
    out = {}
    pixels = {}
    for name, *_ in images or IMAGES + IMAGES16:
        pil = Image.open(os.path.join(img_dir, name))
        rgb = pil.convert("RGB")
        arr = np.asarray(rgb)  # [h, w, 3]
        feat = proc(images=[pil], return_tensors="pt")
        pv = feat["pixel_values"].float().contiguous()
        grid = feat["image_grid_thw"][0].tolist()
        h, w = arr.shape[:2]
        rh, rw = smart_resize(h, w, factor=28, min_pixels=proc.size["shortest_edge"],
                              max_pixels=proc.size["longest_edge"])
        t = torch.from_numpy(arr.copy()).permute(2, 0, 1).contiguous()
        resized = tvF.resize(t, [rh, rw], interpolation=tvF.InterpolationMode.BICUBIC, antialias=True)
        res_hwc = resized.permute(1, 2, 0).contiguous().numpy()
        if [grid[1] * 14, grid[2] * 14] != [rh, rw]:
            raise SystemExit(f"{name}: grid {grid} does not match smart_resize {rh}x{rw}")
        pvn = pv.numpy().astype("<f4")
        out[name] = dict(
            width=int(w), height=int(h), mode=pil.mode,
            resized_height=int(rh), resized_width=int(rw), grid_thw=[int(g) for g in grid],
            num_tokens=int(grid[0] * grid[1] * grid[2] // 4),
            rgb_xxh64=xxh64(arr.tobytes()),
            resized_xxh64=xxh64(res_hwc.tobytes()),
            pixel_values_xxh64=xxh64(pvn.tobytes()),
            pixel_values_head=[float(v) for v in pvn.reshape(-1)[:16]],
            pixel_values_sum=float(pvn.astype(np.float64).sum()),
        )
        pixels[name] = (pv, feat["image_grid_thw"])
        print(f"processor {name}: {w}x{h} -> {rw}x{rh} grid {grid}", flush=True)
    return out, pixels


def hf_config():
    d = mg.hf_config_dict(TEXT)
    d["vision_config"] = dict(VISION)
    d["image_token_index"] = IMAGE_TOKEN
    d["video_token_index"] = VIDEO_TOKEN
    return d


def reference_tower_numpy(sd, vcfg, pv, grids):
    """The tower + projector + merge in the reference layout (Automodel's vision_encoder.py,
    m3-model.md §7), float64, one attention block per image."""
    H, nh = vcfg["hidden_size"], vcfg["num_attention_heads"]
    d = H // nh
    axis = 2 * ((2 * (d // 2) // 3) // 2)
    inv = 1.0 / (10000.0 ** (np.arange(0, axis, 2, dtype=np.float64) / axis))
    g = lambda k: sd[k].double().numpy()  # noqa: E731
    pre = "model.vision_tower."

    def ln(x, w, b, eps=1e-5):
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        return (x - mu) / np.sqrt(var + eps) * w + b

    def gelu(x):
        from math import erf

        return 0.5 * x * (1 + np.vectorize(erf)(x / math.sqrt(2)))

    x_all = pv.double().numpy() @ g(pre + "embeddings.proj.weight").reshape(H, -1).T
    x_all = ln(x_all, g(pre + "pre_layrnorm.weight"), g(pre + "pre_layrnorm.bias"))
    # positions (t, h, w) of each row in merge-window order
    pos = []
    for t, gh, gw in grids:
        for ti in range(t):
            for bh in range(gh // 2):
                for bw in range(gw // 2):
                    for mh in range(2):
                        for mw in range(2):
                            pos.append((ti, bh * 2 + mh, bw * 2 + mw))
    pos = np.array(pos, dtype=np.float64)
    freqs = np.concatenate([pos[:, a:a + 1] * inv[None, :] for a in range(3)], axis=1)
    cos, sin = np.cos(np.concatenate([freqs, freqs], 1)), np.sin(np.concatenate([freqs, freqs], 1))
    rd = cos.shape[1]
    seg = [t * gh * gw for t, gh, gw in grids]
    starts = np.cumsum([0] + seg)

    def rope(q):  # q [S, nh, d]
        r = q[..., :rd]
        half = rd // 2
        rot = np.concatenate([-r[..., half:], r[..., :half]], -1)
        return np.concatenate([r * cos[:, None, :] + rot * sin[:, None, :], q[..., rd:]], -1)

    x = x_all
    for li in range(vcfg["num_hidden_layers"]):
        p = f"{pre}layers.{li}."
        a = ln(x, g(p + "layer_norm1.weight"), g(p + "layer_norm1.bias"))
        lin = lambda v, n: v @ g(p + n + ".weight").T + g(p + n + ".bias")  # noqa: E731
        S = a.shape[0]
        q = rope(lin(a, "self_attn.q_proj").reshape(S, nh, d))
        k = rope(lin(a, "self_attn.k_proj").reshape(S, nh, d))
        v = lin(a, "self_attn.v_proj").reshape(S, nh, d)
        o = np.zeros_like(q)
        for i in range(len(seg)):
            s0, s1 = starts[i], starts[i + 1]
            sc = np.einsum("qhd,khd->hqk", q[s0:s1], k[s0:s1]) / math.sqrt(d)
            sc = np.exp(sc - sc.max(-1, keepdims=True))
            sc /= sc.sum(-1, keepdims=True)
            o[s0:s1] = np.einsum("hqk,khd->qhd", sc, v[s0:s1])
        x = x + lin(o.reshape(S, H), "self_attn.out_proj")
        m = ln(x, g(p + "layer_norm2.weight"), g(p + "layer_norm2.bias"))
        x = x + lin(gelu(lin(m, "mlp.fc1")), "mlp.fc2")
    pp = "model.multi_modal_projector."
    lin2 = lambda v, n: v @ g(pp + n + ".weight").T + g(pp + n + ".bias")  # noqa: E731
    y = lin2(gelu(lin2(x, "linear_1")), "linear_2")
    y = y.reshape(y.shape[0] // 4, -1)
    merged = lin2(gelu(lin2(y, "merge_linear_1")), "merge_linear_2")
    return x, merged


def model_goldens(out_dir, pixels, versions):
    import torch
    from transformers import (
        MiniMaxM3SparseForConditionalGeneration,
        MiniMaxM3VLConfig,
        PreTrainedTokenizerFast,
    )

    device = "cuda" if torch.cuda.is_available() else "cpu"
    mdir = os.path.join(out_dir, "model")
    if os.path.exists(mdir):
        shutil.rmtree(mdir)
    os.makedirs(mdir)
    cfg = MiniMaxM3VLConfig(**hf_config())
    torch.manual_seed(SEED)
    model = MiniMaxM3SparseForConditionalGeneration(cfg)
    mg.init_weights(torch, model, TEXT, SEED)
    mg.to_checkpoint_dtypes(torch, model)
    model.save_pretrained(mdir, max_shard_size="10GB")
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(os.path.join(DEMO, f), os.path.join(mdir, f))
    names = sorted(os.listdir(mdir))
    print("model files:", names, flush=True)

    model_l = MiniMaxM3SparseForConditionalGeneration.from_pretrained(
        mdir, dtype=torch.float32, attn_implementation="eager").to(device).eval()
    sd = {k: v.detach().cpu() for k, v in model_l.state_dict().items()}
    with open(os.path.join(DEMO, "chat_template.jinja")) as f:
        template = f.read()
    tok = PreTrainedTokenizerFast(tokenizer_file=os.path.join(DEMO, "tokenizer.json"))

    cases = []
    for case in CASES:
        content = [dict(type="image_url", image_url=dict(url=f"file://{n}")) for n in case["images"]]
        content.append(dict(type="text", text=case["text"]))
        messages = [dict(role="user", content=content)]
        text = tok.apply_chat_template(messages, chat_template=template, tokenize=False,
                                       add_generation_prompt=True)
        ids0 = tok.encode(text, add_special_tokens=False)
        if ids0.count(IMAGE_TOKEN) != len(case["images"]):
            raise SystemExit(f"{case['name']}: {ids0.count(IMAGE_TOKEN)} image tokens in the prompt")
        pvs = [pixels[n][0] for n in case["images"]]
        grids = torch.cat([pixels[n][1] for n in case["images"]], 0)
        ids, k = [], 0
        for t in ids0:
            if t == IMAGE_TOKEN:
                n = int(grids[k].prod().item() // 4)
                ids += [START_IMAGE] + [IMAGE_TOKEN] * n + [END_IMAGE]
                k += 1
            else:
                ids.append(t)
        pv = torch.cat(pvs, 0).to(device)
        grid_d = grids.to(device)
        with torch.no_grad():
            feats = model_l.model.get_image_features(pixel_values=pv, image_grid_thw=grid_d)
            tower = feats.last_hidden_state[0].float().cpu()
            merged = feats.pooler_output.float().cpu()

            def fwd(seq):
                x = torch.tensor([seq], dtype=torch.long, device=device)
                return model_l(input_ids=x, pixel_values=pv, image_grid_thw=grid_d,
                               use_cache=False).logits[0].float()

            logits = fwd(ids)
            prompt_lp = mg.prompt_logprob_entries(torch, logits, ids)
            seq, greedy = list(ids), []
            last = logits[-1]
            for _ in range(GREEDY):
                t = int(torch.argmax(last).item())
                greedy.append(mg.logprob_entry(torch, last, t))
                seq.append(t)
                last = fwd(seq)[-1]
        ref_tower, ref_merged = reference_tower_numpy(sd, VISION, torch.cat(pvs, 0),
                                                      grids.tolist())
        cases.append(dict(
            name=case["name"], images=case["images"], text=case["text"], rendered=text,
            prompt_ids=ids, grid_thw=grids.tolist(),
            tower_hidden=np.round(tower.numpy().astype(np.float64), 7).tolist(),
            image_embeds=np.round(merged.numpy().astype(np.float64), 7).tolist(),
            reference_tower_hidden=np.round(ref_tower, 7).tolist(),
            reference_image_embeds=np.round(ref_merged, 7).tolist(),
            prompt_logprobs=prompt_lp, greedy=greedy,
        ))
        print(f"case {case['name']}: {len(ids)} prompt ids, greedy {[g['token'] for g in greedy]}",
              flush=True)
    golden = dict(generator=GENERATOR, seed=SEED, versions=versions, compute_dtype="float32",
                  image_token_index=IMAGE_TOKEN, start_image=START_IMAGE, end_image=END_IMAGE,
                  vision_config=VISION, cases=cases)
    with open(os.path.join(mdir, "golden.json"), "w") as f:
        json.dump(golden, f, separators=(",", ":"))
        f.write("\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--make-images", action="store_true")
    ap.add_argument("--fuzz", type=int, default=0,
                    help="only the processor, on this many random images (not committed)")
    args = ap.parse_args()
    import PIL
    import safetensors
    import torch
    import torchvision
    import transformers

    mg.setup_torch_precision(torch)
    versions = dict(python=platform.python_version(), torch=torch.__version__,
                    torchvision=torchvision.__version__, transformers=transformers.__version__,
                    pillow=PIL.__version__, safetensors=safetensors.__version__,
                    numpy=np.__version__, cpu_capability=torch.backends.cpu.get_cpu_capability(),
                    device=torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu")
    print("versions:", json.dumps(versions), flush=True)
    img_dir = os.path.join(args.out, "images")
    if args.fuzz:
        names = make_fuzz_images(img_dir, args.fuzz, SEED)
        proc, _ = processor_goldens(img_dir, names)
        with open(os.path.join(args.out, "processor.json"), "w") as f:
            json.dump(dict(generator=GENERATOR, versions=versions, images=proc), f, indent=1)
        return
    if args.make_images:
        make_images(img_dir)
    make_png16(img_dir)
    proc, pixels = processor_goldens(img_dir)
    with open(os.path.join(args.out, "processor.json"), "w") as f:
        json.dump(dict(generator=GENERATOR, versions=versions, images=proc), f, indent=1)
        f.write("\n")
    model_goldens(args.out, pixels, versions)


if __name__ == "__main__":
    main()
