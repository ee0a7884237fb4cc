// Fused all-reduce of many tensors per rank over any device Communicator
// (the CUDA ring or NCCL): the core's packer plans the packs, tensors are
// copied into one fusion buffer per rank, each pack is all-reduced in place,
// and the results are copied out. Packs of a single tensor skip the copies.
#pragma once

#include <cstddef>
#include <mutex>
#include <vector>

#include "core/communicator.h"
#include "core/dtype.h"
#include "core/reduce_op.h"

namespace mirrored::cuda {

class DeviceBatch {
 public:
  explicit DeviceBatch(std::vector<int> devices);
  ~DeviceBatch();
  DeviceBatch(const DeviceBatch&) = delete;
  DeviceBatch& operator=(const DeviceBatch&) = delete;

  // in[r][t], out[r][t]: tensor t of rank r (out may equal in); counts[t]
  // elements of dtypes[t]. Ordered on the current streams (stream_scope.h).
  void all_reduce(Communicator& comm, const std::vector<std::vector<const void*>>& in,
                  const std::vector<std::vector<void*>>& out, const std::vector<std::size_t>& counts,
                  const std::vector<DType>& dtypes, ReduceOp op, Algorithm algorithm, std::size_t bytes_per_pack,
                  int num_packs);

 private:
  void* fusion(int r, std::size_t bytes);

  std::vector<int> devices_;
  std::vector<void*> buffers_;
  std::vector<std::size_t> capacity_;
  std::mutex mu_;  // the fusion buffers serve one batch at a time
};

}  // namespace mirrored::cuda
