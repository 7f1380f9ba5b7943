// Scaffolding shared by the GPU tests (tests/kernels, tests/model_cuda): the skip when no GPU is
// usable (CI), unit roundoff, and random fp32 / bf16 data. Header-only; included by test sources.
// Invariant: the GPU probe runs once per process and its reason is printed with every skip.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "gpu/device.h"

namespace m3::testing {

// Empty when device 0 is usable, else why not (the probe's message).
inline const std::string& gpu_unavailable_reason() {
  static const std::string reason = [] {
    auto dev = m3::gpu::probe_device(0);
    return dev ? std::string() : dev.error().message;
  }();
  return reason;
}

inline constexpr double kU = 1.0 / (1 << 24);  // fp32 unit roundoff

inline std::vector<float> randn(size_t n, std::mt19937& g, float s = 1.f) {
  std::normal_distribution<float> d(0.f, s);
  std::vector<float> v(n);
  for (auto& x : v) x = d(g);
  return v;
}

// Round to nearest even, as the loader stores bf16 weights.
inline std::vector<uint16_t> to_bf16(const std::vector<float>& v) {
  std::vector<uint16_t> r(v.size());
  for (size_t i = 0; i < v.size(); ++i) r[i] = m3::f32_to_bf16(v[i]);
  return r;
}

}  // namespace m3::testing

#define SKIP_WITHOUT_GPU()                                   \
  do {                                                       \
    if (!m3::testing::gpu_unavailable_reason().empty())      \
      GTEST_SKIP() << m3::testing::gpu_unavailable_reason(); \
  } while (0)
