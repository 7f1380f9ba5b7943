// NixlAgent: one agent of NVIDIA's NIXL transfer library over its UCX backend, for the P/D
// connector (engine/pd_connector.h). The library is NOT a build dependency: libnixl_capi.so (the C
// API of the `nixl-cu13` / `nixl-cu12` wheels) is loaded with dlopen at run time, from
// $M3_NIXL_LIB (the .so or its folder) or else from the wheel `python3` finds; the few functions
// used are declared in nixl_agent.cpp from NIXL's published C API. Thread safe: every call into
// the library holds one mutex (the C API's default agent is not).
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "core/error.h"

namespace m3::engine {

// A byte range of host memory (NIXL's DRAM), as registered and as transferred.
struct NixlDesc {
  uintptr_t addr = 0;
  size_t bytes = 0;
};

struct NixlApi;  // the loaded function table (nixl_agent.cpp)

class NixlAgent {
 public:
  // Loads the library once per process and makes agent `name` with a UCX backend. Errors: the
  // library is missing (names `pip install nixl-cu13` and M3_NIXL_LIB) or has no UCX plugin.
  static Result<std::unique_ptr<NixlAgent>> create(const std::string& name);
  ~NixlAgent();
  NixlAgent(const NixlAgent&) = delete;
  NixlAgent& operator=(const NixlAgent&) = delete;

  // Where the library came from (the start-up log line).
  static std::string library_path();

  // Registers host memory for transfers (kept registered until the agent is destroyed).
  Status register_dram(std::span<const NixlDesc> regions);
  // This agent's metadata (connection info and registered memory) for a peer's load_remote.
  Result<std::string> local_metadata();
  // Loads a peer's metadata; returns its agent name.
  Result<std::string> load_remote(const std::string& metadata);
  void forget_remote(const std::string& agent);

  // Starts one READ of `remote` (the peer's registered memory) into `local` (ours), descriptor i
  // into descriptor i (equal lengths); the peer gets notification `notif` when it completes.
  // Returns a handle for status() / release().
  Result<void*> start_read(std::span<const NixlDesc> local, std::span<const NixlDesc> remote,
                           const std::string& remote_agent, const std::string& notif);
  // 1 in progress, 0 done, negative: failed.
  int status(void* xfer);
  void release(void* xfer);
  // Notifications received since the last call (any peer), in arrival order per peer.
  std::vector<std::string> take_notifications();

 private:
  NixlAgent() = default;
  const NixlApi* api_ = nullptr;
  void* agent_ = nullptr;
  void* backend_ = nullptr;
  std::vector<void*> registered_;  // reg dlists, deregistered at destruction
  std::mutex mu_;
};

}  // namespace m3::engine
