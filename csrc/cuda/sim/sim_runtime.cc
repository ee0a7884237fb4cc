// A simulated CUDA runtime for checking the CUDA executor on a machine
// without a GPU: the runtime calls cuda_ring.cc and device_batch.cc make,
// and reduce_copy, over host memory. Streams are queues; an event wait
// captures the event's latest record, as CUDA's does; drain() runs the
// runnable stream heads in a random order, so a missing dependency shows up
// as a wrong result (or a reported deadlock). Kernels must only touch memory
// of their device or of a peer with access; the simulation checks that too.
// The current device is per thread, as CUDA's is; one recursive lock makes
// the whole machine safe to drive from several threads (see sim_runtime.h).
#include "cuda/sim/sim_runtime.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <initializer_list>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <sys/syscall.h>
#include <unistd.h>

#include "core/lamb.h"
#include "cuda/fused.h"
#include "cuda/fused_body.cuh"
#include "cuda/fused_adafactor.h"
#include "cuda/fused_update.h"
#include "cuda/reduce_kernels.h"
#include "cuda/reduce_ops.cuh"
#include "cuda/scatter_rows.h"
#include "cuda/scatter_rows_body.cuh"

namespace {
struct Capture;
struct Record {
  bool done = false;
  Capture* captured = nullptr;  // recorded into this capture (a graph node), not queued
  std::size_t branch = 0, position = 0;  // where in the capture: which stream, after how many of its ops
};
// A device-side rendezvous of several streams (NCCL's kernels meet this way,
// with no event between GPUs): it runs `work` once, when it heads every one of
// its `parties` streams. A captured one is a template: each graph launch
// takes the next instance, so the k-th launches of the graphs of every party
// meet, as replays of NCCL kernels captured per GPU do.
struct Meet {
  int parties;
  std::function<void()> work;
  std::map<const void*, std::size_t> launched;  // as a template: instances taken per graph
  std::map<std::size_t, std::pair<std::shared_ptr<Meet>, int>> instances;  // k -> (instance, parties given it)
  std::shared_ptr<Meet> instance_for(const void* graph) {
    const std::size_t k = launched[graph]++;
    auto& [meet, given] = instances[k];
    if (!meet) meet = std::make_shared<Meet>(Meet{parties, work, {}, {}});
    std::shared_ptr<Meet> out = meet;
    if (++given == parties) instances.erase(k);
    return out;
  }
};
struct Op {
  std::function<void()> work;      // set: run it
  std::shared_ptr<Record> record;  // set with wait false: complete it; with wait true: wait for it
  bool wait = false;
  std::shared_ptr<Meet> meet;      // set: a rendezvous of streams (work is its own)
};
// The work captured from one stream (a branch of the graph), on its device.
struct Branch {
  int device;
  std::vector<Op> ops;
  std::size_t joined = 0;  // how many of its ops another branch has waited for (the join)
};
// A stream capture in progress: the origin stream's work is branch 0; a stream
// that waits for an event recorded in the capture joins it as a new branch
// (CUDA's fork); it must be waited for again by the end (the join).
struct Capture {
  std::vector<Branch> branches;
  std::string error;  // the first call that invalidated the capture
  bool relaxed = false;  // cudaStreamCaptureModeRelaxed: allocation (not a stream operation) is allowed
};
}  // namespace

// blocking: ordered with the device's legacy default stream (the null
// stream), both ways, as streams created without cudaStreamNonBlocking are.
// capture: set while the stream's work is being captured (into branch `branch`).
struct CUstream_st {
  int device;
  bool blocking;
  std::deque<Op> queue;
  std::shared_ptr<Capture> capture;
  std::size_t branch = 0;
};
struct CUevent_st { int device; std::shared_ptr<Record> latest; };
// A captured graph, and its instantiation: the branches, replayed per launch
// with fresh records; branches beyond the first run on streams of the exec's own.
struct CUgraph_st { std::vector<Branch> branches; };
struct CUgraphExec_st {
  std::vector<Branch> branches;
  std::vector<CUstream_st*> lanes;  // lanes[b]: where branch b > 0 replays
};

namespace mirrored::cuda::sim {
namespace {
int num_devices = 4;
std::set<std::pair<int, int>> peers;
thread_local int current = 0;
std::map<int, CUstream_st*>& null_streams = *new std::map<int, CUstream_st*>;  // never destroyed (see allocations)
std::vector<CUstream_st*>& streams = *new std::vector<CUstream_st*>;
// Simulated device memory: base -> (bytes, device, the block). Holding the
// block's pointer keeps memory a test never frees owned by the simulated
// device (as a GPU's is at exit), not leaked in LeakSanitizer's eyes; the
// map itself is never destroyed, so it still holds them when LSan looks.
struct Allocation {
  std::size_t bytes;
  int device;
  void* block;
};
std::map<std::uintptr_t, Allocation>& allocations = *new std::map<std::uintptr_t, Allocation>;
// Released test memory, poisoned, kept mapped until there is too much of it.
constexpr std::size_t quarantine_limit = std::size_t(256) << 20;
std::deque<std::pair<void*, std::size_t>>& quarantine = *new std::deque<std::pair<void*, std::size_t>>;
std::size_t quarantined = 0;
// Each GPU's memory: 0 is no limit; else an allocation that would take a device past it fails (cudaMalloc
// with cudaErrorMemoryAllocation, allocate() with nullptr), as a full GPU's does.
std::size_t memory_limit = 0;
std::map<int, std::size_t>& in_use = *new std::map<int, std::size_t>;
bool fits(std::size_t bytes, int device) {
  const std::size_t used = in_use[device];
  return memory_limit == 0 || (used <= memory_limit && bytes <= memory_limit - used);
}
std::mt19937 rng;
Counters counted;
void (*block_hook)(void (*)()) = nullptr;
constexpr double kLockSeconds = 600;  // far below pytest's timeout (1800 s): the failing test names the deadlock
std::atomic<double> lock_limit{kLockSeconds};
// The native id (gettid: threading.get_native_id(), gdb's LWP) of the thread that holds the machine, 0 when
// none; `stuck`: a holder a wait already timed out on (a later wait on it gives up after a second).
std::atomic<long> holder{0}, stuck{0};
thread_local int held = 0;  // how deep this thread holds the machine (the lock is recursive)
long native_thread_id() {
  thread_local const long id = static_cast<long>(syscall(SYS_gettid));
  return id;
}

CUstream_st* resolve(cudaStream_t s) {
  if (s) return s;
  CUstream_st*& n = null_streams[current];
  if (!n) streams.push_back(n = new CUstream_st{current, false, {}});
  return n;
}

bool is_null(const CUstream_st* s) {
  auto it = null_streams.find(s->device);
  return it != null_streams.end() && it->second == s;
}

// Queues op on s after the implicit synchronisation of the legacy default
// stream: work there waits for the queued work of the device's blocking
// streams, and work on a blocking stream waits for the null stream's.
void push(CUstream_st* s, Op op) {
  if (s->capture) {  // recorded, not queued (the legacy stream's implicit ordering is not captured)
    s->capture->branches[s->branch].ops.push_back(std::move(op));
    return;
  }
  auto wait_for = [s](CUstream_st* other) {
    if (other == s || other->queue.empty()) return;
    auto record = std::make_shared<Record>();
    other->queue.push_back(Op{nullptr, record, false});
    s->queue.push_back(Op{nullptr, record, true});
  };
  if (is_null(s)) {
    for (CUstream_st* b : streams)
      if (b->blocking && b->device == s->device) wait_for(b);
  } else if (s->blocking) {
    auto it = null_streams.find(s->device);
    if (it != null_streams.end()) wait_for(it->second);
  }
  s->queue.push_back(std::move(op));
}

int find_device(const void* p) {
  const auto u = reinterpret_cast<std::uintptr_t>(p);
  auto it = allocations.upper_bound(u);
  if (it == allocations.begin() || u > (--it)->first + it->second.bytes) return -1;
  return it->second.device;
}

int device_of(const void* p) {
  const int d = find_device(p);
  if (d < 0) throw std::logic_error("simulated kernel touches memory that was never allocated (or was freed)");
  return d;
}
// CUDA refuses, and invalidates the capture, when work that must not be
// captured (a host wait, the legacy stream, a free) meets a capturing stream.
[[noreturn]] void refuse(const std::shared_ptr<Capture>& c, const std::string& call) {
  const std::string what = call + " is not permitted while a stream is capturing (cudaErrorStreamCaptureUnsupported)";
  if (c && c->error.empty()) c->error = what;
  throw std::runtime_error(what);
}

// The capture on any stream of `device` (-1: of any device), or null.
std::shared_ptr<Capture> capture_on(int device) {
  for (auto* s : streams)
    if (s->capture && (device < 0 || s->device == device)) return s->capture;
  return nullptr;
}
}  // namespace

bool capturing(int device) { Lock lock; return capture_on(device) != nullptr; }

std::recursive_mutex& machine() {
  static auto& m = *new std::recursive_mutex;  // outlives every static destructor that may call the runtime
  return m;
}
void set_block_hook(void (*hook)(void (*wait)())) { block_hook = hook; }
void set_lock_seconds(double seconds) { lock_limit = seconds; }
double lock_seconds() { return lock_limit; }
long machine_holder() { return holder; }

namespace {
// Takes the machine, waiting at most lock_seconds(); past that its holder and this thread wait for each
// other (nothing else holds the machine that long): std::logic_error, naming both. It polls, with pauses
// growing to a millisecond, rather than use a timed mutex: ThreadSanitizer (GCC 12's) does not see
// pthread_mutex_clocklock take a lock, and reports each unlock after it as an unlock of a free mutex.
void wait_for_machine() {
  const long was = holder.load();
  const bool known = was != 0 && was == stuck.load();
  const double limit = known ? 1.0 : lock_limit.load();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(limit);
  for (auto pause = std::chrono::microseconds(20);; pause = std::min(pause * 2, std::chrono::microseconds(1000))) {
    if (machine().try_lock()) return;
    if (std::chrono::steady_clock::now() >= deadline) break;
    std::this_thread::sleep_for(pause);
  }
  const long now = holder.load();
  stuck = now;
  char seconds[32];
  std::snprintf(seconds, sizeof seconds, "%g", limit);
  throw std::logic_error(
      "simulated GPU machine: thread " + std::to_string(native_thread_id()) + " waited " + seconds +
      " s for the machine's lock, held by thread " + std::to_string(now) + " when it gave up" +
      " (native ids: threading.get_native_id(), gdb's LWP)" + (known ? ", which outlasted an earlier wait too" : "") +
      ": a deadlock (the holder waits for something the waiter holds, such as the GIL or a lock, or queued work "
      "never ends). MIRRORED_SIM_LOCK_SECONDS sets the limit");
}
}  // namespace

Lock::Lock() {
  if (!machine().try_lock()) {
    if (block_hook) block_hook(&wait_for_machine);
    else wait_for_machine();
  }
  if (held++ == 0) holder = native_thread_id();
}
Lock::~Lock() {
  if (--held == 0) holder = 0;
  machine().unlock();
}

Call::Call(const char* name) { ++counted.calls[name]; }

Counters counters() { Lock lock; return counted; }
void reset_counters() { Lock lock; counted = Counters{}; }

void reset(int devices, std::set<std::pair<int, int>> peer_pairs, unsigned seed) {
  Lock lock;
  num_devices = devices;
  peers = std::move(peer_pairs);
  rng.seed(seed);
  const char* limit = std::getenv("MIRRORED_SIM_DEVICE_BYTES");
  memory_limit = limit && *limit ? std::strtoull(limit, nullptr, 10) : 0;
  const char* seconds = std::getenv("MIRRORED_SIM_LOCK_SECONDS");
  lock_limit = seconds && *seconds ? std::strtod(seconds, nullptr) : kLockSeconds;
}

void set_device_memory_limit(std::size_t bytes) { Lock lock; memory_limit = bytes; }
std::size_t device_memory_limit() { Lock lock; return memory_limit; }
std::size_t device_bytes_in_use(int device) { Lock lock; return in_use[device]; }

void enqueue(cudaStream_t stream, std::function<void()> work) {
  Lock lock;
  CUstream_st* s = resolve(stream);
  if (is_null(s))
    for (CUstream_st* b : streams)
      if (b->capture && b->blocking && b->device == s->device)
        refuse(b->capture, "work on the legacy default stream (it would wait for a capturing stream)");
  push(s, Op{std::move(work)});
}

void launch_kernel(cudaStream_t stream, std::function<void()> work) {
  Lock lock;
  ++counted.kernels[resolve(stream)->device];
  enqueue(stream, std::move(work));
}

void launch_blas(cudaStream_t stream, std::function<void()> work) {
  Lock lock;
  ++counted.blas[resolve(stream)->device];
  enqueue(stream, std::move(work));
}

int current_device() { return current; }
void set_current_device(int device) { current = device; }
int device_of_pointer(const void* p) { Lock lock; return find_device(p); }
int device_of_stream(cudaStream_t stream) { Lock lock; return resolve(stream)->device; }

void* allocate(std::size_t bytes, int device) {
  Lock lock;
  if (!fits(bytes, device)) return nullptr;
  void* p = std::malloc(bytes + 1);  // + 1: a zero-byte allocation still has an address of its own
  if (!p) throw std::bad_alloc();
  std::memset(p, kFreshByte, bytes);
  allocations[reinterpret_cast<std::uintptr_t>(p)] = {bytes, device, p};
  in_use[device] += bytes;
  return p;
}

void release(void* p, cudaStream_t stream) {
  Lock lock;
  auto it = allocations.find(reinterpret_cast<std::uintptr_t>(p));
  if (it == allocations.end()) throw std::logic_error("sim::release of memory that allocate() did not return");
  const std::size_t bytes = it->second.bytes;
  if (const auto c = resolve(stream)->capture) refuse(c, "freeing device memory on a capturing stream");
  in_use[it->second.device] -= bytes;  // a pool may hand it out again at once (in the stream's order)
  enqueue(stream, [p, bytes] {
    std::memset(p, kPoisonByte, bytes);
    allocations.erase(reinterpret_cast<std::uintptr_t>(p));
    quarantine.emplace_back(p, bytes);
    quarantined += bytes;
    while (quarantined > quarantine_limit && quarantine.size() > 1) {
      quarantined -= quarantine.front().second;
      std::free(quarantine.front().first);
      quarantine.pop_front();
    }
  });
}

void drain() { drain_until([] { return false; }); }

// Whether every party of m has it at the head of its queue.
bool met(const Meet* m) {
  int at_head = 0;
  for (auto* s : streams) at_head += !s->queue.empty() && s->queue.front().meet.get() == m;
  return at_head == m->parties;
}

void rendezvous(const std::vector<std::pair<int, cudaStream_t>>& parties, std::function<void()> work) {
  Lock lock;
  auto meet = std::make_shared<Meet>(Meet{static_cast<int>(parties.size()), std::move(work), {}, {}});
  const int saved = current;
  for (const auto& [device, stream] : parties) {
    current = device;  // (a null stream is the device's own)
    push(resolve(stream), Op{nullptr, nullptr, false, meet});
  }
  current = saved;
}

namespace {
// Whether this thread is running queued work now (inside drain_until's loop).
thread_local bool running_work = false;
struct RunningWork {
  RunningWork() { running_work = true; }
  ~RunningWork() { running_work = false; }
};
}  // namespace

void drain_until(const std::function<bool()>& done) {
  Lock lock;
  while (!done()) {
    std::vector<CUstream_st*> ready;
    bool busy = false;
    for (auto* s : streams) {
      if (s->queue.empty()) continue;
      busy = true;
      const Op& head = s->queue.front();
      if (head.meet ? met(head.meet.get()) : !head.wait || head.record->done) ready.push_back(s);
    }
    if (!busy) return;
    // A host wait from inside queued work: the work ran host code (a Python
    // kernel, or a finalizer Python's garbage collector ran in it). The op in
    // flight has left its queue, so draining here would run the work queued
    // behind it first, which no GPU does: refused, loudly.
    if (running_work)
      throw std::logic_error("a host wait (a synchronisation, cudaFree or a graph's destruction) from inside "
                             "simulated GPU work: queued work must not wait for the GPU");
    if (ready.empty()) throw std::logic_error("simulated streams deadlock: every head waits for an event");
    CUstream_st* s = ready[rng() % ready.size()];
    Op op = std::move(s->queue.front());
    s->queue.pop_front();
    RunningWork running;
    if (op.meet) {  // every party passes it at once, the work done once
      for (auto* other : streams)
        if (!other->queue.empty() && other->queue.front().meet == op.meet) other->queue.pop_front();
      op.meet->work();
      continue;
    }
    if (op.work) op.work();
    if (op.record && !op.wait) op.record->done = true;
  }
}

}  // namespace mirrored::cuda::sim

namespace sim = mirrored::cuda::sim;

extern "C" {
cudaError_t cudaGetDeviceCount(int* n) {
  sim::Call call(__func__);
  *n = sim::num_devices;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int d) {
  sim::Call call(__func__);
  if (d < 0 || d >= sim::num_devices) return cudaErrorInvalidDevice;
  sim::current = d;
  return cudaSuccess;
}
cudaError_t cudaGetDevice(int* d) {
  sim::Call call(__func__);
  *d = sim::current;
  return cudaSuccess;
}
cudaError_t cudaGetLastError() {
  sim::Call call(__func__);
  return cudaSuccess;
}
const char* cudaGetErrorName(cudaError_t e) {
  return e == cudaErrorMemoryAllocation ? "cudaErrorMemoryAllocation" : "cudaErrorSimulated";
}
const char* cudaGetErrorString(cudaError_t e) {
  return e == cudaErrorMemoryAllocation ? "out of memory" : "simulated error";
}
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* p, int) {
  sim::Call call(__func__);
  std::memset(p, 0, sizeof *p);
  return cudaSuccess;
}
cudaError_t cudaDeviceGetAttribute(int* v, cudaDeviceAttr, int) {
  sim::Call call(__func__);
  *v = 4;
  return cudaSuccess;
}
cudaError_t cudaDeviceCanAccessPeer(int* can, int a, int b) {
  sim::Call call(__func__);
  *can = static_cast<int>(sim::peers.count({a, b}));
  return cudaSuccess;
}
cudaError_t cudaDeviceEnablePeerAccess(int, unsigned) {
  sim::Call call(__func__);
  return cudaSuccess;
}
cudaError_t cudaDeviceSynchronize() {
  sim::Call call(__func__);
  if (const auto c = sim::capture_on(sim::current)) sim::refuse(c, "cudaDeviceSynchronize");
  ++sim::counted.host_waits;
  ++sim::counted.stream_ops;
  sim::drain();  // the host blocks until the GPU is idle
  return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t s) {
  sim::Call call(__func__);
  const CUstream_st* st = sim::resolve(s);
  if (const auto c = sim::is_null(st) ? sim::capture_on(st->device) : st->capture)
    sim::refuse(c, "cudaStreamSynchronize");
  ++sim::counted.host_waits;
  ++sim::counted.stream_ops;
  sim::drain_until([st] { return st->queue.empty(); });  // other streams' work runs only as far as needed
  return cudaSuccess;
}
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned flags) {
  sim::Call call(__func__);
  sim::streams.push_back(*s = new CUstream_st{sim::current, (flags & cudaStreamNonBlocking) == 0, {}});
  return cudaSuccess;
}
cudaError_t cudaStreamDestroy(cudaStream_t s) {
  sim::Call call(__func__);
  // CUDA lets queued work finish; the simulation runs it before forgetting the stream.
  sim::drain();
  for (auto it = sim::streams.begin(); it != sim::streams.end(); ++it)
    if (*it == s) { sim::streams.erase(it); break; }
  delete s;
  return cudaSuccess;
}
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned) {
  sim::Call call(__func__);
  *e = new CUevent_st{sim::current, nullptr};
  return cudaSuccess;
}
cudaError_t cudaEventDestroy(cudaEvent_t e) {
  sim::Call call(__func__);
  delete e;
  return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
  sim::Call call(__func__);
  ++sim::counted.stream_ops;
  CUstream_st* st = sim::resolve(s);
  if (st->device != e->device) return cudaErrorInvalidResourceHandle;  // CUDA's rule too
  e->latest = std::make_shared<Record>();
  if (st->capture) {  // a node of the graph, which a wait elsewhere may fork from or join
    e->latest->captured = st->capture.get();
    e->latest->branch = st->branch;
    e->latest->position = st->capture->branches[st->branch].ops.size() + 1;
  }
  sim::push(st, Op{nullptr, e->latest, false});
  return cudaSuccess;
}
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned) {
  sim::Call call(__func__);
  ++sim::counted.stream_ops;
  if (!e->latest) return cudaSuccess;
  CUstream_st* st = sim::resolve(s);
  Capture* from = e->latest->captured;
  if (from && !st->capture) {  // the fork: st joins the capture the event was recorded in
    if (sim::is_null(st)) sim::refuse(nullptr, "cudaStreamWaitEvent of the legacy default stream on a captured event");
    for (auto* other : sim::streams)
      if (other->capture.get() == from) { st->capture = other->capture; break; }
    st->branch = from->branches.size();
    from->branches.push_back(Branch{st->device, {}, 0});
  } else if (st->capture && from != st->capture.get()) {
    sim::refuse(st->capture, "cudaStreamWaitEvent on an event recorded outside the capture (or in another one)");
  }
  if (from) {
    Branch& b = from->branches[e->latest->branch];
    if (e->latest->branch != st->branch) b.joined = std::max(b.joined, e->latest->position);
  }
  sim::push(st, Op{nullptr, e->latest, true});
  return cudaSuccess;
}
cudaError_t cudaMalloc(void** p, size_t n) {
  sim::Call call(__func__);
  if (const auto c = sim::capture_on(sim::current); c && !c->relaxed) sim::refuse(c, "cudaMalloc");
  if (!sim::fits(n, sim::current)) return cudaErrorMemoryAllocation;  // (*p untouched, as CUDA leaves it)
  *p = std::malloc(n + 1);
  std::memset(*p, 0xcd, n);
  sim::allocations[reinterpret_cast<std::uintptr_t>(*p)] = {n, sim::current, *p};
  sim::in_use[sim::current] += n;
  return cudaSuccess;
}
cudaError_t cudaMallocHost(void** p, size_t n) {
  sim::Call call(__func__);
  *p = std::malloc(n + 1);  // host memory: a kernel touching it is caught as unallocated
  return cudaSuccess;
}
cudaError_t cudaFreeHost(void* p) {
  sim::Call call(__func__);
  std::free(p);
  return cudaSuccess;
}
cudaError_t cudaEventQuery(cudaEvent_t e) {
  sim::Call call(__func__);
  if (e->latest && e->latest->captured) return cudaErrorStreamCaptureUnsupported;
  return !e->latest || e->latest->done ? cudaSuccess : cudaErrorNotReady;
}
cudaError_t cudaEventSynchronize(cudaEvent_t e) {
  sim::Call call(__func__);
  if (e->latest && e->latest->captured) sim::refuse(nullptr, "cudaEventSynchronize on an event recorded in a capture");
  ++sim::counted.host_waits;
  ++sim::counted.stream_ops;
  if (const auto record = e->latest) sim::drain_until([record] { return record->done; });  // the host waits for it
  return cudaSuccess;
}
cudaError_t cudaFree(void* p) {
  sim::Call call(__func__);
  if (const auto c = sim::capture_on(-1)) sim::refuse(c, "cudaFree");
  ++sim::counted.host_waits;
  sim::drain();  // cudaFree waits for the device, so queued work never reads freed memory
  const auto it = sim::allocations.find(reinterpret_cast<std::uintptr_t>(p));
  if (it != sim::allocations.end()) {
    sim::in_use[it->second.device] -= it->second.bytes;
    sim::allocations.erase(it);
  }
  std::free(p);
  return cudaSuccess;
}
cudaError_t cudaMemcpyAsync(void* d, const void* s, size_t n, cudaMemcpyKind, cudaStream_t st) {
  sim::Call call(__func__);
  ++sim::counted.stream_ops;
  if (sim::resolve(st)->device != sim::current) return cudaErrorInvalidValue;
  sim::enqueue(st, [=] {
    if (n != 0) std::memmove(d, s, n);  // (CUDA takes an empty copy of a null pointer; memmove does not)
  });
  return cudaSuccess;
}
// The synchronous forms, as CUDA orders them: on the legacy stream, the host waiting for it.
cudaError_t cudaMemcpy(void* d, const void* s, size_t n, cudaMemcpyKind kind) {
  sim::Call call(__func__);
  if (const cudaError_t e = cudaMemcpyAsync(d, s, n, kind, nullptr); e != cudaSuccess) return e;
  return cudaStreamSynchronize(nullptr);
}
cudaError_t cudaMemset(void* p, int value, size_t n) {
  sim::Call call(__func__);
  ++sim::counted.stream_ops;
  sim::enqueue(nullptr, [=] { std::memset(p, value, n); });
  return cudaStreamSynchronize(nullptr);
}
cudaError_t cudaMemcpyPeerAsync(void* d, int, const void* s, int, size_t n, cudaStream_t st) {
  sim::Call call(__func__);
  ++sim::counted.stream_ops;
  sim::enqueue(st, [=] { std::memmove(d, s, n); });
  return cudaSuccess;
}
cudaError_t cudaMemcpy2DAsync(void* d, size_t dp, const void* s, size_t sp, size_t w, size_t h, cudaMemcpyKind,
                              cudaStream_t st) { sim::Call call(__func__);
  ++sim::counted.stream_ops;
  sim::enqueue(st, [=] {
    for (size_t r = 0; r < h; ++r) std::memcpy(static_cast<char*>(d) + r * dp, static_cast<const char*>(s) + r * sp, w);
  });
  return cudaSuccess;
}
cudaError_t cudaMemcpy3DPeerAsync(const cudaMemcpy3DPeerParms* p, cudaStream_t st) {
  sim::Call call(__func__);
  ++sim::counted.stream_ops;
  const cudaMemcpy3DPeerParms q = *p;
  sim::enqueue(st, [=] {
    for (size_t r = 0; r < q.extent.height; ++r)
      std::memcpy(static_cast<char*>(q.dstPtr.ptr) + r * q.dstPtr.pitch,
                  static_cast<const char*>(q.srcPtr.ptr) + r * q.srcPtr.pitch, q.extent.width);
  });
  return cudaSuccess;
}
}


// Stream capture and graphs: what a capture records is the queue it would
// have made; a launch queues it again (fresh records, so every launch has
// its own ordering), branch 0 on the launch stream and every other branch on
// a stream of the instantiated graph, and the launch stream then waits for
// them all, as a graph launch completes only when all its nodes have.
extern "C" {
cudaError_t cudaStreamBeginCapture(cudaStream_t s, cudaStreamCaptureMode mode) {
  sim::Call call(__func__);
  CUstream_st* st = sim::resolve(s);
  if (sim::is_null(st)) return cudaErrorStreamCaptureImplicit;  // the legacy stream cannot be captured
  if (st->capture) return cudaErrorIllegalState;
  st->capture = std::make_shared<Capture>();
  st->capture->branches.push_back(Branch{st->device, {}, 0});
  st->capture->relaxed = mode == cudaStreamCaptureModeRelaxed;
  st->branch = 0;
  return cudaSuccess;
}
cudaError_t cudaStreamIsCapturing(cudaStream_t s, cudaStreamCaptureStatus* status) {
  sim::Call call(__func__);
  const CUstream_st* st = sim::resolve(s);
  *status = !st->capture ? cudaStreamCaptureStatusNone
            : st->capture->error.empty() ? cudaStreamCaptureStatusActive : cudaStreamCaptureStatusInvalidated;
  return cudaSuccess;
}
cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t* graph) {
  sim::Call call(__func__);
  CUstream_st* st = sim::resolve(s);
  *graph = nullptr;
  if (!st->capture || st->branch != 0) return cudaErrorIllegalState;  // ends only on the stream that began it
  const std::shared_ptr<Capture> c = st->capture;
  for (auto* other : sim::streams)
    if (other->capture == c) other->capture.reset();
  for (auto& branch : c->branches)
    for (auto& op : branch.ops)
      if (op.record) op.record->captured = nullptr;  // (the capture is gone; launches make their own records)
  if (!c->error.empty()) return cudaErrorStreamCaptureInvalidated;
  for (std::size_t b = 1; b < c->branches.size(); ++b)
    if (c->branches[b].joined != c->branches[b].ops.size()) return cudaErrorStreamCaptureUnjoined;
  *graph = new CUgraph_st{std::move(c->branches)};
  return cudaSuccess;
}
cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t graph, unsigned long long) {
  sim::Call call(__func__);
  auto* x = new CUgraphExec_st{graph->branches, {}};
  x->lanes.resize(x->branches.size(), nullptr);
  for (std::size_t b = 1; b < x->branches.size(); ++b)
    sim::streams.push_back(x->lanes[b] = new CUstream_st{x->branches[b].device, false, {}, nullptr, 0});
  *exec = x;
  return cudaSuccess;
}
cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t s) {
  sim::Call call(__func__);
  CUstream_st* st = sim::resolve(s);
  if (st->capture) sim::refuse(st->capture, "cudaGraphLaunch");
  ++sim::counted.graph_launches[st->device];
  sim::counted.graph_branches[st->device] += static_cast<long>(exec->branches.size());
  std::map<Record*, std::shared_ptr<Record>> fresh;
  auto renew = [&fresh](const std::shared_ptr<Record>& r) {
    auto& n = fresh[r.get()];
    if (!n) n = std::make_shared<Record>();
    return n;
  };
  std::map<Meet*, std::shared_ptr<Meet>> meets;
  auto meet_of = [&meets, exec](const std::shared_ptr<Meet>& m) {
    auto& n = meets[m.get()];
    if (!n) n = m->instance_for(exec);
    return n;
  };
  std::vector<std::shared_ptr<Record>> ends;
  for (std::size_t b = 0; b < exec->branches.size(); ++b) {
    CUstream_st* lane = b == 0 ? st : exec->lanes[b];
    for (const Op& op : exec->branches[b].ops)
      sim::push(lane, Op{op.work, op.record ? renew(op.record) : nullptr, op.wait,
                         op.meet ? meet_of(op.meet) : nullptr});
    if (b > 0) {
      ends.push_back(std::make_shared<Record>());
      sim::push(lane, Op{nullptr, ends.back(), false});
    }
  }
  for (const auto& end : ends) sim::push(st, Op{nullptr, end, true});
  return cudaSuccess;
}
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec) {
  sim::Call call(__func__);
  sim::drain();  // (a launch still queued finishes first, as on a GPU)
  for (std::size_t b = 1; b < exec->lanes.size(); ++b) {
    auto& all = sim::streams;
    all.erase(std::find(all.begin(), all.end(), exec->lanes[b]));
    delete exec->lanes[b];
  }
  delete exec;
  return cudaSuccess;
}
cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
  sim::Call call(__func__);
  delete graph;
  return cudaSuccess;
}
}

namespace mirrored::cuda {
namespace {

// The kernel's arithmetic, element by element: the same functors as the .cu.
template <typename T, ReduceOp Op>
void combine_all(void* out, const void* a, const void* b, std::size_t n, int mean_div) {
  using E = Elem<T>;
  std::vector<T> r(n);
  for (std::size_t i = 0; i < n; ++i) {
    auto v = Combine<Op>()(E::load(static_cast<const T*>(a)[i]), E::load(static_cast<const T*>(b)[i]));
    r[i] = E::store(mean_div > 1 ? divide(v, mean_div) : v);
  }
  std::memcpy(out, r.data(), n * sizeof(T));
}

template <typename T>
void combine_op(void* out, const void* a, const void* b, std::size_t n, ReduceOp op, int mean_div) {
  switch (op) {
    case ReduceOp::kSum: return combine_all<T, ReduceOp::kSum>(out, a, b, n, mean_div);
    case ReduceOp::kProd: return combine_all<T, ReduceOp::kProd>(out, a, b, n, mean_div);
    case ReduceOp::kMin: return combine_all<T, ReduceOp::kMin>(out, a, b, n, mean_div);
    case ReduceOp::kMax: return combine_all<T, ReduceOp::kMax>(out, a, b, n, mean_div);
    case ReduceOp::kMean: break;
  }
  throw std::logic_error("MEAN reached a kernel: callers must pass its combining op");
}

// A launch on `stream`: counted, and on the stream's own device as CUDA requires.
void launched(cudaStream_t stream) {
  if (sim::resolve(stream)->device != sim::current) throw std::logic_error("kernel launched off its stream's device");
  ++sim::counted.launches[sim::current];
}

// A kernel of the current device touches p: its own memory or a peer's with access.
void reachable(const void* p) {
  const int d = sim::device_of(p);
  if (d != sim::current && !sim::peers.count({sim::current, d}))
    throw std::logic_error("kernel touches a peer's memory without peer access");
}

// Runs body(tid, stride) for every thread of a grid of `blocks` blocks, in a
// random thread order (a kernel's threads are unordered): the same bodies as
// the .cu, over the same launch shape.
template <typename F>
void run_grid(unsigned blocks, F body) {
  const std::size_t stride = std::size_t(blocks) * kFusedThreads;
  std::vector<std::size_t> order(stride);
  for (std::size_t t = 0; t < stride; ++t) order[t] = t;
  std::shuffle(order.begin(), order.end(), sim::rng);
  for (std::size_t t : order) body(t, stride);
}

template <typename T>
void fused_op(const FusedArgs& a, std::size_t count, ReduceOp op, int mean_div, unsigned blocks, bool vec) {
  run_grid(blocks, [&](std::size_t tid, std::size_t stride) {
    switch (op) {
      case ReduceOp::kSum: return fused_reduce_body<T, ReduceOp::kSum>(a, count, mean_div, vec, tid, stride);
      case ReduceOp::kProd: return fused_reduce_body<T, ReduceOp::kProd>(a, count, mean_div, vec, tid, stride);
      case ReduceOp::kMin: return fused_reduce_body<T, ReduceOp::kMin>(a, count, mean_div, vec, tid, stride);
      case ReduceOp::kMax: return fused_reduce_body<T, ReduceOp::kMax>(a, count, mean_div, vec, tid, stride);
      case ReduceOp::kMean: break;
    }
    throw std::logic_error("MEAN reached a fused kernel: callers must pass its combining op");
  });
}

}  // namespace

void fused_reduce(const FusedArgs& a, std::size_t count, DType dtype, ReduceOp op, int mean_div, int sms,
                  cudaStream_t stream) {
  sim::Lock lock;
  if (count == 0) return;
  if (a.nin < 1 || a.nin > kMaxFused || a.nout < 0 || a.nout > kMaxFused)
    throw std::logic_error("fused_reduce: bad buffer counts");
  launched(stream);
  for (int j = 0; j < a.nin; ++j) reachable(a.in[j]);
  for (int j = 0; j < a.nout; ++j) reachable(a.out[j]);
  const bool vec = fused_vectorised(a);
  const unsigned blocks = fused_blocks(fused_work(count, dtype_size(dtype), vec), sms);
  sim::enqueue(stream, [=] {
    switch (dtype) {
      case DType::kFloat16: return fused_op<F16>(a, count, op, mean_div, blocks, vec);
      case DType::kBFloat16: return fused_op<BF16>(a, count, op, mean_div, blocks, vec);
      case DType::kFloat32: return fused_op<float>(a, count, op, mean_div, blocks, vec);
      case DType::kFloat64: return fused_op<double>(a, count, op, mean_div, blocks, vec);
      case DType::kInt8: return fused_op<std::int8_t>(a, count, op, mean_div, blocks, vec);
      case DType::kUInt8: return fused_op<std::uint8_t>(a, count, op, mean_div, blocks, vec);
      case DType::kInt32: return fused_op<std::int32_t>(a, count, op, mean_div, blocks, vec);
      case DType::kInt64: return fused_op<std::int64_t>(a, count, op, mean_div, blocks, vec);
    }
  });
}

void fused_gather(const GatherArgs& a, int unit, int sms, cudaStream_t stream) {
  sim::Lock lock;
  const std::size_t total = a.col[a.nin] * a.outer;
  if (total == 0) return;
  launched(stream);
  for (int j = 0; j < a.nin; ++j)
    if (a.col[j + 1] > a.col[j] && a.in[j]) reachable(a.in[j]);
  for (int j = 0; j < a.nout; ++j) reachable(a.out[j]);
  for (int j = 0; j < a.nin; ++j)
    if (reinterpret_cast<std::uintptr_t>(a.in[j]) % unit) throw std::logic_error("fused_gather: input not unit-aligned");
  const unsigned blocks = fused_blocks(total, sms);
  sim::enqueue(stream, [=] {
    run_grid(blocks, [&](std::size_t tid, std::size_t stride) {
      switch (unit) {
        case 16: return fused_gather_body<uint4>(a, tid, stride);
        case 8: return fused_gather_body<std::uint64_t>(a, tid, stride);
        case 4: return fused_gather_body<std::uint32_t>(a, tid, stride);
        case 2: return fused_gather_body<std::uint16_t>(a, tid, stride);
        case 1: return fused_gather_body<std::uint8_t>(a, tid, stride);
      }
      throw std::logic_error("fused_gather: bad unit");
    });
  });
}

void multi_copy(const CopyEntry* table, int entries, std::size_t slots, int sms, cudaStream_t stream) {
  sim::Lock lock;
  if (entries == 0 || slots == 0) return;
  launched(stream);
  reachable(table);
  const int device = sim::current;
  const unsigned blocks = fused_blocks(slots, sms);
  sim::enqueue(stream, [=] {
    // The table is read when the kernel runs (it was uploaded on this stream
    // just before); so are the pointers it holds.
    const int saved = sim::current;
    sim::current = device;
    for (int e = 0; e < entries; ++e)
      if (table[e].bytes) reachable(table[e].src), reachable(table[e].dst);
    if (table[entries - 1].slot + (table[entries - 1].bytes + 15) / 16 != slots)
      throw std::logic_error("multi_copy: the table's slots do not add up to the launch's");
    sim::current = saved;
    run_grid(blocks, [&](std::size_t tid, std::size_t stride) { multi_copy_body(table, entries, tid, stride); });
  });
}

void multi_reduce(const ReduceEntry* table, const void* const* pointers, int entries, int n, std::size_t slots,
                  DType dtype, ReduceOp op, int mean_div, int sms, cudaStream_t stream) {
  sim::Lock lock;
  if (entries == 0 || slots == 0) return;
  if (op == ReduceOp::kMean) throw std::logic_error("multi_reduce: MEAN reached a kernel: pass its combining op");
  launched(stream);
  reachable(table);
  reachable(pointers);
  const int device = sim::current;
  const unsigned blocks = fused_blocks(slots, sms);
  sim::enqueue(stream, [=] {
    // The tables are read when the kernel runs (uploaded on this stream just before); so are the pointers they hold.
    const int saved = sim::current;
    sim::current = device;
    const std::size_t per = 16 / dtype_size(dtype);
    for (int e = 0; e < entries; ++e) {
      if (e > 0 && table[e].slot != table[e - 1].slot + (table[e - 1].count + per - 1) / per)
        throw std::logic_error("multi_reduce: the table's slots are not a prefix sum of its counts");
      for (int j = 0; j < 2 * n; ++j) reachable(pointers[std::size_t(e) * 2 * n + j]);
    }
    if (table[entries - 1].slot + (table[entries - 1].count + per - 1) / per != slots)
      throw std::logic_error("multi_reduce: the table's slots do not add up to the launch's");
    sim::current = saved;
    const auto run = [&](auto type) {
      using T = decltype(type);
      run_grid(blocks, [&](std::size_t tid, std::size_t stride) {
        switch (op) {
          case ReduceOp::kSum: return multi_reduce_body<T, ReduceOp::kSum>(table, pointers, entries, n, mean_div, tid, stride);
          case ReduceOp::kProd: return multi_reduce_body<T, ReduceOp::kProd>(table, pointers, entries, n, mean_div, tid, stride);
          case ReduceOp::kMin: return multi_reduce_body<T, ReduceOp::kMin>(table, pointers, entries, n, mean_div, tid, stride);
          case ReduceOp::kMax: return multi_reduce_body<T, ReduceOp::kMax>(table, pointers, entries, n, mean_div, tid, stride);
          case ReduceOp::kMean: break;
        }
      });
    };
    switch (dtype) {
      case DType::kFloat16: return run(F16{});
      case DType::kBFloat16: return run(BF16{});
      case DType::kFloat32: return run(float{});
      case DType::kFloat64: return run(double{});
      case DType::kInt8: return run(std::int8_t{});
      case DType::kUInt8: return run(std::uint8_t{});
      case DType::kInt32: return run(std::int32_t{});
      case DType::kInt64: return run(std::int64_t{});
    }
  });
}

void reduce_copy(void* out, const void* a, const void* b, std::size_t count, DType dtype, ReduceOp op, int mean_div,
                 int, cudaStream_t stream) {
  sim::Lock lock;
  if (count == 0) return;
  launched(stream);
  for (const void* p : {static_cast<const void*>(out), a, b}) reachable(p);
  sim::enqueue(stream, [=] {
    switch (dtype) {
      case DType::kFloat16: return combine_op<F16>(out, a, b, count, op, mean_div);
      case DType::kBFloat16: return combine_op<BF16>(out, a, b, count, op, mean_div);
      case DType::kFloat32: return combine_op<float>(out, a, b, count, op, mean_div);
      case DType::kFloat64: return combine_op<double>(out, a, b, count, op, mean_div);
      case DType::kInt8: return combine_op<std::int8_t>(out, a, b, count, op, mean_div);
      case DType::kUInt8: return combine_op<std::uint8_t>(out, a, b, count, op, mean_div);
      case DType::kInt32: return combine_op<std::int32_t>(out, a, b, count, op, mean_div);
      case DType::kInt64: return combine_op<std::int64_t>(out, a, b, count, op, mean_div);
    }
  });
}

}  // namespace mirrored::cuda

// The fused optimizer update (cuda/fused_update.h): the .cu's kernel body,
// rules::update_table, per thread of the same grid.
namespace mirrored::cuda {
namespace {

template <typename T>
void fused_update_grid(rules::Rule rule, const void* table, int entries, std::size_t max_count,
                       const rules::FusedScalars<T>& s, unsigned blocks, int device) {
  // The table is read when the kernel runs (it was uploaded on this stream
  // just before); so are the pointers it holds.
  const auto* t = static_cast<const rules::FusedEntry<T>*>(table);
  const int saved = sim::current;
  sim::current = device;
  std::size_t largest = 0;
  for (int e = 0; e < entries; ++e) {
    largest = std::max(largest, t[e].count);
    if (!t[e].count) continue;
    reachable(t[e].weight), reachable(t[e].grad);
    if (t[e].squares) reachable(t[e].squares);
    for (int j = 0; j < rules::kMaxSlots; ++j)
      if (t[e].slots[j]) reachable(t[e].slots[j]);
  }
  sim::current = saved;
  if (largest != max_count) throw std::logic_error("fused_update: max_count is not the table's largest count");
  run_grid(blocks, [&](std::size_t tid, std::size_t stride) { rules::update_table(rule, t, entries, s, tid, stride); });
}

// fused_update_from_device's scalars, read when the kernel runs (as the
// .cu's threads load them).
template <typename T>
rules::FusedScalars<T> scalars_from(const void* device_scalars, int coefficients) {
  reachable(device_scalars);
  const T* p = static_cast<const T*>(device_scalars);
  rules::FusedScalars<T> s{};
  for (int j = 0; j < coefficients; ++j) s.c[j] = p[j];
  s.weight_decay = p[coefficients];
  s.lr = p[coefficients + 1];
  return s;
}

// The .cu's open_gate, on the device the kernel runs on: false skips the update.
template <typename T>
bool open_gate(LossScaleGate gate, rules::FusedScalars<T>& s) {
  if (gate.nonfinite != nullptr) {
    reachable(gate.nonfinite);
    if (*gate.nonfinite != 0) return false;
  }
  if (gate.scale != nullptr) {
    reachable(gate.scale);
    s.unscale = true;
    s.loss_scale = static_cast<T>(*gate.scale);
  }
  return true;
}

// A gated fused update, run when the kernel runs: the gate and (from_device) the scalars read then.
template <typename T>
void gated_update(rules::Rule rule, const void* table, int entries, std::size_t max_count, rules::FusedScalars<T> s,
                  const void* device_scalars, int coefficients, LossScaleGate gate, unsigned blocks, int device) {
  const int saved = sim::current;
  sim::current = device;
  if (device_scalars != nullptr) s = scalars_from<T>(device_scalars, coefficients);
  const bool open = open_gate(gate, s);
  sim::current = saved;
  if (open) fused_update_grid<T>(rule, table, entries, max_count, s, blocks, device);
}

// Lamb's four launches (the .cu's launch_lamb): each phase's body (core/lamb.h) per thread of the same
// grid, the gate and the scalars (`given`, or read from `device_scalars` when not null) read when it runs.
template <typename T>
void lamb_phases(const void* table, int entries, rules::FusedScalars<T> given, const void* device_scalars,
                 int coefficients, LossScaleGate gate, LambScratch lamb, int sms, cudaStream_t stream) {
  if (lamb.data == nullptr) throw std::invalid_argument("fused_update: Lamb without its scratch");
  reachable(lamb.data);
  const int device = sim::current;
  const auto* t = static_cast<const rules::FusedEntry<T>*>(table);
  const rules::LambSums<T> sums{static_cast<T*>(lamb.data), lamb.lanes, lamb.groups};
  const auto phase = [&](std::size_t work, auto body) {
    launched(stream);
    const unsigned blocks = fused_blocks(work, sms);
    sim::enqueue(stream, [=] {
      const int saved = sim::current;
      sim::current = device;
      // The table is read when the kernel runs, and so are the pointers it holds; the scratch must fit it.
      std::size_t lanes = 0, groups = 0, count = 0;
      for (int e = 0; e < entries; ++e) {
        lanes += rules::sum_lanes(t[e].count);
        groups += rules::sum_groups(rules::sum_lanes(t[e].count));
        count += t[e].count;
        if (!t[e].count) continue;
        reachable(t[e].weight), reachable(t[e].grad), reachable(t[e].slots[0]), reachable(t[e].slots[1]);
        if (t[e].squares) reachable(t[e].squares);
      }
      if (lanes != lamb.lanes || groups != lamb.groups || count != lamb.count)
        throw std::logic_error("fused_update: Lamb's scratch does not fit the table");
      rules::FusedScalars<T> s = device_scalars != nullptr ? scalars_from<T>(device_scalars, coefficients) : given;
      const bool open = open_gate(gate, s);
      sim::current = saved;
      if (open) run_grid(blocks, [&](std::size_t tid, std::size_t stride) { body(s, tid, stride); });
    });
  };
  using S = const rules::FusedScalars<T>&;
  phase(lamb.lanes, [=](S s, std::size_t tid, std::size_t stride) { rules::lamb_lanes(t, entries, s, sums, tid, stride); });
  phase(lamb.groups, [=](S, std::size_t tid, std::size_t stride) { rules::lamb_groups(t, entries, sums, tid, stride); });
  phase(entries, [=](S, std::size_t tid, std::size_t stride) { rules::lamb_ratios(t, entries, sums, tid, stride); });
  phase(lamb.count, [=](S s, std::size_t tid, std::size_t stride) { rules::lamb_apply(t, entries, s, sums, tid, stride); });
}

}  // namespace

void fused_update_from_device(rules::Rule rule, DType dtype, const void* table, int entries, std::size_t max_count,
                              const void* device_scalars, int coefficients, int sms, cudaStream_t stream,
                              LossScaleGate gate, LambScratch lamb) {
  sim::Lock lock;
  if (entries == 0 || max_count == 0) return;
  if (dtype != DType::kFloat32 && dtype != DType::kFloat64)
    throw std::invalid_argument("fused_update: the GPU kernel takes float32 and float64");
  reachable(table);
  reachable(device_scalars);
  if (rule == rules::Rule::kLamb) {
    if (dtype == DType::kFloat32)
      return lamb_phases<float>(table, entries, {}, device_scalars, coefficients, gate, lamb, sms, stream);
    return lamb_phases<double>(table, entries, {}, device_scalars, coefficients, gate, lamb, sms, stream);
  }
  launched(stream);
  const int device = sim::current;
  const unsigned blocks = fused_blocks(max_count, sms);
  // The scalars (and the gate) are read from device memory when the kernel runs, not at the launch.
  if (dtype == DType::kFloat32) {
    sim::enqueue(stream, [=] {
      gated_update<float>(rule, table, entries, max_count, {}, device_scalars, coefficients, gate, blocks, device);
    });
  } else {
    sim::enqueue(stream, [=] {
      gated_update<double>(rule, table, entries, max_count, {}, device_scalars, coefficients, gate, blocks, device);
    });
  }
}

void fused_update(rules::Rule rule, DType dtype, const void* table, int entries, std::size_t max_count,
                  const void* scalars, int sms, cudaStream_t stream, LossScaleGate gate, LambScratch lamb) {
  sim::Lock lock;
  if (entries == 0 || max_count == 0) return;
  if (dtype != DType::kFloat32 && dtype != DType::kFloat64)
    throw std::invalid_argument("fused_update: the GPU kernel takes float32 and float64");
  reachable(table);
  if (rule == rules::Rule::kLamb) {
    if (dtype == DType::kFloat32)
      return lamb_phases<float>(table, entries, *static_cast<const rules::FusedScalars<float>*>(scalars), nullptr, 0,
                                gate, lamb, sms, stream);
    return lamb_phases<double>(table, entries, *static_cast<const rules::FusedScalars<double>*>(scalars), nullptr, 0,
                               gate, lamb, sms, stream);
  }
  launched(stream);
  const int device = sim::current;
  const unsigned blocks = fused_blocks(max_count, sms);
  // Kernel arguments are captured at the launch, as CUDA does; the gate is read when it runs.
  if (dtype == DType::kFloat32) {
    const auto s = *static_cast<const rules::FusedScalars<float>*>(scalars);
    sim::enqueue(stream,
                 [=] { gated_update<float>(rule, table, entries, max_count, s, nullptr, 0, gate, blocks, device); });
  } else {
    const auto s = *static_cast<const rules::FusedScalars<double>*>(scalars);
    sim::enqueue(stream,
                 [=] { gated_update<double>(rule, table, entries, max_count, s, nullptr, 0, gate, blocks, device); });
  }
}

void count_nonfinite(DType dtype, const void* data, std::size_t count, int* nonfinite, int sms, cudaStream_t stream) {
  sim::Lock lock;
  if (count == 0) return;
  if (dtype != DType::kFloat32 && dtype != DType::kFloat64)
    throw std::invalid_argument("fused_update: dtype " + std::string(dtype_name(dtype)) +
                                ", the GPU kernel takes float32 and float64");
  launched(stream);
  reachable(data);
  reachable(nonfinite);
  const unsigned blocks = fused_blocks(count, sms);
  const auto check = [=](auto zero) {
    using T = decltype(zero);
    const T* p = static_cast<const T*>(data);
    run_grid(blocks, [&](std::size_t tid, std::size_t stride) {
      bool seen = false;
      for (std::size_t i = tid; i < count; i += stride) seen |= !rules::finite(p[i]);
      if (seen) *nonfinite = 1;
    });
  };
  if (dtype == DType::kFloat32)
    sim::enqueue(stream, [=] { check(float{}); });
  else
    sim::enqueue(stream, [=] { check(double{}); });
}

// The select kernel's one thread, run when it runs: `rows` a copy taken at the launch (by value) or the
// device table itself (read then).
template <typename T>
void select_row_when_run(const long long* iterations, std::shared_ptr<const rules::StepRows<T>> by_value,
                         const void* device_rows, void* out, rules::StepStatus* status, cudaStream_t stream) {
  sim::Lock lock;
  launched(stream);
  for (const void* p : {static_cast<const void*>(iterations), static_cast<const void*>(out),
                        static_cast<const void*>(status)})
    reachable(p);
  if (device_rows != nullptr) reachable(device_rows);
  sim::enqueue(stream, [=] {
    const auto* rows = by_value ? by_value.get() : static_cast<const rules::StepRows<T>*>(device_rows);
    rules::select_step_row(iterations, *rows, static_cast<T*>(out), status);
  });
}

void select_step_row(DType dtype, const long long* iterations, const void* rows, void* out, rules::StepStatus* status,
                     cudaStream_t stream) {
  if (dtype == DType::kFloat32)
    return select_row_when_run<float>(
        iterations, std::make_shared<rules::StepRows<float>>(*static_cast<const rules::StepRows<float>*>(rows)),
        nullptr, out, status, stream);
  if (dtype == DType::kFloat64)
    return select_row_when_run<double>(
        iterations, std::make_shared<rules::StepRows<double>>(*static_cast<const rules::StepRows<double>*>(rows)),
        nullptr, out, status, stream);
  throw std::invalid_argument("select_step_row: the GPU kernel takes float32 and float64");
}

void select_step_row_from_device(DType dtype, const long long* iterations, const void* device_rows, void* out,
                                 rules::StepStatus* status, cudaStream_t stream) {
  if (dtype == DType::kFloat32)
    return select_row_when_run<float>(iterations, nullptr, device_rows, out, status, stream);
  if (dtype == DType::kFloat64)
    return select_row_when_run<double>(iterations, nullptr, device_rows, out, status, stream);
  throw std::invalid_argument("select_step_row: the GPU kernel takes float32 and float64");
}

void loss_scale_step(int* nonfinite, float* scale, long long* counter, long long* iterations, long long growth_steps,
                     bool dynamic, cudaStream_t stream) {
  sim::Lock lock;
  launched(stream);
  for (const void* p : {static_cast<const void*>(nonfinite), static_cast<const void*>(scale),
                        static_cast<const void*>(counter), static_cast<const void*>(iterations)})
    reachable(p);
  sim::enqueue(stream, [=] { rules::loss_scale_step(nonfinite, scale, counter, iterations, growth_steps, dynamic); });
}

// Adafactor (cuda/fused_adafactor.h): the .cu's launches, one per phase, each rules::adafactor_phase per
// thread of the same grid, reading its gate and (from the device) its scalars when it runs.
void fused_adafactor(DType dtype, const void* table, int entries, std::size_t work, void* scratch,
                     const void* scalars, const void* device_scalars, int coefficients, int sms, cudaStream_t stream,
                     LossScaleGate gate) {
  sim::Lock lock;
  if (entries == 0 || work == 0) return;
  if (dtype != DType::kFloat32 && dtype != DType::kFloat64)
    throw std::invalid_argument("fused_update: the GPU kernel takes float32 and float64");
  reachable(table);
  reachable(scratch);
  if (device_scalars != nullptr) reachable(device_scalars);
  const int device = sim::current;
  const unsigned blocks = fused_blocks(work, sms);
  const auto launch = [&](auto zero) {
    using T = decltype(zero);
    rules::FusedScalars<T> given{};  // (kernel arguments are captured at the launch, as CUDA does)
    if (scalars != nullptr) given = *static_cast<const rules::FusedScalars<T>*>(scalars);
    for (int phase = 0; phase < rules::kAdafactorPhases; ++phase) {
      launched(stream);
      sim::enqueue(stream, [=] {
        const auto* t = static_cast<const rules::FusedEntry<T>*>(table);
        const int saved = sim::current;
        sim::current = device;
        for (int e = 0; e < entries; ++e) {  // (the table and the pointers it holds, read when the kernel runs)
          if (t[e].count == 0) continue;
          reachable(t[e].weight), reachable(t[e].grad), reachable(t[e].slots[2]);
          if (t[e].squares) reachable(t[e].squares);
          if (t[e].shape.factored) reachable(t[e].slots[0]), reachable(t[e].slots[1]);
        }
        rules::FusedScalars<T> s = device_scalars != nullptr ? scalars_from<T>(device_scalars, coefficients) : given;
        const bool open = open_gate(gate, s);
        sim::current = saved;
        if (!open) return;
        run_grid(blocks, [&](std::size_t tid, std::size_t stride) {
          rules::adafactor_phase(phase, t, entries, static_cast<T*>(scratch), s, tid, stride);
        });
      });
    }
  };
  if (dtype == DType::kFloat32)
    launch(float{});
  else
    launch(double{});
}

}  // namespace mirrored::cuda

// scatter_add_rows (cuda/scatter_rows.h): the .cu's six kernels, each the same
// body per thread of the same grid. Threads run one at a time in a random
// order, so the count phase's tickets come out in a random order, as a GPU's
// atomics may hand them out: only the rank makes the sums come out right.
namespace mirrored::cuda {

void scatter_add_rows(const ScatterRows& a, void* workspace, int sms, cudaStream_t stream) {
  sim::Lock lock;
  check_scatter_rows(a);
  for (const void* p : std::initializer_list<const void*>{a.values, a.indices, a.out, a.squares, workspace})
    if (p != nullptr) reachable(p);
  const ScatterWork w = scatter_work(workspace, a.slices, a.rows);
  using Body = void (*)(const ScatterRows&, ScatterWork, std::size_t, std::size_t);
  const auto phase = [&](std::size_t work, Body body) {
    launched(stream);
    const unsigned blocks = fused_blocks(work, sms);
    sim::enqueue(stream, [=] {
      run_grid(blocks, [&](std::size_t tid, std::size_t stride) { body(a, w, tid, stride); });
    });
  };
  with_scatter_type(a.dtype, [&](auto zero) {
    using T = decltype(zero);
    phase(scatter_clear_work(a), scatter_clear_body<T>);
    if (a.slices == 0) return;
    phase(a.slices, scatter_count_body);
    phase(a.slices, scatter_reserve_body);
    phase(a.slices, scatter_fill_body);
    phase(a.slices, scatter_rank_body);
    phase(a.slices * a.width, scatter_sum_body<T>);
  });
}

}  // namespace mirrored::cuda
