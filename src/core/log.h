// Logging interface: plain functions, printf-style, to stderr. Usable from any module, including
// translation units compiled by nvcc (no fmt/spdlog here; see dependencies.md gotcha 2).
// Level from $M3_LOG_LEVEL (debug|info|warn|error), default info.
#pragma once

namespace m3 {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarn = 2, kError = 3 };

void set_log_level(LogLevel level);
LogLevel log_level();
void log_write(LogLevel level, const char* fmt, ...) __attribute__((format(printf, 2, 3)));

}  // namespace m3

#define M3_LOG_DEBUG(...) ::m3::log_write(::m3::LogLevel::kDebug, __VA_ARGS__)
#define M3_LOG_INFO(...) ::m3::log_write(::m3::LogLevel::kInfo, __VA_ARGS__)
#define M3_LOG_WARN(...) ::m3::log_write(::m3::LogLevel::kWarn, __VA_ARGS__)
#define M3_LOG_ERROR(...) ::m3::log_write(::m3::LogLevel::kError, __VA_ARGS__)
