// Helpers of the image and video processor tests: a file's bytes, and the XXH64 hex digest the
// goldens (tools/goldens/make_vision_goldens.py, make_video_goldens.py) record for byte arrays.
#pragma once

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <xxhash.h>

namespace m3::vision::test {

inline std::vector<uint8_t> read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

inline std::string hex64(const void* p, size_t n) {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(XXH64(p, n, 0)));
  return buf;
}

}  // namespace m3::vision::test
