// Collectives through one shared-memory segment, for jobs whose processes all
// run on one machine.
//
// Every collective starts with exchange(): each rank posts a small fixed-size
// record (what it is about to do, and tiny payloads inline) and waits until
// every rank has posted its own. A post is a store to a counter on this
// rank's own cache line, and a wait reads the peers' lines: no syscall and no
// shared counter on the fast path; a waiter spins briefly, then yields, then
// sleeps on the peer's counter as a futex (woken only when it says it sleeps).
//
// all_reduce() moves larger buffers: each process copies its buffer into its
// own slot, reduces a 1/p share of it across every slot, and copies the
// reduced whole back: about three passes over memory instead of the TCP
// stack's copies. Buffers go through in chunks, in two alternating sets of
// slots, so consecutive chunks are separated by two barriers only.
//
// The segment is an anonymous memfd: it never has a name in /dev/shm, so
// nothing can be left behind whenever a process dies. Peers open it through
// /proc/<pid>/fd of rank 0, check that it is the file rank 0 announced through
// the store and that it carries rank 0's MAC under the job token; once all have
// mapped it, rank 0 seals it against new writers and checks that no process
// outside the job opened it meanwhile (see mapped_by_all).
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/reduce_op.h"
#include "net/socket.h"

namespace mirrored::net {

class StoreClient;

class ShmReducer {
 public:
  static constexpr std::size_t kChunkBytes = std::size_t{1} << 20;
  static constexpr std::size_t kRecordBytes = 128;  // what exchange() carries per rank
  // Called about every kWakeEvery while a wait lasts, with the ranks not yet
  // arrived; it may throw to end the wait (a dead peer, a signal).
  using OnWait = std::function<void(const std::vector<int>& missing)>;
  static constexpr std::chrono::milliseconds kWakeEvery{100};

  // Rank 0 creates the segment and publishes how to open it under `key`;
  // every rank maps it. Throws on failure (the caller then agrees with its
  // peers to use the network instead).
  ShmReducer(StoreClient& store, const std::string& key, int rank, int size, std::chrono::milliseconds timeout);
  ~ShmReducer();
  ShmReducer(const ShmReducer&) = delete;
  ShmReducer& operator=(const ShmReducer&) = delete;

  // Every rank has mapped the segment: rank 0 seals it (no new writable
  // mapping, no write()), closes its descriptor (the memory lives exactly as
  // long as the mappings), makes sure no process but `job_pids` maps or holds
  // it, and resets it. Returns 0 when the segment can be trusted, else the pid
  // of a process outside the job that holds it (-1: it could not be sealed).
  // Other ranks: 0, nothing to do.
  long mapped_by_all(const std::vector<long>& job_pids);

  // Posts `record` (bytes <= kRecordBytes) and waits until every rank posted its own;
  // table[r] then points at rank r's record, valid until this rank's next
  // exchange() or all_reduce(). Waits end at `deadline` (PeerTimeout), when a
  // peer aborts (PeerLost), or when on_wait throws.
  void exchange(const void* record, std::size_t bytes, std::vector<const char*>& table, Deadline deadline,
                const OnWait& on_wait);

  // acc (count elements of dtype) becomes the combination over all ranks, in
  // place, with every rank's bits identical. Every rank must have agreed on
  // the call (through exchange) first.
  void all_reduce(void* acc, std::size_t count, DType dtype, ReduceOp op, Deadline deadline, const OnWait& on_wait);

  // Wakes every peer waiting in this segment with an error: this rank gave up.
  void abort();

 private:
  struct Lane;
  struct Control;
  Lane& lane(int rank) const;
  void post(std::uint32_t epoch);
  void wait_all(std::uint32_t epoch, Deadline deadline, const OnWait& on_wait, std::chrono::microseconds spin_for);
  void barrier(Deadline deadline, const OnWait& on_wait);
  void check_aborted() const;
  std::string seal_message(const std::string& key, const std::string& nonce, unsigned long long dev,
                           unsigned long long ino) const;
  long holder_outside(const std::vector<long>& job_pids) const;
  char* slot(std::size_t set, int rank) const;

  const int rank_;
  const int size_;
  const bool oversubscribed_;  // more processes than cores: waiters yield instead of spinning
  std::size_t header_ = 0;  // bytes before the data slots (page-aligned)
  std::size_t bytes_ = 0;
  int fd_ = -1;  // rank 0's descriptor, open until every rank has mapped the segment
  unsigned long long ino_ = 0;  // the segment's inode
  void* base_ = nullptr;
  Control* control_ = nullptr;
  std::uint32_t epoch_ = 0;   // posts so far: the same on every rank between calls
  std::uint64_t chunks_ = 0;  // chunks done so far, over all calls: picks the set of slots
};

}  // namespace mirrored::net
