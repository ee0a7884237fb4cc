// The hierarchical engine (nccl/hierarchical.h) on the simulated runtime and
// the stand-in libnccl (its path is the argument): replicas on several GPUs,
// some GPUs hosting several, evenly or not, interleaved or not, on one stream
// per GPU or one per replica. Every collective and op, in and out of place,
// under random interleavings (the callers' streams write the inputs before a
// call and read, then scribble over, the buffers after it); the launch count
// (one fold, one NCCL call and one copy per GPU, no event); a fused batch;
// and one CUDA graph per GPU that replays the all-reduce.
// Exit status 0 when all is right.
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "cuda/device_batch.h"
#include "cuda/sim/expect.h"
#include "cuda/sim/sim_replicas.h"
#include "cuda/sim/sim_runtime.h"
#include "cuda/stream_scope.h"
#include "nccl/hierarchical.h"
#include "nccl/nccl_lib.h"

using namespace mirrored;
using namespace mirrored::cuda;

namespace {

using sim_check::failures;

// Small integers: every op is exact in int32, prod stays within 2^8.
int value(int seed, std::size_t i, ReduceOp op) {
  if (op == ReduceOp::kProd) return (i + seed) % 3 == 0 ? 2 : ((i + seed) % 3 == 1 ? 1 : -1);
  return static_cast<int>((i * 7 + seed * 3) % 11) - 5;
}

int expected(int n, std::size_t i, ReduceOp op) {
  const ReduceOp c = combining_op(op);
  long long e = value(0, i, op);
  for (int q = 1; q < n; ++q) {
    const long long v = value(q, i, op);
    e = c == ReduceOp::kProd ? e * v : c == ReduceOp::kMin ? std::min(e, v) : c == ReduceOp::kMax ? std::max(e, v) : e + v;
  }
  return static_cast<int>(op == ReduceOp::kMean ? e / n : e);
}

// Replicas on `devices`; each replica's stream: its GPU's one stream, or one of its own.
struct Setup : sim_check::Replicas {
  std::vector<cudaStream_t> made;
  Setup(std::vector<int> d, bool stream_each) : Replicas(std::move(d)) {
    std::map<int, cudaStream_t> of_gpu;
    for (int device : devices) {
      if (!stream_each && of_gpu.count(device)) {
        streams.push_back(of_gpu[device]);
        continue;
      }
      cudaSetDevice(device);
      cudaStream_t s = nullptr;
      cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
      made.push_back(s);
      streams.push_back(of_gpu[device] = s);
    }
  }
  ~Setup() {
    for (auto s : made) cudaStreamDestroy(s);
  }
  void write(int r, void* p, std::size_t count, int seed, ReduceOp op) {
    on(r, [=] {
      for (std::size_t i = 0; i < count; ++i) static_cast<int*>(p)[i] = value(seed, i, op);
    });
  }
  // Reads p into `into` on r's stream, then scribbles over p (the caller reuses its buffer at once).
  void read(int r, void* p, std::size_t count, std::vector<int>& into) {
    into.assign(count, 0);
    int* dst = into.data();
    if (count == 0) return;
    on(r, [=] {
      std::memcpy(dst, p, count * sizeof(int));
      std::memset(p, 0x5a, count * sizeof(int));
    });
  }
  // Whether every GPU hosts the same number of replicas, consecutive ones (all_gather goes by GPU).
  bool blocks() const {
    if (devices.size() % gpus()) return false;
    const std::size_t per = devices.size() / gpus();
    for (std::size_t r = 1; r < devices.size(); ++r)
      if ((devices[r] != devices[r - 1]) != (r % per == 0)) return false;
    return true;
  }
  int gpus() const { return static_cast<int>(std::set<int>(devices.begin(), devices.end()).size()); }
};

void check_collectives(Setup& s, std::size_t count, bool in_place) {
  const int n = s.n();
  nccl::HierarchicalCommunicator comm(s.devices);
  EXPECT(comm.gpus() == s.gpus(), "gpus() is %d, not %d", comm.gpus(), s.gpus());
  std::vector<void*> in(n), out(n);
  for (int r = 0; r < n; ++r) {
    in[r] = s.alloc(r, (count + r) * 4);  // (the uneven all_gather's rows are count + r long)
    out[r] = in_place ? in[r] : s.alloc(r, count * 4);
  }
  std::vector<std::vector<int>> got(n);
  for (auto op : {ReduceOp::kSum, ReduceOp::kProd, ReduceOp::kMin, ReduceOp::kMax, ReduceOp::kMean}) {
    for (int r = 0; r < n; ++r) s.write(r, in[r], count, r, op);
    sim::reset_counters();
    {
      StreamScope scope(s.streams);
      comm.all_reduce(n, in.data(), out.data(), count, DType::kInt32, op, Algorithm::kAuto);
    }
    const sim::Counters c = sim::counters();
    const bool shared = s.made.size() == static_cast<std::size_t>(s.gpus());
    if (count > 0 && shared) {  // one stream per GPU: nothing but the kernels and NCCL
      const long want = s.gpus() > 1 ? s.gpus() : 0;
      EXPECT(c.calls.count("ncclAllReduce") ? c.calls.at("ncclAllReduce") == want : want == 0,
             "all_reduce: NCCL calls for %d GPUs", s.gpus());
      EXPECT(!c.calls.count("cudaStreamWaitEvent") && !c.calls.count("cudaEventRecord"),
             "all_reduce on one stream per GPU recorded or waited for an event");
      for (const auto& [d, k] : c.launches) EXPECT(k <= 2, "all_reduce: %ld launches on GPU %d", k, d);
    }
    for (int r = 0; r < n; ++r) s.read(r, out[r], count, got[r]);
    sim::drain();
    for (int r = 0; r < n; ++r)
      for (std::size_t i = 0; i < count; ++i)
        EXPECT(got[r][i] == expected(n, i, op), "all_reduce n=%d op=%s in_place=%d: replica %d element %zu is %d",
               n, reduce_op_name(op), in_place, r, i, got[r][i]);
  }
  for (int root = 0; root < n; ++root) {
    for (int r = 0; r < n; ++r) s.write(r, in[r], count, r, ReduceOp::kSum);
    {
      StreamScope scope(s.streams);
      comm.broadcast(n, in.data(), out.data(), count, DType::kInt32, root);
    }
    for (int r = 0; r < n; ++r) s.read(r, out[r], count, got[r]);
    sim::drain();
    for (int r = 0; r < n; ++r)
      for (std::size_t i = 0; i < count; ++i)
        EXPECT(got[r][i] == value(root, i, ReduceOp::kSum), "broadcast n=%d root=%d: replica %d element %zu", n,
               root, r, i);
    // reduce: only the root's output is written.
    for (auto op : {ReduceOp::kSum, ReduceOp::kProd, ReduceOp::kMin, ReduceOp::kMax, ReduceOp::kMean}) {
      for (int r = 0; r < n; ++r) {
        s.write(r, in[r], count, r, op);
        if (!in_place) s.write(r, out[r], count, 100 + r, ReduceOp::kSum);
      }
      {
        StreamScope scope(s.streams);
        comm.reduce(n, in.data(), out.data(), count, DType::kInt32, op, root);
      }
      for (int r = 0; r < n; ++r) s.read(r, out[r], count, got[r]);
      sim::drain();
      for (int r = 0; r < n; ++r)
        for (std::size_t i = 0; i < count; ++i) {
          const int want = r == root ? expected(n, i, op) : in_place ? value(r, i, op) : value(100 + r, i, ReduceOp::kSum);
          EXPECT(got[r][i] == want, "reduce n=%d root=%d op=%s in_place=%d: replica %d element %zu is %d, not %d", n,
                 root, reduce_op_name(op), in_place, r, i, got[r][i], want);
        }
    }
  }
  // all_gather: by GPU (equal rows, the same number of consecutive replicas on each GPU) or by the
  // native engine (the others, and rows of different sizes).
  for (bool equal : {true, false}) {
    std::vector<std::size_t> rows(n);
    std::size_t width = 0;
    for (int r = 0; r < n; ++r) rows[r] = (equal ? count : count + r) * 4, width += rows[r];
    std::vector<void*> gout(n);
    for (int r = 0; r < n; ++r) {
      s.write(r, in[r], rows[r] / 4, r, ReduceOp::kSum);
      gout[r] = s.alloc(r, width);
    }
    sim::reset_counters();
    {
      StreamScope scope(s.streams);
      comm.all_gather(n, in.data(), gout.data(), rows.data(), 1);
    }
    const sim::Counters c = sim::counters();
    if (equal && count > 0 && s.made.size() == static_cast<std::size_t>(s.gpus()) && s.gpus() > 1 && s.blocks()) {
      EXPECT(c.calls.count("ncclAllGather") && c.calls.at("ncclAllGather") == s.gpus(),
             "all_gather by GPU: NCCL calls for %d GPUs", s.gpus());
      for (const auto& [d, k] : c.launches) EXPECT(k <= 2, "all_gather: %ld launches on GPU %d", k, d);
    }
    for (int r = 0; r < n; ++r) s.read(r, gout[r], width / 4, got[r]);
    sim::drain();
    for (int r = 0; r < n; ++r) {
      std::size_t at = 0;
      for (int j = 0; j < n; ++j)
        for (std::size_t i = 0; i < rows[j] / 4; ++i, ++at)
          EXPECT(got[r][at] == value(j, i, ReduceOp::kSum), "all_gather n=%d equal=%d: replica %d part %d element %zu",
                 n, equal, r, j, i);
    }
  }
  // A fused batch: packed per replica, each pack through the engine, unpacked.
  DeviceBatch batch(s.devices);
  const std::vector<std::size_t> counts = {3, count, 5, 0, 17};
  const std::vector<DType> dtypes(counts.size(), DType::kInt32);
  std::vector<std::vector<const void*>> bin(n);
  std::vector<std::vector<void*>> bout(n);
  for (int r = 0; r < n; ++r)
    for (std::size_t t = 0; t < counts.size(); ++t) {
      void* p = s.alloc(r, counts[t] * 4);
      s.write(r, p, counts[t], r + static_cast<int>(t), ReduceOp::kSum);
      bin[r].push_back(p);
      bout[r].push_back(in_place ? p : s.alloc(r, counts[t] * 4));
    }
  sim::reset_counters();
  {
    StreamScope scope(s.streams);
    batch.all_reduce(comm, bin, bout, counts, dtypes, ReduceOp::kSum, Algorithm::kAuto, 0, 0);
  }
  // One pack: per GPU and stream the pack, the fold and the unpack (every replica reads the GPU's one result).
  if (s.made.size() == static_cast<std::size_t>(s.gpus()))
    for (const auto& [d, k] : sim::counters().launches) EXPECT(k <= 3, "batch: %ld launches on GPU %d", k, d);
  std::vector<std::vector<std::vector<int>>> res(n, std::vector<std::vector<int>>(counts.size()));
  for (int r = 0; r < n; ++r)
    for (std::size_t t = 0; t < counts.size(); ++t) s.read(r, bout[r][t], counts[t], res[r][t]);
  sim::drain();
  for (int r = 0; r < n; ++r)
    for (std::size_t t = 0; t < counts.size(); ++t)
      for (std::size_t i = 0; i < counts[t]; ++i) {
        int e = 0;
        for (int q = 0; q < n; ++q) e += value(q + static_cast<int>(t), i, ReduceOp::kSum);
        EXPECT(res[r][t][i] == e, "batch n=%d: replica %d tensor %zu element %zu", n, r, t, i);
      }
}

// One graph per GPU, each capturing its GPU's one stream: the replays give the all-reduce of the
// inputs written before each launch, with no kernel launched from the host.
void check_capture(const std::vector<int>& devices) {
  Setup s(devices, false);
  const int n = s.n();
  const std::size_t count = 100;
  nccl::HierarchicalCommunicator comm(s.devices);
  std::vector<void*> in(n), out(n);
  for (int r = 0; r < n; ++r) in[r] = s.alloc(r, count * 4), out[r] = s.alloc(r, count * 4);
  sim::drain();
  for (std::size_t k = 0; k < s.made.size(); ++k)
    EXPECT(cudaStreamBeginCapture(s.made[k], cudaStreamCaptureModeRelaxed) == cudaSuccess, "begin capture");
  std::vector<void*> last(n, nullptr);  // the reduce's outputs: only the last replica's is written
  last[n - 1] = s.alloc(n - 1, count * 4);
  std::vector<void*> gathered(n);  // and an all_gather where it goes by GPU
  const std::vector<std::size_t> rows(n, count * 4);
  for (int r = 0; r < n; ++r) gathered[r] = s.alloc(r, count * 4 * n);
  {
    StreamScope scope(s.streams);
    comm.all_reduce(n, in.data(), out.data(), count, DType::kInt32, ReduceOp::kSum, Algorithm::kAuto);
    comm.reduce(n, in.data(), last.data(), count, DType::kInt32, ReduceOp::kMax, n - 1);
    if (s.blocks()) comm.all_gather(n, in.data(), gathered.data(), rows.data(), 1);
  }
  std::vector<cudaGraphExec_t> execs(s.made.size());
  for (std::size_t k = 0; k < s.made.size(); ++k) {
    cudaGraph_t graph = nullptr;
    EXPECT(cudaStreamEndCapture(s.made[k], &graph) == cudaSuccess, "capture of GPU stream %zu", k);
    cudaGraphInstantiate(&execs[k], graph, 0);
    cudaGraphDestroy(graph);
  }
  for (int replay = 0; replay < 3; ++replay) {
    for (int r = 0; r < n; ++r) s.write(r, in[r], count, r + replay, ReduceOp::kSum);
    sim::reset_counters();
    for (std::size_t k = s.made.size(); k-- > 0;) cudaGraphLaunch(execs[k], s.made[k]);
    EXPECT(sim::counters().launches_total() == 0, "a replay launches no kernel");
    std::vector<std::vector<int>> got(n), top, all(n);
    for (int r = 0; r < n; ++r) s.read(r, out[r], count, got[r]), s.read(r, gathered[r], count * n, all[r]);
    top.resize(1);
    s.read(n - 1, last[n - 1], count, top[0]);
    sim::drain();
    for (std::size_t i = 0; i < count; ++i) {
      int e = 0, m = value(replay, i, ReduceOp::kMax);
      for (int q = 0; q < n; ++q) e += value(q + replay, i, ReduceOp::kSum), m = std::max(m, value(q + replay, i, ReduceOp::kMax));
      for (int r = 0; r < n; ++r)
        EXPECT(got[r][i] == e, "replay %d: replica %d element %zu is %d, not %d", replay, r, i, got[r][i], e);
      EXPECT(top[0][i] == m, "replay %d: the reduce's element %zu is %d, not %d", replay, i, top[0][i], m);
      for (int r = 0; r < n && s.blocks(); ++r)
        for (int j = 0; j < n; ++j)
          EXPECT(all[r][j * count + i] == value(j + replay, i, ReduceOp::kSum),
                 "replay %d: replica %d's gather, part %d element %zu", replay, r, j, i);
    }
  }
  for (auto e : execs) cudaGraphExecDestroy(e);
  for (int r = 0; r < n; ++r) cudaFree(in[r]), cudaFree(out[r]);
  cudaFree(last[n - 1]);
  for (void* p : gathered) cudaFree(p);
}

// Threads sharing one engine, each on streams of its own: the engine serves one call at a time, and
// every thread's results are its own inputs' all-reduce.
void check_threads() {
  const std::vector<int> devices{0, 0, 1, 1, 1};
  nccl::HierarchicalCommunicator comm(devices);
  std::atomic<int> wrong{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 3; ++t)
    threads.emplace_back([t, &devices, &comm, &wrong] {
      Setup s(devices, false);
      const int n = s.n();
      const std::size_t count = 301;
      std::vector<void*> buf(n);
      for (int round = 0; round < 10; ++round) {
        for (int r = 0; r < n; ++r) {
          buf[r] = s.alloc(r, count * 4);
          s.write(r, buf[r], count, r + t, ReduceOp::kSum);
        }
        {
          StreamScope scope(s.streams);
          std::vector<const void*> in(buf.begin(), buf.end());
          comm.all_reduce(n, in.data(), buf.data(), count, DType::kInt32, ReduceOp::kSum, Algorithm::kAuto);
        }
        std::vector<std::vector<int>> res(n);
        for (int r = 0; r < n; ++r) s.read(r, buf[r], count, res[r]);
        for (cudaStream_t st : s.made) cudaStreamSynchronize(st);
        for (int r = 0; r < n; ++r) {
          for (std::size_t i = 0; i < count; ++i) {
            int e = 0;
            for (int q = 0; q < n; ++q) e += value(q + t, i, ReduceOp::kSum);
            wrong += res[r][i] != e;
          }
          cudaFree(buf[r]);
        }
      }
    });
  for (auto& th : threads) th.join();
  EXPECT(wrong == 0, "%d wrong elements with 3 threads sharing the engine", wrong.load());
}

// Two buffers for three replicas: every collective says so, naming itself.
void check_errors() {
  nccl::HierarchicalCommunicator comm({0, 0, 1});
  std::vector<void*> p(2, nullptr);
  const std::size_t rows[2] = {4, 4};
  const std::vector<std::pair<const char*, std::function<void()>>> calls = {
      {"all_reduce",
       [&] { comm.all_reduce(2, p.data(), p.data(), 1, DType::kInt32, ReduceOp::kSum, Algorithm::kAuto); }},
      {"broadcast", [&] { comm.broadcast(2, p.data(), p.data(), 1, DType::kInt32, 0); }},
      {"reduce", [&] { comm.reduce(2, p.data(), p.data(), 1, DType::kInt32, ReduceOp::kSum, 0); }},
      {"all_gather", [&] { comm.all_gather(2, p.data(), p.data(), rows, 1); }}};
  for (const auto& [what, call] : calls) {
    std::string message;
    try {
      call();
    } catch (const std::invalid_argument& e) {
      message = e.what();
    }
    EXPECT(message == std::string(what) + ": got 2 buffers for 3 replicas; pass one buffer per replica",
           "%s: message '%s'", what, message.c_str());
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::printf("usage: %s PATH_TO_FAKE_LIBNCCL\n", argv[0]);
    return 2;
  }
  nccl::load({argv[1]});
  sim::reset(4, {}, 1);
  check_errors();
  check_threads();
  long runs = 0;
  const std::vector<std::vector<int>> layouts = {
      {0, 0, 1, 1}, {0, 0, 0, 1, 1, 1}, {0, 0, 1}, {0, 1, 1, 1}, {1, 0, 1, 0}, {0, 0, 1, 1, 2, 2, 3, 3}, {0, 0}};
  for (const auto& devices : layouts)
    for (bool stream_each : {false, true})
      for (std::size_t count : {0, 1, 13, 100})
        for (bool in_place : {false, true}) {
          sim::reset(4, {}, static_cast<unsigned>(runs));
          Setup s(devices, stream_each);
          check_collectives(s, count, in_place);
          ++runs;
        }
  for (const auto& devices : layouts) {
    sim::reset(4, {}, static_cast<unsigned>(runs++));
    check_capture(devices);
  }
  std::printf("hierarchical engine on the simulated runtime: %ld configurations, %d failures\n", runs, failures);
  return failures ? 1 : 0;
}
