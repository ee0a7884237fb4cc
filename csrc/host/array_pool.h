// A cache of the large host blocks that CPU replicas allocate for their arrays.
//
// A training step allocates the same arrays every step (activations,
// gradients, temporaries), then frees them. glibc hands the freed top of a
// heap back to the kernel once it exceeds its trim threshold, so the next step
// faults every page in again: measured at ~3300 page faults, ~8 ms of system
// time per step in a replica thread of bench/train_step.py (2 replicas, 13 MB
// of activations each). The pool keeps freed blocks of 64 KiB and more for
// their size's next allocation instead.
//
// Bounded: it never holds more (cached + live) than the peak of bytes live at
// once, the memory the program needed anyway. A request that would grow the
// pool past that first releases cached blocks of other sizes, so a changed
// shape (a new batch size) replaces the old sizes' blocks rather than adding
// to them. Thread-safe: a block may be freed on another thread than the one
// that allocated it (arrays move between replicas and the caller). A thread
// gets back the blocks it freed itself first, warm in its core's cache: with
// one shared list, two replicas took each other's blocks and their steps were
// ~5 ms slower than on glibc's per-thread heaps without faults.
#pragma once

#include <cstddef>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

namespace mirrored::host {

class ArrayPool {
 public:
  // Blocks below this go straight to malloc/free: glibc's bins serve them without faults.
  static constexpr std::size_t kMinCached = 64 * 1024;
  // Nor is a block above this cached: rare, and held memory would dwarf the faults saved.
  static constexpr std::size_t kMaxCached = std::size_t{256} << 20;

  struct Stats {
    std::size_t live_bytes;    // allocated and not freed, of cacheable sizes
    std::size_t cached_bytes;  // freed and kept for reuse
    std::size_t peak_bytes;    // the most live_bytes ever were
    std::size_t hits;          // allocations served from the cache
    std::size_t misses;        // cacheable allocations that went to malloc
  };

  ArrayPool() = default;
  ~ArrayPool();
  ArrayPool(const ArrayPool&) = delete;
  ArrayPool& operator=(const ArrayPool&) = delete;

  // 64-byte aligned when cacheable, else 16 as malloc; nullptr when out of memory. `zeroed`: calloc's contract.
  void* allocate(std::size_t bytes, bool zeroed = false);
  // realloc's contract (a block of this pool or nullptr; the contents kept up to the smaller size).
  void* reallocate(void* block, std::size_t bytes);
  void release(void* block);  // nullptr: nothing
  void trim();                // frees every cached block
  Stats stats() const;
  // Makes fork() safe for this pool, which must live as long as the process (the handlers cannot be
  // unregistered; one pool per process): its lock is taken before a fork and released after it in
  // parent and child, so that a child forked while another thread allocates finds the lock free
  // and the pool whole (pthread_atfork).
  void guard_fork();

 private:
  void evict_locked();  // releases cached blocks (the largest first) until live + cached is within the peak

  mutable std::mutex mu_;
  // capacity -> the thread that freed them -> cached blocks (their headers)
  std::map<std::size_t, std::map<std::thread::id, std::vector<void*>>> free_;
  Stats stats_{};
};

}  // namespace mirrored::host
