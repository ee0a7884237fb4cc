// The hierarchical engine for replicas on several GPUs where some GPUs host
// several replicas (logical GPUs), as Horovod's hierarchical all-reduce:
// NCCL refuses two ranks on one GPU, so each GPU first folds its replicas'
// buffers into one with a single kernel (the one-pass kernels of fused.h),
// NCCL all-reduces one buffer per GPU across the GPUs (one NCCL rank per
// physical GPU, in place), and one more kernel per GPU writes the result to
// that GPU's replicas' outputs.
//
// Everything is queued on the GPUs' own streams with no host wait and no
// event between GPUs (NCCL's kernels meet on the device), so a CUDA graph
// per GPU can capture it (md.function). GPUs may host different numbers of
// replicas (at most kMaxFused on one GPU): the local fold makes every GPU one
// NCCL rank whatever its count.
//
// reduce folds each GPU's replicas the same way (into a buffer of the
// engine's on GPUs other than the root's) and NCCL-reduces to the root's GPU.
// all_gather, where every GPU hosts the same number of consecutive replicas
// and the rows are equal (axis 0): each GPU gathers its replicas into its
// block of the first one's output, NCCL all-gathers the blocks in place, one
// kernel hands the whole out. Other gathers run on the native engine
// (CudaRing) over the same replicas.
#pragma once

#include <cuda_runtime_api.h>

#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "core/communicator.h"
#include "cuda/cuda_ring.h"
#include "nccl/nccl_communicator.h"

namespace mirrored::nccl {

class HierarchicalCommunicator : public Communicator {
 public:
  // devices[r]: CUDA ordinal of replica r; repeats are logical GPUs. NCCL must be loaded.
  explicit HierarchicalCommunicator(std::vector<int> devices);
  ~HierarchicalCommunicator() override;
  HierarchicalCommunicator(const HierarchicalCommunicator&) = delete;
  HierarchicalCommunicator& operator=(const HierarchicalCommunicator&) = delete;

  const char* backend() const override { return "nccl-hierarchical"; }
  bool one_output_per_gpu() const override { return true; }
  int size() const { return static_cast<int>(devices_.size()); }
  int gpus() const { return static_cast<int>(groups_.size()); }

  // all_reduce: per GPU, fold its replicas into the first one's output, NCCL
  // all-reduce those across GPUs, copy to the other outputs (MEAN divides
  // there, by the replica count); outputs equal to the first one's get no
  // copy. `algorithm` is NCCL's own choice; any value is accepted.
  // broadcast: NCCL broadcasts from the root's GPU into one output per GPU;
  // one copy kernel per GPU writes the other outputs there.
  // reduce: folds each GPU's replicas, NCCL-reduces to the root's GPU into
  // out[root] (MEAN divides there); no other output is written.
  // all_gather: by GPU where it can (see the file comment), else the native engine's.
  MIRRORED_COMMUNICATOR_COLLECTIVES;

 private:
  // The replicas of one GPU: `ranks[0]` leads (its output is the GPU's NCCL buffer).
  struct Group {
    int device = 0;
    int sms = 1;
    std::vector<int> ranks;
    cudaEvent_t ready = nullptr;  // a member on another stream: recorded there, waited for by the lead's
    cudaEvent_t done = nullptr;   // recorded on the lead's stream at exit, waited for by such members
    // reduce's fold buffer on a GPU without the root; `used` is recorded after the NCCL call that read it
    // last, on stream `last`: a call on another stream waits for it before the fold overwrites it.
    void* fold = nullptr;
    std::size_t fold_bytes = 0;
    cudaEvent_t used = nullptr;
    cudaStream_t last = nullptr;
    bool pending = false;
  };

  void release() noexcept;
  void begin(int n, const char* what);
  // Runs f() with each GPU's members' queued work ordered before the lead's stream, and their later
  // work after it (events on one GPU only; nothing when a GPU's replicas share a stream).
  template <typename F>
  void on_leads(F f);
  cuda::CudaRing& native();
  // Whether all_gather can go by GPU: equal rows, outer == 1, every GPU the same number of consecutive replicas.
  bool gathers_by_gpu(const std::size_t* row_bytes, std::size_t outer) const;
  // A fold buffer of `bytes` for GPU k's reduce on its lead stream (a capture gets one of its own: its
  // graph replays it long after the call, so it is never rewritten; it lives as long as this engine).
  void* fold_buffer(std::size_t k, std::size_t bytes, bool captured);

  std::vector<int> devices_;
  std::vector<Group> groups_;
  std::vector<cudaStream_t> callers_;  // each replica's stream for the call in progress
  std::vector<cudaStream_t> leads_;    // each GPU's lead stream for the call in progress
  std::unique_ptr<NcclCommunicator> across_;  // one rank per GPU
  std::unique_ptr<cuda::CudaRing> native_;    // made at the first all_gather it cannot do by GPU
  std::vector<std::pair<int, void*>> captured_;  // (GPU, buffer) of captured reduces' folds
  std::mutex mu_;
};

}  // namespace mirrored::nccl
