#include "cuda/reduce_kernels.h"

#include <algorithm>
#include <cstdint>
#include <string>

#include "cuda/check.h"
#include "cuda/reduce_ops.cuh"

namespace mirrored::cuda {
namespace {

constexpr int kThreads = 512;
constexpr int kBlocksPerSM = 4;

template <typename T, ReduceOp Op>
__global__ void __launch_bounds__(kThreads)
    reduce_copy_kernel(T* out, const T* a, const T* b, std::size_t n, int mean_div, bool vectorised) {
  using E = Elem<T>;
  const Combine<Op> combine;
  const std::size_t tid = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  auto one = [&](T x, T y) {
    auto r = combine(E::load(x), E::load(y));
    if (mean_div > 1) r = divide(r, mean_div);
    return E::store(r);
  };
  std::size_t head = 0;
  if (vectorised) {
    constexpr int kN = Vec16<T>::kN;
    const std::size_t nv = n / kN;
    const uint4* va = reinterpret_cast<const uint4*>(a);
    const uint4* vb = reinterpret_cast<const uint4*>(b);
    uint4* vo = reinterpret_cast<uint4*>(out);
    for (std::size_t i = tid; i < nv; i += stride) {
      Vec16<T> x, y;
      x.raw = va[i];
      y.raw = vb[i];
#pragma unroll
      for (int j = 0; j < kN; ++j) x.v[j] = one(x.v[j], y.v[j]);
      vo[i] = x.raw;
    }
    head = nv * kN;
  }
  for (std::size_t i = head + tid; i < n; i += stride) out[i] = one(a[i], b[i]);
}

template <typename T, ReduceOp Op>
void launch(void* out, const void* a, const void* b, std::size_t count, int mean_div, int sms, cudaStream_t stream) {
  const bool vectorised = ((reinterpret_cast<std::uintptr_t>(out) | reinterpret_cast<std::uintptr_t>(a) |
                            reinterpret_cast<std::uintptr_t>(b)) & 15u) == 0;
  const std::size_t work = vectorised ? count / Vec16<T>::kN + Vec16<T>::kN : count;
  const std::size_t wanted = (work + kThreads - 1) / kThreads;
  const unsigned blocks = static_cast<unsigned>(std::max<std::size_t>(1, std::min<std::size_t>(wanted, std::size_t(sms) * kBlocksPerSM)));
  reduce_copy_kernel<T, Op><<<blocks, kThreads, 0, stream>>>(static_cast<T*>(out), static_cast<const T*>(a),
                                                             static_cast<const T*>(b), count, mean_div, vectorised);
  MIRRORED_CUDA_CHECK(cudaGetLastError());
}

template <typename T>
void dispatch_op(void* out, const void* a, const void* b, std::size_t count, ReduceOp op, int mean_div, int sms,
                 cudaStream_t stream) {
  switch (op) {
    case ReduceOp::kSum: return launch<T, ReduceOp::kSum>(out, a, b, count, mean_div, sms, stream);
    case ReduceOp::kProd: return launch<T, ReduceOp::kProd>(out, a, b, count, mean_div, sms, stream);
    case ReduceOp::kMin: return launch<T, ReduceOp::kMin>(out, a, b, count, mean_div, sms, stream);
    case ReduceOp::kMax: return launch<T, ReduceOp::kMax>(out, a, b, count, mean_div, sms, stream);
    case ReduceOp::kMean: break;
  }
  throw std::invalid_argument(std::string("reduce_copy: op ") + reduce_op_name(op) +
                              " is not a combining op (MEAN combines as sum, then divides)");
}

}  // namespace

void reduce_copy(void* out, const void* a, const void* b, std::size_t count, DType dtype, ReduceOp op, int mean_div,
                 int sms, cudaStream_t stream) {
  if (count == 0) return;
  switch (dtype) {
    case DType::kFloat16: return dispatch_op<F16>(out, a, b, count, op, mean_div, sms, stream);
    case DType::kBFloat16: return dispatch_op<BF16>(out, a, b, count, op, mean_div, sms, stream);
    case DType::kFloat32: return dispatch_op<float>(out, a, b, count, op, mean_div, sms, stream);
    case DType::kFloat64: return dispatch_op<double>(out, a, b, count, op, mean_div, sms, stream);
    case DType::kInt8: return dispatch_op<std::int8_t>(out, a, b, count, op, mean_div, sms, stream);
    case DType::kUInt8: return dispatch_op<std::uint8_t>(out, a, b, count, op, mean_div, sms, stream);
    case DType::kInt32: return dispatch_op<std::int32_t>(out, a, b, count, op, mean_div, sms, stream);
    case DType::kInt64: return dispatch_op<std::int64_t>(out, a, b, count, op, mean_div, sms, stream);
  }
  throw std::invalid_argument("reduce_copy: unknown dtype code " + std::to_string(static_cast<int>(dtype)));
}

}  // namespace mirrored::cuda
