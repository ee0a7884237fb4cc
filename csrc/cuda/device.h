// What the CUDA runtime can see, asked without ever throwing: a machine with
// no driver or no GPU simply has 0 devices.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <string>

namespace mirrored::cuda {

int device_count() noexcept;

struct DeviceProperties {
  std::string name;
  std::size_t total_memory;
  int multiprocessors;
  int major, minor;
};
DeviceProperties device_properties(int ordinal);

// Validates an ordinal against device_count(), naming `argument` on failure.
void check_ordinal(int ordinal, const char* argument);

// Restores the calling thread's current device when a call returns, if the
// call switched away from it. Inside a guard, switch devices only with
// set_device(): it skips the switch to the device already current, so a
// collective whose ranks all live on the caller's GPU makes no switch at all.
// Library calls inside a guard must leave the device as they found it (the
// CUDA libraries, cuBLAS and NCCL do when they succeed); on an error's
// unwinding the guard restores the caller's device whatever its record says.
class DeviceGuard {
 public:
  DeviceGuard();
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  friend cudaError_t set_device(int device) noexcept;
  DeviceGuard* outer_;  // the guard this one is nested in (per thread)
  int saved_ = -1;      // the device at entry; -1 when cudaGetDevice failed
  int current_ = -1;    // the device current now, as this guard saw it set
  int unwinding_;       // std::uncaught_exceptions() at entry: more at exit means an error is unwinding
};

// cudaSetDevice(device), or nothing when the innermost DeviceGuard of this
// thread knows `device` is current already.
cudaError_t set_device(int device) noexcept;

}  // namespace mirrored::cuda
