#include "host/reduce_kernels.h"

namespace mirrored {

#if !defined(MIRRORED_HAVE_AVX2)
const ReduceKernels* reduce_kernels_avx2() { return nullptr; }
#endif
#if !defined(MIRRORED_HAVE_AVX512)
const ReduceKernels* reduce_kernels_avx512() { return nullptr; }
#endif

namespace {
// The CPU is asked first: reduce_kernels_avx512() and reduce_kernels_avx2() are compiled for their ISA, so
// even building their tables may run its instructions (SIGILL on a CPU without it).
const ReduceKernels& choose() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  const bool fma_f16c = __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma");
  if (fma_f16c && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl"))
    if (const ReduceKernels* k = reduce_kernels_avx512()) return *k;
  if (fma_f16c && __builtin_cpu_supports("avx2"))
    if (const ReduceKernels* k = reduce_kernels_avx2()) return *k;
#endif
  return reduce_kernels_baseline();
}
}  // namespace

const ReduceKernels& reduce_kernels() {
  static const ReduceKernels& table = choose();
  return table;
}

}  // namespace mirrored
