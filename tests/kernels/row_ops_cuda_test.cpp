// The CUDA row ops and the expert-parallel id mapping (kernels/cuda/row_ops.cu, moe_experts.cu)
// against their CPU twins (kernels/cpu/ops.h) on the same inputs: moe_localize_ids (integers,
// exact), gather_rows, copy_rows_2d, copy, fill_zero (copies: exact) and add_inplace (one fp32
// addition per element on both sides, __fadd_rn on the GPU: exact). Each output buffer starts
// as NaN garbage on both sides, so an element written on one side only shows; sizes include
// tails of the 256-thread blocks and more than one grid-stride pass (65535 x 256 elements).
// Every test skips where no GPU is usable.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gpu/device.h"
#include "gpu/device_buffer.h"
#include "gpu_test_util.h"
#include "kernels/cpu/ops.h"
#include "kernels/cuda/ops.h"

namespace {

using m3::testing::randn;

namespace cpu = m3::kernels::cpu;
namespace gk = m3::kernels::cuda;
using m3::gpu::DeviceBuffer;
using m3::gpu::Stream;

// More elements than one pass of the row ops' grid (65535 blocks x 256 threads).
constexpr int64_t kPastOneGrid = 65535LL * 256 + 1001;

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

TEST(CudaRowOps, MoeLocalizeIdsMatchesCpu) {
  SKIP_WITHOUT_GPU();
  std::mt19937 g(1);
  Stream s;
  for (int64_t n : {1, 255, 256, 257, 4096 * 8}) {
    std::uniform_int_distribution<int32_t> pick(-1, 127);
    std::vector<int32_t> ids(n);
    for (auto& i : ids) i = pick(g);
    // [first, first + count) slices of 128 experts: whole, halves, an uneven and an empty one.
    for (auto [first, count] :
         {std::pair<int64_t, int64_t>{0, 128}, {0, 64}, {64, 64}, {96, 32}, {30, 7}, {128, 0}}) {
      auto want = ids;
      cpu::moe_localize_ids(want.data(), n, first, count);
      DeviceBuffer<int32_t> d(ids);
      gk::moe_localize_ids(d.data(), n, first, count, s.get());
      s.synchronize();
      ASSERT_EQ(d.to_host(), want) << "n " << n << " slice [" << first << ", +" << count << ")";
    }
  }
}

TEST(CudaRowOps, GatherRowsMatchesCpu) {
  SKIP_WITHOUT_GPU();
  std::mt19937 g(2);
  Stream s;
  for (auto [src_rows, n, cols] : {std::tuple<int64_t, int64_t, int64_t>{1, 1, 1},
                                   {9, 6, 5},
                                   {300, 257, 64},
                                   {70, 1000, 6144}}) {
    const auto src = randn(src_rows * cols, g);
    std::uniform_int_distribution<int32_t> pick(0, static_cast<int32_t>(src_rows - 1));
    std::vector<int32_t> rows(n);
    for (auto& r : rows) r = pick(g);  // repeats, any order
    rows[0] = static_cast<int32_t>(src_rows - 1);
    std::vector<float> want(n * cols + 7, NAN);  // the tail stays NaN on both sides
    cpu::gather_rows(src.data(), rows.data(), n, cols, want.data());
    DeviceBuffer<float> dsrc(src), ddst(std::vector<float>(n * cols + 7, NAN));
    DeviceBuffer<int32_t> drows(rows);
    gk::gather_rows(dsrc.data(), drows.data(), n, cols, ddst.data(), s.get());
    s.synchronize();
    EXPECT_TRUE(same_bits(ddst.to_host(), want)) << n << " rows of " << cols;
  }
}

TEST(CudaRowOps, AddInplaceMatchesCpuBitForBit) {
  SKIP_WITHOUT_GPU();
  std::mt19937 g(3);
  Stream s;
  for (int64_t n : {int64_t{1}, int64_t{255}, int64_t{6144 * 33}, kPastOneGrid}) {
    auto x = randn(n, g, 3.f);
    const auto y = randn(n, g);
    DeviceBuffer<float> dx(x), dy(y);
    cpu::add_inplace(x.data(), y.data(), n);
    gk::add_inplace(dx.data(), dy.data(), n, s.get());
    s.synchronize();
    EXPECT_TRUE(same_bits(dx.to_host(), x)) << "n " << n;
  }
}

TEST(CudaRowOps, CopyRows2dMatchesCpu) {
  SKIP_WITHOUT_GPU();
  std::mt19937 g(4);
  Stream s;
  // (rows, width, src_stride, dst_stride, src column offset): a window of a fused projection
  // into a packed buffer, packed into a wider one, and packed to packed.
  for (auto [rows, width, ss, ds, off] :
       {std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t>{5, 3, 7, 4, 2},
        {300, 1024, 9216, 1024, 8192},
        {17, 128, 128, 200, 0},
        {64, 6144, 6144, 6144, 0}}) {
    const auto src = randn(rows * ss, g);
    std::vector<float> want(rows * ds, NAN);  // the gaps between rows stay NaN
    cpu::copy_rows_2d(want.data(), ds, src.data() + off, ss, width, rows);
    DeviceBuffer<float> dsrc(src), ddst(std::vector<float>(rows * ds, NAN));
    gk::copy_rows_2d(ddst.data(), ds, dsrc.data() + off, ss, width, rows, s.get());
    s.synchronize();
    EXPECT_TRUE(same_bits(ddst.to_host(), want)) << rows << " x " << width;
  }
}

TEST(CudaRowOps, FillZeroAndCopyMatchCpu) {
  SKIP_WITHOUT_GPU();
  std::mt19937 g(5);
  Stream s;
  for (int64_t n : {int64_t{1}, int64_t{1000}, kPastOneGrid}) {
    const auto src = randn(n, g);
    // n elements of an n + 3 buffer: the last 3 stay NaN on both sides.
    std::vector<float> want_copy(n + 3, NAN), want_zero(n + 3, NAN);
    cpu::copy(want_copy.data(), src.data(), n);
    cpu::fill_zero(want_zero.data(), n);
    DeviceBuffer<float> dsrc(src), dcopy(std::vector<float>(n + 3, NAN)),
        dzero(std::vector<float>(n + 3, NAN));
    gk::copy(dcopy.data(), dsrc.data(), n, s.get());
    gk::fill_zero(dzero.data(), n, s.get());
    s.synchronize();
    EXPECT_TRUE(same_bits(dcopy.to_host(), want_copy)) << "copy n " << n;
    EXPECT_TRUE(same_bits(dzero.to_host(), want_zero)) << "fill_zero n " << n;
  }
}

}  // namespace
