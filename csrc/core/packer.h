// Fusion: many small tensors travel as a few large buffers ("packs"). A pack
// holds tensors of one dtype, back to back; the plan is computed once per
// batch and used both to pack and to unpack.
#pragma once

#include <cstddef>
#include <vector>

#include "dtype.h"

namespace mirrored {

struct PackEntry {
  std::size_t tensor;  // index into the batch
  std::size_t offset;  // byte offset inside the pack
  std::size_t bytes;
};

struct Pack {
  DType dtype;
  std::size_t bytes = 0;
  std::vector<PackEntry> entries;
};

// bytes_per_pack > 0: close a pack before it would exceed that many bytes (a
// larger tensor travels alone). Else num_packs > 0: split each dtype's tensors
// into that many packs of about equal bytes, at tensor boundaries. Else: one
// pack per dtype. Tensors keep their batch order inside each dtype.
std::vector<Pack> plan_packs(const std::vector<std::size_t>& tensor_bytes, const std::vector<DType>& dtypes,
                             std::size_t bytes_per_pack, int num_packs);

}  // namespace mirrored
