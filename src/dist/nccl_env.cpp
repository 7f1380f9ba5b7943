#include "dist/nccl_env.h"

#include <cstdlib>
#include <string>

namespace m3::dist {

Status prepare_nccl_environment() {
  const char* v = std::getenv("NCCL_NVLS_ENABLE");
  if (v == nullptr || *v == '\0') {
    // Overwrite: an empty value is present to setenv but means "default" (NVLS on) to NCCL.
    setenv("NCCL_NVLS_ENABLE", "0", 1);
    return {};
  }
  if (std::string(v) == "0") return {};
  return make_error(ErrorCode::kUnsupported,
                    std::string("NCCL_NVLS_ENABLE is set to '") + v +
                        "', but m3serve never enables NVLink multicast (NVLS): on shared GPU hosts "
                        "a program using it can put every GPU of the host out of service; unset "
                        "it or set NCCL_NVLS_ENABLE=0",
                    "NCCL_NVLS_ENABLE");
}

}  // namespace m3::dist
