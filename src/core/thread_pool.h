// ThreadPool: the fixed pool the CPU ops run on. parallel_for splits [0, n) into contiguous
// chunks and blocks until all are done; the calling thread works too. Nested calls from a worker
// run inline (serially) so ops may call each other freely.
// Size: $M3_NUM_THREADS, else the hardware concurrency.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace m3 {

class ThreadPool {
 public:
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return static_cast<int>(workers_.size()) + 1; }

  // fn(begin, end) over chunks of [0, n); chunks are at least `grain` long.
  void parallel_for(int64_t n, const std::function<void(int64_t, int64_t)>& fn, int64_t grain = 1);

 private:
  void worker_loop(int index);

  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable cv_work_;
  std::condition_variable cv_done_;
  std::mutex submit_mu_;  // one parallel_for at a time
  const std::function<void(int64_t, int64_t)>* job_ = nullptr;
  int64_t job_n_ = 0;
  int64_t job_chunk_ = 0;
  int64_t next_chunk_ = 0;
  int64_t num_chunks_ = 0;
  int pending_ = 0;
  uint64_t generation_ = 0;
  bool stop_ = false;
};

// The process-wide pool used by the CPU ops.
ThreadPool& cpu_pool();

// Shorthand for cpu_pool().parallel_for.
inline void parallel_for(int64_t n, const std::function<void(int64_t, int64_t)>& fn,
                         int64_t grain = 1) {
  cpu_pool().parallel_for(n, fn, grain);
}

}  // namespace m3
