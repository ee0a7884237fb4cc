// Matrix products on a cuBLAS handle of mirrored's own, so that they can be
// captured into CUDA graphs: CuPy refuses every cuBLAS call while the current
// stream is capturing, though cuBLAS itself allows it when the handle has a
// workspace of the caller's (cublasSetWorkspace), so that nothing allocates
// inside the capture. libcublas is loaded at run time (dlopen) from paths the
// Python layer finds (the copy CuPy uses first); mirrored never links it.
//
// One handle per GPU, made on first use; one workspace per (GPU, stream), as
// cuBLAS forbids sharing a workspace between streams that may run at once
// (replicas on logical GPUs share a device, each on a stream of its own).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <string>
#include <vector>

#include "cuda/blas_api.h"

namespace mirrored::cuda::blas {

// The stand-in cuBLAS of the simulated runtime asks for this much workspace;
// the real one gets cuBLAS's recommendation for Hopper (32 MiB).
constexpr std::size_t kStandInWorkspaceBytes = std::size_t(64) << 10;
#ifdef MIRRORED_CUDA_SIM
constexpr std::size_t kWorkspaceBytes = kStandInWorkspaceBytes;
#else
constexpr std::size_t kWorkspaceBytes = std::size_t(32) << 20;
#endif

// Element types of a product (the Python layer's codes); each computes in its
// own precision, halves in float32 as CuPy's and PyTorch's products do.
enum class Type : int { kFloat16 = 0, kBFloat16 = 1, kFloat32 = 2, kFloat64 = 3, kComplex64 = 4, kComplex128 = 5 };

// A row-major operand as stored: `ld` elements between rows, `stride`
// elements between the matrices of a batch (0: one matrix for every batch
// item), `op` what the product takes of it (N, T or C).
struct Operand {
  const void* data;
  Operation op;
  long long ld;
  long long stride;
};

// C = op(A) op(B) for each of `batch` items: C row-major m x n, contiguous,
// items m*n elements apart; op(A) is m x k, op(B) is k x n.
struct Product {
  Type type;
  long long m, n, k, batch;
  Operand a, b;
  void* c;
};

// Loads (or returns the path of the already loaded) libcublas from the first
// candidate that loads and has every entry point; a runtime_error naming each
// candidate and the fix otherwise.
std::string load(const std::vector<std::string>& candidates);

// Queues the product on `stream` of GPU `device` (the handle's stream and
// workspace set for it first). Throws invalid_argument for sizes cuBLAS
// cannot take, runtime_error naming the cuBLAS status for a failed call.
void matmul(int device, cudaStream_t stream, const Product& p);

}  // namespace mirrored::cuda::blas
