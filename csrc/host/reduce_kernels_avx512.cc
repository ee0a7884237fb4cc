// avx512 kernels; this file is compiled with avx512 flags (see CMakeLists.txt)
// and only called when the CPU reports avx512 support.
#include <cstdint>
#include <type_traits>
#if defined(__F16C__)
#include <immintrin.h>
#endif

#include "core/half.h"
#include "host/reduce_kernels.h"

namespace mirrored {
namespace isa_avx512 {
#include "host/reduce_kernels_impl.h"
}  // namespace isa_avx512

const ReduceKernels* reduce_kernels_avx512() {
  static const ReduceKernels table = isa_avx512::kern::make_table("avx512");
  return &table;
}
}  // namespace mirrored
