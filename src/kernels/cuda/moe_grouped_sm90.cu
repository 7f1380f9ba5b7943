// The Hopper engine of the grouped expert GEMMs (moe_grouped.cuh, "sm90_*"): CUTLASS's
// ptr-array grouped GEMM (TMA loads, wgmma, a producer warp and two consumer warpgroups per CTA,
// a persistent grid over the group list) from the CUTLASS headers that FlashInfer's wheel bundles
// (.deps/flashinfer/cutlass; src/kernels/CMakeLists.txt defines M3_MOE_SM90 when they are there).
// Without them this file only says so (sm90_built() false) and the mma.sync kernels of
// moe_grouped.cu serve every call.
//
// Shapes, pointers and strides of every group live in device memory, written by a setup kernel
// from the routing offsets (moe_grouped_sm90_gemm.cuh): the host never learns the per-expert
// counts, so the call is free of host syncs and a CUDA graph may capture it. One call:
//   gather:  xg [P][hidden] = bf16(x[token of p]);
//   gate|up: 2 ne groups, expert e's gate (2e) and up (2e + 1) over the same rows of xg, into
//            gu [P][2 inter] (gate at columns [0, inter), up at [inter, 2 inter)), bf16;
//   swiglu:  act [P][inter] = bf16(swiglu_oai(gate, up)) (a separate pass: CUTLASS's epilogue
//            sees one group's columns, never the gate and the up of one element together);
//   down:    ne groups, ye [P][hidden] = act · w2[e]^T in fp32.
// The tile configuration is one of a few compiled ones (moe_grouped_sm90_t*.cu, "variants" with
// the raster order; bench_gemm_moe times each), variant 0 by default.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include <cuda_bf16.h>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/gemv.cuh"
#include "kernels/cuda/moe_grouped.cuh"
#include "kernels/cuda/moe_grouped_sm90.cuh"

namespace m3::kernels::cuda::moe_grouped {

#if defined(M3_MOE_SM90)

namespace {

// The tile configurations (moe_grouped_sm90_t*.cu), each under both raster orders: variant v is
// configuration v / 2, along N when v is odd. Variant 0 is the default.
const sm90::Config* const kConfigs[] = {&sm90::kSwap256x128, &sm90::kTokens128x256,
                                        &sm90::kTokens64x256Pp};
constexpr int kVariants = 2 * static_cast<int>(sizeof(kConfigs) / sizeof(kConfigs[0]));

// The variant in use: M3_MOE_WGMMA_VARIANT (an integer in [0, kVariants), read on first use;
// anything else is refused) or 0, until set_sm90_variant.
int initial_variant() {
  const char* env = std::getenv("M3_MOE_WGMMA_VARIANT");
  if (env == nullptr || *env == 0) return 0;
  char* end = nullptr;
  const long v = std::strtol(env, &end, 10);
  M3_CHECK(*end == 0 && v >= 0 && v < kVariants,
           "M3_MOE_WGMMA_VARIANT=%s: want an integer in [0, %d) (bench_gemm_moe lists them)", env,
           kVariants);
  return static_cast<int>(v);
}
std::atomic<int>& variant_slot() {
  static std::atomic<int> v{initial_variant()};
  return v;
}

int sm_count_of(int device) {
  static std::atomic<int> cached[64];
  const int slot = device & 63;
  int v = cached[slot].load(std::memory_order_relaxed);
  if (v == 0) {
    M3_CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, device));
    cached[slot].store(v, std::memory_order_relaxed);
  }
  return v;
}

bool is_sm90(int device) {
  static std::atomic<int> cached[64];  // 0 unknown, 1 yes, 2 no
  const int slot = device & 63;
  int v = cached[slot].load(std::memory_order_relaxed);
  if (v == 0) {
    int major = 0, minor = 0;
    M3_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    M3_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
    v = (major == 9 && minor == 0) ? 1 : 2;
    cached[slot].store(v, std::memory_order_relaxed);
  }
  return v == 1;
}

// xg[p] = bf16(x[rows[p]]) for the positions p < offsets[ne] (picks of other ranks' experts
// are not positions), 8 elements (two float4) per thread-step.
__global__ void gather_bf16_kernel(const float* __restrict__ x, const int32_t* __restrict__ rows,
                                   const int32_t* __restrict__ offsets, int ne, int64_t cols,
                                   __nv_bfloat16* __restrict__ xg) {
  const int64_t p = blockIdx.x;
  if (p >= offsets[ne]) return;
  const float4* src = reinterpret_cast<const float4*>(x + static_cast<int64_t>(rows[p]) * cols);
  uint4* dst = reinterpret_cast<uint4*>(xg + p * cols);
  for (int64_t c = threadIdx.x; c < cols / 8; c += blockDim.x) {
    const float4 a = src[2 * c], b = src[2 * c + 1];
    const __nv_bfloat162 v0 = __floats2bfloat162_rn(a.x, a.y), v1 = __floats2bfloat162_rn(a.z, a.w),
                         v2 = __floats2bfloat162_rn(b.x, b.y), v3 = __floats2bfloat162_rn(b.z, b.w);
    uint4 o;
    o.x = *reinterpret_cast<const uint32_t*>(&v0);
    o.y = *reinterpret_cast<const uint32_t*>(&v1);
    o.z = *reinterpret_cast<const uint32_t*>(&v2);
    o.w = *reinterpret_cast<const uint32_t*>(&v3);
    dst[c] = o;
  }
}

// act[p][c] = bf16(swiglu_oai(gu[p][c], gu[p][inter + c])), 8 columns per thread-step.
__global__ void swiglu_bf16_kernel(const __nv_bfloat16* __restrict__ gu,
                                   const int32_t* __restrict__ offsets, int ne, int64_t inter,
                                   SwigluParams a, __nv_bfloat16* __restrict__ act) {
  const int64_t p = blockIdx.x;
  if (p >= offsets[ne]) return;
  const uint4* g = reinterpret_cast<const uint4*>(gu + p * 2 * inter);
  const uint4* u = reinterpret_cast<const uint4*>(gu + p * 2 * inter + inter);
  uint4* dst = reinterpret_cast<uint4*>(act + p * inter);
  for (int64_t c = threadIdx.x; c < inter / 8; c += blockDim.x) {
    const uint4 gv = g[c], uv = u[c];
    const uint32_t gw[4] = {gv.x, gv.y, gv.z, gv.w}, uw[4] = {uv.x, uv.y, uv.z, uv.w};
    uint32_t ow[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float g0 = __uint_as_float(gw[i] << 16), g1 = __uint_as_float(gw[i] & 0xffff0000u);
      const float u0 = __uint_as_float(uw[i] << 16), u1 = __uint_as_float(uw[i] & 0xffff0000u);
      const __nv_bfloat162 r =
          __floats2bfloat162_rn(gemv::swiglu_oai(g0, u0, a), gemv::swiglu_oai(g1, u1, a));
      ow[i] = *reinterpret_cast<const uint32_t*>(&r);
    }
    dst[c] = uint4{ow[0], ow[1], ow[2], ow[3]};
  }
}

}  // namespace

bool sm90_built() {
  return true;
}

bool sm90_usable() {
  int device = 0;
  M3_CUDA_CHECK(cudaGetDevice(&device));
  return is_sm90(device);
}

int sm90_variants() {
  return kVariants;
}

const char* sm90_variant_name(int v) {
  M3_CHECK(v >= 0 && v < kVariants, "moe grouped GEMM (sm90): variant %d of %d", v, kVariants);
  static const std::vector<std::string> names = [] {
    std::vector<std::string> n;
    for (int i = 0; i < kVariants; ++i)
      n.push_back(std::string(kConfigs[i / 2]->name) + (i % 2 ? ", raster N" : ", raster M"));
    return n;
  }();
  return names[v].c_str();
}

void set_sm90_variant(int v) {
  M3_CHECK(v >= 0 && v < kVariants, "moe grouped GEMM (sm90): variant %d of %d", v, kVariants);
  variant_slot().store(v, std::memory_order_relaxed);
}

int sm90_variant() {
  return variant_slot().load(std::memory_order_relaxed);
}

size_t sm90_workspace_bytes(int64_t ne) {
  int device = 0;
  M3_CUDA_CHECK(cudaGetDevice(&device));
  size_t most = 0;
  for (const sm90::Config* c : kConfigs)
    most = std::max(most, c->workspace_bytes(static_cast<int>(ne), device, sm_count_of(device)));
  return most + 256;
}

void sm90_experts(const float* x, const int32_t* pair_token, int64_t P, const int32_t* offsets,
                  const MoeExpertWeights& w, const SwigluParams& act, uint16_t* xg, uint16_t* gu,
                  uint16_t* act16, float* ye, void* workspace, size_t workspace_bytes,
                  cudaStream_t stream) {
  if (P == 0) return;
  int device = 0;
  M3_CUDA_CHECK(cudaGetDevice(&device));
  M3_CHECK(is_sm90(device), "moe grouped GEMM (sm90): device %d is not an sm_90 GPU", device);
  M3_CHECK(w.hidden % 8 == 0 && w.inter % 8 == 0 && w.hidden < (1 << 28) && w.inter < (1 << 28),
           "moe grouped GEMM (sm90): hidden %lld / inter %lld must be multiples of 8",
           static_cast<long long>(w.hidden), static_cast<long long>(w.inter));
  M3_CHECK(reinterpret_cast<uintptr_t>(x) % 16 == 0,
           "moe grouped GEMM (sm90): x must be 16-byte aligned");
  const int ne = static_cast<int>(w.num_experts);
  const int v = sm90_variant();
  const sm90::Config& cfg = *kConfigs[v / 2];
  sm90::Call c{};
  c.offsets = offsets;
  c.ne = ne;
  c.inter = w.inter;
  c.hidden = w.hidden;
  c.w1 = w.w1;
  c.w3 = w.w3;
  c.w2 = w.w2;
  c.xg = xg;
  c.gu = gu;
  c.act = act16;
  c.ye = ye;
  c.device = device;
  c.sm_count = sm_count_of(device);
  c.along_n = v % 2 == 1;
  // The workspace from a 256-byte boundary (sm90_workspace_bytes adds the slack).
  const uintptr_t base = (reinterpret_cast<uintptr_t>(workspace) + 255) / 256 * 256;
  const size_t lost = base - reinterpret_cast<uintptr_t>(workspace);
  const size_t need = cfg.workspace_bytes(ne, device, c.sm_count);
  M3_CHECK(workspace_bytes >= need + lost,
           "moe grouped GEMM (sm90): workspace of %zu bytes, %zu needed", workspace_bytes,
           need + lost);
  c.ws = reinterpret_cast<void*>(base);
  c.ws_bytes = workspace_bytes - lost;

  gather_bf16_kernel<<<static_cast<unsigned>(P), 256, 0, stream>>>(
      x, pair_token, offsets, ne, w.hidden, reinterpret_cast<__nv_bfloat16*>(xg));
  M3_CUDA_CHECK_LAUNCH("gather_bf16_kernel");
  cfg.gate_up(c, stream);
  swiglu_bf16_kernel<<<static_cast<unsigned>(P), 256, 0, stream>>>(
      reinterpret_cast<const __nv_bfloat16*>(gu), offsets, ne, w.inter, act,
      reinterpret_cast<__nv_bfloat16*>(act16));
  M3_CUDA_CHECK_LAUNCH("swiglu_bf16_kernel");
  cfg.down(c, stream);
}

#else  // !M3_MOE_SM90: this build has no CUTLASS headers

bool sm90_built() {
  return false;
}
bool sm90_usable() {
  return false;
}
int sm90_variants() {
  return 0;
}
const char* sm90_variant_name(int) {
  M3_CHECK(false, "moe grouped GEMM (sm90): this build has no CUTLASS headers");
  return "";
}
void set_sm90_variant(int) {
  M3_CHECK(false, "moe grouped GEMM (sm90): this build has no CUTLASS headers");
}
int sm90_variant() {
  return 0;
}
size_t sm90_workspace_bytes(int64_t) {
  return 0;
}
void sm90_experts(const float*, const int32_t*, int64_t, const int32_t*, const MoeExpertWeights&,
                  const SwigluParams&, uint16_t*, uint16_t*, uint16_t*, float*, void*, size_t,
                  cudaStream_t) {
  M3_CHECK(false,
           "moe grouped GEMM (sm90): this build has no CUTLASS headers (.deps/flashinfer: run "
           "tools/flashinfer_deps.sh and reconfigure); the mma.sync engine serves it");
}

#endif

}  // namespace m3::kernels::cuda::moe_grouped
