// A table of kernel arguments kept in pinned host memory and mirrored on one
// device: the owner (GradientPack, FusedUpdateTable) writes entries into
// host(), uploads them on a launch's stream, and launches on device(). Two
// events keep the rewrites safe without a device-wide sync: the host copy is
// rewritten only after the last upload read it, and the device copy only
// after the last launch that used it. Under stream capture the upload is
// recorded with no event (the table then serves that one graph).
//
// Plain host code over the CUDA runtime: the real build and the simulated
// runtime share it.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "cuda/check.h"
#include "cuda/device.h"

namespace mirrored::cuda {

class UploadedTable {
 public:
  // `bytes` (> 0) on `device`, which must be current.
  UploadedTable(int device, std::size_t bytes) : device_(device) {
    MIRRORED_CUDA_CHECK(cudaMallocHost(&host_, bytes));
    MIRRORED_CUDA_CHECK(cudaMalloc(&device_table_, bytes));
    MIRRORED_CUDA_CHECK(cudaEventCreateWithFlags(&uploaded_, cudaEventDisableTiming));
    MIRRORED_CUDA_CHECK(cudaEventCreateWithFlags(&used_, cudaEventDisableTiming));
  }
  ~UploadedTable() {
    DeviceGuard guard;
    if (set_device(device_) != cudaSuccess) return;
    if (pending_) cudaEventSynchronize(used_);  // the last launch reads the table
    cudaFree(device_table_);
    cudaFreeHost(host_);
    cudaEventDestroy(uploaded_);
    cudaEventDestroy(used_);
  }
  UploadedTable(const UploadedTable&) = delete;
  UploadedTable& operator=(const UploadedTable&) = delete;

  void* host() const { return host_; }  // pinned, so the upload is asynchronous
  void* device() const { return device_table_; }

  // Blocks until host() may be rewritten: the last upload has read it.
  void wait_uploaded() {
    if (pending_) MIRRORED_CUDA_CHECK(cudaEventSynchronize(uploaded_));
  }

  // Queues the upload of host()'s first `bytes` on `stream`, after the last
  // launch that used the device table.
  void upload(std::size_t bytes, cudaStream_t stream) {
    if (pending_) MIRRORED_CUDA_CHECK(cudaStreamWaitEvent(stream, used_, 0));
    upload_captured(bytes, stream);
    MIRRORED_CUDA_CHECK(cudaEventRecord(uploaded_, stream));
  }

  // The same inside a stream capture: no event to wait on or record.
  void upload_captured(std::size_t bytes, cudaStream_t stream) {
    MIRRORED_CUDA_CHECK(cudaMemcpyAsync(device_table_, host_, bytes, cudaMemcpyHostToDevice, stream));
  }

  // Marks the launch just queued on `stream` as the device table's last user.
  void used_by(cudaStream_t stream) {
    MIRRORED_CUDA_CHECK(cudaEventRecord(used_, stream));
    pending_ = true;
  }

  // Whether an eager launch used the table (both events were recorded).
  bool pending() const { return pending_; }

 private:
  int device_;
  void* host_ = nullptr;
  void* device_table_ = nullptr;
  cudaEvent_t uploaded_ = nullptr;  // host_ may be rewritten once this completed
  cudaEvent_t used_ = nullptr;      // device_table_ may be rewritten after this (the last launch)
  bool pending_ = false;
};

}  // namespace mirrored::cuda
