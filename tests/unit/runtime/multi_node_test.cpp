// The multi-node step format and rendezvous (runtime/multi_node.h) without a model: every field
// of a ForwardBatch survives encode_step/decode_step, a damaged step is refused, the node split
// follows vLLM (size / nnodes per node), and NodeGroup over two "nodes" (threads here) checks the
// layout, agrees on the smallest page offer, carries steps and the shutdown frame, and reports a
// node whose step connection closes.
#include <gtest/gtest.h>

#include <chrono>
#include <climits>
#include <thread>

#include "runtime/multi_node.h"

namespace m3::runtime {
namespace {

ForwardBatch sample_batch() {
  ForwardBatch b;
  b.token_ids = {5, 6, 7};
  b.positions = {0, 1, 9};
  b.seq_ids = {0, 0, 1};
  b.block_table_offsets = {0, 1, 3};
  b.block_table = {4, 8, 9};
  b.logits_indices = {1, 2};
  kernels::cpu::SampleRow r;
  r.row = 1;
  r.temperature = 0.7f;
  r.top_k = 20;
  r.seed = 123456789012345ull;
  r.step = 3;
  b.device_samples = {r};
  b.host_logits_rows = {0};
  b.num_sampleable = 2600;
  b.prev_sample_tokens = {2};
  b.prev_sample_slots = {0};
  b.embed_rows = {1};
  b.embed_values = {0.25f, -1.5f};
  b.aux_layers = {2, 5};
  b.aux_on_device = true;
  return b;
}

TEST(MultiNodeStep, EveryFieldRoundTrips) {
  const ForwardBatch b = sample_batch();
  const std::string wire = encode_step(b, /*capture_msa=*/true);
  ForwardBatch got;
  bool capture = false;
  ASSERT_TRUE(decode_step(wire, &got, &capture).has_value());
  EXPECT_TRUE(capture);
  EXPECT_EQ(got.token_ids, b.token_ids);
  EXPECT_EQ(got.positions, b.positions);
  EXPECT_EQ(got.seq_ids, b.seq_ids);
  EXPECT_EQ(got.block_table_offsets, b.block_table_offsets);
  EXPECT_EQ(got.block_table, b.block_table);
  EXPECT_EQ(got.logits_indices, b.logits_indices);
  ASSERT_EQ(got.device_samples.size(), 1u);
  EXPECT_EQ(got.device_samples[0].row, 1);
  EXPECT_EQ(got.device_samples[0].temperature, 0.7f);
  EXPECT_EQ(got.device_samples[0].top_k, 20);
  EXPECT_EQ(got.device_samples[0].seed, 123456789012345ull);
  EXPECT_EQ(got.device_samples[0].step, 3u);
  EXPECT_EQ(got.host_logits_rows, b.host_logits_rows);
  EXPECT_EQ(got.num_sampleable, 2600);
  EXPECT_EQ(got.prev_sample_tokens, b.prev_sample_tokens);
  EXPECT_EQ(got.prev_sample_slots, b.prev_sample_slots);
  EXPECT_EQ(got.embed_rows, b.embed_rows);
  EXPECT_EQ(got.embed_values, b.embed_values);
  EXPECT_EQ(got.aux_layers, b.aux_layers);
  EXPECT_TRUE(got.aux_on_device);
}

TEST(MultiNodeStep, ADamagedStepIsRefused) {
  std::string wire = encode_step(sample_batch(), false);
  ForwardBatch got;
  bool capture = false;
  EXPECT_FALSE(decode_step(wire.substr(0, wire.size() - 1), &got, &capture).has_value());
  wire.push_back('x');
  auto st = decode_step(wire, &got, &capture);
  ASSERT_FALSE(st.has_value());
  EXPECT_NE(st.error().message.find("same m3serve build"), std::string::npos);
}

TEST(MultiNodeSplit, RanksSplitEvenlyOverNodes) {
  MultiNodeSpec s;
  s.nnodes = 2;
  EXPECT_TRUE(check_node_split(2, s, "--tensor-parallel-size").has_value());
  EXPECT_TRUE(check_node_split(8, s, "--tensor-parallel-size").has_value());
  auto bad = check_node_split(3, s, "--tensor-parallel-size");
  ASSERT_FALSE(bad.has_value());
  EXPECT_NE(bad.error().message.find("--nnodes 2"), std::string::npos) << bad.error().message;
  EXPECT_FALSE(check_node_split(1, s, "--tensor-parallel-size").has_value());
}

int free_port() {
  auto l = dist::tcp_listen("127.0.0.1", 0, "test");
  return dist::bound_port(*l);  // closed on return; nothing else binds it in this test
}

TEST(NodeGroup, LayoutPagesStepsShutdownAndALostNode) {
  MultiNodeSpec s0;
  s0.nnodes = 2;
  s0.master_port = free_port();
  s0.timeout_s = 20;
  MultiNodeSpec s1 = s0;
  s1.node_rank = 1;
  std::unique_ptr<NodeGroup> g0, g1;
  std::thread t([&] {
    auto g = NodeGroup::join(s1, "layout A");
    ASSERT_TRUE(g.has_value()) << g.error().message;
    g1 = std::move(*g);
  });
  auto g = NodeGroup::join(s0, "layout A");
  ASSERT_TRUE(g.has_value()) << g.error().message;
  g0 = std::move(*g);
  t.join();
  int64_t p0 = 0, p1 = 0;
  std::thread tp([&] { p1 = *g1->agree_pages(INT64_MAX); });
  p0 = *g0->agree_pages(40);
  tp.join();
  EXPECT_EQ(p0, 40);
  EXPECT_EQ(p1, 40);
  std::thread tr([&] { ASSERT_TRUE(g1->ready().has_value()); });
  ASSERT_TRUE(g0->ready().has_value());
  tr.join();
  ASSERT_TRUE(g0->send_step("hello").has_value());
  std::string payload;
  bool shutdown = true;
  ASSERT_TRUE(g1->next_step(&payload, &shutdown).has_value());
  EXPECT_FALSE(shutdown);
  EXPECT_EQ(payload, "hello");
  g0->send_shutdown();
  ASSERT_TRUE(g1->next_step(&payload, &shutdown).has_value());
  EXPECT_TRUE(shutdown);
  EXPECT_EQ(g0->lost(), "");
  g1.reset();  // node 1 goes away: node 0's watcher notices without a step
  for (int i = 0; i < 50 && g0->lost().empty(); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_NE(g0->lost().find("node 1"), std::string::npos) << g0->lost();
  EXPECT_FALSE(g0->send_step("x").has_value());
}

TEST(NodeGroup, ADifferentLayoutIsRefusedOnBothSides) {
  MultiNodeSpec s0;
  s0.nnodes = 2;
  s0.master_port = free_port();
  s0.timeout_s = 20;
  MultiNodeSpec s1 = s0;
  s1.node_rank = 1;
  std::string err1;
  std::thread t([&] {
    auto g = NodeGroup::join(s1, "tp 2 + expert parallel");
    ASSERT_FALSE(g.has_value());
    err1 = g.error().message;
  });
  auto g = NodeGroup::join(s0, "tp 2");
  t.join();
  ASSERT_FALSE(g.has_value());
  EXPECT_NE(g.error().message.find("node 1 refused to join"), std::string::npos)
      << g.error().message;
  EXPECT_NE(g.error().message.find("[tp 2 + expert parallel]"), std::string::npos);
  EXPECT_NE(err1.find("differ from node 0's"), std::string::npos) << err1;
}

}  // namespace
}  // namespace m3::runtime
