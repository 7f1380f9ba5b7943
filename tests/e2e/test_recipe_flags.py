"""The vLLM MiniMax-M3 recipe's launch commands against the real `m3serve serve`, with the demo
model in place of the checkpoint: each starts (and answers /v1/models) or exits at once with a
one-line reason that names the flag and what works today. No-op flags print a notice naming
them; a repeated flag takes its last value; a hub id resolves from the local Hugging Face cache
or gets a message about local paths."""

import json
import os
import re
import shlex
import signal
import subprocess
import urllib.request

import pytest

from conftest import REPO

DEMO = os.path.join(REPO, "models", "demo")
SMALL_BLOCKS = os.path.join(REPO, "tests", "golden", "model", "msa_small_blocks")
PARSERS = "--tool-call-parser minimax_m3 --reasoning-parser minimax_m3 --enable-auto-tool-choice"


def launch(binary, model, args, env=None, timeout=120):
    """Starts `m3serve serve MODEL ARGS`. Returns (proc, port, stderr-so-far) when it listens,
    or (None, returncode, stderr) when it exits first."""
    argv = [binary, "serve", model] + shlex.split(args) + ["--host", "127.0.0.1", "--port", "0"]
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    full_env.update(env or {})
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env)
    line = p.stdout.readline()
    m = re.search(r"listening on http://[^:]+:(\d+)", line)
    if not m:
        p.wait(timeout=timeout)
        return None, p.returncode, p.stderr.read()
    return p, int(m.group(1)), None


def stop(p):
    p.send_signal(signal.SIGTERM)
    try:
        _, err = p.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        p.kill()
        _, err = p.communicate()
    return err


def models(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=30) as r:
        return [m["id"] for m in json.load(r)["data"]]


STARTS = [
    ("fp8_kv", "--tensor-parallel-size 8 --block-size 128 --kv-cache-dtype fp8", {}, []),
    ("mxfp8_indexer_fp8", "--tensor-parallel-size 8 --block-size 128 --attention_config.indexer_kv_dtype fp8",
     {}, []),
    ("tp8", f"--tensor-parallel-size 8 --block-size 128 {PARSERS}", {}, []),
    ("tp8_ep", f"--tensor-parallel-size 8 --enable-expert-parallel --block-size 128 {PARSERS}", {}, []),
    ("dp8_ep", f"--data-parallel-size 8 --enable-expert-parallel --block-size 128 {PARSERS}", {}, []),
    ("fp8_per_channel", "--tensor-parallel-size 8 --block-size 128 --quantization fp8_per_channel", {},
     []),
    ("amd_tp8_text", f"--tensor-parallel-size 8 --block-size 128 --attention-backend TRITON_ATTN {PARSERS}",
     {"VLLM_USE_BREAKABLE_CUDAGRAPH": "0"},
     ["--attention-backend TRITON_ATTN is ignored", "environment VLLM_USE_BREAKABLE_CUDAGRAPH is ignored"]),
    ("nvfp4_baseline", f"--tensor-parallel-size 8 --trust-remote-code --block-size 128 {PARSERS}",
     {"VLLM_FLOAT32_MATMUL_PRECISION": "high"}, ["--trust-remote-code is ignored"]),
    ("mxfp8_mi300x_long", "--tensor-parallel-size 8 --block-size 128 --language-model-only "
     "--max-model-len 65536 --attention-backend TRITON_ATTN --async-scheduling "
     f"--max-num-batched-tokens 16384 {PARSERS}",
     {"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1", "VLLM_ENGINE_READY_TIMEOUT_S": "3600"},
     ["VLLM_ALLOW_LONG_MAX_MODEL_LEN=1"]),
    ("mi355x_high_concurrency", "--tensor-parallel-size 4 --block-size 128 --language-model-only "
     "--moe-backend aiter --max-num-batched-tokens 32768 --attention-backend TRITON_ATTN "
     f"--linear-backend emulation {PARSERS}", {"VLLM_ROCM_SHUFFLE_KV_CACHE_LAYOUT": "0"},
     ["--moe-backend aiter is ignored", "--linear-backend emulation is ignored"]),
    ("agentx_lane", "--tensor-parallel-size 4 --trust-remote-code --block-size 128 "
     "--gpu-memory-utilization 0.90 --enable-chunked-prefill --max-num-batched-tokens 32768 "
     "--compilation-config '{\"cudagraph_mode\":\"FULL_DECODE_ONLY\", \"cudagraph_capture_sizes\": [1,2,4]}' "
     "--language-model-only --enable-prefix-caching --attention-backend ROCM_AITER_UNIFIED_ATTN "
     f"--moe-backend aiter {PARSERS} --default-chat-template-kwargs '{{\"thinking_mode\":\"enabled\"}}' "
     "--max-num-seqs 64 --stream-interval 20", {},
     ["--enable-chunked-prefill is ignored",
      "--compilation-config: CUDA graphs replay steps of exactly 3 sizes"]),
    ("dotted_attention_config", "--pipeline-parallel-size 1 --attention_config.backend FLASHINFER "
     "--attention_config.use_trtllm_attention true --no-enable-flashinfer-autotune --kv-cache-dtype auto",
     {}, ["--attention-config (backend, use_trtllm_attention) is ignored",
          "--pipeline-parallel-size 1 is what m3serve does anyway"]),
    ("vision_encoder", "--tensor-parallel-size 8 --block-size 128 --mm-encoder-tp-mode data "
     "--mm-encoder-attn-backend ROCM_AITER_FA --limit-mm-per-prompt '{\"image\": 2}'", {},
     ["--mm-encoder-tp-mode data", "--mm-encoder-attn-backend ROCM_AITER_FA is ignored"]),
    ("common_vllm_set", "--dtype auto --seed 0 --max-logprobs 20 --disable-log-requests --disable-log-stats "
     "--override-generation-config '{\"temperature\": 1.0, \"top_p\": 0.95, \"top_k\": 40}' "
     "--enable-prompt-tokens-details --exclude-tools-when-tool-choice-none --root-path /m3 "
     "--max_num_seqs 8 --host 256.0.0.1", {},
     ["--seed 0", "--disable-log-requests is what m3serve does anyway", "--root-path /m3"]),
]


@pytest.mark.parametrize("name,args,env,notices", STARTS, ids=[s[0] for s in STARTS])
def test_recipe_command_starts(binary, name, args, env, notices):
    p, port, err = launch(binary, DEMO, args, env)
    assert p is not None, f"{name} did not start (rc {port}): {err}"
    try:
        assert models(port) == [DEMO]
    finally:
        err = stop(p)
    for n in notices:
        assert f"m3serve: note: {n}" in err or n in err, (n, err)
    assert "not expected" not in err


REFUSALS = [
    ("long_without_env", "--tensor-parallel-size 8 --block-size 128 --max-model-len 131072", {},
     ["--max-model-len 131072", "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1"]),
    ("kv_fp16", "--tensor-parallel-size 8 --block-size 128 --kv-cache-dtype fp16", {},
     ["--kv-cache-dtype 'fp16'", "accepted: auto, bfloat16, fp8"]),
    ("indexer_unknown_key", "--block-size 128 --attention_config.indexer_kv_type fp8",
     {}, ["--attention-config key 'indexer_kv_type' is unknown", "indexer_kv_dtype"]),
    ("quantization_unknown", "--tensor-parallel-size 8 --block-size 128 --quantization int3", {},
     ["--quantization 'int3' is unknown", "fp8_per_channel"]),
    ("quantization_mismatch", "--block-size 128 --quantization mxfp8", {},
     ["--quantization mxfp8 does not match the checkpoint", "none (a bf16 checkpoint)"]),
    ("eagle3", "--tensor-parallel-size 8 --trust-remote-code --block-size 128 --language-model-only "
     "--speculative-config '{\"method\": \"eagle3\", \"model\": \"Inferact/MiniMax-M3-EAGLE3\", "
     "\"num_speculative_tokens\": 3}'", {}, ["Inferact/MiniMax-M3-EAGLE3", "does not download"]),
    ("kv_events_publisher", "--tensor-parallel-size 4 --kv-events-config "
     "'{\"enable_kv_cache_events\": true, \"publisher\": \"kafka\"}'", {},
     ["--kv-events-config publisher 'kafka' is unknown", "\"zmq\""]),
    ("kv_transfer_mooncake", "--kv-transfer-config '{\"kv_connector\": \"MooncakeConnector\", "
     "\"kv_role\": \"kv_producer\"}'", {},
     ["--kv-transfer-config kv_connector 'MooncakeConnector' is not available", "NixlConnector",
      "OffloadingConnector"]),
    ("kv_transfer_nixl_role", "--kv-transfer-config '{\"kv_connector\": \"NixlConnector\", "
     "\"kv_role\": \"decoder\"}'", {},
     ["kv_role 'decoder' is unknown; NixlConnector takes kv_producer, kv_consumer, kv_both"]),
    ("kv_transfer_nixl_backend", "--kv-transfer-config '{\"kv_connector\": \"NixlConnector\", "
     "\"kv_role\": \"kv_both\", \"kv_connector_extra_config\": {\"backends\": [\"GDS\"]}}'", {},
     ["kv_connector_extra_config.backends must be [\"UCX\"]"]),
    ("kv_transfer_nixl_port", "--kv-transfer-config '{\"kv_connector\": \"NixlConnector\", "
     "\"kv_role\": \"kv_both\"}'", {"VLLM_NIXL_SIDE_CHANNEL_PORT": "70000"},
     ["VLLM_NIXL_SIDE_CHANNEL_PORT='70000' is not a port number"]),
    ("kv_transfer_unknown", "--kv-transfer-config '{\"kv_connector\": \"FooConnector\", "
     "\"kv_role\": \"kv_both\"}'", {},
     ["--kv-transfer-config kv_connector 'FooConnector' is unknown", "OffloadingConnector"]),
    ("kv_transfer_role", "--kv-transfer-config '{\"kv_connector\": \"OffloadingConnector\", "
     "\"kv_role\": \"kv_consumer\", \"kv_connector_extra_config\": {\"cpu_bytes_to_use\": 1e9}}'", {},
     ["kv_role 'kv_consumer' is a prefill/decode disaggregation role", "kv_both"]),
    ("kv_transfer_role_unknown", "--kv-transfer-config '{\"kv_connector\": \"OffloadingConnector\", "
     "\"kv_role\": \"both\"}'", {}, ["kv_role 'both' is unknown", "kv_both"]),
    ("kv_transfer_no_bytes", "--kv-transfer-config '{\"kv_connector\": \"OffloadingConnector\", "
     "\"kv_role\": \"kv_both\"}'", {}, ["needs kv_connector_extra_config.cpu_bytes_to_use"]),
    ("kv_offloading_lmcache", "--kv-offloading-size 8 --kv-offloading-backend lmcache", {},
     ["--kv-offloading-backend 'lmcache' is not supported", "native"]),
    ("kv_events_key", "--kv-events-config '{\"enable_kv_cache_events\": true, \"port\": 5557}'", {},
     ["--kv-events-config key 'port' is unknown", "endpoint"]),
    ("pipeline_2", "--pipeline-parallel-size 2", {}, ["--pipeline-parallel-size 2", "--tensor-parallel-size"]),
    ("block_16", "--block-size 16", {}, ["--block-size 16", "use --block-size 128"]),
    ("unknown_flag", "--no-such-flag 3", {}, ["--no-such-flag", "m3serve serve --help"]),
]


@pytest.mark.parametrize("name,args,env,words", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_recipe_command_refused_with_reason(binary, name, args, env, words):
    p, rc, err = launch(binary, DEMO, args, env)
    if p is not None:
        stop(p)
        pytest.fail(f"{name} started; it should have been refused")
    assert rc != 0
    errors = [l for l in err.splitlines() if l.startswith("m3serve: error:")]
    assert len(errors) == 1, err
    for w in words:
        assert w in errors[0], (w, errors[0])
    assert "not expected" not in err
    assert "m3serve: loading" not in err, "refused before the weights are read"


def test_repeated_flag_last_wins(binary):
    # The first --host cannot be bound; argparse (vLLM) and m3serve take the last one.
    p, port, err = launch(binary, DEMO, "--host 256.0.0.1 --max-num-seqs 1 --max-num-seqs 4")
    assert p is not None, err
    stop(p)


def test_block_size_defaults_to_the_checkpoints_msa_block(binary):
    # msa_small_blocks has 8-token MSA blocks: served without --block-size, refused with 128.
    p, port, err = launch(binary, SMALL_BLOCKS, f"--tokenizer {DEMO}")
    assert p is not None, err
    stop(p)
    p, rc, err = launch(binary, SMALL_BLOCKS, f"--tokenizer {DEMO} --block-size 128")
    assert p is None and rc != 0
    assert "use --block-size 8" in err


def test_hub_id_resolves_from_the_local_cache_or_says_how(binary, tmp_path):
    p, rc, err = launch(binary, "MiniMaxAI/MiniMax-M3", "", {"HF_HOME": str(tmp_path)})
    assert p is None and rc != 0
    assert "does not download" in err and "huggingface-cli download MiniMaxAI/MiniMax-M3" in err
    repo = tmp_path / "hub" / "models--MiniMaxAI--MiniMax-M3"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0123abc")
    (repo / "snapshots").mkdir()
    os.symlink(DEMO, repo / "snapshots" / "0123abc")
    p, port, err = launch(binary, "MiniMaxAI/MiniMax-M3", "--tensor-parallel-size 2", {"HF_HOME": str(tmp_path)})
    assert p is not None, err
    try:
        assert models(port) == ["MiniMaxAI/MiniMax-M3"]  # clients keep sending the hub id
    finally:
        err = stop(p)
    assert "local Hugging Face cache" in err


def test_override_generation_config_and_yarn_free_long_context(binary):
    # VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 lets --max-model-len pass max_position_embeddings (16384
    # for the demo), with a warning; the served length is the one asked for.
    p, port, err = launch(binary, DEMO, "--max-model-len 32k --kv-cache-memory-bytes 256MiB",
                          {"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"})
    assert p is not None, err
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=30) as r:
            assert json.load(r)["data"][0]["max_model_len"] == 32000
    finally:
        err = stop(p)
    assert "were not trained" in err


def test_yarn_1m_recipe_command_serves_a_million_tokens(binary):
    """The recipe's 1M command (YaRN factor 2 over a 512K window through --hf-overrides): the
    context extends to original x factor as in vLLM, with no VLLM_ALLOW_LONG_MAX_MODEL_LEN needed;
    one process here with an fp8 KV cache sized for one 1M-token sequence."""
    yarn = {"text_config": {"rope_scaling": {"rope_type": "yarn", "factor": 2.0,
                                             "original_max_position_embeddings": 524288}}}
    args = ("--block-size 128 --kv-cache-dtype fp8 --max-model-len 1048576 --kv-cache-memory-bytes 1300MiB "
            f"{PARSERS} --hf-overrides {shlex.quote(json.dumps(yarn))}")
    p, port, err = launch(binary, DEMO, args)
    assert p is not None, err
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=30) as r:
            assert json.load(r)["data"][0]["max_model_len"] == 1048576
        body = json.dumps({"model": DEMO, "prompt": "The capital of", "max_tokens": 4, "temperature": 0}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            assert json.load(r)["usage"]["completion_tokens"] == 4
    finally:
        err = stop(p)
    assert "were not trained" not in err
