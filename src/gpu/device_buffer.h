// DeviceBuffer<T>: an owning, move-only cudaMalloc'd array, and Stream: an owning cudaStream_t.
// Used by the CUDA ops' tests and benches and by the GPU model (model/cuda: weights, step
// buffers, KV pages).
// Invariant: data() is null exactly when size() == 0; the memory is freed once, by the owner,
// and every CUDA call is checked (a fault ends the process, design.md §4).
#pragma once

#include <cstddef>
#include <utility>
#include <vector>

#include <cuda_runtime.h>

#include "core/check.h"
#include "gpu/cuda_check.h"

namespace m3::gpu {

template <class T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t n) : size_(n) {
    if (n > 0) M3_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&data_), n * sizeof(T)));
  }
  // A device copy of `host` (synchronous).
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) {
    copy_from(host.data(), host.size());
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept
      : data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      release();
      data_ = std::exchange(o.data_, nullptr);
      size_ = std::exchange(o.size_, 0);
    }
    return *this;
  }
  ~DeviceBuffer() { release(); }

  T* data() { return data_; }
  const T* data() const { return data_; }
  size_t size() const { return size_; }
  size_t bytes() const { return size_ * sizeof(T); }

  // Synchronous host <-> device copies of the first n elements. A pageable host-to-device
  // cudaMemcpy returns once the data is staged, before its DMA (on the legacy default stream)
  // lands, and work on a non-blocking gpu::Stream does not wait for that stream: so copy_from
  // waits for the device before it returns (seen: a kernel on a Stream read a buffer whose copy
  // had not landed, under load from another process).
  void copy_from(const T* host, size_t n) {
    M3_CHECK(n <= size_, "DeviceBuffer: copy of %zu elements into %zu", n, size_);
    if (n > 0) {
      M3_CUDA_CHECK(cudaMemcpy(data_, host, n * sizeof(T), cudaMemcpyHostToDevice));
      M3_CUDA_CHECK(cudaDeviceSynchronize());
    }
  }
  void copy_to(T* host, size_t n) const {
    M3_CHECK(n <= size_, "DeviceBuffer: copy of %zu elements into %zu", n, size_);
    if (n > 0) M3_CUDA_CHECK(cudaMemcpy(host, data_, n * sizeof(T), cudaMemcpyDeviceToHost));
  }
  std::vector<T> to_host() const {
    std::vector<T> out(size_);
    copy_to(out.data(), size_);
    return out;
  }
  // Sets every byte to `byte` (e.g. 0xff fills floats with NaN to catch unwritten outputs).
  void fill_bytes(int byte) {
    // cudaMemset is asynchronous, on the legacy default stream: without the wait, a kernel on
    // a non-blocking gpu::Stream may run first and the fill land on its output (tests saw
    // all-NaN outputs from 0xff fills under load from another process).
    if (size_ > 0) {
      M3_CUDA_CHECK(cudaMemset(data_, byte, bytes()));
      M3_CUDA_CHECK(cudaDeviceSynchronize());
    }
  }

 private:
  void release() {
    if (data_ != nullptr) cudaFree(data_);  // cannot fail usefully in a destructor
    data_ = nullptr;
    size_ = 0;
  }
  T* data_ = nullptr;
  size_t size_ = 0;
};

// An owning non-blocking CUDA stream.
class Stream {
 public:
  Stream() { M3_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking)); }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  ~Stream() { cudaStreamDestroy(stream_); }
  cudaStream_t get() const { return stream_; }
  void synchronize() const { M3_CUDA_CHECK(cudaStreamSynchronize(stream_)); }

 private:
  cudaStream_t stream_ = nullptr;
};

}  // namespace m3::gpu
