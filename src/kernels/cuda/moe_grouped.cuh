// The grouped tensor-core GEMMs of the routed experts (moe_experts' path for many tokens under
// GemmPrecision::kBf16): every active expert's tokens in one launch per projection, the tile
// list built on the device from the routing offsets (no host sync, so a CUDA graph may capture
// it). Internal to moe_experts.cu; moe_grouped.cu holds the kernels.
//   gate_up: act[p, c] = bf16(swiglu(xb[tok(p)] · w1[e][c], xb[tok(p)] · w3[e][c])) for the
//            positions p of expert e (rows gathered through pair_token);
//   down:    ye[p, c] = act[p] · w2[e][c] (fp32).
// bf16 operands on mma.sync m16n8k16 with fp32 accumulation; a CTA computes BM positions of one
// expert by 128 weight rows (gate|up: 64 of each, so the SwiGLU pairs meet in one thread's
// registers), K in steps of 64 through a 3- or 4-stage cp.async pipeline.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "kernels/views.h"

namespace m3::kernels::cuda::moe_grouped {

// Positions [row_begin, row_end) of one expert: one CTA row of the grouped GEMM.
struct Tile {
  int32_t expert, row_begin, row_end;
};

// Tokens per CTA tile for P positions over ne experts: 128 when the mean expert holds at least
// 64 positions, else 64 (less padding for decode-sized batches).
int tile_rows(int64_t P, int64_t ne);
// Upper bound of the tiles for P positions (each active expert adds at most one partial tile).
int64_t max_tiles(int64_t P, int64_t ne, int bm);

// Whether the grouped GEMMs can read these weights (bf16, K and N multiples of 8, 16-byte
// aligned expert matrices).
bool supports(const MoeExpertWeights& w);

// tiles[0, *num_tiles) from offsets [ne + 1] and the ascending active list.
void build_tiles(const int32_t* offsets, const int32_t* active, const int32_t* num_active, int bm,
                 Tile* tiles, int32_t* num_tiles, cudaStream_t stream);

// out[i] = bf16(x[i]) (round to nearest even) for i < count.
void to_bf16(const float* x, int64_t count, uint16_t* out, cudaStream_t stream);

// The two projections (see the file comment). xb [n, hidden] bf16; pair_token [P]; act [P, inter]
// bf16; ye [P, hidden] f32. max_tiles: the grid's bound (tiles past *num_tiles exit at once).
void gate_up(const uint16_t* xb, const int32_t* pair_token, const Tile* tiles,
             const int32_t* num_tiles, int64_t max_tiles, int bm, const MoeExpertWeights& w,
             const SwigluParams& act, uint16_t* act_out, cudaStream_t stream);
void down(const uint16_t* act, const Tile* tiles, const int32_t* num_tiles, int64_t max_tiles,
          int bm, const MoeExpertWeights& w, float* ye, cudaStream_t stream);

// ---- The Hopper engine (moe_grouped_sm90.cu): CUTLASS's ptr-array grouped GEMM (TMA, wgmma,
// warp-specialised persistent CTAs), built where the CUTLASS headers are (M3_MOE_SM90).
// Whether this build has it, and whether it has it and the current device is sm_90.
bool sm90_built();
bool sm90_usable();
// Device bytes of its group arrays and CUTLASS's workspace for ne experts (the current device,
// any variant).
size_t sm90_workspace_bytes(int64_t ne);
// Its compiled tile configurations x raster orders ("variants"; 0 without the engine), their
// names, and the one calls use (process-wide: M3_MOE_WGMMA_VARIANT at first use, else 0).
int sm90_variants();
const char* sm90_variant_name(int v);
void set_sm90_variant(int v);
int sm90_variant();
// The routed experts' GEMMs over the positions grouped by offsets [ne + 1] (P picks, of which
// the offsets[ne] first are this rank's positions): xg [P, hidden] =
// bf16(x[pair_token[p]]), gu [P, 2 inter] bf16 (gate | up), act [P, inter] bf16 swiglu, ye
// [P, hidden] f32 = act · w2[e]^T. ye may overlay xg and gu (they are dead once act is
// written); workspace: sm90_workspace_bytes(ne).
void sm90_experts(const float* x, const int32_t* pair_token, int64_t P, const int32_t* offsets,
                  const MoeExpertWeights& w, const SwigluParams& act, uint16_t* xg, uint16_t* gu,
                  uint16_t* act16, float* ye, void* workspace, size_t workspace_bytes,
                  cudaStream_t stream);

}  // namespace m3::kernels::cuda::moe_grouped
