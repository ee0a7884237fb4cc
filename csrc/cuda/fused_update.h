// The fused optimizer update on GPU memory: one launch per device and dtype
// applies weight decay and an optimizer's rule to every variable and slot of a
// table (core/optimizer_rules.h: FusedEntry, the multi-tensor-apply way), with
// the host kernel's element math, so the bits are the host's.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "core/dtype.h"
#include "core/optimizer_rules.h"

namespace mirrored::cuda {

// `table`: `entries` FusedEntry<T> in memory of `stream`'s device (uploaded on
// `stream` before), T from `dtype` (float32 or float64); `max_count`: the
// largest entry's count (it sizes the grid); `scalars`: a host FusedScalars<T>,
// passed by value. `sms` bounds the grid.
void fused_update(rules::Rule rule, DType dtype, const void* table, int entries, std::size_t max_count,
                  const void* scalars, int sms, cudaStream_t stream);

}  // namespace mirrored::cuda
