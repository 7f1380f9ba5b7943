// Quantized checkpoints on the CPU (issue #18; docs/QUANTIZATION.md). Fixtures are made at test
// time by tools/quant/quantize_checkpoint.py from the golden checkpoints (tests/golden/model/*),
// into the build directory: for each format the quantized checkpoint (real tensor names, dtypes,
// scale shapes, quantization_config) and its exact dequantisation as an f32 checkpoint, computed
// in numpy by the formats' definitions.
//
// Goldens and their tolerances:
//  - Quantized forward == the f32 dequantised checkpoint's forward, bit for bit. The CPU linear
//    dequantises a row exactly (the same float32 products numpy computes) and then runs the very
//    dot products the f32 checkpoint runs, in the same order, so any difference is a loader or
//    dequantisation bug (a wrong nibble order, block index or scale moves logits by >= 1e-3).
//  - Drift against transformers' fp32 logprobs of the bf16 checkpoint (golden.json): the format's
//    own rounding error, measured here (mean and max over every prompt token) and bounded per
//    format by drift_bound (below; docs/QUANTIZATION.md lists the numbers).
//  - Tensor parallel (2 ranks) and expert parallel of a quantized model == the unsharded model to
//    kShardTol = 1e-3 (the sharded test's bound: the all-reduce changes summation order only;
//    column slices of a quantized matrix keep its values, off block boundaries exactly in f32).
// Also the loader's refusals: a scale tensor of the wrong shape or dtype (the tensor's name and
// both shapes), a missing NVFP4 global scale, packed codes of the wrong shape, tensors that do not
// fit the declared method, and --quantization against quantization_config.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "model/golden_util.h"
#include "model/m3_model.h"
#include "model/quantization.h"
#include "model/tensor_table.h"
#include "runtime/forward_backend.h"
#include "runtime/sequence_runner.h"

namespace m3::model {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using namespace m3::runtime;
using kernels::WeightQuant;

constexpr double kShardTol = 1e-3;

// The formats of the script (and --quantization fp8_per_channel, made by m3serve at load from
// the bf16 checkpoint: its reference is the script's "fp8-channel" dequantisation).
const std::vector<std::string> kFormats = {"mxfp8",    "nvfp4",    "mxfp4",
                                           "mxfp4-ct", "nvfp4-ct", "fp8-channel"};
const std::vector<std::string> kModels = {"msa_small_blocks", "m3_ratio"};

// Mean |logprob - transformers fp32 logprob| of the bf16 model over every prompt token allowed
// per format. These tiny random models are very sensitive (transformers' own bf16 moves single
// logprobs by up to 2.7-5.8 on them: docs/PERFORMANCE.md); measured means: 8-bit 0.43-0.67,
// 4-bit experts 0.43-0.98, every linear NVFP4 1.18-1.69 (docs/QUANTIZATION.md). The bounds are
// ~1.5x the largest measured; a misread format (scale off by 2^k, nibbles swapped, a block index
// shifted) gives means of several units.
double drift_bound(const std::string& fmt) {
  if (fmt == "mxfp8" || fmt == "fp8-channel") return 1.0;
  if (fmt == "nvfp4-ct") return 2.5;  // every linear 4-bit: measured 1.18-1.69
  return 1.5;  // 4-bit experts (nvfp4 and mxfp4-ct with MXFP8 elsewhere, mxfp4 with bf16)
}

std::string fixture_root() {
  static const std::string root = [] {
    char tmpl[] = M3_BINARY_DIR "/quant_fixtures_XXXXXX";
    M3_CHECK(mkdtemp(tmpl) != nullptr, "mkdtemp under %s", M3_BINARY_DIR);
    return std::string(tmpl);
  }();
  return root;
}

// The fixture dir of (model, format) and of its dequantised reference, made once per process.
std::string fixture(const std::string& model, const std::string& fmt, bool dequantised) {
  static std::map<std::string, bool> made;
  const std::string dir = fixture_root() + "/" + model + "/" + fmt;
  if (!made[dir]) {
    const std::string cmd = "python3 " M3_SOURCE_DIR "/tools/quant/quantize_checkpoint.py " +
                            golden::root() + "/" + model + " " + dir + " --format " + fmt +
                            " --dequant-out " + dir + "-deq > /dev/null";
    const int rc = std::system(cmd.c_str());
    EXPECT_EQ(rc, 0) << cmd << " failed (needs python3 and numpy)";
    made[dir] = true;
  }
  return dequantised ? dir + "-deq" : dir;
}

std::unique_ptr<M3Model> load(const std::string& dir, const std::string& quantization = "") {
  LoadOptions o;
  o.quantization = quantization;
  auto m = M3Model::load(dir, o);
  EXPECT_TRUE(m.has_value()) << dir << ": " << (m ? "" : m.error().message);
  return m ? std::move(*m) : nullptr;
}

// The quantized model of (model, format): fp8-channel is the bf16 golden under
// --quantization fp8_per_channel.
std::unique_ptr<M3Model> quantized(const std::string& model, const std::string& fmt) {
  if (fmt == "fp8-channel") {
    fixture(model, fmt, true);  // make the reference too
    return load(golden::root() + "/" + model, "fp8_per_channel");
  }
  return load(fixture(model, fmt, false));
}

std::vector<float> prompt_logits(const M3Model& m, const std::vector<int32_t>& ids) {
  SequenceRunner r(m, static_cast<int64_t>(ids.size()) + 1, 1);
  const int s = r.add_sequence();
  return r.step({{s, ids, true}}).logits;
}

struct Case {
  std::string model, fmt;
};
void PrintTo(const Case& c, std::ostream* os) {
  *os << c.model << "_" << c.fmt;
}
std::vector<Case> all_cases() {
  std::vector<Case> r;
  for (const auto& m : kModels)
    for (const auto& f : kFormats) r.push_back({m, f});
  return r;
}
std::string case_name(const ::testing::TestParamInfo<Case>& i) {
  std::string n = i.param.model + "_" + i.param.fmt;
  for (char& c : n)
    if (c == '-') c = '_';
  return n;
}

class QuantGolden : public ::testing::TestWithParam<Case> {};

TEST_P(QuantGolden, ForwardEqualsTheExactDequantisationAndDriftIsBounded) {
  const Case& c = GetParam();
  auto q = quantized(c.model, c.fmt);
  auto d = load(fixture(c.model, c.fmt, true));
  ASSERT_TRUE(q && d);
  // Every linear the format quantizes is held quantized (nothing dequantised at load).
  size_t nq = 0;
  for (size_t k = 1; k < 5; ++k) nq += q->weights().num_quantized[k];
  EXPECT_GT(nq, 0u);
  EXPECT_EQ(q->weights().owned_u16.size(), 0u);
  const json g = golden::read_json(golden::root() + "/" + c.model + "/golden.json");
  const int64_t V = q->config().vocab_size;
  double max_drift = 0, sum_drift = 0;
  int64_t n_drift = 0;
  for (const auto& gc : g["cases"]) {
    const auto ids = gc["prompt_ids"].get<std::vector<int32_t>>();
    const auto lq = prompt_logits(*q, ids);
    const auto ld = prompt_logits(*d, ids);
    ASSERT_EQ(lq.size(), ld.size());
    size_t differ = 0;
    for (size_t i = 0; i < lq.size(); ++i) differ += lq[i] != ld[i];
    EXPECT_EQ(differ, 0u) << gc["name"] << ": logits differ from the dequantised checkpoint's";
    const auto lp = golden::log_softmax_rows(lq, V);
    for (size_t i = 1; i < ids.size(); ++i) {
      const double want = gc["prompt_logprobs"][i]["logprob"].get<double>();
      const double dr = std::fabs(lp[(i - 1) * V + ids[i]] - want);
      max_drift = std::max(max_drift, dr);
      sum_drift += dr;
      ++n_drift;
    }
  }
  const double mean_drift = sum_drift / static_cast<double>(std::max<int64_t>(n_drift, 1));
  std::printf("  %s %s: |logprob - transformers fp32 (bf16 weights)| mean %.4f max %.4f\n",
              c.model.c_str(), c.fmt.c_str(), mean_drift, max_drift);
  EXPECT_LE(mean_drift, drift_bound(c.fmt));
  EXPECT_GT(max_drift, 0.0);  // a quantized model that equals bf16 exactly quantized nothing
}

TEST_P(QuantGolden, TensorAndExpertParallelMatchUnsharded) {
  const Case& c = GetParam();
  if (c.model != "msa_small_blocks") GTEST_SKIP() << "one model is enough for the shard slices";
  auto ref = quantized(c.model, c.fmt);
  ASSERT_TRUE(ref);
  const json g = golden::read_json(golden::root() + "/" + c.model + "/golden.json");
  const auto ids = golden::longest_prompt(g);
  const auto want = prompt_logits(*ref, ids);
  for (const bool ep : {false, true}) {
    auto m = quantized(c.model, c.fmt);
    const int64_t bs = m->config().sparse_block_size;
    const int64_t pages = SequencePages::pages_needed(static_cast<int64_t>(ids.size()) + 1, 1, bs);
    auto be = make_cpu_sharded_backend(std::move(m), pages, 2, ep, 1);
    ASSERT_TRUE(be.has_value()) << be.error().message;
    SequencePages sp((*be)->num_pages(), bs);
    const int s = sp.add_sequence();
    ForwardBatch b = sp.build_step({{s, ids, true}});
    ForwardResult r;
    (*be)->forward(b, &r, false);
    ASSERT_EQ(r.logits.size(), want.size());
    double worst = 0;
    for (size_t i = 0; i < want.size(); ++i)
      worst = std::max(worst, static_cast<double>(std::fabs(r.logits[i] - want[i])));
    EXPECT_LE(worst, kShardTol) << (ep ? "TP2 + EP" : "TP2");
  }
}

INSTANTIATE_TEST_SUITE_P(Formats, QuantGolden, ::testing::ValuesIn(all_cases()), case_name);

// ---- the loader's formats and refusals ----

struct RawTensor {
  DType dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
};

// A fixture's tensors and config, rewritten into a scratch dir and loaded.
class QuantLoad : public ::testing::Test {
 protected:
  void open(const std::string& fmt) {
    src_ = fixture("msa_small_blocks", fmt, false);
    auto ck = Checkpoint::open(src_, {});
    ASSERT_TRUE(ck.has_value()) << ck.error().message;
    tensors_.clear();
    for (const std::string& n : ck->names()) {
      const TensorInfo* t = ck->find(n);
      tensors_[n] =
          RawTensor{t->dtype, t->shape, std::vector<uint8_t>(t->data, t->data + t->nbytes)};
    }
    cfg_ = golden::read_json(fs::path(src_) / "config.json");
    dir_ = fixture_root() + "/rewritten_" + fmt;
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    for (const auto& e : fs::directory_iterator(src_))
      if (e.path().extension() != ".safetensors" && e.path().filename() != "config.json")
        fs::copy_file(e.path(), fs::path(dir_) / e.path().filename());
  }
  Result<std::unique_ptr<M3Model>> load_rewritten(const std::string& quantization = "") {
    json header = json::object();
    size_t at = 0;
    for (const auto& [name, t] : tensors_) {
      header[name] = {{"dtype", dtype_name(t.dtype)},
                      {"shape", t.shape},
                      {"data_offsets", {at, at + t.bytes.size()}}};
      at += t.bytes.size();
    }
    const std::string h = header.dump();
    {
      std::ofstream f(dir_ + "/model.safetensors", std::ios::binary);
      const uint64_t n = h.size();
      f.write(reinterpret_cast<const char*>(&n), 8);
      f.write(h.data(), static_cast<std::streamsize>(h.size()));
      for (const auto& [name, t] : tensors_)
        f.write(reinterpret_cast<const char*>(t.bytes.data()),
                static_cast<std::streamsize>(t.bytes.size()));
    }
    std::ofstream(dir_ + "/config.json") << cfg_.dump(2);
    LoadOptions o;
    o.quantization = quantization;
    return M3Model::load(dir_, o);
  }
  void expect_error(const std::string& quantization, const std::vector<std::string>& parts) {
    auto m = load_rewritten(quantization);
    ASSERT_FALSE(m.has_value()) << "loaded";
    for (const auto& p : parts)
      EXPECT_NE(m.error().message.find(p), std::string::npos)
          << "'" << p << "' not in: " << m.error().message;
  }

  std::string src_, dir_;
  json cfg_;
  std::map<std::string, RawTensor> tensors_;
};

const std::string kL2 = "language_model.model.layers.2.";

TEST_F(QuantLoad, EachFormatIsHeldInItsOwnBytes) {
  // Per format: the linears held quantized, and the weight bytes against the bf16 checkpoint.
  auto bf16 = load(golden::root() + "/msa_small_blocks");
  ASSERT_TRUE(bf16);
  const auto table = m3_tensors(bf16->config());
  const size_t bf16_bytes = view_bytes(bf16->weights(), table);
  struct Want {
    std::string fmt;
    size_t mxfp8, nvfp4, mxfp4, fp8c;
  };
  // 113 linears: 20 attention + 6 index + 6 dense + 72 routed + 9 shared.
  for (const Want& w :
       {Want{"mxfp8", 113, 0, 0, 0}, Want{"nvfp4", 41, 72, 0, 0}, Want{"mxfp4", 0, 0, 72, 0},
        Want{"mxfp4-ct", 41, 0, 72, 0}, Want{"nvfp4-ct", 0, 113, 0, 0}}) {
    auto m = load(fixture("msa_small_blocks", w.fmt, false));
    ASSERT_TRUE(m);
    const M3Weights& qw = m->weights();
    EXPECT_EQ(qw.num_quantized[static_cast<size_t>(WeightQuant::kMxfp8)], w.mxfp8) << w.fmt;
    EXPECT_EQ(qw.num_quantized[static_cast<size_t>(WeightQuant::kNvfp4)], w.nvfp4) << w.fmt;
    EXPECT_EQ(qw.num_quantized[static_cast<size_t>(WeightQuant::kMxfp4)], w.mxfp4) << w.fmt;
    EXPECT_LT(view_bytes(qw, table), bf16_bytes) << w.fmt;
    // The router stays f32, the embedding and lm_head bf16, as stored.
    EXPECT_EQ(qw.layers[2].router.dtype, DType::kF32);
    EXPECT_FALSE(qw.embed_tokens.quantized());
    EXPECT_FALSE(qw.lm_head.quantized());
  }
  // Views of a quantized expert: E2M1 codes [rows, cols / 2], scales per block.
  auto nv = load(fixture("msa_small_blocks", "nvfp4", false));
  const MatRef& w2 = nv->weights().layers[2].experts[3].w2;
  EXPECT_EQ(w2.quant, WeightQuant::kNvfp4);
  EXPECT_EQ(w2.row_bytes(), w2.cols / 2);
  EXPECT_EQ(w2.scales_per_row(), w2.cols / 16);
  EXPECT_GT(w2.global_scale, 0.f);
  EXPECT_EQ(nv->weights().layers[2].q_proj.quant, WeightQuant::kMxfp8);

  // fp8_per_channel: every quantizable linear e4m3 + one f32 per row (about half the bytes);
  // embedding, lm_head and router untouched (the same views as the bf16 load).
  auto f8 = load(golden::root() + "/msa_small_blocks", "fp8_per_channel");
  ASSERT_TRUE(f8);
  const M3Weights& fw = f8->weights();
  EXPECT_EQ(fw.num_quantized[static_cast<size_t>(WeightQuant::kFp8Channel)], 113u);
  size_t lin_now = 0;
  for (const TensorSpec& t : table) {
    if (t.vector) continue;
    for (int64_t e = 0; e < t.count_in(fw); ++e) {
      const MatRef& a = t.mat(fw, e);
      const MatRef& b = t.mat(bf16->weights(), e);
      if (!t.quantizable) {
        EXPECT_FALSE(a.quantized()) << t.names[0];
        ASSERT_EQ(a.dtype, b.dtype) << t.names[0];
        EXPECT_EQ(std::memcmp(a.data, b.data, static_cast<size_t>(b.bytes())), 0) << t.names[0];
        continue;
      }
      EXPECT_EQ(a.quant, WeightQuant::kFp8Channel) << t.names[0];
      EXPECT_EQ(a.bytes(), a.rows * a.cols + a.rows * 4) << t.names[0];
      lin_now += static_cast<size_t>(a.bytes());
    }
  }
  EXPECT_LT(static_cast<double>(lin_now), 0.56 * static_cast<double>(fw.online_source_bytes));
}

TEST_F(QuantLoad, PerChannelFp8CheckpointEqualsTheOnlineQuantization) {
  // compressed-tensors' per-channel fp8 form (F8_E4M3 weight + F32 weight_scale [out, 1]), made
  // by the script's rule, holds exactly what --quantization fp8_per_channel makes at load.
  auto stored = load(fixture("msa_small_blocks", "fp8-channel", false));
  auto online = load(golden::root() + "/msa_small_blocks", "fp8_per_channel");
  ASSERT_TRUE(stored && online);
  EXPECT_EQ(stored->weights().num_quantized[static_cast<size_t>(WeightQuant::kFp8Channel)], 113u);
  const MatRef& a = stored->weights().layers[3].experts[2].w1;
  const MatRef& b = online->weights().layers[3].experts[2].w1;
  ASSERT_EQ(a.quant, WeightQuant::kFp8Channel);
  EXPECT_EQ(std::memcmp(a.data, b.data, static_cast<size_t>(a.data_bytes())), 0);
  EXPECT_EQ(std::memcmp(a.scale, b.scale, static_cast<size_t>(a.scale_bytes())), 0);
  const std::vector<int32_t> ids = {5, 17, 300, 2, 9, 44, 1000, 3};
  const auto la = prompt_logits(*stored, ids), lb = prompt_logits(*online, ids);
  ASSERT_EQ(la.size(), lb.size());
  EXPECT_EQ(std::memcmp(la.data(), lb.data(), la.size() * sizeof(float)), 0);
}

TEST_F(QuantLoad, ScalesOfTheWrongShapeOrDtypeNameTheTensorAndBothShapes) {
  open("mxfp8");
  const std::string s = kL2 + "self_attn.o_proj.weight_scale_inv";
  ASSERT_TRUE(tensors_.count(s));
  ASSERT_TRUE(load_rewritten().has_value());
  RawTensor good = tensors_[s];
  // o_proj [64, 256]: 8 scales per row. A 1x128-block scale (DeepSeek style) is refused.
  tensors_[s] = RawTensor{DType::kU8, {64, 2}, std::vector<uint8_t>(128, 127)};
  expect_error("", {s, "has shape [64, 2], expected [64, 8]"});
  tensors_[s] = RawTensor{DType::kF32, {64, 8}, std::vector<uint8_t>(64 * 8 * 4, 0)};
  expect_error("", {s, "has dtype F32 and shape [64, 8], expected U8", "[64, 8]"});
  tensors_.erase(s);
  expect_error("", {kL2 + "self_attn.o_proj.weight", "is mxfp8 but '" + s + "'", "is missing"});
  tensors_[s] = good;
  // The fp8 weights themselves mis-shaped.
  tensors_[kL2 + "self_attn.o_proj.weight"].shape = {256, 64};
  expect_error("", {kL2 + "self_attn.o_proj.weight", "has shape [256, 64], expected [64, 256]"});
}

TEST_F(QuantLoad, Nvfp4AndMxfp4TensorSetsAreChecked) {
  open("nvfp4");
  const std::string e = kL2 + "block_sparse_moe.experts.1.w2.";
  ASSERT_TRUE(load_rewritten().has_value());
  // w2 [64, 32]: codes [64, 16], fp8 scales [64, 2], a global scale.
  RawTensor scale = tensors_[e + "weight_scale"];
  tensors_[e + "weight_scale"].shape = {64, 1};
  tensors_[e + "weight_scale"].bytes.resize(64);
  expect_error("", {e + "weight_scale", "has shape [64, 1], expected [64, 2]"});
  tensors_[e + "weight_scale"] = scale;
  tensors_.erase(e + "weight_scale_2");
  expect_error("", {e + "weight_scale_2", "is missing", "one F32 value"});
  open("nvfp4");
  tensors_[e + "weight"].shape = {64, 32};
  tensors_[e + "weight"].bytes.resize(64 * 32);
  expect_error("", {e + "weight", "has shape [64, 32], expected [64, 16]", "two E2M1 codes"});

  // compressed-tensors' NVFP4: the global scale `weight_global_scale` divides, so the view
  // holds its reciprocal; missing or not positive, it is named.
  open("nvfp4-ct");
  const std::string n = kL2 + "self_attn.o_proj.";
  ASSERT_TRUE(tensors_.count(n + "weight_packed") && tensors_.count(n + "weight_global_scale"));
  {
    auto m = load_rewritten();
    ASSERT_TRUE(m.has_value()) << m.error().message;
    float stored;
    std::memcpy(&stored, tensors_[n + "weight_global_scale"].bytes.data(), sizeof stored);
    const MatRef& o = (*m)->weights().layers[2].o_proj;
    EXPECT_EQ(o.quant, WeightQuant::kNvfp4);
    EXPECT_EQ(o.global_scale, 1.f / stored);
  }
  std::memset(tensors_[n + "weight_global_scale"].bytes.data(), 0, 4);
  expect_error("", {n + "weight_global_scale", "must be a positive finite number"});
  tensors_.erase(n + "weight_global_scale");
  expect_error("", {n + "weight_scale_2' for ModelOpt",
                    n + "weight_global_scale' for compressed-tensors", "is missing"});

  open("mxfp4-ct");
  const std::string c = kL2 + "block_sparse_moe.experts.0.w1.";
  ASSERT_TRUE(tensors_.count(c + "weight_packed"));
  ASSERT_TRUE(load_rewritten().has_value());
  tensors_[c + "weight_scale"].dtype = DType::kI8;
  expect_error("", {c + "weight_scale", "has dtype I8", "expected U8"});
  open("mxfp4-ct");
  tensors_.erase(c + "weight_scale");
  expect_error("", {c + "weight_packed", "is missing", "(mxfp4)"});
}

TEST_F(QuantLoad, TensorsMustFitTheDeclaredMethod) {
  // An NVFP4 expert in a checkpoint that declares mxfp8.
  open("nvfp4");
  cfg_["quantization_config"] = {{"quant_method", "mxfp8"}};
  fs::remove(fs::path(dir_) / "hf_quant_config.json");
  expect_error("", {"is stored as nvfp4", "quant_method 'mxfp8'", "experts.0.w1.weight"});
  // A method m3serve does not read.
  open("mxfp8");
  cfg_["quantization_config"] = {{"quant_method", "gptq"}, {"bits", 4}};
  expect_error("", {"quantization method 'gptq'", "not supported", "mxfp8, modelopt (NVFP4)"});
}

TEST_F(QuantLoad, CompressedTensorsGroupsAreReadFromTheConfig) {
  const CheckpointQuant nv = read_checkpoint_quant(fixture("msa_small_blocks", "nvfp4-ct", false));
  ASSERT_EQ(nv.method, "compressed-tensors");
  ASSERT_EQ(nv.groups.size(), 1u);
  EXPECT_EQ(nv.groups[0].name, "group_0");
  EXPECT_EQ(nv.groups[0].format, "nvfp4-pack-quantized");
  EXPECT_EQ(nv.groups[0].type, "float");
  EXPECT_EQ(nv.groups[0].num_bits, 4);
  EXPECT_EQ(nv.groups[0].strategy, "tensor_group");
  EXPECT_EQ(nv.groups[0].group_size, 16);
  EXPECT_TRUE(nv.groups[0].activations);  // W4A4: the start-up log says they are not applied
  const CheckpointQuant mx = read_checkpoint_quant(fixture("msa_small_blocks", "mxfp4-ct", false));
  ASSERT_EQ(mx.groups.size(), 2u);
  for (const auto& g : mx.groups) EXPECT_FALSE(g.activations) << g.name;
  EXPECT_TRUE(read_checkpoint_quant(fixture("msa_small_blocks", "mxfp8", false)).groups.empty());
}

TEST_F(QuantLoad, CompressedTensorsSchemesNotReadAreRefusedByGroup) {
  // The groups of quantization_config are checked before any tensor is read: each scheme
  // m3serve cannot read is named with the group, and the ones it reads are listed.
  open("fp8-channel");
  ASSERT_TRUE(load_rewritten().has_value());
  json& w = cfg_["quantization_config"]["config_groups"]["group_0"]["weights"];
  w["strategy"] = "block";
  w["block_structure"] = {128, 128};
  expect_error("", {"compressed-tensors group 'group_0'", "strategy 'block'",
                    "2-D block scales is not read", "float-quantized fp8 per channel"});
  w["strategy"] = "tensor";
  expect_error("", {"one per-tensor scale", "--quantization fp8_per_channel"});
  w = {{"num_bits", 4}, {"type", "int"}, {"strategy", "group"}, {"group_size", 128}};
  cfg_["quantization_config"]["format"] = "pack-quantized";
  expect_error("", {"format 'pack-quantized' with int 4-bit weights", "integer weights",
                    "mxfp4-pack-quantized (group 32)"});
  open("nvfp4-ct");
  // A group without a format of its own and no config-wide one: its weights' scheme decides.
  cfg_["quantization_config"]["config_groups"]["group_0"].erase("format");
  cfg_["quantization_config"].erase("format");
  ASSERT_TRUE(load_rewritten().has_value());
  cfg_["quantization_config"]["config_groups"]["group_0"]["format"] = "nvfp4-pack-quantized";
  cfg_["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 32;
  expect_error("", {"'nvfp4-pack-quantized' with float 4-bit weights", "group_size 32"});
}

TEST_F(QuantLoad, QuantizationFlagMustMatchTheCheckpoint) {
  open("mxfp8");
  ASSERT_TRUE(load_rewritten("mxfp8").has_value());
  ASSERT_TRUE(load_rewritten("FP8").has_value());
  expect_error("modelopt", {"--quantization modelopt does not match the checkpoint",
                            "quant_method 'mxfp8' (config.json quantization_config)"});
  expect_error("fp8_per_channel",
               {"--quantization fp8_per_channel quantizes a bf16 checkpoint", "'mxfp8'"});
  expect_error("int3", {"--quantization 'int3' is unknown; accepted: none, fp8_per_channel"});
  open("nvfp4");  // declared by hf_quant_config.json (and quant_method modelopt)
  ASSERT_TRUE(load_rewritten("modelopt_fp4").has_value());
  ASSERT_TRUE(load_rewritten("nvfp4").has_value());
  expect_error("mxfp4", {"--quantization mxfp4 does not match", "'modelopt'"});
  open("mxfp4");
  ASSERT_TRUE(load_rewritten("quark").has_value());
  ASSERT_TRUE(load_rewritten("mxfp4").has_value());
  open("mxfp4-ct");
  ASSERT_TRUE(load_rewritten("compressed-tensors").has_value());
  ASSERT_TRUE(load_rewritten("mxfp4").has_value());
  open("nvfp4-ct");  // nvfp4 names ModelOpt's and compressed-tensors' NVFP4
  ASSERT_TRUE(load_rewritten("nvfp4").has_value());
  ASSERT_TRUE(load_rewritten("compressed-tensors").has_value());
  expect_error("modelopt", {"--quantization modelopt does not match", "'compressed-tensors'"});
  // A bf16 checkpoint with a quantized method named: refused, pointing at fp8_per_channel.
  auto m = M3Model::load(golden::root() + "/msa_small_blocks", LoadOptions{true, "mxfp8"});
  ASSERT_FALSE(m.has_value());
  EXPECT_NE(m.error().message.find("quant_method none (a bf16 checkpoint)"), std::string::npos)
      << m.error().message;
  EXPECT_NE(m.error().message.find("fp8_per_channel"), std::string::npos);
}

}  // namespace
}  // namespace m3::model
