#include "core/log.h"

#include <atomic>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <mutex>

namespace m3 {

namespace {
LogLevel initial_level() {
  const char* s = std::getenv("M3_LOG_LEVEL");
  if (!s) return LogLevel::kInfo;
  if (!std::strcmp(s, "debug")) return LogLevel::kDebug;
  if (!std::strcmp(s, "warn")) return LogLevel::kWarn;
  if (!std::strcmp(s, "error")) return LogLevel::kError;
  return LogLevel::kInfo;
}
std::atomic<int> g_level{static_cast<int>(initial_level())};
std::mutex g_mu;
}  // namespace

void set_log_level(LogLevel level) {
  g_level = static_cast<int>(level);
}
LogLevel log_level() {
  return static_cast<LogLevel>(g_level.load());
}

void log_write(LogLevel level, const char* fmt, ...) {
  if (static_cast<int>(level) < g_level.load()) return;
  static const char* names[] = {"DEBUG", "INFO", "WARN", "ERROR"};
  char ts[32];
  std::time_t now = std::time(nullptr);
  std::tm tm{};
  localtime_r(&now, &tm);
  std::strftime(ts, sizeof ts, "%H:%M:%S", &tm);
  std::lock_guard<std::mutex> lock(g_mu);
  std::fprintf(stderr, "%s %s ", ts, names[static_cast<int>(level)]);
  va_list ap;
  va_start(ap, fmt);
  std::vfprintf(stderr, fmt, ap);
  va_end(ap);
  std::fputc('\n', stderr);
}

}  // namespace m3
