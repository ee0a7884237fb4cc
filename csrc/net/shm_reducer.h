// All-reduce through one shared-memory segment, for jobs whose processes all
// run on one machine. Each process copies its buffer into its own slot,
// reduces a 1/p share of it across every slot, and copies the reduced whole
// back: about three passes over memory instead of the TCP stack's copies. Buffers
// go through in chunks, in two alternating sets of slots, so consecutive
// chunks are separated by two barriers only.
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <string>

#include "core/dtype.h"
#include "core/reduce_op.h"
#include "net/socket.h"

namespace mirrored::net {

class StoreClient;

class ShmReducer {
 public:
  static constexpr std::size_t kChunkBytes = std::size_t{1} << 20;

  // Rank 0 creates the segment and publishes its name under `key`; every
  // rank maps it. Throws on failure (the caller then agrees with its peers to
  // use the network instead).
  ShmReducer(StoreClient& store, const std::string& key, int rank, int size, std::chrono::milliseconds timeout);
  ~ShmReducer();
  ShmReducer(const ShmReducer&) = delete;
  ShmReducer& operator=(const ShmReducer&) = delete;

  // Rank 0 removes the segment's name once every rank has mapped it; the
  // memory then lives exactly as long as the processes using it.
  void unlink();

  // acc (count elements of dtype) becomes the combination over all ranks, in
  // place, with every rank's bits identical. Waits end at `deadline`
  // (PeerTimeout), when a peer aborts (PeerLost), or when `check_peers`,
  // called every 100 ms of waiting, throws.
  void all_reduce(void* acc, std::size_t count, DType dtype, ReduceOp op, Deadline deadline,
                  const std::function<void()>& check_peers);

  // Wakes every peer waiting in this segment with an error: this rank gave up.
  void abort();

 private:
  struct Control;
  void barrier(Deadline deadline, const std::function<void()>& check_peers);
  char* slot(std::size_t set, int rank) const;

  const int rank_;
  const int size_;
  std::string name_;
  std::size_t bytes_ = 0;
  void* base_ = nullptr;
  Control* control_ = nullptr;
  std::uint64_t chunks_ = 0;  // chunks done so far, over all calls: picks the set of slots
};

}  // namespace mirrored::net
