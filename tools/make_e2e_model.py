#!/usr/bin/env python3
"""Make a tiny random-weight MiniMax-M3 checkpoint for the server's end-to-end tests.

The model is real in every way the server and engine see (the checkpoint's tensor names and
dtypes, the transformers-style config.json, 128-token MSA blocks, a dense layer then an MSA + MoE
layer, the M3 test tokenizer, the built-in M3 chat template, generation_config.json), only tiny
and random, so it runs fast on a CPU and emits arbitrary tokens. Deterministic for a given seed.

Usage: python3 tools/make_e2e_model.py OUT_DIR [--seed 1234]
Writes OUT_DIR/{config.json, generation_config.json, model.safetensors, tokenizer.json,
tokenizer_config.json, chat_template.jinja, e2e_model.json (provenance: script, seed, versions)}.
Needs numpy only (safetensors is written by hand: numpy has no bfloat16).
"""

import argparse
import json
import os
import platform
import shutil
import struct
import sys

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER = os.path.join(REPO, "tests", "golden", "text", "m3_tokenizer", "tokenizer.json")
TEMPLATE = os.path.join(REPO, "tests", "golden", "text", "templates", "minimax_m3.jinja")

# Geometry: small enough that 64 concurrent requests decode quickly on 2 CPU cores.
HIDDEN = 64
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 16
ROTARY = 8
INDEX_HEAD_DIM = 16
BLOCK = 128          # the MSA block == KV page; the server refuses anything else
TOPK_BLOCKS = 2
LOCAL_BLOCKS = 1
EXPERTS = 4
EXPERTS_PER_TOK = 2
INTER = 32           # routed expert
SHARED_INTER = 32
DENSE_INTER = 64
MAX_POS = 8192
LAYER_TYPES = ["full_attention", "minimax_m3_sparse"]
MLP_TYPES = ["dense", "sparse"]


def config(vocab, bos, eos):
    text = {
        "attention_dropout": 0.0,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "dense_intermediate_size": DENSE_INTER,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "index_block_size": BLOCK,
        "index_head_dim": INDEX_HEAD_DIM,
        "index_local_blocks": LOCAL_BLOCKS,
        "index_n_heads": KV_HEADS,
        "index_topk_blocks": TOPK_BLOCKS,
        "initializer_range": 0.02,
        "intermediate_size": INTER,
        "layer_types": LAYER_TYPES,
        "max_position_embeddings": MAX_POS,
        "mlp_layer_types": MLP_TYPES,
        "model_type": "minimax_m3_vl_text",
        "num_attention_heads": HEADS,
        "num_experts_per_tok": EXPERTS_PER_TOK,
        "num_hidden_layers": len(LAYER_TYPES),
        "num_key_value_heads": KV_HEADS,
        "num_local_experts": EXPERTS,
        "output_router_logits": False,
        "pad_token_id": None,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {"partial_rotary_factor": ROTARY / HEAD_DIM, "rope_theta": 5000000.0, "rope_type": "default"},
        "rotary_dim": ROTARY,
        "routed_scaling_factor": 2.0,
        "router_aux_loss_coef": 0.001,
        "router_jitter_noise": 0.0,
        "shared_intermediate_size": SHARED_INTER,
        "swiglu_alpha": 1.702,
        "swiglu_limit": 7.0,
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": vocab,
    }
    return {
        "architectures": ["MiniMaxM3SparseForConditionalGeneration"],
        "dtype": "bfloat16",
        "model_type": "minimax_m3_vl",
        "text_config": text,
        "tie_word_embeddings": False,
    }


def tensors(rng, vocab):
    """name -> (array float32, dtype 'BF16' | 'F32') with the checkpoint's names."""
    out = {}

    def w(name, shape, std, dtype="BF16", mean=0.0):
        out[name] = ((rng.standard_normal(shape) * std + mean).astype(np.float32), dtype)

    base = "language_model.model."
    w(base + "embed_tokens.weight", (vocab, HIDDEN), 1.0)
    w("language_model.lm_head.weight", (vocab, HIDDEN), 0.125)
    w(base + "norm.weight", (HIDDEN,), 0.1)
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    for i, (lt, mt) in enumerate(zip(LAYER_TYPES, MLP_TYPES)):
        p = f"{base}layers.{i}."
        w(p + "input_layernorm.weight", (HIDDEN,), 0.1)
        w(p + "post_attention_layernorm.weight", (HIDDEN,), 0.1)
        w(p + "self_attn.q_proj.weight", (q, HIDDEN), HIDDEN ** -0.5)
        w(p + "self_attn.k_proj.weight", (kv, HIDDEN), HIDDEN ** -0.5)
        w(p + "self_attn.v_proj.weight", (kv, HIDDEN), HIDDEN ** -0.5)
        w(p + "self_attn.o_proj.weight", (HIDDEN, q), q ** -0.5)
        w(p + "self_attn.q_norm.weight", (HEAD_DIM,), 0.1)
        w(p + "self_attn.k_norm.weight", (HEAD_DIM,), 0.1)
        if lt == "minimax_m3_sparse":
            w(p + "self_attn.index_q_proj.weight", (KV_HEADS * INDEX_HEAD_DIM, HIDDEN), HIDDEN ** -0.5)
            w(p + "self_attn.index_k_proj.weight", (INDEX_HEAD_DIM, HIDDEN), HIDDEN ** -0.5)
            w(p + "self_attn.index_q_norm.weight", (INDEX_HEAD_DIM,), 0.1)
            w(p + "self_attn.index_k_norm.weight", (INDEX_HEAD_DIM,), 0.1)
        if mt == "dense":
            m = p + "block_sparse_moe."
            w(m + "gate_proj.weight", (DENSE_INTER, HIDDEN), HIDDEN ** -0.5)
            w(m + "up_proj.weight", (DENSE_INTER, HIDDEN), HIDDEN ** -0.5)
            w(m + "down_proj.weight", (HIDDEN, DENSE_INTER), DENSE_INTER ** -0.5)
        else:
            m = p + "block_sparse_moe."
            w(m + "gate.weight", (EXPERTS, HIDDEN), HIDDEN ** -0.5, "F32")
            w(m + "e_score_correction_bias", (EXPERTS,), 0.01, "F32")
            for e in range(EXPERTS):
                ep = f"{m}experts.{e}."
                w(ep + "w1.weight", (INTER, HIDDEN), HIDDEN ** -0.5)
                w(ep + "w3.weight", (INTER, HIDDEN), HIDDEN ** -0.5)
                w(ep + "w2.weight", (HIDDEN, INTER), INTER ** -0.5)
            w(m + "shared_experts.gate_proj.weight", (SHARED_INTER, HIDDEN), HIDDEN ** -0.5)
            w(m + "shared_experts.up_proj.weight", (SHARED_INTER, HIDDEN), HIDDEN ** -0.5)
            w(m + "shared_experts.down_proj.weight", (HIDDEN, SHARED_INTER), SHARED_INTER ** -0.5)
    return out


def to_bf16_bytes(a):
    # Round to nearest even, as torch's float32 -> bfloat16 cast does.
    u = a.astype(np.float32).view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return r.astype("<u2").tobytes()


def write_safetensors(path, named):
    header, blobs, offset = {}, [], 0
    for name in sorted(named):
        arr, dtype = named[name]
        data = to_bf16_bytes(arr) if dtype == "BF16" else arr.astype("<f4").tobytes()
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    header["__metadata__"] = {"format": "pt"}
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    tok = json.load(open(TOKENIZER, encoding="utf-8"))
    ids = list(tok["model"]["vocab"].values()) + [t["id"] for t in tok["added_tokens"]]
    by_content = {t["content"]: t["id"] for t in tok["added_tokens"]}
    n_tok = max(ids) + 1
    vocab = (n_tok + 127) // 128 * 128  # padded like the real 200,064 rows
    bos, eos = by_content["]~!b["], by_content["[e~["]
    rng = np.random.default_rng(args.seed)
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(config(vocab, bos, eos), f, indent=2)
    with open(os.path.join(args.out, "generation_config.json"), "w") as f:
        json.dump({"do_sample": True, "temperature": 1.0, "top_p": 0.95, "top_k": 40,
                   "bos_token_id": bos, "eos_token_id": eos}, f, indent=2)
    with open(os.path.join(args.out, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "]~b]", "eos_token": "[e~[", "model_max_length": MAX_POS}, f, indent=2)
    shutil.copyfile(TOKENIZER, os.path.join(args.out, "tokenizer.json"))
    shutil.copyfile(TEMPLATE, os.path.join(args.out, "chat_template.jinja"))
    write_safetensors(os.path.join(args.out, "model.safetensors"), tensors(rng, vocab))
    with open(os.path.join(args.out, "e2e_model.json"), "w") as f:
        json.dump({"generator": "tools/make_e2e_model.py", "seed": args.seed, "vocab_size": vocab,
                   "tokenizer_size": n_tok, "eos_token_id": eos, "bos_token_id": bos,
                   "versions": {"python": platform.python_version(), "numpy": np.__version__}}, f, indent=2)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
