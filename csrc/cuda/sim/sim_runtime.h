// Control of the simulated CUDA runtime (sim_runtime.cc), for sim_test.cc.
#pragma once

#include <cuda_runtime_api.h>

#include <functional>
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

}  // namespace mirrored::cuda::sim
