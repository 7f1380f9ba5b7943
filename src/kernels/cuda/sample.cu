// GPU sampler: see sample.h. The candidate set is engine::Sampler's (and kernels/cpu/sample's):
// top_k of z = (logit - max) / T (ties by lower id), then min_p relative to the best token, then
// the shortest best-first prefix whose probability (over the top_k set) reaches top_p; the token
// is argmax over kept ids of z + Gumbel(seed, step, id). Thresholds are found by radix selection
// over order-preserving 32-bit keys of z: 4 passes of 256-bin histograms (counts for top_k,
// probability mass in fp64 for top_p), so no pass sorts the vocabulary.
#include <cfloat>
#include <climits>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/sample.h"

namespace m3::kernels::cuda {

namespace {

constexpr int kThreads = 1024;

__device__ __forceinline__ uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// Bit for bit kernels/cpu/sample.cpp's sample_uniform.
__device__ __forceinline__ double uniform(uint64_t seed, uint64_t step, int64_t id) {
  const uint64_t h = splitmix64(splitmix64(splitmix64(seed) ^ step) ^ static_cast<uint64_t>(id));
  return (static_cast<double>(h >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}

// Order-preserving key: a > b as floats <=> key(a) > key(b) as unsigned (no NaNs here).
__device__ __forceinline__ uint32_t key_of(float f) {
  const uint32_t u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ double block_sum_d(double v, double* red) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < (int)(blockDim.x / 32) ? red[lane] : 0.0;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0) red[0] = v;
  }
  __syncthreads();
  return red[0];
}

// Block-wide best (value, id): larger value, then lower id. T is float or double.
template <class T>
__device__ __forceinline__ void block_best_t(T& v, int32_t& id, T* red_v, int32_t* red_i) {
  auto better = [](T a, int32_t ia, T b, int32_t ib) { return a > b || (a == b && ia < ib); };
  for (int o = 16; o > 0; o >>= 1) {
    const T ov = __shfl_xor_sync(0xffffffffu, v, o);
    const int32_t oi = __shfl_xor_sync(0xffffffffu, id, o);
    if (better(ov, oi, v, id)) {
      v = ov;
      id = oi;
    }
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();
  if (lane == 0) {
    red_v[warp] = v;
    red_i[warp] = id;
  }
  __syncthreads();
  if (warp == 0) {
    const int nw = blockDim.x / 32;
    v = lane < nw ? red_v[lane] : red_v[0];
    id = lane < nw ? red_i[lane] : red_i[0];
    for (int o = 16; o > 0; o >>= 1) {
      const T ov = __shfl_xor_sync(0xffffffffu, v, o);
      const int32_t oi = __shfl_xor_sync(0xffffffffu, id, o);
      if (better(ov, oi, v, id)) {
        v = ov;
        id = oi;
      }
    }
    if (lane == 0) {
      red_v[0] = v;
      red_i[0] = id;
    }
  }
  __syncthreads();
  v = red_v[0];
  id = red_i[0];
}

// This thread's best (value, id) of l[0, V) (ties to the lower id). One CTA reads the whole
// row (800 KB at M3's vocabulary), so the loads must be many and in flight together: where the
// row is 16-byte aligned, float4 loads, kUnroll of them issued before any is compared (a scalar
// strided loop kept one load per thread in flight: 83 us for one row on the H200, ncu).
__device__ __forceinline__ void row_argmax(const float* __restrict__ l, int64_t V, float& mx,
                                           int32_t& arg) {
  auto take = [&](float v, int64_t i) {
    if (v > mx || (v == mx && i < arg)) {
      mx = v;
      arg = static_cast<int32_t>(i);
    }
  };
  int64_t done = 0;
  if ((reinterpret_cast<uintptr_t>(l) & 15u) == 0) {
    constexpr int kUnroll = 4;
    const int64_t n4 = V / 4;
    const float4* l4 = reinterpret_cast<const float4*>(l);
    const int64_t stride = static_cast<int64_t>(blockDim.x) * kUnroll;
    int64_t j = threadIdx.x;
    for (; j + (kUnroll - 1) * blockDim.x < n4; j += stride) {
      float4 v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) v[u] = __ldg(l4 + j + u * blockDim.x);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = 4 * (j + u * static_cast<int64_t>(blockDim.x));
        take(v[u].x, i);
        take(v[u].y, i + 1);
        take(v[u].z, i + 2);
        take(v[u].w, i + 3);
      }
    }
    for (; j < n4; j += blockDim.x) {
      const float4 v = __ldg(l4 + j);
      take(v.x, 4 * j);
      take(v.y, 4 * j + 1);
      take(v.z, 4 * j + 2);
      take(v.w, 4 * j + 3);
    }
    done = 4 * n4;
  }
  for (int64_t i = done + threadIdx.x; i < V; i += blockDim.x) take(l[i], i);
}

__global__ void __launch_bounds__(kThreads)
    sample_kernel(const float* __restrict__ logits, int64_t vocab, int64_t V,
                  const SampleRow* __restrict__ rows, int32_t* __restrict__ out_ids) {
  detail::pdl_enter();
  const SampleRow p = rows[blockIdx.x];
  const float* l = logits + static_cast<int64_t>(p.row) * vocab;
  __shared__ float red_f[32];
  __shared__ double red_d[32];
  __shared__ int32_t red_i[32];
  __shared__ uint32_t hist_n[256];
  __shared__ double hist_m[256];
  __shared__ uint32_t s_prefix, s_kleft;
  __shared__ double s_mass_before;
  __shared__ int s_found;

  // 1. max (and argmax for greedy), ties to the lower id.
  float mx = -FLT_MAX;
  int32_t arg = INT_MAX;
  row_argmax(l, V, mx, arg);
  block_best_t<float>(mx, arg, red_f, red_i);
  if (p.temperature <= 0.f) {
    if (threadIdx.x == 0) out_ids[blockIdx.x] = arg;
    return;
  }
  const float T = p.temperature;
  auto zof = [&](int64_t i) { return (l[i] - mx) / T; };

  // 2. top_k threshold: the key of the k-th largest z (radix select, 8 bits per pass), and for
  //    ties at that key the highest id kept (ties are kept in id order, as a stable sort does).
  uint32_t tk_key = 0;  // keep z with key > tk_key, or == tk_key and id <= tie_max_id
  int64_t tie_max_id = INT64_MAX;
  const int64_t k = (p.top_k > 0 && p.top_k < V) ? p.top_k : V;
  if (k < V) {
    if (threadIdx.x == 0) {
      s_prefix = 0;
      s_kleft = static_cast<uint32_t>(k);
    }
    for (int shift = 24; shift >= 0; shift -= 8) {
      for (int b = threadIdx.x; b < 256; b += blockDim.x) hist_n[b] = 0;
      __syncthreads();
      const uint32_t prefix = s_prefix;
      const uint32_t hi_mask = shift == 24 ? 0u : (0xffffffffu << (shift + 8));
      for (int64_t i = threadIdx.x; i < V; i += blockDim.x) {
        const uint32_t key = key_of(zof(i));
        if ((key & hi_mask) == (prefix & hi_mask)) atomicAdd(&hist_n[(key >> shift) & 255u], 1u);
      }
      __syncthreads();
      if (threadIdx.x == 0) {
        uint32_t left = s_kleft;
        int b = 255;
        for (; b > 0; --b) {
          if (hist_n[b] >= left) break;
          left -= hist_n[b];
        }
        s_prefix = prefix | (static_cast<uint32_t>(b) << shift);
        s_kleft = left;  // how many of the elements in bin b (at this depth) are still kept
      }
      __syncthreads();
    }
    tk_key = s_prefix;
    const uint32_t ties_kept = s_kleft;
    // Count ties; when more exist than are kept, find the id of the last kept one in id order.
    uint32_t my_ties = 0;
    for (int64_t i = threadIdx.x; i < V; i += blockDim.x) my_ties += key_of(zof(i)) == tk_key;
    const double all_ties = block_sum_d(static_cast<double>(my_ties), red_d);
    if (all_ties > ties_kept) {
      // Walk the vocabulary in slices of blockDim ids, in id order, counting ties.
      if (threadIdx.x == 0) {
        s_kleft = ties_kept;
        s_found = 0;
      }
      __syncthreads();
      for (int64_t base = 0; base < V && !s_found; base += blockDim.x) {
        const int64_t i = base + threadIdx.x;
        const bool tie = i < V && key_of(zof(i)) == tk_key;
        const unsigned ballot = __ballot_sync(0xffffffffu, tie);
        const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
        if (lane == 0) red_i[warp] = __popc(ballot);
        __syncthreads();
        if (threadIdx.x == 0) {
          uint32_t left = s_kleft;
          for (int w = 0; w < (int)(blockDim.x / 32) && !s_found; ++w) {
            if ((uint32_t)red_i[w] < left) {
              left -= red_i[w];
              continue;
            }
            // The kept tie ends inside warp w's slice: find it lane by lane.
            int64_t id = base + w * 32;
            for (; id < base + (w + 1) * 32 && id < V; ++id) {
              if (key_of(zof(id)) == tk_key && --left == 0) break;
            }
            tie_max_id = id;
            s_found = 1;
            red_d[0] = static_cast<double>(id);
          }
          s_kleft = left;
        }
        __syncthreads();
      }
      tie_max_id = static_cast<int64_t>(red_d[0]);
      __syncthreads();
    }
  }
  auto in_topk = [&](uint32_t key, int64_t i) {
    return key > tk_key || (key == tk_key && i <= tie_max_id);
  };

  // 3. Probability mass of the top_k set (fp64, as the CPU sums).
  double my_sum = 0.0;
  for (int64_t i = threadIdx.x; i < V; i += blockDim.x) {
    const float z = zof(i);
    if (in_topk(key_of(z), i)) my_sum += exp(static_cast<double>(z));
  }
  const double sum = block_sum_d(my_sum, red_d);

  // 4. min_p: keep tokens whose probability is at least min_p x the best one's.
  const double minp_thresh = static_cast<double>(p.min_p) * (1.0 / sum);
  const bool use_minp = p.min_p > 0.f;

  // 5. top_p: the key where the best-first cumulative mass first reaches top_p (radix select on
  //    mass). Tokens tied at that key are all kept (the CPU keeps them in id order; exact ties
  //    of z at a top_p boundary need identical logits).
  uint32_t tp_key = 0;
  if (p.top_p < 1.f) {
    const double target = static_cast<double>(p.top_p);
    if (threadIdx.x == 0) {
      s_prefix = 0;
      s_mass_before = 0.0;
      s_found = 1;
    }
    for (int shift = 24; shift >= 0; shift -= 8) {
      for (int b = threadIdx.x; b < 256; b += blockDim.x) hist_m[b] = 0.0;
      __syncthreads();
      const uint32_t prefix = s_prefix;
      const uint32_t hi_mask = shift == 24 ? 0u : (0xffffffffu << (shift + 8));
      for (int64_t i = threadIdx.x; i < V; i += blockDim.x) {
        const float z = zof(i);
        const uint32_t key = key_of(z);
        if (in_topk(key, i) && (key & hi_mask) == (prefix & hi_mask))
          atomicAdd(&hist_m[(key >> shift) & 255u], exp(static_cast<double>(z)) / sum);
      }
      __syncthreads();
      if (threadIdx.x == 0) {
        double cum = s_mass_before;
        int b = 255, lowest = -1;
        for (; b >= 0; --b) {
          if (hist_m[b] > 0.0) lowest = b;
          if (hist_m[b] > 0.0 && cum + hist_m[b] >= target) break;
          cum += hist_m[b];
        }
        if (b < 0) {
          // Not reached. At the top level the whole top_k set sums below top_p (rounding):
          // keep it all. Deeper, the sub-bins' sums rounded below their parent's: the crossing
          // element is the last of this group.
          if (shift == 24) s_found = 0;
          b = lowest < 0 ? 0 : lowest;
          cum -= hist_m[b];
        }
        s_prefix = prefix | (static_cast<uint32_t>(b) << shift);
        s_mass_before = cum;
      }
      __syncthreads();
    }
    tp_key = s_found ? s_prefix : 0u;
  }

  // 6. Gumbel-max over the kept set; the best token is always kept (min_p and top_p keep >= 1).
  double best = -DBL_MAX;
  int32_t best_id = INT_MAX;
  for (int64_t i = threadIdx.x; i < V; i += blockDim.x) {
    const float z = zof(i);
    const uint32_t key = key_of(z);
    bool keep = in_topk(key, i) && key >= tp_key;
    if (keep && use_minp && z != 0.f) keep = exp(static_cast<double>(z)) / sum >= minp_thresh;
    if (!keep) continue;
    const double s = static_cast<double>(z) - log(-log(uniform(p.seed, p.step, i)));
    if (s > best || (s == best && i < best_id)) {
      best = s;
      best_id = static_cast<int32_t>(i);
    }
  }
  block_best_t<double>(best, best_id, red_d, red_i);
  if (threadIdx.x == 0) out_ids[blockIdx.x] = best_id;
}

__global__ void gather_ids_kernel(const int32_t* sampled, const int32_t* tokens,
                                  const int32_t* slots, int64_t n, int32_t* ids) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) ids[tokens[i]] = sampled[slots[i]];
}

__global__ void gather_mapped_ids_kernel(const int32_t* ids, const int32_t* rows, int64_t n,
                                         const int32_t* map, int32_t* out) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const int32_t id = ids[rows != nullptr ? rows[i] : i];
  out[i] = map != nullptr ? map[id] : id;
}

}  // namespace

void gather_mapped_ids(const int32_t* ids, const int32_t* rows, int64_t n, const int32_t* map,
                       int32_t* out, cudaStream_t stream) {
  if (n <= 0) return;
  const int threads = 128;
  gather_mapped_ids_kernel<<<static_cast<unsigned>((n + threads - 1) / threads), threads, 0,
                             stream>>>(ids, rows, n, map, out);
  M3_CUDA_CHECK_LAUNCH("gather_mapped_ids");
}

void gather_sampled_ids(const int32_t* sampled, const int32_t* tokens, const int32_t* slots,
                        int64_t n, int32_t* ids, cudaStream_t stream) {
  if (n <= 0) return;
  const int threads = 128;
  gather_ids_kernel<<<static_cast<unsigned>((n + threads - 1) / threads), threads, 0, stream>>>(
      sampled, tokens, slots, n, ids);
  M3_CUDA_CHECK_LAUNCH("gather_sampled_ids");
}

void sample_rows(const float* logits, int64_t vocab, int64_t num_valid, const SampleRow* rows,
                 int64_t n, int32_t* out_ids, cudaStream_t stream) {
  const int64_t V = vocab < num_valid ? vocab : num_valid;
  M3_CHECK(V >= 1, "sample_rows: no valid token (vocab %lld, num_valid %lld)",
           static_cast<long long>(vocab), static_cast<long long>(num_valid));
  if (n == 0) return;
  detail::launch_pdl(sample_kernel, dim3(static_cast<unsigned>(n)), dim3(kThreads), 0, stream,
                     logits, vocab, V, rows, out_ids);
}

}  // namespace m3::kernels::cuda
