// RankThreads: the persistent per-rank threads of a sharded backend, on the CPU (model/
// shard_backend.cpp: ranks are threads over a CpuCommunicator) and on GPUs (model/cuda: thread r
// bound to GPU r by `thread_init`). run(fn) calls fn(r) on every rank's thread at the same time
// and returns when all have returned, so a step costs two condition-variable handoffs and the
// caller never changes its own thread state (e.g. its current device).
// Invariant: rank r always runs on the same thread; not re-entrant (one run at a time).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace m3::runtime {

class RankThreads {
 public:
  // thread_init(r), when given, runs first on rank r's thread (e.g. cudaSetDevice(r)).
  explicit RankThreads(int world, std::function<void(int rank)> thread_init = {});
  ~RankThreads();  // stop()
  RankThreads(const RankThreads&) = delete;
  RankThreads& operator=(const RankThreads&) = delete;
  int world() const { return static_cast<int>(workers_.size()); }
  void run(const std::function<void(int rank)>& fn);
  // Joins the threads (idempotent); run() must not be called after it.
  void stop();

 private:
  void worker(int r);
  std::function<void(int)> thread_init_;
  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable cv_work_, cv_done_;
  const std::function<void(int)>* fn_ = nullptr;
  int pending_ = 0;
  uint64_t generation_ = 0;
  bool stop_ = false;
};

}  // namespace m3::runtime
