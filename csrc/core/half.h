// float16 / bfloat16 <-> float32 conversions in portable C++ (no intrinsics),
// round-to-nearest-even, NaN and Inf preserved. Written as plain bit
// arithmetic so that compilers vectorise loops over them. Internal linkage
// (static) on purpose: each instruction-set build of the kernels gets its own
// copy, so no AVX-512 instance can stand in for the baseline one.
#pragma once

#include <cstdint>
#include <cstring>

namespace mirrored {

static inline float bits_to_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline uint32_t float_to_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }

static inline float bf16_to_float(uint16_t h) { return bits_to_float(static_cast<uint32_t>(h) << 16); }

static inline uint16_t float_to_bf16(float f) {
  uint32_t u = float_to_bits(f);
  // NaN: keep it a (quiet) NaN whatever its payload.
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}

static inline float f16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);  // Inf / NaN
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (man << 13);  // normal: rebias 15 -> 127
  } else {
    // zero or subnormal: value = man * 2^-24, exact in float32
    return bits_to_float(sign) + (sign ? -1.0f : 1.0f) * static_cast<float>(man) * 5.9604644775390625e-08f;
  }
  return bits_to_float(bits);
}

static inline uint16_t float_to_f16(float f) {
  const uint32_t u = float_to_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow (incl. Inf) after rounding
  if (a < 0x38800000u) {
    // subnormal or zero in half: round a * 2^24 to an integer, nearest even
    const float scaled = bits_to_float(a) * 16777216.0f;
    uint32_t m = static_cast<uint32_t>(scaled);
    const float rem = scaled - static_cast<float>(m);
    if (rem > 0.5f || (rem == 0.5f && (m & 1u))) ++m;
    return static_cast<uint16_t>(sign | m);
  }
  // normal: rebias and round the 13 dropped mantissa bits to nearest even
  uint32_t r = a - 0x38000000u;
  r += 0x0fffu + ((r >> 13) & 1u);
  return static_cast<uint16_t>(sign | (r >> 13));
}

}  // namespace mirrored
