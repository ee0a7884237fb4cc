// The fused optimizer update's kernel: a thin __global__ wrapper over
// rules::update_table (core/optimizer_rules.h), which the host tests run with
// the same (tid, stride) walk; and Lamb's four, over core/lamb.h's phases. Compiled without FMA contraction (-fmad=false):
// every operation rounds on its own, as on the host and in TensorFlow.
#include <stdexcept>
#include <string>

#include "core/lamb.h"
#include "cuda/check.h"
#include "cuda/fused.h"
#include "cuda/fused_gate.cuh"
#include "cuda/fused_update.h"

namespace mirrored::cuda {
namespace {

template <typename T>
__global__ void __launch_bounds__(kFusedThreads)
    fused_update_kernel(rules::Rule rule, const rules::FusedEntry<T>* table, int entries,
                        rules::FusedScalars<T> scalars, LossScaleGate gate) {
  if (!open_gate(gate, scalars)) return;
  const std::size_t tid = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  rules::update_table(rule, table, entries, scalars, tid, static_cast<std::size_t>(gridDim.x) * blockDim.x);
}

// The scalars from device memory (a captured step's buffer, rewritten before
// each replay): every thread loads them, they are a few words in one line.
template <typename T>
__global__ void __launch_bounds__(kFusedThreads)
    fused_update_from_device_kernel(rules::Rule rule, const rules::FusedEntry<T>* table, int entries,
                                    const T* device_scalars, int coefficients, LossScaleGate gate) {
  rules::FusedScalars<T> scalars{};
  if (!open_gate(gate, scalars)) return;
  for (int j = 0; j < coefficients; ++j) scalars.c[j] = device_scalars[j];
  scalars.weight_decay = device_scalars[coefficients];
  scalars.lr = device_scalars[coefficients + 1];
  const std::size_t tid = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  rules::update_table(rule, table, entries, scalars, tid, static_cast<std::size_t>(gridDim.x) * blockDim.x);
}

// Lamb's phases (core/lamb.h), one kernel each. Every thread reads the gate (a skipped step runs no
// phase) and, where the phase needs them, the scalars: from `device_scalars` when not null (a captured
// step's), else those passed.
template <typename T>
__device__ bool lamb_scalars(LossScaleGate gate, rules::FusedScalars<T>& scalars, const T* device_scalars,
                             int coefficients) {
  if (device_scalars != nullptr) {
    for (int j = 0; j < coefficients; ++j) scalars.c[j] = device_scalars[j];
    scalars.weight_decay = device_scalars[coefficients];
    scalars.lr = device_scalars[coefficients + 1];
  }
  return open_gate(gate, scalars);
}

__device__ inline std::size_t thread_index() { return blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; }
__device__ inline std::size_t grid_threads() { return static_cast<std::size_t>(gridDim.x) * blockDim.x; }

template <typename T>
__global__ void __launch_bounds__(kFusedThreads)
    lamb_lanes_kernel(const rules::FusedEntry<T>* table, int entries, rules::FusedScalars<T> scalars,
                      const T* device_scalars, int coefficients, LossScaleGate gate, rules::LambSums<T> sums) {
  if (!lamb_scalars(gate, scalars, device_scalars, coefficients)) return;
  rules::lamb_lanes(table, entries, scalars, sums, thread_index(), grid_threads());
}

template <typename T>
__global__ void __launch_bounds__(kFusedThreads)
    lamb_groups_kernel(const rules::FusedEntry<T>* table, int entries, LossScaleGate gate, rules::LambSums<T> sums) {
  if (gate.nonfinite != nullptr && *gate.nonfinite != 0) return;
  rules::lamb_groups(table, entries, sums, thread_index(), grid_threads());
}

template <typename T>
__global__ void __launch_bounds__(kFusedThreads)
    lamb_ratios_kernel(const rules::FusedEntry<T>* table, int entries, LossScaleGate gate, rules::LambSums<T> sums) {
  if (gate.nonfinite != nullptr && *gate.nonfinite != 0) return;
  rules::lamb_ratios(table, entries, sums, thread_index(), grid_threads());
}

template <typename T>
__global__ void __launch_bounds__(kFusedThreads)
    lamb_apply_kernel(const rules::FusedEntry<T>* table, int entries, rules::FusedScalars<T> scalars,
                      const T* device_scalars, int coefficients, LossScaleGate gate, rules::LambSums<T> sums) {
  if (!lamb_scalars(gate, scalars, device_scalars, coefficients)) return;
  rules::lamb_apply(table, entries, scalars, sums, thread_index(), grid_threads());
}

// Threads that see a non-finite element all store the same 1: no atomics needed.
template <typename T>
__global__ void __launch_bounds__(kFusedThreads)
    count_nonfinite_kernel(const T* data, std::size_t count, int* nonfinite) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  bool seen = false;
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < count; i += stride)
    seen |= !rules::finite(data[i]);
  if (seen) *nonfinite = 1;
}

__global__ void loss_scale_step_kernel(int* nonfinite, float* scale, long long* counter, long long* iterations,
                                       long long growth_steps, bool dynamic) {
  rules::loss_scale_step(nonfinite, scale, counter, iterations, growth_steps, dynamic);
}

template <typename T>
__global__ void select_step_row_kernel(const long long* iterations, rules::StepRows<T> rows, T* out,
                                       rules::StepStatus* status) {
  rules::select_step_row(iterations, rows, out, status);
}

template <typename T>
__global__ void select_step_row_from_device_kernel(const long long* iterations, const rules::StepRows<T>* rows,
                                                   T* out, rules::StepStatus* status) {
  rules::select_step_row(iterations, *rows, out, status);
}

template <typename T>
void launch(rules::Rule rule, const void* table, int entries, std::size_t max_count, const void* scalars, int sms,
            cudaStream_t stream, LossScaleGate gate) {
  const unsigned blocks = fused_blocks(max_count, sms);
  fused_update_kernel<T><<<blocks, kFusedThreads, 0, stream>>>(
      rule, static_cast<const rules::FusedEntry<T>*>(table), entries,
      *static_cast<const rules::FusedScalars<T>*>(scalars), gate);
  MIRRORED_CUDA_CHECK(cudaGetLastError());
}

template <typename T>
void launch_from_device(rules::Rule rule, const void* table, int entries, std::size_t max_count,
                        const void* device_scalars, int coefficients, int sms, cudaStream_t stream,
                        LossScaleGate gate) {
  const unsigned blocks = fused_blocks(max_count, sms);
  fused_update_from_device_kernel<T><<<blocks, kFusedThreads, 0, stream>>>(
      rule, static_cast<const rules::FusedEntry<T>*>(table), entries, static_cast<const T*>(device_scalars),
      coefficients, gate);
  MIRRORED_CUDA_CHECK(cudaGetLastError());
}

// Lamb's four launches; `scalars` (host) or `device_scalars` (device memory, when not null).
template <typename T>
void launch_lamb(const void* table, int entries, const rules::FusedScalars<T>& scalars, const void* device_scalars,
                 int coefficients, int sms, cudaStream_t stream, LossScaleGate gate, LambScratch lamb) {
  if (lamb.data == nullptr) throw std::invalid_argument("fused_update: Lamb without its scratch");
  const auto* t = static_cast<const rules::FusedEntry<T>*>(table);
  const auto* d = static_cast<const T*>(device_scalars);
  const rules::LambSums<T> sums{static_cast<T*>(lamb.data), lamb.lanes, lamb.groups};
  lamb_lanes_kernel<T><<<fused_blocks(lamb.lanes, sms), kFusedThreads, 0, stream>>>(t, entries, scalars, d,
                                                                                    coefficients, gate, sums);
  MIRRORED_CUDA_CHECK(cudaGetLastError());
  lamb_groups_kernel<T><<<fused_blocks(lamb.groups, sms), kFusedThreads, 0, stream>>>(t, entries, gate, sums);
  MIRRORED_CUDA_CHECK(cudaGetLastError());
  lamb_ratios_kernel<T><<<fused_blocks(entries, sms), kFusedThreads, 0, stream>>>(t, entries, gate, sums);
  MIRRORED_CUDA_CHECK(cudaGetLastError());
  lamb_apply_kernel<T><<<fused_blocks(lamb.count, sms), kFusedThreads, 0, stream>>>(t, entries, scalars, d,
                                                                                    coefficients, gate, sums);
  MIRRORED_CUDA_CHECK(cudaGetLastError());
}

[[noreturn]] void unsupported(DType dtype) {
  throw std::invalid_argument("fused_update: dtype " + std::string(dtype_name(dtype)) +
                              ", the GPU kernel takes float32 and float64");
}

}  // namespace

void fused_update_from_device(rules::Rule rule, DType dtype, const void* table, int entries, std::size_t max_count,
                              const void* device_scalars, int coefficients, int sms, cudaStream_t stream,
                              LossScaleGate gate, LambScratch lamb) {
  if (entries == 0 || max_count == 0) return;
  if (rule == rules::Rule::kLamb) {
    switch (dtype) {
      case DType::kFloat32:
        return launch_lamb<float>(table, entries, {}, device_scalars, coefficients, sms, stream, gate, lamb);
      case DType::kFloat64:
        return launch_lamb<double>(table, entries, {}, device_scalars, coefficients, sms, stream, gate, lamb);
      default: unsupported(dtype);
    }
  }
  switch (dtype) {
    case DType::kFloat32:
      return launch_from_device<float>(rule, table, entries, max_count, device_scalars, coefficients, sms, stream,
                                       gate);
    case DType::kFloat64:
      return launch_from_device<double>(rule, table, entries, max_count, device_scalars, coefficients, sms, stream,
                                        gate);
    default: unsupported(dtype);
  }
}

void fused_update(rules::Rule rule, DType dtype, const void* table, int entries, std::size_t max_count,
                  const void* scalars, int sms, cudaStream_t stream, LossScaleGate gate, LambScratch lamb) {
  if (entries == 0 || max_count == 0) return;
  if (rule == rules::Rule::kLamb) {
    switch (dtype) {
      case DType::kFloat32:
        return launch_lamb<float>(table, entries, *static_cast<const rules::FusedScalars<float>*>(scalars), nullptr,
                                  0, sms, stream, gate, lamb);
      case DType::kFloat64:
        return launch_lamb<double>(table, entries, *static_cast<const rules::FusedScalars<double>*>(scalars),
                                   nullptr, 0, sms, stream, gate, lamb);
      default: unsupported(dtype);
    }
  }
  switch (dtype) {
    case DType::kFloat32: return launch<float>(rule, table, entries, max_count, scalars, sms, stream, gate);
    case DType::kFloat64: return launch<double>(rule, table, entries, max_count, scalars, sms, stream, gate);
    default: unsupported(dtype);
  }
}

void count_nonfinite(DType dtype, const void* data, std::size_t count, int* nonfinite, int sms, cudaStream_t stream) {
  if (count == 0) return;
  const unsigned blocks = fused_blocks(count, sms);
  switch (dtype) {
    case DType::kFloat32:
      count_nonfinite_kernel<<<blocks, kFusedThreads, 0, stream>>>(static_cast<const float*>(data), count, nonfinite);
      break;
    case DType::kFloat64:
      count_nonfinite_kernel<<<blocks, kFusedThreads, 0, stream>>>(static_cast<const double*>(data), count,
                                                                   nonfinite);
      break;
    default: unsupported(dtype);
  }
  MIRRORED_CUDA_CHECK(cudaGetLastError());
}

void select_step_row(DType dtype, const long long* iterations, const void* rows, void* out, rules::StepStatus* status,
                     cudaStream_t stream) {
  switch (dtype) {
    case DType::kFloat32:
      select_step_row_kernel<float><<<1, 1, 0, stream>>>(
          iterations, *static_cast<const rules::StepRows<float>*>(rows), static_cast<float*>(out), status);
      break;
    case DType::kFloat64:
      select_step_row_kernel<double><<<1, 1, 0, stream>>>(
          iterations, *static_cast<const rules::StepRows<double>*>(rows), static_cast<double*>(out), status);
      break;
    default: unsupported(dtype);
  }
  MIRRORED_CUDA_CHECK(cudaGetLastError());
}

void select_step_row_from_device(DType dtype, const long long* iterations, const void* device_rows, void* out,
                                 rules::StepStatus* status, cudaStream_t stream) {
  switch (dtype) {
    case DType::kFloat32:
      select_step_row_from_device_kernel<float><<<1, 1, 0, stream>>>(
          iterations, static_cast<const rules::StepRows<float>*>(device_rows), static_cast<float*>(out), status);
      break;
    case DType::kFloat64:
      select_step_row_from_device_kernel<double><<<1, 1, 0, stream>>>(
          iterations, static_cast<const rules::StepRows<double>*>(device_rows), static_cast<double*>(out), status);
      break;
    default: unsupported(dtype);
  }
  MIRRORED_CUDA_CHECK(cudaGetLastError());
}

void loss_scale_step(int* nonfinite, float* scale, long long* counter, long long* iterations, long long growth_steps,
                     bool dynamic, cudaStream_t stream) {
  loss_scale_step_kernel<<<1, 1, 0, stream>>>(nonfinite, scale, counter, iterations, growth_steps, dynamic);
  MIRRORED_CUDA_CHECK(cudaGetLastError());
}

}  // namespace mirrored::cuda
