// Host collectives end to end in C++ (what the sanitizer builds exercise):
// results against a scalar reference, in place and out of place, every
// algorithm, plus concurrent callers for ThreadSanitizer.
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <thread>
#include <vector>

#include "check.h"
#include "core/half.h"
#include "host/host_communicator.h"

using namespace mirrored;

namespace {

HostCommunicator& comm() {
  static HostCommunicator c;
  return c;
}

template <typename T>
std::vector<std::vector<T>> inputs(int n, std::size_t count) {
  std::vector<std::vector<T>> v(n, std::vector<T>(count));
  for (int r = 0; r < n; ++r)
    for (std::size_t i = 0; i < count; ++i) v[r][i] = static_cast<T>((i * 7 + r * 3) % 11) - static_cast<T>(5);
  return v;
}

template <typename T>
T fold(const std::vector<std::vector<T>>& v, std::size_t i, ReduceOp op) {
  T acc = v[0][i];
  for (std::size_t r = 1; r < v.size(); ++r) {
    const T x = v[r][i];
    switch (op) {
      case ReduceOp::kSum:
      case ReduceOp::kMean: acc = acc + x; break;
      case ReduceOp::kProd: acc = acc * x; break;
      case ReduceOp::kMin: acc = x < acc ? x : acc; break;
      case ReduceOp::kMax: acc = x > acc ? x : acc; break;
    }
  }
  if (op == ReduceOp::kMean) acc = static_cast<T>(acc / static_cast<T>(v.size()));
  return acc;
}

template <typename T>
bool all_reduce_matches(DType dt, int n, std::size_t count, ReduceOp op, Algorithm algo, bool in_place) {
  auto in = inputs<T>(n, count);
  const auto ref = in;
  std::vector<std::vector<T>> out(n, std::vector<T>(count));
  std::vector<const void*> ip(n);
  std::vector<void*> op_(n);
  for (int r = 0; r < n; ++r) {
    ip[r] = in[r].data();
    op_[r] = in_place ? static_cast<void*>(in[r].data()) : out[r].data();
  }
  comm().all_reduce(n, ip.data(), op_.data(), count, dt, op, algo);
  const auto& res = in_place ? in : out;
  for (int r = 0; r < n; ++r)
    for (std::size_t i = 0; i < count; ++i)
      if (res[r][i] != fold(ref, i, op)) return false;
  return true;
}

}  // namespace

// MIRRORED_NATIVE_TEST_SMALL=1 (the ThreadSanitizer run, ~10x slower): the matrix keeps
// every algorithm, replica count and the sizes that cross the pool's chunking, with two
// ops and one dtype; ASan runs it whole, and the threaded tests below carry race detection.
TEST(all_reduce_every_algorithm_op_and_size) {
  const bool small = std::getenv("MIRRORED_NATIVE_TEST_SMALL") != nullptr;
  for (Algorithm algo : {Algorithm::kRing, Algorithm::kDirect, Algorithm::kTree, Algorithm::kAuto})
    for (int n : {1, 2, 3, 4, 7})
      for (std::size_t count : {0ul, 1ul, 5ul, 4095ul, 4097ul, 70001ul})
        for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMin, ReduceOp::kMax, ReduceOp::kMean})
          for (bool in_place : {false, true}) {
            if (small && (op == ReduceOp::kMin || op == ReduceOp::kMean || count == 1 || count == 4095)) continue;
            CHECK((all_reduce_matches<float>(DType::kFloat32, n, count, op, algo, in_place)));
            if (small) continue;
            CHECK((all_reduce_matches<std::int32_t>(DType::kInt32, n, count, op, algo, in_place)));
            CHECK((all_reduce_matches<double>(DType::kFloat64, n, count, op, algo, in_place)));
          }
}

TEST(large_out_of_place_streams_past_the_cache_with_any_alignment) {
  // 2 * n * S >= 16 MiB out of place takes the non-temporal-store path; an
  // output 4 bytes off a 16-byte boundary exercises its unaligned head and tail.
  const int n = 2;
  const std::size_t count = (std::size_t(2) << 20) + 3;
  std::vector<std::vector<float>> in(n, std::vector<float>(count));
  std::vector<std::vector<float>> out(n, std::vector<float>(count + 1, -1.f));
  for (int r = 0; r < n; ++r)
    for (std::size_t i = 0; i < count; ++i) in[r][i] = static_cast<float>((i % 1000) * (r + 1));
  const void* ip[] = {in[0].data(), in[1].data()};
  void* op[] = {out[0].data() + 1, out[1].data() + 1};
  comm().all_reduce(n, ip, op, count, DType::kFloat32, ReduceOp::kSum, Algorithm::kDirect);
  bool ok = true;
  for (int r = 0; r < n; ++r) {
    ok = ok && out[r][0] == -1.f;  // nothing written before the output
    for (std::size_t i = 0; i < count; ++i) ok = ok && out[r][i + 1] == static_cast<float>((i % 1000) * 3);
  }
  CHECK(ok);
}

TEST(integer_overflow_wraps_without_undefined_behaviour) {
  std::vector<std::int32_t> a(3, std::numeric_limits<std::int32_t>::max()), b(3, 2);
  const void* in[] = {a.data(), b.data()};
  void* out[] = {a.data(), b.data()};
  comm().all_reduce(2, in, out, 3, DType::kInt32, ReduceOp::kSum, Algorithm::kDirect);
  CHECK(a[0] == std::numeric_limits<std::int32_t>::min() + 1);
  std::vector<std::int64_t> c(2, std::numeric_limits<std::int64_t>::max()), d(2, 3);
  const void* in2[] = {c.data(), d.data()};
  void* out2[] = {c.data(), d.data()};
  comm().all_reduce(2, in2, out2, 2, DType::kInt64, ReduceOp::kProd, Algorithm::kRing);
  CHECK(c[0] == std::numeric_limits<std::int64_t>::max() - 2);  // (2^63-1)*3 mod 2^64
}

TEST(min_max_propagate_nan) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> a = {nan, 1.f}, b = {1.f, nan}, o(2);
  const void* in[] = {a.data(), b.data()};
  void* out[] = {o.data(), o.data()};
  for (ReduceOp op : {ReduceOp::kMin, ReduceOp::kMax}) {
    comm().reduce(2, in, out, 2, DType::kFloat32, op, 0);
    CHECK(std::isnan(o[0]) && std::isnan(o[1]));
  }
}

TEST(half_conversions_round_trip_and_round_to_nearest_even) {
  for (std::uint32_t h = 0; h < 0x10000; ++h) {
    const auto x = static_cast<std::uint16_t>(h);
    const float f = f16_to_float(x);
    if (std::isnan(f)) {
      CHECK(std::isnan(f16_to_float(float_to_f16(f))));
    } else {
      CHECK(float_to_f16(f) == x);
    }
    const float g = bf16_to_float(x);
    if (!std::isnan(g)) CHECK(float_to_bf16(g) == x);
  }
  CHECK(float_to_f16(1.0f + 1.0f / 2048) == 0x3c00);  // halfway: to even
  CHECK(float_to_f16(65520.f) == 0x7c00);             // rounds to Inf
  CHECK(float_to_f16(5.96e-8f) == 0x0001);            // smallest subnormal
}

TEST(fp16_sum_through_the_dispatched_kernels) {
  const int n = 3;
  const std::size_t count = 1027;  // a vector body and a scalar tail
  std::vector<std::vector<std::uint16_t>> v(n, std::vector<std::uint16_t>(count));
  for (int r = 0; r < n; ++r)
    for (std::size_t i = 0; i < count; ++i) v[r][i] = float_to_f16(static_cast<float>((i + r) % 9) - 4.f);
  std::vector<const void*> in(n);
  std::vector<void*> out(n);
  for (int r = 0; r < n; ++r) in[r] = out[r] = v[r].data();
  comm().all_reduce(n, in.data(), out.data(), count, DType::kFloat16, ReduceOp::kSum, Algorithm::kDirect);
  bool ok = true;
  for (std::size_t i = 0; i < count; ++i) {
    float expect = 0;
    for (int r = 0; r < n; ++r) expect += static_cast<float>((i + r) % 9) - 4.f;
    ok = ok && f16_to_float(v[0][i]) == expect && v[2][i] == v[0][i];
  }
  CHECK(ok);
}

TEST(broadcast_reduce_all_gather) {
  const int n = 4;
  const std::size_t count = 100003;
  auto in = inputs<float>(n, count);
  std::vector<std::vector<float>> out(n, std::vector<float>(count));
  std::vector<const void*> ip(n);
  std::vector<void*> op(n);
  for (int r = 0; r < n; ++r) ip[r] = in[r].data(), op[r] = out[r].data();
  comm().broadcast(n, ip.data(), op.data(), count, DType::kFloat32, 2);
  for (int r = 0; r < n; ++r) CHECK(std::memcmp(out[r].data(), in[2].data(), count * 4) == 0);
  comm().reduce(n, ip.data(), op.data(), count, DType::kFloat32, ReduceOp::kSum, 1);
  bool ok = true;
  for (std::size_t i = 0; i < count; ++i) ok = ok && out[1][i] == fold(in, i, ReduceOp::kSum);
  CHECK(ok);
  // all_gather with uneven rows: 2 rows, rank j contributes j+1 floats per row.
  std::vector<std::size_t> row_bytes = {4, 8, 12, 16};
  std::vector<std::vector<float>> g(n, std::vector<float>(2 * 10));
  std::vector<void*> gp(n);
  for (int r = 0; r < n; ++r) gp[r] = g[r].data();
  comm().all_gather(n, ip.data(), gp.data(), row_bytes.data(), 2);
  for (int k = 0; k < n; ++k) {
    std::size_t pos = 0;
    for (int row = 0; row < 2; ++row)
      for (int j = 0; j < n; ++j)
        for (int e = 0; e <= j; ++e) CHECK(g[k][pos++] == in[j][row * (j + 1) + e]);
  }
}

TEST(batch_all_reduce_matches_single_calls) {
  const int n = 3, T = 40;
  std::vector<std::size_t> counts(T);
  std::vector<DType> types(T);
  std::vector<std::vector<std::vector<float>>> data(n, std::vector<std::vector<float>>(T));
  for (int t = 0; t < T; ++t) {
    counts[t] = (t * 977) % 5000;
    types[t] = DType::kFloat32;
    for (int r = 0; r < n; ++r) {
      data[r][t].resize(counts[t]);
      for (std::size_t i = 0; i < counts[t]; ++i) data[r][t][i] = static_cast<float>((i + t + r) % 13);
    }
  }
  for (Algorithm algo : {Algorithm::kDirect, Algorithm::kRing, Algorithm::kTree})
    for (std::size_t bpp : {0ul, 4096ul, 100000ul}) {
      std::vector<std::vector<std::vector<float>>> out = data;
      std::vector<const void*> in(n * T);
      std::vector<void*> op(n * T);
      for (int r = 0; r < n; ++r)
        for (int t = 0; t < T; ++t) in[r * T + t] = data[r][t].data(), op[r * T + t] = out[r][t].data();
      comm().batch_all_reduce(n, T, in.data(), op.data(), counts.data(), types.data(), ReduceOp::kSum, bpp, 0, algo);
      bool ok = true;
      for (int t = 0; t < T; ++t)
        for (std::size_t i = 0; i < counts[t]; ++i) {
          float s = 0;
          for (int r = 0; r < n; ++r) s += data[r][t][i];
          for (int r = 0; r < n; ++r) ok = ok && out[r][t][i] == s;
        }
      CHECK(ok);
    }
}

TEST(concurrent_callers_share_the_pool_safely) {
  std::vector<std::thread> threads;
  std::vector<int> ok(4, 0);
  for (int k = 0; k < 4; ++k)
    threads.emplace_back([k, &ok] {
      bool good = true;
      for (int it = 0; it < 10; ++it)
        good = good && all_reduce_matches<float>(DType::kFloat32, 3, 200003, ReduceOp::kSum,
                                                 it % 2 ? Algorithm::kRing : Algorithm::kDirect, it % 3 == 0);
      ok[k] = good;
    });
  for (auto& t : threads) t.join();
  for (int v : ok) CHECK(v == 1);
}

TEST(pool_runs_every_item_of_every_job_exactly_once) {
  // Back-to-back jobs whose sizes alternate small/large: a worker lingering
  // on a finished small job must never claim an item of it once the next,
  // larger job's size is visible (it would run out of range, count twice).
  ThreadPool pool(4);
  std::vector<std::atomic<int>> hits(64);
  bool ok = true;
  for (int job = 0; job < 20000 && ok; ++job) {
    const std::size_t items = job % 2 ? 64 : 2;
    for (auto& h : hits) h.store(0);
    pool.parallel_for(items, [&](std::size_t i) { hits[i].fetch_add(1); });
    for (std::size_t i = 0; i < hits.size(); ++i) ok = ok && hits[i].load() == (i < items ? 1 : 0);
  }
  CHECK(ok);
}

TEST(bad_arguments_throw) {
  float x = 0;
  const void* in[] = {&x};
  void* out[] = {&x};
  bool threw = false;
  try {
    comm().broadcast(1, in, out, 1, DType::kFloat32, 1);
  } catch (const std::invalid_argument&) {
    threw = true;
  }
  CHECK(threw);
  threw = false;
  try {
    comm().all_reduce(0, in, out, 1, DType::kFloat32, ReduceOp::kSum, Algorithm::kAuto);
  } catch (const std::invalid_argument&) {
    threw = true;
  }
  CHECK(threw);
}

TEST(outputs_aliasing_other_inputs_are_staged_and_shared_outputs_refused) {
  // Rotated outputs (out[r] is in[r + 1]) and outputs shifted by a few
  // elements inside one base buffer, for every algorithm and broadcast/reduce.
  const int n = 4;
  const std::size_t count = 4096 + 3, shift = 5, stride = count + 64;
  for (Algorithm algo : {Algorithm::kRing, Algorithm::kDirect, Algorithm::kTree}) {
    for (int layout = 0; layout < 2; ++layout) {
      std::vector<float> base(n * stride + shift);
      for (std::size_t i = 0; i < base.size(); ++i) base[i] = static_cast<float>(i % 97);
      std::vector<const void*> in(n);
      std::vector<void*> out(n);
      for (int r = 0; r < n; ++r) {
        in[r] = base.data() + r * stride;
        out[r] = layout == 0 ? base.data() + ((r + 1) % n) * stride : base.data() + r * stride + shift;
      }
      std::vector<float> want(count, 0.f);
      for (int r = 0; r < n; ++r)
        for (std::size_t i = 0; i < count; ++i) want[i] += static_cast<const float*>(in[r])[i];
      comm().all_reduce(n, in.data(), out.data(), count, DType::kFloat32, ReduceOp::kSum, algo);
      bool ok = true;
      for (int r = 0; r < n; ++r)
        for (std::size_t i = 0; i < count; ++i) ok = ok && static_cast<float*>(out[r])[i] == want[i];
      CHECK(ok);
    }
  }
  // broadcast into a shifted view of the root's input; reduce into a view straddling two inputs
  std::vector<double> base(64);
  for (std::size_t i = 0; i < base.size(); ++i) base[i] = static_cast<double>(i);
  const std::vector<double> before = base;
  std::vector<double> other(16);
  const void* bin[] = {base.data(), other.data()};
  void* bout[] = {base.data() + 3, other.data()};
  comm().broadcast(2, bin, bout, 16, DType::kFloat64, 0);
  bool ok = true;
  for (int i = 0; i < 16; ++i) ok = ok && base[3 + i] == before[i] && other[i] == before[i];
  CHECK(ok);
  base = before;
  const void* rin[] = {base.data(), base.data() + 16};
  void* target = base.data() + 8;
  void* rout[] = {target, target};
  comm().reduce(2, rin, rout, 16, DType::kFloat64, ReduceOp::kSum, 0);
  ok = true;
  for (int i = 0; i < 16; ++i) ok = ok && base[8 + i] == before[i] + before[16 + i];
  CHECK(ok);
  // two outputs in one place: no right answer, refused before anything is written
  float x[8] = {1, 1, 1, 1, 1, 1, 1, 1};
  const void* xin[] = {x, x};
  void* xout[] = {x, x + 2};
  bool threw = false;
  try {
    comm().all_reduce(2, xin, xout, 6, DType::kFloat32, ReduceOp::kSum, Algorithm::kRing);
  } catch (const std::invalid_argument&) {
    threw = true;
  }
  CHECK(threw && x[0] == 1.f && x[7] == 1.f);
}

int main() { return check::run_all(); }
