// The one op the tensor-parallel GPU forward needs beyond the single-GPU ops: the embedding over
// a rank's vocabulary slice (model/shard.h splits embed_tokens by rows). Declared in ops.h;
// tested against the CPU embedding in tests/kernels/shard_ops_cuda_test.cpp.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace m3::kernels::cuda {

namespace {

using detail::load_weight;

__global__ void embedding_vocab_slice_kernel(const void* __restrict__ table, bool bf16,
                                             int64_t rows, int64_t cols, int64_t vocab_begin,
                                             int64_t vocab_size, const int32_t* __restrict__ ids,
                                             float* __restrict__ out) {
  const int64_t t = blockIdx.x;
  const int32_t id = ids[t];
  M3_DEVICE_CHECK(id >= 0 && id < vocab_size, "embedding id %d out of range [0, %lld)", id,
                  static_cast<long long>(vocab_size));
  const int64_t local = static_cast<int64_t>(id) - vocab_begin;
  float* o = out + t * cols;
  if (local < 0 || local >= rows) {
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) o[c] = 0.f;
    return;
  }
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x)
    o[c] = load_weight(table, bf16, local * cols + c);
}

}  // namespace

void embedding_vocab_slice(const MatRef& table, int64_t vocab_begin, int64_t vocab_size,
                           int64_t hidden, const int32_t* ids, int64_t n, float* out,
                           cudaStream_t stream) {
  M3_CHECK(table.rows == 0 || table.dtype == DType::kBF16 || table.dtype == DType::kF32,
           "cuda::embedding_vocab_slice: weight dtype %s", dtype_name(table.dtype));
  M3_CHECK(table.rows == 0 || table.cols == hidden,
           "cuda::embedding_vocab_slice: %lld cols, %lld hidden",
           static_cast<long long>(table.cols), static_cast<long long>(hidden));
  M3_CHECK(vocab_begin >= 0 && vocab_begin + table.rows <= vocab_size,
           "cuda::embedding_vocab_slice: rows [%lld, +%lld) outside a vocabulary of %lld",
           static_cast<long long>(vocab_begin), static_cast<long long>(table.rows),
           static_cast<long long>(vocab_size));
  if (n == 0) return;
  M3_CHECK(n <= 0x7fffffff, "cuda::embedding_vocab_slice: %lld ids", static_cast<long long>(n));
  embedding_vocab_slice_kernel<<<static_cast<unsigned>(n), 256, 0, stream>>>(
      table.data, table.dtype == DType::kBF16, table.rows, hidden, vocab_begin, vocab_size, ids,
      out);
  M3_CUDA_CHECK_LAUNCH("embedding_vocab_slice_kernel");
}

}  // namespace m3::kernels::cuda
