// Control of the simulated CUDA runtime (sim_runtime.cc), for sim_test.cc
// and for the Python test engine (csrc/bindings/cuda_module.cc built with
// MIRRORED_CUDA_SIM).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <functional>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace mirrored::cuda::sim {

// `devices` GPUs; kernels on a may read b's memory iff (a, b) is in
// peer_pairs; `seed` picks the interleaving drain() runs.
// Each GPU's memory limit becomes MIRRORED_SIM_DEVICE_BYTES's (bytes; unset or 0: none).
void reset(int devices, std::set<std::pair<int, int>> peer_pairs, unsigned seed);
// Each GPU's memory, in bytes (0: no limit): an allocation that would take a device's live memory (cudaMalloc's
// and allocate()'s, released or freed memory not counted) past it fails, cudaMalloc with
// cudaErrorMemoryAllocation and allocate() with nullptr.
void set_device_memory_limit(std::size_t bytes);
std::size_t device_memory_limit();
std::size_t device_bytes_in_use(int device);
// Queues host work on a stream (the caller's own work: writing inputs, reading outputs).
void enqueue(cudaStream_t stream, std::function<void()> work);
// The same for a kernel of the embedder (the CuPy stand-in's), counted as one.
void launch_kernel(cudaStream_t stream, std::function<void()> work);
// The same for a kernel of the stand-in cuBLAS (fake_cublas.cc), counted apart.
void launch_blas(cudaStream_t stream, std::function<void()> work);
// Queues work on several (device, stream) pairs as one device-side rendezvous:
// it runs once, when all of them have reached it (NCCL's kernels across GPUs).
void rendezvous(const std::vector<std::pair<int, cudaStream_t>>& parties, std::function<void()> work);
// Runs everything queued, in a random order that respects streams and events.
void drain();
// The same until done() holds (checked before each step): what a host wait
// for one stream or event sees, other streams' work having run only partly.
void drain_until(const std::function<bool()>& done);

// What the code under test asked of the runtime since reset_counters():
// kernel launches per device, the calls that queue work or wait (event
// records and waits, copies, synchronisations) in all, and every runtime
// entry point's calls by name (cudaSetDevice, cudaGetDevice, ...).
struct Counters {
  std::map<int, long> launches;
  std::map<int, long> graph_launches;  // cudaGraphLaunch calls, per device of the launch stream
  // The branches those launches replayed (a captured stream's work each: the origin's, and every
  // stream that forked from it), per device of the launch stream.
  std::map<int, long> graph_branches;
  std::map<int, long> kernels;  // the embedder's kernels (launch_kernel), per device
  std::map<int, long> blas;     // the stand-in cuBLAS's kernels (launch_blas), per device
  long stream_ops = 0;
  long host_waits = 0;  // the host blocked on the GPU: stream, event and device synchronisations, cudaFree
  std::map<std::string, long> calls;
  long launches_total() const {
    long t = 0;
    for (const auto& [d, k] : launches) t += k;
    return t;
  }
};
Counters counters();
void reset_counters();

// The simulation is one machine shared by every thread: each runtime call
// and each drain() holds this (recursive) lock. A thread that must wait for
// it calls the hook with the wait, so that an embedder can let go of its own
// lock (Python's GIL) meanwhile: drain() may run work that takes that lock.
// The wait is bounded: a thread still waiting after lock_seconds() (600 by
// default; MIRRORED_SIM_LOCK_SECONDS, read at each reset) throws
// std::logic_error naming the holder's thread, so a deadlock fails the call
// instead of hanging the program (a wait on a holder that already outlasted
// a limit fails after a second).
std::recursive_mutex& machine();
void set_block_hook(void (*hook)(void (*wait)()));
void set_lock_seconds(double seconds);
double lock_seconds();
long machine_holder();  // the native thread id of the machine's holder, 0 when none
class Lock {
 public:
  Lock();
  ~Lock();
  Lock(const Lock&) = delete;
  Lock& operator=(const Lock&) = delete;
};
// The lock, taken by a runtime entry point that counts itself in Counters::calls.
class Call {
 public:
  explicit Call(const char* name);

 private:
  Lock lock_;
};

// Test memory (the CuPy stand-in's): `bytes` on device `device`, filled
// with a pattern no computation produces. release() poisons it in the order
// of `stream` (where a memory pool would hand it out again) and then stops
// it counting as device memory: a kernel ordered after that reads poison,
// and a launch that names it fails. Its bytes stay mapped (quarantined)
// until quarantine_limit bytes pile up, so a late reader never faults.
// nullptr when the device's memory limit leaves no room.
void* allocate(std::size_t bytes, int device);
void release(void* p, cudaStream_t stream);
constexpr unsigned char kFreshByte = 0xcd, kPoisonByte = 0xdb;
// The calling thread's current device (cudaGetDevice / cudaSetDevice without counting the call:
// the embedder's own device switches, as CuPy's Device.use makes them, are not the engine's).
int current_device();
void set_current_device(int device);
int device_of_pointer(const void* p);  // -1 when not (or no longer) device memory
int device_of_stream(cudaStream_t stream);
// Whether a stream of `device` (-1: of any device) is being captured.
bool capturing(int device);

}  // namespace mirrored::cuda::sim
