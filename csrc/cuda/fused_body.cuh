// The bodies of the one-pass kernels, as __host__ __device__ code: the .cu
// wraps each in a __global__ kernel, and the simulated runtime (sim/) runs the
// very same body for every thread index of the same grid on the CPU. So the
// indexing (which replica's slice, vector tails, odd and empty sizes) is
// tested without a GPU, and only the launch itself is GPU-specific.
//
// A body is called once per thread with (tid, stride) = (global thread index,
// total threads of the grid) and walks its share grid-stride.
#pragma once

#include <cuda_runtime_api.h>
#include <vector_types.h>

#include <cstddef>
#include <cstdint>

#include "cuda/fused.h"
#include "cuda/reduce_ops.cuh"

namespace mirrored::cuda {

// Every output gets op(inputs) (then / mean_div when mean_div > 1). With one
// input it is a copy (broadcast; all_reduce of one rank). out[j] may equal
// in[j] (in place): each thread reads all inputs of its elements before it
// writes any output of them.
template <typename T, ReduceOp Op>
__host__ __device__ inline void fused_reduce_body(const FusedArgs& a, std::size_t count, int mean_div, bool vectorised,
                                                  std::size_t tid, std::size_t stride) {
  using E = Elem<T>;
  using Acc = typename E::Acc;
  const Combine<Op> combine;
  std::size_t head = 0;
  if (vectorised) {
    constexpr int kN = Vec16<T>::kN;
    const std::size_t nv = count / kN;
    for (std::size_t i = tid; i < nv; i += stride) {
      Vec16<T> x;
      x.raw = static_cast<const uint4*>(a.in[0])[i];
      Acc acc[kN];
#pragma unroll
      for (int k = 0; k < kN; ++k) acc[k] = E::load(x.v[k]);
      for (int j = 1; j < a.nin; ++j) {
        Vec16<T> y;
        y.raw = static_cast<const uint4*>(a.in[j])[i];
#pragma unroll
        for (int k = 0; k < kN; ++k) acc[k] = combine(acc[k], E::load(y.v[k]));
      }
#pragma unroll
      for (int k = 0; k < kN; ++k) x.v[k] = E::store(mean_div > 1 ? divide(acc[k], mean_div) : acc[k]);
      for (int j = 0; j < a.nout; ++j) static_cast<uint4*>(a.out[j])[i] = x.raw;
    }
    head = nv * kN;
  }
  for (std::size_t i = head + tid; i < count; i += stride) {
    Acc acc = E::load(static_cast<const T*>(a.in[0])[i]);
    for (int j = 1; j < a.nin; ++j) acc = combine(acc, E::load(static_cast<const T*>(a.in[j])[i]));
    const T r = E::store(mean_div > 1 ? divide(acc, mean_div) : acc);
    for (int j = 0; j < a.nout; ++j) static_cast<T*>(a.out[j])[i] = r;
  }
}

// All-gather in units of U (1, 2, 4, 8 or 16 bytes; every row size and
// pointer is a multiple of it): output unit p of row p / pitch, column
// p % pitch, comes from the input whose column range holds it; every output
// gets it (a null input's columns are left as the output holds them).
template <typename U>
__host__ __device__ inline void fused_gather_body(const GatherArgs& g, std::size_t tid, std::size_t stride) {
  const std::size_t pitch = g.col[g.nin];  // units per output row
  const std::size_t total = pitch * g.outer;
  for (std::size_t p = tid; p < total; p += stride) {
    const std::size_t row = p / pitch, col = p % pitch;
    int lo = 0, hi = g.nin - 1;  // the last j with col[j] <= col (empty inputs share a column start)
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (g.col[mid] <= col) lo = mid; else hi = mid - 1;
    }
    if (g.in[lo] == nullptr) continue;  // a column this output already holds (two-shot's own slice)
    const std::size_t width = g.col[lo + 1] - g.col[lo];
    const U v = static_cast<const U*>(g.in[lo])[row * width + (col - g.col[lo])];
    for (int j = 0; j < g.nout; ++j) static_cast<U*>(g.out[j])[p] = v;
  }
}

// Copies every table entry's bytes (pack into / unpack out of fusion
// buffers): 16-byte slots numbered across entries (entry e owns slots
// [slot[e], slot[e+1])), found by binary search; whole aligned slots move as
// one vector, the rest byte by byte.
__host__ __device__ inline void multi_copy_body(const CopyEntry* table, int entries, std::size_t tid,
                                                std::size_t stride) {
  if (entries == 0) return;
  const std::size_t slots = table[entries - 1].slot + (table[entries - 1].bytes + 15) / 16;
  for (std::size_t s = tid; s < slots; s += stride) {
    int lo = 0, hi = entries - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (table[mid].slot <= s) lo = mid; else hi = mid - 1;
    }
    const CopyEntry& e = table[lo];
    const std::size_t off = (s - e.slot) * 16;
    if (off >= e.bytes) continue;  // an empty entry's slot range is empty; never reached
    const char* src = static_cast<const char*>(e.src) + off;
    char* dst = static_cast<char*>(e.dst) + off;
    const std::size_t n = e.bytes - off < 16 ? e.bytes - off : 16;
    if (n == 16 && ((reinterpret_cast<std::uintptr_t>(src) | reinterpret_cast<std::uintptr_t>(dst)) & 15u) == 0) {
      *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
    } else {
      for (std::size_t k = 0; k < n; ++k) dst[k] = src[k];
    }
  }
}

// The all-reduce of every table entry (multi_reduce): slot s of entry e holds
// its elements [(s - slot_e)·kN, +kN) (kN per 16 bytes, the tail slot fewer);
// an entry whose pointers are all aligned moves its whole slots as vectors.
// A thread's slots only grow, so it finds each slot's entry by a binary
// search of the entries from its last one on. Each element's inputs are all
// read before any output of it is written (in place is safe).
template <typename T, ReduceOp Op>
__host__ __device__ inline void multi_reduce_body(const ReduceEntry* table, const void* const* pointers, int entries,
                                                  int n, int mean_div, std::size_t tid, std::size_t stride) {
  using E = Elem<T>;
  using Acc = typename E::Acc;
  constexpr int kN = Vec16<T>::kN;
  const Combine<Op> combine;
  if (entries == 0) return;
  const std::size_t slots = table[entries - 1].slot + (table[entries - 1].count + kN - 1) / kN;
  int e = 0;
  for (std::size_t s = tid; s < slots; s += stride) {
    if (e + 1 < entries && table[e + 1].slot <= s) {
      int lo = e + 1, hi = entries - 1;  // the last entry starting at or before s
      while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (table[mid].slot <= s) lo = mid; else hi = mid - 1;
      }
      e = lo;
    }
    const ReduceEntry& x = table[e];
    const void* const* in = pointers + std::size_t(e) * 2 * n;
    void* const* out = const_cast<void* const*>(in + n);
    const std::size_t v = s - x.slot, first = v * kN;
    if (first >= x.count) continue;  // (an empty entry owns no slot; never reached)
    if (x.vectorised && x.count - first >= std::size_t(kN)) {
      Vec16<T> y;
      y.raw = static_cast<const uint4*>(in[0])[v];
      Acc acc[kN];
#pragma unroll
      for (int k = 0; k < kN; ++k) acc[k] = E::load(y.v[k]);
      for (int j = 1; j < n; ++j) {
        y.raw = static_cast<const uint4*>(in[j])[v];
#pragma unroll
        for (int k = 0; k < kN; ++k) acc[k] = combine(acc[k], E::load(y.v[k]));
      }
#pragma unroll
      for (int k = 0; k < kN; ++k) y.v[k] = E::store(mean_div > 1 ? divide(acc[k], mean_div) : acc[k]);
      for (int j = 0; j < n; ++j) static_cast<uint4*>(out[j])[v] = y.raw;
      continue;
    }
    const std::size_t last = x.count - first < std::size_t(kN) ? x.count : first + kN;
    for (std::size_t i = first; i < last; ++i) {
      Acc acc = E::load(static_cast<const T*>(in[0])[i]);
      for (int j = 1; j < n; ++j) acc = combine(acc, E::load(static_cast<const T*>(in[j])[i]));
      const T r = E::store(mean_div > 1 ? divide(acc, mean_div) : acc);
      for (int j = 0; j < n; ++j) static_cast<T*>(out[j])[i] = r;
    }
  }
}

}  // namespace mirrored::cuda
