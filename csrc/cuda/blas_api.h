// The few cuBLAS types and entry points the matrix product uses, declared by
// us from cuBLAS's documented ABI (the v2 API, stable since CUDA 11), so the
// build needs no cuBLAS headers and libcublas is only looked for at run time
// (the way nccl/nccl_api.h treats NCCL).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

namespace mirrored::cuda::blas {

using Handle = struct cublasContext*;
using Status = int;  // cublasStatus_t
constexpr Status kSuccess = 0;
constexpr Status kNotSupported = 15;

// cublasOperation_t: the operand as stored (N), transposed (T) or conjugate-transposed (C).
enum Operation : int { kOpN = 0, kOpT = 1, kOpC = 2 };
// cudaDataType_t (library_types.h) and cublasComputeType_t values.
enum DataType : int { kR16F = 2, kR16BF = 14, kR32F = 0, kR64F = 1, kC32F = 4, kC64F = 5 };
enum ComputeType : int { kCompute32F = 68, kCompute64F = 70 };
constexpr int kGemmDefault = -1;   // cublasGemmAlgo_t CUBLAS_GEMM_DEFAULT
constexpr int kDefaultMath = 0;    // cublasMath_t CUBLAS_DEFAULT_MATH: no TF32, as CuPy's float32 `@`

struct Api {
  Status (*Create)(Handle*);
  Status (*SetStream)(Handle, cudaStream_t);
  Status (*SetWorkspace)(Handle, void*, std::size_t);
  Status (*SetMathMode)(Handle, int);
  Status (*GemmEx)(Handle, int transa, int transb, int m, int n, int k, const void* alpha, const void* A, int Atype,
                   int lda, const void* B, int Btype, int ldb, const void* beta, void* C, int Ctype, int ldc,
                   int computeType, int algo);
  Status (*GemmStridedBatchedEx)(Handle, int transa, int transb, int m, int n, int k, const void* alpha,
                                 const void* A, int Atype, int lda, long long strideA, const void* B, int Btype,
                                 int ldb, long long strideB, const void* beta, void* C, int Ctype, int ldc,
                                 long long strideC, int batchCount, int computeType, int algo);
};

// cublasStatus_t's name, for error messages.
inline const char* status_name(Status s) {
  switch (s) {
    case 0: return "CUBLAS_STATUS_SUCCESS";
    case 1: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case 3: return "CUBLAS_STATUS_ALLOC_FAILED";
    case 7: return "CUBLAS_STATUS_INVALID_VALUE";
    case 8: return "CUBLAS_STATUS_ARCH_MISMATCH";
    case 11: return "CUBLAS_STATUS_MAPPING_ERROR";
    case 13: return "CUBLAS_STATUS_EXECUTION_FAILED";
    case 14: return "CUBLAS_STATUS_INTERNAL_ERROR";
    case 15: return "CUBLAS_STATUS_NOT_SUPPORTED";
    case 16: return "CUBLAS_STATUS_LICENSE_ERROR";
  }
  return "CUBLAS_STATUS_UNKNOWN";
}

}  // namespace mirrored::cuda::blas
