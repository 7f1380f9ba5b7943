#include "core/check.h"

#include <cstdarg>

namespace m3 {

void check_failed(const char* file, int line, const char* cond, const char* fmt, ...) {
  std::fprintf(stderr, "m3serve: internal check failed at %s:%d: %s: ", file, line, cond);
  va_list ap;
  va_start(ap, fmt);
  std::vfprintf(stderr, fmt, ap);
  va_end(ap);
  std::fputc('\n', stderr);
  std::abort();
}

void check_failed(const char* file, int line, const char* cond) {
  std::fprintf(stderr, "m3serve: internal check failed at %s:%d: %s\n", file, line, cond);
  std::abort();
}

}  // namespace m3
