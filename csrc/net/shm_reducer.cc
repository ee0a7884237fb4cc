#include "net/shm_reducer.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstring>
#include <new>
#include <random>
#include <system_error>

#include "host/reduce_kernels.h"
#include "net/errors.h"
#include "net/store.h"

namespace mirrored::net {

// The head of the segment. Lock-free atomics work across processes that map
// the same memory; the barrier's phase word doubles as a futex.
struct ShmReducer::Control {
  std::atomic<std::uint32_t> arrived{0};
  std::atomic<std::uint32_t> phase{0};
  std::atomic<std::int32_t> aborted_by{-1};
};

namespace {

constexpr std::size_t kHeader = 4096;  // the Control block, padded so that slots stay page-aligned
static_assert(std::atomic<std::uint32_t>::is_always_lock_free, "cross-process atomics need lock-free words");

void futex_wait(std::atomic<std::uint32_t>* word, std::uint32_t expected, std::chrono::milliseconds wait) {
  timespec ts{static_cast<time_t>(wait.count() / 1000), static_cast<long>(wait.count() % 1000) * 1000000};
  // Shared (not FUTEX_PRIVATE) futexes: the waiters are other processes.
  syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void futex_wake_all(std::atomic<std::uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

std::runtime_error os_error(const std::string& what) {
  return std::runtime_error(what + ": " + std::system_category().message(errno));
}

}  // namespace

ShmReducer::ShmReducer(StoreClient& store, const std::string& key, int rank, int size,
                       std::chrono::milliseconds timeout)
    : rank_(rank), size_(size) {
  bytes_ = kHeader + 2 * static_cast<std::size_t>(size) * kChunkBytes;
  int fd = -1;
  if (rank == 0) {
    std::random_device rd;
    name_ = "/mirrored-" + std::to_string(::getpid()) + "-" + std::to_string(rd());
    fd = ::shm_open(name_.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
    if (fd < 0) throw os_error("shm_open(" + name_ + ")");
    // Reserve the pages now: a full /dev/shm must fail here, not as SIGBUS later.
    const int rc = ::posix_fallocate(fd, 0, static_cast<off_t>(bytes_));
    if (rc != 0) {
      ::close(fd);
      ::shm_unlink(name_.c_str());
      errno = rc;
      throw os_error("reserving " + std::to_string(bytes_) + " bytes of shared memory");
    }
  } else {
    if (!store.wait({key}, timeout).empty()) throw PeerTimeout("shared memory: rank 0 did not publish its segment");
    const auto v = store.get(key);
    name_.assign(v.begin(), v.end());
    fd = ::shm_open(name_.c_str(), O_RDWR | O_CLOEXEC, 0600);
    if (fd < 0) throw os_error("shm_open(" + name_ + ")");
  }
  base_ = ::mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (base_ == MAP_FAILED) {
    base_ = nullptr;
    if (rank == 0) ::shm_unlink(name_.c_str());
    throw os_error("mmap of the shared segment");
  }
  if (rank == 0) {
    control_ = new (base_) Control();
    store.set(key, std::vector<char>(name_.begin(), name_.end()));
  } else {
    control_ = static_cast<Control*>(base_);
  }
}

ShmReducer::~ShmReducer() {
  if (base_) ::munmap(base_, bytes_);
  if (rank_ == 0 && !name_.empty()) ::shm_unlink(name_.c_str());  // a no-op when unlink() ran
}

void ShmReducer::unlink() {
  if (rank_ == 0) ::shm_unlink(name_.c_str());
}

char* ShmReducer::slot(std::size_t set, int rank) const {
  return static_cast<char*>(base_) + kHeader + (set * size_ + rank) * kChunkBytes;
}

void ShmReducer::abort() {
  std::int32_t none = -1;
  control_->aborted_by.compare_exchange_strong(none, rank_);
  control_->phase.fetch_add(1, std::memory_order_release);  // nobody may pass the barrier normally now
  futex_wake_all(&control_->phase);
}

void ShmReducer::barrier(Deadline deadline, const std::function<void()>& check_peers) {
  Control& c = *control_;
  const auto check_aborted = [&c] {
    const std::int32_t by = c.aborted_by.load(std::memory_order_acquire);
    if (by >= 0)
      throw PeerLost("rank " + std::to_string(by) + " aborted the shared-memory all-reduce after a failure");
  };
  check_aborted();
  const std::uint32_t phase = c.phase.load(std::memory_order_acquire);
  if (c.arrived.fetch_add(1, std::memory_order_acq_rel) + 1 == static_cast<std::uint32_t>(size_)) {
    // Last to arrive: reset the count before releasing the others, who can
    // only arrive at the next barrier after seeing the new phase.
    c.arrived.store(0, std::memory_order_relaxed);
    c.phase.fetch_add(1, std::memory_order_release);
    futex_wake_all(&c.phase);
  } else {
    // Spin briefly (peers are usually close behind), then sleep on the futex.
    for (int spin = 0; spin < 2000 && c.phase.load(std::memory_order_acquire) == phase; ++spin) {
    }
    auto next_check = Clock::now() + std::chrono::milliseconds(100);
    while (c.phase.load(std::memory_order_acquire) == phase) {
      check_aborted();
      const auto now = Clock::now();
      if (now >= deadline) throw PeerTimeout("Timed out waiting for peers in the shared-memory all-reduce");
      if (now >= next_check) {
        check_peers();
        next_check = now + std::chrono::milliseconds(100);
      }
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(std::min(deadline, next_check) - now);
      futex_wait(&c.phase, phase, std::max(left, std::chrono::milliseconds(1)));
    }
  }
  check_aborted();
}

void ShmReducer::all_reduce(void* acc, std::size_t count, DType dtype, ReduceOp op, Deadline deadline,
                            const std::function<void()>& check_peers) {
  const std::size_t elem = dtype_size(dtype);
  const std::size_t chunk = kChunkBytes / elem;
  const auto combine = reduce_kernels().combine[static_cast<int>(dtype)][static_cast<int>(combining_op(op))];
  char* data = static_cast<char*>(acc);
  for (std::size_t start = 0; start < count; start += chunk, ++chunks_) {
    const std::size_t n = std::min(chunk, count - start), set = chunks_ % 2;
    char* mine = data + start * elem;
    // Rank r reduces elements [lo, hi) of the chunk; this rank's own share
    // never needs to enter shared memory: it is read from, and written back
    // to, the caller's buffer directly.
    const std::size_t share = (n + size_ - 1) / size_;
    const std::size_t lo = std::min(n, rank_ * share), hi = std::min(n, lo + share);
    std::memcpy(slot(set, rank_), mine, lo * elem);
    std::memcpy(slot(set, rank_) + hi * elem, mine + hi * elem, (n - hi) * elem);
    barrier(deadline, check_peers);
    if (hi > lo) {
      const auto part = [&](int r) -> const char* { return r == rank_ ? mine + lo * elem : slot(set, r) + lo * elem; };
      // Combined over every rank in rank order, into slot 0 for the peers.
      char* dst = slot(set, 0) + lo * elem;
      combine(dst, part(0), part(1), hi - lo);
      for (int r = 2; r < size_; ++r) combine(dst, dst, part(r), hi - lo);
      std::memcpy(mine + lo * elem, dst, (hi - lo) * elem);
    }
    barrier(deadline, check_peers);
    // The peers' shares; safe to read while faster ranks fill the other set with the next chunk.
    std::memcpy(mine, slot(set, 0), lo * elem);
    std::memcpy(mine + hi * elem, slot(set, 0) + hi * elem, (n - hi) * elem);
  }
}

}  // namespace mirrored::net
