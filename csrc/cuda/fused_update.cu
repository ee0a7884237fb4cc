// The fused optimizer update's kernel: a thin __global__ wrapper over
// rules::update_table (core/optimizer_rules.h), which the host tests run with
// the same (tid, stride) walk. Compiled without FMA contraction (-fmad=false):
// every operation rounds on its own, as on the host and in TensorFlow.
#include <stdexcept>
#include <string>

#include "cuda/check.h"
#include "cuda/fused.h"
#include "cuda/fused_update.h"

namespace mirrored::cuda {
namespace {

template <typename T>
__global__ void __launch_bounds__(kFusedThreads)
    fused_update_kernel(rules::Rule rule, const rules::FusedEntry<T>* table, int entries,
                        const rules::FusedScalars<T> scalars) {
  const std::size_t tid = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  rules::update_table(rule, table, entries, scalars, tid, static_cast<std::size_t>(gridDim.x) * blockDim.x);
}

// The scalars from device memory (a captured step's buffer, rewritten before
// each replay): every thread loads them, they are a few words in one line.
template <typename T>
__global__ void __launch_bounds__(kFusedThreads)
    fused_update_from_device_kernel(rules::Rule rule, const rules::FusedEntry<T>* table, int entries,
                                    const T* device_scalars, int coefficients) {
  rules::FusedScalars<T> scalars{};
  for (int j = 0; j < coefficients; ++j) scalars.c[j] = device_scalars[j];
  scalars.weight_decay = device_scalars[coefficients];
  scalars.lr = device_scalars[coefficients + 1];
  const std::size_t tid = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  rules::update_table(rule, table, entries, scalars, tid, static_cast<std::size_t>(gridDim.x) * blockDim.x);
}

template <typename T>
void launch(rules::Rule rule, const void* table, int entries, std::size_t max_count, const void* scalars, int sms,
            cudaStream_t stream) {
  const unsigned blocks = fused_blocks(max_count, sms);
  fused_update_kernel<T><<<blocks, kFusedThreads, 0, stream>>>(
      rule, static_cast<const rules::FusedEntry<T>*>(table), entries,
      *static_cast<const rules::FusedScalars<T>*>(scalars));
  MIRRORED_CUDA_CHECK(cudaGetLastError());
}

template <typename T>
void launch_from_device(rules::Rule rule, const void* table, int entries, std::size_t max_count,
                        const void* device_scalars, int coefficients, int sms, cudaStream_t stream) {
  const unsigned blocks = fused_blocks(max_count, sms);
  fused_update_from_device_kernel<T><<<blocks, kFusedThreads, 0, stream>>>(
      rule, static_cast<const rules::FusedEntry<T>*>(table), entries, static_cast<const T*>(device_scalars),
      coefficients);
  MIRRORED_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void fused_update_from_device(rules::Rule rule, DType dtype, const void* table, int entries, std::size_t max_count,
                              const void* device_scalars, int coefficients, int sms, cudaStream_t stream) {
  if (entries == 0 || max_count == 0) return;
  switch (dtype) {
    case DType::kFloat32:
      return launch_from_device<float>(rule, table, entries, max_count, device_scalars, coefficients, sms, stream);
    case DType::kFloat64:
      return launch_from_device<double>(rule, table, entries, max_count, device_scalars, coefficients, sms, stream);
    default:
      throw std::invalid_argument("fused_update: dtype " + std::string(dtype_name(dtype)) +
                                  ", the GPU kernel takes float32 and float64");
  }
}

void fused_update(rules::Rule rule, DType dtype, const void* table, int entries, std::size_t max_count,
                  const void* scalars, int sms, cudaStream_t stream) {
  if (entries == 0 || max_count == 0) return;
  switch (dtype) {
    case DType::kFloat32: return launch<float>(rule, table, entries, max_count, scalars, sms, stream);
    case DType::kFloat64: return launch<double>(rule, table, entries, max_count, scalars, sms, stream);
    default:
      throw std::invalid_argument("fused_update: dtype " + std::string(dtype_name(dtype)) +
                                  ", the GPU kernel takes float32 and float64");
  }
}

}  // namespace mirrored::cuda
