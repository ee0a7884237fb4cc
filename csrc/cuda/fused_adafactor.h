// Adafactor's fused update on GPU memory: core/adafactor_rule.h's phases, one launch each
// (rules::kAdafactorPhases per device and dtype, whatever the number of variables): a phase reads only what
// the launches before it wrote, so a GPU needs no block-wide or grid-wide synchronisation, and the simulated
// runtime (which runs a kernel's threads one at a time, in a random order) runs the same bodies.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "core/adafactor_rule.h"
#include "core/dtype.h"
#include "cuda/fused_update.h"

namespace mirrored::cuda {

// `table`: `entries` FusedEntry<T> on the stream's device, each with its FactoredShape; `work`: the most work
// items of a variable (rules::adafactor_work), which sizes the grid; `scratch`: the table's
// rules::adafactor_scratch_count T's per variable, in table order. The scalars: a host FusedScalars<T>
// (`scalars`, passed by value), or read when the kernels run from `device_scalars` (`coefficients` T's, then
// weight decay's rate and lr), the other null. Each phase opens `gate` first.
void fused_adafactor(DType dtype, const void* table, int entries, std::size_t work, void* scratch,
                     const void* scalars, const void* device_scalars, int coefficients, int sms, cudaStream_t stream,
                     LossScaleGate gate);

}  // namespace mirrored::cuda
