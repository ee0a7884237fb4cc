// Lamb's fused update on the simulated runtime (cuda/fused_update.h over
// core/lamb.h): FusedUpdateTable::apply over four steps whose packed
// gradients move (the table is uploaded again), one with IndexedSlices'
// squares, one whose scalars the kernels read from device memory, against the
// host kernel bit for bit; a gated step with its flag set writes nothing and
// costs the same launches; each update is kLambLaunches launches however
// many variables the table holds. On two devices from two threads at once
// (for ThreadSanitizer), in random kernel orders. Exit status 0 when all is
// right.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>

#include "core/lamb.h"
#include "cuda/fused_update.h"
#include "cuda/sim/expect.h"
#include "cuda/sim/sim_replicas.h"
#include "cuda/sim/sim_runtime.h"
#include "host/fused_update.h"

using namespace mirrored;
using namespace mirrored::cuda;

namespace {

using sim_check::failures;

const std::vector<std::size_t> kCounts = {1, rules::kSumLanes + 3, 0, 64, 65, 7};

float value(std::size_t i, int which) { return static_cast<float>((i * 7 + which * 5) % 23) / 8.0f - 1.4f; }

std::vector<double> coefficients(int step) {
  const double b1 = 0.9, b2 = 0.999;
  return {1 - b1, 1 - b2, 0.01, 1 - std::pow(b1, step), 1 - std::pow(b2, step), 1e-7};
}

rules::FusedScalars<float> scalars_of(const std::vector<double>& c) {
  rules::FusedScalars<float> s{};
  for (std::size_t j = 0; j < c.size(); ++j) s.c[j] = static_cast<float>(c[j]);
  s.weight_decay = 0.05f;
  s.lr = static_cast<float>(c[2]);
  return s;
}

// Device `device`'s run; true when the weights and slots are the host kernel's, bit for bit, and every
// update took kLambLaunches launches.
bool run(int device) {
  cudaSetDevice(device);
  cudaStream_t s;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  std::size_t total = 0;
  for (std::size_t n : kCounts) total += n;
  const std::size_t bytes = total * sizeof(float);
  std::vector<float> w(total), m(total, 0.0f), v(total, 0.0f);
  for (std::size_t i = 0; i < total; ++i) w[i] = value(i, 0);
  auto* dw = static_cast<float*>(sim::allocate(bytes, device));
  auto* dm = static_cast<float*>(sim::allocate(bytes, device));
  auto* dv = static_cast<float*>(sim::allocate(bytes, device));
  float* grads[2] = {static_cast<float*>(sim::allocate(bytes, device)),
                     static_cast<float*>(sim::allocate(bytes, device))};
  auto* squares = static_cast<float*>(sim::allocate(bytes, device));
  auto* nonfinite = static_cast<int*>(sim::allocate(sizeof(int), device));
  auto* device_scalars = static_cast<float*>(sim::allocate(8 * sizeof(float), device));
  std::memcpy(dw, w.data(), bytes);
  std::memset(dm, 0, bytes);
  std::memset(dv, 0, bytes);
  std::vector<FusedVariable> vars;
  std::vector<rules::FusedEntry<float>> reference;
  std::vector<float> g(total), sq(total);
  std::size_t at = 0;
  for (std::size_t k = 0; k < kCounts.size(); ++k) {
    vars.push_back({dw + at, {dm + at, dv + at, nullptr}, kCounts[k], k % 2 == 0});
    reference.push_back({w.data() + at, g.data() + at, {m.data() + at, v.data() + at, nullptr}, kCounts[k],
                         k % 2 == 0});
    at += kCounts[k];
  }
  FusedUpdateTable table(device, DType::kFloat32, vars);
  bool launches_right = true;
  for (int step = 1; step <= 4; ++step) {
    const std::vector<double> c = coefficients(step);
    const bool sparse = step == 2, from_device = step == 3;
    std::vector<float> host_g(total), host_sq(total);
    for (std::size_t i = 0; i < total; ++i) {
      const float a = value(i, step + 2), b = i % 3 ? value(i, step + 7) : 0.0f;
      host_g[i] = a + b;
      host_sq[i] = a * a + b * b;
    }
    float* into = grads[step % 2];  // new addresses: the table follows
    std::vector<float> host_scalars(c.begin(), c.end());
    host_scalars.push_back(0.05f);
    host_scalars.push_back(static_cast<float>(c[2]));
    sim::enqueue(s, [=] {
      std::memcpy(into, host_g.data(), bytes);
      std::memcpy(squares, host_sq.data(), bytes);
      std::memcpy(device_scalars, host_scalars.data(), host_scalars.size() * sizeof(float));
    });
    const long before = sim::counters().launches[device];
    if (from_device) {
      table.apply_from_device(rules::Rule::kLamb, into, device_scalars, static_cast<int>(c.size()), s);
    } else {
      table.apply(rules::Rule::kLamb, into, c, 0.05, c[2], s, {}, sparse ? squares : nullptr);
    }
    launches_right = launches_right && sim::counters().launches[device] - before == kLambLaunches;
    g = host_g;
    sq = host_sq;
    for (std::size_t k = 0, off = 0; k < reference.size(); off += kCounts[k], ++k)
      reference[k].squares = sparse ? sq.data() + off : nullptr;
    host::fused_update<float>(rules::Rule::kLamb, reference.data(), reference.size(), scalars_of(c));
  }
  // A step whose gate is shut (a non-finite gradient): no phase writes anything.
  sim::enqueue(s, [=] { *nonfinite = 1; });
  table.apply(rules::Rule::kLamb, grads[0], coefficients(5), 0.05, 0.01, s, LossScaleGate{nonfinite, nullptr});
  cudaStreamSynchronize(s);
  const bool same = std::memcmp(dw, w.data(), bytes) == 0 && std::memcmp(dm, m.data(), bytes) == 0 &&
                    std::memcmp(dv, v.data(), bytes) == 0;
  cudaStreamDestroy(s);
  return same && launches_right;
}

}  // namespace

int main() {
  for (unsigned seed = 0; seed < 6; ++seed) sim_check::expect_right_on_two_devices(seed, run);
  std::printf("Lamb's fused update on the simulated runtime: %d failures\n", failures);
  return failures ? 1 : 0;
}
