// An IndexedSlices densified on a GPU, deterministically: every row's slices
// are added in ascending slice order, the host loop's order
// (host/fused_update.h scatter_add_rows), so two GPUs (or two runs) give the
// same bits where atomics (cupy.add.at) would add a repeated row's slices in
// whatever order the hardware picks. No host wait and no allocation: the
// launches can be captured into a CUDA graph. Phases (scatter_rows_body.cuh):
//   clear    the row counts (and, to overwrite, `out` and `squares`)
//   count    counts[row] += 1 per slice; the ticket it gets is the slice's
//            place in its row's segment (an atomic's order: not deterministic)
//   reserve  the slice holding ticket 0 reserves its row's segment
//   fill     grouped[segment + ticket] = slice
//   rank     ordered[segment + (the row's slices before it)] = slice: the
//            host's order, whatever order the atomics picked
//   sum      per (row, column), the row's slices added in that order
// Work: O(slices x width), plus O(k^2) compares for a row named k times,
// spread over its k slices' threads; the clear touches the `rows` counts (and
// `out`'s elements to overwrite it).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "core/dtype.h"

namespace mirrored::cuda {

struct ScatterRows {
  DType dtype = DType::kFloat32;  // of values, out and squares
  const void* values = nullptr;   // slices x width, C order
  const void* indices = nullptr;  // slices row indices, int32 or int64
  bool wide_indices = true;       // int64 (else int32)
  std::size_t slices = 0, width = 0, rows = 0;
  void* out = nullptr;      // rows x width, C order
  void* squares = nullptr;  // the same shape, or null: squares[row] adds values[i] * values[i] (each rounded)
  bool accumulate = true;   // add into out (and squares); false: overwrite them (rows not named become 0)
};

// Bytes of device memory scatter_add_rows needs as its workspace: int32s, two
// per row, one, and three per slice (scatter_rows_body.cuh ScatterWork).
inline std::size_t scatter_rows_workspace_bytes(std::size_t slices, std::size_t rows) {
  return (2 * rows + 1 + 3 * slices) * sizeof(std::int32_t);
}

// out[indices[i]] += values[i] for every i in ascending order (an index < 0
// or >= rows is dropped, as TensorFlow's GPU kernel drops it), six launches
// on `stream` (of the current device, which must reach every pointer);
// `workspace`: scatter_rows_workspace_bytes(slices, rows) bytes of device
// memory, 4-byte aligned, free for the launches' duration. std::invalid_argument
// when slices or rows do not fit 31 bits.
void scatter_add_rows(const ScatterRows& args, void* workspace, int sms, cudaStream_t stream);

}  // namespace mirrored::cuda
