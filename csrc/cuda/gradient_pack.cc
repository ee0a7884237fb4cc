// GradientPack (gradient_pack.h). Plain host code over the CUDA runtime: the
// real build and the simulated runtime share it.
#include "cuda/gradient_pack.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "cuda/check.h"
#include "cuda/device.h"

namespace mirrored::cuda {

GradientPack::GradientPack(int device, const std::vector<void*>& dst, const std::vector<std::size_t>& bytes)
    : device_(device), dst_(dst), bytes_(bytes), entry_of_(dst.size(), -1) {
  check_ordinal(device, "device");
  if (dst.size() != bytes.size())
    throw std::invalid_argument("GradientPack: " + std::to_string(dst.size()) + " destinations and " +
                                std::to_string(bytes.size()) + " sizes; give one size per destination");
  for (std::size_t k = 0; k < dst.size(); ++k) {
    if (bytes[k] == 0) continue;
    if (dst[k] == nullptr) throw std::invalid_argument("GradientPack: dst[" + std::to_string(k) + "] is null");
    entry_of_[k] = entries_++;
  }
  DeviceGuard guard;
  MIRRORED_CUDA_CHECK(set_device(device));
  MIRRORED_CUDA_CHECK(cudaDeviceGetAttribute(&sms_, cudaDevAttrMultiProcessorCount, device));
  const std::size_t table_bytes = std::max(1, entries_) * sizeof(CopyEntry);
  MIRRORED_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&host_table_), table_bytes));
  MIRRORED_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&device_table_), table_bytes));
  MIRRORED_CUDA_CHECK(cudaEventCreateWithFlags(&uploaded_, cudaEventDisableTiming));
  MIRRORED_CUDA_CHECK(cudaEventCreateWithFlags(&used_, cudaEventDisableTiming));
  // The destinations, sizes and slots are fixed; only the sources change.
  for (std::size_t k = 0; k < dst.size(); ++k) {
    if (entry_of_[k] < 0) continue;
    host_table_[entry_of_[k]] = CopyEntry{nullptr, dst[k], bytes[k], slots_};
    slots_ += (bytes[k] + 15) / 16;
  }
}

GradientPack::~GradientPack() {
  DeviceGuard guard;
  if (set_device(device_) != cudaSuccess) return;
  if (pending_) cudaEventSynchronize(used_);  // the last launch reads the table
  cudaFree(device_table_);
  cudaFreeHost(host_table_);
  cudaEventDestroy(uploaded_);
  cudaEventDestroy(used_);
}

bool GradientPack::point_at(const std::vector<const void*>& src) {
  if (src.size() != dst_.size())
    throw std::invalid_argument("GradientPack: " + std::to_string(src.size()) + " sources for " +
                                std::to_string(dst_.size()) + " destinations; pass one gradient per variable");
  bool changed = !device_matches_;
  for (std::size_t k = 0; k < src.size(); ++k) {
    if (entry_of_[k] < 0) continue;
    if (src[k] == nullptr) throw std::invalid_argument("GradientPack: src[" + std::to_string(k) + "] is null");
    changed = changed || host_table_[entry_of_[k]].src != src[k];
  }
  if (!changed) return false;
  if (pending_) MIRRORED_CUDA_CHECK(cudaEventSynchronize(uploaded_));  // the last upload has read host_table_
  device_matches_ = false;  // until the upload is queued (a failed one leaves the next call to upload)
  for (std::size_t k = 0; k < src.size(); ++k)
    if (entry_of_[k] >= 0) host_table_[entry_of_[k]].src = src[k];
  return true;
}

void GradientPack::upload(cudaStream_t stream) {
  MIRRORED_CUDA_CHECK(
      cudaMemcpyAsync(device_table_, host_table_, entries_ * sizeof(CopyEntry), cudaMemcpyHostToDevice, stream));
  device_matches_ = true;
}

void GradientPack::copy(const std::vector<const void*>& src, cudaStream_t stream) {
  if (captured_) throw std::logic_error("GradientPack: this pack belongs to a captured graph");
  if (point_at(src) && entries_ > 0) {
    if (pending_) MIRRORED_CUDA_CHECK(cudaStreamWaitEvent(stream, used_, 0));  // the last launch read the table
    upload(stream);
    MIRRORED_CUDA_CHECK(cudaEventRecord(uploaded_, stream));
  }
  if (entries_ == 0) return;
  multi_copy(device_table_, entries_, slots_, sms_, stream);
  MIRRORED_CUDA_CHECK(cudaEventRecord(used_, stream));
  pending_ = true;
}

void GradientPack::copy_captured(const std::vector<const void*>& src, cudaStream_t stream) {
  if (pending_ || captured_)
    throw std::logic_error("GradientPack: a captured pack serves one capture (make a new pack for another)");
  point_at(src);
  captured_ = true;
  if (entries_ == 0) return;
  upload(stream);
  multi_copy(device_table_, entries_, slots_, sms_, stream);
}

}  // namespace mirrored::cuda
