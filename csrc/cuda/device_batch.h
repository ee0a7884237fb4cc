// Fused all-reduce of many tensors per rank over any device Communicator
// (the CUDA ring or NCCL), in a constant number of launches and driver calls
// whatever the tensor count.
//
// Ranks that all share one GPU (logical GPUs, the CUDA ring) take one pass:
// one multi_reduce kernel per dtype reads every rank's input tensors and
// writes every rank's outputs, from an uploaded table of per-tensor pointers
// and counts (2·n·S bytes, the least any all-reduce moves).
//
// Otherwise the packs (planned once per batch by plan()) travel through one
// fusion buffer per rank: one upload of a (src, dst, bytes) table per GPU and
// stream; one pack kernel per GPU and stream copies every tensor of every
// multi-tensor pack into the fusion buffer (16-byte aligned entries); each
// pack is all-reduced in place (one launch per GPU for ranks that share one);
// one unpack kernel copies the results out. Packs of a single tensor are
// reduced where they lie.
//
// The host never waits for the GPU in steady state: tables come from a ring
// of kTables per GPU and stream leader, and a table is rewritten only once
// the batch that last read it is done (a wait only when the GPU is kTables
// batches behind).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <mutex>
#include <vector>

#include "core/communicator.h"
#include "core/dtype.h"
#include "core/packer.h"
#include "core/reduce_op.h"
#include "cuda/fused.h"

namespace mirrored::cuda {

class DeviceBatch {
 public:
  // A batch's tensors and packing, planned once and used by every call of that batch.
  struct Layout {
    // A multi-tensor pack placed in the fusion buffers: its byte offset
    // there, each entry's offset (16-byte aligned, so the copies move whole
    // vectors), and the elements its all-reduce covers (the padding between
    // entries is reduced too, and never read).
    struct Placed {
      std::size_t pack;  // index into packs
      std::size_t offset;
      std::vector<std::size_t> entry_offset;
      std::size_t count;
    };
    // The non-empty tensors of one dtype (one multi_reduce launch) and their 16-byte slots.
    struct Group {
      DType dtype;
      std::vector<std::size_t> tensors;
      std::size_t slots = 0;
    };
    std::vector<std::size_t> counts;
    std::vector<DType> dtypes;
    std::vector<Pack> packs;
    std::vector<Placed> placed;
    std::size_t fused_bytes = 0;   // one copy of the packs in a fusion buffer
    std::size_t live_entries = 0;  // non-empty entries of the multi-tensor packs
    std::vector<Group> groups;
  };
  static Layout plan(std::vector<std::size_t> counts, std::vector<DType> dtypes, std::size_t bytes_per_pack,
                     int num_packs);

  explicit DeviceBatch(std::vector<int> devices);
  ~DeviceBatch();
  DeviceBatch(const DeviceBatch&) = delete;
  DeviceBatch& operator=(const DeviceBatch&) = delete;

  // in[r][t], out[r][t]: tensor t of rank r (out may equal in), of the
  // layout's counts and dtypes. Ordered on the current streams (stream_scope.h).
  void all_reduce(Communicator& comm, const std::vector<std::vector<const void*>>& in,
                  const std::vector<std::vector<void*>>& out, const Layout& layout, ReduceOp op, Algorithm algorithm);
  // The same, planning the layout for this call.
  void all_reduce(Communicator& comm, const std::vector<std::vector<const void*>>& in,
                  const std::vector<std::vector<void*>>& out, const std::vector<std::size_t>& counts,
                  const std::vector<DType>& dtypes, ReduceOp op, Algorithm algorithm, std::size_t bytes_per_pack,
                  int num_packs) {
    all_reduce(comm, in, out, plan(counts, dtypes, bytes_per_pack, num_packs), op, algorithm);
  }

  static constexpr int kTables = 4;

 private:
  // A table upload's pinned host copy and device copy; `done` is recorded after the last kernel that
  // reads it (which follows the upload on its stream, so both copies are free once it completed).
  struct Table {
    char* host = nullptr;
    char* device = nullptr;
    std::size_t bytes = 0;
    cudaEvent_t done = nullptr;
    bool pending = false;  // done was recorded
  };

  // Per rank: its fusion buffer, and the tables it uploads when it leads a
  // lane (the ranks of one GPU queued on one stream).
  struct Rank {
    int device = 0;
    int sms = 1;
    void* fusion = nullptr;
    std::size_t fusion_bytes = 0;
    Table tables[kTables];
    int next_table = 0;
    cudaEvent_t ready = nullptr;  // one-pass: recorded on this rank's stream, waited for by the leader's
    cudaEvent_t used = nullptr;   // the last batch this rank led is done with its fusion buffer (or finished)
    bool pending = false;         // used was recorded at least once
  };

  // The tables of a call captured into a CUDA graph, which replays them later.
  struct CapturedTable {
    char* host = nullptr;
    char* device = nullptr;
  };

  void* fusion(int r, std::size_t bytes);
  // Rank r's device current, its attributes and events made.
  void prepare(int r);
  // A table of `bytes` for rank r leading a lane on `stream` (captured: a graph-private one, returned as
  // nullptr). *host and *device are set.
  Table* table(int r, std::size_t bytes, bool captured, char** host, char** device);
  void one_pass(const std::vector<std::vector<const void*>>& in, const std::vector<std::vector<void*>>& out,
                const Layout& layout, ReduceOp op);
  void packed(Communicator& comm, const std::vector<std::vector<const void*>>& in,
              const std::vector<std::vector<void*>>& out, const Layout& layout, ReduceOp op, Algorithm algorithm);

  std::vector<Rank> ranks_;
  bool one_gpu_ = true;  // every rank on one GPU
  std::vector<CapturedTable> captured_;
  std::mutex mu_;  // the fusion buffers and tables serve one batch at a time
};

}  // namespace mirrored::cuda
