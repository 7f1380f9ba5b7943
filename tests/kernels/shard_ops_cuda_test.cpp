// kernels/cuda/embedding_vocab_slice (the tensor-parallel embedding) against its CPU twin
// (cpu::embedding_vocab_slice on the same slice, bit for bit) and the CPU embedding: each rank's
// output is the CPU embedding for ids in its vocabulary rows and exactly zero elsewhere, so the
// sum over ranks equals the full CPU embedding bitwise (bf16 -> f32 and f32 copies are exact;
// one non-zero term per element). Even, uneven and empty slices; bf16 and f32.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "gpu/device.h"
#include "gpu/device_buffer.h"
#include "gpu_test_util.h"
#include "kernels/cpu/ops.h"
#include "kernels/cuda/ops.h"

namespace {

using m3::testing::gpu_unavailable_reason;
using m3::testing::kU;
using m3::testing::randn;
using m3::testing::to_bf16;

using m3::DType;
using m3::gpu::DeviceBuffer;
using m3::kernels::cpu::MatRef;

// The ranks of a world-`world` split of a vocab x hidden table (chunks of ceil(V / world) rows,
// the last shorter or empty, as model/shard.h) each embed `ids`; checks each rank's output and
// that their sum is the CPU embedding of the whole table.
void check_split(DType dtype, int64_t vocab, int64_t hidden, int world) {
  std::mt19937 rng(static_cast<uint32_t>(vocab * 131 + hidden * 7 + world));
  std::uniform_real_distribution<float> u(-2.f, 2.f);
  const size_t n_el = static_cast<size_t>(vocab * hidden);
  std::vector<uint8_t> table(n_el * (dtype == DType::kBF16 ? 2 : 4));
  for (size_t i = 0; i < n_el; ++i) {
    const float f = u(rng);
    if (dtype == DType::kBF16) {
      uint32_t bits;
      std::memcpy(&bits, &f, 4);
      const uint16_t b = static_cast<uint16_t>(bits >> 16);
      std::memcpy(table.data() + 2 * i, &b, 2);
    } else {
      std::memcpy(table.data() + 4 * i, &f, 4);
    }
  }
  MatRef full;
  full.data = table.data();
  full.dtype = dtype;
  full.rows = vocab;
  full.cols = hidden;
  std::vector<int32_t> ids;
  std::uniform_int_distribution<int32_t> pick(0, static_cast<int32_t>(vocab - 1));
  for (int i = 0; i < 37; ++i) ids.push_back(pick(rng));
  ids.push_back(0);
  ids.push_back(static_cast<int32_t>(vocab - 1));
  const int64_t n = static_cast<int64_t>(ids.size());
  std::vector<float> want(static_cast<size_t>(n * hidden));
  m3::kernels::cpu::embedding(full, ids.data(), n, want.data());

  DeviceBuffer<uint8_t> d_table(table);
  DeviceBuffer<int32_t> d_ids(ids);
  DeviceBuffer<float> d_out(static_cast<size_t>(n * hidden));
  std::vector<float> sum(want.size(), 0.f);
  const int64_t chunk = (vocab + world - 1) / world;
  for (int r = 0; r < world; ++r) {
    const int64_t v0 = std::min<int64_t>(vocab, r * chunk);
    const int64_t count = std::min<int64_t>(vocab, v0 + chunk) - v0;
    MatRef slice = full;
    slice.rows = count;
    slice.data = d_table.data() + static_cast<size_t>(v0 * hidden) * m3::dtype_size(dtype);
    d_out.fill_bytes(0x7f);  // garbage: every element must be written
    m3::kernels::cuda::embedding_vocab_slice(slice, v0, vocab, hidden, d_ids.data(), n,
                                             d_out.data(), nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::vector<float> got = d_out.to_host();
    // The CPU twin on the host slice: the same bits (+0 off the slice on both sides).
    MatRef host_slice = slice;
    host_slice.data = table.data() + static_cast<size_t>(v0 * hidden) * m3::dtype_size(dtype);
    std::vector<float> twin(static_cast<size_t>(n * hidden), 1.f);
    m3::kernels::cpu::embedding_vocab_slice(host_slice, v0, vocab, hidden, ids.data(), n,
                                            twin.data());
    ASSERT_EQ(0, std::memcmp(got.data(), twin.data(), got.size() * sizeof(float)))
        << "rank " << r << " vs cpu::embedding_vocab_slice";
    for (int64_t t = 0; t < n; ++t) {
      const bool mine = ids[t] >= v0 && ids[t] < v0 + count;
      for (int64_t c = 0; c < hidden; ++c) {
        const float w = mine ? want[t * hidden + c] : 0.f;
        ASSERT_EQ(got[t * hidden + c], w) << "rank " << r << " token " << t << " col " << c;
        sum[t * hidden + c] += got[t * hidden + c];
      }
    }
  }
  EXPECT_EQ(sum, want);
}

TEST(ShardOpsCuda, EmbeddingVocabSliceSumsToTheFullEmbedding) {
  if (!gpu_unavailable_reason().empty()) GTEST_SKIP() << gpu_unavailable_reason();
  check_split(DType::kBF16, 1536, 64, 2);  // even split (the goldens at TP2)
  check_split(DType::kBF16, 1001, 48, 4);  // uneven: the last rank is shorter
  check_split(DType::kF32, 1000, 40, 3);   // f32 table, uneven
  check_split(DType::kBF16, 5, 16, 8);     // more ranks than rows: empty slices
}

}  // namespace
