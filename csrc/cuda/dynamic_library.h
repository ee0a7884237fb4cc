// Libraries mirrored loads at run time (NCCL, cuBLAS), so that nothing of them
// is needed to build: the first candidate path that dlopen loads and that has
// every required entry point wins.
#pragma once

#include <dlfcn.h>

#include <string>
#include <vector>

namespace mirrored::cuda {

// Sets `fn` to the symbol `name` of `handle`; a missing one is added to `missing`.
template <typename F>
bool bind_symbol(void* handle, const char* name, F& fn, std::string& missing) {
  fn = reinterpret_cast<F>(dlsym(handle, name));
  if (!fn) missing += std::string(missing.empty() ? "" : ", ") + name;
  return fn != nullptr;
}

// The handle of the first of `candidates` that loads and for which `bind_all(handle, missing)`
// leaves `missing` empty (its path in `path`), or nullptr. `tried` collects why each other
// candidate was passed over; `too_old` says what lacking entry points means.
template <typename BindAll>
void* open_first(const std::vector<std::string>& candidates, BindAll&& bind_all, const char* too_old,
                 std::string& path, std::string& tried) {
  for (const std::string& candidate : candidates) {
    void* h = dlopen(candidate.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!h) {
      const char* e = dlerror();
      tried += "\n  " + candidate + ": " + (e ? e : "not loadable");
      continue;
    }
    std::string missing;
    bind_all(h, missing);
    if (!missing.empty()) {
      tried += "\n  " + candidate + ": lacks " + missing + " (" + too_old + ")";
      dlclose(h);
      continue;
    }
    path = candidate;
    return h;
  }
  return nullptr;
}

}  // namespace mirrored::cuda
