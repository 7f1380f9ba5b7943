#!/usr/bin/env python3
"""Make the video-input goldens of m3serve (issue #20) from HF transformers 5.17's `minimax_m3_vl`.

Writes into --out (tests/golden/vision), next to make_vision_goldens.py's image goldens:

  videos/            small test videos, made with PyAV only when --make-videos is given (their
                     bytes depend on the encoder, so they are committed and then kept). Every one
                     uses a codec whose decoded frames are RGB and lossless (PNG in QuickTime .mov,
                     FFV1 in .avi), so libav on the C++ side and PyAV here decode the same bytes;
                     their headers carry the frame count PyAV reads as `stream.frames`.
  video.json         per video: the container's frame count and average frame rate, the frames
                     m3serve's sampling picks (HF `sample_frames` with the video processor's
                     fps = 1.0, the count clamped to [min_frames, max_frames] and to the frames
                     the video has, where HF would divide by zero or refuse), the timestamps
                     the HF processor writes, MiniMaxM3VLVideoProcessor's grid and XXH64 of the
                     decoded sampled frames, of the resized frames and of the float32
                     pixel_values_videos; plus a case with max_pixels overridden (the shrink
                     branch of smart_resize on video frames).
                     Model cases on the committed tiny checkpoint (model/, written by
                     make_vision_goldens.py): the prompt ids as MiniMaxM3VLProcessor expands them
                     (per temporal pair: "]<]{t:.1f} seconds[>[" + start + N x video + end), prompt
                     logprobs and a greedy continuation, for a prompt with one video and one with
                     an image and a video (the tower runs images and videos as two calls).

The model is scored in fp32 (eager attention, TF32 off), as make_vision_goldens.py does.

Usage (torch + transformers 5.17 + torchvision + PyAV + Pillow + xxhash; CPU is enough):
  python3 tools/goldens/make_video_goldens.py --out tests/golden/vision [--make-videos]
"""

import argparse
import json
import os
import platform
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_model_goldens as mg  # noqa: E402  (logprob entries, torch precision)

GENERATOR = "tools/goldens/make_video_goldens.py"
SEED = 20261202
IMAGE_TOKEN, VIDEO_TOKEN = 2641, 2642
START_IMAGE, END_IMAGE = 2645, 2646
GREEDY = 8

# name, codec, (width, height), frames, fps. Sizes: multiples of 28 (no resize; what the full
# processor needs: its video kwargs turn do_resize off), upscaling, an odd sampled count (the last
# frame repeated for the temporal pair), a fractional sampling step, fewer frames than one
# second at fps 1 (the clamp to min_frames).
VIDEOS = [
    ("pair.mov", "png", (84, 56), 12, 2),
    ("odd.avi", "ffv1", (90, 62), 12, 4),
    ("step.mov", "png", (44, 30), 25, 7),
    ("short.avi", "ffv1", (50, 36), 3, 10),
]
# (video, processor kwargs) run again with overridden kwargs.
OVERRIDES = [("odd.avi", dict(max_pixels=28 * 28 * 3))]

CASES = [
    dict(name="one_video", media=[("video", "pair.mov")], text="What happens in this video?"),
    dict(name="image_and_video", media=[("image", "grad_small.png"), ("video", "odd_pair.mov")],
         text="Does the video show the picture?"),
]
# Model-case videos that are not processor goldens (dims a multiple of 28: the processor path).
MODEL_VIDEOS = [("odd_pair.mov", "png", (56, 56), 5, 1)]
# A lossy H.264 (yuv420p) clip: its YUV -> RGB conversion goes through each side's own swscale
# build, so only closeness is expected; PyAV's rgb24 frames are stored raw (h264.rgb) for that.
LOSSY = [("h264.mp4", "libx264", (64, 48), 8, 4)]


def xxh64(b):
    import xxhash

    return xxhash.xxh64(b, seed=0).hexdigest()


def make_videos(vid_dir):
    import av

    os.makedirs(vid_dir, exist_ok=True)
    rng = np.random.default_rng(SEED)
    for name, codec, (w, h), n, fps in VIDEOS + MODEL_VIDEOS + LOSSY:
        path = os.path.join(vid_dir, name)
        with av.open(path, "w") as out:
            st = out.add_stream(codec, rate=fps)
            st.width, st.height = w, h
            st.pix_fmt = {"png": "rgb24", "ffv1": "bgr0"}.get(codec, "yuv420p")
            yy, xx = np.mgrid[0:h, 0:w].astype(np.float64)
            # Smooth moving content plus a little texture (each resize tap matters) kept small
            # so the lossless files stay a few KB a frame.
            tex = rng.integers(0, 5, (h, w, 3))
            for i in range(n):
                base = np.stack([
                    127 + 120 * np.sin((xx + 5 * i) / 9.0),
                    127 + 120 * np.cos((yy - 3 * i) / 7.0),
                    255 * ((xx + yy + 11 * i) % 64) / 63.0,
                ], axis=-1) + tex
                cx, cy = (7 * i) % w, (5 * i) % h
                base[max(0, cy - 4):cy + 4, max(0, cx - 6):cx + 6] = (255, 255 - 20 * i % 255, 0)
                frame = av.VideoFrame.from_ndarray(np.clip(base, 0, 255).astype(np.uint8), "rgb24")
                if codec != "png":
                    frame = frame.reformat(format=st.pix_fmt)
                for pkt in st.encode(frame):
                    out.mux(pkt)
            for pkt in st.encode():
                out.mux(pkt)
        print(f"video {name}: {codec} {w}x{h} {n} frames @ {fps} {os.path.getsize(path)} bytes",
              flush=True)


def sample_indices_fn(vp):
    """m3serve's frame sampling: HF's sample_frames at the processor's fps, the count clamped
    into [min_frames, max_frames] and to the frames the video has (HF divides by zero for a
    count of 0 and raises for one over the total)."""

    def fn(metadata, **kwargs):
        total = metadata.total_num_frames
        n = int(total / metadata.fps * vp.fps)
        if 1 <= n <= total and vp.min_frames <= n <= vp.max_frames:
            return vp.sample_frames(metadata, fps=vp.fps)
        n = max(vp.min_frames, min(vp.max_frames, n))
        return vp.sample_frames(metadata, num_frames=min(n, total))

    return fn


def load(vid_dir, name, vp):
    from transformers.video_utils import load_video

    frames, meta = load_video(os.path.join(vid_dir, name), backend="pyav",
                              sample_indices_fn=sample_indices_fn(vp))
    return frames, meta


def timestamps(meta, grid_t, tp):
    idx = [int(i) for i in meta.frames_indices]
    return [f"{idx[min(f * tp, len(idx) - 1)] / meta.fps:.1f}" for f in range(grid_t)]


def processor_goldens(vid_dir):
    import torch
    from torchvision.transforms.v2 import functional as tvF
    from transformers.models.minimax_m3_vl.image_processing_minimax_m3_vl import smart_resize
    from transformers.models.minimax_m3_vl.video_processing_minimax_m3_vl import (
        MiniMaxM3VLVideoProcessor,
    )

    vp = MiniMaxM3VLVideoProcessor()
    out = {}
    runs = [(n, {}) for n, *_ in VIDEOS] + OVERRIDES
    for name, kw in runs:
        frames, meta = load(vid_dir, name, vp)  # [n, h, w, 3] uint8
        feat = vp(videos=[frames], video_metadata=[meta], do_sample_frames=False,
                  return_metadata=True, return_tensors="pt", **kw)
        pv = feat["pixel_values_videos"].float().contiguous().numpy().astype("<f4")
        grid = [int(g) for g in feat["video_grid_thw"][0].tolist()]
        h, w = frames.shape[1:3]
        rh, rw = smart_resize(h, w, factor=28, min_pixels=kw.get("min_pixels", vp.min_pixels),
                              max_pixels=kw.get("max_pixels", vp.max_pixels))
        t = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2).contiguous()
        resized = tvF.resize(t, [rh, rw], interpolation=tvF.InterpolationMode.BICUBIC,
                             antialias=True)
        res = resized.permute(0, 2, 3, 1).contiguous().numpy()
        if [grid[1] * 14, grid[2] * 14] != [rh, rw]:
            raise SystemExit(f"{name}: grid {grid} does not match smart_resize {rh}x{rw}")
        key = name + ("" if not kw else "|" + json.dumps(kw, sort_keys=True))
        out[key] = dict(
            file=name, kwargs=kw, width=int(w), height=int(h),
            total_num_frames=int(meta.total_num_frames), fps=float(meta.fps),
            frames_indices=[int(i) for i in meta.frames_indices],
            timestamps=timestamps(meta, grid[0], vp.temporal_patch_size),
            resized_height=int(rh), resized_width=int(rw), grid_thw=grid,
            num_tokens=int(grid[0] * grid[1] * grid[2] // 4),
            frames_xxh64=xxh64(np.ascontiguousarray(frames).tobytes()),
            resized_xxh64=xxh64(res.tobytes()),
            pixel_values_xxh64=xxh64(pv.tobytes()),
            pixel_values_head=[float(v) for v in pv.reshape(-1)[:16]],
            pixel_values_sum=float(pv.astype(np.float64).sum()),
        )
        print(f"processor {key}: {w}x{h} x{meta.total_num_frames} @ {meta.fps} -> frames "
              f"{out[key]['frames_indices']} {rw}x{rh} grid {grid}", flush=True)
    for name, *_ in LOSSY:
        frames, meta = load(vid_dir, name, vp)
        raw = np.ascontiguousarray(frames)
        with open(os.path.join(vid_dir, name.rsplit(".", 1)[0] + ".rgb"), "wb") as f:
            f.write(raw.tobytes())
        out[name] = dict(file=name, lossy=True, width=int(raw.shape[2]), height=int(raw.shape[1]),
                         total_num_frames=int(meta.total_num_frames), fps=float(meta.fps),
                         frames_indices=[int(i) for i in meta.frames_indices],
                         frames_xxh64=xxh64(raw.tobytes()))
        print(f"lossy {name}: frames {out[name]['frames_indices']}", flush=True)
    return out


def model_goldens(root, vid_dir):
    import torch
    from PIL import Image
    from transformers import (
        MiniMaxM3SparseForConditionalGeneration,
        MiniMaxM3VLImageProcessor,
        MiniMaxM3VLProcessor,
        PreTrainedTokenizerFast,
    )
    from transformers.models.minimax_m3_vl.video_processing_minimax_m3_vl import (
        MiniMaxM3VLVideoProcessor,
    )

    mdir = os.path.join(root, "model")
    model = MiniMaxM3SparseForConditionalGeneration.from_pretrained(
        mdir, dtype=torch.float32, attn_implementation="eager").eval()
    tok = PreTrainedTokenizerFast(tokenizer_file=os.path.join(mdir, "tokenizer.json"))
    with open(os.path.join(mdir, "chat_template.jinja")) as f:
        template = f.read()
    vp = MiniMaxM3VLVideoProcessor()
    proc = MiniMaxM3VLProcessor(image_processor=MiniMaxM3VLImageProcessor(), tokenizer=tok,
                                video_processor=vp, chat_template=template)
    cases = []
    for case in CASES:
        content, images, videos, metas = [], [], [], []
        for kind, name in case["media"]:
            if kind == "image":
                content.append(dict(type="image_url", image_url=dict(url=f"file://{name}")))
                images.append(Image.open(os.path.join(root, "images", name)))
            else:
                content.append(dict(type="video_url", video_url=dict(url=f"file://{name}")))
                frames, meta = load(vid_dir, name, vp)
                videos.append(frames)
                metas.append(meta)
        content.append(dict(type="text", text=case["text"]))
        messages = [dict(role="user", content=content)]
        text = tok.apply_chat_template(messages, chat_template=template, tokenize=False,
                                       add_generation_prompt=True)
        feat = proc(text=[text], images=images or None, videos=videos,
                    videos_kwargs=dict(video_metadata=metas, do_sample_frames=False),
                    return_tensors="pt")
        ids = feat["input_ids"][0].tolist()
        kw = dict(pixel_values_videos=feat["pixel_values_videos"],
                  video_grid_thw=feat["video_grid_thw"])
        if images:
            kw.update(pixel_values=feat["pixel_values"], image_grid_thw=feat["image_grid_thw"])
        with torch.no_grad():
            def fwd(seq):
                x = torch.tensor([seq], dtype=torch.long)
                return model(input_ids=x, use_cache=False, **kw).logits[0].float()

            logits = fwd(ids)
            prompt_lp = mg.prompt_logprob_entries(torch, logits, ids)
            seq, greedy = list(ids), []
            last = logits[-1]
            for _ in range(GREEDY):
                t = int(torch.argmax(last).item())
                greedy.append(mg.logprob_entry(torch, last, t))
                seq.append(t)
                last = fwd(seq)[-1]
        cases.append(dict(
            name=case["name"], media=[list(m) for m in case["media"]], text=case["text"],
            rendered=text, prompt_ids=ids,
            video_grid_thw=feat["video_grid_thw"].tolist(),
            video_timestamps=[timestamps(m, int(g[0]), vp.temporal_patch_size)
                              for m, g in zip(metas, feat["video_grid_thw"].tolist())],
            prompt_logprobs=prompt_lp, greedy=greedy))
        print(f"case {case['name']}: {len(ids)} prompt ids ({ids.count(VIDEO_TOKEN)} video), "
              f"greedy {[g['token'] for g in greedy]}", flush=True)
    return cases


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--make-videos", action="store_true")
    args = ap.parse_args()
    import av
    import PIL
    import torch
    import torchvision
    import transformers

    mg.setup_torch_precision(torch)
    versions = dict(python=platform.python_version(), torch=torch.__version__,
                    torchvision=torchvision.__version__, transformers=transformers.__version__,
                    pyav=av.__version__, libavcodec=".".join(map(str, av.library_versions["libavcodec"])),
                    pillow=PIL.__version__, numpy=np.__version__,
                    cpu_capability=torch.backends.cpu.get_cpu_capability(), device="cpu")
    print("versions:", json.dumps(versions), flush=True)
    vid_dir = os.path.join(args.out, "videos")
    if args.make_videos:
        make_videos(vid_dir)
    proc = processor_goldens(vid_dir)
    cases = model_goldens(args.out, vid_dir)
    with open(os.path.join(args.out, "video.json"), "w") as f:
        json.dump(dict(generator=GENERATOR, versions=versions, video_token_index=VIDEO_TOKEN,
                       start_image=START_IMAGE, end_image=END_IMAGE, videos=proc, cases=cases),
                  f, separators=(",", ":"))
        f.write("\n")


if __name__ == "__main__":
    main()
