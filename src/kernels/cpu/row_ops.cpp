// Row gathers, residual adds and copies (the twins of kernels/cuda/row_ops.cu).
#include <algorithm>

#include "kernels/cpu/ops.h"

namespace m3::kernels::cpu {

void gather_rows(const float* src, const int32_t* rows, int64_t n, int64_t cols, float* dst) {
  for (int64_t i = 0; i < n; ++i)
    std::copy_n(src + static_cast<int64_t>(rows[i]) * cols, cols, dst + i * cols);
}

void add_inplace(float* x, const float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] += y[i];
}

void copy_rows_2d(float* dst, int64_t dst_stride, const float* src, int64_t src_stride,
                  int64_t width, int64_t rows) {
  for (int64_t r = 0; r < rows; ++r) std::copy_n(src + r * src_stride, width, dst + r * dst_stride);
}

void fill_zero(float* x, int64_t n) {
  std::fill(x, x + n, 0.f);
}

void copy(float* dst, const float* src, int64_t n) {
  if (n > 0 && dst != src) std::copy(src, src + n, dst);
}

}  // namespace m3::kernels::cpu
