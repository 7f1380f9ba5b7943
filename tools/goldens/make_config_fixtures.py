#!/usr/bin/env python3
"""Writes the config.json fixtures of tests/unit/model (read by config_test.cpp).

  config_shipped.json       the MiniMax-M3 config.json in its shipped form (text_config with
                            sparse_attention_config, moe_layer_freq, rotary_dim, rope_theta,
                            hidden_act swigluoai). Values transcribed from
                            /work/shared/docs/m3-model.md section 1 (not copied from the repo).
  config_flat.json          the same model after a transformers round trip:
                            MiniMaxM3VLConfig(**shipped).save_pretrained(), i.e. the flat form
                            (index_*, layer_types, mlp_layer_types, rope_parameters, hidden_act
                            silu) with keys equal to the class defaults left out (use_diff).
  config_flat_full.json     the same, every key written (to_dict()).
  config_tiny_shipped.json  a 4-layer model in the shipped form (MSA on layers 1-3, MoE on 2-3),
                            with a small vision_config.
  config_tiny_flat.json     the tiny model after the transformers round trip (save_pretrained).

The C++ test parses every pair and requires equal M3Configs. Run with a Python that has
transformers >= 5.24 (only the config classes are used; torch is not needed):
    python tools/goldens/make_config_fixtures.py
The versions used are written to fixtures/config_fixtures_versions.json.
"""
import json
import os
import sys
import tempfile

import transformers
from transformers.models.minimax_m3_vl.configuration_minimax_m3_vl import MiniMaxM3VLConfig

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "unit",
                   "model", "fixtures")


def shipped_m3():
    n = 60
    freq = [0, 0, 0] + [1] * (n - 3)
    pinpoints = [[336 * a, 336 * b] for a in range(1, 7) for b in range(1, 7)]
    return {
        "architectures": ["MiniMaxM3SparseForConditionalGeneration"],
        "model_type": "minimax_m3_vl",
        "torch_dtype": "bfloat16",
        "image_token_index": 200025,
        "video_token_index": 200026,
        "image_seq_length": 576,
        "process_image_mode": "dynamic_res",
        "image_grid_pinpoints": pinpoints,
        "vision_feature_layer": -1,
        "vision_feature_select_strategy": "full",
        "projector_hidden_act": "gelu",
        "projector_hidden_size": 6144,
        "multimodal_projector_bias": True,
        "img_token_compression_config": {"type": "patch_merge", "spatial_merge_size": 2,
                                         "temporal_patch_size": 2},
        "num_reward_heads": 0,
        "text_config": {
            "hidden_size": 6144,
            "num_hidden_layers": n,
            "num_attention_heads": 64,
            "num_key_value_heads": 4,
            "head_dim": 128,
            "intermediate_size": 3072,
            "dense_intermediate_size": 12288,
            "shared_intermediate_size": 3072,
            "vocab_size": 200064,
            "max_position_embeddings": 1048576,
            "rms_norm_eps": 1e-06,
            "use_gemma_norm": True,
            "use_qk_norm": True,
            "qk_norm_type": "per_head",
            "attention_output_gate": False,
            "rope_theta": 5000000,
            "rotary_dim": 64,
            "partial_rotary_factor": 0.5,
            "hidden_act": "swigluoai",
            "swiglu_alpha": 1.702,
            "swiglu_limit": 7.0,
            "tie_word_embeddings": False,
            "num_local_experts": 128,
            "num_experts_per_tok": 4,
            "n_shared_experts": 1,
            "scoring_func": "sigmoid",
            "use_routing_bias": True,
            "routed_scaling_factor": 2.0,
            "moe_layer_freq": freq,
            "num_mtp_modules": 7,
            "num_nextn_predict_layers": 1,
            "sparse_attention_config": {
                "use_sparse_attention": True,
                "sparse_attention_freq": freq,
                "sparse_num_index_heads": 4,
                "sparse_index_dim": 128,
                "sparse_block_size": 128,
                "sparse_topk_blocks": 16,
                "sparse_score_type": "max",
                "sparse_init_block": 0,
                "sparse_local_block": 1,
                "sparse_disable_index_value": freq,
            },
        },
        "vision_config": {
            "model_type": "clip_vision_model",
            "hidden_size": 1280,
            "num_attention_heads": 16,
            "num_hidden_layers": 32,
            "intermediate_size": 5120,
            "patch_size": 14,
            "image_size": 2016,
            "projection_dim": 6144,
            "hidden_act": "gelu",
            "layer_norm_eps": 1e-05,
            "vision_segment_max_frames": 4,
        },
    }


def shipped_tiny():
    n = 4
    return {
        "architectures": ["MiniMaxM3SparseForConditionalGeneration"],
        "model_type": "minimax_m3_vl",
        "text_config": {
            "hidden_size": 64,
            "num_hidden_layers": n,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "intermediate_size": 32,
            "dense_intermediate_size": 96,
            "shared_intermediate_size": 32,
            "vocab_size": 300,
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-05,
            "rope_theta": 10000,
            "rotary_dim": 8,
            "partial_rotary_factor": 0.5,
            "hidden_act": "swigluoai",
            "swiglu_alpha": 1.702,
            "swiglu_limit": 7.0,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "n_shared_experts": 1,
            "scoring_func": "sigmoid",
            "use_routing_bias": True,
            "routed_scaling_factor": 1.5,
            "moe_layer_freq": [0, 0, 1, 1],
            "bos_token_id": 1,
            "eos_token_id": [2, 3],
            "sparse_attention_config": {
                "use_sparse_attention": True,
                "sparse_attention_freq": [0, 1, 1, 1],
                "sparse_num_index_heads": 2,
                "sparse_index_dim": 16,
                "sparse_block_size": 16,
                "sparse_topk_blocks": 4,
                "sparse_score_type": "max",
                "sparse_init_block": 0,
                "sparse_local_block": 1,
                "sparse_disable_index_value": [0, 1, 1, 1],
            },
        },
        # transformers writes a vision_config (its defaults) even when none is given, so the
        # shipped tiny form carries one too for the two forms to be the same model.
        "vision_config": {
            "hidden_size": 32,
            "num_attention_heads": 2,
            "num_hidden_layers": 1,
            "intermediate_size": 64,
            "patch_size": 14,
        },
    }


def write(name, obj):
    path = os.path.join(OUT, name)
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=False)
        f.write("\n")
    print("wrote", os.path.normpath(path))


def saved_by_transformers(shipped):
    cfg = MiniMaxM3VLConfig(**json.loads(json.dumps(shipped)))
    with tempfile.TemporaryDirectory() as d:
        cfg.save_pretrained(d)
        with open(os.path.join(d, "config.json")) as f:
            return json.load(f), cfg.to_dict()


def main():
    os.makedirs(OUT, exist_ok=True)
    m3 = shipped_m3()
    tiny = shipped_tiny()
    write("config_shipped.json", m3)
    flat, flat_full = saved_by_transformers(m3)
    write("config_flat.json", flat)
    write("config_flat_full.json", flat_full)
    write("config_tiny_shipped.json", tiny)
    tiny_flat, _ = saved_by_transformers(tiny)
    write("config_tiny_flat.json", tiny_flat)
    write("config_fixtures_versions.json",
          {"transformers": transformers.__version__, "python": sys.version.split()[0]})


if __name__ == "__main__":
    main()
