// scatter_add_rows (cuda/scatter_rows.h) on the simulated runtime, whose
// threads run in a random order (so the count phase's tickets come out in a
// random order): every dtype, int32 and int64 indices, rows named once, a few
// times and hundreds of times, dropped indices, no slices, with
// and without squares, adding into `out` and overwriting it; against the
// slice-order reference bit for bit, and for float32 and float64 against the
// host loop (host/fused_update.h). The values are chosen so that another
// order of additions gives other bits (checked). On two devices from two
// threads at once (for ThreadSanitizer). Exit status 0 when all is right.
#include <cstdio>
#include <cstring>
#include <random>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include "cuda/fused.h"
#include "cuda/reduce_ops.cuh"
#include "cuda/scatter_rows.h"
#include "cuda/sim/expect.h"
#include "cuda/sim/sim_replicas.h"
#include "cuda/sim/sim_runtime.h"
#include "host/fused_update.h"

using namespace mirrored;
using namespace mirrored::cuda;

namespace {

using sim_check::failures;

struct Case {
  std::size_t slices, width, rows;
  int distinct;      // rows the slices name (0: any of `rows`)
  bool wide, squares, accumulate;
  int dropped;       // every dropped-th index is out of range (0: none)
};

const std::vector<Case> kCases = {
    {0, 3, 5, 0, true, true, true, 0},        {0, 3, 5, 0, false, false, false, 0},
    {1, 1, 1, 0, true, false, true, 0},       {7, 4, 9, 2, false, true, true, 3},
    {64, 5, 100, 0, true, true, false, 0},    {300, 3, 40, 1, true, true, true, 0},
    {300, 2, 50, 3, false, false, false, 7},  {513, 17, 600, 20, true, true, true, 5},
    {40, 0, 6, 2, true, true, false, 0},
};

// A value whose sums depend on the order they are added in (large and small magnitudes mixed).
double value(std::mt19937& rng) {
  std::uniform_int_distribution<int> pick(-50, 50), scale(0, 3);
  const double magnitudes[] = {1.0, 1e-3, 3e4, 1e8};
  return pick(rng) * magnitudes[scale(rng)] / 7.0;
}

template <typename T>
T make(double v) {
  if constexpr (std::is_integral_v<T>)
    return static_cast<T>(static_cast<long long>(v));  // (wrapped, as a cast from a wider integer is)
  else
    return Elem<T>::store(static_cast<typename Elem<T>::Acc>(v));
}

// The host's order: out[indices[i]] += values[i] for i ascending (`order` reversed: descending, to show
// that the order matters), each addition rounded to T.
template <typename T>
void reference(const Case& c, const std::vector<T>& values, const std::vector<long long>& rows, std::vector<T>& out,
               std::vector<T>& squares, bool reversed) {
  using E = Elem<T>;
  const Combine<ReduceOp::kSum> add;
  const Combine<ReduceOp::kProd> multiply;
  for (std::size_t n = 0; n < c.slices; ++n) {
    const std::size_t i = reversed ? c.slices - 1 - n : n;
    if (rows[i] < 0 || rows[i] >= static_cast<long long>(c.rows)) continue;
    for (std::size_t j = 0; j < c.width; ++j) {
      const auto v = E::load(values[i * c.width + j]);
      T& o = out[rows[i] * c.width + j];
      o = E::store(add(E::load(o), v));
      if (c.squares) {
        T& s = squares[rows[i] * c.width + j];
        s = E::store(add(E::load(s), E::load(E::store(multiply(v, v)))));
      }
    }
  }
}

// (memcpy of an empty vector: its data() may be null, which memcpy must not get)
template <typename T>
void copy_in(void* device, const std::vector<T>& host) {
  if (!host.empty()) std::memcpy(device, host.data(), host.size() * sizeof(T));
}

template <typename T>
bool same_bits(const T* a, const std::vector<T>& b) {
  return b.empty() || std::memcmp(a, b.data(), b.size() * sizeof(T)) == 0;
}

// One case of dtype T on the current device; true when right.
template <typename T>
bool run_case(DType dtype, const Case& c, std::mt19937& rng, cudaStream_t s, int device, bool& order_mattered) {
  std::vector<T> values(c.slices * c.width), out(c.rows * c.width), squares(c.rows * c.width);
  std::vector<long long> rows(c.slices);
  std::uniform_int_distribution<long long> row(0, c.distinct ? c.distinct - 1 : static_cast<long long>(c.rows) - 1);
  for (auto& v : values) v = make<T>(value(rng));
  for (std::size_t i = 0; i < c.slices; ++i)
    rows[i] = c.dropped && i % c.dropped == 0 ? (i % 2 ? -1 - static_cast<long long>(i) : c.rows + i) : row(rng);
  for (auto& o : out) o = make<T>(c.accumulate ? value(rng) : 99.0);  // overwritten: whatever it held goes
  for (auto& q : squares) q = make<T>(c.accumulate ? value(rng) : 99.0);
  const std::size_t cells = c.rows * c.width;
  T* d_values = static_cast<T*>(sim::allocate(values.size() * sizeof(T) + 1, device));
  T* d_out = static_cast<T*>(sim::allocate(cells * sizeof(T) + 1, device));
  T* d_squares = static_cast<T*>(sim::allocate(cells * sizeof(T) + 1, device));
  void* d_indices = sim::allocate(c.slices * 8 + 1, device);
  void* workspace = sim::allocate(scatter_rows_workspace_bytes(c.slices, c.rows), device);
  std::vector<std::int32_t> narrow(rows.begin(), rows.end());
  sim::enqueue(s, [=] {
    copy_in(d_values, values);
    copy_in(d_out, out);
    copy_in(d_squares, squares);
    if (c.wide)
      copy_in(d_indices, rows);
    else
      copy_in(d_indices, narrow);
  });
  ScatterRows a;
  a.dtype = dtype;
  a.values = d_values, a.indices = d_indices, a.wide_indices = c.wide;
  a.slices = c.slices, a.width = c.width, a.rows = c.rows;
  a.out = d_out, a.squares = c.squares ? d_squares : nullptr, a.accumulate = c.accumulate;
  scatter_add_rows(a, workspace, 4, s);
  cudaStreamSynchronize(s);
  std::vector<T> want(c.accumulate ? out : std::vector<T>(cells, make<T>(0.0)));
  std::vector<T> want_squares(c.accumulate ? squares : std::vector<T>(cells, make<T>(0.0)));
  std::vector<T> backwards(want), backwards_squares(want_squares);
  reference<T>(c, values, rows, want, want_squares, false);
  reference<T>(c, values, rows, backwards, backwards_squares, true);
  order_mattered |= !same_bits(backwards.data(), want) || !same_bits(backwards_squares.data(), want_squares);
  bool right = same_bits(d_out, want) && (c.squares ? same_bits(d_squares, want_squares)
                                                   : same_bits(d_squares, squares));  // untouched without
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
    // The host loop (the CPU replicas' densify) gives the same bits: it drops negative indices only.
    std::vector<std::int64_t> kept_rows;
    std::vector<T> kept_values;
    for (std::size_t i = 0; i < c.slices; ++i)
      if (rows[i] < static_cast<long long>(c.rows)) {
        kept_rows.push_back(rows[i]);
        kept_values.insert(kept_values.end(), values.begin() + i * c.width, values.begin() + (i + 1) * c.width);
      }
    std::vector<T> host = c.accumulate ? out : std::vector<T>(cells, T(0));
    std::vector<T> host_squares = c.accumulate ? squares : std::vector<T>(cells, T(0));
    host::scatter_add_rows<T>(host.data(), c.squares ? host_squares.data() : nullptr, c.rows, c.width,
                              kept_values.data(), kept_rows.data(), kept_rows.size());
    right = right && same_bits(d_out, host) && (!c.squares || same_bits(d_squares, host_squares));
  }
  for (void* p : {static_cast<void*>(d_values), static_cast<void*>(d_out), static_cast<void*>(d_squares), d_indices,
                  workspace})
    sim::release(p, s);
  return right;
}

// Every case in every dtype on device `device`; true when all are right and the order showed.
bool run(int device) {
  cudaSetDevice(device);
  cudaStream_t s;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  std::mt19937 rng(17 + device);
  bool right = true, order_mattered = false;
  for (const Case& c : kCases) {
    right &= run_case<F16>(DType::kFloat16, c, rng, s, device, order_mattered);
    right &= run_case<BF16>(DType::kBFloat16, c, rng, s, device, order_mattered);
    right &= run_case<float>(DType::kFloat32, c, rng, s, device, order_mattered);
    right &= run_case<double>(DType::kFloat64, c, rng, s, device, order_mattered);
    right &= run_case<std::int8_t>(DType::kInt8, c, rng, s, device, order_mattered);
    right &= run_case<std::uint8_t>(DType::kUInt8, c, rng, s, device, order_mattered);
    right &= run_case<std::int32_t>(DType::kInt32, c, rng, s, device, order_mattered);
    right &= run_case<std::int64_t>(DType::kInt64, c, rng, s, device, order_mattered);
  }
  cudaStreamSynchronize(s);
  cudaStreamDestroy(s);
  return right && order_mattered;
}

void check_launches_and_limits() {
  sim::reset(1, {}, 3);
  cudaSetDevice(0);
  std::vector<void*> buffers;
  for (std::size_t bytes : std::vector<std::size_t>{32, 32, 64, scatter_rows_workspace_bytes(4, 8)}) {
    buffers.push_back(sim::allocate(bytes, 0));
    std::memset(buffers.back(), 0, bytes);
  }
  ScatterRows a;
  a.values = buffers[0], a.indices = buffers[1], a.out = buffers[2];
  a.slices = 4, a.width = 2, a.rows = 8;
  sim::reset_counters();
  scatter_add_rows(a, buffers[3], 4, nullptr);
  EXPECT(sim::counters().launches[0] == 6, "a densify took %ld launches, not 6", sim::counters().launches[0]);
  EXPECT(sim::counters().host_waits == 0, "a densify waited for the GPU");
  sim::drain();
  a.slices = std::size_t(1) << 31;
  bool refused = false;
  try {
    scatter_add_rows(a, buffers[3], 4, nullptr);
  } catch (const std::invalid_argument&) {
    refused = true;
  }
  EXPECT(refused, "2**31 slices were not refused");
  for (void* p : buffers) sim::release(p, nullptr);
  sim::drain();
}

}  // namespace

int main() {
  for (unsigned seed = 0; seed < 6; ++seed) sim_check::expect_right_on_two_devices(seed, run);
  check_launches_and_limits();
  std::printf("scatter_add_rows on the simulated runtime: %d failures\n", failures);
  return failures ? 1 : 0;
}
