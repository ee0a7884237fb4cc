// Loading libnccl.so.2 at run time. The Python layer passes the candidates
// (the nvidia-nccl-cu13 wheel's copy first, then the system's); the first one
// that loads and has every required symbol wins, once per process.
#pragma once

#include <string>
#include <vector>

#include "nccl/nccl_api.h"

namespace mirrored::nccl {

struct Library {
  Api api{};
  int version = 0;
  std::string path;
};

// Loads (or returns the already loaded) library; throws a runtime_error that
// names every candidate tried, why it failed, and `pip install nvidia-nccl-cu13`.
const Library& load(const std::vector<std::string>& candidates);
// The loaded library, or a runtime_error naming the fix when none is.
const Library& loaded();

// Throws when `result` is not success, naming the call and NCCL's message.
void check(const Library& lib, Result result, const char* call, Comm comm = nullptr);

}  // namespace mirrored::nccl

#define MIRRORED_NCCL_CHECK(lib, call, comm) ::mirrored::nccl::check((lib), (lib).api.call, "nccl" #call, (comm))
