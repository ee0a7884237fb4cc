#include "host/thread_pool.h"

#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
static inline void cpu_relax() { _mm_pause(); }
#else
static inline void cpu_relax() {}
#endif

namespace mirrored {

namespace {
// How long an idle worker polls for the next job before sleeping. Long
// enough to cover the gap between back-to-back collectives from Python,
// short enough not to steal a core from replica threads on a small machine.
constexpr auto kSpin = std::chrono::microseconds(50);

int default_threads() {
  if (const char* env = std::getenv("MIRRORED_NUM_THREADS")) {
    const int n = std::atoi(env);
    if (n >= 1) return std::min(n, 256);
  }
  cpu_set_t set;
  int n = 0;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) n = CPU_COUNT(&set);
  if (n <= 0) n = static_cast<int>(std::thread::hardware_concurrency());
  return std::max(1, std::min(n, 16));
}
}  // namespace

ThreadPool::ThreadPool(int num_threads) {
  for (int w = 1; w < std::max(1, num_threads); ++w) workers_.emplace_back([this, w] { worker_loop(w); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_.store(true);
  }
  wake_.notify_all();
  for (auto& t : workers_) t.join();
}

ThreadPool& ThreadPool::global() {
  // Leaked on purpose: worker threads must outlive every static destructor
  // that might still run a collective at interpreter exit.
  static ThreadPool* pool = new ThreadPool(default_threads());
  return *pool;
}

void ThreadPool::dispatch(int nworkers, Task task, void* ctx) {
  std::lock_guard<std::mutex> submit(submit_mu_);
  nworkers = std::min(nworkers, size());
  task_.store(task, std::memory_order_relaxed);
  ctx_.store(ctx, std::memory_order_relaxed);
  pending_.store(nworkers - 1, std::memory_order_relaxed);
  {
    // Publishing under the mutex pairs with the sleepers' predicate check.
    std::lock_guard<std::mutex> lock(mu_);
    const std::uint64_t gen = (job_.load(std::memory_order_relaxed) >> 16) + 1;
    job_.store((gen << 16) | static_cast<std::uint64_t>(nworkers), std::memory_order_release);
  }
  wake_.notify_all();
  task(ctx, 0);
  while (pending_.load(std::memory_order_acquire) != 0) cpu_relax();
}

void ThreadPool::worker_loop(int worker) {
  std::uint64_t seen = 0;  // generation of the last job looked at
  auto generation = [](std::uint64_t job) { return job >> 16; };
  for (;;) {
    // Poll first, then sleep until the generation moves on.
    const auto deadline = std::chrono::steady_clock::now() + kSpin;
    std::uint64_t job = job_.load(std::memory_order_acquire);
    while (generation(job) == seen && !stop_.load(std::memory_order_relaxed) &&
           std::chrono::steady_clock::now() < deadline) {
      for (int i = 0; i < 64; ++i) cpu_relax();
      job = job_.load(std::memory_order_acquire);
    }
    if (generation(job) == seen) {
      std::unique_lock<std::mutex> lock(mu_);
      wake_.wait(lock, [&] { return stop_.load() || generation(job_.load(std::memory_order_acquire)) != seen; });
      job = job_.load(std::memory_order_acquire);
    }
    if (stop_.load()) return;
    seen = generation(job);
    // A job that does not need this worker can finish (and the next one be
    // published) without it; task_/ctx_ are only stable for jobs it is part of.
    if (worker < static_cast<int>(job & 0xffff)) {
      task_.load(std::memory_order_relaxed)(ctx_.load(std::memory_order_relaxed), worker);
      pending_.fetch_sub(1, std::memory_order_acq_rel);
    }
  }
}

}  // namespace mirrored
