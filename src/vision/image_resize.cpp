#include "vision/image_resize.h"

#include <algorithm>
#include <cmath>

#include "core/check.h"

namespace m3::vision {
namespace {

// Keys' cubic convolution kernel with a = -0.5 (PIL's and ATen's antialiased bicubic filter).
double cubic_filter(double x) {
  constexpr double a = -0.5;
  x = std::abs(x);
  if (x < 1.0) return ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0;
  if (x < 2.0) return (((x - 5.0) * x + 8.0) * x - 4.0) * a;
  return 0.0;
}

// One pass's taps: output i reads inputs [xmin[i], xmin[i] + xsize[i]) with int16 weights
// w[i * max_taps + j] at `precision` fractional bits.
struct Taps {
  std::vector<int64_t> xmin, xsize;
  std::vector<int32_t> w;
  int64_t max_taps = 0;
  int precision = 0;
};

Taps make_taps(int64_t in, int64_t out) {
  const double scale = static_cast<double>(in) / static_cast<double>(out);
  const double support = scale >= 1.0 ? 2.0 * scale : 2.0;  // interp size 4, halved
  Taps t;
  t.max_taps = static_cast<int64_t>(std::ceil(support)) * 2 + 1;
  t.xmin.resize(out);
  t.xsize.resize(out);
  std::vector<double> wd(static_cast<size_t>(out * t.max_taps), 0.0);
  const double invscale = scale >= 1.0 ? 1.0 / scale : 1.0;
  double wt_max = 0.0;
  for (int64_t i = 0; i < out; ++i) {
    const double center = scale * (static_cast<double>(i) + 0.5);
    const int64_t xmin = std::max(static_cast<int64_t>(center - support + 0.5), int64_t{0});
    int64_t xsize = std::min(static_cast<int64_t>(center + support + 0.5), in) - xmin;
    xsize = std::clamp(xsize, int64_t{0}, t.max_taps);
    double* w = wd.data() + i * t.max_taps;
    double total = 0.0;
    for (int64_t j = 0; j < xsize; ++j) {
      w[j] = cubic_filter((static_cast<double>(j + xmin) - center + 0.5) * invscale);
      total += w[j];
    }
    if (total != 0.0) {
      for (int64_t j = 0; j < xsize; ++j) {
        w[j] /= total;
        wt_max = std::max(wt_max, w[j]);
      }
    }
    t.xmin[i] = xmin;
    t.xsize[i] = xsize;
  }
  int precision = 0;
  for (precision = 0; precision < 22; ++precision) {
    const int next = static_cast<int>(0.5 + wt_max * (1 << (precision + 1)));
    if (next >= (1 << 15)) break;
  }
  t.precision = precision;
  t.w.resize(wd.size());
  for (size_t k = 0; k < wd.size(); ++k) {
    const double v = wd[k] * (1 << precision);
    t.w[k] = static_cast<int16_t>(v < 0 ? static_cast<int>(-0.5 + v) : static_cast<int>(0.5 + v));
  }
  return t;
}

uint8_t round_out(int64_t acc, int precision) {
  return static_cast<uint8_t>(std::clamp<int64_t>(acc >> precision, 0, 255));
}

}  // namespace

std::vector<uint8_t> resize_bicubic_aa(const uint8_t* src, int64_t in_h, int64_t in_w,
                                       int64_t channels, int64_t out_h, int64_t out_w) {
  M3_CHECK(in_h >= 1 && in_w >= 1 && out_h >= 1 && out_w >= 1 && channels >= 1);
  std::vector<uint8_t> cur(src, src + in_h * in_w * channels);
  int64_t w = in_w;
  if (out_w != in_w) {  // horizontal pass
    const Taps t = make_taps(in_w, out_w);
    std::vector<uint8_t> next(static_cast<size_t>(in_h * out_w * channels));
    const int64_t half = int64_t{1} << (t.precision - 1);
    for (int64_t y = 0; y < in_h; ++y) {
      const uint8_t* row = cur.data() + y * in_w * channels;
      uint8_t* orow = next.data() + y * out_w * channels;
      for (int64_t x = 0; x < out_w; ++x) {
        const int32_t* k = t.w.data() + x * t.max_taps;
        for (int64_t c = 0; c < channels; ++c) {
          int64_t acc = half;
          for (int64_t j = 0; j < t.xsize[x]; ++j)
            acc += static_cast<int64_t>(row[(t.xmin[x] + j) * channels + c]) * k[j];
          orow[x * channels + c] = round_out(acc, t.precision);
        }
      }
    }
    cur.swap(next);
    w = out_w;
  }
  if (out_h != in_h) {  // vertical pass
    const Taps t = make_taps(in_h, out_h);
    std::vector<uint8_t> next(static_cast<size_t>(out_h * w * channels));
    const int64_t half = int64_t{1} << (t.precision - 1);
    const int64_t stride = w * channels;
    for (int64_t y = 0; y < out_h; ++y) {
      const int32_t* k = t.w.data() + y * t.max_taps;
      uint8_t* orow = next.data() + y * stride;
      for (int64_t i = 0; i < stride; ++i) {
        int64_t acc = half;
        for (int64_t j = 0; j < t.xsize[y]; ++j)
          acc += static_cast<int64_t>(cur[(t.xmin[y] + j) * stride + i]) * k[j];
        orow[i] = round_out(acc, t.precision);
      }
    }
    cur.swap(next);
  }
  return cur;
}

}  // namespace m3::vision
