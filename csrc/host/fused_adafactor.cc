// Adafactor on the host: core/adafactor_rule.h's phases with the same orders, each variable in turn and each
// phase as loops over contiguous memory (the row, column and RMS sums in the kernels' orders, the rest
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

// Buffers of one call, grown to the largest variable and reused (the loops below run over them, contiguous and
// free of branches, so they vectorise).
template <typename T>
struct Scratch {
  std::vector<T> lanes, grad, regulated, u, row_sums, col_sums;
};

template <typename T>
T* sized(std::vector<T>& v, std::size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}

// The sums of `rows` rows of `cols` contiguous T's, each in index order (sequential_sum's), eight rows at a time:
// eight independent chains of additions, whose latencies overlap.
template <typename T>
void row_sums(const T* x, std::size_t rows, std::size_t cols, T* out) {
  constexpr std::size_t kChains = 8;
  std::size_t i = 0;
  for (; cols > 0 && i + kChains <= rows; i += kChains) {
    T s[kChains];
    for (std::size_t q = 0; q < kChains; ++q) s[q] = x[(i + q) * cols];
    for (std::size_t j = 1; j < cols; ++j)
      for (std::size_t q = 0; q < kChains; ++q) s[q] = s[q] + x[(i + q) * cols + j];
    for (std::size_t q = 0; q < kChains; ++q) out[i + q] = s[q];
  }
  for (; i < rows; ++i) out[i] = sequential_sum<T>([&](std::size_t j) { return x[i * cols + j]; }, cols);
}

template <typename T>
void update_variable(const FusedEntry<T>& e, const FusedScalars<T>& s, Scratch<T>& scratch) {
  const T* c = s.c;
  const std::size_t n = e.count;
  const FactoredShape& f = e.shape;
  T* const w = e.weight;
  T* const v = e.slots[2];
  T* const lanes = sized(scratch.lanes, sum_lanes(n));
  const T* g = e.grad;
  if (s.unscale) {  // (a loss-scaled step's gradients, divided first: the GPU's adafactor_grad)
    T* unscaled = sized(scratch.grad, n);
    for (std::size_t i = 0; i < n; ++i) unscaled[i] = g[i] / s.loss_scale;
    g = unscaled;
  }
  if (e.decay)
    for (std::size_t i = 0; i < n; ++i) w[i] = decayed(w[i], s.weight_decay, s.lr);
  const T w_sum = variable_sum<T>([&](std::size_t i) { return w[i] * w[i]; }, n, lanes);
  const T alpha = maximum(c[kEpsilon2], T(std::sqrt(w_sum / static_cast<T>(n)))) * c[kRho];
  T* const regulated = sized(scratch.regulated, n);
  if (e.squares != nullptr) {
    for (std::size_t i = 0; i < n; ++i) regulated[i] = e.squares[i] + c[kEpsilon1];
  } else {
    for (std::size_t i = 0; i < n; ++i) regulated[i] = g[i] * g[i] + c[kEpsilon1];
  }
  if (f.factored) {
    T* const r = e.slots[0];
    T* const col = e.slots[1];
    T* const rows = sized(scratch.row_sums, f.batches * f.rows);
    row_sums(regulated, f.batches * f.rows, f.cols, rows);
    for (std::size_t q = 0; q < f.batches * f.rows; ++q) r[q] = adafactor_moment(r[q], rows[q], f.cols, c);
    T* const sums = sized(scratch.col_sums, f.cols);  // one batch's column sums, a row at a time
    for (std::size_t b = 0; b < f.batches; ++b) {
      const T* x = regulated + b * f.rows * f.cols;
      for (std::size_t j = 0; j < f.cols; ++j) sums[j] = f.rows > 0 ? x[j] : T(0);
      for (std::size_t i = 1; i < f.rows; ++i)
        for (std::size_t j = 0; j < f.cols; ++j) sums[j] = sums[j] + x[i * f.cols + j];
      T* const cb = col + b * f.cols;
      for (std::size_t j = 0; j < f.cols; ++j) cb[j] = adafactor_moment(cb[j], sums[j], f.rows, c);
      const T* rb = r + b * f.rows;
      const T mean = sequential_sum<T>([&](std::size_t i) { return rb[i]; }, f.rows) / static_cast<T>(f.rows);
      for (std::size_t i = 0; i < f.rows; ++i) {
        T* const vi = v + (b * f.rows + i) * f.cols;
        const T ratio = rb[i] / mean;
        for (std::size_t j = 0; j < f.cols; ++j) vi[j] = ratio * cb[j];
      }
    }
  } else {
    for (std::size_t i = 0; i < n; ++i) v[i] = v[i] * c[kBeta2] + regulated[i] * c[kOneMinusBeta2];
  }
  T* const u = sized(scratch.u, n);
  for (std::size_t i = 0; i < n; ++i) u[i] = g[i] / std::sqrt(v[i]);
  const T u_sum = variable_sum<T>([&](std::size_t i) { return u[i] * u[i]; }, n, lanes);
  const T denominator = maximum(T(1), T(std::sqrt(u_sum / static_cast<T>(n))) / c[kClipThreshold]);
  for (std::size_t i = 0; i < n; ++i) w[i] = w[i] - (u[i] / denominator) * alpha;
}

}  // namespace

template <typename T>
void fused_adafactor(const FusedEntry<T>* entries, std::size_t n, const T* const* others, int more,
                     const FusedScalars<T>& s) {
  constexpr DType dtype = std::is_same_v<T, float> ? DType::kFloat32 : DType::kFloat64;
  Scratch<T> scratch;
  std::vector<T> sum;
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
