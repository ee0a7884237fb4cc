#include "cuda/device.h"

#include <cuda_runtime_api.h>

#include <exception>
#include <stdexcept>

#include "cuda/check.h"

namespace mirrored::cuda {

int device_count() noexcept {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // no driver / no device: not an error for us, and not sticky
    return 0;
  }
  return n;
}

DeviceProperties device_properties(int ordinal) {
  check_ordinal(ordinal, "ordinal");
  cudaDeviceProp p{};
  MIRRORED_CUDA_CHECK(cudaGetDeviceProperties(&p, ordinal));
  return {p.name, p.totalGlobalMem, p.multiProcessorCount, p.major, p.minor};
}

void check_ordinal(int ordinal, const char* argument) {
  const int n = device_count();
  if (ordinal < 0 || ordinal >= n)
    throw std::invalid_argument(std::string(argument) + ": GPU " + std::to_string(ordinal) + " does not exist (" +
                                std::to_string(n) + " visible; check CUDA_VISIBLE_DEVICES)");
}

namespace {
thread_local DeviceGuard* innermost = nullptr;
}  // namespace

DeviceGuard::DeviceGuard() : outer_(innermost), unwinding_(std::uncaught_exceptions()) {
  if (cudaGetDevice(&saved_) != cudaSuccess) saved_ = -1;
  current_ = saved_;
  innermost = this;
}

DeviceGuard::~DeviceGuard() {
  innermost = outer_;
  // On an error's unwinding the record is not trusted: a library call that failed may have left
  // another device current (NCCL's group end skips its own restore when it fails).
  if (saved_ >= 0 && (current_ != saved_ || std::uncaught_exceptions() > unwinding_)) cudaSetDevice(saved_);
}

cudaError_t set_device(int device) noexcept {
  DeviceGuard* g = innermost;
  if (g != nullptr && g->current_ == device) return cudaSuccess;
  const cudaError_t err = cudaSetDevice(device);
  if (g != nullptr) g->current_ = err == cudaSuccess ? device : -1;  // after a failure: unknown, so switch next time
  return err;
}

}  // namespace mirrored::cuda
