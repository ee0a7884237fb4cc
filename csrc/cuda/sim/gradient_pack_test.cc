// GradientPack (cuda/gradient_pack.h) on the simulated runtime: gradients of
// every size (empty, under one 16-byte slot, misaligned offsets in the packed
// buffer) copied back to back, the table uploaded only when a source moves,
// the sources rewritten by the stream between calls (a missing ordering reads
// stale bytes); a capture replayed with new gradient values; two packs driven
// from two threads at once; and the misuses refused. Exit status 0 when all is right.
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <thread>
#include <vector>

#include "cuda/gradient_pack.h"
#include "cuda/sim/expect.h"
#include "cuda/sim/sim_runtime.h"

using namespace mirrored::cuda;

namespace {

using sim_check::failures;

const std::vector<std::size_t> kBytes = {0, 4, 20, 64, 1204, 3, 16, 4096 + 7};

struct Gradients {
  std::vector<void*> ptr;
  explicit Gradients(int device) {
    for (std::size_t b : kBytes) ptr.push_back(sim::allocate(b + 1, device));
  }
  std::vector<const void*> src() const { return {ptr.begin(), ptr.end()}; }
  // Step `seed`'s values, written by the stream (ordered before the pack that follows).
  void write(cudaStream_t s, int seed) const {
    for (std::size_t k = 0; k < ptr.size(); ++k) {
      auto* p = static_cast<unsigned char*>(ptr[k]);
      const std::size_t n = kBytes[k];
      sim::enqueue(s, [=] {
        for (std::size_t i = 0; i < n; ++i) p[i] = static_cast<unsigned char>(i * 31 + k * 7 + seed * 13);
      });
    }
  }
};

struct Packed {
  unsigned char* base;
  std::vector<void*> dst;
  std::size_t total = 0;
  explicit Packed(int device) {
    for (std::size_t b : kBytes) total += b;
    base = static_cast<unsigned char*>(sim::allocate(total + 1, device));
    std::size_t at = 0;
    for (std::size_t b : kBytes) dst.push_back(base + at), at += b;
  }
  // The packed bytes after the stream's work so far, against step `seed`'s values.
  bool holds(cudaStream_t s, int seed) const {
    std::vector<unsigned char> got(total);
    unsigned char* into = got.data();
    const unsigned char* from = base;
    const std::size_t n = total;
    sim::enqueue(s, [=] { std::memcpy(into, from, n); });
    cudaStreamSynchronize(s);
    std::size_t at = 0;
    for (std::size_t k = 0; k < kBytes.size(); ++k)
      for (std::size_t i = 0; i < kBytes[k]; ++i)
        if (got[at++] != static_cast<unsigned char>(i * 31 + k * 7 + seed * 13)) return false;
    return true;
  }
};

void check_eager(unsigned seed) {
  sim::reset(2, {}, seed);
  cudaSetDevice(0);
  cudaStream_t s, other;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking);
  Gradients a(0), b(0);
  Packed packed(0);
  GradientPack pack(0, packed.dst, kBytes);
  for (int step = 0; step < 6; ++step) {
    // Steps alternate two gradient sets (and streams): every other step the sources move.
    const Gradients& g = step % 4 < 2 ? a : b;
    cudaStream_t st = step % 3 ? s : other;
    g.write(st, step);
    sim::reset_counters();
    pack.copy(g.src(), st);
    const auto c = sim::counters();
    EXPECT(c.launches.at(0) == 1, "step %d: %ld launches, expected one", step, c.launches.at(0));
    EXPECT(packed.holds(st, step), "step %d (seed %u): the packed bytes are not the gradients'", step, seed);
    if (step > 0 && step % 2 == 1) {
      // The same sources as the last step: no upload, so only the launch and its event record.
      EXPECT(c.stream_ops <= 2, "step %d: %ld stream operations with unmoved sources", step, c.stream_ops);
    }
  }
  sim::drain();
  cudaStreamDestroy(s);
  cudaStreamDestroy(other);
}

void check_capture(unsigned seed) {
  sim::reset(2, {}, seed);
  cudaSetDevice(1);
  cudaStream_t s;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  Gradients g(1);
  Packed packed(1);
  GradientPack pack(1, packed.dst, kBytes);
  EXPECT(cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed) == cudaSuccess, "begin capture");
  pack.copy_captured(g.src(), s);
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  EXPECT(cudaStreamEndCapture(s, &graph) == cudaSuccess, "end capture");
  EXPECT(cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess, "instantiate");
  cudaGraphDestroy(graph);
  for (int replay = 0; replay < 3; ++replay) {
    g.write(s, 100 + replay);
    sim::reset_counters();
    cudaGraphLaunch(exec, s);
    EXPECT(sim::counters().launches_total() == 0, "a replay launches nothing itself");
    EXPECT(packed.holds(s, 100 + replay), "replay %d: the packed bytes are not the gradients'", replay);
  }
  cudaGraphExecDestroy(exec);
  bool refused = false;
  try {
    pack.copy(g.src(), s);
  } catch (const std::logic_error&) {
    refused = true;
  }
  EXPECT(refused, "an eager copy with a captured pack is refused");
  cudaStreamDestroy(s);
}

void check_threads(unsigned seed) {
  sim::reset(2, {}, seed);
  std::vector<std::thread> threads;
  std::vector<int> ok(2, 0);
  for (int t = 0; t < 2; ++t)
    threads.emplace_back([t, &ok] {
      cudaSetDevice(t);
      cudaStream_t s;
      cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
      Gradients a(t), b(t);
      Packed packed(t);
      GradientPack pack(t, packed.dst, kBytes);
      int good = 0;
      for (int step = 0; step < 8; ++step) {
        const Gradients& g = step % 2 ? a : b;
        g.write(s, step + t);
        pack.copy(g.src(), s);
        good += packed.holds(s, step + t);
      }
      ok[t] = good;
      cudaStreamDestroy(s);
    });
  for (auto& th : threads) th.join();
  EXPECT(ok[0] == 8 && ok[1] == 8, "threads: %d and %d of 8 steps packed right", ok[0], ok[1]);
}

void check_misuse() {
  sim::reset(2, {}, 1);
  cudaSetDevice(0);
  Packed packed(0);
  bool refused = false;
  try {
    GradientPack pack(0, packed.dst, {4});
  } catch (const std::invalid_argument&) {
    refused = true;
  }
  EXPECT(refused, "destinations and sizes of different lengths are refused");
  GradientPack pack(0, packed.dst, kBytes);
  refused = false;
  try {
    pack.copy({packed.dst[0]}, nullptr);
  } catch (const std::invalid_argument&) {
    refused = true;
  }
  EXPECT(refused, "a source list of the wrong length is refused");
}

// A copy whose upload fails (here: a stream of another GPU) after the sources moved: the next copy
// with the same sources uploads the table again rather than reading the one of the sources before.
void check_failed_upload() {
  sim::reset(2, {}, 3);
  cudaStream_t on_other_gpu, s;
  cudaSetDevice(1);
  cudaStreamCreateWithFlags(&on_other_gpu, cudaStreamNonBlocking);
  cudaSetDevice(0);
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  Gradients a(0), b(0);
  Packed packed(0);
  GradientPack pack(0, packed.dst, kBytes);
  a.write(s, 1);
  pack.copy(a.src(), s);
  EXPECT(packed.holds(s, 1), "the first copy packs the gradients");
  b.write(s, 2);
  bool refused = false;
  try {
    pack.copy(b.src(), on_other_gpu);
  } catch (const std::exception&) {
    refused = true;
  }
  EXPECT(refused, "a copy on a stream of another GPU fails");
  pack.copy(b.src(), s);
  EXPECT(packed.holds(s, 2), "after a failed upload the next copy packs the new sources, not the old ones");
  sim::drain();
  cudaStreamDestroy(s);
  cudaStreamDestroy(on_other_gpu);
}

}  // namespace

int main() {
  for (unsigned seed = 0; seed < 8; ++seed) {
    check_eager(seed);
    check_capture(seed);
    check_threads(seed);
  }
  check_misuse();
  check_failed_upload();
  std::printf("GradientPack on the simulated runtime: %d failures\n", failures);
  return failures ? 1 : 0;
}
