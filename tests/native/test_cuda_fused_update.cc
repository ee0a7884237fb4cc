// The fused optimizer update's CUDA kernel (csrc/cuda/fused_update.cu, through
// FusedUpdateTable) on a real GPU, against the host kernel bit for bit: every
// rule and variant, float32 and float64, sizes with every tail and beyond one
// grid, weight decay on and off, three steps with the packed gradients moving
// (the table is uploaded again). Without a GPU it reports itself skipped
// (exit 77); built as cuda_fused_update_sim_test it runs the same checks on the
// simulated runtime, where the kernels' bodies run as host code.
#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstring>
#include <limits>
#include <vector>

#include "check.h"
#include "cuda/device.h"
#ifdef MIRRORED_CUDA_SIM
#include "cuda/sim/sim_runtime.h"
#endif
#include "cuda/fused_update.h"
#include "host/fused_update.h"

using namespace mirrored;

namespace {

constexpr int kSkipped = 77;

struct Case {
  rules::Rule rule;
  std::vector<double> c;
  int slots;
};

const std::vector<Case> kCases = {
    {rules::Rule::kSgd, {0.01}, 0},
    {rules::Rule::kSgdMomentum, {0.01, 0.9}, 1},
    {rules::Rule::kSgdNesterov, {0.01, 0.9}, 1},
    {rules::Rule::kAdam, {0.1, 0.001, 0.0031, 1e-7}, 2},
    {rules::Rule::kRmsprop, {0.01, 0.9, 0.1, 1e-7, 0.0, 0.0}, 1},
    {rules::Rule::kRmsprop, {0.01, 0.9, 0.1, 1e-7, 0.5, 0.0}, 2},
    {rules::Rule::kRmsprop, {0.01, 0.9, 0.1, 1e-7, 0.0, 1.0}, 2},
    {rules::Rule::kRmsprop, {0.01, 0.9, 0.1, 1e-7, 0.5, 1.0}, 3},
    {rules::Rule::kAdagrad, {0.1, 1e-7}, 1},
    {rules::Rule::kNadam, {0.001, 1e-7, 0.1, 0.001, 0.45, 0.8, 0.55, 0.6, 0.002}, 2},
    {rules::Rule::kAdamAmsgrad, {0.1, 0.001, 0.0031, 1e-7}, 3},
};
#ifdef MIRRORED_CUDA_SIM  // (the simulated runtime runs kernels as host loops, under the sanitizers too)
constexpr std::size_t kLargest = 70001;
#else
constexpr std::size_t kLargest = 3000017;
#endif
const std::vector<std::size_t> kSizes = {0, 1, 3, 7, 8, 9, 15, 16, 17, 31, 33, 64, 1000, 4099, kLargest};

#define CUDA_OK(call) CHECK((call) == cudaSuccess)

// `count` elements of device memory (one byte more: a zero count still gets a distinct buffer).
template <typename T>
T* device_buffer(std::size_t count) {
  void* p = nullptr;
  CUDA_OK(cudaMalloc(&p, count * sizeof(T) + 1));
  return static_cast<T*>(p);
}

// Deterministic values of every sign and magnitude; slots positive (a velocity above 1).
template <typename T>
T value(std::size_t i, int which) {
  const unsigned h = static_cast<unsigned>(i * 2654435761u + which * 40503u);
  const T unit = static_cast<T>(h % 20011) / T(20011);
  return which == 0 ? unit * 2 - 1 : which == 1 ? (unit - T(0.5)) * 3 : T(which == 2 ? 1 : 0) + unit / 8;
}

// With `loss_scaled`, the steps of md.mixed_precision.LossScaleOptimizer on
// the GPU: the check over the packed gradients, the gated update dividing by
// a scale of 1000 (an inexact reciprocal), the scale's step; step 1 carries an
// inf in its last gradient and must write nothing, and halves the scale that
// step 2 divides by. The host kernel runs on gradients divided first by the
// scale of their step, and skips step 1.
constexpr float kLossScale = 1000.0f;

template <typename T>
void check_case(const Case& k, DType dtype, bool loss_scaled) {
  const int n = static_cast<int>(kSizes.size());
  std::size_t total = 0;
  for (std::size_t s : kSizes) total += s;
  // Host state, and the same on the GPU: weights then slots, each variable's own buffers.
  std::vector<std::vector<T>> w(n), g(n);
  std::vector<std::vector<std::vector<T>>> s(n);
  std::vector<T*> dw(n);
  std::vector<std::vector<T*>> ds(n);
  std::vector<cuda::FusedVariable> vars(n);
  for (int v = 0; v < n; ++v) {
    const std::size_t count = kSizes[v];
    w[v].resize(count);
    for (std::size_t i = 0; i < count; ++i) w[v][i] = value<T>(i + v, 0);
    dw[v] = device_buffer<T>(count);
    CUDA_OK(cudaMemcpy(dw[v], w[v].data(), count * sizeof(T), cudaMemcpyHostToDevice));
    vars[v] = {dw[v], {nullptr, nullptr, nullptr}, count, v % 3 == 0};
    for (int j = 0; j < k.slots; ++j) {
      s[v].emplace_back(count);
      for (std::size_t i = 0; i < count; ++i) s[v][j][i] = value<T>(i + v, 2 + (j > 0));
      T* p = device_buffer<T>(count);
      CUDA_OK(cudaMemcpy(p, s[v][j].data(), count * sizeof(T), cudaMemcpyHostToDevice));
      ds[v].push_back(p);
      vars[v].slots[j] = p;
    }
  }
  cuda::FusedUpdateTable table(0, dtype, vars);
  CHECK(table.total_count() == total);
  const double wd = static_cast<T>(0.004), lr = static_cast<T>(k.c[0]);
  std::vector<double> c;
  for (double x : k.c) c.push_back(static_cast<T>(x));
  rules::FusedScalars<T> scalars{};
  for (std::size_t j = 0; j < c.size(); ++j) scalars.c[j] = static_cast<T>(c[j]);
  scalars.weight_decay = static_cast<T>(wd);
  scalars.lr = static_cast<T>(lr);
  T* packed[2] = {nullptr, nullptr};
  for (T*& p : packed) p = device_buffer<T>(total);
  int* nonfinite = device_buffer<int>(1);
  float* scale = device_buffer<float>(1);
  long long* counters = device_buffer<long long>(2);  // the good-step counter, iterations
  const long long zeros[2] = {0, 0};
  CUDA_OK(cudaMemset(nonfinite, 0, sizeof(int)));
  CUDA_OK(cudaMemcpy(scale, &kLossScale, sizeof(float), cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(counters, zeros, sizeof(zeros), cudaMemcpyHostToDevice));
  float host_scale = kLossScale;  // the scale each step's gradients are divided by: halved by the skip
  for (int step = 0; step < 3; ++step) {
    const bool skipped = loss_scaled && step == 1;
    std::vector<T> host_packed(total);
    std::vector<rules::FusedEntry<T>> entries(n);
    std::size_t at = 0;
    for (int v = 0; v < n; ++v) {
      g[v].resize(kSizes[v]);
      for (std::size_t i = 0; i < kSizes[v]; ++i) {
        host_packed[at + i] = value<T>(i + v + step, 1);
        g[v][i] = loss_scaled ? host_packed[at + i] / static_cast<T>(host_scale) : host_packed[at + i];
      }
      entries[v] = {w[v].data(), g[v].data(), {nullptr, nullptr, nullptr}, kSizes[v], vars[v].decay};
      for (int j = 0; j < k.slots; ++j) entries[v].slots[j] = s[v][j].data();
      at += kSizes[v];
    }
    if (skipped) {
      host_packed[total - 1] = std::numeric_limits<T>::infinity();
      host_scale /= 2;  // (from the next step on)
    } else {
      host::fused_update<T>(k.rule, entries.data(), entries.size(), scalars);
    }
    T* grads = packed[step % 2];  // a new address every step: the table follows
    CUDA_OK(cudaMemcpy(grads, host_packed.data(), total * sizeof(T), cudaMemcpyHostToDevice));
    if (loss_scaled) {
      table.check_finite(grads, nonfinite, nullptr);
      table.apply(k.rule, grads, c, wd, lr, nullptr, cuda::LossScaleGate{nonfinite, scale});
      cuda::loss_scale_step(nonfinite, scale, counters, counters + 1, 2, true, nullptr);
    } else {
      table.apply(k.rule, grads, c, wd, lr, nullptr);
    }
  }
  CUDA_OK(cudaDeviceSynchronize());
  if (loss_scaled) {  // good, bad (halved, counted anew), good
    int flag = -1;
    float scale_after = 0;
    long long state[2] = {-1, -1};
    CUDA_OK(cudaMemcpy(&flag, nonfinite, sizeof(int), cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(&scale_after, scale, sizeof(float), cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(state, counters, sizeof(state), cudaMemcpyDeviceToHost));
    CHECK(flag == 0 && scale_after == kLossScale / 2 && state[0] == 1 && state[1] == 2);
  }
  CUDA_OK(cudaFree(nonfinite));
  CUDA_OK(cudaFree(scale));
  CUDA_OK(cudaFree(counters));
  for (int v = 0; v < n; ++v) {
    std::vector<T> back(kSizes[v]);
    CUDA_OK(cudaMemcpy(back.data(), dw[v], back.size() * sizeof(T), cudaMemcpyDeviceToHost));
    CHECK(back.empty() || std::memcmp(back.data(), w[v].data(), back.size() * sizeof(T)) == 0);
    for (int j = 0; j < k.slots; ++j) {
      CUDA_OK(cudaMemcpy(back.data(), ds[v][j], back.size() * sizeof(T), cudaMemcpyDeviceToHost));
      CHECK(back.empty() || std::memcmp(back.data(), s[v][j].data(), back.size() * sizeof(T)) == 0);
      CUDA_OK(cudaFree(ds[v][j]));
    }
    CUDA_OK(cudaFree(dw[v]));
  }
  for (T* p : packed) CUDA_OK(cudaFree(p));
}

TEST(gpu_kernel_equals_the_host_kernel_bit_for_bit) {
  for (const Case& k : kCases) {
    check_case<float>(k, DType::kFloat32, false);
    check_case<double>(k, DType::kFloat64, false);
  }
}

TEST(a_loss_scaled_gpu_step_unscales_skips_and_steps_the_scale_as_the_host) {
  for (const Case& k : kCases) {
    check_case<float>(k, DType::kFloat32, true);
    check_case<double>(k, DType::kFloat64, true);
  }
}

}  // namespace

int main() {
#ifdef MIRRORED_CUDA_SIM
  cuda::sim::reset(1, {}, 0);  // the kernels' bodies on the simulated runtime: the test's own logic, without a GPU
#endif
  if (cuda::device_count() == 0) {
    std::printf("skipped: no GPU\n");
    return kSkipped;
  }
  return check::run_all();
}
