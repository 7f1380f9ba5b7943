// Quantized-weight GEMV and the dequantise-then-bf16-GEMM prefill path (kernels/cuda/quant.h) at
// M3's linear shapes, with the ceilings of the same run: the device copy bandwidth (bytes read +
// written per second, bench_util.h), cuBLAS bf16 (GEMM at the same n; at n = 1 its GEMV) and, for
// prefill, cuBLASLt's plain FP8 GEMM (e4m3 x e4m3 -> bf16, no block scales) at the same shape,
// beside fp8_per_channel's FP8-activation GEMM (kernels/cuda/quant.h fp8_linear).
// Weights rotate over enough copies (>= 512 MB) that L2 (50 MB) holds none of them, so every call
// reads its weights from HBM. Prints markdown tables (docs/PERFORMANCE.md quotes them).
// Usage: bench_quant_gemv [--quick]
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "bench_util.h"
#include "core/dtype.h"
#include "gpu/cuda_check.h"
#include "gpu/device_buffer.h"
#include "kernels/cuda/quant.h"

namespace {

using m3::gpu::DeviceBuffer;
using m3::kernels::MatRef;
using m3::kernels::WeightQuant;

#define CUBLAS_CHECK(x)                                                           \
  do {                                                                            \
    cublasStatus_t s_ = (x);                                                      \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                            \
      std::fprintf(stderr, "cuBLAS error %d at %s:%d\n", s_, __FILE__, __LINE__); \
      std::exit(1);                                                               \
    }                                                                             \
  } while (0)

struct Shape {
  const char* name;
  int64_t m, k;
};

// A quantized matrix's bytes (codes + scales) filled with valid random codes and mild scales.
struct Copies {
  std::vector<DeviceBuffer<uint8_t>> data, scale;
  std::vector<MatRef> mats;
};

Copies make_copies(WeightQuant q, int64_t m, int64_t k, std::mt19937& g) {
  MatRef proto;
  proto.rows = m;
  proto.cols = k;
  proto.quant = q;
  proto.dtype = m3::kernels::weight_quant_is_4bit(q) ? m3::DType::kU8 : m3::DType::kF8E4M3;
  proto.global_scale = q == WeightQuant::kNvfp4 ? 0.01f : 1.f;
  std::vector<uint8_t> d(static_cast<size_t>(proto.data_bytes())),
      s(static_cast<size_t>(proto.scale_bytes()));
  std::uniform_int_distribution<int> byte(0, 255);
  for (auto& b : d) {
    b = static_cast<uint8_t>(byte(g));
    if (!m3::kernels::weight_quant_is_4bit(q) && (b & 0x7f) == 0x7f) b = 0x3f;  // no NaN codes
  }
  if (q == WeightQuant::kFp8Channel) {
    for (int64_t r = 0; r < m; ++r) {
      const float v = 0.01f;
      std::memcpy(s.data() + r * 4, &v, 4);
    }
  } else {
    for (auto& b : s) b = q == WeightQuant::kNvfp4 ? 0x38 : 120;
  }
  Copies c;
  const int64_t bytes = proto.bytes();
  const int64_t n = std::max<int64_t>(2, (int64_t{512} << 20) / bytes + 1);
  for (int64_t i = 0; i < n; ++i) {
    c.data.emplace_back(d);
    c.scale.emplace_back(s);
    MatRef w = proto;
    w.data = c.data.back().data();
    w.scale = c.scale.back().data();
    c.mats.push_back(w);
  }
  return c;
}

const char* fmt_name(WeightQuant q) {
  return m3::kernels::weight_quant_name(q);
}

// cuBLASLt FP8 GEMM D[m, n] (bf16) = W[m, k] (e4m3) . X[n, k]^T (e4m3): the plain FP8 ceiling.
// Returns ms per call, or -1 when cuBLASLt offers no algorithm.
double lt_fp8_ms(cublasLtHandle_t lt, cudaStream_t stream, const void* w, const void* x, void* d,
                 int64_t m, int64_t n, int64_t k, void* ws, size_t ws_bytes) {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  double ms = -1;
  const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  if (cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F) == CUBLAS_STATUS_SUCCESS &&
      cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta) == 0 &&
      cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb) == 0 &&
      cublasLtMatrixLayoutCreate(&la, CUDA_R_8F_E4M3, k, m, k) == 0 &&
      cublasLtMatrixLayoutCreate(&lb, CUDA_R_8F_E4M3, k, n, k) == 0 &&
      cublasLtMatrixLayoutCreate(&lc, CUDA_R_16BF, m, n, m) == 0 &&
      cublasLtMatmulPreferenceCreate(&pref) == 0 &&
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                           &ws_bytes, sizeof ws_bytes) == 0) {
    cublasLtMatmulHeuristicResult_t h{};
    int found = 0;
    if (cublasLtMatmulAlgoGetHeuristic(lt, op, la, lb, lc, lc, pref, 1, &h, &found) == 0 &&
        found > 0) {
      const float one = 1.f, zero = 0.f;
      bool ok = true;
      ms = m3::bench::time_ms(stream, 10, [&] {
        ok = ok && cublasLtMatmul(lt, op, &one, w, la, x, lb, &zero, d, lc, d, lc, &h.algo, ws,
                                  ws_bytes, stream) == CUBLAS_STATUS_SUCCESS;
      });
      if (!ok) ms = -1;
    }
  }
  if (pref) cublasLtMatmulPreferenceDestroy(pref);
  if (lc) cublasLtMatrixLayoutDestroy(lc);
  if (lb) cublasLtMatrixLayoutDestroy(lb);
  if (la) cublasLtMatrixLayoutDestroy(la);
  if (op) cublasLtMatmulDescDestroy(op);
  return ms;
}

}  // namespace

int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::string(argv[1]) == "--quick";
  int dev_count = 0;
  if (cudaGetDeviceCount(&dev_count) != cudaSuccess || dev_count == 0) {
    std::fprintf(stderr, "bench_quant_gemv: no usable GPU\n");
    return 1;
  }
  cudaDeviceProp prop{};
  M3_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  const double copy_bw = m3::bench::copy_bandwidth();
  std::printf("device %s; copy bandwidth %.0f GB/s (read + written)\n\n", prop.name, copy_bw / 1e9);
  cudaStream_t stream;
  M3_CUDA_CHECK(cudaStreamCreate(&stream));
  cublasHandle_t cb;
  CUBLAS_CHECK(cublasCreate(&cb));
  CUBLAS_CHECK(cublasSetStream(cb, stream));
  cublasLtHandle_t lt;
  CUBLAS_CHECK(cublasLtCreate(&lt));
  const size_t ws_bytes = size_t{64} << 20;
  DeviceBuffer<uint8_t> ws(ws_bytes), x8(static_cast<size_t>(4096) * 12288);
  DeviceBuffer<uint16_t> d16(static_cast<size_t>(4096) * 12288);
  M3_CUDA_CHECK(cudaMemset(x8.data(), 0x38, x8.size()));
  std::mt19937 g(1);

  const std::vector<Shape> shapes = {{"expert w1/w3 [3072, 6144]", 3072, 6144},
                                     {"expert w2 [6144, 3072]", 6144, 3072},
                                     {"q_proj [8192, 6144]", 8192, 6144},
                                     {"dense gate [12288, 6144]", 12288, 6144}};
  const WeightQuant formats[] = {WeightQuant::kFp8Channel, WeightQuant::kMxfp8, WeightQuant::kNvfp4,
                                 WeightQuant::kMxfp4};
  const std::vector<int64_t> decode_n =
      quick ? std::vector<int64_t>{1, 4} : std::vector<int64_t>{1, 2, 4, 8, 16, 32, 64};
  const std::vector<int64_t> prefill_n =
      quick ? std::vector<int64_t>{64, 1024} : std::vector<int64_t>{16, 64, 256, 1024, 4096};
  const int64_t max_n = 4096;
  DeviceBuffer<float> x(static_cast<size_t>(max_n * 12288)), y(static_cast<size_t>(max_n * 12288));
  {
    std::vector<float> hx(x.size());
    std::normal_distribution<float> nd(0.f, 1.f);
    for (auto& v : hx) v = nd(g);
    x.copy_from(hx.data(), hx.size());
  }
  DeviceBuffer<uint16_t> xb(static_cast<size_t>(max_n * 12288));
  M3_CUDA_CHECK(cudaMemset(xb.data(), 0x3c, xb.size() * 2));
  DeviceBuffer<uint16_t> wdq(static_cast<size_t>(12288 * 6144));

  for (const Shape& sh : shapes) {
    // bf16 baseline: the same matrix in bf16 (rotated copies), cuBLAS GEMM (fp32 out).
    const size_t bf16_bytes = static_cast<size_t>(sh.m * sh.k) * 2;
    const int nb = static_cast<int>(std::max<size_t>(2, (size_t{512} << 20) / bf16_bytes + 1));
    std::vector<DeviceBuffer<uint16_t>> wb;
    for (int i = 0; i < nb; ++i) {
      wb.emplace_back(static_cast<size_t>(sh.m * sh.k));
      M3_CUDA_CHECK(cudaMemset(wb.back().data(), 0x3c, bf16_bytes));
    }
    const float one = 1.f, zero = 0.f;
    auto bf16_gemm = [&](const uint16_t* w, int64_t n) {
      // y[n, m] = x[n, k] . w[m, k]^T: column-major C[m, n] = W^T(k x m)^T ... as cuBLAS sees it.
      CUBLAS_CHECK(cublasGemmEx(cb, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(sh.m),
                                static_cast<int>(n), static_cast<int>(sh.k), &one, w, CUDA_R_16BF,
                                static_cast<int>(sh.k), xb.data(), CUDA_R_16BF,
                                static_cast<int>(sh.k), &zero, y.data(), CUDA_R_32F,
                                static_cast<int>(sh.m), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    };
    std::printf(
        "### %s\n\nDecode GEMV (weights read from HBM; GB/s of the format's own bytes, "
        "codes + scales; %% of the copy bandwidth):\n\n",
        sh.name);
    std::printf("| n | cuBLAS bf16 us | GB/s |");
    for (WeightQuant q : formats) std::printf(" %s us | GB/s | %% copy |", fmt_name(q));
    std::printf("\n|---|---|---|");
    for (size_t i = 0; i < 4; ++i) std::printf("---|---|---|");
    std::printf("\n");
    std::vector<Copies> copies;
    for (WeightQuant q : formats) copies.push_back(make_copies(q, sh.m, sh.k, g));
    for (int64_t n : decode_n) {
      int i = 0;
      const double tb = m3::bench::time_ms(stream, 40, [&] { bf16_gemm(wb[i++ % nb].data(), n); });
      std::printf("| %lld | %.1f | %.0f |", static_cast<long long>(n), tb * 1e3,
                  bf16_bytes / (tb * 1e-3) / 1e9);
      for (size_t f = 0; f < 4; ++f) {
        const Copies& c = copies[f];
        int j = 0;
        const double t = m3::bench::time_ms(stream, 40, [&] {
          m3::kernels::cuda::gemv_quant(x.data(), n, c.mats[j++ % c.mats.size()], y.data(), stream);
        });
        const double bw = c.mats[0].bytes() / (t * 1e-3);
        std::printf(" %.1f | %.0f | %.0f%% |", t * 1e3, bw / 1e9, 100.0 * bw / copy_bw);
      }
      std::printf("\n");
    }
    std::fflush(stdout);
    std::printf(
        "\nPrefill: dequantize_bf16 into a scratch + cuBLAS bf16 GEMM, against cuBLAS bf16 "
        "on bf16 weights and cuBLASLt's plain FP8 GEMM (e4m3 weights and activations, "
        "bf16 out; TFLOP/s = 2 m k n / time), and fp8_per_channel with per-token FP8 "
        "activations (fp8_linear: quantize x, cuBLASLt FP8 with the token and channel "
        "scales):\n\n| n | cuBLAS bf16 TFLOP/s | cuBLASLt fp8 TFLOP/s | fp8_linear TFLOP/s |");
    for (WeightQuant q : formats) std::printf(" %s dequant us | total TFLOP/s |", fmt_name(q));
    std::printf("\n|---|---|---|---|");
    for (size_t i = 0; i < 4; ++i) std::printf("---|---|");
    std::printf("\n");
    for (int64_t n : prefill_n) {
      const double flop = 2.0 * sh.m * sh.k * n;
      int i = 0;
      const double tb = m3::bench::time_ms(stream, 10, [&] { bf16_gemm(wb[i++ % nb].data(), n); });
      // The fp8 weights of the copies (each copy's codes are a valid e4m3 matrix).
      const double t8 = lt_fp8_ms(lt, stream, copies[1].mats[0].data, x8.data(), d16.data(), sh.m,
                                  n, sh.k, ws.data(), ws_bytes);
      // copies[0] is fp8_per_channel (formats[0]).
      bool f8ok = true;
      int jf = 0;
      const double tf = m3::bench::time_ms(stream, 10, [&] {
        const Copies& c = copies[0];
        f8ok = f8ok && m3::kernels::cuda::fp8_linear(x.data(), n, c.mats[jf++ % c.mats.size()],
                                                     y.data(), stream);
      });
      std::printf(
          "| %lld | %.0f | %s | %s |", static_cast<long long>(n), flop / (tb * 1e-3) / 1e12,
          t8 > 0 ? std::to_string(static_cast<int>(flop / (t8 * 1e-3) / 1e12)).c_str() : "n/a",
          f8ok ? std::to_string(static_cast<int>(flop / (tf * 1e-3) / 1e12)).c_str() : "n/a");
      for (size_t f = 0; f < 4; ++f) {
        const Copies& c = copies[f];
        int j = 0;
        const double td = m3::bench::time_ms(stream, 10, [&] {
          m3::kernels::cuda::dequantize_bf16(c.mats[j++ % c.mats.size()], wdq.data(), stream);
        });
        int j2 = 0;
        const double tt = m3::bench::time_ms(stream, 10, [&] {
          m3::kernels::cuda::dequantize_bf16(c.mats[j2++ % c.mats.size()], wdq.data(), stream);
          bf16_gemm(wdq.data(), n);
        });
        std::printf(" %.1f | %.0f |", td * 1e3, flop / (tt * 1e-3) / 1e12);
      }
      std::printf("\n");
    }
    std::printf("\n");
    std::fflush(stdout);
  }
  CUBLAS_CHECK(cublasLtDestroy(lt));
  CUBLAS_CHECK(cublasDestroy(cb));
  M3_CUDA_CHECK(cudaStreamDestroy(stream));
  return 0;
}
