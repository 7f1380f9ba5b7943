// GPU discovery: whether a usable CUDA device is present, and what it is. Tests and the
// `--device cuda` start-up path call this first, so a machine without a GPU gets a clear
// error (or a skipped test) instead of a CUDA fault.
#pragma once

#include <cstdint>
#include <string>

#include "core/error.h"

namespace m3::gpu {

struct DeviceInfo {
  int index = 0;
  std::string name;
  int cc_major = 0, cc_minor = 0;
  int num_sms = 0;
  size_t total_bytes = 0;
  size_t free_bytes = 0;
};

// The device `index`, or an error saying why no GPU can be used (no driver, no device).
Result<DeviceInfo> probe_device(int index = 0);

}  // namespace m3::gpu
