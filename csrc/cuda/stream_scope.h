// The streams a device collective is ordered on, one per local rank, set by
// the caller for the duration of a call (like CuPy's "current stream").
// Thread-local, so the Communicator interface stays stream-free and two
// threads may drive collectives at once.
#pragma once

#include <cuda_runtime_api.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "cuda/check.h"

namespace mirrored::cuda {

inline thread_local const std::vector<cudaStream_t>* current_streams_ = nullptr;

class StreamScope {
 public:
  explicit StreamScope(std::vector<cudaStream_t> streams) : streams_(std::move(streams)), saved_(current_streams_) {
    current_streams_ = &streams_;
  }
  ~StreamScope() { current_streams_ = saved_; }
  StreamScope(const StreamScope&) = delete;
  StreamScope& operator=(const StreamScope&) = delete;

 private:
  std::vector<cudaStream_t> streams_;
  const std::vector<cudaStream_t>* saved_;
};

// Rank r's stream: the scope's, or the legacy default stream when none is set.
inline cudaStream_t current_stream(int rank, int nranks) {
  if (current_streams_ == nullptr) return nullptr;
  if (static_cast<int>(current_streams_->size()) != nranks)
    throw std::invalid_argument("streams: got " + std::to_string(current_streams_->size()) + " streams for " +
                                std::to_string(nranks) + " ranks; pass one stream per buffer");
  return (*current_streams_)[rank];
}

// Every rank's stream for a call over n ranks, into `into` (kept by the engine: no allocation per call).
inline void current_streams(int n, std::vector<cudaStream_t>& into) {
  into.resize(n);
  for (int r = 0; r < n; ++r) into[r] = current_stream(r, n);
}

// An event that orders one stream after another (no timing).
inline cudaEvent_t make_event() {
  cudaEvent_t e = nullptr;
  MIRRORED_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  return e;
}

// Whether `stream` is being captured into a CUDA graph, which replays its work long after the call.
inline bool capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  MIRRORED_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
  return status != cudaStreamCaptureStatusNone;
}

}  // namespace mirrored::cuda
