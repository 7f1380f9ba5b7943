// The wgmma grouped expert GEMMs in one tile configuration (moe_grouped_sm90_gemm.cuh): M = 64
// tokens, N = 256 weight rows, ping-pong (the two consumer warpgroups on alternate tiles),
// clusters of 2 along N (the token tile multicast).
#if defined(M3_MOE_SM90)
#include "kernels/cuda/moe_grouped_sm90_gemm.cuh"

namespace m3::kernels::cuda::moe_grouped::sm90 {
const Config kTokens64x256Pp = Experts<cute::Shape<cute::_64, cute::_256, cute::_64>,
                                       cute::Shape<cute::_1, cute::_2, cute::_1>, true,
                                       false>::config("64t x 256w ping-pong, cluster 1x2");
}  // namespace m3::kernels::cuda::moe_grouped::sm90
#endif
