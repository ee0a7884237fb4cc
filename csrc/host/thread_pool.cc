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
// How long an idle worker polls for the next job before sleeping: covers
// the gap between back-to-back collectives from Python, yet short enough not
// to steal a core from replica threads on a small machine.
constexpr auto kSpin = std::chrono::microseconds(50);
constexpr std::uint64_t kIndexMask = (std::uint64_t{1} << 40) - 1;

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
  for (int w = 1; w < std::max(1, num_threads); ++w) workers_.emplace_back([this] { worker_loop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_.store(true);
  }
  wake_.notify_all();
  for (auto& t : workers_) t.join();
}

namespace {
std::atomic<bool> global_made{false};
}  // namespace

ThreadPool& ThreadPool::global() {
  // Leaked on purpose: workers must outlive every static destructor that
  // might still run a collective at interpreter exit.
  static ThreadPool* pool = [] {
    auto* made = new ThreadPool(default_threads());
    global_made.store(true, std::memory_order_release);
    return made;
  }();
  return *pool;
}

bool ThreadPool::global_started() { return global_made.load(std::memory_order_acquire); }

void ThreadPool::work_on(std::uint64_t generation) {
  std::uint64_t cur = cursor_.load(std::memory_order_acquire);
  for (;;) {
    if ((cur >> kIndexBits) != generation) return;
    const std::size_t item = cur & kIndexMask;
    // Acquire pairs with dispatch's release of a new job's size: a worker that
    // sees the new size also sees the finished job closed, so its CAS fails.
    if (item >= items_.load(std::memory_order_acquire)) return;
    if (!cursor_.compare_exchange_weak(cur, cur + 1, std::memory_order_acq_rel, std::memory_order_acquire)) continue;
    // The claim succeeded, so this job cannot finish (and be replaced)
    // before this item is done: its description is stable.
    task_.load(std::memory_order_relaxed)(ctx_.load(std::memory_order_relaxed), item);
    done_.fetch_add(1, std::memory_order_acq_rel);
    cur = cursor_.load(std::memory_order_acquire);
  }
}

void ThreadPool::dispatch(std::size_t items, Task task, void* ctx) {
  std::lock_guard<std::mutex> submit(submit_mu_);
  const std::uint64_t previous = cursor_.load(std::memory_order_relaxed) >> kIndexBits;
  // Close the finished job before its description changes: a worker that
  // read its exhausted cursor and then saw the new, larger item count would
  // otherwise claim a phantom item (run out of range, count it done twice).
  cursor_.store((previous << kIndexBits) | kIndexMask, std::memory_order_seq_cst);
  task_.store(task, std::memory_order_relaxed);
  ctx_.store(ctx, std::memory_order_relaxed);
  done_.store(0, std::memory_order_relaxed);
  items_.store(items, std::memory_order_release);
  const std::uint64_t generation = previous + 1;
  {
    // Publishing under the mutex pairs with the sleepers' predicate check.
    std::lock_guard<std::mutex> lock(mu_);
    cursor_.store(generation << kIndexBits, std::memory_order_release);
  }
  wake_.notify_all();
  work_on(generation);
  // Items claimed by workers may still run; let them finish.
  for (int spins = 0; done_.load(std::memory_order_acquire) != items; ++spins) {
    if (spins < 1024) {
      cpu_relax();
    } else {
      std::this_thread::yield();  // a claimant may be waiting for this core
    }
  }
}

void ThreadPool::worker_loop() {
  std::uint64_t seen = 0;  // generation of the last job looked at
  auto generation = [this] { return cursor_.load(std::memory_order_acquire) >> kIndexBits; };
  for (;;) {
    const auto deadline = std::chrono::steady_clock::now() + kSpin;
    std::uint64_t gen = generation();
    while (gen == seen && !stop_.load(std::memory_order_relaxed) && std::chrono::steady_clock::now() < deadline) {
      for (int i = 0; i < 64; ++i) cpu_relax();
      gen = generation();
    }
    if (gen == seen) {
      std::unique_lock<std::mutex> lock(mu_);
      wake_.wait(lock, [&] { return stop_.load() || generation() != seen; });
      gen = generation();
    }
    if (stop_.load()) return;
    seen = gen;
    work_on(gen);
  }
}

}  // namespace mirrored
