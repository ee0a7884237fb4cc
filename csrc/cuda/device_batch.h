// Fused all-reduce of many tensors per rank over any device Communicator
// (the CUDA ring or NCCL), in a constant number of launches and driver calls
// whatever the tensor count: the core's packer plans the packs; one upload
// of a (src, dst, bytes) table per GPU and stream; one pack kernel per GPU
// and stream copies every tensor of every multi-tensor pack into one fusion
// buffer per rank (16-byte aligned entries); each pack is all-reduced in
// place (one launch per GPU for ranks that share one); one unpack kernel
// copies the results out. Packs of a single tensor are reduced where they lie.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <mutex>
#include <vector>

#include "core/communicator.h"
#include "core/dtype.h"
#include "core/reduce_op.h"
#include "cuda/fused.h"

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
  // Per rank: its fusion buffer, and the copy table it uploads when it
  // leads a lane (the ranks of one GPU queued on one stream).
  struct Rank {
    int device = 0;
    int sms = 1;
    void* fusion = nullptr;
    std::size_t fusion_bytes = 0;
    CopyEntry* host_table = nullptr;  // pinned, so the upload is asynchronous
    CopyEntry* device_table = nullptr;
    std::size_t table_entries = 0;
    cudaEvent_t uploaded = nullptr;  // host_table may be rewritten once this completed
    cudaEvent_t used = nullptr;      // device_table may be rewritten after this
    bool pending = false;            // both events were recorded at least once
  };

  // The tables of a call captured into a CUDA graph, which replays them later.
  struct CapturedTable {
    CopyEntry* host = nullptr;
    CopyEntry* device = nullptr;
  };

  void* fusion(int r, std::size_t bytes);
  void reserve_table(int r, std::size_t entries);

  std::vector<Rank> ranks_;
  std::vector<CapturedTable> captured_;
  std::mutex mu_;  // the fusion buffers and tables serve one batch at a time
};

}  // namespace mirrored::cuda
