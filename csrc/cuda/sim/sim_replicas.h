// The simulator tests' replicas (ranks): each one's GPU and its caller's
// stream, where a test allocates device memory and queues caller-side work
// (writing inputs, reading results). A test's own struct adds how its
// streams are made.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <functional>
#include <thread>
#include <utility>
#include <vector>

#include "cuda/sim/expect.h"
#include "cuda/sim/sim_runtime.h"

namespace mirrored::cuda::sim_check {

// run(0) on this thread and run(1) on another, at once, on a fresh simulated machine of two GPUs whose
// kernels run in seed's order; a failure (EXPECT) names the seed and which device's run was wrong.
inline void expect_right_on_two_devices(unsigned seed, const std::function<bool(int)>& run) {
  sim::reset(2, {}, seed);
  bool right[2] = {false, false};
  std::thread other([&] { right[1] = run(1); });
  right[0] = run(0);
  other.join();
  EXPECT(right[0] && right[1], "seed %u: device 0 %s, device 1 %s", seed, right[0] ? "right" : "wrong",
         right[1] ? "right" : "wrong");
}

struct Replicas {
  std::vector<int> devices;
  std::vector<cudaStream_t> streams;  // the callers'; null: the device's default stream

  explicit Replicas(std::vector<int> d) : devices(std::move(d)) {}
  int n() const { return static_cast<int>(devices.size()); }
  // One byte more than asked: a buffer of 0 bytes still has an address of its own.
  void* alloc(int r, std::size_t bytes) {
    cudaSetDevice(devices[r]);
    void* p = nullptr;
    cudaMalloc(&p, bytes + 1);
    return p;
  }
  // Caller-side work on replica r's stream.
  void on(int r, std::function<void()> f) {
    cudaSetDevice(devices[r]);
    sim::enqueue(streams[r], std::move(f));
  }
};

}  // namespace mirrored::cuda::sim_check
