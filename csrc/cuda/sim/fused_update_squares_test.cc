// A sparse step's fused update on the simulated runtime (cuda/fused_update.h):
// FusedUpdateTable::apply with packed squares (what Adam reads in place of
// grad * grad, an IndexedSlices gradient's rows squared one by one) over three
// steps whose gradients and squares move (the table is uploaded again) and a
// dense step between them (no squares: the kernel squares), against the host
// kernel bit for bit; the captured-table path; a squares buffer with a loss
// scale refused. On two devices from two threads at once (for ThreadSanitizer),
// in random kernel orders. Exit status 0 when all is right.
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "cuda/fused_update.h"
#include "cuda/sim/expect.h"
#include "cuda/sim/sim_replicas.h"
#include "cuda/sim/sim_runtime.h"
#include "host/fused_update.h"

using namespace mirrored;
using namespace mirrored::cuda;

namespace {

using sim_check::failures;

const std::vector<std::size_t> kCounts = {1, 3, 512, 0, 1000};
const std::vector<double> kAdam = {0.1, 0.001, 0.0031, 1e-7};

float value(std::size_t i, int which) { return static_cast<float>((i * 7 + which * 5) % 23) / 8.0f - 1.0f; }

// Device `device`'s run; true when the weights and slots are the host kernel's, bit for bit.
bool run(int device) {
  cudaSetDevice(device);
  cudaStream_t s;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  std::size_t total = 0;
  for (std::size_t n : kCounts) total += n;
  std::vector<float> w(total), m(total, 0.0f), v(total, 0.0f);
  for (std::size_t i = 0; i < total; ++i) w[i] = value(i, 0);
  auto* dw = static_cast<float*>(sim::allocate(total * sizeof(float), device));
  auto* dm = static_cast<float*>(sim::allocate(total * sizeof(float), device));
  auto* dv = static_cast<float*>(sim::allocate(total * sizeof(float), device));
  float* grads[2] = {static_cast<float*>(sim::allocate(total * sizeof(float), device)),
                     static_cast<float*>(sim::allocate(total * sizeof(float), device))};
  float* squares[2] = {static_cast<float*>(sim::allocate(total * sizeof(float), device)),
                       static_cast<float*>(sim::allocate(total * sizeof(float), device))};
  std::memcpy(dw, w.data(), total * sizeof(float));
  std::memset(dm, 0, total * sizeof(float));
  std::memset(dv, 0, total * sizeof(float));
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
  rules::FusedScalars<float> scalars{};
  for (std::size_t j = 0; j < kAdam.size(); ++j) scalars.c[j] = static_cast<float>(kAdam[j]);
  scalars.weight_decay = 0.004f, scalars.lr = 0.1f;
  for (int step = 0; step < 4; ++step) {
    const bool sparse = step != 2;
    std::vector<float> host_g(total), host_sq(total);
    for (std::size_t i = 0; i < total; ++i) {
      // Every third row untouched (0, 0), the others a "repeated row" whose squares exceed g * g.
      const float a = i % 3 ? value(i, step + 2) : 0.0f, b = i % 3 ? value(i, step + 7) : 0.0f;
      host_g[i] = a + b;
      host_sq[i] = a * a + b * b;
    }
    float *into = grads[step % 2], *into_sq = squares[step % 2];  // new addresses: the table follows
    sim::enqueue(s, [=] {
      std::memcpy(into, host_g.data(), total * sizeof(float));
      std::memcpy(into_sq, host_sq.data(), total * sizeof(float));
    });
    table.apply(rules::Rule::kAdam, into, kAdam, 0.004, 0.1, s, {}, sparse ? into_sq : nullptr);
    g = host_g;
    sq = host_sq;
    for (std::size_t k = 0, off = 0; k < reference.size(); off += kCounts[k], ++k)
      reference[k].squares = sparse ? sq.data() + off : nullptr;
    host::fused_update<float>(rules::Rule::kAdam, reference.data(), reference.size(), scalars);
  }
  cudaStreamSynchronize(s);
  bool same = std::memcmp(dw, w.data(), total * sizeof(float)) == 0 &&
              std::memcmp(dm, m.data(), total * sizeof(float)) == 0 &&
              std::memcmp(dv, v.data(), total * sizeof(float)) == 0;
  // The kernel would divide the gradients by the scale but not their squares: refused.
  bool refused = false;
  try {
    float* scale = static_cast<float*>(sim::allocate(sizeof(float), device));
    table.apply(rules::Rule::kAdam, grads[0], kAdam, 0.004, 0.1, s, LossScaleGate{nullptr, scale}, squares[0]);
  } catch (const std::invalid_argument&) {
    refused = true;
  }
  cudaStreamDestroy(s);
  return same && refused;
}

}  // namespace

int main() {
  for (unsigned seed = 0; seed < 8; ++seed) sim_check::expect_right_on_two_devices(seed, run);
  std::printf("sparse fused update (squares) on the simulated runtime: %d failures\n", failures);
  return failures ? 1 : 0;
}
