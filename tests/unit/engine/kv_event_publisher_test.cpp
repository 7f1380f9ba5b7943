// KvEventPublisher: the msgpack batch is vLLM's KVEventBatch shape (array [ts, events, rank],
// events as maps tagged by "type"), batches arrive as [topic, seq, payload] on the PUB socket,
// the replay socket returns buffered batches from a sequence number and then the end marker, a
// busy endpoint is refused naming it, and data-parallel ranks offset the port as vLLM does.
#include "engine/kv_event_publisher.h"

#include <msgpack.hpp>
#include <zmq.hpp>

#include <chrono>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

namespace m3::engine {
namespace {

sched::KvCacheEvent stored(std::vector<sched::BlockHash> hashes,
                           std::optional<sched::BlockHash> parent, int block_size) {
  sched::KvCacheEvent e;
  e.kind = sched::KvCacheEvent::Kind::kStored;
  e.block_hashes = std::move(hashes);
  e.parent_block_hash = parent;
  e.block_size = block_size;
  for (size_t i = 0; i < e.block_hashes.size() * static_cast<size_t>(block_size); ++i)
    e.token_ids.push_back(static_cast<int32_t>(100 + i));
  return e;
}

std::map<std::string, msgpack::object> as_map(const msgpack::object& o) {
  std::map<std::string, msgpack::object> m;
  EXPECT_EQ(o.type, msgpack::type::MAP);
  for (uint32_t i = 0; i < o.via.map.size; ++i)
    m[o.via.map.ptr[i].key.as<std::string>()] = o.via.map.ptr[i].val;
  return m;
}

int64_t seq_of(const zmq::message_t& m) {
  EXPECT_EQ(m.size(), 8u);
  uint64_t v = 0;
  for (size_t i = 0; i < 8; ++i) v = (v << 8) | static_cast<const unsigned char*>(m.data())[i];
  return static_cast<int64_t>(v);
}

TEST(KvEventPublisher, BatchIsVllmsShape) {
  sched::KvCacheEvent removed;
  removed.kind = sched::KvCacheEvent::Kind::kRemoved;
  removed.block_hashes = {0xfedcba9876543210ULL};
  removed.medium = sched::KvMedium::kHost;
  sched::KvCacheEvent cleared;
  cleared.kind = sched::KvCacheEvent::Kind::kAllCleared;
  const std::string payload = encode_kv_event_batch(
      1234.5, {stored({11, 12}, std::nullopt, 2), stored({13}, 12, 2), removed, cleared}, 3);
  msgpack::object_handle oh = msgpack::unpack(payload.data(), payload.size());
  const msgpack::object& batch = oh.get();
  ASSERT_EQ(batch.type, msgpack::type::ARRAY);
  ASSERT_EQ(batch.via.array.size, 3u);
  EXPECT_DOUBLE_EQ(batch.via.array.ptr[0].as<double>(), 1234.5);
  EXPECT_EQ(batch.via.array.ptr[2].as<int>(), 3);
  const msgpack::object& events = batch.via.array.ptr[1];
  ASSERT_EQ(events.via.array.size, 4u);
  auto e0 = as_map(events.via.array.ptr[0]);
  EXPECT_EQ(e0["type"].as<std::string>(), "BlockStored");
  EXPECT_EQ(e0["block_hashes"].as<std::vector<uint64_t>>(), (std::vector<uint64_t>{11, 12}));
  EXPECT_TRUE(e0["parent_block_hash"].is_nil());
  EXPECT_EQ(e0["token_ids"].as<std::vector<int>>(), (std::vector<int>{100, 101, 102, 103}));
  EXPECT_EQ(e0["block_size"].as<int>(), 2);
  EXPECT_TRUE(e0["lora_id"].is_nil());
  EXPECT_TRUE(e0["lora_name"].is_nil());
  EXPECT_EQ(e0["medium"].as<std::string>(), "GPU");
  EXPECT_EQ(e0.size(), 9u);
  auto e1 = as_map(events.via.array.ptr[1]);
  EXPECT_EQ(e1["parent_block_hash"].as<uint64_t>(), 12u);
  auto e2 = as_map(events.via.array.ptr[2]);
  EXPECT_EQ(e2["type"].as<std::string>(), "BlockRemoved");
  EXPECT_EQ(e2["block_hashes"].as<std::vector<uint64_t>>(),
            (std::vector<uint64_t>{0xfedcba9876543210ULL}));
  EXPECT_EQ(e2["medium"].as<std::string>(), "CPU");
  auto e3 = as_map(events.via.array.ptr[3]);
  EXPECT_EQ(e3["type"].as<std::string>(), "AllBlocksCleared");
  EXPECT_EQ(e3.size(), 1u);
}

TEST(KvEventPublisher, OffsetEndpointPortPerRank) {
  EXPECT_EQ(offset_endpoint_port("tcp://*:5557", 0), "tcp://*:5557");
  EXPECT_EQ(offset_endpoint_port("tcp://*:5557", 2), "tcp://*:5559");
  EXPECT_EQ(offset_endpoint_port("tcp://*:0", 2), "tcp://*:0");
  EXPECT_EQ(offset_endpoint_port("inproc://kv", 1), "inproc://kv_dp1");
}

TEST(KvEventPublisher, PublishesAndReplays) {
  KvEventsConfig cfg;
  cfg.enabled = true;
  cfg.endpoint = "tcp://127.0.0.1:*";
  cfg.replay_endpoint = "tcp://127.0.0.1:*";
  cfg.topic = "kv-events";
  auto pub = KvEventPublisher::create(cfg, 0, 2);
  ASSERT_TRUE(pub.has_value()) << pub.error().message;
  zmq::context_t ctx;
  zmq::socket_t sub(ctx, zmq::socket_type::sub);
  sub.set(zmq::sockopt::subscribe, "kv-events");
  sub.set(zmq::sockopt::rcvtimeo, 5000);
  sub.connect((*pub)->endpoint());
  // A PUB drops messages until the subscription arrives: publish until the first one lands.
  std::vector<zmq::message_t> first;
  for (int attempt = 0; attempt < 100 && first.empty(); ++attempt) {
    (*pub)->publish({stored({static_cast<uint64_t>(attempt + 1)}, std::nullopt, 2)});
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    zmq::message_t m;
    while (sub.recv(m, zmq::recv_flags::dontwait)) {
      first.push_back(std::move(m));
      if (!first.back().more()) break;
    }
  }
  ASSERT_EQ(first.size(), 3u);
  EXPECT_EQ(first[0].to_string(), "kv-events");
  const int64_t seen = seq_of(first[1]);
  // Replay from 0 returns every batch sent so far, in order, then the end marker ["", -1, ""].
  // A DEALER sends the empty delimiter a REQ would and reads the whole stream of replies.
  zmq::socket_t dealer(ctx, zmq::socket_type::dealer);
  dealer.set(zmq::sockopt::rcvtimeo, 5000);
  dealer.connect((*pub)->replay_endpoint());
  const std::string zero(8, '\0');
  dealer.send(zmq::const_buffer(nullptr, 0), zmq::send_flags::sndmore);
  dealer.send(zmq::buffer(zero), zmq::send_flags::none);
  for (int64_t want = 0;; ++want) {
    std::vector<zmq::message_t> frames;
    do {
      zmq::message_t m;
      ASSERT_TRUE(dealer.recv(m, zmq::recv_flags::none)) << "replay timed out";
      frames.push_back(std::move(m));
    } while (frames.back().more());
    ASSERT_EQ(frames.size(), 4u);  // "", topic, seq, payload
    EXPECT_EQ(frames[0].size(), 0u);
    if (seq_of(frames[2]) == -1) {
      EXPECT_EQ(frames[1].size(), 0u);
      EXPECT_EQ(frames[3].size(), 0u);
      EXPECT_EQ(want, seen + 1);
      break;
    }
    ASSERT_LE(want, seen);
    EXPECT_EQ(frames[1].to_string(), "kv-events");
    EXPECT_EQ(seq_of(frames[2]), want);
    msgpack::object_handle oh =
        msgpack::unpack(static_cast<const char*>(frames[3].data()), frames[3].size());
    auto ev = as_map(oh.get().via.array.ptr[1].via.array.ptr[0]);
    EXPECT_EQ(ev["block_hashes"].as<std::vector<uint64_t>>(),
              std::vector<uint64_t>{static_cast<uint64_t>(want + 1)});
  }
  EXPECT_GE((*pub)->num_batches_published(), seen + 1);
}

TEST(KvEventPublisher, BusyEndpointIsNamed) {
  KvEventsConfig cfg;
  cfg.enabled = true;
  cfg.endpoint = "tcp://127.0.0.1:*";
  auto first = KvEventPublisher::create(cfg, 0, 2);
  ASSERT_TRUE(first.has_value());
  cfg.endpoint = (*first)->endpoint();  // tcp://127.0.0.1:PORT, no '*': would connect
  cfg.endpoint.replace(6, 9, "*");      // tcp://*:PORT binds, and the port is taken
  auto second = KvEventPublisher::create(cfg, 0, 2);
  ASSERT_FALSE(second.has_value());
  EXPECT_NE(second.error().message.find("cannot be bound"), std::string::npos)
      << second.error().message;
  EXPECT_NE(second.error().message.find(cfg.endpoint), std::string::npos);
}

}  // namespace
}  // namespace m3::engine
