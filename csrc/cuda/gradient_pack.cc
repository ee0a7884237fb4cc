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
  table_.emplace(device, std::max(1, entries_) * sizeof(CopyEntry));
  // The destinations, sizes and slots are fixed; only the sources change.
  for (std::size_t k = 0; k < dst.size(); ++k) {
    if (entry_of_[k] < 0) continue;
    host_table()[entry_of_[k]] = CopyEntry{nullptr, dst[k], bytes[k], slots_};
    slots_ += (bytes[k] + 15) / 16;
  }
}

bool GradientPack::point_at(const std::vector<const void*>& src) {
  if (src.size() != dst_.size())
    throw std::invalid_argument("GradientPack: " + std::to_string(src.size()) + " sources for " +
                                std::to_string(dst_.size()) + " destinations; pass one gradient per variable");
  bool changed = !device_matches_;
  for (std::size_t k = 0; k < src.size(); ++k) {
    if (entry_of_[k] < 0) continue;
    if (src[k] == nullptr) throw std::invalid_argument("GradientPack: src[" + std::to_string(k) + "] is null");
    changed = changed || host_table()[entry_of_[k]].src != src[k];
  }
  if (!changed) return false;
  table_->rewrite();
  device_matches_ = false;  // until the upload is queued (a failed one leaves the next call to upload)
  for (std::size_t k = 0; k < src.size(); ++k)
    if (entry_of_[k] >= 0) host_table()[entry_of_[k]].src = src[k];
  return true;
}

CopyEntry* GradientPack::host_table() const { return static_cast<CopyEntry*>(table_->host()); }

void GradientPack::copy(const std::vector<const void*>& src, cudaStream_t stream) {
  if (captured_) throw std::logic_error("GradientPack: this pack belongs to a captured graph");
  if (point_at(src) && entries_ > 0) {
    table_->upload(entries_ * sizeof(CopyEntry), stream);
    device_matches_ = true;
  }
  if (entries_ == 0) return;
  multi_copy(static_cast<const CopyEntry*>(table_->device()), entries_, slots_, sms_, stream);
  table_->used_by(stream);
}

void GradientPack::copy_captured(const std::vector<const void*>& src, cudaStream_t stream) {
  if (table_->pending() || captured_)
    throw std::logic_error("GradientPack: a captured pack serves one capture (make a new pack for another)");
  point_at(src);
  captured_ = true;
  if (entries_ == 0) return;
  table_->upload_captured(entries_ * sizeof(CopyEntry), stream);
  device_matches_ = true;
  multi_copy(static_cast<const CopyEntry*>(table_->device()), entries_, slots_, sms_, stream);
}

}  // namespace mirrored::cuda
