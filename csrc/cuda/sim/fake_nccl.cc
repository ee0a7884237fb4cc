// A stand-in libnccl for the simulated runtime: the entry points
// NcclCommunicator loads, with NCCL's semantics for one process (the dtypes
// mirrored passes). A group's calls run as one collective: a device-side
// rendezvous of the ranks' streams (no event between GPUs, as NCCL's kernels
// meet), which stream capture records per GPU and graph launches replay.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "cuda/reduce_ops.cuh"
#include "cuda/sim/sim_runtime.h"

namespace {

struct Clique;
struct Comm { int rank; int device; std::shared_ptr<Clique> clique; };
struct Clique { int nranks; };
struct Call { int kind; const void* send; void* recv; std::size_t count; int dtype, op, root; Comm* comm; cudaStream_t stream; };
enum { kAllReduce, kBroadcast, kReduce, kAllGather };
struct UniqueId { char bytes[128]; };

constexpr int version = 22000;
thread_local int depth = 0;  // groups are per thread, as NCCL's are
thread_local std::vector<Call> pending;
std::map<std::string, std::shared_ptr<Clique>> cliques;

// NCCL's arithmetic, element by element: the kernels' own functors
// (reduce_ops.cuh), so halves combine in float and integers wrap.
template <typename T, mirrored::ReduceOp Op>
void reduce_all(std::vector<T>& acc, const std::vector<Call>& calls, bool mean) {
  using E = mirrored::cuda::Elem<T>;
  const int n = static_cast<int>(calls.size());
  for (std::size_t i = 0; i < acc.size(); ++i) {
    auto v = E::load(static_cast<const T*>(calls[0].send)[i]);
    for (int r = 1; r < n; ++r) v = mirrored::cuda::Combine<Op>()(v, E::load(static_cast<const T*>(calls[r].send)[i]));
    acc[i] = E::store(mean ? mirrored::cuda::divide(v, n) : v);
  }
}

template <typename T>
void run_typed(const std::vector<Call>& calls) {
  using mirrored::ReduceOp;
  const Call& c0 = calls[0];
  if (c0.kind == kBroadcast) {
    std::vector<T> v(c0.count);
    for (const Call& c : calls) if (c.comm->rank == c.root) std::memcpy(v.data(), c.send, v.size() * sizeof(T));
    for (const Call& c : calls) std::memcpy(c.recv, v.data(), v.size() * sizeof(T));
    return;
  }
  std::vector<T> acc(c0.count);
  switch (c0.op) {  // ncclSum, ncclProd, ncclMax, ncclMin, ncclAvg
    case 0: reduce_all<T, ReduceOp::kSum>(acc, calls, false); break;
    case 1: reduce_all<T, ReduceOp::kProd>(acc, calls, false); break;
    case 2: reduce_all<T, ReduceOp::kMax>(acc, calls, false); break;
    case 3: reduce_all<T, ReduceOp::kMin>(acc, calls, false); break;
    default: reduce_all<T, ReduceOp::kSum>(acc, calls, true); break;
  }
  for (const Call& c : calls)
    if (c0.kind == kAllReduce || c.comm->rank == c.root) std::memcpy(c.recv, acc.data(), acc.size() * sizeof(T));
}

void run_gather(const std::vector<Call>& calls) {
  const std::size_t bytes = calls[0].count;  // gathers are byte copies (ncclUint8)
  std::vector<char> all(bytes * calls.size());
  for (const Call& c : calls) std::memcpy(all.data() + c.comm->rank * bytes, c.send, bytes);
  for (const Call& c : calls) std::memcpy(c.recv, all.data(), all.size());
}

void run(const std::vector<Call>& calls) {
  using mirrored::cuda::BF16;
  using mirrored::cuda::F16;
  if (calls[0].kind == kAllGather) return run_gather(calls);
  switch (calls[0].dtype) {  // ncclDataType_t
    case 0: return run_typed<std::int8_t>(calls);
    case 1: return run_typed<std::uint8_t>(calls);
    case 2: return run_typed<std::int32_t>(calls);
    case 4: return run_typed<std::int64_t>(calls);
    case 6: return run_typed<F16>(calls);
    case 7: return run_typed<float>(calls);
    case 8: return run_typed<double>(calls);
    case 9: return run_typed<BF16>(calls);
  }
}

int launch(std::vector<Call> calls) {
  std::sort(calls.begin(), calls.end(), [](const Call& a, const Call& b) { return a.comm->rank < b.comm->rank; });
  if (static_cast<int>(calls.size()) != calls[0].comm->clique->nranks) return 5;  // ncclInvalidUsage: a rank missing
  std::vector<std::pair<int, cudaStream_t>> parties;
  for (const Call& c : calls) parties.emplace_back(c.comm->device, c.stream);
  mirrored::cuda::sim::rendezvous(parties, [calls] { run(calls); });
  return 0;
}

int enqueue(Call c) {
  if (c.kind != kAllGather && (c.dtype < 0 || c.dtype > 9 || c.dtype == 3 || c.dtype == 5))
    return 4;  // ncclInvalidArgument: a dtype mirrored never passes
  pending.push_back(c);
  if (depth > 0) return 0;
  std::vector<Call> calls;
  calls.swap(pending);
  return launch(calls);
}

}  // namespace

// Exported even from a module built with hidden visibility: the Python test
// engine (_cuda_sim) is its own libnccl, dlopen'ed by path like a real one.
#pragma GCC visibility push(default)
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
  mirrored::cuda::sim::Lock lock;  // ranks may join from several threads
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
// Each rank's collective call is counted by name in the runtime's Counters::calls.
int ncclAllReduce(const void* s, void* r, std::size_t n, int dt, int op, Comm* c, cudaStream_t st) {
  mirrored::cuda::sim::Call call("ncclAllReduce");
  return enqueue({kAllReduce, s, r, n, dt, op, 0, c, st});
}
int ncclBroadcast(const void* s, void* r, std::size_t n, int dt, int root, Comm* c, cudaStream_t st) {
  mirrored::cuda::sim::Call call("ncclBroadcast");
  return enqueue({kBroadcast, s, r, n, dt, 0, root, c, st});
}
int ncclReduce(const void* s, void* r, std::size_t n, int dt, int op, int root, Comm* c, cudaStream_t st) {
  mirrored::cuda::sim::Call call("ncclReduce");
  return enqueue({kReduce, s, r, n, dt, op, root, c, st});
}
int ncclAllGather(const void* s, void* r, std::size_t n, int dt, Comm* c, cudaStream_t st) {
  mirrored::cuda::sim::Call call("ncclAllGather");
  return enqueue({kAllGather, s, r, n, dt, 0, 0, c, st});
}
}
#pragma GCC visibility pop
