// The simulator tests' check: EXPECT(cond, printf format, args...) counts a failure, prints
// the first ten, and returns from the calling function (its later checks would only repeat it).
#pragma once

#include <cstdio>

namespace mirrored::cuda::sim_check {
inline int failures = 0;
}  // namespace mirrored::cuda::sim_check

#define EXPECT(cond, ...)                                                                                   \
  if (!(cond)) {                                                                                            \
    if (++::mirrored::cuda::sim_check::failures <= 10) std::printf("FAIL: " __VA_ARGS__), std::printf("\n"); \
    return;                                                                                                 \
  }
