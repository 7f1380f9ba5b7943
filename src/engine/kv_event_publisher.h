// KvEventPublisher: vLLM's KV event stream over ZeroMQ (`--kv-events-config`), so KV-aware
// routers (vllm-router's kv_aware policy, Dynamo's KV router) see which prefixes this engine
// holds. The engine thread hands each step's sched::KvCacheEvents to publish(); one thread per
// publisher encodes them as vLLM's msgpack KVEventBatch and sends the multipart message
// [topic, seq (8 bytes big-endian), payload] on a PUB socket, keeps the last buffer_steps
// payloads, and answers replay requests on a ROUTER socket: a request [start_seq (8 bytes
// big-endian)] gets [topic, seq, payload] for every buffered batch with seq >= start_seq, then
// the end marker ["", -1 (8 bytes), ""]. Invariants: seq counts 0, 1, 2, ... in publish order;
// sockets are only touched by the publisher thread after create() returns.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/error.h"
#include "sched/kv_event.h"

namespace m3::engine {

// vLLM's KVEventsConfig (vllm/config/kv_events.py), the keys m3serve reads.
struct KvEventsConfig {
  bool enabled = false;  // enable_kv_cache_events with publisher "zmq"
  // PUB socket: bound when it has '*', '::' or is ipc:// / inproc:// (vLLM's rule), else
  // connected (to an XSUB proxy). Data-parallel rank r uses the tcp port + r.
  std::string endpoint = "tcp://*:5557";
  std::string replay_endpoint;  // ROUTER socket, always bound; "" none
  std::string topic;
  int buffer_steps = 10000;     // batches kept for replay
  int hwm = 100000;             // PUB send high-water mark
  int max_queue_size = 100000;  // batches waiting for the publisher thread; more are dropped
};

// vLLM's offset_endpoint_port: tcp ports move up by the rank (port 0 stays 0), inproc names get
// "_dp<rank>"; rank 0 is unchanged.
std::string offset_endpoint_port(const std::string& endpoint, int data_parallel_rank);

// One batch as vLLM's msgspec encodes KVEventBatch: the array [ts, events, data_parallel_rank];
// each event a map tagged {"type": "BlockStored" | "BlockRemoved" | "AllBlocksCleared", ...}
// with BlockStored's block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
// lora_name, group_idx and BlockRemoved's block_hashes, medium, group_idx. Hashes are unsigned
// 64-bit integers (vLLM's VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES default).
std::string encode_kv_event_batch(double ts, const std::vector<sched::KvCacheEvent>& events,
                                  int data_parallel_rank);

class KvEventPublisher {
 public:
  // Opens and binds (or connects) the sockets now, so a bad or busy endpoint is an error naming
  // it and the fix, then starts the thread.
  static Result<std::unique_ptr<KvEventPublisher>> create(const KvEventsConfig& config,
                                                          int data_parallel_rank, int block_size);
  ~KvEventPublisher();  // sends what is queued (up to ~1 s), then closes the sockets

  // Queues one batch (engine thread; never blocks on the network). Empty lists are not sent.
  void publish(std::vector<sched::KvCacheEvent> events);

  // The endpoints as bound (a `tcp://*:0` shows the port the system picked).
  const std::string& endpoint() const;
  const std::string& replay_endpoint() const;
  int64_t num_batches_published() const;
  int64_t num_batches_dropped() const;

  struct Impl;

 private:
  explicit KvEventPublisher(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace m3::engine
