#!/usr/bin/env python3
"""Writes the image-decoder test images and their expected pixels (tests/golden/vision/decoder.json).

- images/exif_<k>.jpg for orientation k = 1..8: the same 37x23 picture (asymmetric, so every
  flip and rotation differs) saved once as a JPEG, then copied with an EXIF APP1 segment
  carrying Orientation = k. Expected: the RGB pixels PIL gives after ImageOps.exif_transpose
  (how vLLM's loader and transformers' load_image turn a photo upright).
- images/cmyk.jpg: a CMYK JPEG with a non-zero black channel. Expected: PIL's convert("RGB").
- images/gif_*.gif: GIFs (interlaced and not, a transparent index, an animation, grey levels).
  Expected: PIL's Image.open (frame 0) + convert("RGB").
Each entry records the size and the xxh64 of the RGB bytes, which m3serve's decoder must
reproduce byte for byte.

Usage: python3 tools/goldens/make_decoder_images.py  (needs pillow, numpy, xxhash)
"""
import io
import json
import os
import platform
import struct

import numpy as np
import PIL
import xxhash
from PIL import Image, ImageOps

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT = os.path.join(ROOT, "tests", "golden", "vision")


def app1_orientation(k):
    """An EXIF APP1 segment (little-endian TIFF, one IFD entry: Orientation = k)."""
    ifd = struct.pack("<H", 1) + struct.pack("<HHIHH", 0x0112, 3, 1, k, 0) + struct.pack("<I", 0)
    tiff = b"II*\x00" + struct.pack("<I", 8) + ifd
    payload = b"Exif\x00\x00" + tiff
    return b"\xff\xe1" + struct.pack(">H", len(payload) + 2) + payload


def main():
    h, w = 23, 37
    y, x = np.mgrid[0:h, 0:w]
    rgb = np.stack([(x * 7) % 256, (y * 11) % 256, ((x + 2 * y) * 5) % 256], -1).astype(np.uint8)
    rgb[:5, :9] = [250, 20, 20]  # a red corner block marks the top-left
    buf = io.BytesIO()
    Image.fromarray(rgb, "RGB").save(buf, format="JPEG", quality=95, subsampling=0)
    base = buf.getvalue()
    assert base[:2] == b"\xff\xd8"
    cases = {}
    for k in range(1, 9):
        data = base[:2] + app1_orientation(k) + base[2:]
        name = f"exif_{k}.jpg"
        with open(os.path.join(OUT, "images", name), "wb") as f:
            f.write(data)
        im = Image.open(io.BytesIO(data))
        assert im.getexif().get(0x0112) == k
        up = ImageOps.exif_transpose(im).convert("RGB")
        arr = np.asarray(up)
        cases[name] = {
            "orientation": k,
            "width": up.size[0],
            "height": up.size[1],
            "rgb_xxh64": xxhash.xxh64(arr.tobytes(), seed=0).hexdigest(),
        }
    y, x = np.mgrid[0:29, 0:43]
    cmyk = np.stack([(x * 5) % 256, (y * 9) % 256, ((x + y) * 3) % 256, (x * y) % 200], -1)
    name = "cmyk.jpg"
    Image.fromarray(cmyk.astype(np.uint8), "CMYK").save(
        os.path.join(OUT, "images", name), quality=95)
    im = Image.open(os.path.join(OUT, "images", name))
    assert im.mode == "CMYK"
    arr = np.asarray(im.convert("RGB"))
    cases[name] = {"orientation": 1, "width": arr.shape[1], "height": arr.shape[0],
                   "rgb_xxh64": xxhash.xxh64(arr.tobytes(), seed=0).hexdigest()}
    def gif(name, im, **kw):
        path = os.path.join(OUT, "images", name)
        im.save(path, format="GIF", **kw)
        back = Image.open(path)
        arr = np.asarray(back.convert("RGB"))
        cases[name] = {"orientation": 1, "width": arr.shape[1], "height": arr.shape[0],
                       "rgb_xxh64": xxhash.xxh64(arr.tobytes(), seed=0).hexdigest()}

    pic = Image.fromarray(rgb, "RGB")
    gif("gif_interlaced.gif", pic.convert("P", palette=Image.ADAPTIVE, colors=50))  # 23 rows: interlaced
    gif("gif_plain.gif", pic.crop((0, 0, 20, 12)).convert("P", palette=Image.ADAPTIVE, colors=7),
        interlace=False)
    gif("gif_transparent.gif", pic.convert("P", palette=Image.ADAPTIVE, colors=16), transparency=3)
    frames = [pic.convert("P", palette=Image.ADAPTIVE, colors=32),
              pic.transpose(Image.FLIP_LEFT_RIGHT).convert("P", palette=Image.ADAPTIVE, colors=32)]
    path = os.path.join(OUT, "images", "gif_anim.gif")
    frames[0].save(path, format="GIF", save_all=True, append_images=frames[1:], duration=100, loop=0)
    arr = np.asarray(Image.open(path).convert("RGB"))
    cases["gif_anim.gif"] = {"orientation": 1, "width": arr.shape[1], "height": arr.shape[0],
                             "rgb_xxh64": xxhash.xxh64(arr.tobytes(), seed=0).hexdigest()}
    gif("gif_grey.gif", pic.convert("L"))
    meta = {
        "generator": "tools/goldens/make_decoder_images.py",
        "versions": {"python": platform.python_version(), "pillow": PIL.__version__,
                     "numpy": np.__version__, "xxhash": xxhash.VERSION},
        "images": cases,
    }
    with open(os.path.join(OUT, "decoder.json"), "w") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
