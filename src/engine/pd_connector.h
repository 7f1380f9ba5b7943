// PdConnector: prefill/decode disaggregation over NIXL (`--kv-transfer-config` with
// kv_connector "NixlConnector"), speaking vLLM's NixlConnector request protocol so vLLM's routers
// drive it unchanged. The engine owns one; its own threads do the network work:
// - producer (kv_producer / kv_both): a request with kv_transfer_params.do_remote_decode keeps its
//   pages when it finishes (sched: hold_kv_on_finish); hold() records them with a deadline and
//   returns the kv_transfer_params the response carries (engine id, page ids, side channel). A
//   ZeroMQ REP socket (the side channel, VLLM_NIXL_SIDE_CHANNEL_HOST:PORT) answers a consumer's
//   metadata request with the NIXL agent metadata and the pool's layout; the consumer READs the
//   pages itself (one-sided) and NIXL notifies us, which releases them; so does the deadline.
// - consumer (kv_consumer / kv_both): a request with do_remote_prefill is admitted with pages for
//   its prompt (sched: load_remote_kv); start_load() fetches the peer's metadata (cached per
//   engine id; each peer's first fetch on its own thread, so a hung peer delays only its own
//   loads), READs every region of every page into ours, and reports the outcome.
// The engine thread polls take_events() and applies them to the scheduler. Invariant: every
// start_load() produces exactly one loaded event (ok or not) unless shutdown() came first, and no
// READ into our pages is in flight after shutdown() returns.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/error.h"
#include "engine/kv_transfer.h"
#include "runtime/forward_backend.h"

namespace m3::engine {

class NixlAgent;

class PdConnector {
 public:
  // Makes the NIXL agent, registers the pool's regions and, for a producer, binds the side
  // channel. `wake` is called (from the connector's threads) when take_events() has something.
  // Errors: NIXL missing (names the pip package), the port taken (names the variable).
  static Result<std::unique_ptr<PdConnector>> create(const PdConfig& config,
                                                     std::vector<runtime::KvRegion> regions,
                                                     int block_size, std::function<void()> wake);
  ~PdConnector();

  const std::string& engine_id() const { return engine_id_; }
  // The side channel's port (the bound one where the config asked for 0).
  int port() const { return cfg_.port; }
  const PdConfig& config() const { return cfg_; }

  // Producer (engine thread): the request's pages are held; returns the response's params.
  KvTransferParams hold(uint64_t request_id, const std::vector<int32_t>& pages);
  // Consumer (engine thread): read `remote`'s pages into `local_pages`: the request's block table
  // (one page per block_size prompt tokens) from block `first_block` on (the blocks before it
  // are a local prefix-cache hit), so local page i takes the remote page of block first_block + i.
  void start_load(uint64_t request_id, std::vector<int32_t> local_pages, KvTransferParams remote,
                  int first_block = 0);

  struct Events {
    std::vector<uint64_t> released;  // held pages that may be freed (read, or expired)
    std::vector<std::pair<uint64_t, bool>> loaded;  // (request, KV read in)
  };
  Events take_events();
  bool has_events() const;
  PdStats stats() const;

  // Stops the threads; in-flight READs are released (cancelled) first.
  void shutdown();

  // The notification a consumer sends after reading request `remote_request_id`'s pages, and
  // its parse (nullopt: not ours).
  static std::string read_notification(const std::string& remote_request_id);
  static std::optional<uint64_t> parse_read_notification(const std::string& msg);

 private:
  PdConnector() = default;
  struct Remote;  // a producer we read from
  struct Load;    // one request's read
  struct Fetch;   // a peer's metadata being fetched (consumer_loop)
  void producer_loop();
  void consumer_loop();
  // Fetches (or finds) the peer's metadata; "" on success, else why not.
  std::string connect_remote(const KvTransferParams& p, std::shared_ptr<Remote>* out);
  // connect_remote's halves: the side-channel exchange (any thread; touches no mutable state)
  // and the check + NIXL registration of its answer (the consumer thread).
  std::string fetch_metadata(const KvTransferParams& p, std::string* head, std::string* md) const;
  std::string install_remote(const KvTransferParams& p, const std::string& head,
                             const std::string& md, std::shared_ptr<Remote>* out);
  void begin(Load& load);
  void finish(Load& load, bool ok, const std::string& why);
  void push_loaded(uint64_t id, bool ok);

  PdConfig cfg_;
  std::string engine_id_;
  int block_size_ = 0;
  std::vector<runtime::KvRegion> regions_;
  std::unique_ptr<NixlAgent> agent_;
  std::string agent_metadata_;
  std::function<void()> wake_;
  std::atomic<bool> stop_{false};
  std::thread producer_thread_, consumer_thread_;
  void* zmq_ctx_ = nullptr;
  void* side_channel_ = nullptr;  // REP socket (producer)

  mutable std::mutex mu_;
  std::condition_variable cv_;
  Events events_;
  PdStats stats_;
  std::unordered_map<uint64_t, std::chrono::steady_clock::time_point> held_;  // id -> deadline
  std::deque<std::unique_ptr<Load>> queued_;
  std::unordered_map<std::string, std::shared_ptr<Remote>> remotes_;  // consumer thread only
};

}  // namespace m3::engine
