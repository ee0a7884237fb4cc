#include "net/gloo_communicator.h"

#include <gloo/allreduce.h>
#include <gloo/context.h>
#include <gloo/common/error.h>
#include <gloo/transport/unbound_buffer.h>
#include <gloo/types.h>

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "host/output_staging.h"
#include "host/reduce_kernels.h"
#include "net/errors.h"
#include "net/mesh.h"

namespace mirrored::net {
namespace {

// Up to this size "auto" all-reduces with one all-gather round (see all_reduce).
constexpr std::size_t kDirectMaxBytes = 16 << 10;
// A Gloo header message carries payloads up to this size (the "direct" range).
constexpr std::size_t kGlooInlineBytes = kDirectMaxBytes;
constexpr std::size_t kGlooMessageBytes = sizeof(CollectiveHeader) + kGlooInlineBytes;
// The Gloo slot prefix of the headers: none of Gloo's own algorithms uses it.
constexpr std::uint8_t kHeaderSlotPrefix = 0x6d;
// The slot prefix of our own data stages (all_gather_blocks, reduce_scatter_ring, ...).
constexpr std::uint8_t kDataSlotPrefix = 0x6e;
static_assert(sizeof(CollectiveHeader) <= ShmReducer::kRecordBytes, "a header must fit a shared-memory record");

const char* kind_name(std::uint8_t kind) {
  switch (kind) {
    case CollectiveHeader::kAllReduce: return "all_reduce";
    case CollectiveHeader::kBroadcast: return "broadcast";
    case CollectiveHeader::kReduce: return "reduce";
    case CollectiveHeader::kAllGather: return "all_gather";
    case CollectiveHeader::kBarrier: return "barrier";
    case CollectiveHeader::kExchange: return "exchange";
  }
  return "unknown collective";
}

// What a process passes to a collective, for a mismatch error.
std::string describe(const CollectiveHeader& h) {
  const std::string elements = std::to_string(h.count) + " " + dtype_name(static_cast<DType>(h.dtype)) + " elements";
  const std::string op = std::string(" (") + reduce_op_name(static_cast<ReduceOp>(h.op)) + ")";
  switch (h.kind) {
    case CollectiveHeader::kAllReduce:
      return elements + op +
             (h.algorithm ? std::string(", algorithm=") + algorithm_name(static_cast<Algorithm>(h.algorithm)) : "");
    case CollectiveHeader::kBroadcast: return elements + " from replica " + std::to_string(h.root);
    case CollectiveHeader::kReduce: return elements + op + " to replica " + std::to_string(h.root);
    case CollectiveHeader::kAllGather:
    case CollectiveHeader::kExchange: return "a size record of " + std::to_string(h.count) + " values";
    default: return "no data";
  }
}

bool same_call(const CollectiveHeader& a, const CollectiveHeader& b) {
  return a.seq == b.seq && a.kind == b.kind && a.count == b.count && a.root == b.root && a.dtype == b.dtype &&
         a.op == b.op && a.algorithm == b.algorithm && a.layout == b.layout;
}

// FNV-1a over 64-bit words.
std::uint64_t fnv1a(std::uint64_t h, std::uint64_t word) {
  for (int i = 0; i < 8; ++i) h = (h ^ ((word >> (8 * i)) & 0xff)) * 0x100000001b3ull;
  return h;
}

std::vector<char> to_bytes(std::int64_t v) {
  std::vector<char> b(sizeof(v));
  std::memcpy(b.data(), &v, sizeof(v));
  return b;
}

// Gloo's algorithms move elements of a given size and call our reduce
// function on them; they never look inside, so an unsigned integer of the
// right width stands for any of our dtypes (float16 and bfloat16 included).
template <typename Fn>
void with_element(std::size_t size, Fn&& fn) {
  switch (size) {
    case 1: fn(std::uint8_t{}); break;
    case 2: fn(std::uint16_t{}); break;
    case 4: fn(std::uint32_t{}); break;
    case 8: fn(std::uint64_t{}); break;
    default: throw std::invalid_argument("element size " + std::to_string(size) + " is not 1, 2, 4 or 8");
  }
}

// dst = in[first] (op) every other in[j]. Starting from in[first] keeps an
// in-place call (dst == in[first]) correct.
void combine_local(int n, const void* const* in, void* dst, int first, std::size_t count, DType dtype, ReduceOp op) {
  if (n == 1 || count == 0) {
    if (dst != in[first]) std::memcpy(dst, in[first], count * dtype_size(dtype));
    return;
  }
  const auto& k = reduce_kernels();
  const void* acc = in[first];
  for (int j = 0; j < n; ++j) {
    if (j == first) continue;
    combine(k, dtype, op, dst, acc, in[j], count);
    acc = dst;
  }
}

}  // namespace

GlooCommunicator::GlooCommunicator(std::shared_ptr<StoreClient> store, std::vector<std::string> task_names,
                                   int local_replicas, const std::string& host, std::chrono::milliseconds timeout,
                                   const std::string& scope)
    : store_(std::move(store)),
      tasks_(std::move(task_names)),
      rank_(store_->rank()),
      local_(local_replicas),
      timeout_(timeout),
      prefix_(scope + "/") {
  if (tasks_.empty() || rank_ < 0 || rank_ >= size())
    throw std::invalid_argument("task_names: rank " + std::to_string(rank_) + " is not one of " +
                                std::to_string(tasks_.size()) + " tasks");
  if (local_ < 1) throw std::invalid_argument("local_replicas must be >= 1, got " + std::to_string(local_));

  // Arrival: every task announces its replica count; the keys that never
  // appear name the tasks that never came.
  store_->set(prefix_ + "replicas/" + std::to_string(rank_), to_bytes(local_));
  std::vector<std::string> keys;
  for (int r = 0; r < size(); ++r) keys.push_back(prefix_ + "replicas/" + std::to_string(r));
  const auto missing = store_->wait(keys, store_->timeout());
  if (!missing.empty()) {
    std::vector<std::string> who;
    for (const auto& m : missing) who.push_back(tasks_[std::stoi(m.substr(m.rfind('/') + 1))]);
    throw PeerTimeout("rendezvous: task(s) " + join(who) + " did not join within " + seconds(store_->timeout()) +
                      "; start every task of TF_CONFIG's cluster with MultiWorkerMirroredStrategy, or raise "
                      "CommunicationOptions.timeout_seconds");
  }
  for (int r = 0; r < size(); ++r) {
    std::int64_t theirs = 0;
    const auto v = store_->get(keys[r]);
    std::memcpy(&theirs, v.data(), std::min(v.size(), sizeof(theirs)));
    if (theirs != local_)
      throw std::invalid_argument("task " + tasks_[r] + " has " + std::to_string(theirs) + " local replicas but " +
                                  tasks_[rank_] + " has " + std::to_string(local_) +
                                  ": every worker must use the same number of devices");
  }

  // Over connections that proved the job token (see mesh.h), never Gloo's own listeners.
  auto context = connect_mesh(*store_, prefix_, tasks_, host, store_->timeout());
  context_ = std::move(context);
  setup_shared_memory();
  seq_ = 0;  // users count their own collectives: the set-up exchange (all inline, no Gloo tags) is not one
  // Last: a constructor that throws must not leave a running thread behind.
  watchdog_ = std::thread([this] { watch(); });
}

void GlooCommunicator::setup_shared_memory() {
  if (size() == 1) {
    shm_off_ = "the job has one task";
    return;
  }
  // Same machine: same host name and same boot (containers may share a
  // name). A rank with MIRRORED_SHM=0 publishes a different identity, so
  // every rank agrees on the network then.
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  std::string me = host;
  if (std::FILE* f = std::fopen("/proc/sys/kernel/random/boot_id", "r")) {
    char id[64] = {};
    if (std::fgets(id, sizeof(id), f)) me += std::string("/") + id;
    std::fclose(f);
  }
  const char* env = std::getenv("MIRRORED_SHM");
  const bool disabled = env && std::string(env) == "0";
  if (disabled) me += "/rank " + std::to_string(rank_) + " without shared memory";
  const std::string pid = std::to_string(::getpid());
  store_->set(prefix_ + "pid/" + std::to_string(rank_), std::vector<char>(pid.begin(), pid.end()));
  store_->set(prefix_ + "host/" + std::to_string(rank_), std::vector<char>(me.begin(), me.end()));
  std::vector<std::string> keys, pid_keys;
  for (int r = 0; r < size(); ++r) {
    keys.push_back(prefix_ + "host/" + std::to_string(r));
    pid_keys.push_back(prefix_ + "pid/" + std::to_string(r));
  }
  // Every peer was in the mesh a moment ago; one that never publishes has died since.
  const auto missing = store_->wait(keys, store_->timeout());
  if (!missing.empty()) {
    std::vector<std::string> who;
    for (const auto& m : missing) who.push_back(tasks_[std::stoi(m.substr(m.rfind('/') + 1))]);
    throw PeerTimeout("rendezvous: task(s) " + join(who) + " joined the Gloo mesh but did not announce their host within " +
                      seconds(store_->timeout()) + " (did it crash while starting?)");
  }
  for (const auto& k : keys)
    if (store_->get(k) != std::vector<char>(me.begin(), me.end())) {  // the same answer on every rank
      shm_off_ = disabled ? "MIRRORED_SHM=0" : "the tasks run on different hosts (or one has MIRRORED_SHM=0)";
      return;
    }
  std::unique_ptr<ShmReducer> candidate;
  try {
    candidate = std::make_unique<ShmReducer>(*store_, prefix_ + "shm", rank_, size(), store_->timeout());
  } catch (const std::exception&) {
    // e.g. /dev/shm full or absent: every rank falls back to the network
    if (rank_ == 0) store_->set(prefix_ + "shm", {});
  }
  // Everyone learns whether everyone mapped the segment, then whether rank 0
  // could seal it with nobody outside the job holding it (see mapped_by_all).
  // Over Gloo: the headers only go through the segment once it is trusted.
  const auto mapped = exchange_locked({candidate ? 1u : 0u}, CollectiveHeader::kExchange);
  if (std::find(mapped.begin(), mapped.end(), std::uint64_t{0}) != mapped.end()) {
    shm_off_ = "a task could not map (or verify) the shared segment";
    return;
  }
  std::vector<long> pids;
  for (const auto& k : pid_keys) {
    const auto v = store_->get(k);
    pids.push_back(std::stol(std::string(v.begin(), v.end())));
  }
  const long intruder = candidate->mapped_by_all(pids);
  const auto verdict = exchange_locked({static_cast<std::uint64_t>(intruder)}, CollectiveHeader::kExchange);
  if (verdict[0] != 0) {
    const auto pid = static_cast<long>(verdict[0]);
    shm_off_ = pid < 0 ? "the shared segment could not be sealed"
                       : "process " + std::to_string(pid) + ", outside the job, opened the shared segment";
    return;
  }
  shm_ = std::move(candidate);
}

void GlooCommunicator::check_peers() {
  const auto tasks = store_->status();
  for (int r = 0; r < size() && r < static_cast<int>(tasks.size()); ++r)
    if (r != rank_ && tasks[r].departed && !tasks[r].connected) throw PeerLost("task " + tasks_[r] + " is gone");
}

std::string GlooCommunicator::shared_memory_off() const { return shm_ ? "" : shm_off_; }

GlooCommunicator::~GlooCommunicator() { close(); }

void GlooCommunicator::close() {
  {
    std::lock_guard<std::mutex> lock(watch_mu_);
    stopping_ = true;
  }
  watch_cv_.notify_all();
  if (watchdog_.joinable()) watchdog_.join();
  std::lock_guard<std::mutex> lock(mu_);
  data_buffers_.clear();
  header_out_.reset();
  header_in_.reset();
  context_.reset();
  shm_.reset();
  if (broken_.empty()) broken_ = "the communicator was closed; create a new strategy";
}

void GlooCommunicator::watch() {
  constexpr std::chrono::milliseconds kTick{50};
  std::int64_t seen = 0, reported = 0;
  std::unique_lock<std::mutex> lock(watch_mu_);
  while (!watch_cv_.wait_for(lock, kTick, [this] { return stopping_; })) {
    // A header wait over Gloo cannot time out without breaking the mesh:
    // waking it lets the waiting thread look at signals, stalls and the clock.
    if (waiting_in_) waiting_in_->abortWaitRecv();
    const std::int64_t now = running_.load(std::memory_order_relaxed);
    // Seen on two ticks in a row: this collective has been waiting for a while.
    if (now != 0 && now == seen && now != reported) {
      lock.unlock();
      try {
        store_->progress(now);
      } catch (const std::exception&) {
        // The store is gone; the collective's own failure will say so.
      }
      reported = now;
      lock.lock();
    }
    seen = now;
  }
}

void GlooCommunicator::check_replicas(int n, const char* what) const {
  if (n != local_)
    throw std::invalid_argument(std::string(what) + ": got " + std::to_string(n) +
                                " local buffers, but this worker joined the job with " + std::to_string(local_) +
                                " replicas");
}

CollectiveHeader GlooCommunicator::header(CollectiveHeader::Kind kind) {
  CollectiveHeader h;
  h.kind = kind;
  return h;
}

std::size_t GlooCommunicator::inline_capacity() const {
  return shm_ ? CollectiveHeader::kInlineBytes : kGlooInlineBytes;
}

void GlooCommunicator::set_payload(CollectiveHeader& h, const void* data, std::size_t bytes) {
  h.inline_bytes = static_cast<std::uint32_t>(bytes);
  if (bytes <= CollectiveHeader::kInlineBytes) std::memcpy(h.data, data, bytes);
  payload_ = static_cast<const char*>(data);
}

const char* GlooCommunicator::payload(int rank) const {
  if (shm_) return table_[rank].data;
  return rank == rank_ ? payload_ : in_messages_.data() + rank * kGlooMessageBytes + sizeof(CollectiveHeader);
}

namespace {
// The CallTimeout in force on this thread; negative: none (the communicator's own timeout applies).
thread_local std::chrono::milliseconds this_call_timeout{-1};
}  // namespace

GlooCommunicator::CallTimeout::CallTimeout(std::chrono::milliseconds timeout) : saved_(this_call_timeout) {
  this_call_timeout = timeout;
}

GlooCommunicator::CallTimeout::~CallTimeout() { this_call_timeout = saved_; }

std::chrono::milliseconds GlooCommunicator::begin_call_timeout() {
  call_timeout_ = this_call_timeout.count() >= 0 ? this_call_timeout : timeout_;
  // "No timeout" still needs a finite wait for Gloo; a dead peer is detected
  // through its socket long before this.
  return call_timeout_.count() > 0 ? call_timeout_ : std::chrono::hours(24 * 30);
}

template <typename Fn>
void GlooCommunicator::collective(CollectiveHeader& mine, Fn&& fn) {
  const char* what = kind_name(mine.kind);
  if (!broken_.empty()) throw PeerLost(std::string(what) + ": " + broken_);
  mine.seq = static_cast<std::uint64_t>(++seq_);
  running_.store(seq_, std::memory_order_relaxed);
  const auto timeout = begin_call_timeout();
  guarded(what, [&] { agree(mine, after(timeout)); });
  continue_collective(what, [&](std::uint32_t tag, std::chrono::milliseconds t) { fn(tag, t); });
}

template <typename Fn>
void GlooCommunicator::continue_collective(const char* what, Fn&& fn) {
  if (!broken_.empty()) throw PeerLost(std::string(what) + ": " + broken_);
  running_.store(seq_, std::memory_order_relaxed);
  guarded(what, [&] {
    const auto timeout = begin_call_timeout();
    data_buffers_.clear();  // the last data stage's: Gloo's I/O thread is long done with them
    fn(static_cast<std::uint32_t>(seq_), timeout);
  });
  running_.store(0, std::memory_order_relaxed);
}

// Runs one stage of collective `what`. A mismatch (only the agreement raises
// one) is the same on every process and moved no data, so the job stays
// usable; an interrupt or any other failure breaks the job's collectives.
template <typename Stage>
void GlooCommunicator::guarded(const char* what, Stage&& stage) {
  try {
    stage();
  } catch (const CollectiveMismatch&) {
    running_.store(0, std::memory_order_relaxed);
    throw;
  } catch (const Interrupted& e) {
    running_.store(0, std::memory_order_relaxed);
    interrupted(what, e);
  } catch (const std::exception& e) {
    running_.store(0, std::memory_order_relaxed);
    fail(what, e);
  }
}

void GlooCommunicator::agree(const CollectiveHeader& mine, Deadline deadline) {
  wait_start_ = Clock::now();
  next_stall_ = stall_period_;
  current_kind_ = mine.kind;
  if (shm_) {
    shm_->exchange(&mine, sizeof(mine), shm_table_, deadline,
                   [this](const std::vector<int>& missing) { on_wait(missing); });
    table_.resize(size());
    for (int r = 0; r < size(); ++r) std::memcpy(&table_[r], shm_table_[r], sizeof(CollectiveHeader));
  } else {
    agree_over_gloo(mine, deadline);
  }
  check_agreement(mine);
}

void GlooCommunicator::agree_over_gloo(const CollectiveHeader& mine, Deadline deadline) {
  constexpr std::size_t kBytes = sizeof(CollectiveHeader);
  if (!header_out_) {
    out_message_.assign(kGlooMessageBytes, 0);
    in_messages_.assign(size() * kGlooMessageBytes, 0);
    header_out_ = context_->createUnboundBuffer(out_message_.data(), out_message_.size());
    header_in_ = context_->createUnboundBuffer(in_messages_.data(), in_messages_.size());
  }
  std::memcpy(out_message_.data(), &mine, kBytes);
  if (mine.inline_bytes > 0) std::memcpy(out_message_.data() + kBytes, payload_, mine.inline_bytes);
  // One slot for every header: a pair delivers them in order, and every
  // process sends exactly one per collective.
  const std::uint64_t slot = gloo::Slot::build(kHeaderSlotPrefix, 0);
  // A message may be shorter than the slot posted for it: the header says how long.
  for (int r = 0; r < size(); ++r)
    if (r != rank_) header_in_->recv(r, slot, r * kGlooMessageBytes, kGlooMessageBytes);
  for (int r = 0; r < size(); ++r)
    if (r != rank_) header_out_->send(r, slot, 0, kBytes + mine.inline_bytes);
  std::vector<char> arrived(size(), 0);
  arrived[rank_] = 1;
  int left = size() - 1;
  {
    std::lock_guard<std::mutex> lock(watch_mu_);
    waiting_in_ = header_in_.get();
  }
  struct Unregister {
    GlooCommunicator* self;
    ~Unregister() {
      std::lock_guard<std::mutex> lock(self->watch_mu_);
      self->waiting_in_ = nullptr;
    }
  } unregister{this};
  auto next_wake = Clock::now() + ShmReducer::kWakeEvery;
  while (left > 0) {
    const auto now = Clock::now();
    if (now >= deadline) throw PeerTimeout("Timed out waiting for peers to reach this collective");
    if (now >= next_wake) {
      std::vector<int> missing;
      for (int r = 0; r < size(); ++r)
        if (!arrived[r]) missing.push_back(r);
      on_wait(missing);
      next_wake = Clock::now() + ShmReducer::kWakeEvery;
    }
    // Woken early (false) by the watchdog; Gloo's own timeout is a backstop only.
    const auto wait = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now) + std::chrono::seconds(1);
    int src = -1;
    if (header_in_->waitRecv(&src, wait)) {
      if (src >= 0 && src < size()) arrived[src] = 1;
      --left;
    }
  }
  for (int r = 0; r < size() - 1; ++r) header_out_->waitSend(std::chrono::duration_cast<std::chrono::milliseconds>(
      std::max(deadline - Clock::now(), Clock::duration(std::chrono::seconds(1)))));
  table_.resize(size());
  for (int r = 0; r < size(); ++r)
    if (r != rank_) std::memcpy(&table_[r], in_messages_.data() + r * kGlooMessageBytes, kBytes);
  table_[rank_] = mine;
}

void GlooCommunicator::check_agreement(const CollectiveHeader& mine) {
  // Every process reads the same table, so every process throws the same
  // error, naming rank 0 and the first rank that differs from it.
  const CollectiveHeader& a = table_[0];
  for (int r = 1; r < size(); ++r) {
    const CollectiveHeader& b = table_[r];
    if (same_call(a, b)) continue;
    std::string message;
    if (a.seq != b.seq) {
      message = "collectives out of step: " + tasks_[0] + " is at collective #" + std::to_string(a.seq) + " (" +
                kind_name(a.kind) + "), " + tasks_[r] + " at #" + std::to_string(b.seq) + " (" +
                kind_name(b.kind) + ")";
      // Numbering never realigns: nothing later can be trusted.
      broken_ = "this job's collectives are broken since collective #" + std::to_string(mine.seq) + " (" + message +
                "); restart the job";
    } else if (a.kind == b.kind && a.layout != b.layout && (a.layout == 0 || b.layout == 0)) {
      const int batch = a.layout != 0 ? 0 : r;
      message = "collective #" + std::to_string(a.seq) + ": " + tasks_[batch] + " calls batch_all_reduce, " +
                tasks_[batch == 0 ? r : 0] + " calls all_reduce (" + describe(a) + ")";
    } else if (a.kind == b.kind && a.layout != b.layout) {
      message = "batch_all_reduce #" + std::to_string(a.seq) + ": " + tasks_[0] + " and " + tasks_[r] +
                " pass batches that differ in their tensors' sizes or dtypes, or in bytes_per_pack / num_packs";
    } else if (a.kind != b.kind) {
      message = "collective #" + std::to_string(a.seq) + ": " + tasks_[0] + " calls " + kind_name(a.kind) + " (" +
                describe(a) + "), " + tasks_[r] + " calls " + kind_name(b.kind) + " (" + describe(b) + ")";
    } else {
      // A pack of a batch (both batches have the same layout) or a single collective.
      message = std::string(a.layout != 0 ? "batch_all_reduce" : kind_name(a.kind)) + " #" + std::to_string(a.seq) +
                ": " + tasks_[0] + " passes " + describe(a) + ", " + tasks_[r] + " passes " + describe(b);
    }
    throw CollectiveMismatch(message +
                             "; every worker must run the same collectives in the same order, with the same sizes, "
                             "dtypes, ops and roots (no data was exchanged)");
  }
}

void GlooCommunicator::on_wait(const std::vector<int>& missing) {
  check_peers();
  if (!wait_hook_) return;
  WaitReport report;
  report.collective = std::string(kind_name(current_kind_)) + " #" + std::to_string(seq_);
  const auto waited = Clock::now() - wait_start_;
  report.waited_s = std::chrono::duration<double>(waited).count();
  if (stall_period_.count() > 0 && waited >= next_stall_) {
    report.stalled = true;
    next_stall_ = waited + stall_period_;
  }
  for (int r : missing) report.missing.push_back(tasks_[r]);
  wait_hook_(report);
}

void GlooCommunicator::interrupted(const std::string& what, const Interrupted& cause) {
  const std::string at = what + " #" + std::to_string(seq_);
  try {
    const std::string record = static_cast<char>('0' + static_cast<int>(Verdict::kUnknown)) + std::string("task ") +
                               tasks_[rank_] + " was interrupted (" + cause.what() + ") in " + at;
    store_->set(prefix_ + "failed/" + std::to_string(rank_), std::vector<char>(record.begin(), record.end()));
  } catch (const std::exception&) {
    // The store is gone; peers will find out themselves.
  }
  // Peers waiting for us fail at once instead of at their timeout.
  if (shm_) shm_->abort();
  drop_transport();
  broken_ = "this job's collectives are broken since " + at + ": task " + tasks_[rank_] + " was interrupted (" +
            cause.what() + "); restart the job";
  throw cause;
}

// Closes every pair, then drops the header buffers and the context. A pair
// delivers completions into our buffers under its own lock, and close() takes
// that lock: once it returns, nothing in Gloo still signals a buffer that a
// failed collective left a receive posted on, so the buffers (headers and
// the data stages kept from the last call) can go.
void GlooCommunicator::drop_transport() {
  if (context_) {
    for (int r = 0; r < size(); ++r) {
      if (r == rank_) continue;
      try {
        auto& pair = context_->getPair(r);
        if (pair) pair->close();
      } catch (const std::exception&) {
        // Already closed or never connected: nothing left to wait out.
      }
    }
  }
  data_buffers_.clear();
  header_out_.reset();
  header_in_.reset();
  context_.reset();
}

// The task that serves the store stays, at most a couple of seconds, until
// every live peer has read the diagnosis: each publishes its own record right
// after reading. Leaving at once would take the store along (the process
// exits on the error) and make a slower peer blame this task as gone.
void GlooCommunicator::linger_for_peers() {
  if (store_->server_task() != tasks_[rank_]) return;
  try {
    const std::vector<TaskState> tasks = store_->status();
    std::vector<std::string> records;
    for (int r = 0; r < size() && r < static_cast<int>(tasks.size()); ++r)
      if (r != rank_ && !(tasks[r].departed && !tasks[r].connected))
        records.push_back(prefix_ + "failed/" + std::to_string(r));
    if (!records.empty()) store_->wait(records, std::chrono::milliseconds(2000));
  } catch (const std::exception&) {
    // Our own store cannot answer: there is nothing left to wait for.
  }
}

void GlooCommunicator::fail(const char* what, const std::exception& cause) {
  const bool timed_out = std::strstr(cause.what(), "Timed out") != nullptr || dynamic_cast<const PeerTimeout*>(&cause);
  Verdict verdict = Verdict::kUnknown;
  const std::string who = diagnose(seq_, timed_out, &verdict);
  // A peer woken by our abort below reads our finding instead of blaming us.
  try {
    const std::string record = static_cast<char>('0' + static_cast<int>(verdict)) + who;
    store_->set(prefix_ + "failed/" + std::to_string(rank_), std::vector<char>(record.begin(), record.end()));
  } catch (const std::exception&) {
    // The store is gone too; peers will find that out themselves.
  }
  // Closing every pair (and waking every shared-memory waiter) makes peers
  // blocked on us fail at once instead of at their own timeout.
  if (shm_) shm_->abort();
  drop_transport();
  linger_for_peers();
  broken_ = "this job's collectives are broken since " + std::string(what) + " #" + std::to_string(seq_) +
            " (failed on task " + tasks_[rank_] + ": " + who + " [" + cause.what() +
            "]); restart the job (from a checkpoint)";
  if (verdict == Verdict::kBehind || (verdict == Verdict::kUnknown && timed_out)) throw PeerTimeout(broken_);
  throw PeerLost(broken_);
}

std::string GlooCommunicator::diagnose(std::int64_t seq, bool timed_out, Verdict* verdict) {
  // A socket error can reach us a moment before the store sees the same
  // death, so look again for a little while before blaming nobody. After a
  // timeout there is no such race: a death would have been seen long ago.
  for (int attempt = 0;; ++attempt) {
    std::vector<TaskState> tasks;
    std::vector<std::string> records;
    for (int r = 0; r < size(); ++r) records.push_back(prefix_ + "failed/" + std::to_string(r));
    try {
      tasks = store_->status();
      const auto missing = store_->wait(records, std::chrono::milliseconds(0));
      // A peer that gave up first has named the culprits already.
      for (int r = 0; r < size(); ++r) {
        if (r == rank_ || std::find(missing.begin(), missing.end(), records[r]) != missing.end()) continue;
        const auto record = store_->get(records[r]);
        *verdict = static_cast<Verdict>(record.at(0) - '0');
        return std::string(record.begin() + 1, record.end()) + " (found by " + tasks_[r] + ", which gave up first)";
      }
    } catch (const PeerTimeout&) {
      *verdict = Verdict::kBehind;  // alive but silent: not "gone"
      return "task " + store_->server_task() + " (which serves the rendezvous store) is not responding: it is "
             "stopped (e.g. SIGSTOP), hung or overloaded";
    } catch (const std::exception&) {
      *verdict = Verdict::kGone;
      return "task " + store_->server_task() + " (which serves the rendezvous store) is gone";
    }
    // Frozen ourselves for about the timeout (our store's loop saw it): the
    // peers gave up on us, so whoever left did nothing wrong.
    const auto pause = recent_pause(std::chrono::seconds(10));  // we fail right after resuming
    if (call_timeout_.count() > 0 && pause * 2 >= call_timeout_ && pause.count() > 0) {
      *verdict = Verdict::kBehind;
      return "this task (" + tasks_[rank_] + ") was frozen for " + seconds(pause) +
             " (SIGSTOP, or a stalled machine), about the collective's timeout of " + seconds(call_timeout_) +
             " or longer, so its peers gave up waiting for it";
    }
    std::vector<std::string> gone, behind;
    for (int r = 0; r < size() && r < static_cast<int>(tasks.size()); ++r) {
      if (r == rank_) continue;
      if (tasks[r].departed && !tasks[r].connected) gone.push_back(tasks_[r]);
      else if (tasks[r].progress < seq)
        behind.push_back(tasks_[r]);
    }
    if (!gone.empty()) {
      *verdict = Verdict::kGone;
      return "task(s) " + join(gone) + " are gone (process exited or host unreachable)";
    }
    if (timed_out || attempt >= 10) {
      if (!behind.empty()) {
        *verdict = Verdict::kBehind;
        return "task(s) " + join(behind) + " did not reach this collective" +
               (timed_out && call_timeout_.count() > 0 ? " within its timeout of " + seconds(call_timeout_) : "");
      }
      *verdict = Verdict::kUnknown;
      return "every task reached this collective; a peer aborted it after a failure of its own";
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

// Gloo's collective functions (gloo::allreduce, allgather, broadcast, reduce)
// create their transport buffers on every call and destroy them on return;
// this Gloo's buffer destructor spins in sched_yield() until Gloo's I/O
// thread has let go of the buffer, and on a busy machine that yield hands the
// core to another process for a whole scheduler tick: a floor of about 4 ms
// (one tick; 8 ms for two buffers) under every call. The data stages below
// are our own, over the same pairs, and keep their buffers until the next
// data stage, long after the I/O thread is done with them.
gloo::transport::UnboundBuffer* GlooCommunicator::data_buffer(void* ptr, std::size_t bytes) {
  data_buffers_.push_back(context_->createUnboundBuffer(ptr, bytes));
  return data_buffers_.back().get();
}

namespace {
void wait_recv(gloo::transport::UnboundBuffer* b, std::chrono::milliseconds timeout) {
  // Nothing aborts these waits: false cannot come back, but never read a half-filled buffer.
  if (!b->waitRecv(nullptr, timeout)) throw PeerLost("a Gloo receive was aborted");
}
void wait_send(gloo::transport::UnboundBuffer* b, std::chrono::milliseconds timeout) {
  if (!b->waitSend(nullptr, timeout)) throw PeerLost("a Gloo send was aborted");
}
}  // namespace

void GlooCommunicator::all_gather_blocks(char* base, const std::vector<std::size_t>& offset,
                                         const std::vector<std::size_t>& bytes, std::uint32_t tag,
                                         std::chrono::milliseconds timeout) {
  std::size_t total = 0;
  for (int r = 0; r < size(); ++r) total = std::max(total, offset[r] + bytes[r]);
  auto* buf = data_buffer(base, total);
  const std::uint64_t slot = gloo::Slot::build(kDataSlotPrefix, tag);
  int recvs = 0, sends = 0;
  for (int r = 0; r < size(); ++r)
    if (r != rank_ && bytes[r] > 0) buf->recv(r, slot, offset[r], bytes[r]), ++recvs;
  // Peers in ring order from this rank: not everyone sends to rank 0 first.
  for (int i = 1; i < size() && bytes[rank_] > 0; ++i)
    buf->send((rank_ + i) % size(), slot, offset[rank_], bytes[rank_]), ++sends;
  for (int i = 0; i < recvs; ++i) wait_recv(buf, timeout);
  for (int i = 0; i < sends; ++i) wait_send(buf, timeout);
}

void GlooCommunicator::reduce_scatter_ring(char* acc, std::size_t count, std::size_t elem, ReduceFn fn,
                                           std::uint32_t tag, std::chrono::milliseconds timeout) {
  const int p = size(), right = (rank_ + 1) % p, left = (rank_ + p - 1) % p;
  std::size_t largest = 0;
  for (int c = 0; c < p; ++c) largest = std::max(largest, chunk_begin(count, c + 1) - chunk_begin(count, c));
  ring_in_.resize(largest * elem);
  auto* out = data_buffer(acc, count * elem);
  auto* in = data_buffer(ring_in_.data(), ring_in_.size());
  const std::uint64_t slot = gloo::Slot::build(kDataSlotPrefix, tag);
  // Step s: send chunk rank - s to the right, add chunk rank - s - 1 from the
  // left into ours. After p - 1 steps chunk rank + 1 holds every process's part.
  for (int s = 0; s < p - 1; ++s) {
    const int send_c = (rank_ - s + 2 * p) % p, recv_c = (rank_ - s - 1 + 2 * p) % p;
    const std::size_t s0 = chunk_begin(count, send_c), s1 = chunk_begin(count, send_c + 1);
    const std::size_t r0 = chunk_begin(count, recv_c), r1 = chunk_begin(count, recv_c + 1);
    if (r1 > r0) in->recv(left, slot, 0, (r1 - r0) * elem);
    if (s1 > s0) out->send(right, slot, s0 * elem, (s1 - s0) * elem);
    if (r1 > r0) {
      wait_recv(in, timeout);
      fn(acc + r0 * elem, acc + r0 * elem, ring_in_.data(), r1 - r0);
    }
    if (s1 > s0) wait_send(out, timeout);
  }
}

// The network stage of an all-reduce: acc holds this process's combined
// replicas and receives the job's reduction (a MEAN is left as the SUM; the
// caller divides). The caller holds mu_.
void GlooCommunicator::reduce_across(void* acc, std::size_t count, DType dtype, ReduceOp op, Algorithm algorithm,
                                     ReduceOp agreed, std::uint64_t layout) {
  if (size() == 1) return;
  const std::size_t bytes = count * dtype_size(dtype);
  const auto combine_fn = reduce_kernels().combine[static_cast<int>(dtype)][static_cast<int>(combining_op(op))];
  CollectiveHeader h = header(CollectiveHeader::kAllReduce);
  h.count = count;
  h.dtype = static_cast<std::uint8_t>(dtype);
  h.op = static_cast<std::uint8_t>(agreed);
  h.algorithm = static_cast<std::uint8_t>(algorithm);
  h.layout = layout;
  // Tiny buffers ride in the headers: once they are agreed, every process
  // combines every contribution in rank order, so every process gets the same bits.
  const bool tiny = bytes <= inline_capacity() && (algorithm == Algorithm::kAuto || algorithm == Algorithm::kDirect);
  if (tiny && count > 0) set_payload(h, acc, bytes);
  // Small buffers are latency-bound: one all-gather round and a local
  // reduction beats the ring's 2(p-1) rounds. (With fewer elements than
  // processes most ring segments are empty: ring wins.)
  const bool direct = algorithm == Algorithm::kDirect ||
                      (algorithm == Algorithm::kAuto && bytes <= kDirectMaxBytes && count >= std::size_t(size()));
  collective(h, [&](std::uint32_t tag, std::chrono::milliseconds timeout) {
    if (count == 0) return;
    if (tiny) {
      // Into scratch: acc is this rank's payload, read for every rank in turn.
      scratch_.resize(bytes);
      combine_fn(scratch_.data(), payload(0), payload(1), count);
      for (int r = 2; r < size(); ++r) combine_fn(scratch_.data(), scratch_.data(), payload(r), count);
      std::memcpy(acc, scratch_.data(), bytes);
    } else if (shm_ && algorithm == Algorithm::kAuto) {
      shm_->all_reduce(acc, count, dtype, op, after(timeout),
                       [this](const std::vector<int>& missing) { on_wait(missing); });
    } else if (direct) {
      gathered_.resize(bytes * size());
      std::memcpy(gathered_.data() + rank_ * bytes, acc, bytes);
      std::vector<std::size_t> offset(size()), sizes(size(), bytes);
      for (int r = 0; r < size(); ++r) offset[r] = r * bytes;
      all_gather_blocks(gathered_.data(), offset, sizes, tag, timeout);
      combine_fn(acc, gathered_.data(), gathered_.data() + bytes, count);
      for (int r = 2; r < size(); ++r) combine_fn(acc, acc, gathered_.data() + r * bytes, count);
    } else if (algorithm != Algorithm::kTree) {
      // Ring: reduce-scatter, then every process passes the chunks it has
      // completed to its right, p - 1 steps (2 (p - 1) / p of the buffer sent per process).
      const std::size_t elem = dtype_size(dtype);
      char* a = static_cast<char*>(acc);
      reduce_scatter_ring(a, count, elem, combine_fn, tag, timeout);
      const int p = size(), right = (rank_ + 1) % p, left = (rank_ + p - 1) % p;
      auto* buf = data_buffer(a, bytes);
      const std::uint64_t slot = gloo::Slot::build(kDataSlotPrefix, tag) + std::uint8_t{1};
      for (int s = 0; s < p - 1; ++s) {
        const int send_c = (owned_chunk(rank_) - s + p) % p, recv_c = (owned_chunk(left) - s + p) % p;
        const std::size_t s0 = chunk_begin(count, send_c), s1 = chunk_begin(count, send_c + 1);
        const std::size_t r0 = chunk_begin(count, recv_c), r1 = chunk_begin(count, recv_c + 1);
        if (r1 > r0) buf->recv(left, slot, r0 * elem, (r1 - r0) * elem);
        if (s1 > s0) buf->send(right, slot, s0 * elem, (s1 - s0) * elem);
        if (r1 > r0) wait_recv(buf, timeout);
        if (s1 > s0) wait_send(buf, timeout);
      }
    } else {
      gloo::AllreduceOptions o(context_);
      with_element(dtype_size(dtype), [&](auto t) { o.setOutput(static_cast<decltype(t)*>(acc), count); });
      o.setReduceFunction(combine_fn);
      // "tree": Gloo's bcube, log(p) rounds (at Gloo's per-call buffer cost, see data_buffer).
      o.setAlgorithm(gloo::AllreduceOptions::Algorithm::BCUBE);
      o.setTag(tag);
      o.setTimeout(timeout);
      gloo::allreduce(o);
    }
  });
}

void GlooCommunicator::all_reduce_as(int n, const void* const* in, void* const* out, std::size_t count, DType dtype,
                                     ReduceOp op, Algorithm algorithm, ReduceOp agreed) {
  check_replicas(n, "all_reduce");
  const std::size_t bytes = count * dtype_size(dtype);
  // out[0] is written before the other inputs are read: an output aliasing
  // another replica's input (or part of its own) is computed in scratch.
  const OutputStaging staging("all_reduce", n, in, bytes, out, bytes, {});
  out = staging.outputs();
  std::lock_guard<std::mutex> lock(mu_);
  void* acc = out[0];
  combine_local(n, in, acc, 0, count, dtype, op);
  reduce_across(acc, count, dtype, op, algorithm, agreed, 0);
  if (op == ReduceOp::kMean && count > 0) reduce_kernels().divide[static_cast<int>(dtype)](acc, count, n * size());
  for (int i = 1; i < n; ++i)
    if (out[i] != acc) std::memcpy(out[i], acc, bytes);
  staging.finish();
}

std::uint64_t GlooCommunicator::batch_layout(int ntensors, const std::size_t* counts, const DType* dtypes,
                                             std::size_t bytes_per_pack, int num_packs) {
  std::uint64_t h = 0xcbf29ce484222325ull;
  h = fnv1a(h, static_cast<std::uint64_t>(ntensors));
  for (int t = 0; t < ntensors; ++t) h = fnv1a(fnv1a(h, counts[t]), static_cast<std::uint64_t>(dtypes[t]));
  h = fnv1a(fnv1a(h, bytes_per_pack), static_cast<std::uint64_t>(num_packs));
  return h | 1;  // never 0, which marks a plain all_reduce
}

const std::vector<Pack>& GlooCommunicator::packs_for(int ntensors, const std::size_t* counts, const DType* dtypes,
                                                     std::size_t bytes_per_pack, int num_packs) {
  // A training loop reduces the same gradient list every step: replan only when the layout changes.
  const std::uint64_t layout = batch_layout(ntensors, counts, dtypes, bytes_per_pack, num_packs);
  bool same = layout == batch_.layout && batch_.bytes.size() == static_cast<std::size_t>(ntensors);
  for (int t = 0; same && t < ntensors; ++t)
    same = batch_.dtypes[t] == dtypes[t] && batch_.bytes[t] == counts[t] * dtype_size(dtypes[t]);
  if (!same) {
    batch_.layout = layout;
    batch_.dtypes.assign(dtypes, dtypes + ntensors);
    batch_.bytes.resize(ntensors);
    for (int t = 0; t < ntensors; ++t) batch_.bytes[t] = counts[t] * dtype_size(dtypes[t]);
    batch_.packs = plan_packs(batch_.bytes, batch_.dtypes, bytes_per_pack, num_packs);
    std::size_t largest = 0;
    for (const Pack& p : batch_.packs) largest = std::max(largest, p.bytes);
    if (fusion_.size() < largest) fusion_.resize(largest);
  }
  return batch_.packs;
}

void GlooCommunicator::batch_all_reduce(int n, int ntensors, const void* const* in, void* const* out,
                                        const std::size_t* counts, const DType* dtypes, ReduceOp op,
                                        std::size_t bytes_per_pack, int num_packs, Algorithm algorithm,
                                        ReduceOp agreed) {
  check_replicas(n, "batch_all_reduce");
  if (ntensors < 0) throw std::invalid_argument("batch_all_reduce: ntensors must be >= 0");
  if (ntensors == 0) return;
  std::lock_guard<std::mutex> lock(mu_);
  const std::vector<Pack>& packs = packs_for(ntensors, counts, dtypes, bytes_per_pack, num_packs);
  std::vector<const void*> column(n);  // tensor t of every local replica
  for (const Pack& p : packs) {
    // A pack's inputs are all read into the fusion buffer before any of its outputs is written.
    char* acc = fusion_.data();
    for (const PackEntry& e : p.entries) {
      if (e.bytes == 0) continue;  // an empty tensor: nothing to read (its pointer may be null)
      for (int k = 0; k < n; ++k) column[k] = in[k * ntensors + e.tensor];
      combine_local(n, column.data(), acc + e.offset, 0, counts[e.tensor], p.dtype, op);
    }
    const std::size_t count = p.bytes / dtype_size(p.dtype);
    // Every pack carries the whole batch's layout: workers whose batches differ all raise at the first pack.
    reduce_across(acc, count, p.dtype, op, algorithm, agreed, batch_.layout);
    if (op == ReduceOp::kMean && count > 0) reduce_kernels().divide[static_cast<int>(p.dtype)](acc, count, n * size());
    for (const PackEntry& e : p.entries)
      for (int k = 0; k < n; ++k)
        if (e.bytes) std::memcpy(out[k * ntensors + e.tensor], acc + e.offset, e.bytes);
  }
}

void GlooCommunicator::broadcast(int n, const void* const* in, void* const* out, std::size_t count, DType dtype,
                                 int root) {
  check_replicas(n, "broadcast");
  if (root < 0 || root >= n * size())
    throw std::invalid_argument("broadcast: root=" + std::to_string(root) + " is not a replica of this job (0.." +
                                std::to_string(n * size() - 1) + ")");
  const int root_rank = root / n, root_local = root % n;
  const std::size_t bytes = count * dtype_size(dtype);
  // Only the root's input is read (on its process); an output that equals it is fine.
  const OutputStaging staging("broadcast", n, in, bytes, out, bytes, {root_local, -1, true});
  out = staging.outputs();
  std::lock_guard<std::mutex> lock(mu_);
  void* mine = rank_ == root_rank ? out[root_local] : out[0];
  if (rank_ == root_rank && mine != in[root_local]) std::memcpy(mine, in[root_local], bytes);
  if (size() > 1) {
    CollectiveHeader h = header(CollectiveHeader::kBroadcast);
    h.count = count;
    h.dtype = static_cast<std::uint8_t>(dtype);
    h.root = root;
    const bool tiny = bytes <= inline_capacity();
    if (tiny && rank_ == root_rank) set_payload(h, mine, bytes);
    collective(h, [&](std::uint32_t tag, std::chrono::milliseconds timeout) {
      if (bytes == 0) return;
      if (tiny) {
        if (rank_ != root_rank) std::memcpy(mine, payload(root_rank), bytes);
        return;
      }
      // The root sends to every peer (in ring order from itself).
      auto* buf = data_buffer(mine, bytes);
      const std::uint64_t slot = gloo::Slot::build(kDataSlotPrefix, tag);
      if (rank_ != root_rank) {
        buf->recv(root_rank, slot, 0, bytes);
        wait_recv(buf, timeout);
        return;
      }
      for (int i = 1; i < size(); ++i) buf->send((rank_ + i) % size(), slot, 0, bytes);
      for (int i = 1; i < size(); ++i) wait_send(buf, timeout);
    });
  }
  for (int i = 0; i < n; ++i)
    if (out[i] != mine) std::memcpy(out[i], mine, bytes);
  staging.finish();
}

void GlooCommunicator::reduce_as(int n, const void* const* in, void* const* out, std::size_t count, DType dtype,
                                 ReduceOp op, int root, ReduceOp agreed) {
  check_replicas(n, "reduce");
  if (root < 0 || root >= n * size())
    throw std::invalid_argument("reduce: root=" + std::to_string(root) + " is not a replica of this job (0.." +
                                std::to_string(n * size() - 1) + ")");
  const int root_rank = root / n, root_local = root % n;
  const bool is_root = rank_ == root_rank;
  const std::size_t bytes = count * dtype_size(dtype);
  // Only the root's process writes an output (out[root_local]), after reading every input.
  const OutputStaging staging("reduce", n, in, bytes, out, is_root ? bytes : 0, {-1, root_local, false});
  out = staging.outputs();
  std::lock_guard<std::mutex> lock(mu_);
  // Outputs other than the root's stay untouched, so other processes reduce into scratch.
  if (!is_root) scratch_.resize(bytes);
  void* acc = is_root ? out[root_local] : static_cast<void*>(scratch_.data());
  combine_local(n, in, acc, is_root ? root_local : 0, count, dtype, op);
  const auto combine_fn = reduce_kernels().combine[static_cast<int>(dtype)][static_cast<int>(combining_op(op))];
  if (size() > 1) {
    CollectiveHeader h = header(CollectiveHeader::kReduce);
    h.count = count;
    h.dtype = static_cast<std::uint8_t>(dtype);
    h.op = static_cast<std::uint8_t>(agreed);
    h.root = root;
    const bool tiny = bytes <= inline_capacity();
    if (tiny && count > 0) set_payload(h, acc, bytes);
    collective(h, [&](std::uint32_t tag, std::chrono::milliseconds timeout) {
      if (count == 0) return;
      if (tiny) {
        if (!is_root) return;
        std::vector<char> sum(bytes);
        combine_fn(sum.data(), payload(0), payload(1), count);
        for (int r = 2; r < size(); ++r) combine_fn(sum.data(), sum.data(), payload(r), count);
        std::memcpy(acc, sum.data(), bytes);
        return;
      }
      // Ring reduce-scatter, then every process sends the chunk it completed to the root.
      const std::size_t elem = dtype_size(dtype);
      char* a = static_cast<char*>(acc);
      reduce_scatter_ring(a, count, elem, combine_fn, tag, timeout);
      auto* buf = data_buffer(a, bytes);
      const std::uint64_t slot = gloo::Slot::build(kDataSlotPrefix, tag) + std::uint8_t{1};
      auto chunk = [&](int r) {
        const int c = owned_chunk(r);
        return std::make_pair(chunk_begin(count, c) * elem, (chunk_begin(count, c + 1) - chunk_begin(count, c)) * elem);
      };
      if (!is_root) {
        const auto [at, len] = chunk(rank_);
        if (len == 0) return;
        buf->send(root_rank, slot, at, len);
        wait_send(buf, timeout);
        return;
      }
      int recvs = 0;
      for (int r = 0; r < size(); ++r) {
        const auto [at, len] = chunk(r);
        if (r != rank_ && len > 0) buf->recv(r, slot, at, len), ++recvs;
      }
      for (int i = 0; i < recvs; ++i) wait_recv(buf, timeout);
    });
  }
  if (is_root && op == ReduceOp::kMean && count > 0)
    reduce_kernels().divide[static_cast<int>(dtype)](acc, count, n * size());
  staging.finish();
}

std::vector<std::uint64_t> GlooCommunicator::exchange(const std::vector<std::uint64_t>& mine,
                                                      CollectiveHeader::Kind kind) {
  std::lock_guard<std::mutex> lock(mu_);
  return exchange_locked(mine, kind);
}

std::vector<std::uint64_t> GlooCommunicator::exchange_locked(const std::vector<std::uint64_t>& mine,
                                                             CollectiveHeader::Kind kind) {
  if (size() == 1 || mine.empty()) return mine;
  std::vector<std::uint64_t> in(mine), all(mine.size() * size());
  const std::size_t bytes = mine.size() * sizeof(std::uint64_t);
  CollectiveHeader h = header(kind);
  h.count = mine.size();
  h.dtype = static_cast<std::uint8_t>(DType::kInt64);
  const bool tiny = bytes <= inline_capacity();
  if (tiny) set_payload(h, in.data(), bytes);
  collective(h, [&](std::uint32_t tag, std::chrono::milliseconds timeout) {
    if (tiny) {
      for (int r = 0; r < size(); ++r) std::memcpy(all.data() + r * mine.size(), payload(r), bytes);
      return;
    }
    std::memcpy(all.data() + rank_ * mine.size(), in.data(), bytes);
    std::vector<std::size_t> offset(size()), sizes(size(), bytes);
    for (int r = 0; r < size(); ++r) offset[r] = r * bytes;
    all_gather_blocks(reinterpret_cast<char*>(all.data()), offset, sizes, tag, timeout);
  });
  return all;
}

void GlooCommunicator::all_gather(int n, const void* const* in, void* const* out, const std::size_t* row_bytes,
                                  std::size_t outer) {
  check_replicas(n, "all_gather");
  // Every process learns every process's row count and row sizes first.
  std::vector<std::uint64_t> mine{outer};
  mine.insert(mine.end(), row_bytes, row_bytes + n);
  std::vector<std::uint64_t> job_rows;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const auto all = exchange_locked(mine, CollectiveHeader::kAllGather);
    const std::size_t stride = n + 1;
    for (int r = 0; r < size(); ++r) {
      if (all[r * stride] != all[0])
        throw CollectiveMismatch("all_gather #" + std::to_string(seq_) + ": " + tasks_[0] + " has " +
                                 std::to_string(all[0]) + " rows before the gather axis, " + tasks_[r] + " has " +
                                 std::to_string(all[r * stride]) +
                                 "; shapes may differ along the gather axis only (no data was exchanged)");
      job_rows.insert(job_rows.end(), all.begin() + r * stride + 1, all.begin() + (r + 1) * stride);
    }
  }
  all_gather_planned(n, in, out, job_rows.data(), outer);
}

namespace {
// A shape as Python prints a tuple: "(2, 3)", "(5,)".
std::string shape_text(const std::uint64_t* dims, std::size_t ndim) {
  std::string text = "(";
  for (std::size_t d = 0; d < ndim; ++d) text += (d ? ", " : "") + std::to_string(dims[d]);
  return text + (ndim == 1 ? ",)" : ")");
}
}  // namespace

std::vector<std::uint64_t> GlooCommunicator::agree_gather(int n, DType dtype, int axis,
                                                          const std::vector<std::vector<std::uint64_t>>& shapes) {
  check_replicas(n, "all_gather");
  if (static_cast<int>(shapes.size()) != n) throw std::invalid_argument("all_gather: one shape per local replica");
  const std::size_t ndim = shapes[0].size();
  if (ndim == 0 || ndim > kMaxGatherDims || axis < 0 || static_cast<std::size_t>(axis) >= ndim)
    throw std::invalid_argument("all_gather: shapes need 1.." + std::to_string(kMaxGatherDims) +
                                " dimensions and an axis among them");
  // The record: ndim, dtype, axis, then each local replica's shape padded to kMaxGatherDims.
  const std::size_t width = 3 + kMaxGatherDims * n;
  std::vector<std::uint64_t> mine(width, 0);
  mine[0] = ndim;
  mine[1] = static_cast<std::uint64_t>(dtype);
  mine[2] = static_cast<std::uint64_t>(axis);
  for (int j = 0; j < n; ++j) {
    if (shapes[j].size() != ndim) throw std::invalid_argument("all_gather: local shapes differ in rank");
    std::copy(shapes[j].begin(), shapes[j].end(), mine.begin() + 3 + kMaxGatherDims * j);
  }
  const std::vector<std::uint64_t> table = exchange(mine, CollectiveHeader::kAllGather);
  // Every process checks the same table, so every process raises the same error.
  const std::uint64_t* head = table.data();
  const auto dims = [&](int w, int j) { return table.data() + w * width + 3 + kMaxGatherDims * j; };
  const auto agrees = [&](int w) {
    const std::uint64_t* row = table.data() + w * width;
    if (row[0] != head[0] || row[1] != head[1] || row[2] != head[2]) return false;
    for (int j = 0; j < n; ++j)
      for (std::size_t d = 0; d < ndim; ++d)
        if (d != static_cast<std::size_t>(axis) && dims(w, j)[d] != dims(0, 0)[d]) return false;
    return true;
  };
  const auto call = [&](int w) {
    const std::uint64_t* row = table.data() + w * width;
    const std::string name = row[1] < static_cast<std::uint64_t>(kNumDTypes)
                                 ? dtype_name(static_cast<DType>(row[1]))
                                 : "dtype code " + std::to_string(row[1]);
    std::string listed;
    for (int j = 0; j < n; ++j)
      listed += (j ? ", " : "") + shape_text(dims(w, j), std::min<std::size_t>(row[0], kMaxGatherDims));
    return name + " buffers of shape " + listed + " gathered along axis " + std::to_string(row[2]);
  };
  for (int w = 0; w < size(); ++w)  // this process's own replicas too
    if (!agrees(w))
      throw CollectiveMismatch("all_gather #" + std::to_string(seq_) + ": " + tasks_[0] + " passes " + call(0) + ", " +
                               tasks_[w] + " passes " + call(w) +
                               "; every worker must pass the same dtype, number of dimensions and axis, and shapes "
                               "may differ along the gather axis only (no data was exchanged)");
  std::vector<std::uint64_t> extents;
  for (int w = 0; w < size(); ++w)
    for (int j = 0; j < n; ++j) extents.push_back(dims(w, j)[axis]);
  return extents;
}

void GlooCommunicator::all_gather_planned(int n, const void* const* in, void* const* out,
                                          const std::uint64_t* job_row_bytes, std::size_t outer) {
  check_replicas(n, "all_gather");
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::size_t> block(size(), 0);  // bytes contributed by each process
  for (int r = 0; r < size(); ++r)
    for (int j = 0; j < n; ++j) block[r] += outer * job_row_bytes[r * n + j];
  // This process's contribution: each local replica's whole buffer in turn.
  std::vector<std::size_t> offset(size(), 0);
  std::size_t total = 0;
  for (int r = 0; r < size(); ++r) offset[r] = total, total += block[r];
  gathered_.resize(total);
  std::size_t at = offset[rank_];
  for (int j = 0; j < n; ++j) {
    const std::size_t b = outer * job_row_bytes[rank_ * n + j];
    std::memcpy(gathered_.data() + at, in[j], b);
    at += b;
  }
  if (size() > 1 && total > 0) {
    // The data stage of the collective whose size table was just agreed.
    continue_collective("all_gather", [&](std::uint32_t tag, std::chrono::milliseconds timeout) {
      all_gather_blocks(gathered_.data(), offset, block, tag, timeout);
    });
  }
  // Interleave rows: row r of the result is row r of every replica of the job in order.
  char* dst = static_cast<char*>(out[0]);
  for (std::size_t row = 0; row < outer; ++row) {
    const char* base = gathered_.data();
    for (int r = 0; r < size(); ++r) {
      const char* replica = base;
      for (int j = 0; j < n; ++j) {
        const std::size_t rb = job_row_bytes[r * n + j];
        std::memcpy(dst, replica + row * rb, rb);
        dst += rb;
        replica += outer * rb;
      }
      base += block[r];
    }
  }
  for (int i = 1; i < n; ++i) std::memcpy(out[i], out[0], total);
}

void GlooCommunicator::barrier() {
  std::lock_guard<std::mutex> lock(mu_);
  if (size() == 1) return;
  // Agreeing on the headers is a barrier already.
  CollectiveHeader h = header(CollectiveHeader::kBarrier);
  collective(h, [](std::uint32_t, std::chrono::milliseconds) {});
}

}  // namespace mirrored::net
