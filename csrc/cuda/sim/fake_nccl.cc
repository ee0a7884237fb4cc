// A stand-in libnccl for the simulated runtime: the entry points
// NcclCommunicator loads, with NCCL's semantics for one process (the dtypes
// mirrored passes). A group's calls run as one collective: a device-side
// rendezvous of the ranks' streams (no event between GPUs, as NCCL's kernels
// meet), which stream capture records per GPU and graph launches replay.
//
// The collective reads and writes the ranks' own buffers, no staging copy, so an
// aliasing mistake of the caller shows as it would on NCCL. NCCL's in-place rules
// (its documentation, "In-place Operations"): all-reduce, broadcast and reduce are
// in place when sendbuff == recvbuff, all-gather when sendbuff == recvbuff +
// rank * sendcount; every other pair of buffers a call uses, within a rank and
// across ranks, must not overlap. NCCL does not check that (its kernels then
// corrupt the results); this stand-in refuses the call with ncclInvalidArgument
// and says which buffers overlap (ncclGetLastError).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <utility>
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
constexpr int kInvalidArgument = 4, kInvalidUsage = 5;  // ncclResult_t
thread_local int depth = 0;  // groups are per thread, as NCCL's are
thread_local std::vector<Call> pending;
thread_local std::string last_error;  // what ncclGetLastError says
std::map<std::string, std::shared_ptr<Clique>> cliques;

std::size_t dtype_bytes(int dtype) {  // ncclDataType_t; gathers count bytes (ncclUint8)
  switch (dtype) {
    case 0: case 1: return 1;
    case 6: case 9: return 2;
    case 2: case 7: return 4;
    default: return 8;
  }
}

// The byte ranges a rank's call reads and writes, as NCCL uses them: a broadcast reads only the root's
// sendbuff and a reduce writes only the root's recvbuff (NCCL ignores the other ranks' one).
struct Extent { const char* begin; std::size_t bytes; const char* what; };
struct Uses { Extent read{}, written{}; };

Uses uses_of(const Call& c) {
  const std::size_t bytes = c.count * (c.kind == kAllGather ? 1 : dtype_bytes(c.dtype));
  const bool root = c.comm->rank == c.root;
  Uses u;
  if (c.kind != kBroadcast || root) u.read = {static_cast<const char*>(c.send), bytes, "sendbuff"};
  if (c.kind != kReduce || root)
    u.written = {static_cast<const char*>(c.recv), c.kind == kAllGather ? bytes * c.comm->clique->nranks : bytes,
                 "recvbuff"};
  return u;
}

bool overlap(const Extent& a, const Extent& b) {
  return a.bytes && b.bytes && a.begin < b.begin + b.bytes && b.begin < a.begin + a.bytes;
}

// Whether a rank's sendbuff and recvbuff are NCCL's in-place pair for its call.
bool in_place(const Call& c) {
  const std::size_t offset = c.kind == kAllGather ? c.count * static_cast<std::size_t>(c.comm->rank) : 0;
  return static_cast<const char*>(c.send) == static_cast<const char*>(c.recv) + offset;
}

// An empty string when the calls' buffers follow NCCL's rules, else which buffers overlap.
std::string illegal_overlap(const std::vector<Call>& calls) {
  char text[160];
  for (std::size_t a = 0; a < calls.size(); ++a) {
    const Uses ua = uses_of(calls[a]);
    if (overlap(ua.read, ua.written) && !in_place(calls[a])) {
      std::snprintf(text, sizeof text, "rank %d's sendbuff overlaps its recvbuff without being NCCL's in-place pair",
                    calls[a].comm->rank);
      return text;
    }
    for (std::size_t b = 0; b < calls.size(); ++b) {
      if (a == b) continue;
      const Uses ub = uses_of(calls[b]);
      for (const Extent& other : {ub.read, ub.written})
        if (overlap(ua.written, other)) {
          std::snprintf(text, sizeof text, "rank %d's recvbuff overlaps rank %d's %s", calls[a].comm->rank,
                        calls[b].comm->rank, other.what);
          return text;
        }
    }
  }
  return {};
}

// NCCL's arithmetic, element by element: the kernels' own functors
// (reduce_ops.cuh), so halves combine in float and integers wrap. Every rank's
// element i is read before any is written: an in-place rank's own one too.
template <typename T, mirrored::ReduceOp Op>
void reduce_all(const std::vector<Call>& calls, bool mean) {
  using E = mirrored::cuda::Elem<T>;
  const int n = static_cast<int>(calls.size());
  const Call& c0 = calls[0];
  for (std::size_t i = 0; i < c0.count; ++i) {
    auto v = E::load(static_cast<const T*>(c0.send)[i]);
    for (int r = 1; r < n; ++r) v = mirrored::cuda::Combine<Op>()(v, E::load(static_cast<const T*>(calls[r].send)[i]));
    const T out = E::store(mean ? mirrored::cuda::divide(v, n) : v);
    for (const Call& c : calls)
      if (c.kind == kAllReduce || c.comm->rank == c.root) static_cast<T*>(c.recv)[i] = out;
  }
}

template <typename T>
void run_typed(const std::vector<Call>& calls) {
  using mirrored::ReduceOp;
  const Call& c0 = calls[0];
  if (c0.kind == kBroadcast) {
    const Call* root = nullptr;
    for (const Call& c : calls) if (c.comm->rank == c.root) root = &c;
    for (const Call& c : calls)
      if (c.recv != root->send) std::memcpy(c.recv, root->send, c.count * sizeof(T));
    return;
  }
  switch (c0.op) {  // ncclSum, ncclProd, ncclMax, ncclMin, ncclAvg
    case 0: return reduce_all<T, ReduceOp::kSum>(calls, false);
    case 1: return reduce_all<T, ReduceOp::kProd>(calls, false);
    case 2: return reduce_all<T, ReduceOp::kMax>(calls, false);
    case 3: return reduce_all<T, ReduceOp::kMin>(calls, false);
    default: return reduce_all<T, ReduceOp::kSum>(calls, true);
  }
}

// Rank j's sendbuff into part j of every rank's recvbuff; an in-place rank's own part is its sendbuff already.
void run_gather(const std::vector<Call>& calls) {
  const std::size_t bytes = calls[0].count;  // gathers are byte copies (ncclUint8)
  for (const Call& c : calls)
    for (const Call& part : calls) {
      char* to = static_cast<char*>(c.recv) + part.comm->rank * bytes;
      if (to != part.send) std::memcpy(to, part.send, bytes);
    }
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
  if (static_cast<int>(calls.size()) != calls[0].comm->clique->nranks) {
    last_error = "a rank of the communicator is missing from the collective";
    return kInvalidUsage;
  }
  last_error = illegal_overlap(calls);
  if (!last_error.empty()) return kInvalidArgument;
  std::vector<std::pair<int, cudaStream_t>> parties;
  for (const Call& c : calls) parties.emplace_back(c.comm->device, c.stream);
  mirrored::cuda::sim::rendezvous(parties, [calls] { run(calls); });
  return 0;
}

int enqueue(Call c) {
  if (c.kind != kAllGather && (c.dtype < 0 || c.dtype > 9 || c.dtype == 3 || c.dtype == 5)) {
    last_error = "a dtype mirrored never passes";
    return kInvalidArgument;
  }
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
const char* ncclGetErrorString(int result) {
  return result == kInvalidArgument ? "invalid argument (fake NCCL)"
         : result == kInvalidUsage  ? "invalid usage (fake NCCL)"
                                    : "fake NCCL error";
}
const char* ncclGetLastError(Comm*) { return last_error.c_str(); }
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
