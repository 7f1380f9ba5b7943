#include "app/parallel_args.h"

#include <CLI/CLI.hpp>

#include "dist/tcp_socket.h"
#include "model/m3_model.h"
#include "runtime/forward_backend.h"

namespace m3::app {

void add_parallel_options(CLI::App* sub, ParallelArgs& a) {
  sub->add_option("--tensor-parallel-size,--tp", a.tensor_parallel_size,
                  "Ranks that split each layer (query heads, MLP/expert intermediates, "
                  "vocabulary); on the CPU they are threads of this process")
      ->capture_default_str();
  sub->add_flag("--enable-expert-parallel", a.enable_expert_parallel,
                "MoE layers: each rank owns whole experts (E / ranks) instead of a slice of "
                "every expert");
  sub->add_option("--data-parallel-size,--dp", a.data_parallel_size,
                  "Attention data-parallel ranks: each runs its own sequences with all heads, "
                  "the routed experts are split over all of them (CPU: threads; cuda: one GPU "
                  "per rank over NCCL; not combined with --tensor-parallel-size yet)")
      ->capture_default_str();
  sub->add_option("--moe-dispatch", a.moe_dispatch,
                  "How --data-parallel-size ranks with --enable-expert-parallel send tokens to "
                  "the experts: all-to-all (each token only to the ranks owning its top-k "
                  "experts; less traffic, the host reads the routing each MoE layer), "
                  "all-gather (every token to every rank; CUDA-graph friendly) or auto "
                  "(all-to-all on the CPU, all-gather on GPUs; docs/MULTI_NODE.md)")
      ->capture_default_str();
  sub->add_option("--nnodes", a.nnodes,
                  "serve: processes (nodes) the --tensor-parallel-size ranks are split over, "
                  "size / nnodes each; node 0 serves the API, the others run with --headless "
                  "(docs/MULTI_NODE.md)")
      ->capture_default_str();
  sub->add_option("--node-rank", a.node_rank, "This node's rank in [0, --nnodes)")
      ->capture_default_str();
  sub->add_option("--master-addr", a.master_addr,
                  "Address of node 0, where the nodes rendezvous (node 0 listens there)")
      ->capture_default_str();
  sub->add_option("--master-port", a.master_port, "TCP port of the rendezvous on node 0")
      ->capture_default_str();
}

namespace {
Status bad(const std::string& msg, const std::string& flag) {
  return make_error(ErrorCode::kInvalidArgument, msg, flag);
}
}  // namespace

Status validate_parallel(const ParallelArgs& a, const std::string& device, bool serve_command) {
  if (a.tensor_parallel_size < 1)
    return bad("--tensor-parallel-size must be >= 1, got " + std::to_string(a.tensor_parallel_size),
               "--tensor-parallel-size");
  if (a.data_parallel_size < 1)
    return bad("--data-parallel-size must be >= 1, got " + std::to_string(a.data_parallel_size),
               "--data-parallel-size");
  if (a.nnodes < 1)
    return bad("--nnodes must be >= 1, got " + std::to_string(a.nnodes), "--nnodes");
  if (a.node_rank < 0 || a.node_rank >= a.nnodes)
    return bad("--node-rank " + std::to_string(a.node_rank) + " is outside [0, " +
                   std::to_string(a.nnodes) + ") for --nnodes " + std::to_string(a.nnodes),
               "--node-rank");
  if (a.master_port < 1 || a.master_port > 65535)
    return bad("--master-port " + std::to_string(a.master_port) + " is not a TCP port (1-65535)",
               "--master-port");
  if (a.master_addr.empty())
    return bad("--master-addr is empty; give node 0's host name or IP address", "--master-addr");
  if (a.data_parallel_size > 1 && a.tensor_parallel_size > 1)
    return make_error(ErrorCode::kUnsupported,
                      "--data-parallel-size " + std::to_string(a.data_parallel_size) +
                          " together with --tensor-parallel-size " +
                          std::to_string(a.tensor_parallel_size) +
                          " is not implemented yet; use one of them (docs/MULTI_NODE.md)",
                      "--data-parallel-size");
  auto dispatch = model::parse_moe_dispatch(a.moe_dispatch);
  if (!dispatch) return tl::unexpected(dispatch.error());
  if (*dispatch == model::MoeDispatch::kAllToAll &&
      !(a.data_parallel_size > 1 && a.enable_expert_parallel))
    return bad(
        "--moe-dispatch all-to-all needs --data-parallel-size > 1 with --enable-expert-parallel "
        "(tensor-parallel ranks all see every token, and sliced experts need every row on every "
        "rank); drop --moe-dispatch or add those flags",
        "--moe-dispatch");
  if (a.headless && a.nnodes == 1)
    return bad(
        "--headless is for nodes 1 .. N-1 of a group of --nnodes N > 1 (no API server); "
        "drop it, or give --nnodes and --node-rank (docs/MULTI_NODE.md)",
        "--headless");
  if (a.nnodes > 1) {
    const std::string n = std::to_string(a.nnodes);
    if (!serve_command)
      return make_error(ErrorCode::kUnsupported,
                        "--nnodes " + n +
                            " works with `m3serve serve` only (node 0 serves, the others run "
                            "--headless); run this command on one node (docs/MULTI_NODE.md)",
                        "--nnodes");
    if (a.data_parallel_size > 1)
      return make_error(ErrorCode::kUnsupported,
                        "--data-parallel-size over several nodes (--nnodes " + n +
                            ") is refused: m3serve splits a model over nodes by tensor "
                            "parallelism only; split it with --tensor-parallel-size over the "
                            "nodes, or run one data-parallel server per node (docs/MULTI_NODE.md)",
                        "--data-parallel-size");
    if (a.tensor_parallel_size < a.nnodes || a.tensor_parallel_size % a.nnodes != 0)
      return bad("--tensor-parallel-size " + std::to_string(a.tensor_parallel_size) +
                     " does not split evenly over --nnodes " + n +
                     " (each node holds size / nnodes ranks, as vLLM splits them): use a "
                     "multiple of " +
                     n,
                 "--tensor-parallel-size");
    if (a.node_rank == 0 && a.headless)
      return bad(
          "--headless on --node-rank 0: node 0 runs the API server, scheduler and engine; "
          "drop --headless there and give it to the other nodes",
          "--headless");
    if (a.node_rank > 0 && !a.headless)
      return bad("--node-rank " + std::to_string(a.node_rank) +
                     " runs no API server: add --headless (node 0 serves; docs/MULTI_NODE.md)",
                 "--headless");
  }
  // --device cuda --tensor-parallel-size N or --data-parallel-size N: one GPU per rank over
  // NCCL (app/device_backend.cpp checks the GPU count), with or without --enable-expert-parallel.
  (void)device;
  return {};
}

runtime::MultiNodeSpec multi_node_spec(const ParallelArgs& a) {
  runtime::MultiNodeSpec s;
  s.nnodes = a.nnodes;
  s.node_rank = a.node_rank;
  s.master_addr = a.master_addr;
  s.master_port = a.master_port;
  s.timeout_s = dist::dist_timeout_s();
  return s;
}

engine::BackendFactory wrap_backend_factory(const ParallelArgs& a,
                                            engine::BackendFactory device_factory,
                                            bool dp_kv_partitions) {
  if (!wants_sharding(a)) return device_factory;
  const int tp = a.tensor_parallel_size, dp = a.data_parallel_size;
  const bool ep = a.enable_expert_parallel;
  // validate_parallel checked the value.
  const model::MoeDispatch dispatch =
      model::parse_moe_dispatch(a.moe_dispatch).value_or(model::MoeDispatch::kAuto);
  if (a.nnodes > 1) {
    // Node 0 of a group over processes (validate_parallel: serve, TP only, even split).
    const runtime::MultiNodeSpec nodes = multi_node_spec(a);
    return engine::BackendFactory(
        [tp, ep, nodes](std::unique_ptr<model::M3Model> host,
                        int64_t cpu_num_pages) -> Result<std::unique_ptr<runtime::ForwardBackend>> {
          return runtime::make_cpu_multi_node_backend(std::move(host), cpu_num_pages, tp, ep,
                                                      nodes);
        });
  }
  return engine::BackendFactory(
      [tp, ep, dp, dp_kv_partitions, dispatch](
          std::unique_ptr<model::M3Model> host,
          int64_t cpu_num_pages) -> Result<std::unique_ptr<runtime::ForwardBackend>> {
        // Serving: the scheduler hands out pages, so DP ranks get a page partition each.
        return runtime::make_cpu_sharded_backend(std::move(host), cpu_num_pages, tp, ep, dp,
                                                 dp_kv_partitions, dispatch);
      });
}

}  // namespace m3::app
