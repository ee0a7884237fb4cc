// Collectives across the processes of a multi-worker job, through Gloo's TCP
// transport. Every call is hierarchical: this process's local replicas are
// combined first with the host reduce kernels, one buffer per process crosses
// the network through Gloo, and the result is copied back to every local
// replica. Replica g of the job is local replica g % n of process g / n.
//
// Every collective starts with an agreement: each process sends every peer a
// fixed-size header (which collective, its number, element count, dtype, op,
// root, ...; payloads up to kInlineBytes ride along), through the shared
// segment when there is one, else as one small Gloo message per peer. Any
// difference raises the same CollectiveMismatch on every process before any
// data moves; tiny collectives are complete after the headers.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/communicator.h"
#include "core/packer.h"
#include "net/errors.h"
#include "net/shm_reducer.h"
#include "net/store.h"

namespace gloo {
class Context;
namespace transport {
class UnboundBuffer;
}
}  // namespace gloo

namespace mirrored::net {

// A collective as every process must call it. Fixed layout: it crosses the network as bytes.
struct CollectiveHeader {
  enum Kind : std::uint8_t { kAllReduce = 1, kBroadcast, kReduce, kAllGather, kBarrier, kExchange };
  std::uint64_t seq = 0;    // collectives this communicator has run, this one included
  std::uint64_t count = 0;  // elements (exchange, all_gather: 64-bit values of the size record)
  std::int64_t root = -1;   // a replica of the job; -1: none
  std::uint8_t kind = 0;
  std::uint8_t dtype = 0;
  std::uint8_t op = 0;
  std::uint8_t algorithm = 0;
  std::uint32_t inline_bytes = 0;  // payload carried in `data`
  // A pack of a batch_all_reduce: the digest of the whole batch (its tensors'
  // sizes and dtypes, and the packing), so that batches which differ raise at
  // the first pack even where that pack agrees; 0 for every other collective.
  std::uint64_t layout = 0;
  static constexpr std::size_t kInlineBytes = 64;
  char data[kInlineBytes] = {};
};
static_assert(sizeof(CollectiveHeader) == 104, "the header's layout is part of the wire format");

// What a collective that waits long reports (see set_wait_hook).
struct WaitReport {
  std::string collective;            // e.g. "all_reduce #12"
  double waited_s = 0;               // since the wait began
  std::vector<std::string> missing;  // tasks that have not arrived yet
  bool stalled = false;              // a stall warning is due (see set_stall_warning)
};

class GlooCommunicator : public Communicator {
 public:
  // Joins the full mesh of task_names.size() processes; this process is
  // store->rank(). Every process must pass the same task names (e.g.
  // "chief:0", "worker:0"), the same `scope` (namespaces the store keys of
  // this communicator) and the same local_replicas. The mesh is set up over
  // connections authenticated with the job token (mesh.h); this task listens
  // on `host` (its TF_CONFIG host). `timeout` bounds every collective (zero:
  // none; a dead peer is still detected through its socket) that no
  // CallTimeout overrides.
  GlooCommunicator(std::shared_ptr<StoreClient> store, std::vector<std::string> task_names, int local_replicas,
                   const std::string& host, std::chrono::milliseconds timeout, const std::string& scope);
  ~GlooCommunicator() override;

  // The timeout of one call (CommunicationOptions.timeout_seconds passed to
  // that call): while it lives, the collectives this thread runs are bounded
  // by `timeout` (zero: none) instead of the communicator's own. Thread-local,
  // so concurrent callers on other threads keep theirs.
  class CallTimeout {
   public:
    explicit CallTimeout(std::chrono::milliseconds timeout);
    ~CallTimeout();
    CallTimeout(const CallTimeout&) = delete;
    CallTimeout& operator=(const CallTimeout&) = delete;

   private:
    std::chrono::milliseconds saved_;
  };

  const char* backend() const override { return "gloo"; }
  int rank() const { return rank_; }
  int size() const { return static_cast<int>(tasks_.size()); }
  int local_replicas() const { return local_; }
  // Why all-reduces do not go through shared memory; empty when they do (for the engine log line).
  std::string shared_memory_off() const;

  void all_reduce(int n, const void* const* in, void* const* out, std::size_t count, DType dtype, ReduceOp op,
                  Algorithm algorithm) override {
    all_reduce_as(n, in, out, count, dtype, op, algorithm, op);
  }
  // As all_reduce, but the workers compare `agreed` as the op: an integer
  // MEAN is computed as a SUM (divided in float64 by the caller), and must
  // still mismatch another worker's SUM.
  void all_reduce_as(int n, const void* const* in, void* const* out, std::size_t count, DType dtype, ReduceOp op,
                     Algorithm algorithm, ReduceOp agreed);
  // ntensors tensors per local replica: in[k * ntensors + t] is tensor t of
  // local replica k (counts[t] elements of dtypes[t]). The tensors are fused
  // by the engines' one packer (core/packer.h) and every pack is all-reduced
  // as above, its header carrying the batch's layout digest (batch_layout)
  // so that workers whose batches differ all raise before any data moves.
  // out[k * ntensors + t] may equal its own input; no other overlap is allowed.
  void batch_all_reduce(int n, int ntensors, const void* const* in, void* const* out, const std::size_t* counts,
                        const DType* dtypes, ReduceOp op, std::size_t bytes_per_pack, int num_packs,
                        Algorithm algorithm, ReduceOp agreed);
  // The digest a batch's packs carry (never 0).
  static std::uint64_t batch_layout(int ntensors, const std::size_t* counts, const DType* dtypes,
                                    std::size_t bytes_per_pack, int num_packs);
  // `root` is a replica of the whole job.
  void broadcast(int n, const void* const* in, void* const* out, std::size_t count, DType dtype, int root) override;
  void reduce(int n, const void* const* in, void* const* out, std::size_t count, DType dtype, ReduceOp op,
              int root) override {
    reduce_as(n, in, out, count, dtype, op, root, op);
  }
  void reduce_as(int n, const void* const* in, void* const* out, std::size_t count, DType dtype, ReduceOp op, int root,
                 ReduceOp agreed);
  // Rows are concatenated over the replicas of the whole job; row sizes and the
  // row count are exchanged first, so they may differ between processes.
  void all_gather(int n, const void* const* in, void* const* out, const std::size_t* row_bytes,
                  std::size_t outer) override;
  // Every process's `mine` (all of the same length), concatenated in rank
  // order. `kind` names the collective this exchange opens (kExchange, or
  // kAllGather for the size table of a gather: all_gather_planned continues it).
  std::vector<std::uint64_t> exchange(const std::vector<std::uint64_t>& mine,
                                      CollectiveHeader::Kind kind = CollectiveHeader::kExchange);
  // Opens an all-gather: this process's local replicas have `shapes` (each of
  // the same number of dimensions, 1..kMaxGatherDims; they may differ along
  // `axis` only); every process's size table is exchanged and checked, alike
  // on every process (a CollectiveMismatch before any data moves). Returns
  // every replica's extent along `axis`, in job replica order, for
  // all_gather_planned.
  static constexpr std::size_t kMaxGatherDims = 32;
  std::vector<std::uint64_t> agree_gather(int n, DType dtype, int axis,
                                          const std::vector<std::vector<std::uint64_t>>& shapes);
  // The data stage of the all-gather whose size table the last exchange(...,
  // kAllGather) agreed: job_row_bytes holds every replica's row size, in job
  // replica order; no sizes are exchanged again.
  void all_gather_planned(int n, const void* const* in, void* const* out, const std::uint64_t* job_row_bytes,
                          std::size_t outer);
  const std::string& task(int rank) const { return tasks_.at(rank); }
  // Collectives started so far (the number of the last one).
  std::int64_t collectives() const { return seq_; }
  // Called from the calling thread about every 100 ms while a collective waits
  // for peers to arrive (never on the fast path). It may throw Interrupted (a
  // signal) to end the wait: the job's collectives are then broken.
  void set_wait_hook(std::function<void(const WaitReport&)> hook) { wait_hook_ = std::move(hook); }
  // A wait longer than `period` reports `stalled`, and again after every
  // further period (zero: never). The call is not failed: the timeout does that.
  void set_stall_warning(std::chrono::milliseconds period) { stall_period_ = period; }
  void barrier();
  // Stops the watchdog and closes the mesh; later calls raise. Idempotent.
  void close();

 private:
  // Agrees on `mine` with every peer (throwing CollectiveMismatch on every
  // process alike), then runs the data stage fn(tag, timeout); the caller
  // holds the call mutex. On failure tears the mesh down (so that peers blocked
  // on us fail fast too) and throws an error naming the culprits.
  template <typename Fn>
  void collective(CollectiveHeader& mine, Fn&& fn);
  // A data stage without its own agreement (the caller agreed already).
  template <typename Fn>
  void continue_collective(const char* what, Fn&& fn);
  // Runs one stage of `what`; any failure but a mismatch breaks the job.
  template <typename Stage>
  void guarded(const char* what, Stage&& stage);
  void agree(const CollectiveHeader& mine, Deadline deadline);
  void agree_over_gloo(const CollectiveHeader& mine, Deadline deadline);
  void check_agreement(const CollectiveHeader& mine);
  void on_wait(const std::vector<int>& missing);
  CollectiveHeader header(CollectiveHeader::Kind kind);
  // Payloads up to inline_capacity() bytes ride with the header (the
  // segment's record holds 64 bytes; a Gloo message more).
  std::size_t inline_capacity() const;
  void set_payload(CollectiveHeader& h, const void* data, std::size_t bytes);
  const char* payload(int rank) const;  // rank's inline payload, once agreed
  void drop_transport();
  void linger_for_peers();
  [[noreturn]] void fail(const char* what, const std::exception& cause);
  [[noreturn]] void interrupted(const std::string& what, const Interrupted& cause);
  enum class Verdict { kGone, kBehind, kUnknown };
  std::string diagnose(std::int64_t seq, bool timed_out, Verdict* verdict);
  void check_replicas(int n, const char* what) const;
  // The network stage of an all-reduce of acc (this process's combined replicas), mu_ held.
  void reduce_across(void* acc, std::size_t count, DType dtype, ReduceOp op, Algorithm algorithm, ReduceOp agreed,
                     std::uint64_t layout);
  const std::vector<Pack>& packs_for(int ntensors, const std::size_t* counts, const DType* dtypes,
                                     std::size_t bytes_per_pack, int num_packs);
  void watch();
  void setup_shared_memory();
  void check_peers();
  std::vector<std::uint64_t> exchange_locked(const std::vector<std::uint64_t>& mine, CollectiveHeader::Kind kind);

  using ReduceFn = void (*)(void* dst, const void* a, const void* b, std::size_t n);
  // Data stages over Gloo's pairs (see data_buffer in the .cc): every process
  // sends its block [offset[r], offset[r] + bytes[r]) of `base` to every peer
  // and receives theirs in place; one round.
  void all_gather_blocks(char* base, const std::vector<std::size_t>& offset, const std::vector<std::size_t>& bytes,
                         std::uint32_t tag, std::chrono::milliseconds timeout);
  // Ring reduce-scatter of acc (count elements): afterwards this process holds
  // the job's reduction of chunk owned_chunk(rank_), in place.
  void reduce_scatter_ring(char* acc, std::size_t count, std::size_t elem, ReduceFn fn, std::uint32_t tag,
                           std::chrono::milliseconds timeout);
  std::size_t chunk_begin(std::size_t count, int chunk) const { return count * chunk / size(); }
  int owned_chunk(int rank) const { return (rank + 1) % size(); }
  gloo::transport::UnboundBuffer* data_buffer(void* ptr, std::size_t bytes);

  std::shared_ptr<StoreClient> store_;
  const std::vector<std::string> tasks_;
  const int rank_;
  const int local_;
  const std::chrono::milliseconds timeout_;
  std::chrono::milliseconds call_timeout_{0};  // the running collective's (timeout_ or a CallTimeout's), mu_ held
  // The running collective's timeout, and the wait it allows (a month where there is none).
  std::chrono::milliseconds begin_call_timeout();
  const std::string prefix_;  // of this communicator's store keys
  std::shared_ptr<gloo::Context> context_;
  std::mutex mu_;
  std::int64_t seq_ = 0;
  std::string broken_;         // why the mesh was torn down; empty while healthy
  std::vector<CollectiveHeader> table_;   // every process's header of the current collective, in rank order
  std::vector<const char*> shm_table_;    // the same, where the shared segment holds it
  std::chrono::steady_clock::time_point wait_start_;  // of the current collective's agreement
  std::uint8_t current_kind_ = 0;
  std::chrono::milliseconds stall_period_{0};
  std::chrono::steady_clock::duration next_stall_{};  // since wait_start_
  std::function<void(const WaitReport&)> wait_hook_;
  // The Gloo path's headers: one message to and from every peer, in buffers registered once.
  std::unique_ptr<gloo::transport::UnboundBuffer> header_out_, header_in_;
  std::vector<char> out_message_, in_messages_;  // header + inline payload; one slot per rank for the peers'
  const char* payload_ = nullptr;                 // this process's inline payload in the current collective
  gloo::transport::UnboundBuffer* waiting_in_ = nullptr;  // poked by the watchdog to wake the wait (watch_mu_)
  // Buffers of past data stages, destroyed at the start of the next one (see DataStage).
  std::vector<std::unique_ptr<gloo::transport::UnboundBuffer>> data_buffers_;
  std::vector<char> scratch_;  // reused across calls
  struct {
    std::uint64_t layout = 0;
    std::vector<std::size_t> bytes;
    std::vector<DType> dtypes;
    std::vector<Pack> packs;
  } batch_;                    // the last batch's packs (mu_)
  std::vector<char> fusion_;   // a pack of the batch being reduced
  std::vector<char> gathered_;
  std::vector<char> ring_in_;  // a chunk arriving in reduce_scatter_ring
  // All processes on one machine: large all-reduces go through shared memory.
  std::unique_ptr<ShmReducer> shm_;
  std::string shm_off_;  // why there is no shm_ (decided once, in setup_shared_memory)

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
