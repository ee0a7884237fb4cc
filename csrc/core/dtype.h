// The element types every layer understands (NCCL's set), with their sizes
// and names. One table so that host, CUDA, NCCL and Gloo agree on codes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace mirrored {

enum class DType : int {
  kFloat16 = 0,
  kBFloat16 = 1,
  kFloat32 = 2,
  kFloat64 = 3,
  kInt8 = 4,
  kUInt8 = 5,
  kInt32 = 6,
  kInt64 = 7,
};
constexpr int kNumDTypes = 8;

inline std::size_t dtype_size(DType t) {
  switch (t) {
    case DType::kInt8:
    case DType::kUInt8: return 1;
    case DType::kFloat16:
    case DType::kBFloat16: return 2;
    case DType::kFloat32:
    case DType::kInt32: return 4;
    case DType::kFloat64:
    case DType::kInt64: return 8;
  }
  throw std::invalid_argument("unknown dtype code " + std::to_string(static_cast<int>(t)));
}

inline const char* dtype_name(DType t) {
  switch (t) {
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat32: return "float32";
    case DType::kFloat64: return "float64";
    case DType::kInt8: return "int8";
    case DType::kUInt8: return "uint8";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
  }
  return "unknown";
}

inline DType dtype_from_code(int code) {
  if (code < 0 || code >= kNumDTypes)
    throw std::invalid_argument("dtype code " + std::to_string(code) + " is not one of mirrored's 8 dtypes");
  return static_cast<DType>(code);
}

inline bool dtype_is_integer(DType t) {
  return t == DType::kInt8 || t == DType::kUInt8 || t == DType::kInt32 || t == DType::kInt64;
}

}  // namespace mirrored
