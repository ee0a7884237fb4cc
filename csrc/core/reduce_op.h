// Reduction operators. MEAN is not an operator of its own: it is SUM followed
// by a scale of 1/N applied once, by whoever produces the final value.
#pragma once

#include <stdexcept>
#include <string>

namespace mirrored {

enum class ReduceOp : int { kSum = 0, kProd = 1, kMin = 2, kMax = 3, kMean = 4 };

inline const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kProd: return "prod";
    case ReduceOp::kMin: return "min";
    case ReduceOp::kMax: return "max";
    case ReduceOp::kMean: return "mean";
  }
  return "unknown";
}

inline ReduceOp reduce_op_from_code(int code) {
  if (code < 0 || code > 4)
    throw std::invalid_argument("reduce op code " + std::to_string(code) + " is not sum/prod/min/max/mean");
  return static_cast<ReduceOp>(code);
}

// The elementwise operator used while combining buffers (MEAN combines as SUM).
inline ReduceOp combining_op(ReduceOp op) { return op == ReduceOp::kMean ? ReduceOp::kSum : op; }

}  // namespace mirrored
