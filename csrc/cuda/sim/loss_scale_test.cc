// A loss-scaled fused update on the simulated runtime (cuda/fused_update.h):
// the check over the packed gradients into a device flag, the gated update
// that divides by the scale (1000: an inexact reciprocal) and writes nothing
// after an inf or a nan, and rules::loss_scale_step, over steps good, inf,
// good, nan, good, against rules::update_table on gradients divided first;
// on two devices from two threads at once (for ThreadSanitizer), in random
// kernel orders. Exit status 0 when all is right.
#include <cstdio>
#include <cstring>
#include <limits>
#include <vector>

#include "cuda/fused_update.h"
#include "cuda/sim/expect.h"
#include "cuda/sim/sim_replicas.h"
#include "cuda/sim/sim_runtime.h"

using namespace mirrored;
using namespace mirrored::cuda;

namespace {

using sim_check::failures;

const std::vector<std::size_t> kCounts = {1, 3, 512, 513, 0, 1000};
constexpr float kScale = 1000.0f;
constexpr double kLr = 0.01, kMomentum = 0.9;

float value(std::size_t i, int which) { return static_cast<float>((i * 7 + which * 5) % 23) / 8.0f - 1.0f; }

// Device `device`'s run; true when the weights, slots and state are the reference's, bit for bit.
bool run(int device) {
  cudaSetDevice(device);
  cudaStream_t s;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  std::size_t total = 0;
  for (std::size_t n : kCounts) total += n;
  std::vector<float> w(total), m(total);
  for (std::size_t i = 0; i < total; ++i) w[i] = value(i, 0), m[i] = value(i, 1) / 4;
  auto* dw = static_cast<float*>(sim::allocate(total * sizeof(float), device));
  auto* dm = static_cast<float*>(sim::allocate(total * sizeof(float), device));
  auto* grads = static_cast<float*>(sim::allocate(total * sizeof(float), device));
  auto* nonfinite = static_cast<int*>(sim::allocate(sizeof(int), device));
  auto* scale = static_cast<float*>(sim::allocate(sizeof(float), device));
  auto* counters = static_cast<long long*>(sim::allocate(2 * sizeof(long long), device));
  std::memcpy(dw, w.data(), total * sizeof(float));
  std::memcpy(dm, m.data(), total * sizeof(float));
  *nonfinite = 0, *scale = kScale, counters[0] = counters[1] = 0;
  std::vector<FusedVariable> vars;
  std::vector<rules::FusedEntry<float>> reference;
  std::vector<float> g(total);
  std::size_t at = 0;
  for (std::size_t k = 0; k < kCounts.size(); ++k) {
    vars.push_back({dw + at, {dm + at, nullptr, nullptr}, kCounts[k], k % 2 == 0});
    reference.push_back({w.data() + at, g.data() + at, {m.data() + at, nullptr, nullptr}, kCounts[k], k % 2 == 0});
    at += kCounts[k];
  }
  FusedUpdateTable table(device, DType::kFloat32, vars);
  rules::FusedScalars<float> scalars{};
  scalars.c[0] = static_cast<float>(kLr), scalars.c[1] = static_cast<float>(kMomentum);
  scalars.weight_decay = 0.004f, scalars.lr = static_cast<float>(kLr);
  const float bad[] = {0, std::numeric_limits<float>::infinity(), 0, std::numeric_limits<float>::quiet_NaN(), 0};
  for (int step = 0; step < 5; ++step) {
    std::vector<float> host(total);
    for (std::size_t i = 0; i < total; ++i) host[i] = value(i, step + 2) * kScale;
    if (step % 2) host[(step * 977) % total] = bad[step];
    float* into = grads;
    sim::enqueue(s, [=] { std::memcpy(into, host.data(), host.size() * sizeof(float)); });
    table.check_finite(grads, nonfinite, s);
    table.apply(rules::Rule::kSgdMomentum, grads, {kLr, kMomentum}, 0.004, kLr, s, LossScaleGate{nonfinite, scale});
    loss_scale_step(nonfinite, scale, counters, counters + 1, 2, true, s);
    if (step % 2 == 0) {
      // The reference skips the bad steps; each halved the scale, and no two good steps came in a row
      // to double it (growth_steps 2): the good steps divide by 1000, 500, 250.
      const float divisor = kScale / static_cast<float>(1 << (step / 2));
      for (std::size_t i = 0; i < total; ++i) g[i] = host[i] / divisor;
      rules::update_table(rules::Rule::kSgdMomentum, reference.data(), static_cast<int>(reference.size()), scalars, 0,
                          1);
    }
  }
  cudaStreamSynchronize(s);
  const bool same = std::memcmp(dw, w.data(), total * sizeof(float)) == 0 &&
                    std::memcmp(dm, m.data(), total * sizeof(float)) == 0;
  const bool state = *nonfinite == 0 && *scale == kScale / 4 && counters[0] == 1 && counters[1] == 3;
  cudaStreamDestroy(s);
  return same && state;
}

}  // namespace

int main() {
  for (unsigned seed = 0; seed < 8; ++seed) sim_check::expect_right_on_two_devices(seed, run);
  std::printf("loss-scaled fused update on the simulated runtime: %d failures\n", failures);
  return failures ? 1 : 0;
}
