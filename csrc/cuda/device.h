// What the CUDA runtime can see, asked without ever throwing: a machine with
// no driver or no GPU simply has 0 devices.
#pragma once

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

// Restores the calling thread's current device when a call returns.
class DeviceGuard {
 public:
  DeviceGuard();
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int saved_ = -1;
};

}  // namespace mirrored::cuda
