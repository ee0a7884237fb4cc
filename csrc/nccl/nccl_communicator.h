// NCCL behind the Communicator interface: one NCCL rank per local GPU, driven
// from one thread with group calls. Either all ranks are local
// (ncclCommInitAll) or this process holds ranks [first_rank, first_rank + n)
// of a job of `nranks` joined through a unique id (multi-worker).
// Calls are ordered on the current streams (cuda/stream_scope.h).
#pragma once

#include <mutex>
#include <string>
#include <vector>

#include "core/communicator.h"
#include "nccl/nccl_lib.h"

namespace mirrored::nccl {

class NcclCommunicator : public Communicator {
 public:
  // All ranks in this process, one per device; NCCL refuses two ranks on one GPU.
  explicit NcclCommunicator(std::vector<int> devices);
  // Ranks first_rank.. of a multi-process job sharing `unique_id` (128 bytes).
  NcclCommunicator(const std::string& unique_id, int first_rank, int nranks, std::vector<int> devices);
  ~NcclCommunicator() override;
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  const char* backend() const override { return "nccl"; }
  int size() const { return static_cast<int>(comms_.size()); }
  int nranks() const { return nranks_; }

  // all_reduce: `algorithm` is NCCL's own choice; any value is accepted. MEAN is ncclAvg.
  // broadcast, reduce: `root` is a rank of the whole job (the local index when all ranks are local).
  // all_gather: equal row sizes and outer == 1 only (NCCL's all-gather is rank-major).
  MIRRORED_COMMUNICATOR_COLLECTIVES;

 private:
  void begin(int n, const char* what) const;
  int nccl_op(ReduceOp op) const;
  // Runs f(local_rank, stream) for every local rank inside one NCCL group.
  template <typename F>
  void group(int n, F f);

  const Library& lib_;
  std::vector<int> devices_;
  std::vector<Comm> comms_;
  int nranks_ = 0;
  std::mutex mu_;  // one group at a time: NCCL calls on a communicator must not interleave
};

// A fresh unique id (128 bytes) for NcclCommunicator's multi-process constructor.
std::string unique_id();

}  // namespace mirrored::nccl
