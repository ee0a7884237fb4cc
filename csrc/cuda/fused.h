// One-pass kernels for ranks that share a GPU (logical GPUs), and for ranks
// whose GPUs read each other's memory: a single launch reads every input and
// writes every output, 2·n·S bytes for an all-reduce of n buffers of S bytes
// (the least any all-reduce moves), where a ring moves 5(n-1)·S on one GPU
// and costs a launch and an event wait per step.
//
// The bodies live in fused_body.cuh, shared with the simulated runtime.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "core/dtype.h"
#include "core/reduce_op.h"

namespace mirrored::cuda {

// Buffers one launch takes, in kernel parameters (passed by value: no table
// to upload). More ranks than this on one GPU use the ring or the tree.
constexpr int kMaxFused = 32;

struct FusedArgs {
  const void* in[kMaxFused];
  void* out[kMaxFused];
  int nin = 0, nout = 0;
};

// in[j] has `outer` rows of col[j+1] - col[j] units; out rows are col[nin] units.
struct GatherArgs {
  const void* in[kMaxFused];
  void* out[kMaxFused];
  std::size_t col[kMaxFused + 1];
  std::size_t outer = 0;
  int nin = 0, nout = 0;
};

// One copy of a batch's pack or unpack: `bytes` from src to dst; `slot`: the
// first 16-byte slot of this entry, counted across the table (a prefix sum).
struct CopyEntry {
  const void* src;
  void* dst;
  std::size_t bytes;
  std::size_t slot;
};

// One tensor of a multi-tensor all-reduce on one GPU (multi_reduce): `count`
// elements, its first slot of 16 bytes' worth of elements counted across the
// table (a prefix sum), and whether every one of its pointers is 16-byte
// aligned (whole slots then move as vectors). Its n input and n output
// pointers sit in the pointer table at [2n·e, 2n·e + n) and [2n·e + n, 2n·(e+1)).
struct ReduceEntry {
  std::size_t slot;
  std::size_t count;
  std::size_t vectorised;
};

// Launch shape: enough 512-thread blocks for the work, at most 4 per SM (the
// bodies are grid-stride loops, so a bounded grid covers any size).
constexpr unsigned kFusedThreads = 512;
constexpr unsigned kFusedBlocksPerSM = 4;
inline unsigned fused_blocks(std::size_t work, int sms) {
  const std::size_t wanted = (work + kFusedThreads - 1) / kFusedThreads;
  return static_cast<unsigned>(
      std::max<std::size_t>(1, std::min<std::size_t>(wanted, std::size_t(std::max(sms, 1)) * kFusedBlocksPerSM)));
}

inline bool aligned16(const void* p) { return (reinterpret_cast<std::uintptr_t>(p) & 15u) == 0; }

// Whether every pointer of `a` is 16-byte aligned: the vector path applies.
inline bool fused_vectorised(const FusedArgs& a) {
  for (int j = 0; j < a.nin; ++j)
    if (!aligned16(a.in[j])) return false;
  for (int j = 0; j < a.nout; ++j)
    if (!aligned16(a.out[j])) return false;
  return true;
}

// Work items (vectors plus the scalar tail, or elements) of a reduce body.
inline std::size_t fused_work(std::size_t count, std::size_t elem_size, bool vectorised) {
  if (!vectorised) return count;
  const std::size_t per = 16 / elem_size;
  return count / per + count % per;
}

// out[*] = op(in[*]) (/ mean_div), one launch on `stream`. `op` is a
// combining op; nin == 1 copies. Every pointer must be readable (or
// writable) from the stream's device. count 0 launches nothing.
void fused_reduce(const FusedArgs& args, std::size_t count, DType dtype, ReduceOp op, int mean_div, int sms,
                  cudaStream_t stream);
// The all-gather of `args` in units of `unit` bytes (1, 2, 4, 8 or 16).
void fused_gather(const GatherArgs& args, int unit, int sms, cudaStream_t stream);
// Runs the copies of `entries` entries of a table in device memory readable
// from the stream's device, whose entries hold `slots` 16-byte slots in all.
void multi_copy(const CopyEntry* device_table, int entries, std::size_t slots, int sms, cudaStream_t stream);
// out_e[j] = op(in_e[0..n)) (/ mean_div) for every entry e of a table in device
// memory (all tensors of one dtype, every pointer readable or writable from
// the stream's device): one launch over `slots` slots in all, whatever the
// tensor count. out_e[j] may equal in_e[j] (in place). `op` is a combining op.
void multi_reduce(const ReduceEntry* entries, const void* const* pointers, int count, int n, std::size_t slots,
                  DType dtype, ReduceOp op, int mean_div, int sms, cudaStream_t stream);

}  // namespace mirrored::cuda
