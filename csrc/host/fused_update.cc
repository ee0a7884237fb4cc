#include "host/fused_update.h"

#include "core/optimizer_rules.h"

namespace mirrored::host {

namespace {

// One loop for every rule: the rule's functor (core/optimizer_rules.h) on each
// element, its slots loaded into locals and stored back. `Decay` and the
// functor are template arguments, so the loop carries no branch and
// vectorises. The buffers are __restrict parameters (the entries of a table
// never overlap, the caller's contract; a variable's own buffers are
// distinct) and the scalars a local copy, so the compiler needs no run-time
// alias checks (with three slots it would need more than it allows, and
// would not vectorise).
template <typename T, bool Decay, typename F>
void update_arrays(F rule, std::size_t count, T* __restrict w, const T* __restrict g, T* __restrict s0,
                   T* __restrict s1, T* __restrict s2, const FusedScalars<T> s) {
  static_assert(F::kSlots <= kMaxSlots, "a rule has at most kMaxSlots slots");
  for (std::size_t i = 0; i < count; ++i) {
    T st[F::kSlots > 0 ? F::kSlots : 1];
    if constexpr (F::kSlots > 0) st[0] = s0[i];
    if constexpr (F::kSlots > 1) st[1] = s1[i];
    if constexpr (F::kSlots > 2) st[2] = s2[i];
    const T wi = Decay ? rules::decayed(w[i], s.weight_decay, s.lr) : w[i];
    w[i] = rule(wi, g[i], st, s.c);
    if constexpr (F::kSlots > 0) s0[i] = st[0];
    if constexpr (F::kSlots > 1) s1[i] = st[1];
    if constexpr (F::kSlots > 2) s2[i] = st[2];
  }
}

template <typename T, bool Decay, typename F>
void update_entry(F rule, const FusedEntry<T>& e, const FusedScalars<T>& s) {
  update_arrays<T, Decay>(rule, e.count, e.weight, e.grad, e.slots[0], e.slots[1], e.slots[2], s);
}

template <typename T>
struct TableLoop {
  const FusedEntry<T>* entries;
  std::size_t n;
  const FusedScalars<T>& s;
  template <typename F>
  void operator()(F rule) const {
    for (std::size_t k = 0; k < n; ++k) {
      if (entries[k].decay) {
        update_entry<T, true>(rule, entries[k], s);
      } else {
        update_entry<T, false>(rule, entries[k], s);
      }
    }
  }
};

}  // namespace

template <typename T>
void fused_update(Rule rule, const FusedEntry<T>* entries, std::size_t n, const FusedScalars<T>& s) {
  rules::visit_rule(rule, s.c, TableLoop<T>{entries, n, s});
}

template void fused_update<float>(Rule, const FusedEntry<float>*, std::size_t, const FusedScalars<float>&);
template void fused_update<double>(Rule, const FusedEntry<double>*, std::size_t, const FusedScalars<double>&);

}  // namespace mirrored::host
