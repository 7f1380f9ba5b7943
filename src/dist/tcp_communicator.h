// TcpCommunicator: Communicator for CPU ranks in separate processes (or nodes), host memory over
// TCP (issue #22). The ranks meet through a TcpStore (dist/tcp_store.h): each listens on an
// ephemeral port of the address node 0 sees it at, publishes it, connects to every lower rank
// and accepts every higher one, so the group is a full mesh of W*(W-1)/2 connections. Used by
// the multi-node CPU backend (runtime/cpu_sharded_backend.cpp); ranks of one process may each
// hold one (they then talk over loopback like any other pair).
// Invariant: the numbers are CpuCommunicator's bit for bit: all_reduce_sum and
// reduce_scatter_sum add the ranks' buffers in rank order (0, 1, ..., W-1) on every rank, so TP
// over processes gives the tokens of TP over threads. A lost peer (closed connection, socket
// error, no progress for timeout_s) never hangs or aborts: fault() says which peer and why,
// every connection of this rank is shut (so the other ranks notice at once), and this and every
// later collective returns at once with zeros in its outputs. A mismatch in the collectives'
// sequence or sizes between ranks is a bug (M3_CHECK, as in CpuCommunicator).
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/error.h"
#include "dist/communicator.h"
#include "dist/tcp_socket.h"
#include "dist/tcp_store.h"

namespace m3::dist {

class TcpCommunicator final : public Communicator {
 public:
  // Joins group `prefix` (a store key prefix every rank of the group shares) as `rank` of
  // `world`. Blocks until the mesh is connected. Errors: a peer that does not appear within the
  // store's timeout (naming the rank), a listen/connect failure.
  static Result<std::unique_ptr<TcpCommunicator>> create(TcpStore& store, const std::string& prefix,
                                                         int rank, int world);
  // Each collective gives up on a peer that makes no progress for timeout_s (default: the
  // store's timeout).
  void set_timeout_s(double s) { timeout_s_ = s; }

  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  std::string backend_name() const override { return "cpu-tcp"; }
  std::string fault() const override;

  void all_reduce_sum(float* data, int64_t n) override;
  void all_gather(const float* send, int64_t n, float* recv) override;
  void all_gather(const int32_t* send, int64_t n, int32_t* recv) override;
  void reduce_scatter_sum(const float* send, int64_t n, float* recv) override;
  void all_to_all_v(const float* send, const int64_t* send_counts, float* recv,
                    const int64_t* recv_counts) override;
  void all_to_all_v(const int32_t* send, const int64_t* send_counts, int32_t* recv,
                    const int64_t* recv_counts) override;
  void broadcast(float* data, int64_t n, int root) override;
  void broadcast(int32_t* data, int64_t n, int root) override;
  void barrier() override;

  // One message of a collective: `bytes` to or from `peer`.
  struct Part {
    int peer = 0;
    const char* send = nullptr;  // sends
    char* recv = nullptr;        // receives
    int64_t bytes = 0;
  };

 private:
  TcpCommunicator(int rank, int world, std::vector<Socket> peers,
                  std::vector<std::string> peer_addrs, double timeout_s);
  // Moves every part of one collective (tagged `op`); false when the group is (now) broken.
  bool exchange(uint32_t op, const std::vector<Part>& sends, const std::vector<Part>& recvs);
  void fail(int peer, const std::string& why);
  bool broken() const;
  template <class T>
  void gather_impl(const T* send, int64_t n, T* recv, uint32_t op);
  template <class T>
  void a2a_impl(const T* send, const int64_t* send_counts, T* recv, const int64_t* recv_counts,
                uint32_t op);
  template <class T>
  void bcast_impl(T* data, int64_t n, int root, uint32_t op);

  int rank_;
  int world_;
  std::vector<Socket> peers_;  // [world]; peers_[rank_] unused
  std::vector<std::string> peer_addrs_;
  double timeout_s_;
  uint64_t seq_ = 0;  // collectives issued (checked against the peers' in every header)
  mutable std::mutex fault_mu_;
  std::string fault_;
  std::vector<float> scratch_;
};

}  // namespace m3::dist
