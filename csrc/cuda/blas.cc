#include "cuda/blas.h"

#include <array>
#include <atomic>
#include <climits>
#include <complex>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <utility>

#include "cuda/check.h"
#include "cuda/dynamic_library.h"
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
// `stream` is the one the handle was last set to (with its workspace), so that
// a product on the same stream as the last one sets neither again.
struct DeviceState {
  Handle handle = nullptr;
  std::map<cudaStream_t, void*> workspaces;
  std::optional<cudaStream_t> stream;
  std::mutex mu;
};

// Devices a process can address (CUDA's ordinals are small; more is refused).
constexpr int kMaxDevices = 256;

// `mu` guards loading the library and making a device's state; a product reads
// both through the atomics without it, as neither changes once set.
std::mutex mu;
std::atomic<Library*> lib{nullptr};  // never unloaded, and neither are the handles: products may be queued at exit
std::array<std::atomic<DeviceState*>, kMaxDevices> states{};

void check(Status status, const char* call) {
  if (status == kSuccess) return;
  throw std::runtime_error(std::string(call) + " failed: " + status_name(status) + " (" + std::to_string(status) +
                           ")");
}

const Api& loaded() {
  const Library* l = lib.load(std::memory_order_acquire);
  if (!l) throw std::runtime_error(std::string("cuBLAS is not loaded; ") + kFix);
  return l->api;
}

DeviceState& state_of(int device, const Api& api) {
  if (device < 0 || device >= kMaxDevices)
    throw std::invalid_argument("matmul: device=" + std::to_string(device) + " is not a GPU ordinal");
  std::atomic<DeviceState*>& slot = states[static_cast<std::size_t>(device)];
  if (DeviceState* s = slot.load(std::memory_order_acquire)) return *s;
  std::lock_guard<std::mutex> lock(mu);
  if (DeviceState* s = slot.load(std::memory_order_relaxed)) return *s;
  auto made = std::make_unique<DeviceState>();
  DeviceGuard guard;
  MIRRORED_CUDA_CHECK(set_device(device));
  check(api.Create(&made->handle), "cublasCreate");
  check(api.SetMathMode(made->handle, kDefaultMath), "cublasSetMathMode");
  slot.store(made.get(), std::memory_order_release);
  return *made.release();
}

// The stream's workspace, allocated on its first product (relaxed stream
// capture, as md.function's, allows the allocation), kept as long as the process.
void* workspace_of(DeviceState& s, cudaStream_t stream) {
  void*& w = s.workspaces[stream];
  if (!w) w = device_malloc(kWorkspaceBytes, "cuBLAS workspace");
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
  if (const Library* l = lib.load(std::memory_order_relaxed)) return l->path;
  auto l = std::make_unique<Library>();
  Api& a = l->api;
  std::string tried;
  void* h = open_first(candidates, [&a](void* h, std::string& missing) {
    bind_symbol(h, "cublasCreate_v2", a.Create, missing);
    bind_symbol(h, "cublasSetStream_v2", a.SetStream, missing);
    bind_symbol(h, "cublasSetWorkspace_v2", a.SetWorkspace, missing);
    bind_symbol(h, "cublasSetMathMode", a.SetMathMode, missing);
    bind_symbol(h, "cublasGemmEx", a.GemmEx, missing);
    bind_symbol(h, "cublasGemmStridedBatchedEx", a.GemmStridedBatchedEx, missing);
  }, "cuBLAS older than CUDA 11", l->path, tried);
  if (!h)
    throw std::runtime_error(std::string("cuBLAS is not available; ") + kFix + ". Tried:" +
                             (tried.empty() ? std::string(" no candidates") : tried));
  lib.store(l.get(), std::memory_order_release);
  return l.release()->path;
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
  // cuBLAS calls go to the handle's device, which the caller mostly has current already.
  int current = -1;
  MIRRORED_CUDA_CHECK(cudaGetDevice(&current));
  std::optional<DeviceGuard> guard;
  if (current != device) {
    guard.emplace();
    MIRRORED_CUDA_CHECK(set_device(device));
  }
  if (s.stream != stream) {
    void* workspace = workspace_of(s, stream);
    s.stream.reset();  // (until both calls succeed)
    // SetStream resets the workspace to cuBLAS's own pool: the stream's workspace is set after it.
    check(api.SetStream(s.handle, stream), "cublasSetStream");
    check(api.SetWorkspace(s.handle, workspace, kWorkspaceBytes), "cublasSetWorkspace");
    s.stream = stream;
  }
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
