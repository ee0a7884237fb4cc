// A GPU out of memory in the engine (cuda/check.h device_malloc), on the simulated runtime with a device
// memory limit: an all-reduce over the ring (its staging scratch) and fused batches (fusion buffers, pointer
// tables, the ring under them) fail at every allocation point in turn, each time with an OutOfMemory naming
// the bytes, a device and the use, nothing queued behind it that deadlocks or runs half a collective, and the
// next call on the same engine objects (with room again) right; the memory they hold all comes back when they
// go. Ranks on two GPUs without peer access (the ring stages through scratch), and with it. Exit status 0 when
// all is right.
#include <cstdio>
#include <cstring>
#include <set>
#include <string>
#include <vector>

#include "cuda/check.h"
#include "cuda/cuda_ring.h"
#include "cuda/device_batch.h"
#include "cuda/sim/expect.h"
#include "cuda/sim/sim_replicas.h"
#include "cuda/sim/sim_runtime.h"
#include "cuda/stream_scope.h"

using namespace mirrored;
using namespace mirrored::cuda;

namespace {

using sim_check::failures;

constexpr std::size_t kCount = 3000;  // int32 elements per rank
const std::vector<std::size_t> kCounts = {700, 5, 1200, 33};

int value(int rank, std::size_t i) { return static_cast<int>((i * 7 + rank * 3) % 11) - 5; }

struct Ranks : sim_check::Replicas {
  explicit Ranks(std::vector<int> d) : Replicas(std::move(d)) {
    streams.assign(devices.size(), nullptr);
    for (std::size_t r = 0; r < devices.size(); ++r) {
      cudaSetDevice(devices[r]);
      cudaStreamCreateWithFlags(&streams[r], 0);
    }
  }
  ~Ranks() {
    for (auto s : streams) cudaStreamDestroy(s);
  }
  void write(int r, void* p, std::size_t count, int seed) {
    on(r, [=] {
      for (std::size_t i = 0; i < count; ++i) static_cast<int*>(p)[i] = value(seed, i);
    });
  }
  // Whether p holds the sum over ranks of value(seed_base + rank, i).
  bool summed(int r, void* p, std::size_t count, int seed_base) {
    std::vector<int> got(count);
    int* into = got.data();
    on(r, [=] { std::memcpy(into, p, count * sizeof(int)); });
    sim::drain();
    for (std::size_t i = 0; i < count; ++i) {
      int want = 0;
      for (int q = 0; q < n(); ++q) want += value(seed_base + q, i);
      if (got[i] != want) return false;
    }
    return true;
  }
};

std::size_t in_use(int devices) {
  std::size_t most = 0;
  for (int d = 0; d < devices; ++d) most = std::max(most, sim::device_bytes_in_use(d));
  return most;
}

// What an OutOfMemory must say: the bytes, the device, the use.
void expect_oom(const OutOfMemory& e, const char* what) {
  EXPECT(e.bytes() > 0 && (e.device() == 0 || e.device() == 1) && !e.purpose().empty(),
         "%s: OutOfMemory of %zu bytes on device %d for '%s'", what, e.bytes(), e.device(), e.purpose().c_str());
  const std::string message = e.what();
  EXPECT(message.find("OOM when allocating " + std::to_string(e.bytes()) + " bytes") == 0 &&
             message.find("GPU " + std::to_string(e.device())) != std::string::npos,
         "%s: message '%s'", what, e.what());
}

// The ring all-reduce, its limit `extra` bytes above what the buffers take: OutOfMemory (no kernel launched,
// the streams drain), then right once the limit is lifted; the ring's memory back when it goes.
void check_ring(bool peers, std::size_t extra, unsigned seed, int& failed_calls) {
  sim::reset(2, peers ? std::set<std::pair<int, int>>{{0, 1}, {1, 0}} : std::set<std::pair<int, int>>{}, seed);
  sim::set_device_memory_limit(0);
  Ranks l({0, 1});
  std::vector<void*> in(2), out(2);
  for (int r = 0; r < 2; ++r) in[r] = l.alloc(r, kCount * 4), out[r] = l.alloc(r, kCount * 4);
  const std::size_t baseline = in_use(2);
  {
    CudaRing ring(l.devices, 2048, 2);
    sim::set_device_memory_limit(baseline + extra);
    for (int r = 0; r < 2; ++r) l.write(r, in[r], kCount, r);
    const long launches = sim::counters().launches_total();
    bool failed = false;
    try {
      StreamScope scope(l.streams);
      ring.all_reduce(2, in.data(), out.data(), kCount, DType::kInt32, ReduceOp::kSum, Algorithm::kRing);
    } catch (const OutOfMemory& e) {
      failed = true;
      ++failed_calls;
      expect_oom(e, "ring all_reduce");
      EXPECT(sim::counters().launches_total() == launches, "ring all_reduce extra=%zu: kernels launched before the "
             "OutOfMemory", extra);
    }
    sim::drain();  // (a half-issued ring would deadlock here)
    sim::set_device_memory_limit(0);
    if (failed) {
      StreamScope scope(l.streams);
      ring.all_reduce(2, in.data(), out.data(), kCount, DType::kInt32, ReduceOp::kSum, Algorithm::kRing);
    }
    for (int r = 0; r < 2; ++r)
      EXPECT(l.summed(r, out[r], kCount, 0), "ring all_reduce peers=%d extra=%zu failed=%d: rank %d wrong", peers,
             extra, failed, r);
  }
  EXPECT(in_use(2) == baseline, "ring extra=%zu: %zu bytes in use after the ring went, %zu before", extra,
         in_use(2), baseline);
  for (int r = 0; r < 2; ++r) cudaFree(in[r]), cudaFree(out[r]);
}

// A fused batch through DeviceBatch and the ring, twice (the second call on a table and fusion buffer of the
// first), its limit `extra` bytes above the buffers: each call OutOfMemory or right, a failed one right on retry
// with room.
void check_batch(bool peers, std::size_t extra, unsigned seed, int& failed_calls, std::set<std::string>& uses) {
  sim::reset(2, peers ? std::set<std::pair<int, int>>{{0, 1}, {1, 0}} : std::set<std::pair<int, int>>{}, seed);
  sim::set_device_memory_limit(0);
  Ranks l({0, 1});
  const std::vector<DType> dtypes(kCounts.size(), DType::kInt32);
  std::vector<std::vector<const void*>> bin(2);
  std::vector<std::vector<void*>> bout(2);
  for (int r = 0; r < 2; ++r)
    for (std::size_t t = 0; t < kCounts.size(); ++t) {
      bin[r].push_back(l.alloc(r, kCounts[t] * 4));
      bout[r].push_back(l.alloc(r, kCounts[t] * 4));
    }
  const std::size_t baseline = in_use(2);
  {
    CudaRing ring(l.devices, 1024, 2);
    DeviceBatch batch(l.devices);
    for (int call = 0; call < 2; ++call) {
      sim::set_device_memory_limit(call == 0 ? baseline + extra : baseline + 2 * extra);
      for (int r = 0; r < 2; ++r)
        for (std::size_t t = 0; t < kCounts.size(); ++t)
          l.write(r, const_cast<void*>(bin[r][t]), kCounts[t], r + int(t) + call);
      bool failed = false;
      try {
        StreamScope scope(l.streams);
        batch.all_reduce(ring, bin, bout, kCounts, dtypes, ReduceOp::kSum, Algorithm::kRing, 0, 0);
      } catch (const OutOfMemory& e) {
        failed = true;
        ++failed_calls;
        uses.insert(e.purpose());
        expect_oom(e, "batch all_reduce");
      }
      sim::drain();
      if (failed) {
        sim::set_device_memory_limit(0);
        StreamScope scope(l.streams);
        batch.all_reduce(ring, bin, bout, kCounts, dtypes, ReduceOp::kSum, Algorithm::kRing, 0, 0);
      }
      for (int r = 0; r < 2; ++r)
        for (std::size_t t = 0; t < kCounts.size(); ++t)
          EXPECT(l.summed(r, bout[r][t], kCounts[t], int(t) + call), "batch peers=%d extra=%zu call %d failed=%d: "
                 "rank %d tensor %zu wrong", peers, extra, call, failed, r, t);
    }
    sim::set_device_memory_limit(0);
  }
  EXPECT(in_use(2) == baseline, "batch extra=%zu: %zu bytes in use after the engine went, %zu before", extra,
         in_use(2), baseline);
  for (int r = 0; r < 2; ++r)
    for (std::size_t t = 0; t < kCounts.size(); ++t) cudaFree(const_cast<void*>(bin[r][t])), cudaFree(bout[r][t]);
}

}  // namespace

int main() {
  int ring_oom = 0, batch_oom = 0;
  std::set<std::string> uses;  // what the batches' failed allocations were for
  unsigned seed = 0;
  // Limits from no room at all to room for everything, in steps finer than the engine's allocations.
  for (bool peers : {false, true})
    for (std::size_t extra = 0; extra <= 40000; extra += 1000) {
      check_ring(peers, extra, ++seed, ring_oom);
      check_batch(peers, extra, ++seed, batch_oom, uses);
    }
  // Each path did run out of memory (else the sweep proved nothing), a batch at each of its allocations: its
  // fusion buffer, its pointer table, and the ring's scratch under it once the packing was queued.
  const std::set<std::string> every_use = {"batch fusion buffer", "batch pointer table", "ring scratch chunk"};
  if (ring_oom == 0 || uses != every_use) {
    ++failures;
    std::printf("FAIL: the sweep ran out of memory in %d ring calls, and in batches for:", ring_oom);
    for (const std::string& use : uses) std::printf(" '%s'", use.c_str());
    std::printf("\n");
  }
  std::printf("GPU out of memory on the simulated runtime: %d ring and %d batch calls ran out; %d failures\n",
              ring_oom, batch_oom, failures);
  return failures ? 1 : 0;
}
