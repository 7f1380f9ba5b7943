// The grouped expert GEMMs (moe_grouped.cuh). Layout of one CTA (128 threads, 4 warps as 2 x 2):
// smem holds per stage an A tile [BM][64] (positions x K) and a B tile [128][64] (weight rows x
// K), both bf16 with K contiguous, 16-byte chunks swizzled by row so ldmatrix reads are free of
// bank conflicts. Warp (wm, wn) owns BM/2 rows and eight n8 column tiles (64 x 64 at BM = 128, so
// each ldmatrix feeds 4-8 MMAs): for the down projection B rows [64 wn, 64 wn + 64); for gate|up
// the gate rows [32 wn, 32 wn + 32) (tiles 0-3) and the same up rows [64 + 32 wn, ...) (tiles
// 4-7), so tile j and j + 4 hold the same output element.
#include <algorithm>
#include <atomic>

#include <cuda_bf16.h>

#include "kernels/cuda/attn_common.cuh"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/gemv.cuh"
#include "kernels/cuda/kv_format.cuh"
#include "kernels/cuda/moe_grouped.cuh"

namespace m3::kernels::cuda::moe_grouped {

namespace {

using detail::ceil_div;

constexpr int kThreads = 128;
constexpr int kBK = 64;   // K per stage: 8 chunks of 8 bf16 (128-byte rows)
constexpr int kBN = 128;  // weight rows per CTA
// Pipeline depth: 96 KiB of stages either way, so two CTAs fit on an SM.
template <int BM>
constexpr int stages() {
  return BM == 128 ? 3 : 4;
}

// Element offset of (row, 16-byte chunk c) in a [rows][64] bf16 tile: the chunk is XORed with
// the row's low 3 bits, so the 8 rows an ldmatrix phase reads hit 8 different bank groups.
__device__ __forceinline__ int swz(int row, int c) {
  return row * kBK + ((c ^ (row & 7)) << 3);
}

struct Args {
  const uint16_t* a;      // activations, rows of K
  const int32_t* a_rows;  // position -> row of `a` (null: the position itself)
  const uint16_t* b0;     // expert 0's first matrix (w1 or w2), [N, K] per expert
  const uint16_t* b1;     // expert 0's second matrix (w3; gate|up only)
  int64_t b_stride;       // elements between experts
  int n, k;               // output columns (weight rows) and reduction length
  const Tile* tiles;
  const int32_t* num_tiles;
  void* out;  // [P, n]: bf16 act (gate|up) or f32 ye (down)
  SwigluParams act;
};

template <int BM, bool kGateUp>
__global__ void __launch_bounds__(kThreads, 2) grouped_gemm_kernel(Args p) {
  constexpr int MI = BM / 32;  // m16 tiles per warp (warp rows BM / 2)
  constexpr int NJ = 8;        // n8 tiles per warp (warp columns 64)
  constexpr int kStages = stages<BM>();
  const int t = blockIdx.y;
  if (t >= *p.num_tiles) return;
  const Tile tile = p.tiles[t];
  extern __shared__ __align__(128) uint16_t smem[];
  uint16_t* As = smem;                       // [kStages][BM][kBK]
  uint16_t* Bs = smem + kStages * BM * kBK;  // [kStages][kBN][kBK]
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp >> 1, wn = warp & 1;
  // Output columns of this CTA: gate|up 64 (gate rows c0.., up rows c0..), down 128.
  const int c0 = blockIdx.x * (kGateUp ? kBN / 2 : kBN);
  const int64_t e = tile.expert;

  // This thread's loads per stage: chunk lc of rows lr + 16 i (A: i < BM / 16, B: i < 8). The
  // source rows are fixed for the whole K loop.
  constexpr int kAL = BM / 16, kBL = kBN / 16;
  const int lc = tid & 7, lr = tid >> 3;
  int64_t a_off[kAL];  // element offset of the row's chunk in `a`, -1: past the tile
#pragma unroll
  for (int i = 0; i < kAL; ++i) {
    const int pos = tile.row_begin + lr + 16 * i;
    a_off[i] = pos < tile.row_end
                   ? static_cast<int64_t>(p.a_rows ? p.a_rows[pos] : pos) * p.k + lc * 8
                   : -1;
  }
  int64_t b_off[kBL];  // element offset from expert e's matrix base, -1: past N
  const uint16_t* b_base0 = p.b0 + e * p.b_stride;
  const uint16_t* b_base1 = kGateUp ? p.b1 + e * p.b_stride : b_base0;
#pragma unroll
  for (int i = 0; i < kBL; ++i) {
    const int wrow = c0 + lr + 16 * (kGateUp ? (i & 3) : i);
    b_off[i] = wrow < p.n ? static_cast<int64_t>(wrow) * p.k + lc * 8 : -1;
  }
  const int ktiles = (p.k + kBK - 1) / kBK;
  auto load_stage = [&](int stage, int kt) {
    const int k0 = kt * kBK;
    const bool k_ok = k0 + lc * 8 < p.k;
    uint16_t* as = As + stage * BM * kBK;
    uint16_t* bs = Bs + stage * kBN * kBK;
#pragma unroll
    for (int i = 0; i < kAL; ++i) {
      const bool ok = k_ok && a_off[i] >= 0;
      detail::cp_async16_zfill(as + swz(lr + 16 * i, lc), ok ? p.a + a_off[i] + k0 : p.a, ok);
    }
#pragma unroll
    for (int i = 0; i < kBL; ++i) {
      const bool ok = k_ok && b_off[i] >= 0;
      const uint16_t* base = (kGateUp && i >= 4) ? b_base1 : b_base0;
      detail::cp_async16_zfill(bs + swz(lr + 16 * i, lc), ok ? base + b_off[i] + k0 : p.b0, ok);
    }
  };

  float acc[MI][NJ][4];
#pragma unroll
  for (int i = 0; i < MI; ++i)
#pragma unroll
    for (int j = 0; j < NJ; ++j)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[i][j][r] = 0.f;

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < ktiles) load_stage(s, s);
    detail::cp_async_commit();
  }
  // ldmatrix lane roles: A x4 = rows 0-15 of an m16 tile, chunk +0 / +1 (lanes 16-31);
  // B x4 = two n8 tiles: rows (lane & 7) + 8 (lane >> 4), chunk + ((lane >> 3) & 1).
  const int a_row = lane & 15, a_chunk = lane >> 4;
  const int b_row = (lane & 7) + ((lane >> 4) << 3), b_chunk = (lane >> 3) & 1;
  for (int kt = 0; kt < ktiles; ++kt) {
    detail::cp_async_wait<kStages - 2>();
    __syncthreads();
    {
      const int next = kt + kStages - 1;
      if (next < ktiles) load_stage(next % kStages, next);
      detail::cp_async_commit();
    }
    const uint16_t* as = As + (kt % kStages) * BM * kBK;
    const uint16_t* bs = Bs + (kt % kStages) * kBN * kBK;
#pragma unroll
    for (int kk = 0; kk < kBK / 16; ++kk) {
      uint32_t af[MI][4];
#pragma unroll
      for (int i = 0; i < MI; ++i) {
        const int row = wm * (BM / 2) + i * 16 + a_row;
        detail::ldmatrix_x4(detail::smem_addr(as + swz(row, kk * 2 + a_chunk)), af[i][0], af[i][1],
                            af[i][2], af[i][3]);
      }
      uint32_t bf[NJ][2];
#pragma unroll
      for (int q = 0; q < NJ / 2; ++q) {
        // gate|up: pairs 0, 1 gate rows 32 wn + 16 q, pairs 2, 3 the same up rows (+ 64);
        // down: rows 64 wn + 16 q.
        const int base = kGateUp ? (q >> 1) * 64 + wn * 32 + (q & 1) * 16 : wn * 64 + q * 16;
        detail::ldmatrix_x4(detail::smem_addr(bs + swz(base + b_row, kk * 2 + b_chunk)),
                            bf[2 * q][0], bf[2 * q][1], bf[2 * q + 1][0], bf[2 * q + 1][1]);
      }
#pragma unroll
      for (int i = 0; i < MI; ++i)
#pragma unroll
        for (int j = 0; j < NJ; ++j) detail::mma_bf16(acc[i][j], af[i], bf[j][0], bf[j][1]);
    }
  }
  detail::cp_async_wait<0>();

  // Epilogue: thread holds (row g / g + 8, cols 2 (lane % 4) + {0, 1}) of each m16 x n8 tile.
  const int g = lane >> 2, tq = lane & 3;
#pragma unroll
  for (int i = 0; i < MI; ++i) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int pos = tile.row_begin + wm * (BM / 2) + i * 16 + g + 8 * h;
      if (pos >= tile.row_end) continue;
      if (kGateUp) {
        __nv_bfloat16* out = static_cast<__nv_bfloat16*>(p.out) + static_cast<int64_t>(pos) * p.n;
#pragma unroll
        for (int j = 0; j < NJ / 2; ++j) {
          const int col = c0 + wn * 32 + j * 8 + 2 * tq;
          if (col >= p.n) continue;
          const float v0 = gemv::swiglu_oai(acc[i][j][2 * h], acc[i][j + 4][2 * h], p.act);
          const float v1 = gemv::swiglu_oai(acc[i][j][2 * h + 1], acc[i][j + 4][2 * h + 1], p.act);
          *reinterpret_cast<__nv_bfloat162*>(out + col) = __floats2bfloat162_rn(v0, v1);
        }
      } else {
        float* out = static_cast<float*>(p.out) + static_cast<int64_t>(pos) * p.n;
#pragma unroll
        for (int j = 0; j < NJ; ++j) {
          const int col = c0 + wn * 64 + j * 8 + 2 * tq;
          if (col >= p.n) continue;
          *reinterpret_cast<float2*>(out + col) =
              make_float2(acc[i][j][2 * h], acc[i][j][2 * h + 1]);
        }
      }
    }
  }
}

__global__ void build_tiles_kernel(const int32_t* __restrict__ offsets,
                                   const int32_t* __restrict__ active,
                                   const int32_t* __restrict__ num_active, int bm,
                                   Tile* __restrict__ tiles, int32_t* __restrict__ num_tiles) {
  // One warp: lane l takes active experts l, l + 32, ...; a warp scan of their tile counts
  // places each expert's tiles after those of the experts before it (ascending id).
  const int lane = threadIdx.x, na = *num_active;
  int base = 0;
  for (int a0 = 0; a0 < na; a0 += 32) {
    const int a = a0 + lane;
    int e = 0, begin = 0, end = 0, cnt = 0;
    if (a < na) {
      e = active[a];
      begin = offsets[e];
      end = offsets[e + 1];
      cnt = (end - begin + bm - 1) / bm;
    }
    int incl = cnt;
    for (int o = 1; o < 32; o <<= 1) {
      const int v = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += v;
    }
    const int first = base + incl - cnt;
    for (int i = 0; i < cnt; ++i) {
      const int rb = begin + i * bm;
      tiles[first + i] = Tile{e, rb, min(end, rb + bm)};
    }
    base += __shfl_sync(0xffffffffu, incl, 31);
  }
  if (lane == 0) *num_tiles = base;
}

__global__ void to_bf16_kernel(const float* __restrict__ x, int64_t count,
                               __nv_bfloat16* __restrict__ out) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += step)
    out[i] = __float2bfloat16_rn(x[i]);
}

template <int BM, bool kGateUp>
void launch(const Args& a, int64_t max_tiles, int64_t ncols, cudaStream_t stream) {
  constexpr size_t smem = stages<BM>() * (BM + kBN) * kBK * sizeof(uint16_t);
  static std::atomic<uint64_t> raised{0};  // devices whose limit is set (per function)
  detail::raise_smem_limit_once(raised, grouped_gemm_kernel<BM, kGateUp>, static_cast<int>(smem));
  const int per_cta = kGateUp ? kBN / 2 : kBN;
  M3_CHECK(max_tiles <= 65535, "moe grouped GEMM: %lld tiles", static_cast<long long>(max_tiles));
  const dim3 grid(ceil_div(ncols, per_cta), static_cast<unsigned>(max_tiles));
  grouped_gemm_kernel<BM, kGateUp><<<grid, kThreads, smem, stream>>>(a);
  M3_CUDA_CHECK_LAUNCH("grouped_gemm_kernel");
}

}  // namespace

int tile_rows(int64_t P, int64_t ne) {
  return P >= 64 * ne ? 128 : 64;
}

int64_t max_tiles(int64_t P, int64_t ne, int bm) {
  return (P + bm - 1) / bm + std::min(P, ne);
}

bool supports(const MoeExpertWeights& w) {
  auto al = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  return w.dtype == DType::kBF16 && w.quant == WeightQuant::kNone && w.mats_of == nullptr &&
         w.w1_of == nullptr && w.hidden % 8 == 0 && w.inter % 8 == 0 && al(w.w1) && al(w.w3) &&
         al(w.w2);
}

void build_tiles(const int32_t* offsets, const int32_t* active, const int32_t* num_active, int bm,
                 Tile* tiles, int32_t* num_tiles, cudaStream_t stream) {
  build_tiles_kernel<<<1, 32, 0, stream>>>(offsets, active, num_active, bm, tiles, num_tiles);
  M3_CUDA_CHECK_LAUNCH("build_tiles_kernel");
}

void to_bf16(const float* x, int64_t count, uint16_t* out, cudaStream_t stream) {
  if (count == 0) return;
  const unsigned blocks = static_cast<unsigned>(std::clamp<int64_t>((count + 255) / 256, 1, 8192));
  to_bf16_kernel<<<blocks, 256, 0, stream>>>(x, count, reinterpret_cast<__nv_bfloat16*>(out));
  M3_CUDA_CHECK_LAUNCH("to_bf16_kernel");
}

void gate_up(const uint16_t* xb, const int32_t* pair_token, const Tile* tiles,
             const int32_t* num_tiles, int64_t max_tiles, int bm, const MoeExpertWeights& w,
             const SwigluParams& act, uint16_t* act_out, cudaStream_t stream) {
  Args a{};
  a.a = xb;
  a.a_rows = pair_token;
  a.b0 = static_cast<const uint16_t*>(w.w1);
  a.b1 = static_cast<const uint16_t*>(w.w3);
  a.b_stride = w.inter * w.hidden;
  a.n = static_cast<int>(w.inter);
  a.k = static_cast<int>(w.hidden);
  a.tiles = tiles;
  a.num_tiles = num_tiles;
  a.out = act_out;
  a.act = act;
  if (bm == 128)
    launch<128, true>(a, max_tiles, w.inter, stream);
  else
    launch<64, true>(a, max_tiles, w.inter, stream);
}

void down(const uint16_t* act, const Tile* tiles, const int32_t* num_tiles, int64_t max_tiles,
          int bm, const MoeExpertWeights& w, float* ye, cudaStream_t stream) {
  Args a{};
  a.a = act;
  a.a_rows = nullptr;
  a.b0 = static_cast<const uint16_t*>(w.w2);
  a.b1 = nullptr;
  a.b_stride = w.hidden * w.inter;
  a.n = static_cast<int>(w.hidden);
  a.k = static_cast<int>(w.inter);
  a.tiles = tiles;
  a.num_tiles = num_tiles;
  a.out = ye;
  if (bm == 128)
    launch<128, false>(a, max_tiles, w.hidden, stream);
  else
    launch<64, false>(a, max_tiles, w.hidden, stream);
}

}  // namespace m3::kernels::cuda::moe_grouped
