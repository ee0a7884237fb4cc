// The fused optimizer update (csrc/host/fused_update.cc) under the sanitizers:
// every rule over tables whose entries end on every vector tail (exact-size
// buffers, so AddressSanitizer sees any overrun), one table against one entry
// at a time, exact values where the arithmetic is exact, and concurrent calls
// on disjoint tables (as replica threads make them) for ThreadSanitizer. And
// the GPU kernel's walk (rules::update_table, which csrc/cuda/fused_update.cu
// runs per thread) in a random thread order over several grid sizes, against
// the host kernel bit for bit: the simulated runtime's way of running a kernel.
#include <algorithm>
#include <cmath>
#include <limits>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

#include "check.h"
#include "host/fused_update.h"

using namespace mirrored::host;

namespace {

struct Case {
  Rule rule;
  std::vector<double> c;
  int slots;
};

const std::vector<Case>& cases() {
  static const std::vector<Case> all = {
      {Rule::kSgd, {0.01}, 0},
      {Rule::kSgdMomentum, {0.01, 0.9}, 1},
      {Rule::kSgdNesterov, {0.01, 0.9}, 1},
      {Rule::kAdam, {0.1, 0.001, 0.0031, 1e-7}, 2},
      {Rule::kRmsprop, {0.01, 0.9, 0.1, 1e-7, 0.0, 0.0}, 1},
      {Rule::kRmsprop, {0.01, 0.9, 0.1, 1e-7, 0.5, 1.0}, 3},
      {Rule::kAdagrad, {0.1, 1e-7}, 1},
      {Rule::kNadam, {0.001, 1e-7, 0.1, 0.001, 0.45, 0.8, 0.55, 0.6, 0.002}, 2},
      {Rule::kAdamAmsgrad, {0.1, 0.001, 0.0031, 1e-7}, 3},
      {Rule::kEma, {0.99, 0.01}, 0},
      {Rule::kAdamax, {0.1, 0.95, 0.01, 0.19, 1e-7}, 2},
      {Rule::kAdadelta, {1.0, 0.95, 0.05, 1e-6}, 2},
      {Rule::kLion, {0.01, 0.9, 0.1, 0.99, 0.01}, 1},
      {Rule::kFtrl, {0.1, 0.5, 0.06, 0.5, 0.01}, 2},
      {Rule::kFtrl, {0.05, 0.3, 0.0, 0.0, 0.5}, 2},
      {Rule::kScheduleFreeAdamW, {0.01, 0.001, 0.002997, 1e-8, 0.1, 0.9, 2.0 / 3.0, 1.0 / 3.0}, 2},
      {Rule::kMuon, {-0.05, 0.95, 1.0}, 1},
      {Rule::kMuon, {-0.1, 0.9, 0.0}, 1},
  };
  return all;
}

// One variable's buffers, each exactly `count` long.
template <typename T>
struct Buffers {
  std::vector<T> w, g;
  std::vector<std::vector<T>> s;
  Buffers(std::size_t count, int slots, int seed) : w(count), g(count), s(slots, std::vector<T>(count)) {
    for (std::size_t i = 0; i < count; ++i) {
      w[i] = static_cast<T>(((i * 7 + seed) % 13) - 6) / T(8);
      g[i] = static_cast<T>(((i * 5 + seed) % 11) - 5) / T(4);
      for (int j = 0; j < slots; ++j) s[j][i] = (j == 0 ? T(1) : T(0)) + static_cast<T>((i + j) % 3) / T(16);
    }
  }
  FusedEntry<T> entry(bool decay) {
    FusedEntry<T> e{w.data(), g.data(), {nullptr, nullptr, nullptr}, w.size(), decay};
    for (std::size_t j = 0; j < s.size(); ++j) e.slots[j] = s[j].data();
    return e;
  }
  bool operator==(const Buffers& o) const { return w == o.w && s == o.s; }
};

template <typename T>
FusedScalars<T> scalars(const Case& k) {
  FusedScalars<T> s{};
  for (std::size_t j = 0; j < k.c.size(); ++j) s.c[j] = static_cast<T>(k.c[j]);
  s.weight_decay = T(0.004);
  s.lr = static_cast<T>(k.c[0]);
  return s;
}

template <typename T>
bool table_equals_one_entry_at_a_time(const Case& k) {
  const std::vector<std::size_t> sizes = {0, 1, 3, 7, 8, 9, 15, 16, 17, 31, 33, 1000};
  std::vector<Buffers<T>> table_bufs, single_bufs;
  for (std::size_t v = 0; v < sizes.size(); ++v) {
    table_bufs.emplace_back(sizes[v], k.slots, static_cast<int>(v));
    single_bufs.emplace_back(sizes[v], k.slots, static_cast<int>(v));
  }
  const FusedScalars<T> s = scalars<T>(k);
  std::vector<FusedEntry<T>> table;
  for (std::size_t v = 0; v < sizes.size(); ++v) table.push_back(table_bufs[v].entry(v % 2 == 0));
  fused_update<T>(k.rule, table.data(), table.size(), s);
  for (std::size_t v = 0; v < sizes.size(); ++v) {
    const FusedEntry<T> one = single_bufs[v].entry(v % 2 == 0);
    fused_update<T>(k.rule, &one, 1, s);
  }
  bool same = true;
  for (std::size_t v = 0; v < sizes.size(); ++v) same = same && table_bufs[v] == single_bufs[v];
  bool changed = false;  // the update did something
  for (std::size_t v = 0; v < sizes.size(); ++v) changed = changed || !(table_bufs[v] == Buffers<T>(sizes[v], k.slots, int(v)));
  return same && changed;
}

// The GPU kernel over `threads` threads (blocks x block size of a launch), its
// threads in a random order, against the host kernel.
template <typename T>
bool gpu_walk_equals_the_host_kernel(const Case& k, std::size_t threads, unsigned seed) {
  const std::vector<std::size_t> sizes = {0, 1, 3, 511, 512, 513, 1000, 2049};
  std::vector<Buffers<T>> host_bufs, gpu_bufs;
  for (std::size_t v = 0; v < sizes.size(); ++v) {
    host_bufs.emplace_back(sizes[v], k.slots, static_cast<int>(v));
    gpu_bufs.emplace_back(sizes[v], k.slots, static_cast<int>(v));
  }
  std::vector<FusedEntry<T>> host_table, gpu_table;
  for (std::size_t v = 0; v < sizes.size(); ++v) {
    host_table.push_back(host_bufs[v].entry(v % 3 == 0));
    gpu_table.push_back(gpu_bufs[v].entry(v % 3 == 0));
  }
  const FusedScalars<T> s = scalars<T>(k);
  fused_update<T>(k.rule, host_table.data(), host_table.size(), s);
  std::vector<std::size_t> order(threads);
  std::iota(order.begin(), order.end(), std::size_t(0));
  std::shuffle(order.begin(), order.end(), std::mt19937(seed));
  for (std::size_t tid : order)
    mirrored::rules::update_table(k.rule, gpu_table.data(), static_cast<int>(gpu_table.size()), s, tid, threads);
  bool same = true;
  for (std::size_t v = 0; v < sizes.size(); ++v) same = same && host_bufs[v] == gpu_bufs[v];
  return same;
}

// A loss-scaled step's walk (FusedScalars::unscale, the GPU kernel's gated
// path) against the host kernel on gradients divided by the scale first, as
// Keras' `grad / scale` then the update: bit for bit, for a power of two and
// for a scale whose reciprocal is inexact.
template <typename T>
bool unscaled_walk_equals_dividing_first(const Case& k, float scale) {
  const std::vector<std::size_t> sizes = {0, 1, 3, 511, 513, 1000};
  std::vector<Buffers<T>> host_bufs, gpu_bufs;
  for (std::size_t v = 0; v < sizes.size(); ++v) {
    host_bufs.emplace_back(sizes[v], k.slots, static_cast<int>(v));
    gpu_bufs.emplace_back(sizes[v], k.slots, static_cast<int>(v));
    for (T& g : host_bufs.back().g) g = g / static_cast<T>(scale);
  }
  std::vector<FusedEntry<T>> host_table, gpu_table;
  for (std::size_t v = 0; v < sizes.size(); ++v) {
    host_table.push_back(host_bufs[v].entry(v % 2 == 0));
    gpu_table.push_back(gpu_bufs[v].entry(v % 2 == 0));
  }
  FusedScalars<T> s = scalars<T>(k);
  fused_update<T>(k.rule, host_table.data(), host_table.size(), s);
  s.unscale = true;
  s.loss_scale = static_cast<T>(scale);
  for (std::size_t tid = 0; tid < 512; ++tid)
    mirrored::rules::update_table(k.rule, gpu_table.data(), static_cast<int>(gpu_table.size()), s, tid, 512);
  bool same = true;
  for (std::size_t v = 0; v < sizes.size(); ++v) same = same && host_bufs[v] == gpu_bufs[v];
  return same;
}

// The summed update (fused_update_summed) over `replicas` replicas' gradients of exact-size buffers whose
// sizes cross the 8 KiB blocks of summed gradients, against the plain update of the gradients summed
// first in replica order: bit for bit.
template <typename T>
bool summed_equals_summing_first(const Case& k, int replicas) {
  const std::size_t block = 8 * 1024 / sizeof(T);
  const std::vector<std::size_t> sizes = {0, 1, 17, block - 1, block, block + 1, 3 * block + 5};
  std::vector<Buffers<T>> summed_bufs, reference_bufs;
  std::vector<std::vector<std::vector<T>>> others(sizes.size());  // [variable][replica - 1]
  for (std::size_t v = 0; v < sizes.size(); ++v) {
    summed_bufs.emplace_back(sizes[v], k.slots, static_cast<int>(v));
    reference_bufs.emplace_back(sizes[v], k.slots, static_cast<int>(v));
    for (int r = 1; r < replicas; ++r) {
      std::vector<T> g(sizes[v]);
      for (std::size_t i = 0; i < g.size(); ++i) g[i] = static_cast<T>(((i * 3 + r * 7) % 17) - 8) / T(3);
      for (std::size_t i = 0; i < g.size(); ++i) reference_bufs[v].g[i] = reference_bufs[v].g[i] + g[i];
      others[v].push_back(std::move(g));
    }
  }
  std::vector<FusedEntry<T>> summed_table, reference_table;
  std::vector<const T*> pointers;
  for (std::size_t v = 0; v < sizes.size(); ++v) {
    summed_table.push_back(summed_bufs[v].entry(v % 2 == 0));
    reference_table.push_back(reference_bufs[v].entry(v % 2 == 0));
    for (const auto& g : others[v]) pointers.push_back(g.data());
  }
  const FusedScalars<T> s = scalars<T>(k);
  fused_update_summed<T>(k.rule, summed_table.data(), summed_table.size(), pointers.data(), replicas, s);
  fused_update<T>(k.rule, reference_table.data(), reference_table.size(), s);
  bool same = true;
  for (std::size_t v = 0; v < sizes.size(); ++v) same = same && summed_bufs[v] == reference_bufs[v];
  return same;
}

}  // namespace

TEST(the_gpu_kernel_walk_in_any_thread_order_equals_the_host_kernel) {
  for (const Case& k : cases())
    for (std::size_t threads : {std::size_t(1), std::size_t(7), std::size_t(512), std::size_t(4096)}) {
      CHECK(gpu_walk_equals_the_host_kernel<float>(k, threads, 17u));
      CHECK(gpu_walk_equals_the_host_kernel<double>(k, threads, 29u));
    }
}

TEST(every_rule_over_a_table_equals_one_entry_at_a_time) {
  for (const Case& k : cases()) {
    CHECK(table_equals_one_entry_at_a_time<float>(k));
    CHECK(table_equals_one_entry_at_a_time<double>(k));
  }
}

TEST(sgd_momentum_exact_values) {
  // Powers of two: every operation is exact, so the values are known.
  std::vector<float> w = {1.0f, -2.0f}, g = {0.5f, 4.0f}, m = {0.25f, 0.0f};
  FusedEntry<float> e{w.data(), g.data(), {m.data(), nullptr, nullptr}, 2, true};
  FusedScalars<float> s{};
  s.c[0] = 0.5f;   // lr
  s.c[1] = 0.5f;   // momentum
  s.weight_decay = 0.25f;
  s.lr = 0.5f;
  fused_update<float>(Rule::kSgdMomentum, &e, 1, s);
  // w -= w*0.25*0.5; m = m*0.5 - g*0.5; w += m
  CHECK(m[0] == 0.125f - 0.25f && m[1] == -2.0f);
  CHECK(w[0] == 1.0f - 0.125f + (0.125f - 0.25f) && w[1] == -2.0f + 0.25f - 2.0f);
}

TEST(amsgrad_keeps_the_maximum_velocity_and_divides_by_it) {
  // v_hat = max(v_hat, v) after v's update; a NaN on either side propagates (tf.maximum's rule).
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> w = {1.0f, 1.0f, 1.0f, 1.0f}, g = {0.0f, 2.0f, 0.0f, nan}, m = {0.0f, 0.0f, 0.0f, 0.0f};
  std::vector<float> v = {4.0f, 0.0f, 1.0f, 0.0f}, v_hat = {16.0f, 0.0f, nan, 0.0f};
  FusedEntry<float> e{w.data(), g.data(), {m.data(), v.data(), v_hat.data()}, 4, false};
  FusedScalars<float> s{};
  s.c[0] = 0.5f;  // 1 - beta_1
  s.c[1] = 0.5f;  // 1 - beta_2
  s.c[2] = 1.0f;  // alpha
  s.c[3] = 0.0f;  // epsilon
  fused_update<float>(Rule::kAdamAmsgrad, &e, 1, s);
  CHECK(v[0] == 2.0f && v_hat[0] == 16.0f && w[0] == 1.0f);            // m stays 0: no step
  CHECK(v[1] == 2.0f && v_hat[1] == 2.0f && m[1] == 1.0f);               // the new velocity is larger
  CHECK(w[1] == 1.0f - 1.0f / std::sqrt(2.0f));
  CHECK(std::isnan(v_hat[2]) && std::isnan(v_hat[3]) && std::isnan(w[3]));
}

TEST(ema_is_momentum_times_average_plus_one_minus_momentum_times_the_variable) {
  std::vector<float> average = {0.0f, 2.0f}, w = {4.0f, 8.0f};
  FusedEntry<float> e{average.data(), w.data(), {nullptr, nullptr, nullptr}, 2, false};
  FusedScalars<float> s{};
  s.c[0] = 0.75f;
  s.c[1] = 0.25f;
  fused_update<float>(Rule::kEma, &e, 1, s);
  CHECK(average[0] == 1.0f && average[1] == 3.5f && w[0] == 4.0f && w[1] == 8.0f);
}

TEST(schedule_free_adamw_exact_values_recover_x_from_the_updated_momentum) {
  // Powers of two, every operation exact. v = 0 + (4 - 0) * 0.5 = 2; z = 1 - (2 * 0.5) / (sqrt(2 / 0.5) + 0) = 0.5;
  // x = (y - z * 0.5) / 0.5 with the updated z (Keras reads its momentum after the update) = 1.5, averaged
  // towards z: 1.5 * 0.5 + 0.5 * 0.5 = 1; y = 0.5 * 0.5 + 1 * 0.5 = 0.75 (0.625 from z before its update).
  std::vector<float> y = {1.0f}, g = {2.0f}, z = {1.0f}, v = {0.0f};
  FusedEntry<float> e{y.data(), g.data(), {z.data(), v.data(), nullptr}, 1, false};
  FusedScalars<float> s{};
  const float c[] = {0.5f, 0.5f, 0.5f, 0.0f, 0.5f, 0.5f, 0.5f, 0.5f};  // lr, 1-b2, 1-b2^t, eps, 1-b1, b1, 1-1/t, 1/t
  std::copy(c, c + 8, s.c);
  fused_update<float>(Rule::kScheduleFreeAdamW, &e, 1, s);
  CHECK(v[0] == 2.0f && z[0] == 0.5f && y[0] == 0.75f);
}

TEST(concurrent_calls_on_disjoint_tables) {
  const Case& k = cases()[3];  // Adam
  std::vector<Buffers<float>> bufs;
  for (int t = 0; t < 4; ++t) bufs.emplace_back(4096 + t, k.slots, t);
  std::vector<std::thread> threads;
  const FusedScalars<float> s = scalars<float>(k);
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&, t] {
      FusedEntry<float> e = bufs[t].entry(false);
      for (int step = 0; step < 20; ++step) fused_update<float>(k.rule, &e, 1, s);
    });
  for (auto& th : threads) th.join();
  CHECK(!(bufs[0] == Buffers<float>(4096, k.slots, 0)));
}

TEST(the_summed_update_equals_summing_first_in_replica_order) {
  for (const Case& k : cases())
    for (int replicas : {2, 3, 4}) {
      CHECK(summed_equals_summing_first<float>(k, replicas));
      CHECK(summed_equals_summing_first<double>(k, replicas));
    }
}

TEST(replicas_read_each_others_gradients_concurrently) {
  // As CPU replicas do: each thread updates its own copy, reading every thread's gradient.
  const Case& k = cases()[1];  // SGD with momentum
  constexpr int kReplicas = 4;
  std::vector<Buffers<float>> bufs;
  for (int t = 0; t < kReplicas; ++t) bufs.emplace_back(5000, k.slots, 0);
  const FusedScalars<float> s = scalars<float>(k);
  std::vector<std::thread> threads;
  for (int t = 0; t < kReplicas; ++t)
    threads.emplace_back([&, t] {
      FusedEntry<float> e = bufs[t].entry(false);
      e.grad = bufs[0].g.data();
      const float* others[kReplicas - 1] = {bufs[1].g.data(), bufs[2].g.data(), bufs[3].g.data()};
      for (int step = 0; step < 20; ++step) fused_update_summed<float>(k.rule, &e, 1, others, kReplicas, s);
    });
  for (auto& th : threads) th.join();
  for (int t = 1; t < kReplicas; ++t) CHECK(bufs[t] == bufs[0]);
  CHECK(!(bufs[0] == Buffers<float>(5000, k.slots, 0)));
}

int main() { return check::run_all(); }

TEST(an_unscaled_walk_equals_the_host_kernel_on_gradients_divided_first) {
  for (const Case& k : cases())
    for (float scale : {1024.0f, 1000.0f, 3.0f}) {
      CHECK(unscaled_walk_equals_dividing_first<float>(k, scale));
      CHECK(unscaled_walk_equals_dividing_first<double>(k, scale));
    }
}

TEST(finite_tells_inf_and_nan_from_every_finite_value) {
  using mirrored::rules::finite;
  for (float x : {0.0f, -0.0f, 1.0f, std::numeric_limits<float>::max(), -std::numeric_limits<float>::max(),
                  std::numeric_limits<float>::denorm_min()})
    CHECK(finite(x));
  for (float x : {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                  std::numeric_limits<float>::quiet_NaN()})
    CHECK(!finite(x));
  CHECK(finite(std::numeric_limits<double>::max()) && !finite(std::numeric_limits<double>::infinity()));
}

TEST(loss_scale_step_follows_keras_dynamic_scaling) {
  // Growth every 3 good steps, halving (and a new count) on a bad one; only good steps count.
  int nonfinite = 0;
  float scale = 8.0f;
  long long counter = 0, iterations = 0;
  const int pattern[] = {0, 0, 0, 0, 1, 0, 0, 0};
  const float scales[] = {8.0f, 8.0f, 16.0f, 16.0f, 8.0f, 8.0f, 8.0f, 16.0f};
  const long long counters[] = {1, 2, 0, 1, 0, 1, 2, 0};
  for (int step = 0; step < 8; ++step) {
    nonfinite = pattern[step];
    mirrored::rules::loss_scale_step(&nonfinite, &scale, &counter, &iterations, 3, true);
    CHECK(nonfinite == 0 && scale == scales[step] && counter == counters[step]);
  }
  CHECK(iterations == 7);
  // A fixed scale: every step counts, the scale and its counter stay.
  scale = 8.0f;
  counter = 0;
  iterations = 0;
  for (int step = 0; step < 4; ++step)
    mirrored::rules::loss_scale_step(&nonfinite, &scale, &counter, &iterations, 1, false);
  CHECK(scale == 8.0f && counter == 0 && iterations == 4);
}

// Squares (FusedEntry::squares, an IndexedSlices gradient's rows squared one
// by one): exact-size buffers, each entry's squares `extra` above g * g.
template <typename T>
std::vector<std::vector<T>> squares_of(std::vector<Buffers<T>>& bufs, T extra) {
  std::vector<std::vector<T>> out;
  for (Buffers<T>& b : bufs) {
    out.emplace_back(b.g.size());
    for (std::size_t i = 0; i < b.g.size(); ++i) out.back()[i] = b.g[i] * b.g[i] + extra;
  }
  return out;
}

// With squares equal to g * g every rule gives the dense update's bits; with
// other squares the squaring rules change and the others do not; the GPU walk
// in a random thread order reads the squares as the host kernel does.
template <typename T>
bool squares_are_read_as_the_squared_gradient(const Case& k, std::size_t threads) {
  const std::vector<std::size_t> sizes = {0, 1, 3, 7, 8, 9, 17, 513, 1000};
  std::vector<Buffers<T>> dense, same, other, walked;
  for (std::size_t v = 0; v < sizes.size(); ++v)
    for (auto* bufs : {&dense, &same, &other, &walked}) bufs->emplace_back(sizes[v], k.slots, static_cast<int>(v));
  const auto exact = squares_of(same, T(0)), more = squares_of(other, T(0.75)), walk = squares_of(walked, T(0.75));
  std::vector<FusedEntry<T>> dense_table, same_table, other_table, walk_table;
  for (std::size_t v = 0; v < sizes.size(); ++v) {
    dense_table.push_back(dense[v].entry(v % 2 == 0));
    same_table.push_back(same[v].entry(v % 2 == 0));
    same_table.back().squares = exact[v].data();
    other_table.push_back(other[v].entry(v % 2 == 0));
    other_table.back().squares = more[v].data();
    walk_table.push_back(walked[v].entry(v % 2 == 0));
    walk_table.back().squares = walk[v].data();
  }
  const FusedScalars<T> s = scalars<T>(k);
  fused_update<T>(k.rule, dense_table.data(), dense_table.size(), s);
  fused_update<T>(k.rule, same_table.data(), same_table.size(), s);
  fused_update<T>(k.rule, other_table.data(), other_table.size(), s);
  std::vector<std::size_t> order(threads);
  std::iota(order.begin(), order.end(), std::size_t(0));
  std::shuffle(order.begin(), order.end(), std::mt19937(7u));
  for (std::size_t tid : order)
    mirrored::rules::update_table(k.rule, walk_table.data(), static_cast<int>(walk_table.size()), s, tid, threads);
  const bool squaring = k.rule == Rule::kAdam || k.rule == Rule::kRmsprop || k.rule == Rule::kAdagrad ||
                        k.rule == Rule::kNadam || k.rule == Rule::kAdamAmsgrad || k.rule == Rule::kAdadelta ||
                        k.rule == Rule::kFtrl || k.rule == Rule::kScheduleFreeAdamW;
  bool ok = true, differs = false;
  for (std::size_t v = 0; v < sizes.size(); ++v) {
    ok = ok && dense[v] == same[v] && other[v] == walked[v];
    differs = differs || !(dense[v] == other[v]);
  }
  return ok && differs == squaring;
}

TEST(every_rule_reads_the_squares_in_place_of_g_times_g_on_host_and_in_the_gpu_walk) {
  for (const Case& k : cases())
    for (std::size_t threads : {1, 5, 256}) {
      CHECK(squares_are_read_as_the_squared_gradient<float>(k, threads));
      CHECK(squares_are_read_as_the_squared_gradient<double>(k, threads));
    }
}

TEST(adagrad_exact_values_with_squares) {
  // acc += squares (not g * g); w -= g * lr / sqrt(acc + epsilon): powers of two, exact.
  std::vector<float> w = {1.0f, 1.0f}, g = {1.0f, 0.0f}, acc = {1.0f, 4.0f}, sq = {3.0f, 12.0f};
  FusedEntry<float> e{w.data(), g.data(), {acc.data(), nullptr, nullptr}, 2, false};
  e.squares = sq.data();
  FusedScalars<float> s{};
  s.c[0] = 0.5f;  // lr
  s.c[1] = 0.0f;  // epsilon
  fused_update<float>(Rule::kAdagrad, &e, 1, s);
  CHECK(acc[0] == 4.0f && acc[1] == 16.0f);
  CHECK(w[0] == 1.0f - 0.25f && w[1] == 1.0f);
}

TEST(scatter_add_rows_adds_repeats_in_order_with_their_squares_and_skips_negative_rows) {
  // 4 rows of width 3 (exact-size buffers); row 2 named twice, row 0 once, -1 skipped.
  const std::vector<std::int64_t> indices = {2, 0, -1, 2};
  std::vector<double> values(indices.size() * 3);
  for (std::size_t i = 0; i < values.size(); ++i) values[i] = 0.1 * static_cast<double>(i + 1);
  std::vector<double> out(12, 0.0), squares(12, 0.0);
  CHECK(scatter_add_rows<double>(out.data(), squares.data(), 4, 3, values.data(), indices.data(), 4) == -1);
  for (std::size_t j = 0; j < 3; ++j) {
    const double a = values[j], b = values[9 + j], c = values[3 + j];
    CHECK(out[6 + j] == (0.0 + a) + b && squares[6 + j] == (0.0 + a * a) + b * b);
    CHECK(out[j] == c && squares[j] == c * c);
    CHECK(out[3 + j] == 0.0 && out[9 + j] == 0.0 && squares[3 + j] == 0.0 && squares[9 + j] == 0.0);
  }
  // Without squares, the gradient alone.
  std::vector<double> plain(12, 0.0);
  CHECK(scatter_add_rows<double>(plain.data(), nullptr, 4, 3, values.data(), indices.data(), 4) == -1);
  CHECK(plain == out);
}

TEST(scatter_add_rows_reports_an_index_past_the_rows_and_writes_nothing) {
  const std::vector<std::int64_t> indices = {1, 4, 0};
  const std::vector<float> values = {1.0f, 2.0f, 3.0f};
  std::vector<float> out(4, 0.0f), squares(4, 0.0f);
  CHECK(scatter_add_rows<float>(out.data(), squares.data(), 4, 1, values.data(), indices.data(), 3) == 1);
  CHECK(out == std::vector<float>(4, 0.0f) && squares == std::vector<float>(4, 0.0f));
}

TEST(concurrent_scatter_adds_into_disjoint_buffers) {
  // Replica threads densify their own gradients at once (ThreadSanitizer checks no shared state).
  const std::vector<std::int64_t> indices = {3, 1, 3, 0, 7, 3};
  std::vector<float> values(indices.size() * 5);
  for (std::size_t i = 0; i < values.size(); ++i) values[i] = static_cast<float>(i % 7) - 3.0f;
  std::vector<std::vector<float>> outs(4, std::vector<float>(8 * 5, 0.0f)), squares = outs;
  std::vector<std::thread> threads;
  for (std::size_t t = 0; t < outs.size(); ++t)
    threads.emplace_back([&, t] {
      scatter_add_rows<float>(outs[t].data(), squares[t].data(), 8, 5, values.data(), indices.data(), indices.size());
    });
  for (std::thread& t : threads) t.join();
  for (std::size_t t = 1; t < outs.size(); ++t) CHECK(outs[t] == outs[0] && squares[t] == squares[0]);
  CHECK(outs[0][3 * 5] == (0.0f + values[0]) + values[10] + values[25]);
}
