// A table of kernel arguments kept in pinned host memory and mirrored on one
// device: the owner (GradientPack, FusedUpdateTable) writes entries into
// host(), uploads them on a launch's stream, and launches on device(). Events
// keep the rewrites safe without a device-wide sync: the device copy is
// rewritten only after the last launch that used it (a wait of the stream, not
// of the host), and the host copy is one of kHostCopies pinned copies used in
// turn, so rewriting it waits only for the upload kHostCopies uploads ago (a
// host that many steps ahead of the GPU; an upload runs as soon as the launch
// before it, so it is mostly done). Under stream capture the upload is
// recorded with no event (the table then serves that one graph).
//
// Plain host code over the CUDA runtime: the real build and the simulated
// runtime share it.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstring>

#include "cuda/check.h"
#include "cuda/device.h"

namespace mirrored::cuda {

class UploadedTable {
 public:
  static constexpr int kHostCopies = 4;

  // `bytes` (> 0) on `device`, which must be current.
  // The device memory first: when the GPU is out of memory the OutOfMemory leaves nothing behind (a throwing
  // constructor runs no destructor).
  UploadedTable(int device, std::size_t bytes) : device_(device), bytes_(bytes) {
    device_table_ = device_malloc(bytes, "uploaded table");
    for (Copy& c : host_) {
      MIRRORED_CUDA_CHECK(cudaMallocHost(&c.data, bytes));
      MIRRORED_CUDA_CHECK(cudaEventCreateWithFlags(&c.uploaded, cudaEventDisableTiming));
    }
    MIRRORED_CUDA_CHECK(cudaEventCreateWithFlags(&used_, cudaEventDisableTiming));
  }
  ~UploadedTable() {
    DeviceGuard guard;
    if (set_device(device_) != cudaSuccess) return;
    if (pending_) cudaEventSynchronize(used_);  // the last launch reads the table
    for (Copy& c : host_)
      if (c.queued) cudaEventSynchronize(c.uploaded);  // an upload still reads it
    cudaFree(device_table_);
    for (Copy& c : host_) {
      cudaFreeHost(c.data);
      cudaEventDestroy(c.uploaded);
    }
    cudaEventDestroy(used_);
  }
  UploadedTable(const UploadedTable&) = delete;
  UploadedTable& operator=(const UploadedTable&) = delete;

  void* host() const { return host_[current_].data; }  // pinned, so the upload is asynchronous
  void* device() const { return device_table_; }

  // Makes host() a copy that may be rewritten, holding the current one's
  // bytes: the next of the pinned copies, once the upload that last read it
  // is done (a wait only when the host is kHostCopies uploads ahead).
  void rewrite() {
    Copy& next = host_[(current_ + 1) % kHostCopies];
    if (next.queued) {
      const cudaError_t done = cudaEventQuery(next.uploaded);
      if (done == cudaErrorNotReady) {
        MIRRORED_CUDA_CHECK(cudaEventSynchronize(next.uploaded));
      } else {
        MIRRORED_CUDA_CHECK(done);
      }
    }
    next.queued = false;
    std::memcpy(next.data, host_[current_].data, bytes_);
    current_ = (current_ + 1) % kHostCopies;
  }

  // Queues the upload of host()'s first `bytes` on `stream`, after the last
  // launch that used the device table.
  void upload(std::size_t bytes, cudaStream_t stream) {
    after_last_use(stream);
    upload_captured(bytes, stream);
    MIRRORED_CUDA_CHECK(cudaEventRecord(host_[current_].uploaded, stream));
    host_[current_].queued = true;
  }

  // The same inside a stream capture: no event to wait on or record.
  void upload_captured(std::size_t bytes, cudaStream_t stream) {
    MIRRORED_CUDA_CHECK(cudaMemcpyAsync(device_table_, host(), bytes, cudaMemcpyHostToDevice, stream));
  }

  // Orders `stream`'s next work after the last launch that used the device table.
  void after_last_use(cudaStream_t stream) {
    if (pending_) MIRRORED_CUDA_CHECK(cudaStreamWaitEvent(stream, used_, 0));
  }

  // Marks the launch just queued on `stream` as the device table's last user.
  void used_by(cudaStream_t stream) {
    MIRRORED_CUDA_CHECK(cudaEventRecord(used_, stream));
    pending_ = true;
  }

  // Whether an eager launch used the table (its events were recorded).
  bool pending() const { return pending_; }

 private:
  struct Copy {
    void* data = nullptr;
    cudaEvent_t uploaded = nullptr;  // data may be rewritten once this completed
    bool queued = false;             // an upload of data was queued (and `uploaded` recorded after it)
  };

  int device_;
  std::size_t bytes_;
  Copy host_[kHostCopies];
  int current_ = 0;
  void* device_table_ = nullptr;
  cudaEvent_t used_ = nullptr;  // device_table_ may be rewritten after this (the last launch)
  bool pending_ = false;
};

}  // namespace mirrored::cuda
