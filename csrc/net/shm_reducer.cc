#include "net/shm_reducer.h"

#include <dirent.h>
#include <fcntl.h>
#include <sched.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>
#include <new>
#include <random>
#include <system_error>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "host/reduce_kernels.h"
#include "net/errors.h"
#include "net/hmac.h"
#include "net/store.h"

namespace mirrored::net {

// One rank's corner of the segment. Only its owner writes it; the counter
// has a cache line to itself so that a post invalidates nothing else.
struct ShmReducer::Lane {
  alignas(64) std::atomic<std::uint32_t> posted{0};  // the owner's posts so far; the futex word
  std::atomic<std::uint32_t> sleepers{0};            // peers asleep on `posted`: a post wakes them
  alignas(64) char record[2][kRecordBytes];          // by post parity (see exchange)
};

// The head of the segment. Lock-free atomics work across processes that map
// the same memory.
struct ShmReducer::Control {
  alignas(64) std::atomic<std::int32_t> aborted_by{-1};
  // Proves to an attacher that rank 0 of this job wrote this segment: the
  // nonce (also announced through the store) and HMAC(job token, seal_message()).
  std::uint8_t nonce[16] = {};
  std::uint8_t mac[32] = {};
};

namespace {

static_assert(std::atomic<std::uint32_t>::is_always_lock_free, "cross-process atomics need lock-free words");
static_assert(std::atomic<std::int32_t>::is_always_lock_free, "cross-process atomics need lock-free words");

constexpr std::size_t kPage = 4096;
// A waiter spins (keeping its core: a yield under load can cost a whole
// time slice) while peers are likely close behind, then sleeps on a futex.
// The spin outlasts a loaded scheduler's wake-up latency (about a
// millisecond): otherwise once one side sleeps, each wakes the other too late
// and both keep sleeping, at a millisecond per collective. With more
// processes than cores a spinner would hold the core a peer needs: it yields.
constexpr std::chrono::microseconds kSpinFor{5000};
// Between the chunks of a large all-reduce peers are in lock step, a chunk's
// work apart: under load, a short spin and then the futex lets the core go
// to the peer (measured: 16 MiB at 2 workers, load 6: 1.8 ms with 20 us, 2.2
// ms with 1 ms of spinning).
constexpr std::chrono::microseconds kDataSpinFor{50};

bool more_processes_than_cores(int processes) {
  cpu_set_t set;
  CPU_ZERO(&set);
  const int cores = sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : 0;
  return cores > 0 && processes > cores;
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

constexpr std::size_t kLanesAt = 128;  // the Control block comes first

void futex_wait(std::atomic<std::uint32_t>* word, std::uint32_t expected, std::chrono::microseconds wait) {
  timespec ts{static_cast<time_t>(wait.count() / 1000000), static_cast<long>(wait.count() % 1000000) * 1000};
  // Shared (not FUTEX_PRIVATE) futexes: the waiters are other processes.
  syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void futex_wake_all(std::atomic<std::uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

constexpr const char* kSegmentName = "mirrored-collectives";

std::string hex(const std::string& bytes) {
  static const char digits[] = "0123456789abcdef";
  std::string out;
  for (unsigned char c : bytes) {
    out.push_back(digits[c >> 4]);
    out.push_back(digits[c & 15]);
  }
  return out;
}

std::runtime_error os_error(const std::string& what) {
  return std::runtime_error(what + ": " + std::system_category().message(errno));
}

// Whether `posted` has reached `epoch` (counters wrap; peers are never more than one post apart).
inline bool reached(std::uint32_t posted, std::uint32_t epoch) {
  return static_cast<std::int32_t>(posted - epoch) >= 0;
}

}  // namespace

// What the creator's MAC covers: this segment (device and inode, so a file
// put at the announced path instead fails), its size, and a fresh nonce.
std::string ShmReducer::seal_message(const std::string& key, const std::string& nonce, unsigned long long dev,
                                     unsigned long long ino) const {
  return std::string("mirrored shared segment") + '\0' + key + '\0' + nonce + '\0' + std::to_string(dev) + ':' + std::to_string(ino) +
         ':' + std::to_string(bytes_);
}

ShmReducer::ShmReducer(StoreClient& store, const std::string& key, int rank, int size,
                       std::chrono::milliseconds timeout)
    : rank_(rank), size_(size), oversubscribed_(more_processes_than_cores(size)) {
  static_assert(sizeof(Control) <= 128, "the lanes start at byte 128");
  header_ = (kLanesAt + size * sizeof(Lane) + kPage - 1) / kPage * kPage;
  bytes_ = header_ + 2 * static_cast<std::size_t>(size) * kChunkBytes;
  struct stat st {};
  if (rank == 0) {
    // Sealable: once every rank has mapped it, nobody can map it writable again (mapped_by_all).
    fd_ = ::memfd_create(kSegmentName, MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd_ < 0) throw os_error("memfd_create");
    ::fchmod(fd_, 0600);
    // Reserve the pages now: a full tmpfs must fail here, not as SIGBUS later.
    const int rc = ::posix_fallocate(fd_, 0, static_cast<off_t>(bytes_));
    if (rc != 0 || ::fstat(fd_, &st) != 0) {
      ::close(fd_);
      fd_ = -1;
      errno = rc != 0 ? rc : errno;
      throw os_error("reserving " + std::to_string(bytes_) + " bytes of shared memory");
    }
    base_ = ::mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
  } else {
    if (!store.wait({key}, timeout).empty()) throw PeerTimeout("shared memory: rank 0 did not publish its segment");
    const auto v = store.get(key);
    long long pid = 0, fd = -1;
    unsigned long long bytes = 0, dev = 0, ino = 0;
    char nonce_hex[33] = {};
    const std::string text(v.begin(), v.end());
    if (std::sscanf(text.c_str(), "%lld %lld %llu %llu %llu %32s", &pid, &fd, &bytes, &dev, &ino, nonce_hex) != 6 ||
        bytes != bytes_)
      throw std::runtime_error("shared memory: rank 0 offers no usable segment");
    // Another process's descriptor, opened through procfs: needs the same user (else: the network).
    const std::string path = "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(fd);
    const int local = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
    if (local < 0) throw os_error("open(" + path + ")");
    // The file rank 0 announced, and no other (a reused pid or descriptor number, another pid namespace).
    if (::fstat(local, &st) != 0 || static_cast<std::size_t>(st.st_size) != bytes_ || st.st_dev != dev ||
        st.st_ino != ino) {
      ::close(local);
      throw std::runtime_error("shared memory: " + path + " is not the segment rank 0 announced");
    }
    base_ = ::mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, local, 0);
    ::close(local);
    if (base_ != MAP_FAILED) {
      control_ = static_cast<Control*>(base_);
      const std::string nonce(reinterpret_cast<const char*>(control_->nonce), sizeof(control_->nonce));
      Digest mac;
      std::memcpy(mac.data(), control_->mac, mac.size());
      if (hex(nonce) != nonce_hex ||
          !same_digest(mac, hmac_sha256(store.token(), seal_message(key, nonce, st.st_dev, st.st_ino)))) {
        ::munmap(base_, bytes_);
        base_ = nullptr;
        throw std::runtime_error("shared memory: the segment opened does not carry this job's seal");
      }
    }
  }
  if (base_ == MAP_FAILED) {
    base_ = nullptr;
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
    throw os_error("mmap of the shared segment");
  }
  ino_ = st.st_ino;
  if (rank == 0) {
    const std::string nonce = random_bytes(sizeof(Control::nonce));
    const Digest mac = hmac_sha256(store.token(), seal_message(key, nonce, st.st_dev, st.st_ino));
    control_ = new (base_) Control();
    std::memcpy(control_->nonce, nonce.data(), nonce.size());
    std::memcpy(control_->mac, mac.data(), mac.size());
    for (int r = 0; r < size; ++r) new (&lane(r)) Lane();
    const std::string text = std::to_string(::getpid()) + " " + std::to_string(fd_) + " " + std::to_string(bytes_) +
                             " " + std::to_string(st.st_dev) + " " + std::to_string(st.st_ino) + " " + hex(nonce);
    store.set(key, std::vector<char>(text.begin(), text.end()));
  }
}

ShmReducer::~ShmReducer() {
  if (base_) ::munmap(base_, bytes_);
  if (fd_ >= 0) ::close(fd_);
}

long ShmReducer::mapped_by_all(const std::vector<long>& job_pids) {
  if (fd_ < 0) return 0;
  // From now on nobody can map the segment writable or write() it (existing mappings keep working).
  const int sealed = ::fcntl(fd_, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_FUTURE_WRITE | F_SEAL_SEAL);
  ::close(fd_);
  fd_ = -1;
  if (sealed != 0) return -1;
  // Until that moment any process of our user could have opened it through
  // /proc/<pid>/fd: one that still maps or holds it is not trusted.
  if (const long intruder = holder_outside(job_pids)) return intruder;
  // Whatever was written before the seal is overwritten before any rank uses the segment.
  control_->aborted_by.store(-1, std::memory_order_relaxed);
  for (int r = 0; r < size_; ++r) new (&lane(r)) Lane();
  return 0;
}

long ShmReducer::holder_outside(const std::vector<long>& job_pids) const {
  const std::string name = std::string("/memfd:") + kSegmentName;
  const std::string inode = " " + std::to_string(ino_) + " ";
  DIR* proc = ::opendir("/proc");
  if (!proc) return 0;
  long found = 0;
  while (dirent* e = ::readdir(proc)) {
    char* end = nullptr;
    const long pid = std::strtol(e->d_name, &end, 10);
    if (pid <= 0 || *end != '\0' || std::find(job_pids.begin(), job_pids.end(), pid) != job_pids.end()) continue;
    const std::string dir = std::string("/proc/") + e->d_name;
    // Only our user's processes (and root's) can open another process's descriptors through /proc.
    struct stat owner {};
    if (::stat(dir.c_str(), &owner) != 0 || (owner.st_uid != ::geteuid() && owner.st_uid != 0)) continue;
    // Mappings: "address perms offset dev inode path".
    if (std::FILE* maps = std::fopen((dir + "/maps").c_str(), "r")) {
      char line[4096];
      while (!found && std::fgets(line, sizeof(line), maps))
        if (std::strstr(line, name.c_str()) && std::strstr(line, inode.c_str())) found = pid;
      std::fclose(maps);
    }
    // Open descriptors.
    if (DIR* fds = found ? nullptr : ::opendir((dir + "/fd").c_str())) {
      while (dirent* f = ::readdir(fds)) {
        const std::string link = dir + "/fd/" + f->d_name;
        char target[256];
        const ssize_t n = ::readlink(link.c_str(), target, sizeof(target) - 1);
        if (n <= 0 || std::string(target, n).rfind(name, 0) != 0) continue;
        struct stat st {};
        if (::stat(link.c_str(), &st) == 0 && st.st_ino == ino_) found = pid;
      }
      ::closedir(fds);
    }
    if (found) break;
  }
  ::closedir(proc);
  return found;
}

ShmReducer::Lane& ShmReducer::lane(int rank) const {
  return *reinterpret_cast<Lane*>(static_cast<char*>(base_) + kLanesAt + rank * sizeof(Lane));
}

char* ShmReducer::slot(std::size_t set, int rank) const {
  return static_cast<char*>(base_) + header_ + (set * size_ + rank) * kChunkBytes;
}

void ShmReducer::abort() {
  std::int32_t none = -1;
  control_->aborted_by.compare_exchange_strong(none, rank_);
  for (int r = 0; r < size_; ++r) futex_wake_all(&lane(r).posted);  // sleepers re-check and see the abort
}

void ShmReducer::check_aborted() const {
  const std::int32_t by = control_->aborted_by.load(std::memory_order_acquire);
  if (by >= 0)
    throw PeerLost("rank " + std::to_string(by) + " aborted the shared-memory collectives after a failure");
}

void ShmReducer::post(std::uint32_t epoch) {
  Lane& mine = lane(rank_);
  // Sequentially consistent on both sides: either this store is seen by a
  // peer about to sleep, or that peer's sleepers count is seen here.
  mine.posted.store(epoch, std::memory_order_seq_cst);
  if (mine.sleepers.load(std::memory_order_seq_cst) != 0) futex_wake_all(&mine.posted);
}

void ShmReducer::wait_all(std::uint32_t epoch, Deadline deadline, const OnWait& on_wait,
                          std::chrono::microseconds spin_for) {
  int r = 0;
  const auto next_behind = [&] {
    for (; r < size_; ++r)
      if (r != rank_ && !reached(lane(r).posted.load(std::memory_order_acquire), epoch)) return true;
    return false;
  };
  if (!next_behind()) return;
  for (int spin = 0; spin < (oversubscribed_ ? 16 : 256); ++spin) {
    cpu_relax();
    if (!next_behind()) return;
  }
  const auto start = Clock::now();
  auto next_wake = start + kWakeEvery;
  while (next_behind()) {
    check_aborted();
    const auto now = Clock::now();
    if (now >= deadline) throw PeerTimeout("Timed out waiting for peers in the shared-memory collective");
    if (now >= next_wake) {
      std::vector<int> missing;
      for (int q = 0; q < size_; ++q)
        if (q != rank_ && !reached(lane(q).posted.load(std::memory_order_acquire), epoch)) missing.push_back(q);
      on_wait(missing);
      next_wake = Clock::now() + kWakeEvery;
      continue;
    }
    if (now - start < spin_for) {
      if (oversubscribed_) {
        sched_yield();
      } else {
        for (int spin = 0; spin < 64; ++spin) cpu_relax();
      }
      continue;
    }
    Lane& peer = lane(r);
    peer.sleepers.fetch_add(1, std::memory_order_seq_cst);
    const std::uint32_t seen = peer.posted.load(std::memory_order_seq_cst);
    if (!reached(seen, epoch)) {
      const auto left = std::chrono::duration_cast<std::chrono::microseconds>(std::min(deadline, next_wake) - now);
      futex_wait(&peer.posted, seen, std::max(left, std::chrono::microseconds(100)));
    }
    peer.sleepers.fetch_sub(1, std::memory_order_seq_cst);
  }
  check_aborted();
}

void ShmReducer::barrier(Deadline deadline, const OnWait& on_wait) {
  check_aborted();
  post(++epoch_);
  wait_all(epoch_, deadline, on_wait, kDataSpinFor);
}

void ShmReducer::exchange(const void* record, std::size_t bytes, std::vector<const char*>& table,
                          Deadline deadline, const OnWait& on_wait) {
  if (bytes > kRecordBytes) throw std::invalid_argument("a shared-memory record holds at most 128 bytes");
  check_aborted();
  // Records alternate by post parity: a rank can only post twice more (and
  // so overwrite this record) after every peer has posted once more, which a
  // peer does only once it has finished reading this table.
  const std::uint32_t epoch = ++epoch_;
  std::memcpy(lane(rank_).record[epoch % 2], record, bytes);
  post(epoch);
  wait_all(epoch, deadline, on_wait, kSpinFor);
  table.resize(size_);
  for (int r = 0; r < size_; ++r) table[r] = lane(r).record[epoch % 2];
}

void ShmReducer::all_reduce(void* acc, std::size_t count, DType dtype, ReduceOp op, Deadline deadline,
                            const OnWait& on_wait) {
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
    barrier(deadline, on_wait);
    if (hi > lo) {
      const auto part = [&](int r) -> const char* { return r == rank_ ? mine + lo * elem : slot(set, r) + lo * elem; };
      // Combined over every rank in rank order, into slot 0 for the peers.
      char* dst = slot(set, 0) + lo * elem;
      combine(dst, part(0), part(1), hi - lo);
      for (int r = 2; r < size_; ++r) combine(dst, dst, part(r), hi - lo);
      std::memcpy(mine + lo * elem, dst, (hi - lo) * elem);
    }
    barrier(deadline, on_wait);
    // The peers' shares; safe to read while faster ranks fill the other set with the next chunk.
    std::memcpy(mine, slot(set, 0), lo * elem);
    std::memcpy(mine + hi * elem, slot(set, 0) + hi * elem, (n - hi) * elem);
  }
}

}  // namespace mirrored::net
