// One check for every CUDA runtime call: a failure becomes an exception whose
// message names the call and carries CUDA's own error name and text.
#pragma once

#include <cuda_runtime_api.h>

#include <stdexcept>
#include <string>

namespace mirrored::cuda {

inline void check(cudaError_t err, const char* call) {
  if (err == cudaSuccess) return;
  throw std::runtime_error(std::string(call) + " failed: " + cudaGetErrorName(err) + ": " + cudaGetErrorString(err));
}

}  // namespace mirrored::cuda

#define MIRRORED_CUDA_CHECK(call) ::mirrored::cuda::check((call), #call)
