#include "host/reduce_kernels.h"

namespace mirrored {

#if !defined(MIRRORED_HAVE_AVX2)
const ReduceKernels* reduce_kernels_avx2() { return nullptr; }
#endif
#if !defined(MIRRORED_HAVE_AVX512)
const ReduceKernels* reduce_kernels_avx512() { return nullptr; }
#endif

namespace {
const ReduceKernels& choose() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  if (const ReduceKernels* k = reduce_kernels_avx512();
      k && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma"))
    return *k;
  if (const ReduceKernels* k = reduce_kernels_avx2();
      k && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma"))
    return *k;
#endif
  return reduce_kernels_baseline();
}
}  // namespace

const ReduceKernels& reduce_kernels() {
  static const ReduceKernels& table = choose();
  return table;
}

}  // namespace mirrored
