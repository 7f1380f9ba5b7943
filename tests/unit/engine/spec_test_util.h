// Helpers of the speculative-decoding tests (spec_decode_test.cpp): a random EAGLE-3 draft for a
// target, in memory or written to a directory in the checkpoint format (config.json +
// model.safetensors, F32). Header-only.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "model/config.h"

namespace m3::engine::testing {

struct DraftShape {
  int64_t hidden = 0, heads = 4, kv_heads = 2, head_dim = 16, inter = 96, vocab = 0;
  int64_t target_hidden = 0;
  std::vector<int32_t> aux = {1, 2, 3};
  bool own_embed = false;
};

inline DraftShape shape_for(const model::M3Config& t) {
  DraftShape s;
  s.hidden = t.hidden_size;
  s.target_hidden = t.hidden_size;
  s.vocab = t.vocab_size;
  return s;
}

// Tensors of a random draft: name -> (shape, values). Norm weights near 1 (Llama form).
inline std::map<std::string, std::pair<std::vector<int64_t>, std::vector<float>>> random_tensors(
    const DraftShape& s, uint32_t seed) {
  std::mt19937 g(seed);
  std::map<std::string, std::pair<std::vector<int64_t>, std::vector<float>>> t;
  auto mat = [&](const std::string& n, int64_t r, int64_t c) {
    std::normal_distribution<float> d(0.f, 1.0f / std::sqrt(static_cast<float>(c)));
    std::vector<float> v(static_cast<size_t>(r * c));
    for (auto& x : v) x = d(g);
    t[n] = {{r, c}, std::move(v)};
  };
  auto norm = [&](const std::string& n) {
    std::uniform_real_distribution<float> d(0.8f, 1.2f);
    std::vector<float> v(static_cast<size_t>(s.hidden));
    for (auto& x : v) x = d(g);
    t[n] = {{s.hidden}, std::move(v)};
  };
  const int64_t H = s.hidden, q = s.heads * s.head_dim, kv = s.kv_heads * s.head_dim;
  mat("fc.weight", H, static_cast<int64_t>(s.aux.size()) * s.target_hidden);
  mat("midlayer.self_attn.q_proj.weight", q, 2 * H);
  mat("midlayer.self_attn.k_proj.weight", kv, 2 * H);
  mat("midlayer.self_attn.v_proj.weight", kv, 2 * H);
  mat("midlayer.self_attn.o_proj.weight", H, q);
  mat("midlayer.mlp.gate_proj.weight", s.inter, H);
  mat("midlayer.mlp.up_proj.weight", s.inter, H);
  mat("midlayer.mlp.down_proj.weight", H, s.inter);
  for (const char* n : {"midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
                        "midlayer.post_attention_layernorm.weight", "norm.weight"})
    norm(n);
  if (s.own_embed) mat("embed_tokens.weight", s.vocab, H);
  return t;
}

// Writes config.json and model.safetensors (F32) of a random draft into `dir`.
inline void write_draft(const std::string& dir, const DraftShape& s, uint32_t seed = 7,
                        const std::string& arch = "LlamaForCausalLMEagle3") {
  std::filesystem::create_directories(dir);
  nlohmann::json cfg = {{"architectures", {arch}},
                        {"hidden_size", s.hidden},
                        {"num_attention_heads", s.heads},
                        {"num_key_value_heads", s.kv_heads},
                        {"head_dim", s.head_dim},
                        {"intermediate_size", s.inter},
                        {"vocab_size", s.vocab},
                        {"draft_vocab_size", s.vocab},
                        {"target_hidden_size", s.target_hidden},
                        {"rms_norm_eps", 1e-6},
                        {"rope_theta", 10000.0},
                        {"hidden_act", "silu"},
                        {"eagle_config", {{"eagle_aux_hidden_state_layer_ids", s.aux}}}};
  std::ofstream(dir + "/config.json") << cfg.dump(2);
  const auto tensors = random_tensors(s, seed);
  nlohmann::json header = nlohmann::json::object();
  size_t off = 0;
  for (const auto& [name, tv] : tensors) {
    const size_t n = tv.second.size() * 4;
    header[name] = {{"dtype", "F32"}, {"shape", tv.first}, {"data_offsets", {off, off + n}}};
    off += n;
  }
  std::string h = header.dump();
  while (h.size() % 8 != 0) h.push_back(' ');
  std::ofstream out(dir + "/model.safetensors", std::ios::binary);
  const uint64_t len = h.size();
  out.write(reinterpret_cast<const char*>(&len), 8);
  out.write(h.data(), static_cast<std::streamsize>(h.size()));
  for (const auto& [name, tv] : tensors)
    out.write(reinterpret_cast<const char*>(tv.second.data()),
              static_cast<std::streamsize>(tv.second.size() * 4));
}

}  // namespace m3::engine::testing
