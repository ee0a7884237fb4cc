// Element-wise kernels over host memory, one table per instruction set; the
// best table for this CPU is chosen once, when the library loads (never
// -march=native: the wheel must run on any x86-64).
#pragma once

#include <cstddef>

#include "core/dtype.h"
#include "core/reduce_op.h"

namespace mirrored {

struct ReduceKernels {
  const char* isa;
  // dst[i] = a[i] (op) b[i]; dst may alias a or b. Indexed [dtype][op], op in
  // sum/prod/min/max (MEAN combines as sum).
  void (*combine[kNumDTypes][4])(void* dst, const void* a, const void* b, std::size_t n);
  // dst[i] = dst[i] / divisor: true division, integers truncated toward zero.
  void (*divide[kNumDTypes])(void* dst, std::size_t n, int divisor);
};

// The table for this CPU (SSE2 baseline, AVX2, AVX-512), chosen at load time.
const ReduceKernels& reduce_kernels();

// dst = a (op) b for one dtype/op pair; MEAN combines as sum.
inline void combine(const ReduceKernels& k, DType t, ReduceOp op, void* dst, const void* a, const void* b,
                    std::size_t n) {
  k.combine[static_cast<int>(t)][static_cast<int>(combining_op(op))](dst, a, b, n);
}

// Per-ISA tables, defined in reduce_kernels_<isa>.cc.
const ReduceKernels& reduce_kernels_baseline();
const ReduceKernels* reduce_kernels_avx2();    // nullptr when not compiled in
const ReduceKernels* reduce_kernels_avx512();  // nullptr when not compiled in

}  // namespace mirrored
