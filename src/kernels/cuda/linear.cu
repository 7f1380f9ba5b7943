// linear (fp32 activations × bf16/f32 weights -> fp32) and embedding. linear picks its engine
// by token count: up to blas::kGemvMaxTokens the bandwidth-bound GEMV (gemv.cuh, exact fp32
// arithmetic), above it cuBLASLt (blas.cu, under the GEMM precision); a tiled SIMT GEMM serves
// every layout neither can read (cols not a multiple of the 16-byte vector, misaligned data).
#include <algorithm>
#include <type_traits>

#include "kernels/cuda/blas.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/gemv.cuh"
#include "kernels/cuda/ops.h"

namespace m3::kernels::cuda {

namespace {

using detail::ceil_div;
using detail::load_weight;

// Tile: kTileT tokens × kTileR weight rows per block, kTileK of the reduction dim per step;
// 256 threads as 16 × 16, each owning a 4 × 4 patch of outputs.
constexpr int kTileT = 64, kTileR = 64, kTileK = 16, kLinearThreads = 256, kPatch = 4;
static_assert(kTileT * kTileK == kLinearThreads * 4 && kTileR * kTileK == kLinearThreads * 4);
static_assert(kTileT == 16 * kPatch && kTileR == 16 * kPatch);

__global__ void __launch_bounds__(kLinearThreads)
    linear_kernel(const float* __restrict__ x, const void* __restrict__ w, bool w_bf16,
                  float* __restrict__ y, int64_t n, int64_t m, int64_t k) {
  // Stored k-major so the inner loop reads 4 consecutive tokens / rows per step; +4 pads rows.
  __shared__ float xs[kTileK][kTileT + 4];
  __shared__ float ws[kTileK][kTileR + 4];
  const int64_t t0 = static_cast<int64_t>(blockIdx.y) * kTileT;
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * kTileR;
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  float acc[kPatch][kPatch];
#pragma unroll
  for (int i = 0; i < kPatch; ++i)
#pragma unroll
    for (int j = 0; j < kPatch; ++j) acc[i][j] = 0.f;

  for (int64_t k0 = 0; k0 < k; k0 += kTileK) {
#pragma unroll
    for (int l = 0; l < 4; ++l) {
      const int e = threadIdx.x + l * kLinearThreads;
      const int row = e / kTileK, kk = e % kTileK;
      const int64_t gk = k0 + kk;
      const int64_t gt = t0 + row, gr = r0 + row;
      xs[kk][row] = (gt < n && gk < k) ? x[gt * k + gk] : 0.f;
      ws[kk][row] = (gr < m && gk < k) ? load_weight(w, w_bf16, gr * k + gk) : 0.f;
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kTileK; ++kk) {
      float a[kPatch], b[kPatch];
#pragma unroll
      for (int i = 0; i < kPatch; ++i) a[i] = xs[kk][ty * kPatch + i];
#pragma unroll
      for (int j = 0; j < kPatch; ++j) b[j] = ws[kk][tx * kPatch + j];
#pragma unroll
      for (int i = 0; i < kPatch; ++i)
#pragma unroll
        for (int j = 0; j < kPatch; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < kPatch; ++i) {
    const int64_t t = t0 + ty * kPatch + i;
    if (t >= n) continue;
#pragma unroll
    for (int j = 0; j < kPatch; ++j) {
      const int64_t r = r0 + tx * kPatch + j;
      if (r < m) y[t * m + r] = acc[i][j];
    }
  }
}

__global__ void embedding_kernel(const void* __restrict__ table, bool bf16, int64_t rows,
                                 int64_t cols, const int32_t* __restrict__ ids,
                                 float* __restrict__ out) {
  const int64_t t = blockIdx.x;
  const int32_t id = ids[t];
  M3_DEVICE_CHECK(id >= 0 && id < rows, "embedding id %d out of range [0, %lld)", id,
                  static_cast<long long>(rows));
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x)
    out[t * cols + c] = load_weight(table, bf16, static_cast<int64_t>(id) * cols + c);
}

// Rows of 8 columns per thread (one 16-byte bf16 load or two f32 ones), blockIdx.y the column
// chunk: a decode step's few rows spread over several CTAs with every load in flight at once.
__global__ void embedding_vec_kernel(const void* __restrict__ table, bool bf16, int64_t rows,
                                     int64_t cols, const int32_t* __restrict__ ids,
                                     float* __restrict__ out) {
  detail::pdl_enter();
  const int64_t t = blockIdx.x;
  const int32_t id = ids[t];
  M3_DEVICE_CHECK(id >= 0 && id < rows, "embedding id %d out of range [0, %lld)", id,
                  static_cast<long long>(rows));
  const int64_t c = (static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x) * 8;
  if (c >= cols) return;
  const int64_t src = static_cast<int64_t>(id) * cols + c;
  float4 a, b;
  if (bf16) {
    const uint4 r = *reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(table) + src);
    a = make_float4(__uint_as_float(r.x << 16), __uint_as_float(r.x & 0xffff0000u),
                    __uint_as_float(r.y << 16), __uint_as_float(r.y & 0xffff0000u));
    b = make_float4(__uint_as_float(r.z << 16), __uint_as_float(r.z & 0xffff0000u),
                    __uint_as_float(r.w << 16), __uint_as_float(r.w & 0xffff0000u));
  } else {
    const float4* f = reinterpret_cast<const float4*>(static_cast<const float*>(table) + src);
    a = f[0];
    b = f[1];
  }
  float4* o = reinterpret_cast<float4*>(out + t * cols + c);
  o[0] = a;
  o[1] = b;
}

void check_dtype(const MatRef& w, const char* op) {
  M3_CHECK(w.dtype == DType::kBF16 || w.dtype == DType::kF32, "%s: weight dtype %s", op,
           dtype_name(w.dtype));
}

}  // namespace

namespace {

__global__ void splitk_sum_kernel(const float* __restrict__ part, int splits, int64_t count,
                                  float* __restrict__ y) {
  detail::pdl_enter();
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += stride) {
    float s = part[i];
    for (int z = 1; z < splits; ++z) s += part[z * count + i];
    y[i] = s;
  }
}

void linear_simt(const float* x, int64_t n, const MatRef& w, float* y, cudaStream_t stream) {
  M3_CHECK(ceil_div(n, kTileT) <= 65535u, "cuda::linear: %lld tokens is too many for one call",
           static_cast<long long>(n));
  const dim3 grid(ceil_div(w.rows, kTileR), ceil_div(n, kTileT));
  linear_kernel<<<grid, kLinearThreads, 0, stream>>>(x, w.data, w.dtype == DType::kBF16, y, n,
                                                     w.rows, w.cols);
  M3_CUDA_CHECK_LAUNCH("linear_kernel");
}

bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

// The streaming GEMV (gemv.cuh stream_kernel) for one token over a bf16 matrix whose rows fill
// the SMs; false where it does not apply (the caller runs gemv_kernel).
bool linear_stream(const float* x, const MatRef& w, float* y, cudaStream_t stream) {
  const int64_t k = w.cols;
  if (!gemv::stream_on() || k > gemv::kStreamMaxK) return false;
  gemv::StreamParams p;
  p.x = x;
  p.w = static_cast<const uint16_t*>(w.data);
  p.y = y;
  p.m = w.rows;
  p.k = k;
  p.kpad = static_cast<int>((k + gemv::kStreamChunk - 1) / gemv::kStreamChunk * gemv::kStreamChunk);
  p.stages = gemv::stream_stages(p.kpad);
  if (p.stages == 0) return false;
  gemv::stream_launch(p, stream);
  return true;
}

template <class W>
void linear_gemv(const float* x, int64_t n, const MatRef& w, float* y, cudaStream_t stream) {
  constexpr int kRows = gemv::kLoadRows;
  const int64_t m = w.rows, k = w.cols, unit = gemv::k_unit<W>();
  const int sms = blas::num_sms();
  // Few rows (the router): smaller CTAs, then split k so that about 2 CTAs per SM run. The
  // choice depends on (m, k) only, so a token's result does not depend on n.
  int warps = gemv::kThreads / 32;
  while (warps > 2 && static_cast<int64_t>(ceil_div(m, warps * kRows)) < sms) warps /= 2;
  if (static_cast<int64_t>(ceil_div(m, warps * kRows)) >= sms) {
    if (gemv::linear_warps() > 0)
      warps = gemv::linear_warps();
    else if (gemv::balance_on())
      warps = gemv::balanced_warps(ceil_div(m, kRows), sms, warps);
  }
  const int64_t ctas = ceil_div(m, warps * kRows);
  int64_t splits = 1;
  if (ctas < sms)
    splits = std::clamp<int64_t>((2 * sms + ctas - 1) / ctas, 1, std::max<int64_t>(1, k / unit));
  int64_t k_split = (k + splits - 1) / splits;
  k_split = (k_split + unit - 1) / unit * unit;
  splits = (k + k_split - 1) / k_split;

  if constexpr (std::is_same_v<W, uint16_t>) {
    if (n == 1 && splits == 1 && linear_stream(x, w, y, stream)) return;
  }
  const int nt = gemv::nt_bucket(n);
  gemv::Params p;
  p.x = x;
  p.w = w.data;
  p.m = m;
  p.k = k;
  p.n = n;
  p.k_split = k_split;
  p.kc = gemv::chunk_k<W>(nt, k_split);
  float* part = nullptr;
  if (splits > 1) {
    part = static_cast<float*>(blas::pool_alloc(splits * n * m * sizeof(float), stream));
    p.y = part;
    p.y_split_stride = n * m;
  } else {
    p.y = y;
  }
  M3_CHECK(splits <= 65535);
  gemv::launch<W, false>(p, nt, dim3(static_cast<unsigned>(ctas), 1, static_cast<unsigned>(splits)),
                         warps * 32, stream);
  if (part != nullptr) {
    const int64_t count = n * m;
    const int64_t blocks = std::min<int64_t>((count + 255) / 256, 4096);
    detail::launch_pdl(splitk_sum_kernel, dim3(static_cast<unsigned>(blocks)), dim3(256), 0, stream,
                       part, static_cast<int>(splits), count, y);
    blas::pool_free(part, stream);
  }
}

}  // namespace

namespace blas {

bool gemv_supports(const MatRef& w) {
  const int64_t vec = w.dtype == DType::kBF16 ? 8 : 4;
  return (w.dtype == DType::kBF16 || w.dtype == DType::kF32) && w.cols > 0 && w.cols % vec == 0 &&
         aligned16(w.data);
}

LinearPath auto_path(int64_t n, const MatRef& w) {
  return n <= kGemvMaxTokens && gemv_supports(w) ? LinearPath::kGemv : LinearPath::kGemm;
}

void linear_with(LinearPath path, const float* x, int64_t n, const MatRef& w, float* y,
                 cudaStream_t stream) {
  check_dtype(w, "cuda::linear");
  if (n == 0 || w.rows == 0) return;
  if (path == LinearPath::kAuto) path = auto_path(n, w);
  if (path == LinearPath::kGemv && gemv_supports(w) && aligned16(x)) {
    if (w.dtype == DType::kBF16)
      linear_gemv<uint16_t>(x, n, w, y, stream);
    else
      linear_gemv<float>(x, n, w, y, stream);
    return;
  }
  const bool lt_layout = w.cols > 0 && (w.dtype == DType::kF32 || w.cols % 8 == 0);
  if (path == LinearPath::kGemm && lt_layout && gemm(x, n, w, y, stream)) return;
  linear_simt(x, n, w, y, stream);
}

}  // namespace blas

void linear(const float* x, int64_t n, const MatRef& w, float* y, cudaStream_t stream) {
  blas::linear_with(blas::LinearPath::kAuto, x, n, w, y, stream);
}

void embedding(const MatRef& table, const int32_t* ids, int64_t n, float* out,
               cudaStream_t stream) {
  check_dtype(table, "cuda::embedding");
  if (n == 0) return;
  M3_CHECK(n <= 0x7fffffff, "cuda::embedding: %lld ids", static_cast<long long>(n));
  if (table.cols % 8 == 0 && aligned16(table.data) && aligned16(out)) {
    constexpr int kThreads = 256;
    const dim3 grid(static_cast<unsigned>(n), ceil_div(table.cols / 8, kThreads));
    detail::launch_pdl(embedding_vec_kernel, grid, dim3(kThreads), 0, stream, table.data,
                       table.dtype == DType::kBF16, table.rows, table.cols, ids, out);
    return;
  }
  embedding_kernel<<<static_cast<unsigned>(n), 256, 0, stream>>>(
      table.data, table.dtype == DType::kBF16, table.rows, table.cols, ids, out);
  M3_CUDA_CHECK_LAUNCH("embedding_kernel");
}

}  // namespace m3::kernels::cuda
