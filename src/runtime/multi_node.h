// Ranks in separate processes, one process per node (issue #22; vLLM's --nnodes, --node-rank,
// --master-addr, --master-port, --headless). The world of W = --tensor-parallel-size ranks is
// split over the nodes as vLLM does: W / nnodes consecutive ranks per node, node R holding ranks
// [R * W / nnodes, (R + 1) * W / nnodes) as threads. Node 0 runs the API server, scheduler and
// engine; its backend (make_leader_backend) sends every step's batch to the other nodes before
// its own ranks run it. Nodes R > 0 (--headless) run run_headless(): receive each step, run
// their ranks' shards of the forward (the collectives meet those of node 0's ranks), drop the
// results, until node 0 shuts down. The device-specific parts (the ranks and their
// communicators: TCP on the CPU, NCCL on GPUs) are in cpu_sharded_backend.cpp and
// cuda/cuda_shard_backend.cpp; this file holds what they share: the rendezvous (TcpStore), the
// layout check, the KV page agreement and the step channel.
// Invariant: node 0 never hangs on a lost node and never aborts for one: a closed step channel
// or a broken collective becomes ForwardBackend::fault(), which the engine turns into errors for
// its requests; a headless node whose node 0 goes away exits (cleanly after a shutdown frame,
// with an error otherwise).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "dist/tcp_socket.h"
#include "dist/tcp_store.h"
#include "runtime/forward_backend.h"

namespace m3::runtime {

struct MultiNodeSpec {
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  double timeout_s = 600.0;  // start-up waits and collectives (M3_DIST_TIMEOUT_S)
  bool active() const { return nnodes > 1; }
};

// Ok when `world` ranks split evenly over spec.nnodes; else an error naming the flags.
Status check_node_split(int world, const MultiNodeSpec& spec, const std::string& flag);

// A step's batch on the wire (every field of ForwardBatch, and capture_msa).
std::string encode_step(const ForwardBatch& batch, bool capture_msa);
Status decode_step(const std::string& bytes, ForwardBatch* batch, bool* capture_msa);

// The group's meeting: the store (node 0 serves it), the layout every node must share, the step
// channel (node 0 accepts one connection per other node), and the KV pages all agree on.
class NodeGroup {
 public:
  // Connects (node 0: serves the store and the step channel) and checks `layout` (a one-line
  // description of the model and the parallel flags) against node 0's. Errors: the store's, a
  // layout that differs (naming both), a node that does not join before the timeout.
  static Result<std::unique_ptr<NodeGroup>> join(const MultiNodeSpec& spec,
                                                 const std::string& layout);
  ~NodeGroup();

  const MultiNodeSpec& spec() const { return spec_; }
  dist::TcpStore& store() { return *store_; }
  // Every node offers the pages it can hold; all get the smallest offer (node 0 included).
  Result<int64_t> agree_pages(int64_t offered);
  // Node 0: every other node's step connection (after join()). Ends with barrier "ready".
  Status ready();

  // Node 0: sends one step (or the shutdown frame) to every other node. Errors: a node that
  // cannot be reached (its connection is closed: the node is lost).
  Status send_step(const std::string& payload);
  void send_shutdown();
  // Node 0: "" while every node's step connection is open; else which node went away (watched
  // by a thread, so a node lost while the server is idle is noticed without a step).
  std::string lost() const;

  // Nodes > 0: the next step; *shutdown when node 0 said goodbye. Waits without a deadline
  // (the server may be idle for hours) but returns an error when node 0's connection closes.
  Status next_step(std::string* payload, bool* shutdown);

 private:
  NodeGroup() = default;
  void watch();
  void set_lost(const std::string& why);

  MultiNodeSpec spec_;
  std::unique_ptr<dist::TcpStore> store_;
  std::vector<dist::Socket> followers_;  // node 0: [nnodes], index 0 unused
  std::vector<std::string> follower_names_;
  dist::Socket leader_;  // nodes > 0
  mutable std::mutex mu_;
  std::string lost_;
  std::atomic<bool> stop_{false};
  std::thread watcher_;
};

// Node 0's backend: `local` runs node 0's ranks; every forward first sends the step to the other
// nodes. fault(): the group's lost() or the local ranks' fault(). The destructor sends the
// shutdown frame before the local ranks are released.
std::unique_ptr<ForwardBackend> make_leader_backend(std::unique_ptr<ForwardBackend> local,
                                                    std::unique_ptr<NodeGroup> group);

// A node R > 0: runs each step node 0 sends on `local` (its ranks) until the shutdown frame
// (ok) or a lost node 0 / broken group (the error says which).
Status run_headless(ForwardBackend& local, NodeGroup& group);

}  // namespace m3::runtime
