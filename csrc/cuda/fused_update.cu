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

template <typename T>
void launch(rules::Rule rule, const void* table, int entries, std::size_t max_count, const void* scalars, int sms,
            cudaStream_t stream) {
  const unsigned blocks = fused_blocks(max_count, sms);
  fused_update_kernel<T><<<blocks, kFusedThreads, 0, stream>>>(
      rule, static_cast<const rules::FusedEntry<T>*>(table), entries,
      *static_cast<const rules::FusedScalars<T>*>(scalars));
  MIRRORED_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

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
