// The NCCL environment rules m3serve enforces before any NCCL communicator starts. Kept apart
// from nccl_communicator.h so it builds (and is tested) without CUDA. Called by
// NcclCommunicator::create and make_nccl_unique_id.
// Invariant: after prepare_nccl_environment() succeeds, NCCL_NVLS_ENABLE is "0" in this process:
// NVLink multicast (NVLS) is never enabled (on the shared GPU hosts we target a program using it
// can put the host's GPUs out of service for a long time); a user who asked for it is refused.
#pragma once

#include "core/error.h"

namespace m3::dist {

// Sets NCCL_NVLS_ENABLE=0 when it is unset; accepts an explicit 0; refuses any other value with a
// message saying why and how to fix it.
Status prepare_nccl_environment();

}  // namespace m3::dist
