// One face for every engine: in-process host buffers, CUDA device buffers,
// NCCL, Gloo. A call passes this process's local buffers, one per local
// replica (n of them); engines that span processes combine across them too.
#pragma once

#include <cstddef>
#include <stdexcept>
#include <string>

#include "dtype.h"
#include "reduce_op.h"

namespace mirrored {

// How an in-process collective is scheduled. kAuto lets the engine choose
// from measured crossover points.
enum class Algorithm : int { kAuto = 0, kRing = 1, kDirect = 2, kTree = 3 };

inline const char* algorithm_name(Algorithm a) {
  switch (a) {
    case Algorithm::kAuto: return "auto";
    case Algorithm::kRing: return "ring";
    case Algorithm::kDirect: return "direct";
    case Algorithm::kTree: return "tree";
  }
  return "unknown";
}

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual const char* backend() const = 0;

  // out[i] = op over all in[*] (element-wise), for each local i. out may equal in.
  virtual void all_reduce(int n, const void* const* in, void* const* out, std::size_t count, DType dtype,
                          ReduceOp op, Algorithm algorithm) = 0;
  // out[i] = in[root] for every i.
  virtual void broadcast(int n, const void* const* in, void* const* out, std::size_t count, DType dtype, int root) {
    (void)n, (void)in, (void)out, (void)count, (void)dtype, (void)root;
    unsupported("broadcast");
  }
  // Whether all_reduce takes one output per GPU: every local replica of a GPU
  // passing the same out pointer, which receives the result once (callers
  // that read the result where it lies, as fused batches do, save the copies).
  virtual bool one_output_per_gpu() const { return false; }
  // out[root] = op over all in[*]; other outputs untouched.
  virtual void reduce(int n, const void* const* in, void* const* out, std::size_t count, DType dtype, ReduceOp op,
                      int root) {
    (void)n, (void)in, (void)out, (void)count, (void)dtype, (void)op, (void)root;
    unsupported("reduce");
  }
  // Every out[i] receives `outer` rows; row r is in[0]'s row r, then in[1]'s
  // row r, ... where in[j]'s rows are row_bytes[j] long (sizes may differ).
  virtual void all_gather(int n, const void* const* in, void* const* out, const std::size_t* row_bytes,
                          std::size_t outer) {
    (void)n, (void)in, (void)out, (void)row_bytes, (void)outer;
    unsupported("all_gather");
  }

 protected:
  [[noreturn]] void unsupported(const char* what) const {
    throw std::logic_error(std::string("backend ") + backend() + " does not support " + what);
  }
  // A call's first check: n buffers for the engine's `size` local replicas (`per` names one: "replica", "rank").
  static void check_buffers(int n, int size, const char* what, const char* per) {
    if (n != size)
      throw std::invalid_argument(std::string(what) + ": got " + std::to_string(n) + " buffers for " +
                                  std::to_string(size) + " " + per + "s; pass one buffer per " + per);
  }
};

// The four collectives, declared in an engine that implements them all (their contracts: Communicator's).
#define MIRRORED_COMMUNICATOR_COLLECTIVES                                                                          \
  void all_reduce(int n, const void* const* in, void* const* out, std::size_t count, DType dtype, ReduceOp op,     \
                  Algorithm algorithm) override;                                                                   \
  void broadcast(int n, const void* const* in, void* const* out, std::size_t count, DType dtype, int root) override; \
  void reduce(int n, const void* const* in, void* const* out, std::size_t count, DType dtype, ReduceOp op,         \
              int root) override;                                                                                  \
  void all_gather(int n, const void* const* in, void* const* out, const std::size_t* row_bytes, std::size_t outer) \
      override

}  // namespace mirrored
