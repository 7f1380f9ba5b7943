#include "dist/one_shot_all_reduce.h"

#include <algorithm>

#include "core/check.h"
#include "gpu/cuda_check.h"

namespace m3::dist {

namespace {

constexpr int kThreads = 512;
constexpr uint32_t kMaxPolls = 1u << 26;  // x ~64 ns of __nanosleep: seconds, then give up

// Every rank's staging buffer and flag array, by value in the kernel's parameters.
struct Peers {
  const float* staging[OneShotAllReduce::kMaxRanks];
  uint32_t* flags[OneShotAllReduce::kMaxRanks];
};

__device__ __forceinline__ void store_release(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ uint32_t load_acquire(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Block b of every rank meets here: thread t < world writes `v` into rank t's flag [b][rank] and
// waits until rank t has written at least `v` into ours [b][t]. The __syncthreads() before
// orders the block's earlier memory work before the release; the one after makes the acquired
// view the whole block's.
__device__ void handshake(const Peers& p, int rank, int world, int b, uint32_t v, int* error) {
  __syncthreads();
  const int t = threadIdx.x;
  if (t < world) {
    store_release(p.flags[t] + b * OneShotAllReduce::kMaxRanks + rank, v);
    const uint32_t* mine = p.flags[rank] + b * OneShotAllReduce::kMaxRanks + t;
    uint32_t polls = 0;
    while (static_cast<int32_t>(load_acquire(mine) - v) < 0) {
      if (++polls > kMaxPolls) {
        atomicExch(error, 1);  // a peer never came: give up rather than hang the GPU
        break;
      }
      __nanosleep(64);
    }
  }
  __syncthreads();
}

// out[i] = staging_0[i] + staging_1[i] + ... + staging_{W-1}[i], in that order, between two
// handshakes (staging ready on every rank; every rank done reading). epochs[b] counts block b's
// calls on this rank; every rank's block b counts the same calls, so 2e-1 and 2e are fresh
// flag values for call e. Loads bypass L1 (__ldcg): a peer's buffer changes between calls.
__global__ void __launch_bounds__(kThreads)
    one_shot_kernel(Peers p, int rank, int world, float* __restrict__ out, int64_t n,
                    uint32_t* __restrict__ epochs, int* error) {
  const int b = blockIdx.x;
  const uint32_t e = epochs[b] + 1;
  handshake(p, rank, world, b, 2 * e - 1, error);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(b) * blockDim.x + threadIdx.x; i < n; i += stride) {
    float acc = __ldcg(p.staging[0] + i);
    for (int r = 1; r < world; ++r) acc = __fadd_rn(acc, __ldcg(p.staging[r] + i));
    out[i] = acc;
  }
  handshake(p, rank, world, b, 2 * e, error);
  if (threadIdx.x == 0) epochs[b] = e;
}

}  // namespace

Result<std::shared_ptr<OneShotAllReduce>> OneShotAllReduce::create(int world, int64_t max_elems) {
  if (world < 2 || world > kMaxRanks || max_elems < 1) {
    return make_error(ErrorCode::kInvalidArgument,
                      "the one-shot all-reduce takes 2.." + std::to_string(kMaxRanks) +
                          " ranks and a positive message size, got " + std::to_string(world) +
                          " ranks of " + std::to_string(max_elems) + " floats",
                      "M3_ONE_SHOT_ALLREDUCE");
  }
  return std::make_shared<OneShotAllReduce>(world, max_elems);
}

OneShotAllReduce::OneShotAllReduce(int world, int64_t max_elems)
    : world_(world),
      max_elems_(max_elems),
      ranks_(world),
      barrier_(world),
      join_status_(world) {}

OneShotAllReduce::~OneShotAllReduce() {
  int cur = 0;
  cudaGetDevice(&cur);
  for (Rank& r : ranks_) {
    if (r.device < 0) continue;
    cudaSetDevice(r.device);
    cudaFree(r.staging);
    cudaFree(r.flags);
    cudaFree(r.epochs);
    cudaFree(r.error);
  }
  cudaSetDevice(cur);
}

Status OneShotAllReduce::join(int rank, int device) {
  M3_CHECK(rank >= 0 && rank < world_, "one-shot all-reduce: rank %d of %d", rank, world_);
  Rank& me = ranks_[rank];
  me.device = device;
  M3_CUDA_CHECK(cudaMalloc(&me.staging, static_cast<size_t>(max_elems_) * sizeof(float)));
  M3_CUDA_CHECK(cudaMalloc(&me.flags, kMaxBlocks * kMaxRanks * sizeof(uint32_t)));
  M3_CUDA_CHECK(cudaMalloc(&me.epochs, kMaxBlocks * sizeof(uint32_t)));
  M3_CUDA_CHECK(cudaMalloc(&me.error, sizeof(int)));
  M3_CUDA_CHECK(cudaMemset(me.flags, 0, kMaxBlocks * kMaxRanks * sizeof(uint32_t)));
  M3_CUDA_CHECK(cudaMemset(me.epochs, 0, kMaxBlocks * sizeof(uint32_t)));
  M3_CUDA_CHECK(cudaMemset(me.error, 0, sizeof(int)));
  M3_CUDA_CHECK(cudaDeviceSynchronize());
  barrier_.arrive_and_wait();  // every rank's device is known
  Status st;
  for (int r = 0; r < world_ && st.has_value(); ++r) {
    const int peer = ranks_[r].device;
    if (peer == device) continue;
    int can = 0;
    M3_CUDA_CHECK(cudaDeviceCanAccessPeer(&can, device, peer));
    if (!can) {
      st = make_error(ErrorCode::kUnsupported,
                      "GPU " + std::to_string(device) + " cannot read GPU " +
                          std::to_string(peer) +
                          " over P2P; the one-shot all-reduce needs it (unset "
                          "M3_ONE_SHOT_ALLREDUCE to keep NCCL's)",
                      "M3_ONE_SHOT_ALLREDUCE");
      break;
    }
    const cudaError_t e = cudaDeviceEnablePeerAccess(peer, 0);
    if (e == cudaErrorPeerAccessAlreadyEnabled) {
      cudaGetLastError();  // another rank of this device enabled it already
    } else {
      M3_CUDA_CHECK(e);
    }
  }
  join_status_[rank] = st;
  barrier_.arrive_and_wait();  // every rank's status is known: all fail alike
  for (int r = 0; r < world_; ++r)
    if (!join_status_[r].has_value()) return join_status_[r];
  return {};
}

void OneShotAllReduce::all_reduce_sum(int rank, float* data, int64_t n, cudaStream_t stream) {
  M3_CHECK(n <= max_elems_, "one-shot all-reduce of %lld floats, above its %lld",
           static_cast<long long>(n), static_cast<long long>(max_elems_));
  if (n <= 0) return;  // every rank has the same n: all skip
  const Rank& me = ranks_[rank];
  M3_CUDA_CHECK(cudaMemcpyAsync(me.staging, data, static_cast<size_t>(n) * sizeof(float),
                                cudaMemcpyDeviceToDevice, stream));
  Peers p{};
  for (int r = 0; r < world_; ++r) {
    p.staging[r] = ranks_[r].staging;
    p.flags[r] = ranks_[r].flags;
  }
  // About two elements per thread, at most kMaxBlocks blocks (few enough to be resident with
  // every peer's: a block waits only for the same block of the others).
  const int64_t want = (n + 2 * kThreads - 1) / (2 * kThreads);
  const int blocks = static_cast<int>(std::clamp<int64_t>(want, 1, kMaxBlocks));
  one_shot_kernel<<<blocks, kThreads, 0, stream>>>(p, rank, world_, data, n, me.epochs, me.error);
  M3_CUDA_CHECK_LAUNCH("one_shot_kernel");
}

std::string OneShotAllReduce::fault(int rank) const {
  const Rank& me = ranks_[rank];
  if (me.error == nullptr) return "";
  int err = 0;
  M3_CUDA_CHECK(cudaMemcpy(&err, me.error, sizeof(int), cudaMemcpyDeviceToHost));
  if (err == 0) return "";
  return "one-shot all-reduce: rank " + std::to_string(rank) +
         " gave up waiting for a peer (a rank that never joined the call); its results are "
         "wrong";
}

}  // namespace m3::dist
