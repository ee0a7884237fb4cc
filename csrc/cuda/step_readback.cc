// StepReadback (step_readback.h): a ring of pinned slots, each with the event
// its copy completes.
#include "cuda/step_readback.h"

#include <algorithm>
#include <stdexcept>

#include "cuda/check.h"
#include "cuda/device.h"

namespace mirrored::cuda {

StepReadback::StepReadback(int device, int slots) : device_(device) {
  if (slots < 1) throw std::invalid_argument("StepReadback: slots must be >= 1");
  check_ordinal(device, "device");
  MIRRORED_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&host_), slots * sizeof(rules::StepStatus)));
  slots_.resize(static_cast<std::size_t>(slots));
  for (Slot& s : slots_) MIRRORED_CUDA_CHECK(cudaEventCreateWithFlags(&s.copied, cudaEventDisableTiming));
}

StepReadback::~StepReadback() {
  DeviceGuard guard;
  if (set_device(device_) != cudaSuccess) return;
  // Copies still in flight write into host_: they land before it goes.
  for (std::size_t i = 0; i < count_; ++i) cudaEventSynchronize(slots_[(first_ + i) % slots_.size()].copied);
  for (Slot& s : slots_) cudaEventDestroy(s.copied);
  cudaFreeHost(host_);
}

bool StepReadback::record(const rules::StepStatus* status, long long tag, cudaStream_t stream) {
  if (count_ == slots_.size()) return false;
  const std::size_t at = (first_ + count_) % slots_.size();
  MIRRORED_CUDA_CHECK(
      cudaMemcpyAsync(host_ + at, status, sizeof(rules::StepStatus), cudaMemcpyDeviceToHost, stream));
  MIRRORED_CUDA_CHECK(cudaEventRecord(slots_[at].copied, stream));
  slots_[at].tag = tag;
  ++count_;
  return true;
}

StepReadback::Reading StepReadback::take_oldest() {
  const Reading reading{slots_[first_].tag, host_[first_]};
  first_ = (first_ + 1) % slots_.size();
  --count_;
  return reading;
}

std::vector<StepReadback::Reading> StepReadback::arrived() {
  std::vector<Reading> out;
  while (count_ > 0) {
    // Copies on one stream complete in order, but the records may span streams: stop at the first that has not
    // arrived, so readings stay in the order they were taken.
    const cudaError_t done = cudaEventQuery(slots_[first_].copied);
    if (done == cudaErrorNotReady) break;
    MIRRORED_CUDA_CHECK(done);
    out.push_back(take_oldest());
  }
  return out;
}

std::vector<StepReadback::Reading> StepReadback::wait(int n) {
  if (count_ == 0) return {};
  const std::size_t k = std::min<std::size_t>(count_, static_cast<std::size_t>(std::max(n, 1)));
  MIRRORED_CUDA_CHECK(cudaEventSynchronize(slots_[(first_ + k - 1) % slots_.size()].copied));
  return arrived();
}

}  // namespace mirrored::cuda
