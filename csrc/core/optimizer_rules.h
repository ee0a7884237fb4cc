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

#include "core/host_device.h"

namespace mirrored::rules {

using std::copysign;
using std::fabs;
using std::pow;
using std::sqrt;

// Codes shared with rules.py.
enum class Rule : int {
  kSgd = 0,
  kSgdMomentum,
  kSgdNesterov,
  kAdam,
  kRmsprop,
  kAdagrad,
  kNadam,
  kAdamAmsgrad,
  kEma,
  kAdamax,
  kAdadelta,
  kLion,
  kFtrl,
  // Rules that reduce over a whole variable: no element-wise functor, kernels of their own.
  kLamb,       // core/lamb.h's phases
  kAdafactor,  // core/adafactor_rule.h's phases
  // Element-wise again.
  kScheduleFreeAdamW,
  // Muon's element-wise part: its momentum and the matrix Newton-Schulz orthogonalises (the rest of the step
  // is matrix products and other rules' kernels: python/mirrored/train/optimizers/muon.py).
  kMuon
};

constexpr int kMaxSlots = 3;
constexpr int kMaxCoefficients = 9;

// Number of scalars each rule reads (rules.py's coefficients); -1 for a code that is no rule.
inline int rule_coefficients(int rule) {
  constexpr int counts[] = {1, 2, 2, 4, 6, 2, 9, 4, 2, 5, 4, 5, 5, 6, 6, 8, 3};
  constexpr int rules = sizeof(counts) / sizeof(counts[0]);
  return rule >= 0 && rule < rules ? counts[rule] : -1;
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
    case Rule::kSgd:
    case Rule::kEma: return 0;
    case Rule::kSgdMomentum:
    case Rule::kSgdNesterov:
    case Rule::kAdagrad:
    case Rule::kLion:
    case Rule::kMuon: return 1;
    case Rule::kAdam:
    case Rule::kNadam:
    case Rule::kAdamax:
    case Rule::kAdadelta:
    case Rule::kFtrl:
    case Rule::kScheduleFreeAdamW:
    case Rule::kLamb: return 2;
    case Rule::kAdamAmsgrad:
    case Rule::kAdafactor: return 3;
    case Rule::kRmsprop: return 1 + (c[5] != 0.0) + (c[4] != 0.0);
  }
  return -1;
}

// A variable's shape as a rule that reduces over its last two axes sees it (Adafactor's factored moments):
// `batches` (the product of the leading dims) x `rows` x `cols`. Not `factored`: fewer than 2 dims.
struct FactoredShape {
  std::size_t batches = 0, rows = 0, cols = 0;
  bool factored = false;
};

// The FactoredShape of a variable of `nd` dims, dims(d) the size of dim d.
template <typename Dims>
FactoredShape factored_shape(std::size_t nd, const Dims& dims) {
  FactoredShape f;
  f.factored = nd >= 2;
  if (f.factored) {
    f.rows = static_cast<std::size_t>(dims(nd - 2));
    f.cols = static_cast<std::size_t>(dims(nd - 1));
    f.batches = 1;
    for (std::size_t d = 0; d + 2 < nd; ++d) f.batches *= static_cast<std::size_t>(dims(d));
  }
  return f;
}

// One variable of a fused update (one entry of its table): `count` elements of
// the variable, its gradient and each of its slots (in the rule's order), all
// of one dtype, on one device. `squares`, when not null, holds what a squaring
// rule takes in place of grad[i] * grad[i]: an IndexedSlices gradient's rows
// squared one by one and added up (Keras' TF backend squares the slices, so a
// row named twice takes a*a + b*b, not (a + b)^2); rows no slice names hold
// 0 = 0 * 0, as the dense step's.
template <typename T>
struct FusedEntry {
  T* weight;
  const T* grad;
  T* slots[kMaxSlots];
  std::size_t count;
  bool decay;  // Keras' decoupled weight decay, w -= w * weight_decay * lr, first
  const T* squares = nullptr;
  FactoredShape shape{};  // Adafactor's (core/adafactor_rule.h); the element-wise rules ignore it
};

// The rule's scalars, already in T (rules.py's order for the rule), and the weight decay's.
// `unscale`: a loss-scaled step (md.mixed_precision.LossScaleOptimizer), whose
// gradients are divided by `loss_scale` first, in T, as Keras' `grad / scale` does.
template <typename T>
struct FusedScalars {
  T c[kMaxCoefficients];
  T weight_decay;
  T lr;
  bool unscale;
  T loss_scale;
};

// Whether x is neither inf nor nan (inf - inf and nan - nan are nan).
template <typename T>
MIRRORED_HD inline bool finite(T x) {
  return x - x == T(0);
}

// LossScaleOptimizer's state after a step, Keras' rules: a step with a
// non-finite gradient (`*nonfinite`, set by the check) counts nothing, halves a
// dynamic scale and restarts its count of good steps; a finite one counts in
// `iterations` and doubles a dynamic scale after `growth_steps` in a row. The
// flag is cleared for the next step's check.
MIRRORED_HD inline void loss_scale_step(int* nonfinite, float* scale, long long* counter, long long* iterations,
                                        long long growth_steps, bool dynamic) {
  if (*nonfinite) {
    if (dynamic) {
      *counter = 0;
      *scale = *scale * 0.5f;
    }
  } else {
    *iterations += 1;
    if (dynamic) {
      if (*counter == growth_steps - 1) {
        *counter = 0;
        *scale = *scale * 2.0f;
      } else {
        *counter += 1;
      }
    }
  }
  *nonfinite = 0;
}

// The scalars of a step whose number only the device knows (a dynamic loss
// scale skips a step on the GPU and leaves `iterations` where it was): the host
// knows the step lies in [lower, lower + rows) and writes one row per candidate,
// `width` scalars each (the rule's coefficients, then weight decay's rate and
// lr: FusedScalars' order without the gate). Passed by value to the select
// kernel (a CUDA launch copies its arguments), or uploaded for a captured one.
constexpr int kMaxStepRows = 32;
constexpr int kMaxRowWidth = kMaxCoefficients + 2;

template <typename T>
struct StepRows {
  long long lower;
  int rows;
  int width;
  T values[kMaxStepRows * kMaxRowWidth];  // row r at values[r * width]
};

// What select_step_row leaves in `status`: the step it read, and 1 when that
// step was outside the rows (the host checks it when the copy arrives).
struct StepStatus {
  long long step;
  long long outside;
};

// Copies the row of step `*iterations` into `out` (width T's). A step outside
// the rows cannot happen (the host counts every apply and learns `lower` from
// a count the device had reached before): if it does, `out` becomes NaN, so no
// wrong scalar is applied quietly, and `status->outside` is set for the host.
template <typename T>
MIRRORED_HD inline void select_step_row(const long long* iterations, const StepRows<T>& rows, T* out,
                                        StepStatus* status) {
  const long long step = *iterations;
  const long long r = step - rows.lower;
  const bool inside = r >= 0 && r < rows.rows;
  for (int j = 0; j < rows.width; ++j) out[j] = inside ? rows.values[r * rows.width + j] : static_cast<T>(NAN);
  status->step = step;
  if (!inside) status->outside = 1;
}

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
MIRRORED_HD inline T adam(T w, T g, T gg, T& m, T& v, const T* c) {
  m = m + (g - m) * c[0];
  v = v + (gg - v) * c[1];
  return w - (m * c[2]) / (sqrt(v) + c[3]);
}

// slots: velocity, then the average gradient (Centered), then the momentum (Momentum).
template <typename T, bool Centered, bool Momentum>
MIRRORED_HD inline T rmsprop(T w, T g, T gg, T& v, T& a, T& mom, const T* c) {
  const T lr = c[0], rho = c[1], one_minus_rho = c[2], epsilon = c[3], mu = c[4];
  v = v * rho + gg * one_minus_rho;
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
MIRRORED_HD inline T adagrad(T w, T g, T gg, T& acc, const T* c) {
  acc = acc + gg;
  return w - (g * c[0]) / sqrt(acc + c[1]);
}

// c: lr, epsilon, 1-beta_1, 1-beta_2, u_t_1, 1-u_product_t_1, 1-u_t, 1-u_product_t, 1-beta_2^t
template <typename T>
MIRRORED_HD inline T nadam(T w, T g, T gg, T& m, T& v, const T* c) {
  m = m + (g - m) * c[2];
  v = v + (gg - v) * c[3];
  const T m_hat = (m * c[4]) / c[5] + (g * c[6]) / c[7];
  return w - (m_hat * c[0]) / (sqrt(v / c[8]) + c[1]);
}

// Adam with amsgrad (Keras: velocity_hat = maximum(velocity_hat, velocity), then
// the step divides by sqrt(velocity_hat)). The maximum propagates a NaN from
// either side, as tf.maximum and np.maximum do.
template <typename T>
MIRRORED_HD inline T adam_amsgrad(T w, T g, T gg, T& m, T& v, T& v_hat, const T* c) {
  m = m + (g - m) * c[0];
  v = v + (gg - v) * c[1];
  v_hat = (v > v_hat || v != v) ? v : v_hat;
  return w - (m * c[2]) / (sqrt(v_hat) + c[3]);
}

// Keras' moving average of a variable (use_ema), as a rule whose "weight" is
// the average and whose "gradient" is the variable: c = (momentum, 1 - momentum).
template <typename T>
MIRRORED_HD inline T ema(T average, T w, const T* c) {
  return average * c[0] + w * c[1];
}

// maximum and minimum as tf.maximum / tf.minimum: a NaN on either side propagates.
template <typename T>
MIRRORED_HD inline T maximum(T a, T b) {
  return (a > b || a != a) ? a : b;
}
template <typename T>
MIRRORED_HD inline T minimum(T a, T b) {
  return (a < b || a != a) ? a : b;
}

// c: 1-beta_1, beta_2, lr, 1-beta_1^t, epsilon (slots: momentum, norm)
template <typename T>
MIRRORED_HD inline T adamax(T w, T g, T& m, T& u, const T* c) {
  m = m + (g - m) * c[0];
  u = maximum(u * c[1], T(fabs(g)));
  return w - (m * c[2]) / ((u + c[4]) * c[3]);
}

// c: lr, rho, 1-rho, epsilon (slots: accumulated_grad, accumulated_delta_var)
template <typename T>
MIRRORED_HD inline T adadelta(T w, T g, T gg, T& accumulated_grad, T& accumulated_delta, const T* c) {
  accumulated_grad = accumulated_grad * c[1] + gg * c[2];
  const T delta = -((sqrt(accumulated_delta + c[3]) * g) / sqrt(accumulated_grad + c[3]));
  accumulated_delta = accumulated_delta * c[1] + (delta * delta) * c[2];
  return w + delta * c[0];
}

// sign(x) as tf.sign and np.sign: -1, 1, +0 for either zero (tf.sign(-0.0) is 0.0), and a NaN stays
// NaN. The +-1 is copysign's, not a choice between the constants 1 and -1: with those, -O3 folds the
// caller's `sign(x) * lr` into branches (1 * lr is lr), a multiply that may trap is not if-converted,
// and the host loop branched per element (mispredicting on random signs) instead of vectorising.
template <typename T>
MIRRORED_HD inline T sign(T x) {
  const T zero_or_nan = x == x ? T(0) : x;
  return (x > T(0) || x < T(0)) ? copysign(T(1), x) : zero_or_nan;
}

// c: lr, beta_1, 1-beta_1, beta_2, 1-beta_2 (slot: momentum)
template <typename T>
MIRRORED_HD inline T lion(T w, T g, T& m, const T* c) {
  const T result = w - sign(m * c[1] + g * c[2]) * c[0];
  m = m * c[3] + g * c[4];
  return result;
}

// x^p in T, computed in double and rounded once: float's pow differs by an ulp between libm, NumPy's SIMD
// loops and CUDA, double's rounded to float does not (rules.py's _power). (A float64 variable's pow is the
// platform's: on a real GPU CUDA's, within an ulp or two of the host's.)
template <typename T>
MIRRORED_HD inline T power(T x, T p) {
  return static_cast<T>(pow(static_cast<double>(x), static_cast<double>(p)));
}

// c: lr, -learning_rate_power, 2*l2_shrinkage, 2*l2_reg (with beta / (2 lr)), l1 (slots: accumulator, linear).
// Sqrt: the power is 0.5 (Keras' default learning_rate_power=-0.5), taken as sqrt, which is power()'s value
// for an accumulator >= 0 and a vectorisable instruction rather than a call to pow.
template <typename T, bool Sqrt>
MIRRORED_HD inline T ftrl(T w, T g, T gg, T& accumulator, T& linear, const T* c) {
  const T new_accumulator = accumulator + gg;
  const T new_power = Sqrt ? sqrt(new_accumulator) : power(new_accumulator, c[1]);
  const T old_power = Sqrt ? sqrt(accumulator) : power(accumulator, c[1]);
  linear = linear + ((g + w * c[2]) - ((new_power - old_power) / c[0]) * w);
  const T quadratic = new_power / c[0] + c[3];
  accumulator = new_accumulator;
  return (maximum(minimum(linear, c[4]), -c[4]) - linear) / quadratic;
}

// Keras 3.15's ScheduleFreeAdamW (Defazio et al., 2024). The variable holds y, the point the gradient is
// taken at; the slot `momentum` holds z (the sequence the Adam-style steps move) and `velocity` Adam's second
// moment. The averaged sequence x is not stored: it is recovered from y and z each step, as Keras does, with
// z already updated (Keras reads its momentum variable after the update). c: lr (warmed up), 1-beta_2,
// 1-beta_2^t, epsilon, 1-beta_1, beta_1, 1-1/t, 1/t.
template <typename T>
MIRRORED_HD inline T schedule_free_adamw(T y, T g, T gg, T& z, T& v, const T* c) {
  v = v + (gg - v) * c[1];
  z = z - (g * c[0]) / (sqrt(v / c[2]) + c[3]);
  const T x_old = (y - z * c[4]) / c[5];
  const T x = x_old * c[6] + z * c[7];
  return z * c[4] + x * c[5];
}

// Muon's momentum, Keras' m += g + m * (momentum - 1), and the matrix its Newton-Schulz iteration takes:
// g + momentum * m with Nesterov, else m. The rule's "weight" is that matrix (a scratch buffer), written only.
// c: momentum - 1, momentum, nesterov (1 or 0) (slot: momentum)
template <typename T, bool Nesterov>
MIRRORED_HD inline T muon_momentum(T g, T& m, const T* c) {
  m = m + (g + m * c[0]);
  return Nesterov ? g + c[1] * m : m;
}

// Each rule as a functor over one element: `kSlots` slot values in `st` (the
// rule's order), read and written back by the caller; `gg` is the gradient's
// square (g * g, or FusedEntry::squares'), read by the squaring rules only. The host loop
// (csrc/host/fused_update.cc) and the GPU walk below share them.
template <typename T>
struct Sgd {
  static constexpr int kSlots = 0;
  MIRRORED_HD T operator()(T w, T g, T, T*, const T* c) const { return sgd(w, g, c); }
};

template <typename T, bool Nesterov>
struct SgdMomentum {
  static constexpr int kSlots = 1;
  MIRRORED_HD T operator()(T w, T g, T, T* st, const T* c) const {
    return sgd_momentum<T, Nesterov>(w, g, st[0], c);
  }
};

template <typename T>
struct Adam {
  static constexpr int kSlots = 2;
  MIRRORED_HD T operator()(T w, T g, T gg, T* st, const T* c) const { return adam(w, g, gg, st[0], st[1], c); }
};

template <typename T>
struct AdamAmsgrad {
  static constexpr int kSlots = 3;
  MIRRORED_HD T operator()(T w, T g, T gg, T* st, const T* c) const {
    return adam_amsgrad(w, g, gg, st[0], st[1], st[2], c);
  }
};

template <typename T, bool Centered, bool Momentum>
struct Rmsprop {
  static constexpr int kSlots = 1 + Centered + Momentum;
  MIRRORED_HD T operator()(T w, T g, T gg, T* st, const T* c) const {
    // Locals for the slots this variant lacks (no pointer into `st` chosen at run time: the host
    // loop keeps `st` in registers and vectorises).
    T a = T(0), mom = T(0);
    if constexpr (Centered) a = st[1];
    if constexpr (Momentum) mom = st[Centered ? 2 : 1];
    const T result = rmsprop<T, Centered, Momentum>(w, g, gg, st[0], a, mom, c);
    if constexpr (Centered) st[1] = a;
    if constexpr (Momentum) st[Centered ? 2 : 1] = mom;
    return result;
  }
};

template <typename T>
struct Adagrad {
  static constexpr int kSlots = 1;
  MIRRORED_HD T operator()(T w, T g, T gg, T* st, const T* c) const { return adagrad(w, g, gg, st[0], c); }
};

template <typename T>
struct Nadam {
  static constexpr int kSlots = 2;
  MIRRORED_HD T operator()(T w, T g, T gg, T* st, const T* c) const { return nadam(w, g, gg, st[0], st[1], c); }
};

template <typename T>
struct Ema {
  static constexpr int kSlots = 0;
  MIRRORED_HD T operator()(T average, T w, T, T*, const T* c) const { return ema(average, w, c); }
};

template <typename T>
struct Adamax {
  static constexpr int kSlots = 2;
  MIRRORED_HD T operator()(T w, T g, T, T* st, const T* c) const { return adamax(w, g, st[0], st[1], c); }
};

template <typename T>
struct Adadelta {
  static constexpr int kSlots = 2;
  MIRRORED_HD T operator()(T w, T g, T gg, T* st, const T* c) const { return adadelta(w, g, gg, st[0], st[1], c); }
};

template <typename T>
struct Lion {
  static constexpr int kSlots = 1;
  MIRRORED_HD T operator()(T w, T g, T, T* st, const T* c) const { return lion(w, g, st[0], c); }
};

template <typename T, bool Sqrt>
struct Ftrl {
  static constexpr int kSlots = 2;
  MIRRORED_HD T operator()(T w, T g, T gg, T* st, const T* c) const {
    return ftrl<T, Sqrt>(w, g, gg, st[0], st[1], c);
  }
};

template <typename T>
struct ScheduleFreeAdamW {
  static constexpr int kSlots = 2;
  MIRRORED_HD T operator()(T w, T g, T gg, T* st, const T* c) const {
    return schedule_free_adamw(w, g, gg, st[0], st[1], c);
  }
};

template <typename T, bool Nesterov>
struct MuonMomentum {
  static constexpr int kSlots = 1;
  MIRRORED_HD T operator()(T, T g, T, T* st, const T* c) const { return muon_momentum<T, Nesterov>(g, st[0], c); }
};

// Calls visit(F{}) with the functor F of `rule` (RMSprop's variant read from its coefficients `c`).
template <typename T, typename Visitor>
MIRRORED_HD inline void visit_rule(Rule rule, const T* c, const Visitor& visit) {
  switch (rule) {
    case Rule::kSgd: return visit(Sgd<T>{});
    case Rule::kSgdMomentum: return visit(SgdMomentum<T, false>{});
    case Rule::kSgdNesterov: return visit(SgdMomentum<T, true>{});
    case Rule::kAdam: return visit(Adam<T>{});
    case Rule::kAdamAmsgrad: return visit(AdamAmsgrad<T>{});
    case Rule::kRmsprop: {
      const bool centered = c[5] != T(0), momentum = c[4] != T(0);
      if (centered) return momentum ? visit(Rmsprop<T, true, true>{}) : visit(Rmsprop<T, true, false>{});
      return momentum ? visit(Rmsprop<T, false, true>{}) : visit(Rmsprop<T, false, false>{});
    }
    case Rule::kAdagrad: return visit(Adagrad<T>{});
    case Rule::kNadam: return visit(Nadam<T>{});
    case Rule::kEma: return visit(Ema<T>{});
    case Rule::kAdamax: return visit(Adamax<T>{});
    case Rule::kAdadelta: return visit(Adadelta<T>{});
    case Rule::kLion: return visit(Lion<T>{});
    case Rule::kFtrl: return c[1] == T(0.5) ? visit(Ftrl<T, true>{}) : visit(Ftrl<T, false>{});
    case Rule::kScheduleFreeAdamW: return visit(ScheduleFreeAdamW<T>{});
    case Rule::kMuon: return c[2] != T(0) ? visit(MuonMomentum<T, true>{}) : visit(MuonMomentum<T, false>{});
    case Rule::kLamb:
    case Rule::kAdafactor: return;  // (no element-wise functor: the callers run their own phases)
  }
}

// Element i of entry e under the rule F: what a host loop iteration or a GPU thread does.
template <typename T, typename F>
MIRRORED_HD inline void update_element(F rule, const FusedEntry<T>& e, const FusedScalars<T>& s, std::size_t i) {
  T st[F::kSlots > 0 ? F::kSlots : 1];
  for (int j = 0; j < F::kSlots; ++j) st[j] = e.slots[j][i];
  const T w = e.decay ? decayed(e.weight[i], s.weight_decay, s.lr) : e.weight[i];
  const T g = s.unscale ? e.grad[i] / s.loss_scale : e.grad[i];
  // (A loss-scaled step has no squares: the gate takes dense gradients only.)
  e.weight[i] = rule(w, g, e.squares != nullptr ? e.squares[i] : g * g, st, s.c);
  for (int j = 0; j < F::kSlots; ++j) e.slots[j][i] = st[j];
}

template <typename T>
struct TableWalk {
  const FusedEntry<T>* table;
  int entries;
  const FusedScalars<T>& s;
  std::size_t tid, stride;
  template <typename F>
  MIRRORED_HD void operator()(F rule) const {
    for (int k = 0; k < entries; ++k)
      for (std::size_t i = tid; i < table[k].count; i += stride) update_element(rule, table[k], s, i);
  }
};

// A whole table, walked grid-stride: thread `tid` of `stride` threads updates
// elements tid, tid + stride, ... of every entry. The CUDA kernel runs this per
// thread; one host thread with (0, 1) runs it all.
template <typename T>
MIRRORED_HD inline void update_table(Rule rule, const FusedEntry<T>* table, int entries, const FusedScalars<T>& s,
                                     std::size_t tid, std::size_t stride) {
  visit_rule(rule, s.c, TableWalk<T>{table, entries, s, tid, stride});
}

}  // namespace mirrored::rules
