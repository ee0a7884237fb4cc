// The kernels, written once as plain loops the compiler vectorises; each
// reduce_kernels_<isa>.cc includes this file inside its own namespace and is
// compiled with that ISA's flags.
//
// NaN handling follows IEEE / NumPy: sum and prod propagate NaN naturally;
// min and max return NaN when either input is NaN (np.minimum/np.maximum).
// Signed integers wrap on overflow (as NumPy does); the arithmetic is done in
// unsigned types so the wrap is defined behaviour.

// Included inside a per-ISA namespace: the including file provides
// <cstdint>, <type_traits>, core/half.h and (with F16C) <immintrin.h>.

namespace kern {

using mirrored::DType;

struct Sum {
  template <typename T> static T apply(T a, T b) { return a + b; }
};
struct Prod {
  template <typename T> static T apply(T a, T b) { return a * b; }
};
struct Min {
  template <typename T> static T apply(T a, T b) {
    if constexpr (std::is_floating_point_v<T>) {
      return (a != a || a < b) ? a : (b != b ? b : (b < a ? b : a));
    } else {
      return b < a ? b : a;
    }
  }
};
struct Max {
  template <typename T> static T apply(T a, T b) {
    if constexpr (std::is_floating_point_v<T>) {
      return (a != a || a > b) ? a : (b != b ? b : (b > a ? b : a));
    } else {
      return b > a ? b : a;
    }
  }
};

// Integers: + and * in the unsigned type of the same width.
template <typename T, typename Op>
inline T apply_int(T a, T b) {
  using U = std::make_unsigned_t<T>;
  if constexpr (std::is_same_v<Op, Sum>) {
    return static_cast<T>(static_cast<U>(static_cast<U>(a) + static_cast<U>(b)));
  } else if constexpr (std::is_same_v<Op, Prod>) {
    // Promote to at least unsigned int so u16*u16 cannot overflow a signed int.
    using W = std::conditional_t<(sizeof(U) < sizeof(unsigned)), unsigned, U>;
    return static_cast<T>(static_cast<U>(static_cast<W>(static_cast<U>(a)) * static_cast<W>(static_cast<U>(b))));
  } else {
    return Op::apply(a, b);
  }
}

template <typename T, typename Op>
void combine_native(void* dst, const void* a, const void* b, std::size_t n) {
  T* __restrict d = static_cast<T*>(dst);
  const T* x = static_cast<const T*>(a);
  const T* y = static_cast<const T*>(b);
  if constexpr (std::is_integral_v<T>) {
    for (std::size_t i = 0; i < n; ++i) d[i] = apply_int<T, Op>(x[i], y[i]);
  } else {
    for (std::size_t i = 0; i < n; ++i) d[i] = Op::apply(x[i], y[i]);
  }
}

// 16-bit floats: widen to float, combine, round back (round to nearest even).
template <typename Op, bool kBF16>
void combine_half(void* dst, const void* a, const void* b, std::size_t n) {
  auto* d = static_cast<std::uint16_t*>(dst);
  const auto* x = static_cast<const std::uint16_t*>(a);
  const auto* y = static_cast<const std::uint16_t*>(b);
  std::size_t i = 0;
#if defined(__F16C__)
  if constexpr (!kBF16) {
    for (; i + 8 <= n; i += 8) {
      const __m256 fx = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i)));
      const __m256 fy = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(y + i)));
      alignas(32) float fa[8], fb[8], fr[8];
      _mm256_store_ps(fa, fx);
      _mm256_store_ps(fb, fy);
      for (int j = 0; j < 8; ++j) fr[j] = Op::apply(fa[j], fb[j]);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i),
                       _mm256_cvtps_ph(_mm256_load_ps(fr), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
  }
#endif
  for (; i < n; ++i) {
    if constexpr (kBF16) {
      d[i] = mirrored::float_to_bf16(Op::apply(mirrored::bf16_to_float(x[i]), mirrored::bf16_to_float(y[i])));
    } else {
      d[i] = mirrored::float_to_f16(Op::apply(mirrored::f16_to_float(x[i]), mirrored::f16_to_float(y[i])));
    }
  }
}

template <typename T>
void divide_native(void* dst, std::size_t n, int divisor) {
  T* d = static_cast<T*>(dst);
  if constexpr (std::is_integral_v<T>) {
    const T k = static_cast<T>(divisor);
    for (std::size_t i = 0; i < n; ++i) d[i] = static_cast<T>(d[i] / k);
  } else {
    const T k = static_cast<T>(divisor);
    for (std::size_t i = 0; i < n; ++i) d[i] = d[i] / k;
  }
}

template <bool kBF16>
void divide_half(void* dst, std::size_t n, int divisor) {
  auto* d = static_cast<std::uint16_t*>(dst);
  const float k = static_cast<float>(divisor);
  for (std::size_t i = 0; i < n; ++i) {
    if constexpr (kBF16) {
      d[i] = mirrored::float_to_bf16(mirrored::bf16_to_float(d[i]) / k);
    } else {
      d[i] = mirrored::float_to_f16(mirrored::f16_to_float(d[i]) / k);
    }
  }
}

template <typename Op>
constexpr void fill_op(mirrored::ReduceKernels& k, int op) {
  k.combine[static_cast<int>(DType::kFloat16)][op] = combine_half<Op, false>;
  k.combine[static_cast<int>(DType::kBFloat16)][op] = combine_half<Op, true>;
  k.combine[static_cast<int>(DType::kFloat32)][op] = combine_native<float, Op>;
  k.combine[static_cast<int>(DType::kFloat64)][op] = combine_native<double, Op>;
  k.combine[static_cast<int>(DType::kInt8)][op] = combine_native<std::int8_t, Op>;
  k.combine[static_cast<int>(DType::kUInt8)][op] = combine_native<std::uint8_t, Op>;
  k.combine[static_cast<int>(DType::kInt32)][op] = combine_native<std::int32_t, Op>;
  k.combine[static_cast<int>(DType::kInt64)][op] = combine_native<std::int64_t, Op>;
}

inline mirrored::ReduceKernels make_table(const char* isa) {
  mirrored::ReduceKernels k{};
  k.isa = isa;
  fill_op<Sum>(k, 0);
  fill_op<Prod>(k, 1);
  fill_op<Min>(k, 2);
  fill_op<Max>(k, 3);
  k.divide[static_cast<int>(DType::kFloat16)] = divide_half<false>;
  k.divide[static_cast<int>(DType::kBFloat16)] = divide_half<true>;
  k.divide[static_cast<int>(DType::kFloat32)] = divide_native<float>;
  k.divide[static_cast<int>(DType::kFloat64)] = divide_native<double>;
  k.divide[static_cast<int>(DType::kInt8)] = divide_native<std::int8_t>;
  k.divide[static_cast<int>(DType::kUInt8)] = divide_native<std::uint8_t>;
  k.divide[static_cast<int>(DType::kInt32)] = divide_native<std::int32_t>;
  k.divide[static_cast<int>(DType::kInt64)] = divide_native<std::int64_t>;
  return k;
}

}  // namespace kern
