// Outputs that alias inputs in ways the algorithms do not expect.
//
// Every algorithm allows exactly one kind of aliasing: out[k] == in[k] (in
// place), which stays zero-copy. An output that overlaps an input the
// collective still reads (another replica's input, or a shifted view of its
// own) would be overwritten mid-reduction: such an output is computed into a
// scratch buffer and copied in at the end. Outputs that overlap each other
// have no right answer (two replicas' results in one place) and are refused.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

namespace mirrored {

class OutputStaging {
 public:
  struct Use {
    int reads = -1;   // the one input the collective reads (-1: all of them)
    int writes = -1;  // the one output it writes (-1: all of them)
    // Whether an output may equal any input read, not only its own (a
    // broadcast skips the copy where out[k] == in[root]).
    bool exact_any = false;
  };

  // in[k] spans in_bytes, out[k] out_bytes. Throws std::invalid_argument
  // naming the outputs when two written outputs overlap. The check is
  // O(n^2) pointer comparisons: nothing next to the collective itself.
  OutputStaging(const char* what, int n, const void* const* in, std::size_t in_bytes, void* const* out,
                std::size_t out_bytes, Use use)
      : n_(n), out_(out), bytes_(out_bytes) {
    if (out_bytes == 0) return;
    const int w0 = use.writes < 0 ? 0 : use.writes, w1 = use.writes < 0 ? n : use.writes + 1;
    const int r0 = use.reads < 0 ? 0 : use.reads, r1 = use.reads < 0 ? n : use.reads + 1;
    for (int k = w0; k < w1; ++k) {
      for (int j = w0; j < k; ++j)
        if (overlaps(out[k], out_bytes, out[j], out_bytes))
          throw std::invalid_argument(std::string(what) + ": out[" + std::to_string(j) + "] and out[" +
                                      std::to_string(k) +
                                      "] share memory; give every replica its own output array");
      for (int j = r0; j < r1; ++j) {
        if (!overlaps(out[k], out_bytes, in[j], in_bytes)) continue;
        if (out[k] == in[j] && out_bytes == in_bytes && (j == k || use.exact_any)) continue;
        stage(k);
        break;
      }
    }
  }

  // The outputs the algorithm writes: the caller's, or scratch in their place.
  void* const* outputs() const { return staged_.empty() ? out_ : ptrs_.data(); }

  // Copies the staged results into the caller's outputs (after the collective).
  void finish() const {
    for (const auto& s : staged_) std::memcpy(out_[s.index], s.buffer.get(), bytes_);
  }

 private:
  struct Aligned {
    void operator()(char* p) const { ::operator delete(p, std::align_val_t(64)); }
  };
  struct Staged {
    int index;
    std::unique_ptr<char, Aligned> buffer;
  };

  static bool overlaps(const void* a, std::size_t a_bytes, const void* b, std::size_t b_bytes) {
    // As integers: < between unrelated pointers is unspecified in C++.
    const auto x = reinterpret_cast<std::uintptr_t>(a), y = reinterpret_cast<std::uintptr_t>(b);
    return a_bytes && b_bytes && x < y + b_bytes && y < x + a_bytes;
  }

  void stage(int k) {
    if (ptrs_.empty()) ptrs_.assign(out_, out_ + n_);
    staged_.push_back({k, std::unique_ptr<char, Aligned>(static_cast<char*>(
                              ::operator new(bytes_, std::align_val_t(64))))});
    ptrs_[k] = staged_.back().buffer.get();
  }

  int n_;
  void* const* out_;
  std::size_t bytes_;
  std::vector<void*> ptrs_;
  std::vector<Staged> staged_;
};

}  // namespace mirrored
