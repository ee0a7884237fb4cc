// Splitting [0, count) between workers. Boundaries fall on 64-byte multiples
// so two workers never write the same cache line.
#pragma once

#include <algorithm>
#include <cstddef>

namespace mirrored {

struct Range {
  std::size_t begin;
  std::size_t end;
  std::size_t size() const { return end - begin; }
};

inline Range partition(std::size_t count, std::size_t elem_size, int part, int nparts) {
  const std::size_t granule = std::max<std::size_t>(1, 64 / elem_size);
  const std::size_t granules = (count + granule - 1) / granule;
  const std::size_t per = (granules + nparts - 1) / nparts;
  const std::size_t begin = std::min(count, per * granule * part);
  const std::size_t end = std::min(count, begin + per * granule);
  return {begin, end};
}

}  // namespace mirrored
