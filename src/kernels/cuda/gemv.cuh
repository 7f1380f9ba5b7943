// The bandwidth-bound GEMV behind linear() for a few tokens and behind the MoE experts (grouped:
// one weight matrix per expert, each applied to that expert's tokens), and linear()'s streaming
// kernel for one token. Included by linear.cu and the MoE sources (moe_experts.cu, moe_grouped*.cu:
// they share swiglu_oai) only.
// Invariant: each weight element is read from memory once per group of up to NT tokens; lane l
// of a warp always owns the k positions {s * 32 * kVec + l * kVec + i}, so a token's result
// depends on neither the other tokens, nor the chunking of k through shared memory, nor n: only
// on (m, k) through the split-K choice, which the host makes from the weight shape alone.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "core/env.h"
#include "kernels/cuda/blas.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace m3::kernels::cuda::gemv {

inline constexpr int kThreads = 256;  // 8 warps per CTA
inline constexpr int kIters = 4;      // the most 16-byte weight loads per row per lane in flight
inline constexpr int kLoadRows = 4;   // weight rows each warp loads per k step (fused: 2 + 2)
inline constexpr size_t kSmemBudget = 64 * 1024;  // staged x per CTA: 3 CTAs fit an SM

// Loads in flight per row and CTAs per SM by token-group size: registers hold the loads, NT x 4
// accumulators and the widened weights; two CTAs per SM let one compute while the other waits.
constexpr int iters(int nt) {
  return nt <= 2 ? 4 : 2;
}
constexpr int min_ctas(int nt) {
  return nt <= 8 ? 2 : 1;
}

template <class W>
struct Traits;
template <>
struct Traits<uint16_t> {  // bf16 bits
  static constexpr int kVec = 8;
  using Raw = uint4;
  __device__ static void widen(const Raw& r, float* f) {
    const uint32_t u[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      f[2 * i] = __uint_as_float(u[i] << 16);  // element 2i: the low half
      f[2 * i + 1] = __uint_as_float(u[i] & 0xffff0000u);
    }
  }
};
template <>
struct Traits<float> {
  static constexpr int kVec = 4;
  using Raw = float4;
  __device__ static void widen(const Raw& r, float* f) {
    f[0] = r.x;
    f[1] = r.y;
    f[2] = r.z;
    f[3] = r.w;
  }
};

// k elements one warp covers per load: lane l reads [l * kVec, (l + 1) * kVec).
template <class W>
constexpr int64_t seg() {
  return 32 * Traits<W>::kVec;
}
// The unit every chunk and split of k is a multiple of.
template <class W>
constexpr int64_t k_unit() {
  return seg<W>() * kIters;
}

struct Params {
  const float* x = nullptr;         // input rows [*, k] f32
  const int32_t* x_rows = nullptr;  // x row of position p (null: p itself)
  const void* w = nullptr;          // [m, k] (grouped: expert 0's; expert e at + e * w_stride)
  const void* w_up = nullptr;       // fused: the up matrix beside w (gate)
  int64_t w_stride = 0;             // elements between experts
  int64_t m = 0, k = 0;
  float* y = nullptr;  // [positions, m] (split-K: partials, + z * y_split_stride)
  int64_t y_split_stride = 0;
  int64_t n = 0;                     // positions when not grouped
  const int32_t* offsets = nullptr;  // grouped: [experts + 1] position ranges (null: dense)
  const int32_t* active = nullptr;   // grouped: active expert ids, ascending
  const int32_t* num_active = nullptr;
  int64_t k_split = 0;  // k elements per blockIdx.z
  int64_t kc = 0;       // k elements staged per chunk
  SwigluParams act;
  // Grouped only: one more expert slot, the last blockIdx.y, for a dense expert over every
  // token (the MoE's shared expert, whose weights lie outside the routed experts' stride).
  // Its positions are [extra_p0, extra_p0 + extra_n); position p reads x row p - extra_p0
  // when x_rows is set (x holds the tokens), else x row p (x holds positions).
  // The extra slot is blockIdx.y == 0, so that its CTAs are the first to become resident and
  // prefetch its first weights under the kernel ahead (the routed slots' depend on the routing).
  const void* w_extra = nullptr;
  const void* w_up_extra = nullptr;
  int64_t extra_p0 = 0, extra_n = 0;
  // Grouped, with route_ids (P = route_p <= kRouteMaxPicks picks: a decode step's): every CTA
  // groups the picks ids [P] (k per token, experts < route_ne; -1 another rank's) itself, as the
  // grouping kernel does, instead of reading offsets / active / num_active / x_rows; CTA
  // (0, 0, 0) writes those arrays and the pair arrays (route_out) for the kernels after it.
  const int32_t* route_ids = nullptr;
  const float* route_wts = nullptr;
  int route_p = 0, route_k = 0, route_ne = 0;
  struct RouteOut {
    int32_t* offsets;
    int32_t* active;
    int32_t* num_active;
    int32_t* pair_token;
    float* pair_weight;
    int32_t* pair_pos;
  } route_out{};
};

inline constexpr int kRouteMaxPicks = 32;  // in-kernel routing: one pick per lane of a warp
// Whether the first sub-step's weights are loaded into registers before x is staged (else
// prefetched towards L2): where that fits the 128 registers of two CTAs per SM without spills
// (ptxas -v: not at 2 and 8 tokens).
constexpr bool hoist_first(int nt) {
  return nt != 2 && nt != 8;
}

// One 16-byte global -> shared copy in flight without registers (cp.async, L2 only); zeros
// where !valid (src is then not read).
__device__ __forceinline__ void cp_async16(float* smem, const float* src, bool valid) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src),
               "r"(valid ? 16 : 0)
               : "memory");
}

__device__ __forceinline__ float swiglu_oai(float g, float u, const SwigluParams& a) {
  // The CPU op's formula term by term (see norm_rope_mlp.cu).
  const float gc = a.limit < g ? a.limit : g;
  const float uc = u < -a.limit ? -a.limit : (a.limit < u ? a.limit : u);
  const float glu = gc * (1.0f / (1.0f + expf(-a.alpha * gc)));
  return (uc + a.beta) * glu;
}

// Smem slot of element o (0 <= o < seg) of a segment: lane l's 16-byte quarters q sit at
// q * 128 + l * 4 floats, so a warp reading quarter q touches 512 consecutive bytes (no bank
// conflicts).
template <class W>
__device__ __forceinline__ int smem_slot(int o) {
  constexpr int V = Traits<W>::kVec;
  return ((o % V) / 4) * 128 + (o / V) * 4;
}

// A lane's V staged x elements of one segment (smem_slot layout: its 16-byte quarters 128 floats
// apart), from xt = the segment's base + lane * 4.
template <int V>
__device__ __forceinline__ void load_x(const float* xt, float (&xv)[V]) {
#pragma unroll
  for (int q = 0; q < V / 4; ++q) {
    const float4 f = *reinterpret_cast<const float4*>(xt + q * 128);
    xv[4 * q] = f.x;
    xv[4 * q + 1] = f.y;
    xv[4 * q + 2] = f.z;
    xv[4 * q + 3] = f.w;
  }
}

// The first sub-step's weights of rows row0.. (w: the gate or only matrix, wu: up) towards L2:
// what a CTA issues before it waits for the kernel ahead (pdl_enter), for a matrix no routing
// decides (the dense one, or the grouped launch's extra slot).
template <class W, bool kFused, int kIt>
__device__ __forceinline__ void prefetch_first(const void* w, const void* wu, const Params& p,
                                               int64_t row0, int64_t kb, int64_t ke, int lane) {
  constexpr int kRows = kFused ? kLoadRows / 2 : kLoadRows;
  constexpr int V = Traits<W>::kVec;
  constexpr int64_t kSeg = seg<W>();
  const int64_t klen = min(p.kc, ke - kb);
#pragma unroll
  for (int r = 0; r < kLoadRows; ++r) {
    const int64_t row = row0 + (kFused ? r % kRows : r);
    if (row >= p.m) continue;
    const W* base = static_cast<const W*>((kFused && r >= kRows) ? wu : w) + row * p.k + kb;
#pragma unroll
    for (int it = 0; it < kIt; ++it) {
      const int64_t kk = it * kSeg + lane * V;
      if (kk < klen) asm volatile("prefetch.L2 [%0];" ::"l"(base + kk));
    }
  }
}

// The P <= kRouteMaxPicks picks grouped by warp 0 (Params::route_ids): lane p holds pick p; its
// position is the number of valid picks of lower experts plus those of its expert at lower
// lanes (the grouping kernel's order: experts ascending, then pick order), its expert's slot the
// number of distinct lower experts. Leaves the token of every position in tok, and slot `slot`'s
// expert (-1: no such slot) and position range in *se, *sp0, *sp1; with `write`, the routing
// arrays in p.route_out.
__device__ __forceinline__ void route_warp(const Params& p, int slot, bool write, int32_t* tok,
                                           int32_t* se, int32_t* sp0, int32_t* sp1) {
  const int lane = threadIdx.x % 32;
  int e = -1;
  if (lane < p.route_p) {
    e = p.route_ids[lane];
    M3_DEVICE_CHECK(e >= -1 && e < p.route_ne, "moe: expert id %d of %d", e, p.route_ne);
  }
  const bool valid = e >= 0;
  const unsigned peers = __match_any_sync(0xffffffffu, e);
  const int rank = __popc(peers & ((1u << lane) - 1u));
  const bool leader = valid && rank == 0;
  const unsigned leaders = __ballot_sync(0xffffffffu, leader);
  int less = 0, distinct_less = 0;
  for (int q = 0; q < 32; ++q) {
    const int eq = __shfl_sync(0xffffffffu, e, q);
    if (eq >= 0 && eq < e) {
      ++less;
      distinct_less += (leaders >> q) & 1u;
    }
  }
  const int pos = less + rank;
  if (lane == 0) *se = -1;
  __syncwarp();
  if (valid) tok[pos] = lane / p.route_k;
  if (leader && distinct_less == slot) {
    *se = e;
    *sp0 = less;
    *sp1 = less + __popc(peers);
  }
  if (!write) return;
  const Params::RouteOut& o = p.route_out;
  if (valid) {
    o.pair_token[pos] = lane / p.route_k;
    o.pair_weight[pos] = p.route_wts[lane];
    if (leader) o.active[distinct_less] = e;
  }
  if (lane < p.route_p) o.pair_pos[lane] = valid ? pos : -1;
  if (lane == 0) *o.num_active = __popc(leaders);
  // offsets[x] = the valid picks of experts below x, x = 0..ne.
  for (int x0 = 0; x0 <= p.route_ne; x0 += 32) {
    const int x = x0 + lane;
    int c = 0;
    for (int q = 0; q < 32; ++q) {
      const int eq = __shfl_sync(0xffffffffu, e, q);
      c += (eq >= 0 && eq < x) ? 1 : 0;
    }
    if (x <= p.route_ne) o.offsets[x] = c;
  }
}

// Grid: x = row tiles of (warps * rows per warp), y = expert slot (grouped) or 1, z = k splits.
template <class W, int NT, bool kFused>
__global__ void __launch_bounds__(kThreads, min_ctas(NT)) gemv_kernel(Params p) {
  using T = Traits<W>;
  constexpr int kIt = iters(NT);
  using Raw = typename T::Raw;
  constexpr int V = T::kVec;
  constexpr int64_t kSeg = seg<W>();
  constexpr int kRows = kFused ? kLoadRows / 2 : kLoadRows;  // output rows per warp
  extern __shared__ float4 gemv_smem[];
  float* xs = reinterpret_cast<float*>(gemv_smem);

  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
  const int64_t row0 = (static_cast<int64_t>(blockIdx.x) * nwarps + warp) * kRows;
  const int64_t kb = static_cast<int64_t>(blockIdx.z) * p.k_split;
  const int64_t ke = min(p.k, kb + p.k_split);
  const bool has_extra = p.offsets != nullptr && p.w_extra != nullptr;
  const bool extra = has_extra && blockIdx.y == 0;  // this CTA serves the extra (shared) expert
  if (p.offsets == nullptr) {
    prefetch_first<W, kFused, kIt>(p.w, p.w_up, p, row0, kb, ke, lane);
  } else if (extra) {
    prefetch_first<W, kFused, kIt>(p.w_extra, p.w_up_extra, p, row0, kb, ke, lane);
  }
  detail::pdl_enter();  // the routing, x and y belong to earlier kernels
  __shared__ int32_t route_tok[kRouteMaxPicks];
  __shared__ int32_t route_e, route_p0, route_p1;
  const int slot = static_cast<int>(blockIdx.y) - (has_extra ? 1 : 0);  // routed slot
  if (p.route_ids != nullptr) {
    if (warp == 0)
      route_warp(p, slot, blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0, route_tok,
                 &route_e, &route_p0, &route_p1);
    __syncthreads();
  }
  int64_t p0 = 0, p1 = p.n;
  const W* w = static_cast<const W*>(p.w);
  const W* wu = static_cast<const W*>(p.w_up);
  if (p.offsets != nullptr) {
    if (extra) {
      p0 = p.extra_p0;
      p1 = p.extra_p0 + p.extra_n;
      w = static_cast<const W*>(p.w_extra);
      wu = static_cast<const W*>(p.w_up_extra);
    } else {
      int e = -1;
      if (p.route_ids != nullptr) {
        e = route_e;
        p0 = route_p0;
        p1 = route_p1;
      } else if (slot < *p.num_active) {
        e = p.active[slot];
        p0 = p.offsets[e];
        p1 = p.offsets[e + 1];
      }
      if (e < 0) return;  // fewer active experts than slots: nothing to do
      w += e * p.w_stride;
      if (kFused) wu += e * p.w_stride;
    }
  }
  float* y = p.y + blockIdx.z * p.y_split_stride;

  // Rows this warp loads: unfused rows row0..row0+3; fused gate rows row0, row0+1 then the
  // same rows of up.
  const W* wrow[kLoadRows];
  bool row_ok[kLoadRows];
#pragma unroll
  for (int r = 0; r < kLoadRows; ++r) {
    const int64_t row = row0 + (kFused ? r % kRows : r);
    row_ok[r] = row < p.m;
    const W* base = (kFused && r >= kRows) ? wu : w;
    wrow[r] = base + (row_ok[r] ? row : 0) * p.k;
  }

  for (int64_t pg = p0; pg < p1; pg += NT) {
    const int nt = static_cast<int>(min(static_cast<int64_t>(NT), p1 - pg));
    float acc[NT][kLoadRows];
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
      for (int r = 0; r < kLoadRows; ++r) acc[t][r] = 0.f;

    for (int64_t kc = kb; kc < ke; kc += p.kc) {
      const int64_t klen = min(p.kc, ke - kc);
      // Sub-steps of kIt segments: all their weight loads are issued before the first use.
      Raw raw[kIt][kLoadRows];
      auto load_sub = [&](int64_t sub) {
#pragma unroll
        for (int it = 0; it < kIt; ++it) {
          const int64_t kk = sub + it * kSeg + lane * V;
#pragma unroll
          for (int r = 0; r < kLoadRows; ++r) {
            if (kk < klen && row_ok[r])
              raw[it][r] = __ldg(reinterpret_cast<const Raw*>(wrow[r] + kc + kk));
            else
              raw[it][r] = Raw{};
          }
        }
      };
      // The first sub-step's weights are loaded before x is staged, so the CTA's first weight
      // round trip overlaps the staging's instead of following its barrier (or, without the
      // registers for it, go towards L2 meanwhile).
      if constexpr (hoist_first(NT)) {
        load_sub(0);
      } else {
#pragma unroll
        for (int it = 0; it < kIt; ++it) {
          const int64_t kk = it * kSeg + lane * V;
#pragma unroll
          for (int r = 0; r < kLoadRows; ++r)
            if (kk < klen && row_ok[r]) asm volatile("prefetch.L2 [%0];" ::"l"(wrow[r] + kc + kk));
        }
      }
      __syncthreads();  // the previous chunk's reads of xs are done
      // x staged by cp.async: every 16-byte copy of the CTA in flight at once, beside the
      // first sub-step's weights, with no registers held (one round trip for the staging).
      const int q_per_tok = static_cast<int>(p.kc / 4);
      for (int i = threadIdx.x; i < NT * q_per_tok; i += blockDim.x) {
        const int t = i / q_per_tok;
        const int kk = (i % q_per_tok) * 4;
        const bool valid = t < nt && kk < klen;
        const float* src = p.x;
        if (valid) {
          const int64_t pos = pg + t;
          int64_t xr = pos;
          if (p.x_rows != nullptr)
            xr = extra ? pos - p.extra_p0 : p.route_ids ? route_tok[pos] : p.x_rows[pos];
          src = p.x + xr * p.k + kc + kk;
        }
        const int s = kk / static_cast<int>(kSeg), o = kk % static_cast<int>(kSeg);
        cp_async16(xs + t * p.kc + s * kSeg + smem_slot<W>(o), src, valid);
      }
      asm volatile("cp.async.wait_all;" ::: "memory");
      __syncthreads();
      for (int64_t sub = 0; sub < klen; sub += kIt * kSeg) {
        if (sub > 0 || !hoist_first(NT)) load_sub(sub);
#pragma unroll
        for (int it = 0; it < kIt; ++it) {
          if (sub + it * kSeg >= klen) break;  // uniform: a short last chunk
          float wf[kLoadRows][V];
#pragma unroll
          for (int r = 0; r < kLoadRows; ++r) T::widen(raw[it][r], wf[r]);
#pragma unroll
          for (int t = 0; t < NT; ++t) {
            if (t >= nt) break;  // uniform
            float xv[V];
            load_x<V>(xs + t * p.kc + sub + it * kSeg + lane * 4, xv);
#pragma unroll
            for (int r = 0; r < kLoadRows; ++r)
#pragma unroll
              for (int i = 0; i < V; ++i) acc[t][r] = fmaf(wf[r][i], xv[i], acc[t][r]);
          }
        }
      }
    }
    // Warp sums; lane 0 writes.
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      if (t >= nt) break;
#pragma unroll
      for (int r = 0; r < kLoadRows; ++r) acc[t][r] = detail::warp_sum(acc[t][r]);
      if (lane == 0) {
        float* yt = y + (pg + t) * p.m;
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          if (!row_ok[r]) continue;
          yt[row0 + r] = kFused ? swiglu_oai(acc[t][r], acc[t][r + kRows], p.act) : acc[t][r];
        }
      }
    }
  }
}

// ---- The streaming batch-1 GEMV (bf16 weights, one token, dense) ----
// One CTA per SM, resident for the whole matrix: its x is staged once, and each warp streams its
// own contiguous run of rows (m / warps, differing by at most one between warps) through a ring of
// shared-memory stages filled by bulk copies (lane 0 issues them; one mbarrier per stage). A stage
// holds kStreamRows rows x kStreamChunk k elements; the ring's first stages are issued before
// pdl_enter (weights are no earlier kernel's output), so the stream starts under the kernel ahead.
// Numerics: lane l owns the same k positions and sums them in the same order as gemv_kernel, then
// the same warp_sum, so a row's result is bit for bit gemv_kernel's (and so every token count's).
// Measured (H200, bench_gemv): 1 row per stage ran at 3.0 TB/s on the largest shapes against 4.2
// for 2 rows (more waits per byte), 4 rows as fast as 2 with half the stages.
inline constexpr int kStreamWarps = 8;
inline constexpr int kStreamRows = 2;
inline constexpr int kStreamChunk = k_unit<uint16_t>();   // 1024 k: gemv_kernel's sub-step
inline constexpr int kStreamRowBytes = kStreamChunk * 2;  // one row's share of a stage
inline constexpr int kStreamStageBytes = kStreamRows * kStreamRowBytes;
inline constexpr int kStreamMaxStages = 8;
inline constexpr int64_t kStreamMaxK = 16384;  // x staged whole: at most 64 KiB

struct StreamParams {
  const float* x = nullptr;     // [k] f32
  const uint16_t* w = nullptr;  // [m, k] bf16 bits
  float* y = nullptr;           // [m]
  int64_t m = 0, k = 0;
  int kpad = 0;    // x elements staged: k rounded up to kStreamChunk (zeros past k)
  int stages = 0;  // ring stages per warp, 2..kStreamMaxStages
};

// Dynamic shared memory of stream_kernel: x, the barriers, then the rings (128-byte aligned).
__host__ __device__ inline size_t stream_ring_offset(int kpad) {
  return (static_cast<size_t>(kpad) * 4 + kStreamWarps * kStreamMaxStages * 8 + 127) / 128 * 128;
}
inline size_t stream_smem(int kpad, int stages) {
  return stream_ring_offset(kpad) + static_cast<size_t>(kStreamWarps) * stages * kStreamStageBytes;
}
// Ring stages per warp in what the device's opt-in shared memory (detail::smem_optin_limit)
// leaves past x and the barriers (0: too few).
inline int stream_stages(int kpad) {
  const int64_t left = detail::smem_optin_limit() - static_cast<int64_t>(stream_ring_offset(kpad));
  const int64_t s = std::min<int64_t>(
      kStreamMaxStages, left / (static_cast<int64_t>(kStreamWarps) * kStreamStageBytes));
  return s >= 2 ? static_cast<int>(s) : 0;
}

// acc[j] += row j (< nr) of a ring stage (R rows of kStreamRowBytes: k elements kk0 ..
// kk0 + kStreamChunk of each) times x (staged whole at xs in the smem_slot layout), lane l over
// gemv_kernel's k positions in its order (rows j >= nr and k past the end add 0 * 0).
template <int R>
__device__ __forceinline__ void stream_accumulate(const unsigned char* stage, const float* xs,
                                                  int64_t kk0, int64_t k, int nr, int lane,
                                                  float (&acc)[R]) {
  using T = Traits<uint16_t>;
  constexpr int V = T::kVec;
  constexpr int kSeg = 32 * V;
#pragma unroll
  for (int it = 0; it < kStreamChunk / kSeg; ++it) {
    const int64_t seg0 = kk0 + it * kSeg;
    if (seg0 >= k) break;  // uniform: a short last chunk
    const bool valid = seg0 + lane * V < k;
    float xv[V];
    load_x<V>(xs + seg0 + lane * 4, xv);
#pragma unroll
    for (int j = 0; j < R; ++j) {
      uint4 raw = make_uint4(0u, 0u, 0u, 0u);
      if (valid && j < nr)
        raw = *reinterpret_cast<const uint4*>(stage + j * kStreamRowBytes +
                                              (it * kSeg + lane * V) * 2);
      float wf[V];
      T::widen(raw, wf);
#pragma unroll
      for (int e = 0; e < V; ++e) acc[j] = fmaf(wf[e], xv[e], acc[j]);
    }
  }
}

// x[0, k) -> xs (zeros to kpad) in the smem_slot layout, by every thread of the CTA (cp.async;
// the caller waits and syncs).
__device__ __forceinline__ void stream_stage_x(float* xs, const float* x, int64_t k, int kpad) {
  constexpr int kSeg = seg<uint16_t>();
  for (int q = threadIdx.x; q < kpad / 4; q += blockDim.x) {
    const int kk = q * 4;
    const bool valid = kk < k;
    cp_async16(xs + (kk / kSeg) * kSeg + smem_slot<uint16_t>(kk % kSeg), valid ? x + kk : x, valid);
  }
}

// A template (R = kStreamRows) so that every .cu file including this header may hold the
// kernel: a plain __global__ function defined here is defined once per object and fails to link.
template <int R>
__global__ void __launch_bounds__(kStreamWarps * 32, 1) stream_kernel(StreamParams p) {
  extern __shared__ float4 gemv_smem[];
  unsigned char* smem = reinterpret_cast<unsigned char*>(gemv_smem);
  float* xs = reinterpret_cast<float*>(smem);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int S = p.stages;
  const uint32_t bar0 =
      detail::smem_addr(smem + static_cast<size_t>(p.kpad) * 4) + warp * kStreamMaxStages * 8;
  const size_t ring_off =
      stream_ring_offset(p.kpad) + static_cast<size_t>(warp) * S * kStreamStageBytes;
  const unsigned char* ring_p = smem + ring_off;
  const uint32_t ring = detail::smem_addr(ring_p);

  // This warp's rows [r0, r1): an even share of all the grid's warps.
  const int64_t W = static_cast<int64_t>(gridDim.x) * kStreamWarps;
  const int64_t gw = static_cast<int64_t>(blockIdx.x) * kStreamWarps + warp;
  const int64_t r0 = gw * p.m / W, r1 = (gw + 1) * p.m / W;
  const int nch = static_cast<int>((p.k + kStreamChunk - 1) / kStreamChunk);
  const int items = static_cast<int>((r1 - r0 + R - 1) / R) * nch;  // (row pair, chunk)

  if (lane == 0) {
    for (int st = 0; st < S; ++st) detail::mbar_init(bar0 + 8 * st, 1);
    detail::mbar_fence_init();
  }
  __syncwarp();
  auto issue = [&](int i) {
    if (i >= items) return;
    __syncwarp();  // every lane is past its reads of this stage (item i - S)
    if (lane != 0) return;
    const int pass = i / nch, c = i - pass * nch;
    const int64_t row = r0 + static_cast<int64_t>(pass) * R;
    const int nr = static_cast<int>(min(static_cast<int64_t>(R), r1 - row));
    const int64_t kk0 = static_cast<int64_t>(c) * kStreamChunk;
    const uint32_t bytes =
        static_cast<uint32_t>(min(static_cast<int64_t>(kStreamChunk), p.k - kk0) * 2);
    const int st = i % S;
    const uint32_t bar = bar0 + 8 * st;
    detail::mbar_arrive_expect_tx(bar, nr * bytes);
    for (int j = 0; j < nr; ++j)
      detail::bulk_copy_g2s(ring + st * kStreamStageBytes + j * kStreamRowBytes,
                            p.w + (row + j) * p.k + kk0, bytes, bar);
  };
  for (int i = 0; i < S; ++i) issue(i);

  detail::pdl_enter();  // x and y belong to earlier kernels
  stream_stage_x(xs, p.x, p.k, p.kpad);
  asm volatile("cp.async.wait_all;" ::: "memory");
  __syncthreads();

  float acc[R];
#pragma unroll
  for (int j = 0; j < R; ++j) acc[j] = 0.f;
  for (int i = 0; i < items; ++i) {
    const int pass = i / nch, c = i - pass * nch;
    const int st = i % S;
    const int64_t row = r0 + static_cast<int64_t>(pass) * R;
    const int nr = static_cast<int>(min(static_cast<int64_t>(R), r1 - row));
    detail::mbar_wait(bar0 + 8 * st, static_cast<uint32_t>(i / S) & 1u);
    stream_accumulate<R>(ring_p + st * kStreamStageBytes, xs,
                         static_cast<int64_t>(c) * kStreamChunk, p.k, nr, lane, acc);
    issue(i + S);  // into the stage just read
    if (c == nch - 1) {
#pragma unroll
      for (int j = 0; j < R; ++j) {
        acc[j] = detail::warp_sum(acc[j]);
        if (lane == 0 && j < nr) p.y[row + j] = acc[j];
        acc[j] = 0.f;
      }
    }
  }
}

// Whether linear's batch-1 bf16 GEMV streams (stream_kernel; M3_GEMV_STREAM=0: gemv_kernel).
inline bool stream_on() {
  static const bool on = env_switch("M3_GEMV_STREAM", true);
  return on;
}

// Launches stream_kernel over one CTA per SM (its dynamic shared memory limit raised once).
inline void stream_launch(const StreamParams& p, cudaStream_t stream) {
  detail::allow_optin_smem<stream_kernel<kStreamRows>>();
  detail::launch_pdl(stream_kernel<kStreamRows>, dim3(static_cast<unsigned>(blas::num_sms())),
                     dim3(kStreamWarps * 32), stream_smem(p.kpad, p.stages), stream, p);
}

// Warps per CTA (max_warps, its halves, down to 2) for `warp_tasks` row groups (kLoadRows rows
// each, one per warp) that fill the GPU at least once: the CTAs are spread over the SMs, so the
// step lasts as long as the busiest SM's share, ceil(ctas / sms) CTAs. Picks the size whose busiest
// SM carries the least beyond the mean (M3's 6144-row GEMVs: 192 CTAs of 8 warps leave 60 SMs with
// two and 72 with one, 73% of the mean; 384 of 4 warps give three or two, 97%); a smaller CTA only
// for a gain of 2% or more (each CTA stages x again). Only the CTA shape changes: each row's sum is
// the same whatever the choice.
inline int balanced_warps(int64_t warp_tasks, int sms, int max_warps = kThreads / 32) {
  int best = max_warps;
  double best_eff = -1.0;
  for (int w = max_warps; w >= 2; w /= 2) {
    const int64_t ctas = (warp_tasks + w - 1) / w;
    const int64_t per_sm = (ctas + sms - 1) / sms;
    const double eff = static_cast<double>(warp_tasks) / (static_cast<double>(sms) * per_sm * w);
    if (eff > best_eff + 0.02) {
      best = w;
      best_eff = eff;
    }
  }
  return best;
}

// Tuning switches (read once): M3_GEMV_BALANCE=1 sizes linear's dense GEMV CTAs by
// balanced_warps (even shares per SM: 2-4 warps for M3's 6144-9856 rows); the default keeps
// them at 8 warps. Measured in one H200 run (2026-12-02, bench_layer 8192 10 bf16, x staged by
// cp.async): balanced 0.324 / 0.947 / 3.330 / 4.357 ms at batch 1 / 8 / 64 / 256, 8-warp CTAs
// 0.290 / 0.925 / 3.312 / 4.326 (balanced_warps had come with the earlier per-thread staging, in
// the changes that took batch 1 from 0.365 to 0.293 ms). M3_GEMV_EXPERT_WARPS (8, 4 or 2; default
// 8) sizes the grouped expert GEMVs' CTAs.
inline bool balance_on() {
  static const bool on = env_switch("M3_GEMV_BALANCE", false);
  return on;
}
// M3_GEMV_WARPS (2-8; unset: the choice above) fixes the warps per CTA of linear's dense GEMV where
// its rows fill the SMs: a tuning switch for bench_step / bench_layer (like M3_GEMV_BALANCE, for
// 2+ tokens, or one token with M3_GEMV_STREAM=0: one token otherwise streams, stream_kernel). The
// result does not depend on it (a lane's k positions and the summation order are the same for every
// CTA shape). M3's 6144-9856-row projections get 192-308 CTAs of 8 warps, so some SMs carry twice
// the rows of others, yet evener shares lost (one H200 run, 2026-12-02, bench_step 4 2048 batch 1:
// 8 warps 1.542 ms, 6 1.561, 5 1.658, 4 1.781; docs/PERFORMANCE.md "Session 13").
inline int linear_warps() {
  static const int w = [] {
    const char* v = std::getenv("M3_GEMV_WARPS");
    if (v == nullptr || *v == '\0') return 0;
    const int n = std::atoi(v);
    M3_CHECK(n >= 2 && n <= kThreads / 32 && std::to_string(n) == v,
             "M3_GEMV_WARPS=%s: a warp count from 2 to 8", v);
    return n;
  }();
  return w;
}
inline int expert_warps() {
  static const int w = [] {
    const char* v = std::getenv("M3_GEMV_EXPERT_WARPS");
    if (v == nullptr || *v == '\0') return 8;
    const std::string s = v;
    M3_CHECK(s == "8" || s == "4" || s == "2", "M3_GEMV_EXPERT_WARPS=%s: 8 (default), 4 or 2", v);
    return std::atoi(v);
  }();
  return w;
}

// Token-group size for up to n positions per group: 1, 2, 4, 8 or 16 (more loop).
inline int nt_bucket(int64_t n) {
  return n <= 1 ? 1 : n <= 2 ? 2 : n <= 4 ? 4 : n <= 8 ? 8 : 16;
}

// Largest chunk of k to stage for nt tokens within the shared-memory budget, at most k_split.
template <class W>
int64_t chunk_k(int nt, int64_t k_split) {
  const int64_t unit = k_unit<W>();
  const int64_t max_kc =
      std::max<int64_t>(unit, static_cast<int64_t>(kSmemBudget) / (nt * 4) / unit * unit);
  return std::min(max_kc, (k_split + unit - 1) / unit * unit);
}

template <class W, int NT, bool kFused>
void launch_nt(const Params& p, dim3 grid, int threads, cudaStream_t stream) {
  auto kernel = gemv_kernel<W, NT, kFused>;
  const size_t smem = static_cast<size_t>(NT) * p.kc * sizeof(float);
  if (smem + 1024 > 48 * 1024) {
    // Above 48 KiB with the kernel's static shared memory (< 1 KiB: the routing's) the dynamic
    // limit must be raised (per function; cheap, and idempotent).
    M3_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(kSmemBudget)));
  }
  detail::launch_pdl(kernel, grid, dim3(threads), smem, stream, p);
}

// Launches the instance for token groups of `nt` (from nt_bucket); p.kc from chunk_k<W>(nt, ..).
template <class W, bool kFused>
void launch(const Params& p, int nt, dim3 grid, int threads, cudaStream_t stream) {
  switch (nt) {
    case 1:
      return launch_nt<W, 1, kFused>(p, grid, threads, stream);
    case 2:
      return launch_nt<W, 2, kFused>(p, grid, threads, stream);
    case 4:
      return launch_nt<W, 4, kFused>(p, grid, threads, stream);
    case 8:
      return launch_nt<W, 8, kFused>(p, grid, threads, stream);
    default:
      M3_CHECK(nt == 16, "gemv: token group %d", nt);
      return launch_nt<W, 16, kFused>(p, grid, threads, stream);
  }
}

}  // namespace m3::kernels::cuda::gemv
