// avx2 kernels; this file is compiled with avx2 flags (see CMakeLists.txt)
// and only called when the CPU reports avx2 support.
#include <cstdint>
#include <type_traits>
#if defined(__F16C__)
#include <immintrin.h>
#endif

#include "core/half.h"
#include "host/reduce_kernels.h"

namespace mirrored {
namespace isa_avx2 {
#include "host/reduce_kernels_impl.h"
}  // namespace isa_avx2

const ReduceKernels* reduce_kernels_avx2() {
  static const ReduceKernels table = isa_avx2::kern::make_table("avx2");
  return &table;
}
}  // namespace mirrored
