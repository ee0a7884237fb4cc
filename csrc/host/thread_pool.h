// A persistent pool of worker threads for host collectives. A job is a
// number of independent items; the caller and every awake worker claim
// items one at a time, so the caller never waits for a worker that the OS
// has not scheduled yet (it just does the items itself) — important when
// replica threads and pool threads share a few cores. Idle workers spin
// briefly (back-to-back collectives start in well under a microsecond),
// then sleep, so an idle pool costs no CPU.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

namespace mirrored {

class ThreadPool {
 public:
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  // Threads that can work on a job, the caller included.
  int size() const { return static_cast<int>(workers_.size()) + 1; }

  // Calls fn(item) for every item in [0, items), on the caller and the pool;
  // returns when all calls are done. Jobs from different callers run one
  // after another.
  template <typename Fn>
  void parallel_for(std::size_t items, Fn&& fn) {
    if (items == 0) return;
    if (items == 1 || workers_.empty()) {
      for (std::size_t i = 0; i < items; ++i) fn(i);
      return;
    }
    using F = std::remove_reference_t<Fn>;
    auto trampoline = [](void* ctx, std::size_t item) { (*static_cast<F*>(ctx))(item); };
    dispatch(items, trampoline, const_cast<void*>(static_cast<const void*>(&fn)));
  }

  // The process-wide pool: MIRRORED_NUM_THREADS threads, else one per CPU
  // this process may run on (capped at 16).
  static ThreadPool& global();
  // Whether global() has made the pool (its thread count is fixed from then on).
  static bool global_started();

 private:
  using Task = void (*)(void*, std::size_t);
  void dispatch(std::size_t items, Task task, void* ctx);
  // Claims and runs items of job `generation` until none are left.
  void work_on(std::uint64_t generation);
  void worker_loop();

  std::vector<std::thread> workers_;
  std::mutex submit_mu_;  // one job at a time

  // (generation << kIndexBits) | next unclaimed item, in one word so that a
  // claim (compare-and-swap) can only succeed for the job it was read from.
  static constexpr int kIndexBits = 40;
  std::atomic<std::uint64_t> cursor_{0};
  // The job's description; stable while any of its items is unclaimed.
  std::atomic<Task> task_{nullptr};
  std::atomic<void*> ctx_{nullptr};
  std::atomic<std::size_t> items_{0};
  std::atomic<std::size_t> done_{0};

  std::mutex mu_;
  std::condition_variable wake_;
  std::atomic<bool> stop_{false};
};

}  // namespace mirrored
