// One check for every CUDA runtime call: a failure becomes an exception whose
// message names the call and carries CUDA's own error name and text. Device
// and pinned memory come from device_malloc / host_malloc, whose failure for
// want of memory is an OutOfMemory naming the bytes, the device and the use
// (the bindings raise it as md.errors.ResourceExhaustedError).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <stdexcept>
#include <string>

namespace mirrored::cuda {

inline void check(cudaError_t err, const char* call) {
  if (err == cudaSuccess) return;
  throw std::runtime_error(std::string(call) + " failed: " + cudaGetErrorName(err) + ": " + cudaGetErrorString(err));
}

// An allocation the device (or pinned host memory) could not satisfy.
class OutOfMemory : public std::runtime_error {
 public:
  // device: the GPU's ordinal, -1 for pinned host memory; purpose: what the engine wanted the memory for.
  OutOfMemory(std::size_t bytes, int device, const char* purpose)
      : std::runtime_error("OOM when allocating " + std::to_string(bytes) + " bytes for the engine's " + purpose +
                           (device < 0 ? std::string(" in pinned host memory") : " on GPU " + std::to_string(device))),
        bytes_(bytes), device_(device), purpose_(purpose) {}
  std::size_t bytes() const { return bytes_; }
  int device() const { return device_; }
  const std::string& purpose() const { return purpose_; }

 private:
  std::size_t bytes_;
  int device_;
  std::string purpose_;
};

// `bytes` of device memory on the current device (cudaMalloc), for `purpose`; OutOfMemory when the device has
// no room. Nothing is allocated when it throws.
inline void* device_malloc(std::size_t bytes, const char* purpose) {
  void* p = nullptr;
  const cudaError_t err = cudaMalloc(&p, bytes);
  if (err == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();  // not sticky: the device stays usable, and the next call must not see it
    int device = -1;
    (void)cudaGetDevice(&device);
    throw OutOfMemory(bytes, device, purpose);
  }
  check(err, "cudaMalloc");
  return p;
}

// `bytes` of pinned host memory (cudaMallocHost), for `purpose`; OutOfMemory when there is no room.
inline void* host_malloc(std::size_t bytes, const char* purpose) {
  void* p = nullptr;
  const cudaError_t err = cudaMallocHost(&p, bytes);
  if (err == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();
    throw OutOfMemory(bytes, -1, purpose);
  }
  check(err, "cudaMallocHost");
  return p;
}

}  // namespace mirrored::cuda

#define MIRRORED_CUDA_CHECK(call) ::mirrored::cuda::check((call), #call)
