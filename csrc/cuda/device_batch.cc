#include "cuda/device_batch.h"

#include <cuda_runtime_api.h>

#include <stdexcept>
#include <string>

#include "core/packer.h"
#include "cuda/check.h"
#include "cuda/device.h"
#include "cuda/stream_scope.h"

namespace mirrored::cuda {

DeviceBatch::DeviceBatch(std::vector<int> devices)
    : devices_(std::move(devices)), buffers_(devices_.size(), nullptr), capacity_(devices_.size(), 0) {}

DeviceBatch::~DeviceBatch() {
  DeviceGuard guard;
  for (std::size_t r = 0; r < buffers_.size(); ++r)
    if (buffers_[r] && cudaSetDevice(devices_[r]) == cudaSuccess) cudaFree(buffers_[r]);
}

void* DeviceBatch::fusion(int r, std::size_t bytes) {
  if (capacity_[r] >= bytes) return buffers_[r];
  MIRRORED_CUDA_CHECK(cudaSetDevice(devices_[r]));
  if (buffers_[r]) {
    // An earlier batch may still be reading it on some stream of this device.
    MIRRORED_CUDA_CHECK(cudaDeviceSynchronize());
    MIRRORED_CUDA_CHECK(cudaFree(buffers_[r]));
    buffers_[r] = nullptr;
    capacity_[r] = 0;
  }
  MIRRORED_CUDA_CHECK(cudaMalloc(&buffers_[r], bytes));
  capacity_[r] = bytes;
  return buffers_[r];
}

void DeviceBatch::all_reduce(Communicator& comm, const std::vector<std::vector<const void*>>& in,
                             const std::vector<std::vector<void*>>& out, const std::vector<std::size_t>& counts,
                             const std::vector<DType>& dtypes, ReduceOp op, Algorithm algorithm,
                             std::size_t bytes_per_pack, int num_packs) {
  const int n = static_cast<int>(devices_.size());
  if (static_cast<int>(in.size()) != n || static_cast<int>(out.size()) != n)
    throw std::invalid_argument("batch_all_reduce: got " + std::to_string(in.size()) + " input and " +
                                std::to_string(out.size()) + " output lists for " + std::to_string(n) + " ranks");
  for (int r = 0; r < n; ++r)
    if (in[r].size() != counts.size() || out[r].size() != counts.size())
      throw std::invalid_argument("batch_all_reduce: rank " + std::to_string(r) + " has " +
                                  std::to_string(in[r].size()) + " tensors, expected " +
                                  std::to_string(counts.size()) + " like every rank");
  std::vector<std::size_t> bytes(counts.size());
  for (std::size_t t = 0; t < counts.size(); ++t) bytes[t] = counts[t] * dtype_size(dtypes[t]);
  const std::vector<Pack> packs = plan_packs(bytes, dtypes, bytes_per_pack, num_packs);

  std::lock_guard<std::mutex> lock(mu_);
  DeviceGuard guard;
  std::vector<const void*> pin(n);
  std::vector<void*> pout(n);
  for (const Pack& pack : packs) {
    if (pack.bytes == 0) continue;
    const std::size_t count = pack.bytes / dtype_size(pack.dtype);
    if (pack.entries.size() == 1) {  // alone in its pack: reduce it where it lies
      const std::size_t t = pack.entries[0].tensor;
      for (int r = 0; r < n; ++r) pin[r] = in[r][t], pout[r] = out[r][t];
      comm.all_reduce(n, pin.data(), pout.data(), count, pack.dtype, op, algorithm);
      continue;
    }
    // Pack and unpack on each rank's own stream: the collective is ordered
    // after the packing and before the unpacking on the same streams.
    for (int r = 0; r < n; ++r) {
      char* f = static_cast<char*>(fusion(r, pack.bytes));
      MIRRORED_CUDA_CHECK(cudaSetDevice(devices_[r]));
      for (const PackEntry& e : pack.entries)
        if (e.bytes > 0)
          MIRRORED_CUDA_CHECK(cudaMemcpyAsync(f + e.offset, in[r][e.tensor], e.bytes, cudaMemcpyDeviceToDevice,
                                              current_stream(r, n)));
      pin[r] = f, pout[r] = f;
    }
    comm.all_reduce(n, pin.data(), pout.data(), count, pack.dtype, op, algorithm);
    for (int r = 0; r < n; ++r) {
      const char* f = static_cast<const char*>(pin[r]);
      MIRRORED_CUDA_CHECK(cudaSetDevice(devices_[r]));
      for (const PackEntry& e : pack.entries)
        if (e.bytes > 0)
          MIRRORED_CUDA_CHECK(cudaMemcpyAsync(out[r][e.tensor], f + e.offset, e.bytes, cudaMemcpyDeviceToDevice,
                                              current_stream(r, n)));
    }
  }
}

}  // namespace mirrored::cuda
