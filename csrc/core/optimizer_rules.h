// The optimizers' update rules on one element, shared by the host kernel
// (csrc/host/fused_update.cc) and the CUDA kernel (csrc/cuda/fused_update.cu):
// Keras 3's element-wise sequences in the variable's dtype T, every operation
// rounded on its own (both are compiled without contraction into fused
// multiply-adds), so host and device give the same bits as
// python/mirrored/train/optimizers/rules.py, the reference.
//
// Each returns the new weight and updates the slots it is given; `c` holds the
// rule's scalars in rules.py's order.
#pragma once

#include <cmath>
#include <cstddef>
#include <string>

#if defined(__CUDACC__)
#define MIRRORED_HD __host__ __device__
#else
#define MIRRORED_HD
#endif

namespace mirrored::rules {

using std::sqrt;

// Codes shared with rules.py.
enum class Rule : int { kSgd = 0, kSgdMomentum, kSgdNesterov, kAdam, kRmsprop, kAdagrad, kNadam };

constexpr int kMaxSlots = 3;
constexpr int kMaxCoefficients = 9;

// Number of scalars each rule reads (rules.py's coefficients); -1 for a code that is no rule.
inline int rule_coefficients(int rule) {
  constexpr int counts[] = {1, 2, 2, 4, 6, 2, 9};
  return rule >= 0 && rule < 7 ? counts[rule] : -1;
}

// What is wrong with `given` coefficients for `rule` (a code from Python), naming the argument; empty when nothing.
inline std::string coefficients_error(int rule, std::size_t given) {
  const int wanted = rule_coefficients(rule);
  if (wanted < 0) return "rule=" + std::to_string(rule) + ": no such rule";
  if (given != static_cast<std::size_t>(wanted))
    return "coefficients: " + std::to_string(given) + " given, the rule takes " + std::to_string(wanted);
  return {};
}

// Number of slots the rule updates, given its coefficients (RMSprop's variants are read from them).
inline int rule_slots(int rule, const double* c) {
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

// One variable of a fused update (one entry of its table): `count` elements of
// the variable, its gradient and each of its slots (in the rule's order), all
// of one dtype, on one device.
template <typename T>
struct FusedEntry {
  T* weight;
  const T* grad;
  T* slots[kMaxSlots];
  std::size_t count;
  bool decay;  // Keras' decoupled weight decay, w -= w * weight_decay * lr, first
};

// The rule's scalars, already in T (rules.py's order for the rule), and the weight decay's.
template <typename T>
struct FusedScalars {
  T c[kMaxCoefficients];
  T weight_decay;
  T lr;
};

// Keras' decoupled weight decay, before the rule.
template <typename T>
MIRRORED_HD inline T decayed(T w, T weight_decay, T lr) {
  return w - (w * weight_decay) * lr;
}

template <typename T>
MIRRORED_HD inline T sgd(T w, T g, const T* c) {
  return w - g * c[0];
}

template <typename T, bool Nesterov>
MIRRORED_HD inline T sgd_momentum(T w, T g, T& m, const T* c) {
  const T lr = c[0], mu = c[1];
  m = m * mu - g * lr;
  return Nesterov ? w + (m * mu - g * lr) : w + m;
}

template <typename T>
MIRRORED_HD inline T adam(T w, T g, T& m, T& v, const T* c) {
  m = m + (g - m) * c[0];
  v = v + (g * g - v) * c[1];
  return w - (m * c[2]) / (sqrt(v) + c[3]);
}

// slots: velocity, then the average gradient (Centered), then the momentum (Momentum).
template <typename T, bool Centered, bool Momentum>
MIRRORED_HD inline T rmsprop(T w, T g, T& v, T& a, T& mom, const T* c) {
  const T lr = c[0], rho = c[1], one_minus_rho = c[2], epsilon = c[3], mu = c[4];
  v = v * rho + (g * g) * one_minus_rho;
  T denominator;
  if (Centered) {
    a = a * rho + g * one_minus_rho;
    denominator = (v - a * a) + epsilon;
  } else {
    denominator = v + epsilon;
  }
  const T increment = (g * lr) / sqrt(denominator);
  if (Momentum) {
    mom = mom * mu + increment;
    return w - mom;
  }
  return w - increment;
}

template <typename T>
MIRRORED_HD inline T adagrad(T w, T g, T& acc, const T* c) {
  acc = acc + g * g;
  return w - (g * c[0]) / sqrt(acc + c[1]);
}

// c: lr, epsilon, 1-beta_1, 1-beta_2, u_t_1, 1-u_product_t_1, 1-u_t, 1-u_product_t, 1-beta_2^t
template <typename T>
MIRRORED_HD inline T nadam(T w, T g, T& m, T& v, const T* c) {
  m = m + (g - m) * c[2];
  v = v + (g * g - v) * c[3];
  const T m_hat = (m * c[4]) / c[5] + (g * c[6]) / c[7];
  return w - (m_hat * c[0]) / (sqrt(v / c[8]) + c[1]);
}

// Element i of entry e under `rule`: what a host loop iteration or a GPU thread does.
template <typename T>
MIRRORED_HD inline void update_element(Rule rule, const FusedEntry<T>& e, const FusedScalars<T>& s, std::size_t i) {
  const T w = e.decay ? decayed(e.weight[i], s.weight_decay, s.lr) : e.weight[i];
  const T g = e.grad[i];
  T unused = T(0);
  switch (rule) {
    case Rule::kSgd: e.weight[i] = sgd(w, g, s.c); return;
    case Rule::kSgdMomentum: e.weight[i] = sgd_momentum<T, false>(w, g, e.slots[0][i], s.c); return;
    case Rule::kSgdNesterov: e.weight[i] = sgd_momentum<T, true>(w, g, e.slots[0][i], s.c); return;
    case Rule::kAdam: e.weight[i] = adam(w, g, e.slots[0][i], e.slots[1][i], s.c); return;
    case Rule::kRmsprop: {
      const bool centered = s.c[5] != T(0), momentum = s.c[4] != T(0);
      T& v = e.slots[0][i];
      if (centered && momentum) {
        e.weight[i] = rmsprop<T, true, true>(w, g, v, e.slots[1][i], e.slots[2][i], s.c);
      } else if (centered) {
        e.weight[i] = rmsprop<T, true, false>(w, g, v, e.slots[1][i], unused, s.c);
      } else if (momentum) {
        e.weight[i] = rmsprop<T, false, true>(w, g, v, unused, e.slots[1][i], s.c);
      } else {
        e.weight[i] = rmsprop<T, false, false>(w, g, v, unused, unused, s.c);
      }
      return;
    }
    case Rule::kAdagrad: e.weight[i] = adagrad(w, g, e.slots[0][i], s.c); return;
    case Rule::kNadam: e.weight[i] = nadam(w, g, e.slots[0][i], e.slots[1][i], s.c); return;
  }
}

// A whole table, walked grid-stride: thread `tid` of `stride` threads updates
// elements tid, tid + stride, ... of every entry. The CUDA kernel runs this per
// thread; one host thread with (0, 1) runs it all.
template <typename T>
MIRRORED_HD inline void update_table(Rule rule, const FusedEntry<T>* table, int entries, const FusedScalars<T>& s,
                                     std::size_t tid, std::size_t stride) {
  for (int k = 0; k < entries; ++k)
    for (std::size_t i = tid; i < table[k].count; i += stride) update_element(rule, table[k], s, i);
}

}  // namespace mirrored::rules
