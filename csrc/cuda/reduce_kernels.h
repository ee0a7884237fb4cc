// Host entry points of the reduction kernels. Pointers are device pointers
// readable from `stream`'s device (the same device, or a peer with access).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "core/dtype.h"
#include "core/reduce_op.h"

namespace mirrored::cuda {

// out[i] = a[i] (op) b[i], then / mean_div when mean_div > 1. `op` is a
// combining op (not kMean). out may alias a or b. `sms` bounds the grid.
void reduce_copy(void* out, const void* a, const void* b, std::size_t count, DType dtype, ReduceOp op, int mean_div,
                 int sms, cudaStream_t stream);

}  // namespace mirrored::cuda
