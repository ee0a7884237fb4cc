// The host's view of a step count a GPU keeps (a LossScaleOptimizer's
// `iterations`, which a skipped step leaves where it was), learnt without
// waiting for the GPU: each step queues an asynchronous 16-byte copy of the
// rules::StepStatus the select kernel wrote into a pinned slot and records an
// event there; the host later takes the copies that have arrived
// (cudaEventQuery, never a wait). Slots are reused in order, each once its
// copy arrived; with every slot in flight a record is skipped, the earlier
// ones bring a count soon enough.
//
// Plain host code over the CUDA runtime: the real build and the simulated
// runtime share it.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <vector>

#include "core/optimizer_rules.h"

namespace mirrored::cuda {

class StepReadback {
 public:
  struct Reading {
    long long tag;  // the caller's, given to record()
    rules::StepStatus status;
  };

  // `slots` (>= 1) copies in flight at most, on `device`, which must be current.
  StepReadback(int device, int slots);
  ~StepReadback();
  StepReadback(const StepReadback&) = delete;
  StepReadback& operator=(const StepReadback&) = delete;

  int device() const { return device_; }
  int in_flight() const { return static_cast<int>(count_); }

  // Queues the copy of `*status` (device memory) on `stream`, tagged `tag`;
  // false (nothing queued) when every slot is in flight.
  bool record(const rules::StepStatus* status, long long tag, cudaStream_t stream);

  // The copies that have arrived, oldest first, their slots freed; no wait.
  std::vector<Reading> arrived();

  // Waits for the `n`-th oldest copy in flight (at least the oldest, at most
  // the newest), then returns arrived(): every copy up to it, at least.
  std::vector<Reading> wait(int n);

 private:
  struct Slot {
    cudaEvent_t copied = nullptr;
    long long tag = 0;
  };
  Reading take_oldest();

  int device_;
  rules::StepStatus* host_ = nullptr;  // pinned: one StepStatus per slot
  std::vector<Slot> slots_;
  std::size_t first_ = 0;  // the oldest slot in flight
  std::size_t count_ = 0;  // slots in flight, from first_ on (cyclically)
};

}  // namespace mirrored::cuda
