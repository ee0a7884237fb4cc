// Adafactor on the host: core/adafactor_rule.h's phases with the same orders, each variable in turn and each
// phase as a loop over contiguous memory (the row, column and RMS sums in the kernels' orders, the rest
// element-wise), so the bits are the GPU's and rules.py's.
#include "host/fused_adafactor.h"

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "core/adafactor_rule.h"
#include "host/reduce_kernels.h"

namespace mirrored::host {

namespace {

using namespace rules;

template <typename T>
void update_variable(const FusedEntry<T>& e, const FusedScalars<T>& s, std::vector<T>& scratch) {
  const T* c = s.c;
  const std::size_t n = e.count;
  const FactoredShape& f = e.shape;
  T* const w = e.weight;
  T* const v = e.slots[2];
  scratch.resize(std::max(sum_lanes(n), f.factored ? f.cols : 0));
  if (e.decay)
    for (std::size_t i = 0; i < n; ++i) w[i] = decayed(w[i], s.weight_decay, s.lr);
  const T w_sum = variable_sum<T>([&](std::size_t i) { return w[i] * w[i]; }, n, scratch.data());
  const T alpha = maximum(c[kEpsilon2], T(std::sqrt(w_sum / static_cast<T>(n)))) * c[kRho];
  const auto regulated = [&](std::size_t i) { return adafactor_regulated(e, s, i); };
  if (f.factored) {
    T* const r = e.slots[0];
    T* const col = e.slots[1];
    T* const sums = scratch.data();  // one batch's column sums, a row at a time (each column in row order)
    for (std::size_t b = 0; b < f.batches; ++b) {
      const std::size_t first = b * f.rows * f.cols;
      for (std::size_t i = 0; i < f.rows; ++i) {
        const std::size_t at = first + i * f.cols;
        const T row = sequential_sum<T>([&](std::size_t j) { return regulated(at + j); }, f.cols);
        r[b * f.rows + i] = adafactor_moment(r[b * f.rows + i], row, f.cols, c);
        for (std::size_t j = 0; j < f.cols; ++j) sums[j] = i == 0 ? regulated(at + j) : sums[j] + regulated(at + j);
      }
      for (std::size_t j = 0; j < f.cols; ++j)
        col[b * f.cols + j] = adafactor_moment(col[b * f.cols + j], f.rows > 0 ? sums[j] : T(0), f.rows, c);
      const T* rb = r + b * f.rows;
      const T mean = sequential_sum<T>([&](std::size_t i) { return rb[i]; }, f.rows) / static_cast<T>(f.rows);
      for (std::size_t i = 0; i < f.rows; ++i)
        for (std::size_t j = 0; j < f.cols; ++j) v[first + i * f.cols + j] = (rb[i] / mean) * col[b * f.cols + j];
    }
  } else {
    for (std::size_t i = 0; i < n; ++i) v[i] = v[i] * c[kBeta2] + regulated(i) * c[kOneMinusBeta2];
  }
  const auto u = [&](std::size_t i) { return adafactor_grad(e, s, i) / std::sqrt(v[i]); };
  const T u_sum = variable_sum<T>([&](std::size_t i) { return u(i) * u(i); }, n, scratch.data());
  const T denominator = maximum(T(1), T(std::sqrt(u_sum / static_cast<T>(n))) / c[kClipThreshold]);
  for (std::size_t i = 0; i < n; ++i) w[i] = w[i] - (u(i) / denominator) * alpha;
}

}  // namespace

template <typename T>
void fused_adafactor(const FusedEntry<T>* entries, std::size_t n, const T* const* others, int more,
                     const FusedScalars<T>& s) {
  constexpr DType dtype = std::is_same_v<T, float> ? DType::kFloat32 : DType::kFloat64;
  std::vector<T> scratch, sum;
  for (std::size_t k = 0; k < n; ++k) {
    if (others == nullptr) {
      update_variable(entries[k], s, scratch);
      continue;
    }
    // The gradients summed first, ((g0 + g1) + g2) + ..., the host all-reduce's order (fused_update_summed):
    // every phase reads the gradient again.
    FusedEntry<T> e = entries[k];
    const T* const* mine = others + k * more;
    sum.resize(e.count);
    const ReduceKernels& kernels = reduce_kernels();
    combine(kernels, dtype, ReduceOp::kSum, sum.data(), e.grad, mine[0], e.count);
    for (int r = 1; r < more; ++r) combine(kernels, dtype, ReduceOp::kSum, sum.data(), sum.data(), mine[r], e.count);
    e.grad = sum.data();
    update_variable(e, s, scratch);
  }
}

template void fused_adafactor<float>(const FusedEntry<float>*, std::size_t, const float* const*, int,
                                     const FusedScalars<float>&);
template void fused_adafactor<double>(const FusedEntry<double>*, std::size_t, const double* const*, int,
                                      const FusedScalars<double>&);

}  // namespace mirrored::host
