#include "core/thread_pool.h"

#include <algorithm>
#include <cstdlib>

namespace m3 {

namespace {
thread_local bool t_in_pool = false;
}

ThreadPool::ThreadPool(int num_threads) {
  const int n = std::max(1, num_threads);
  for (int i = 0; i < n - 1; ++i) workers_.emplace_back([this, i] { worker_loop(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_work_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::worker_loop(int) {
  t_in_pool = true;
  uint64_t seen = 0;
  for (;;) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_work_.wait(lock, [&] { return stop_ || generation_ != seen; });
    if (stop_) return;
    seen = generation_;
    while (next_chunk_ < num_chunks_) {
      const int64_t c = next_chunk_++;
      const auto* job = job_;
      const int64_t b = c * job_chunk_, e = std::min(job_n_, b + job_chunk_);
      lock.unlock();
      (*job)(b, e);
      lock.lock();
    }
    if (--pending_ == 0) cv_done_.notify_all();
  }
}

void ThreadPool::parallel_for(int64_t n, const std::function<void(int64_t, int64_t)>& fn,
                              int64_t grain) {
  if (n <= 0) return;
  grain = std::max<int64_t>(1, grain);
  const int64_t max_chunks = std::max<int64_t>(1, n / grain);
  const int64_t want = std::min<int64_t>(max_chunks, static_cast<int64_t>(num_threads()) * 4);
  if (t_in_pool || workers_.empty() || want <= 1) {
    fn(0, n);
    return;
  }
  std::lock_guard<std::mutex> submit(submit_mu_);
  std::unique_lock<std::mutex> lock(mu_);
  job_ = &fn;
  job_n_ = n;
  job_chunk_ = (n + want - 1) / want;
  num_chunks_ = (n + job_chunk_ - 1) / job_chunk_;
  next_chunk_ = 0;
  pending_ = static_cast<int>(workers_.size());
  ++generation_;
  cv_work_.notify_all();
  t_in_pool = true;
  while (next_chunk_ < num_chunks_) {
    const int64_t c = next_chunk_++;
    const int64_t b = c * job_chunk_, e = std::min(job_n_, b + job_chunk_);
    lock.unlock();
    fn(b, e);
    lock.lock();
  }
  t_in_pool = false;
  cv_done_.wait(lock, [&] { return pending_ == 0; });
  job_ = nullptr;
}

ThreadPool& cpu_pool() {
  static ThreadPool pool([] {
    if (const char* s = std::getenv("M3_NUM_THREADS")) {
      const int v = std::atoi(s);
      if (v > 0) return v;
    }
    return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  }());
  return pool;
}

}  // namespace m3
