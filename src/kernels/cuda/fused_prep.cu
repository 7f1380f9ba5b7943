// Fused per-layer preparation ops (declared in kernels/cuda/fused.h): the residual add fused with
// the next Gemma RMSNorm, and QK-norm + partial NeoX RoPE + the K / V / index-K page writes of
// one attention layer in one launch. Each computes what the CPU ops compute one after another
// (rmsnorm_gemma, rope_neox, kv_write: same fp32 formulas term by term), so it is tested against
// that sequence; fusing saves the launches and activation round trips of decode steps.
#include <algorithm>
#include <cmath>

#include "kernels/cuda/attn_common.cuh"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/fused.h"
#include "kernels/cuda/kv_format.cuh"

namespace m3::kernels::cuda {

namespace {

using detail::block_sum;
using detail::load_weight;

constexpr int kAddNormThreads = 256;
constexpr int kPrepThreads = 128;
constexpr int64_t kMaxPrepDim = 512;

__global__ void __launch_bounds__(kAddNormThreads)
    add_rmsnorm_kernel(float* x, const float* __restrict__ y, int64_t dim,
                       const void* __restrict__ w, bool w_bf16, float eps, float* out) {
  __shared__ float red[32];
  float* xr = x + blockIdx.x * dim;
  const float* yr = y + blockIdx.x * dim;
  float* o = out + blockIdx.x * dim;
  float ss = 0.f;
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) {
    const float v = xr[i] + yr[i];  // the residual add (cuda_add_inplace's x += y)
    xr[i] = v;
    ss = fmaf(v, v, ss);
  }
  ss = block_sum(ss, red);
  const float inv = 1.0f / sqrtf(ss / static_cast<float>(dim) + eps);
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x)
    o[i] = (xr[i] * inv) * (1.0f + load_weight(w, w_bf16, i));
}

__global__ void __launch_bounds__(detail::kRowThreadsMax)
    add_rmsnorm_vec_kernel(float* x, const float* __restrict__ y, int64_t dim,
                           const void* __restrict__ w, bool w_bf16, float eps, float* out) {
  __shared__ float red[32];
  detail::pdl_enter();
  const int64_t r = blockIdx.x;
  detail::rmsnorm_row_vec<true>(x + r * dim, y + r * dim, dim, w, w_bf16, eps, out + r * dim, red);
}

struct Freqs {
  float head[kMaxRopeHalf];
  float index[kMaxRopeHalf];
  float af = 1.f;  // YaRN's attention factor on cos and sin (1 without scaling)
};

// One vector of `dim` floats: Gemma RMSNorm with `w` (none when w is null: a layer without
// QK-norm, e.g. an EAGLE-3 draft's), then RoPE over its first `rot` dims at position p; element i
// of the result goes to emit(i, value) (dst may alias src).
template <class Emit>
__device__ void norm_rope(const float* src, int64_t dim, const void* w, bool w_bf16, float eps,
                          int64_t rot, const float* inv_freq, float af, float p, float* buf,
                          float* red, Emit emit) {
  if (w == nullptr) {  // uniform over the block
    for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) buf[i] = src[i];
  } else {
    float ss = 0.f;
    for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) {
      const float v = src[i];
      ss = fmaf(v, v, ss);
    }
    ss = block_sum(ss, red);
    const float inv = 1.0f / sqrtf(ss / static_cast<float>(dim) + eps);
    for (int64_t i = threadIdx.x; i < dim; i += blockDim.x)
      buf[i] = (src[i] * inv) * (1.0f + load_weight(w, w_bf16, i));
  }
  __syncthreads();
  const int64_t half = rot / 2;
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) {
    float r = buf[i];
    if (i < half) {
      const float a = p * inv_freq[i];
      r = buf[i] * (cosf(a) * af) - buf[i + half] * (sinf(a) * af);
    } else if (i < rot) {
      const float a = p * inv_freq[i - half];
      r = buf[i] * (cosf(a) * af) + buf[i - half] * (sinf(a) * af);
    }
    emit(i, r);
  }
  __syncthreads();  // buf is reused by the caller's next vector
}

// Element i of a cache array of format `dt`: x stored as kv_write stores it (docs/KV_CACHE.md).
__device__ __forceinline__ void store_elem(void* base, KvDtype dt, int64_t i, float x, float inv) {
  switch (dt) {
    case KvDtype::kF32:
      static_cast<float*>(base)[i] = x;
      return;
    case KvDtype::kBf16:
      static_cast<uint16_t*>(base)[i] = detail::f32_to_bf16_bits(x);
      return;
    case KvDtype::kFp8:
      static_cast<uint8_t*>(base)[i] = detail::f32_to_fp8(x * inv);
      return;
  }
}

// inv_k / inv_v: 1 / k_scale, 1 / v_scale (host fp32) for an fp8 cache.
__global__ void __launch_bounds__(kPrepThreads)
    attn_prep_kernel(AttnPrepArgs a, KvPages c, TokenLayout L, const Freqs f, float inv_k,
                     float inv_v) {
  __shared__ float red[32];
  __shared__ float buf[kMaxPrepDim];
  __shared__ float row[kMaxPrepDim];
  detail::pdl_enter();
  const int64_t t = blockIdx.x;
  const int64_t slot_kind = blockIdx.y;
  const float p = static_cast<float>(L.positions[t]);
  const int64_t d = a.head_dim;
  const int64_t nq = a.num_q_heads, nkv = a.num_kv_heads, ni = a.num_index_heads;
  const int64_t di = a.index_dim;
  // Row starts of this token's inputs (packed per tensor, or one fused projection row).
  const int64_t qs = a.in_stride ? a.in_stride : nq * d, ks = a.in_stride ? a.in_stride : nkv * d,
                iqs = a.in_stride ? a.in_stride : ni * di, iks = a.in_stride ? a.in_stride : di;
  if (slot_kind < nq) {  // a query head
    float* dst = a.q_out + (t * nq + slot_kind) * d;
    norm_rope(a.q + t * qs + slot_kind * d, d, a.q_norm.data, a.q_norm.dtype == DType::kBF16, a.eps,
              a.rot_dim, f.head, f.af, p, buf, red, [&](int64_t i, float r) { dst[i] = r; });
    return;
  }
  if (slot_kind < nq + ni) {  // an index query head
    const int64_t h = slot_kind - nq;
    float* dst = a.iq_out + (t * ni + h) * di;
    norm_rope(a.iq + t * iqs + h * di, di, a.iq_norm.data, a.iq_norm.dtype == DType::kBF16, a.eps,
              a.index_rot_dim, f.index, f.af, p, buf, red, [&](int64_t i, float r) { dst[i] = r; });
    return;
  }
  // K head h (and V head h), or the index-K row: into the token's page slot (kv_write's math).
  const int32_t s = L.seq_ids[t], pos = L.positions[t];
  const int64_t nblk = L.block_table_offsets[s + 1] - L.block_table_offsets[s];
  M3_DEVICE_CHECK(pos >= 0 && pos / c.page_size < nblk,
                  "attn_prep: position %d beyond the block table (%lld pages)", pos,
                  static_cast<long long>(nblk));
  const int32_t page = L.block_table[L.block_table_offsets[s] + pos / c.page_size];
  M3_DEVICE_CHECK(page >= 0 && page < c.num_pages, "attn_prep: page %d out of range", page);
  const int64_t slot = static_cast<int64_t>(page) * c.page_size + pos % c.page_size;
  const int64_t h = slot_kind - nq - ni;
  if (h < nkv) {
    const int64_t at = slot * nkv * d + h * d;
    norm_rope(a.k + t * ks + h * d, d, a.k_norm.data, a.k_norm.dtype == DType::kBF16, a.eps,
              a.rot_dim, f.head, f.af, p, buf, red,
              [&](int64_t i, float r) { store_elem(c.k, c.kv_dtype, at + i, r, inv_k); });
    for (int64_t i = threadIdx.x; i < d; i += blockDim.x)
      store_elem(c.v, c.kv_dtype, at + i, a.v[t * ks + h * d + i], inv_v);
    return;
  }
  // The index-K row: an fp8 row first gets its per-token power-of-two scale (kv_write's rule).
  norm_rope(a.ik + t * iks, di, a.ik_norm.data, a.ik_norm.dtype == DType::kBF16, a.eps,
            a.index_rot_dim, f.index, f.af, p, buf, red, [&](int64_t i, float r) { row[i] = r; });
  float inv = 1.f;
  if (c.ik_dtype == KvDtype::kFp8) {
    float amax = 0.f;
    for (int64_t i = threadIdx.x; i < di; i += blockDim.x) amax = fmaxf(amax, fabsf(row[i]));
    amax = detail::block_max(amax, red);
    const float sc = fp8_row_scale(amax);
    if (threadIdx.x == 0) c.ik_scale[slot] = sc;
    inv = 1.0f / sc;  // a power of two: exact
  }
  for (int64_t i = threadIdx.x; i < di; i += blockDim.x)
    store_elem(c.ik, c.ik_dtype, slot * di + i, row[i], inv);
}

__global__ void swiglu_rows_kernel(const float* __restrict__ gu, int64_t n, int64_t inter,
                                   float alpha, float limit, float beta, float* __restrict__ out) {
  const int64_t total = n * inter;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
       e += stride) {
    const int64_t t = e / inter, i = e % inter;
    const float g = gu[t * 2 * inter + i], u = gu[t * 2 * inter + inter + i];
    // swiglu_oai's formula term by term (norm_rope_mlp.cu).
    const float gc = limit < g ? limit : g;
    const float uc = u < -limit ? -limit : (limit < u ? limit : u);
    const float glu = gc * (1.0f / (1.0f + expf(-alpha * gc)));
    out[e] = (uc + beta) * glu;
  }
}

void fill_freqs(float* out, int64_t rot, double theta, const RopeScaling& scaling) {
  // Exactly the CPU op's fp32 formula (the same host function and libm), so angles match bit for
  // bit.
  rope_inv_freq(theta, scaling, rot, out);
}

}  // namespace

void add_rmsnorm_gemma(float* x, const float* y, int64_t rows, int64_t dim, const VecRef& w,
                       float eps, float* out, cudaStream_t stream) {
  M3_CHECK(w.n == dim, "cuda::add_rmsnorm: weight has %lld entries, dim %lld",
           static_cast<long long>(w.n), static_cast<long long>(dim));
  if (rows == 0) return;
  M3_CHECK(rows <= 0x7fffffff);
  if (detail::norm_row_fits(dim, x, y, out)) {
    detail::launch_pdl(add_rmsnorm_vec_kernel, dim3(static_cast<unsigned>(rows)),
                       dim3(detail::norm_row_threads(dim)), 0, stream, x, y, dim, w.data,
                       w.dtype == DType::kBF16, eps, out);
    return;
  }
  add_rmsnorm_kernel<<<static_cast<unsigned>(rows), kAddNormThreads, 0, stream>>>(
      x, y, dim, w.data, w.dtype == DType::kBF16, eps, out);
  M3_CUDA_CHECK_LAUNCH("add_rmsnorm_kernel");
}

void attn_prep(const AttnPrepArgs& a, const KvPages& cache, const TokenLayout& layout,
               cudaStream_t stream) {
  M3_CHECK(a.head_dim <= kMaxPrepDim && a.index_dim <= kMaxPrepDim,
           "attn_prep: head dims %lld/%lld", static_cast<long long>(a.head_dim),
           static_cast<long long>(a.index_dim));
  M3_CHECK(a.rot_dim % 2 == 0 && a.rot_dim <= a.head_dim && a.rot_dim / 2 <= kMaxRopeHalf);
  // QK-norm weights of head_dim each, or none at all (the CPU op's rule).
  const bool qk_norm = a.q_norm.n != 0 || a.k_norm.n != 0;
  M3_CHECK(!qk_norm || (a.q_norm.n == a.head_dim && a.k_norm.n == a.head_dim),
           "attn_prep: q/k norm weights of %lld/%lld entries for head_dim %lld",
           static_cast<long long>(a.q_norm.n), static_cast<long long>(a.k_norm.n),
           static_cast<long long>(a.head_dim));
  M3_CHECK(cache.num_kv_heads == a.num_kv_heads && cache.head_dim == a.head_dim);
  M3_CHECK(a.q != nullptr && a.q_out != nullptr && a.k != nullptr && a.v != nullptr);
  // In place only when packed: a fused row would be overwritten while other blocks read it.
  M3_CHECK(a.in_stride == 0 || (a.q_out != a.q && (a.num_index_heads == 0 || a.iq_out != a.iq)),
           "attn_prep: fused-row inputs need separate outputs");
  const bool index = a.num_index_heads > 0;
  if (index) {
    M3_CHECK(a.iq != nullptr && a.iq_out != nullptr && a.ik != nullptr && cache.ik != nullptr &&
                 cache.index_dim == a.index_dim,
             "attn_prep: index projections without an index-K cache");
    M3_CHECK(cache.ik_dtype != KvDtype::kFp8 || cache.ik_scale != nullptr,
             "attn_prep: an fp8 index-K needs its scale array");
    M3_CHECK(a.index_rot_dim % 2 == 0 && a.index_rot_dim <= a.index_dim &&
             a.index_rot_dim / 2 <= kMaxRopeHalf);
    M3_CHECK(a.iq_norm.n == a.index_dim && a.ik_norm.n == a.index_dim);
  }
  if (layout.num_tokens == 0) return;
  M3_CHECK(layout.num_tokens <= 0x7fffffff);
  Freqs f{};
  fill_freqs(f.head, a.rot_dim, a.theta, a.scaling);
  if (index) fill_freqs(f.index, a.index_rot_dim, a.theta, a.scaling);
  f.af = a.scaling.active() ? a.scaling.attention_factor : 1.0f;
  const int64_t slots = a.num_q_heads + a.num_kv_heads + (index ? a.num_index_heads + 1 : 0);
  AttnPrepArgs args = a;
  if (!index) args.num_index_heads = 0;
  if (!qk_norm) args.q_norm.data = args.k_norm.data = nullptr;  // norm_rope skips the norm
  detail::launch_pdl(attn_prep_kernel,
                     dim3(static_cast<unsigned>(layout.num_tokens), static_cast<unsigned>(slots)),
                     dim3(kPrepThreads), 0, stream, args, cache, layout, f, 1.0f / cache.k_scale,
                     1.0f / cache.v_scale);
}

void swiglu_oai_rows(const float* gate_up, int64_t n, int64_t inter, float alpha, float limit,
                     float beta, float* out, cudaStream_t stream) {
  const int64_t total = n * inter;
  if (total == 0) return;
  const int64_t blocks = std::min<int64_t>((total + 255) / 256, 132 * 32);
  swiglu_rows_kernel<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(gate_up, n, inter, alpha,
                                                                        limit, beta, out);
  M3_CUDA_CHECK_LAUNCH("swiglu_rows_kernel");
}

}  // namespace m3::kernels::cuda
