// The vocabulary-slice embedding of a tensor-parallel rank (the twin of kernels/cuda/shard_ops.cu).
#include <algorithm>

#include "core/check.h"
#include "kernels/cpu/ops.h"

namespace m3::kernels::cpu {

void embedding_vocab_slice(const MatRef& table, int64_t vocab_begin, int64_t vocab_size,
                           int64_t hidden, const int32_t* ids, int64_t n, float* out) {
  M3_CHECK(table.rows == 0 || table.cols == hidden,
           "embedding_vocab_slice: table of %lld columns "
           "for hidden %lld",
           static_cast<long long>(table.cols), static_cast<long long>(hidden));
  M3_CHECK(vocab_begin >= 0 && vocab_begin + table.rows <= vocab_size,
           "embedding_vocab_slice: rows [%lld, %lld) outside the vocabulary of %lld",
           static_cast<long long>(vocab_begin), static_cast<long long>(vocab_begin + table.rows),
           static_cast<long long>(vocab_size));
  std::fill(out, out + n * hidden, 0.f);
  for (int64_t t = 0; t < n; ++t) {
    const int32_t id = ids[t];
    M3_CHECK(id >= 0 && id < vocab_size, "embedding id %d out of range", id);
    if (id < vocab_begin || id >= vocab_begin + table.rows) continue;
    const int32_t local = static_cast<int32_t>(id - vocab_begin);
    embedding(table, &local, 1, out + t * hidden);
  }
}

}  // namespace m3::kernels::cpu
