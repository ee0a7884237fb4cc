// Adafactor's fused update (csrc/host/fused_adafactor.cc, core/adafactor_rule.h) under the sanitizers: tables of
// variables of every rank Keras factors or not, in exact-size buffers (AddressSanitizer sees any overrun); the GPU
// kernels' phases (each a launch, its threads in a random order, over several grid sizes) against the host kernel
// bit for bit, also loss-scaled and with squares; exact values; the summed variant; and concurrent calls on
// disjoint tables for ThreadSanitizer.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

#include "check.h"
#include "core/adafactor_rule.h"
#include "host/fused_update.h"

using namespace mirrored::host;
using mirrored::rules::FactoredShape;
using mirrored::rules::factored_shape;

namespace {

const std::vector<std::vector<std::size_t>>& shapes() {
  static const std::vector<std::vector<std::size_t>> all = {
      {}, {5}, {8193}, {3, 4}, {2, 3, 4}, {1, 1}, {130, 70}, {4, 1, 9}, {0, 5}, {5, 0}, {2, 0, 3}};
  return all;
}

FactoredShape factored(const std::vector<std::size_t>& shape) {
  return factored_shape(shape.size(), [&](std::size_t d) { return shape[d]; });
}

// One variable's buffers, each exactly its size; an unfactored variable has no r and c (null slots: Keras'
// placeholders, which the kernels never touch).
template <typename T>
struct Variable {
  FactoredShape f;
  std::vector<T> w, g, sq, r, c, v;
  Variable(const std::vector<std::size_t>& shape, int seed) : f(factored(shape)) {
    std::size_t count = 1;
    for (std::size_t d : shape) count *= d;
    std::mt19937 rng(static_cast<unsigned>(seed));
    std::uniform_real_distribution<double> unit(-1.0, 1.0);
    // Values over several binades, so that another order of a sum rounds differently.
    const auto value = [&](bool positive) {
      const double x = unit(rng) * static_cast<double>(1 << (rng() % 8)) / 16;
      return static_cast<T>(positive ? (x < 0 ? -x : x) + 1e-3 : x);
    };
    for (std::size_t i = 0; i < count; ++i) {
      w.push_back(value(false));
      g.push_back(value(false));
      sq.push_back(g.back() * g.back() * T(1.5));
      v.push_back(value(true));
    }
    if (f.factored) {
      for (std::size_t i = 0; i < f.batches * f.rows; ++i) r.push_back(value(true));
      for (std::size_t i = 0; i < f.batches * f.cols; ++i) c.push_back(value(true));
    }
  }
  FusedEntry<T> entry(bool decay, bool squares) {
    FusedEntry<T> e{w.data(), g.data(), {nullptr, nullptr, v.data()}, w.size(), decay};
    if (f.factored) e.slots[0] = r.data(), e.slots[1] = c.data();
    if (squares) e.squares = sq.data();
    e.shape = f;
    return e;
  }
  // Bit for bit (an empty mean is NaN: a variable of no rows leaves NaN in its c, as Keras').
  bool operator==(const Variable& o) const { return same(w, o.w) && same(r, o.r) && same(c, o.c) && same(v, o.v); }
  static bool same(const std::vector<T>& a, const std::vector<T>& b) {
    return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
  }
};

template <typename T>
FusedScalars<T> scalars() {
  // rho_t, epsilon_2, epsilon_1, beta_2_t, 1 - beta_2_t, clip_threshold (a threshold the update's RMS passes)
  FusedScalars<T> s{};
  const double c[] = {0.01, 1e-3, 1e-30, 0.2, 0.8, 0.5};
  for (int j = 0; j < 6; ++j) s.c[j] = static_cast<T>(c[j]);
  s.weight_decay = T(0.004);
  s.lr = T(0.01);
  return s;
}

template <typename T>
std::vector<Variable<T>> variables(int seed) {
  std::vector<Variable<T>> all;
  for (std::size_t k = 0; k < shapes().size(); ++k) all.emplace_back(shapes()[k], seed + static_cast<int>(k));
  return all;
}

template <typename T>
std::vector<FusedEntry<T>> table_of(std::vector<Variable<T>>& vars, bool squares) {
  std::vector<FusedEntry<T>> table;
  for (std::size_t k = 0; k < vars.size(); ++k) table.push_back(vars[k].entry(k % 2 == 0, squares && k % 3 != 1));
  return table;
}

// The GPU kernels' phases over `threads` threads, each phase's threads in a random order, against the host kernel.
template <typename T>
bool phases_equal_the_host_kernel(std::size_t threads, unsigned seed, bool squares, float scale) {
  auto host = variables<T>(3), gpu = variables<T>(3);
  if (scale != 1.0f)
    for (auto& v : host)
      for (T& g : v.g) g = g / static_cast<T>(scale);
  auto host_table = table_of(host, squares), gpu_table = table_of(gpu, squares);
  FusedScalars<T> s = scalars<T>();
  fused_update<T>(Rule::kAdafactor, host_table.data(), host_table.size(), s);
  if (scale != 1.0f) s.unscale = true, s.loss_scale = static_cast<T>(scale);
  std::size_t scratch = 0;
  for (const auto& e : gpu_table) scratch += mirrored::rules::adafactor_scratch_count(e.count, e.shape);
  std::vector<T> work(scratch);
  std::vector<std::size_t> order(threads);
  std::iota(order.begin(), order.end(), std::size_t(0));
  std::mt19937 rng(seed);
  for (int phase = 0; phase < mirrored::rules::kAdafactorPhases; ++phase) {
    std::shuffle(order.begin(), order.end(), rng);
    for (std::size_t tid : order)
      mirrored::rules::adafactor_phase(phase, gpu_table.data(), static_cast<int>(gpu_table.size()), work.data(), s,
                                       tid, threads);
  }
  bool same = true;
  for (std::size_t k = 0; k < host.size(); ++k) same = same && host[k] == gpu[k];
  bool changed = false;  // the update did something
  const auto before = variables<T>(3);
  for (std::size_t k = 0; k < host.size(); ++k) changed = changed || !Variable<T>::same(host[k].w, before[k].w);
  return same && changed;
}

template <typename T>
bool table_equals_one_variable_at_a_time() {
  auto in_table = variables<T>(5), alone = variables<T>(5);
  auto table = table_of(in_table, true);
  const FusedScalars<T> s = scalars<T>();
  fused_update<T>(Rule::kAdafactor, table.data(), table.size(), s);
  for (std::size_t k = 0; k < alone.size(); ++k) {
    const FusedEntry<T> one = alone[k].entry(k % 2 == 0, k % 3 != 1);
    fused_update<T>(Rule::kAdafactor, &one, 1, s);
  }
  bool same = true;
  for (std::size_t k = 0; k < alone.size(); ++k) same = same && in_table[k] == alone[k];
  return same;
}

// fused_update_summed over `replicas` replicas against the plain update of the gradients summed first in order.
template <typename T>
bool summed_equals_summing_first(int replicas) {
  auto summed = variables<T>(7), reference = variables<T>(7);
  std::vector<std::vector<std::vector<T>>> others(summed.size());  // [variable][replica - 1]
  std::vector<const T*> pointers;
  for (std::size_t k = 0; k < summed.size(); ++k) {
    for (int r = 1; r < replicas; ++r) {
      Variable<T> other(shapes()[k], 100 + r);
      for (std::size_t i = 0; i < other.g.size(); ++i) reference[k].g[i] = reference[k].g[i] + other.g[i];
      others[k].push_back(other.g);
    }
    for (const auto& g : others[k]) pointers.push_back(g.data());
  }
  auto summed_table = table_of(summed, false), reference_table = table_of(reference, false);
  const FusedScalars<T> s = scalars<T>();
  fused_update_summed<T>(Rule::kAdafactor, summed_table.data(), summed_table.size(), pointers.data(), replicas, s);
  fused_update<T>(Rule::kAdafactor, reference_table.data(), reference_table.size(), s);
  bool same = true;
  for (std::size_t k = 0; k < summed.size(); ++k) same = same && summed[k] == reference[k];
  return same;
}

}  // namespace

TEST(the_gpu_phases_in_any_thread_order_equal_the_host_kernel) {
  for (std::size_t threads : {std::size_t(1), std::size_t(7), std::size_t(512), std::size_t(8192)}) {
    CHECK(phases_equal_the_host_kernel<float>(threads, 17u, false, 1.0f));
    CHECK(phases_equal_the_host_kernel<double>(threads, 29u, false, 1.0f));
  }
}

TEST(the_gpu_phases_read_the_squares_and_unscale_as_the_host_kernel) {
  CHECK(phases_equal_the_host_kernel<float>(512, 3u, true, 1.0f));
  CHECK(phases_equal_the_host_kernel<double>(64, 5u, true, 1.0f));
  CHECK(phases_equal_the_host_kernel<float>(512, 7u, false, 1024.0f));
  CHECK(phases_equal_the_host_kernel<float>(100, 9u, false, 3.0f));  // (an inexact reciprocal)
}

TEST(a_table_equals_one_variable_at_a_time) {
  CHECK(table_equals_one_variable_at_a_time<float>());
  CHECK(table_equals_one_variable_at_a_time<double>());
}

TEST(the_summed_update_equals_summing_first_in_replica_order) {
  for (int replicas : {2, 3, 4}) {
    CHECK(summed_equals_summing_first<float>(replicas));
    CHECK(summed_equals_summing_first<double>(replicas));
  }
}

TEST(exact_values_factored_and_not) {
  // g = 2 everywhere, epsilon_1 = 0, beta_2_t = 0: the moments are 4 (r, c, and v = (4 / 4) * 4); u = 2 / 2 = 1,
  // rms(u) = 1 over a clip threshold of 0.5: the step is 0.5; rms(w) = 1, rho_t = 0.25: w = 1 - 0.5 * 0.25.
  FusedScalars<float> s{};
  const float c[] = {0.25f, 1e-3f, 0.0f, 0.0f, 1.0f, 0.5f};
  std::copy(c, c + 6, s.c);
  std::vector<float> w(6, 1.0f), g(6, 2.0f), r(2, 9.0f), col(3, 9.0f), v(6, 9.0f);
  FusedEntry<float> e{w.data(), g.data(), {r.data(), col.data(), v.data()}, 6, false};
  e.shape = factored({2, 3});
  std::vector<float> w1(1, 1.0f), g1(1, 2.0f), v1(1, 9.0f);
  FusedEntry<float> plain{w1.data(), g1.data(), {nullptr, nullptr, v1.data()}, 1, false};
  const FusedEntry<float> table[] = {e, plain};
  fused_update<float>(Rule::kAdafactor, table, 2, s);
  for (float x : w) CHECK(x == 0.875f);
  for (float x : r) CHECK(x == 4.0f);
  for (float x : col) CHECK(x == 4.0f);
  for (float x : v) CHECK(x == 4.0f);
  CHECK(w1[0] == 0.875f && v1[0] == 4.0f);
}

TEST(concurrent_calls_on_disjoint_tables) {
  std::vector<std::vector<Variable<float>>> sets;
  for (int t = 0; t < 4; ++t) sets.push_back(variables<float>(11));
  std::vector<std::thread> threads;
  for (auto& set : sets)
    threads.emplace_back([&set] {
      auto table = table_of(set, true);
      for (int step = 0; step < 3; ++step) fused_update<float>(Rule::kAdafactor, table.data(), table.size(),
                                                               scalars<float>());
    });
  for (auto& t : threads) t.join();
  for (auto& set : sets) CHECK(set.size() == sets[0].size() && set[0] == sets[0][0] && set[6] == sets[0][6]);
}

int main() { return check::run_all(); }
