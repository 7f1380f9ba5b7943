#include "model/cuda/device_weights.h"

#include "core/check.h"
#include "core/dtype.h"

namespace m3::model {

void* device_alloc(DeviceStore& store, size_t* counted, size_t bytes) {
  store.emplace_back(bytes);
  *counted += bytes;
  return store.back().data();
}

kernels::MatRef device_copy(DeviceStore& store, size_t* counted, const kernels::MatRef& m,
                            const char* owner) {
  kernels::MatRef r = m;
  if (m.data == nullptr || m.rows * m.cols == 0) return r;
  M3_CHECK(!m.quantized(), "%s: quantized weights are not uploaded here (bf16 or f32 only)", owner);
  const size_t bytes = static_cast<size_t>(m.rows * m.cols) * dtype_size(m.dtype);
  r.data = device_alloc(store, counted, bytes);
  store.back().copy_from(static_cast<const uint8_t*>(m.data), bytes);
  return r;
}

kernels::VecRef device_copy(DeviceStore& store, size_t* counted, const kernels::VecRef& v) {
  kernels::VecRef r = v;
  if (v.data == nullptr || v.n == 0) return r;
  const size_t bytes = static_cast<size_t>(v.n) * dtype_size(v.dtype);
  r.data = device_alloc(store, counted, bytes);
  store.back().copy_from(static_cast<const uint8_t*>(v.data), bytes);
  return r;
}

}  // namespace m3::model
