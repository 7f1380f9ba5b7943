// CUTLASS's ptr-array grouped GEMM for the routed experts in one tile configuration (included by
// the moe_grouped_sm90_t*.cu files, each defining one sm90::Config). bf16 operands, fp32
// accumulation, D in bf16 (gate|up) or fp32 (down). Every group's shape, pointers and strides
// are written on the device by setup_kernel from the routing offsets; CUTLASS's group scheduler
// reads them there (no host copy of the shapes: the launch needs no host sync and a CUDA graph
// may capture it; its grid is one persistent CTA per SM).
//
// kSwap: the GEMM's M side is the expert's weight rows and its N side its tokens (D^T = W X^T;
// the column-major D of (weight row, token) is our row-major [token][weight row]), so the
// per-expert padding lies in the token tile only. Otherwise M = tokens, N = weight rows.
#pragma once

#include <algorithm>
#include <cstdint>

#include <cutlass/cutlass.h>
#include <cutlass/epilogue/thread/linear_combination.h>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cute/tensor.hpp>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/moe_grouped_sm90.cuh"

namespace m3::kernels::cuda::moe_grouped::sm90 {

using Problem = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;
using Mnk = Problem::UnderlyingProblemShape;
using Bf16 = cutlass::bfloat16_t;

// Tile: CTA tile (M, N, K); Cluster; kPingpong: the ping-pong schedule (two consumer warpgroups
// on alternate tiles) instead of the cooperative one (both on one tile); kSwap as above.
template <class ElementD, class Tile, class Cluster, bool kPingpong, bool kSwap>
struct GroupedGemm {
  using LayoutA = cutlass::layout::RowMajor;     // [M][K]
  using LayoutB = cutlass::layout::ColumnMajor;  // [N][K]
  using LayoutD =
      std::conditional_t<kSwap, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;
  using MainSchedule =
      std::conditional_t<kPingpong, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                         cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>;
  using EpiSchedule =
      std::conditional_t<kPingpong, cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong,
                         cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;
  static constexpr int kAlignAB = 8;
  static constexpr int kAlignD = 128 / cutlass::sizeof_bits<ElementD>::value;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD*, kAlignD,
      ElementD, LayoutD*, kAlignD, EpiSchedule,
      cutlass::epilogue::fusion::LinearCombination<ElementD, float, void, float>>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Bf16, LayoutA*, kAlignAB, Bf16, LayoutB*,
      kAlignAB, float, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epilogue::SharedStorage))>,
      MainSchedule>::CollectiveOp;
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
    const size_t per =
        sizeof(Mnk) + 3 * sizeof(void*) + sizeof(StrideA) + sizeof(StrideB) + sizeof(StrideD);
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

  // Group g: `rows` tokens at `tok` (row stride k), weights `w` ([n][k]), output d (row
  // stride ldd per token), n output columns, reduction k.
  __device__ static void set_group(const Arrays& a, int g, int rows, int n, int k, const Bf16* tok,
                                   const Bf16* w, ElementD* d, int64_t ldd) {
    StrideA sa{};
    cute::get<0>(sa) = k;
    StrideB sb{};
    cute::get<0>(sb) = k;
    StrideD sd{};
    if constexpr (kSwap) {
      a.shape[g] = Mnk{n, rows, k};
      a.a[g] = w;
      a.b[g] = tok;
      cute::get<1>(sd) = ldd;
    } else {
      a.shape[g] = Mnk{rows, n, k};
      a.a[g] = tok;
      a.b[g] = w;
      cute::get<0>(sd) = ldd;
    }
    a.d[g] = d;
    a.sa[g] = sa;
    a.sb[g] = sb;
    a.sd[g] = sd;
  }

  static typename Gemm::Arguments arguments(const Arrays& a, int groups, const Call& c) {
    cutlass::KernelHardwareInfo hw;
    hw.device_id = c.device;
    hw.sm_count = c.sm_count;
    typename Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGrouped,
                                  {groups, a.shape, nullptr},
                                  {a.a, a.sa, a.b, a.sb},
                                  {{}, nullptr, a.sd, a.d, a.sd},
                                  hw};
    args.epilogue.thread.alpha = 1.f;
    args.epilogue.thread.beta = 0.f;
    using Raster = typename Kernel::TileScheduler::RasterOrderOptions;
    args.scheduler.raster_order = c.along_n ? Raster::AlongN : Raster::AlongM;
    return args;
  }

  static size_t cutlass_workspace(int groups, int device, int sm_count) {
    Call c{};
    c.device = device;
    c.sm_count = sm_count;
    return Gemm::get_workspace_size(arguments(Arrays{}, groups, c));
  }

  static void run(const Arrays& arr, int groups, const Call& c, void* ws, size_t ws_bytes,
                  cudaStream_t stream) {
    const auto args = arguments(arr, groups, c);
    Gemm gemm;
    M3_CHECK(gemm.can_implement(args) == cutlass::Status::kSuccess,
             "moe grouped GEMM (sm90): CUTLASS cannot implement this problem");
    M3_CHECK(Gemm::get_workspace_size(args) <= ws_bytes,
             "moe grouped GEMM (sm90): workspace of %zu bytes, %zu needed", ws_bytes,
             Gemm::get_workspace_size(args));
    M3_CHECK(gemm.initialize(args, ws, stream) == cutlass::Status::kSuccess,
             "moe grouped GEMM (sm90): initialize failed");
    const cutlass::Status st = gemm.run(stream);
    M3_CHECK(st == cutlass::Status::kSuccess, "moe grouped GEMM (sm90): launch failed: %s",
             cutlass::cutlassGetStatusString(st));
    M3_CUDA_CHECK_LAUNCH("moe grouped GEMM (sm90)");
  }
};

// The group arrays of both GEMMs of E (an Experts<...>) from the offsets: one thread per
// expert; gate|up group 2e is expert e's gate, 2e + 1 its up (same rows, output columns
// [0, inter) and [inter, 2 inter)).
template <class E>
__global__ void setup_kernel(Call c, typename E::GateUp::Arrays g1, typename E::Down::Arrays g2);

// Both projections in one tile configuration.
template <class Tile, class Cluster, bool kPingpong, bool kSwap>
struct Experts {
  using GateUp = GroupedGemm<Bf16, Tile, Cluster, kPingpong, kSwap>;
  using Down = GroupedGemm<float, Tile, Cluster, kPingpong, kSwap>;

  struct Parts {
    typename GateUp::Arrays g1;
    typename Down::Arrays g2;
    void* ws;
    size_t ws_bytes;
  };
  static Parts parts(const Call& c) {
    Parts p;
    uint8_t* at = static_cast<uint8_t*>(c.ws);
    p.g1 = GateUp::carve(at, 2 * c.ne);
    p.g2 = Down::carve(at, c.ne);
    const size_t used = static_cast<size_t>(at - static_cast<uint8_t*>(c.ws));
    M3_CHECK(used <= c.ws_bytes, "moe grouped GEMM (sm90): workspace too small");
    p.ws = at;
    p.ws_bytes = c.ws_bytes - used;
    return p;
  }

  static size_t workspace_bytes(int ne, int device, int sm_count) {
    const size_t ws = std::max(GateUp::cutlass_workspace(2 * ne, device, sm_count),
                               Down::cutlass_workspace(ne, device, sm_count));
    return GateUp::array_bytes(2 * ne) + Down::array_bytes(ne) + (ws + 255) / 256 * 256;
  }

  static void gate_up(const Call& c, cudaStream_t stream) {
    const Parts p = parts(c);
    setup_kernel<Experts><<<(c.ne + 127) / 128, 128, 0, stream>>>(c, p.g1, p.g2);
    M3_CUDA_CHECK_LAUNCH("moe sm90 setup_kernel");
    GateUp::run(p.g1, 2 * c.ne, c, p.ws, p.ws_bytes, stream);
  }
  static void down(const Call& c, cudaStream_t stream) {
    const Parts p = parts(c);
    Down::run(p.g2, c.ne, c, p.ws, p.ws_bytes, stream);
  }

  static constexpr Config config(const char* name) {
    return Config{name, &workspace_bytes, &gate_up, &down};
  }
};

template <class E>
__global__ void setup_kernel(Call c, typename E::GateUp::Arrays g1, typename E::Down::Arrays g2) {
  using GateUp = typename E::GateUp;
  using Down = typename E::Down;
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= c.ne) return;
  const int64_t begin = c.offsets[e];
  const int rows = c.offsets[e + 1] - c.offsets[e];
  const int inter = static_cast<int>(c.inter), hidden = static_cast<int>(c.hidden);
  const Bf16* xg = static_cast<const Bf16*>(c.xg) + begin * hidden;
  Bf16* gu = static_cast<Bf16*>(c.gu) + begin * 2 * inter;
  const int64_t wsz = static_cast<int64_t>(inter) * hidden;
  GateUp::set_group(g1, 2 * e, rows, inter, hidden, xg, static_cast<const Bf16*>(c.w1) + e * wsz,
                    gu, 2 * inter);
  GateUp::set_group(g1, 2 * e + 1, rows, inter, hidden, xg,
                    static_cast<const Bf16*>(c.w3) + e * wsz, gu + inter, 2 * inter);
  Down::set_group(g2, e, rows, hidden, inter, static_cast<const Bf16*>(c.act) + begin * inter,
                  static_cast<const Bf16*>(c.w2) + e * wsz, c.ye + begin * hidden, hidden);
}

}  // namespace m3::kernels::cuda::moe_grouped::sm90
