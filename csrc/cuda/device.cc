#include "cuda/device.h"

#include <cuda_runtime_api.h>

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

DeviceGuard::DeviceGuard() {
  if (cudaGetDevice(&saved_) != cudaSuccess) saved_ = -1;
}

DeviceGuard::~DeviceGuard() {
  if (saved_ >= 0) cudaSetDevice(saved_);
}

}  // namespace mirrored::cuda
