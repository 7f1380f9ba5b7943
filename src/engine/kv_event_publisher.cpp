#include "engine/kv_event_publisher.h"

#include <msgpack.hpp>
#include <zmq.hpp>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>
#include <utility>

#include "core/log.h"

namespace m3::engine {

namespace {

using Packer = msgpack::packer<msgpack::sbuffer>;

void pack_str(Packer& pk, const char* s) {
  const size_t n = std::strlen(s);
  pk.pack_str(static_cast<uint32_t>(n));
  pk.pack_str_body(s, static_cast<uint32_t>(n));
}

void pack_hashes(Packer& pk, const std::vector<sched::BlockHash>& hashes) {
  pk.pack_array(static_cast<uint32_t>(hashes.size()));
  for (sched::BlockHash h : hashes) pk.pack_uint64(h);
}

std::string seq_bytes(int64_t seq) {
  std::string b(8, '\0');
  const uint64_t u = static_cast<uint64_t>(seq);
  for (int i = 0; i < 8; ++i) b[i] = static_cast<char>((u >> (56 - 8 * i)) & 0xff);
  return b;
}

bool binds(const std::string& endpoint) {
  return endpoint.find('*') != std::string::npos || endpoint.find("::") != std::string::npos ||
         endpoint.rfind("ipc://", 0) == 0 || endpoint.rfind("inproc://", 0) == 0;
}

}  // namespace

std::string offset_endpoint_port(const std::string& endpoint, int data_parallel_rank) {
  if (endpoint.empty() || data_parallel_rank == 0) return endpoint;
  if (endpoint.find("inproc") != std::string::npos)
    return endpoint + "_dp" + std::to_string(data_parallel_rank);
  const size_t colon = endpoint.rfind(':');
  if (endpoint.rfind("tcp://", 0) != 0 || colon == std::string::npos || colon < 6) return endpoint;
  const std::string port = endpoint.substr(colon + 1);
  if (port.empty() || port.find_first_not_of("0123456789") != std::string::npos) return endpoint;
  const long base = std::stol(port);
  if (base == 0) return endpoint;
  return endpoint.substr(0, colon + 1) + std::to_string(base + data_parallel_rank);
}

std::string encode_kv_event_batch(double ts, const std::vector<sched::KvCacheEvent>& events,
                                  int data_parallel_rank) {
  msgpack::sbuffer buf;
  Packer pk(&buf);
  pk.pack_array(3);
  pk.pack_double(ts);
  pk.pack_array(static_cast<uint32_t>(events.size()));
  for (const sched::KvCacheEvent& e : events) {
    switch (e.kind) {
      case sched::KvCacheEvent::Kind::kStored:
        pk.pack_map(9);
        pack_str(pk, "type");
        pack_str(pk, "BlockStored");
        pack_str(pk, "block_hashes");
        pack_hashes(pk, e.block_hashes);
        pack_str(pk, "parent_block_hash");
        if (e.parent_block_hash)
          pk.pack_uint64(*e.parent_block_hash);
        else
          pk.pack_nil();
        pack_str(pk, "token_ids");
        pk.pack_array(static_cast<uint32_t>(e.token_ids.size()));
        for (int32_t t : e.token_ids) pk.pack_int32(t);
        pack_str(pk, "block_size");
        pk.pack_int32(e.block_size);
        pack_str(pk, "lora_id");
        pk.pack_nil();
        pack_str(pk, "medium");
        pack_str(pk, sched::kv_medium_name(e.medium));
        pack_str(pk, "lora_name");
        pk.pack_nil();
        pack_str(pk, "group_idx");  // one KV cache group: K, V and index-K pages move together
        pk.pack_int32(0);
        break;
      case sched::KvCacheEvent::Kind::kRemoved:
        pk.pack_map(4);
        pack_str(pk, "type");
        pack_str(pk, "BlockRemoved");
        pack_str(pk, "block_hashes");
        pack_hashes(pk, e.block_hashes);
        pack_str(pk, "medium");
        pack_str(pk, sched::kv_medium_name(e.medium));
        pack_str(pk, "group_idx");
        pk.pack_int32(0);
        break;
      case sched::KvCacheEvent::Kind::kAllCleared:
        pk.pack_map(1);
        pack_str(pk, "type");
        pack_str(pk, "AllBlocksCleared");
        break;
    }
  }
  pk.pack_int32(data_parallel_rank);
  return std::string(buf.data(), buf.size());
}

struct KvEventPublisher::Impl {
  KvEventsConfig cfg;
  int rank = 0;
  int block_size = 0;
  std::string endpoint;
  std::string replay_endpoint;
  zmq::context_t ctx{1};
  zmq::socket_t pub;
  zmq::socket_t replay;  // invalid when there is no replay endpoint
  std::thread thread;

  std::mutex mu;
  std::condition_variable cv;
  struct Pending {
    int64_t seq;
    double ts;
    std::vector<sched::KvCacheEvent> events;
  };
  std::deque<Pending> queue;
  bool stopping = false;
  int64_t next_seq = 0;  // a dropped batch keeps its number, so readers see the gap
  std::atomic<int64_t> published{0};
  std::atomic<int64_t> dropped{0};

  // Publisher thread only.
  std::deque<std::pair<int64_t, std::string>> buffer;  // (seq, payload), oldest first

  void run();
  void send_batch(Pending p);
  void service_replay();
};

void KvEventPublisher::Impl::send_batch(Pending p) {
  std::string payload = encode_kv_event_batch(p.ts, p.events, rank);
  const int64_t seq = p.seq;
  try {
    pub.send(zmq::buffer(cfg.topic), zmq::send_flags::sndmore);
    pub.send(zmq::buffer(seq_bytes(seq)), zmq::send_flags::sndmore);
    pub.send(zmq::buffer(payload), zmq::send_flags::none);
  } catch (const zmq::error_t& e) {
    M3_LOG_WARN("kv events: sending batch %lld failed: %s", static_cast<long long>(seq), e.what());
  }
  ++published;
  if (replay) {
    buffer.emplace_back(seq, std::move(payload));
    while (static_cast<int64_t>(buffer.size()) > cfg.buffer_steps) buffer.pop_front();
  }
}

void KvEventPublisher::Impl::service_replay() {
  std::vector<zmq::message_t> frames;
  while (true) {
    zmq::message_t m;
    if (!replay.recv(m, zmq::recv_flags::dontwait)) break;
    const bool more = m.more();
    frames.push_back(std::move(m));
    if (!more) break;
  }
  if (frames.empty()) return;
  // [identity, "", start_seq]: what a REQ (or a DEALER sending an empty delimiter) asks.
  if (frames.size() != 3 || frames[2].size() != 8) {
    M3_LOG_WARN(
        "kv events: ignored a replay request of %zu frames (expected [identity, '', "
        "8-byte start seq])",
        frames.size());
    return;
  }
  uint64_t start = 0;
  const auto* b = static_cast<const unsigned char*>(frames[2].data());
  for (int i = 0; i < 8; ++i) start = (start << 8) | b[i];
  const int64_t start_seq = static_cast<int64_t>(start);
  const std::string identity(static_cast<const char*>(frames[0].data()), frames[0].size());
  auto send_reply = [&](const std::string& topic, const std::string& seq, const std::string& pl) {
    replay.send(zmq::buffer(identity), zmq::send_flags::sndmore);
    replay.send(zmq::const_buffer(nullptr, 0), zmq::send_flags::sndmore);
    replay.send(zmq::buffer(topic), zmq::send_flags::sndmore);
    replay.send(zmq::buffer(seq), zmq::send_flags::sndmore);
    replay.send(zmq::buffer(pl), zmq::send_flags::none);
  };
  try {
    for (const auto& [seq, payload] : buffer)
      if (seq >= start_seq) send_reply(cfg.topic, seq_bytes(seq), payload);
    send_reply("", seq_bytes(-1), "");
  } catch (const zmq::error_t& e) {
    M3_LOG_WARN("kv events: replay from %lld failed: %s", static_cast<long long>(start_seq),
                e.what());
  }
}

void KvEventPublisher::Impl::run() {
  for (;;) {
    std::deque<Pending> batch;
    bool stop = false;
    {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait_for(lock, std::chrono::milliseconds(10), [&] { return !queue.empty() || stopping; });
      batch.swap(queue);
      stop = stopping;
    }
    for (Pending& p : batch) send_batch(std::move(p));
    if (replay) {
      zmq::pollitem_t item{replay.handle(), 0, ZMQ_POLLIN, 0};
      try {
        while (zmq::poll(&item, 1, std::chrono::milliseconds(0)) > 0 && (item.revents & ZMQ_POLLIN))
          service_replay();
      } catch (const zmq::error_t& e) {
        M3_LOG_WARN("kv events: replay socket: %s", e.what());
      }
    }
    if (stop) {
      std::lock_guard<std::mutex> lock(mu);
      if (queue.empty()) return;
    }
  }
}

Result<std::unique_ptr<KvEventPublisher>> KvEventPublisher::create(const KvEventsConfig& config,
                                                                   int data_parallel_rank,
                                                                   int block_size) {
  auto impl = std::make_unique<Impl>();
  impl->cfg = config;
  impl->rank = data_parallel_rank;
  impl->block_size = block_size;
  const std::string endpoint = offset_endpoint_port(config.endpoint, data_parallel_rank);
  const std::string replay_endpoint =
      offset_endpoint_port(config.replay_endpoint, data_parallel_rank);
  auto fail = [&](const std::string& key, const std::string& ep, const zmq::error_t& e, bool bind) {
    std::string fix = e.num() == EADDRINUSE
                          ? "another process holds it: give a free port (e.g. \"" + key +
                                "\": \"tcp://*:0\" lets the system pick one) or stop that process"
                          : "give an address like tcp://*:5557 (bound on every interface), "
                            "tcp://HOST:PORT (connected, to a ZeroMQ proxy) or ipc:///PATH";
    return make_error(ErrorCode::kInvalidArgument,
                      "--kv-events-config " + key + " '" + ep + "' cannot be " +
                          (bind ? "bound" : "connected") + ": " + e.what() + "; " + fix,
                      "--kv-events-config");
  };
  try {
    impl->pub = zmq::socket_t(impl->ctx, zmq::socket_type::pub);
    impl->pub.set(zmq::sockopt::sndhwm, config.hwm);
    impl->pub.set(zmq::sockopt::linger, 500);
  } catch (const zmq::error_t& e) {
    return make_error(ErrorCode::kInternal, std::string("kv events: ZeroMQ: ") + e.what());
  }
  const bool bind = binds(endpoint);
  try {
    if (bind) {
      impl->pub.bind(endpoint);
      impl->endpoint = impl->pub.get(zmq::sockopt::last_endpoint);
    } else {
      impl->pub.connect(endpoint);
      impl->endpoint = endpoint;
    }
  } catch (const zmq::error_t& e) {
    return fail("endpoint", endpoint, e, bind);
  }
  if (!replay_endpoint.empty()) {
    try {
      impl->replay = zmq::socket_t(impl->ctx, zmq::socket_type::router);
      // A full replay plus its end marker must fit even when the reader acks late (vLLM's 2x).
      impl->replay.set(zmq::sockopt::sndhwm, 2 * (config.buffer_steps + 1));
      impl->replay.set(zmq::sockopt::linger, 0);
      impl->replay.bind(replay_endpoint);
      impl->replay_endpoint = impl->replay.get(zmq::sockopt::last_endpoint);
    } catch (const zmq::error_t& e) {
      return fail("replay_endpoint", replay_endpoint, e, true);
    }
  }
  Impl* raw = impl.get();
  impl->thread = std::thread([raw] { raw->run(); });
  return std::unique_ptr<KvEventPublisher>(new KvEventPublisher(std::move(impl)));
}

KvEventPublisher::KvEventPublisher(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

KvEventPublisher::~KvEventPublisher() {
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->stopping = true;
  }
  impl_->cv.notify_all();
  if (impl_->thread.joinable()) impl_->thread.join();
  impl_->replay.close();
  impl_->pub.close();  // lingers up to 500 ms for subscribers still reading
}

void KvEventPublisher::publish(std::vector<sched::KvCacheEvent> events) {
  if (events.empty()) return;
  const double ts =
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    const int64_t seq = impl_->next_seq++;
    if (static_cast<int>(impl_->queue.size()) >= impl_->cfg.max_queue_size) {
      if (impl_->dropped++ == 0)
        M3_LOG_WARN(
            "kv events: %d batches are waiting to be sent (max_queue_size); dropping new "
            "ones: subscribers will see a gap in the sequence numbers",
            impl_->cfg.max_queue_size);
      return;
    }
    impl_->queue.push_back({seq, ts, std::move(events)});
  }
  impl_->cv.notify_one();
}

const std::string& KvEventPublisher::endpoint() const {
  return impl_->endpoint;
}

const std::string& KvEventPublisher::replay_endpoint() const {
  return impl_->replay_endpoint;
}

int64_t KvEventPublisher::num_batches_published() const {
  return impl_->published;
}

int64_t KvEventPublisher::num_batches_dropped() const {
  return impl_->dropped;
}

}  // namespace m3::engine
