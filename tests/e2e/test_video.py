"""Video input through the real `m3serve serve` and the official openai client (issue #20), on the
tiny MiniMax-M3-VL checkpoint of tests/golden/vision/model, against transformers 5.17's goldens
for prompts with a video (tests/golden/vision/video.json, tools/goldens/make_video_goldens.py):
vLLM's `video_url` part (data: URL and file:// under --allowed-local-media-path), the prompt ids
exactly as MiniMaxM3VLProcessor expands them (timestamps per frame pair), prompt logprobs and the
greedy continuation, usage counting the video tokens, the prefix cache keyed by the video's
content, --limit-mm-per-prompt '{"video": M}', and every bad-input case as a 400 that names the
part while the server goes on serving."""

import base64
import json
import os

import openai
import pytest

from conftest import MODEL_NAME, REPO, Server

VISION = os.path.join(REPO, "tests", "golden", "vision")
MODEL = os.path.join(VISION, "model")
VIDEOS = os.path.join(VISION, "videos")
IMAGES = os.path.join(VISION, "images")
LOGPROB_TOL = 2e-3  # the model goldens' tolerance (tests/model/model_golden_test.cpp)
MARGIN_FLOOR = 4e-3

MIME = {"mov": "video/quicktime", "avi": "video/x-msvideo", "png": "image/png"}


def data_url(name, payload=None):
    folder = IMAGES if name.endswith(".png") else VIDEOS
    raw = payload if payload is not None else open(os.path.join(folder, name), "rb").read()
    return f"data:{MIME[name.rsplit('.', 1)[1]]};base64," + base64.b64encode(raw).decode()


def golden():
    with open(os.path.join(VISION, "video.json")) as f:
        return json.load(f)


def part(kind, url):
    return {"type": f"{kind}_url", f"{kind}_url": {"url": url}}


def messages(media, text):
    content = [part(kind, url) for kind, url in media]
    content.append({"type": "text", "text": text})
    return [{"role": "user", "content": content}]


def case_messages(c, local=False):
    def url(kind, name):
        if local and kind == "video":
            return "file://" + os.path.join(VIDEOS, name)
        return data_url(name)

    return messages([(k, url(k, n)) for k, n in c["media"]], c["text"])


@pytest.fixture(scope="module")
def vserver(binary):
    s = Server(binary, MODEL, ["--allowed-local-media-path", VIDEOS,
                               "--limit-mm-per-prompt", '{"image": 2, "video": 1}'])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def vclient(vserver):
    client = openai.OpenAI(base_url=vserver.base + "/v1", api_key="none", max_retries=0)
    try:
        chat(client, messages([("video", data_url("short.avi"))], "probe"), max_tokens=1)
    except openai.BadRequestError as e:
        if "no video decoding" in e.response.json()["error"]["message"]:
            pytest.skip("this m3serve build has no video decoding (built without libav)")
        raise
    return client


def chat(client, msgs, **kw):
    return client.chat.completions.create(model=MODEL_NAME, messages=msgs, temperature=0,
                                          logprobs=True, **kw)


@pytest.mark.parametrize("case", [c["name"] for c in golden()["cases"]])
def test_matches_transformers(vclient, case):
    c = next(x for x in golden()["cases"] if x["name"] == case)
    r = chat(vclient, case_messages(c), max_tokens=len(c["greedy"]),
             extra_body={"return_token_ids": True, "prompt_logprobs": 0})
    body = r.model_dump()
    assert body["prompt_token_ids"] == c["prompt_ids"]  # timestamps + placeholder runs, exactly
    assert r.usage.prompt_tokens == len(c["prompt_ids"])  # the video tokens are counted
    plp = body["prompt_logprobs"]
    worst = 0.0
    for i, want in enumerate(c["prompt_logprobs"]):
        got = plp[i + 1][str(c["prompt_ids"][i + 1])]["logprob"]
        worst = max(worst, abs(got - want["logprob"]))
    assert worst <= LOGPROB_TOL, worst
    compared = 0
    for g, t in zip(c["greedy"], r.choices[0].logprobs.content):
        if g["top"][0][1] - g["top"][1][1] < MARGIN_FLOOR:
            break
        assert abs(t.logprob - g["logprob"]) <= LOGPROB_TOL, (case, compared, t.logprob, g["logprob"])
        compared += 1
    assert compared >= 4, f"{case}: only {compared} greedy steps compared"


def test_local_file_under_the_allowed_path(vclient):
    c = golden()["cases"][0]
    r = chat(vclient, case_messages(c, local=True), max_tokens=1)
    assert r.usage.prompt_tokens == len(c["prompt_ids"])


def test_same_video_reuses_the_cache_and_another_does_not(vclient):
    text = "Tell me about this clip, please, in some detail."
    first = chat(vclient, messages([("video", data_url("pair.mov"))], text), max_tokens=2)
    again = chat(vclient, messages([("video", data_url("pair.mov"))], text), max_tokens=2)
    assert again.usage.prompt_tokens_details.cached_tokens > first.usage.prompt_tokens - 16 - 16
    # odd.avi samples 4 frames of 84x56 like short.avi (3 frames, the last repeated): the same
    # grid, other content: its blocks from the first video token on are not reused.
    a = chat(vclient, messages([("video", data_url("odd.avi"))], text), max_tokens=2)
    b = chat(vclient, messages([("video", data_url("short.avi"))], text), max_tokens=2)
    assert a.usage.prompt_tokens == b.usage.prompt_tokens
    assert b.usage.prompt_tokens_details.cached_tokens < b.usage.prompt_tokens - 24


def bad_request(client, msgs, *words):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, msgs, max_tokens=2)
    msg = e.value.response.json()["error"]["message"]
    for w in words:
        assert w in msg, (w, msg)
    return msg


def test_bad_videos_are_400s_naming_the_part(vclient):
    mov = open(os.path.join(VIDEOS, "pair.mov"), "rb").read()
    avi = open(os.path.join(VIDEOS, "odd.avi"), "rb").read()
    where = "messages[0].content[1]"

    def two(url):  # the bad video is the second part
        return [{"role": "user", "content": [{"type": "text", "text": "look"}, part("video", url)]}]

    bad_request(vclient, two(data_url("pair.mov", mov[: len(mov) // 2])), where, "truncated")
    bad_request(vclient, two(data_url("odd.avi", avi[: len(avi) // 2])), where, "truncated")
    corrupt = bytearray(mov)
    for i in range(2000, len(corrupt), 7):
        corrupt[i] ^= 0x5A
    bad_request(vclient, two(data_url("pair.mov", bytes(corrupt))), where)
    bad_request(vclient, two(data_url("pair.mov", b"\x00" * 64 + b"not a video at all" * 50)),
                where, "not a video file")
    # A PNG is an image, not a container this server reads as video.
    bad_request(vclient, two(data_url("exact.png")), where, "not a video file")
    bad_request(vclient, two("data:video/mp4,AAAA"), where, "not base64")
    bad_request(vclient, two("data:video/mp4;base64,***"), where, "not valid base64")
    bad_request(vclient, two("https://example.com/clip.mp4"), where, "not fetched")
    bad_request(vclient, two("file:///etc/hostname"), where, "outside")
    # Two videos: over --limit-mm-per-prompt '{"video": 1}', the second part named.
    bad_request(vclient, messages([("video", data_url("pair.mov"))] * 2, "two"),
                "messages[0].content[1]", "--limit-mm-per-prompt")
    # The placeholder typed as text is not a video.
    bad_request(vclient, [{"role": "user", "content": [
        part("video", data_url("pair.mov")), {"type": "text", "text": "]<]video[>["}]}],
        "placeholders")
    # ... and the server goes on serving.
    c = golden()["cases"][0]
    r = chat(vclient, case_messages(c), max_tokens=1)
    assert r.usage.prompt_tokens == len(c["prompt_ids"])


def test_video_limit_zero_turns_video_off(binary, vclient):
    # --limit-mm-per-prompt video 0 turns video input off with a 400 that names the flag.
    s = Server(binary, MODEL, ["--limit-mm-per-prompt", '{"video": 0}'])
    try:
        client = openai.OpenAI(base_url=s.base + "/v1", api_key="none", max_retries=0)
        bad_request(client, messages([("video", data_url("pair.mov"))], "hi"),
                    "messages[0].content[0]", "--limit-mm-per-prompt")
    finally:
        s.stop()


def test_concurrent_video_requests_with_bad_ones_among_them(vclient):
    from concurrent.futures import ThreadPoolExecutor

    cases = golden()["cases"]
    alone = {}
    for c in cases:
        r = chat(vclient, case_messages(c), max_tokens=4)
        alone[c["name"]] = [t.token for t in r.choices[0].logprobs.content]
    mov = open(os.path.join(VIDEOS, "pair.mov"), "rb").read()

    def good(c):
        r = chat(vclient, case_messages(c), max_tokens=4)
        return c["name"], [t.token for t in r.choices[0].logprobs.content]

    def bad(i):
        try:
            chat(vclient, messages([("video", data_url("pair.mov", mov[: 200 + 97 * i]))], "x"),
                 max_tokens=2)
        except openai.BadRequestError as e:
            return e.response.status_code
        return 200

    with ThreadPoolExecutor(8) as pool:
        goods = [pool.submit(good, cases[i % len(cases)]) for i in range(6)]
        bads = [pool.submit(bad, i) for i in range(6)]
        for f in goods:
            name, toks = f.result()
            assert toks == alone[name], name
        assert [f.result() for f in bads] == [400] * 6
