// In-process collectives over CUDA device buffers, one rank per local replica.
// The all-reduce executes csrc/core's RingSchedule (or TreeSchedule) with
// copies and reduce kernels; it never chooses chunks or order itself.
//
// Ranks may share a physical GPU (logical GPUs): their buffers then meet by
// plain device-local copies and kernels. Ranks on different GPUs read each
// other directly when peer access exists, else through a staging buffer.
//
// Every call is asynchronous and ordered on the caller's streams (see
// stream_scope.h): it starts after the work already queued there and work
// queued there afterwards sees its results.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <mutex>
#include <vector>

#include "core/communicator.h"
#include "cuda/fused.h"

namespace mirrored::cuda {

class CudaRing : public Communicator {
 public:
  // devices[r]: CUDA ordinal of rank r (repeated for logical GPUs).
  // chunk_bytes: the least a rank moves per ring step (larger buffers get
  // larger chunks, at most 2 slices per channel); channels: slices in flight
  // per rank, each on its own stream.
  explicit CudaRing(std::vector<int> devices, std::size_t chunk_bytes = std::size_t(1) << 20, int channels = 2);
  ~CudaRing() override;
  CudaRing(const CudaRing&) = delete;
  CudaRing& operator=(const CudaRing&) = delete;

  const char* backend() const override { return "cuda-ring"; }
  int size() const { return static_cast<int>(ranks_.size()); }

  MIRRORED_COMMUNICATOR_COLLECTIVES;

  // The algorithm kAuto resolves to for a message of `bytes` (kDirect: the
  // one-pass kernels of fused.h, one launch per GPU).
  Algorithm choose(std::size_t bytes) const;
  // Whether every rank's kernels can read every rank's memory (one GPU, or
  // peer access between all of them) and the ranks fit one launch.
  bool one_pass_capable() const { return one_pass_; }

 private:
  struct Rank {
    int device = 0;
    int sms = 1;
    std::vector<cudaStream_t> streams;   // one per channel, non-blocking
    cudaEvent_t ready = nullptr;         // recorded on the caller's stream at entry
    std::vector<cudaEvent_t> done;       // per channel, recorded at exit
    std::vector<cudaEvent_t> step[2];    // per channel, by step parity: "my op of this step is done"
    std::vector<void*> scratch;          // per channel, chunk_bytes_, only where staging is needed
    std::vector<bool> direct;            // direct[q]: this rank's kernels may read rank q's memory
  };

  // The ranks of one GPU: one-pass kernels launch once per group.
  struct Group {
    int device = 0;
    int sms = 1;
    std::vector<int> ranks;
  };

  void release() noexcept;
  // Validates n and takes the caller's streams for this call.
  void begin(int n, const char* what);
  // Entry: channels [0, used) of rank r wait for the caller's streams of the
  // ranks whose memory r reads (the ring: r and its predecessor; otherwise
  // all). Exit: each caller stream waits for the channels of the ranks that
  // read its memory (the ring: r and its successor; otherwise all).
  void fork(int used, bool ring);
  // The scratch of channels [0, used) of every rank that folds a peer's data through it (no direct access to
  // some rank), taken before a folding collective queues anything: an OutOfMemory leaves no half-issued work.
  void stage(int used);
  void join(int used, bool ring);

  // out = a (op) b on rank r's channel c, where a is r's own memory and b is
  // rank q's; staged through r's scratch when r cannot read q directly.
  void fold(int r, int c, void* out, const void* a, const void* b, int q, std::size_t count, DType dtype, ReduceOp op,
            int mean_div);
  // dst (rank r's) = src (rank q's), on r's channel c.
  void copy(int r, int c, void* dst, const void* src, int q, std::size_t bytes);
  void* scratch(int r, int c);
  // Elements per rank and ring step for a buffer of `count`.
  std::size_t ring_chunk_elems(int n, std::size_t count, std::size_t elem_size) const;

  void gather_rows(int r, void* dst, std::size_t dst_pitch, const void* src, int q, std::size_t width,
                   std::size_t rows);
  // Runs launch(g, stream) once per GPU group on a caller stream of that
  // GPU, ordered after every caller stream's queued work and before its
  // later work. When every rank uses one stream of one GPU (the common
  // case) that is a bare launch: no event at all.
  template <typename F>
  void one_pass(F launch);
  // The same with `phases` rounds of launch(g, stream, phase), each round
  // after every GPU finished the previous one (an event barrier).
  template <typename F>
  void phased(int phases, F launch);
  // Ranks on distinct GPUs with peer access, in place or large: GPU r
  // reduces slice r of every input into its output (reading its peers),
  // then, after a barrier, gathers the other slices from its peers' outputs.
  // Two launches per GPU, 2(n-1)/n·S bytes over the links each way, like
  // the ring, where the ring takes 2(n-1) dependent steps.
  void two_shot_all_reduce(const void* const* in, void* const* out, std::size_t count, DType dtype, ReduceOp op);
  void direct_all_reduce(const void* const* in, void* const* out, std::size_t count, DType dtype, ReduceOp op);
  void ring_all_reduce(const void* const* in, void* const* out, std::size_t count, DType dtype, ReduceOp op);
  void tree_all_reduce(const void* const* in, void* const* out, std::size_t count, DType dtype, ReduceOp op);

  std::vector<Rank> ranks_;
  std::vector<Group> groups_;
  bool one_pass_ = false;
  std::vector<cudaStream_t> callers_;  // the caller's streams for the call in progress
  std::vector<int> uniq_;              // phased()'s distinct caller streams, kept to reuse its memory
  std::size_t chunk_bytes_;
  int channels_;
  std::mutex mu_;
};

}  // namespace mirrored::cuda
