// kernels/cuda/sample_rows against kernels/cpu/sample_rows: the same token for every row over
// greedy, temperature, top_k, top_p, min_p and their combinations, at M3's vocabulary (200064,
// with padding rows beyond num_valid) and small/odd sizes, with exact logit ties under top_k.
// Integer outputs, so equality is exact: the thresholds and the Gumbel noise are the same
// arithmetic on both sides (fp32 z, fp64 masses; a mass boundary within fp64 rounding of a
// kept/dropped decision has probability ~1e-13 per row for these random logits).
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "gpu/device.h"
#include "gpu/device_buffer.h"
#include "gpu_test_util.h"
#include "kernels/cpu/sample.h"
#include "kernels/cuda/sample.h"

namespace {

using m3::testing::gpu_unavailable_reason;
using m3::testing::kU;
using m3::testing::randn;
using m3::testing::to_bf16;

using m3::gpu::DeviceBuffer;
using m3::gpu::Stream;
using m3::kernels::cpu::SampleRow;

void check_same(const std::vector<float>& logits, int64_t vocab, int64_t num_valid,
                const std::vector<SampleRow>& rows, const std::string& what) {
  std::vector<int32_t> want(rows.size());
  m3::kernels::cpu::sample_rows(logits.data(), vocab, num_valid, rows.data(),
                                static_cast<int64_t>(rows.size()), want.data());
  DeviceBuffer<float> d_l(logits.size());
  d_l.copy_from(logits.data(), logits.size());
  DeviceBuffer<SampleRow> d_rows(rows.size());
  d_rows.copy_from(rows.data(), rows.size());
  DeviceBuffer<int32_t> d_out(rows.size());
  Stream s;
  m3::kernels::cuda::sample_rows(d_l.data(), vocab, num_valid, d_rows.data(),
                                 static_cast<int64_t>(rows.size()), d_out.data(), s.get());
  s.synchronize();
  std::vector<int32_t> got(rows.size());
  d_out.copy_to(got.data(), got.size());
  for (size_t i = 0; i < rows.size(); ++i) {
    EXPECT_EQ(got[i], want[i]) << what << " row " << i << " (t=" << rows[i].temperature
                               << " top_k=" << rows[i].top_k << " top_p=" << rows[i].top_p
                               << " min_p=" << rows[i].min_p << " step=" << rows[i].step << ")";
    EXPECT_LT(got[i], num_valid);
  }
}

std::vector<SampleRow> param_grid(int64_t num_logit_rows, int repeats) {
  const float temps[] = {0.f, 0.3f, 1.f, 1.7f};
  const int top_ks[] = {0, 1, 2, 40, 1000};
  const float top_ps[] = {1.f, 0.95f, 0.5f, 0.05f};
  const float min_ps[] = {0.f, 0.1f};
  std::vector<SampleRow> rows;
  uint64_t step = 0;
  for (float t : temps)
    for (int k : top_ks)
      for (float tp : top_ps)
        for (float mp : min_ps)
          for (int r = 0; r < repeats; ++r) {
            SampleRow p;
            p.row = static_cast<int32_t>(rows.size() % num_logit_rows);
            p.temperature = t;
            p.top_k = k;
            p.top_p = tp;
            p.min_p = mp;
            p.seed = 1000 + r;
            p.step = step++;
            rows.push_back(p);
          }
  return rows;
}

TEST(SampleCuda, MatchesCpuAtM3Vocab) {
  SKIP_WITHOUT_GPU();
  const int64_t V = 200064, valid = 200061, R = 8;
  std::mt19937 g(11);
  std::normal_distribution<float> d(0.f, 3.f);
  std::vector<float> l(R * V);
  for (auto& x : l) x = d(g);
  for (int64_t r = 0; r < R; ++r) l[r * V + V - 1] = 1e4f;  // padding rows must never win
  check_same(l, V, valid, param_grid(R, 1), "m3 vocab");
}

TEST(SampleCuda, MatchesCpuOnSmallAndOddVocabs) {
  SKIP_WITHOUT_GPU();
  for (int64_t V : {1, 2, 7, 33, 1025, 4099}) {
    std::mt19937 g(static_cast<uint32_t>(V));
    std::normal_distribution<float> d(0.f, 2.f);
    std::vector<float> l(3 * V);
    for (auto& x : l) x = d(g);
    check_same(l, V, V, param_grid(3, 2), "V=" + std::to_string(V));
  }
}

TEST(SampleCuda, TopKKeepsTiesInIdOrder) {
  SKIP_WITHOUT_GPU();
  // Logits on a coarse grid: many exact ties, so the k-th largest value is shared by several
  // ids and only the lowest ids among them may be kept (a stable best-first order).
  const int64_t V = 5000;
  std::mt19937 g(5);
  std::uniform_int_distribution<int> d(-8, 8);
  std::vector<float> l(V);
  for (auto& x : l) x = static_cast<float>(d(g)) * 0.5f;
  std::vector<SampleRow> rows;
  for (int k : {1, 3, 100, 290, 301, 2500, 4999}) {
    for (int r = 0; r < 16; ++r) {
      SampleRow p;
      p.temperature = 1.f;
      p.top_k = k;
      p.seed = 7;
      p.step = rows.size();
      rows.push_back(p);
    }
  }
  check_same(l, V, V, rows, "ties");
}

// Greedy rows at M3's vocabulary whose maximum is shared by several ids (in different threads,
// different unrolled loads of one thread, and the scalar tail past the last float4): the lowest
// id wins, as on the CPU; ids at or past num_valid never do. Rows 1 and 2 start off a 16-byte
// boundary (vocab 200063: the scalar path), row 0 on one.
TEST(SampleCuda, GreedyTiesGoToTheLowestIdOnBothPaths) {
  SKIP_WITHOUT_GPU();
  for (int64_t V : {int64_t{200064}, int64_t{200063}}) {
    const int64_t valid = V - 2;
    std::vector<float> l(3 * V, 0.f);
    std::mt19937 g(3);
    std::normal_distribution<float> d(0.f, 1.f);
    for (auto& x : l) x = d(g);
    const std::vector<std::vector<int64_t>> tied = {
        {150001, 4099, 1024 * 4 + 7, 200000}, {V - 3, 6000}, {valid - 1, 17, 17 + 4096}};
    for (int64_t r = 0; r < 3; ++r) {
      for (int64_t id : tied[r]) l[r * V + id] = 50.f;
      l[r * V + V - 1] = 1e4f;  // padding: never chosen
    }
    std::vector<SampleRow> rows(3);
    for (int r = 0; r < 3; ++r) {
      rows[r].row = r;
      rows[r].temperature = 0.f;
    }
    check_same(l, V, valid, rows, "greedy ties V=" + std::to_string(V));
    // The CPU twin's answers, stated: the lowest tied id of each row.
    std::vector<int32_t> want(3);
    m3::kernels::cpu::sample_rows(l.data(), V, valid, rows.data(), 3, want.data());
    EXPECT_EQ(want[0], 4099);
    EXPECT_EQ(want[1], 6000);
    EXPECT_EQ(want[2], 17);
  }
}

}  // namespace
