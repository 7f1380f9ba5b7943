#!/usr/bin/env python3
"""Trains the EAGLE-3 draft head of the demo model (models/demo-eagle3) on the GPU machine.

One command (torch 2.11 + transformers 5.17 there; nothing is downloaded):

    python3 tools/demo_model/train_eagle3.py --out "$OUT" --train-seconds 150

- Data: conversations of the demo's own tasks (tools/demo_model/tasks.py: arithmetic, lookups,
  small talk, tool calls and answers after tool results; passkey documents are left out, they are
  longer than 512 tokens), rendered with the demo's chat template. The labels are the demo model's
  own outputs: its next-token distribution at every position (transformers' implementation,
  loaded from models/demo, fp32). Every document is at most 512 tokens, where the demo's MSA
  layers attend densely.
- Draft (LlamaForCausalLMEagle3 layout, m3-model.md section 5.2): fc over the residual streams
  entering target layers 1, 2, 3 (eagle_aux_hidden_state_layer_ids), one Llama layer over
  concat(input_norm(embed), hidden_norm(hidden)), GQA 8 query / 2 KV heads of 32, SiLU MLP 768,
  final norm, and the target's own embedding and LM head (frozen, not exported).
- Training-time test: TTT_STEPS unrolled draft steps per position, each step feeding the
  previous step's pre-norm output one position later and attending to the context keys and the
  earlier steps' keys exactly as the engine's draft steps do (engine/spec_decode.cpp), with a
  soft cross-entropy against the target's distribution.
- Writes $OUT/demo-eagle3/{config.json, model.safetensors, training_log.txt} and
  $OUT/eagle3_golden.json (a prompt's aux hidden states from transformers and the draft's
  outputs on them, for tests/unit/model/eagle3_test.cpp).
"""
import argparse
import json
import math
import os
import random
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import tasks  # noqa: E402
from chat_format import MODEL_DIR, ChatTemplate  # noqa: E402

LOG = []
T0 = time.time()


def log(*a):
    line = f"[{time.time() - T0:7.1f}s] " + " ".join(str(x) for x in a)
    print(line, flush=True)
    LOG.append(line)


AUX = [1, 2, 3]  # residual stream entering these target layers
KINDS = [("arith", 3), ("lookup", 3), ("chat", 1), ("tool_call", 2), ("tool_answer", 2)]
MAX_LEN = 512
TTT_STEPS = 4


def make_docs(n, seed, tok, tpl):
    rng = random.Random(seed)
    kinds = [k for k, _ in KINDS]
    ws = [w for _, w in KINDS]
    docs = []
    while len(docs) < n:
        kind = rng.choices(kinds, ws)[0]
        s = tasks.train_sample(rng, kind)
        prompt = tpl.render(s["messages"], s["tools"], True, s["mode"])
        ids = tok.encode(prompt + s["completion"], add_special_tokens=False).ids
        if len(ids) <= MAX_LEN:
            docs.append((ids, kind))
    return docs


def rope(torch, x, pos, theta):
    # x: [B, h, S, d]; NeoX rotate-half over the whole head (Llama), positions pos [S]
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    f = pos[:, None].float() * inv[None, :]
    emb = torch.cat([f, f], -1)
    cos, sin = emb.cos(), emb.sin()
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    rot = torch.cat([-x2, x1], -1)
    return x * cos + rot * sin


def build_draft(torch, H, heads, kv_heads, hd, inter, naux):
    nn = torch.nn

    class RMSNorm(nn.Module):
        def __init__(self, n, eps=1e-6):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(n))
            self.eps = eps

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight

    class Draft(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(naux * H, H, bias=False)
            self.input_layernorm = RMSNorm(H)
            self.hidden_norm = RMSNorm(H)
            self.post_attention_layernorm = RMSNorm(H)
            self.norm = RMSNorm(H)
            self.q_proj = nn.Linear(2 * H, heads * hd, bias=False)
            self.k_proj = nn.Linear(2 * H, kv_heads * hd, bias=False)
            self.v_proj = nn.Linear(2 * H, kv_heads * hd, bias=False)
            self.o_proj = nn.Linear(heads * hd, H, bias=False)
            self.gate_proj = nn.Linear(H, inter, bias=False)
            self.up_proj = nn.Linear(H, inter, bias=False)
            self.down_proj = nn.Linear(inter, H, bias=False)

        def qkv(self, emb, h, pos, theta):
            B, S, _ = emb.shape
            x = torch.cat([self.input_layernorm(emb), self.hidden_norm(h)], -1)
            q = self.q_proj(x).view(B, S, heads, hd).transpose(1, 2)
            k = self.k_proj(x).view(B, S, kv_heads, hd).transpose(1, 2)
            v = self.v_proj(x).view(B, S, kv_heads, hd).transpose(1, 2)
            return rope(torch, q, pos, theta), rope(torch, k, pos, theta), v

        def finish(self, h, attn):
            r = h + self.o_proj(attn)
            a = self.post_attention_layernorm(r)
            m = self.down_proj(torch.nn.functional.silu(self.gate_proj(a)) * self.up_proj(a))
            return r + m  # pre-norm output

    return Draft()


def shift(torch, x, m):
    """x[..., i, :] -> x[..., i - m, :] along the sequence dim (-2); rows i < m are zero."""
    if m == 0:
        return x
    pad = torch.zeros_like(x[..., :m, :])
    return torch.cat([pad, x[..., :-m, :]], -2)


def ttt_forward(torch, draft, emb_next, aux, pos, steps, theta, kv_rep):
    """Unrolled draft steps. Step s row i: token t[i+1] (emb_next), hidden fc(aux[i]) (s == 0)
    or step s-1's pre-norm output at row i-1; keys: step 0's at rows <= i - s and step r's at
    row i - s + r (r = 1..s). Returns the pre-norm outputs of every step."""
    F = torch.nn.functional
    B, S, H = emb_next.shape
    h = draft.fc(aux)
    ks, vs, outs = [], [], []
    idx = torch.arange(S, device=aux.device)
    for s in range(steps):
        q, k, v = draft.qkv(emb_next, h, pos, theta)
        k = k.repeat_interleave(kv_rep, 1)
        v = v.repeat_interleave(kv_rep, 1)
        ks.append(k)
        vs.append(v)
        d = q.shape[-1]
        sc0 = torch.matmul(q, ks[0].transpose(-1, -2)) / math.sqrt(d)  # [B, h, S, S]
        allowed = idx[None, :] <= (idx[:, None] - s)
        sc0 = sc0.masked_fill(~allowed, float("-inf"))
        diag = []
        for r in range(1, s + 1):
            kr = shift(torch, ks[r], s - r)
            dr = (q * kr).sum(-1, keepdim=True) / math.sqrt(d)
            valid = (idx >= (s - r))[None, None, :, None]
            diag.append(dr.masked_fill(~valid, float("-inf")))
        p = F.softmax(torch.cat([sc0] + diag, -1), -1)
        o = torch.matmul(p[..., :S], vs[0])
        for r in range(1, s + 1):
            o = o + p[..., S + r - 1: S + r] * shift(torch, vs[r], s - r)
        o = o.transpose(1, 2).reshape(B, S, -1)
        g = draft.finish(h, o)
        outs.append(g)
        h = shift(torch, g, 1)  # the next step reads row i-1's output at row i
    return outs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--train-seconds", type=float, default=150)
    ap.add_argument("--docs", type=int, default=6000)
    ap.add_argument("--batch", type=int, default=48)
    ap.add_argument("--lr", type=float, default=2e-3)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    out_dir = os.path.join(args.out, "demo-eagle3")
    os.makedirs(out_dir, exist_ok=True)

    import numpy as np
    import tokenizers
    import torch
    import transformers
    from transformers import MiniMaxM3SparseForConditionalGeneration

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = "cuda" if torch.cuda.is_available() else "cpu"
    log(f"torch {torch.__version__} transformers {transformers.__version__} tokenizers "
        f"{tokenizers.__version__} numpy {np.__version__} device {device}")
    log(f"args {vars(args)}")
    torch.manual_seed(0)

    tok = tokenizers.Tokenizer.from_file(os.path.join(MODEL_DIR, "tokenizer.json"))
    tpl = ChatTemplate(os.path.join(MODEL_DIR, "chat_template.jinja"))
    docs = make_docs(args.docs, 7, tok, tpl)
    held = make_docs(256, 99991, tok, tpl)
    by_kind = {}
    for ids, k in docs:
        by_kind[k] = by_kind.get(k, 0) + 1
    log(f"{len(docs)} training docs {by_kind}, mean {sum(len(d) for d, _ in docs) / len(docs):.0f} "
        f"tokens; {len(held)} held-out docs")

    target = MiniMaxM3SparseForConditionalGeneration.from_pretrained(MODEL_DIR, dtype=torch.float32)
    target.to(device).eval()
    for p in target.parameters():
        p.requires_grad_(False)
    lm = target.model.language_model
    tcfg = target.config.text_config
    H, V = tcfg.hidden_size, tcfg.vocab_size
    captured = {}

    def pre_hook(li):
        def fn(mod, args_, kwargs):
            hs = args_[0] if args_ else kwargs["hidden_states"]
            captured[li] = hs
        return fn

    for li in AUX:
        lm.layers[li].register_forward_pre_hook(pre_hook(li), with_kwargs=True)
    embed = lm.embed_tokens.weight  # [V, H], frozen
    lm_head = target.lm_head.weight  # [V, H], frozen

    heads, kv_heads, hd, inter = 8, 2, 32, 768
    theta = 10000.0
    draft = build_draft(torch, H, heads, kv_heads, hd, inter, len(AUX)).to(device)
    nparam = sum(p.numel() for p in draft.parameters())
    log(f"draft: {nparam / 1e6:.3f}M parameters (fc {len(AUX)}x{H}->{H}, {heads} heads / "
        f"{kv_heads} KV heads x {hd}, mlp {inter}); embedding and LM head shared with the target")

    pad = tok.token_to_id("]!p~[")

    def batch_of(items):
        L = max(len(d) for d, _ in items)
        x = torch.full((len(items), L), pad, dtype=torch.long)
        m = torch.zeros((len(items), L), dtype=torch.bool)
        for i, (d, _) in enumerate(items):
            x[i, : len(d)] = torch.tensor(d)
            m[i, : len(d)] = True
        return x.to(device), m.to(device)

    def target_pass(x):
        with torch.no_grad():
            logits = target(input_ids=x, use_cache=False).logits.float()  # [B, S, V]
            aux = torch.cat([captured[li] for li in AUX], -1).float()  # [B, S, 3H]
        return logits, aux

    def losses(x, m):
        logits, aux = target_pass(x)
        B, S = x.shape
        # row i: token t[i+1], label: the target's distribution at position i+1
        nxt = torch.cat([x[:, 1:], torch.full_like(x[:, :1], pad)], 1)
        emb_next = torch.nn.functional.embedding(nxt, embed)
        lab = torch.cat([logits[:, 1:], logits[:, -1:]], 1).softmax(-1)
        lab_tok = lab.argmax(-1)
        valid_base = torch.cat([m[:, 1:], torch.zeros_like(m[:, :1])], 1)  # i+1 exists
        pos = torch.arange(S, device=device)
        outs = ttt_forward(torch, draft, emb_next, aux, pos, TTT_STEPS, theta, heads // kv_heads)
        total, accs = 0.0, []
        idx = torch.arange(S, device=device)
        for s, g in enumerate(outs):
            lg = torch.matmul(draft.norm(g), lm_head.t())
            valid = valid_base & (idx >= s)[None, :]
            ce = -(lab * torch.log_softmax(lg, -1)).sum(-1)
            w = valid.float()
            total = total + (0.8 ** s) * (ce * w).sum() / w.sum().clamp_min(1)
            accs.append(((lg.argmax(-1) == lab_tok) & valid).sum().item() / max(1, valid.sum().item()))
        return total, accs

    opt = torch.optim.AdamW(draft.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    t_train = time.time()
    step, ema = 0, None
    order = list(range(len(docs)))
    random.Random(1).shuffle(order)
    ptr = 0
    while time.time() - t_train < args.train_seconds:
        frac = (time.time() - t_train) / args.train_seconds
        lr = args.lr * min(1.0, (step + 1) / 50) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for g_ in opt.param_groups:
            g_["lr"] = lr
        if ptr + args.batch > len(order):
            random.Random(step).shuffle(order)
            ptr = 0
        items = [docs[j] for j in order[ptr: ptr + args.batch]]
        ptr += args.batch
        x, m = batch_of(items)
        loss, accs = losses(x, m)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        if step % 50 == 0:
            log(f"step {step} lr {lr:.2e} loss {loss.item():.4f} (ema {ema:.4f}) top-1 agreement "
                f"by draft step {[round(a, 3) for a in accs]}")
        step += 1
    log(f"trained {step} steps in {time.time() - t_train:.0f}s")

    draft.eval()
    with torch.no_grad():
        agg = [0.0] * TTT_STEPS
        nb = 0
        for i in range(0, len(held), 32):
            x, m = batch_of(held[i: i + 32])
            _, accs = losses(x, m)
            agg = [a + b for a, b in zip(agg, accs)]
            nb += 1
        accs = [round(a / nb, 4) for a in agg]
        # Acceptance length estimate for K=3 if the steps' agreements were independent:
        # 1 + a0 + a0 a1 + a0 a1 a2.
        est, prod = 1.0, 1.0
        for a in accs[:3]:
            prod *= a
            est += prod
        log(f"held-out top-1 agreement with the target by draft step {accs}; "
            f"independent-steps estimate of the acceptance length at K=3: {est:.2f}")

    # Export (names as vLLM / SpecForge write LlamaForCausalLMEagle3 checkpoints).
    from safetensors.torch import save_file
    sd = {"fc.weight": draft.fc.weight, "norm.weight": draft.norm.weight}
    for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        sd[f"midlayer.{n}.weight"] = getattr(draft, n).weight
    for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
        sd[f"midlayer.self_attn.{n}.weight"] = getattr(draft, n).weight
    for n in ("gate_proj", "up_proj", "down_proj"):
        sd[f"midlayer.mlp.{n}.weight"] = getattr(draft, n).weight
    sd = {k: v.detach().to(torch.bfloat16).contiguous().cpu() for k, v in sd.items()}
    save_file(sd, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": H, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "head_dim": hd, "intermediate_size": inter, "hidden_act": "silu",
        "rms_norm_eps": 1e-6, "rope_theta": theta, "rope_scaling": None,
        "max_position_embeddings": tcfg.max_position_embeddings,
        "num_hidden_layers": 1, "vocab_size": V, "draft_vocab_size": V,
        "target_hidden_size": H, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": AUX, "use_aux_hidden_state": True},
    }
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")

    # Golden for the C++ tests: the bf16 weights as exported, read back in fp32.
    with torch.no_grad():
        exp = {k: v.float().to(device) for k, v in sd.items()}
        draft.fc.weight.copy_(exp["fc.weight"])
        draft.norm.weight.copy_(exp["norm.weight"])
        for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
            getattr(draft, n).weight.copy_(exp[f"midlayer.{n}.weight"])
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            getattr(draft, n).weight.copy_(exp[f"midlayer.self_attn.{n}.weight"])
        for n in ("gate_proj", "up_proj", "down_proj"):
            getattr(draft, n).weight.copy_(exp[f"midlayer.mlp.{n}.weight"])
        ids = held[0][0][:20]
        x = torch.tensor([ids], device=device)
        logits, aux = target_pass(x)
        S = len(ids) - 1  # rows 0..S-1 have a next token
        nxt = x[:, 1:]
        emb_next = torch.nn.functional.embedding(nxt, embed)
        pos = torch.arange(S, device=device)
        outs = ttt_forward(torch, draft, emb_next, aux[:, :S], pos, 1, theta, heads // kv_heads)
        g = outs[0][0]
        lg = torch.matmul(draft.norm(g), lm_head.t())
        gold = {
            "source": "tools/demo_model/train_eagle3.py",
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
            "aux_layers": AUX,
            "tokens": ids,
            "aux_hidden": aux[0, :S].cpu().flatten().tolist(),
            "draft_prenorm": g.cpu().flatten().tolist(),
            "draft_logits_last": lg[-1].cpu().tolist(),
            "draft_argmax": lg.argmax(-1).cpu().tolist(),
        }
        with open(os.path.join(args.out, "eagle3_golden.json"), "w") as f:
            json.dump(gold, f)
    log(f"exported {out_dir} ({os.path.getsize(os.path.join(out_dir, 'model.safetensors'))} bytes)")
    with open(os.path.join(out_dir, "training_log.txt"), "w") as f:
        f.write("\n".join(LOG) + "\n")


if __name__ == "__main__":
    main()
