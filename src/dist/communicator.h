// Communicator: the collectives the sharded forward needs (tensor / expert / attention-data
// parallelism), for one rank of a group of world_size() ranks. Implementations: CpuCommunicator
// (ranks are threads of one process, host memory; the CPU sharded forward and its tests),
// TcpCommunicator (ranks in separate processes or nodes, host memory over TCP) and
// NcclCommunicator (one GPU per rank, device memory, ordered on the communicator's CUDA stream).
// Invariant: every rank of a group calls the same collectives in the same order with the same
// sizes; a mismatch is a bug (the CPU one checks what it can with M3_CHECK). Buffers are host
// pointers for the CPU communicator and device pointers for NCCL; counts are elements.
#pragma once

#include <cstdint>
#include <string>

namespace m3::dist {

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  // For logs: "cpu-threads" or "nccl".
  virtual std::string backend_name() const = 0;

  // data[i] = sum over ranks of data[i], in place. Every rank gets bitwise the same result.
  virtual void all_reduce_sum(float* data, int64_t n) = 0;
  // recv[r * n .. (r+1) * n) = rank r's send[0 .. n). recv holds world_size() * n elements.
  virtual void all_gather(const float* send, int64_t n, float* recv) = 0;
  virtual void all_gather(const int32_t* send, int64_t n, int32_t* recv) = 0;
  // send holds world_size() * n elements; recv[0 .. n) = sum over ranks of their send[rank*n ..).
  virtual void reduce_scatter_sum(const float* send, int64_t n, float* recv) = 0;
  // Variable all-to-all: rank r sends send[soff[d] .. soff[d] + send_counts[d]) to rank d, where
  // soff is the exclusive prefix sum of send_counts; what rank s sent to r lands at
  // recv[roff[s] ..) with roff the prefix sum of recv_counts. recv_counts[s] must equal rank s's
  // send_counts[r]. Both count arrays have world_size() entries.
  virtual void all_to_all_v(const float* send, const int64_t* send_counts, float* recv,
                            const int64_t* recv_counts) = 0;
  virtual void all_to_all_v(const int32_t* send, const int64_t* send_counts, int32_t* recv,
                            const int64_t* recv_counts) = 0;
  // data[0 .. n) of rank `root` copied to every rank.
  virtual void broadcast(float* data, int64_t n, int root) = 0;
  virtual void broadcast(int32_t* data, int64_t n, int root) = 0;
  // Returns when every rank has entered it (NCCL: when the stream's prior work is done on all).
  virtual void barrier() = 0;
  // Empty while the group works; else why it no longer does (the TCP communicator between
  // processes: a lost peer; its collectives then return at once with zeros, never hang).
  virtual std::string fault() const { return ""; }
};

}  // namespace m3::dist
