// The one-pass kernels (fused.h): thin __global__ wrappers over the bodies of
// fused_body.cuh, and their launches.
#include <cstdint>
#include <stdexcept>
#include <string>

#include "cuda/check.h"
#include "cuda/fused.h"
#include "cuda/fused_body.cuh"

namespace mirrored::cuda {
namespace {

__device__ __forceinline__ std::size_t thread_index() {
  return blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
}
__device__ __forceinline__ std::size_t grid_threads() { return static_cast<std::size_t>(gridDim.x) * blockDim.x; }

// The arguments arrive by value in parameter space (a few hundred bytes):
// the op, MEAN's divisor and the pointers sit in registers and constant memory.
template <typename T, ReduceOp Op>
__global__ void __launch_bounds__(kFusedThreads)
    fused_reduce_kernel(const FusedArgs args, std::size_t count, int mean_div, bool vectorised) {
  fused_reduce_body<T, Op>(args, count, mean_div, vectorised, thread_index(), grid_threads());
}

template <typename U>
__global__ void __launch_bounds__(kFusedThreads) fused_gather_kernel(const GatherArgs args) {
  fused_gather_body<U>(args, thread_index(), grid_threads());
}

__global__ void __launch_bounds__(kFusedThreads) multi_copy_kernel(const CopyEntry* table, int entries) {
  multi_copy_body(table, entries, thread_index(), grid_threads());
}

template <typename T, ReduceOp Op>
__global__ void __launch_bounds__(kFusedThreads)
    multi_reduce_kernel(const ReduceEntry* table, const void* const* pointers, int entries, int n, int mean_div) {
  multi_reduce_body<T, Op>(table, pointers, entries, n, mean_div, thread_index(), grid_threads());
}

template <typename T, ReduceOp Op>
void launch_multi(const ReduceEntry* table, const void* const* pointers, int entries, int n, std::size_t slots,
                  int mean_div, int sms, cudaStream_t stream) {
  multi_reduce_kernel<T, Op><<<fused_blocks(slots, sms), kFusedThreads, 0, stream>>>(table, pointers, entries, n,
                                                                                    mean_div);
  MIRRORED_CUDA_CHECK(cudaGetLastError());
}

template <typename T>
void multi_op(const ReduceEntry* table, const void* const* pointers, int entries, int n, std::size_t slots,
              ReduceOp op, int mean_div, int sms, cudaStream_t stream) {
  switch (op) {
    case ReduceOp::kSum: return launch_multi<T, ReduceOp::kSum>(table, pointers, entries, n, slots, mean_div, sms, stream);
    case ReduceOp::kProd: return launch_multi<T, ReduceOp::kProd>(table, pointers, entries, n, slots, mean_div, sms, stream);
    case ReduceOp::kMin: return launch_multi<T, ReduceOp::kMin>(table, pointers, entries, n, slots, mean_div, sms, stream);
    case ReduceOp::kMax: return launch_multi<T, ReduceOp::kMax>(table, pointers, entries, n, slots, mean_div, sms, stream);
    case ReduceOp::kMean: break;
  }
  throw std::invalid_argument("multi_reduce: MEAN combines as sum; pass its combining op and the divisor");
}

template <typename T, ReduceOp Op>
void launch(const FusedArgs& a, std::size_t count, int mean_div, int sms, cudaStream_t stream) {
  const bool vec = fused_vectorised(a);
  const unsigned blocks = fused_blocks(fused_work(count, sizeof(T), vec), sms);
  fused_reduce_kernel<T, Op><<<blocks, kFusedThreads, 0, stream>>>(a, count, mean_div, vec);
  MIRRORED_CUDA_CHECK(cudaGetLastError());
}

template <typename T>
void dispatch_op(const FusedArgs& a, std::size_t count, ReduceOp op, int mean_div, int sms, cudaStream_t stream) {
  switch (op) {
    case ReduceOp::kSum: return launch<T, ReduceOp::kSum>(a, count, mean_div, sms, stream);
    case ReduceOp::kProd: return launch<T, ReduceOp::kProd>(a, count, mean_div, sms, stream);
    case ReduceOp::kMin: return launch<T, ReduceOp::kMin>(a, count, mean_div, sms, stream);
    case ReduceOp::kMax: return launch<T, ReduceOp::kMax>(a, count, mean_div, sms, stream);
    case ReduceOp::kMean: break;
  }
  throw std::invalid_argument("fused_reduce: MEAN combines as sum; pass its combining op and the divisor");
}

}  // namespace

void fused_reduce(const FusedArgs& a, std::size_t count, DType dtype, ReduceOp op, int mean_div, int sms,
                  cudaStream_t stream) {
  if (count == 0) return;
  switch (dtype) {
    case DType::kFloat16: return dispatch_op<F16>(a, count, op, mean_div, sms, stream);
    case DType::kBFloat16: return dispatch_op<BF16>(a, count, op, mean_div, sms, stream);
    case DType::kFloat32: return dispatch_op<float>(a, count, op, mean_div, sms, stream);
    case DType::kFloat64: return dispatch_op<double>(a, count, op, mean_div, sms, stream);
    case DType::kInt8: return dispatch_op<std::int8_t>(a, count, op, mean_div, sms, stream);
    case DType::kUInt8: return dispatch_op<std::uint8_t>(a, count, op, mean_div, sms, stream);
    case DType::kInt32: return dispatch_op<std::int32_t>(a, count, op, mean_div, sms, stream);
    case DType::kInt64: return dispatch_op<std::int64_t>(a, count, op, mean_div, sms, stream);
  }
  throw std::invalid_argument("fused_reduce: unknown dtype code " + std::to_string(static_cast<int>(dtype)));
}

void fused_gather(const GatherArgs& a, int unit, int sms, cudaStream_t stream) {
  const std::size_t total = a.col[a.nin] * a.outer;
  if (total == 0) return;
  const unsigned blocks = fused_blocks(total, sms);
  switch (unit) {
    case 16: fused_gather_kernel<uint4><<<blocks, kFusedThreads, 0, stream>>>(a); break;
    case 8: fused_gather_kernel<std::uint64_t><<<blocks, kFusedThreads, 0, stream>>>(a); break;
    case 4: fused_gather_kernel<std::uint32_t><<<blocks, kFusedThreads, 0, stream>>>(a); break;
    case 2: fused_gather_kernel<std::uint16_t><<<blocks, kFusedThreads, 0, stream>>>(a); break;
    case 1: fused_gather_kernel<std::uint8_t><<<blocks, kFusedThreads, 0, stream>>>(a); break;
    default: throw std::invalid_argument("fused_gather: unit must be 1, 2, 4, 8 or 16 bytes");
  }
  MIRRORED_CUDA_CHECK(cudaGetLastError());
}

void multi_copy(const CopyEntry* table, int entries, std::size_t slots, int sms, cudaStream_t stream) {
  if (entries == 0 || slots == 0) return;
  multi_copy_kernel<<<fused_blocks(slots, sms), kFusedThreads, 0, stream>>>(table, entries);
  MIRRORED_CUDA_CHECK(cudaGetLastError());
}

void multi_reduce(const ReduceEntry* table, const void* const* pointers, int entries, int n, std::size_t slots,
                  DType dtype, ReduceOp op, int mean_div, int sms, cudaStream_t stream) {
  if (entries == 0 || slots == 0) return;
  switch (dtype) {
    case DType::kFloat16: return multi_op<F16>(table, pointers, entries, n, slots, op, mean_div, sms, stream);
    case DType::kBFloat16: return multi_op<BF16>(table, pointers, entries, n, slots, op, mean_div, sms, stream);
    case DType::kFloat32: return multi_op<float>(table, pointers, entries, n, slots, op, mean_div, sms, stream);
    case DType::kFloat64: return multi_op<double>(table, pointers, entries, n, slots, op, mean_div, sms, stream);
    case DType::kInt8: return multi_op<std::int8_t>(table, pointers, entries, n, slots, op, mean_div, sms, stream);
    case DType::kUInt8: return multi_op<std::uint8_t>(table, pointers, entries, n, slots, op, mean_div, sms, stream);
    case DType::kInt32: return multi_op<std::int32_t>(table, pointers, entries, n, slots, op, mean_div, sms, stream);
    case DType::kInt64: return multi_op<std::int64_t>(table, pointers, entries, n, slots, op, mean_div, sms, stream);
  }
  throw std::invalid_argument("multi_reduce: unknown dtype code " + std::to_string(static_cast<int>(dtype)));
}

}  // namespace mirrored::cuda
