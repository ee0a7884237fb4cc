// A replica's gradients copied into its fusion buffers (the optimizer's pack,
// before the all-reduce and the fused update) in one multi_copy launch per
// step, whatever the tensor count. The (src, dst, bytes) table is built once:
// the destinations and sizes never change, and the sources are rewritten (and
// the table uploaded again, from pinned memory, on the launch's stream) only
// when a gradient's address changes.
//
// Under stream capture (md.function) nothing of this may be rewritten later:
// a pack serves one captured graph, whose replays re-run the upload from its
// pinned host table and the copy. It must live as long as that graph.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <optional>
#include <vector>

#include "cuda/fused.h"
#include "cuda/uploaded_table.h"

namespace mirrored::cuda {

class GradientPack {
 public:
  // dst[k]: where gradient k goes on `device`, bytes[k] long (0: skipped).
  GradientPack(int device, const std::vector<void*>& dst, const std::vector<std::size_t>& bytes);
  GradientPack(const GradientPack&) = delete;
  GradientPack& operator=(const GradientPack&) = delete;

  int device() const { return device_; }
  std::size_t size() const { return dst_.size(); }

  // Copies src[k] (device memory readable from `device`, bytes[k] long) to
  // dst[k] for every k: one launch on `stream`, a stream of the table's device
  // (current). The table is uploaded first when a source moved since the last
  // call.
  void copy(const std::vector<const void*>& src, cudaStream_t stream);

  // The same, recorded into the graph `stream` is capturing: the upload and the
  // launch, with no event and no host wait. The pack then serves that graph only.
  void copy_captured(const std::vector<const void*>& src, cudaStream_t stream);

 private:
  // Points the host table at `src`; whether any source changed.
  bool point_at(const std::vector<const void*>& src);
  CopyEntry* host_table() const;

  int device_;
  int sms_ = 1;
  std::vector<void*> dst_;
  std::vector<std::size_t> bytes_;
  std::vector<int> entry_of_;         // gradient k's entry in the table, or -1 (0 bytes)
  int entries_ = 0;                   // non-empty copies
  std::size_t slots_ = 0;             // 16-byte slots of all entries
  std::optional<UploadedTable> table_;  // entries_ CopyEntry; made once entries_ is counted
  bool device_matches_ = false;       // the device table holds (or its queued upload gives) the host table's sources
  bool captured_ = false;             // copy_captured was called: the pack belongs to a graph
};

}  // namespace mirrored::cuda
