// The replica array pool (csrc/host/array_pool.h) under the sanitizers: blocks
// come back for their size, are zeroed when asked, keep their contents through a
// reallocation, never make the pool hold more than its peak of live bytes, and
// move between threads (a block freed on another thread than its own, as arrays
// pass between replicas) without a race.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "check.h"
#include "host/array_pool.h"

using mirrored::host::ArrayPool;

namespace {

constexpr std::size_t kBig = 256 * 1024;  // cacheable
constexpr std::size_t kSmall = 1000;      // below ArrayPool::kMinCached

bool within_peak(const ArrayPool& pool) {
  auto s = pool.stats();
  return s.live_bytes + s.cached_bytes <= s.peak_bytes;
}

}  // namespace

int main() { return check::run_all(); }

TEST(a_freed_block_serves_the_next_request_of_its_size) {
  ArrayPool pool;
  void* a = pool.allocate(kBig);
  CHECK(a != nullptr && reinterpret_cast<std::uintptr_t>(a) % 64 == 0);
  std::memset(a, 7, kBig);
  pool.release(a);
  CHECK(pool.stats().cached_bytes == kBig);
  void* b = pool.allocate(kBig - 100);  // rounded up to the same pages
  CHECK(b == a);
  auto s = pool.stats();
  CHECK(s.hits == 1 && s.misses == 1 && s.cached_bytes == 0 && s.live_bytes == kBig);
  pool.release(b);
}

TEST(small_blocks_go_straight_to_malloc) {
  ArrayPool pool;
  void* a = pool.allocate(kSmall);
  CHECK(a != nullptr && reinterpret_cast<std::uintptr_t>(a) % 16 == 0);
  std::memset(a, 1, kSmall);
  pool.release(a);
  auto s = pool.stats();
  CHECK(s.live_bytes == 0 && s.cached_bytes == 0 && s.hits == 0 && s.misses == 0);
  pool.release(nullptr);
  void* empty = pool.allocate(0);
  CHECK(empty != nullptr);
  pool.release(empty);
}

TEST(zeroed_blocks_are_zero_even_when_reused) {
  ArrayPool pool;
  for (std::size_t bytes : {kSmall, kBig}) {
    void* dirty = pool.allocate(bytes);
    std::memset(dirty, 0xab, bytes);
    pool.release(dirty);
    auto* z = static_cast<unsigned char*>(pool.allocate(bytes, true));
    bool zero = true;
    for (std::size_t i = 0; i < bytes; ++i) zero = zero && z[i] == 0;
    CHECK(zero);
    pool.release(z);
  }
}

TEST(reallocation_keeps_the_contents) {
  ArrayPool pool;
  void* fresh = pool.reallocate(nullptr, kBig);  // realloc(NULL, n) is malloc(n)
  CHECK(fresh != nullptr && pool.stats().live_bytes == kBig);
  pool.release(fresh);
  for (std::size_t from : {kSmall, kBig}) {
    for (std::size_t to : {kSmall / 2, kBig / 2, 3 * kBig}) {
      auto* a = static_cast<unsigned char*>(pool.allocate(from));
      for (std::size_t i = 0; i < from; ++i) a[i] = static_cast<unsigned char>(i * 31);
      auto* b = static_cast<unsigned char*>(pool.reallocate(a, to));
      bool kept = b != nullptr;
      for (std::size_t i = 0; kept && i < std::min(from, to); ++i) kept = b[i] == static_cast<unsigned char>(i * 31);
      CHECK(kept);
      pool.release(b);
    }
  }
  CHECK(within_peak(pool));
}

TEST(the_pool_never_holds_more_than_its_peak_of_live_bytes) {
  ArrayPool pool;
  std::mt19937 rng(5);
  std::vector<void*> live;
  // Steps of one shape, then of another (a new batch size): the old sizes' blocks make room.
  for (std::size_t shape : {64 * 1024, 100 * 1024, 300 * 1024}) {
    for (int step = 0; step < 20; ++step) {
      for (int k = 0; k < 12; ++k) live.push_back(pool.allocate(shape * (1 + k % 3)));
      while (!live.empty()) {
        std::size_t i = rng() % live.size();
        pool.release(live[i]);
        live[i] = live.back();
        live.pop_back();
        CHECK(within_peak(pool));
      }
    }
    auto s = pool.stats();
    CHECK(s.live_bytes == 0 && s.cached_bytes <= s.peak_bytes);
  }
  auto s = pool.stats();
  CHECK(s.hits > s.misses);
  pool.trim();
  CHECK(pool.stats().cached_bytes == 0);
}

TEST(blocks_freed_on_other_threads) {
  ArrayPool pool;
  constexpr int kThreads = 4, kRounds = 200;
  std::vector<std::vector<void*>> made(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int r = 0; r < kRounds; ++r) {
        auto* p = static_cast<unsigned char*>(pool.allocate(kBig + 4096 * (r % 3), r % 2 == 0));
        p[0] = static_cast<unsigned char>(t);
        p[kBig - 1] = static_cast<unsigned char>(r);
        made[t].push_back(p);
        if (r % 2) {  // some freed here, the rest by the next thread below
          pool.release(made[t].back());
          made[t].pop_back();
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  threads.clear();
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (void* p : made[(t + 1) % kThreads]) pool.release(p);
    });
  }
  for (auto& th : threads) th.join();
  auto s = pool.stats();
  CHECK(s.live_bytes == 0 && within_peak(pool));
}

TEST(a_thread_gets_back_the_block_it_freed_first) {
  ArrayPool pool;
  void* mine[2] = {};
  void* again[2] = {};
  auto on_thread = [](auto fn) { std::thread(fn).join(); };
  on_thread([&] { mine[0] = pool.allocate(kBig); });
  on_thread([&] { mine[1] = pool.allocate(kBig); });
  std::thread first([&] {
    pool.release(mine[0]);
    std::thread second([&] {
      pool.release(mine[1]);
      again[1] = pool.allocate(kBig);  // the last freed is first's; second gets its own back
    });
    second.join();
    again[0] = pool.allocate(kBig);
  });
  first.join();
  CHECK(again[0] == mine[0] && again[1] == mine[1]);
  auto s = pool.stats();
  CHECK(s.hits == 2 && s.misses == 2);
  pool.release(again[0]);
  pool.release(again[1]);
  // A thread with none of its own takes another's.
  void* other = nullptr;
  on_thread([&] { other = pool.allocate(kBig); });
  CHECK(other == again[0] || other == again[1]);
  pool.release(other);
}

// fork() while other threads allocate and free all the time (their lock held much of it): every child
// allocates from the pool and exits, none hangs on a lock a thread of the parent held at the fork.
TEST(a_child_forked_while_threads_use_the_pool_can_allocate) {
  static ArrayPool* pool = new ArrayPool();  // guard_fork's pool lives as long as the process
  pool->guard_fork();
  std::atomic<bool> stop{false};
  std::vector<std::thread> churn;
  for (int t = 0; t < 2; ++t) {
    churn.emplace_back([&stop] {
      while (!stop.load(std::memory_order_relaxed)) {
        void* a = pool->allocate(kBig);
        void* b = pool->allocate(2 * kBig);
        pool->release(a);
        pool->release(b);
      }
    });
  }
  int hung = 0, failed = 0;
  for (int i = 0; i < 50; ++i) {
    const pid_t pid = fork();
    if (pid == 0) {
      void* a = pool->allocate(kBig);
      const bool ok = a != nullptr;
      pool->release(a);
      _exit(ok ? 0 : 1);
    }
    // Generous: a busy machine may be slow to run the child.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    int status = 0;
    while (waitpid(pid, &status, WNOHANG) == 0) {
      if (std::chrono::steady_clock::now() > deadline) {
        kill(pid, SIGKILL);
        waitpid(pid, &status, 0);
        ++hung;
        break;
      }
      usleep(1000);
    }
    if (!hung && !(WIFEXITED(status) && WEXITSTATUS(status) == 0)) ++failed;
    if (hung) break;
  }
  stop = true;
  for (auto& t : churn) t.join();
  CHECK(hung == 0);
  CHECK(failed == 0);
}
