// Tests for model/config.cpp: both config.json forms of MiniMax-M3 (shipped and
// transformers-written) parse to the same M3Config, defaults, and every refusal.
// Fixtures: tests/unit/model/fixtures/config_*.json, made by
// tools/goldens/make_config_fixtures.py (the flat ones by transformers itself).
#include <gtest/gtest.h>

#include <cmath>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

#include "model/config.h"

namespace m3::model {
namespace {

using json = nlohmann::json;

std::string fixture_path(const std::string& name) {
  return std::string(M3_SOURCE_DIR) + "/tests/unit/model/fixtures/" + name;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in) << "cannot open " << path;
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

M3Config parse_ok(const std::string& text, const std::string& source = "config.json") {
  Result<M3Config> r = parse_config(text, source);
  EXPECT_TRUE(r.has_value()) << (r ? "" : r.error().message);
  return r ? *r : M3Config{};
}

M3Config parse_fixture(const std::string& name) {
  return parse_ok(read_file(fixture_path(name)), name);
}

// Expects a parse failure whose message contains every one of `parts`.
Error parse_fails(const json& j, std::initializer_list<std::string> parts) {
  Result<M3Config> r = parse_config(j.dump(), "config.json");
  EXPECT_FALSE(r.has_value()) << "parsed although it should not: " << j.dump().substr(0, 200);
  if (r) return Error{};
  for (const std::string& p : parts) {
    EXPECT_NE(r.error().message.find(p), std::string::npos)
        << "message lacks \"" << p << "\": " << r.error().message;
  }
  return r.error();
}

// Every field of M3Config; extend when the struct grows.
void expect_same(const M3Config& a, const M3Config& b) {
  EXPECT_EQ(a.model_type, b.model_type);
  EXPECT_EQ(a.vocab_size, b.vocab_size);
  EXPECT_EQ(a.hidden_size, b.hidden_size);
  EXPECT_EQ(a.num_hidden_layers, b.num_hidden_layers);
  EXPECT_EQ(a.num_attention_heads, b.num_attention_heads);
  EXPECT_EQ(a.num_key_value_heads, b.num_key_value_heads);
  EXPECT_EQ(a.head_dim, b.head_dim);
  EXPECT_EQ(a.intermediate_size, b.intermediate_size);
  EXPECT_EQ(a.dense_intermediate_size, b.dense_intermediate_size);
  EXPECT_EQ(a.shared_intermediate_size, b.shared_intermediate_size);
  EXPECT_EQ(a.num_local_experts, b.num_local_experts);
  EXPECT_EQ(a.num_experts_per_tok, b.num_experts_per_tok);
  EXPECT_EQ(a.n_shared_experts, b.n_shared_experts);
  EXPECT_EQ(a.max_position_embeddings, b.max_position_embeddings);
  // Doubles are copied from the same JSON literals in both forms: exact equality is right.
  EXPECT_EQ(a.rms_norm_eps, b.rms_norm_eps);
  EXPECT_EQ(a.rope_theta, b.rope_theta);
  EXPECT_EQ(a.rotary_dim, b.rotary_dim);
  EXPECT_EQ(a.swiglu_alpha, b.swiglu_alpha);
  EXPECT_EQ(a.swiglu_limit, b.swiglu_limit);
  EXPECT_EQ(a.swiglu_beta, b.swiglu_beta);
  EXPECT_EQ(a.routed_scaling_factor, b.routed_scaling_factor);
  EXPECT_EQ(a.use_routing_bias, b.use_routing_bias);
  EXPECT_EQ(a.tie_word_embeddings, b.tie_word_embeddings);
  EXPECT_EQ(a.index_n_heads, b.index_n_heads);
  EXPECT_EQ(a.index_head_dim, b.index_head_dim);
  EXPECT_EQ(a.sparse_block_size, b.sparse_block_size);
  EXPECT_EQ(a.sparse_topk_blocks, b.sparse_topk_blocks);
  EXPECT_EQ(a.sparse_init_blocks, b.sparse_init_blocks);
  EXPECT_EQ(a.sparse_local_blocks, b.sparse_local_blocks);
  EXPECT_EQ(a.layer_is_sparse, b.layer_is_sparse);
  EXPECT_EQ(a.layer_is_moe, b.layer_is_moe);
  EXPECT_EQ(a.bos_token_id, b.bos_token_id);
  EXPECT_EQ(a.eos_token_ids, b.eos_token_ids);
  EXPECT_EQ(a.has_vision_config, b.has_vision_config);
}

std::vector<bool> m3_layer_flags() {
  std::vector<bool> v(60, true);
  v[0] = v[1] = v[2] = false;
  return v;
}

// The real MiniMax-M3 values (m3-model.md §1).
void expect_real_m3(const M3Config& c) {
  EXPECT_EQ(c.model_type, "minimax_m3_vl");
  EXPECT_EQ(c.vocab_size, 200064);
  EXPECT_EQ(c.hidden_size, 6144);
  EXPECT_EQ(c.num_hidden_layers, 60);
  EXPECT_EQ(c.num_attention_heads, 64);
  EXPECT_EQ(c.num_key_value_heads, 4);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.q_size(), 8192);
  EXPECT_EQ(c.kv_size(), 512);
  EXPECT_EQ(c.intermediate_size, 3072);
  EXPECT_EQ(c.dense_intermediate_size, 12288);
  EXPECT_EQ(c.shared_intermediate_size, 3072);
  EXPECT_EQ(c.num_local_experts, 128);
  EXPECT_EQ(c.num_experts_per_tok, 4);
  EXPECT_EQ(c.n_shared_experts, 1);
  EXPECT_EQ(c.max_position_embeddings, 1048576);
  EXPECT_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_EQ(c.rope_theta, 5000000.0);
  EXPECT_EQ(c.rotary_dim, 64);
  EXPECT_EQ(c.swiglu_alpha, 1.702);
  EXPECT_EQ(c.swiglu_limit, 7.0);
  EXPECT_EQ(c.swiglu_beta, 1.0);
  EXPECT_EQ(c.routed_scaling_factor, 2.0);
  EXPECT_TRUE(c.use_routing_bias);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.index_n_heads, 4);
  EXPECT_EQ(c.index_head_dim, 128);
  EXPECT_EQ(c.sparse_block_size, 128);
  EXPECT_EQ(c.sparse_topk_blocks, 16);
  EXPECT_EQ(c.sparse_init_blocks, 0);
  EXPECT_EQ(c.sparse_local_blocks, 1);
  EXPECT_EQ(c.layer_is_sparse, m3_layer_flags());
  EXPECT_EQ(c.layer_is_moe, m3_layer_flags());
  EXPECT_EQ(c.num_sparse_layers(), 57);
  EXPECT_TRUE(c.any_sparse());
  EXPECT_EQ(c.bos_token_id, 200034);
  EXPECT_EQ(c.eos_token_ids, std::vector<int64_t>{200020});
  EXPECT_TRUE(c.has_vision_config);
}

json tiny_shipped() {
  return json::parse(read_file(fixture_path("config_tiny_shipped.json")));
}
json tiny_flat() {
  return json::parse(read_file(fixture_path("config_tiny_flat.json")));
}

// ---------------------------------------------------------------------------------------------
// Both forms of the real model.

TEST(Config, ShippedFormIsRealM3) {
  expect_real_m3(parse_fixture("config_shipped.json"));
}

TEST(Config, TransformersFlatFormIsRealM3) {
  expect_real_m3(parse_fixture("config_flat.json"));
  expect_real_m3(parse_fixture("config_flat_full.json"));
}

TEST(Config, ShippedAndFlatFormsAreEqual) {
  const M3Config shipped = parse_fixture("config_shipped.json");
  expect_same(shipped, parse_fixture("config_flat.json"));
  expect_same(shipped, parse_fixture("config_flat_full.json"));
}

TEST(Config, TinyFormsAreEqualAndRight) {
  const M3Config s = parse_fixture("config_tiny_shipped.json");
  const M3Config f = parse_fixture("config_tiny_flat.json");
  expect_same(s, f);
  EXPECT_EQ(s.hidden_size, 64);
  EXPECT_EQ(s.num_hidden_layers, 4);
  EXPECT_EQ(s.num_attention_heads, 4);
  EXPECT_EQ(s.num_key_value_heads, 2);
  EXPECT_EQ(s.head_dim, 16);
  EXPECT_EQ(s.rotary_dim, 8);
  EXPECT_EQ(s.rope_theta, 10000.0);
  EXPECT_EQ(s.rms_norm_eps, 1e-5);
  EXPECT_EQ(s.vocab_size, 300);
  EXPECT_EQ(s.intermediate_size, 32);
  EXPECT_EQ(s.dense_intermediate_size, 96);
  EXPECT_EQ(s.shared_intermediate_size, 32);
  EXPECT_EQ(s.num_local_experts, 8);
  EXPECT_EQ(s.num_experts_per_tok, 2);
  EXPECT_EQ(s.routed_scaling_factor, 1.5);
  EXPECT_EQ(s.index_n_heads, 2);
  EXPECT_EQ(s.index_head_dim, 16);
  EXPECT_EQ(s.sparse_block_size, 16);
  EXPECT_EQ(s.sparse_topk_blocks, 4);
  EXPECT_EQ(s.layer_is_sparse, (std::vector<bool>{false, true, true, true}));
  EXPECT_EQ(s.layer_is_moe, (std::vector<bool>{false, false, true, true}));
  EXPECT_EQ(s.num_sparse_layers(), 3);
  EXPECT_EQ(s.bos_token_id, 1);
  EXPECT_EQ(s.eos_token_ids, (std::vector<int64_t>{2, 3}));
  EXPECT_TRUE(s.has_vision_config);
}

TEST(Config, HasVisionConfigFollowsTheFile) {
  json j = tiny_shipped();
  j.erase("vision_config");
  EXPECT_FALSE(parse_ok(j.dump()).has_vision_config);
  j["vision_config"] = nullptr;
  EXPECT_FALSE(parse_ok(j.dump()).has_vision_config);
}

TEST(Config, TextOnlyModelTypes) {
  // The text_config of the tiny model, promoted to the top level, under each text-only type.
  for (const char* type : {"minimax_m3_vl_text", "minimax_m3", "minimax_m3_text"}) {
    json t = tiny_shipped()["text_config"];
    t["model_type"] = type;
    M3Config c = parse_ok(t.dump());
    EXPECT_EQ(c.model_type, type);
    EXPECT_FALSE(c.has_vision_config);
    M3Config ref = parse_fixture("config_tiny_shipped.json");
    ref.model_type = type;
    ref.has_vision_config = false;
    expect_same(ref, c);
  }
}

TEST(Config, Summary) {
  const M3Config c = parse_fixture("config_shipped.json");
  const std::string s = c.summary();
  EXPECT_EQ(s.find('\n'), std::string::npos);
  for (const char* part :
       {"60 layers", "57 MSA", "3 full", "57 MoE", "3 dense", "hidden 6144", "64q/4kv x 128",
        "rotary 64", "128 top-4", "1 shared", "block 128", "top-16", "vocab 200064"}) {
    EXPECT_NE(s.find(part), std::string::npos) << "summary lacks \"" << part << "\": " << s;
  }
}

// ---------------------------------------------------------------------------------------------
// Defaults and derived values.

TEST(Config, DefaultsWhenKeysAbsent) {
  json j = tiny_shipped();
  json& t = j["text_config"];
  t.erase("head_dim");          // -> hidden / heads = 64 / 4
  t.erase("bos_token_id");      // -> 200034
  t.erase("eos_token_id");      // -> [200020]
  t.erase("use_routing_bias");  // -> true
  t.erase("n_shared_experts");  // -> 1
  t.erase("scoring_func");
  t.erase("max_position_embeddings");  // -> transformers default 524288
  t["sparse_attention_config"].erase("sparse_init_block");
  t["sparse_attention_config"].erase("sparse_disable_index_value");
  M3Config c = parse_ok(j.dump());
  EXPECT_EQ(c.head_dim, 16);
  EXPECT_EQ(c.bos_token_id, 200034);
  EXPECT_EQ(c.eos_token_ids, std::vector<int64_t>{200020});
  EXPECT_TRUE(c.use_routing_bias);
  EXPECT_EQ(c.n_shared_experts, 1);
  EXPECT_EQ(c.max_position_embeddings, 524288);
  EXPECT_EQ(c.sparse_init_blocks, 0);
  EXPECT_EQ(c.swiglu_beta, 1.0);  // absent in the fixture too: the "+1" on up
}

TEST(Config, SwigluBetaAndRoutingBiasRead) {
  json j = tiny_shipped();
  j["text_config"]["swiglu_beta"] = 0.5;
  j["text_config"]["use_routing_bias"] = false;
  M3Config c = parse_ok(j.dump());
  EXPECT_EQ(c.swiglu_beta, 0.5);
  EXPECT_FALSE(c.use_routing_bias);
}

TEST(Config, EosIntOrList) {
  json j = tiny_shipped();
  j["text_config"]["eos_token_id"] = 7;
  EXPECT_EQ(parse_ok(j.dump()).eos_token_ids, std::vector<int64_t>{7});
  j["text_config"]["eos_token_id"] = {7, 9, 11};
  EXPECT_EQ(parse_ok(j.dump()).eos_token_ids, (std::vector<int64_t>{7, 9, 11}));
  j["text_config"].erase("eos_token_id");
  j["eos_token_id"] = 5;  // the VL top level is consulted when text_config has none
  EXPECT_EQ(parse_ok(j.dump()).eos_token_ids, std::vector<int64_t>{5});
  j["text_config"]["eos_token_id"] = "</s>";
  parse_fails(j, {"eos_token_id", "token id"});
  j["text_config"]["eos_token_id"] = json::array();
  parse_fails(j, {"eos_token_id", "empty"});
}

TEST(Config, NoSharedExpertSpellings) {
  json j = tiny_shipped();
  j["text_config"]["shared_intermediate_size"] = 0;
  M3Config a = parse_ok(j.dump());
  EXPECT_EQ(a.n_shared_experts, 0);
  EXPECT_EQ(a.shared_intermediate_size, 0);
  j = tiny_shipped();
  j["text_config"]["n_shared_experts"] = 0;
  M3Config b = parse_ok(j.dump());
  EXPECT_EQ(b.n_shared_experts, 0);
  EXPECT_EQ(b.shared_intermediate_size, 0);
}

TEST(Config, UseSparseAttentionFalseMeansAllFull) {
  json j = tiny_shipped();
  j["text_config"]["sparse_attention_config"]["use_sparse_attention"] = false;
  M3Config c = parse_ok(j.dump());
  EXPECT_EQ(c.num_sparse_layers(), 0);
  EXPECT_FALSE(c.any_sparse());
  EXPECT_EQ(c.layer_is_sparse.size(), 4u);
}

TEST(Config, NoLayerListsFollowTransformersDefaults) {
  // transformers: no layer_types/sparse_attention_freq -> all full attention; no
  // mlp_layer_types/moe_layer_freq -> all MoE.
  json j = tiny_flat();
  j["text_config"].erase("layer_types");
  j["text_config"].erase("mlp_layer_types");
  M3Config c = parse_ok(j.dump());
  EXPECT_EQ(c.layer_is_sparse, std::vector<bool>(4, false));
  EXPECT_EQ(c.layer_is_moe, std::vector<bool>(4, true));
}

TEST(Config, RotaryDimRules) {
  // Flat form: rope_parameters decides (transformers ignores its rotary_dim field).
  json j = tiny_flat();
  j["text_config"]["rope_parameters"]["partial_rotary_factor"] = 1.0;
  EXPECT_EQ(parse_ok(j.dump()).rotary_dim, 16);
  j["text_config"]["rope_parameters"].erase("partial_rotary_factor");
  EXPECT_EQ(parse_ok(j.dump()).rotary_dim, 16) << "transformers' default factor is 1.0";
  j["text_config"]["rope_parameters"]["rope_theta"] = 123.0;
  j["text_config"]["rope_theta"] = 999.0;
  EXPECT_EQ(parse_ok(j.dump()).rope_theta, 123.0);
  // Shipped form: rotary_dim, else partial_rotary_factor * head_dim, else 64.
  j = tiny_shipped();
  j["text_config"]["rotary_dim"] = 12;
  EXPECT_EQ(parse_ok(j.dump()).rotary_dim, 12);
  j["text_config"].erase("rotary_dim");
  j["text_config"]["partial_rotary_factor"] = 0.25;
  EXPECT_EQ(parse_ok(j.dump()).rotary_dim, 4);
  // A null rope_scaling is the shipped "no scaling".
  j["text_config"]["rope_scaling"] = nullptr;
  EXPECT_EQ(parse_ok(j.dump()).rotary_dim, 4);
  j = json::parse(read_file(fixture_path("config_shipped.json")));
  j["text_config"].erase("rotary_dim");
  j["text_config"].erase("partial_rotary_factor");
  EXPECT_EQ(parse_ok(j.dump()).rotary_dim, 64);
}

TEST(Config, BothFormsAgreeingIsAccepted) {
  json j = tiny_shipped();
  j["text_config"]["index_topk_blocks"] = 4;
  j["text_config"]["layer_types"] = {"full_attention", "minimax_m3_sparse", "minimax_m3_sparse",
                                     "minimax_m3_sparse"};
  j["text_config"]["mlp_layer_types"] = {"dense", "dense", "sparse", "sparse"};
  expect_same(parse_fixture("config_tiny_shipped.json"), parse_ok(j.dump()));
}

// ---------------------------------------------------------------------------------------------
// Refusals.

TEST(ConfigRefuses, UnknownModelType) {
  json j = tiny_shipped();
  j["model_type"] = "llama";
  Error e = parse_fails(j, {"\"llama\"", "minimax_m3_vl", "minimax_m3_vl_text"});
  EXPECT_EQ(e.code, ErrorCode::kUnsupported);
  EXPECT_EQ(e.param, "model_type");
  j.erase("model_type");
  parse_fails(j, {"model_type is missing"});
}

TEST(ConfigRefuses, VlWithoutTextConfig) {
  json j = tiny_shipped();
  j.erase("text_config");
  parse_fails(j, {"text_config"});
  parse_fails(json::array({1, 2}), {"JSON object"});
}

TEST(ConfigRefuses, IndexHeadsNotKvHeads) {
  json j = tiny_shipped();
  j["text_config"]["sparse_attention_config"]["sparse_num_index_heads"] = 4;
  parse_fails(j, {"index_n_heads", "= 4", "num_key_value_heads = 2"});
  j = tiny_flat();
  j["text_config"]["index_n_heads"] = 1;
  parse_fails(j, {"index_n_heads", "= 1", "num_key_value_heads = 2"});
}

TEST(ConfigRefuses, HeadsNotMultipleOfKvHeads) {
  json j = tiny_shipped();
  j["text_config"]["num_attention_heads"] = 5;
  parse_fails(j, {"num_attention_heads = 5", "not a multiple", "num_key_value_heads = 2"});
}

TEST(ConfigRefuses, BadRotaryDim) {
  json j = tiny_shipped();
  j["text_config"]["rotary_dim"] = 7;
  parse_fails(j, {"rotary_dim 7", "even"});
  j["text_config"]["rotary_dim"] = 18;
  parse_fails(j, {"rotary_dim 18", "head_dim 16"});
  j = tiny_flat();
  j["text_config"]["rope_parameters"]["partial_rotary_factor"] = 1.5;
  parse_fails(j, {"partial_rotary_factor", "(0, 1]"});
  j = tiny_flat();
  j["text_config"]["rope_parameters"]["partial_rotary_factor"] = 0.3125;  // 16 * 0.3125 = 5
  parse_fails(j, {"rotary_dim 5", "even"});
}

TEST(ConfigRefuses, RotaryWiderThanIndexHeads) {
  json j = tiny_shipped();
  j["text_config"]["head_dim"] = 32;
  j["text_config"]["rotary_dim"] = 32;
  parse_fails(j, {"rotary_dim 32", "index_head_dim 16"});
}

TEST(Config, YarnRopeScaling) {
  // The recipe's 1M override on the shipped form: YaRN over the base RoPE's rotated dims.
  json j = tiny_shipped();
  const M3Config base = parse_ok(j.dump());
  j["text_config"]["rope_scaling"] = {
      {"rope_type", "yarn"}, {"factor", 2.0}, {"original_max_position_embeddings", 524288}};
  M3Config c = parse_ok(j.dump());
  EXPECT_EQ(c.rotary_dim, base.rotary_dim);
  EXPECT_EQ(c.rope_theta, base.rope_theta);
  EXPECT_TRUE(c.rope_scaling.active());
  EXPECT_EQ(c.rope_scaling.factor, 2.f);
  EXPECT_EQ(c.rope_scaling.original_max_position, 524288.0);
  EXPECT_EQ(c.rope_scaling.beta_fast, 32.f);
  EXPECT_EQ(c.rope_scaling.beta_slow, 1.f);
  EXPECT_FLOAT_EQ(c.rope_scaling.attention_factor, static_cast<float>(0.1 * std::log(2.0) + 1.0));
  EXPECT_EQ(c.max_position_embeddings, 1048576) << "original x factor, as vLLM derives it";
  // transformers' keys in rope_parameters (flat form), with explicit factors.
  j = tiny_flat();
  j["text_config"]["rope_parameters"]["rope_type"] = "yarn";
  j["text_config"]["rope_parameters"]["factor"] = 4.0;
  j["text_config"]["rope_parameters"]["attention_factor"] = 1.25;
  j["text_config"]["rope_parameters"]["beta_fast"] = 16.0;
  c = parse_ok(j.dump());
  EXPECT_EQ(c.rope_scaling.attention_factor, 1.25f);
  EXPECT_EQ(c.rope_scaling.beta_fast, 16.f);
  EXPECT_EQ(c.rope_scaling.original_max_position, c.max_position_embeddings / 4.0);
  // No scaling: inactive.
  EXPECT_FALSE(base.rope_scaling.active());
}

TEST(ConfigRefuses, RopeScaling) {
  json j = tiny_shipped();
  j["text_config"]["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 1.0}};
  parse_fails(j, {"rope_scaling", "factor", "above 1"});
  j["text_config"]["rope_scaling"] = {{"rope_type", "dynamic"}, {"factor", 2.0}};
  Error e = parse_fails(j, {"rope_scaling", "\"dynamic\"", "\"yarn\""});
  EXPECT_EQ(e.code, ErrorCode::kUnsupported);
  j = tiny_flat();
  j["text_config"]["rope_parameters"]["rope_type"] = "linear";
  parse_fails(j, {"rope_parameters", "\"linear\""});
  j = tiny_flat();
  j["text_config"]["rope_parameters"] = {{"full_attention", {{"rope_theta", 1.0}}},
                                         {"minimax_m3_sparse", {{"rope_theta", 1.0}}}};
  parse_fails(j, {"per layer type"});
}

TEST(ConfigRefuses, TopKOverExperts) {
  json j = tiny_shipped();
  j["text_config"]["num_experts_per_tok"] = 9;
  parse_fails(j, {"num_experts_per_tok = 9", "num_local_experts = 8"});
}

TEST(ConfigRefuses, LayerListLengths) {
  json j = tiny_shipped();
  j["text_config"]["moe_layer_freq"] = {0, 1, 1};
  parse_fails(j, {"moe_layer_freq", "3 entries", "num_hidden_layers is 4"});
  j = tiny_shipped();
  j["text_config"]["sparse_attention_config"]["sparse_attention_freq"] = {0, 1, 1, 1, 1};
  parse_fails(j, {"sparse_attention_freq", "5 entries"});
  j = tiny_flat();
  j["text_config"]["layer_types"].erase(0);
  parse_fails(j, {"layer_types", "3 entries"});
  j = tiny_flat();
  j["text_config"]["mlp_layer_types"].push_back("dense");
  parse_fails(j, {"mlp_layer_types", "5 entries"});
  j = tiny_shipped();
  j["text_config"]["sparse_attention_config"]["sparse_disable_index_value"] = {1, 1};
  parse_fails(j, {"sparse_disable_index_value", "2 entries"});
}

TEST(ConfigRefuses, BadLayerEntries) {
  json j = tiny_flat();
  j["text_config"]["mlp_layer_types"][2] = "moe";
  parse_fails(j, {"mlp_layer_types[2]", "\"moe\"", "\"sparse\"", "\"dense\""});
  j = tiny_flat();
  j["text_config"]["layer_types"][0] = "sliding_attention";
  parse_fails(j, {"layer_types[0]", "sliding_attention"});
  j = tiny_shipped();
  j["text_config"]["moe_layer_freq"][1] = 2;
  parse_fails(j, {"moe_layer_freq[1]", "0 or 1"});
  j["text_config"]["moe_layer_freq"] = 1;
  parse_fails(j, {"moe_layer_freq", "a list"});
}

TEST(ConfigRefuses, NonPositiveSizes) {
  for (const char* key :
       {"hidden_size", "vocab_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "intermediate_size", "dense_intermediate_size",
        "num_local_experts", "num_experts_per_tok", "max_position_embeddings"}) {
    json j = tiny_shipped();
    j["text_config"][key] = 0;
    parse_fails(j, {key, "must be positive"});
  }
  json j = tiny_shipped();
  j["text_config"]["sparse_attention_config"]["sparse_block_size"] = 0;
  parse_fails(j, {"sparse_block_size", "positive"});
  j = tiny_shipped();
  j["text_config"]["rms_norm_eps"] = -1e-6;
  parse_fails(j, {"rms_norm_eps", "positive"});
  j = tiny_shipped();
  j["text_config"]["shared_intermediate_size"] = -1;
  parse_fails(j, {"shared_intermediate_size", ">= 0"});
}

TEST(ConfigRefuses, WrongJsonTypes) {
  json j = tiny_shipped();
  j["text_config"]["hidden_size"] = "64";
  Error e = parse_fails(j, {"text_config.hidden_size", "must be an integer", "a string"});
  EXPECT_EQ(e.param, "text_config.hidden_size");
  j = tiny_shipped();
  j["text_config"]["rope_theta"] = "1e4";
  parse_fails(j, {"rope_theta", "a number"});
  j = tiny_shipped();
  j["text_config"]["sparse_attention_config"] = 3;
  parse_fails(j, {"sparse_attention_config", "an object"});
}

TEST(ConfigRefuses, ScoringFunc) {
  json j = tiny_shipped();
  j["text_config"]["scoring_func"] = "softmax";
  Error e = parse_fails(j, {"scoring_func", "\"softmax\"", "sigmoid"});
  EXPECT_EQ(e.code, ErrorCode::kUnsupported);
}

TEST(ConfigRefuses, IndexValueBranch) {
  json j = tiny_shipped();
  j["text_config"]["sparse_attention_config"]["sparse_disable_index_value"] = {0, 1, 0, 1};
  Error e = parse_fails(j, {"sparse_disable_index_value[2]", "sparse layer 2", "not supported"});
  EXPECT_EQ(e.code, ErrorCode::kUnsupported);
}

TEST(ConfigRefuses, SharedExpertsOverOne) {
  json j = tiny_shipped();
  j["text_config"]["n_shared_experts"] = 2;
  parse_fails(j, {"n_shared_experts = 2", "0 or 1"});
}

TEST(ConfigRefuses, OtherActivationsAndAttentionOptions) {
  json j = tiny_shipped();
  j["text_config"]["hidden_act"] = "gelu";
  parse_fails(j, {"hidden_act", "\"gelu\"", "swigluoai"});
  j = tiny_shipped();
  j["text_config"]["use_qk_norm"] = false;
  parse_fails(j, {"use_qk_norm"});
  j = tiny_shipped();
  j["text_config"]["qk_norm_type"] = "per_layer";
  parse_fails(j, {"qk_norm_type", "per_head"});
  j = tiny_shipped();
  j["text_config"]["attention_output_gate"] = true;
  parse_fails(j, {"attention_output_gate"});
  j = tiny_shipped();
  j["text_config"]["sparse_attention_config"]["sparse_score_type"] = "mean";
  parse_fails(j, {"sparse_score_type", "\"mean\"", "max"});
}

TEST(ConfigRefuses, BlockSelectionGeometry) {
  json j = tiny_shipped();
  j["text_config"]["sparse_attention_config"]["sparse_local_block"] = 0;
  parse_fails(j, {"sparse_local_block", "= 0", ">= 1"});
  j = tiny_shipped();
  j["text_config"]["sparse_attention_config"]["sparse_init_block"] = 4;
  parse_fails(j, {"sparse_init_block + sparse_local_block = 5", "sparse_topk_blocks = 4"});
}

TEST(ConfigRefuses, FormsDisagree) {
  json j = tiny_shipped();
  j["text_config"]["index_topk_blocks"] = 8;
  parse_fails(j, {"index_topk_blocks = 8", "sparse_topk_blocks = 4", "disagrees"});
  j = tiny_shipped();
  j["text_config"]["index_block_size"] = 64;
  parse_fails(j, {"index_block_size = 64", "sparse_block_size = 16"});
  j = tiny_shipped();
  j["text_config"]["layer_types"] = {"full_attention", "full_attention", "minimax_m3_sparse",
                                     "minimax_m3_sparse"};
  parse_fails(j, {"layer_types", "sparse_attention_freq", "[0,0,1,1]", "[0,1,1,1]"});
  j = tiny_shipped();
  j["text_config"]["mlp_layer_types"] = {"sparse", "sparse", "sparse", "sparse"};
  parse_fails(j, {"mlp_layer_types", "moe_layer_freq", "disagrees"});
}

TEST(ConfigRefuses, MalformedJsonNamesLineAndColumn) {
  const std::string text = "{\n  \"model_type\": \"minimax_m3_vl\",\n  \"text_config\": {,}\n}";
  Result<M3Config> r = parse_config(text, "/models/x/config.json");
  ASSERT_FALSE(r.has_value());
  EXPECT_EQ(r.error().code, ErrorCode::kFormat);
  EXPECT_NE(r.error().message.find("/models/x/config.json"), std::string::npos)
      << r.error().message;
  EXPECT_NE(r.error().message.find("line 3"), std::string::npos) << r.error().message;
  EXPECT_NE(r.error().message.find("column"), std::string::npos) << r.error().message;
  EXPECT_FALSE(parse_config("", "config.json").has_value());
}

// ---------------------------------------------------------------------------------------------
// load_config and check_kv_block_size.

class ConfigDir : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/m3_config_test_XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string dir_;
};

TEST_F(ConfigDir, LoadsFromDirectory) {
  std::filesystem::copy_file(fixture_path("config_shipped.json"), dir_ + "/config.json");
  Result<M3Config> r = load_config(dir_);
  ASSERT_TRUE(r.has_value()) << r.error().message;
  expect_real_m3(*r);
}

TEST_F(ConfigDir, MissingFile) {
  Result<M3Config> r = load_config(dir_);
  ASSERT_FALSE(r.has_value());
  EXPECT_EQ(r.error().code, ErrorCode::kNotFound);
  EXPECT_NE(r.error().message.find(dir_ + "/config.json"), std::string::npos) << r.error().message;
}

TEST_F(ConfigDir, ErrorsNameTheFile) {
  std::ofstream(dir_ + "/config.json") << "{\"model_type\": \"gpt2\"}";
  Result<M3Config> r = load_config(dir_);
  ASSERT_FALSE(r.has_value());
  EXPECT_NE(r.error().message.find(dir_ + "/config.json"), std::string::npos) << r.error().message;
}

TEST(KvBlockSize, MustBeTheMsaBlock) {
  const M3Config m3 = parse_fixture("config_shipped.json");
  EXPECT_TRUE(check_kv_block_size(m3, 128).has_value());
  Status s = check_kv_block_size(m3, 16);
  ASSERT_FALSE(s.has_value());
  EXPECT_EQ(s.error().param, "--block-size");
  EXPECT_NE(s.error().message.find("--block-size 16"), std::string::npos) << s.error().message;
  EXPECT_NE(s.error().message.find("use --block-size 128"), std::string::npos) << s.error().message;

  const M3Config tiny = parse_fixture("config_tiny_shipped.json");
  EXPECT_TRUE(check_kv_block_size(tiny, 16).has_value());
  s = check_kv_block_size(tiny, 128);
  ASSERT_FALSE(s.has_value());
  EXPECT_NE(s.error().message.find("use --block-size 16"), std::string::npos) << s.error().message;
}

TEST(KvBlockSize, AlsoWithoutSparseLayers) {
  json j = tiny_shipped();
  j["text_config"]["sparse_attention_config"]["use_sparse_attention"] = false;
  const M3Config c = parse_ok(j.dump());
  ASSERT_FALSE(c.any_sparse());
  EXPECT_TRUE(check_kv_block_size(c, 16).has_value());
  Status s = check_kv_block_size(c, 32);
  ASSERT_FALSE(s.has_value());
  EXPECT_NE(s.error().message.find("use --block-size 16"), std::string::npos) << s.error().message;
}

}  // namespace
}  // namespace m3::model

namespace m3::model {
namespace {

// The vision keys (m3-model.md §1.4): the shipped config (clip_vision_model, merge geometry in
// img_token_compression_config) runs the reference RoPE layout; a config transformers wrote
// (minimax_m3_vl_vision, rope_parameters) runs transformers' layout.
TEST(Config, VisionConfigBothForms) {
  const M3Config s = parse_fixture("config_shipped.json");
  ASSERT_TRUE(s.vision.present);
  EXPECT_EQ(s.vision.hidden_size, 1280);
  EXPECT_EQ(s.vision.num_hidden_layers, 32);
  EXPECT_EQ(s.vision.num_attention_heads, 16);
  EXPECT_EQ(s.vision.head_dim(), 80);
  EXPECT_EQ(s.vision.intermediate_size, 5120);
  EXPECT_EQ(s.vision.spatial_merge_size, 2);
  EXPECT_EQ(s.vision.temporal_patch_size, 2);
  EXPECT_EQ(s.vision.patch_row_size(), 1176);
  EXPECT_EQ(s.vision.image_token_index, 200025);
  EXPECT_EQ(s.vision.projector_hidden_size, 6144);
  EXPECT_EQ(s.vision.rope_layout, VisionRopeLayout::kReference);

  const M3Config h =
      parse_ok(read_file(std::string(M3_SOURCE_DIR) + "/tests/golden/vision/model/config.json"));
  ASSERT_TRUE(h.vision.present);
  EXPECT_EQ(h.vision.rope_layout, VisionRopeLayout::kTransformers);
  EXPECT_EQ(h.vision.hidden_size, 32);
  EXPECT_EQ(h.vision.num_hidden_layers, 2);
  EXPECT_EQ(h.vision.projector_hidden_size, 48);
  EXPECT_EQ(h.vision.image_token_index, 2641);
  EXPECT_EQ(h.vision.rope_theta, 10000.0);
}

TEST(Config, VisionConfigRefusesWhatTheTowerCannotRun) {
  json j = json::parse(read_file(fixture_path("config_shipped.json")));
  j["vision_config"]["hidden_act"] = "quick_gelu";
  auto r = parse_config(j.dump());
  ASSERT_FALSE(r.has_value());
  EXPECT_NE(r.error().message.find("vision_config.hidden_act"), std::string::npos);
  j = json::parse(read_file(fixture_path("config_shipped.json")));
  j["vision_config"]["num_attention_heads"] = 7;
  EXPECT_FALSE(parse_config(j.dump()).has_value());
}

}  // namespace
}  // namespace m3::model
