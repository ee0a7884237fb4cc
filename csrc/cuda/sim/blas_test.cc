// The matrix product (cuda/blas.cc) on the simulated runtime, through the
// stand-in libcublas whose path is the argument: every op pair, batch and
// broadcast operand, leading dimensions beyond the row length, four element
// types, against a naive row-major product; a capture replayed on new
// inputs; the stand-in's refusals (no workspace under capture, too small a
// workspace, bad leading dimensions); and threads sharing a GPU's handle on
// streams of their own. Exit status 0 when all is right.
#include <dlfcn.h>

#include <array>
#include <cmath>
#include <complex>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

#include "cuda/blas.h"
#include "cuda/reduce_ops.cuh"
#include "cuda/sim/expect.h"
#include "cuda/sim/sim_runtime.h"

using namespace mirrored::cuda;
using blas::Operation;

namespace {

using sim_check::failures;

using C64 = std::complex<double>;

// Each type as stored and as the reference computes it.
template <typename T> struct Traits;
template <> struct Traits<float> {
  static constexpr blas::Type type = blas::Type::kFloat32;
  static float put(C64 v) { return static_cast<float>(v.real()); }
  static C64 get(float v) { return v; }
  static constexpr double tol = 1e-4;
};
template <> struct Traits<double> {
  static constexpr blas::Type type = blas::Type::kFloat64;
  static double put(C64 v) { return v.real(); }
  static C64 get(double v) { return v; }
  static constexpr double tol = 1e-12;
};
template <> struct Traits<C64> {
  static constexpr blas::Type type = blas::Type::kComplex128;
  static C64 put(C64 v) { return v; }
  static C64 get(C64 v) { return v; }
  static constexpr double tol = 1e-12;
};
template <> struct Traits<F16> {
  static constexpr blas::Type type = blas::Type::kFloat16;
  static F16 put(C64 v) { return Elem<F16>::store(static_cast<float>(v.real())); }
  static C64 get(F16 v) { return Elem<F16>::load(v); }
  static constexpr double tol = 2e-2;
};

void* device_alloc(std::size_t bytes) {
  void* p = nullptr;
  cudaMalloc(&p, bytes ? bytes : 1);
  return p;
}

// op(X) is rows x cols; X is stored row-major (ld apart, items `stride` apart) as op says.
template <typename T>
C64 at(const T* x, Operation op, long long ld, long long r, long long c) {
  const C64 v = Traits<T>::get(op == blas::kOpN ? x[r * ld + c] : x[c * ld + r]);
  return op == blas::kOpC ? std::conj(v) : v;
}

template <typename T>
void check_product(Operation op_a, Operation op_b, long long m, long long n, long long k, long long batch,
                   bool shared_b, int device, cudaStream_t stream) {
  const long long lda = (op_a == blas::kOpN ? k : m) + 2, ldb = (op_b == blas::kOpN ? n : k) + 1;
  const long long rows_a = op_a == blas::kOpN ? m : k, rows_b = op_b == blas::kOpN ? k : n;
  const long long stride_a = rows_a * lda, stride_b = shared_b ? 0 : rows_b * ldb;
  const long long items_b = shared_b ? 1 : batch;
  cudaSetDevice(device);
  auto* a = static_cast<T*>(device_alloc(sizeof(T) * stride_a * batch));
  auto* b = static_cast<T*>(device_alloc(sizeof(T) * rows_b * ldb * items_b));
  auto* c = static_cast<T*>(device_alloc(sizeof(T) * m * n * batch));
  for (long long i = 0; i < stride_a * batch; ++i) a[i] = Traits<T>::put(C64(i % 7 - 3.0, i % 3 - 1.0) * 0.25);
  for (long long i = 0; i < rows_b * ldb * items_b; ++i) b[i] = Traits<T>::put(C64(i % 5 - 2.0, 1.0 - i % 4) * 0.5);
  cudaSetDevice(0);  // the engine switches to the product's device itself
  blas::matmul(device, stream, {Traits<T>::type, m, n, k, batch, {a, op_a, lda, stride_a}, {b, op_b, ldb, stride_b}, c});
  int current = -1;
  cudaGetDevice(&current);
  EXPECT(current == 0, "the caller's device is current again after a product on GPU %d (got %d)", device, current);
  sim::drain();
  for (long long item = 0; item < batch; ++item)
    for (long long i = 0; i < m; ++i)
      for (long long j = 0; j < n; ++j) {
        C64 want = 0;
        for (long long l = 0; l < k; ++l)
          want += at(a + item * stride_a, op_a, lda, i, l) * at(b + item * stride_b, op_b, ldb, l, j);
        want = Traits<T>::get(Traits<T>::put(want));
        const C64 got = Traits<T>::get(c[item * m * n + i * n + j]);
        EXPECT(std::abs(got - want) <= Traits<T>::tol * (1 + std::abs(want)),
               "product op %d/%d m=%lld n=%lld k=%lld batch %lld item %lld (%lld, %lld): got %g%+gi want %g%+gi",
               op_a, op_b, m, n, k, batch, item, i, j, got.real(), got.imag(), want.real(), want.imag());
      }
  cudaFree(a), cudaFree(b), cudaFree(c);
}

template <typename T>
void check_products(cudaStream_t stream1) {
  const Operation ops[] = {blas::kOpN, blas::kOpT, blas::kOpC};
  for (Operation op_a : ops)
    for (Operation op_b : ops)
      for (auto [m, n, k] : std::vector<std::array<long long, 3>>{{1, 1, 1}, {3, 5, 4}, {7, 2, 1}, {2, 3, 0}})
        for (long long batch : {1, 3})
          for (bool shared_b : {false, true}) check_product<T>(op_a, op_b, m, n, k, batch, shared_b, 1, stream1);
}

// A product captured on a stream and replayed: each launch reads the inputs of its time.
void check_capture() {
  cudaSetDevice(0);
  cudaStream_t s = nullptr;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  auto* a = static_cast<float*>(device_alloc(4 * 6)), *b = static_cast<float*>(device_alloc(4 * 6));
  auto* c = static_cast<float*>(device_alloc(4 * 4));
  for (int i = 0; i < 6; ++i) b[i] = 1.0f;
  const blas::Product p{blas::Type::kFloat32, 2, 2, 3, 1, {a, blas::kOpN, 3, 0}, {b, blas::kOpN, 2, 0}, c};
  cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed);
  blas::matmul(0, s, p);  // the stream's workspace is allocated here (relaxed mode allows it)
  cudaGraph_t graph = nullptr;
  EXPECT(cudaStreamEndCapture(s, &graph) == cudaSuccess, "a captured product ends its capture");
  cudaGraphExec_t exec = nullptr;
  cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  sim::reset_counters();
  for (float v : {1.0f, 2.0f}) {
    for (int i = 0; i < 6; ++i) a[i] = v;
    cudaGraphLaunch(exec, s);
    cudaStreamSynchronize(s);
    for (int i = 0; i < 4; ++i) EXPECT(c[i] == 3 * v, "replay with inputs %g: c[%d] = %g", v, i, c[i]);
  }
  EXPECT(sim::counters().blas.empty(), "a replay queues no product from the host");
  cudaGraphExecDestroy(exec);
  cudaFree(a), cudaFree(b), cudaFree(c);
}

// A product on the stream of the last one sets neither stream nor workspace again; one on
// another stream sets both, and a capture on a stream set eagerly before still has its workspace.
void check_stream_switches(void* lib) {
  using Count = long long (*)();
  auto set_streams = reinterpret_cast<Count>(dlsym(lib, "mirroredSimCublasSetStreamCalls"));
  EXPECT(set_streams, "the stand-in counts its cublasSetStream calls");
  if (!set_streams) return;
  cudaSetDevice(0);
  cudaStream_t s1 = nullptr, s2 = nullptr;
  cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking);
  cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking);
  auto* a = static_cast<float*>(device_alloc(4 * 4)), *c = static_cast<float*>(device_alloc(4 * 4));
  for (int i = 0; i < 4; ++i) a[i] = 1.0f;
  const blas::Product p{blas::Type::kFloat32, 2, 2, 2, 1, {a, blas::kOpN, 2, 0}, {a, blas::kOpT, 2, 0}, c};
  blas::matmul(0, s1, p);
  const long long first = set_streams();
  blas::matmul(0, s1, p);
  blas::matmul(0, s1, p);
  EXPECT(set_streams() == first, "products on the last product's stream set no stream (%lld calls)",
         set_streams() - first);
  blas::matmul(0, s2, p);
  EXPECT(set_streams() == first + 1, "a product on another stream sets it");
  blas::matmul(0, s1, p);
  EXPECT(set_streams() == first + 2, "and one back on the first stream sets that again");
  cudaStreamBeginCapture(s1, cudaStreamCaptureModeRelaxed);
  blas::matmul(0, s1, p);  // (the stand-in refuses a capture without the stream's workspace)
  cudaGraph_t graph = nullptr;
  EXPECT(cudaStreamEndCapture(s1, &graph) == cudaSuccess, "a capture on a stream set before ends");
  EXPECT(set_streams() == first + 2, "a captured product on the handle's stream sets nothing");
  cudaGraphDestroy(graph);
  sim::drain();
  for (int i = 0; i < 4; ++i) EXPECT(c[i] == 2.0f, "c[%d] = %g", i, c[i]);
  cudaFree(a), cudaFree(c);
}

// The stand-in's own rules, called directly as a careless caller would.
void check_refusals(void* lib) {
  using Create = int (*)(blas::Handle*);
  using Destroy = int (*)(blas::Handle);
  using SetStream = int (*)(blas::Handle, cudaStream_t);
  using SetWorkspace = int (*)(blas::Handle, void*, std::size_t);
  using Gemm = int (*)(blas::Handle, int, int, int, int, int, const void*, const void*, int, int, const void*, int,
                       int, const void*, void*, int, int, int, int);
  auto create = reinterpret_cast<Create>(dlsym(lib, "cublasCreate_v2"));
  auto destroy = reinterpret_cast<Destroy>(dlsym(lib, "cublasDestroy_v2"));
  auto set_stream = reinterpret_cast<SetStream>(dlsym(lib, "cublasSetStream_v2"));
  auto set_workspace = reinterpret_cast<SetWorkspace>(dlsym(lib, "cublasSetWorkspace_v2"));
  auto gemm = reinterpret_cast<Gemm>(dlsym(lib, "cublasGemmEx"));
  EXPECT(create && destroy && set_stream && set_workspace && gemm, "the stand-in exports cuBLAS's entry points");
  cudaSetDevice(0);
  blas::Handle h = nullptr;
  create(&h);
  cudaStream_t s = nullptr;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  auto* x = static_cast<float*>(device_alloc(64));
  void* workspace = device_alloc(blas::kStandInWorkspaceBytes);
  const float one = 1, zero = 0;
  auto call = [&](int ld) {
    return gemm(h, blas::kOpN, blas::kOpN, 2, 2, 2, &one, x, blas::kR32F, ld, x, blas::kR32F, 2, &zero, x + 8,
                blas::kR32F, 2, blas::kCompute32F, blas::kGemmDefault);
  };
  set_stream(h, s);
  EXPECT(call(2) == blas::kSuccess, "cuBLAS's own workspace outside a capture");
  EXPECT(call(1) == 7, "lda below the rows: CUBLAS_STATUS_INVALID_VALUE");
  cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed);
  EXPECT(call(2) == blas::kNotSupported, "no workspace of the caller's under capture");
  set_workspace(h, workspace, blas::kStandInWorkspaceBytes);
  EXPECT(call(2) == blas::kSuccess, "a workspace of the caller's under capture");
  set_stream(h, s);  // resets the workspace, as cuBLAS's does
  EXPECT(call(2) == blas::kNotSupported, "cublasSetStream forgets the workspace");
  cudaGraph_t graph = nullptr;
  cudaStreamEndCapture(s, &graph);
  cudaGraphDestroy(graph);
  set_workspace(h, workspace, 1024);
  EXPECT(call(2) == blas::kNotSupported, "too small a workspace");
  sim::drain();
  destroy(h);
  cudaFree(x), cudaFree(workspace);
}

// Threads sharing GPU 0's handle, each on a stream of its own.
void check_threads() {
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([] {
      cudaSetDevice(0);
      cudaStream_t s = nullptr;
      cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
      for (int i = 0; i < 3; ++i) check_product<float>(blas::kOpT, blas::kOpN, 4, 3, 5, 2, false, 0, s);
    });
  for (auto& t : threads) t.join();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::printf("usage: blas_sim_test PATH_OF_THE_STAND_IN_LIBCUBLAS\n");
    return 2;
  }
  sim::reset(2, {}, 7);
  try {
    blas::matmul(0, nullptr, {blas::Type::kFloat32, 1, 1, 1, 1, {}, {}, nullptr});
    std::printf("FAIL: a product before cuBLAS is loaded\n"), ++failures;
  } catch (const std::runtime_error& e) {
    if (!std::strstr(e.what(), "MIRRORED_CUBLAS_LIBRARY")) std::printf("FAIL: %s\n", e.what()), ++failures;
  }
  blas::load({"/nonexistent/libcublas.so", argv[1]});
  cudaSetDevice(1);
  cudaStream_t stream1 = nullptr;
  cudaStreamCreateWithFlags(&stream1, cudaStreamNonBlocking);
  check_products<float>(stream1);
  check_products<double>(nullptr);
  check_products<C64>(stream1);
  check_products<F16>(stream1);
  check_capture();
  check_refusals(dlopen(argv[1], RTLD_NOW | RTLD_LOCAL));
  check_stream_switches(dlopen(argv[1], RTLD_NOW | RTLD_LOCAL));
  check_threads();
  std::printf("cuBLAS engine on the simulated runtime: %d failures\n", failures);
  return failures ? 1 : 0;
}
