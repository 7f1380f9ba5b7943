// The CUTLASS side of the wgmma grouped expert GEMMs (moe_grouped_sm90.cu): one tile
// configuration per translation unit (moe_grouped_sm90_t*.cu, so they compile in parallel), each
// running both projections for a call. Included only by those files, and only where
// M3_MOE_SM90 is defined (the CUTLASS headers are found).
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

namespace m3::kernels::cuda::moe_grouped::sm90 {

// One call of both GEMMs (device pointers; see moe_grouped.cuh for the buffers).
struct Call {
  const int32_t* offsets;  // [ne + 1]
  int ne;
  int64_t inter, hidden;
  const void *w1, *w3, *w2;  // bf16 [ne][inter][hidden], [ne][inter][hidden], [ne][hidden][inter]
  const void* xg;            // bf16 [P][hidden]
  void* gu;                  // bf16 [P][2 inter]
  const void* act;           // bf16 [P][inter]
  float* ye;                 // [P][hidden]
  void* ws;                  // group arrays, then CUTLASS's workspace
  size_t ws_bytes;
  int device, sm_count;
  bool along_n;  // CUTLASS's raster order (false: along M)
};

// A tile configuration: its workspace bytes for ne experts, and the two GEMMs of a call
// (gate|up, then - after `between`, the SwiGLU pass - down).
struct Config {
  const char* name;
  size_t (*workspace_bytes)(int ne, int device, int sm_count);
  void (*gate_up)(const Call& c, cudaStream_t stream);
  void (*down)(const Call& c, cudaStream_t stream);
};

// The configurations of this build, in moe_grouped_sm90_t*.cu.
extern const Config kSwap256x128;     // D^T = W X^T, 256 weight rows x 128 tokens, cooperative
extern const Config kTokens128x256;   // D = X W^T, 128 tokens x 256 weight rows, cooperative
extern const Config kTokens64x256Pp;  // D = X W^T, 64 tokens x 256 weight rows, ping-pong

}  // namespace m3::kernels::cuda::moe_grouped::sm90
