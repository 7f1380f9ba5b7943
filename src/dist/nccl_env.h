// The NCCL environment rules m3serve enforces before any NCCL communicator starts. Kept apart
// from nccl_communicator.h so it builds (and is tested) without CUDA. Called by
// NcclCommunicator::create and make_nccl_unique_id.
// Invariant: after prepare_nccl_environment() succeeds, NCCL_NVLS_ENABLE is "0" in this process:
// NVLink multicast (NVLS) is never enabled (on the shared GPU hosts we target a program using it
// can put the host's GPUs out of service for a long time); a user who asked for it is refused.
#pragma once

#include <cstdint>

#include "core/error.h"

namespace m3::dist {

// Sets NCCL_NVLS_ENABLE=0 when it is unset; accepts an explicit 0; refuses any other value with a
// message saying why and how to fix it.
Status prepare_nccl_environment();

// M3_ONE_SHOT_ALLREDUCE: "1" asks the GPU tensor-parallel ranks of one process for the one-shot
// P2P all-reduce on small messages (dist/one_shot_all_reduce.h; off by default, never run on
// several GPUs yet); unset, empty or "0": NCCL's only. Another value: an error naming it.
Result<bool> one_shot_all_reduce_requested();
// The largest message (bytes) the one-shot all-reduce takes; larger ones go to NCCL.
inline constexpr int64_t kOneShotAllReduceMaxBytes = int64_t{1} << 20;

}  // namespace m3::dist
