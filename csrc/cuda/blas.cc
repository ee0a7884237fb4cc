#include "cuda/blas.h"

#include <climits>
#include <complex>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <utility>

#include "core/dynamic_library.h"
#include "cuda/check.h"
#include "cuda/device.h"

namespace mirrored::cuda::blas {
namespace {

constexpr const char* kFix =
    "install the cuBLAS CuPy uses (`pip install nvidia-cublas-cu13`, or the CUDA toolkit's libcublas) or set "
    "MIRRORED_CUBLAS_LIBRARY to libcublas.so's path";

struct Library {
  Api api{};
  std::string path;
};

// A GPU's handle and its workspaces, one per stream; `mu` serialises the
// set-stream/set-workspace/call sequence of the threads sharing the handle.
struct DeviceState {
  Handle handle = nullptr;
  std::map<cudaStream_t, void*> workspaces;
  std::mutex mu;
};

std::mutex mu;
Library* lib = nullptr;  // never unloaded, and neither are the handles: products may be queued at exit
std::map<int, DeviceState*>& states = *new std::map<int, DeviceState*>;

void check(Status status, const char* call) {
  if (status == kSuccess) return;
  throw std::runtime_error(std::string(call) + " failed: " + status_name(status) + " (" + std::to_string(status) +
                           ")");
}

const Api& loaded() {
  std::lock_guard<std::mutex> lock(mu);
  if (!lib) throw std::runtime_error(std::string("cuBLAS is not loaded; ") + kFix);
  return lib->api;
}

DeviceState& state_of(int device, const Api& api) {
  std::lock_guard<std::mutex> lock(mu);
  DeviceState*& s = states[device];
  if (!s) {
    auto made = std::make_unique<DeviceState>();
    DeviceGuard guard;
    MIRRORED_CUDA_CHECK(cudaSetDevice(device));
    check(api.Create(&made->handle), "cublasCreate");
    check(api.SetMathMode(made->handle, kDefaultMath), "cublasSetMathMode");
    s = made.release();
  }
  return *s;
}

// The stream's workspace, allocated on its first product (relaxed stream
// capture, as md.function's, allows the allocation), kept as long as the process.
void* workspace_of(DeviceState& s, cudaStream_t stream) {
  void*& w = s.workspaces[stream];
  if (!w) MIRRORED_CUDA_CHECK(cudaMalloc(&w, kWorkspaceBytes));
  return w;
}

struct Format {
  int data;
  int compute;
};

Format format_of(Type t) {
  switch (t) {
    case Type::kFloat16: return {kR16F, kCompute32F};
    case Type::kBFloat16: return {kR16BF, kCompute32F};
    case Type::kFloat32: return {kR32F, kCompute32F};
    case Type::kFloat64: return {kR64F, kCompute64F};
    case Type::kComplex64: return {kC32F, kCompute32F};
    case Type::kComplex128: return {kC64F, kCompute64F};
  }
  throw std::invalid_argument("matmul: unknown element type code " + std::to_string(static_cast<int>(t)));
}

// alpha = 1 and beta = 0 in the compute type's scalar type (host pointer mode).
struct Scalars {
  std::complex<double> one{1.0, 0.0}, zero{0.0, 0.0};
  std::complex<float> one_f{1.0f, 0.0f}, zero_f{0.0f, 0.0f};
  const void* alpha(Type t) const { return wide(t) ? static_cast<const void*>(&one) : &one_f; }
  const void* beta(Type t) const { return wide(t) ? static_cast<const void*>(&zero) : &zero_f; }
  // A real scalar is the real part's bytes, which the complex value begins with.
  static bool wide(Type t) { return t == Type::kFloat64 || t == Type::kComplex128; }
};

int fits(long long v, const char* what) {
  if (v < 0 || v > INT_MAX)
    throw std::invalid_argument(std::string("matmul: ") + what + "=" + std::to_string(v) +
                                " is beyond what cuBLAS takes (0 to 2**31 - 1)");
  return static_cast<int>(v);
}

}  // namespace

std::string load(const std::vector<std::string>& candidates) {
  std::lock_guard<std::mutex> lock(mu);
  if (lib) return lib->path;
  auto l = std::make_unique<Library>();
  Api& a = l->api;
  std::string tried;
  if (dl::open_first(candidates, "cuBLAS older than CUDA 11", [&a](void* h, std::string& missing) {
        dl::bind(h, "cublasCreate_v2", a.Create, missing);
        dl::bind(h, "cublasSetStream_v2", a.SetStream, missing);
        dl::bind(h, "cublasSetWorkspace_v2", a.SetWorkspace, missing);
        dl::bind(h, "cublasSetMathMode", a.SetMathMode, missing);
        dl::bind(h, "cublasGemmEx", a.GemmEx, missing);
        dl::bind(h, "cublasGemmStridedBatchedEx", a.GemmStridedBatchedEx, missing);
      }, l->path, tried)) {
    lib = l.release();
    return lib->path;
  }
  throw std::runtime_error(std::string("cuBLAS is not available; ") + kFix + ". Tried:" +
                           (tried.empty() ? std::string(" no candidates") : tried));
}

void matmul(int device, cudaStream_t stream, const Product& p) {
  const Api& api = loaded();
  const Format f = format_of(p.type);
  // Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: cuBLAS reads each row-major
  // operand as its column-major transpose, so the operands swap places and keep their op flags.
  const int m = fits(p.n, "n"), n = fits(p.m, "m"), k = fits(p.k, "k");
  const int lda = fits(p.b.ld, "ld of b"), ldb = fits(p.a.ld, "ld of a"), ldc = m > 0 ? m : 1;
  const int batch = fits(p.batch, "batch");
  if (m == 0 || n == 0 || batch == 0) return;
  const Scalars scalars;
  DeviceState& s = state_of(device, api);
  std::lock_guard<std::mutex> lock(s.mu);
  DeviceGuard guard;
  MIRRORED_CUDA_CHECK(cudaSetDevice(device));
  // SetStream resets the workspace to cuBLAS's own pool: the stream's workspace is set after it.
  check(api.SetStream(s.handle, stream), "cublasSetStream");
  check(api.SetWorkspace(s.handle, workspace_of(s, stream), kWorkspaceBytes), "cublasSetWorkspace");
  if (batch == 1) {
    check(api.GemmEx(s.handle, p.b.op, p.a.op, m, n, k, scalars.alpha(p.type), p.b.data, f.data, lda, p.a.data, f.data,
                     ldb, scalars.beta(p.type), p.c, f.data, ldc, f.compute, kGemmDefault),
          "cublasGemmEx");
    return;
  }
  check(api.GemmStridedBatchedEx(s.handle, p.b.op, p.a.op, m, n, k, scalars.alpha(p.type), p.b.data, f.data, lda,
                                 p.b.stride, p.a.data, f.data, ldb, p.a.stride, scalars.beta(p.type), p.c, f.data, ldc,
                                 p.m * p.n, batch, f.compute, kGemmDefault),
        "cublasGemmStridedBatchedEx");
}

}  // namespace mirrored::cuda::blas
