// Binary-tree reduction as data: at level l, rank r (a multiple of 2^(l+1))
// folds in rank r + 2^l; after ceil(log2 N) levels rank 0 holds the result,
// which is then broadcast. log2(N) dependent steps instead of the ring's
// 2(N-1): the better choice when latency, not bandwidth, dominates.
#pragma once

#include <cstddef>
#include <stdexcept>
#include <string>

namespace mirrored {

struct TreeOp {
  int dst;          // rank whose output receives the combination
  int src;          // rank folded into it
  bool dst_input;   // dst has not been written yet: read its input
  bool src_input;   // src has not been written yet: read its input
  bool finalize;    // the last fold: apply MEAN's 1/N here
};

class TreeSchedule {
 public:
  explicit TreeSchedule(int nranks) : nranks_(nranks) {
    if (nranks < 1) throw std::invalid_argument("tree needs at least 1 participant, got " + std::to_string(nranks));
    while ((1 << levels_) < nranks_) ++levels_;
  }
  int nranks() const { return nranks_; }
  int num_levels() const { return levels_; }
  // Folds at `level`: ranks 0, 2^(l+1), 2*2^(l+1), ... that have a partner.
  int num_ops(int level) const {
    const int stride = 1 << (level + 1);
    const int half = 1 << level;
    int n = 0;
    for (int r = 0; r + half < nranks_; r += stride) ++n;
    return n;
  }
  TreeOp op(int level, int index) const {
    const int half = 1 << level;
    TreeOp o;
    o.dst = index * (half << 1);
    o.src = o.dst + half;
    // A rank has been written iff it was a destination at level 0, which any
    // multiple of 2^level with a right neighbour was.
    o.dst_input = level == 0;
    o.src_input = level == 0 || o.src + 1 >= nranks_;
    o.finalize = level == levels_ - 1;
    return o;
  }

 private:
  int nranks_;
  int levels_ = 0;
};

}  // namespace mirrored
