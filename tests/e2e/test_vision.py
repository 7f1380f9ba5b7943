"""Image input through the real `m3serve serve` and the official openai client (issue #20), on the
tiny MiniMax-M3-VL checkpoint of tests/golden/vision/model whose goldens transformers 5.17 made
(tools/goldens/make_vision_goldens.py): greedy tokens and logprobs of prompts with one and two
images against transformers, usage counting the image tokens, the prefix cache keyed by the
image, every bad-input case of the issue answered with a 400 that names the part while the server
goes on serving, --limit-mm-per-prompt and --language-model-only."""

import base64
import json
import os

import openai
import pytest

from conftest import MODEL_NAME, REPO, Server

VISION = os.path.join(REPO, "tests", "golden", "vision")
MODEL = os.path.join(VISION, "model")
IMAGES = os.path.join(VISION, "images")
# Logprob tolerance of the model goldens (tests/model/model_golden_test.cpp derives it); greedy
# steps whose golden top-2 margin is under 4e-3 may flip and end the comparison.
LOGPROB_TOL = 2e-3
MARGIN_FLOOR = 4e-3

MIME = {"png": "image/png", "jpg": "image/jpeg", "webp": "image/webp"}


def data_url(name, payload=None):
    raw = payload if payload is not None else open(os.path.join(IMAGES, name), "rb").read()
    return f"data:{MIME[name.rsplit('.', 1)[1]]};base64," + base64.b64encode(raw).decode()


def golden():
    with open(os.path.join(MODEL, "golden.json")) as f:
        return json.load(f)


def image_messages(urls, text):
    content = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    content.append({"type": "text", "text": text})
    return [{"role": "user", "content": content}]


@pytest.fixture(scope="module")
def vserver(binary):
    s = Server(binary, MODEL, ["--allowed-local-media-path", IMAGES,
                               "--limit-mm-per-prompt", '{"image": 2}'])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def vclient(vserver):
    return openai.OpenAI(base_url=vserver.base + "/v1", api_key="none", max_retries=0)


def chat(client, messages, **kw):
    return client.chat.completions.create(model=MODEL_NAME, messages=messages, temperature=0,
                                          logprobs=True, **kw)


@pytest.mark.parametrize("case", [c["name"] for c in golden()["cases"]])
def test_matches_transformers(vclient, case):
    c = next(x for x in golden()["cases"] if x["name"] == case)
    r = chat(vclient, image_messages([data_url(n) for n in c["images"]], c["text"]),
             max_tokens=len(c["greedy"]))
    assert r.usage.prompt_tokens == len(c["prompt_ids"])  # the image tokens are counted
    got = r.choices[0].logprobs.content
    compared = 0
    for g, t in zip(c["greedy"], got):
        if g["top"][0][1] - g["top"][1][1] < MARGIN_FLOOR:
            break
        assert abs(t.logprob - g["logprob"]) <= LOGPROB_TOL, (case, compared, t.logprob, g["logprob"])
        compared += 1
    assert compared >= 4, f"{case}: only {compared} greedy steps compared"


def test_same_image_reuses_the_cache_and_another_does_not(vclient):
    text = "Tell me about this image, please, in some detail."
    first = chat(vclient, image_messages([data_url("exact.png")], text), max_tokens=2)
    again = chat(vclient, image_messages([data_url("exact.png")], text), max_tokens=2)
    assert again.usage.prompt_tokens_details.cached_tokens > first.usage.prompt_tokens - 128 - 16
    # gray.jpg processes to the same 8x6 patch grid (the same placeholder ids) but other content.
    other = chat(vclient, image_messages([data_url("gray.jpg")], text), max_tokens=2)
    assert other.usage.prompt_tokens == first.usage.prompt_tokens
    assert other.usage.prompt_tokens_details.cached_tokens < first.usage.prompt_tokens - 24


def test_local_file_under_the_allowed_path(vclient):
    url = "file://" + os.path.join(IMAGES, "grad_small.png")
    c = golden()["cases"][0]
    r = chat(vclient, image_messages([url], c["text"]), max_tokens=1)
    assert r.usage.prompt_tokens == len(c["prompt_ids"])
    assert r.choices[0].logprobs.content[0].token is not None


def bad_request(client, messages, *words):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, messages, max_tokens=2)
    msg = e.value.response.json()["error"]["message"]
    for w in words:
        assert w in msg, (w, msg)
    return msg


def test_bad_images_are_400s_naming_the_part(vclient):
    png = open(os.path.join(IMAGES, "exact.png"), "rb").read()
    part = "messages[0].content[1]"

    def two(url):  # the bad image is the second part
        return [{"role": "user", "content": [{"type": "text", "text": "look"},
                                             {"type": "image_url", "image_url": {"url": url}}]}]

    bad_request(vclient, two(data_url("exact.png", png[: len(png) // 2])), part, "PNG")
    bad_request(vclient, two(data_url("photo.jpg", open(os.path.join(IMAGES, "photo.jpg"), "rb").read()[:5000])),
                part, "JPEG")
    corrupt = bytearray(png)
    for i in range(80, len(corrupt), 5):
        corrupt[i] ^= 0x33
    bad_request(vclient, two(data_url("exact.png", bytes(corrupt))), part, "PNG")
    bad_request(vclient, two("data:image/bmp;base64," + base64.b64encode(b"BM:\x00\x00\x00\x00").decode()),
                part, "unsupported image format")
    bad_request(vclient, two("data:image/gif;base64," + base64.b64encode(b"GIF89a\x01\x00\x01\x00").decode()),
                part, "GIF")
    bad_request(vclient, two("data:image/png,not-base64"), part, "not base64")
    bad_request(vclient, two("data:image/png;base64,***"), part, "not valid base64")
    bad_request(vclient, two("https://example.com/cat.png"), part, "data: URL")
    bad_request(vclient, two("file:///etc/hostname"), part, "--allowed-local-media-path")
    # 9000 x 9000 pixels, over the decoder's limit: refused from the header.
    import struct
    import zlib
    ihdr = struct.pack(">IIBBBBB", 9000, 9000, 8, 2, 0, 0, 0)
    chunk = lambda t, d: struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d))  # noqa: E731
    bomb = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 100)) + chunk(b"IEND", b"")
    bad_request(vclient, two(data_url("exact.png", bomb)), part, "limit")
    bad_request(vclient, [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}]}],
        "messages[0].content[0]", "video")
    three = image_messages([data_url("exact.png")] * 3, "three")
    bad_request(vclient, three, "--limit-mm-per-prompt")
    # The placeholder typed as text is not an image.
    bad_request(vclient, [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url("exact.png")}},
        {"type": "text", "text": "]<]image[>["}]}], "placeholders")
    # ... and the server goes on serving.
    c = golden()["cases"][0]
    r = chat(vclient, image_messages([data_url(n) for n in c["images"]], c["text"]), max_tokens=1)
    assert r.choices[0].logprobs.content[0].token is not None


def test_language_model_only_refuses_images(binary):
    s = Server(binary, MODEL, ["--language-model-only"])
    try:
        client = openai.OpenAI(base_url=s.base + "/v1", api_key="none", max_retries=0)
        bad_request(client, image_messages([data_url("exact.png")], "hi"), "--language-model-only")
        r = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=2)
        assert r.usage.completion_tokens == 2
    finally:
        s.stop()


def test_concurrent_image_requests_with_bad_ones_among_them(vclient):
    # Good and bad image requests at once: every good one gets the answer it gets alone, every
    # bad one its 400, and nothing else is disturbed.
    from concurrent.futures import ThreadPoolExecutor

    cases = golden()["cases"]
    alone = {}
    for c in cases:
        r = chat(vclient, image_messages([data_url(n) for n in c["images"]], c["text"]), max_tokens=4)
        alone[c["name"]] = [t.token for t in r.choices[0].logprobs.content]
    png = open(os.path.join(IMAGES, "exact.png"), "rb").read()

    def good(c):
        r = chat(vclient, image_messages([data_url(n) for n in c["images"]], c["text"]), max_tokens=4)
        return c["name"], [t.token for t in r.choices[0].logprobs.content]

    def bad(i):
        try:
            chat(vclient, image_messages([data_url("exact.png", png[: 100 + i])], "x"), max_tokens=2)
        except openai.BadRequestError as e:
            return e.response.status_code
        return 200

    with ThreadPoolExecutor(12) as pool:
        goods = [pool.submit(good, cases[i % len(cases)]) for i in range(9)]
        bads = [pool.submit(bad, i) for i in range(9)]
        for f in goods:
            name, toks = f.result()
            assert toks == alone[name], name
        assert [f.result() for f in bads] == [400] * 9


def test_process_image_cli_matches_the_hf_processor(binary, tmp_path):
    import subprocess

    want = json.load(open(os.path.join(VISION, "processor.json")))["images"]
    files = [os.path.join(IMAGES, n) for n in sorted(want)]
    out = subprocess.run([binary, "process-image", *files, "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rows = [json.loads(l) for l in out.stdout.splitlines()]
    assert len(rows) == len(files)
    for r in rows:
        w = want[os.path.basename(r["file"])]
        assert r["grid_thw"] == w["grid_thw"] and r["num_tokens"] == w["num_tokens"]
        assert r["pixel_values_xxh64"] == w["pixel_values_xxh64"], r["file"]
        assert os.path.getsize(r["pixel_values_file"]) == r["grid_thw"][1] * r["grid_thw"][2] * 1176 * 4
    bad = subprocess.run([binary, "process-image", os.path.join(VISION, "processor.json")],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "unsupported image format" in bad.stdout
