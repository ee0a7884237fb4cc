#include "packer.h"

#include <stdexcept>
#include <string>

namespace mirrored {

std::vector<Pack> plan_packs(const std::vector<std::size_t>& tensor_bytes, const std::vector<DType>& dtypes,
                             std::size_t bytes_per_pack, int num_packs) {
  if (tensor_bytes.size() != dtypes.size())
    throw std::invalid_argument("plan_packs: " + std::to_string(tensor_bytes.size()) + " sizes but " +
                                std::to_string(dtypes.size()) + " dtypes");
  if (num_packs < 0) throw std::invalid_argument("num_packs must be >= 0, got " + std::to_string(num_packs));

  std::vector<Pack> packs;
  for (int code = 0; code < kNumDTypes; ++code) {
    const DType dt = static_cast<DType>(code);
    std::size_t group_bytes = 0;
    std::size_t group_size = 0;
    for (std::size_t i = 0; i < dtypes.size(); ++i)
      if (dtypes[i] == dt) group_bytes += tensor_bytes[i], ++group_size;
    if (group_size == 0) continue;

    // The byte budget of one pack in this group.
    std::size_t budget = group_bytes;  // one pack
    if (bytes_per_pack > 0) {
      budget = bytes_per_pack;
    } else if (num_packs > 0) {
      budget = (group_bytes + num_packs - 1) / num_packs;
    }
    const std::size_t first = packs.size();
    packs.push_back(Pack{dt, 0, {}});
    for (std::size_t i = 0; i < dtypes.size(); ++i) {
      if (dtypes[i] != dt) continue;
      Pack* p = &packs.back();
      const bool full = p->bytes > 0 && p->bytes + tensor_bytes[i] > budget;
      const bool may_open = bytes_per_pack > 0 || num_packs == 0 ||
                            packs.size() - first < static_cast<std::size_t>(num_packs);
      if (full && may_open) {
        packs.push_back(Pack{dt, 0, {}});
        p = &packs.back();
      }
      p->entries.push_back(PackEntry{i, p->bytes, tensor_bytes[i]});
      p->bytes += tensor_bytes[i];
    }
  }
  return packs;
}

}  // namespace mirrored
