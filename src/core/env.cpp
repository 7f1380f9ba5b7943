#include "core/env.h"

#include <cstdlib>
#include <cstring>

#include "core/log.h"

namespace m3 {

bool env_switch(const char* name, bool def) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return def;
  if (std::strcmp(v, "1") == 0) return true;
  if (std::strcmp(v, "0") == 0) return false;
  M3_LOG_WARN("%s=%s is not a switch value: use 1 (on) or 0 (off); keeping the default (%s)", name,
              v, def ? "1" : "0");
  return def;
}

}  // namespace m3
