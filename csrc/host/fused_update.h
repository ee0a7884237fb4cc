// The fused optimizer update on host memory: one call applies weight decay and
// an optimizer's rule to every variable (and its slots) of one device, walking a
// table of (pointer, count) entries — the multi-tensor-apply way.
//
// Each rule is Keras 3's element-wise sequence in the variable's dtype, every
// operation rounded on its own (this file is compiled without floating-point
// contraction), so results are bit-identical to python/mirrored/train/
// optimizers/rules.py, the reference.
#pragma once

#include <cstddef>

namespace mirrored::host {

// Codes shared with rules.py.
enum class Rule : int { kSgd = 0, kSgdMomentum, kSgdNesterov, kAdam, kRmsprop, kAdagrad, kNadam };

constexpr int kMaxSlots = 3;
constexpr int kMaxCoefficients = 9;

// One variable of a fused update: `count` elements of the variable, its
// gradient and each of its slots (in the rule's order), all of one dtype.
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

// Number of slots and coefficients each rule reads; -1 for a code that is no rule.
int rule_slots(int rule, const double* coefficients);
int rule_coefficients(int rule);

// Applies `rule` to entries[0..n). Entries must not overlap each other.
template <typename T>
void fused_update(Rule rule, const FusedEntry<T>* entries, std::size_t n, const FusedScalars<T>& s);

extern template void fused_update<float>(Rule, const FusedEntry<float>*, std::size_t, const FusedScalars<float>&);
extern template void fused_update<double>(Rule, const FusedEntry<double>*, std::size_t, const FusedScalars<double>&);

}  // namespace mirrored::host
