// The ring all-reduce as data: which participant reduces or copies which chunk
// from whom at which step. Transports (host memory, CUDA device buffers)
// execute these ops; they never decide chunking or order themselves.
//
// The buffer is cut into slices of N chunks (N = participants). Within a slice,
// N-1 reduce-scatter steps leave chunk (r+1) mod N fully reduced at rank r, and
// N-1 all-gather steps pass every reduced chunk once around the ring. Slices
// are independent, so several are in flight at once (on the host, one per
// worker thread; on GPUs, one per pipeline stage).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace mirrored {

enum class RingVerb : std::uint8_t {
  kReduceCopy,  // out[rank][chunk] = in[rank][chunk] (op) buf[peer][chunk]
  kCopy,        // out[rank][chunk] = out[peer][chunk]
};

struct RingOp {
  RingVerb verb;
  int rank;            // performs the op and writes only its own output
  int peer;            // ring predecessor whose buffer is read
  bool peer_input;     // read the predecessor's input (first step), else its output
  bool finalize;       // produces the fully reduced chunk: apply MEAN's 1/N here
  std::size_t offset;  // first element of the chunk
  std::size_t count;   // elements; 0 for empty chunks at the tail
};

class RingSchedule {
 public:
  // chunk_elems: elements each participant handles per slice and step.
  RingSchedule(int nranks, std::size_t count, std::size_t chunk_elems)
      : nranks_(nranks), count_(count), chunk_(std::max<std::size_t>(chunk_elems, 1)) {
    if (nranks < 1) throw std::invalid_argument("ring needs at least 1 participant, got " + std::to_string(nranks));
  }

  int nranks() const { return nranks_; }
  std::size_t count() const { return count_; }
  int num_steps() const { return 2 * (nranks_ - 1); }
  std::size_t slice_elems() const { return chunk_ * static_cast<std::size_t>(nranks_); }
  std::size_t num_slices() const { return (count_ + slice_elems() - 1) / slice_elems(); }

  // The op `rank` performs at `step` of `slice`. Its only dependency is
  // op(slice, step - 1, peer): transports must order exactly that pair.
  RingOp op(std::size_t slice, int step, int rank) const {
    const int n = nranks_;
    const int peer = (rank + n - 1) % n;
    const bool reduce_phase = step < n - 1;
    // Reduce-scatter step k touches chunk rank-k-1; all-gather step j chunk rank-j.
    const int k = reduce_phase ? step : step - (n - 1);
    const int chunk = ((rank - k - (reduce_phase ? 1 : 0)) % n + n) % n;

    const std::size_t base = slice * slice_elems();
    const std::size_t in_slice = std::min(slice_elems(), count_ - base);
    // The last slice may be short: spread it evenly over the N chunks.
    const std::size_t per_chunk = (in_slice + n - 1) / n;
    const std::size_t begin = std::min(in_slice, per_chunk * chunk);
    const std::size_t end = std::min(in_slice, begin + per_chunk);

    RingOp o;
    o.verb = reduce_phase ? RingVerb::kReduceCopy : RingVerb::kCopy;
    o.rank = rank;
    o.peer = peer;
    o.peer_input = reduce_phase && k == 0;
    o.finalize = reduce_phase && k == n - 2;
    o.offset = base + begin;
    o.count = end - begin;
    return o;
  }

 private:
  int nranks_;
  std::size_t count_;
  std::size_t chunk_;
};

}  // namespace mirrored
