#include "model/weights.h"

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

class Loader {
 public:
  Loader(const Checkpoint& ckpt, M3Weights& w) : ckpt_(ckpt), w_(w) {}

  // The first of `names` present in the checkpoint (alternative spellings of one tensor).
  std::string pick(const std::vector<std::string>& names) const {
    for (const auto& n : names)
      if (ckpt_.has(n)) return n;
    return names.front();
  }

  Result<MatRef> matrix(const std::string& name, int64_t rows, int64_t cols) {
    const TensorInfo* t = ckpt_.find(name);
    if (t && t->dtype == DType::kF8E4M3) return fp8_matrix(*t, rows, cols);
    M3_TRY(const TensorInfo* ti,
           ckpt_.get(name, {rows, cols}, {DType::kBF16, DType::kF32, DType::kF16, DType::kF8E4M3}));
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
  // MXFP8: W[o, i] = fp8(Wq[o, i]) * 2^(S[o, i/32] - 127), exact in bf16.
  Result<MatRef> fp8_matrix(const TensorInfo& t, int64_t rows, int64_t cols) {
    if (t.shape != std::vector<int64_t>{rows, cols}) {
      return make_error(ErrorCode::kFormat,
                        "tensor '" + t.name + "' has shape " + t.shape_str() + ", expected " +
                            shape_str({rows, cols}) + " (in " + t.file + ")",
                        t.name);
    }
    const std::string scale_name = t.name + "_scale_inv";
    const int64_t nblk = (cols + 31) / 32;
    M3_TRY(const TensorInfo* s, ckpt_.get(scale_name, {rows, nblk}, {DType::kU8}));
    auto& buf = w_.owned_u16.emplace_back(rows * cols);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        const float v =
            fp8_e4m3_to_f32(t.data[r * cols + c]) * e8m0_to_f32(s->data[r * nblk + c / 32]);
        buf[r * cols + c] = f32_to_bf16(v);
      }
    }
    w_.bytes_owned += buf.size() * 2;
    return MatRef{buf.data(), DType::kBF16, rows, cols};
  }

  const Checkpoint& ckpt_;
  M3Weights& w_;
};

}  // namespace

Result<std::unique_ptr<M3Weights>> load_weights(std::shared_ptr<Checkpoint> ckpt,
                                                const M3Config& cfg) {
  auto w = std::make_unique<M3Weights>();
  w->checkpoint = ckpt;
  Loader ld(*ckpt, *w);
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
      M3_TRY(t.mat(*w, e), ld.matrix(name, t.rows, t.cols));
    }
    return {};
  };
  for (size_t i = 0; i < table.size();) {
    const TensorSpec& t = table[i];
    for (size_t s = 0; s < t.names.size() && t.spelling_from < 0; ++s) {
      if (ckpt->has(t.name(root, s))) {
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
