#include "host/fused_update.h"

#include <cmath>

namespace mirrored::host {

namespace {

// One loop per rule; `Decay` is a template argument so the loop carries no branch.
// __restrict: the entries of a table never overlap (checked by the binding's caller).
template <typename T, bool Decay>
inline T decayed(T w, const FusedScalars<T>& s) {
  return Decay ? w - (w * s.weight_decay) * s.lr : w;
}

template <typename T, bool Decay>
void sgd(const FusedEntry<T>& e, const FusedScalars<T>& s) {
  T* __restrict w = e.weight;
  const T* __restrict g = e.grad;
  const T lr = s.c[0];
  for (std::size_t i = 0; i < e.count; ++i) w[i] = decayed<T, Decay>(w[i], s) - g[i] * lr;
}

template <typename T, bool Decay, bool Nesterov>
void sgd_momentum(const FusedEntry<T>& e, const FusedScalars<T>& s) {
  T* __restrict w = e.weight;
  const T* __restrict g = e.grad;
  T* __restrict m = e.slots[0];
  const T lr = s.c[0], mu = s.c[1];
  for (std::size_t i = 0; i < e.count; ++i) {
    const T wi = decayed<T, Decay>(w[i], s);
    const T mi = m[i] * mu - g[i] * lr;
    m[i] = mi;
    w[i] = Nesterov ? wi + (mi * mu - g[i] * lr) : wi + mi;
  }
}

template <typename T, bool Decay>
void adam(const FusedEntry<T>& e, const FusedScalars<T>& s) {
  T* __restrict w = e.weight;
  const T* __restrict g = e.grad;
  T* __restrict m = e.slots[0];
  T* __restrict v = e.slots[1];
  const T one_minus_beta_1 = s.c[0], one_minus_beta_2 = s.c[1], alpha = s.c[2], epsilon = s.c[3];
  for (std::size_t i = 0; i < e.count; ++i) {
    const T wi = decayed<T, Decay>(w[i], s);
    const T gi = g[i];
    const T mi = m[i] + (gi - m[i]) * one_minus_beta_1;
    const T vi = v[i] + (gi * gi - v[i]) * one_minus_beta_2;
    m[i] = mi;
    v[i] = vi;
    w[i] = wi - (mi * alpha) / (std::sqrt(vi) + epsilon);
  }
}

template <typename T, bool Decay, bool Centered, bool Momentum>
void rmsprop(const FusedEntry<T>& e, const FusedScalars<T>& s) {
  T* __restrict w = e.weight;
  const T* __restrict g = e.grad;
  T* __restrict v = e.slots[0];
  T* __restrict a = e.slots[1];  // the average gradient when centered
  T* __restrict mom = e.slots[Centered ? 2 : 1];
  const T lr = s.c[0], rho = s.c[1], one_minus_rho = s.c[2], epsilon = s.c[3], mu = s.c[4];
  for (std::size_t i = 0; i < e.count; ++i) {
    const T wi = decayed<T, Decay>(w[i], s);
    const T gi = g[i];
    const T vi = v[i] * rho + (gi * gi) * one_minus_rho;
    v[i] = vi;
    T denominator;
    if constexpr (Centered) {
      const T ai = a[i] * rho + gi * one_minus_rho;
      a[i] = ai;
      denominator = (vi - ai * ai) + epsilon;
    } else {
      denominator = vi + epsilon;
    }
    const T increment = (gi * lr) / std::sqrt(denominator);
    if constexpr (Momentum) {
      const T mi = mom[i] * mu + increment;
      mom[i] = mi;
      w[i] = wi - mi;
    } else {
      w[i] = wi - increment;
    }
  }
}

template <typename T, bool Decay>
void adagrad(const FusedEntry<T>& e, const FusedScalars<T>& s) {
  T* __restrict w = e.weight;
  const T* __restrict g = e.grad;
  T* __restrict acc = e.slots[0];
  const T lr = s.c[0], epsilon = s.c[1];
  for (std::size_t i = 0; i < e.count; ++i) {
    const T wi = decayed<T, Decay>(w[i], s);
    const T gi = g[i];
    const T ai = acc[i] + gi * gi;
    acc[i] = ai;
    w[i] = wi - (gi * lr) / std::sqrt(ai + epsilon);
  }
}

template <typename T, bool Decay>
void nadam(const FusedEntry<T>& e, const FusedScalars<T>& s) {
  T* __restrict w = e.weight;
  const T* __restrict g = e.grad;
  T* __restrict m = e.slots[0];
  T* __restrict v = e.slots[1];
  const T lr = s.c[0], epsilon = s.c[1], one_minus_beta_1 = s.c[2], one_minus_beta_2 = s.c[3], u_t_1 = s.c[4],
          one_minus_u_product_t_1 = s.c[5], one_minus_u_t = s.c[6], one_minus_u_product_t = s.c[7],
          one_minus_beta_2_power = s.c[8];
  for (std::size_t i = 0; i < e.count; ++i) {
    const T wi = decayed<T, Decay>(w[i], s);
    const T gi = g[i];
    const T mi = m[i] + (gi - m[i]) * one_minus_beta_1;
    const T vi = v[i] + (gi * gi - v[i]) * one_minus_beta_2;
    m[i] = mi;
    v[i] = vi;
    const T m_hat = (mi * u_t_1) / one_minus_u_product_t_1 + (gi * one_minus_u_t) / one_minus_u_product_t;
    w[i] = wi - (m_hat * lr) / (std::sqrt(vi / one_minus_beta_2_power) + epsilon);
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

int rule_coefficients(int rule) {
  static const int counts[] = {1, 2, 2, 4, 6, 2, 9};
  return rule >= 0 && rule < 7 ? counts[rule] : -1;
}

int rule_slots(int rule, const double* c) {
  switch (static_cast<Rule>(rule)) {
    case Rule::kSgd: return 0;
    case Rule::kSgdMomentum:
    case Rule::kSgdNesterov:
    case Rule::kAdagrad: return 1;
    case Rule::kAdam:
    case Rule::kNadam: return 2;
    case Rule::kRmsprop: return 1 + (c[5] != 0.0) + (c[4] != 0.0);
  }
  return -1;
}

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
