#include "host/fused_update.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "core/optimizer_rules.h"
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

}  // namespace

template <typename T>
void fused_update(Rule rule, const FusedEntry<T>* entries, std::size_t n, const FusedScalars<T>& s) {
  if (rule == Rule::kAdafactor) return fused_adafactor<T>(entries, n, nullptr, 0, s);
  rules::visit_rule(rule, s.c, TableLoop<T>{entries, n, s});
}

template <typename T>
void fused_update_summed(Rule rule, const FusedEntry<T>* entries, std::size_t n, const T* const* others,
                         int replicas, const FusedScalars<T>& s) {
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
