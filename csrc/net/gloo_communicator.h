// Collectives across the processes of a multi-worker job, through Gloo's TCP
// transport. Every call is hierarchical: this process's local replicas are
// combined first with the host reduce kernels, one buffer per process crosses
// the network through Gloo, and the result is copied back to every local
// replica. Replica g of the job is local replica g % n of process g / n.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/communicator.h"
#include "net/shm_reducer.h"
#include "net/store.h"

namespace gloo {
class Context;
}

namespace mirrored::net {

class GlooCommunicator : public Communicator {
 public:
  // Joins the full mesh of task_names.size() processes; this process is
  // store->rank(). Every process must pass the same task names (e.g.
  // "chief:0", "worker:0"), the same `scope` (namespaces the store keys of
  // this communicator) and the same local_replicas. Gloo listens on `host`
  // (this task's TF_CONFIG host). `timeout` bounds every collective
  // (zero: none; a dead peer is still detected through its socket).
  GlooCommunicator(std::shared_ptr<StoreClient> store, std::vector<std::string> task_names, int local_replicas,
                   const std::string& host, std::chrono::milliseconds timeout, const std::string& scope);
  ~GlooCommunicator() override;

  const char* backend() const override { return "gloo"; }
  int rank() const { return rank_; }
  int size() const { return static_cast<int>(tasks_.size()); }
  int local_replicas() const { return local_; }
  // Why all-reduces do not go through shared memory; empty when they do (for the engine log line).
  std::string shared_memory_off() const;

  void all_reduce(int n, const void* const* in, void* const* out, std::size_t count, DType dtype, ReduceOp op,
                  Algorithm algorithm) override;
  // `root` is a replica of the whole job.
  void broadcast(int n, const void* const* in, void* const* out, std::size_t count, DType dtype, int root) override;
  void reduce(int n, const void* const* in, void* const* out, std::size_t count, DType dtype, ReduceOp op,
              int root) override;
  // Rows are concatenated over the replicas of the whole job; row sizes and the
  // row count are exchanged first, so they may differ between processes.
  void all_gather(int n, const void* const* in, void* const* out, const std::size_t* row_bytes,
                  std::size_t outer) override;
  // Every process's `mine` (all of the same length), concatenated in rank order.
  std::vector<std::uint64_t> exchange(const std::vector<std::uint64_t>& mine);
  void barrier();
  // Stops the watchdog and closes the mesh; later calls raise. Idempotent.
  void close();

 private:
  // Runs one Gloo operation (the caller holds the call mutex) with a fresh
  // tag; on failure tears the mesh down (so that peers blocked on us fail
  // fast too) and throws an error naming the culprits.
  template <typename Fn>
  void collective(const char* what, Fn&& fn);
  [[noreturn]] void fail(const char* what, const std::exception& cause);
  enum class Verdict { kGone, kBehind, kUnknown };
  std::string diagnose(std::int64_t seq, bool timed_out, Verdict* verdict);
  void check_replicas(int n, const char* what) const;
  void watch();
  void setup_shared_memory();
  void check_peers();
  std::vector<std::uint64_t> exchange_locked(const std::vector<std::uint64_t>& mine);

  std::shared_ptr<StoreClient> store_;
  const std::vector<std::string> tasks_;
  const int rank_;
  const int local_;
  const std::chrono::milliseconds timeout_;
  const std::string prefix_;  // of this communicator's store keys
  std::shared_ptr<gloo::Context> context_;
  std::mutex mu_;
  std::int64_t seq_ = 0;
  std::string broken_;         // why the mesh was torn down; empty while healthy
  std::vector<char> scratch_;  // reused across calls
  std::vector<char> gathered_;
  // All processes on one machine: large all-reduces go through shared memory.
  std::unique_ptr<ShmReducer> shm_;

  // Progress for diagnosis: a collective still running after a tick of the
  // watchdog is reported to the store, so that a failure can tell the peers
  // that never reached it from those waiting in it; quick collectives cost
  // nothing on the wire.
  std::atomic<std::int64_t> running_{0};  // sequence number of the collective in flight, 0: none
  std::mutex watch_mu_;
  std::condition_variable watch_cv_;
  bool stopping_ = false;
  std::thread watchdog_;
};

}  // namespace mirrored::net
