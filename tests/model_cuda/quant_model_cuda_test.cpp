// Quantized checkpoints on the GPU (issue #18; docs/QUANTIZATION.md): M3ModelCuda keeps the
// linears as stored (codes and scales in device memory) and runs them through the quantized ops,
// and must compute what the CPU model computes on the same checkpoint. Fixtures: the golden
// checkpoints quantized at test time by tools/quant/quantize_checkpoint.py (as
// tests/model/quant_golden_test does), each format, plus --quantization fp8_per_channel of the
// bf16 golden. Covered paths: prefill of the longest golden prompt (190-200 tokens: linears
// dequantised into the workspace + bf16 GEMM, experts through the grouped quantized GEMV; the
// MoE's per-expert dequantise path above kMoeGemvMaxTokens is covered by quant_cuda_test's
// moe_experts case only), decode of one sequence (the quantized GEMV, the grouped quantized
// expert GEMV, CUDA graphs replayed), and a batch of 8 sequences (a 40-token step and 8-token
// decode steps: the dequantise path of the linears with the grouped expert GEMV on groups of
// several positions).
//
// Tolerance kGpuCpuTol (GPU vs CPU logprobs, every vocabulary entry): model_cuda_test's, with its
// derivation: both sides compute the same fp32 products of the same dequantised values (the GPU
// GEMV decodes codes exactly and scales each block's dot product; the prefill path's bf16 copy
// is exact, its row factor applied after), so only the summation order, fma contraction and libm
// ulps differ, as for bf16 weights. Skips where no GPU is usable (CI).
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "gpu/device.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/quant.h"
#include "model/cuda/m3_model_cuda.h"
#include "model/golden_util.h"
#include "model/m3_model.h"
#include "model/tensor_table.h"
#include "runtime/cuda/cuda_backend.h"
#include "runtime/sequence_runner.h"

namespace m3::model {
namespace {

using namespace m3::runtime;
namespace fs = std::filesystem;
using kernels::WeightQuant;

constexpr double kGpuCpuTol = 2e-4;

const std::string& no_gpu_reason() {
  static const std::string reason = [] {
    auto info = gpu::probe_device(0);
    return info ? std::string() : info.error().message + " ";
  }();
  return reason;
}

std::string fixture_root() {
  static const std::string root = [] {
    char tmpl[] = M3_BINARY_DIR "/quant_cuda_fixtures_XXXXXX";
    M3_CHECK(mkdtemp(tmpl) != nullptr, "mkdtemp under %s", M3_BINARY_DIR);
    return std::string(tmpl);
  }();
  return root;
}

// The checkpoint dir of (model, format); fp8-channel is the bf16 golden itself (quantized at load).
std::string checkpoint(const std::string& model, const std::string& fmt) {
  if (fmt == "fp8-channel") return golden::root() + "/" + model;
  const std::string dir = fixture_root() + "/" + model + "/" + fmt;
  if (!fs::exists(dir + "/config.json")) {
    const std::string cmd = "python3 " M3_SOURCE_DIR "/tools/quant/quantize_checkpoint.py " +
                            golden::root() + "/" + model + " " + dir + " --format " + fmt +
                            " > /dev/null";
    EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd << " failed (needs python3 and numpy)";
  }
  return dir;
}

double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double m = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i)
    m = std::max<double>(m, std::fabs(a[i] - b[i]));
  return m;
}

struct Case {
  std::string model, fmt;
};
void PrintTo(const Case& c, std::ostream* os) {
  *os << c.model << "_" << c.fmt;
}

std::vector<Case> cases() {
  std::vector<Case> r;
  for (const char* m : {"msa_small_blocks", "m3_ratio"})
    for (const char* f : {"mxfp8", "nvfp4", "mxfp4", "mxfp4-ct", "nvfp4-ct", "fp8-channel"})
      r.push_back({m, f});
  return r;
}

class QuantModelCuda : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    if (!no_gpu_reason().empty()) GTEST_SKIP() << "no usable GPU: " << no_gpu_reason();
    const Case& c = GetParam();
    LoadOptions o;
    if (c.fmt == "fp8-channel") o.quantization = "fp8_per_channel";
    auto m = M3ModelCuda::load(checkpoint(c.model, c.fmt), o);
    ASSERT_TRUE(m.has_value()) << m.error().message;
    model_ = std::move(*m);
    ASSERT_TRUE(model_->use_graphs());
    golden_ = golden::read_json(fs::path(golden::root()) / c.model / "golden.json");
  }
  int64_t vocab() const { return model_->config().vocab_size; }

  std::unique_ptr<M3ModelCuda> model_;
  nlohmann::json golden_;
};

// The device holds the quantized linears as stored: its weight bytes are the host views' codes
// and scales (view_bytes as uploaded, plus alignment padding of at most 256 bytes per allocation
// and NVFP4's per-expert global scales). msa_small_blocks (every width a multiple of 16) keeps
// every quantized linear quantized, in fewer bytes than a bf16 upload of the same linears.
// m3_ratio's intermediate width 24 is no multiple of 16: its routed experts and its dense and
// shared down projections are uploaded as f32 values (uploads_quantized), so its Quark MXFP4
// fixture (MXFP4 experts only) holds nothing quantized.
TEST_P(QuantModelCuda, WeightsStayQuantizedOnTheGpu) {
  const M3Weights& hw = model_->host()->weights();
  const M3Weights& dw = model_->device_weights();
  const auto table = m3_tensors(model_->config());
  const size_t as_uploaded = view_bytes(hw, table, /*as_uploaded=*/true);
  size_t bf16_equiv = 0, mats = 0, quantized = 0, kept = 0;
  for (const auto& t : table) {
    if (t.vector) continue;
    if (t.may_tie && t.mat(hw).data == hw.embed_tokens.data) continue;
    for (int64_t e = 0; e < t.count_in(hw); ++e) {
      const MatRef& h = t.mat(hw, e);
      const MatRef& d = t.mat(dw, e);
      if (h.data == nullptr) continue;
      const size_t as_bf16 = h.quantized() ? static_cast<size_t>(h.rows * h.cols) * 2 : h.bytes();
      bf16_equiv += as_bf16;
      mats +=
          d.quantized() ? h.bytes() : static_cast<size_t>(d.rows * d.cols) * dtype_size(d.dtype);
      quantized += h.quantized();
      kept += d.quantized();
      if (d.quantized()) {
        EXPECT_EQ(d.quant, h.quant) << t.names[0];
        EXPECT_EQ(d.global_scale, h.global_scale) << t.names[0];
      }
    }
  }
  std::printf(
      "  %s/%s: %zu of %zu quantized linears held quantized; GPU weights %.3f MiB "
      "(views as uploaded %.3f MiB); matrices %.3f MiB (%.3f MiB in an all-bf16 upload)\n",
      GetParam().model.c_str(), GetParam().fmt.c_str(), kept, quantized,
      model_->weight_bytes() / 1048576.0, as_uploaded / 1048576.0, mats / 1048576.0,
      bf16_equiv / 1048576.0);
  ASSERT_GT(quantized, 0u);
  const bool none_fit = GetParam().model == "m3_ratio" && GetParam().fmt == "mxfp4";
  if (none_fit) {
    EXPECT_EQ(kept, 0u);
  } else {
    EXPECT_GT(kept, 0u);
  }
  if (GetParam().model == "msa_small_blocks") {
    EXPECT_EQ(kept, quantized);
    EXPECT_LT(mats, bf16_equiv);
  }
  EXPECT_GE(model_->weight_bytes(), as_uploaded);
  EXPECT_LE(model_->weight_bytes(), as_uploaded + 256 * (table.size() + 8) + 4096);
  // Routed experts: msa_small_blocks' widths (hidden 64, inter 32) are multiples of 16, so every
  // quantized expert stays quantized; m3_ratio's are f32.
  for (size_t li = 0; li < dw.layers.size(); ++li) {
    const LayerWeights& L = dw.layers[li];
    if (L.experts.empty() || !hw.layers[li].experts[0].w1.quantized()) continue;
    EXPECT_EQ(L.experts[0].w1.quantized(), GetParam().model == "msa_small_blocks") << li;
  }
}

// Prefill the longest golden prompt (at most 300 tokens; MSA selections too), then 4 greedy
// decode steps, on both devices.
TEST_P(QuantModelCuda, PrefillAndDecodeMatchTheCpu) {
  auto ids = golden::longest_prompt(golden_);
  if (ids.size() > 300) ids.resize(300);
  const int64_t n = static_cast<int64_t>(ids.size()), steps = 4;
  SequenceRunner cpu(*model_->host(), n + steps + 1, 1);
  SequenceRunner gpu(borrow_cuda_backend(*model_, n + steps + 1, 1));
  const int cs = cpu.add_sequence(), gs = gpu.add_sequence();
  const auto c = cpu.step({{cs, ids, true}}, /*capture_msa=*/true);
  const auto g = gpu.step({{gs, ids, true}}, /*capture_msa=*/true);
  ASSERT_EQ(c.logits.size(), g.logits.size());
  const double lp_err = max_abs_diff(golden::log_softmax_rows(c.logits, vocab()),
                                     golden::log_softmax_rows(g.logits, vocab()));
  int64_t msa_diff = 0;
  ASSERT_EQ(c.msa_blocks.size(), g.msa_blocks.size());
  for (size_t l = 0; l < c.msa_blocks.size(); ++l) {
    ASSERT_EQ(c.msa_blocks[l].size(), g.msa_blocks[l].size());
    for (size_t i = 0; i < c.msa_blocks[l].size(); ++i)
      msa_diff += c.msa_blocks[l][i] != g.msa_blocks[l][i];
  }
  EXPECT_LT(lp_err, kGpuCpuTol) << "prefill of " << n;
  EXPECT_EQ(msa_diff, 0);
  std::vector<float> last(c.logits.end() - vocab(), c.logits.end());
  const int64_t replays0 = model_->graph_replays();
  double dec_err = 0;
  for (int64_t s = 0; s < steps; ++s) {
    const int32_t tok =
        static_cast<int32_t>(std::max_element(last.begin(), last.end()) - last.begin());
    const auto cd = cpu.step({{cs, std::span<const int32_t>(&tok, 1), false}});
    const auto gd = gpu.step({{gs, std::span<const int32_t>(&tok, 1), false}});
    const double e = max_abs_diff(golden::log_softmax_rows(cd.logits, vocab()),
                                  golden::log_softmax_rows(gd.logits, vocab()));
    EXPECT_LT(e, kGpuCpuTol) << "decode step " << s;
    dec_err = std::max(dec_err, e);
    last = cd.logits;
  }
  EXPECT_GT(model_->graph_replays(), replays0) << "decode steps should replay a CUDA graph";
  std::printf(
      "  %s/%s: prefill %lld tokens max |logprob diff| %.3g (%lld MSA entries differ), "
      "decode max %.3g\n",
      GetParam().model.c_str(), GetParam().fmt.c_str(), static_cast<long long>(n), lp_err,
      static_cast<long long>(msa_diff), dec_err);
}

// 8 sequences: one 40-token step (5 prompt tokens each), then 3 decode steps of 8 tokens.
TEST_P(QuantModelCuda, BatchedStepsMatchTheCpu) {
  const auto base = golden::longest_prompt(golden_);
  ASSERT_GE(base.size(), 40u + 3 * 8);
  const int B = 8;
  SequenceRunner cpu(*model_->host(), B * 16, B);
  SequenceRunner gpu(borrow_cuda_backend(*model_, B * 16, B));
  std::vector<int> cs(B), gs(B);
  for (int i = 0; i < B; ++i) {
    cs[i] = cpu.add_sequence();
    gs[i] = gpu.add_sequence();
  }
  double worst = 0;
  for (int step = 0; step < 4; ++step) {
    const size_t len = step == 0 ? 5 : 1;
    std::vector<SequenceRunner::Chunk> cc, gc;
    for (int i = 0; i < B; ++i) {
      const size_t at = step == 0 ? 5 * i : 40 + 8 * (step - 1) + i;
      const std::span<const int32_t> toks(base.data() + at, len);
      cc.push_back({cs[i], toks, false});
      gc.push_back({gs[i], toks, false});
    }
    const auto c = cpu.step(cc);
    const auto g = gpu.step(gc);
    ASSERT_EQ(c.logits.size(), static_cast<size_t>(B * vocab()));
    const double e = max_abs_diff(golden::log_softmax_rows(c.logits, vocab()),
                                  golden::log_softmax_rows(g.logits, vocab()));
    EXPECT_LT(e, kGpuCpuTol) << "step " << step;
    worst = std::max(worst, e);
  }
  std::printf("  %s/%s: 8 sequences, steps of 40 and 8 tokens: max |logprob diff| %.3g\n",
              GetParam().model.c_str(), GetParam().fmt.c_str(), worst);
}

// FP8 activations (the default under the bf16 GEMM precision; M3_FP8_ACTIVATIONS=0 turns them
// off): a prefill above kQuantGemmMaxTokens (256) sends every fp8_per_channel linear whose widths
// cuBLASLt's FP8 GEMM takes (multiples of 16: msa_small_blocks) to fp8_linear. The prompt (the
// longest golden prompt twice, 380-400 tokens) runs with them on and off, both under bf16 GEMMs;
// on must differ from off where they engage (they ran), and stay as close to the CPU's exact
// result as the bf16 GEMMs do, within the rounding of x to e4m3 per token (2^-4 relative, 16x
// bf16's 2^-8): mean |logprob diff| over every entry of every row at most 16x bf16's plus 0.05.
// The largest entry (far-tail logprobs of a tiny random model, 12.5 under bf16 activations on the
// H200) may grow by at most 4.
TEST_P(QuantModelCuda, Fp8ActivationsPrefillStaysNearTheCpu) {
  if (GetParam().fmt != "fp8-channel") GTEST_SKIP() << "FP8 activations: fp8_per_channel only";
  namespace cuda = kernels::cuda;
  struct Restore {
    cuda::GemmPrecision p = cuda::gemm_precision();
    bool a = cuda::fp8_activations();
    ~Restore() {
      cuda::set_gemm_precision(p);
      cuda::set_fp8_activations(a);
    }
  } restore;
  auto ids = golden::longest_prompt(golden_);
  const auto once = ids;
  ids.insert(ids.end(), once.begin(), once.end());
  if (ids.size() > 400) ids.resize(400);
  ASSERT_GT(ids.size(), 256u);
  const int64_t n = static_cast<int64_t>(ids.size());
  SequenceRunner cpu(*model_->host(), n + 1, 1);
  const auto c = cpu.step({{cpu.add_sequence(), ids, true}});
  const auto ref = golden::log_softmax_rows(c.logits, vocab());
  cuda::set_gemm_precision(cuda::GemmPrecision::kBf16);
  auto run = [&](bool fp8) {
    cuda::set_fp8_activations(fp8);
    SequenceRunner gpu(borrow_cuda_backend(*model_, n + 1, 1));
    const auto g = gpu.step({{gpu.add_sequence(), ids, true}});
    return golden::log_softmax_rows(g.logits, vocab());
  };
  const auto off = run(false), on = run(true);
  auto mean_diff = [&](const std::vector<float>& a) {
    double sum = 0;
    for (size_t i = 0; i < a.size(); ++i) sum += std::fabs(a[i] - ref[i]);
    return sum / static_cast<double>(a.size());
  };
  const double off_mean = mean_diff(off), on_mean = mean_diff(on);
  const double off_max = max_abs_diff(off, ref), on_max = max_abs_diff(on, ref);
  std::printf(
      "  %s/%s: prefill %lld tokens vs the CPU, |logprob diff| mean / max: bf16 activations "
      "%.3g / %.3g, FP8 activations %.3g / %.3g\n",
      GetParam().model.c_str(), GetParam().fmt.c_str(), static_cast<long long>(n), off_mean,
      off_max, on_mean, on_max);
  if (GetParam().model == "msa_small_blocks") {
    EXPECT_GT(max_abs_diff(on, off), 0.0);
  }
  EXPECT_LE(on_mean, 16 * off_mean + 0.05);
  EXPECT_LE(on_max, off_max + 4.0);
}

INSTANTIATE_TEST_SUITE_P(Formats, QuantModelCuda, ::testing::ValuesIn(cases()),
                         [](const auto& info) {
                           std::string s = info.param.model + "_" + info.param.fmt;
                           std::replace(s.begin(), s.end(), '-', '_');
                           return s;
                         });

}  // namespace
}  // namespace m3::model
