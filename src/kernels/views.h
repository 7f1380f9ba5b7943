// Device-neutral views and argument structs shared by the two implementations of the M3 ops:
// kernels/cpu (the reference, host pointers) and kernels/cuda (device pointers). A view only
// points at memory it does not own; which memory (host or device) is the caller's business and
// the op's contract. The model's forward (model/m3_forward.h) fills these once and hands them to
// either set of ops, so nothing here depends on CUDA.
// Invariant: plain data; copying a view never copies what it points at.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "core/check.h"
#include "core/dtype.h"

namespace m3::kernels {

namespace cuda {
class FlashPrefill;
}

// How a weight matrix's elements are stored (docs/QUANTIZATION.md is this, written down).
// W[r, c] is the real weight; `data` and `scale` are MatRef's two arrays.
//   kNone       data: dtype (bf16 or f32) [rows, cols]; no scale.
//   kFp8Channel data: e4m3 [rows, cols]; scale: f32 [rows]. W = fp8(q[r, c]) * scale[r]
//               (--quantization fp8_per_channel, made at load from a bf16 checkpoint).
//   kMxfp8      data: e4m3 [rows, cols]; scale: E8M0 u8 [rows, ceil(cols / 32)].
//               W = fp8(q[r, c]) * 2^(scale[r, c / 32] - 127) (m3-model.md §2.6).
//   kNvfp4      data: E2M1 codes, two per byte, low nibble = even column, u8 [rows, cols / 2];
//               scale: e4m3 [rows, ceil(cols / 16)]; global_scale: f32.
//               W = e2m1(q[r, c]) * fp8(scale[r, c / 16]) * global_scale (§2.7).
//   kMxfp4      data: E2M1 codes as kNvfp4; scale: E8M0 u8 [rows, ceil(cols / 32)].
//               W = e2m1(q[r, c]) * 2^(scale[r, c / 32] - 127) (§2.8).
// A row's scales follow it, so a range of rows is a range of both arrays (slice_rows).
enum class WeightQuant : uint8_t { kNone, kFp8Channel, kMxfp8, kNvfp4, kMxfp4 };

inline const char* weight_quant_name(WeightQuant q) {
  switch (q) {
    case WeightQuant::kNone:
      return "none";
    case WeightQuant::kFp8Channel:
      return "fp8_per_channel";
    case WeightQuant::kMxfp8:
      return "mxfp8";
    case WeightQuant::kNvfp4:
      return "nvfp4";
    case WeightQuant::kMxfp4:
      return "mxfp4";
  }
  return "?";
}

// Columns one scale covers along a row (0: one scale per row or none).
inline int64_t weight_quant_block(WeightQuant q) {
  return q == WeightQuant::kNvfp4                                 ? 16
         : (q == WeightQuant::kMxfp8 || q == WeightQuant::kMxfp4) ? 32
                                                                  : 0;
}
inline bool weight_quant_is_4bit(WeightQuant q) {
  return q == WeightQuant::kNvfp4 || q == WeightQuant::kMxfp4;
}

// A weight matrix [rows = out_features, cols = in_features], row-major (PyTorch Linear layout),
// in one of the storage formats above.
struct MatRef {
  const void* data = nullptr;
  DType dtype = DType::kBF16;  // kBF16 or kF32 (kNone); kF8E4M3 (fp8 formats); kU8 (4-bit codes)
  int64_t rows = 0;
  int64_t cols = 0;
  WeightQuant quant = WeightQuant::kNone;
  const void* scale = nullptr;  // the format's scales (null for kNone)
  float global_scale = 1.f;     // kNvfp4's weight_scale_2 (1 otherwise)

  bool quantized() const { return quant != WeightQuant::kNone; }
  // Bytes of one row of `data`.
  int64_t row_bytes() const {
    return weight_quant_is_4bit(quant) ? (cols + 1) / 2
                                       : cols * static_cast<int64_t>(dtype_size(dtype));
  }
  // Scales per row, and the bytes they take.
  int64_t scales_per_row() const {
    if (quant == WeightQuant::kNone) return 0;
    if (quant == WeightQuant::kFp8Channel) return 1;
    const int64_t b = weight_quant_block(quant);
    return (cols + b - 1) / b;
  }
  int64_t scale_row_bytes() const {
    return quant == WeightQuant::kFp8Channel ? 4 : scales_per_row();  // f32, else 1-byte scales
  }
  int64_t data_bytes() const { return rows * row_bytes(); }
  int64_t scale_bytes() const { return rows * scale_row_bytes(); }
  int64_t bytes() const { return data_bytes() + scale_bytes(); }
  // Rows [begin, begin + count) as a MatRef (for slicing fused matrices): both arrays advance.
  MatRef slice_rows(int64_t begin, int64_t count) const {
    M3_CHECK(begin >= 0 && begin + count <= rows);
    MatRef m = *this;
    m.data = static_cast<const uint8_t*>(data) + begin * row_bytes();
    if (scale != nullptr) m.scale = static_cast<const uint8_t*>(scale) + begin * scale_row_bytes();
    m.rows = count;
    return m;
  }
};

// A weight vector (norm weights, biases), bf16 or f32. at() and to_f32() read host memory.
struct VecRef {
  const void* data = nullptr;
  DType dtype = DType::kBF16;
  int64_t n = 0;
  float at(int64_t i) const {
    if (dtype == DType::kF32) return static_cast<const float*>(data)[i];
    return bf16_to_f32(static_cast<const uint16_t*>(data)[i]);
  }
  void to_f32(float* out) const {
    for (int64_t i = 0; i < n; ++i) out[i] = at(i);
  }
};

// The element formats of the paged KV cache (docs/KV_CACHE.md is the layout, written down):
//   kF32   fp32, the oracle mode (--dtype float32 --kv-cache-dtype float32).
//   kBf16  bf16, rounded to nearest even (the GPU default).
//   kFp8   OCP FP8 E4M3 ("fn"), saturating, rounded to nearest even, with a scale:
//          K/V: one per-tensor scale per layer (k_scale, v_scale; the checkpoint's or 1.0):
//               stored = fp8(x * (1 / scale)), read = fp8_value * scale;
//          index-K: one scale per token, a power of two (ik_scale[slot] = 2^ceil(log2(amax/448)),
//               1 when the row is zero), so x / scale is exact and only the fp8 rounding remains.
enum class KvDtype : uint8_t { kF32, kBf16, kFp8 };

inline int64_t kv_dtype_size(KvDtype d) {
  return d == KvDtype::kF32 ? 4 : d == KvDtype::kBf16 ? 2 : 1;
}
inline const char* kv_dtype_name(KvDtype d) {
  return d == KvDtype::kF32 ? "float32" : d == KvDtype::kBf16 ? "bfloat16" : "fp8_e4m3";
}

#if defined(__CUDACC__)
#define M3_HD __host__ __device__
#else
#define M3_HD
#endif

// The per-token scale of an fp8 index-K row whose largest magnitude is `amax`: the smallest
// power of two s with amax / s <= 448 (E4M3's largest finite value); 1 for a zero (or NaN) row.
// Exact on host and device alike (frexp/ldexp and a comparison, no division).
M3_HD inline float fp8_row_scale(float amax) {
  if (!(amax > 0.f)) return 1.f;
  if (amax > 3.0e38f) amax = 3.0e38f;
  int e = 0;
  const float m = frexpf(amax, &e);  // amax = m * 2^e, m in [0.5, 1)
  return ldexpf(1.f, m * 512.f <= 448.f ? e - 9 : e - 8);
}

// Per-layer paged KV storage. A page holds `page_size` tokens; a slot is page * page_size +
// offset. Elements are `kv_dtype` (K, V) and `ik_dtype` (index-K), addressed through the
// typed accessors below (the pointers are untyped because the format is a run-time choice).
struct KvPages {
  void* k = nullptr;          // [num_pages, page_size, num_kv_heads, head_dim] kv_dtype
  void* v = nullptr;          // [num_pages, page_size, num_kv_heads, head_dim] kv_dtype
  void* ik = nullptr;         // [num_pages, page_size, index_dim] ik_dtype (sparse layers only)
  float* ik_scale = nullptr;  // [num_pages, page_size] per-token scales (ik_dtype kFp8 only)
  KvDtype kv_dtype = KvDtype::kF32;
  KvDtype ik_dtype = KvDtype::kF32;
  float k_scale = 1.f;  // per-tensor scales of an fp8 K/V (1 otherwise)
  float v_scale = 1.f;
  int64_t num_pages = 0;
  int64_t page_size = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t index_dim = 0;

  // An fp32 cache over caller-owned arrays (tests, benches).
  static KvPages fp32(float* k, float* v, float* ik, int64_t num_pages, int64_t page_size,
                      int64_t num_kv_heads, int64_t head_dim, int64_t index_dim) {
    KvPages c;
    c.k = k;
    c.v = v;
    c.ik = ik;
    c.num_pages = num_pages;
    c.page_size = page_size;
    c.num_kv_heads = num_kv_heads;
    c.head_dim = head_dim;
    c.index_dim = index_dim;
    return c;
  }

  template <typename T>
  M3_HD T* k_as() const {
    return static_cast<T*>(k);
  }
  template <typename T>
  M3_HD T* v_as() const {
    return static_cast<T*>(v);
  }
  template <typename T>
  M3_HD T* ik_as() const {
    return static_cast<T*>(ik);
  }
  // Bytes of one token's K (or V) row of all KV heads, and of one index-K row.
  int64_t kv_row_bytes() const { return num_kv_heads * head_dim * kv_dtype_size(kv_dtype); }
  int64_t ik_row_bytes() const { return index_dim * kv_dtype_size(ik_dtype); }
};

// Where each token of a step lives: sequence, absolute position, and the sequences' block tables
// in CSR form (block_table[block_table_offsets[s] + b] = physical page of logical block b).
struct TokenLayout {
  int64_t num_tokens = 0;
  const int32_t* positions = nullptr;            // [num_tokens]
  const int32_t* seq_ids = nullptr;              // [num_tokens]
  const int32_t* block_table_offsets = nullptr;  // [num_seqs + 1]
  const int32_t* block_table = nullptr;          // [block_table_offsets[num_seqs]]
  // Host-known: some sequence has two or more tokens in this step (a prefill chunk, a
  // speculative verify run). The CUDA dense attention then runs those tokens through its
  // query-tiled kernel (one tile of keys serves every query of the tile); false keeps the
  // per-token kernels for all tokens (always correct, slow for prefill).
  bool multi_token_seqs = false;
  // Host-known: some sequence has exactly one token in this step (a decode row). false (every
  // sequence has two or more) lets the CUDA attention skip its per-token kernel once the
  // multi-token kernels serve every token; leave true when unsure (graph-captured steps, whose
  // replays may carry decode rows).
  bool single_token_seqs = true;
  // Host object with this step's FlashInfer prefill plan for those tokens (CUDA builds with
  // FlashInfer, kernels/cuda/attn_flash.h), or null.
  cuda::FlashPrefill* flash_prefill = nullptr;
};

// RoPE context extension (YaRN, as transformers' and vLLM's "yarn" rope type computes it), over
// the rotated dims only. factor <= 1 means none: plain RoPE, inv_freq = theta^(-2i / rot).
// With a factor each frequency blends the plain one (extrapolation) with it divided by factor
// (interpolation) along a linear ramp between the correction dims of beta_fast and beta_slow
// rotations over original_max_position_embeddings; cos and sin are then scaled by
// attention_factor (0.1 ln(factor) + 1 unless the config gives it).
struct RopeScaling {
  float factor = 0.f;
  double original_max_position = 0;
  float beta_fast = 32.f, beta_slow = 1.f;
  float attention_factor = 1.f;
  bool truncate = true;  // the correction range rounded to whole dims (floor / ceil)
  bool active() const { return factor > 1.f; }
};

// The rope's inverse frequencies of `rot` rotated dims into out[rot / 2], in fp32 as the
// reference computes them; shared by the CPU op and the CUDA op's host-side table, so both use
// the same numbers.
inline void rope_inv_freq(double theta, const RopeScaling& sc, int64_t rot, float* out) {
  const int64_t half = rot / 2;
  if (!sc.active()) {
    for (int64_t i = 0; i < half; ++i) {
      const float e = static_cast<float>(2 * i) / static_cast<float>(rot);
      out[i] = 1.0f / std::pow(static_cast<float>(theta), e);
    }
    return;
  }
  const double two_pi = 6.283185307179586;
  auto correction_dim = [&](double rotations) {
    return static_cast<double>(rot) * std::log(sc.original_max_position / (rotations * two_pi)) /
           (2.0 * std::log(theta));
  };
  double low = correction_dim(sc.beta_fast), high = correction_dim(sc.beta_slow);
  if (sc.truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, static_cast<double>(rot - 1));
  if (low == high) high += 0.001;
  for (int64_t i = 0; i < half; ++i) {
    const float e = static_cast<float>(2 * i) / static_cast<float>(rot);
    const float pos = std::pow(static_cast<float>(theta), e);
    const float extrapolation = 1.0f / pos, interpolation = 1.0f / (sc.factor * pos);
    float ramp = static_cast<float>((static_cast<double>(i) - low) / (high - low));
    ramp = std::min(std::max(ramp, 0.f), 1.f);
    const float extra = 1.0f - ramp;  // share of the extrapolated (plain) frequency
    out[i] = interpolation * (1.0f - extra) + extrapolation * extra;
  }
}

// Arguments of attn_prep, one attention layer's preparation after its projections:
//   q_out  = rope(rmsnorm_gemma(q, q_norm), rot_dim)        per query head
//   iq_out = rope(rmsnorm_gemma(iq, iq_norm), index_rot_dim) per index head (if any)
//   page K = rope(rmsnorm_gemma(k, k_norm), rot_dim), page V = v, per KV head
// (q_norm and k_norm both empty, n == 0: no QK-norm, as in a Llama layer; the CPU op only so far)
//   page index-K = rope(rmsnorm_gemma(ik, ik_norm), index_rot_dim) (if any)
// The inputs are token rows `in_stride` floats apart (one fused projection's output:
// q | k | v | iq | ik columns), or packed per tensor when in_stride is 0; q_out / iq_out are
// packed [T, heads, dim] and may equal q / iq when those are packed. Full-attention layers pass
// num_index_heads = 0.
struct AttnPrepArgs {
  const float* q = nullptr;
  float* q_out = nullptr;
  int64_t num_q_heads = 0;
  const float* k = nullptr;
  const float* v = nullptr;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0, rot_dim = 0;
  VecRef q_norm, k_norm;
  const float* iq = nullptr;
  float* iq_out = nullptr;
  const float* ik = nullptr;
  int64_t num_index_heads = 0;
  int64_t index_dim = 0, index_rot_dim = 0;
  VecRef iq_norm, ik_norm;
  int64_t in_stride = 0;  // floats between token rows of q, k, v, iq, ik (0: packed)
  float eps = 1e-6f;
  double theta = 10000.0;
  RopeScaling scaling;  // YaRN context extension (none by default)
};

// The routed experts of one MoE layer (w1/w3: [inter, hidden], w2: [hidden, inter], all of one
// dtype, bf16 or f32, or all of one quantized format through mats_of). Contiguous layout: each
// projection stored over the experts back to back, expert e's matrix at base + e * rows * cols
// elements (what the CUDA op requires). The CPU op also takes experts scattered in memory (a
// checkpoint read in place): then w1_of / w3_of / w2_of are host arrays of num_experts pointers and
// the bases are ignored.
struct MoeExpertWeights {
  const void* w1 = nullptr;  // gate
  const void* w3 = nullptr;  // up
  const void* w2 = nullptr;  // down
  DType dtype = DType::kBF16;
  int64_t num_experts = 0, inter = 0, hidden = 0;
  const void* const* w1_of = nullptr;
  const void* const* w3_of = nullptr;
  const void* const* w2_of = nullptr;
  // Quantized experts (docs/QUANTIZATION.md): `quant` their one format, and
  // mats_of a host array of 3 * num_experts views, expert e's w1, w3, w2 at 3e, 3e + 1, 3e + 2
  // (each with its own scales and global scale). When mats_of is set the fields above are
  // ignored.
  WeightQuant quant = WeightQuant::kNone;
  const MatRef* mats_of = nullptr;
  // The CUDA op's NVFP4 experts: their global scales on the device, f32 [3, num_experts]
  // (w1's, w3's, w2's; null: every view's global_scale is the same). The CPU op reads mats_of.
  const float* global_scales = nullptr;
  // Expert e's projection `base` (w1, w3 or w2) and its per-expert array.
  const void* expert(const void* base, const void* const* of, int64_t e) const {
    if (of != nullptr) return of[e];
    return static_cast<const uint8_t*>(base) +
           static_cast<size_t>(e * inter * hidden) * dtype_size(dtype);
  }
  // Expert e's projection `proj` (0: w1 gate, 1: w3 up, 2: w2 down) as a view.
  MatRef expert_mat(int proj, int64_t e) const {
    if (mats_of != nullptr) return mats_of[3 * e + proj];
    const void* base = proj == 0 ? w1 : proj == 1 ? w3 : w2;
    const void* const* of = proj == 0 ? w1_of : proj == 1 ? w3_of : w2_of;
    MatRef m;
    m.data = expert(base, of, e);
    m.dtype = dtype;
    m.rows = proj == 2 ? hidden : inter;
    m.cols = proj == 2 ? inter : hidden;
    return m;
  }
};

// An MoE layer's shared expert (gate, up: [inter, hidden]; down: [hidden, inter]), for a
// backend that runs it beside the routed experts (kernels/cuda moe_experts_shared).
struct MoeSharedExpert {
  MatRef gate, up, down;
};

// SwiGLU-OAI constants (see swiglu_oai).
struct SwigluParams {
  float alpha = 1.702f, limit = 7.0f, beta = 1.0f;
};

// Scratch memory an op may use for one call (split-KV partials, MSA block scores). It is the
// caller's: ops never allocate. The CPU ops need none and ignore it.
struct Workspace {
  void* data = nullptr;
  size_t bytes = 0;
};

}  // namespace m3::kernels
