// A persistent pool of worker threads for host collectives. The calling
// thread works too, so a pool of W threads runs W-1 background workers.
// Workers spin briefly after each job (back-to-back collectives then start in
// well under a microsecond) and sleep on a condition variable otherwise, so
// an idle pool costs no CPU.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace mirrored {

class ThreadPool {
 public:
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return static_cast<int>(workers_.size()) + 1; }

  // Calls fn(worker) once for each worker in [0, nworkers), nworkers <=
  // size(); worker 0 runs on the caller. Returns when all calls are done.
  // Jobs from different callers run one after another.
  template <typename Fn>
  void run(int nworkers, Fn&& fn) {
    if (nworkers <= 1) {
      fn(0);
      return;
    }
    auto trampoline = [](void* ctx, int worker) { (*static_cast<Fn*>(ctx))(worker); };
    dispatch(nworkers, trampoline, &fn);
  }

  // The process-wide pool: MIRRORED_NUM_THREADS threads, else one per CPU
  // this process may run on (capped at 16).
  static ThreadPool& global();

 private:
  using Task = void (*)(void*, int);
  void dispatch(int nworkers, Task task, void* ctx);
  void worker_loop(int worker);

  std::vector<std::thread> workers_;
  std::mutex submit_mu_;  // one job at a time

  // The current job: (generation << 16) | workers, published in one store so
  // a worker never pairs one job's generation with another's worker count.
  std::mutex mu_;
  std::condition_variable wake_;
  std::atomic<std::uint64_t> job_{0};
  std::atomic<Task> task_{nullptr};
  std::atomic<void*> ctx_{nullptr};
  std::atomic<int> pending_{0};
  std::atomic<bool> stop_{false};
};

}  // namespace mirrored
