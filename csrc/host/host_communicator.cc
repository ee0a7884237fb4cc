#include "host/host_communicator.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

#include "core/partition.h"
#include "core/ring_schedule.h"
#include "core/tree_schedule.h"
#include "host/output_staging.h"
#include "host/stream_store.h"

namespace mirrored {

namespace {

// Work is done in blocks that stay in L1 while the n inputs stream past.
constexpr std::size_t kBlockBytes = 16 * 1024;
// One ring chunk per participant per slice: a slice (n chunks of n in+out
// buffers) stays in L2, so the ring's 2(n-1) passes hit cache, not DRAM.
constexpr std::size_t kRingChunkBytes = 16 * 1024;
// Below this many bytes touched, waking the pool costs more than it saves.
constexpr std::size_t kParallelBytes = 256 * 1024;
// Out-of-place collectives touching at least this many bytes (2 * n * S)
// stream their outputs past the cache (see host/stream_store.h).
constexpr std::size_t kStreamBytes = 16 << 20;
// Bytes of each buffer one pool item covers: large enough to amortise the
// claim, small enough to balance two to sixteen threads.
constexpr std::size_t kItemBytes = 64 * 1024;
// Replicas per batched call (bounds the per-worker pointer arrays).
constexpr int kMaxReplicas = 256;

inline char* at(void* p, std::size_t off) { return static_cast<char*>(p) + off; }
inline const char* at(const void* p, std::size_t off) { return static_cast<const char*>(p) + off; }

void check_n(int n, const char* what) {
  if (n < 1) throw std::invalid_argument(std::string(what) + ": needs at least one buffer, got " + std::to_string(n));
}
void check_root(int n, int root, const char* what) {
  if (root < 0 || root >= n)
    throw std::invalid_argument(std::string(what) + ": root=" + std::to_string(root) + " is not in [0, " +
                                std::to_string(n) + ")");
}

}  // namespace

HostCommunicator::HostCommunicator(ThreadPool& pool) : pool_(pool), kernels_(reduce_kernels()) {}

template <typename Fn>
void HostCommunicator::for_items(std::size_t items, std::size_t bytes_touched, Fn&& fn) {
  if (bytes_touched < kParallelBytes) {
    for (std::size_t i = 0; i < items; ++i) fn(i);
  } else {
    pool_.parallel_for(items, fn);
  }
}

namespace {
// Items of kItemBytes over [0, count): item i is [i * per, min(count, (i + 1) * per)).
struct Items {
  std::size_t count, per;
  Items(std::size_t count_, std::size_t es) : count(count_), per(std::max<std::size_t>(1, kItemBytes / es)) {}
  std::size_t size() const { return (count + per - 1) / per; }
  Range operator[](std::size_t i) const { return {i * per, std::min(count, (i + 1) * per)}; }
};
}  // namespace

Algorithm HostCommunicator::choose(int n, std::size_t bytes) {
  // Crossovers measured with `python -m mirrored.bench all_reduce --algo ...`
  // (BENCHMARKS.md): in shared memory every algorithm reads each input once
  // and writes each output once when cache-blocked, and direct does it with
  // the fewest passes, so it wins at every size measured; the tree only ties
  // it for tiny buffers and the ring pays 2(n-1) passes over L2.
  (void)n, (void)bytes;
  return Algorithm::kDirect;
}

bool HostCommunicator::streams(int n, const void* const* in, void* const* out, std::size_t bytes) {
  if (2 * n * bytes < kStreamBytes) return false;
  for (int k = 0; k < n; ++k)
    if (out[k] == in[k]) return false;  // in place: the lines were just read, plain stores are free
  return true;
}

void HostCommunicator::fold_range(int n, const void* const* in, void* const* out, int first, bool every_output,
                                  std::size_t begin, std::size_t end, DType dtype, ReduceOp op, bool stream) const {
  const std::size_t es = dtype_size(dtype);
  const std::size_t block = std::max<std::size_t>(1, kBlockBytes / es);
  // Streaming folds into an L1 scratch block and streams it to the outputs.
  alignas(64) static thread_local unsigned char scratch[kBlockBytes];
  for (std::size_t b = begin; b < end; b += block) {
    const std::size_t m = std::min(block, end - b);
    const std::size_t off = b * es;
    void* acc = stream ? static_cast<void*>(scratch) : at(out[first], off);
    if (n == 1) {
      if (acc != at(in[0], off)) std::memcpy(acc, at(in[0], off), m * es);
    } else {
      // Start from `first` so an in-place fold never overwrites an input it
      // has yet to read.
      const int second = first == 0 ? 1 : 0;
      combine(kernels_, dtype, op, acc, at(in[first], off), at(in[second], off), m);
      for (int k = 0; k < n; ++k)
        if (k != first && k != second) combine(kernels_, dtype, op, acc, acc, at(in[k], off), m);
      if (op == ReduceOp::kMean) kernels_.divide[static_cast<int>(dtype)](acc, m, n);
    }
    if (stream) {
      for (int k = 0; k < n; ++k)
        if (every_output || k == first) stream_store(at(out[k], off), acc, m * es);
    } else if (every_output) {
      for (int k = 0; k < n; ++k)
        if (k != first) std::memcpy(at(out[k], off), acc, m * es);
    }
  }
}

void HostCommunicator::all_reduce(int n, const void* const* in, void* const* out, std::size_t count, DType dtype,
                                  ReduceOp op, Algorithm algorithm, std::size_t ring_chunk_bytes) {
  check_n(n, "all_reduce");
  if (count == 0) return;
  const std::size_t bytes = count * dtype_size(dtype);
  const OutputStaging staging("all_reduce", n, in, bytes, out, bytes, {});
  if (algorithm == Algorithm::kAuto) algorithm = choose(n, bytes);
  switch (algorithm) {
    case Algorithm::kRing:
      ring(n, in, staging.outputs(), count, dtype, op, ring_chunk_bytes ? ring_chunk_bytes : kRingChunkBytes);
      break;
    case Algorithm::kTree: tree(n, in, staging.outputs(), count, dtype, op); break;
    case Algorithm::kDirect:
    case Algorithm::kAuto: direct(n, in, staging.outputs(), count, dtype, op); break;
  }
  staging.finish();
}

void HostCommunicator::direct(int n, const void* const* in, void* const* out, std::size_t count, DType dtype,
                              ReduceOp op) {
  const Items items(count, dtype_size(dtype));
  const bool stream = streams(n, in, out, count * dtype_size(dtype));
  for_items(items.size(), 2 * n * count * dtype_size(dtype), [&](std::size_t i) {
    fold_range(n, in, out, 0, true, items[i].begin, items[i].end, dtype, op, stream);
  });
}

void HostCommunicator::ring(int n, const void* const* in, void* const* out, std::size_t count, DType dtype,
                            ReduceOp op, std::size_t chunk_bytes) {
  const std::size_t es = dtype_size(dtype);
  if (n == 1) {
    if (out[0] != in[0]) std::memcpy(out[0], in[0], count * es);
    return;
  }
  const RingSchedule schedule(n, count, std::max<std::size_t>(1, chunk_bytes / es));
  // Slices are independent pool items; within one, running the steps in
  // order satisfies every op's single dependency (the peer's previous step).
  for_items(schedule.num_slices(), 2 * n * count * es, [&](std::size_t s) {
    {
      for (int step = 0; step < schedule.num_steps(); ++step) {
        for (int rank = 0; rank < n; ++rank) {
          const RingOp o = schedule.op(s, step, rank);
          if (o.count == 0) continue;
          const std::size_t off = o.offset * es;
          if (o.verb == RingVerb::kReduceCopy) {
            const void* peer = o.peer_input ? in[o.peer] : out[o.peer];
            combine(kernels_, dtype, op, at(out[rank], off), at(in[rank], off), at(peer, off), o.count);
            if (o.finalize && op == ReduceOp::kMean)
              kernels_.divide[static_cast<int>(dtype)](at(out[rank], off), o.count, n);
          } else {
            std::memcpy(at(out[rank], off), at(out[o.peer], off), o.count * es);
          }
        }
      }
    }
  });
}

void HostCommunicator::tree(int n, const void* const* in, void* const* out, std::size_t count, DType dtype,
                            ReduceOp op) {
  const std::size_t es = dtype_size(dtype);
  const TreeSchedule schedule(n);
  const std::size_t block = std::max<std::size_t>(1, kBlockBytes / es);
  const Items items(count, es);
  for_items(items.size(), 2 * n * count * es, [&](std::size_t i) {
    const Range r = items[i];
    for (std::size_t b = r.begin; b < r.end; b += block) {
      const std::size_t m = std::min(block, r.end - b);
      const std::size_t off = b * es;
      if (n == 1 && out[0] != in[0]) std::memcpy(at(out[0], off), at(in[0], off), m * es);
      for (int level = 0; level < schedule.num_levels(); ++level) {
        for (int i = 0; i < schedule.num_ops(level); ++i) {
          const TreeOp o = schedule.op(level, i);
          const void* a = o.dst_input ? in[o.dst] : out[o.dst];
          const void* c = o.src_input ? in[o.src] : out[o.src];
          combine(kernels_, dtype, op, at(out[o.dst], off), at(a, off), at(c, off), m);
          if (o.finalize && op == ReduceOp::kMean) kernels_.divide[static_cast<int>(dtype)](at(out[0], off), m, n);
        }
      }
      for (int k = 1; k < n; ++k) std::memcpy(at(out[k], off), at(out[0], off), m * es);
    }
  });
}

void HostCommunicator::broadcast(int n, const void* const* in, void* const* out, std::size_t count, DType dtype,
                                 int root) {
  check_n(n, "broadcast");
  check_root(n, root, "broadcast");
  const std::size_t bytes = count * dtype_size(dtype);
  const OutputStaging staging("broadcast", n, in, bytes, out, bytes, {root, -1, true});
  void* const* outs = staging.outputs();
  const Items items(bytes, 1);
  for_items(items.size(), 2 * n * bytes, [&](std::size_t i) {
    const Range r = items[i];
    for (int k = 0; k < n; ++k)
      if (outs[k] != in[root] && r.size()) std::memcpy(at(outs[k], r.begin), at(in[root], r.begin), r.size());
  });
  staging.finish();
}

void HostCommunicator::reduce(int n, const void* const* in, void* const* out, std::size_t count, DType dtype,
                              ReduceOp op, int root) {
  check_n(n, "reduce");
  check_root(n, root, "reduce");
  const std::size_t bytes = count * dtype_size(dtype);
  const OutputStaging staging("reduce", n, in, bytes, out, bytes, {-1, root, false});
  void* const* outs = staging.outputs();
  const Items items(count, dtype_size(dtype));
  for_items(items.size(), (n + 1) * bytes, [&](std::size_t i) {
    fold_range(n, in, outs, root, false, items[i].begin, items[i].end, dtype, op, false);
  });
  staging.finish();
}

void HostCommunicator::all_gather(int n, const void* const* in, void* const* out, const std::size_t* row_bytes,
                                  std::size_t outer) {
  check_n(n, "all_gather");
  std::size_t row = 0;
  for (int j = 0; j < n; ++j) row += row_bytes[j];
  const std::size_t total = row * outer;
  if (row == 0) return;
  const Items items(total, 1);
  for_items(items.size(), 2 * n * total, [&](std::size_t item) {
    // Each item fills the byte range [begin, end) of every output.
    const Range r = items[item];
    std::size_t pos = r.begin;
    while (pos < r.end) {
      const std::size_t i = pos / row;  // row index
      std::size_t within = pos % row;
      int j = 0;
      while (within >= row_bytes[j]) within -= row_bytes[j++];
      const std::size_t len = std::min(row_bytes[j] - within, r.end - pos);
      const char* src = at(in[j], i * row_bytes[j] + within);
      for (int k = 0; k < n; ++k) std::memcpy(at(out[k], pos), src, len);
      pos += len;
    }
  });
}

const std::vector<Pack>& HostCommunicator::packs_for(int ntensors, const std::size_t* counts, const DType* dtypes,
                                                     std::size_t bytes_per_pack, int num_packs) {
  // Training loops reduce the same gradient list every step: replan only
  // when the batch's layout changes.
  bool same = plan_num_packs_ == num_packs && plan_bytes_per_pack_ == bytes_per_pack &&
              plan_bytes_.size() == static_cast<std::size_t>(ntensors);
  for (int t = 0; same && t < ntensors; ++t)
    same = plan_dtypes_[t] == dtypes[t] && plan_bytes_[t] == counts[t] * dtype_size(dtypes[t]);
  if (!same) {
    plan_bytes_.resize(ntensors);
    plan_dtypes_.assign(dtypes, dtypes + ntensors);
    for (int t = 0; t < ntensors; ++t) plan_bytes_[t] = counts[t] * dtype_size(dtypes[t]);
    plan_ = plan_packs(plan_bytes_, plan_dtypes_, bytes_per_pack, num_packs);
    plan_bytes_per_pack_ = bytes_per_pack;
    plan_num_packs_ = num_packs;
  }
  return plan_;
}

void HostCommunicator::batch_all_reduce(int n, int ntensors, const void* const* in, void* const* out,
                                        const std::size_t* counts, const DType* dtypes, ReduceOp op,
                                        std::size_t bytes_per_pack, int num_packs, Algorithm algorithm,
                                        std::size_t ring_chunk_bytes) {
  check_n(n, "batch_all_reduce");
  if (n > kMaxReplicas)
    throw std::invalid_argument("batch_all_reduce: at most " + std::to_string(kMaxReplicas) + " replicas, got " +
                                std::to_string(n));
  if (ntensors == 0) return;
  std::size_t total = 0;
  for (int t = 0; t < ntensors; ++t) total += counts[t] * dtype_size(dtypes[t]);
  if (algorithm == Algorithm::kAuto) algorithm = choose(n, total);

  if (algorithm == Algorithm::kDirect) {
    // Direct needs no contiguous buffer: every worker folds its share of each
    // tensor in place of a pack, in one pass over the pool (zero-copy fusion).
    // Items are kItemBytes-sized pieces of the tensors laid end to end; a
    // piece may span several small tensors.
    const Items items(total, 1);
    for_items(items.size(), 2 * n * total, [&](std::size_t i) {
      const void* tin[kMaxReplicas];
      void* tout[kMaxReplicas];
      const Range piece = items[i];
      std::size_t start = 0;  // byte offset of tensor t in the virtual concatenation
      for (int t = 0; t < ntensors && start < piece.end; ++t) {
        const std::size_t es = dtype_size(dtypes[t]);
        const std::size_t bytes = counts[t] * es;
        const std::size_t lo = std::max(piece.begin, start), hi = std::min(piece.end, start + bytes);
        if (lo < hi) {
          for (int k = 0; k < n; ++k) tin[k] = in[k * ntensors + t], tout[k] = out[k * ntensors + t];
          // Piece boundaries are multiples of kItemBytes, hence of every element size.
          fold_range(n, tin, tout, 0, true, (lo - start) / es, (hi - start) / es, dtypes[t], op, false);
        }
        start += bytes;
      }
    });
    return;
  }

  // Ring and tree run over contiguous packs: copy in, reduce in place, copy out.
  std::lock_guard<std::mutex> lock(batch_mu_);
  const std::vector<Pack>& packs = packs_for(ntensors, counts, dtypes, bytes_per_pack, num_packs);
  std::size_t largest = 0;
  for (const Pack& p : packs) largest = std::max(largest, p.bytes);
  if (fusion_.size() < static_cast<std::size_t>(n)) fusion_.resize(n);
  std::vector<void*>& bufs = fusion_ptrs_;
  bufs.resize(n);
  for (int k = 0; k < n; ++k) {
    if (fusion_[k].size() < largest) fusion_[k].resize(largest);
    bufs[k] = fusion_[k].data();
  }
  for (const Pack& p : packs) {
    for_items(n, 2 * n * p.bytes, [&](std::size_t k) {
      for (const PackEntry& e : p.entries)
        if (e.bytes) std::memcpy(at(bufs[k], e.offset), in[k * ntensors + e.tensor], e.bytes);
    });
    all_reduce(n, bufs.data(), bufs.data(), p.bytes / dtype_size(p.dtype), p.dtype, op, algorithm, ring_chunk_bytes);
    for_items(n, 2 * n * p.bytes, [&](std::size_t k) {
      for (const PackEntry& e : p.entries)
        if (e.bytes) std::memcpy(out[k * ntensors + e.tensor], at(bufs[k], e.offset), e.bytes);
    });
  }
}

}  // namespace mirrored
