#!/usr/bin/env python3
"""Make model goldens for m3serve from HF transformers' `minimax_m3_vl` implementation.

For every config in CONFIGS this builds a tiny `MiniMaxM3SparseForConditionalGeneration`,
gives every weight a real (non-zero, non-identity) value, saves it the way transformers saves
checkpoints (original `language_model.model.layers.N...` names, BF16 with the router in FP32),
RELOADS it from disk in fp32 with eager attention, and scores prompts with that reloaded model
(fp32, TF32 off). Per model directory it writes:

  config.json          as transformers wrote it (flat index_* keys, layer_types, rope_parameters)
  config_shipped.json  the same model in the shipped MiniMax-M3 form (sparse_attention_config,
                       moe_layer_freq, hidden_act swigluoai, rotary_dim, rope_theta, ...)
  model.safetensors    one file
  golden.json          prompt logprobs, greedy continuation (no KV cache), MSA block choices

Usage (needs torch + transformers with minimax_m3_vl; run on the GPU machine):
  python3 tools/goldens/make_model_goldens.py --out tests/golden/model [--only NAME] [--seed S]
CPU-only checks (no torch):
  python3 tools/goldens/make_model_goldens.py --check-configs          # both config forms parse alike
  python3 tools/goldens/make_model_goldens.py --validate tests/golden/model
  python3 tools/goldens/make_model_goldens.py --numpy-check tests/golden/model [--max-len 3000]
      (an independent float64 numpy forward from docs/m3-model.md, compared with golden.json)
See tools/goldens/README.md.
"""

import argparse
import json
import math
import os
import platform
import shutil
import sys
import tempfile

import numpy as np

GENERATOR = "tools/goldens/make_model_goldens.py"
TOP_N = 5

# ----------------------------------------------------------------------------------------------
# Configs. Each entry describes one tiny model in neutral terms; `hf_config_dict` turns it into
# the transformers kwargs and `shipped_config_dict` into the shipped MiniMax-M3 config.json form.
# ----------------------------------------------------------------------------------------------

VISION_TINY = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_channels=3,
    image_size=56,
    patch_size=14,
    temporal_patch_size=2,
    spatial_merge_size=2,
    hidden_act="gelu",
    layer_norm_eps=1e-5,
)

CONFIGS = [
    dict(
        name="msa_small_blocks",
        about="8-token MSA blocks, top-4, local 1: sparsity matters from 33 tokens on; 2 dense "
        "full-attention layers then 3 MoE+MSA layers; 8 experts top-2 + shared, biased router, "
        "routed_scaling 2.0; rope_theta 1e4.",
        vocab_size=1024,
        hidden_size=64,
        num_layers=5,
        first_dense=2,  # layers [0, first_dense) are dense MLP + full attention
        num_heads=8,
        num_kv_heads=2,
        head_dim=32,
        partial_rotary_factor=0.5,
        index_heads=2,
        index_head_dim=32,
        block_size=8,
        topk_blocks=4,
        local_blocks=1,
        use_sparse=True,
        num_experts=8,
        experts_per_tok=2,
        intermediate_size=32,
        shared_intermediate_size=48,
        dense_intermediate_size=128,
        routed_scaling_factor=2.0,
        rope_theta=1.0e4,
        swiglu_alpha=1.702,
        swiglu_limit=7.0,
        projector_hidden_size=32,
        # prompt lengths: 1 token, exactly 8 blocks, odd lengths, a long-ish one
        prompts=[1, 64, 61, 129, 200],
        greedy_tokens=16,
        # cases whose residual stream is dumped per layer (all positions when <= 40 tokens,
        # else the last 16): here the odd-length case, past the point where MSA is sparse
        hidden_dump_cases=[2],
    ),
    dict(
        name="m3_ratio",
        about="M3 head ratios: 64 query heads, 4 KV heads, 4 index heads (16 q heads per KV head); "
        "head_dim 16 with rotary 8 (partial_rotary_factor 0.5), index_head_dim 16; 16-token blocks, "
        "top-4; 2 dense layers then MoE (16 experts, top-4); rope_theta 5e6.",
        vocab_size=1536,
        hidden_size=64,
        num_layers=4,
        first_dense=2,
        num_heads=64,
        num_kv_heads=4,
        head_dim=16,
        partial_rotary_factor=0.5,
        index_heads=4,
        index_head_dim=16,
        block_size=16,
        topk_blocks=4,
        local_blocks=1,
        use_sparse=True,
        num_experts=16,
        experts_per_tok=4,
        intermediate_size=24,
        shared_intermediate_size=24,
        dense_intermediate_size=96,
        routed_scaling_factor=2.0,
        rope_theta=5.0e6,
        swiglu_alpha=1.702,
        swiglu_limit=7.0,
        projector_hidden_size=32,
        prompts=[1, 48, 97, 190],
        greedy_tokens=16,
        hidden_dump_cases=[0, 2],
    ),
    dict(
        name="real_geometry",
        about="The shipped MSA geometry: 128-token blocks, top-16, local 1, M3 head ratios with "
        "tiny dims; a 2450-token prompt (19+ blocks, so real sparsity kicks in past 2048) and a "
        "short one; layer 0 dense, layers 1-2 MoE+MSA; rope_theta 5e6.",
        vocab_size=2048,
        hidden_size=64,
        num_layers=3,
        first_dense=1,
        num_heads=64,
        num_kv_heads=4,
        head_dim=16,
        partial_rotary_factor=0.5,
        index_heads=4,
        index_head_dim=16,
        block_size=128,
        topk_blocks=16,
        local_blocks=1,
        use_sparse=True,
        num_experts=8,
        experts_per_tok=2,
        intermediate_size=32,
        shared_intermediate_size=32,
        dense_intermediate_size=96,
        routed_scaling_factor=2.0,
        rope_theta=5.0e6,
        swiglu_alpha=1.702,
        swiglu_limit=7.0,
        projector_hidden_size=32,
        prompts=[2450, 33],
        greedy_tokens=8,
        hidden_dump_cases=[0, 1],
    ),
    dict(
        name="dense_only",
        about="No sparse layers (use_sparse_attention false, all full attention); MLP pattern "
        "dense/MoE/dense/MoE (not a prefix); swiglu_limit 2.0 so the clamps bite often; 6 experts "
        "top-3, routed_scaling 1.5; rope_theta 1e6; full rotary (partial_rotary_factor 1.0).",
        vocab_size=768,
        hidden_size=48,
        num_layers=4,
        mlp_pattern=[0, 1, 0, 1],
        num_heads=6,
        num_kv_heads=2,
        head_dim=16,
        partial_rotary_factor=1.0,
        index_heads=2,
        index_head_dim=16,
        block_size=128,
        topk_blocks=16,
        local_blocks=1,
        use_sparse=False,
        num_experts=6,
        experts_per_tok=3,
        intermediate_size=24,
        shared_intermediate_size=24,
        dense_intermediate_size=64,
        routed_scaling_factor=1.5,
        rope_theta=1.0e6,
        swiglu_alpha=1.702,
        swiglu_limit=2.0,
        projector_hidden_size=32,
        prompts=[1, 17, 100],
        greedy_tokens=12,
        hidden_dump_cases=[1],
    ),
    dict(
        name="yarn_ratio",
        about="m3_ratio with YaRN (rope_type yarn, factor 4 over an original 64-token window, "
        "beta_fast 32 / beta_slow 1, attention factor 0.1 ln 4 + 1): prompts run past the original "
        "window, so the blended frequencies and the cos/sin scale are exercised. M3 head ratios: 64 query heads, 4 KV heads, 4 index heads (16 q heads per KV head); "
        "head_dim 16 with rotary 8 (partial_rotary_factor 0.5), index_head_dim 16; 16-token blocks, "
        "top-4; 2 dense layers then MoE (16 experts, top-4); rope_theta 5e6.",
        vocab_size=1536,
        hidden_size=64,
        num_layers=4,
        first_dense=2,
        num_heads=64,
        num_kv_heads=4,
        head_dim=16,
        partial_rotary_factor=0.5,
        index_heads=4,
        index_head_dim=16,
        block_size=16,
        topk_blocks=4,
        local_blocks=1,
        use_sparse=True,
        num_experts=16,
        experts_per_tok=4,
        intermediate_size=24,
        shared_intermediate_size=24,
        dense_intermediate_size=96,
        routed_scaling_factor=2.0,
        rope_theta=5.0e6,
        yarn=dict(factor=4.0, original_max_position_embeddings=64),
        swiglu_alpha=1.702,
        swiglu_limit=7.0,
        projector_hidden_size=32,
        prompts=[1, 48, 97, 190],
        greedy_tokens=16,
        hidden_dump_cases=[0, 2],
    ),
]


def moe_freq(cfg):
    if "mlp_pattern" in cfg:
        return list(cfg["mlp_pattern"])
    return [0 if i < cfg["first_dense"] else 1 for i in range(cfg["num_layers"])]


def sparse_freq(cfg):
    # M3 makes exactly the MoE layers sparse; dense_only has no sparse layers at all.
    if not cfg["use_sparse"]:
        return [0] * cfg["num_layers"]
    return moe_freq(cfg)


def rotary_dim(cfg):
    return int(cfg["head_dim"] * cfg["partial_rotary_factor"])


def max_positions(cfg):
    """A YaRN model's window is original x factor (what transformers and vLLM derive)."""
    y = cfg.get("yarn")
    return int(y["factor"] * y["original_max_position_embeddings"]) if y else 65536


def rope_parameters(cfg):
    p = dict(rope_type="default", rope_theta=cfg["rope_theta"], partial_rotary_factor=cfg["partial_rotary_factor"])
    if cfg.get("yarn"):
        p.update(rope_type="yarn", **cfg["yarn"])
    return p


def hf_config_dict(cfg):
    """kwargs for transformers' MiniMaxM3VLConfig (flat index_* keys, explicit layer types)."""
    text = dict(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        dense_intermediate_size=cfg["dense_intermediate_size"],
        shared_intermediate_size=cfg["shared_intermediate_size"],
        num_hidden_layers=cfg["num_layers"],
        num_attention_heads=cfg["num_heads"],
        num_key_value_heads=cfg["num_kv_heads"],
        head_dim=cfg["head_dim"],
        max_position_embeddings=max_positions(cfg),
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        num_experts_per_tok=cfg["experts_per_tok"],
        num_local_experts=cfg["num_experts"],
        routed_scaling_factor=cfg["routed_scaling_factor"],
        rotary_dim=rotary_dim(cfg),
        swiglu_alpha=cfg["swiglu_alpha"],
        swiglu_limit=cfg["swiglu_limit"],
        rope_parameters=rope_parameters(cfg),
        mlp_layer_types=["sparse" if f else "dense" for f in moe_freq(cfg)],
        layer_types=["minimax_m3_sparse" if f else "full_attention" for f in sparse_freq(cfg)],
        index_n_heads=cfg["index_heads"],
        index_head_dim=cfg["index_head_dim"],
        index_block_size=cfg["block_size"],
        index_topk_blocks=cfg["topk_blocks"],
        index_local_blocks=cfg["local_blocks"],
        # The defaults (200034/200020) lie outside these tiny vocabularies.
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    return dict(
        text_config=text,
        vision_config=dict(VISION_TINY),
        projector_hidden_size=cfg["projector_hidden_size"],
        tie_word_embeddings=False,
    )


def shipped_config_dict(cfg):
    """The same model as the shipped MiniMax-M3 config.json spells it (m3-model.md §1.1-1.3)."""
    n = cfg["num_layers"]
    sf = sparse_freq(cfg)
    text = dict(
        hidden_size=cfg["hidden_size"],
        num_hidden_layers=n,
        num_attention_heads=cfg["num_heads"],
        num_key_value_heads=cfg["num_kv_heads"],
        head_dim=cfg["head_dim"],
        intermediate_size=cfg["intermediate_size"],
        dense_intermediate_size=cfg["dense_intermediate_size"],
        shared_intermediate_size=cfg["shared_intermediate_size"],
        vocab_size=cfg["vocab_size"],
        max_position_embeddings=max_positions(cfg),
        rms_norm_eps=1e-6,
        use_gemma_norm=True,
        use_qk_norm=True,
        qk_norm_type="per_head",
        attention_output_gate=False,
        rope_theta=cfg["rope_theta"],
        rotary_dim=rotary_dim(cfg),
        partial_rotary_factor=cfg["partial_rotary_factor"],
        **({"rope_scaling": dict(rope_type="yarn", rope_theta=cfg["rope_theta"],
                                 partial_rotary_factor=cfg["partial_rotary_factor"], **cfg["yarn"])}
           if cfg.get("yarn") else {}),
        hidden_act="swigluoai",
        swiglu_alpha=cfg["swiglu_alpha"],
        swiglu_limit=cfg["swiglu_limit"],
        tie_word_embeddings=False,
        num_local_experts=cfg["num_experts"],
        num_experts_per_tok=cfg["experts_per_tok"],
        n_shared_experts=1,
        scoring_func="sigmoid",
        use_routing_bias=True,
        routed_scaling_factor=cfg["routed_scaling_factor"],
        moe_layer_freq=moe_freq(cfg),
        sparse_attention_config=dict(
            use_sparse_attention=bool(cfg["use_sparse"]),
            sparse_attention_freq=sf,
            sparse_num_index_heads=cfg["index_heads"],
            sparse_index_dim=cfg["index_head_dim"],
            sparse_block_size=cfg["block_size"],
            sparse_topk_blocks=cfg["topk_blocks"],
            sparse_score_type="max",
            sparse_init_block=0,
            sparse_local_block=cfg["local_blocks"],
            sparse_disable_index_value=list(sf),
        ),
    )
    vision = dict(VISION_TINY)
    vision["model_type"] = "clip_vision_model"
    return dict(
        architectures=["MiniMaxM3SparseForConditionalGeneration"],
        model_type="minimax_m3_vl",
        torch_dtype="bfloat16",
        image_token_index=200025,
        video_token_index=200026,
        projector_hidden_size=cfg["projector_hidden_size"],
        projector_hidden_act="gelu",
        multimodal_projector_bias=True,
        vision_feature_layer=-1,
        vision_feature_select_strategy="full",
        tie_word_embeddings=False,
        text_config=text,
        vision_config=vision,
    )


def check_shipped_parses_same(cfg):
    """Parse both forms with transformers' config class and compare the fields the model reads."""
    from transformers import MiniMaxM3VLConfig

    a = MiniMaxM3VLConfig(**json.loads(json.dumps(hf_config_dict(cfg)))).text_config
    b = MiniMaxM3VLConfig(**json.loads(json.dumps(shipped_config_dict(cfg)))).text_config
    fields = [
        "vocab_size", "hidden_size", "intermediate_size", "dense_intermediate_size",
        "shared_intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "rms_norm_eps", "num_experts_per_tok",
        "num_local_experts", "routed_scaling_factor", "rotary_dim", "swiglu_alpha", "swiglu_limit",
        "mlp_layer_types", "layer_types", "index_n_heads", "index_head_dim", "index_block_size",
        "index_topk_blocks", "index_local_blocks", "tie_word_embeddings",
    ]
    bad = [(f, getattr(a, f), getattr(b, f)) for f in fields if getattr(a, f) != getattr(b, f)]
    ra, rb = dict(a.rope_parameters), dict(b.rope_parameters)
    for k in ("rope_theta", "partial_rotary_factor", "rope_type"):
        if ra.get(k) != rb.get(k):
            bad.append(("rope_parameters." + k, ra.get(k), rb.get(k)))
    if bad:
        raise SystemExit(f"[{cfg['name']}] shipped config parses differently: {bad}")
    return a


# ----------------------------------------------------------------------------------------------
# Prompts
# ----------------------------------------------------------------------------------------------


def make_prompts(cfg, seed, model_index):
    out = []
    for ci, length in enumerate(cfg["prompts"]):
        rng = np.random.default_rng([seed, model_index, ci])
        ids = rng.integers(0, cfg["vocab_size"], size=length).tolist()
        out.append(dict(name=f"len{length}", prompt_ids=[int(x) for x in ids]))
    return out


def msa_positions(length):
    """All positions for short prompts; for long ones every 7th plus the last 64."""
    if length <= 256:
        return list(range(length))
    return sorted(set(range(0, length, 7)) | set(range(max(0, length - 64), length)))


# ----------------------------------------------------------------------------------------------
# Torch part
# ----------------------------------------------------------------------------------------------


def setup_torch_precision(torch):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


def verify_fp32_matmul(torch, device):
    """TF32 would show up as ~1e-3 relative error; IEEE fp32 stays near 1e-6."""
    g = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(512, 512, generator=g, dtype=torch.float64)
    b = torch.randn(512, 512, generator=g, dtype=torch.float64)
    ref = a @ b
    got = (a.float().to(device) @ b.float().to(device)).double().cpu()
    rel = ((got - ref).abs().max() / ref.abs().max()).item()
    print(f"fp32 matmul max rel err vs fp64: {rel:.3e}", flush=True)
    if rel > 1e-5:
        raise SystemExit(f"fp32 matmul looks like TF32 (rel err {rel:.3e}); refusing to make goldens")
    return rel


def init_weights(torch, model, cfg, seed):
    """Give every parameter a real value: nothing zero, norms not identity, biased router."""
    from transformers.models.minimax_m3_vl import modeling_minimax_m3_vl as mm

    g = torch.Generator(device="cpu").manual_seed(seed)

    def normal_(t, std, mean=0.0):
        with torch.no_grad():
            t.copy_(torch.randn(t.shape, generator=g, dtype=torch.float32) * std + mean)

    H = cfg["hidden_size"]
    done = set()
    for mname, mod in model.named_modules():
        if isinstance(mod, mm.MiniMaxM3VLRMSNorm):
            normal_(mod.weight, 0.2)  # Gemma (1+w): spread around the identity
            done.add(id(mod.weight))
        elif isinstance(mod, mm.MiniMaxM3VLTopKRouter):
            # router logits std ~2 -> sigmoid scores spread ~0.3; bias of comparable size changes
            # which experts win (checked below).
            normal_(mod.weight, 2.0 / math.sqrt(H))
            normal_(mod.e_score_correction_bias, 0.15)
            done.add(id(mod.weight))
        elif isinstance(mod, mm.MiniMaxM3VLExperts):
            normal_(mod.gate_up_proj, 2.5 / math.sqrt(H))
            normal_(mod.down_proj, 1.0 / math.sqrt(cfg["intermediate_size"]))
            done.add(id(mod.gate_up_proj))
            done.add(id(mod.down_proj))
        elif isinstance(mod, mm.MiniMaxM3VLDenseMLP):
            normal_(mod.gate_up_proj.weight, 2.5 / math.sqrt(H))
            normal_(mod.down_proj.weight, 1.0 / math.sqrt(mod.down_proj.weight.shape[1]))
            done.add(id(mod.gate_up_proj.weight))
            done.add(id(mod.down_proj.weight))
    lm = model.model.language_model
    normal_(lm.embed_tokens.weight, 1.0)
    done.add(id(lm.embed_tokens.weight))
    # logits std ~3 after the unit-RMS final norm: peaked, non-trivial next-token distributions
    normal_(model.lm_head.weight, 3.0 / math.sqrt(H))
    done.add(id(model.lm_head.weight))
    for pname, p in model.named_parameters():
        if id(p) in done:
            continue
        if p.ndim == 1:
            if "norm" in pname and pname.endswith("weight"):  # vision LayerNorms: scale around 1
                normal_(p, 0.1, mean=1.0)
            else:  # biases
                normal_(p, 0.05)
        else:
            fan_in = int(np.prod(p.shape[1:]))
            normal_(p, 1.0 / math.sqrt(fan_in))
        done.add(id(p))


def to_checkpoint_dtypes(torch, model):
    """BF16 everywhere except router weight + e_score_correction_bias (FP32, as shipped).
    (m3-model.md §2.4 says the shipped vision patch-embedding conv is FP32; it stays BF16 here so
    that transformers records the model dtype as bfloat16 -- the vision tower is not scored.)"""
    from transformers.models.minimax_m3_vl import modeling_minimax_m3_vl as mm

    keep = {}
    for mname, mod in model.named_modules():
        if isinstance(mod, mm.MiniMaxM3VLTopKRouter):
            keep[mname] = (mod.weight.detach().clone(), mod.e_score_correction_bias.detach().clone())
    model.to(torch.bfloat16)
    for mname, mod in model.named_modules():
        if mname in keep:
            w, b = keep[mname]
            mod.weight = torch.nn.Parameter(w.float(), requires_grad=False)
            mod.e_score_correction_bias = b.float()


def logprob_entry(torch, logits_row, token):
    lp = torch.log_softmax(logits_row.double(), dim=-1)  # fp64 log-softmax of the fp32 logits
    top = torch.topk(lp, TOP_N)
    return dict(
        token=int(token),
        logprob=float(lp[token].item()),
        top=[[int(i), float(v)] for v, i in zip(top.values.tolist(), top.indices.tolist())],
    )


def prompt_logprob_entries(torch, logits, ids):
    """Entry i (i >= 1): log_softmax(logits[i-1]) at ids[i], plus the TOP_N best (vectorised)."""
    if len(ids) < 2:
        return []
    lp = torch.log_softmax(logits[:-1].double(), dim=-1)
    tgt = torch.tensor(ids[1:], device=lp.device)
    tok_lp = lp.gather(1, tgt[:, None])[:, 0].cpu().tolist()
    top = torch.topk(lp, TOP_N, dim=-1)
    tv, ti = top.values.cpu().tolist(), top.indices.cpu().tolist()
    return [
        dict(token=int(ids[i + 1]), logprob=float(tok_lp[i]),
             top=[[int(a), float(b)] for a, b in zip(ti[i], tv[i])])
        for i in range(len(ids) - 1)
    ]


class MsaRecorder:
    """Forward hooks on the indexer modules: records selected blocks and their score margins."""

    def __init__(self, torch, model, cfg):
        from transformers.models.minimax_m3_vl import modeling_minimax_m3_vl as mm

        self.torch = torch
        self.mm = mm
        self.cfg = cfg
        self.positions = None
        self.records = {}
        self.mismatches = 0
        self.handles = []
        for li, layer in enumerate(model.model.language_model.layers):
            idx = layer.self_attn.indexer
            if idx is not None:
                self.handles.append(idx.register_forward_hook(self._make_hook(li)))

    def remove(self):
        for h in self.handles:
            h.remove()

    def _make_hook(self, layer_idx):
        def hook(module, args, output):
            if self.positions is None:
                return
            self._record(layer_idx, module, args, output)

        return hook

    def _record(self, layer_idx, m, args, output):
        torch = self.torch
        hs, (cos, sin), pos_ids = args[0], args[1], args[3]  # args[2] is the (unused) cache
        b, s, _ = hs.shape
        hd = m.head_dim
        # Recompute the block scores the module ranked (same ops as its forward) to get margins.
        iq = m.q_norm(m.q_proj(hs).view(b, s, -1, hd)).transpose(1, 2)
        ik = m.k_norm(m.k_proj(hs).view(b, s, 1, hd)).transpose(1, 2)
        iq, ik = self.mm.apply_rotary_pos_emb(iq, ik, cos[..., :hd], sin[..., :hd])
        scores = torch.matmul(iq.float(), ik.float().transpose(-1, -2))  # [1, Hi, S, S]
        kpos = torch.arange(s, device=hs.device)
        scores = scores.masked_fill(kpos[None, None, None, :] > pos_ids[:, None, :, None], float("-inf"))
        B = m.block_size
        nbt = -(-s // B)
        if nbt * B - s:
            scores = torch.nn.functional.pad(scores, (0, nbt * B - s), value=float("-inf"))
        blk = scores.view(b, m.num_heads, s, nbt, B).amax(-1)[0]  # [Hi, S, nbt]
        pos = self.positions
        blk_sel = blk[:, pos, :].double().cpu().numpy()
        out_sel = output[0][:, pos, :].cpu().numpy()  # [Hi, P, topk]
        topk, local = m.topk_blocks, m.local_blocks
        rec_blocks, rec_margin = [], []
        for pi, p in enumerate(pos):
            nb = p // B + 1
            forced = sorted({max(0, p // B - l) for l in range(local)})
            heads, margins = [], []
            for h in range(m.num_heads):
                got = sorted(int(x) for x in out_sel[h, pi] if x >= 0)
                free = [bb for bb in range(nb) if bb not in forced]
                sc = blk_sel[h, pi, free]
                order = np.argsort(-sc, kind="stable")
                nfree = min(topk, nb) - len(forced)
                mine = sorted(forced + [free[i] for i in order[:nfree]])
                if mine != got:
                    self.mismatches += 1
                heads.append(got)
                if nb > topk:
                    margins.append(float(sc[order[nfree - 1]] - sc[order[nfree]]))
            rec_blocks.append(heads)
            rec_margin.append(min(margins) if margins else None)
        self.records[str(layer_idx)] = dict(positions=list(pos), blocks=rec_blocks, margin=rec_margin)


class HiddenRecorder:
    """Residual stream after the embedding and after every decoder layer, plus the final norm."""

    def __init__(self, model):
        lm = model.model.language_model
        self.on = False
        self.data = {}
        self.positions = []
        self.handles = [lm.embed_tokens.register_forward_hook(self._hook("embed"))]
        for i, layer in enumerate(lm.layers):
            self.handles.append(layer.register_forward_hook(self._hook(f"layer{i}")))
        self.handles.append(lm.norm.register_forward_hook(self._hook("final_norm")))

    def _hook(self, key):
        def hook(module, args, output):
            if self.on:
                t = output[0] if isinstance(output, tuple) else output
                rows = t[0, self.positions].double().cpu().tolist()
                self.data[key] = [[float(v) for v in row] for row in rows]

        return hook

    def remove(self):
        for h in self.handles:
            h.remove()


class StatsRecorder:
    """Property checks: does the biased router pick differently, do the SwiGLU clamps bite."""

    def __init__(self, torch, model, cfg):
        from transformers.models.minimax_m3_vl import modeling_minimax_m3_vl as mm

        self.torch = torch
        self.cfg = cfg
        self.on = False
        self.route_tokens = 0
        self.route_changed = 0
        self.gate_vals = 0
        self.gate_clamped = 0
        self.up_clamped = 0
        self.handles = []
        for mod in model.modules():
            if isinstance(mod, mm.MiniMaxM3VLTopKRouter):
                self.handles.append(mod.register_forward_hook(self._router_hook))
            elif isinstance(mod, mm.MiniMaxM3VLDenseMLP):
                self.handles.append(mod.gate_up_proj.register_forward_hook(self._mlp_hook))

    def _router_hook(self, mod, args, output):
        if not self.on:
            return
        torch = self.torch
        logits, _w, idx = output
        s = torch.sigmoid(logits.float())
        plain = torch.topk(s, mod.top_k, dim=-1).indices.sort(-1).values
        biased = idx.sort(-1).values
        self.route_tokens += s.shape[0]
        self.route_changed += int((plain != biased).any(-1).sum().item())

    def _mlp_hook(self, mod, args, output):
        if not self.on:
            return
        gate, up = output.chunk(2, dim=-1)
        lim = self.cfg["swiglu_limit"]
        self.gate_vals += gate.numel()
        self.gate_clamped += int((gate > lim).sum().item())
        self.up_clamped += int((up.abs() > lim).sum().item())

    def summary(self):
        return dict(
            router_tokens=self.route_tokens,
            router_bias_changed_selection_frac=self.route_changed / max(1, self.route_tokens),
            dense_mlp_gate_clamped_frac=self.gate_clamped / max(1, self.gate_vals),
            dense_mlp_up_clamped_frac=self.up_clamped / max(1, self.gate_vals),
        )

    def remove(self):
        for h in self.handles:
            h.remove()


def safetensors_listing(path):
    from safetensors import safe_open

    rows = []
    with safe_open(path, framework="pt") as f:
        for k in f.keys():
            sl = f.get_slice(k)
            rows.append((k, str(sl.get_dtype()), list(sl.get_shape())))
    return rows


def check_saved_dtypes(rows, name):
    bad = []
    for k, dt, shape in rows:
        want_f32 = (
            k.endswith("block_sparse_moe.gate.weight")
            or k.endswith("block_sparse_moe.e_score_correction_bias")
        )
        want = "F32" if want_f32 else "BF16"
        if dt != want:
            bad.append((k, dt, want))
    if bad:
        raise SystemExit(f"[{name}] unexpected dtypes in saved file: {bad[:10]}")
    if not any(k.endswith("block_sparse_moe.e_score_correction_bias") for k, _, _ in rows):
        raise SystemExit(f"[{name}] no e_score_correction_bias in saved file")


def make_model(args, cfg, model_index, out_root, versions):
    import torch
    from transformers import MiniMaxM3SparseForConditionalGeneration, MiniMaxM3VLConfig

    name = cfg["name"]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out_dir = os.path.join(out_root, name)
    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    os.makedirs(out_dir)
    print(f"\n=== {name} ===", flush=True)

    check_shipped_parses_same(cfg)
    hf_cfg = MiniMaxM3VLConfig(**hf_config_dict(cfg))
    torch.manual_seed(args.seed + 1000 * model_index)
    model = MiniMaxM3SparseForConditionalGeneration(hf_cfg)
    init_weights(torch, model, cfg, args.seed + 1000 * model_index)
    to_checkpoint_dtypes(torch, model)
    saved_sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model.save_pretrained(out_dir, max_shard_size="10GB")
    st_path = os.path.join(out_dir, "model.safetensors")
    if not os.path.exists(st_path):
        raise SystemExit(f"[{name}] save_pretrained did not write a single model.safetensors: {os.listdir(out_dir)}")
    rows = safetensors_listing(st_path)
    check_saved_dtypes(rows, name)
    print(f"saved {len(rows)} tensors, {os.path.getsize(st_path)} bytes", flush=True)

    # Score the model RELOADED from disk (what an engine reads), fp32, eager attention.
    model_l, info = MiniMaxM3SparseForConditionalGeneration.from_pretrained(
        out_dir, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    for key in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        if info.get(key):
            raise SystemExit(f"[{name}] reload {key}: {list(info[key])[:10]}")
    lsd = model_l.state_dict()
    if set(lsd) != set(saved_sd):
        raise SystemExit(f"[{name}] reloaded state_dict keys differ: {sorted(set(lsd) ^ set(saved_sd))[:10]}")
    for k, v in saved_sd.items():
        if not torch.equal(lsd[k].float(), v.float()):
            raise SystemExit(f"[{name}] reloaded tensor {k} differs from the saved value")
    print("reload: all tensors equal to the saved values", flush=True)
    model_l.to(device).eval()

    # Also load the shipped-form config with the same weights: it must give identical logits.
    with open(os.path.join(out_dir, "config_shipped.json"), "w") as f:
        json.dump(shipped_config_dict(cfg), f, indent=2)
        f.write("\n")
    shipped_dir = tempfile.mkdtemp(prefix=f"shipped_{name}_")
    shutil.copy(os.path.join(out_dir, "config_shipped.json"), os.path.join(shipped_dir, "config.json"))
    os.symlink(os.path.abspath(st_path), os.path.join(shipped_dir, "model.safetensors"))
    model_s = MiniMaxM3SparseForConditionalGeneration.from_pretrained(
        shipped_dir, dtype=torch.float32, attn_implementation="eager"
    ).to(device).eval()

    msa = MsaRecorder(torch, model_l, cfg)
    hid = HiddenRecorder(model_l)
    stats = StatsRecorder(torch, model_l, cfg)

    def forward(m, ids):
        x = torch.tensor([ids], dtype=torch.long, device=device)
        return m(input_ids=x, use_cache=False).logits[0].float()

    cases = []
    shipped_max_diff = 0.0
    best_lps, uniq_frac = [], []
    with torch.no_grad():
        for ci, case in enumerate(make_prompts(cfg, args.seed, model_index)):
            ids = case["prompt_ids"]
            L = len(ids)
            msa.positions = msa_positions(L)
            msa.records = {}
            dump = ci in cfg["hidden_dump_cases"]
            hid.on, hid.data = dump, {}
            hid.positions = list(range(L)) if L <= 40 else list(range(L - 16, L))
            stats.on = True
            logits = forward(model_l, ids)
            stats.on = hid.on = False
            msa.positions = None
            msa_rec = dict(msa.records)
            hidden = dict(positions=hid.positions, **hid.data) if dump else None

            ls = forward(model_s, ids)
            shipped_max_diff = max(shipped_max_diff, (ls - logits).abs().max().item())

            prompt_lps = [None] + prompt_logprob_entries(torch, logits, ids)

            # Greedy: re-run the FULL sequence each step (no KV cache).
            seq = list(ids)
            g_ids, g_lps, g_margin = [], [], []
            last0 = None
            for step in range(cfg["greedy_tokens"]):
                lg = forward(model_l, seq)[-1]
                if step == 0:
                    last0 = (lg - logits[-1]).abs().max().item()
                top2 = torch.topk(lg, 2)
                tok = int(top2.indices[0].item())
                g_ids.append(tok)
                g_lps.append(logprob_entry(torch, lg, tok))
                g_margin.append(float((top2.values[0] - top2.values[1]).item()))
                seq.append(tok)
            best_lps.extend(e["logprob"] for e in g_lps)
            uniq_frac.append(len(set(g_ids)) / len(g_ids))
            c = dict(
                name=case["name"],
                prompt_ids=ids,
                prompt_logprobs=prompt_lps,
                greedy_ids=g_ids,
                greedy_logprobs=g_lps,
                greedy_margin=g_margin,
                msa=msa_rec,
            )
            if hidden is not None:
                c["hidden_states"] = hidden
            cases.append(c)
            mm = [m for r in msa_rec.values() for m in r["margin"] if m is not None]
            print(
                f"  case {case['name']}: greedy {g_ids} min greedy margin {min(g_margin):.4g}; "
                f"step0-vs-prompt max|dlogit| {last0:.3g}; "
                f"msa layers {sorted(msa_rec)} ranked positions {len(mm)} "
                f"min block margin {min(mm) if mm else None}",
                flush=True,
            )

    msa.remove()
    hid.remove()
    st = stats.summary()
    stats.remove()
    logV = math.log(cfg["vocab_size"])
    props = dict(
        mean_greedy_best_logprob=float(np.mean(best_lps)),
        minus_log_vocab=-logV,
        greedy_unique_token_frac=[float(x) for x in uniq_frac],
        msa_selection_mismatches_vs_recomputed=msa.mismatches,
        shipped_config_max_abs_logit_diff=shipped_max_diff,
        **st,
    )
    print("  properties:", json.dumps(props), flush=True)
    problems = []
    if props["mean_greedy_best_logprob"] < -logV + 1.0:
        problems.append("next-token distributions are nearly flat")
    if any(u <= 1.0 / cfg["greedy_tokens"] + 1e-9 for u in uniq_frac):
        problems.append("a greedy continuation is one repeated token")
    if msa.mismatches:
        problems.append(f"{msa.mismatches} MSA selections differ from the recomputed ranking")
    if shipped_max_diff != 0.0:
        problems.append(f"shipped config gives different logits (max diff {shipped_max_diff})")
    if st["router_tokens"] and st["router_bias_changed_selection_frac"] == 0:
        problems.append("router bias never changes a selection")
    if problems:
        print(f"  WARNING [{name}]: " + "; ".join(problems), flush=True)

    golden = dict(
        generator=GENERATOR,
        seed=args.seed,
        versions=versions,
        compute_dtype="float32",
        top_n=TOP_N,
        model=name,
        about=cfg["about"],
        properties=props,
        cases=cases,
    )
    with open(os.path.join(out_dir, "golden.json"), "w") as f:
        json.dump(golden, f, separators=(",", ":"))
        f.write("\n")
    with open(os.path.join(out_dir, "tensors.txt"), "w") as f:
        for k, dt, shape in rows:
            f.write(f"{k}\t{dt}\t{shape}\n")
    shutil.rmtree(shipped_dir, ignore_errors=True)
    del model, model_l, model_s
    if device == "cuda":
        torch.cuda.empty_cache()
    return problems


# ----------------------------------------------------------------------------------------------
# --validate: torch-free consistency checks of a generated golden tree (runs anywhere)
# ----------------------------------------------------------------------------------------------


def read_safetensors_header(path):
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(n))


def validate_model_dir(d):
    errs = []
    for fn in ("config.json", "config_shipped.json", "model.safetensors", "golden.json"):
        if not os.path.exists(os.path.join(d, fn)):
            errs.append(f"missing {fn}")
    if errs:
        return errs
    cfg = json.load(open(os.path.join(d, "config.json")))
    shipped = json.load(open(os.path.join(d, "config_shipped.json")))
    g = json.load(open(os.path.join(d, "golden.json")))
    t, ts = cfg["text_config"], shipped["text_config"]
    sac = ts["sparse_attention_config"]
    if [x == "minimax_m3_sparse" for x in t["layer_types"]] != [bool(x) for x in sac["sparse_attention_freq"]]:
        errs.append("layer_types vs sparse_attention_freq")
    if [x == "sparse" for x in t["mlp_layer_types"]] != [bool(x) for x in ts["moe_layer_freq"]]:
        errs.append("mlp_layer_types vs moe_layer_freq")
    for flat, nested in (("index_block_size", "sparse_block_size"), ("index_topk_blocks", "sparse_topk_blocks"),
                         ("index_local_blocks", "sparse_local_block"), ("index_n_heads", "sparse_num_index_heads"),
                         ("index_head_dim", "sparse_index_dim")):
        if t[flat] != sac[nested]:
            errs.append(f"{flat} != {nested}")
    if t["rope_parameters"]["rope_theta"] != ts["rope_theta"]:
        errs.append("rope_theta")
    hdr = read_safetensors_header(os.path.join(d, "model.safetensors"))
    for k, v in hdr.items():
        if k == "__metadata__":
            continue
        f32 = k.endswith("block_sparse_moe.gate.weight") or k.endswith("block_sparse_moe.e_score_correction_bias")
        if v["dtype"] != ("F32" if f32 else "BF16"):
            errs.append(f"dtype of {k} is {v['dtype']}")
    nl = t["num_hidden_layers"]
    for i in range(nl):
        pre = f"language_model.model.layers.{i}."
        need = [pre + "self_attn.q_proj.weight", pre + "input_layernorm.weight"]
        if t["layer_types"][i] == "minimax_m3_sparse":
            need.append(pre + "self_attn.index_q_proj.weight")
        if t["mlp_layer_types"][i] == "sparse":
            need += [pre + "block_sparse_moe.gate.weight", pre + "block_sparse_moe.e_score_correction_bias",
                     pre + "block_sparse_moe.experts.0.w1.weight"]
        errs += [f"missing tensor {k}" for k in need if k not in hdr]
    V, B, K = t["vocab_size"], t["index_block_size"], t["index_topk_blocks"]
    sparse_layers = {str(i) for i, x in enumerate(t["layer_types"]) if x == "minimax_m3_sparse"}
    for c in g["cases"]:
        ids, name = c["prompt_ids"], c["name"]
        pl = c["prompt_logprobs"]
        if len(pl) != len(ids) or pl[0] is not None:
            errs.append(f"{name}: prompt_logprobs shape")
        for e, tok in zip(list(pl[1:]) + list(c["greedy_logprobs"]), list(ids[1:]) + list(c["greedy_ids"])):
            tops = [lp for _, lp in e["top"]]
            if e["token"] != tok or len(e["top"]) != g["top_n"] or tops != sorted(tops, reverse=True) \
                    or e["logprob"] > tops[0] + 1e-12 or not all(0 <= i < V for i, _ in e["top"]):
                errs.append(f"{name}: bad logprob entry for token {tok}")
                break
        if [e["top"][0][0] for e in c["greedy_logprobs"]] != c["greedy_ids"]:
            errs.append(f"{name}: greedy ids are not the argmax")
        if any(m < 0 for m in c["greedy_margin"]):
            errs.append(f"{name}: negative greedy margin")
        if set(c["msa"]) != sparse_layers:
            errs.append(f"{name}: msa layers {sorted(c['msa'])} != sparse layers {sorted(sparse_layers)}")
        for li, r in c["msa"].items():
            for p, heads, m in zip(r["positions"], r["blocks"], r["margin"]):
                nb = p // B + 1
                if (m is None) != (nb <= K) or len(heads) != t["index_n_heads"]:
                    errs.append(f"{name} layer {li} pos {p}: margin/heads shape")
                    break
                for h in heads:
                    if h != sorted(set(h)) or len(h) != min(K, nb) or (p // B) not in h or h[-1] >= nb:
                        errs.append(f"{name} layer {li} pos {p}: bad block set {h}")
                        break
    return errs


def validate(root):
    bad = 0
    for name in sorted(os.listdir(root)):
        d = os.path.join(root, name)
        if not os.path.isdir(d):
            continue
        errs = validate_model_dir(d)
        print(f"{name}: {'ok' if not errs else 'FAILED'}")
        for e in errs[:20]:
            print("   ", e)
        bad += bool(errs)
    return 1 if bad else 0


# ----------------------------------------------------------------------------------------------
# --numpy-check: an independent float64 numpy forward written from docs/m3-model.md §3-4, reading
# config_shipped.json + model.safetensors, compared with golden.json (no torch needed). It checks
# that what transformers computed is the documented math, so the goldens test the right thing.
# ----------------------------------------------------------------------------------------------


def load_safetensors_np(path):
    hdr = read_safetensors_header(path)
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        f.seek(8 + n)  # tensor offsets count from the end of the JSON header
        data = f.read()
    out = {}
    for k, v in hdr.items():
        if k == "__metadata__":
            continue
        a, b = v["data_offsets"]
        raw = data[a:b]
        if v["dtype"] == "BF16":
            u = np.frombuffer(raw, dtype=np.uint16).astype(np.uint32) << 16
            arr = u.view(np.float32)
        elif v["dtype"] == "F32":
            arr = np.frombuffer(raw, dtype=np.float32)
        else:
            raise SystemExit(f"unexpected dtype {v['dtype']} for {k}")
        out[k] = arr.reshape(v["shape"]).astype(np.float64)
    return out


class NumpyM3:
    def __init__(self, model_dir):
        cfg = json.load(open(os.path.join(model_dir, "config_shipped.json")))
        self.t = cfg["text_config"]
        self.w = load_safetensors_np(os.path.join(model_dir, "model.safetensors"))
        t = self.t
        self.rot = t["rotary_dim"]
        self.inv_freq = t["rope_theta"] ** (-np.arange(0, self.rot, 2, dtype=np.float64) / self.rot)
        self.sac = t["sparse_attention_config"]

    def norm(self, x, w):
        eps = self.t["rms_norm_eps"]
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * (1.0 + w)

    def rope(self, x, pos):  # x [T, ..., D]; NeoX halves over the first rotary_dim dims
        r = self.rot
        ang = pos[:, None] * self.inv_freq[None, :]  # [T, r/2]
        shape = (x.shape[0],) + (1,) * (x.ndim - 2) + (r // 2,)
        c, s = np.cos(ang).reshape(shape), np.sin(ang).reshape(shape)
        x1, x2 = x[..., : r // 2], x[..., r // 2: r]
        return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s, x[..., r:]], axis=-1)

    def swiglu(self, g, u):
        lim, al = self.t["swiglu_limit"], self.t["swiglu_alpha"]
        g = np.minimum(g, lim)
        u = np.clip(u, -lim, lim)
        return g / (1.0 + np.exp(-al * g)) * (u + 1.0)

    def mlp(self, x, pre):
        w = self.w
        if pre + "mlp.gate_proj.weight" in w:
            pre = pre + "mlp."
        return self.swiglu(x @ w[pre + "gate_proj.weight"].T, x @ w[pre + "up_proj.weight"].T) @ w[pre + "down_proj.weight"].T

    def moe(self, x, pre):
        w, t = self.w, self.t
        s = 1.0 / (1.0 + np.exp(-(x @ w[pre + "gate.weight"].T)))
        choice = s + w[pre + "e_score_correction_bias"][None, :]
        k = t["num_experts_per_tok"]
        out = np.zeros_like(x)
        for i in range(x.shape[0]):
            sel = np.argsort(-choice[i], kind="stable")[:k]
            ww = s[i, sel] / s[i, sel].sum() * t["routed_scaling_factor"]
            for e, we in zip(sel, ww):
                ep = f"{pre}experts.{e}."
                h = self.swiglu(x[i] @ w[ep + "w1.weight"].T, x[i] @ w[ep + "w3.weight"].T)
                out[i] += we * (h @ w[ep + "w2.weight"].T)
        return out + self.mlp(x, pre + "shared_experts.")

    def select_blocks(self, a, pre, pos):
        """[Ni, T] lists of selected block ids (m3-model.md §4.2-4.4) and the pooled scores."""
        w, sac = self.w, self.sac
        Ni, Di, B, K = sac["sparse_num_index_heads"], sac["sparse_index_dim"], sac["sparse_block_size"], sac["sparse_topk_blocks"]
        T = a.shape[0]
        iq = self.norm((a @ w[pre + "index_q_proj.weight"].T).reshape(T, Ni, Di), w[pre + "index_q_norm.weight"])
        ik = self.norm(a @ w[pre + "index_k_proj.weight"].T, w[pre + "index_k_norm.weight"])
        iq, ik = self.rope(iq, pos), self.rope(ik, pos)
        sel = []
        for g in range(Ni):
            sc = iq[:, g, :] @ ik.T  # [T, T]
            row = []
            for t in range(T):
                nb = t // B + 1
                if nb <= K:
                    row.append(list(range(nb)))
                    continue
                blk = np.array([sc[t, b * B: min((b + 1) * B, t + 1)].max() for b in range(nb - 1)])
                top = np.argsort(-blk, kind="stable")[: K - 1]
                row.append(sorted([int(b) for b in top] + [nb - 1]))
            sel.append(row)
        return sel

    def forward(self, ids):
        w, t = self.w, self.t
        T = len(ids)
        pos = np.arange(T, dtype=np.float64)
        Nq, Nkv, D = t["num_attention_heads"], t["num_key_value_heads"], t["head_dim"]
        B = self.sac["sparse_block_size"]
        h = w["language_model.model.embed_tokens.weight"][ids]
        sels = {}
        hidden = {"embed": h}
        for li in range(t["num_hidden_layers"]):
            pre = f"language_model.model.layers.{li}."
            a = self.norm(h, w[pre + "input_layernorm.weight"])
            q = self.norm((a @ w[pre + "self_attn.q_proj.weight"].T).reshape(T, Nq, D), w[pre + "self_attn.q_norm.weight"])
            k = self.norm((a @ w[pre + "self_attn.k_proj.weight"].T).reshape(T, Nkv, D), w[pre + "self_attn.k_norm.weight"])
            v = (a @ w[pre + "self_attn.v_proj.weight"].T).reshape(T, Nkv, D)
            q, k = self.rope(q, pos), self.rope(k, pos)
            causal = np.tril(np.ones((T, T), dtype=bool))
            masks = [causal] * Nkv
            if self.sac["use_sparse_attention"] and self.sac["sparse_attention_freq"][li]:
                sel = self.select_blocks(a, pre + "self_attn.", pos)
                sels[str(li)] = sel
                masks = []
                for g in range(Nkv):
                    blk_ok = np.zeros((T, T // B + 1), dtype=bool)
                    for ti, bl in enumerate(sel[g]):
                        blk_ok[ti, bl] = True
                    masks.append(causal & blk_ok[:, np.arange(T) // B])
            o = np.zeros((T, Nq, D))
            G = Nq // Nkv
            for hq in range(Nq):
                g = hq // G
                s = (q[:, hq, :] @ k[:, g, :].T) / math.sqrt(D)
                s = np.where(masks[g], s, -np.inf)
                s = np.exp(s - s.max(-1, keepdims=True))
                o[:, hq, :] = (s / s.sum(-1, keepdims=True)) @ v[:, g, :]
            h = h + o.reshape(T, Nq * D) @ w[pre + "self_attn.o_proj.weight"].T
            m = self.norm(h, w[pre + "post_attention_layernorm.weight"])
            if t["moe_layer_freq"][li]:
                h = h + self.moe(m, pre + "block_sparse_moe.")
            else:
                h = h + self.mlp(m, pre + "block_sparse_moe.")
            hidden[f"layer{li}"] = h
        h = self.norm(h, w["language_model.model.norm.weight"])
        hidden["final_norm"] = h
        return h @ w["language_model.lm_head.weight"].T, sels, hidden


def log_softmax_np(x):
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def numpy_check(root, only, max_len):
    """Compare the numpy reference with golden.json. Tolerances: HF ran in fp32, this in fp64 on
    the same bf16-rounded weights; fp32 rounding through a few layers moves logprobs by ~1e-5,
    so 2e-3 leaves a wide margin while a wrong formula moves them by >1e-1. Block selections are
    compared only where the golden margin exceeds 1e-3 (fp32 noise can reorder closer ties)."""
    bad = 0
    for name in sorted(os.listdir(root)):
        d = os.path.join(root, name)
        if not os.path.isdir(d) or (only and name not in only):
            continue
        ref = NumpyM3(d)
        g = json.load(open(os.path.join(d, "golden.json")))
        for c in g["cases"]:
            ids = c["prompt_ids"] + c["greedy_ids"][:-1]
            if len(ids) > max_len:
                print(f"{name}/{c['name']}: skipped ({len(ids)} tokens > --max-len {max_len})")
                continue
            logits, sels, hidden = ref.forward(ids)
            lp = log_softmax_np(logits)
            L = len(c["prompt_ids"])
            # np.max propagates NaN, so a NaN anywhere fails the `< tol` tests below
            d_lp = np.max(np.array([0.0] + [abs(lp[i - 1, ids[i]] - e["logprob"])
                                            for i, e in enumerate(c["prompt_logprobs"]) if e]))
            d_g = np.max(np.array([abs(lp[L - 1 + j, tok] - e["logprob"])
                                   for j, (tok, e) in enumerate(zip(c["greedy_ids"], c["greedy_logprobs"]))]))
            # hidden dumps: relative to the largest magnitude in that tensor (same fp32-vs-fp64
            # argument as the logprobs; a wrong layer would differ by O(1) relative)
            d_h = 0.0
            hs = c.get("hidden_states")
            if hs:
                for key, rows in hs.items():
                    if key == "positions":
                        continue
                    got, mine = np.array(rows), hidden[key][hs["positions"]]
                    d_h = max(d_h, float(np.max(np.abs(got - mine)) / np.max(np.abs(mine))))
            argmax_ok = all(int(np.argmax(lp[L - 1 + j])) == tok or c["greedy_margin"][j] < 1e-3
                            for j, tok in enumerate(c["greedy_ids"]))
            sel_bad = sel_n = sel_skip = 0
            for li, r in c["msa"].items():
                for p, heads, m in zip(r["positions"], r["blocks"], r["margin"]):
                    if m is not None and m < 1e-3:
                        sel_skip += 1
                        continue
                    for hh, blocks in enumerate(heads):
                        sel_n += 1
                        sel_bad += blocks != sels[li][hh][p]
            ok = d_lp < 2e-3 and d_g < 2e-3 and argmax_ok and sel_bad == 0 and d_h < 1e-4
            bad += not ok
            print(f"{name}/{c['name']}: {'ok' if ok else 'MISMATCH'}  max|dlogprob| prompt {d_lp:.2e} "
                  f"greedy {d_g:.2e}  argmax {'ok' if argmax_ok else 'DIFFERS'}  "
                  f"block sets {sel_n - sel_bad}/{sel_n} equal ({sel_skip} near-tie positions skipped)"
                  + (f"  hidden rel {d_h:.1e}" if hs else ""), flush=True)
    return 1 if bad else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="tests/golden/model")
    ap.add_argument("--only", action="append", help="config name (repeatable)")
    ap.add_argument("--seed", type=int, default=20260623)
    ap.add_argument("--check-configs", action="store_true",
                    help="only check that both config forms parse the same (no torch needed)")
    ap.add_argument("--validate", metavar="DIR",
                    help="torch-free consistency checks of a generated golden tree, then exit")
    ap.add_argument("--numpy-check", metavar="DIR",
                    help="compare golden.json with an independent numpy forward (no torch), then exit")
    ap.add_argument("--max-len", type=int, default=400, help="--numpy-check skips longer sequences")
    args = ap.parse_args()
    if args.validate:
        return validate(args.validate)
    if args.numpy_check:
        return numpy_check(args.numpy_check, args.only, args.max_len)

    cfgs = [c for c in CONFIGS if not args.only or c["name"] in args.only]
    if args.only and len(cfgs) != len(set(args.only)):
        raise SystemExit(f"unknown config in --only; known: {[c['name'] for c in CONFIGS]}")

    if args.check_configs:
        for c in cfgs:
            t = check_shipped_parses_same(c)
            print(f"{c['name']}: ok ({t.layer_types}, {t.mlp_layer_types}, {dict(t.rope_parameters)})")
        return 0

    import safetensors
    import torch
    import transformers

    setup_torch_precision(torch)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        verify_fp32_matmul(torch, device)
    versions = dict(
        python=platform.python_version(),
        torch=torch.__version__,
        transformers=transformers.__version__,
        safetensors=safetensors.__version__,
        numpy=np.__version__,
        cuda=torch.version.cuda,
        device=torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
    )
    print("versions:", json.dumps(versions), flush=True)
    os.makedirs(args.out, exist_ok=True)
    all_problems = {}
    for i, c in enumerate(CONFIGS):
        if c in cfgs:
            try:
                p = make_model(args, c, i, args.out, versions)
            except BaseException as e:  # keep going so one device run reports every config
                import traceback

                traceback.print_exc()
                p = [f"failed: {type(e).__name__}: {e}"]
            if p:
                all_problems[c["name"]] = p
    if all_problems:
        print("PROBLEMS:", json.dumps(all_problems), flush=True)
        return 1
    print("all goldens written", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
