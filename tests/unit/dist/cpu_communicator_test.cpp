// CpuCommunicator: every collective for 1..4 and 8 ranks and odd sizes against values computed
// independently here, plus the determinism the sharded forward relies on (all-reduce sums in
// rank order, bitwise the same on every rank) and the NVLS environment rule of the NCCL side.
#include <gtest/gtest.h>

#include <cstdlib>
#include <mutex>
#include <numeric>
#include <vector>

#include "dist/cpu_communicator.h"
#include "dist/nccl_env.h"

namespace m3::dist {
namespace {

// A value rank r holds at index i: distinct per (rank, index), not exactly representable sums
// (so the order of a float sum matters and the determinism check has teeth).
// Tabulated once, so the ranks and the expectations read the very same floats (computing them
// twice lets the compiler contract one site into an FMA and round differently).
float val(int r, int64_t i) {
  static const std::vector<std::vector<float>> table = [] {
    std::vector<std::vector<float>> t(8, std::vector<float>(4096));
    for (int rr = 0; rr < 8; ++rr)
      for (int64_t ii = 0; ii < 4096; ++ii)
        t[rr][ii] =
            0.1f * static_cast<float>(rr + 1) + 1e-3f * static_cast<float>(ii) + 1.0f / 3.0f;
    return t;
  }();
  return table.at(r).at(i);
}

class Collectives : public ::testing::TestWithParam<int> {};

TEST_P(Collectives, AllReduceSumsInRankOrderOnEveryRank) {
  const int W = GetParam();
  for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{1001}}) {
    std::vector<std::vector<float>> got(W);
    run_cpu_ranks(W, [&](int r, Communicator& c) {
      EXPECT_EQ(c.rank(), r);
      EXPECT_EQ(c.world_size(), W);
      std::vector<float> v(n);
      for (int64_t i = 0; i < n; ++i) v[i] = val(r, i);
      c.all_reduce_sum(v.data(), n);
      got[r] = v;
    });
    for (int64_t i = 0; i < n; ++i) {
      float want = val(0, i);
      for (int r = 1; r < W; ++r) want += val(r, i);  // rank order, as documented
      for (int r = 0; r < W; ++r) ASSERT_EQ(got[r][i], want) << "rank " << r << " index " << i;
    }
  }
}

TEST_P(Collectives, AllGatherFloatAndInt) {
  const int W = GetParam();
  const int64_t n = 5;
  std::vector<std::vector<float>> gf(W);
  std::vector<std::vector<int32_t>> gi(W);
  run_cpu_ranks(W, [&](int r, Communicator& c) {
    std::vector<float> f(n);
    std::vector<int32_t> i32(n);
    for (int64_t i = 0; i < n; ++i) {
      f[i] = val(r, i);
      i32[i] = r * 100 + static_cast<int32_t>(i);
    }
    gf[r].resize(W * n);
    gi[r].resize(W * n);
    c.all_gather(f.data(), n, gf[r].data());
    c.all_gather(i32.data(), n, gi[r].data());
  });
  for (int r = 0; r < W; ++r)
    for (int s = 0; s < W; ++s)
      for (int64_t i = 0; i < n; ++i) {
        EXPECT_EQ(gf[r][s * n + i], val(s, i));
        EXPECT_EQ(gi[r][s * n + i], s * 100 + i);
      }
}

TEST_P(Collectives, ReduceScatterGivesEachRankItsSlice) {
  const int W = GetParam();
  const int64_t n = 3;
  std::vector<std::vector<float>> got(W);
  run_cpu_ranks(W, [&](int r, Communicator& c) {
    std::vector<float> send(W * n);
    for (int64_t i = 0; i < W * n; ++i) send[i] = val(r, i);
    got[r].resize(n);
    c.reduce_scatter_sum(send.data(), n, got[r].data());
  });
  for (int r = 0; r < W; ++r)
    for (int64_t i = 0; i < n; ++i) {
      float want = val(0, r * n + i);
      for (int s = 1; s < W; ++s) want += val(s, r * n + i);
      EXPECT_EQ(got[r][i], want);
    }
}

TEST_P(Collectives, AllToAllVMovesUnevenCounts) {
  const int W = GetParam();
  // Rank s sends (s + d) % 3 + (d == 0 ? 1 : 0) elements to rank d: some zero, all different.
  auto count = [](int s, int d) -> int64_t { return (s + d) % 3 + (d == 0 ? 1 : 0); };
  auto item = [](int s, int d, int64_t i) { return s * 1000 + d * 10 + static_cast<int32_t>(i); };
  std::vector<std::vector<int32_t>> got_i(W);
  std::vector<std::vector<float>> got_f(W);
  run_cpu_ranks(W, [&](int r, Communicator& c) {
    std::vector<int64_t> sc(W), rc(W);
    std::vector<int32_t> send;
    for (int d = 0; d < W; ++d) {
      sc[d] = count(r, d);
      rc[d] = count(d, r);
      for (int64_t i = 0; i < sc[d]; ++i) send.push_back(item(r, d, i));
    }
    std::vector<float> send_f(send.begin(), send.end());
    const int64_t total = std::accumulate(rc.begin(), rc.end(), int64_t{0});
    got_i[r].resize(total);
    got_f[r].resize(total);
    c.all_to_all_v(send.data(), sc.data(), got_i[r].data(), rc.data());
    c.all_to_all_v(send_f.data(), sc.data(), got_f[r].data(), rc.data());
  });
  for (int r = 0; r < W; ++r) {
    std::vector<int32_t> want;
    for (int s = 0; s < W; ++s)
      for (int64_t i = 0; i < count(s, r); ++i) want.push_back(item(s, r, i));
    EXPECT_EQ(got_i[r], want) << "rank " << r;
    ASSERT_EQ(got_f[r].size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(got_f[r][i], static_cast<float>(want[i]));
  }
}

// The shapes the all-to-all MoE dispatch produces: nobody sends anything (a step whose tokens
// all stay home, or no tokens at all), one rank sends to every rank while the others send
// nothing, and every rank sends only to itself. Empty vectors' null data() included.
TEST_P(Collectives, AllToAllVEmptyAndOneSidedSends) {
  const int W = GetParam();
  run_cpu_ranks(W, [&](int r, Communicator& c) {
    std::vector<int64_t> zero(W, 0);
    std::vector<float> none_f;
    std::vector<int32_t> none_i;
    c.all_to_all_v(none_f.data(), zero.data(), none_f.data(), zero.data());
    c.all_to_all_v(none_i.data(), zero.data(), none_i.data(), zero.data());
    // Rank W-1 sends d + 1 values to each rank d.
    std::vector<int64_t> sc(W, 0), rc(W, 0);
    std::vector<float> send;
    if (r == W - 1)
      for (int d = 0; d < W; ++d) {
        sc[d] = d + 1;
        for (int i = 0; i <= d; ++i) send.push_back(val(d, i));
      }
    rc[W - 1] = r + 1;
    std::vector<float> got(r + 1, -1.f);
    c.all_to_all_v(send.data(), sc.data(), got.data(), rc.data());
    for (int i = 0; i <= r; ++i) EXPECT_EQ(got[i], val(r, i)) << "rank " << r << " item " << i;
    // Only to itself.
    std::vector<int64_t> self(W, 0);
    self[r] = 3;
    const std::vector<int32_t> mine = {r, r + 10, r + 20};
    std::vector<int32_t> back(3, -1);
    c.all_to_all_v(mine.data(), self.data(), back.data(), self.data());
    EXPECT_EQ(back, mine) << "rank " << r;
  });
}

TEST_P(Collectives, BroadcastFromEveryRoot) {
  const int W = GetParam();
  for (int root = 0; root < W; ++root) {
    std::vector<std::vector<int32_t>> gi(W);
    std::vector<std::vector<float>> gf(W);
    run_cpu_ranks(W, [&](int r, Communicator& c) {
      gi[r] = {r, r + 1, r + 2};
      gf[r] = {val(r, 0), val(r, 1)};
      c.broadcast(gi[r].data(), 3, root);
      c.broadcast(gf[r].data(), 2, root);
      c.barrier();
    });
    for (int r = 0; r < W; ++r) {
      EXPECT_EQ(gi[r], (std::vector<int32_t>{root, root + 1, root + 2}));
      EXPECT_EQ(gf[r], (std::vector<float>{val(root, 0), val(root, 1)}));
    }
  }
}

TEST_P(Collectives, BarrierOrdersSideEffects) {
  const int W = GetParam();
  std::mutex mu;
  std::vector<int> before;
  std::vector<size_t> seen_after(W);
  run_cpu_ranks(W, [&](int r, Communicator& c) {
    {
      std::lock_guard<std::mutex> lock(mu);
      before.push_back(r);
    }
    c.barrier();
    std::lock_guard<std::mutex> lock(mu);
    seen_after[r] = before.size();
  });
  for (int r = 0; r < W; ++r) EXPECT_EQ(seen_after[r], static_cast<size_t>(W));
}

TEST_P(Collectives, ManyBackToBackCollectivesDoNotMixBuffers) {
  // Ranks reuse one buffer across iterations: a rank racing ahead into the next all-reduce must
  // not overwrite a value another rank is still reading.
  const int W = GetParam();
  std::vector<float> final_v(W);
  run_cpu_ranks(W, [&](int r, Communicator& c) {
    std::vector<float> v(33);
    for (int it = 0; it < 200; ++it) {
      for (auto& e : v) e = static_cast<float>(r + it);
      c.all_reduce_sum(v.data(), static_cast<int64_t>(v.size()));
      const float want = static_cast<float>(W * it + W * (W - 1) / 2);
      for (float e : v) ASSERT_EQ(e, want) << "iteration " << it;
    }
    final_v[r] = v[0];
  });
  for (int r = 0; r < W; ++r) EXPECT_EQ(final_v[r], final_v[0]);
}

INSTANTIATE_TEST_SUITE_P(Ranks, Collectives, ::testing::Values(1, 2, 3, 4, 8),
                         [](const auto& info) { return "w" + std::to_string(info.param); });

TEST(CpuGroup, RefusesZeroRanks) {
  auto g = CpuGroup::create(0);
  ASSERT_FALSE(g.has_value());
  EXPECT_NE(g.error().message.find("at least 1"), std::string::npos) << g.error().message;
}

TEST(NcclEnv, NvlsIsForcedOffUnlessTheUserAskedForIt) {
  unsetenv("NCCL_NVLS_ENABLE");
  ASSERT_TRUE(prepare_nccl_environment().has_value());
  ASSERT_NE(std::getenv("NCCL_NVLS_ENABLE"), nullptr);
  EXPECT_STREQ(std::getenv("NCCL_NVLS_ENABLE"), "0");
  EXPECT_TRUE(prepare_nccl_environment().has_value());  // an explicit 0 is fine
  setenv("NCCL_NVLS_ENABLE", "", 1);                    // empty means NCCL's default: must become 0
  ASSERT_TRUE(prepare_nccl_environment().has_value());
  EXPECT_STREQ(std::getenv("NCCL_NVLS_ENABLE"), "0");
  setenv("NCCL_NVLS_ENABLE", "1", 1);
  auto st = prepare_nccl_environment();
  ASSERT_FALSE(st.has_value());
  EXPECT_NE(st.error().message.find("NVLS"), std::string::npos) << st.error().message;
  EXPECT_EQ(st.error().param, "NCCL_NVLS_ENABLE");
  unsetenv("NCCL_NVLS_ENABLE");
}

}  // namespace
}  // namespace m3::dist
