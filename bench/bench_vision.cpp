// The vision tower on the GPU (model/cuda/vision_cuda.h) at MiniMax-M3's shapes (m3-model.md
// §1.4, §7: 32 layers, hidden 1280, 16 heads x 80, MLP 5120, projector 6144, text hidden 6144)
// on synthetic bf16 weights generated on the device: images/s through tower + projector + merge
// for 1 and 4 images per call (each its own attention block, the shipped layout), under the
// serving default (bf16 GEMMs) and the exact precision, with the achieved TFLOP/s beside the
// bf16 GEMM ceiling measured in the same run (cuBLASLt 8192^3, and the tower's fc1 shape). The
// time is one encode() call: patch rows host -> device, the forward, embeddings device -> host.
// Then the time to first token of one request with one such image through the engine on the
// CUDA backend (what `serve` runs under its HTTP layer and processor) on
// synthetic:layers=4,vision=1 (M3's text geometry with 4 layers and the synthetic tower), against
// the same prompt without the image (its placeholder rows as plain text tokens).
// Usage: bench_vision [--size WxH] [--reps R] [--ttft-layers N] (GPU machine; exits 1 without
// a GPU; --ttft-layers 0 skips the TTFT part)
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "bench_util.h"
#include "engine/engine.h"
#include "gpu/device.h"
#include "kernels/cuda/blas.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/vision.h"
#include "model/config.h"
#include "model/cuda/vision_cuda.h"
#include "runtime/cuda/cuda_backend.h"
#include "vision/image_processor.h"

using namespace m3;
namespace kc = kernels::cuda;

namespace {

// bf16 GEMM y[n, m] = x[n, k] . W[m, k]^T through cuBLASLt: TFLOP/s.
double gemm_tflops(int64_t n, int64_t m, int64_t k, cudaStream_t s) {
  gpu::DeviceBuffer<uint16_t> x(static_cast<size_t>(n * k)), w(static_cast<size_t>(m * k));
  gpu::DeviceBuffer<float> y(static_cast<size_t>(n * m));
  x.fill_bytes(0x3c);
  w.fill_bytes(0x3c);
  const kernels::MatRef W{w.data(), DType::kBF16, m, k};
  const double ms = bench::time_ms(s, 20, [&] {
    if (!kc::blas::gemm_bf16(x.data(), n, W, y.data(), 0.f, s)) std::abort();
  });
  return 2.0 * n * m * k / (ms * 1e-3) / 1e12;
}

// TTFT of one request (32 text tokens, the image's placeholders, 32 text tokens; max_tokens 1)
// through the engine, serving precision (bf16 GEMMs), prefix caching off; and of the same
// prompt with text tokens in place of the image.
void ttft(int64_t layers, const vision::ProcessedImage& p, int64_t reps) {
  kc::set_gemm_precision(kc::GemmPrecision::kBf16);
  engine::EngineConfig ec;
  ec.model_dir = "synthetic:layers=" + std::to_string(layers) + ",vision=1";
  ec.max_num_batched_tokens = 8192;
  ec.enable_prefix_caching = false;
  ec.max_model_len = 8192;
  ec.block_size = 128;
  runtime::CudaBackendOptions opts;
  opts.gpu_memory_utilization = 0.5;
  opts.max_model_len = 8192;
  opts.warmup_tokens = 1024;
  ec.backend_factory = [opts](std::unique_ptr<model::M3Model> host, int64_t) {
    return runtime::make_cuda_backend(std::move(host), opts);
  };
  auto eng = engine::Engine::create(ec);
  if (!eng) {
    std::fprintf(stderr, "bench_vision: engine: %s\n", eng.error().message.c_str());
    std::exit(1);
  }
  const auto& info = (*eng)->model_info();
  if (!info.image_input) {
    std::fprintf(stderr, "bench_vision: no image input: %s\n", info.image_refusal.c_str());
    std::exit(1);
  }
  const int32_t ntok = static_cast<int32_t>(p.num_patches() / 4);
  auto run = [&](bool with_image, uint64_t salt) {
    engine::GenerateRequest req;
    for (int i = 0; i < 32; ++i) req.prompt_token_ids.push_back(1000 + i);
    for (int i = 0; i < ntok; ++i)
      req.prompt_token_ids.push_back(with_image ? info.image_token_id : 2000 + i);
    for (int i = 0; i < 32; ++i) req.prompt_token_ids.push_back(3000 + i);
    if (with_image) {
      engine::ImageInput im;
      im.grid_t = p.grid_t;
      im.grid_h = p.grid_h;
      im.grid_w = p.grid_w;
      im.num_tokens = ntok;
      im.token_offset = 32;
      im.patches = p.pixel_values;
      im.content_hash = salt;
      req.images.push_back(std::move(im));
    }
    req.params.max_tokens = 1;
    req.params.ignore_eos = true;
    const double t0 = bench::now_s();
    auto s = (*eng)->submit(std::move(req));
    if (!s) {
      std::fprintf(stderr, "bench_vision: submit: %s\n", s.error().message.c_str());
      std::exit(1);
    }
    double first = 0;
    for (;;) {
      auto o = (*s)->next(std::chrono::seconds(120));
      if (!o) {
        std::fprintf(stderr, "bench_vision: no output in 120 s\n");
        std::exit(1);
      }
      if (first == 0 && !o->new_token_ids.empty()) first = bench::now_s() - t0;
      if (o->finished) break;
    }
    return first;
  };
  for (bool img : {true, false}) {
    run(img, 1);  // warm-up
    double best = 1e30, sum = 0;
    for (int64_t r = 0; r < reps; ++r) {
      const double t = run(img, 100 + static_cast<uint64_t>(r));
      best = std::min(best, t);
      sum += t;
    }
    std::printf(
        "TTFT synthetic:layers=%ld,vision=1 through the engine, %ld-token prompt %s: best "
        "%.1f ms, mean %.1f ms\n",
        layers, static_cast<long>(64 + ntok),
        img ? "with one image (tower + prefill)" : "of text only (prefill alone)", best * 1e3,
        sum / reps * 1e3);
  }
}

}  // namespace

int main(int argc, char** argv) {
  int64_t w = 672, h = 672, reps = 10, ttft_layers = 4;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--size") {
      std::sscanf(argv[i + 1], "%ldx%ld", &w, &h);
    } else if (a == "--reps") {
      reps = std::atol(argv[i + 1]);
    } else if (a == "--ttft-layers") {
      ttft_layers = std::atol(argv[i + 1]);
    }
  }
  auto dev = gpu::probe_device(0);
  if (!dev) {
    std::fprintf(stderr, "bench_vision: %s\n", dev.error().message.c_str());
    return 1;
  }
  gpu::Stream stream;
  cudaStream_t s = stream.get();
  model::M3Config cfg;
  cfg.hidden_size = 6144;
  cfg.vision.present = true;  // M3's vision_config defaults (model/config.h), reference layout
  const auto& v = cfg.vision;
  auto tower = model::VisionTowerCuda::synthetic(cfg, 1, s);

  vision::RgbImage img;
  img.width = w;
  img.height = h;
  img.rgb.resize(static_cast<size_t>(w * h * 3));
  for (size_t i = 0; i < img.rgb.size(); ++i)
    img.rgb[i] = static_cast<uint8_t>((i * 2654435761u) >> 24);
  auto p = vision::preprocess_image(img, vision::ProcessorConfig{});
  if (!p) {
    std::fprintf(stderr, "%s\n", p.error().message.c_str());
    return 1;
  }
  const int64_t Hv = v.hidden_size, I = v.intermediate_size, P = v.projector_hidden_size,
                H = cfg.hidden_size, L = v.num_hidden_layers;
  const int64_t n = p->num_patches(), nt = n / 4;
  const double gemm_flops = 2.0 * n * Hv * v.patch_row_size() +
                            L * 2.0 * n * (4.0 * Hv * Hv + 2.0 * Hv * I) +
                            2.0 * n * (Hv * P + P * H) + 2.0 * nt * (4 * H * P + P * H);
  const double attn_flops = L * 4.0 * n * n * Hv;
  const double flops = gemm_flops + attn_flops;
  std::printf("%s; image %ldx%ld -> %ldx%ld px, %ld patches, %ld tokens per image\n",
              dev->name.c_str(), w, h, p->resized_w, p->resized_h, n, nt);
  std::printf("per image: %.1f GFLOP (%.1f GEMM, %.1f attention)\n", flops / 1e9, gemm_flops / 1e9,
              attn_flops / 1e9);
  const double ceil_big = gemm_tflops(8192, 8192, 8192, s);
  const double ceil_fc1 = gemm_tflops(n, I, Hv, s);
  std::printf("bf16 GEMM ceiling: 8192^3 %.0f TFLOP/s; the tower's fc1 (%ld x %ld x %ld) %.0f\n",
              ceil_big, n, I, Hv, ceil_fc1);
  std::vector<model::VisionImage> four(4,
                                       {p->grid_t, p->grid_h, p->grid_w, p->pixel_values.data()});
  for (auto prec : {kc::GemmPrecision::kBf16, kc::GemmPrecision::kExact}) {
    kc::set_gemm_precision(prec);
    const char* pname = prec == kc::GemmPrecision::kBf16 ? "bf16" : "exact";
    for (int64_t k : {1, 4}) {
      std::vector<float> emb;
      const std::span<const model::VisionImage> imgs(four.data(), static_cast<size_t>(k));
      tower->encode(imgs, &emb);  // warm-up: buffers, plans
      tower->encode(imgs, &emb);
      double best = 1e30, sum = 0;
      for (int64_t r = 0; r < reps; ++r) {
        const double t0 = bench::now_s();
        tower->encode(imgs, &emb);
        const double dt = bench::now_s() - t0;
        best = std::min(best, dt);
        sum += dt;
      }
      std::printf(
          "%-5s %ld image(s)/call: best %.2f ms, mean %.2f ms = %.1f images/s, %.0f TFLOP/s "
          "(%.0f%% of the 8192^3 ceiling)\n",
          pname, k, best * 1e3, sum / reps * 1e3, k / best, k * flops / best / 1e12,
          100.0 * k * flops / best / 1e12 / ceil_big);
    }
    // The attention alone (one image, one layer's shape) to show its share.
    {
      const int64_t width = Hv;
      gpu::DeviceBuffer<float> q(static_cast<size_t>(n * width)),
          kk(static_cast<size_t>(n * width)), vv(static_cast<size_t>(n * width)),
          o(static_cast<size_t>(n * width));
      q.fill_bytes(0x3c);
      kk.fill_bytes(0x3c);
      vv.fill_bytes(0x3c);
      const int64_t seg[2] = {0, n};
      const int64_t heads = v.num_attention_heads, d = v.head_dim();
      const size_t bytes = kc::attention_segments_workspace_bytes(n, heads, d, n, n);
      gpu::DeviceBuffer<uint8_t> ws(bytes);
      const double ms = bench::time_ms(s, 20, [&] {
        kc::attention_segments(q.data(), kk.data(), vv.data(), n, heads, d, seg, 1, 0.1f,
                               kernels::Workspace{ws.data(), bytes}, o.data(), s);
      });
      std::printf(
          "%-5s attention of one layer (%ld patches, %ld x %ld): %.3f ms = %.0f TFLOP/s; "
          "x %ld layers = %.2f ms\n",
          pname, n, heads, d, ms, 4.0 * n * n * Hv / (ms * 1e-3) / 1e12, L, ms * L);
    }
  }
  if (ttft_layers > 0) ttft(ttft_layers, *p, reps);
  return 0;
}
