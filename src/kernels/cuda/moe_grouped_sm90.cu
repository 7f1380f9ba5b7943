// The Hopper engine of the grouped expert GEMMs (moe_grouped.cuh, "sm90_*"): CUTLASS's
// ptr-array grouped GEMM (TMA loads, wgmma, a producer warp and two consumer warpgroups per CTA,
// a persistent grid over the group list) from the CUTLASS headers that FlashInfer's wheel bundles
// (.deps/flashinfer/cutlass; src/kernels/CMakeLists.txt defines M3_MOE_SM90 when they are there).
// Without them this file only says so (sm90_built() false) and the mma.sync kernels of
// moe_grouped.cu serve every call.
//
// Shapes, pointers and strides of every group live in device memory, written by setup_kernel
// from the routing offsets: the host never learns the per-expert counts, so the call is free of
// host syncs and a CUDA graph may capture it (CUTLASS's group scheduler walks the problem list
// on the device when no host copy of the shapes is given).
//
// Swapped operands: the GEMM's M side is the expert's weight rows and its N side the expert's
// tokens (D^T = W · X^T), so the per-expert padding lives in the token tile (128) only, and the
// column-major D of (weight row, token) is our row-major [token][weight row] output.
//   gate|up: 2 ne groups, expert e's gate (2e) and up (2e + 1) over the same gathered rows xg,
//            into gu [P][2 inter] (gate at columns [0, inter), up at [inter, 2 inter)), bf16;
//   swiglu:  act [P][inter] = bf16(swiglu_oai(gu gate, gu up)) (a separate pass: CUTLASS's
//            epilogue sees one group's columns, never the gate and up of one element together);
//   down:    ne groups, ye [P][hidden] = act · w2[e]^T in fp32.
#include <atomic>
#include <cstdint>

#include <cuda_bf16.h>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/gemv.cuh"
#include "kernels/cuda/moe_grouped.cuh"

#if defined(M3_MOE_SM90)
#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/thread/linear_combination.h>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#endif

namespace m3::kernels::cuda::moe_grouped {

#if defined(M3_MOE_SM90)

namespace {

using Problem = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;
using Mnk = Problem::UnderlyingProblemShape;
using Bf16 = cutlass::bfloat16_t;

// One grouped GEMM: bf16 operands, fp32 accumulation, D of ElementD; A = weights [M][K]
// (row-major), B = tokens [N][K] (CUTLASS's column-major K x N), D column-major M x N.
template <class ElementD>
struct GroupedGemm {
  using TileShape = cute::Shape<cute::_256, cute::_128, cute::_64>;
  using ClusterShape = cute::Shape<cute::_2, cute::_1, cute::_1>;
  using LayoutA = cutlass::layout::RowMajor;
  using LayoutB = cutlass::layout::ColumnMajor;
  using LayoutD = cutlass::layout::ColumnMajor;
  static constexpr int kAlignAB = 8;
  static constexpr int kAlignD = 128 / cutlass::sizeof_bits<ElementD>::value;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD*, kAlignD,
      ElementD, LayoutD*, kAlignD, cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative,
      cutlass::epilogue::fusion::LinearCombination<ElementD, float, void, float>>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Bf16, LayoutA*, kAlignAB, Bf16,
      LayoutB*, kAlignAB, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epilogue::SharedStorage))>,
      cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Problem, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;

  // The per-group arrays (device memory, `groups` entries each).
  struct Arrays {
    Mnk* shape;
    const Bf16** a;
    const Bf16** b;
    ElementD** d;
    StrideA* sa;
    StrideB* sb;
    StrideD* sd;
  };
  static size_t array_bytes(int64_t groups) {
    const size_t per = sizeof(Mnk) + 2 * sizeof(void*) + sizeof(void*) + sizeof(StrideA) +
                       sizeof(StrideB) + sizeof(StrideD);
    return static_cast<size_t>(groups) * per + 7 * 256;
  }
  static Arrays carve(uint8_t*& p, int64_t groups) {
    auto take = [&](size_t bytes) {
      void* r = p;
      p += (bytes + 255) / 256 * 256;
      return r;
    };
    Arrays a;
    a.shape = static_cast<Mnk*>(take(groups * sizeof(Mnk)));
    a.a = static_cast<const Bf16**>(take(groups * sizeof(void*)));
    a.b = static_cast<const Bf16**>(take(groups * sizeof(void*)));
    a.d = static_cast<ElementD**>(take(groups * sizeof(void*)));
    a.sa = static_cast<StrideA*>(take(groups * sizeof(StrideA)));
    a.sb = static_cast<StrideB*>(take(groups * sizeof(StrideB)));
    a.sd = static_cast<StrideD*>(take(groups * sizeof(StrideD)));
    return a;
  }

  static typename Gemm::Arguments arguments(const Arrays& a, int groups, int device,
                                            int sm_count) {
    cutlass::KernelHardwareInfo hw;
    hw.device_id = device;
    hw.sm_count = sm_count;
    typename Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGrouped,
                                  {groups, a.shape, nullptr},
                                  {a.a, a.sa, a.b, a.sb},
                                  {{}, nullptr, a.sd, a.d, a.sd},
                                  hw};
    args.epilogue.thread.alpha = 1.f;
    args.epilogue.thread.beta = 0.f;
    return args;
  }
};

using GateUp = GroupedGemm<Bf16>;
using Down = GroupedGemm<float>;

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

// Bytes of CUTLASS's own workspace (per-SM TMA descriptors) for one kernel.
template <class G>
size_t cutlass_workspace(int groups, int device) {
  typename G::Arrays none{};
  return G::Gemm::get_workspace_size(G::arguments(none, groups, device, sm_count_of(device)));
}

// The group arrays of both GEMMs from offsets [ne + 1]: one thread per expert.
__global__ void setup_kernel(const int32_t* __restrict__ offsets, int ne, int64_t inter,
                             int64_t hidden, const Bf16* w1, const Bf16* w3, const Bf16* w2,
                             const Bf16* xg, Bf16* gu, const Bf16* act, float* ye,
                             GateUp::Arrays g1, Down::Arrays g2) {
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= ne) return;
  const int64_t begin = offsets[e];
  const int rows = offsets[e + 1] - offsets[e];
  for (int up = 0; up < 2; ++up) {
    const int g = 2 * e + up;
    g1.shape[g] = Mnk{static_cast<int>(inter), rows, static_cast<int>(hidden)};
    g1.a[g] = (up ? w3 : w1) + e * inter * hidden;
    g1.b[g] = xg + begin * hidden;
    g1.d[g] = gu + begin * 2 * inter + up * inter;
    GateUp::StrideA sa{};
    cute::get<0>(sa) = hidden;
    GateUp::StrideB sb{};
    cute::get<0>(sb) = hidden;
    GateUp::StrideD sd{};
    cute::get<1>(sd) = 2 * inter;
    g1.sa[g] = sa;
    g1.sb[g] = sb;
    g1.sd[g] = sd;
  }
  g2.shape[e] = Mnk{static_cast<int>(hidden), rows, static_cast<int>(inter)};
  g2.a[e] = w2 + e * hidden * inter;
  g2.b[e] = act + begin * inter;
  g2.d[e] = ye + begin * hidden;
  Down::StrideA sa{};
  cute::get<0>(sa) = inter;
  Down::StrideB sb{};
  cute::get<0>(sb) = inter;
  Down::StrideD sd{};
  cute::get<1>(sd) = hidden;
  g2.sa[e] = sa;
  g2.sb[e] = sb;
  g2.sd[e] = sd;
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

template <class G>
void run_gemm(const typename G::Arrays& arr, int groups, void* ws, size_t ws_bytes, int device,
              cudaStream_t stream) {
  const auto args = G::arguments(arr, groups, device, sm_count_of(device));
  typename G::Gemm gemm;
  M3_CHECK(gemm.can_implement(args) == cutlass::Status::kSuccess,
           "moe grouped GEMM (sm90): CUTLASS cannot implement this problem");
  M3_CHECK(G::Gemm::get_workspace_size(args) <= ws_bytes,
           "moe grouped GEMM (sm90): workspace of %zu bytes, %zu needed", ws_bytes,
           G::Gemm::get_workspace_size(args));
  M3_CHECK(gemm.initialize(args, ws, stream) == cutlass::Status::kSuccess,
           "moe grouped GEMM (sm90): initialize failed");
  const cutlass::Status st = gemm.run(stream);
  M3_CHECK(st == cutlass::Status::kSuccess, "moe grouped GEMM (sm90): launch failed: %s",
           cutlass::cutlassGetStatusString(st));
  M3_CUDA_CHECK_LAUNCH("moe grouped GEMM (sm90)");
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

size_t sm90_workspace_bytes(int64_t ne) {
  int device = 0;
  M3_CUDA_CHECK(cudaGetDevice(&device));
  const int groups = static_cast<int>(2 * ne);
  const size_t ws = std::max(cutlass_workspace<GateUp>(groups, device),
                             cutlass_workspace<Down>(static_cast<int>(ne), device));
  return GateUp::array_bytes(2 * ne) + Down::array_bytes(ne) + (ws + 255) / 256 * 256 + 256;
}

void sm90_experts(const float* x, const int32_t* pair_token, int64_t P, const int32_t* offsets,
                  const MoeExpertWeights& w, const SwigluParams& act, uint16_t* xg, uint16_t* gu,
                  uint16_t* act16, float* ye, void* workspace, size_t workspace_bytes,
                  cudaStream_t stream) {
  if (P == 0) return;
  int device = 0;
  M3_CUDA_CHECK(cudaGetDevice(&device));
  M3_CHECK(is_sm90(device), "moe grouped GEMM (sm90): device %d is not an sm_90 GPU", device);
  M3_CHECK(w.hidden % 8 == 0 && w.inter % 8 == 0 && w.hidden < (1 << 30) && w.inter < (1 << 30),
           "moe grouped GEMM (sm90): hidden %lld / inter %lld must be multiples of 8",
           static_cast<long long>(w.hidden), static_cast<long long>(w.inter));
  M3_CHECK(reinterpret_cast<uintptr_t>(x) % 16 == 0,
           "moe grouped GEMM (sm90): x must be 16-byte aligned");
  const int ne = static_cast<int>(w.num_experts);
  M3_CHECK(workspace_bytes >= sm90_workspace_bytes(ne),
           "moe grouped GEMM (sm90): workspace of %zu bytes, %zu needed", workspace_bytes,
           sm90_workspace_bytes(ne));
  uint8_t* p = static_cast<uint8_t*>(workspace);
  const GateUp::Arrays g1 = GateUp::carve(p, 2 * ne);
  const Down::Arrays g2 = Down::carve(p, ne);
  p = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(p) + 255) / 256 * 256);
  const size_t ws_left = workspace_bytes - static_cast<size_t>(p - static_cast<uint8_t*>(workspace));

  gather_bf16_kernel<<<static_cast<unsigned>(P), 256, 0, stream>>>(
      x, pair_token, offsets, ne, w.hidden, reinterpret_cast<__nv_bfloat16*>(xg));
  M3_CUDA_CHECK_LAUNCH("gather_bf16_kernel");
  setup_kernel<<<(ne + 127) / 128, 128, 0, stream>>>(
      offsets, ne, w.inter, w.hidden, static_cast<const Bf16*>(w.w1),
      static_cast<const Bf16*>(w.w3), static_cast<const Bf16*>(w.w2),
      reinterpret_cast<const Bf16*>(xg), reinterpret_cast<Bf16*>(gu),
      reinterpret_cast<const Bf16*>(act16), ye, g1, g2);
  M3_CUDA_CHECK_LAUNCH("moe sm90 setup_kernel");
  run_gemm<GateUp>(g1, 2 * ne, p, ws_left, device, stream);
  swiglu_bf16_kernel<<<static_cast<unsigned>(P), 256, 0, stream>>>(
      reinterpret_cast<const __nv_bfloat16*>(gu), offsets, ne, w.inter, act,
      reinterpret_cast<__nv_bfloat16*>(act16));
  M3_CUDA_CHECK_LAUNCH("swiglu_bf16_kernel");
  run_gemm<Down>(g2, ne, p, ws_left, device, stream);
}

#else  // !M3_MOE_SM90: this build has no CUTLASS headers

bool sm90_built() {
  return false;
}
bool sm90_usable() {
  return false;
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
