#include "nccl/nccl_lib.h"

#include <dlfcn.h>

#include <memory>
#include <mutex>
#include <stdexcept>

namespace mirrored::nccl {
namespace {

constexpr const char* kFix = "install it with `pip install nvidia-nccl-cu13` (or the system's libnccl2)";

std::mutex mu;
std::unique_ptr<Library> lib;  // never unloaded: communicators may outlive any owner

template <typename F>
bool bind(void* handle, const char* name, F& fn, std::string& missing) {
  fn = reinterpret_cast<F>(dlsym(handle, name));
  if (!fn) missing += std::string(missing.empty() ? "" : ", ") + name;
  return fn != nullptr;
}

}  // namespace

const Library& load(const std::vector<std::string>& candidates) {
  std::lock_guard<std::mutex> lock(mu);
  if (lib) return *lib;
  std::string tried;
  for (const std::string& path : candidates) {
    void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!h) {
      const char* e = dlerror();
      tried += "\n  " + path + ": " + (e ? e : "not loadable");
      continue;
    }
    auto l = std::make_unique<Library>();
    Api& a = l->api;
    std::string missing;
    bind(h, "ncclGetVersion", a.GetVersion, missing);
    bind(h, "ncclGetErrorString", a.GetErrorString, missing);
    bind(h, "ncclGetUniqueId", a.GetUniqueId, missing);
    bind(h, "ncclCommInitRank", a.CommInitRank, missing);
    bind(h, "ncclCommInitAll", a.CommInitAll, missing);
    bind(h, "ncclCommDestroy", a.CommDestroy, missing);
    bind(h, "ncclAllReduce", a.AllReduce, missing);
    bind(h, "ncclBroadcast", a.Broadcast, missing);
    bind(h, "ncclReduce", a.Reduce, missing);
    bind(h, "ncclAllGather", a.AllGather, missing);
    bind(h, "ncclGroupStart", a.GroupStart, missing);
    bind(h, "ncclGroupEnd", a.GroupEnd, missing);
    if (!missing.empty()) {
      tried += "\n  " + path + ": lacks " + missing + " (too old an NCCL)";
      dlclose(h);
      continue;
    }
    std::string optional;
    bind(h, "ncclGetLastError", a.GetLastError, optional);
    if (a.GetVersion(&l->version) != kSuccess) l->version = 0;
    l->path = path;
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
