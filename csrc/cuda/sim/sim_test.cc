// The CUDA executor (CudaRing, DeviceBatch) on the simulated runtime: every
// collective, algorithm and layout (ranks sharing a GPU, one GPU each, with
// and without peer access), in and out of place, under many random
// interleavings. The callers' streams write the inputs before each call and
// read then scribble over inputs and outputs after it, so a missing fork or
// join dependency corrupts a result. With a path to fake_nccl's library as
// argument, NcclCommunicator (and batches over it) run the same checks.
// Exit status 0 when all is right.
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <type_traits>
#include <cstring>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "cuda/cuda_ring.h"
#include "cuda/device.h"
#include "cuda/device_batch.h"
#include "cuda/fused.h"
#include "cuda/reduce_ops.cuh"
#include "cuda/sim/expect.h"
#include "cuda/sim/sim_replicas.h"
#include "cuda/sim/sim_runtime.h"
#include "cuda/stream_scope.h"
#include "nccl/nccl_communicator.h"

using namespace mirrored;
using namespace mirrored::cuda;

namespace {

using sim_check::failures;

// Exact in every dtype used: small integers, and prod stays within 2^4.
long long value(int rank, std::size_t i, ReduceOp op) {
  if (op == ReduceOp::kProd) return (i + rank) % 3 == 0 ? 2 : ((i + rank) % 3 == 1 ? 1 : -1);
  return static_cast<long long>((i * 7 + rank * 3) % 11) - 5;
}

long long expected(int n, std::size_t i, ReduceOp op) {
  long long e = value(0, i, op);
  for (int q = 1; q < n; ++q) {
    const long long v = value(q, i, op);
    e = op == ReduceOp::kProd ? e * v : op == ReduceOp::kMin ? std::min(e, v) : op == ReduceOp::kMax ? std::max(e, v) : e + v;
  }
  return e;
}

// Ranks on `devices`, each on a stream of its own or on its device's default stream.
struct Layout : sim_check::Replicas {
  Layout(std::vector<int> d, bool own_streams) : Replicas(std::move(d)) {
    streams.assign(devices.size(), nullptr);
    for (std::size_t r = 0; r < devices.size() && own_streams; ++r) {
      cudaSetDevice(devices[r]);
      cudaStreamCreateWithFlags(&streams[r], 0);
    }
  }
  ~Layout() {
    for (auto s : streams)
      if (s) cudaStreamDestroy(s);
  }
};

template <typename T>
void write(Layout& l, int r, void* p, std::size_t count, ReduceOp op, int seed) {
  l.on(r, [=] {
    for (std::size_t i = 0; i < count; ++i) static_cast<T*>(p)[i] = static_cast<T>(value(seed, i, op));
  });
}

template <typename T>
void read(Layout& l, int r, void* p, std::size_t count, std::vector<T>& into) {
  into.assign(count, T());
  T* dst = into.data();
  if (count == 0) return;  // (an empty vector's data() may be null, which memcpy must not get)
  l.on(r, [=] {
    std::memcpy(dst, p, count * sizeof(T));
    std::memset(p, 0x5a, count * sizeof(T));  // the caller reuses its buffer at once
  });
}

// The tensors of a fused batch on every rank (int32 or float32, seeded per
// rank and tensor) and where their results go.
void batch_buffers(Layout& l, int n, const std::vector<std::size_t>& counts, const std::vector<DType>& dtypes,
                   ReduceOp s, bool in_place, std::vector<std::vector<const void*>>& bin,
                   std::vector<std::vector<void*>>& bout) {
  bin.assign(n, {});
  bout.assign(n, {});
  for (int r = 0; r < n; ++r)
    for (std::size_t t = 0; t < counts.size(); ++t) {
      void* p = l.alloc(r, counts[t] * 4);
      if (dtypes[t] == DType::kInt32) write<int>(l, r, p, counts[t], s, r + int(t));
      else write<float>(l, r, p, counts[t], s, r + int(t));
      bin[r].push_back(p);
      bout[r].push_back(in_place ? p : l.alloc(r, counts[t] * 4));
    }
}

// Whether every rank's batch outputs hold the sums batch_buffers' inputs must give.
bool batch_summed(Layout& l, int n, const std::vector<std::size_t>& counts, const std::vector<DType>& dtypes,
                  ReduceOp s, const std::vector<std::vector<void*>>& bout, const char* what) {
  std::vector<std::vector<std::vector<int>>> res(n, std::vector<std::vector<int>>(counts.size()));
  for (int r = 0; r < n; ++r)
    for (std::size_t t = 0; t < counts.size(); ++t) read<int>(l, r, bout[r][t], counts[t], res[r][t]);
  sim::drain();
  for (int r = 0; r < n; ++r)
    for (std::size_t t = 0; t < counts.size(); ++t)
      for (std::size_t i = 0; i < counts[t]; ++i) {
        long long e = 0;
        for (int q = 0; q < n; ++q) e += value(q + int(t), i, s);
        float f;
        std::memcpy(&f, &res[r][t][i], 4);
        if (dtypes[t] == DType::kInt32 ? res[r][t][i] == e : f == float(e)) continue;
        if (++failures <= 10) std::printf("FAIL: %s n=%d: rank %d tensor %zu element %zu\n", what, n, r, t, i);
        return false;
      }
  return true;
}

template <typename T>
void check_all_reduce(Layout& l, std::size_t count, std::size_t chunk, int channels, ReduceOp op, Algorithm algo,
                      bool in_place, DType dtype) {
  const int n = l.n();
  CudaRing ring(l.devices, chunk, channels);
  std::vector<void*> in(n), out(n);
  for (int r = 0; r < n; ++r) {
    in[r] = l.alloc(r, count * sizeof(T));
    out[r] = in_place ? in[r] : l.alloc(r, count * sizeof(T));
  }
  for (int call = 0; call < 2; ++call) {  // twice: events, streams and scratch are reused
    std::vector<std::vector<T>> got(n);
    for (int r = 0; r < n; ++r) write<T>(l, r, in[r], count, op, r);
    {
      StreamScope scope(l.streams);
      ring.all_reduce(n, in.data(), out.data(), count, dtype, op, algo);
    }
    for (int r = 0; r < n; ++r) {
      read<T>(l, r, out[r], count, got[r]);
      if (!in_place) l.on(r, [p = in[r], count] { std::memset(p, 0x66, count * sizeof(T)); });
    }
    sim::drain();
    for (int r = 0; r < n; ++r)
      for (std::size_t i = 0; i < count; ++i) {
        long long e = expected(n, i, op == ReduceOp::kMean ? ReduceOp::kSum : op);
        const double want = op != ReduceOp::kMean ? double(e)
                          : std::is_integral<T>::value ? double(e / n) : double(T(e) / T(n));
        EXPECT(double(got[r][i]) == want, "all_reduce n=%d count=%zu chunk=%zu channels=%d op=%s algo=%s in_place=%d: "
               "rank %d element %zu is %g, expected %g", n, count, chunk, channels, reduce_op_name(op),
               algorithm_name(algo), in_place, r, i, double(got[r][i]), want);
      }
  }
  for (int r = 0; r < n; ++r) {
    cudaFree(in[r]);
    if (!in_place) cudaFree(out[r]);
  }
}

void check_others(Layout& l, std::size_t count, bool in_place) {
  const int n = l.n();
  const ReduceOp s = ReduceOp::kSum;
  CudaRing ring(l.devices, 48, 2);
  DeviceBatch batch(l.devices);
  std::vector<void*> in(n), out(n);
  for (int r = 0; r < n; ++r) {
    in[r] = l.alloc(r, count * 4);
    out[r] = in_place ? in[r] : l.alloc(r, count * 4);
  }
  std::vector<std::vector<int>> got(n);
  for (int root = 0; root < n; ++root) {
    for (int r = 0; r < n; ++r) write<int>(l, r, in[r], count, s, r);
    {
      StreamScope scope(l.streams);
      ring.broadcast(n, in.data(), out.data(), count, DType::kInt32, root);
    }
    for (int r = 0; r < n; ++r) read<int>(l, r, out[r], count, got[r]);
    sim::drain();
    for (int r = 0; r < n; ++r)
      for (std::size_t i = 0; i < count; ++i)
        EXPECT(got[r][i] == value(root, i, s), "broadcast n=%d root=%d: rank %d element %zu", n, root, r, i);

    for (int r = 0; r < n; ++r) {
      write<int>(l, r, in[r], count, s, r);
      if (!in_place) write<int>(l, r, out[r], count, s, 100 + r);  // must stay untouched off the root
    }
    {
      StreamScope scope(l.streams);
      ring.reduce(n, in.data(), out.data(), count, DType::kInt32, ReduceOp::kMean, root);
    }
    for (int r = 0; r < n; ++r) read<int>(l, r, out[r], count, got[r]);
    sim::drain();
    for (int r = 0; r < n; ++r)
      for (std::size_t i = 0; i < count; ++i) {
        const long long want = r == root ? expected(n, i, s) / n : value(in_place ? r : 100 + r, i, s);
        EXPECT(got[r][i] == want, "reduce n=%d root=%d in_place=%d: rank %d element %zu is %d, expected %lld", n,
               root, in_place, r, i, got[r][i], want);
      }
  }
  // all_gather: rank j gives j+1 ints per row; `outer` rows.
  for (std::size_t outer : {1, 3}) {
    std::vector<std::size_t> row(n);
    std::size_t pitch = 0;
    std::vector<void*> gin(n), gout(n);
    for (int j = 0; j < n; ++j) pitch += row[j] = (j + 1) * 4;
    for (int r = 0; r < n; ++r) {
      gin[r] = l.alloc(r, row[r] * outer);
      gout[r] = l.alloc(r, pitch * outer);
      write<int>(l, r, gin[r], row[r] / 4 * outer, s, r);
    }
    {
      StreamScope scope(l.streams);
      ring.all_gather(n, gin.data(), gout.data(), row.data(), outer);
    }
    for (int r = 0; r < n; ++r) read<int>(l, r, gout[r], pitch / 4 * outer, got[r]);
    sim::drain();
    for (int r = 0; r < n; ++r) {
      std::size_t k = 0;
      for (std::size_t o = 0; o < outer; ++o)
        for (int j = 0; j < n; ++j)
          for (std::size_t e = 0; e < row[j] / 4; ++e, ++k)
            EXPECT(got[r][k] == value(j, o * (row[j] / 4) + e, s), "all_gather n=%d outer=%zu: rank %d int %zu", n,
                   outer, r, k);
    }
    for (int r = 0; r < n; ++r) cudaFree(gin[r]), cudaFree(gout[r]);
  }
  // Fused batches: int32 and float32 tensors interleaved, several packings.
  const std::vector<std::size_t> counts = {3, 0, 17, 1, 40};
  const std::vector<DType> dtypes = {DType::kInt32, DType::kFloat32, DType::kInt32, DType::kInt32, DType::kFloat32};
  for (auto [bytes_per_pack, num_packs] : std::vector<std::pair<std::size_t, int>>{{0, 0}, {16, 0}, {64, 0}, {0, 2}}) {
    std::vector<std::vector<const void*>> bin;
    std::vector<std::vector<void*>> bout;
    batch_buffers(l, n, counts, dtypes, s, in_place, bin, bout);
    {
      StreamScope scope(l.streams);
      batch.all_reduce(ring, bin, bout, counts, dtypes, s, Algorithm::kRing, bytes_per_pack, num_packs);
    }
    char what[96];
    std::snprintf(what, sizeof what, "batch bytes_per_pack=%zu num_packs=%d in_place=%d", bytes_per_pack, num_packs,
                  int(in_place));
    if (!batch_summed(l, n, counts, dtypes, s, bout, what)) return;
  }
}


// NcclCommunicator over the fake libnccl: mapping, groups, roots, batches,
// and the errors it must raise before reaching NCCL.
void check_nccl(Layout& l, std::size_t count, bool in_place, bool by_unique_id) {
  const int n = l.n();
  const ReduceOp s = ReduceOp::kSum;
  nccl::NcclCommunicator comm = by_unique_id ? nccl::NcclCommunicator(nccl::unique_id(), 0, n, l.devices)
                                             : nccl::NcclCommunicator(l.devices);
  std::vector<void*> in(n), out(n);
  for (int r = 0; r < n; ++r) {
    in[r] = l.alloc(r, count * 4);
    out[r] = in_place ? in[r] : l.alloc(r, count * 4);
  }
  std::vector<std::vector<int>> got(n);
  for (auto op : {ReduceOp::kSum, ReduceOp::kProd, ReduceOp::kMin, ReduceOp::kMax, ReduceOp::kMean}) {
    for (int r = 0; r < n; ++r) write<int>(l, r, in[r], count, op, r);
    {
      StreamScope scope(l.streams);
      comm.all_reduce(n, in.data(), out.data(), count, DType::kInt32, op, Algorithm::kAuto);
    }
    for (int r = 0; r < n; ++r) read<int>(l, r, out[r], count, got[r]);
    sim::drain();
    for (int r = 0; r < n; ++r)
      for (std::size_t i = 0; i < count; ++i) {
        const long long e = expected(n, i, op == ReduceOp::kMean ? s : op);
        EXPECT(got[r][i] == (op == ReduceOp::kMean ? e / n : e), "nccl all_reduce n=%d op=%s: rank %d element %zu", n,
               reduce_op_name(op), r, i);
      }
  }
  for (int root = 0; root < n; ++root) {
    for (int r = 0; r < n; ++r) {
      write<int>(l, r, in[r], count, s, r);
      if (!in_place) write<int>(l, r, out[r], count, s, 100 + r);
    }
    {
      StreamScope scope(l.streams);
      comm.reduce(n, in.data(), out.data(), count, DType::kInt32, s, root);
    }
    for (int r = 0; r < n; ++r) read<int>(l, r, out[r], count, got[r]);
    sim::drain();
    for (int r = 0; r < n; ++r)
      for (std::size_t i = 0; i < count; ++i)
        EXPECT(got[r][i] == (r == root ? expected(n, i, s) : value(in_place ? r : 100 + r, i, s)),
               "nccl reduce n=%d root=%d: rank %d element %zu", n, root, r, i);
    for (int r = 0; r < n; ++r) write<int>(l, r, in[r], count, s, r);
    {
      StreamScope scope(l.streams);
      comm.broadcast(n, in.data(), out.data(), count, DType::kInt32, root);
    }
    for (int r = 0; r < n; ++r) read<int>(l, r, out[r], count, got[r]);
    sim::drain();
    for (int r = 0; r < n; ++r)
      for (std::size_t i = 0; i < count; ++i)
        EXPECT(got[r][i] == value(root, i, s), "nccl broadcast n=%d root=%d: rank %d element %zu", n, root, r, i);
  }
  // In place, NCCL's way: each rank's input is its own part of its output (sendbuff == recvbuff + rank * count).
  std::vector<void*> gin(n), gout(n);
  std::vector<std::size_t> rows(n, count * 4);
  for (int r = 0; r < n; ++r) {
    gout[r] = l.alloc(r, count * 4 * n);
    gin[r] = in_place ? static_cast<char*>(gout[r]) + r * count * 4 : in[r];
    write<int>(l, r, gin[r], count, s, r);
  }
  {
    StreamScope scope(l.streams);
    comm.all_gather(n, gin.data(), gout.data(), rows.data(), 1);
  }
  for (int r = 0; r < n; ++r) read<int>(l, r, gout[r], count * n, got[r]);
  sim::drain();
  for (int r = 0; r < n; ++r)
    for (int j = 0; j < n; ++j)
      for (std::size_t i = 0; i < count; ++i)
        EXPECT(got[r][j * count + i] == value(j, i, s), "nccl all_gather n=%d: rank %d part %d element %zu", n, r, j, i);
  // A fused batch over NCCL.
  DeviceBatch batch(l.devices);
  const std::vector<std::size_t> counts = {3, count, 5};
  const std::vector<DType> dtypes = {DType::kInt32, DType::kInt32, DType::kFloat32};
  std::vector<std::vector<const void*>> bin;
  std::vector<std::vector<void*>> bout;
  batch_buffers(l, n, counts, dtypes, s, in_place, bin, bout);
  sim::reset_counters();
  {
    StreamScope scope(l.streams);
    batch.all_reduce(comm, bin, bout, counts, dtypes, s, Algorithm::kAuto, 0, 0);
  }
  // A pack and an unpack kernel per GPU around NCCL's calls, whatever the tensor count.
  for (const auto& [d, k] : sim::counters().launches)
    EXPECT(k <= 2, "nccl batch: %ld launches on GPU %d", k, d);
  if (!batch_summed(l, n, counts, dtypes, s, bout, "nccl batch")) return;
}

template <typename E, typename F>
void expect_error(const char* what, const char* needle, F f) {
  try {
    f();
  } catch (const E& e) {
    EXPECT(std::string(e.what()).find(needle) != std::string::npos, "%s: message '%s' lacks '%s'", what, e.what(), needle);
    return;
  }
  EXPECT(false, "%s: no error", what);
}

void check_nccl_errors() {
  Layout l({0, 1}, false);
  expect_error<std::invalid_argument>("two ranks on one GPU", "use algorithm='ring'",
                                      [] { nccl::NcclCommunicator c({0, 0}); });
  expect_error<std::invalid_argument>("bad unique id", "expected 128 bytes",
                                      [] { nccl::NcclCommunicator c("short", 0, 2, {0, 1}); });
  nccl::NcclCommunicator comm({0, 1});
  std::vector<std::size_t> rows = {4, 8};
  std::vector<void*> p = {l.alloc(0, 8), l.alloc(1, 8)};
  expect_error<std::invalid_argument>("unequal all_gather", "equal-sized",
                                      [&] { comm.all_gather(2, p.data(), p.data(), rows.data(), 1); });
  // Buffers that overlap other than as NCCL's in-place pairs: refused, naming them (NCCL would corrupt).
  std::vector<void*> in = {l.alloc(0, 64), l.alloc(1, 64)}, out = {l.alloc(0, 64), l.alloc(1, 64)};
  StreamScope scope(l.streams);
  auto all_reduce = [&](std::vector<void*> o, std::size_t count) {
    comm.all_reduce(2, in.data(), o.data(), count, DType::kInt32, ReduceOp::kSum, Algorithm::kAuto);
  };
  expect_error<std::runtime_error>("all_reduce into its input shifted", "rank 1's sendbuff overlaps its recvbuff",
                                   [&] { all_reduce({out[0], static_cast<char*>(in[1]) + 4}, 4); });
  expect_error<std::runtime_error>("all_reduce into another rank's input",
                                   "rank 0's recvbuff overlaps rank 1's sendbuff", [&] { all_reduce({in[1], out[1]}, 4); });
  expect_error<std::runtime_error>("two ranks' outputs overlapping", "rank 0's recvbuff overlaps rank 1's recvbuff",
                                   [&] { all_reduce({out[1], static_cast<char*>(out[1]) + 8}, 4); });
  std::vector<std::size_t> parts = {16, 16};
  std::vector<void*> wrong = {static_cast<char*>(out[0]) + 16, static_cast<char*>(out[1]) + 16};
  expect_error<std::runtime_error>("all_gather from the wrong part of its output",
                                   "rank 0's sendbuff overlaps its recvbuff",
                                   [&] { comm.all_gather(2, wrong.data(), out.data(), parts.data(), 1); });
}

// What op over n ranks' value()s gives in T: integers wrap at every step
// (NumPy's result) and MEAN truncates the wrapped sum; floats are exact here.
template <typename T>
double reference(int n, std::size_t i, ReduceOp op) {
  using A = typename Elem<T>::Acc;
  const ReduceOp c = combining_op(op);
  if constexpr (std::is_integral<T>::value) {
    auto v = [&](int q) { return static_cast<long long>(static_cast<T>(value(q, i, op))); };
    long long acc = v(0);
    for (int q = 1; q < n; ++q) {
      const long long x = v(q);
      acc = c == ReduceOp::kSum ? static_cast<long long>(static_cast<T>(acc + x))
          : c == ReduceOp::kProd ? static_cast<long long>(static_cast<T>(acc * x))
          : c == ReduceOp::kMin ? std::min(acc, x) : std::max(acc, x);
    }
    return double(op == ReduceOp::kMean ? static_cast<long long>(static_cast<T>(acc / n)) : acc);
  } else {
    const long long e = expected(n, i, c);
    return op == ReduceOp::kMean ? double(A(e) / A(n)) : double(e);
  }
}

// The one-pass kernel's body against a scalar reference, for every dtype and
// op, sizes around the 16-byte vector and the grid (empty, odd, tails), and
// inputs or outputs 16-byte aligned or not (the scalar path), n = 1..9
// inputs into 1..3 outputs, in place or not.
template <typename T>
void check_fused_body(DType dtype) {
  using E = Elem<T>;
  const bool half = sizeof(T) == 2 && !std::is_integral<T>::value;
  for (int n : {1, 2, 3, 8, 9})
    for (std::size_t count : {0, 1, 3, 7, 8, 15, 16, 17, 33, 255, 257, 8193, 40000})
      for (auto op : {ReduceOp::kSum, ReduceOp::kProd, ReduceOp::kMin, ReduceOp::kMax, ReduceOp::kMean})
        for (int misalign : {0, 1})
          for (bool in_place : {false, true}) {
            if (count > 300 && (op == ReduceOp::kProd || n == 9 || misalign)) continue;
            std::vector<char*> bufs;
            FusedArgs a;
            a.nin = n;
            for (int j = 0; j < n; ++j) {
              void* p = nullptr;
              cudaMalloc(&p, (count + 1) * sizeof(T));
              T* x = reinterpret_cast<T*>(static_cast<char*>(p) + (j == n - 1 ? misalign * sizeof(T) : 0));
              for (std::size_t i = 0; i < count; ++i) x[i] = E::store(static_cast<typename E::Acc>(value(j, i, op)));
              bufs.push_back(static_cast<char*>(p));
              a.in[j] = x;
            }
            const int nout = in_place ? std::min(n, 2) : 3;
            for (int j = 0; j < nout; ++j) {
              if (in_place) {
                a.out[a.nout++] = const_cast<void*>(a.in[j]);
                continue;
              }
              void* p = nullptr;
              cudaMalloc(&p, (count + 1) * sizeof(T));
              bufs.push_back(static_cast<char*>(p));
              a.out[a.nout++] = static_cast<char*>(p) + (j == 1 ? misalign * sizeof(T) : 0);
            }
            sim::reset_counters();
            fused_reduce(a, count, dtype, combining_op(op), op == ReduceOp::kMean ? n : 1, 4, nullptr);
            sim::drain();
            if (sim::counters().launches_total() != (count ? 1 : 0)) {
              if (++failures <= 10) std::printf("FAIL: fused_reduce launched %ld kernels\n", sim::counters().launches_total());
            }
            bool ok = true;
            for (int j = 0; j < a.nout && ok; ++j)
              for (std::size_t i = 0; i < count && ok; ++i) {
                const double want = reference<T>(n, i, op);
                const double got = double(E::load(static_cast<const T*>(a.out[j])[i]));
                const double tol = half ? 1e-2 * std::max(1.0, std::abs(want)) : 0.0;
                if (std::abs(got - want) > tol) {
                  ok = false;
                  if (++failures <= 10)
                    std::printf("FAIL: fused body %s n=%d count=%zu op=%s misalign=%d in_place=%d: out %d element %zu "
                                "is %g, expected %g\n", dtype_name(dtype), n, count, reduce_op_name(op), misalign,
                                int(in_place), j, i, got, want);
                }
              }
            for (char* p : bufs) cudaFree(p);
          }
}

// The simulated runtime counts launches and stream operations: a collective
// of co-located ranks is exactly one launch on their GPU, and no event at
// all when every rank queues on the same stream; ranks on GPUs with peer
// access launch once per GPU.
void check_launch_counts() {
  std::set<std::pair<int, int>> all_pairs;
  for (int a = 0; a < 4; ++a)
    for (int b = 0; b < 4; ++b)
      if (a != b) all_pairs.insert({a, b});
  for (const auto& devices : std::vector<std::vector<int>>{{0}, {0, 0}, {1, 1, 1}, {0, 0, 0, 0}, std::vector<int>(8, 2),
                                                            {0, 1}, {0, 1, 2, 3}, {0, 0, 1, 1}})
    for (bool own_streams : {false, true}) {
      sim::reset(4, all_pairs, 7);
      Layout l(devices, own_streams);
      const int n = l.n();
      std::set<int> gpus(devices.begin(), devices.end());
      const long per_gpu = 1;
      CudaRing ring(l.devices);
      const std::size_t count = 1000;
      std::vector<void*> in(n), out(n), gout(n);
      std::vector<std::size_t> rows(n, 12);
      for (int r = 0; r < n; ++r) {
        in[r] = l.alloc(r, count * 4), out[r] = l.alloc(r, count * 4), gout[r] = l.alloc(r, 12 * n);
        write<float>(l, r, in[r], count, ReduceOp::kSum, r);
      }
      sim::drain();
      auto check = [&](const char* what, long launches_on_each, bool any_gpu_only_root, auto call) {
        sim::reset_counters();
        {
          StreamScope scope(l.streams);
          call();
        }
        const auto& c = sim::counters();
        const bool shared_stream = gpus.size() == 1 && !own_streams;
        bool ok = shared_stream ? c.stream_ops == 0 : true;
        if (any_gpu_only_root) {
          ok = ok && c.launches_total() == launches_on_each;
        } else {
          for (int d : gpus) ok = ok && (c.launches.count(d) ? c.launches.at(d) : 0) == launches_on_each;
          ok = ok && c.launches_total() == launches_on_each * long(gpus.size());
        }
        if (!ok && ++failures <= 10)
          std::printf("FAIL: %s on %zu GPU(s), n=%d, own_streams=%d: %ld launches, %ld stream ops\n", what,
                      gpus.size(), n, int(own_streams), c.launches_total(), c.stream_ops);
        sim::drain();
      };
      check("all_reduce", per_gpu, false,
            [&] { ring.all_reduce(n, in.data(), out.data(), count, DType::kFloat32, ReduceOp::kMean, Algorithm::kAuto); });
      if (gpus.size() == 1)  // in place too (across GPUs in place takes the ring)
        check("all_reduce in place", n == 1 ? 0 : per_gpu, false,  // one rank in place: nothing to do
              [&] { ring.all_reduce(n, in.data(), in.data(), count, DType::kFloat32, ReduceOp::kSum, Algorithm::kAuto); });
      check("broadcast", per_gpu, false, [&] { ring.broadcast(n, in.data(), out.data(), count, DType::kFloat32, n - 1); });
      check("reduce", 1, true, [&] { ring.reduce(n, in.data(), out.data(), count, DType::kFloat32, ReduceOp::kMax, 0); });
      check("all_gather", per_gpu, false, [&] { ring.all_gather(n, in.data(), gout.data(), rows.data(), 1); });
      // Fused batches: at most 3 launches per GPU (pack, all-reduce, unpack; one
      // when every rank is on one GPU) when a GPU's ranks queue on one stream (as the Strategy's do; else a
      // pack and an unpack per stream), and the same stream operations for 2
      // tensors as for 300 (once the table has grown).
      DeviceBatch batch(l.devices);
      long ops_at_2 = -1;
      const long lanes = own_streams ? n : long(gpus.size());
      const long per_gpu_limit = own_streams ? 2 * long(n) + 1 : 3;
      int call = 0;
      for (std::size_t tensors : {2, 10, 300, 2, 300}) {
        ++call;
        std::vector<std::size_t> counts(tensors);
        for (std::size_t t = 0; t < tensors; ++t) counts[t] = (t * 13) % 37;
        const std::vector<DType> dtypes(tensors, DType::kInt32);
        std::vector<std::vector<const void*>> bin;
        std::vector<std::vector<void*>> bout;
        batch_buffers(l, n, counts, dtypes, ReduceOp::kSum, tensors == 10, bin, bout);
        sim::drain();
        sim::reset_counters();
        {
          StreamScope scope(l.streams);
          batch.all_reduce(ring, bin, bout, counts, dtypes, ReduceOp::kSum, Algorithm::kAuto, 0, 0);
        }
        const auto c = sim::counters();
        bool ok = c.launches_total() <= 2 * lanes + long(gpus.size());
        for (const auto& [d, k] : c.launches) ok = ok && k <= per_gpu_limit;
        if (call == 4) ops_at_2 = c.stream_ops;
        if (call == 5) ok = ok && c.stream_ops == ops_at_2;
        // Ranks on one GPU: one multi-tensor kernel (one dtype), and no host wait while each call
        // takes a table of the ring it has not used yet (the fifth regrows the first: a free).
        if (gpus.size() == 1) ok = ok && c.launches_total() == 1 && (call == 5 || c.host_waits == 0);
        if (!ok && ++failures <= 10)
          std::printf("FAIL: batch of %zu on %zu GPU(s), n=%d, own_streams=%d: %ld launches, %ld stream ops, "
                      "%ld host waits\n", tensors, gpus.size(), n, int(own_streams), c.launches_total(), c.stream_ops,
                      c.host_waits);
        if (!batch_summed(l, n, counts, dtypes, ReduceOp::kSum, bout, "counted batch")) return;
        for (int r = 0; r < n; ++r)
          for (std::size_t t = 0; t < tensors; ++t) {
            if (bout[r][t] != bin[r][t]) cudaFree(bout[r][t]);
            cudaFree(const_cast<void*>(bin[r][t]));
          }
      }
      for (int r = 0; r < n; ++r) cudaFree(in[r]), cudaFree(out[r]), cudaFree(gout[r]);
    }
}

// The multi-tensor all-reduce (multi_reduce, batches of ranks on one GPU):
// one table of tensors that are empty, odd-sized, shorter than a vector or
// many vectors long, some of them off alignment on one rank, in and out of
// place, in one launch.
template <typename T>
void check_multi_reduce_body(DType dtype) {
  using E = Elem<T>;
  const bool half = sizeof(T) == 2 && !std::is_integral<T>::value;
  const std::vector<std::size_t> counts{0, 1, 3, 7, 8, 17, 33, 257, 0, 16};
  constexpr std::size_t kPer = 16 / sizeof(T);
  for (int n : {1, 2, 3, 8})
    for (auto op : {ReduceOp::kSum, ReduceOp::kProd, ReduceOp::kMin, ReduceOp::kMax, ReduceOp::kMean})
      for (bool in_place : {false, true}) {
        std::vector<void*> bufs;
        std::vector<ReduceEntry> entries;
        std::vector<const void*> pointers;
        std::size_t slots = 0;
        for (std::size_t t = 0; t < counts.size(); ++t) {
          if (counts[t] == 0) continue;  // (the batch leaves empty tensors out of the table)
          const std::size_t count = counts[t], misalign = t % 3 == 1 ? 1 : 0;
          std::vector<void*> in(n), out(n);
          bool vectorised = true;
          for (int r = 0; r < n; ++r) {
            void* p = nullptr;
            cudaMalloc(&p, (count + 1) * sizeof(T));
            bufs.push_back(p);
            T* x = reinterpret_cast<T*>(static_cast<char*>(p) + (r == n - 1 ? misalign * sizeof(T) : 0));
            for (std::size_t i = 0; i < count; ++i) x[i] = E::store(static_cast<typename E::Acc>(value(r, i + t, op)));
            in[r] = x;
            if (in_place) {
              out[r] = x;
            } else {
              cudaMalloc(&p, count * sizeof(T));
              bufs.push_back(p);
              out[r] = p;
            }
            vectorised = vectorised && aligned16(in[r]) && aligned16(out[r]);
          }
          entries.push_back(ReduceEntry{slots, count, vectorised});
          slots += (count + kPer - 1) / kPer;
          for (int r = 0; r < n; ++r) pointers.push_back(in[r]);
          for (int r = 0; r < n; ++r) pointers.push_back(out[r]);
        }
        void* table = nullptr;
        void* ptrs = nullptr;
        cudaMalloc(&table, entries.size() * sizeof(ReduceEntry));
        cudaMalloc(&ptrs, pointers.size() * sizeof(void*));
        std::memcpy(table, entries.data(), entries.size() * sizeof(ReduceEntry));
        std::memcpy(ptrs, pointers.data(), pointers.size() * sizeof(void*));
        sim::reset_counters();
        multi_reduce(static_cast<const ReduceEntry*>(table), static_cast<const void* const*>(ptrs),
                     static_cast<int>(entries.size()), n, slots, dtype, combining_op(op),
                     op == ReduceOp::kMean ? n : 1, 2, nullptr);
        sim::drain();
        EXPECT(sim::counters().launches_total() == 1, "multi_reduce launched %ld kernels",
               sim::counters().launches_total());
        bool ok = true;
        std::size_t e = 0;
        for (std::size_t t = 0; t < counts.size() && ok; ++t) {
          if (counts[t] == 0) continue;
          for (int r = 0; r < n && ok; ++r)
            for (std::size_t i = 0; i < counts[t] && ok; ++i) {
              const double want = reference<T>(n, i + t, op);
              const double got = double(E::load(static_cast<const T*>(pointers[e * 2 * n + n + r])[i]));
              if (std::abs(got - want) > (half ? 1e-2 * std::max(1.0, std::abs(want)) : 0.0)) {
                ok = false;
                if (++failures <= 10)
                  std::printf("FAIL: multi_reduce %s n=%d op=%s in_place=%d: tensor %zu rank %d element %zu is %g, "
                              "expected %g\n", dtype_name(dtype), n, reduce_op_name(op), int(in_place), t, r, i, got,
                              want);
              }
            }
          ++e;
        }
        for (void* p : bufs) cudaFree(p);
        cudaFree(table);
        cudaFree(ptrs);
      }
}

// The one-pass all-gather in every unit (16 down to 1 byte): row sizes that
// are odd, empty or differ per rank, several rows, pointers off alignment.
void check_fused_gather() {
  for (const auto& devices : std::vector<std::vector<int>>{{0, 0, 0}, {1, 1}, {0, 0, 0, 0, 0}})
    for (const auto& sizes : std::vector<std::vector<std::size_t>>{{16, 32, 48}, {1, 3, 5}, {0, 16, 0}, {8, 8, 24},
                                                                  {2, 6, 0}, {4, 0, 12}, {0, 0, 0}})
      for (std::size_t outer : {1, 2, 5})
        for (int misalign : {0, 1, 4}) {
          sim::reset(4, {}, 3);
          Layout l(devices, false);
          const int n = l.n();
          CudaRing ring(l.devices);
          std::vector<std::size_t> rows(n);
          std::size_t pitch = 0;
          for (int j = 0; j < n; ++j) pitch += rows[j] = sizes[j % sizes.size()];
          std::vector<void*> in(n), out(n), base;
          for (int r = 0; r < n; ++r) {
            char* p = static_cast<char*>(l.alloc(r, rows[r] * outer + 16));
            char* q = static_cast<char*>(l.alloc(r, pitch * outer + 16));
            base.push_back(p), base.push_back(q);
            in[r] = p + (r == 1 ? misalign : 0), out[r] = q + (r == 0 ? misalign : 0);
            for (std::size_t k = 0; k < rows[r] * outer; ++k) static_cast<unsigned char*>(in[r])[k] = (r * 37 + k) & 255;
          }
          sim::reset_counters();
          ring.all_gather(n, in.data(), out.data(), rows.data(), outer);
          sim::drain();
          if (sim::counters().launches_total() != (pitch * outer ? 1 : 0) && ++failures <= 10)
            std::printf("FAIL: all_gather took %ld launches\n", sim::counters().launches_total());
          for (int r = 0; r < n; ++r) {
            std::size_t k = 0;
            for (std::size_t o = 0; o < outer; ++o)
              for (int j = 0; j < n; ++j)
                for (std::size_t e = 0; e < rows[j]; ++e, ++k) {
                  const unsigned char want = (j * 37 + o * rows[j] + e) & 255;
                  EXPECT(static_cast<unsigned char*>(out[r])[k] == want,
                         "fused all_gather n=%d rows=%zu,%zu,%zu outer=%zu misalign=%d: rank %d byte %zu", n, rows[0],
                         rows[1], rows[n > 2 ? 2 : 1], outer, misalign, r, k);
                }
          }
          for (void* p : base) cudaFree(p);
        }
}

}  // namespace

// Several threads drive the machine at once, as replica threads do through
// the Python engine: each its own communicator, streams and current device;
// every host wait drains everybody's queued work. Results stay exact.
void check_threads() {
  std::atomic<int> wrong{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([t, &wrong] {
      const std::vector<int> devices{t % 4, t % 4, (t + 1) % 4};
      Layout l(devices, true);
      CudaRing ring(devices, 64, 2);
      const std::size_t count = 301;
      std::vector<void*> buf(devices.size());
      for (int round = 0; round < 20; ++round) {
        for (int r = 0; r < l.n(); ++r) {
          buf[r] = l.alloc(r, count * 4);
          write<int>(l, r, buf[r], count, ReduceOp::kSum, r);
        }
        {
          StreamScope scope(l.streams);
          std::vector<const void*> in(buf.begin(), buf.end());
          ring.all_reduce(l.n(), in.data(), buf.data(), count, DType::kInt32, ReduceOp::kSum,
                          round % 2 ? Algorithm::kRing : Algorithm::kTree);
        }
        std::vector<std::vector<int>> res(l.n());
        for (int r = 0; r < l.n(); ++r) read<int>(l, r, buf[r], count, res[r]);
        for (int r = 0; r < l.n(); ++r) cudaSetDevice(devices[r]), cudaStreamSynchronize(l.streams[r]);
        for (int r = 0; r < l.n(); ++r) {
          for (std::size_t i = 0; i < count; ++i)
            if (res[r][i] != expected(l.n(), i, ReduceOp::kSum)) ++wrong;
          cudaFree(buf[r]);
        }
      }
    });
  for (auto& th : threads) th.join();
  EXPECT(wrong == 0, "%d wrong elements with 4 threads driving the machine", wrong.load());
}

// Queued work that waits for the GPU (host code run inside a kernel, e.g. a
// finalizer Python's garbage collector ran there) is refused: draining from
// inside it would run the work queued behind it first.
void check_wait_inside_work() {
  sim::reset(1, {}, 0);
  int order = 0, waited = -1, behind = -1;
  bool refused = false;
  sim::enqueue(nullptr, [&] {
    cudaDeviceSynchronize();
    waited = order++;
  });
  sim::enqueue(nullptr, [&] { behind = order++; });
  try {
    sim::drain();
  } catch (const std::logic_error& e) {
    refused = std::string(e.what()).find("from inside simulated GPU work") != std::string::npos;
  }
  EXPECT(refused && waited == -1 && behind == -1, "a host wait inside queued work: refused %d, ran %d, %d", refused,
         waited, behind);
  sim::drain();  // the work behind it still runs, after
  EXPECT(behind == 0, "the work behind the refused one ran (%d)", behind);
  sim::enqueue(nullptr, [&] { cudaDeviceSynchronize(); });  // nothing else queued: no wait needed, none refused
  sim::drain();
}

// Stream capture: an all-reduce over callers' streams (forked from the first
// caller's stream, joined back) captured once, then replayed with new inputs
// written before each launch: every replay gives the sums, as one graph
// launch and no kernel launch; a host wait, or a fork never joined, makes the
// capture fail the way CUDA's does.
void check_capture() {
  for (const auto& devices : std::vector<std::vector<int>>{{0}, {0, 0}, {0, 0, 0, 0}, {0, 1}, {1, 0, 1}})
    for (auto algo : {Algorithm::kRing, Algorithm::kTree}) {
      sim::reset(4, {}, static_cast<unsigned>(devices.size() * 10 + static_cast<int>(algo)));
      Layout l(devices, true);
      const int n = l.n();
      const std::size_t count = 301;
      CudaRing ring(devices, 64, 2);
      std::vector<void*> buf(n);
      for (int r = 0; r < n; ++r) buf[r] = l.alloc(r, count * 4);
      auto all_reduce = [&] {
        StreamScope scope(l.streams);
        std::vector<const void*> in(buf.begin(), buf.end());
        ring.all_reduce(n, in.data(), buf.data(), count, DType::kInt32, ReduceOp::kSum, algo);
      };
      all_reduce();  // the warm-up: scratch buffers are made outside the capture
      sim::drain();
      cudaEvent_t fork, joined;
      cudaSetDevice(devices[0]);
      cudaEventCreateWithFlags(&fork, cudaEventDisableTiming);
      std::vector<cudaEvent_t> join(n);
      for (int r = 0; r < n; ++r) cudaSetDevice(devices[r]), cudaEventCreateWithFlags(&join[r], cudaEventDisableTiming);
      cudaSetDevice(devices[0]);
      EXPECT(cudaStreamBeginCapture(l.streams[0], cudaStreamCaptureModeRelaxed) == cudaSuccess, "begin capture");
      cudaEventRecord(fork, l.streams[0]);
      for (int r = 1; r < n; ++r) cudaSetDevice(devices[r]), cudaStreamWaitEvent(l.streams[r], fork, 0);
      all_reduce();
      for (int r = 1; r < n; ++r) {
        cudaSetDevice(devices[r]);
        cudaEventRecord(join[r], l.streams[r]);
        cudaSetDevice(devices[0]);
        cudaStreamWaitEvent(l.streams[0], join[r], 0);
      }
      cudaSetDevice(devices[0]);
      cudaGraph_t graph = nullptr;
      cudaGraphExec_t exec = nullptr;
      EXPECT(cudaStreamEndCapture(l.streams[0], &graph) == cudaSuccess, "end capture on %d ranks", n);
      EXPECT(cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess, "instantiate");
      cudaGraphDestroy(graph);
      cudaSetDevice(devices[0]);
      cudaEventCreateWithFlags(&joined, cudaEventDisableTiming);
      for (int replay = 0; replay < 3; ++replay) {
        // Inputs written on the first stream, seeded per replay, then one launch there.
        for (int r = 0; r < n; ++r) {
          void* p = buf[r];
          const int seed = r + replay;
          cudaSetDevice(devices[0]);
          sim::enqueue(l.streams[0], [=] {
            for (std::size_t i = 0; i < count; ++i) static_cast<int*>(p)[i] = static_cast<int>(value(seed, i, ReduceOp::kSum));
          });
        }
        sim::reset_counters();
        cudaSetDevice(devices[0]);
        cudaGraphLaunch(exec, l.streams[0]);
        const auto c = sim::counters();
        EXPECT(c.launches_total() == 0 && c.graph_launches.at(devices[0]) == 1, "a replay is one graph launch");
        EXPECT(c.graph_branches.at(devices[0]) >= n,
               "the launch replays a branch per caller's stream at least (the engine forks streams of its own too)");
        std::vector<std::vector<int>> res(n);
        for (int r = 0; r < n; ++r) {
          res[r].assign(count, 0);
          int* dst = res[r].data();
          void* p = buf[r];
          sim::enqueue(l.streams[0], [=] { std::memcpy(dst, p, count * 4); });
        }
        cudaStreamSynchronize(l.streams[0]);
        for (int r = 0; r < n; ++r)
          for (std::size_t i = 0; i < count; ++i) {
            long long e = 0;
            for (int q = 0; q < n; ++q) e += value(q + replay, i, ReduceOp::kSum);
            EXPECT(res[r][i] == e, "replay %d on %d ranks: rank %d element %zu is %d, not %lld", replay, n, r, i,
                   res[r][i], e);
          }
      }
      cudaGraphExecDestroy(exec);
      // A host wait inside the capture invalidates it; a fork never joined is refused at the end.
      cudaSetDevice(devices[0]);
      cudaStreamBeginCapture(l.streams[0], cudaStreamCaptureModeRelaxed);
      bool refused = false;
      try {
        cudaStreamSynchronize(l.streams[0]);
      } catch (const std::runtime_error& e) {
        refused = std::string(e.what()).find("cudaStreamSynchronize") != std::string::npos;
      }
      cudaStreamCaptureStatus status;
      cudaStreamIsCapturing(l.streams[0], &status);
      EXPECT(refused && status == cudaStreamCaptureStatusInvalidated, "a host wait while capturing is refused");
      EXPECT(cudaStreamEndCapture(l.streams[0], &graph) == cudaErrorStreamCaptureInvalidated && !graph,
             "an invalidated capture gives no graph");
      if (n > 1) {
        cudaStreamBeginCapture(l.streams[0], cudaStreamCaptureModeRelaxed);
        cudaEventRecord(fork, l.streams[0]);
        cudaSetDevice(devices[1]);
        cudaStreamWaitEvent(l.streams[1], fork, 0);
        sim::enqueue(l.streams[1], [] {});
        cudaSetDevice(devices[0]);
        EXPECT(cudaStreamEndCapture(l.streams[0], &graph) == cudaErrorStreamCaptureUnjoined, "unjoined fork");
      }
      for (int r = 0; r < n; ++r) cudaEventDestroy(join[r]);
      cudaEventDestroy(fork);
      cudaEventDestroy(joined);
      sim::drain();
      for (int r = 0; r < n; ++r) cudaFree(buf[r]);
    }
}

// NCCL captured one graph per GPU (each rank's stream captured on its own):
// the ranks meet on the device, so the graphs, launched one per GPU, replay
// the all-reduce with the inputs written before each launch.
void check_nccl_capture() {
  for (const auto& devices : std::vector<std::vector<int>>{{0, 1}, {2, 0, 1}}) {
    sim::reset(4, {}, static_cast<unsigned>(devices.size()));
    Layout l(devices, true);
    const int n = l.n();
    const std::size_t count = 100;
    nccl::NcclCommunicator comm(l.devices);
    std::vector<void*> buf(n);
    for (int r = 0; r < n; ++r) buf[r] = l.alloc(r, count * 4);
    sim::drain();
    for (int r = 0; r < n; ++r) {
      cudaSetDevice(devices[r]);
      EXPECT(cudaStreamBeginCapture(l.streams[r], cudaStreamCaptureModeRelaxed) == cudaSuccess, "begin");
    }
    {
      StreamScope scope(l.streams);
      std::vector<const void*> in(buf.begin(), buf.end());
      comm.all_reduce(n, in.data(), buf.data(), count, DType::kInt32, ReduceOp::kSum, Algorithm::kAuto);
    }
    std::vector<cudaGraphExec_t> execs(n);
    for (int r = 0; r < n; ++r) {
      cudaSetDevice(devices[r]);
      cudaGraph_t graph = nullptr;
      EXPECT(cudaStreamEndCapture(l.streams[r], &graph) == cudaSuccess, "nccl capture on rank %d", r);
      cudaGraphInstantiate(&execs[r], graph, 0);
      cudaGraphDestroy(graph);
    }
    for (int replay = 0; replay < 3; ++replay) {
      for (int r = 0; r < n; ++r) write<int>(l, r, buf[r], count, ReduceOp::kSum, r + replay);
      sim::reset_counters();
      for (int r = n - 1; r >= 0; --r) cudaSetDevice(devices[r]), cudaGraphLaunch(execs[r], l.streams[r]);
      EXPECT(sim::counters().launches_total() == 0, "a replay launches no kernel");
      std::vector<std::vector<int>> got(n);
      for (int r = 0; r < n; ++r) read<int>(l, r, buf[r], count, got[r]);
      sim::drain();
      for (int r = 0; r < n; ++r)
        for (std::size_t i = 0; i < count; ++i) {
          long long e = 0;
          for (int q = 0; q < n; ++q) e += value(q + replay, i, ReduceOp::kSum);
          EXPECT(got[r][i] == e, "nccl replay %d: rank %d element %zu is %d, not %lld", replay, r, i, got[r][i], e);
        }
    }
    for (int r = 0; r < n; ++r) cudaGraphExecDestroy(execs[r]), cudaFree(buf[r]);
  }
}

// DeviceGuard puts the caller's device back, switching only when a call switched: on return, and
// on an error's unwinding even where its record says nothing switched (a library call that fails,
// as NCCL's group end does, may leave another device current without going through set_device).
void check_device_guard() {
  using mirrored::cuda::DeviceGuard;
  using mirrored::cuda::set_device;
  const auto current = [] {
    int d = -1;
    cudaGetDevice(&d);
    return d;
  };
  cudaSetDevice(1);
  {
    DeviceGuard outer;
    set_device(2);
    {
      DeviceGuard inner;
      set_device(3);
      set_device(3);
    }
    EXPECT(current() == 2, "an inner guard puts back its outer one's device, not %d", current());
  }
  EXPECT(current() == 1, "a guard puts back the caller's device, not %d", current());
  sim::reset_counters();
  { DeviceGuard same; set_device(1); }
  EXPECT(sim::counters().calls["cudaSetDevice"] == 0, "a switch to the device already current is no call");
  for (int inside : {1, 2}) {
    try {
      DeviceGuard guard;
      set_device(inside);
      cudaSetDevice(3);  // (a library call switching on its own, then failing)
      throw std::runtime_error("a library call failed");
    } catch (const std::runtime_error&) {
    }
    EXPECT(current() == 1, "after an error inside a guard (on %d) the caller's device 1 is current, not %d", inside,
           current());
  }
  cudaSetDevice(0);
}

int main(int argc, char** argv) {
  sim::reset(4, {}, 1);
  check_fused_body<F16>(DType::kFloat16);
  check_fused_body<BF16>(DType::kBFloat16);
  check_fused_body<float>(DType::kFloat32);
  check_fused_body<double>(DType::kFloat64);
  check_fused_body<std::int8_t>(DType::kInt8);
  check_fused_body<std::uint8_t>(DType::kUInt8);
  check_fused_body<std::int32_t>(DType::kInt32);
  check_fused_body<std::int64_t>(DType::kInt64);
  check_multi_reduce_body<F16>(DType::kFloat16);
  check_multi_reduce_body<BF16>(DType::kBFloat16);
  check_multi_reduce_body<float>(DType::kFloat32);
  check_multi_reduce_body<double>(DType::kFloat64);
  check_multi_reduce_body<std::int8_t>(DType::kInt8);
  check_multi_reduce_body<std::uint8_t>(DType::kUInt8);
  check_multi_reduce_body<std::int32_t>(DType::kInt32);
  check_multi_reduce_body<std::int64_t>(DType::kInt64);
  check_device_guard();
  check_launch_counts();
  check_fused_gather();
  check_threads();
  check_wait_inside_work();
  check_capture();
  // Large or in-place messages over GPUs with peer access: the two-shot
  // kernels (one rank per GPU), or the ring (several ranks per GPU).
  {
    std::set<std::pair<int, int>> peers;
    for (int a = 0; a < 4; ++a)
      for (int b = 0; b < 4; ++b)
        if (a != b) peers.insert({a, b});
    for (const auto& devices : std::vector<std::vector<int>>{{0, 1}, {0, 1, 2}, {2, 0, 3, 1}, {1, 0, 1}})
      for (bool own_streams : {false, true})
        for (std::size_t count : {std::size_t(70001), std::size_t(3 * 65536 + 8)})
          for (auto op : {ReduceOp::kSum, ReduceOp::kMean, ReduceOp::kMax})
            for (bool in_place : {false, true}) {
              sim::reset(4, peers, static_cast<unsigned>(count + devices.size() + own_streams));
              Layout l(devices, own_streams);
              sim::reset_counters();
              check_all_reduce<int>(l, count, 16, 1, op, Algorithm::kAuto, in_place, DType::kInt32);
              // Two calls: 2 launches per GPU each with one rank per GPU.
              const std::set<int> gpus(devices.begin(), devices.end());
              if (gpus.size() == devices.size())
                for (int d : gpus)
                  if (sim::counters().launches.at(d) != 4 && ++failures <= 10)
                    std::printf("FAIL: two-shot on GPU %d: %ld launches for 2 calls\n", d,
                                sim::counters().launches.at(d));
            }
  }
  const std::vector<std::vector<int>> layouts = {
      {0}, {1}, {0, 0}, {0, 1}, {0, 0, 0}, {0, 1, 2}, {0, 0, 1}, {0, 0, 0, 0}, {0, 1, 2, 3}, {1, 0, 1, 0}, {0, 1, 2, 3, 0}};
  std::set<std::pair<int, int>> all_pairs, odd_pairs;
  for (int a = 0; a < 4; ++a)
    for (int b = 0; b < 4; ++b)
      if (a != b) {
        all_pairs.insert({a, b});
        if ((a + b) % 2) odd_pairs.insert({a, b});
      }
  // MIRRORED_NATIVE_TEST_SMALL=1 (the sanitizer runs, where it runs ~10x slower; pytest's
  // test_cuda_build runs the whole matrix unsanitized): the schedule matrix below is
  // single-threaded; one peer set, the four-GPU layouts with their own streams, and the
  // sizes at the chunk edges keep the engine's code under the sanitizers while the threaded
  // checks above carry the race detection.
  const bool small = std::getenv("MIRRORED_NATIVE_TEST_SMALL") != nullptr;
  const std::vector<std::set<std::pair<int, int>>> peer_sets =
      small ? std::vector<std::set<std::pair<int, int>>>{odd_pairs}
            : std::vector<std::set<std::pair<int, int>>>{{}, odd_pairs, all_pairs};
  long runs = 0;
  for (const auto& peers : peer_sets)
    for (const auto& devices : layouts)
      for (bool own_streams : {false, true}) {
        if (small && (devices.size() != 4 || !own_streams)) continue;
        sim::reset(4, peers, static_cast<unsigned>(runs));
        Layout l(devices, own_streams);
        const bool one_pass = CudaRing(devices).one_pass_capable();
        for (std::size_t count : {0, 1, 5, 63, 64, 65, 301})
          for (std::size_t chunk : {16, 48, 4096})
            for (int channels : {1, 2, 3})
              for (auto op : {ReduceOp::kSum, ReduceOp::kProd, ReduceOp::kMin, ReduceOp::kMax, ReduceOp::kMean})
                for (auto algo : {Algorithm::kRing, Algorithm::kTree, Algorithm::kAuto, Algorithm::kDirect})
                  for (bool in_place : {false, true}) {
                    if (chunk == 4096 && channels > 1) continue;
                    if (small && (count == 1 || count == 63 || chunk == 48 || channels == 3)) continue;
                    if (algo == Algorithm::kDirect && (chunk != 16 || channels != 1 || !one_pass))
                      continue;  // the one-pass kernel has no chunks or channels; it needs every rank reachable
                    ++runs;
                    check_all_reduce<int>(l, count, chunk, channels, op, algo, in_place, DType::kInt32);
                    if (count <= 65 && chunk == 16 && op != ReduceOp::kProd) {
                      check_all_reduce<float>(l, count, chunk, channels, op, algo, in_place, DType::kFloat32);
                      check_all_reduce<std::int8_t>(l, count, chunk, channels, op, algo, in_place, DType::kInt8);
                    }
                  }
        for (std::size_t count : {0, 1, 13, 100})
          for (bool in_place : {false, true}) check_others(l, count, in_place), ++runs;
      }
  if (argc > 1) {
    nccl::load({argv[1]});
    check_nccl_errors();
    check_nccl_capture();
    for (const auto& devices : std::vector<std::vector<int>>{{0}, {0, 1}, {2, 0, 1}, {1, 3, 0, 2}})
      for (bool own_streams : {false, true}) {
        sim::reset(4, {}, static_cast<unsigned>(runs));
        Layout l(devices, own_streams);
        for (std::size_t count : {0, 1, 13, 100})
          for (bool in_place : {false, true})
            for (bool by_id : {false, true}) check_nccl(l, count, in_place, by_id), ++runs;
      }
  }
  std::printf("cuda executor on the simulated runtime: %ld configurations, %d failures\n", runs, failures);
  return failures ? 1 : 0;
}
