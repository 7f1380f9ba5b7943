// linear_quant (ops.h): the quantized linear of the GPU model. Decode-sized calls go to the GEMV
// that reads the stored codes (quant_gemv.cu); under the bf16 GEMM precision, up to
// kQuantGemmMaxTokens tokens, the tensor-core GEMM that reads the codes as stored and converts
// them in shared memory (moe_grouped_quant.cu dense_quant: bf16(x), as linear()'s bf16 GEMM);
// larger ones (and the exact precision) dequantise the matrix into the caller's workspace
// without its row factor (exact in bf16), run linear()'s tensor-core GEMM under the GEMM
// precision, then apply the factor, so the result is the fp32 product up to summation order, as
// for bf16 weights. With FP8 activations on (quant.h fp8_activations), fp8_per_channel prefill
// GEMMs run on the FP8 tensor cores instead (fp8_linear.cu).
#include "core/check.h"
#include "kernels/cuda/blas.h"
#include "kernels/cuda/moe_grouped_quant.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/quant.h"

namespace m3::kernels::cuda {

namespace {
bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}
}  // namespace

size_t linear_quant_workspace_bytes(int64_t n, const MatRef& w) {
  if (n <= kQuantGemvMaxTokens) return 0;
  return static_cast<size_t>(w.rows) * static_cast<size_t>(w.cols) * sizeof(uint16_t);
}

void linear_quant(const float* x, int64_t n, const MatRef& w, float* y, Workspace ws,
                  cudaStream_t stream) {
  M3_CHECK(quant_op_supported(w), "linear_quant: %s weights [%lld, %lld] (cols a multiple of 16)",
           weight_quant_name(w.quant), static_cast<long long>(w.rows),
           static_cast<long long>(w.cols));
  if (n <= 0) return;
  if (n <= kQuantGemvMaxTokens && aligned16(x)) {
    gemv_quant(x, n, w, y, stream);
    return;
  }
  if (n > kQuantGemmMaxTokens && w.quant == WeightQuant::kFp8Channel &&
      gemm_precision() == GemmPrecision::kBf16 && fp8_activations() &&
      fp8_linear(x, n, w, y, stream))
    return;
  if (n <= kQuantGemmMaxTokens && gemm_precision() == GemmPrecision::kBf16 && ws.data != nullptr &&
      moe_grouped::dense_quant_ok(n, w, y, ws.bytes)) {
    moe_grouped::dense_quant(x, n, w, y, ws.data, ws.bytes, stream);
    return;
  }
  const size_t need = static_cast<size_t>(w.rows) * static_cast<size_t>(w.cols) * sizeof(uint16_t);
  M3_CHECK(ws.data != nullptr && ws.bytes >= need,
           "linear_quant: %zu bytes of workspace for a [%lld, %lld] matrix, %zu needed", ws.bytes,
           static_cast<long long>(w.rows), static_cast<long long>(w.cols), need);
  auto* wb = static_cast<uint16_t*>(ws.data);
  dequantize_bf16_unscaled(w, wb, stream);  // wb: [rows, cols] bf16, values / row factor
  const MatRef b{wb, DType::kBF16, w.rows, w.cols};
  blas::linear_with(blas::LinearPath::kGemm, x, n, b, y, stream);
  apply_row_factor(y, n, w, stream);
}

}  // namespace m3::kernels::cuda
