// Element-wise combining for every dtype x op, as __host__ __device__ code so
// the kernels and host-side checks share one definition. Half types combine
// in float and round once; integers wrap modulo 2^bits like NumPy; min/max
// propagate NaN (IEEE/NumPy semantics, unlike fminf/fmaxf).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <vector_types.h>

#include <cstdint>
#include <type_traits>

#include "core/reduce_op.h"

namespace mirrored::cuda {

// 16 bytes of T: one vector load or store moves them all (every kernel's vector path).
template <typename T>
union Vec16 {
  static constexpr int kN = 16 / sizeof(T);
  uint4 raw;
  T v[kN];
};

// Storage of the 16-bit floats: trivial types, so they fit into vector unions.
struct F16 { std::uint16_t bits; };
struct BF16 { std::uint16_t bits; };

// Elem<T>::Acc is the type arithmetic happens in; load/store convert.
template <typename T>
struct Elem {
  using Acc = T;
  __host__ __device__ static Acc load(T x) { return x; }
  __host__ __device__ static T store(Acc x) { return x; }
};
template <>
struct Elem<F16> {
  using Acc = float;
  __host__ __device__ static float load(F16 x) { return __half2float(__ushort_as_half(x.bits)); }
  __host__ __device__ static F16 store(float x) { return F16{__half_as_ushort(__float2half_rn(x))}; }
};
template <>
struct Elem<BF16> {
  using Acc = float;
  __host__ __device__ static float load(BF16 x) { return __bfloat162float(__ushort_as_bfloat16(x.bits)); }
  __host__ __device__ static BF16 store(float x) { return BF16{__bfloat16_as_ushort(__float2bfloat16_rn(x))}; }
};

template <ReduceOp Op>
struct Combine;

// Integer sum/prod go through the unsigned type: wrap-around is defined there
// (signed overflow is not), and it is NumPy's result.
template <typename A, bool = std::is_integral_v<A>>
struct WrapOf { using type = A; };
template <typename A>
struct WrapOf<A, true> { using type = std::make_unsigned_t<A>; };
template <typename A>
using Wrap = typename WrapOf<A>::type;

template <>
struct Combine<ReduceOp::kSum> {
  template <typename A>
  __host__ __device__ A operator()(A a, A b) const {
    return static_cast<A>(static_cast<Wrap<A>>(a) + static_cast<Wrap<A>>(b));
  }
};
template <>
struct Combine<ReduceOp::kProd> {
  template <typename A>
  __host__ __device__ A operator()(A a, A b) const {
    return static_cast<A>(static_cast<Wrap<A>>(a) * static_cast<Wrap<A>>(b));
  }
};
template <>
struct Combine<ReduceOp::kMin> {
  template <typename A>
  __host__ __device__ A operator()(A a, A b) const {
    return (a < b || a != a) ? a : b;  // a != a: a is NaN; b NaN falls through to b
  }
};
template <>
struct Combine<ReduceOp::kMax> {
  template <typename A>
  __host__ __device__ A operator()(A a, A b) const {
    return (a > b || a != a) ? a : b;
  }
};

// MEAN's final 1/N: true division for floats (in the accumulation type, so
// halves round once), truncation toward zero for integers, as NumPy's
// (x / n).astype(dtype) gives.
template <typename A>
__host__ __device__ A divide(A x, int n) {
  if constexpr (std::is_integral_v<A>) {
    return static_cast<A>(static_cast<long long>(x) / n);
  } else {
    return x / static_cast<A>(n);
  }
}

}  // namespace mirrored::cuda
