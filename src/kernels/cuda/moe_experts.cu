// The routed experts of an MoE layer on the GPU (moe_experts in ops.h): device-side grouping of
// the router's picks by expert, then grouped GEMVs (few tokens), grouped tensor-core GEMMs (many
// tokens under GemmPrecision::kBf16: moe_grouped.cu on mma.sync, moe_grouped_sm90.cu on
// wgmma/TMA from kMoeWgmmaMinTokens, moe_grouped_quant.cu for quantized experts), all without a
// host sync, or, for many
// tokens in the exact precision, one read-back of the per-expert counts and linear() per active
// expert over its gathered tokens. All end in the CPU model's combine order: routed = 0, then
// += weight * out per expert in ascending id; out = shared + routed.
#include <algorithm>
#include <vector>

#include "kernels/cuda/blas.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/gemv.cuh"
#include "kernels/cuda/moe_grouped.cuh"
#include "kernels/cuda/moe_grouped_quant.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/quant.h"
#include "kernels/cuda/quant_stream.cuh"

namespace m3::kernels::cuda {

namespace {

using detail::ceil_div;

constexpr int kRouteThreads = 1024;
constexpr int64_t kMaxExperts = 1024;  // the grouping kernel's per-warp counts live in smem
constexpr int64_t kMaxTopK = 16;       // the combine sorts a token's picks in registers

// Routing arrays at the start of the workspace; then the path's activations.
struct Layout {
  int32_t* offsets;     // [ne + 1] position ranges per expert
  int32_t* active;      // [ne] active expert ids, ascending
  int32_t* num_active;  // [1]
  int32_t* pair_token;  // [P] token of each position (positions sorted by expert, then token)
  float* pair_weight;   // [P] its routing weight
  int32_t* pair_pos;    // [P] position of pick (t, j) = ids[t * k + j]
  // few tokens (grouped GEMV); positions [P, P + n) are the shared expert's when it runs
  // inside the GEMVs (moe_experts_shared), token t at P + t
  float* act;  // [P + n, inter] swiglu(gate, up) per position
  float* ye;   // [P + n, hidden] expert output per position
  float* uq;   // [P, inter] up per position (quantized experts: gate and up run apart)
  // many tokens (per-expert linear)
  float* xe;      // [n, hidden] one expert's gathered tokens
  float* g;       // [n, inter]
  float* u;       // [n, inter]
  float* ye_e;    // [n, hidden]
  float* routed;  // [n, hidden]
  uint16_t* wdq;  // [max(inter, hidden) * min(inter, hidden)] one dequantised expert matrix
  // many tokens (grouped GEMMs; shares its memory with the per-expert buffers: a call uses one)
  uint16_t* xb;              // [n, hidden] bf16(x)
  uint16_t* act16;           // [P, inter] bf16 swiglu(gate, up) per position
  float* gye;                // [P, hidden] expert output per position
  moe_grouped::Tile* tiles;  // [max_tiles]
  int32_t* num_tiles;        // [1]
  // many tokens (the wgmma engine; overlays the same region as the two above)
  uint16_t* wact16;  // [P, inter] bf16 swiglu(gate, up) per position
  uint16_t* xg;      // [P, hidden] bf16 x gathered per position
  uint16_t* gu;      // [P, 2 inter] bf16 gate | up per position
  float* wye;        // [P, hidden] expert output per position (overlays xg and gu)
  void* sm90_ws;     // group arrays + CUTLASS's workspace
  size_t sm90_ws_bytes;
  size_t bytes;
};

Layout layout_for(void* base, int64_t n, int64_t k, const MoeExpertWeights& w) {
  Layout l{};
  const int64_t P = n * k, ne = w.num_experts;
  const bool few = n <= kMoeGemvMaxTokens;
  const bool quant = w.quant != WeightQuant::kNone;
  size_t off = 0;
  auto take = [&](size_t bytes) {
    void* p = base ? static_cast<uint8_t*>(base) + off : nullptr;
    off += (bytes + 255) / 256 * 256;
    return p;
  };
  l.offsets = static_cast<int32_t*>(take((ne + 1) * sizeof(int32_t)));
  l.active = static_cast<int32_t*>(take(ne * sizeof(int32_t)));
  l.num_active = static_cast<int32_t*>(take(sizeof(int32_t)));
  l.pair_token = static_cast<int32_t*>(take(P * sizeof(int32_t)));
  l.pair_weight = static_cast<float*>(take(P * sizeof(float)));
  l.pair_pos = static_cast<int32_t*>(take(P * sizeof(int32_t)));
  if (few) {
    l.act = static_cast<float*>(take((P + n) * w.inter * sizeof(float)));
    l.ye = static_cast<float*>(take((P + n) * w.hidden * sizeof(float)));
    if (quant) l.uq = static_cast<float*>(take(P * w.inter * sizeof(float)));
  }
  // The many-token buffers are always laid out: the few-token path falls back to them when the
  // GEMV cannot read the weights' layout. The grouped GEMMs' buffers overlay them (a call runs
  // one of the two), sized for one chunk of at most kMoeGroupedChunk tokens.
  const size_t region = off;
  l.xe = static_cast<float*>(take(n * w.hidden * sizeof(float)));
  l.g = static_cast<float*>(take(n * w.inter * sizeof(float)));
  l.u = static_cast<float*>(take(n * w.inter * sizeof(float)));
  l.ye_e = static_cast<float*>(take(n * w.hidden * sizeof(float)));
  l.routed = static_cast<float*>(take(n * w.hidden * sizeof(float)));
  if (quant) l.wdq = static_cast<uint16_t*>(take(w.inter * w.hidden * sizeof(uint16_t)));
  const size_t per_expert_end = off;
  off = region;
  const int64_t nc = std::min(n, kMoeGroupedChunk), Pc = nc * k;
  const int bm = quant ? moe_grouped::tile_rows_quant(Pc, ne) : moe_grouped::tile_rows(Pc, ne);
  l.xb = static_cast<uint16_t*>(take(nc * w.hidden * sizeof(uint16_t)));
  l.act16 = static_cast<uint16_t*>(take(Pc * w.inter * sizeof(uint16_t)));
  l.gye = static_cast<float*>(take(Pc * w.hidden * sizeof(float)));
  l.tiles = static_cast<moe_grouped::Tile*>(
      take(moe_grouped::max_tiles(Pc, ne, bm) * sizeof(moe_grouped::Tile)));
  l.num_tiles = static_cast<int32_t*>(take(sizeof(int32_t)));
  const size_t mma_end = off;
  off = region;
  if (moe_grouped::sm90_built()) {
    l.wact16 = static_cast<uint16_t*>(take(Pc * w.inter * sizeof(uint16_t)));
    const size_t overlay = off;
    l.xg = static_cast<uint16_t*>(take(Pc * w.hidden * sizeof(uint16_t)));
    l.gu = static_cast<uint16_t*>(take(Pc * 2 * w.inter * sizeof(uint16_t)));
    const size_t gathered_end = off;
    off = overlay;
    l.wye = static_cast<float*>(take(Pc * w.hidden * sizeof(float)));
    off = std::max(off, gathered_end);
    l.sm90_ws_bytes = moe_grouped::sm90_workspace_bytes(ne);
    l.sm90_ws = take(l.sm90_ws_bytes);
  }
  l.bytes = std::max({off, mma_end, per_expert_end});
  return l;
}

// Groups the P = n * k picks by expert with a stable counting sort in one CTA: counts, an
// exclusive scan into offsets (and the ascending list of active experts), then the picks in
// chunks of blockDim, each placed after the picks of earlier chunks, earlier warps
// (per-warp counts in smem) and earlier lanes (__match_any_sync) of the same expert.
__global__ void __launch_bounds__(kRouteThreads)
    moe_route_kernel(const int32_t* __restrict__ ids, const float* __restrict__ wts, int P, int k,
                     int ne, int32_t* __restrict__ offsets, int32_t* __restrict__ active,
                     int32_t* __restrict__ num_active, int32_t* __restrict__ pair_token,
                     float* __restrict__ pair_weight, int32_t* __restrict__ pair_pos) {
  extern __shared__ int32_t route_smem[];
  detail::pdl_enter();
  int32_t* cnt = route_smem;                                        // [ne]
  int32_t* base = route_smem + ne;                                  // [ne]
  uint8_t* wcnt = reinterpret_cast<uint8_t*>(route_smem + 2 * ne);  // [32 warps][ne]
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  for (int e = tid; e < ne; e += blockDim.x) cnt[e] = 0;
  for (int i = tid; i < 32 * ne; i += blockDim.x) wcnt[i] = 0;
  __syncthreads();
  for (int p = tid; p < P; p += blockDim.x) {
    const int e = ids[p];
    M3_DEVICE_CHECK(e >= -1 && e < ne, "moe: expert id %d of %d", e, ne);
    if (e >= 0) atomicAdd(&cnt[e], 1);  // -1: an expert of another rank (expert parallel)
  }
  __syncthreads();
  if (warp == 0) {
    // Lane l scans experts [lo, hi); a warp scan joins the lanes.
    const int per = (ne + 31) / 32, lo = min(ne, lane * per), hi = min(ne, lo + per);
    int local = 0, local_active = 0;
    for (int e = lo; e < hi; ++e) {
      local += cnt[e];
      local_active += cnt[e] > 0;
    }
    int incl = local, incl_active = local_active;
    for (int o = 1; o < 32; o <<= 1) {
      const int a = __shfl_up_sync(0xffffffffu, incl, o);
      const int b = __shfl_up_sync(0xffffffffu, incl_active, o);
      if (lane >= o) {
        incl += a;
        incl_active += b;
      }
    }
    int run = incl - local, run_active = incl_active - local_active;
    for (int e = lo; e < hi; ++e) {
      base[e] = run;
      offsets[e] = run;
      run += cnt[e];
      if (cnt[e] > 0) active[run_active++] = e;
    }
    if (lane == 31) {
      offsets[ne] = incl;
      *num_active = incl_active;
    }
  }
  __syncthreads();
  const unsigned lt_mask = (1u << lane) - 1u;
  for (int c = 0; c < P; c += blockDim.x) {
    const int p = c + tid;
    const int e = p < P ? ids[p] : -1;
    const bool valid = e >= 0;
    if (p < P && !valid) pair_pos[p] = -1;  // not this rank's: the combine skips it
    const unsigned peers = __match_any_sync(0xffffffffu, e);
    const int rank = __popc(peers & lt_mask);
    if (valid && rank == 0) wcnt[warp * ne + e] = static_cast<uint8_t>(__popc(peers));
    __syncthreads();
    int pos = 0;
    if (valid) {
      int pre = 0;
      for (int w = 0; w < warp; ++w) pre += wcnt[w * ne + e];
      pos = base[e] + pre + rank;
      pair_pos[p] = pos;
      pair_token[pos] = p / k;
      pair_weight[pos] = wts[p];
    }
    __syncthreads();
    if (valid) {
      atomicMax(&base[e], pos + 1);
      if (rank == 0) wcnt[warp * ne + e] = 0;
    }
    __syncthreads();
  }
}

// Token t's k pick positions in ascending order (insertion sort) into pos; returns the first
// index past the picks of other ranks' experts (pos -1, which sort first and are skipped).
__device__ __forceinline__ int sorted_picks(const int32_t* __restrict__ pair_pos, int64_t t, int k,
                                            int32_t (&pos)[kMaxTopK]) {
#pragma unroll
  for (int j = 0; j < kMaxTopK; ++j) {
    if (j >= k) break;
    const int32_t v = pair_pos[t * k + j];
    int i = j;
    while (i > 0 && pos[i - 1] > v) {
      pos[i] = pos[i - 1];
      --i;
    }
    pos[i] = v;
  }
  int first = 0;
  while (first < k && pos[first] < 0) ++first;
  return first;
}

// out[t] = shared[t] + Σ_j weight * ye[pos_j] over t's picks in ascending position (= ascending
// expert id). One CTA per token.
__global__ void moe_combine_kernel(const float* __restrict__ ye,
                                   const int32_t* __restrict__ pair_pos,
                                   const float* __restrict__ pair_weight, int k, int64_t hidden,
                                   const float* shared, float* out) {
  const int64_t t = blockIdx.x;
  int32_t pos[kMaxTopK];
  float wt[kMaxTopK];
  const int first = sorted_picks(pair_pos, t, k, pos);
  for (int j = first; j < k; ++j) wt[j] = pair_weight[pos[j]];
  for (int64_t c = threadIdx.x; c < hidden; c += blockDim.x) {
    float routed = 0.f;
    for (int j = first; j < k; ++j) routed += wt[j] * ye[pos[j] * hidden + c];
    out[t * hidden + c] = shared ? shared[t * hidden + c] + routed : routed;
  }
}

// The same with 4 columns per thread and blockIdx.y the column chunk (hidden % 4 == 0, 16-byte
// aligned rows): a decode step's few tokens spread over several CTAs. Same sums in the same
// order as moe_combine_kernel.
__global__ void moe_combine_vec_kernel(const float* __restrict__ ye,
                                       const int32_t* __restrict__ pair_pos,
                                       const float* __restrict__ pair_weight, int k, int64_t hidden,
                                       const float* shared, float* out) {
  detail::pdl_enter();
  const int64_t t = blockIdx.x;
  const int64_t c = (static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x) * 4;
  if (c >= hidden) return;
  int32_t pos[kMaxTopK];
  const int first = sorted_picks(pair_pos, t, k, pos);
  float4 routed = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int j = first; j < k; ++j) {
    const float wt = pair_weight[pos[j]];
    const float4 y = *reinterpret_cast<const float4*>(ye + pos[j] * hidden + c);
    routed.x += wt * y.x;
    routed.y += wt * y.y;
    routed.z += wt * y.z;
    routed.w += wt * y.w;
  }
  if (shared) {
    const float4 s = *reinterpret_cast<const float4*>(shared + t * hidden + c);
    routed = make_float4(s.x + routed.x, s.y + routed.y, s.z + routed.z, s.w + routed.w);
  }
  *reinterpret_cast<float4*>(out + t * hidden + c) = routed;
}

constexpr int kCombineThreads = 256;

// out = shared + Σ weight * ye over each token's picks, by the vector kernel when it can.
void combine(const float* ye, const Layout& l, int64_t n, int64_t k, int64_t hidden,
             const float* shared, float* out, cudaStream_t stream) {
  auto al = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  if (hidden % 4 == 0 && al(ye) && al(out) && (shared == nullptr || al(shared))) {
    const dim3 grid(static_cast<unsigned>(n), ceil_div(hidden / 4, kCombineThreads));
    detail::launch_pdl(moe_combine_vec_kernel, grid, dim3(kCombineThreads), 0, stream, ye,
                       l.pair_pos, l.pair_weight, static_cast<int>(k), hidden, shared, out);
    return;
  }
  moe_combine_kernel<<<static_cast<unsigned>(n), kCombineThreads, 0, stream>>>(
      ye, l.pair_pos, l.pair_weight, static_cast<int>(k), hidden, shared, out);
  M3_CUDA_CHECK_LAUNCH("moe_combine_kernel");
}

__global__ void gather_rows_kernel(const float* __restrict__ x, const int32_t* __restrict__ rows,
                                   int64_t cols, float* __restrict__ out) {
  const int64_t i = blockIdx.x;
  const float* src = x + static_cast<int64_t>(rows[i]) * cols;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) out[i * cols + c] = src[c];
}

// routed[rows[i]] += weight[i] * ye[i]; the rows of one expert are distinct (no races).
__global__ void scatter_add_rows_kernel(const float* __restrict__ ye,
                                        const int32_t* __restrict__ rows,
                                        const float* __restrict__ weight, int64_t cols,
                                        float* __restrict__ routed) {
  const int64_t i = blockIdx.x;
  float* dst = routed + static_cast<int64_t>(rows[i]) * cols;
  const float wgt = weight[i];
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) dst[c] += wgt * ye[i * cols + c];
}

__global__ void add_kernel(const float* shared, const float* __restrict__ routed, int64_t count,
                           float* out) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += step)
    out[i] = shared ? shared[i] + routed[i] : routed[i];
}

__global__ void swiglu_kernel(float* g, const float* __restrict__ u, int64_t count,
                              SwigluParams a) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += step)
    g[i] = gemv::swiglu_oai(g[i], u[i], a);
}

unsigned grid_for(int64_t count) {
  return static_cast<unsigned>(std::clamp<int64_t>((count + 255) / 256, 1, 4096));
}

cpu::MatRef expert_mat(const void* base, DType dt, int64_t e, int64_t rows, int64_t cols) {
  return cpu::MatRef{static_cast<const uint8_t*>(base) + e * rows * cols * dtype_size(dt), dt, rows,
                     cols};
}

// The grouped GEMVs: gate|up with SwiGLU-OAI fused, then down, over every active expert; with
// `s`, the shared expert too, as one more slot over all n tokens at positions [P, P + n). With
// `route` (P <= gemv::kRouteMaxPicks) the gate|up GEMV groups the picks ids / weights itself
// and writes the routing arrays for the down GEMV and the combine (no grouping kernel ran).
template <class W>
void experts_gemv(const float* x, int64_t n, int64_t k, const MoeExpertWeights& w,
                  const MoeSharedExpert* s, const SwigluParams& act, const Layout& l,
                  const int32_t* ids, const float* weights, bool route, cudaStream_t stream) {
  const int64_t P = n * k;
  const unsigned slots = static_cast<unsigned>(std::min(P, w.num_experts)) + (s ? 1 : 0);
  // Token groups sized for twice the mean tokens per expert, at most 8 (registers): most
  // experts then run one group; one with more tokens loops (re-reading its rows, mostly from L2).
  const int64_t mean2 = (2 * P + w.num_experts - 1) / w.num_experts;
  // The shared expert's slot holds all n tokens: its group covers them (n <= 2, see
  // moe_fuses_shared), so its weights are read once.
  const int nt =
      std::max(gemv::nt_bucket(std::min<int64_t>({n, mean2, 8})), s ? gemv::nt_bucket(n) : 1);
  const int warps = gemv::expert_warps();
  {
    gemv::Params p;
    p.x = x;
    p.x_rows = l.pair_token;
    p.w = w.w1;
    p.w_up = w.w3;
    p.w_stride = w.inter * w.hidden;
    p.m = w.inter;
    p.k = w.hidden;
    p.y = l.act;
    p.offsets = l.offsets;
    p.active = l.active;
    p.num_active = l.num_active;
    p.k_split = w.hidden;
    p.kc = gemv::chunk_k<W>(nt, w.hidden);
    p.act = act;
    if (s) {
      p.w_extra = s->gate.data;
      p.w_up_extra = s->up.data;
      p.extra_p0 = P;
      p.extra_n = n;
    }
    if (route) {
      p.route_ids = ids;
      p.route_wts = weights;
      p.route_p = static_cast<int>(P);
      p.route_k = static_cast<int>(k);
      p.route_ne = static_cast<int>(w.num_experts);
      p.route_out = {l.offsets, l.active, l.num_active, l.pair_token, l.pair_weight, l.pair_pos};
    }
    const unsigned tiles = ceil_div(w.inter, warps * gemv::kLoadRows / 2);
    gemv::launch<W, true>(p, nt, dim3(tiles, slots, 1), warps * 32, stream);
  }
  {
    gemv::Params p;
    p.x = l.act;
    p.w = w.w2;
    p.w_stride = w.hidden * w.inter;
    p.m = w.hidden;
    p.k = w.inter;
    p.y = l.ye;
    p.offsets = l.offsets;
    p.active = l.active;
    p.num_active = l.num_active;
    p.k_split = w.inter;
    p.kc = gemv::chunk_k<W>(nt, w.inter);
    if (s) {
      p.w_extra = s->down.data;
      p.extra_p0 = P;
      p.extra_n = n;
    }
    const unsigned tiles = ceil_div(w.hidden, warps * gemv::kLoadRows);
    gemv::launch<W, false>(p, nt, dim3(tiles, slots, 1), warps * 32, stream);
  }
}

bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

// Quantized experts (w.mats_of): every projection of the one format, in a layout the quantized
// GEMV reads.
bool quant_layout_ok(const float* x, const MoeExpertWeights& w) {
  for (int p = 0; p < 3; ++p) {
    const MatRef& m = w.mats_of[p];
    if (m.quant != w.quant || !quant_op_supported(m)) return false;
  }
  return aligned16(x);
}

bool gemv_layout_ok(const float* x, const MoeExpertWeights& w) {
  if (w.quant != WeightQuant::kNone) return quant_layout_ok(x, w);
  const int64_t vec = w.dtype == DType::kBF16 ? 8 : 4;
  return w.hidden % vec == 0 && w.inter % vec == 0 && aligned16(w.w1) && aligned16(w.w3) &&
         aligned16(w.w2) && aligned16(x);
}

// Projection `proj` (0 w1, 1 w3, 2 w2) of quantized experts as the grouped GEMV reads it; checks
// that the views lie back to back (codes and scales each at one stride).
QuantExperts quant_experts(const MoeExpertWeights& w, int proj) {
  QuantExperts q;
  q.first = w.mats_of[proj];
  const int64_t ne = w.num_experts;
  auto at = [](const void* p) { return reinterpret_cast<intptr_t>(p); };
  if (ne > 1) {
    q.data_stride = at(w.mats_of[3 + proj].data) - at(q.first.data);
    q.scale_stride = at(w.mats_of[3 + proj].scale) - at(q.first.scale);
  }
  bool same_global = true;
  for (int64_t e = 0; e < ne; ++e) {
    const MatRef& m = w.mats_of[3 * e + proj];
    M3_CHECK(m.quant == q.first.quant && m.rows == q.first.rows && m.cols == q.first.cols &&
                 at(m.data) == at(q.first.data) + e * q.data_stride &&
                 at(m.scale) == at(q.first.scale) + e * q.scale_stride,
             "moe_experts: quantized expert %lld (projection %d) is not laid out back to back "
             "with expert 0 (one format and shape, codes and scales at fixed strides)",
             static_cast<long long>(e), proj);
    same_global = same_global && m.global_scale == q.first.global_scale;
  }
  if (q.first.quant == WeightQuant::kNvfp4 && !same_global) {
    M3_CHECK(w.global_scales != nullptr,
             "moe_experts: NVFP4 experts with different global scales need global_scales");
    q.global_scales = w.global_scales + proj * ne;
  }
  return q;
}

// Whether the grouped tensor-core GEMMs read these quantized experts (moe_grouped_quant.cu):
// every projection back to back in one format (quant_experts' layout) in a shape they take.
bool quant_grouped_ok(const MoeExpertWeights& w) {
  if (w.quant == WeightQuant::kNone || w.mats_of == nullptr || w.w1_of != nullptr ||
      w.w3_of != nullptr || w.w2_of != nullptr)
    return false;
  for (int p = 0; p < 3; ++p) {
    const MatRef& m = w.mats_of[p];
    if (m.quant != w.quant || !quant_op_supported(m)) return false;
    if (!moe_grouped::supports_quant(quant_experts(w, p))) return false;
  }
  const MatRef &m1 = w.mats_of[0], &m3 = w.mats_of[1], &m2 = w.mats_of[2];
  return m1.rows == w.inter && m1.cols == w.hidden && m3.rows == w.inter && m3.cols == w.hidden &&
         m2.rows == w.hidden && m2.cols == w.inter;
}

// The grouped GEMV path over quantized experts: gate and up (two launches), swiglu, down.
void experts_gemv_quant(const float* x, int64_t n, int64_t k, const MoeExpertWeights& w,
                        const SwigluParams& act, const Layout& l, cudaStream_t stream);

void experts_gemv_quant(const float* x, int64_t n, int64_t k, const MoeExpertWeights& w,
                        const SwigluParams& act, const Layout& l, cudaStream_t stream) {
  const int64_t P = n * k;
  const int64_t slots = std::min(P, w.num_experts);
  // Position groups for twice the mean positions per expert, at most the GEMV's 4 (one pass
  // over an expert's weights serves that many; an expert with more loops, from L2 mostly).
  const int64_t mean2 = (2 * P + w.num_experts - 1) / w.num_experts;
  const int nt = gemv::nt_bucket(std::min<int64_t>({n, mean2, kGemvTokens}));
  const QuantExperts w1 = quant_experts(w, 0), w3 = quant_experts(w, 1), w2 = quant_experts(w, 2);
  // One token (one position per active expert): the streaming kernel, gate and up in one launch
  // over every active expert (quant_stream.cuh); the group kernels where it does not take them.
  const QuantExperts gu[2] = {w1, w3};
  float* const gu_y[2] = {l.act, l.uq};
  if (n != 1 || !qstream::grouped(x, l.pair_token, /*x_one_row=*/true, gu, gu_y, 2, l.offsets,
                                  l.active, l.num_active, slots, stream)) {
    gemv_quant_grouped(x, l.pair_token, w1, l.act, l.offsets, l.active, l.num_active, slots, nt,
                       stream);
    gemv_quant_grouped(x, l.pair_token, w3, l.uq, l.offsets, l.active, l.num_active, slots, nt,
                       stream);
  }
  swiglu_kernel<<<grid_for(P * w.inter), 256, 0, stream>>>(l.act, l.uq, P * w.inter, act);
  M3_CUDA_CHECK_LAUNCH("swiglu_kernel");
  float* const down_y[1] = {l.ye};
  if (n != 1 || !qstream::grouped(l.act, nullptr, /*x_one_row=*/false, &w2, down_y, 1, l.offsets,
                                  l.active, l.num_active, slots, stream))
    gemv_quant_grouped(l.act, nullptr, w2, l.ye, l.offsets, l.active, l.num_active, slots, nt,
                       stream);
}

}  // namespace

namespace {
__global__ void localize_ids_kernel(int32_t* ids, int64_t n, int64_t first, int64_t count) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const int64_t e = ids[i] - first;
  ids[i] = (e >= 0 && e < count) ? static_cast<int32_t>(e) : -1;
}
}  // namespace

void moe_localize_ids(int32_t* ids, int64_t n, int64_t first, int64_t count, cudaStream_t stream) {
  if (n == 0) return;
  localize_ids_kernel<<<static_cast<unsigned>((n + 255) / 256), 256, 0, stream>>>(ids, n, first,
                                                                                  count);
  M3_CUDA_CHECK_LAUNCH("localize_ids_kernel");
}

bool moe_experts_graph_safe(int64_t n, const float* x, const MoeExpertWeights& w) {
  const MoePath path = moe_path(n, w, x);
  return path == MoePath::kGemv || path == MoePath::kGrouped || path == MoePath::kGroupedWgmma;
}

bool moe_wgmma_available() {
  return moe_grouped::sm90_usable();
}

int quant_gemm_variants() {
  return 2;
}

void set_quant_gemm_variant(int v) {
  moe_grouped::set_quant_gemm_variant(v);
}

int quant_gemm_variant() {
  return moe_grouped::quant_gemm_variant();
}

int moe_wgmma_variants() {
  return moe_grouped::sm90_variants();
}

const char* moe_wgmma_variant_name(int v) {
  return moe_grouped::sm90_variant_name(v);
}

void set_moe_wgmma_variant(int v) {
  moe_grouped::set_sm90_variant(v);
}

MoePath moe_path(int64_t n, const MoeExpertWeights& w, const float* x) {
  if (w.quant != WeightQuant::kNone && gemm_precision() == GemmPrecision::kBf16 &&
      n >= kMoeGroupedMinTokens && quant_grouped_ok(w))
    return MoePath::kGrouped;
  const bool grouped = gemm_precision() == GemmPrecision::kBf16 && moe_grouped::supports(w);
  if (grouped && n >= kMoeWgmmaMinTokens && aligned16(x) && moe_wgmma_available())
    return MoePath::kGroupedWgmma;
  if (grouped && n >= kMoeGroupedMinTokens) return MoePath::kGrouped;
  if (n <= kMoeGemvMaxTokens && gemv_layout_ok(x, w)) return MoePath::kGemv;
  return grouped ? MoePath::kGrouped : MoePath::kPerExpert;
}

size_t moe_workspace_bytes(int64_t n, int64_t k, const MoeExpertWeights& w) {
  return layout_for(nullptr, n, k, w).bytes;
}

void moe_experts(const float* x, int64_t n, const int32_t* ids, const float* weights, int64_t k,
                 const MoeExpertWeights& w, const SwigluParams& act, const float* shared,
                 float* out, void* workspace, cudaStream_t stream) {
  moe_experts_with(MoePath::kAuto, x, n, ids, weights, k, w, act, shared, out, workspace, stream);
}

namespace {

// moe_experts_with, and with `sx` (the kGemv path only) the shared expert inside the GEMVs
// (then `shared` is null).
void run_moe(MoePath path, const float* x, int64_t n, const int32_t* ids, const float* weights,
             int64_t k, const MoeExpertWeights& w, const MoeSharedExpert* sx,
             const SwigluParams& act, const float* shared, float* out, void* workspace,
             cudaStream_t stream) {
  const bool quant = w.quant != WeightQuant::kNone;
  M3_CHECK(quant || w.dtype == DType::kBF16 || w.dtype == DType::kF32, "moe_experts: dtype %s",
           dtype_name(w.dtype));
  M3_CHECK(w.w1_of == nullptr && w.w3_of == nullptr && w.w2_of == nullptr,
           "moe_experts: the CUDA op takes only the contiguous expert layout");
  M3_CHECK(quant == (w.mats_of != nullptr),
           "moe_experts: quantized experts come as mats_of views (and only they)");
  M3_CHECK(w.num_experts > 0 && w.num_experts <= kMaxExperts,
           "moe_experts: %lld experts (max %lld)", static_cast<long long>(w.num_experts),
           static_cast<long long>(kMaxExperts));
  M3_CHECK(k > 0 && k <= kMaxTopK, "moe_experts: top-%lld", static_cast<long long>(k));
  M3_CHECK(sx == nullptr || (path == MoePath::kGemv && !quant && shared == nullptr),
           "moe_experts: the shared expert runs inside the grouped GEMVs only");
  if (n == 0) return;
  const int64_t P = n * k;
  M3_CHECK(P <= 0x7fffffff && n <= 0x7fffffff);
  if (path == MoePath::kAuto) path = moe_path(n, w, x);
  if (path == MoePath::kGemv)
    M3_CHECK(n <= kMoeGemvMaxTokens && gemv_layout_ok(x, w),
             "moe_experts: the grouped GEMV cannot take %lld tokens of this layout",
             static_cast<long long>(n));
  if (path == MoePath::kGroupedWgmma)
    M3_CHECK(moe_wgmma_available() && aligned16(x),
             "moe_experts: the wgmma grouped GEMM needs a build with the CUTLASS headers "
             "(.deps/flashinfer), an sm_90 GPU and a 16-byte aligned x; MoePath::kGrouped runs "
             "without them");
  if (path == MoePath::kGrouped || path == MoePath::kGroupedWgmma) {
    M3_CHECK(path == MoePath::kGrouped && quant ? quant_grouped_ok(w) : moe_grouped::supports(w),
             "moe_experts: the grouped GEMM cannot read this layout (bf16 experts with dims "
             "multiple of 8; quantized experts back to back, rows multiple of 8, cols of 16 "
             "(fp8) / 32 (4-bit), on the mma.sync engine only)");
    if (n > kMoeGroupedChunk) {
      // Chunks of tokens are independent MoE calls; the workspace holds one chunk.
      for (int64_t c0 = 0; c0 < n; c0 += kMoeGroupedChunk) {
        const int64_t m = std::min(kMoeGroupedChunk, n - c0);
        run_moe(path, x + c0 * w.hidden, m, ids + c0 * k, weights + c0 * k, k, w, nullptr, act,
                shared ? shared + c0 * w.hidden : nullptr, out + c0 * w.hidden, workspace, stream);
      }
      return;
    }
  }
  const Layout l = layout_for(workspace, n, k, w);
  const int ne = static_cast<int>(w.num_experts);

  // A decode step's few picks on the GEMVs are grouped by the gate|up GEMV itself (experts_gemv).
  const bool route_in_gemv = path == MoePath::kGemv && !quant && P <= gemv::kRouteMaxPicks;
  if (!route_in_gemv) {
    const size_t smem = 2 * ne * sizeof(int32_t) + 32 * ne;
    detail::launch_pdl(moe_route_kernel, dim3(1), dim3(kRouteThreads), smem, stream, ids, weights,
                       static_cast<int>(P), static_cast<int>(k), ne, l.offsets, l.active,
                       l.num_active, l.pair_token, l.pair_weight, l.pair_pos);
  }

  if (path == MoePath::kGroupedWgmma) {
    moe_grouped::sm90_experts(x, l.pair_token, P, l.offsets, w, act, l.xg, l.gu, l.wact16, l.wye,
                              l.sm90_ws, l.sm90_ws_bytes, stream);
    combine(l.wye, l, n, k, w.hidden, shared, out, stream);
    return;
  }
  if (path == MoePath::kGrouped && quant) {
    // Quantized experts: the weights are read as stored, no dequantised copy.
    const int bm = moe_grouped::tile_rows_quant(P, ne);
    const int64_t tiles = moe_grouped::max_tiles(P, ne, bm);
    const QuantExperts w1 = quant_experts(w, 0), w3 = quant_experts(w, 1), w2 = quant_experts(w, 2);
    moe_grouped::build_tiles(l.offsets, l.active, l.num_active, bm, l.tiles, l.num_tiles, stream);
    moe_grouped::to_bf16_quant(x, n, w.hidden, w.quant, l.xb, stream);
    moe_grouped::gate_up_quant(l.xb, l.pair_token, l.tiles, l.num_tiles, tiles, bm, w1, w3, act,
                               l.act16, stream);
    moe_grouped::down_quant(l.act16, l.tiles, l.num_tiles, tiles, bm, w2, l.gye, stream);
    combine(l.gye, l, n, k, w.hidden, shared, out, stream);
    return;
  }
  if (path == MoePath::kGrouped) {
    const int bm = moe_grouped::tile_rows(P, ne);
    const int64_t tiles = moe_grouped::max_tiles(P, ne, bm);
    moe_grouped::build_tiles(l.offsets, l.active, l.num_active, bm, l.tiles, l.num_tiles, stream);
    moe_grouped::to_bf16(x, n * w.hidden, l.xb, stream);
    moe_grouped::gate_up(l.xb, l.pair_token, l.tiles, l.num_tiles, tiles, bm, w, act, l.act16,
                         stream);
    moe_grouped::down(l.act16, l.tiles, l.num_tiles, tiles, bm, w, l.gye, stream);
    combine(l.gye, l, n, k, w.hidden, shared, out, stream);
    return;
  }
  if (path == MoePath::kGemv) {
    if (quant)
      experts_gemv_quant(x, n, k, w, act, l, stream);
    else if (w.dtype == DType::kBF16)
      experts_gemv<uint16_t>(x, n, k, w, sx, act, l, ids, weights, route_in_gemv, stream);
    else
      experts_gemv<float>(x, n, k, w, sx, act, l, ids, weights, route_in_gemv, stream);
    // With the shared expert inside, its outputs are ye's positions [P, P + n): token t's at
    // row P + t, the `shared` term of the combine.
    const float* sh = sx ? l.ye + P * w.hidden : shared;
    combine(l.ye, l, n, k, w.hidden, sh, out, stream);
    return;
  }

  // Many tokens: the counts decide the GEMM shapes, so read them back (the one host sync).
  std::vector<int32_t> offsets(ne + 1);
  M3_CUDA_CHECK(cudaMemcpyAsync(offsets.data(), l.offsets, (ne + 1) * sizeof(int32_t),
                                cudaMemcpyDeviceToHost, stream));
  M3_CUDA_CHECK(cudaStreamSynchronize(stream));
  M3_CUDA_CHECK(cudaMemsetAsync(l.routed, 0, n * w.hidden * sizeof(float), stream));
  for (int e = 0; e < ne; ++e) {
    const int64_t begin = offsets[e], m = offsets[e + 1] - begin;
    if (m == 0) continue;
    gather_rows_kernel<<<static_cast<unsigned>(m), 256, 0, stream>>>(x, l.pair_token + begin,
                                                                     w.hidden, l.xe);
    M3_CUDA_CHECK_LAUNCH("gather_rows_kernel");
    if (quant) {
      // One expert matrix at a time dequantised into the workspace (linear_quant), so the
      // workspace holds one [inter, hidden] bf16 matrix whatever the expert count.
      const Workspace wq{l.wdq, static_cast<size_t>(w.inter * w.hidden) * sizeof(uint16_t)};
      linear_quant(l.xe, m, w.mats_of[3 * e], l.g, wq, stream);
      linear_quant(l.xe, m, w.mats_of[3 * e + 1], l.u, wq, stream);
    } else {
      linear(l.xe, m, expert_mat(w.w1, w.dtype, e, w.inter, w.hidden), l.g, stream);
      linear(l.xe, m, expert_mat(w.w3, w.dtype, e, w.inter, w.hidden), l.u, stream);
    }
    swiglu_kernel<<<grid_for(m * w.inter), 256, 0, stream>>>(l.g, l.u, m * w.inter, act);
    M3_CUDA_CHECK_LAUNCH("swiglu_kernel");
    if (quant) {
      const Workspace wq{l.wdq, static_cast<size_t>(w.inter * w.hidden) * sizeof(uint16_t)};
      linear_quant(l.g, m, w.mats_of[3 * e + 2], l.ye_e, wq, stream);
    } else {
      linear(l.g, m, expert_mat(w.w2, w.dtype, e, w.hidden, w.inter), l.ye_e, stream);
    }
    scatter_add_rows_kernel<<<static_cast<unsigned>(m), 256, 0, stream>>>(
        l.ye_e, l.pair_token + begin, l.pair_weight + begin, w.hidden, l.routed);
    M3_CUDA_CHECK_LAUNCH("scatter_add_rows_kernel");
  }
  add_kernel<<<grid_for(n * w.hidden), 256, 0, stream>>>(shared, l.routed, n * w.hidden, out);
  M3_CUDA_CHECK_LAUNCH("add_kernel");
}

}  // namespace

void moe_experts_with(MoePath path, const float* x, int64_t n, const int32_t* ids,
                      const float* weights, int64_t k, const MoeExpertWeights& w,
                      const SwigluParams& act, const float* shared, float* out, void* workspace,
                      cudaStream_t stream) {
  run_moe(path, x, n, ids, weights, k, w, nullptr, act, shared, out, workspace, stream);
}

bool moe_fuses_shared(int64_t n, const float* x, const MoeExpertWeights& w,
                      const MoeSharedExpert& s) {
  if (n > kMoeSharedFusedMaxTokens || w.quant != WeightQuant::kNone ||
      moe_path(n, w, x) != MoePath::kGemv)
    return false;
  auto same = [&](const MatRef& m, int64_t rows, int64_t cols) {
    return m.quant == WeightQuant::kNone && m.dtype == w.dtype && m.rows == rows &&
           m.cols == cols && aligned16(m.data);
  };
  return same(s.gate, w.inter, w.hidden) && same(s.up, w.inter, w.hidden) &&
         same(s.down, w.hidden, w.inter);
}

void moe_experts_shared(const float* x, int64_t n, const int32_t* ids, const float* weights,
                        int64_t k, const MoeExpertWeights& w, const MoeSharedExpert& s,
                        const SwigluParams& act, float* out, void* workspace, cudaStream_t stream) {
  M3_CHECK(moe_fuses_shared(n, x, w, s),
           "moe_experts_shared: the shared expert (gate %lldx%lld, down %lldx%lld) cannot run "
           "inside the grouped GEMVs of %lld tokens over these experts (inter %lld, hidden "
           "%lld); use moe_experts with the shared expert's output",
           static_cast<long long>(s.gate.rows), static_cast<long long>(s.gate.cols),
           static_cast<long long>(s.down.rows), static_cast<long long>(s.down.cols),
           static_cast<long long>(n), static_cast<long long>(w.inter),
           static_cast<long long>(w.hidden));
  run_moe(MoePath::kGemv, x, n, ids, weights, k, w, &s, act, nullptr, out, workspace, stream);
}

}  // namespace m3::kernels::cuda
