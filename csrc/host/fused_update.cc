#include "host/fused_update.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "core/lamb.h"
#include "core/optimizer_rules.h"
#include "core/variable_sums.h"
#include "host/fused_adafactor.h"
#include "host/reduce_kernels.h"

namespace mirrored::host {

namespace {

// One loop for every rule: the rule's functor (core/optimizer_rules.h) on each
// element, its slots loaded into locals and stored back. `Decay` and the
// functor are template arguments, so the loop carries no branch and
// vectorises. The buffers are __restrict parameters (the entries of a table
// never overlap, the caller's contract; a variable's own buffers are
// distinct) and the scalars a local copy, so the compiler needs no run-time
// alias checks (with three slots it would need more than it allows, and
// would not vectorise). `Squares`: the entry's squared gradient is read from
// `sq` (FusedEntry::squares), else made as g * g.
template <typename T, bool Decay, bool Squares = false, typename F>
void update_arrays(F rule, std::size_t count, T* __restrict w, const T* __restrict g, T* __restrict s0,
                   T* __restrict s1, T* __restrict s2, const FusedScalars<T> s, const T* __restrict sq = nullptr) {
  static_assert(F::kSlots <= kMaxSlots, "a rule has at most kMaxSlots slots");
  for (std::size_t i = 0; i < count; ++i) {
    T st[F::kSlots > 0 ? F::kSlots : 1];
    if constexpr (F::kSlots > 0) st[0] = s0[i];
    if constexpr (F::kSlots > 1) st[1] = s1[i];
    if constexpr (F::kSlots > 2) st[2] = s2[i];
    const T wi = Decay ? rules::decayed(w[i], s.weight_decay, s.lr) : w[i];
    const T gi = g[i];
    if constexpr (Squares) {
      w[i] = rule(wi, gi, sq[i], st, s.c);
    } else {
      w[i] = rule(wi, gi, gi * gi, st, s.c);
    }
    if constexpr (F::kSlots > 0) s0[i] = st[0];
    if constexpr (F::kSlots > 1) s1[i] = st[1];
    if constexpr (F::kSlots > 2) s2[i] = st[2];
  }
}

template <typename T, bool Decay, typename F>
void update_entry(F rule, const FusedEntry<T>& e, const FusedScalars<T>& s) {
  if (e.squares != nullptr) {
    update_arrays<T, Decay, true>(rule, e.count, e.weight, e.grad, e.slots[0], e.slots[1], e.slots[2], s,
                                  e.squares);
  } else {
    update_arrays<T, Decay>(rule, e.count, e.weight, e.grad, e.slots[0], e.slots[1], e.slots[2], s);
  }
}

// Summed gradients are made a block at a time, small enough to stay in L1 while the rule reads them.
constexpr std::size_t kSumBytes = 8 * 1024;

template <typename T>
T* at(T* p, std::size_t offset) {
  return p ? p + offset : nullptr;  // (a slot the rule does not have stays null)
}

// The entry's update with gradient g0 + g1 + ... (replica 0's is e.grad, replica r's others[r - 1]), summed
// by the host all-reduce's own kernels (this CPU's table), pair by pair in replica order as its direct fold.
template <typename T, bool Decay, typename F>
void update_entry_summed(F rule, const FusedEntry<T>& e, const T* const* others, int more, const FusedScalars<T>& s) {
  constexpr std::size_t block = kSumBytes / sizeof(T);
  constexpr DType dtype = std::is_same_v<T, float> ? DType::kFloat32 : DType::kFloat64;
  const ReduceKernels& kernels = reduce_kernels();
  alignas(64) T sum[block];
  for (std::size_t b = 0; b < e.count; b += block) {
    const std::size_t m = std::min(block, e.count - b);
    combine(kernels, dtype, ReduceOp::kSum, sum, e.grad + b, others[0] + b, m);
    for (int r = 1; r < more; ++r) combine(kernels, dtype, ReduceOp::kSum, sum, sum, others[r] + b, m);
    update_arrays<T, Decay>(rule, m, e.weight + b, sum, at(e.slots[0], b), at(e.slots[1], b), at(e.slots[2], b),
                            s);
  }
}

// others: null for the plain update, else `more` further gradients per entry (fused_update_summed).
template <typename T>
struct TableLoop {
  const FusedEntry<T>* entries;
  std::size_t n;
  const FusedScalars<T>& s;
  const T* const* others = nullptr;
  int more = 0;
  template <typename F>
  void operator()(F rule) const {
    for (std::size_t k = 0; k < n; ++k) {
      const bool decay = entries[k].decay;
      if (others != nullptr) {
        const T* const* mine = others + k * more;
        decay ? update_entry_summed<T, true>(rule, entries[k], mine, more, s)
              : update_entry_summed<T, false>(rule, entries[k], mine, more, s);
      } else {
        decay ? update_entry<T, true>(rule, entries[k], s) : update_entry<T, false>(rule, entries[k], s);
      }
    }
  }
};

// Lamb's first pass over `n` elements of one lane block (core/lamb.h): weight decay and the moments stored,
// the squares of the decayed weight and of the update added to lanes 0..n of `lane_w` and `lane_u` (or
// written there, `First`: the variable's first block). Contiguous elements and lanes: the loop vectorises.
template <typename T, bool Decay, bool Squares, bool First>
void lamb_block(std::size_t n, T* __restrict w, const T* __restrict g, T* __restrict m, T* __restrict v,
                const T* __restrict sq, T* __restrict lane_w, T* __restrict lane_u, const FusedScalars<T> s) {
  for (std::size_t p = 0; p < n; ++p) {
    const T wi = Decay ? rules::decayed(w[p], s.weight_decay, s.lr) : w[p];
    const T gi = g[p];
    T mi = m[p], vi = v[p];
    const T u = rules::lamb_moments(gi, Squares ? sq[p] : gi * gi, mi, vi, s.c);
    w[p] = wi;
    m[p] = mi;
    v[p] = vi;
    lane_w[p] = First ? wi * wi : lane_w[p] + wi * wi;
    lane_u[p] = First ? u * u : lane_u[p] + u * u;
  }
}

template <typename T, bool Decay, bool Squares>
void lamb_block(bool first, std::size_t n, T* w, const T* g, T* m, T* v, const T* sq, T* lane_w, T* lane_u,
                const FusedScalars<T>& s) {
  first ? lamb_block<T, Decay, Squares, true>(n, w, g, m, v, sq, lane_w, lane_u, s)
        : lamb_block<T, Decay, Squares, false>(n, w, g, m, v, sq, lane_w, lane_u, s);
}

// The second pass: w -= update * (ratio * lr), the update recomputed from the moments.
template <typename T>
void lamb_apply_entry(std::size_t n, T* __restrict w, const T* __restrict m, const T* __restrict v, T ratio_lr,
                      const FusedScalars<T> s) {
  for (std::size_t i = 0; i < n; ++i) w[i] = rules::lamb_applied(w[i], m[i], v[i], ratio_lr, s.c);
}

// The sum of `lanes` lane sums: groups of kSumGroup in lane order, then the groups in order (variable_sums.h).
template <typename T>
T lanes_total(const T* lane, std::size_t lanes) {
  T total = T(0);
  for (std::size_t g = 0; g < rules::sum_groups(lanes); ++g) {
    const T s = rules::group_sum(lane, lanes, g);
    total = g == 0 ? s : total + s;
  }
  return total;
}

// Lamb on one entry, its lanes' sums in `lane` (2 * kSumLanes T's). With `others` (`more` further replicas'
// gradients), the gradient is summed a kSumBytes block at a time, as update_entry_summed sums it.
template <typename T, bool Decay>
void lamb_entry(const FusedEntry<T>& e, const T* const* others, int more, const FusedScalars<T>& s, T* lane) {
  const std::size_t lanes = rules::sum_lanes(e.count);
  T* lane_w = lane;
  T* lane_u = lane + rules::kSumLanes;
  T* m = e.slots[0];
  T* v = e.slots[1];
  for (std::size_t b = 0; b < e.count; b += lanes) {
    const std::size_t n = std::min(lanes, e.count - b);
    if (others == nullptr) {
      if (e.squares != nullptr) {
        lamb_block<T, Decay, true>(b == 0, n, e.weight + b, e.grad + b, m + b, v + b, e.squares + b, lane_w,
                                   lane_u, s);
      } else {
        lamb_block<T, Decay, false>(b == 0, n, e.weight + b, e.grad + b, m + b, v + b, nullptr, lane_w, lane_u,
                                    s);
      }
      continue;
    }
    constexpr std::size_t block = kSumBytes / sizeof(T);
    constexpr DType dtype = std::is_same_v<T, float> ? DType::kFloat32 : DType::kFloat64;
    const ReduceKernels& kernels = reduce_kernels();
    alignas(64) T sum[block];
    for (std::size_t p = 0; p < n; p += block) {
      const std::size_t q = std::min(block, n - p), i = b + p;
      combine(kernels, dtype, ReduceOp::kSum, sum, e.grad + i, others[0] + i, q);
      for (int r = 1; r < more; ++r) combine(kernels, dtype, ReduceOp::kSum, sum, sum, others[r] + i, q);
      lamb_block<T, Decay, false>(b == 0, q, e.weight + i, sum, m + i, v + i, nullptr, lane_w + p, lane_u + p, s);
    }
  }
  const T ratio = rules::lamb_ratio(lanes_total(lane_w, lanes), lanes_total(lane_u, lanes));
  lamb_apply_entry(e.count, e.weight, m, v, ratio * s.c[2], s);
}

// Lamb on a whole table, entry after entry (each entry's two passes back to back, while it is in cache).
template <typename T>
void lamb_table(const FusedEntry<T>* entries, std::size_t n, const T* const* others, int more,
                const FusedScalars<T>& s) {
  // The lane sums: one buffer per thread, kept (replica threads call at once; a fresh 128 KiB buffer per
  // call would be mapped and faulted in at every step).
  thread_local std::vector<T> lane(2 * rules::kSumLanes);
  for (std::size_t k = 0; k < n; ++k) {
    const T* const* mine = others != nullptr ? others + k * more : nullptr;
    entries[k].decay ? lamb_entry<T, true>(entries[k], mine, more, s, lane.data())
                     : lamb_entry<T, false>(entries[k], mine, more, s, lane.data());
  }
}

}  // namespace

template <typename T>
void fused_update(Rule rule, const FusedEntry<T>* entries, std::size_t n, const FusedScalars<T>& s) {
  if (rule == Rule::kLamb) return lamb_table<T>(entries, n, nullptr, 0, s);
  if (rule == Rule::kAdafactor) return fused_adafactor<T>(entries, n, nullptr, 0, s);
  rules::visit_rule(rule, s.c, TableLoop<T>{entries, n, s});
}

template <typename T>
void fused_update_summed(Rule rule, const FusedEntry<T>* entries, std::size_t n, const T* const* others,
                         int replicas, const FusedScalars<T>& s) {
  if (rule == Rule::kLamb) return lamb_table<T>(entries, n, others, replicas - 1, s);
  if (rule == Rule::kAdafactor) return fused_adafactor<T>(entries, n, others, replicas - 1, s);
  rules::visit_rule(rule, s.c, TableLoop<T>{entries, n, s, others, replicas - 1});
}

template <typename T>
std::ptrdiff_t scatter_add_rows(T* out, T* squares, std::size_t rows, std::size_t width, const T* values,
                                const std::int64_t* indices, std::size_t n) {
  // Checked first, so a bad index leaves `out` and `squares` as they were.
  for (std::size_t i = 0; i < n; ++i)
    if (indices[i] >= static_cast<std::int64_t>(rows)) return static_cast<std::ptrdiff_t>(i);
  for (std::size_t i = 0; i < n; ++i) {
    if (indices[i] < 0) continue;
    T* __restrict row = out + static_cast<std::size_t>(indices[i]) * width;
    const T* __restrict v = values + i * width;
    if (squares == nullptr) {
      for (std::size_t j = 0; j < width; ++j) row[j] += v[j];
    } else {
      T* __restrict sq = squares + static_cast<std::size_t>(indices[i]) * width;
      for (std::size_t j = 0; j < width; ++j) {
        row[j] += v[j];
        sq[j] += v[j] * v[j];
      }
    }
  }
  return -1;
}

template void fused_update<float>(Rule, const FusedEntry<float>*, std::size_t, const FusedScalars<float>&);
template void fused_update<double>(Rule, const FusedEntry<double>*, std::size_t, const FusedScalars<double>&);
template void fused_update_summed<float>(Rule, const FusedEntry<float>*, std::size_t, const float* const*, int,
                                         const FusedScalars<float>&);
template void fused_update_summed<double>(Rule, const FusedEntry<double>*, std::size_t, const double* const*, int,
                                          const FusedScalars<double>&);

template std::ptrdiff_t scatter_add_rows<float>(float*, float*, std::size_t, std::size_t, const float*,
                                                const std::int64_t*, std::size_t);
template std::ptrdiff_t scatter_add_rows<double>(double*, double*, std::size_t, std::size_t, const double*,
                                                 const std::int64_t*, std::size_t);

}  // namespace mirrored::host
