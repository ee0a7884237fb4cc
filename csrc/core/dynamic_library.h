// The libraries mirrored loads at run time with dlopen (libnccl, libcublas), so
// that nothing of them is needed to build: the first of a list of candidate
// paths that loads and has every entry point mirrored calls.
#pragma once

#include <dlfcn.h>

#include <string>
#include <vector>

namespace mirrored::dl {

// fn = the entry point `name` of the library `handle`; when it has none, fn is
// null and `name` is appended to `missing` (comma-separated).
template <typename F>
bool bind(void* handle, const char* name, F& fn, std::string& missing) {
  fn = reinterpret_cast<F>(dlsym(handle, name));
  if (!fn) missing += std::string(missing.empty() ? "" : ", ") + name;
  return fn != nullptr;
}

// The first of `candidates` that dlopen loads and in which bind_all(handle,
// missing) (binding each entry point with bind()) misses none: its handle, its
// path in `path`. Null when none does; `tried` then says for each candidate
// why ("\n  PATH: dlopen's error", or "lacks NAMES (`lacking`)").
template <typename BindAll>
void* open_first(const std::vector<std::string>& candidates, const char* lacking, BindAll&& bind_all,
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
    if (missing.empty()) {
      path = candidate;
      return h;
    }
    tried += "\n  " + candidate + ": lacks " + missing + " (" + lacking + ")";
    dlclose(h);
  }
  return nullptr;
}

}  // namespace mirrored::dl
