#!/usr/bin/env python3
"""Tokenizer throughput: HF `tokenizers` (single-threaded) vs m3serve's bench_tokenizer.

Builds a ~4 MB corpus (Python stdlib sources = code + English docstrings, plus generated
multilingual text: CJK, emoji, numbers), encodes it in ~4 KiB chunks with HF (encode_batch under
RAYON_NUM_THREADS=1) and with the C++ binary, checks that both produce the same ids (FNV-1a
checksum) and prints MB/s and the ratio.

Usage: python3 bench/bench_tokenizer.py --binary build/<dir>/bench/bench_tokenizer \
         [--tokenizer tests/golden/text/m3_tokenizer/tokenizer.json] [--corpus /tmp/m3_corpus.txt]
"""
import argparse
import glob
import os
import random
import subprocess
import sys
import sysconfig
import time

os.environ["RAYON_NUM_THREADS"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"

import tokenizers  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

CHUNK = 4096


def make_corpus(path, target_bytes=4_000_000):
    parts, size = [], 0
    stdlib = sysconfig.get_paths()["stdlib"]
    for f in sorted(glob.glob(os.path.join(stdlib, "*.py"))):
        try:
            t = open(f, encoding="utf-8").read()
        except (UnicodeDecodeError, OSError):
            continue
        parts.append(t)
        size += len(t.encode())
        if size > target_bytes * 3 // 4:
            break
    rng = random.Random(0)
    cjk = "你好世界这是一个测试中文分词器模型的注意力机制专家路由缓存请求日本語のテキストとカタカナ안녕하세요세계"
    emoji = ["😀", "👍🏽", "👨‍👩‍👧‍👦", "🇯🇵", "❤️", "🚀"]
    while size < target_bytes:
        line = "".join(rng.choice(cjk) for _ in range(rng.randint(5, 40)))
        line += " " + " ".join(str(rng.randint(0, 10 ** 9)) for _ in range(3))
        line += " " + rng.choice(emoji) + " naïve café résumé\n"
        parts.append(line)
        size += len(line.encode())
    with open(path, "w", encoding="utf-8") as f:
        f.write("".join(parts))


def chunks_of(data: bytes):
    out, pos, n = [], 0, len(data)
    while pos < n:
        end = pos + CHUNK
        if end >= n:
            end = n
        else:
            nl = data.find(b"\n", end)
            end = n if nl < 0 else nl + 1
        out.append(data[pos:end].decode("utf-8"))
        pos = end
    return out


def fnv(ids_lists):
    h = 1469598103934665603
    for ids in ids_lists:
        for i in ids:
            for b in (i & 0xFFFFFFFF).to_bytes(4, "little"):
                h ^= b
                h = (h * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return h


def main():
    root = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
    ap = argparse.ArgumentParser()
    ap.add_argument("--binary", required=True)
    ap.add_argument("--tokenizer", default=os.path.join(root, "tests/golden/text/m3_tokenizer/tokenizer.json"))
    ap.add_argument("--corpus", default="/tmp/m3_tokenizer_bench_corpus.txt")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    if not os.path.exists(a.corpus):
        make_corpus(a.corpus)
    data = open(a.corpus, "rb").read()
    chunks = chunks_of(data)
    tok = Tokenizer.from_file(a.tokenizer)
    mb = len(data) / 1e6

    t0 = time.perf_counter()
    encs = tok.encode_batch(chunks, add_special_tokens=False)
    cold = time.perf_counter() - t0
    ids = [e.ids for e in encs]
    best = 1e30
    for _ in range(a.repeats):
        t0 = time.perf_counter()
        tok.encode_batch(chunks, add_special_tokens=False)
        best = min(best, time.perf_counter() - t0)
    hf_sum = fnv(ids)
    hf_tokens = sum(len(x) for x in ids)

    out = subprocess.run([a.binary, a.tokenizer, a.corpus, str(a.repeats)], check=True,
                         capture_output=True, text=True).stdout
    ours = dict(line.split(" ", 1) for line in out.strip().splitlines())
    ours_sum = int(ours["checksum"], 16)
    ours_mbs = float(ours["mb_s"])
    print(f"tokenizer {a.tokenizer}")
    print(f"corpus {a.corpus}: {mb:.2f} MB, {len(chunks)} chunks, HF tokens {hf_tokens}; "
          f"tokenizers {tokenizers.__version__}, RAYON_NUM_THREADS=1")
    print(f"ids identical: {'yes' if ours_sum == hf_sum else 'NO'} ({ours['bytes'].split()[-1]} tokens ours)")
    print(f"HF  : cold {mb / cold:.2f} MB/s, warm {mb / best:.2f} MB/s")
    print(f"m3  : cold {float(ours['cold_mb_s']):.2f} MB/s, warm {ours_mbs:.2f} MB/s, "
          f"load {float(ours['load_s']):.2f} s")
    print(f"ratio (m3 / HF, warm): {ours_mbs / (mb / best):.2f}x")
    return 0 if ours_sum == hf_sum else 1


if __name__ == "__main__":
    sys.exit(main())
