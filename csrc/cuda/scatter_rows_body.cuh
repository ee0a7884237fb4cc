// The bodies of scatter_add_rows' six phases (cuda/scatter_rows.h), as
// __host__ __device__ code: scatter_rows.cu wraps each in a kernel, and the
// simulated runtime runs the same body for every thread of the same grid, one
// thread at a time in a random order (so the count phase hands out its tickets
// in a random order there too, and the rank is what makes the result right).
// A body is called once per thread with (tid, stride) and walks its share
// grid-stride.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>

#include "cuda/reduce_ops.cuh"
#include "cuda/scatter_rows.h"

namespace mirrored::cuda {

// The workspace, int32 throughout: per row its slice count and its segment's
// start; the next free place of the segments; per slice its ticket (its place
// in its row's segment in the fill, -1 when its index is dropped); the slices
// grouped by row (the fill: in the atomics' order), and grouped by row in
// ascending order (the rank).
struct ScatterWork {
  int* counts;
  int* base;
  int* cursor;
  int* ticket;
  int* grouped;
  int* ordered;
};

__host__ __device__ inline ScatterWork scatter_work(void* workspace, std::size_t slices, std::size_t rows) {
  int* p = static_cast<int*>(workspace);
  int* per_slice = p + 2 * rows + 1;
  return {p, p + rows, p + 2 * rows, per_slice, per_slice + slices, per_slice + 2 * slices};
}

// The old value of *p, then *p += v. On a GPU the lanes of a warp that add to
// the same p (the slices of a row named many times, every row's reservation
// on the one cursor) make one atomic together, each lane getting the old value
// plus what the lanes below it in its group add: same-address atomics are
// serialised, and these would be one per slice. The simulator runs one thread
// at a time, so a plain read and write is the same there.
__host__ __device__ inline int fetch_add(int* p, int v) {
#ifdef __CUDA_ARCH__
  const unsigned group = __match_any_sync(__activemask(), reinterpret_cast<unsigned long long>(p));
  const int lane = static_cast<int>(threadIdx.x % 32), leader = __ffs(group) - 1;
  int below = 0, total = 0;
  for (unsigned rest = group; rest != 0; rest &= rest - 1) {
    const int from = __ffs(rest) - 1;
    const int x = __shfl_sync(group, v, from);
    below += from < lane ? x : 0;
    total += x;
  }
  int old = 0;
  if (lane == leader) old = atomicAdd(p, total);
  return __shfl_sync(group, old, leader) + below;
#else
  const int old = *p;
  *p = old + v;
  return old;
#endif
}

// Slice i's row, or -1 when its index is outside [0, rows) (dropped).
__host__ __device__ inline long long scatter_row(const ScatterRows& a, std::size_t i) {
  const long long r = a.wide_indices ? static_cast<const std::int64_t*>(a.indices)[i]
                                     : static_cast<const std::int32_t*>(a.indices)[i];
  return r >= 0 && static_cast<unsigned long long>(r) < a.rows ? r : -1;
}

// Clear: the counts and the cursor; to overwrite, out and squares (T's zero).
template <typename T>
__host__ __device__ inline void scatter_clear_body(const ScatterRows& a, ScatterWork w, std::size_t tid,
                                                   std::size_t stride) {
  for (std::size_t r = tid; r < a.rows; r += stride) w.counts[r] = 0;
  if (tid == 0) *w.cursor = 0;
  if (a.accumulate) return;
  const T zero = Elem<T>::store(typename Elem<T>::Acc(0));
  const std::size_t total = a.rows * a.width;
  for (std::size_t p = tid; p < total; p += stride) {
    static_cast<T*>(a.out)[p] = zero;
    if (a.squares != nullptr) static_cast<T*>(a.squares)[p] = zero;
  }
}

__host__ __device__ inline void scatter_count_body(const ScatterRows& a, ScatterWork w, std::size_t tid,
                                                   std::size_t stride) {
  for (std::size_t i = tid; i < a.slices; i += stride) {
    const long long r = scatter_row(a, i);
    w.ticket[i] = r < 0 ? -1 : fetch_add(&w.counts[r], 1);
  }
}

// Ticket 0 (one slice per row named): the row's segment, at a place the
// cursor's atomic order picks; only the places differ from run to run.
__host__ __device__ inline void scatter_reserve_body(const ScatterRows& a, ScatterWork w, std::size_t tid,
                                                     std::size_t stride) {
  for (std::size_t i = tid; i < a.slices; i += stride)
    if (w.ticket[i] == 0) {
      const long long r = scatter_row(a, i);
      w.base[r] = fetch_add(w.cursor, w.counts[r]);
    }
}

__host__ __device__ inline void scatter_fill_body(const ScatterRows& a, ScatterWork w, std::size_t tid,
                                                  std::size_t stride) {
  for (std::size_t i = tid; i < a.slices; i += stride)
    if (w.ticket[i] >= 0) w.grouped[w.base[scatter_row(a, i)] + w.ticket[i]] = static_cast<int>(i);
}

// Each slice's place in its row's ascending order is the number of its row's
// slices before it: O(k) per slice of a row named k times, every slice at once
// (a warp's slices of one row read the same entries together), where one
// thread sorting a segment would take O(k log k) steps one after another.
__host__ __device__ inline void scatter_rank_body(const ScatterRows& a, ScatterWork w, std::size_t tid,
                                                  std::size_t stride) {
  for (std::size_t i = tid; i < a.slices; i += stride) {
    if (w.ticket[i] < 0) continue;
    const long long r = scatter_row(a, i);
    const int* segment = w.grouped + w.base[r];
    const int k = w.counts[r];
    int before = 0;
    for (int j = 0; j < k; ++j) before += segment[j] < static_cast<int>(i);
    w.ordered[w.base[r] + before] = static_cast<int>(i);
  }
}

// Per (slice holding ticket 0, column): its row's slices added in ascending
// order, each addition rounded to T (np.add.at's and the host loop's order
// and rounding); with squares, each value squared and rounded, then added.
template <typename T>
__host__ __device__ inline void scatter_sum_body(const ScatterRows& a, ScatterWork w, std::size_t tid,
                                                 std::size_t stride) {
  using E = Elem<T>;
  using Acc = typename E::Acc;
  const Combine<ReduceOp::kSum> add;
  const Combine<ReduceOp::kProd> multiply;
  const T* values = static_cast<const T*>(a.values);
  T* out = static_cast<T*>(a.out);
  T* squares = static_cast<T*>(a.squares);
  const std::size_t total = a.slices * a.width;
  for (std::size_t p = tid; p < total; p += stride) {
    const std::size_t i = p / a.width, column = p % a.width;
    if (w.ticket[i] != 0) continue;
    const std::size_t r = static_cast<std::size_t>(scatter_row(a, i));
    const int* segment = w.ordered + w.base[r];
    const int k = w.counts[r];
    const std::size_t at = r * a.width + column;
    T sum = a.accumulate ? out[at] : E::store(Acc(0));
    T sum_of_squares = squares != nullptr && a.accumulate ? squares[at] : E::store(Acc(0));
    for (int j = 0; j < k; ++j) {
      const Acc v = E::load(values[static_cast<std::size_t>(segment[j]) * a.width + column]);
      sum = E::store(add(E::load(sum), v));
      if (squares != nullptr) {
        const Acc square = E::load(E::store(multiply(v, v)));  // rounded to T first, as the host's
        sum_of_squares = E::store(add(E::load(sum_of_squares), square));
      }
    }
    out[at] = sum;
    if (squares != nullptr) squares[at] = sum_of_squares;
  }
}

// The clear phase's work items (its grid's size, fused.h's shape).
inline std::size_t scatter_clear_work(const ScatterRows& a) {
  return a.accumulate ? a.rows + 1 : a.rows * a.width + a.rows + 1;
}

// The workspace counts and places slices in int32.
inline void check_scatter_rows(const ScatterRows& a) {
  constexpr std::size_t limit = std::numeric_limits<int>::max();
  if (a.slices >= limit || a.rows >= limit)
    throw std::invalid_argument("scatter_add_rows: " + std::to_string(a.slices) + " slices into " +
                                std::to_string(a.rows) + " rows; the GPU kernel takes fewer than 2**31 of each "
                                "(split the slices, or densify on the host)");
}

// f(T{}) for the element type T of `dtype`.
template <typename F>
decltype(auto) with_scatter_type(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kFloat16: return f(F16{});
    case DType::kBFloat16: return f(BF16{});
    case DType::kFloat32: return f(float{});
    case DType::kFloat64: return f(double{});
    case DType::kInt8: return f(std::int8_t{});
    case DType::kUInt8: return f(std::uint8_t{});
    case DType::kInt32: return f(std::int32_t{});
    case DType::kInt64: return f(std::int64_t{});
  }
  throw std::invalid_argument("scatter_add_rows: dtype code " + std::to_string(static_cast<int>(dtype)) +
                              " is not one of mirrored's dtypes");
}

}  // namespace mirrored::cuda
