#include "gpu/device.h"

#include <cstdio>
#include <cstdlib>

#include "gpu/cuda_check.h"

namespace m3::gpu {

void cuda_fail(cudaError_t err, const char* what, const char* file, int line) {
  std::fprintf(stderr, "m3serve: CUDA error in %s (%s:%d): %s (%s)\n", what, file, line,
               cudaGetErrorString(err), cudaGetErrorName(err));
  std::abort();
}

Result<DeviceInfo> probe_device(int index) {
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error so later probes start clean
    return make_error(ErrorCode::kUnavailable,
                      std::string("no usable CUDA device: ") + cudaGetErrorString(err) +
                          "; run with --device cpu on machines without an NVIDIA GPU",
                      "--device");
  }
  if (index < 0 || index >= count) {
    return make_error(ErrorCode::kInvalidArgument,
                      "CUDA device " + std::to_string(index) + " does not exist (" +
                          std::to_string(count) + " visible)",
                      "--device");
  }
  cudaDeviceProp prop{};
  M3_CUDA_CHECK(cudaGetDeviceProperties(&prop, index));
  DeviceInfo info;
  info.index = index;
  info.name = prop.name;
  info.cc_major = prop.major;
  info.cc_minor = prop.minor;
  info.num_sms = prop.multiProcessorCount;
  M3_CUDA_CHECK(cudaSetDevice(index));
  M3_CUDA_CHECK(cudaMemGetInfo(&info.free_bytes, &info.total_bytes));
  return info;
}

}  // namespace m3::gpu
