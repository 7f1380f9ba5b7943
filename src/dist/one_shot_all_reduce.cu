#include "dist/one_shot_all_reduce.h"

#include <cstdio>
#include <string>

#include "core/check.h"
#include "gpu/cuda_check.h"

namespace m3::dist {

namespace {

constexpr int kThreads = 512;
constexpr unsigned long long kSpinLimitNs = 20ull * 1000 * 1000 * 1000;  // a lost peer: trap

struct Args {
  float* bufs[OneShotGroup::kMaxRanks];      // every rank's staging slots
  uint32_t* flags[OneShotGroup::kMaxRanks];  // every rank's flags [W][kCtas]
  uint32_t* epochs;                          // this rank's, [kCtas]
  float* data;
  int64_t n;
  int64_t max_floats;
  int rank, world;
};

__device__ __forceinline__ void store_release_sys(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ uint32_t load_acquire_sys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// CTA b: floats [b * per, (b + 1) * per) of the vector (per a multiple of 4, from n alone, so
// every rank's CTA b has the same chunk). Stage it, raise flag (rank, b) on every rank, wait for
// flag (s, b) of every rank s here, sum the W staged chunks in rank order into data. `vec`: data
// is 16-byte aligned (this rank's choice only: the staging slots always are), so whole groups of
// 4 move as float4; the sums are the same either way.
__global__ void __launch_bounds__(kThreads) one_shot_kernel(Args a, bool vec) {
  const int b = blockIdx.x;
  const uint32_t e = a.epochs[b] + 1u;  // only this CTA of this rank ever writes epochs[b]
  const int64_t per = ((a.n + 3) / 4 + OneShotGroup::kCtas - 1) / OneShotGroup::kCtas * 4;
  const int64_t i0 = min(a.n, b * per), i1 = min(a.n, i0 + per);
  const int64_t v1 = vec ? i0 + (i1 - i0) / 4 * 4 : i0;  // [i0, v1) as float4, then floats
  const int64_t slot = static_cast<int64_t>(e & 1u) * a.max_floats;
  float* mine = a.bufs[a.rank] + slot;
  for (int64_t i = i0 + 4 * threadIdx.x; i < v1; i += 4 * blockDim.x)
    *reinterpret_cast<float4*>(mine + i) = *reinterpret_cast<const float4*>(a.data + i);
  for (int64_t i = v1 + threadIdx.x; i < i1; i += blockDim.x) mine[i] = a.data[i];
  __syncthreads();  // the CTA's staging is done (and ordered before thread s's release below)
  if (threadIdx.x < a.world) {
    __threadfence_system();
    store_release_sys(a.flags[threadIdx.x] + a.rank * OneShotGroup::kCtas + b, e);
    const uint32_t* f = a.flags[a.rank] + threadIdx.x * OneShotGroup::kCtas + b;
    const unsigned long long t0 = global_ns();
    while (load_acquire_sys(f) < e) {
      if (global_ns() - t0 > kSpinLimitNs) {
        printf("one_shot_all_reduce: rank %d CTA %d waited 20 s for rank %d (call %u)\n", a.rank, b,
               static_cast<int>(threadIdx.x), e);
        __trap();
      }
    }
  }
  __syncthreads();  // every rank's chunk b of call e is staged
  for (int64_t i = i0 + 4 * threadIdx.x; i < v1; i += 4 * blockDim.x) {
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int s = 0; s < a.world; ++s) {
      const float4 v = __ldcg(reinterpret_cast<const float4*>(a.bufs[s] + slot + i));
      acc.x += v.x;
      acc.y += v.y;
      acc.z += v.z;
      acc.w += v.w;
    }
    *reinterpret_cast<float4*>(a.data + i) = acc;
  }
  for (int64_t i = v1 + threadIdx.x; i < i1; i += blockDim.x) {
    float acc = 0.f;
    for (int s = 0; s < a.world; ++s) acc += __ldcg(a.bufs[s] + slot + i);
    a.data[i] = acc;
  }
  if (threadIdx.x == 0) a.epochs[b] = e;
}

std::string gpu_name(int d) {
  return "GPU " + std::to_string(d);
}

}  // namespace

Result<std::shared_ptr<OneShotGroup>> OneShotGroup::create(const std::vector<int>& devices,
                                                           int64_t max_floats) {
  const int w = static_cast<int>(devices.size());
  if (w < 1 || w > kMaxRanks) {
    return make_error(ErrorCode::kInvalidArgument,
                      "one-shot all-reduce: " + std::to_string(w) + " ranks (1 to " +
                          std::to_string(kMaxRanks) + ")",
                      "");
  }
  if (max_floats < 1) {
    return make_error(
        ErrorCode::kInvalidArgument,
        "one-shot all-reduce: a capacity of " + std::to_string(max_floats) + " floats", "");
  }
  int before = 0;
  M3_CUDA_CHECK(cudaGetDevice(&before));
  for (int r = 0; r < w; ++r) {
    for (int s = 0; s < w; ++s) {
      if (devices[r] == devices[s]) continue;
      int ok = 0;
      M3_CUDA_CHECK(cudaDeviceCanAccessPeer(&ok, devices[r], devices[s]));
      if (!ok) {
        return make_error(ErrorCode::kUnsupported,
                          "one-shot all-reduce: " + gpu_name(devices[r]) + " cannot read " +
                              gpu_name(devices[s]) + "'s memory (no peer access); NCCL serves",
                          "");
      }
    }
  }
  std::shared_ptr<OneShotGroup> g(new OneShotGroup());
  g->devices_ = devices;
  g->max_floats_ = (max_floats + 3) / 4 * 4;  // slot 1 stays 16-byte aligned
  for (int r = 0; r < w; ++r) {
    M3_CUDA_CHECK(cudaSetDevice(devices[r]));
    for (int s = 0; s < w; ++s) {
      if (devices[s] == devices[r]) continue;
      const cudaError_t pe = cudaDeviceEnablePeerAccess(devices[s], 0);
      if (pe == cudaErrorPeerAccessAlreadyEnabled) {
        (void)cudaGetLastError();  // enabled by an earlier group: fine
      } else {
        M3_CUDA_CHECK(pe);
      }
    }
    float* buf = nullptr;
    uint32_t* flags = nullptr;
    uint32_t* epochs = nullptr;
    M3_CUDA_CHECK(cudaMalloc(&buf, 2 * g->max_floats_ * sizeof(float)));
    M3_CUDA_CHECK(cudaMalloc(&flags, static_cast<size_t>(w) * kCtas * sizeof(uint32_t)));
    M3_CUDA_CHECK(cudaMalloc(&epochs, kCtas * sizeof(uint32_t)));
    M3_CUDA_CHECK(cudaMemset(flags, 0, static_cast<size_t>(w) * kCtas * sizeof(uint32_t)));
    M3_CUDA_CHECK(cudaMemset(epochs, 0, kCtas * sizeof(uint32_t)));
    g->bufs_.push_back(buf);
    g->flags_.push_back(flags);
    g->epochs_.push_back(epochs);
  }
  for (int r = 0; r < w; ++r) {
    M3_CUDA_CHECK(cudaSetDevice(devices[r]));
    M3_CUDA_CHECK(cudaDeviceSynchronize());  // the zeroed flags before any rank's first call
  }
  M3_CUDA_CHECK(cudaSetDevice(before));
  return g;
}

OneShotGroup::~OneShotGroup() {
  int before = 0;
  cudaGetDevice(&before);
  for (size_t r = 0; r < bufs_.size(); ++r) {
    cudaSetDevice(devices_[r]);
    cudaFree(bufs_[r]);
    cudaFree(flags_[r]);
    cudaFree(epochs_[r]);
  }
  cudaSetDevice(before);
}

void OneShotGroup::all_reduce_sum(int rank, float* data, int64_t n, cudaStream_t stream) const {
  const int w = world_size();
  M3_CHECK(rank >= 0 && rank < w, "one-shot all-reduce: rank %d of %d", rank, w);
  M3_CHECK(n >= 0 && n <= max_floats_, "one-shot all-reduce: %lld floats (capacity %lld)",
           static_cast<long long>(n), static_cast<long long>(max_floats_));
  Args a{};
  for (int s = 0; s < w; ++s) {
    a.bufs[s] = bufs_[s];
    a.flags[s] = flags_[s];
  }
  a.epochs = epochs_[rank];
  a.data = data;
  a.n = n;
  a.max_floats = max_floats_;
  a.rank = rank;
  a.world = w;
  // Every call runs all kCtas CTAs (empty chunks included): the epochs advance together.
  const bool vec = reinterpret_cast<uintptr_t>(data) % 16 == 0;
  one_shot_kernel<<<kCtas, kThreads, 0, stream>>>(a, vec);
  M3_CUDA_CHECK(cudaGetLastError());
}

}  // namespace m3::dist
