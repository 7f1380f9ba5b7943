// The wgmma grouped expert GEMMs in one tile configuration (moe_grouped_sm90_gemm.cuh): swapped
// operands (M = 256 weight rows, N = 128 tokens), cooperative, clusters of 2 along M (the token
// tile multicast to both CTAs).
#if defined(M3_MOE_SM90)
#include "kernels/cuda/moe_grouped_sm90_gemm.cuh"

namespace m3::kernels::cuda::moe_grouped::sm90 {
const Config kSwap256x128 = Experts<cute::Shape<cute::_256, cute::_128, cute::_64>,
                                    cute::Shape<cute::_2, cute::_1, cute::_1>, false,
                                    true>::config("swap 256w x 128t coop, cluster 2x1");
}  // namespace m3::kernels::cuda::moe_grouped::sm90
#endif
