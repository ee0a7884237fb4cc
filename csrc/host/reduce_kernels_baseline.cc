// Baseline kernels: the compiler's default for the target (SSE2 on x86-64).
#include <cstdint>
#include <type_traits>
#if defined(__F16C__)
#include <immintrin.h>
#endif

#include "core/half.h"
#include "host/reduce_kernels.h"

namespace mirrored {
namespace isa_baseline {
#include "host/reduce_kernels_impl.h"
}  // namespace isa_baseline

const ReduceKernels& reduce_kernels_baseline() {
  static const ReduceKernels table = isa_baseline::kern::make_table("baseline");
  return table;
}
}  // namespace mirrored
