#!/usr/bin/env python3
"""Make the tokenizer fixtures and goldens for tests/unit/text/tokenizer (m3::text::Tokenizer).

Writes, with HF `tokenizers` (PyPI) as the oracle:
  tests/golden/text/m3_tokenizer/tokenizer.json      small byte-level BPE trained here, carrying
                                                     MiniMax-M3's 61 special tokens (ids right
                                                     after the BPE vocab), o200k-style Split +
                                                     ByteLevel(use_regex=false) like M3.
  tests/golden/text/tokenizer/flags_tokenizer.json   tiny second fixture: NFKC normalizer,
                                                     ByteLevel(add_prefix_space, GPT-2 regex),
                                                     TemplateProcessing, and added tokens with
                                                     lstrip/rstrip/single_word/normalized flags.
  tests/golden/text/tokenizer/goldens.json           encode/decode cases for those two and for
                                                     the real Qwen3 tokenizer (read from
                                                     /work/shared/fixtures, not copied).
Everything is deterministic (fixed seeds; BPE training is single-threaded here).
Run: RAYON_NUM_THREADS=1 python3 tools/goldens/make_tokenizer_goldens.py
"""
import json
import os
import random
import sys

os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import tokenizers  # noqa: E402
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers  # noqa: E402
from tokenizers import pre_tokenizers, processors, trainers  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
OUT_DIR = os.path.join(ROOT, "tests", "golden", "text", "tokenizer")
M3_DIR = os.path.join(ROOT, "tests", "golden", "text", "m3_tokenizer")
QWEN3 = os.path.join(ROOT, "..", "shared", "fixtures", "qwen3-tokenizer", "tokenizer.json")

# o200k_base split regex (what MiniMax-M3's tokenizer.json uses, m3-model.md §6.1).
O200K_REGEX = "|".join([
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])

# MiniMax-M3 special tokens in id order (m3-model.md §6.1, ids 200000-200060 in the real model).
M3_SPECIALS = (
    ["]!p~["]
    + ["<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>", "<reponame>", "<filename>",
       "<gh_stars>", "<issue_start>", "<issue_comment>", "<issue_closed>", "<jupyter_start>",
       "<jupyter_text>", "<jupyter_code>", "<jupyter_output>", "<empty_output>",
       "<commit_before>", "<commit_msg>", "<commit_after>"]
    + ["]~b]", "[e~[", "]!d~[", "<function_call>", "<code_interpreter>", "]<]speech[>[",
       "]<]image[>[", "]<]video[>[", "]<]start of speech[>[", "]<]end of speech[>[",
       "]<]start of image[>[", "]<]end of image[>[", "]<]start of video[>[",
       "]<]end of video[>[", "]<]vision pad[>[", "]~!b["]
    + ["<jupyter_error>", "<add_file>", "<delete_file>", "<rename_file>", "<edit_file>",
       "<commit_message>", "<empty_source_file>", "<repo_struct>", "<code_context>",
       "<file_content>", "<source_files>", "<pr_start>", "<review_comment>", "<filepath>",
       "<file_sep>"]
    + ["<think>", "</think>", "<tool_call>", "</tool_call>", "]<]frame[>[",
       "]<]start of frame[>[", "]<]end of frame[>[", "<|content_altered_placeholder|>",
       "]<]minimax[>[", "<mm:think>", "</mm:think>"]
)
assert len(M3_SPECIALS) == 61, len(M3_SPECIALS)

WORDS = ("the of and to in is that for it with as was on be by this are from at or an have not "
         "which but all were when we there can more if will one about their has would what up "
         "model token server request stream batch cache kernel tensor attention expert router "
         "latency throughput memory buffer thread queue schedule prefill decode sample").split()
CJK = "你好世界这是一个测试中文分词器模型的注意力机制专家路由缓存请求日本語のテキストとカタカナ안녕하세요세계"
EMOJI = ["😀", "👍🏽", "👨‍👩‍👧‍👦", "🇯🇵", "❤️", "🚀", "🤖", "✅", "🧑🏿‍💻"]
CODE = [
    "def f(x):\n    return x * 2 + 1\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}\n",
    '{"key": [1, 2, 3], "nested": {"a": null, "b": true}}\n',
    "#include <vector>\nstd::vector<int> v{1, 2, 3};\n",
    "SELECT id, name FROM users WHERE age >= 18 ORDER BY name;\n",
    "    if not items:\n        raise ValueError('empty')\n\n",
]


def training_corpus(rng):
    lines = []
    for _ in range(6000):
        kind = rng.random()
        if kind < 0.45:
            n = rng.randint(3, 14)
            s = " ".join(rng.choice(WORDS) for _ in range(n))
            if rng.random() < 0.5:
                s = s.capitalize()
            lines.append(s + rng.choice([".", ",", "!", "?", "", ":"]))
        elif kind < 0.65:
            lines.append(rng.choice(CODE))
        elif kind < 0.78:
            lines.append(" ".join(str(rng.randint(0, 10 ** rng.randint(1, 12))) for _ in range(4)))
        elif kind < 0.92:
            lines.append("".join(rng.choice(CJK) for _ in range(rng.randint(2, 16))))
        else:
            lines.append(" ".join(rng.choice(EMOJI) for _ in range(rng.randint(1, 4))))
    return lines


def make_m3_fixture(rng):
    tok = Tokenizer(models.BPE())
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(O200K_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=3000, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(training_corpus(rng), trainer=trainer)
    # Specials after training so they get ids right after the BPE vocab (as in M3: 200000+).
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in M3_SPECIALS])
    return tok


FLAG_TOKENS = [
    # content, special, lstrip, rstrip, single_word, normalized
    ("<s>", True, False, False, False, False),
    ("</s>", True, False, False, False, False),
    ("[MASK]", True, True, False, False, False),
    ("<R>", False, False, True, False, False),
    ("<Both>", True, True, True, False, False),
    ("zzyzx", False, False, False, True, False),
    ("qq", False, False, False, True, True),
    ("\ufb01x", False, False, False, False, True),   # 'ﬁx': NFKC-normalized to 'fix'
    ("<a>", True, False, False, False, False),
    ("<a><b>", True, False, False, False, False),
    ("\u2192", False, False, False, False, False),  # '→' (not a byte-level char: raw decode)
    ("new york", False, False, False, False, False),
    ("the", False, False, False, False, False),     # already in the BPE vocab: keeps its id
]


def make_flags_fixture(rng):
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.Sequence([normalizers.NFKC()])
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(training_corpus(rng)[:1500], trainer=trainer)
    tok.add_tokens([AddedToken(c, special=sp, lstrip=ls, rstrip=rs, single_word=sw, normalized=nm)
                    for (c, sp, ls, rs, sw, nm) in FLAG_TOKENS])
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> $B:1 </s>:1",
        special_tokens=[("<s>", bos), ("</s>", eos)])
    return tok


def common_cases(specials):
    long_rng = random.Random(7)
    long_text = " ".join(long_rng.choice(WORDS) for _ in range(1500)) + "\n" + \
        "".join(long_rng.choice(CJK) for _ in range(500))
    cases = [
        "", " ", "  ", "   ", "\t", "\n", "\n\n\n", " \n \n", "\r\n", "a \n\n b",
        "hello world", "Hello  world   !", "a\tb\t\tc\t", "line1\r\nline2\r\n", "abc   ",
        "   leading", "trailing\n   ", "1234567890", "3.14159 2718281828 1,000,000",
        "x=10000000000000;", "0.5e-10 +42 -7", "version 1.2.3-rc4",
        "I'm you're they've he'll she'd IT'S DON'T we'Re", "it'\u017f ok 's 'S",
        "CamelCaseWords and HTTPServer2 getHTTPResponse", "ALLCAPS lowercase MiXeD",
        "https://example.com/path?q=1&r=2#frag", "foo/bar//baz\n/\n", "!!!??? ... --- *** ///",
        "a'b'c 's 't", "(parens) [brackets] {braces} <angles>", "tab\tseparated\tvalues\n",
        "def f(x):\n    return x * 2 + 1\n\n\nclass A:\n\tpass\n",
        "for (int i = 0; i < n; ++i) {\n    sum += a[i];  // acc\n}\n",
        '{"key": [1, 2, 3], "nested": {"a": null, "b": true}}',
        "你好，世界！这是一个测试。", "日本語のテキストとカタカナ、ひらがな。", "안녕하세요 세계",
        "mixed 中文 and English 混合 text123", "\U0001F600 \U0001F44D\U0001F3FD \U0001F680!",
        "family: \U0001F468\u200d\U0001F469\u200d\U0001F467\u200d\U0001F466 flag: \U0001F1EF\U0001F1F5 heart \u2764\ufe0f",
        "e\u0301 cafe\u0301 A\u030a n\u0303o \u212b \u1100\u1161\u11a8", "\u0301\u0301 leading marks",
        "\u00a0nbsp \u3000ideographic\u2003em \u180e mongolian \u200b zw \u2028ls \u0085nel",
        "\u00e9t\u00e9 na\u00efve r\u00e9sum\u00e9 \u00fcber stra\u00dfe",
        "\u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645 \u05e9\u05dc\u05d5\u05dd",
        "\u0928\u092e\u0938\u094d\u0924\u0947 \u0926\u0941\u0928\u093f\u092f\u093e",
        "\ufb01le \ufb02ow \u2460 \u00bd x\u00b2 \uff21\uff22\uff23",
        "ends with space ", " \t \n\t\n  x", "\n\n\n\n\n\n\n\nx\n\n",
        long_text,
        # Long single pre-tokens exercise the heap-based merge path (> 32 symbols).
        "x" * 300, " " * 300 + "y", "ab" * 150, "=" * 120 + "\n" * 50, "\u4f60\u597d" * 80,
        "\U0001F600" * 40,
    ]
    # Special tokens inside text, at the edges, adjacent, partial.
    s = specials
    cases += [
        s[0] + "hello" + s[1], "x" + s[0] + s[0] + "y", " " + s[0] + " ", s[0],
        s[0][:-1] + " partial " + s[0][1:], s[1] + "\n" + s[2] + "\n\n" + s[0] + " tail",
    ]
    return cases


def random_cases(rng, specials, n):
    pools = [
        "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ", "0123456789",
        " \t\n\r", "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~", CJK, "".join(EMOJI),
        "\u0301\u0308\u0303\u200d\ufe0f\u00a0\u3000\u2028\u180e\u0085\u00e9\u00c5\u212b\ufb01",
        "'sSlLdDmMtTrReEvV",
    ]
    out = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(0, 12)):
            r = rng.random()
            if r < 0.08 and specials:
                parts.append(rng.choice(specials))
            else:
                pool = rng.choice(pools)
                parts.append("".join(rng.choice(pool) for _ in range(rng.randint(1, 6))))
        out.append("".join(parts))
    return out


INVALID_UTF8 = [b"abc\xff\xfedef", b"\xe4\xb8", b"x\xe4\xb8y", b"\xed\xa0\x80x", b"\xc0\xafz",
                b"\xf0\x9f\x98", b"ok \xf0\x9f\x98\x80 \xf0\x90\x80", b"\x80\x80 cont", b"\xf5\xff"]


def encode_cases(tok, texts, raw_cases):
    out = []
    def case(key, value, text):
        ids = tok.encode(text, add_special_tokens=False).ids
        c = {key: value, "ids": ids}
        decoded = tok.decode(ids, skip_special_tokens=False)
        if decoded != text:  # e.g. NFC / NFKC / add_prefix_space: record what HF gives back
            c["decoded"] = decoded
        return c
    for t in texts:
        out.append(case("text", t, t))
    for b in raw_cases:
        t = b.decode("utf-8", errors="replace")  # our documented behaviour for invalid UTF-8
        out.append(case("bytes_hex", b.hex(), t))
    return out


def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


BYTES_TO_UNICODE = bytes_to_unicode()


def decode_cases(tok, specials, rng):
    """Id sequences that stress decode: split UTF-8 chars, specials between bytes, bad ids."""
    bid = lambda b: tok.token_to_id(BYTES_TO_UNICODE[b])  # noqa: E731
    sid = [tok.token_to_id(s) for s in specials]
    ni = bid(0xE4), bid(0xBD), bid(0xA0)  # '你' = E4 BD A0
    seqs = [
        [], list(ni), [ni[0]], [ni[0], ni[1]], [ni[0], sid[0], ni[1], ni[2]],
        [sid[0], ni[0], ni[1], ni[2], sid[1]], [ni[1], ni[2]], [bid(0xFF), bid(0x41)],
        [bid(0xF0), bid(0x9F), bid(0x98), bid(0x80)], [bid(0xF0), bid(0x9F), bid(0x98)],
        [10 ** 9, ni[0], ni[1], ni[2]], sid[:4],
        tok.encode(specials[0] + " hello " + specials[1] + " \u4f60\u597d", add_special_tokens=False).ids,
    ]
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    for _ in range(40):  # random id soup, including every kind of token
        seqs.append([rng.randrange(vocab_size) for _ in range(rng.randint(1, 12))])
    out = []
    for ids in seqs:
        out.append({"ids": ids, "skip_special": False, "text": tok.decode(ids, skip_special_tokens=False)})
        out.append({"ids": ids, "skip_special": True, "text": tok.decode(ids, skip_special_tokens=True)})
    return out


def main():
    rng = random.Random(20240601)
    os.makedirs(OUT_DIR, exist_ok=True)
    os.makedirs(M3_DIR, exist_ok=True)

    m3 = make_m3_fixture(random.Random(1))
    m3.save(os.path.join(M3_DIR, "tokenizer.json"), pretty=False)
    flags = make_flags_fixture(random.Random(2))
    flags.save(os.path.join(OUT_DIR, "flags_tokenizer.json"), pretty=False)
    # Reload what we wrote so goldens come from exactly the files the tests read.
    m3 = Tokenizer.from_file(os.path.join(M3_DIR, "tokenizer.json"))
    flags = Tokenizer.from_file(os.path.join(OUT_DIR, "flags_tokenizer.json"))

    suites = []
    m3_specials = M3_SPECIALS
    texts = common_cases(["]~b]", "[e~[", "<mm:think>"]) + [
        "]~!b[]~b]system\nYou are a helpful assistant.[e~[\n]~b]user\nhi there[e~[\n]~b]ai\n"
        "<mm:think>Let me think.</mm:think>Hello!]<]minimax[>[<tool_call>\n]<]minimax[>[<invoke "
        "name=\"get_weather\">]<]minimax[>[<city>Paris]<]minimax[>[</city>]<]minimax[>[</invoke>\n"
        "]<]minimax[>[</tool_call>[e~[",
        "]<]start of image[>[]<]image[>[]<]image[>[]<]end of image[>[",
        "<think> vs <mm:think> vs <mm:think >", "]~b ]~b]] [e~[[e~[ [e~", "<|content_altered_placeholder|>x",
    ]
    suites.append({
        "name": "m3", "tokenizer": "tests/golden/text/m3_tokenizer/tokenizer.json",
        "encode": encode_cases(m3, texts + random_cases(rng, m3_specials, 300), INVALID_UTF8),
        "decode": decode_cases(m3, ["]~b]", "[e~[", "<mm:think>", "</mm:think>"], rng),
        "specials": {s: m3.token_to_id(s) for s in M3_SPECIALS},
        "vocab_size": m3.get_vocab_size(with_added_tokens=True),
    })

    flag_specials = [t[0] for t in FLAG_TOKENS]
    flag_texts = common_cases(["<s>", "</s>", "[MASK]"]) + [
        "a [MASK] b", "a   [MASK]   b", "[MASK][MASK]  [MASK]", "x <R>   y", "x<R>\n\n y",
        "  <Both>  z", "zzyzx", "a zzyzx b", "azzyzx", "zzyzx_", "zzyzx!", "qq qqq qq.", "\ufb01x fix \ufb01xes",
        "<a><b><a> <a><b", "new york new  york", "\u2192\u2192 \u2192", "the then other the",
        "<s>x</s>", "\u00e9qq", "_zzyzx", "\u00e9zzyzx", "zzyzx\u00e9", "\u4f60zzyzx",
    ]
    flags_suite = {
        "name": "flags", "tokenizer": "tests/golden/text/tokenizer/flags_tokenizer.json",
        "encode": encode_cases(flags, flag_texts + random_cases(rng, flag_specials, 300), INVALID_UTF8),
        "decode": decode_cases(flags, ["<s>", "</s>", "\ufb01x", "<R>"], rng),
        "vocab_size": flags.get_vocab_size(with_added_tokens=True),
        "with_special": [{"text": t, "ids": flags.encode(t).ids} for t in ["", "hello", "a [MASK] b"]],
    }
    suites.append(flags_suite)

    # Variants of the flags fixture: other Split behaviours / invert / String patterns, and
    # ignore_merges. `patch` is applied to the JSON before loading (keys "model.X" patch model).
    variant_texts = flag_texts[:60] + random_cases(rng, flag_specials, 60)
    splits = [
        ("isolated", False, {"Regex": r"\s+|\d"}), ("removed", False, {"Regex": r"\s+|\d"}),
        ("merged_with_previous", False, {"Regex": r"\s+|\d"}),
        ("merged_with_next", False, {"Regex": r"\s+|\d"}), ("contiguous", False, {"Regex": r"\s|\d"}),
        ("removed", True, {"Regex": r"[a-z]+"}), ("isolated", False, {"String": " "}),
        ("merged_with_next", True, {"String": "e"}), ("isolated", False, {"Regex": r"x*"}),
    ]
    for idx, (behavior, invert, pattern) in enumerate(splits):
        pt = pre_tokenizers.Split(Regex(pattern["Regex"]) if "Regex" in pattern else pattern["String"],
                                  behavior=behavior, invert=invert)
        seq = pre_tokenizers.Sequence([pt, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        probe = Tokenizer.from_str(flags.to_str())
        probe.pre_tokenizer = seq
        patch = {"pre_tokenizer": json.loads(probe.to_str())["pre_tokenizer"]}
        suites.append({"name": f"flags_split{idx}_{behavior}_{'inv' if invert else 'fwd'}_{list(pattern)[0]}",
                       "tokenizer": flags_suite["tokenizer"], "patch": patch,
                       "encode": encode_cases(probe, variant_texts, [])})
    j = json.loads(flags.to_str())
    j["model"]["ignore_merges"] = True
    im = Tokenizer.from_str(json.dumps(j))
    suites.append({"name": "flags_ignore_merges", "tokenizer": flags_suite["tokenizer"],
                   "patch": {"model.ignore_merges": True},
                   "encode": encode_cases(im, variant_texts, [])})

    if os.path.exists(QWEN3):
        qwen = Tokenizer.from_file(QWEN3)
        q_specials = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>", "<tool_call>"]
        q_texts = common_cases(q_specials) + [
            "<|im_start|>system\nYou are Qwen.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
            "<|im_start|>assistant\n<think>\n\n</think>\n\nHello!<|im_end|>",
        ]
        suites.append({
            "name": "qwen3", "tokenizer": "../shared/fixtures/qwen3-tokenizer/tokenizer.json",
            "optional": True,
            "encode": encode_cases(qwen, q_texts + random_cases(rng, q_specials, 300), INVALID_UTF8),
            "decode": decode_cases(qwen, ["<|im_start|>", "<|im_end|>", "<think>", "</think>"], rng),
            "vocab_size": qwen.get_vocab_size(with_added_tokens=True),
        })
    else:
        print("warning: Qwen3 tokenizer not found at", QWEN3, "- its goldens are left out",
              file=sys.stderr)

    golden = {
        "generator": "tools/goldens/make_tokenizer_goldens.py",
        "tokenizers_version": tokenizers.__version__,
        "python_version": sys.version.split()[0],
        "invalid_utf8_policy": "bytes_hex cases: ids = HF encode(bytes.decode('utf-8', 'replace'))",
        "suites": suites,
    }
    with open(os.path.join(OUT_DIR, "goldens.json"), "w", encoding="utf-8") as f:
        json.dump(golden, f, ensure_ascii=False, separators=(",", ":"))
        f.write("\n")
    for s in suites:
        print(f"{s['name']}: {len(s['encode'])} encode, {len(s.get('decode', []))} decode cases")


if __name__ == "__main__":
    main()
