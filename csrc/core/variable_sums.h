// The one order in which a rule that reduces over a whole variable (Lamb's
// norms, Adafactor's root mean squares) adds up its elements, shared by the
// host kernel, the CUDA kernels (and the simulator, which runs their bodies)
// and the NumPy/CuPy reference (rules.py's variable_sum). A fixed order makes
// every copy of a variable take the same bits on every replica, on host and on
// GPU, whatever the grid.
//
// A variable of `count` elements has lanes = min(count, kSumLanes) lanes:
// lane p adds x[p], x[p + lanes], x[p + 2 lanes], ... in that order (one GPU
// thread each, coalesced; the host adds a block of `lanes` at a time). The
// lanes are added in groups of kSumGroup, each group in lane order, and the
// groups in order. Every addition rounds in T, as Keras' float32 sums do.
//
// The terms are squares (x >= 0, inf or NaN), so the reference may pad the
// last block with zeros: s + 0 is s.
#pragma once

#include <cstddef>

#include "core/host_device.h"

namespace mirrored::rules {

constexpr std::size_t kSumLanes = 8192;
constexpr std::size_t kSumGroup = 64;

MIRRORED_HD inline std::size_t sum_lanes(std::size_t count) { return count < kSumLanes ? count : kSumLanes; }

MIRRORED_HD inline std::size_t sum_groups(std::size_t lanes) { return (lanes + kSumGroup - 1) / kSumGroup; }

// Lane p of a variable of `count` elements split in `lanes` lanes (p < lanes): term(i) for
// i = p, p + lanes, ..., added in that order. (One GPU thread per lane.)
template <typename T, typename Term>
MIRRORED_HD inline T lane_sum(const Term& term, std::size_t count, std::size_t lanes, std::size_t p) {
  T s = term(p);
  for (std::size_t i = p + lanes; i < count; i += lanes) s = s + term(i);
  return s;
}

// Group g of the lane sums `lane` (`lanes` of them): lanes g * kSumGroup, ... in order.
template <typename T>
MIRRORED_HD inline T group_sum(const T* lane, std::size_t lanes, std::size_t g) {
  const std::size_t first = g * kSumGroup, end = first + kSumGroup < lanes ? first + kSumGroup : lanes;
  T s = lane[first];
  for (std::size_t p = first + 1; p < end; ++p) s = s + lane[p];
  return s;
}

// The variable's sum from its group sums, in order (0 for a variable of no elements).
template <typename T>
MIRRORED_HD inline T total_sum(const T* group, std::size_t groups) {
  T s = groups > 0 ? group[0] : T(0);
  for (std::size_t g = 1; g < groups; ++g) s = s + group[g];
  return s;
}

// The whole sum on one thread, the lanes advanced a block at a time (the host's way: the inner
// loop runs over contiguous elements and vectorises). `lane` has room for sum_lanes(count) T's.
template <typename T, typename Term>
inline T variable_sum(const Term& term, std::size_t count, T* lane) {
  const std::size_t lanes = sum_lanes(count);
  for (std::size_t p = 0; p < lanes; ++p) lane[p] = term(p);
  for (std::size_t b = lanes; b < count; b += lanes) {
    const std::size_t m = count - b < lanes ? count - b : lanes;
    for (std::size_t p = 0; p < m; ++p) lane[p] = lane[p] + term(b + p);
  }
  const std::size_t groups = sum_groups(lanes);
  T total = T(0);
  for (std::size_t g = 0; g < groups; ++g) {
    const T s = group_sum(lane, lanes, g);
    total = g == 0 ? s : total + s;
  }
  return total;
}

}  // namespace mirrored::rules
