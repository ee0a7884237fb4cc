// Control of the simulated CUDA runtime (sim_runtime.cc), for sim_test.cc.
#pragma once

#include <cuda_runtime_api.h>

#include <functional>
#include <map>
#include <random>
#include <set>
#include <utility>

namespace mirrored::cuda::sim {

// `devices` GPUs; kernels on a may read b's memory iff (a, b) is in
// peer_pairs; `seed` picks the interleaving drain() runs.
void reset(int devices, std::set<std::pair<int, int>> peer_pairs, unsigned seed);
// Queues host work on a stream (the caller's own work: writing inputs, reading outputs).
void enqueue(cudaStream_t stream, std::function<void()> work);
// Runs everything queued, in a random order that respects streams and events.
void drain();

// What the code under test asked of the runtime since reset_counters():
// kernel launches per device, and the calls that queue work or wait
// (event records and waits, copies, synchronisations), in all.
struct Counters {
  std::map<int, long> launches;
  long stream_ops = 0;
  long launches_total() const {
    long t = 0;
    for (const auto& [d, k] : launches) t += k;
    return t;
  }
};
const Counters& counters();
void reset_counters();

}  // namespace mirrored::cuda::sim
