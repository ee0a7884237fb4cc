#include "nccl/nccl_lib.h"

#include <memory>
#include <mutex>
#include <stdexcept>

#include "cuda/dynamic_library.h"

namespace mirrored::nccl {
namespace {

constexpr const char* kFix = "install it with `pip install nvidia-nccl-cu13` (or the system's libnccl2)";

std::mutex mu;
std::unique_ptr<Library> lib;  // never unloaded: communicators may outlive any owner

}  // namespace

const Library& load(const std::vector<std::string>& candidates) {
  std::lock_guard<std::mutex> lock(mu);
  if (lib) return *lib;
  auto l = std::make_unique<Library>();
  Api& a = l->api;
  std::string tried;
  void* h = cuda::open_first(candidates, [&a](void* h, std::string& missing) {
    cuda::bind_symbol(h, "ncclGetVersion", a.GetVersion, missing);
    cuda::bind_symbol(h, "ncclGetErrorString", a.GetErrorString, missing);
    cuda::bind_symbol(h, "ncclGetUniqueId", a.GetUniqueId, missing);
    cuda::bind_symbol(h, "ncclCommInitRank", a.CommInitRank, missing);
    cuda::bind_symbol(h, "ncclCommInitAll", a.CommInitAll, missing);
    cuda::bind_symbol(h, "ncclCommDestroy", a.CommDestroy, missing);
    cuda::bind_symbol(h, "ncclAllReduce", a.AllReduce, missing);
    cuda::bind_symbol(h, "ncclBroadcast", a.Broadcast, missing);
    cuda::bind_symbol(h, "ncclReduce", a.Reduce, missing);
    cuda::bind_symbol(h, "ncclAllGather", a.AllGather, missing);
    cuda::bind_symbol(h, "ncclGroupStart", a.GroupStart, missing);
    cuda::bind_symbol(h, "ncclGroupEnd", a.GroupEnd, missing);
  }, "too old an NCCL", l->path, tried);
  if (!h)
    throw std::runtime_error(std::string("NCCL is not available; ") + kFix + ". Tried:" +
                             (tried.empty() ? std::string(" no candidates") : tried));
  std::string optional;
  cuda::bind_symbol(h, "ncclGetLastError", a.GetLastError, optional);
  if (a.GetVersion(&l->version) != kSuccess) l->version = 0;
  lib = std::move(l);
  return *lib;
}

const Library& loaded() {
  std::lock_guard<std::mutex> lock(mu);
  if (!lib) throw std::runtime_error(std::string("NCCL is not loaded; ") + kFix);
  return *lib;
}

void check(const Library& l, Result result, const char* call, Comm comm) {
  if (result == kSuccess) return;
  std::string msg = std::string(call) + " failed: " + l.api.GetErrorString(result);
  if (l.api.GetLastError) {
    const char* last = l.api.GetLastError(comm);
    if (last && *last) msg += std::string(" (") + last + ")";
  }
  throw std::runtime_error(msg);
}

}  // namespace mirrored::nccl
