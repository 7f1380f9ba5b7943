// The wgmma grouped expert GEMMs in one tile configuration (moe_grouped_sm90_gemm.cuh): M = 128
// tokens, N = 256 weight rows, cooperative, clusters of 2 along N (the token tile multicast).
#if defined(M3_MOE_SM90)
#include "kernels/cuda/moe_grouped_sm90_gemm.cuh"

namespace m3::kernels::cuda::moe_grouped::sm90 {
const Config kTokens128x256 = Experts<cute::Shape<cute::_128, cute::_256, cute::_64>,
                                      cute::Shape<cute::_1, cute::_2, cute::_1>, false,
                                      false>::config("128t x 256w coop, cluster 1x2");
}  // namespace m3::kernels::cuda::moe_grouped::sm90
#endif
