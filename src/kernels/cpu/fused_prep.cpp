// The fused CPU ops (fused.h), each composed of the plain reference ops.
#include "kernels/cpu/fused.h"

#include <algorithm>
#include <vector>

#include "core/check.h"

namespace m3::kernels::cpu {

namespace {
// rows of `width` floats, `stride` apart in src (0: packed), packed into dst.
void pack_rows(const float* src, int64_t stride, int64_t rows, int64_t width, float* dst) {
  if (stride == 0 || stride == width) {
    if (src != dst) std::copy(src, src + rows * width, dst);
    return;
  }
  for (int64_t r = 0; r < rows; ++r) std::copy_n(src + r * stride, width, dst + r * width);
}
}  // namespace

void add_rmsnorm_gemma(float* x, const float* y, int64_t rows, int64_t dim, const VecRef& w,
                       float eps, float* out) {
  M3_CHECK(out != x, "add_rmsnorm_gemma: out must not alias x");
  add_inplace(x, y, rows * dim);
  rmsnorm_gemma(x, rows, dim, w, eps, out);
}

void attn_prep(const AttnPrepArgs& a, const KvPages& cache, const TokenLayout& layout) {
  const int64_t T = layout.num_tokens, d = a.head_dim;
  M3_CHECK(a.q_out != nullptr && a.num_q_heads > 0 && a.num_kv_heads > 0);
  M3_CHECK(cache.num_kv_heads == a.num_kv_heads && cache.head_dim == d,
           "attn_prep: the cache holds %lld KV heads of %lld, the step %lld of %lld",
           static_cast<long long>(cache.num_kv_heads), static_cast<long long>(cache.head_dim),
           static_cast<long long>(a.num_kv_heads), static_cast<long long>(d));
  // Both norms empty: heads without QK-norm (a Llama draft layer); else both of head_dim.
  const bool qk_norm = a.q_norm.n != 0 || a.k_norm.n != 0;
  M3_CHECK(!qk_norm || (a.q_norm.n == d && a.k_norm.n == d),
           "attn_prep: q/k norm weights of %lld / %lld for "
           "head_dim %lld",
           static_cast<long long>(a.q_norm.n), static_cast<long long>(a.k_norm.n),
           static_cast<long long>(d));
  M3_CHECK(a.rot_dim >= 0 && a.rot_dim <= d && a.rot_dim % 2 == 0, "attn_prep: rot_dim %lld",
           static_cast<long long>(a.rot_dim));
  M3_CHECK(a.in_stride == 0 || a.q_out != a.q, "attn_prep: strided q needs a separate q_out");
  M3_CHECK(a.num_index_heads == 0 || (cache.ik != nullptr && cache.index_dim == a.index_dim &&
                                      a.index_rot_dim >= 0 && a.index_rot_dim <= a.index_dim),
           "attn_prep: index heads need index-K pages of dim %lld",
           static_cast<long long>(a.index_dim));
  // q: [T, nq, d] -> q_out, normed per head and rotated.
  pack_rows(a.q, a.in_stride, T, a.num_q_heads * d, a.q_out);
  if (qk_norm) rmsnorm_gemma(a.q_out, T * a.num_q_heads, d, a.q_norm, a.eps, a.q_out);
  rope_neox(a.q_out, T, a.num_q_heads, d, a.rot_dim, layout.positions, a.theta, a.scaling);
  // k: [T, nkv, d] normed and rotated; v: [T, nkv, d] as is; both into the pages.
  std::vector<float> k(T * a.num_kv_heads * d), v(T * a.num_kv_heads * d), ik;
  pack_rows(a.k, a.in_stride, T, a.num_kv_heads * d, k.data());
  pack_rows(a.v, a.in_stride, T, a.num_kv_heads * d, v.data());
  if (qk_norm) rmsnorm_gemma(k.data(), T * a.num_kv_heads, d, a.k_norm, a.eps, k.data());
  rope_neox(k.data(), T, a.num_kv_heads, d, a.rot_dim, layout.positions, a.theta, a.scaling);
  if (a.num_index_heads > 0) {
    const int64_t ni = a.num_index_heads, di = a.index_dim;
    M3_CHECK(a.iq != nullptr && a.iq_out != nullptr && a.ik != nullptr);
    pack_rows(a.iq, a.in_stride, T, ni * di, a.iq_out);
    rmsnorm_gemma(a.iq_out, T * ni, di, a.iq_norm, a.eps, a.iq_out);
    rope_neox(a.iq_out, T, ni, di, a.index_rot_dim, layout.positions, a.theta, a.scaling);
    ik.resize(T * di);  // one shared index-K head
    pack_rows(a.ik, a.in_stride, T, di, ik.data());
    rmsnorm_gemma(ik.data(), T, di, a.ik_norm, a.eps, ik.data());
    rope_neox(ik.data(), T, 1, di, a.index_rot_dim, layout.positions, a.theta, a.scaling);
  }
  kv_write(cache, layout, k.data(), v.data(), ik.empty() ? nullptr : ik.data());
}

void swiglu_oai_rows(const float* gate_up, int64_t n, int64_t inter, float alpha, float limit,
                     float beta, float* out) {
  std::vector<float> g(n * inter), u(n * inter);
  for (int64_t t = 0; t < n; ++t) {
    std::copy_n(gate_up + t * 2 * inter, inter, g.begin() + t * inter);
    std::copy_n(gate_up + t * 2 * inter + inter, inter, u.begin() + t * inter);
  }
  swiglu_oai(g.data(), u.data(), n, inter, alpha, limit, beta, out);
}

}  // namespace m3::kernels::cpu
