#include "net/gloo_communicator.h"

#include <gloo/allgather.h>
#include <gloo/allgatherv.h>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/reduce.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "host/reduce_kernels.h"
#include "net/errors.h"

namespace mirrored::net {
namespace {

// Up to this size "auto" all-reduces with one all-gather round (see all_reduce).
constexpr std::size_t kDirectMaxBytes = 16 << 10;

std::string join(const std::vector<std::string>& names) {
  std::string s;
  for (const auto& n : names) s += (s.empty() ? "" : ", ") + n;
  return s;
}

std::string seconds(std::chrono::milliseconds ms) {
  return std::to_string(ms.count() / 1000) + "." + std::to_string(ms.count() % 1000 / 100) + " s";
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

// Gloo's Store contract over our store client, inside one key namespace.
// Gloo names its keys after ranks, so a key that never appears names a task.
class GlooStore : public gloo::rendezvous::Store {
 public:
  GlooStore(StoreClient& store, std::string prefix, const std::vector<std::string>& tasks)
      : store_(store), prefix_(std::move(prefix)), tasks_(tasks) {}

  void set(const std::string& key, const std::vector<char>& data) override { store_.set(prefix_ + key, data); }

  std::vector<char> get(const std::string& key) override {
    wait({key});
    return store_.get(prefix_ + key);
  }

  void wait(const std::vector<std::string>& keys) override { wait(keys, store_.timeout()); }

  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    std::vector<std::string> full;
    for (const auto& k : keys) full.push_back(prefix_ + k);
    const auto missing = store_.wait(full, timeout);
    if (missing.empty()) return;
    std::vector<std::string> who;
    for (const auto& m : missing) who.push_back(task_of(m.substr(prefix_.size())));
    throw PeerTimeout("connecting the Gloo mesh: " + join(who) + " did not publish an address within " +
                      seconds(timeout) + " (did it crash while starting?)");
  }

 private:
  std::string task_of(const std::string& key) const {
    std::size_t i = key.size();
    while (i > 0 && std::isdigit(static_cast<unsigned char>(key[i - 1]))) --i;
    if (i == key.size()) return "key '" + key + "'";
    const long rank = std::stol(key.substr(i));
    return rank < static_cast<long>(tasks_.size()) ? "task " + tasks_[rank] : "key '" + key + "'";
  }

  StoreClient& store_;
  const std::string prefix_;
  const std::vector<std::string>& tasks_;
};

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

  gloo::transport::tcp::attr attr;
  attr.hostname = host;  // this task's own TF_CONFIG host: Gloo listens there only
  auto device = gloo::transport::tcp::CreateDevice(attr);
  auto context = std::make_shared<gloo::rendezvous::Context>(rank_, size());
  context->setTimeout(store_->timeout());
  GlooStore gloo_store(*store_, prefix_ + "gloo/", tasks_);
  try {
    context->connectFullMesh(gloo_store, device);
  } catch (const gloo::Exception& e) {
    throw PeerLost(std::string("connecting the Gloo mesh failed: ") + e.what());
  }
  context_ = std::move(context);
  setup_shared_memory();
  // Last: a constructor that throws must not leave a running thread behind.
  watchdog_ = std::thread([this] { watch(); });
}

void GlooCommunicator::setup_shared_memory() {
  if (size() == 1) return;
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
  if (env && std::string(env) == "0") me += "/rank " + std::to_string(rank_) + " without shared memory";
  store_->set(prefix_ + "host/" + std::to_string(rank_), std::vector<char>(me.begin(), me.end()));
  std::vector<std::string> keys;
  for (int r = 0; r < size(); ++r) keys.push_back(prefix_ + "host/" + std::to_string(r));
  if (!store_->wait(keys, store_->timeout()).empty()) return;  // cannot happen after connectFullMesh
  for (const auto& k : keys)
    if (store_->get(k) != std::vector<char>(me.begin(), me.end())) return;  // the same answer on every rank
  std::uint64_t ok = 1;
  try {
    shm_ = std::make_unique<ShmReducer>(*store_, prefix_ + "shm", rank_, size(), store_->timeout());
  } catch (const std::exception&) {
    ok = 0;  // e.g. /dev/shm full or absent: every rank falls back to the network
    if (rank_ == 0) store_->set(prefix_ + "shm", {});
  }
  // Everyone learns whether everyone mapped the segment.
  const auto all = exchange_locked({ok});
  if (std::find(all.begin(), all.end(), std::uint64_t{0}) != all.end()) {
    shm_.reset();
    return;
  }
  shm_->unlink();
}

void GlooCommunicator::check_peers() {
  const auto tasks = store_->status();
  for (int r = 0; r < size() && r < static_cast<int>(tasks.size()); ++r)
    if (r != rank_ && tasks[r].departed && !tasks[r].connected) throw PeerLost("task " + tasks_[r] + " is gone");
}

std::string GlooCommunicator::shared_memory_off() const {
  if (shm_) return "";
  if (size() == 1) return "the job has one task";
  const char* env = std::getenv("MIRRORED_SHM");
  if (env && std::string(env) == "0") return "MIRRORED_SHM=0";
  // The identities setup_shared_memory() compared: differing ones mean other hosts (or MIRRORED_SHM=0 there).
  const auto first = store_->get(prefix_ + "host/0");
  for (int r = 1; r < size(); ++r)
    if (store_->get(prefix_ + "host/" + std::to_string(r)) != first)
      return "the tasks run on different hosts (or one has MIRRORED_SHM=0)";
  return "a task could not map a /dev/shm segment";
}

GlooCommunicator::~GlooCommunicator() { close(); }

void GlooCommunicator::close() {
  {
    std::lock_guard<std::mutex> lock(watch_mu_);
    stopping_ = true;
  }
  watch_cv_.notify_all();
  if (watchdog_.joinable()) watchdog_.join();
  std::lock_guard<std::mutex> lock(mu_);
  context_.reset();
  shm_.reset();
  if (broken_.empty()) broken_ = "the communicator was closed";
}

void GlooCommunicator::watch() {
  constexpr std::chrono::milliseconds kTick{50};
  std::int64_t seen = 0, reported = 0;
  std::unique_lock<std::mutex> lock(watch_mu_);
  while (!watch_cv_.wait_for(lock, kTick, [this] { return stopping_; })) {
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

template <typename Fn>
void GlooCommunicator::collective(const char* what, Fn&& fn) {
  if (!broken_.empty())
    throw PeerLost(std::string(what) + ": the multi-worker mesh is down (" + broken_ +
                   "); after a failure restart the job, after close() create a new strategy");
  const std::int64_t seq = ++seq_;
  running_.store(seq, std::memory_order_relaxed);
  try {
    // "No timeout" still needs a finite wait for Gloo; a dead peer is detected
    // through its socket long before this.
    const auto timeout = timeout_.count() > 0 ? timeout_ : std::chrono::hours(24 * 30);
    fn(static_cast<std::uint32_t>(seq), timeout);
  } catch (const std::exception& e) {
    running_.store(0, std::memory_order_relaxed);
    fail(what, e);
  }
  running_.store(0, std::memory_order_relaxed);
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
  context_.reset();
  broken_ = std::string(what) + " across workers failed at collective #" + std::to_string(seq_) + " on task " +
            tasks_[rank_] + ": " + who + " [" + cause.what() + "]";
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
    } catch (const std::exception&) {
      *verdict = Verdict::kGone;
      return "task " + store_->server_task() + " (which serves the rendezvous store) is gone";
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
        return "task(s) " + join(behind) + " did not reach this collective";
      }
      *verdict = Verdict::kUnknown;
      return "every task reached this collective; a peer aborted it after a failure of its own";
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

void GlooCommunicator::all_reduce(int n, const void* const* in, void* const* out, std::size_t count, DType dtype,
                                  ReduceOp op, Algorithm algorithm) {
  check_replicas(n, "all_reduce");
  std::lock_guard<std::mutex> lock(mu_);
  void* acc = out[0];
  combine_local(n, in, acc, 0, count, dtype, op);
  const std::size_t bytes = count * dtype_size(dtype);
  const auto combine_fn = reduce_kernels().combine[static_cast<int>(dtype)][static_cast<int>(combining_op(op))];
  // Small buffers are latency-bound: one all-gather round and a local
  // reduction beats the ring's 2(p-1) rounds. Every process combines the same
  // contributions in rank order, so every process gets the same bits. (With
  // fewer elements than processes most ring segments are empty: ring wins.)
  const bool direct = algorithm == Algorithm::kDirect ||
                      (algorithm == Algorithm::kAuto && bytes <= kDirectMaxBytes && count >= std::size_t(size()));
  if (size() > 1 && count > 0 && shm_ && algorithm == Algorithm::kAuto) {
    collective("all_reduce", [&](std::uint32_t, std::chrono::milliseconds timeout) {
      shm_->all_reduce(acc, count, dtype, op, after(timeout), [this] { check_peers(); });
    });
  } else if (size() > 1 && count > 0 && direct) {
    gathered_.resize(bytes * size());
    collective("all_reduce", [&](std::uint32_t tag, std::chrono::milliseconds timeout) {
      gloo::AllgatherOptions o(context_);
      o.setInput(static_cast<std::uint8_t*>(acc), bytes);
      o.setOutput(reinterpret_cast<std::uint8_t*>(gathered_.data()), gathered_.size());
      o.setTag(tag);
      o.setTimeout(timeout);
      gloo::allgather(o);
    });
    combine_fn(acc, gathered_.data(), gathered_.data() + bytes, count);
    for (int r = 2; r < size(); ++r) combine_fn(acc, acc, gathered_.data() + r * bytes, count);
  } else if (size() > 1 && count > 0) {
    collective("all_reduce", [&](std::uint32_t tag, std::chrono::milliseconds timeout) {
      gloo::AllreduceOptions o(context_);
      with_element(dtype_size(dtype), [&](auto t) { o.setOutput(static_cast<decltype(t)*>(acc), count); });
      o.setReduceFunction(combine_fn);
      // Ring moves 2(p-1)/p of the buffer per process, the bandwidth optimum;
      // bcube ("tree") takes log(p) rounds.
      o.setAlgorithm(algorithm == Algorithm::kTree ? gloo::AllreduceOptions::Algorithm::BCUBE
                                                   : gloo::AllreduceOptions::Algorithm::RING);
      o.setTag(tag);
      o.setTimeout(timeout);
      gloo::allreduce(o);
    });
  }
  if (op == ReduceOp::kMean && count > 0) reduce_kernels().divide[static_cast<int>(dtype)](acc, count, n * size());
  for (int i = 1; i < n; ++i)
    if (out[i] != acc) std::memcpy(out[i], acc, bytes);
}

void GlooCommunicator::broadcast(int n, const void* const* in, void* const* out, std::size_t count, DType dtype,
                                 int root) {
  check_replicas(n, "broadcast");
  if (root < 0 || root >= n * size())
    throw std::invalid_argument("broadcast: root=" + std::to_string(root) + " is not a replica of this job (0.." +
                                std::to_string(n * size() - 1) + ")");
  std::lock_guard<std::mutex> lock(mu_);
  const int root_rank = root / n, root_local = root % n;
  const std::size_t bytes = count * dtype_size(dtype);
  void* mine = rank_ == root_rank ? out[root_local] : out[0];
  if (rank_ == root_rank && mine != in[root_local]) std::memcpy(mine, in[root_local], bytes);
  if (size() > 1 && bytes > 0) {
    collective("broadcast", [&](std::uint32_t tag, std::chrono::milliseconds timeout) {
      gloo::BroadcastOptions o(context_);
      o.setOutput(static_cast<std::uint8_t*>(mine), bytes);
      o.setRoot(root_rank);
      o.setTag(tag);
      o.setTimeout(timeout);
      gloo::broadcast(o);
    });
  }
  for (int i = 0; i < n; ++i)
    if (out[i] != mine) std::memcpy(out[i], mine, bytes);
}

void GlooCommunicator::reduce(int n, const void* const* in, void* const* out, std::size_t count, DType dtype,
                              ReduceOp op, int root) {
  check_replicas(n, "reduce");
  if (root < 0 || root >= n * size())
    throw std::invalid_argument("reduce: root=" + std::to_string(root) + " is not a replica of this job (0.." +
                                std::to_string(n * size() - 1) + ")");
  std::lock_guard<std::mutex> lock(mu_);
  const int root_rank = root / n, root_local = root % n;
  const bool is_root = rank_ == root_rank;
  // Outputs other than the root's stay untouched, so other processes reduce into scratch.
  if (!is_root) scratch_.resize(count * dtype_size(dtype));
  void* acc = is_root ? out[root_local] : static_cast<void*>(scratch_.data());
  combine_local(n, in, acc, is_root ? root_local : 0, count, dtype, op);
  if (size() > 1 && count > 0) {
    collective("reduce", [&](std::uint32_t tag, std::chrono::milliseconds timeout) {
      gloo::ReduceOptions o(context_);
      with_element(dtype_size(dtype), [&](auto t) { o.setOutput(static_cast<decltype(t)*>(acc), count); });
      o.setReduceFunction(reduce_kernels().combine[static_cast<int>(dtype)][static_cast<int>(combining_op(op))]);
      o.setRoot(root_rank);
      o.setTag(tag);
      o.setTimeout(timeout);
      gloo::reduce(o);
    });
  }
  if (is_root && op == ReduceOp::kMean && count > 0)
    reduce_kernels().divide[static_cast<int>(dtype)](acc, count, n * size());
}

std::vector<std::uint64_t> GlooCommunicator::exchange(const std::vector<std::uint64_t>& mine) {
  std::lock_guard<std::mutex> lock(mu_);
  return exchange_locked(mine);
}

std::vector<std::uint64_t> GlooCommunicator::exchange_locked(const std::vector<std::uint64_t>& mine) {
  if (size() == 1 || mine.empty()) return mine;
  std::vector<std::uint64_t> in(mine), all(mine.size() * size());
  collective("exchange", [&](std::uint32_t tag, std::chrono::milliseconds timeout) {
    gloo::AllgatherOptions o(context_);
    o.setInput(in.data(), in.size());
    o.setOutput(all.data(), all.size());
    o.setTag(tag);
    o.setTimeout(timeout);
    gloo::allgather(o);
  });
  return all;
}

void GlooCommunicator::all_gather(int n, const void* const* in, void* const* out, const std::size_t* row_bytes,
                                  std::size_t outer) {
  check_replicas(n, "all_gather");
  std::lock_guard<std::mutex> lock(mu_);
  // Every process learns every process's row count and row sizes first.
  std::vector<std::uint64_t> mine{outer};
  mine.insert(mine.end(), row_bytes, row_bytes + n);
  const auto all = exchange_locked(mine);
  const std::size_t stride = n + 1;
  std::vector<std::size_t> block(size(), 0);  // bytes contributed by each process
  for (int r = 0; r < size(); ++r) {
    if (all[r * stride] != outer)
      throw std::invalid_argument("all_gather: task " + tasks_[r] + " has " + std::to_string(all[r * stride]) +
                                  " rows before the gather axis but " + tasks_[rank_] + " has " +
                                  std::to_string(outer) + "; shapes may differ along the gather axis only");
    for (int j = 0; j < n; ++j) block[r] += outer * all[r * stride + 1 + j];
  }
  // This process's contribution: each local replica's whole buffer in turn.
  scratch_.resize(block[rank_]);
  std::size_t at = 0;
  for (int j = 0; j < n; ++j) {
    std::memcpy(scratch_.data() + at, in[j], outer * row_bytes[j]);
    at += outer * row_bytes[j];
  }
  std::size_t total = 0;
  for (auto b : block) total += b;
  if (size() > 1 && total > 0) {
    gathered_.resize(total);
    collective("all_gather", [&](std::uint32_t tag, std::chrono::milliseconds timeout) {
      gloo::AllgathervOptions o(context_);
      o.setInput(reinterpret_cast<std::uint8_t*>(scratch_.data()), block[rank_]);
      o.setOutput(reinterpret_cast<std::uint8_t*>(gathered_.data()), block);
      o.setTag(tag);
      o.setTimeout(timeout);
      gloo::allgatherv(o);
    });
  } else {
    gathered_.assign(scratch_.begin(), scratch_.end());
  }
  // Interleave rows: row r of the result is row r of every replica of the job in order.
  char* dst = static_cast<char*>(out[0]);
  for (std::size_t row = 0; row < outer; ++row) {
    const char* base = gathered_.data();
    for (int r = 0; r < size(); ++r) {
      const char* replica = base;
      for (int j = 0; j < n; ++j) {
        const std::size_t rb = all[r * stride + 1 + j];
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
  collective("barrier", [&](std::uint32_t tag, std::chrono::milliseconds timeout) {
    gloo::BarrierOptions o(context_);
    o.setTag(tag);
    o.setTimeout(timeout);
    gloo::barrier(o);
  });
}

}  // namespace mirrored::net
