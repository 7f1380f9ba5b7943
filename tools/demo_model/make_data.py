#!/usr/bin/env python3
"""Training data and tokenizer for the m3serve demo model.

  python3 tools/demo_model/make_data.py tokenizer   # (re)train models/demo/tokenizer.json
  python3 tools/demo_model/make_data.py preview     # print a few rendered samples

The tokenizer is a byte-level BPE trained with HF `tokenizers` on rendered training
conversations, with M3's pre-tokenizer regex (o200k style) and M3's 61 special tokens appended
after the ordinary tokens in M3's order. `build_docs` (called by train.py on the GPU machine)
renders samples with models/demo/chat_template.jinja and tokenizes prompt and completion.
No torch here.
"""

import json
import multiprocessing as mp
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tasks  # noqa: E402
from chat_format import MODEL_DIR, SPECIAL_TOKENS, ChatTemplate, EOS, PAD  # noqa: E402

N_ORDINARY_MAX = 3008       # BPE target; the corpus is small, so training stops earlier
M3_SPLIT_REGEX = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+"
    r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"
    r"[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
KIND_WEIGHTS = [("arith", 20), ("lookup", 18), ("chat", 7), ("tool_call", 22),
                ("tool_answer", 13), ("passkey", 20)]
ROW = 4096                  # training row length (tokens)
PASSKEY_MIN, PASSKEY_MAX = 200, 3700   # filler tokens; the rendered doc stays below ROW


def tokenizer_path():
    return os.path.join(MODEL_DIR, "tokenizer.json")


def vocab_size(tok):
    """Embedding rows: used ids rounded up to a multiple of 64 (M3 pads its vocab the same way:
    ids 200061..200063 are unused rows)."""
    return (tok.get_vocab_size() + 63) // 64 * 64


def load_tokenizer():
    from tokenizers import Tokenizer
    return Tokenizer.from_file(tokenizer_path())


def train_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tpl = ChatTemplate()
    rng = random.Random(7)

    class Approx:  # rough filler lengths before a tokenizer exists (words ~ tokens)
        def __call__(self, s):
            return len(s.split()) + 1

    texts = []
    for i in range(6000):
        kind = rng.choices([k for k, _ in KIND_WEIGHTS], [w for _, w in KIND_WEIGHTS])[0]
        s = tasks.train_sample(rng, kind, Approx(), 300)
        texts.append(tpl.render(s["messages"], s["tools"], True, s["mode"]) + s["completion"])
    tok = Tokenizer(models.BPE(byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(M3_SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    # Special tokens are split out of the training text so BPE never learns their pieces.
    specials = set(SPECIAL_TOKENS)

    def pieces():
        import re
        pat = re.compile("(" + "|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True)) + ")")
        for t in texts:
            for p in pat.split(t):
                if p and p not in specials:
                    yield p

    trainer = trainers.BpeTrainer(vocab_size=N_ORDINARY_MAX, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[])
    tok.train_from_iterator(pieces(), trainer=trainer)
    n = tok.get_vocab_size()
    tok.add_special_tokens(SPECIAL_TOKENS)
    for i, s in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(s) != n + i:
            raise SystemExit(f"special {s} got id {tok.token_to_id(s)}")
    os.makedirs(MODEL_DIR, exist_ok=True)
    tok.save(tokenizer_path())
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "]~b]",
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 16384,
    }
    with open(os.path.join(MODEL_DIR, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    ids = tok.encode(texts[0], add_special_tokens=False).ids
    print(f"tokenizer: {tok.get_vocab_size()} ids; sample 0: {len(texts[0])} chars -> {len(ids)} tokens")


# ------------------------------------------------------------------------------------------
# Docs for training (called by train.py)
# ------------------------------------------------------------------------------------------

_W = {}


def _worker_init():
    _W["tpl"] = ChatTemplate()
    _W["tok"] = load_tokenizer()
    _W["flen"] = tasks.FillerLengths(_W["tok"])


def _make_docs(args):
    seed, count = args
    rng = random.Random(seed)
    tpl, tok, flen = _W["tpl"], _W["tok"], _W["flen"]
    kinds = [k for k, _ in KIND_WEIGHTS]
    weights = [w for _, w in KIND_WEIGHTS]
    out = []
    for _ in range(count):
        kind = rng.choices(kinds, weights)[0]
        ctx = rng.randint(PASSKEY_MIN, PASSKEY_MAX) if kind == "passkey" else None
        s = tasks.train_sample(rng, kind, flen, ctx)
        prompt = tpl.render(s["messages"], s["tools"], True, s["mode"])
        p = tok.encode(prompt, add_special_tokens=False).ids
        c = tok.encode(s["completion"], add_special_tokens=False).ids
        if len(p) + len(c) > ROW:
            continue
        out.append((p, c, kind))
    return out


def _docs_for(seed, count, weights, pk_lo, pk_hi, row):
    """`count` docs of the kinds in `weights`; passkey filler lengths log-uniform in
    [pk_lo, pk_hi] tokens (many short ones, so each batch holds many retrievals); docs longer
    than `row` are dropped."""
    import math
    rng = random.Random(seed)
    tpl, tok, flen = _W["tpl"], _W["tok"], _W["flen"]
    kinds = [k for k, _ in weights]
    ws = [w for _, w in weights]
    out = []
    for _ in range(count):
        kind = rng.choices(kinds, ws)[0]
        ctx = None
        if kind == "passkey":
            ctx = int(math.exp(rng.uniform(math.log(pk_lo), math.log(pk_hi))))
        s = tasks.train_sample(rng, kind, flen, ctx)
        prompt = tpl.render(s["messages"], s["tools"], True, s["mode"])
        p = tok.encode(prompt, add_special_tokens=False).ids
        c = tok.encode(s["completion"], add_special_tokens=False).ids
        if len(p) + len(c) > row:
            continue
        out.append((p, c, kind))
    return out


def _make_rows(args):
    """Worker: generate a chunk of docs and pack them (docs are iid, so packing per chunk is as
    good as packing globally). Returns (tokens, weights, starts, tokens-by-kind)."""
    seed, count, weights, pk_lo, pk_hi, row, pad_id = args
    docs = _docs_for(seed, count, weights, pk_lo, pk_hi, row)
    kinds = {}
    for p, c, k in docs:
        kinds[k] = kinds.get(k, 0) + len(p) + len(c)
    t, w, st = pack_rows(docs, row=row, pad_id=pad_id, seed=seed)
    return t, w, st, kinds


def slots_per_doc(weights, pk_lo, pk_hi, other=300, overhead=215, align=128, fill=0.9):
    """Rough row slots one doc takes, for sizing a phase's data: non-passkey docs ~300 tokens,
    passkey docs the template overhead plus the mean of the log-uniform filler length, plus the
    alignment padding and the first-fit packing loss."""
    import math
    tot = sum(w for _, w in weights)
    pk = dict(weights).get("passkey", 0) / tot
    mean_f = (pk_hi - pk_lo) / max(1e-9, math.log(pk_hi / pk_lo))
    return (pk * (overhead + mean_f) + (1 - pk) * other + align / 2) / fill


def rows_jobs(n_docs, seed, weights, pk_lo, pk_hi, row, pad_id, chunk=400):
    return [(seed * 1_000_003 + i, min(chunk, n_docs - i * chunk), weights, pk_lo, pk_hi, row, pad_id)
            for i in range((n_docs + chunk - 1) // chunk)]


def join_rows(parts):
    import numpy as np
    kinds = {}
    for _, _, _, k in parts:
        for a, b in k.items():
            kinds[a] = kinds.get(a, 0) + b
    return (np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]),
            np.concatenate([p[2] for p in parts]), kinds)


def worker_pool(procs):
    return mp.get_context("fork").Pool(procs, initializer=_worker_init)


def build_docs(n_docs, seed=1, procs=None):
    procs = procs or max(1, (os.cpu_count() or 2) - 1)
    chunk = 500
    jobs = [(seed * 1_000_003 + i, min(chunk, n_docs - i * chunk))
            for i in range((n_docs + chunk - 1) // chunk)]
    if procs == 1:
        _worker_init()
        res = [_make_docs(j) for j in jobs]
    else:
        with mp.get_context("fork").Pool(procs, initializer=_worker_init) as pool:
            res = pool.map(_make_docs, jobs)
    return [d for r in res for d in r]


def pack_rows(docs, row=ROW, align=128, pad_id=None, seed=0):
    """Packs docs into rows, first fit (a doc goes into the first row with room, so rows are not
    closed early); every doc starts at a multiple of `align` so that MSA blocks (positions // 128
    within the doc) line up with slot blocks. Returns numpy arrays: tokens [R,row] int32,
    weight [R,row] float32 (0 pad, 0.2 prompt, 1 completion, per target position: weight[t]
    applies to predicting tokens[t+1]), start [R,row] int32 (doc start slot; a pad tail belongs
    to its own segment and is never a loss target)."""
    import numpy as np

    rng = random.Random(seed)
    order = list(range(len(docs)))
    rng.shuffle(order)
    rows_t, rows_w, rows_s, used = [], [], [], []
    for i in order:
        p, c, _ = docs[i]
        n = len(p) + len(c)
        span = (n + align - 1) // align * align
        r = next((k for k, u in enumerate(used) if u + span <= row), None)
        if r is None:
            rows_t.append(np.full(row, pad_id, np.int32))
            rows_w.append(np.zeros(row, np.float32))
            rows_s.append(np.zeros(row, np.int32))
            used.append(0)
            r = len(used) - 1
        start = used[r]
        rows_t[r][start:start + n] = p + c
        # predicting token j+1 from position j: prompt targets weight 0.2, completion 1.0
        w = np.zeros(n, np.float32)
        w[: len(p) - 1] = 0.2
        w[len(p) - 1: n - 1] = 1.0
        rows_w[r][start:start + n] = w
        end = min(row, start + span)
        rows_s[r][start:end] = start
        used[r] = end
    for r in range(len(used)):
        if used[r] < row:
            rows_s[r][used[r]:] = used[r]
    return np.stack(rows_t), np.stack(rows_w), np.stack(rows_s)


def main():
    cmd = sys.argv[1] if len(sys.argv) > 1 else "preview"
    if cmd == "tokenizer":
        train_tokenizer()
    elif cmd == "preview":
        docs = build_docs(int(sys.argv[2]) if len(sys.argv) > 2 else 40, seed=3, procs=1)
        tok = load_tokenizer()
        by = {}
        for p, c, k in docs:
            by.setdefault(k, []).append(len(p) + len(c))
        for k, v in sorted(by.items()):
            print(f"{k:12s} n={len(v):4d} mean_len={sum(v) / len(v):7.1f} max={max(v)}")
        for p, c, k in docs[:6]:
            if k == "passkey":
                continue
            print("=" * 80, k)
            print(tok.decode(p, skip_special_tokens=False) + "|||" + tok.decode(c, skip_special_tokens=False))
    else:
        raise SystemExit(f"unknown command {cmd}")


if __name__ == "__main__":
    main()
