// A stand-in libnccl for the simulated runtime: the entry points
// NcclCommunicator loads, with NCCL's semantics for one process (int32 and
// float32 only). A group's calls run as one collective: every rank's stream
// records its arrival, rank 0's stream waits for all arrivals and computes
// every output, and the other streams wait for that, as NCCL's kernels
// synchronise the ranks' streams.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "cuda/sim/sim_runtime.h"

namespace {

struct Clique;
struct Comm { int rank; int device; std::shared_ptr<Clique> clique; };
struct Clique { int nranks; };
struct Call { int kind; const void* send; void* recv; std::size_t count; int dtype, op, root; Comm* comm; cudaStream_t stream; };
enum { kAllReduce, kBroadcast, kReduce, kAllGather };
struct UniqueId { char bytes[128]; };

constexpr int version = 22000;
int depth = 0;
std::vector<Call> pending;
std::map<std::string, std::shared_ptr<Clique>> cliques;

template <typename T>
void reduce_into(std::vector<T>& acc, const T* x, int op, bool first) {
  for (std::size_t i = 0; i < acc.size(); ++i) {
    if (first) { acc[i] = x[i]; continue; }
    if constexpr (std::is_integral_v<T>) {  // integers wrap, as NCCL's do (signed overflow is UB here)
      using U = std::make_unsigned_t<T>;
      acc[i] = op == 1 ? T(U(acc[i]) * U(x[i])) : op == 2 ? std::max(acc[i], x[i]) : op == 3 ? std::min(acc[i], x[i])
                                                                       : T(U(acc[i]) + U(x[i]));
    } else {
      acc[i] = op == 1 ? acc[i] * x[i] : op == 2 ? std::max(acc[i], x[i]) : op == 3 ? std::min(acc[i], x[i]) : acc[i] + x[i];
    }
  }
}

template <typename T>
void run_typed(std::vector<Call> calls) {
  const Call& c0 = calls[0];
  const int n = static_cast<int>(calls.size());
  if (c0.kind == kAllGather) {
    const std::size_t bytes = c0.count * sizeof(T);
    std::vector<char> all(bytes * n);
    for (const Call& c : calls) std::memcpy(all.data() + c.comm->rank * bytes, c.send, bytes);
    for (const Call& c : calls) std::memcpy(c.recv, all.data(), all.size());
    return;
  }
  if (c0.kind == kBroadcast) {
    std::vector<T> v(c0.count);
    for (const Call& c : calls) if (c.comm->rank == c.root) std::memcpy(v.data(), c.send, v.size() * sizeof(T));
    for (const Call& c : calls) std::memcpy(c.recv, v.data(), v.size() * sizeof(T));
    return;
  }
  std::vector<T> acc(c0.count);
  for (int r = 0; r < n; ++r) reduce_into(acc, static_cast<const T*>(calls[r].send), c0.op, r == 0);
  if (c0.op == 4) for (auto& x : acc) x = static_cast<T>(x / n);
  for (const Call& c : calls)
    if (c0.kind == kAllReduce || c.comm->rank == c.root) std::memcpy(c.recv, acc.data(), acc.size() * sizeof(T));
}

int launch(std::vector<Call> calls) {
  std::sort(calls.begin(), calls.end(), [](const Call& a, const Call& b) { return a.comm->rank < b.comm->rank; });
  if (static_cast<int>(calls.size()) != calls[0].comm->clique->nranks) return 5;  // ncclInvalidUsage: a rank missing
  std::vector<cudaEvent_t> arrived(calls.size());
  for (std::size_t r = 0; r < calls.size(); ++r) {
    cudaSetDevice(calls[r].comm->device);
    cudaEventCreateWithFlags(&arrived[r], cudaEventDisableTiming);
    cudaEventRecord(arrived[r], calls[r].stream);
  }
  cudaSetDevice(calls[0].comm->device);
  for (auto e : arrived) cudaStreamWaitEvent(calls[0].stream, e, 0), cudaEventDestroy(e);  // a wait keeps its record
  mirrored::cuda::sim::enqueue(calls[0].stream, [calls] {
    if (calls[0].dtype == 2 || calls[0].kind == kAllGather) run_typed<int>(calls);  // gathers are byte copies
    else run_typed<float>(calls);
  });
  cudaEvent_t done;
  cudaEventCreateWithFlags(&done, cudaEventDisableTiming);
  cudaEventRecord(done, calls[0].stream);
  for (std::size_t r = 1; r < calls.size(); ++r) {
    cudaSetDevice(calls[r].comm->device);  // a null stream is the current device's
    cudaStreamWaitEvent(calls[r].stream, done, 0);
  }
  cudaEventDestroy(done);
  return 0;
}

int enqueue(Call c) {
  if (c.kind == kAllGather) c.count /= 4, c.dtype = 2;  // bytes (ncclUint8) as int32 words in the tests
  else if (c.dtype != 2 && c.dtype != 7) return 4;       // ncclInvalidArgument: the fake knows int32/float32
  pending.push_back(c);
  if (depth > 0) return 0;
  std::vector<Call> calls;
  calls.swap(pending);
  return launch(calls);
}

}  // namespace

extern "C" {
int ncclGetVersion(int* v) { *v = version; return 0; }
const char* ncclGetErrorString(int) { return "fake NCCL error"; }
int ncclGetUniqueId(char* id) {
  static unsigned long long next = 0;
  std::memset(id, 0, 128);
  ++next;
  std::memcpy(id, &next, sizeof next);
  return 0;
}
int ncclCommInitRank(Comm** comm, int nranks, UniqueId id, int rank) {
  auto& c = cliques[std::string(id.bytes, 128)];
  if (!c) c = std::make_shared<Clique>(Clique{nranks});
  int device = 0;
  cudaGetDevice(&device);
  *comm = new Comm{rank, device, c};
  return 0;
}
int ncclCommInitAll(Comm** comms, int n, const int* devices) {
  auto c = std::make_shared<Clique>(Clique{n});
  for (int i = 0; i < n; ++i) comms[i] = new Comm{i, devices[i], c};
  return 0;
}
int ncclCommDestroy(Comm* c) { delete c; return 0; }
int ncclGroupStart() { ++depth; return 0; }
int ncclGroupEnd() {
  if (--depth > 0 || pending.empty()) return 0;  // a group of inits has no calls
  std::vector<Call> calls;
  calls.swap(pending);
  return launch(calls);
}
int ncclAllReduce(const void* s, void* r, std::size_t n, int dt, int op, Comm* c, cudaStream_t st) { return enqueue({kAllReduce, s, r, n, dt, op, 0, c, st}); }
int ncclBroadcast(const void* s, void* r, std::size_t n, int dt, int root, Comm* c, cudaStream_t st) { return enqueue({kBroadcast, s, r, n, dt, 0, root, c, st}); }
int ncclReduce(const void* s, void* r, std::size_t n, int dt, int op, int root, Comm* c, cudaStream_t st) { return enqueue({kReduce, s, r, n, dt, op, root, c, st}); }
int ncclAllGather(const void* s, void* r, std::size_t n, int dt, Comm* c, cudaStream_t st) { return enqueue({kAllGather, s, r, n, dt, 0, 0, c, st}); }
}
