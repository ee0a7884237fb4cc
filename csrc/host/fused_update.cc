#include "host/fused_update.h"

#include "core/optimizer_rules.h"

namespace mirrored::host {

namespace {

// One loop per rule over the shared element math (core/optimizer_rules.h);
// `Decay` is a template argument so the loop carries no branch. __restrict:
// the entries of a table never overlap (the caller's contract).
template <typename T, bool Decay>
inline T decayed(T w, const FusedScalars<T>& s) {
  return Decay ? rules::decayed(w, s.weight_decay, s.lr) : w;
}

template <typename T, bool Decay>
void sgd(const FusedEntry<T>& e, const FusedScalars<T>& s) {
  T* __restrict w = e.weight;
  const T* __restrict g = e.grad;
  for (std::size_t i = 0; i < e.count; ++i) w[i] = rules::sgd(decayed<T, Decay>(w[i], s), g[i], s.c);
}

template <typename T, bool Decay, bool Nesterov>
void sgd_momentum(const FusedEntry<T>& e, const FusedScalars<T>& s) {
  T* __restrict w = e.weight;
  const T* __restrict g = e.grad;
  T* __restrict m = e.slots[0];
  for (std::size_t i = 0; i < e.count; ++i) {
    T mi = m[i];
    w[i] = rules::sgd_momentum<T, Nesterov>(decayed<T, Decay>(w[i], s), g[i], mi, s.c);
    m[i] = mi;
  }
}

template <typename T, bool Decay>
void adam(const FusedEntry<T>& e, const FusedScalars<T>& s) {
  T* __restrict w = e.weight;
  const T* __restrict g = e.grad;
  T* __restrict m = e.slots[0];
  T* __restrict v = e.slots[1];
  for (std::size_t i = 0; i < e.count; ++i) {
    T mi = m[i], vi = v[i];
    w[i] = rules::adam(decayed<T, Decay>(w[i], s), g[i], mi, vi, s.c);
    m[i] = mi;
    v[i] = vi;
  }
}

template <typename T, bool Decay, bool Centered, bool Momentum>
void rmsprop(const FusedEntry<T>& e, const FusedScalars<T>& s) {
  T* __restrict w = e.weight;
  const T* __restrict g = e.grad;
  T* __restrict v = e.slots[0];
  T* __restrict a = e.slots[1];  // the average gradient when centered
  T* __restrict mom = e.slots[Centered ? 2 : 1];
  for (std::size_t i = 0; i < e.count; ++i) {
    T vi = v[i], ai = Centered ? a[i] : T(0), mi = Momentum ? mom[i] : T(0);
    w[i] = rules::rmsprop<T, Centered, Momentum>(decayed<T, Decay>(w[i], s), g[i], vi, ai, mi, s.c);
    v[i] = vi;
    if constexpr (Centered) a[i] = ai;
    if constexpr (Momentum) mom[i] = mi;
  }
}

template <typename T, bool Decay>
void adagrad(const FusedEntry<T>& e, const FusedScalars<T>& s) {
  T* __restrict w = e.weight;
  const T* __restrict g = e.grad;
  T* __restrict acc = e.slots[0];
  for (std::size_t i = 0; i < e.count; ++i) {
    T ai = acc[i];
    w[i] = rules::adagrad(decayed<T, Decay>(w[i], s), g[i], ai, s.c);
    acc[i] = ai;
  }
}

template <typename T, bool Decay>
void nadam(const FusedEntry<T>& e, const FusedScalars<T>& s) {
  T* __restrict w = e.weight;
  const T* __restrict g = e.grad;
  T* __restrict m = e.slots[0];
  T* __restrict v = e.slots[1];
  for (std::size_t i = 0; i < e.count; ++i) {
    T mi = m[i], vi = v[i];
    w[i] = rules::nadam(decayed<T, Decay>(w[i], s), g[i], mi, vi, s.c);
    m[i] = mi;
    v[i] = vi;
  }
}

template <typename T, bool Decay>
void apply_entry(Rule rule, const FusedEntry<T>& e, const FusedScalars<T>& s) {
  switch (rule) {
    case Rule::kSgd: return sgd<T, Decay>(e, s);
    case Rule::kSgdMomentum: return sgd_momentum<T, Decay, false>(e, s);
    case Rule::kSgdNesterov: return sgd_momentum<T, Decay, true>(e, s);
    case Rule::kAdam: return adam<T, Decay>(e, s);
    case Rule::kRmsprop: {
      const bool centered = s.c[5] != T(0), momentum = s.c[4] != T(0);
      if (centered) return momentum ? rmsprop<T, Decay, true, true>(e, s) : rmsprop<T, Decay, true, false>(e, s);
      return momentum ? rmsprop<T, Decay, false, true>(e, s) : rmsprop<T, Decay, false, false>(e, s);
    }
    case Rule::kAdagrad: return adagrad<T, Decay>(e, s);
    case Rule::kNadam: return nadam<T, Decay>(e, s);
  }
}

}  // namespace

template <typename T>
void fused_update(Rule rule, const FusedEntry<T>* entries, std::size_t n, const FusedScalars<T>& s) {
  for (std::size_t k = 0; k < n; ++k) {
    if (entries[k].decay) {
      apply_entry<T, true>(rule, entries[k], s);
    } else {
      apply_entry<T, false>(rule, entries[k], s);
    }
  }
}

template void fused_update<float>(Rule, const FusedEntry<float>*, std::size_t, const FusedScalars<float>&);
template void fused_update<double>(Rule, const FusedEntry<double>*, std::size_t, const FusedScalars<double>&);

}  // namespace mirrored::host
