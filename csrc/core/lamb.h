// Keras' Lamb on a fused update table, shared by the host kernel
// (csrc/host/fused_update.cc), the CUDA kernels (csrc/cuda/fused_update.cu)
// and the simulated runtime, which runs the kernels' bodies: every operation
// in T and rounded on its own, both norms added up in core/variable_sums.h's
// order, so all of them give rules.py's lamb (the reference) bit for bit.
//
// Per variable: weight decay first (Keras decays, then takes the norm of the
// decayed weight), Adam's moments, the step
//   update = (m / (1 - beta_1^t)) / (sqrt(v / (1 - beta_2^t)) + epsilon),
// the trust ratio |w| / |update| (1 unless both norms are > 0), then
// w -= (ratio * lr) * update. The norms need the whole variable before any
// element may move, so a GPU runs four launches per table, whatever the
// number of variables, each reading only what earlier launches wrote (no
// block-level synchronisation, which the simulator cannot run):
//   lanes   (entry, lane) threads: decay, moments, and the lane sums of w*w
//           and update*update
//   groups  (entry, group) threads: the group sums of those lanes
//   ratios  (entry) threads: the totals (<= 128 groups) and the trust ratio
//   apply   (entry, element) threads: the update recomputed from m and v (it
//           depends on nothing else), w -= (ratio * lr) * update
// Computing the ratio inside the apply would cost every thread of a large
// variable a walk over its 2 x 128 group sums, more than the launch it saves.
//
// c: 1-beta_1, 1-beta_2, lr, 1-beta_1^t, 1-beta_2^t, epsilon (slots: momentum, velocity).
#pragma once

#include <cmath>
#include <cstddef>

#include "core/optimizer_rules.h"
#include "core/variable_sums.h"

namespace mirrored::rules {

constexpr int kLambCoefficients = 6;

// Adam's moments on one element; returns its update (the step before the trust ratio).
template <typename T>
MIRRORED_HD inline T lamb_moments(T g, T gg, T& m, T& v, const T* c) {
  m = m + (g - m) * c[0];
  v = v + (gg - v) * c[1];
  return (m / c[3]) / (sqrt(v / c[4]) + c[5]);
}

// The update again from the moments lamb_moments left (the apply's, which keeps no copy of it).
template <typename T>
MIRRORED_HD inline T lamb_update(T m, T v, const T* c) {
  return (m / c[3]) / (sqrt(v / c[4]) + c[5]);
}

// Keras' trust ratio from the two sums of squares: |w| / |update| when both norms are > 0 (a NaN norm is
// not), else 1.
template <typename T>
MIRRORED_HD inline T lamb_ratio(T w_squares, T update_squares) {
  const T w_norm = sqrt(w_squares), u_norm = sqrt(update_squares);
  return w_norm > T(0) && u_norm > T(0) ? w_norm / u_norm : T(1);
}

// The apply on one element: w - update * (ratio * lr).
template <typename T>
MIRRORED_HD inline T lamb_applied(T w, T m, T v, T ratio_lr, const T* c) {
  return w - lamb_update(m, v, c) * ratio_lr;
}

// Where an entry's sums sit in a table's scratch (the entries' back to back, in table order).
struct LambAt {
  std::size_t lane, group;  // the entry's first lane and first group among all entries'
};

// The scratch of a table whose entries have `lanes` lanes and `groups` groups in all (sum_lanes and
// sum_groups of each entry's count, added up): the lane sums of w*w at [0, lanes) and of update*update at
// [lanes, 2 lanes), the group sums likewise at 2 lanes (w*w) and 2 lanes + groups (update*update), then
// one ratio per entry.
template <typename T>
struct LambSums {
  T* data;
  std::size_t lanes, groups;
  MIRRORED_HD T* lane_w() const { return data; }
  MIRRORED_HD T* lane_u() const { return data + lanes; }
  MIRRORED_HD T* group_w() const { return data + 2 * lanes; }
  MIRRORED_HD T* group_u() const { return data + 2 * lanes + groups; }
  MIRRORED_HD T* ratio() const { return data + 2 * lanes + 2 * groups; }
};

// T's a table of `entries` entries with `lanes` lanes and `groups` groups in all needs as its scratch.
inline std::size_t lamb_scratch_count(std::size_t entries, std::size_t lanes, std::size_t groups) {
  return 2 * lanes + 2 * groups + entries;
}

// Calls f(k, j, at) for item j of entry k for every item whose place among all entries' items (each
// entry's `items(count)` back to back, in table order) is tid, tid + stride, ...: a grid-stride walk over
// the whole table, so many small variables fill the grid as one large one does. `at`: the entry's sums.
template <typename T, typename Items, typename F>
MIRRORED_HD inline void lamb_walk(const FusedEntry<T>* table, int entries, std::size_t tid, std::size_t stride,
                                  const Items& items, const F& f) {
  std::size_t first = 0;  // the entry's first item among all entries'
  LambAt at{0, 0};
  for (int k = 0; k < entries; ++k) {
    const std::size_t count = table[k].count, n = items(count);
    for (std::size_t j = tid >= first ? tid - first : (stride - (first - tid) % stride) % stride; j < n; j += stride)
      f(k, j, at);
    first += n;
    const std::size_t lanes = sum_lanes(count);
    at.lane += lanes;
    at.group += sum_groups(lanes);
  }
}

// Element i of entry e in the lanes phase: weight decay (stored), the moments (stored), and the two
// squares its lane adds up.
template <typename T>
MIRRORED_HD inline void lamb_element(const FusedEntry<T>& e, const FusedScalars<T>& s, std::size_t i, T& ww,
                                     T& uu) {
  const T w = e.decay ? decayed(e.weight[i], s.weight_decay, s.lr) : e.weight[i];
  const T g = s.unscale ? e.grad[i] / s.loss_scale : e.grad[i];
  // (A loss-scaled step has no squares: the gate takes dense gradients only.)
  const T gg = e.squares != nullptr ? e.squares[i] : g * g;
  const T u = lamb_moments(g, gg, e.slots[0][i], e.slots[1][i], s.c);
  e.weight[i] = w;
  ww = w * w;
  uu = u * u;
}

// The lanes phase, thread `tid` of `stride`: lane p of an entry adds elements p, p + lanes, ... in turn
// (variable_sums.h's lane_sum).
template <typename T>
MIRRORED_HD inline void lamb_lanes(const FusedEntry<T>* table, int entries, const FusedScalars<T>& s,
                                   const LambSums<T>& sums, std::size_t tid, std::size_t stride) {
  lamb_walk(table, entries, tid, stride, [](std::size_t n) { return sum_lanes(n); },
            [&](int k, std::size_t p, LambAt at) {
              const FusedEntry<T>& e = table[k];
              const std::size_t lanes = sum_lanes(e.count);
              T sw, su;
              lamb_element(e, s, p, sw, su);
              for (std::size_t i = p + lanes; i < e.count; i += lanes) {
                T ww, uu;
                lamb_element(e, s, i, ww, uu);
                sw = sw + ww;
                su = su + uu;
              }
              sums.lane_w()[at.lane + p] = sw;
              sums.lane_u()[at.lane + p] = su;
            });
}

// The groups phase: group g of an entry's lanes, for both sums.
template <typename T>
MIRRORED_HD inline void lamb_groups(const FusedEntry<T>* table, int entries, const LambSums<T>& sums,
                                    std::size_t tid, std::size_t stride) {
  lamb_walk(table, entries, tid, stride, [](std::size_t n) { return sum_groups(sum_lanes(n)); },
            [&](int k, std::size_t g, LambAt at) {
              const std::size_t lanes = sum_lanes(table[k].count);
              sums.group_w()[at.group + g] = group_sum(sums.lane_w() + at.lane, lanes, g);
              sums.group_u()[at.group + g] = group_sum(sums.lane_u() + at.lane, lanes, g);
            });
}

// The ratios phase: entry k's totals, its groups in order, and its trust ratio.
template <typename T>
MIRRORED_HD inline void lamb_ratios(const FusedEntry<T>* table, int entries, const LambSums<T>& sums,
                                    std::size_t tid, std::size_t stride) {
  lamb_walk(table, entries, tid, stride, [](std::size_t) { return std::size_t(1); },
            [&](int k, std::size_t, LambAt at) {
              const std::size_t groups = sum_groups(sum_lanes(table[k].count));
              sums.ratio()[k] = lamb_ratio(total_sum(sums.group_w() + at.group, groups),
                                           total_sum(sums.group_u() + at.group, groups));
            });
}

// The apply phase: element i of entry k moves by its update times (ratio * lr).
template <typename T>
MIRRORED_HD inline void lamb_apply(const FusedEntry<T>* table, int entries, const FusedScalars<T>& s,
                                   const LambSums<T>& sums, std::size_t tid, std::size_t stride) {
  lamb_walk(table, entries, tid, stride, [](std::size_t n) { return n; }, [&](int k, std::size_t i, LambAt) {
    const FusedEntry<T>& e = table[k];
    e.weight[i] = lamb_applied(e.weight[i], e.slots[0][i], e.slots[1][i], sums.ratio()[k] * s.c[2], s.c);
  });
}

}  // namespace mirrored::rules
