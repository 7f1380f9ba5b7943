"""aiperf (NVIDIA's serving benchmark, installed by tools/setup.sh in .deps/aiperf-venv) runs
unchanged against `m3serve serve` with the demo model: chat and completions, streamed and not,
every request answered (streamed requests with a first token); its metrics come out."""

import json
import os
import subprocess

import pytest

from conftest import REPO, Server

DEMO = os.path.join(REPO, "models", "demo")
AIPERF = os.path.join(REPO, ".deps", "aiperf-venv", "bin", "aiperf")


@pytest.fixture(scope="module")
def demo(binary):
    if not os.path.exists(AIPERF):
        if os.environ.get("CI"):
            pytest.fail("aiperf is missing: tools/setup.sh installs it in .deps/aiperf-venv")
        pytest.skip("aiperf not installed (tools/setup.sh installs it)")
    s = Server(binary, DEMO, ["--served-model-name", "m3demo", "--tool-call-parser", "minimax_m3",
                              "--reasoning-parser", "minimax_m3", "--enable-auto-tool-choice"])
    yield s
    s.stop()


@pytest.mark.parametrize("endpoint,stream", [("chat", True), ("completions", False)])
def test_aiperf_profile(demo, tmp_path, endpoint, stream):
    # ignore_eos keeps every answer non-empty (the demo model may end a random prompt at once,
    # which aiperf counts as an error); as users run it against vLLM for fixed output lengths.
    argv = [AIPERF, "profile", "--model", "m3demo", "--url", demo.base, "--endpoint-type", endpoint,
            "--tokenizer", DEMO, "--concurrency", "4", "--request-count", "12",
            "--synthetic-input-tokens-mean", "48", "--output-tokens-mean", "16",
            "--extra-inputs", "ignore_eos:true", "--ui-type", "none", "--artifact-dir", str(tmp_path)]
    if stream:
        argv.append("--streaming")
    env = dict(os.environ)
    r = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.load(open(tmp_path / "profile_export_aiperf.json"))
    text = json.dumps(summary)
    assert "request_throughput" in text, text[:2000]
    records = [json.loads(l) for l in open(tmp_path / "profile_export.jsonl")]
    assert len(records) == 12 and not [x for x in records if x.get("error")], \
        [x["error"] for x in records if x.get("error")][:3]
    if stream:
        assert all("time_to_first_token" in x["metrics"] for x in records)
