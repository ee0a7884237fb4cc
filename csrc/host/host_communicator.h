// Collectives over the host buffers of n in-process replicas: one call with
// all n buffers, run on the persistent thread pool. The ring and tree
// algorithms execute the schedules of csrc/core; "direct" has each worker
// fold its slice of all n inputs and write it to every output.
#pragma once

#include <cstddef>
#include <mutex>
#include <vector>

#include "core/communicator.h"
#include "core/packer.h"
#include "host/reduce_kernels.h"
#include "host/thread_pool.h"

namespace mirrored {

class HostCommunicator final : public Communicator {
 public:
  explicit HostCommunicator(ThreadPool& pool = ThreadPool::global());

  const char* backend() const override { return "host"; }
  void all_reduce(int n, const void* const* in, void* const* out, std::size_t count, DType dtype, ReduceOp op,
                  Algorithm algorithm) override {
    all_reduce(n, in, out, count, dtype, op, algorithm, 0);
  }
  // ring_chunk_bytes: bytes per participant per ring step (0: the default).
  void all_reduce(int n, const void* const* in, void* const* out, std::size_t count, DType dtype, ReduceOp op,
                  Algorithm algorithm, std::size_t ring_chunk_bytes);
  void broadcast(int n, const void* const* in, void* const* out, std::size_t count, DType dtype, int root) override;
  void reduce(int n, const void* const* in, void* const* out, std::size_t count, DType dtype, ReduceOp op,
              int root) override;
  void all_gather(int n, const void* const* in, void* const* out, const std::size_t* row_bytes,
                  std::size_t outer) override;

  // ntensors tensors per replica: in[r * ntensors + t] is tensor t of replica
  // r (counts[t] elements of dtypes[t]). Tensors are fused into packs (see
  // core/packer.h) and each pack is reduced in one pass.
  void batch_all_reduce(int n, int ntensors, const void* const* in, void* const* out, const std::size_t* counts,
                        const DType* dtypes, ReduceOp op, std::size_t bytes_per_pack, int num_packs,
                        Algorithm algorithm, std::size_t ring_chunk_bytes = 0);

  // The algorithm `auto` resolves to for n replicas of `bytes` each.
  static Algorithm choose(int n, std::size_t bytes);
  const char* isa() const { return kernels_.isa; }

 private:
  // Runs fn(item) for items in [0, items): inline when the job touches
  // fewer than kParallelBytes (waking the pool would cost more), else on the
  // pool.
  template <typename Fn>
  void for_items(std::size_t items, std::size_t bytes_touched, Fn&& fn);
  void direct(int n, const void* const* in, void* const* out, std::size_t count, DType dtype, ReduceOp op);
  void ring(int n, const void* const* in, void* const* out, std::size_t count, DType dtype, ReduceOp op,
            std::size_t chunk_bytes);
  void tree(int n, const void* const* in, void* const* out, std::size_t count, DType dtype, ReduceOp op);
  // Folds [begin, end) of all inputs into out[first] and copies it to the
  // other outputs (all of them when every_output, else none); with `stream`,
  // folds in a cache-resident scratch block and streams it to the outputs.
  void fold_range(int n, const void* const* in, void* const* out, int first, bool every_output, std::size_t begin,
                  std::size_t end, DType dtype, ReduceOp op, bool stream) const;
  // Whether an all-reduce of n buffers of `bytes` should bypass the cache.
  static bool streams(int n, const void* const* in, void* const* out, std::size_t bytes);
  const std::vector<Pack>& packs_for(int ntensors, const std::size_t* counts, const DType* dtypes,
                                     std::size_t bytes_per_pack, int num_packs);

  ThreadPool& pool_;
  const ReduceKernels& kernels_;

  // Fusion state, reused across calls (grow-only), guarded by batch_mu_.
  std::mutex batch_mu_;
  std::vector<std::vector<char>> fusion_;
  std::vector<void*> fusion_ptrs_;
  std::vector<std::size_t> plan_bytes_;
  std::vector<DType> plan_dtypes_;
  std::size_t plan_bytes_per_pack_ = 0;
  int plan_num_packs_ = -1;
  std::vector<Pack> plan_;
};

}  // namespace mirrored
