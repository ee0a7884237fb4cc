// The loss-scale gate as the fused update's kernels read it (cuda/fused_update.h, LossScaleGate): every
// kernel of a gated step opens it first.
#pragma once

#include "core/optimizer_rules.h"
#include "cuda/fused_update.h"

namespace mirrored::cuda {

// The gate's part of the scalars; false when the step is skipped (every thread
// returns before writing anything).
template <typename T>
__device__ inline bool open_gate(LossScaleGate gate, rules::FusedScalars<T>& scalars) {
  if (gate.nonfinite != nullptr && *gate.nonfinite != 0) return false;
  if (gate.scale != nullptr) {
    scalars.unscale = true;
    scalars.loss_scale = static_cast<T>(*gate.scale);
  }
  return true;
}

}  // namespace mirrored::cuda
