// PdConnector (engine/pd_connector.h) without an engine: a producer and a consumer connector in
// one process, each over its own fake "pool" (host arrays shaped like KV regions), talking over
// loopback through the side channel and NIXL's UCX backend. Checks that exactly the named pages
// of every region arrive, in the right slots, that the producer is told to release them, that
// held pages expire, and that a missing or mismatched peer fails the load (no hang, one event).
// Needs NIXL (`pip install nixl-cu13`); skipped when it is not installed.
#include "engine/pd_connector.h"

#include <chrono>
#include <cstring>
#include <numeric>
#include <thread>

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>

#include <gtest/gtest.h>

namespace m3::engine {
namespace {

using namespace std::chrono_literals;

TEST(PdConnector, ReadNotificationRoundTrips) {
  for (uint64_t id : {uint64_t{0}, uint64_t{17}, UINT64_MAX}) {
    auto back =
        PdConnector::parse_read_notification(PdConnector::read_notification(std::to_string(id)));
    ASSERT_TRUE(back.has_value()) << id;
    EXPECT_EQ(*back, id);
  }
  for (const char* bad : {"", "m3pd:read:", "m3pd:read:12x", "other:12", "m3pd:read:-1",
                          "m3pd:read:18446744073709551616"}) {
    EXPECT_FALSE(PdConnector::parse_read_notification(bad).has_value()) << bad;
  }
}

// A pool of `pages` pages in `num_regions` arrays with different page sizes (as K/V/index-K).
struct FakePool {
  std::vector<std::vector<uint8_t>> arrays;
  std::vector<runtime::KvRegion> regions;
  FakePool(int pages, uint8_t salt) {
    const int64_t sizes[] = {256, 256, 64, 32};
    for (int64_t pb : sizes) {
      arrays.emplace_back(static_cast<size_t>(pb * pages));
      auto& a = arrays.back();
      for (size_t i = 0; i < a.size(); ++i) a[i] = static_cast<uint8_t>(i * 31 + salt * 7 + pb);
    }
    for (size_t r = 0; r < arrays.size(); ++r)
      regions.push_back({arrays[r].data(), sizes[r], pages});
  }
  const uint8_t* page(size_t region, int p) const {
    return arrays[region].data() + p * regions[region].page_bytes;
  }
};

struct Waker {
  std::mutex mu;
  std::condition_variable cv;
  void operator()() { cv.notify_all(); }
};

// Polls until pred() or the timeout.
template <class Pred>
bool wait_for(Pred pred, std::chrono::milliseconds timeout = 10s) {
  const auto end = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < end) {
    if (pred()) return true;
    std::this_thread::sleep_for(2ms);
  }
  return pred();
}

// A port nobody listens on: the kernel hands out a free one, which is closed again at once.
int unused_port() {
  const int s = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  int port = 0;
  if (::bind(s, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 &&
      ::getsockname(s, reinterpret_cast<sockaddr*>(&addr), &len) == 0)
    port = ntohs(addr.sin_port);
  ::close(s);
  return port;
}

class PdPair : public ::testing::Test {
 protected:
  void SetUp() override {
    PdConfig pc;
    pc.role = KvRole::kProducer;
    pc.port = 0;  // the kernel picks: parallel test processes cannot collide
    pc.host = "127.0.0.1";
    pc.abort_timeout_s =
        2;  // held pages expire (UnreadPagesExpire); long enough for a read under load
    auto p = PdConnector::create(pc, prod_pool.regions, 16, [] {});
    if (!p && p.error().message.find("pip install nixl-cu13") != std::string::npos)
      GTEST_SKIP() << p.error().message;
    ASSERT_TRUE(p.has_value()) << p.error().message;
    producer = std::move(*p);
    PdConfig cc;
    cc.role = KvRole::kConsumer;
    cc.transfer_timeout_s = 2;
    cc.side_channel_timeout_s = 1;
    auto c = PdConnector::create(cc, cons_pool.regions, 16, [] {});
    ASSERT_TRUE(c.has_value()) << c.error().message;
    consumer = std::move(*c);
  }
  FakePool prod_pool{8, 1};
  FakePool cons_pool{8, 2};
  std::unique_ptr<PdConnector> producer, consumer;
};

TEST_F(PdPair, ReadsExactlyTheNamedPagesAndReleasesThem) {
  const std::vector<int32_t> held = {5, 2, 7};
  KvTransferParams p = producer->hold(42, held);
  EXPECT_TRUE(p.do_remote_prefill);
  EXPECT_EQ(p.remote_engine_id, producer->engine_id());
  EXPECT_EQ(p.remote_request_id, "42");
  EXPECT_EQ(p.remote_block_ids, (std::vector<int64_t>{5, 2, 7}));
  FakePool before = cons_pool;  // what the pages not loaded must still hold
  consumer->start_load(9, {1, 3, 0}, p);
  PdConnector::Events ce;
  ASSERT_TRUE(wait_for([&] {
    auto e = consumer->take_events();
    ce.loaded.insert(ce.loaded.end(), e.loaded.begin(), e.loaded.end());
    return !ce.loaded.empty();
  }));
  ASSERT_EQ(ce.loaded.size(), 1u);
  EXPECT_EQ(ce.loaded[0], std::make_pair(uint64_t{9}, true));
  const int local[] = {1, 3, 0};
  for (size_t r = 0; r < cons_pool.regions.size(); ++r) {
    const size_t pb = static_cast<size_t>(cons_pool.regions[r].page_bytes);
    for (int i = 0; i < 3; ++i)
      EXPECT_EQ(std::memcmp(cons_pool.page(r, local[i]), prod_pool.page(r, held[i]), pb), 0)
          << "region " << r << " page " << local[i];
    for (int pg : {2, 4, 5, 6, 7})
      EXPECT_EQ(std::memcmp(cons_pool.page(r, pg), before.page(r, pg), pb), 0)
          << "region " << r << " untouched page " << pg;
  }
  // NIXL notifies the producer, which releases request 42 (and only it).
  std::vector<uint64_t> released;
  ASSERT_TRUE(wait_for([&] {
    auto e = producer->take_events();
    released.insert(released.end(), e.released.begin(), e.released.end());
    return !released.empty();
  }));
  EXPECT_EQ(released, std::vector<uint64_t>{42});
  EXPECT_EQ(producer->stats().num_released_read, 1);
  EXPECT_EQ(producer->stats().num_held, 0);
  EXPECT_EQ(consumer->stats().num_pages_read, 3);
}

// first_block: the consumer already holds the prompt's first blocks; only the rest are read, each
// from the producer's page of the same block.
TEST_F(PdPair, ReadsFromFirstBlockOn) {
  KvTransferParams p = producer->hold(50, {6, 4, 3});
  FakePool before = cons_pool;
  consumer->start_load(11, {5}, p, /*first_block=*/2);  // block 2 -> our page 5
  std::vector<std::pair<uint64_t, bool>> loaded;
  ASSERT_TRUE(wait_for([&] {
    auto e = consumer->take_events();
    loaded.insert(loaded.end(), e.loaded.begin(), e.loaded.end());
    return !loaded.empty();
  }));
  EXPECT_EQ(loaded, (std::vector<std::pair<uint64_t, bool>>{{11, true}}));
  for (size_t r = 0; r < cons_pool.regions.size(); ++r) {
    const size_t pb = static_cast<size_t>(cons_pool.regions[r].page_bytes);
    EXPECT_EQ(std::memcmp(cons_pool.page(r, 5), prod_pool.page(r, 3), pb), 0) << "region " << r;
    for (int pg : {0, 1, 2, 3, 4, 6, 7})
      EXPECT_EQ(std::memcmp(cons_pool.page(r, pg), before.page(r, pg), pb), 0)
          << "region " << r << " untouched page " << pg;
  }
  EXPECT_EQ(consumer->stats().num_pages_read, 1);
}

// A peer that accepts the connection but never answers holds up only its own loads: another
// peer's load queued after it completes first, while the hung fetch waits out its side-channel
// timeout (5 s here: the ordering, not a duration, is what is checked).
TEST_F(PdPair, HungPeerDoesNotDelayOtherPeers) {
  PdConfig cc;
  cc.role = KvRole::kConsumer;
  cc.transfer_timeout_s = 5;
  cc.side_channel_timeout_s = 5;
  FakePool pool{8, 3};
  auto made = PdConnector::create(cc, pool.regions, 16, [] {});
  ASSERT_TRUE(made.has_value()) << made.error().message;
  std::unique_ptr<PdConnector> patient = std::move(*made);
  const int mute = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t alen = sizeof addr;
  ASSERT_EQ(::bind(mute, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  ASSERT_EQ(::listen(mute, 4), 0);
  ASSERT_EQ(::getsockname(mute, reinterpret_cast<sockaddr*>(&addr), &alen), 0);
  KvTransferParams good = producer->hold(60, {1, 2});
  KvTransferParams hung = good;
  hung.remote_engine_id = "m3-hung";
  hung.remote_host = "127.0.0.1";
  hung.remote_port = ntohs(addr.sin_port);
  patient->start_load(21, {0, 1}, hung);
  patient->start_load(22, {2, 3}, good);
  std::vector<std::pair<uint64_t, bool>> loaded;
  ASSERT_TRUE(wait_for(
      [&] {
        auto e = patient->take_events();
        loaded.insert(loaded.end(), e.loaded.begin(), e.loaded.end());
        return loaded.size() >= 2;
      },
      20s));
  EXPECT_EQ(loaded, (std::vector<std::pair<uint64_t, bool>>{{22, true}, {21, false}}));
  for (size_t r = 0; r < pool.regions.size(); ++r) {
    const size_t pb = static_cast<size_t>(pool.regions[r].page_bytes);
    EXPECT_EQ(std::memcmp(pool.page(r, 2), prod_pool.page(r, 1), pb), 0) << "region " << r;
  }
  ::close(mute);
}

TEST_F(PdPair, UnreadPagesExpire) {
  producer->hold(1, {0});
  std::vector<uint64_t> released;
  ASSERT_TRUE(wait_for([&] {
    auto e = producer->take_events();
    released.insert(released.end(), e.released.begin(), e.released.end());
    return !released.empty();
  }));
  EXPECT_EQ(released, std::vector<uint64_t>{1});
  EXPECT_EQ(producer->stats().num_released_expired, 1);
}

TEST_F(PdPair, BadPeersFailTheLoadOnce) {
  KvTransferParams good = producer->hold(3, {0, 1});
  KvTransferParams wrong_engine = good;
  wrong_engine.remote_engine_id = "m3-someone-else";
  KvTransferParams no_peer = good;
  no_peer.remote_engine_id = "m3-gone";
  no_peer.remote_port = unused_port();  // nobody listens: refused at once
  // Something listens but never answers (a hung peer): the metadata request times out.
  const int mute = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t alen = sizeof addr;
  ASSERT_EQ(::bind(mute, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  ASSERT_EQ(::listen(mute, 4), 0);
  ASSERT_EQ(::getsockname(mute, reinterpret_cast<sockaddr*>(&addr), &alen), 0);
  KvTransferParams hung = good;
  hung.remote_engine_id = "m3-hung";
  hung.remote_host = "127.0.0.1";
  hung.remote_port = ntohs(addr.sin_port);
  KvTransferParams out_of_pool = good;
  out_of_pool.remote_block_ids = {0, 8};
  KvTransferParams too_few = good;
  too_few.remote_block_ids = {0};
  consumer->start_load(1, {0, 1}, wrong_engine);
  consumer->start_load(2, {0, 1}, no_peer);
  consumer->start_load(3, {0, 1}, out_of_pool);
  consumer->start_load(4, {0, 1}, too_few);
  consumer->start_load(5, {0, 1}, hung);
  std::vector<std::pair<uint64_t, bool>> loaded;
  ASSERT_TRUE(wait_for(
      [&] {
        auto e = consumer->take_events();
        loaded.insert(loaded.end(), e.loaded.begin(), e.loaded.end());
        return loaded.size() >= 5;
      },
      15s));
  std::sort(loaded.begin(), loaded.end());
  EXPECT_EQ(loaded, (std::vector<std::pair<uint64_t, bool>>{
                        {1, false}, {2, false}, {3, false}, {4, false}, {5, false}}));
  EXPECT_EQ(consumer->stats().num_loads_failed, 5);
  ::close(mute);
  EXPECT_EQ(consumer->stats().num_pages_read, 0);
}

TEST(PdConnector, SideChannelPortInUseIsNamed) {
  FakePool pool(2, 0);
  PdConfig pc;
  pc.role = KvRole::kProducer;
  pc.port = 0;
  auto a = PdConnector::create(pc, pool.regions, 16, [] {});
  if (!a && a.error().message.find("pip install nixl-cu13") != std::string::npos)
    GTEST_SKIP() << a.error().message;
  ASSERT_TRUE(a.has_value()) << a.error().message;
  ASSERT_GT((*a)->port(), 0);
  EXPECT_EQ((*a)->hold(1, {0}).remote_port, (*a)->port());
  pc.port = (*a)->port();
  auto b = PdConnector::create(pc, pool.regions, 16, [] {});
  ASSERT_FALSE(b.has_value());
  EXPECT_NE(b.error().message.find("set VLLM_NIXL_SIDE_CHANNEL_PORT to a free port"),
            std::string::npos)
      << b.error().message;
}

}  // namespace
}  // namespace m3::engine
