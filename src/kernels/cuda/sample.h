// GPU sampling of logits rows (greedy, temperature, top_k, top_p, min_p, seeded), the CUDA twin
// of kernels/cpu/sample.h: the same candidate set and the same counter-based Gumbel noise, so the
// forward copies one token id per row to the host instead of a 200K-entry row of logits.
// Called by the GPU forward (model/cuda) after lm_head. Invariant: enqueues only on `stream`
// (no host sync, no allocation); every pointer is a device pointer.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "kernels/cpu/sample.h"

namespace m3::kernels::cuda {

using cpu::SampleRow;

// out_ids[i] = the token sampled from logits row rows[i].row; ids >= num_valid are never chosen.
// One thread block per row: a max pass, radix selections for the top_k and top_p thresholds
// (4 byte-wise passes each, only when those filters are on), a sum pass and the Gumbel-max pass.
void sample_rows(const float* logits, int64_t vocab, int64_t num_valid, const SampleRow* rows,
                 int64_t n, int32_t* out_ids, cudaStream_t stream);

// Async scheduling: ids[tokens[i]] = sampled[slots[i]] for i < n (a step's decode inputs taken
// from the ids the step before it sampled, without the host seeing them).
void gather_sampled_ids(const int32_t* sampled, const int32_t* tokens, const int32_t* slots,
                        int64_t n, int32_t* ids, cudaStream_t stream);

// Speculative drafting: out[i] = map[ids[rows[i]]] for i < n (rows null: ids[i]; map null:
// no mapping), the draft's greedy ids gathered into the next draft step's inputs and mapped
// from its vocabulary to the target's (an EAGLE-3 draft's d2t).
void gather_mapped_ids(const int32_t* ids, const int32_t* rows, int64_t n, const int32_t* map,
                       int32_t* out, cudaStream_t stream);

}  // namespace m3::kernels::cuda
