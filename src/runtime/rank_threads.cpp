#include "runtime/rank_threads.h"

#include "core/check.h"

namespace m3::runtime {

RankThreads::RankThreads(int world, std::function<void(int)> thread_init)
    : thread_init_(std::move(thread_init)) {
  for (int r = 0; r < world; ++r) workers_.emplace_back([this, r] { worker(r); });
}

RankThreads::~RankThreads() {
  stop();
}

void RankThreads::stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_work_.notify_all();
  for (auto& t : workers_)
    if (t.joinable()) t.join();
}

void RankThreads::run(const std::function<void(int)>& fn) {
  std::unique_lock<std::mutex> lock(mu_);
  M3_CHECK(!stop_ && fn_ == nullptr, "RankThreads::run after stop() or re-entered");
  fn_ = &fn;
  pending_ = static_cast<int>(workers_.size());
  ++generation_;
  cv_work_.notify_all();
  cv_done_.wait(lock, [&] { return pending_ == 0; });
  fn_ = nullptr;
}

void RankThreads::worker(int r) {
  if (thread_init_) thread_init_(r);
  uint64_t seen = 0;
  for (;;) {
    const std::function<void(int)>* fn = nullptr;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_work_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      fn = fn_;
    }
    (*fn)(r);
    std::lock_guard<std::mutex> lock(mu_);
    if (--pending_ == 0) cv_done_.notify_all();
  }
}

}  // namespace m3::runtime
