// The plain data of prefill/decode disaggregation shared by the engine's API and its connector
// (engine/pd_connector.h): the connector's configuration (from `--kv-transfer-config` with
// kv_connector "NixlConnector"), vLLM's per-request kv_transfer_params, and the counters /metrics
// shows. No behaviour here.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace m3::engine {

enum class KvRole { kProducer, kConsumer, kBoth };

struct PdConfig {
  KvRole role = KvRole::kBoth;
  // The side channel: bound on all interfaces at `port`, advertised as `host` (vLLM's
  // VLLM_NIXL_SIDE_CHANNEL_HOST / _PORT, defaults localhost / 5600). Port 0: the kernel picks a
  // free one, and the params hold() hands out name it.
  std::string host = "localhost";
  int port = 5600;
  // Held pages no consumer read within this many seconds are freed (vLLM's
  // VLLM_NIXL_ABORT_REQUEST_TIMEOUT, 480).
  double abort_timeout_s = 480;
  // A READ that takes longer fails (the request is then recomputed).
  double transfer_timeout_s = 30;
  // The side channel's metadata answer (fetched once per prefill worker; it blocks the loads
  // queued behind it, so it is kept short).
  double side_channel_timeout_s = 5;
  bool produces() const { return role != KvRole::kConsumer; }
  bool consumes() const { return role != KvRole::kProducer; }
};

const char* kv_role_name(KvRole role);

// vLLM's kv_transfer_params, as plain data (the server maps JSON to and from it).
struct KvTransferParams {
  bool do_remote_decode = false;   // prefill here, keep the KV for a decode worker
  bool do_remote_prefill = false;  // decode here, reading the prompt's KV from a prefill worker
  std::string remote_engine_id;
  std::string remote_request_id;
  std::string remote_host;
  int remote_port = 0;
  std::vector<int64_t> remote_block_ids;
  int tp_size = 1;
};

struct PdStats {
  int64_t num_held = 0;           // producer: requests whose pages wait for a consumer
  int64_t num_released_read = 0;  // producer: released after a consumer read them
  int64_t num_released_expired = 0;
  int64_t num_loads_ok = 0;  // consumer
  int64_t num_loads_failed = 0;
  int64_t num_pages_read = 0;
};

}  // namespace m3::engine
