// A stand-in libcublas for the simulated runtime: the entry points
// cuda/blas.cc loads, with cuBLAS's column-major semantics of cublasGemmEx
// and cublasGemmStridedBatchedEx (op N/T/C, leading dimensions, batch
// strides, alpha and beta, each data type computed in its compute type).
// A product is a kernel queued on the handle's stream (run at
// synchronisation, recorded under capture, replayed by graph launches),
// counted apart from the engine's. Like a real capture, it refuses a handle
// without a workspace of the caller's on a capturing stream, and a workspace
// smaller than it needs.
#include <cuda_runtime_api.h>

#include <atomic>
#include <complex>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <functional>

#include "cuda/blas.h"
#include "cuda/reduce_ops.cuh"
#include "cuda/sim/sim_runtime.h"

namespace {

namespace blas = mirrored::cuda::blas;
namespace sim = mirrored::cuda::sim;
using mirrored::cuda::BF16;
using mirrored::cuda::F16;

constexpr int kInvalidValue = 7, kExecutionFailed = 13;

// cublasSetStream calls of every handle, for the engine's test that a product on
// the stream of the last one sets no stream (nor workspace) again.
std::atomic<long long> set_stream_calls{0};

struct Handle {
  int device;
  cudaStream_t stream = nullptr;
  void* workspace = nullptr;  // null: cuBLAS's own pool, which allocates (not capturable)
  std::size_t workspace_bytes = 0;
};

// Element load/store in the compute type: halves widen to float, complex stays complex.
template <typename T>
struct Element {
  using Acc = typename mirrored::cuda::Elem<T>::Acc;
  static Acc load(const void* p, std::size_t i) { return mirrored::cuda::Elem<T>::load(static_cast<const T*>(p)[i]); }
  static void store(void* p, std::size_t i, Acc v) { static_cast<T*>(p)[i] = mirrored::cuda::Elem<T>::store(v); }
  static Acc conj(Acc v) { return v; }
  static Acc scalar(std::complex<double> v) { return static_cast<Acc>(v.real()); }
};
template <typename R>
struct Element<std::complex<R>> {
  using Acc = std::complex<R>;
  static Acc load(const void* p, std::size_t i) { return static_cast<const Acc*>(p)[i]; }
  static void store(void* p, std::size_t i, Acc v) { static_cast<Acc*>(p)[i] = v; }
  static Acc conj(Acc v) { return std::conj(v); }
  static Acc scalar(std::complex<double> v) { return Acc(v); }
};

struct Gemm {
  int opa, opb, m, n, k;
  const void *a, *b;
  void* c;
  int lda, ldb, ldc;
  long long stride_a, stride_b, stride_c;
  int batch;
  std::complex<double> alpha, beta;  // read at the call, as host pointer mode does
};

// Column-major: C[i + j*ldc] = alpha * sum_l op(A)(i, l) op(B)(l, j) + beta * C[i + j*ldc] (C unread when beta is 0).
template <typename T>
void run(const Gemm& g) {
  using E = Element<T>;
  using Acc = typename E::Acc;
  const auto operand = [](const void* p, int op, int ld, long long row, long long col) {
    // op N: element (row, col) of the stored matrix; T and C read it transposed, C conjugated.
    const Acc v = E::load(p, static_cast<std::size_t>(op == blas::kOpN ? row + col * ld : col + row * ld));
    return op == blas::kOpC ? E::conj(v) : v;
  };
  const Acc alpha = E::scalar(g.alpha), beta = E::scalar(g.beta);
  for (int item = 0; item < g.batch; ++item) {
    const auto* a = static_cast<const char*>(g.a) + item * g.stride_a * sizeof(T);
    const auto* b = static_cast<const char*>(g.b) + item * g.stride_b * sizeof(T);
    auto* c = static_cast<char*>(g.c) + item * g.stride_c * sizeof(T);
    for (int j = 0; j < g.n; ++j)
      for (int i = 0; i < g.m; ++i) {
        Acc sum{};
        for (int l = 0; l < g.k; ++l) sum += operand(a, g.opa, g.lda, i, l) * operand(b, g.opb, g.ldb, l, j);
        const std::size_t at = static_cast<std::size_t>(i) + static_cast<std::size_t>(j) * g.ldc;
        E::store(c, at, g.beta == 0.0 ? alpha * sum : alpha * sum + beta * E::load(c, at));
      }
  }
}

std::size_t size_of(int type) {
  switch (type) {
    case blas::kR16F: case blas::kR16BF: return 2;
    case blas::kR32F: return 4;
    case blas::kR64F: case blas::kC32F: return 8;
    case blas::kC64F: return 16;
  }
  return 0;
}

bool wide(int compute) { return compute == blas::kCompute64F; }

// The compute type cuBLAS pairs with each data type (the ones mirrored uses).
bool compute_fits(int type, int compute) {
  switch (type) {
    case blas::kR16F: case blas::kR16BF: case blas::kR32F: case blas::kC32F: return compute == blas::kCompute32F;
    case blas::kR64F: case blas::kC64F: return compute == blas::kCompute64F;
  }
  return false;
}

std::complex<double> scalar(const void* p, int type, int compute) {
  const bool complex = type == blas::kC32F || type == blas::kC64F;
  if (wide(compute)) {
    const double* d = static_cast<const double*>(p);
    return {d[0], complex ? d[1] : 0.0};
  }
  const float* f = static_cast<const float*>(p);
  return {f[0], complex ? f[1] : 0.0f};
}

// Whether [p, p + bytes) lies in live memory of `device` (bytes > 0).
bool on_device(const void* p, std::size_t bytes, int device) {
  const char* first = static_cast<const char*>(p);
  return sim::device_of_pointer(first) == device && sim::device_of_pointer(first + bytes - 1) == device;
}

// Bytes from an operand's first element to its last one's end: `rows` x `cols` stored column-major, `batch` items.
std::size_t extent(long long rows, long long cols, int ld, long long stride, int batch, std::size_t size) {
  return static_cast<std::size_t>((cols - 1) * ld + rows + (batch - 1) * stride) * size;
}

int gemm(Handle* h, int opa, int opb, int m, int n, int k, const void* alpha, const void* a, int atype, int lda,
         long long stride_a, const void* b, int btype, int ldb, long long stride_b, const void* beta, void* c,
         int ctype, int ldc, long long stride_c, int batch, int compute) {
  sim::Lock lock;
  if (!h || atype != btype || btype != ctype || !size_of(atype) || !compute_fits(atype, compute))
    return blas::kNotSupported;
  const bool op_ok = opa >= blas::kOpN && opa <= blas::kOpC && opb >= blas::kOpN && opb <= blas::kOpC;
  const int rows_a = opa == blas::kOpN ? m : k, rows_b = opb == blas::kOpN ? k : n;
  if (!op_ok || m < 0 || n < 0 || k < 0 || batch < 0 || lda < std::max(1, rows_a) || ldb < std::max(1, rows_b) ||
      ldc < std::max(1, m) || stride_a < 0 || stride_b < 0 || stride_c < 0)
    return kInvalidValue;
  int current = -1;
  cudaGetDevice(&current);
  // A handle serves the device current at its creation; its stream must be that device's.
  if (current != h->device || sim::device_of_stream(h->stream) != h->device) return kExecutionFailed;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  cudaStreamIsCapturing(h->stream, &capture);
  if (h->workspace ? h->workspace_bytes < blas::kStandInWorkspaceBytes : capture != cudaStreamCaptureStatusNone)
    return blas::kNotSupported;  // cuBLAS would allocate: a capture cannot hold that
  if (m == 0 || n == 0 || batch == 0) return blas::kSuccess;
  const std::size_t size = size_of(atype);
  if ((k > 0 && (!on_device(a, extent(rows_a, opa == blas::kOpN ? k : m, lda, stride_a, batch, size), h->device) ||
                 !on_device(b, extent(rows_b, opb == blas::kOpN ? n : k, ldb, stride_b, batch, size), h->device))) ||
      !on_device(c, extent(m, n, ldc, stride_c, batch, size), h->device))
    return kExecutionFailed;  // an illegal address on a GPU
  const Gemm g{opa, opb, m, n, k, a, b, c, lda, ldb, ldc, stride_a, stride_b, stride_c, batch,
               scalar(alpha, atype, compute), scalar(beta, atype, compute)};
  std::function<void()> work;
  switch (atype) {
    case blas::kR16F: work = [g] { run<F16>(g); }; break;
    case blas::kR16BF: work = [g] { run<BF16>(g); }; break;
    case blas::kR32F: work = [g] { run<float>(g); }; break;
    case blas::kR64F: work = [g] { run<double>(g); }; break;
    case blas::kC32F: work = [g] { run<std::complex<float>>(g); }; break;
    case blas::kC64F: work = [g] { run<std::complex<double>>(g); }; break;
  }
  sim::launch_blas(h->stream, std::move(work));
  return blas::kSuccess;
}

}  // namespace

// Exported even from a module built with hidden visibility: the Python test
// engine (_cuda_sim) is its own libcublas, dlopen'ed by path like a real one.
#pragma GCC visibility push(default)
extern "C" {
int cublasCreate_v2(Handle** h) {
  sim::Lock lock;
  int device = 0;
  cudaGetDevice(&device);
  *h = new Handle{device};
  return blas::kSuccess;
}
int cublasDestroy_v2(Handle* h) {
  delete h;
  return blas::kSuccess;
}
int cublasSetStream_v2(Handle* h, cudaStream_t stream) {
  sim::Lock lock;
  ++set_stream_calls;
  h->stream = stream;
  h->workspace = nullptr;  // as cuBLAS: a new stream goes back to the library's own workspace pool
  h->workspace_bytes = 0;
  return blas::kSuccess;
}
int cublasSetWorkspace_v2(Handle* h, void* workspace, std::size_t bytes) {
  sim::Lock lock;
  if (bytes && !on_device(workspace, bytes, h->device)) return kInvalidValue;
  h->workspace = bytes ? workspace : nullptr;
  h->workspace_bytes = bytes;
  return blas::kSuccess;
}
int cublasSetMathMode(Handle*, int mode) {
  return mode == blas::kDefaultMath ? blas::kSuccess : blas::kNotSupported;  // (it computes without TF32 only)
}
int cublasGemmEx(Handle* h, int opa, int opb, int m, int n, int k, const void* alpha, const void* a, int atype,
                 int lda, const void* b, int btype, int ldb, const void* beta, void* c, int ctype, int ldc,
                 int compute, int) {
  return gemm(h, opa, opb, m, n, k, alpha, a, atype, lda, 0, b, btype, ldb, 0, beta, c, ctype, ldc, 0, 1, compute);
}
int cublasGemmStridedBatchedEx(Handle* h, int opa, int opb, int m, int n, int k, const void* alpha, const void* a,
                               int atype, int lda, long long stride_a, const void* b, int btype, int ldb,
                               long long stride_b, const void* beta, void* c, int ctype, int ldc, long long stride_c,
                               int batch, int compute, int) {
  return gemm(h, opa, opb, m, n, k, alpha, a, atype, lda, stride_a, b, btype, ldb, stride_b, beta, c, ctype, ldc,
              stride_c, batch, compute);
}
// Not cuBLAS's: the count of cublasSetStream calls so far (blas_test.cc).
long long mirroredSimCublasSetStreamCalls() { return set_stream_calls.load(); }
}
#pragma GCC visibility pop
