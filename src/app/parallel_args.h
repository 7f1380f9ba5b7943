// The parallelism flags of `serve`, `chat` and `generate` (issue #7): --tensor-parallel-size,
// --enable-expert-parallel, --data-parallel-size and the multi-node rendezvous flags --nnodes,
// --node-rank, --master-addr, --master-port. Registers them, validates them, and wraps a device's
// backend factory so the engine gets the tensor- or data-parallel CPU backend
// (runtime::make_cpu_sharded_backend) when asked.
// Invariant: what m3serve does not run (data and tensor parallel together, data parallel over
// nodes, several nodes outside `serve`) is refused here with one line, before the weights are
// read. --device cuda --tensor-parallel-size N and --data-parallel-size N are wired in
// app/device_backend.cpp; --nnodes M (tensor parallel over M processes, runtime/multi_node.h) for
// both devices there and in wrap_backend_factory.
#pragma once

#include <cstdint>
#include <string>

#include "core/error.h"
#include "engine/engine.h"
#include "runtime/multi_node.h"

namespace CLI {
class App;
}

namespace m3::app {

struct ParallelArgs {
  int tensor_parallel_size = 1;
  bool enable_expert_parallel = false;
  int data_parallel_size = 1;
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  bool headless = false;  // serve --headless: a node R > 0 without the API server
  // --moe-dispatch (model::MoeDispatch): auto, all-gather or all-to-all.
  std::string moe_dispatch = "auto";
};

void add_parallel_options(CLI::App* sub, ParallelArgs& a);

// Errors (one line each, naming the flag): sizes < 1, --node-rank outside [0, --nnodes), a port
// outside [1, 65535], an empty --master-addr, DP and TP both > 1 (on any `device`), and with
// --nnodes > 1: a command other than serve (`serve_command` false), --data-parallel-size > 1, a
// --tensor-parallel-size that does not split evenly over the nodes, --headless on node 0 or a
// node R > 0 without it (the messages point at docs/MULTI_NODE.md), an unknown --moe-dispatch
// and --moe-dispatch all-to-all without --data-parallel-size > 1 and --enable-expert-parallel.
Status validate_parallel(const ParallelArgs& a, const std::string& device,
                         bool serve_command = false);

// The multi-node spec of these flags (runtime/multi_node.h; the timeout from M3_DIST_TIMEOUT_S).
runtime::MultiNodeSpec multi_node_spec(const ParallelArgs& a);

// True when the flags ask for more than one rank.
inline bool wants_sharding(const ParallelArgs& a) {
  return a.tensor_parallel_size > 1 || a.data_parallel_size > 1;
}

// For --device cpu with --tensor-parallel-size or --data-parallel-size > 1: the sharded CPU
// backend (the engine's CPU page count, rank threads over a CPU communicator). Otherwise returns
// `device_factory` unchanged. dp_kv_partitions: data-parallel ranks get one page-id partition
// each (the engine's scheduler); off for drivers with one page-id space. Call after
// validate_parallel.
engine::BackendFactory wrap_backend_factory(const ParallelArgs& a,
                                            engine::BackendFactory device_factory,
                                            bool dp_kv_partitions = true);

}  // namespace m3::app
