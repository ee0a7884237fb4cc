// Keras' Adafactor over a table of variables (FusedEntry, shape: its FactoredShape; slots r, c, v), in the
// phases a GPU runs as separate launches, each reading only what earlier phases wrote: the host kernel
// (csrc/host/fused_adafactor.cc), the CUDA kernels (csrc/cuda/fused_adafactor.cu) and the simulator run these
// bodies or the same orders, so every copy of a variable gets rules.py's adafactor bits.
//
// The orders: rms(x) = sqrt(sum / n) with the sum in core/variable_sums.h's order; each mean (a row's and a
// column's of g*g + epsilon_1, and r's over its last axis) a sum in index order, then divided by the count.
// With B x R x C a factored variable (B the leading dims' product):
//   1. lanes of decayed(w)^2 (w decayed in place), and v = v*beta + (g*g + eps1)*(1-beta) for a plain
//      variable; one thread per row: r; one thread per column: c
//   2. the w lanes' groups; one thread per batch: mean(r)
//   3. v = (r / mean(r)) * c (factored), lanes of u^2 with u = g / sqrt(v); per variable alpha from the
//      w groups' total
//   4. the u lanes' groups
//   5. per variable, the clipping denominator max(1, rms(u) / clip_threshold) from the u groups' total
//   6. w -= (u / denominator) * alpha, element by element
//
// Scratch per variable, in table order (adafactor_scratch_count T's each): its lanes, its groups, B means
// of r (factored), then alpha and the denominator.
#pragma once

#include <cstddef>

#include "core/optimizer_rules.h"
#include "core/variable_sums.h"

namespace mirrored::rules {

// c: rho_t, epsilon_2, epsilon_1, beta_2_t, 1-beta_2_t, clip_threshold (rules.py's adafactor)
enum AdafactorCoefficient { kRho = 0, kEpsilon2, kEpsilon1, kBeta2, kOneMinusBeta2, kClipThreshold };

constexpr int kAdafactorPhases = 6;

// The scratch T's of a variable of `count` elements.
MIRRORED_HD inline std::size_t adafactor_scratch_count(std::size_t count, const FactoredShape& f) {
  const std::size_t lanes = sum_lanes(count);
  return lanes + sum_groups(lanes) + (f.factored ? f.batches : 0) + 2;
}

// The most work items a phase has for the variable (its threads: elements, rows or columns).
inline std::size_t adafactor_work(std::size_t count, const FactoredShape& f) {
  std::size_t most = count;
  if (f.factored) {
    if (f.batches * f.rows > most) most = f.batches * f.rows;
    if (f.batches * f.cols > most) most = f.batches * f.cols;
  }
  return most;
}

// Element i of the variable's gradient, unscaled by a loss-scaled step (as update_element), and its regulated
// square (g*g or the squares given, + epsilon_1).
template <typename T>
MIRRORED_HD inline T adafactor_grad(const FusedEntry<T>& e, const FusedScalars<T>& s, std::size_t i) {
  return s.unscale ? e.grad[i] / s.loss_scale : e.grad[i];
}

template <typename T>
MIRRORED_HD inline T adafactor_regulated(const FusedEntry<T>& e, const FusedScalars<T>& s, std::size_t i) {
  if (e.squares != nullptr) return e.squares[i] + s.c[kEpsilon1];
  const T g = adafactor_grad(e, s, i);
  return g * g + s.c[kEpsilon1];
}

// term(0) + term(1) + ... + term(n - 1), added in that order (0 for n = 0).
template <typename T, typename Term>
MIRRORED_HD inline T sequential_sum(const Term& term, std::size_t n) {
  T s = n > 0 ? term(0) : T(0);
  for (std::size_t k = 1; k < n; ++k) s = s + term(k);
  return s;
}

// The moving average of a row's or a column's mean of the regulated squares (r, c).
template <typename T>
MIRRORED_HD inline T adafactor_moment(T moment, T sum, std::size_t count, const T* c) {
  return moment * c[kBeta2] + (sum / static_cast<T>(count)) * c[kOneMinusBeta2];
}

// The velocity of element i of a factored variable: (r / mean(r)) * c.
template <typename T>
MIRRORED_HD inline T adafactor_factored_velocity(const FusedEntry<T>& e, const T* means, std::size_t i) {
  const FactoredShape& f = e.shape;
  const std::size_t row = i / f.cols, b = row / f.rows;  // (count > 0: cols and rows are too)
  return (e.slots[0][row] / means[b]) * e.slots[1][b * f.cols + i % f.cols];
}

// Walks the table for one phase: calls body(e, scratch of e, k) for each entry, its scratch found by adding up
// the counts before it (each thread walks every entry anyway).
template <typename T, typename Body>
MIRRORED_HD inline void adafactor_walk(const FusedEntry<T>* table, int entries, T* scratch, const Body& body) {
  for (int k = 0; k < entries; ++k) {
    body(table[k], scratch, k);
    scratch += adafactor_scratch_count(table[k].count, table[k].shape);
  }
}

// Phase `phase` (0 to kAdafactorPhases - 1) of the table for thread `tid` of `stride`.
template <typename T>
MIRRORED_HD inline void adafactor_phase(int phase, const FusedEntry<T>* table, int entries, T* scratch,
                                        const FusedScalars<T>& s, std::size_t tid, std::size_t stride) {
  const T* c = s.c;
  adafactor_walk(table, entries, scratch, [&](const FusedEntry<T>& e, T* mine, int k) {
    const std::size_t n = e.count, lanes = sum_lanes(n), groups = sum_groups(lanes);
    const FactoredShape& f = e.shape;
    T* lane = mine;
    T* group = mine + lanes;
    T* means = group + groups;
    T* scalars = means + (f.factored ? f.batches : 0);  // alpha, the denominator
    const bool owner = tid == static_cast<std::size_t>(k) % stride;  // the thread of the variable's scalars
    switch (phase) {
      case 0: {
        for (std::size_t p = tid; p < lanes; p += stride) {
          lane[p] = lane_sum<T>([&](std::size_t i) {
            const T w = e.decay ? decayed(e.weight[i], s.weight_decay, s.lr) : e.weight[i];
            if (e.decay) e.weight[i] = w;
            if (!f.factored)
              e.slots[2][i] = e.slots[2][i] * c[kBeta2] + adafactor_regulated(e, s, i) * c[kOneMinusBeta2];
            return w * w;
          }, n, lanes, p);
        }
        if (!f.factored) return;
        for (std::size_t q = tid; q < f.batches * f.rows; q += stride) {
          const std::size_t first = q * f.cols;
          const T sum = sequential_sum<T>([&](std::size_t j) { return adafactor_regulated(e, s, first + j); }, f.cols);
          e.slots[0][q] = adafactor_moment(e.slots[0][q], sum, f.cols, c);
        }
        for (std::size_t q = tid; q < f.batches * f.cols; q += stride) {
          const std::size_t first = (q / f.cols) * f.rows * f.cols + q % f.cols;
          const T sum = sequential_sum<T>(
              [&](std::size_t i) { return adafactor_regulated(e, s, first + i * f.cols); }, f.rows);
          e.slots[1][q] = adafactor_moment(e.slots[1][q], sum, f.rows, c);
        }
        return;
      }
      case 1:
      case 3:
        for (std::size_t j = tid; j < groups; j += stride) group[j] = group_sum(lane, lanes, j);
        if (phase == 1 && f.factored) {
          for (std::size_t b = tid; b < f.batches; b += stride) {
            const T* r = e.slots[0] + b * f.rows;
            means[b] = sequential_sum<T>([&](std::size_t i) { return r[i]; }, f.rows) / static_cast<T>(f.rows);
          }
        }
        return;
      case 2: {
        for (std::size_t p = tid; p < lanes; p += stride) {
          lane[p] = lane_sum<T>([&](std::size_t i) {
            if (f.factored) e.slots[2][i] = adafactor_factored_velocity(e, means, i);
            const T u = adafactor_grad(e, s, i) / sqrt(e.slots[2][i]);
            return u * u;
          }, n, lanes, p);
        }
        if (owner)
          scalars[0] = maximum(c[kEpsilon2], T(sqrt(total_sum(group, groups) / static_cast<T>(n)))) * c[kRho];
        return;
      }
      case 4:
        if (owner)
          scalars[1] = maximum(T(1), T(sqrt(total_sum(group, groups) / static_cast<T>(n))) / c[kClipThreshold]);
        return;
      case 5: {
        const T alpha = scalars[0], denominator = scalars[1];
        for (std::size_t i = tid; i < n; i += stride) {
          const T u = adafactor_grad(e, s, i) / sqrt(e.slots[2][i]);
          e.weight[i] = e.weight[i] - (u / denominator) * alpha;
        }
        return;
      }
    }
  });
}

}  // namespace mirrored::rules
