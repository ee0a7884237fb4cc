// Adafactor's kernels (cuda/fused_adafactor.h): one __global__ wrapper over rules::adafactor_phase, launched
// once per phase on the same stream. Compiled without FMA contraction (-fmad=false), as fused_update.cu.
#include <stdexcept>
#include <string>

#include "cuda/check.h"
#include "cuda/fused.h"
#include "cuda/fused_adafactor.h"
#include "cuda/fused_gate.cuh"

namespace mirrored::cuda {
namespace {

template <typename T>
__global__ void __launch_bounds__(kFusedThreads)
    adafactor_kernel(int phase, const rules::FusedEntry<T>* table, int entries, T* scratch,
                     rules::FusedScalars<T> scalars, const T* device_scalars, int coefficients, LossScaleGate gate) {
  if (device_scalars != nullptr) {  // (a few words in one line: every thread loads them)
    for (int j = 0; j < coefficients; ++j) scalars.c[j] = device_scalars[j];
    scalars.weight_decay = device_scalars[coefficients];
    scalars.lr = device_scalars[coefficients + 1];
  }
  if (!open_gate(gate, scalars)) return;
  const std::size_t tid = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  rules::adafactor_phase(phase, table, entries, scratch, scalars, tid,
                         static_cast<std::size_t>(gridDim.x) * blockDim.x);
}

template <typename T>
void launch(const void* table, int entries, std::size_t work, void* scratch, const void* scalars,
            const void* device_scalars, int coefficients, int sms, cudaStream_t stream, LossScaleGate gate) {
  rules::FusedScalars<T> s{};
  if (scalars != nullptr) s = *static_cast<const rules::FusedScalars<T>*>(scalars);
  const unsigned blocks = fused_blocks(work, sms);
  for (int phase = 0; phase < rules::kAdafactorPhases; ++phase) {
    adafactor_kernel<T><<<blocks, kFusedThreads, 0, stream>>>(
        phase, static_cast<const rules::FusedEntry<T>*>(table), entries, static_cast<T*>(scratch), s,
        static_cast<const T*>(device_scalars), coefficients, gate);
    MIRRORED_CUDA_CHECK(cudaGetLastError());
  }
}

}  // namespace

void fused_adafactor(DType dtype, const void* table, int entries, std::size_t work, void* scratch,
                     const void* scalars, const void* device_scalars, int coefficients, int sms, cudaStream_t stream,
                     LossScaleGate gate) {
  if (entries == 0 || work == 0) return;
  switch (dtype) {
    case DType::kFloat32:
      return launch<float>(table, entries, work, scratch, scalars, device_scalars, coefficients, sms, stream, gate);
    case DType::kFloat64:
      return launch<double>(table, entries, work, scratch, scalars, device_scalars, coefficients, sms, stream, gate);
    default:
      throw std::invalid_argument("fused_update: dtype " + std::string(dtype_name(dtype)) +
                                  ", the GPU kernel takes float32 and float64");
  }
}

}  // namespace mirrored::cuda
