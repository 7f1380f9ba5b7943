// M3_CHECK: always-on assertion for bugs (design.md §4). User input must never reach one:
// validate it and return a Result instead. On failure prints file:line and the message, aborts.
#pragma once

#include <cstdio>
#include <cstdlib>

namespace m3 {
[[noreturn]] void check_failed(const char* file, int line, const char* cond, const char* fmt, ...)
    __attribute__((format(printf, 4, 5)));
[[noreturn]] void check_failed(const char* file, int line, const char* cond);
}  // namespace m3

#define M3_CHECK(cond, ...)                                                     \
  do {                                                                          \
    if (__builtin_expect(!(cond), 0))                                           \
      ::m3::check_failed(__FILE__, __LINE__, #cond __VA_OPT__(, ) __VA_ARGS__); \
  } while (0)
