#!/usr/bin/env python3
"""Train, export and evaluate the m3serve demo model (a scaled-down MiniMax-M3) on one GPU.

One command does everything (run on the GPU machine, from the repository root):
  python3 tools/demo_model/train.py --out "$OUT" --deadline 470 --reserve 125
Everything is scheduled against a wall-clock deadline (seconds from start): training stops
`--reserve` seconds before it, then export and evaluation run; a watchdog thread writes whatever
exists and exits if the deadline is overrun by 25 s.

1. generates the training data (tasks.py, rendered with models/demo/chat_template.jinja and
   tokenized with models/demo/tokenizer.json) in worker processes, as a curriculum of three
   phases (PHASES: 1024-, 2048-, 4096-token rows, passkey filler growing from 20-700 to
   120-3700 tokens, a large passkey share); rows are packed first-fit, every conversation
   starting on a 128-token boundary with positions restarting at 0. Later phases are generated
   while the first trains;
2. builds transformers' MiniMaxM3SparseForConditionalGeneration (M3's architecture scaled down:
   layer 0 dense MLP + full attention, layers 1-3 MoE (8 experts top-2 + shared, biased sigmoid
   router) + MSA with the real 128-token blocks and top-4 blocks) and trains it with its own
   modules, except that attention is computed here so packed rows, dense warm-up and the block
   sparse mask can be controlled;
   - the MSA block choice is not differentiable, so the lightning indexer is trained only by a KL
     loss that aligns softmax(indexer block-max scores) with the main attention's block-level
     attention mass (dense attention, averaged over the KV group's query heads), on detached
     inputs (m3-model.md section 4.11): dense warm-up, then KL alignment while still dense,
     then the sparse attention (indexer top-k blocks) is used for the rest of training;
   - the router bias (e_score_correction_bias) is updated aux-loss-free style from expert loads;
3. exports with save_pretrained (BF16, router weight + bias FP32) plus tokenizer, template,
   generation_config, and checks that the reloaded model matches this script's forward;
4. evaluates the reloaded model with transformers (fp32, TF32 off) on the prompts of
   tasks.eval_set: passkey accuracy by length (trained indexer vs dense vs recency-only
   selection), tool-call parse rate, task accuracy with thinking on/off.
Writes to --out: demo_model.tar.gz (split into .partN pieces if over 15 MiB), hf_eval.json,
train_log.txt (also printed).
"""

import argparse
import json
import math
import os
import random
import shutil
import sys
import tarfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import make_data  # noqa: E402
import tasks  # noqa: E402
from chat_format import (MODEL_DIR, SPECIAL_TOKENS, ChatTemplate, parse_tool_calls,  # noqa: E402
                         split_reasoning)

LOG = []


def log(*a):
    s = " ".join(str(x) for x in a)
    print(s, flush=True)
    LOG.append(s)


# ------------------------------------------------------------------------------------------
# Model config
# ------------------------------------------------------------------------------------------


def model_config(tok, small=False):
    vid = {s: tok.token_to_id(s) for s in SPECIAL_TOKENS}
    V = make_data.vocab_size(tok)
    L = 4
    text = dict(
        vocab_size=V,
        hidden_size=64 if small else 256,
        intermediate_size=64 if small else 256,          # routed expert
        shared_intermediate_size=64 if small else 256,
        dense_intermediate_size=128 if small else 768,
        num_hidden_layers=L,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=32,
        max_position_embeddings=16384,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        num_experts_per_tok=2,
        num_local_experts=8,
        routed_scaling_factor=2.0,
        rotary_dim=16,
        swiglu_alpha=1.702,
        swiglu_limit=7.0,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5),
        mlp_layer_types=["dense"] + ["sparse"] * (L - 1),
        layer_types=["full_attention"] + ["minimax_m3_sparse"] * (L - 1),
        index_n_heads=4,
        index_head_dim=32,
        index_block_size=128,
        index_topk_blocks=4,
        index_local_blocks=1,
        bos_token_id=vid["]~!b["],
        eos_token_id=vid["[e~["],
        pad_token_id=vid["]!p~["],
    )
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_channels=3, image_size=56, patch_size=14, temporal_patch_size=2,
                  spatial_merge_size=2, hidden_act="gelu", layer_norm_eps=1e-5)
    return dict(text_config=text, vision_config=vision, projector_hidden_size=32,
                tie_word_embeddings=False, image_token_index=vid["]<]image[>["],
                video_token_index=vid["]<]video[>["])


# ------------------------------------------------------------------------------------------
# Training forward (transformers' modules; attention computed here)
# ------------------------------------------------------------------------------------------


class Trainer:
    def __init__(self, torch, model, cfg, router_hooks=True):
        from transformers.models.minimax_m3_vl import modeling_minimax_m3_vl as mm

        self.torch = torch
        self.F = torch.nn.functional
        self.mm = mm
        self.model = model
        self.lm = model.model.language_model
        self.tc = cfg["text_config"]
        self.block = self.tc["index_block_size"]
        self.topk = self.tc["index_topk_blocks"]
        self.loads = {}
        for li, layer in enumerate(self.lm.layers):
            if router_hooks and hasattr(layer.mlp, "gate"):
                layer.mlp.gate.register_forward_hook(self._router_hook(li))

    def _router_hook(self, li):
        def hook(mod, args, out):
            idx = out[2]
            cnt = self.torch.bincount(idx.reshape(-1), minlength=mod.num_experts).float()
            self.loads[li] = self.loads.get(li, 0) + cnt
        return hook

    def update_router_bias(self, rate):
        """Aux-loss-free balancing: raise the bias of under-loaded experts, lower overloaded."""
        torch = self.torch
        spread = []
        with torch.no_grad():
            for li, cnt in self.loads.items():
                gate = self.lm.layers[li].mlp.gate
                gate.e_score_correction_bias += rate * torch.sign(cnt.mean() - cnt)
                spread.append((cnt.max() / cnt.sum()).item())
        self.loads = {}
        return max(spread) if spread else 0.0

    def forward(self, tokens, start, phase, kl_slots=None, want_logits=False):
        """phase: 'dense' (MSA layers attend densely) or 'sparse' (indexer top-k blocks).
        kl_slots [B,K]: query slots where the indexer KL is computed (None = no KL)."""
        torch, F = self.torch, self.F
        B, S = tokens.shape
        slot = torch.arange(S, device=tokens.device)
        pos = (slot[None, :] - start).long()
        base = (start[:, :, None] == start[:, None, :]) & (slot[None, :, None] >= slot[None, None, :])
        h = self.lm.embed_tokens(tokens)
        cos, sin = self.lm.rotary_emb(h, position_ids=pos)
        kl_total = h.new_zeros((), dtype=torch.float32)
        sel_stats = []
        for layer in self.lm.layers:
            a = layer.input_layernorm(h)
            out, kl, st = self.attention(layer.self_attn, a, cos, sin, base, phase, kl_slots)
            if kl is not None:
                kl_total = kl_total + kl
            if st is not None:
                sel_stats.append(st)
            h = h + out
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        h = self.lm.norm(h)
        logits = self.model.lm_head(h)
        return logits, kl_total, sel_stats

    def attention(self, attn, a, cos, sin, base, phase, kl_slots):
        torch, F, mm = self.torch, self.F, self.mm
        B, S, _ = a.shape
        hd = attn.head_dim
        q = attn.q_norm(attn.q_proj(a).view(B, S, -1, hd)).transpose(1, 2)
        k = attn.k_norm(attn.k_proj(a).view(B, S, -1, hd)).transpose(1, 2)
        v = attn.v_proj(a).view(B, S, -1, hd).transpose(1, 2)
        q, k = mm.apply_rotary_pos_emb(q, k, cos, sin)
        H, G = q.shape[1], k.shape[1]
        hpg = H // G
        kl = None
        st = None
        keep = base[:, None]  # [B,1,S,S]
        idx = attn.indexer
        if idx is not None:
            ad = a.detach()
            dI = idx.head_dim
            iq = idx.q_norm(idx.q_proj(ad).view(B, S, -1, dI)).transpose(1, 2)
            ik = idx.k_norm(idx.k_proj(ad).view(B, S, 1, dI)).transpose(1, 2)
            iq, ik = mm.apply_rotary_pos_emb(iq, ik, cos[..., :dI], sin[..., :dI])
            nb = (S + self.block - 1) // self.block
            if phase == "sparse":
                with torch.no_grad():
                    sc = torch.matmul(iq.float(), ik.float().transpose(-1, -2))  # [B,NI,S,S]
                    sc = sc.masked_fill(~base[:, None], float("-inf"))
                    if nb * self.block != S:
                        sc = F.pad(sc, (0, nb * self.block - S), value=float("-inf"))
                    blk = sc.view(B, -1, S, nb, self.block).amax(-1)  # [B,NI,S,nb]
                    del sc
                    qb = (torch.arange(S, device=a.device) // self.block)
                    blk.scatter_(-1, qb.view(1, 1, S, 1).expand(B, blk.shape[1], S, 1), float("inf"))
                    kk = min(self.topk, nb)
                    tv, ti = blk.topk(kk, dim=-1)
                    kb = torch.zeros_like(blk, dtype=torch.bool)
                    kb.scatter_(-1, ti, tv > float("-inf"))
                    keep = kb.repeat_interleave(self.block, dim=-1)[..., :S] & base[:, None]  # [B,G,S,S]
                    st = kb.sum(-1).float().mean().item()
            if kl_slots is not None:
                kl = self.indexer_kl(q, k, iq, ik, base, kl_slots, nb, hd, hpg)
        if keep.shape[1] == 1:
            out = F.scaled_dot_product_attention(q, k.repeat_interleave(hpg, 1), v.repeat_interleave(hpg, 1),
                                                 attn_mask=keep)
        else:
            qg = q.reshape(B * G, hpg, S, hd)
            kg = k.reshape(B * G, 1, S, hd).expand(-1, hpg, -1, -1).contiguous()
            vg = v.reshape(B * G, 1, S, hd).expand(-1, hpg, -1, -1).contiguous()
            out = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=keep.reshape(B * G, 1, S, S))
            out = out.reshape(B, H, S, hd)
        out = out.transpose(1, 2).reshape(B, S, H * hd)
        return attn.o_proj(out), kl, st

    def indexer_kl(self, q, k, iq, ik, base, slots, nb, hd, hpg):
        """KL(block attention mass of dense attention || softmax of indexer block-max scores)."""
        torch, F = self.torch, self.F
        B, H, S, _ = q.shape
        K = slots.shape[1]
        m = torch.gather(base, 1, slots[:, :, None].expand(B, K, S))  # [B,K,S]
        with torch.no_grad():
            qs = torch.gather(q.float(), 2, slots[:, None, :, None].expand(B, H, K, hd))
            kr = k.float().repeat_interleave(hpg, 1)
            lg = torch.matmul(qs, kr.transpose(-1, -2)) * hd ** -0.5  # [B,H,K,S]
            lg = lg.masked_fill(~m[:, None], float("-inf"))
            p = torch.softmax(lg, dim=-1)
            pad = nb * self.block - S
            if pad:
                p = F.pad(p, (0, pad))
            p = p.view(B, H, K, nb, self.block).sum(-1)
            p = p.view(B, H // hpg, hpg, K, nb).mean(2)  # [B,G,K,nb]
        NI, dI = iq.shape[1], iq.shape[-1]
        iqs = torch.gather(iq.float(), 2, slots[:, None, :, None].expand(B, NI, K, dI))
        sc = torch.matmul(iqs, ik.float().transpose(-1, -2))  # [B,NI,K,S]
        sc = sc.masked_fill(~m[:, None], float("-inf"))
        if pad:
            sc = F.pad(sc, (0, pad), value=float("-inf"))
        bs = sc.view(B, NI, K, nb, self.block).amax(-1)  # [B,NI,K,nb]
        valid = bs > float("-inf")
        logq = torch.log_softmax(bs.masked_fill(~valid, -1e30), dim=-1)
        term = torch.where(p > 0, p * (torch.log(p.clamp_min(1e-30)) - logq), torch.zeros_like(p))
        return term.sum(-1).mean()


# ------------------------------------------------------------------------------------------
# Export
# ------------------------------------------------------------------------------------------


def export(torch, model, tok, out_dir):
    from transformers.models.minimax_m3_vl import modeling_minimax_m3_vl as mm

    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    os.makedirs(out_dir)
    model = model.cpu()
    keep = {}
    for name, mod in model.named_modules():
        if isinstance(mod, mm.MiniMaxM3VLTopKRouter):
            keep[name] = (mod.weight.detach().clone().float(), mod.e_score_correction_bias.detach().clone().float())
    model.to(torch.bfloat16)
    for name, mod in model.named_modules():
        if name in keep:
            w, b = keep[name]
            mod.weight = torch.nn.Parameter(w, requires_grad=False)
            mod.e_score_correction_bias = b
    model.save_pretrained(out_dir, max_shard_size="10GB")
    normalize_checkpoint_names(torch, os.path.join(out_dir, "model.safetensors"))
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(os.path.join(MODEL_DIR, f), os.path.join(out_dir, f))
    eos = tok.token_to_id("[e~[")
    gen = {"bos_token_id": tok.token_to_id("]~!b["), "eos_token_id": eos,
           "pad_token_id": tok.token_to_id("]!p~["), "do_sample": False, "max_new_tokens": 512}
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump(gen, f, indent=2)
        f.write("\n")
    from safetensors import safe_open
    st = os.path.join(out_dir, "model.safetensors")
    if not os.path.exists(st):
        raise SystemExit(f"save_pretrained did not write one model.safetensors: {os.listdir(out_dir)}")
    with safe_open(st, "pt") as f:
        names = list(f.keys())
        dt = {n: str(f.get_slice(n).get_dtype()) for n in names}
    bad = [n for n in names if (("block_sparse_moe.gate.weight" in n or "e_score_correction_bias" in n)
                                 != (dt[n] in ("F32", "float32")))]
    log(f"export: {len(names)} tensors, {os.path.getsize(st) / 1e6:.1f} MB; dtype problems: {bad[:5]}")
    for n in sorted(names):
        if (".layers.1." in n and "experts." not in n) or ".layers.0." in n or "layers" not in n:
            log(f"  {n} {dt[n]}")
    return out_dir


def normalize_checkpoint_names(torch, path):
    """transformers 5.17's save_pretrained writes the dense MLP of layer 0 as
    `block_sparse_moe.{gate,up,down}_proj` and the vision MLP as `block_sparse_moe.fc1/fc2`
    (its reverse rename of `.mlp.` is too broad); 5.24 then cannot load them. Rewrite them to
    the shipped M3 names (`mlp.gate_proj`, ..., m3-model.md section 2.2), which both read."""
    import re
    from safetensors.torch import load_file, save_file

    sd = load_file(path)
    pat = re.compile(r"\.block_sparse_moe\.(gate_proj|up_proj|down_proj|fc1|fc2)\.")
    out = {pat.sub(r".mlp.\1.", k): v for k, v in sd.items()}
    renamed = sum(1 for k in sd if pat.search(k))
    save_file(out, path, metadata={"format": "pt"})
    log(f"checkpoint names: {renamed} tensors renamed block_sparse_moe.* -> mlp.* (dense/vision MLP)")


# ------------------------------------------------------------------------------------------
# Evaluation with transformers (model reloaded from the exported files)
# ------------------------------------------------------------------------------------------


class HFEval:
    def __init__(self, torch, model_dir, device):
        from tokenizers import Tokenizer
        from transformers import MiniMaxM3SparseForConditionalGeneration

        self.torch = torch
        self.device = device
        self.model, info = MiniMaxM3SparseForConditionalGeneration.from_pretrained(
            model_dir, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
        problems = {k: list(v)[:5] for k, v in info.items() if v}
        log(f"reload info: {problems or 'clean'}")
        self.model.to(device).eval()
        self.tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
        self.tpl = ChatTemplate(os.path.join(model_dir, "chat_template.jinja"))
        self.eos = self.tok.token_to_id("[e~[")
        self.indexers = [l.self_attn.indexer for l in self.model.model.language_model.layers
                         if l.self_attn.indexer is not None]
        self.use_cache = True
        self.selection = "indexer"

    def set_selection(self, how):
        """indexer (trained) | dense (every block) | recency (the most recent top-k blocks)."""
        import types
        self.selection = how
        for idx in self.indexers:
            if not hasattr(idx, "_orig_forward"):
                idx._orig_forward = idx.forward
                idx._orig_topk = idx.topk_blocks
            idx.forward = idx._orig_forward
            idx.topk_blocks = idx._orig_topk
            if how == "dense":
                idx.topk_blocks = 10 ** 9
            elif how == "recency":
                def fwd(self_, hidden_states, position_embeddings, cache, position_ids, _o=idx._orig_forward):
                    torch = self.torch
                    _o(hidden_states, position_embeddings, cache, position_ids)  # keeps the index cache in step
                    qb = position_ids // self_.block_size  # [B,Sq]
                    r = qb[:, None, :, None] - torch.arange(self_.topk_blocks, device=qb.device)
                    r = r.masked_fill(r < 0, -1)
                    return r.expand(-1, self_.num_heads, -1, -1).contiguous()
                idx.forward = types.MethodType(fwd, idx)

    def prompt_ids(self, item):
        text = self.tpl.render(item["messages"], item["tools"], True, item["mode"])
        return self.tok.encode(text, add_special_tokens=False).ids

    def greedy(self, ids, max_new):
        torch = self.torch
        x = torch.tensor([ids], device=self.device)
        with torch.no_grad():
            if self.use_cache:
                out = self.model.generate(input_ids=x, attention_mask=torch.ones_like(x),
                                          max_new_tokens=max_new, do_sample=False,
                                          eos_token_id=self.eos, pad_token_id=self.eos)
                new = out[0, len(ids):].tolist()
            else:
                new = []
                for _ in range(max_new):
                    lg = self.model(input_ids=x, use_cache=False).logits[0, -1]
                    t = int(lg.argmax())
                    new.append(t)
                    if t == self.eos:
                        break
                    x = torch.cat([x, torch.tensor([[t]], device=self.device)], 1)
        if self.eos in new:
            new = new[: new.index(self.eos) + 1]
        return new

    def decode(self, new):
        if new and new[-1] == self.eos:
            new = new[:-1]
        return self.tok.decode(new, skip_special_tokens=False)


MAX_NEW = {"arith": {"enabled": 72, "disabled": 24}, "lookup": {"enabled": 72, "disabled": 24},
           "tool": {"enabled": 96, "disabled": 72}, "passkey": {"disabled": 12}}


def score_item(ev, item):
    ids = ev.prompt_ids(item)
    new = ev.greedy(ids, MAX_NEW[item["kind"]][item["mode"]])
    text = ev.decode(new)
    reasoning, rest = split_reasoning(text, item["mode"])
    rec = dict(id=item["id"], prompt_tokens=len(ids), output=text, finished=bool(new) and new[-1] == ev.eos)
    if item["kind"] == "tool":
        try:
            content, calls = parse_tool_calls(rest, item["tools"])
            rec["parsed"] = bool(calls)
            rec["calls"] = calls
        except ValueError as e:
            rec["parsed"], rec["calls"], rec["parse_error"] = False, [], str(e)
        rec["correct"] = tasks.tool_call_correct(item, rec["calls"])
    else:
        rec["correct"] = tasks.answer_correct(item, rest)
    return rec


def run_eval(torch, ev, items, deadline):
    res = {"items": [], "selection": {}}
    PARTIAL["res"] = res
    # cache/no-cache agreement on a long passkey prompt (MSA decode path of transformers)
    long_item = [i for i in items if i["kind"] == "passkey"][-1]
    ids = ev.prompt_ids(long_item)
    ev.use_cache = False
    a = ev.greedy(ids, 8)
    ev.use_cache = True
    try:
        b = ev.greedy(ids, 8)
        res["cache_matches_nocache"] = a == b
        if a != b:
            log(f"WARNING generate(cache) {b} != no-cache greedy {a}; using no-cache")
            ev.use_cache = False
    except Exception as e:  # noqa: BLE001 - transformers version differences
        log(f"generate() failed ({type(e).__name__}: {e}); using no-cache greedy")
        res["cache_matches_nocache"] = None
        ev.use_cache = False
    passkeys = [i for i in items if i["kind"] == "passkey"]
    rest = [i for i in items if i["kind"] != "passkey"]
    # interleave so that a deadline cuts every category evenly
    order = passkeys + [rest[j] for j in sorted(range(len(rest)), key=lambda j: (j % 4, j))]
    for item in order:
        if time.time() > deadline - 40:
            log("eval deadline reached; remaining items skipped")
            break
        res["items"].append(dict(score_item(ev, item), kind=item["kind"], mode=item["mode"],
                                 ctx=item.get("ctx")))
    for how, stop in (("dense", deadline - 20), ("recency", deadline)):
        ev.set_selection(how)
        rows = []
        res["selection"][how] = rows
        for item in [i for i in items if i["kind"] == "passkey"]:
            if time.time() > stop:
                break
            rows.append(dict(score_item(ev, item), ctx=item["ctx"]))
    ev.set_selection("indexer")
    return res


def summarize(res):
    items = res["items"]
    s = {"passkey_by_ctx": {}, "tasks": {}, "tools": {}}
    for L in tasks.PASSKEY_EVAL_LENGTHS:
        row = {}
        pk = [r for r in items if r["kind"] == "passkey" and r["ctx"] == L]
        if pk:
            row["indexer"] = sum(r["correct"] for r in pk) / len(pk)
            row["prompt_tokens"] = round(sum(r["prompt_tokens"] for r in pk) / len(pk))
        for how, rows in res["selection"].items():
            rr = [r for r in rows if r["ctx"] == L]
            if rr:
                row[how] = sum(r["correct"] for r in rr) / len(rr)
        row["n"] = len(pk)
        s["passkey_by_ctx"][str(L)] = row
    for kind in ("arith", "lookup"):
        for mode in ("enabled", "disabled"):
            rr = [r for r in items if r["kind"] == kind and r["mode"] == mode]
            if rr:
                s["tasks"][f"{kind}_thinking_{mode}"] = dict(
                    accuracy=sum(r["correct"] for r in rr) / len(rr), n=len(rr),
                    finished=sum(r["finished"] for r in rr) / len(rr))
    for mode in ("enabled", "disabled"):
        rr = [r for r in items if r["kind"] == "tool" and r["mode"] == mode]
        if rr:
            s["tools"][f"thinking_{mode}"] = dict(
                parse_rate=sum(r["parsed"] for r in rr) / len(rr),
                correct_call=sum(r["correct"] for r in rr) / len(rr), n=len(rr))
    return s


# ------------------------------------------------------------------------------------------
# Main
# ------------------------------------------------------------------------------------------


# Curriculum: passkey filler grows from a few hundred tokens to several thousand while the row
# length grows with it (short rows are cheaper: attention cost is per row length squared). Each
# phase keeps a large passkey share, and passkey lengths are log-uniform, so every batch holds
# many retrievals (the first model saw ~8 per step and never learned to copy the key).
PHASES = [
    # name, end (fraction of training time), row, passkey filler range, kind weights
    ("A", 0.30, 1024, (20, 700), [("arith", 13), ("lookup", 13), ("chat", 4), ("tool_call", 16),
                                  ("tool_answer", 9), ("passkey", 45)]),
    ("B", 0.50, 2048, (60, 1750), [("arith", 14), ("lookup", 14), ("chat", 5), ("tool_call", 17),
                                   ("tool_answer", 10), ("passkey", 40)]),
    ("C", 1.00, 4096, (120, 3700), [("arith", 16), ("lookup", 16), ("chat", 5), ("tool_call", 20),
                                    ("tool_answer", 11), ("passkey", 32)]),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--deadline", type=float, default=470,
                    help="wall-clock seconds from start by which everything (train, export, eval) ends")
    ap.add_argument("--reserve", type=float, default=125,
                    help="seconds kept after training for export + transformers eval")
    ap.add_argument("--train-seconds", type=float, default=0, help="cap on training time (0: deadline)")
    ap.add_argument("--tokens-per-step", type=int, default=32768)
    ap.add_argument("--tok-rate", type=float, default=5e5,
                    help="expected training slots/s at 1024-token rows (scaled by sqrt(1024/row) for "
                         "longer rows); sizes the generated data (rows wrap into more epochs)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--kl-start", type=float, default=0.15, help="fraction of training time")
    ap.add_argument("--sparse-start", type=float, default=0.5, help="fraction of training time")
    ap.add_argument("--kl-slots", type=int, default=256)
    ap.add_argument("--procs", type=int, default=0)
    ap.add_argument("--small", action="store_true", help="tiny CPU smoke configuration")
    ap.add_argument("--eval-n", type=int, default=0, help="limit eval items per kind (smoke)")
    args = ap.parse_args()
    t0 = time.time()
    deadline = t0 + args.deadline
    os.makedirs(args.out, exist_ok=True)
    start_watchdog(args.out, deadline + 25)

    import numpy as np
    import tokenizers
    import torch
    import transformers

    device = "cuda" if torch.cuda.is_available() else "cpu"
    log(f"torch {torch.__version__} transformers {transformers.__version__} tokenizers "
        f"{tokenizers.__version__} numpy {np.__version__} device {device} "
        f"{torch.cuda.get_device_name() if device == 'cuda' else ''}")
    log(f"args {vars(args)}")
    torch.manual_seed(0)
    random.seed(0)

    tok = make_data.load_tokenizer()
    pad_id = tok.token_to_id("]!p~[")
    procs = args.procs or max(1, min(14, (os.cpu_count() or 2) - 1))
    pool = make_data.worker_pool(procs)
    # data budget: the training time this deadline leaves (data gen of phase A runs first)
    train_budget = args.deadline - args.reserve - 25
    if args.train_seconds:
        train_budget = min(train_budget, args.train_seconds)
    phase_data, prev = {}, 0.0
    for pi, (name, end, row, (lo, hi), weights) in enumerate(PHASES):
        row_ = min(row, 1024) if args.small else row
        hi_ = min(hi, row_ - 300)
        lo_ = min(lo, hi_ - 1)
        # phase A's data is what the first step waits for: make ~3/4 of what it may use (rows
        # wrap into a second epoch if training is faster); B and C are made during A
        share = 0.8 if pi == 0 else 1.0
        slots = (end - prev) * train_budget * args.tok_rate * (1024 / row) ** 0.5 * share
        n_docs = max(procs, int(slots / make_data.slots_per_doc(weights, lo_, hi_)))
        jobs = make_data.rows_jobs(n_docs, seed=11 + pi, weights=weights, pk_lo=lo_, pk_hi=hi_,
                                   row=row_, pad_id=pad_id)
        # phase A in two parts: training starts as soon as the first is ready, the second is
        # added when it is
        cut = max(1, len(jobs) * 35 // 100) if pi == 0 and len(jobs) > 1 else len(jobs)
        parts = [pool.map_async(make_data._make_rows, jobs[:cut])]
        if cut < len(jobs):
            parts.append(pool.map_async(make_data._make_rows, jobs[cut:]))
        phase_data[name] = dict(row=row_, pk=(lo_, hi_), n_docs=n_docs, parts=parts, loaded=0)
        prev = end
    tp = time.time()

    from transformers import MiniMaxM3SparseForConditionalGeneration, MiniMaxM3VLConfig

    cfg = model_config(tok, small=args.small)
    config = MiniMaxM3VLConfig(**json.loads(json.dumps(cfg)))
    model = MiniMaxM3SparseForConditionalGeneration(config).to(device)
    model.train()
    nparam = sum(p.numel() for n, p in model.named_parameters() if "vision" not in n and "projector" not in n)
    log(f"model: {nparam / 1e6:.2f}M text params; config {json.dumps(cfg['text_config'])}")
    tr = Trainer(torch, model, cfg)

    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (decay if p.ndim >= 2 and "embed" not in n else no_decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)

    first = PHASES[0][0]
    phase_data[first]["parts"][0].wait()
    log(f"phase {first} data ready {time.time() - tp:.0f}s after submitting ({time.time() - t0:.0f}s elapsed)")

    def load_phase(name):
        """Rows of every ready part of the phase (waits for the first part)."""
        d = phase_data[name]
        d["parts"][0].wait()
        ready = [p for p in d["parts"] if p.ready()]
        tt, ww, ss, kinds = make_data.join_rows([c for p in ready for c in p.get()])
        d.update(T=torch.from_numpy(tt).long(), W=torch.from_numpy(ww), S=torch.from_numpy(ss).long(),
                 perm=torch.randperm(tt.shape[0]), ptr=0, epoch=d.get("epoch", 0), loaded=len(ready))
        log(f"phase {name}: {len(ready)}/{len(d['parts'])} parts of {d['n_docs']} docs -> {tt.shape[0]} rows "
            f"x {tt.shape[1]}, passkey filler {d['pk'][0]}-{d['pk'][1]}; tokens by kind "
            f"{dict(sorted(kinds.items()))}")
        return d

    t_train = time.time()
    train_s = deadline - args.reserve - t_train
    if args.train_seconds:
        train_s = min(train_s, args.train_seconds)
    log(f"training for {train_s:.0f}s ({t_train - t0:.0f}s elapsed)")
    step, ema, cur, d = 0, None, None, None
    tokens_seen = 0
    while True:
        now = time.time()
        frac = (now - t_train) / train_s
        if frac >= 1.0 or now > deadline - args.reserve:
            break
        name = next(p[0] for p in PHASES if frac < p[1])
        if name != cur:
            d = load_phase(name)
            cur = name
            save_log(args.out)
        elif step % 50 == 0 and d["loaded"] < len(d["parts"]) and all(p.ready() for p in d["parts"]):
            d = load_phase(name)
        batch = max(1, args.tokens_per_step // d["row"])
        phase = "sparse" if frac >= args.sparse_start else "dense"
        use_kl = frac >= args.kl_start
        lr = args.lr * min(1.0, (step + 1) / args.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = lr
        R = d["T"].shape[0]
        if d["ptr"] + batch > R:
            d["perm"], d["ptr"] = torch.randperm(R), 0
            d["epoch"] += 1
        bi = d["perm"][d["ptr"]:d["ptr"] + batch]
        d["ptr"] += batch
        tokens, w, start = d["T"][bi].to(device), d["W"][bi].to(device), d["S"][bi].to(device)
        slots = None
        if use_kl:
            pri = torch.rand(w.shape, device=device) + (w >= 1.0).float()
            slots = pri.topk(min(args.kl_slots, w.shape[1]), dim=-1).indices.sort(-1).values
        with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=device == "cuda"):
            logits, kl, sel = tr.forward(tokens, start, phase, slots)
        ce = torch.nn.functional.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                                               tokens[:, 1:].reshape(-1), reduction="none")
        wv = w[:, :-1].reshape(-1)
        lm_loss = (ce * wv).sum() / wv.sum()
        comp = (wv >= 1.0).float()
        comp_loss = (ce * comp).sum() / comp.sum().clamp_min(1)
        loss = lm_loss + (kl if use_kl else 0.0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        spread = tr.update_router_bias(1e-3)
        step += 1
        tokens_seen += tokens.numel()
        if step % 25 == 0 or step == 1:
            cl = comp_loss.item()
            ema = cl if ema is None else 0.8 * ema + 0.2 * cl
            log(f"step {step} t={time.time() - t_train:.0f}s data={cur}/ep{d['epoch']} phase={phase} "
                f"lr={lr:.2e} lm={lm_loss.item():.3f} completion={cl:.3f} (ema {ema:.3f}) kl={float(kl):.3f} "
                f"gnorm={float(gn):.2f} max_expert_share={spread:.2f} "
                f"blocks/query={(sum(sel) / len(sel)) if sel else 0:.2f}")
    log(f"trained {step} steps ({tokens_seen / 1e6:.1f}M tokens) in {time.time() - t_train:.0f}s; "
        f"{time.time() - t0:.0f}s elapsed")
    pool.terminate()
    phase_data.clear()

    model.eval()
    import tempfile
    export_dir = os.path.join(tempfile.mkdtemp(prefix="m3demo_"), "demo")
    export(torch, model, tok, export_dir)
    tgz = os.path.join(args.out, "demo_model.tar.gz")
    with tarfile.open(tgz, "w:gz") as tf:
        tf.add(export_dir, arcname="demo")
    split_large(tgz)
    log(f"exported; {time.time() - t0:.0f}s elapsed")
    save_log(args.out)
    del model, opt, tr
    if device == "cuda":
        torch.cuda.empty_cache()

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    ev = HFEval(torch, export_dir, device)
    flen = tasks.FillerLengths(tok)
    items = tasks.eval_set(flen)
    if args.eval_n:
        by = {}
        keep = []
        for it in items:
            key = (it["kind"], it.get("ctx"))
            by[key] = by.get(key, 0) + 1
            if by[key] <= args.eval_n:
                keep.append(it)
        items = keep
    # parity: this script's forward (sparse phase) vs transformers' forward on a long prompt
    try:
        trp = Trainer(torch, ev.model, cfg, router_hooks=False)
        pk = [i for i in items if i["kind"] == "passkey"][-1]
        ids = ev.prompt_ids(pk)
        x = torch.tensor([ids], device=device)
        with torch.no_grad():
            ref = ev.model(input_ids=x, use_cache=False).logits[0].float()
            mine, _, _ = trp.forward(x, torch.zeros_like(x), "sparse")
            mine = mine[0].float()
        dlt = (ref - mine).abs().max().item()
        agree = (ref.argmax(-1) == mine.argmax(-1)).float().mean().item()
        log(f"parity (train forward vs transformers, {len(ids)} tokens, fp32): max |dlogit| {dlt:.2e}, "
            f"argmax agreement {agree:.4f}")
        parity = dict(tokens=len(ids), max_abs_logit_diff=dlt, argmax_agreement=agree)
    except Exception as e:  # noqa: BLE001
        log(f"parity check failed: {type(e).__name__}: {e}")
        parity = dict(error=str(e))
    meta = dict(parity=parity,
                versions=dict(torch=torch.__version__, transformers=transformers.__version__,
                              tokenizers=tokenizers.__version__),
                train=dict(steps=step, seconds=round(train_s), tokens_per_step=args.tokens_per_step,
                           phases=[dict(name=n, end=e, row=r, passkey_filler=list(pk_), weights=dict(wt))
                                   for n, e, r, pk_, wt in PHASES],
                           kl_start=args.kl_start, sparse_start=args.sparse_start, lr=args.lr))
    PARTIAL.update(out=args.out, meta=meta)
    try:
        res = run_eval(torch, ev, items, deadline=deadline - 5)
    except Exception as e:  # noqa: BLE001 - keep the trained model and the log
        import traceback
        log("eval failed: " + traceback.format_exc())
        res = {"items": [], "selection": {}, "error": str(e)}
    write_eval(args.out, meta, res)
    log(f"done in {time.time() - t0:.0f}s")
    save_log(args.out)
    shutil.rmtree(export_dir, ignore_errors=True)


PARTIAL = {}


def split_large(path, limit=15 * 2 ** 20):
    """The device run returns files of at most 16 MiB: split a larger one into .partN pieces
    (join with `cat path.part* > path`)."""
    size = os.path.getsize(path)
    if size <= limit:
        return
    with open(path, "rb") as f:
        i = 0
        while True:
            b = f.read(limit)
            if not b:
                break
            with open(f"{path}.part{i}", "wb") as g:
                g.write(b)
            i += 1
    os.remove(path)
    log(f"{os.path.basename(path)} is {size / 2 ** 20:.1f} MiB: split into {i} parts")


def write_eval(out, meta, res):
    summary = summarize(res)
    log("summary: " + json.dumps(summary, indent=1))
    o = dict(summary=summary, cache_matches_nocache=res.get("cache_matches_nocache"), **meta,
             items=res["items"], selection=res["selection"])
    with open(os.path.join(out, "hf_eval.json"), "w") as f:
        json.dump(o, f, indent=1)


def start_watchdog(out, when):
    """If anything overruns the wall-clock deadline, write what exists (log, partial eval) and
    exit, so the device run's limit never kills the process before its results are written."""
    import threading

    def fire():
        log(f"WATCHDOG: deadline passed at {time.strftime('%H:%M:%S')}; writing partial results and exiting")
        try:
            if "res" in PARTIAL and "meta" in PARTIAL:
                write_eval(out, PARTIAL["meta"], PARTIAL["res"])
        except Exception as e:  # noqa: BLE001
            log(f"partial eval write failed: {e}")
        save_log(out)
        os._exit(3)

    t = threading.Timer(max(1.0, when - time.time()), fire)
    t.daemon = True
    t.start()


def save_log(out):
    with open(os.path.join(out, "train_log.txt"), "w") as f:
        f.write("\n".join(LOG) + "\n")


if __name__ == "__main__":
    main()
