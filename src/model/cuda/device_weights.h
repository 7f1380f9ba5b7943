// Device copies of host weight views for the GPU models (M3ModelCuda, the EAGLE-3 draft, the
// vision tower): each tensor one allocation appended to its owner's store, the bytes counted.
// Unquantized views only (bf16 / f32); M3ModelCuda uploads quantized ones itself.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "gpu/device_buffer.h"
#include "kernels/views.h"

namespace m3::model {

using DeviceStore = std::vector<gpu::DeviceBuffer<uint8_t>>;

// `bytes` uninitialised bytes in a new buffer of `store`; *counted += bytes.
void* device_alloc(DeviceStore& store, size_t* counted, size_t bytes);
// The view with its data copied into a new buffer of `store` (a null or empty view comes back as
// it is). `owner` names the model in the error a quantized view gets.
kernels::MatRef device_copy(DeviceStore& store, size_t* counted, const kernels::MatRef& m,
                            const char* owner);
kernels::VecRef device_copy(DeviceStore& store, size_t* counted, const kernels::VecRef& v);

}  // namespace m3::model
