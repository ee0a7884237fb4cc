// Lamb on the fused host kernel (csrc/host/fused_update.cc over
// csrc/core/lamb.h) under the sanitizers: exact-size buffers around a lane
// block's edge (AddressSanitizer sees any overrun of the variable or of the
// lane sums), against a reference written element by element with
// core/variable_sums.h's one-thread sum, bit for bit; the summed replicas'
// variant against summing first; concurrent calls (each thread its own lane
// buffer) for ThreadSanitizer. And the GPU's four phases, each body run per
// thread in a random order over several grid sizes, one phase after the
// other (the simulated runtime's way), against the host kernel bit for bit.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

#include "check.h"
#include "core/lamb.h"
#include "core/variable_sums.h"
#include "host/fused_update.h"

using namespace mirrored::host;
namespace rules = mirrored::rules;

namespace {

constexpr std::size_t kLanes = rules::kSumLanes;
const std::vector<std::size_t> kSizes = {0, 1, 7, kLanes - 1, kLanes, kLanes + 1, 3 * kLanes + 5};

// One variable's buffers, each exactly `count` long: w, g, its squares (a repeated row's: above g * g), m, v.
template <typename T>
struct Variable {
  std::vector<T> w, g, sq, m, v;
  Variable(std::size_t count, unsigned seed) : w(count), g(count), sq(count), m(count), v(count) {
    std::mt19937 rng(seed);
    std::normal_distribution<double> normal;
    for (std::size_t i = 0; i < count; ++i) {
      w[i] = static_cast<T>(normal(rng));
      g[i] = static_cast<T>(normal(rng));
      sq[i] = g[i] * g[i] + static_cast<T>(0.25);
      m[i] = static_cast<T>(normal(rng) * 0.1);
      v[i] = static_cast<T>(std::fabs(normal(rng)) * 0.01);
    }
  }
  FusedEntry<T> entry(bool decay, bool squares) {
    FusedEntry<T> e{w.data(), g.data(), {m.data(), v.data(), nullptr}, w.size(), decay};
    if (squares) e.squares = sq.data();
    return e;
  }
  bool operator==(const Variable& o) const { return w == o.w && m == o.m && v == o.v; }
};

template <typename T>
FusedScalars<T> scalars(int step) {
  const double b1 = 0.9, b2 = 0.999;
  FusedScalars<T> s{};
  s.c[0] = static_cast<T>(1 - b1);
  s.c[1] = static_cast<T>(1 - b2);
  s.c[2] = static_cast<T>(0.01);
  s.c[3] = T(1) - static_cast<T>(std::pow(b1, step));
  s.c[4] = T(1) - static_cast<T>(std::pow(b2, step));
  s.c[5] = static_cast<T>(1e-7);
  s.weight_decay = static_cast<T>(0.05);
  s.lr = s.c[2];
  return s;
}

// Keras' Lamb on one variable, element by element (no core/lamb.h code): the two norms by variable_sum.
template <typename T>
void reference(const FusedEntry<T>& e, const FusedScalars<T>& s) {
  const T* c = s.c;
  std::vector<T> u(e.count), lane(rules::sum_lanes(e.count) + 1);
  for (std::size_t i = 0; i < e.count; ++i) {
    if (e.decay) e.weight[i] = e.weight[i] - (e.weight[i] * s.weight_decay) * s.lr;
    const T g = e.grad[i], gg = e.squares ? e.squares[i] : g * g;
    T& m = e.slots[0][i];
    T& v = e.slots[1][i];
    m = m + (g - m) * c[0];
    v = v + (gg - v) * c[1];
    u[i] = (m / c[3]) / (std::sqrt(v / c[4]) + c[5]);
  }
  const T w_norm = std::sqrt(rules::variable_sum<T>([&](std::size_t i) { return e.weight[i] * e.weight[i]; },
                                                    e.count, lane.data()));
  const T u_norm = std::sqrt(rules::variable_sum<T>([&](std::size_t i) { return u[i] * u[i]; }, e.count, lane.data()));
  const T ratio = w_norm > T(0) && u_norm > T(0) ? w_norm / u_norm : T(1);
  for (std::size_t i = 0; i < e.count; ++i) e.weight[i] = e.weight[i] - u[i] * (ratio * c[2]);
}

// The kernel over a table of kSizes (decay on odd entries, squares on every third) for three steps, against
// the reference one variable at a time.
template <typename T>
bool kernel_equals_the_reference() {
  std::vector<Variable<T>> got, want;
  for (std::size_t k = 0; k < kSizes.size(); ++k) {
    got.emplace_back(kSizes[k], static_cast<unsigned>(k));
    want.emplace_back(kSizes[k], static_cast<unsigned>(k));
  }
  std::vector<FusedEntry<T>> table;
  for (std::size_t k = 0; k < kSizes.size(); ++k) table.push_back(got[k].entry(k % 2 == 1, k % 3 == 0));
  for (int step = 1; step <= 3; ++step) {
    const FusedScalars<T> s = scalars<T>(step);
    fused_update<T>(Rule::kLamb, table.data(), table.size(), s);
    for (std::size_t k = 0; k < kSizes.size(); ++k) reference(want[k].entry(k % 2 == 1, k % 3 == 0), s);
  }
  bool same = true, moved = false;
  for (std::size_t k = 0; k < kSizes.size(); ++k) {
    same = same && got[k] == want[k];
    moved = moved || !(got[k] == Variable<T>(kSizes[k], static_cast<unsigned>(k)));
  }
  return same && moved;
}

// The four phases of the GPU kernels, each over `threads` threads in a random order, against the host
// kernel; `unscale`: a loss-scaled step (its gradients divided by the scale first on the host's side).
template <typename T>
bool gpu_phases_equal_the_host_kernel(std::size_t threads, unsigned seed, bool unscale) {
  const std::vector<std::size_t> sizes = {5, 0, kLanes + 3, 64, 65, 1, 2 * kLanes};
  std::vector<Variable<T>> host, gpu;
  std::size_t lanes = 0, groups = 0;
  for (std::size_t k = 0; k < sizes.size(); ++k) {
    host.emplace_back(sizes[k], 40u + static_cast<unsigned>(k));
    gpu.emplace_back(sizes[k], 40u + static_cast<unsigned>(k));
    lanes += rules::sum_lanes(sizes[k]);
    groups += rules::sum_groups(rules::sum_lanes(sizes[k]));
    if (unscale)
      for (T& g : host.back().g) g = g / T(1000);
  }
  std::vector<FusedEntry<T>> host_table, gpu_table;
  for (std::size_t k = 0; k < sizes.size(); ++k) {
    host_table.push_back(host[k].entry(k % 2 == 0, !unscale && k % 3 == 1));
    gpu_table.push_back(gpu[k].entry(k % 2 == 0, !unscale && k % 3 == 1));
  }
  FusedScalars<T> s = scalars<T>(2);
  fused_update<T>(Rule::kLamb, host_table.data(), host_table.size(), s);
  s.unscale = unscale;
  s.loss_scale = T(1000);
  // Scratch poisoned with NaN: a phase reading what no earlier phase wrote shows in the weights.
  std::vector<T> scratch(rules::lamb_scratch_count(sizes.size(), lanes, groups), std::nan(""));
  const rules::LambSums<T> sums{scratch.data(), lanes, groups};
  const FusedEntry<T>* t = gpu_table.data();
  const int n = static_cast<int>(gpu_table.size());
  std::vector<std::size_t> order(threads);
  std::iota(order.begin(), order.end(), std::size_t(0));
  std::mt19937 rng(seed);
  const auto phase = [&](auto body) {
    std::shuffle(order.begin(), order.end(), rng);
    for (std::size_t tid : order) body(tid);
  };
  phase([&](std::size_t tid) { rules::lamb_lanes(t, n, s, sums, tid, threads); });
  phase([&](std::size_t tid) { rules::lamb_groups(t, n, sums, tid, threads); });
  phase([&](std::size_t tid) { rules::lamb_ratios(t, n, sums, tid, threads); });
  phase([&](std::size_t tid) { rules::lamb_apply(t, n, s, sums, tid, threads); });
  bool same = true;
  for (std::size_t k = 0; k < sizes.size(); ++k) same = same && host[k] == gpu[k];
  return same;
}

// fused_update_summed over `replicas` replicas' gradients against the plain update of their sum in
// replica order, sizes crossing the 8 KiB sum blocks and the lane blocks.
template <typename T>
bool summed_equals_summing_first(int replicas) {
  const std::size_t block = 8 * 1024 / sizeof(T);
  const std::vector<std::size_t> sizes = {0, 1, block - 1, block + 1, kLanes + 1, 3 * kLanes + 5};
  std::vector<Variable<T>> summed, first;
  std::vector<std::vector<std::vector<T>>> others(sizes.size());
  for (std::size_t k = 0; k < sizes.size(); ++k) {
    summed.emplace_back(sizes[k], 70u + static_cast<unsigned>(k));
    first.emplace_back(sizes[k], 70u + static_cast<unsigned>(k));
    for (int r = 1; r < replicas; ++r) {
      std::vector<T> g(sizes[k]);
      for (std::size_t i = 0; i < g.size(); ++i) g[i] = static_cast<T>(((i * 3 + r * 7) % 17) - 8) / T(3);
      for (std::size_t i = 0; i < g.size(); ++i) first[k].g[i] = first[k].g[i] + g[i];
      others[k].push_back(std::move(g));
    }
  }
  std::vector<FusedEntry<T>> summed_table, first_table;
  std::vector<const T*> pointers;
  for (std::size_t k = 0; k < sizes.size(); ++k) {
    summed_table.push_back(summed[k].entry(k % 2 == 0, false));
    first_table.push_back(first[k].entry(k % 2 == 0, false));
    for (const auto& g : others[k]) pointers.push_back(g.data());
  }
  const FusedScalars<T> s = scalars<T>(4);
  fused_update_summed<T>(Rule::kLamb, summed_table.data(), summed_table.size(), pointers.data(), replicas, s);
  fused_update<T>(Rule::kLamb, first_table.data(), first_table.size(), s);
  bool same = true;
  for (std::size_t k = 0; k < sizes.size(); ++k) same = same && summed[k] == first[k];
  return same;
}

}  // namespace

TEST(lamb_host_kernel_equals_the_reference_bit_for_bit) {
  CHECK(kernel_equals_the_reference<float>());
  CHECK(kernel_equals_the_reference<double>());
}

TEST(lamb_gpu_phases_in_any_thread_order_equal_the_host_kernel) {
  for (std::size_t threads : {std::size_t(1), std::size_t(7), std::size_t(512), std::size_t(8192 * 3)}) {
    CHECK(gpu_phases_equal_the_host_kernel<float>(threads, 17u, false));
    CHECK(gpu_phases_equal_the_host_kernel<double>(threads, 29u, false));
  }
  CHECK(gpu_phases_equal_the_host_kernel<float>(512, 5u, true));
  CHECK(gpu_phases_equal_the_host_kernel<double>(512, 6u, true));
}

TEST(lamb_summed_update_equals_summing_first_in_replica_order) {
  for (int replicas : {2, 3, 4}) {
    CHECK(summed_equals_summing_first<float>(replicas));
    CHECK(summed_equals_summing_first<double>(replicas));
  }
}

TEST(lamb_trust_ratio_is_one_when_a_norm_is_zero) {
  // w = 0: |w| = 0, ratio 1, the step is the update times lr; g = 0 with no moments: |update| = 0, no step.
  std::vector<float> w = {0.0f, 0.0f}, g = {1.0f, -1.0f}, m = {0.0f, 0.0f}, v = {0.0f, 0.0f};
  std::vector<float> w2 = {0.5f, 2.0f}, g2 = {0.0f, 0.0f}, m2 = {0.0f, 0.0f}, v2 = {0.0f, 0.0f};
  FusedEntry<float> table[2] = {{w.data(), g.data(), {m.data(), v.data(), nullptr}, 2, false},
                                {w2.data(), g2.data(), {m2.data(), v2.data(), nullptr}, 2, false}};
  FusedScalars<float> s{};
  s.c[0] = 0.5f, s.c[1] = 0.25f, s.c[2] = 0.125f, s.c[3] = 0.5f, s.c[4] = 0.25f, s.c[5] = 1.0f;
  fused_update<float>(Rule::kLamb, table, 2, s);
  // m = 0.5 g, v = 0.25; update = (m / 0.5) / (sqrt(v / 0.25) + 1) = g / 2: w -= (g / 2) * (1 * 0.125).
  CHECK(w[0] == -0.0625f && w[1] == 0.0625f && m[0] == 0.5f && v[1] == 0.25f);
  CHECK(w2[0] == 0.5f && w2[1] == 2.0f);
}

TEST(lamb_concurrent_calls_on_disjoint_tables) {
  std::vector<Variable<float>> vars, alone;
  for (unsigned t = 0; t < 4; ++t) {
    vars.emplace_back(kLanes + 100 * t, t);
    alone.emplace_back(kLanes + 100 * t, t);
  }
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&, t] {
      FusedEntry<float> e = vars[t].entry(t % 2 == 0, false);
      for (int step = 1; step <= 10; ++step) fused_update<float>(Rule::kLamb, &e, 1, scalars<float>(step));
    });
  for (auto& th : threads) th.join();
  for (int t = 0; t < 4; ++t) {
    FusedEntry<float> e = alone[t].entry(t % 2 == 0, false);
    for (int step = 1; step <= 10; ++step) fused_update<float>(Rule::kLamb, &e, 1, scalars<float>(step));
    CHECK(vars[t] == alone[t]);
  }
}

int main() { return check::run_all(); }
