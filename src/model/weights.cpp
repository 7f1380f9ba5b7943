#include "model/weights.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string_view>

#include "model/tensor_table.h"

namespace m3::model {

namespace {

std::string shape_str(const std::vector<int64_t>& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}

using kernels::WeightQuant;

int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

class Loader {
 public:
  Loader(const Checkpoint& ckpt, M3Weights& w, const QuantPlan& qp) : ckpt_(ckpt), w_(w), qp_(qp) {}

  // A linear weight `name` ("<module>.weight") in whatever format the checkpoint stores it
  // (docs/QUANTIZATION.md lists the tensor sets); `quantizable`: fp8_per_channel applies.
  Result<MatRef> matrix(const std::string& name, int64_t rows, int64_t cols, bool quantizable) {
    M3_TRY(MatRef m, stored_matrix(name, rows, cols));
    if (!method_allows(qp_.checkpoint.method, m.quant)) {
      return make_error(ErrorCode::kFormat,
                        "tensor '" + name + "' is stored as " + weight_quant_name(m.quant) +
                            ", which a checkpoint declaring quant_method '" +
                            qp_.checkpoint.method + "' (" + qp_.checkpoint.source +
                            ") does not contain; the tensors and the config disagree",
                        name);
    }
    if (qp_.online_fp8_per_channel && quantizable && !m.quantized()) {
      w_.online_source_bytes += static_cast<size_t>(m.bytes());
      m = quantize_fp8_per_channel(m);
    }
    if (m.quantized()) ++w_.num_quantized[static_cast<size_t>(m.quant)];
    return m;
  }

  Result<VecRef> vector(const std::string& name, int64_t n) {
    M3_TRY(const TensorInfo* ti, ckpt_.get(name, {n}, {DType::kBF16, DType::kF32, DType::kF16}));
    if (ti->dtype == DType::kF16) {
      auto& buf = w_.owned_f32.emplace_back(n);
      const uint16_t* src = reinterpret_cast<const uint16_t*>(ti->data);
      for (int64_t i = 0; i < n; ++i) buf[i] = f16_to_f32(src[i]);
      return VecRef{buf.data(), DType::kF32, n};
    }
    w_.bytes_in_place += ti->nbytes;
    return VecRef{ti->data, ti->dtype, n};
  }

 private:
  Result<MatRef> stored_matrix(const std::string& name, int64_t rows, int64_t cols) {
    const std::string base = name.size() > 7 && name.compare(name.size() - 7, 7, ".weight") == 0
                                 ? name.substr(0, name.size() - 7)
                                 : name;
    const TensorInfo* t = ckpt_.find(name);
    if (t == nullptr) {
      // compressed-tensors' packed 4-bit form: <module>.weight_packed + weight_scale.
      if (const TensorInfo* p = ckpt_.find(base + ".weight_packed")) {
        return fp4_matrix(*p, base, rows, cols);
      }
    }
    if (t && t->dtype == DType::kF8E4M3) return fp8_matrix(*t, base, rows, cols);
    if (t && t->dtype == DType::kU8) return fp4_matrix(*t, base, rows, cols);
    auto got = ckpt_.get(name, {rows, cols}, {DType::kBF16, DType::kF32, DType::kF16});
    if (!got) {
      Error e = got.error();
      if (e.code == ErrorCode::kNotFound)
        e.message +=
            ", or quantized (F8_E4M3 with its scales, or packed E2M1 codes: "
            "docs/QUANTIZATION.md)";
      return tl::unexpected(std::move(e));
    }
    const TensorInfo* ti = *got;
    MatRef m{ti->data, ti->dtype, rows, cols};
    if (ti->dtype == DType::kF16) {
      auto& buf = w_.owned_f32.emplace_back(rows * cols);
      const uint16_t* src = reinterpret_cast<const uint16_t*>(ti->data);
      for (int64_t i = 0; i < rows * cols; ++i) buf[i] = f16_to_f32(src[i]);
      w_.bytes_owned += buf.size() * 4;
      m = MatRef{buf.data(), DType::kF32, rows, cols};
    } else {
      w_.bytes_in_place += ti->nbytes;
    }
    return m;
  }

  static tl::unexpected<Error> shape_error(const TensorInfo& t, const std::string& what,
                                           const std::vector<int64_t>& want) {
    return make_error(ErrorCode::kFormat,
                      "tensor '" + t.name + "' (" + what + ") has shape " + t.shape_str() +
                          ", expected " + shape_str(want) + " (in " + t.file + ")",
                      t.name);
  }

  // The scales `scale_name` of weight `weight`: present, of `dtype`, shape `want`.
  Result<const TensorInfo*> scales(const std::string& scale_name, const TensorInfo& weight,
                                   const char* format, DType dtype,
                                   const std::vector<int64_t>& want, const char* dtype_what) {
    const TensorInfo* s = ckpt_.find(scale_name);
    const std::string what = std::string("the ") + format + " scales of '" + weight.name + "'";
    if (s == nullptr) {
      return make_error(ErrorCode::kFormat,
                        "tensor '" + weight.name + "' is " + format + " but '" + scale_name +
                            "' (" + dtype_name(dtype) + " " + shape_str(want) +
                            ") is missing from " + ckpt_.dir(),
                        scale_name);
    }
    if (s->dtype != dtype) {
      return make_error(ErrorCode::kFormat,
                        "tensor '" + scale_name + "' (" + what + ") has dtype " +
                            dtype_name(s->dtype) + " and shape " + s->shape_str() + ", expected " +
                            dtype_name(dtype) + " (" + dtype_what + ") of shape " +
                            shape_str(want) + " (in " + s->file + ")",
                        scale_name);
    }
    if (s->shape != want) return shape_error(*s, what, want);
    w_.bytes_in_place += s->nbytes;
    return s;
  }

  // float8_e4m3 weights: MXFP8 (`weight_scale_inv`, or compressed-tensors' u8 `weight_scale`,
  // E8M0 per 1x32) or per-output-channel fp8 (an f32 `weight_scale` of [rows] or [rows, 1]).
  Result<MatRef> fp8_matrix(const TensorInfo& t, const std::string& base, int64_t rows,
                            int64_t cols) {
    if (t.shape != std::vector<int64_t>{rows, cols}) {
      return shape_error(t, "float8_e4m3 weights", {rows, cols});
    }
    MatRef m{t.data, DType::kF8E4M3, rows, cols};
    w_.bytes_in_place += t.nbytes;
    const std::vector<int64_t> mx_shape = {rows, ceil_div(cols, 32)};
    const std::string inv = t.name + "_scale_inv", ws = base + ".weight_scale";
    if (ckpt_.has(inv) || !ckpt_.has(ws)) {
      M3_TRY(const TensorInfo* s,
             scales(inv, t, "mxfp8", DType::kU8, mx_shape, "E8M0 exponents, one per 1x32 block"));
      m.quant = WeightQuant::kMxfp8;
      m.scale = s->data;
      return m;
    }
    const TensorInfo* s = ckpt_.find(ws);
    if (s->dtype == DType::kU8) {
      M3_TRY(s, scales(ws, t, "mxfp8", DType::kU8, mx_shape, "E8M0 exponents, one per 1x32 block"));
      m.quant = WeightQuant::kMxfp8;
      m.scale = s->data;
      return m;
    }
    if (s->dtype != DType::kF32 ||
        (s->shape != std::vector<int64_t>{rows} && s->shape != std::vector<int64_t>{rows, 1})) {
      return make_error(ErrorCode::kFormat,
                        "tensor '" + ws + "' (the scales of fp8 weights '" + t.name +
                            "') has dtype " + dtype_name(s->dtype) + " and shape " +
                            s->shape_str() + ", expected F32 " + shape_str({rows, 1}) +
                            " (one per output channel) or U8 " + shape_str(mx_shape) +
                            " (E8M0 per 1x32 block) (in " + s->file + ")",
                        ws);
    }
    w_.bytes_in_place += s->nbytes;
    m.quant = WeightQuant::kFp8Channel;
    m.scale = s->data;
    return m;
  }

  // Packed E2M1 (two codes per byte, low nibble first): NVFP4 (fp8 `weight_scale` per 16 +
  // f32 `weight_scale_2`, or compressed-tensors' `weight_packed` + `weight_global_scale`) or MXFP4
  // (u8 E8M0 `weight_scale` per 32; Quark's `weight` or compressed-tensors' `weight_packed`).
  Result<MatRef> fp4_matrix(const TensorInfo& t, const std::string& base, int64_t rows,
                            int64_t cols) {
    const std::vector<int64_t> packed = {rows, ceil_div(cols, 2)};
    if (cols % 2 != 0 || t.shape != packed) {
      return shape_error(t, "packed 4-bit weights, two E2M1 codes per byte", packed);
    }
    MatRef m{t.data, DType::kU8, rows, cols};
    w_.bytes_in_place += t.nbytes;
    const std::string ws = base + ".weight_scale";
    const TensorInfo* s = ckpt_.find(ws);
    if (s != nullptr && s->dtype == DType::kF8E4M3) {
      M3_TRY(s, scales(ws, t, "nvfp4", DType::kF8E4M3, {rows, ceil_div(cols, 16)},
                       "float8_e4m3 scales, one per 16"));
      // The global scale: ModelOpt's `weight_scale_2` multiplies; compressed-tensors'
      // `weight_global_scale` divides (W = e2m1 * fp8(s) / global), held as its reciprocal.
      const std::string mo = base + ".weight_scale_2", ct = base + ".weight_global_scale";
      const bool inverse = !ckpt_.has(mo) && ckpt_.has(ct);
      const std::string gs = inverse ? ct : mo;
      const TensorInfo* g = ckpt_.find(gs);
      if (g == nullptr || g->dtype != DType::kF32 || g->numel() != 1) {
        return make_error(
            ErrorCode::kFormat,
            "tensor '" + t.name + "' is nvfp4 but its global scale " +
                (g == nullptr
                     ? "('" + mo + "' for ModelOpt, '" + ct + "' for compressed-tensors) is missing"
                     : "'" + gs + "' has dtype " + std::string(dtype_name(g->dtype)) +
                           " and shape " + g->shape_str()) +
                "; expected one F32 value (shape [] or [1])",
            gs);
      }
      float v;
      std::memcpy(&v, g->data, sizeof(float));
      if (!(v > 0.f) || !std::isfinite(v) || (inverse && !std::isfinite(1.f / v))) {
        return make_error(ErrorCode::kFormat,
                          "tensor '" + gs + "' (the nvfp4 global scale of '" + t.name + "') is " +
                              std::to_string(v) + "; it must be a positive finite number",
                          gs);
      }
      if (inverse) v = 1.f / v;
      m.quant = WeightQuant::kNvfp4;
      m.scale = s->data;
      m.global_scale = v;
      return m;
    }
    if (s == nullptr && !ckpt_.has(ws)) {
      return make_error(ErrorCode::kFormat,
                        "tensor '" + t.name + "' is uint8 (packed 4-bit weights) but '" + ws +
                            "' is missing; expected float8_e4m3 " +
                            shape_str({rows, ceil_div(cols, 16)}) + " (nvfp4, with " + base +
                            ".weight_scale_2) or U8 " + shape_str({rows, ceil_div(cols, 32)}) +
                            " (mxfp4)",
                        ws);
    }
    M3_TRY(s, scales(ws, t, "mxfp4", DType::kU8, {rows, ceil_div(cols, 32)},
                     "E8M0 exponents, one per 1x32 block"));
    m.quant = WeightQuant::kMxfp4;
    m.scale = s->data;
    return m;
  }

  // --quantization fp8_per_channel: row r's scale is amax_r / 448 (1 for a zero row), the
  // codes e4m3(w / scale) rounded to nearest even (m3::f32_to_fp8_e4m3); owned here.
  MatRef quantize_fp8_per_channel(const MatRef& src) {
    const int64_t rows = src.rows, cols = src.cols;
    auto& q = w_.owned_u8.emplace_back(static_cast<size_t>(rows * cols));
    auto& sc = w_.owned_f32.emplace_back(static_cast<size_t>(rows));
    std::vector<float> row(static_cast<size_t>(cols));
    for (int64_t r = 0; r < rows; ++r) {
      kernels::cpu::dequantize_row(src, r, row.data());
      float amax = 0.f;
      for (float v : row) amax = std::max(amax, std::fabs(v));
      const float s = amax > 0.f ? amax / 448.f : 1.f;
      sc[r] = s;
      for (int64_t c = 0; c < cols; ++c) q[r * cols + c] = f32_to_fp8_e4m3(row[c] / s);
    }
    w_.bytes_owned += q.size() + sc.size() * sizeof(float);
    MatRef m{q.data(), DType::kF8E4M3, rows, cols};
    m.quant = WeightQuant::kFp8Channel;
    m.scale = sc.data();
    return m;
  }

  const Checkpoint& ckpt_;
  M3Weights& w_;
  const QuantPlan& qp_;
};

}  // namespace

MatRef dequantize_to_f32(const MatRef& m, std::vector<float>& storage) {
  storage.resize(static_cast<size_t>(m.rows * m.cols));
  for (int64_t r = 0; r < m.rows; ++r)
    kernels::cpu::dequantize_row(m, r, storage.data() + r * m.cols);
  return MatRef{storage.data(), DType::kF32, m.rows, m.cols};
}

Result<std::unique_ptr<M3Weights>> load_weights(std::shared_ptr<Checkpoint> ckpt,
                                                const M3Config& cfg, const QuantPlan& quant) {
  auto w = std::make_unique<M3Weights>();
  w->checkpoint = ckpt;
  Loader ld(*ckpt, *w, quant);
  const std::vector<TensorSpec> table = m3_tensors(cfg);
  size_views(*w, cfg, table, cfg.num_local_experts);
  // The first root under which the embedding is present (kCheckpointRoots), else the first.
  std::string_view root = kCheckpointRoots[0];
  for (std::string_view r : kCheckpointRoots) {
    if (ckpt->has(table[0].name(r))) {
      root = r;
      break;
    }
  }
  // Spelling chosen per tensor: the first present, or the one of the tensor it follows.
  std::vector<size_t> spelling(table.size(), 0);
  auto load_one = [&](size_t i, int64_t e) -> Status {
    const TensorSpec& t = table[i];
    const std::string name = t.name(root, spelling[i], e);
    if (t.vector) {
      M3_TRY(t.vec(*w), ld.vector(name, t.rows));
    } else if (t.may_tie && !ckpt->has(name)) {
      t.mat(*w) = w->embed_tokens;  // tied: the embedding's view (loaded first)
    } else {
      M3_TRY(t.mat(*w, e), ld.matrix(name, t.rows, t.cols, t.quantizable));
    }
    return {};
  };
  for (size_t i = 0; i < table.size();) {
    const TensorSpec& t = table[i];
    for (size_t s = 0; s < t.names.size() && t.spelling_from < 0; ++s) {
      // "<module>.weight" is present as compressed-tensors' "<module>.weight_packed" too.
      const std::string n = t.name(root, s);
      if (ckpt->has(n) || (!t.vector && ckpt->has(n + "_packed"))) {
        spelling[i] = s;
        break;
      }
    }
    if (t.spelling_from >= 0) spelling[i] = spelling[static_cast<size_t>(t.spelling_from)];
    if (t.experts == 0) {
      M3_TRY_STATUS(load_one(i, 0));
      ++i;
      continue;
    }
    // A layer's routed-expert tensors, expert by expert (w1, w3, w2 of expert 0, then 1, ...).
    size_t end = i;
    while (end < table.size() && table[end].experts > 0 && table[end].layer == t.layer) ++end;
    for (int64_t e = 0; e < t.experts; ++e)
      for (size_t j = i; j < end; ++j) M3_TRY_STATUS(load_one(j, e));
    i = end;
  }
  return w;
}

}  // namespace m3::model
