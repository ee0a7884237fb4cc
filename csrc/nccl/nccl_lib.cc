#include "nccl/nccl_lib.h"

#include <memory>
#include <mutex>
#include <stdexcept>

#include "core/dynamic_library.h"

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
  void* h = dl::open_first(candidates, "too old an NCCL", [&a](void* h, std::string& missing) {
    dl::bind(h, "ncclGetVersion", a.GetVersion, missing);
    dl::bind(h, "ncclGetErrorString", a.GetErrorString, missing);
    dl::bind(h, "ncclGetUniqueId", a.GetUniqueId, missing);
    dl::bind(h, "ncclCommInitRank", a.CommInitRank, missing);
    dl::bind(h, "ncclCommInitAll", a.CommInitAll, missing);
    dl::bind(h, "ncclCommDestroy", a.CommDestroy, missing);
    dl::bind(h, "ncclAllReduce", a.AllReduce, missing);
    dl::bind(h, "ncclBroadcast", a.Broadcast, missing);
    dl::bind(h, "ncclReduce", a.Reduce, missing);
    dl::bind(h, "ncclAllGather", a.AllGather, missing);
    dl::bind(h, "ncclGroupStart", a.GroupStart, missing);
    dl::bind(h, "ncclGroupEnd", a.GroupEnd, missing);
  }, l->path, tried);
  if (h) {
    std::string optional;
    dl::bind(h, "ncclGetLastError", a.GetLastError, optional);
    if (a.GetVersion(&l->version) != kSuccess) l->version = 0;
    lib = std::move(l);
    return *lib;
  }
  throw std::runtime_error(std::string("NCCL is not available; ") + kFix + ". Tried:" +
                           (tried.empty() ? std::string(" no candidates") : tried));
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
