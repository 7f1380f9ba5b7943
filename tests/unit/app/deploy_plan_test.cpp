// `m3serve plan`'s arithmetic (app/deploy_plan.h) against numbers derived by hand from M3's
// geometry (m3-model.md §1.5): weight bytes per format and rank, KV bytes per token per GPU for
// each strategy and KV format, and the fit of a requested --max-model-len.
#include <gtest/gtest.h>

#include "app/deploy_plan.h"
#include "model/synthetic_model.h"

namespace m3::app {
namespace {

model::M3Config m3(kernels::KvDtype kv = kernels::KvDtype::kBf16,
                   kernels::KvDtype ik = kernels::KvDtype::kBf16) {
  model::M3Config c = model::synthetic_m3_config(60);
  c.kv_cache_dtype = kv;
  c.index_cache_dtype = ik;
  return c;
}

TEST(DeployPlan, WeightBytesPerFormat) {
  const model::M3Config c = m3();
  auto whole = model::make_shard_plan(c, model::ShardSpec{});
  ASSERT_TRUE(whole.has_value());
  // bf16: the tensor table's own count (426,174,572,928 parameters, f32 router + bias).
  EXPECT_EQ(weight_bytes(c, *whole, WeightFormat::kBf16), model::synthetic_weight_bytes(c));
  // MXFP8 keeps embedding, lm_head, norms and router; a linear's element is 1 + 1/32 bytes.
  const double bf16 = static_cast<double>(weight_bytes(c, *whole, WeightFormat::kBf16));
  const double mx = static_cast<double>(weight_bytes(c, *whole, WeightFormat::kMxfp8));
  const double kept = 2.0 * 2 * 200064 * 6144;  // embed + lm_head in bf16
  EXPECT_NEAR((mx - kept) / (bf16 - kept), (1.0 + 1.0 / 32) / 2, 0.002);
  // NVFP4's routed experts: 57 layers x 128 experts x 3 x 3072 x 6144 elements at 0.5625 B.
  const double experts = 57.0 * 128 * 3 * 3072 * 6144;
  const double nv = static_cast<double>(weight_bytes(c, *whole, WeightFormat::kNvfp4));
  EXPECT_NEAR(mx - nv, experts * ((1.0 + 1.0 / 32) - 0.5625), 1e6);
}

TEST(DeployPlan, KvBytesPerTokenAndTokensPerStrategy) {
  PlanInput in;
  in.gpus = 8;
  auto plans = plan_deployment(m3(), in);
  ASSERT_TRUE(plans.has_value()) << plans.error().message;
  ASSERT_EQ(plans->size(), 3u);
  // TP8: 4 KV heads over 8 ranks, one (replicated) head each, the index-K whole:
  // 60 x 2 x 128 x 2 + 57 x 128 x 2.
  EXPECT_EQ((*plans)[0].kv_bytes_per_token, 60 * 2 * 128 * 2 + 57 * 128 * 2);
  // DP8: every rank keeps all heads of its own sequences (137,472 B, m3-model.md §1.5).
  EXPECT_EQ((*plans)[2].kv_bytes_per_token, 137472);
  EXPECT_EQ((*plans)[2].tokens_total, 8 * (*plans)[2].tokens_per_gpu);
  EXPECT_EQ((*plans)[0].tokens_total, (*plans)[0].tokens_per_gpu);
  for (const auto& p : *plans) {
    EXPECT_TRUE(p.weights_fit) << p.name;
    EXPECT_EQ(p.tokens_per_gpu % 128, 0) << p.name;
    EXPECT_LE(p.max_model_len, 1048576) << p.name;
    // The pool follows the serving rule: utilization x (memory - reserve - weights).
    EXPECT_NEAR(p.kv_gib, 0.9 * (140.0 - 2.0 - p.weights_served_gib), 1e-9) << p.name;
  }
  // fp8 KV + fp8 index-K on DP: 60 x 2 x 4 x 128 + 57 x (128 + 4) bytes.
  auto fp8 = plan_deployment(m3(kernels::KvDtype::kFp8, kernels::KvDtype::kFp8), in);
  ASSERT_TRUE(fp8.has_value());
  EXPECT_EQ((*fp8)[2].kv_bytes_per_token, 60 * 2 * 4 * 128 + 57 * (128 + 4));
  EXPECT_GT((*fp8)[2].tokens_per_gpu, 3 * (*plans)[2].tokens_per_gpu / 2);
}

TEST(DeployPlan, RequestedLengthAndBadInput) {
  PlanInput in;
  in.gpus = 8;
  in.max_model_len = 1048576;
  auto plans = plan_deployment(m3(), in);
  ASSERT_TRUE(plans.has_value());
  EXPECT_FALSE((*plans)[2].requested_fits);  // one DP rank's pool is far below 1M in bf16
  in.gpus = 0;
  EXPECT_FALSE(plan_deployment(m3(), in).has_value());
  // Weights that do not fit one GPU: TP1 of the whole model.
  in.gpus = 1;
  in.max_model_len = 0;
  auto one = plan_deployment(m3(), in);
  ASSERT_TRUE(one.has_value());
  ASSERT_EQ(one->size(), 1u);
  EXPECT_FALSE((*one)[0].weights_fit);
  EXPECT_EQ((*one)[0].tokens_per_gpu, 0);
  WeightFormat f;
  EXPECT_TRUE(parse_weight_format("MXFP8", f) && f == WeightFormat::kMxfp8);
  EXPECT_FALSE(parse_weight_format("int3", f));
}

}  // namespace
}  // namespace m3::app
