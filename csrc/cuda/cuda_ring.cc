#include "cuda/cuda_ring.h"

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "core/ring_schedule.h"
#include "core/tree_schedule.h"
#include "cuda/check.h"
#include "cuda/device.h"
#include "cuda/fused.h"
#include "cuda/reduce_kernels.h"
#include "cuda/stream_scope.h"

namespace mirrored::cuda {
namespace {

const void* at(const void* p, std::size_t bytes) { return static_cast<const char*>(p) + bytes; }
void* at(void* p, std::size_t bytes) { return static_cast<char*>(p) + bytes; }

// kAuto's table (choose()). Measured on an H200 with every replica on the one
// GPU (logical GPUs), float32 sum, before the one-pass kernels existed:
//   n = 8, 16 MiB: ring 930 us, tree 145 us; n = 4 and 8: the tree was 3-7x
//   faster than the ring from 1 to 64 MiB; the ring moved 5(n-1)·S bytes on
//   one GPU where 2n·S suffice (0.8, 0.5, 0.4 of the copy bound at 256 MiB
//   for n = 2, 4, 8), and each of its steps cost a launch and an event wait.
// Hence: ranks on one GPU take the one-pass kernel (2n·S bytes, one launch)
// at every size; where it cannot run, the tree below 64 MiB on more than 2
// ranks sharing GPUs. Ranks on distinct GPUs without peer access keep the
// earlier rule (tree below 256 KiB beyond 2 ranks; not yet measured there),
// and ranks on distinct GPUs with peer access take the one-shot kernel up to
// 256 KiB (out of place), where one launch per GPU beats the ring's 2(n-1)
// dependent steps, and the two-shot kernels above it (the ring's bytes in 2
// launches per GPU), as NCCL's and custom all-reduce kernels do (not yet
// measured here; NCCL stays the default for one GPU per replica).
constexpr std::size_t kTreeBelowBytesShared = std::size_t(64) << 20;
constexpr std::size_t kTreeBelowBytes = std::size_t(256) << 10;
constexpr std::size_t kPeerOneShotBelowBytes = std::size_t(256) << 10;

// Slices per channel. Every ring op costs the host a few microseconds (event
// wait, launch, record) whatever its size, while a GPU reduces a megabyte in
// about one: a large buffer is cut into few, large slices, just enough for
// each channel to overlap one slice's steps with the next one's.
constexpr std::size_t kSlicesPerChannel = 2;

}  // namespace

CudaRing::CudaRing(std::vector<int> devices, std::size_t chunk_bytes, int channels)
    // Chunks are whole 16-byte vectors so that full slices keep every chunk aligned.
    : chunk_bytes_(std::max<std::size_t>(16, chunk_bytes / 16 * 16)), channels_(channels) {
  if (devices.empty()) throw std::invalid_argument("devices: a CUDA communicator needs at least one GPU rank");
  if (channels < 1) throw std::invalid_argument("channels must be >= 1, got " + std::to_string(channels));
  DeviceGuard guard;
  ranks_.resize(devices.size());
  try {
    for (std::size_t r = 0; r < devices.size(); ++r) {
      check_ordinal(devices[r], "devices");
      Rank& k = ranks_[r];
      k.device = devices[r];
      MIRRORED_CUDA_CHECK(set_device(k.device));
      MIRRORED_CUDA_CHECK(cudaDeviceGetAttribute(&k.sms, cudaDevAttrMultiProcessorCount, k.device));
      k.ready = make_event();
      for (int c = 0; c < channels_; ++c) {
        cudaStream_t s = nullptr;
        MIRRORED_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
        k.streams.push_back(s);
        k.done.push_back(make_event());
        k.step[0].push_back(make_event());
        k.step[1].push_back(make_event());
        k.scratch.push_back(nullptr);
      }
    }
    for (auto& k : ranks_) {
      for (const auto& q : ranks_) {
        int can = 0;
        if (q.device != k.device) MIRRORED_CUDA_CHECK(cudaDeviceCanAccessPeer(&can, k.device, q.device));
        if (can) {
          MIRRORED_CUDA_CHECK(set_device(k.device));
          const cudaError_t err = cudaDeviceEnablePeerAccess(q.device, 0);
          if (err == cudaErrorPeerAccessAlreadyEnabled) {
            cudaGetLastError();  // enabled earlier (by us or CuPy): what we wanted
          } else {
            check(err, "cudaDeviceEnablePeerAccess");
          }
        }
        k.direct.push_back(q.device == k.device || can);
      }
    }
    one_pass_ = size() <= kMaxFused;
    for (std::size_t r = 0; r < ranks_.size(); ++r) {
      for (bool d : ranks_[r].direct) one_pass_ = one_pass_ && d;
      auto g = std::find_if(groups_.begin(), groups_.end(), [&](const Group& x) { return x.device == ranks_[r].device; });
      if (g == groups_.end()) g = groups_.insert(groups_.end(), Group{ranks_[r].device, ranks_[r].sms, {}});
      g->ranks.push_back(static_cast<int>(r));
    }
  } catch (...) {
    release();
    throw;
  }
}

CudaRing::~CudaRing() { release(); }

void CudaRing::release() noexcept {
  DeviceGuard guard;
  for (auto& k : ranks_) {
    if (set_device(k.device) != cudaSuccess) continue;
    for (auto s : k.streams) cudaStreamDestroy(s);  // waits for nothing: queued work still completes
    for (auto* events : {&k.done, &k.step[0], &k.step[1]})
      for (auto e : *events) cudaEventDestroy(e);
    if (k.ready) cudaEventDestroy(k.ready);
    for (auto p : k.scratch)
      if (p) cudaFree(p);
  }
  ranks_.clear();
}

void CudaRing::begin(int n, const char* what) {
  check_buffers(n, size(), what, "rank");
  current_streams(n, callers_);
}

void CudaRing::fork(int used, bool ring) {
  const int n = size();
  for (int r = 0; r < n; ++r) {
    MIRRORED_CUDA_CHECK(set_device(ranks_[r].device));
    MIRRORED_CUDA_CHECK(cudaEventRecord(ranks_[r].ready, callers_[r]));
  }
  for (int r = 0; r < n; ++r) {
    MIRRORED_CUDA_CHECK(set_device(ranks_[r].device));
    for (int c = 0; c < used; ++c) {
      const cudaStream_t s = ranks_[r].streams[c];
      if (ring) {
        MIRRORED_CUDA_CHECK(cudaStreamWaitEvent(s, ranks_[r].ready, 0));
        MIRRORED_CUDA_CHECK(cudaStreamWaitEvent(s, ranks_[(r + n - 1) % n].ready, 0));
      } else {
        for (const auto& q : ranks_) MIRRORED_CUDA_CHECK(cudaStreamWaitEvent(s, q.ready, 0));
      }
    }
  }
}

void CudaRing::join(int used, bool ring) {
  const int n = size();
  for (auto& k : ranks_) {
    MIRRORED_CUDA_CHECK(set_device(k.device));
    for (int c = 0; c < used; ++c) MIRRORED_CUDA_CHECK(cudaEventRecord(k.done[c], k.streams[c]));
  }
  for (int r = 0; r < n; ++r) {
    MIRRORED_CUDA_CHECK(set_device(ranks_[r].device));  // a null caller stream means this device's
    for (int q = 0; q < n; ++q) {
      if (ring && q != r && q != (r + 1) % n) continue;
      for (int c = 0; c < used; ++c) MIRRORED_CUDA_CHECK(cudaStreamWaitEvent(callers_[r], ranks_[q].done[c], 0));
    }
  }
}

void CudaRing::stage(int used) {
  for (int r = 0; r < size(); ++r) {
    const Rank& k = ranks_[r];
    if (std::all_of(k.direct.begin(), k.direct.end(), [](bool d) { return d; })) continue;
    MIRRORED_CUDA_CHECK(set_device(k.device));
    for (int c = 0; c < used; ++c) scratch(r, c);
  }
}

void* CudaRing::scratch(int r, int c) {
  void*& p = ranks_[r].scratch[c];
  if (!p) p = device_malloc(chunk_bytes_, "ring scratch chunk");
  return p;
}

void CudaRing::fold(int r, int c, void* out, const void* a, const void* b, int q, std::size_t count, DType dtype,
                    ReduceOp op, int mean_div) {
  Rank& k = ranks_[r];
  MIRRORED_CUDA_CHECK(set_device(k.device));
  if (k.direct[q]) {
    reduce_copy(out, a, b, count, dtype, op, mean_div, k.sms, k.streams[c]);
    return;
  }
  // No peer access: bring q's elements over piece by piece (the copy engine
  // stages through host memory), then reduce locally.
  const std::size_t es = dtype_size(dtype);
  const std::size_t cap = chunk_bytes_ / es;
  void* s = scratch(r, c);
  for (std::size_t off = 0; off < count; off += cap) {
    const std::size_t m = std::min(cap, count - off);
    MIRRORED_CUDA_CHECK(cudaMemcpyPeerAsync(s, k.device, at(b, off * es), ranks_[q].device, m * es, k.streams[c]));
    reduce_copy(at(out, off * es), at(a, off * es), s, m, dtype, op, mean_div, k.sms, k.streams[c]);
  }
}

void CudaRing::copy(int r, int c, void* dst, const void* src, int q, std::size_t bytes) {
  if (bytes == 0 || dst == src) return;
  Rank& k = ranks_[r];
  MIRRORED_CUDA_CHECK(set_device(k.device));
  if (ranks_[q].device == k.device) {
    MIRRORED_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, k.streams[c]));
  } else {
    MIRRORED_CUDA_CHECK(cudaMemcpyPeerAsync(dst, k.device, src, ranks_[q].device, bytes, k.streams[c]));
  }
}

void CudaRing::gather_rows(int r, void* dst, std::size_t dst_pitch, const void* src, int q, std::size_t width,
                           std::size_t rows) {
  if (rows == 1) return copy(r, 0, dst, src, q, width);
  Rank& k = ranks_[r];
  MIRRORED_CUDA_CHECK(set_device(k.device));
  if (ranks_[q].device == k.device) {
    MIRRORED_CUDA_CHECK(
        cudaMemcpy2DAsync(dst, dst_pitch, src, width, width, rows, cudaMemcpyDeviceToDevice, k.streams[0]));
    return;
  }
  cudaMemcpy3DPeerParms p{};
  p.srcPtr = cudaPitchedPtr{const_cast<void*>(src), width, width, rows};
  p.srcDevice = ranks_[q].device;
  p.dstPtr = cudaPitchedPtr{dst, dst_pitch, width, rows};
  p.dstDevice = k.device;
  p.extent = cudaExtent{width, rows, 1};
  MIRRORED_CUDA_CHECK(cudaMemcpy3DPeerAsync(&p, k.streams[0]));
}

std::size_t CudaRing::ring_chunk_elems(int n, std::size_t count, std::size_t elem_size) const {
  const std::size_t per_rank = (count + n - 1) / n;
  const std::size_t floor_elems = chunk_bytes_ / elem_size;
  const std::size_t slices =
      std::min<std::size_t>(channels_ * kSlicesPerChannel, std::max<std::size_t>(1, (per_rank + floor_elems - 1) / floor_elems));
  // Equal slices, each chunk a whole number of 16-byte vectors (kept aligned).
  const std::size_t vec = std::max<std::size_t>(1, 16 / elem_size);
  const std::size_t chunk = (per_rank + slices - 1) / slices;
  return (chunk + vec - 1) / vec * vec;
}

Algorithm CudaRing::choose(std::size_t bytes) const {
  // One GPU: the one-pass kernel. Distinct GPUs with peer access: one-shot
  // up to kPeerOneShotBelowBytes out of place, else two-shot (all_reduce
  // picks); several ranks per GPU across GPUs: one-shot while small.
  if (one_pass_ && (groups_.size() == 1 || groups_.size() == ranks_.size() || bytes <= kPeerOneShotBelowBytes))
    return Algorithm::kDirect;
  const bool shared = groups_.size() < ranks_.size();
  const std::size_t tree_below = shared ? kTreeBelowBytesShared : kTreeBelowBytes;
  return size() > 2 && bytes < tree_below ? Algorithm::kTree : Algorithm::kRing;
}

template <typename F>
void CudaRing::one_pass(F launch) {
  phased(1, [&](int g, cudaStream_t s, int) { launch(g, s); });
}

template <typename F>
void CudaRing::phased(int phases, F launch) {
  const int n = size();
  auto same = [&](int a, int b) { return callers_[a] == callers_[b] && ranks_[a].device == ranks_[b].device; };
  // The distinct caller streams, each named by its first rank (a null stream
  // is a different stream on each GPU).
  std::vector<int>& uniq = uniq_;
  uniq.clear();
  for (int r = 0; r < n; ++r)
    if (std::none_of(uniq.begin(), uniq.end(), [&](int u) { return same(u, r); })) uniq.push_back(r);
  auto on = [](int device) { MIRRORED_CUDA_CHECK(set_device(device)); };  // no call when already current
  const bool sync = uniq.size() > 1;
  // Whether some launching stream is not u's (and so waits for u's work, and u for its launches).
  auto waited = [&](int u) {
    return std::any_of(groups_.begin(), groups_.end(), [&](const Group& g) { return !same(u, g.ranks[0]); });
  };
  if (sync) {  // each launching stream waits for every other caller stream's queued work
    for (int u : uniq) {
      if (!waited(u)) continue;
      on(ranks_[u].device);
      MIRRORED_CUDA_CHECK(cudaEventRecord(ranks_[u].ready, callers_[u]));
    }
    for (const Group& g : groups_) {
      on(g.device);
      for (int u : uniq)
        if (!same(u, g.ranks[0])) MIRRORED_CUDA_CHECK(cudaStreamWaitEvent(callers_[g.ranks[0]], ranks_[u].ready, 0));
    }
  }
  for (int phase = 0; phase < phases; ++phase) {
    if (phase > 0) {  // barrier: every GPU's previous round is done before any starts the next
      for (const Group& g : groups_) {
        on(g.device);
        MIRRORED_CUDA_CHECK(cudaEventRecord(ranks_[g.ranks[0]].step[phase & 1][0], callers_[g.ranks[0]]));
      }
      for (const Group& g : groups_) {
        on(g.device);
        for (const Group& h : groups_)
          if (&h != &g)
            MIRRORED_CUDA_CHECK(cudaStreamWaitEvent(callers_[g.ranks[0]], ranks_[h.ranks[0]].step[phase & 1][0], 0));
      }
    }
    for (std::size_t g = 0; g < groups_.size(); ++g) {
      on(groups_[g].device);
      launch(static_cast<int>(g), callers_[groups_[g].ranks[0]], phase);
    }
  }
  if (sync) {  // and every other caller stream's later work waits for every launch
    for (const Group& g : groups_) {
      on(g.device);
      MIRRORED_CUDA_CHECK(cudaEventRecord(ranks_[g.ranks[0]].done[0], callers_[g.ranks[0]]));
    }
    for (int u : uniq) {
      on(ranks_[u].device);
      for (const Group& g : groups_)
        if (!same(u, g.ranks[0])) MIRRORED_CUDA_CHECK(cudaStreamWaitEvent(callers_[u], ranks_[g.ranks[0]].done[0], 0));
    }
  }
}

void CudaRing::two_shot_all_reduce(const void* const* in, void* const* out, std::size_t count, DType dtype,
                                   ReduceOp op) {
  const int n = size();
  const std::size_t es = dtype_size(dtype);
  const std::size_t vec = std::max<std::size_t>(1, 16 / es);  // slices of whole vectors keep them aligned
  const std::size_t per = ((count + n - 1) / n + vec - 1) / vec * vec;
  auto lo = [&](int r) { return std::min(count, r * per); };
  auto hi = [&](int r) { return std::min(count, (r + 1) * per); };
  int unit = 16;
  auto fits = [&](int u) {
    for (int q = 0; q < n; ++q)
      if ((hi(q) - lo(q)) * es % u || reinterpret_cast<std::uintptr_t>(out[q]) % u || (lo(q) * es) % u) return false;
    return true;
  };
  while (unit > 1 && !fits(unit)) unit /= 2;
  const int mean_div = op == ReduceOp::kMean ? n : 1;
  phased(2, [&](int g, cudaStream_t s, int phase) {
    const int r = groups_[g].ranks[0];  // one rank per GPU here
    if (phase == 0) {  // out[r]'s slice r = op over every input's slice r
      if (hi(r) == lo(r)) return;
      FusedArgs a;
      a.nin = n;
      for (int q = 0; q < n; ++q) a.in[q] = at(in[q], lo(r) * es);
      a.nout = 1;
      a.out[0] = at(out[r], lo(r) * es);
      return fused_reduce(a, hi(r) - lo(r), dtype, combining_op(op), mean_div, groups_[g].sms, s);
    }
    GatherArgs a;  // out[r]'s other slices from their owners' outputs; its own (null) is left alone
    a.nin = n;
    a.outer = 1;
    a.col[0] = 0;
    for (int q = 0; q < n; ++q) {
      a.in[q] = q == r ? nullptr : at(out[q], lo(q) * es);
      a.col[q + 1] = a.col[q] + (hi(q) - lo(q)) * es / unit;
    }
    a.nout = 1;
    a.out[0] = out[r];
    fused_gather(a, unit, groups_[g].sms, s);
  });
}

void CudaRing::direct_all_reduce(const void* const* in, void* const* out, std::size_t count, DType dtype,
                                 ReduceOp op) {
  const int n = size();
  const int mean_div = op == ReduceOp::kMean ? n : 1;
  one_pass([&](int g, cudaStream_t s) {
    FusedArgs a;
    a.nin = n;
    for (int r = 0; r < n; ++r) a.in[r] = in[r];
    for (int r : groups_[g].ranks)
      if (n > 1 || out[r] != in[r]) a.out[a.nout++] = out[r];  // one rank in place: nothing to do
    if (a.nout) fused_reduce(a, count, dtype, combining_op(op), mean_div, groups_[g].sms, s);
  });
}

void CudaRing::all_reduce(int n, const void* const* in, void* const* out, std::size_t count, DType dtype, ReduceOp op,
                          Algorithm algorithm) {
  std::lock_guard<std::mutex> lock(mu_);
  DeviceGuard guard;
  begin(n, "all_reduce");
  const std::size_t bytes = count * dtype_size(dtype);
  if (algorithm == Algorithm::kAuto) algorithm = choose(bytes);
  if (algorithm == Algorithm::kDirect && !one_pass_)
    throw std::invalid_argument("algorithm='direct' needs every rank to read every other rank's memory (one GPU, or "
                                "peer access between all the GPUs) and at most " + std::to_string(kMaxFused) +
                                " ranks; use 'ring', 'tree' or 'auto'");
  if (bytes == 0) return;
  if (algorithm == Algorithm::kDirect) {
    // Across GPUs, one GPU's kernel would overwrite an input in place that
    // another GPU's kernel may still be reading: the ring runs instead.
    bool in_place = false;
    for (int r = 0; r < n; ++r) in_place = in_place || out[r] == in[r];
    if (groups_.size() == 1 || (!in_place && bytes <= kPeerOneShotBelowBytes))
      return direct_all_reduce(in, out, count, dtype, op);
    if (groups_.size() == ranks_.size()) return two_shot_all_reduce(in, out, count, dtype, op);
    algorithm = Algorithm::kRing;  // several ranks per GPU across GPUs, in place or large
  }
  if (n == 1) {  // the sum (or mean, min, ...) of one buffer is itself
    fork(1, false);
    copy(0, 0, out[0], in[0], 0, bytes);
    return join(1, false);
  }
  if (algorithm == Algorithm::kRing) return ring_all_reduce(in, out, count, dtype, op);
  tree_all_reduce(in, out, count, dtype, op);
}

void CudaRing::ring_all_reduce(const void* const* in, void* const* out, std::size_t count, DType dtype, ReduceOp op) {
  const int n = size();
  const std::size_t es = dtype_size(dtype);
  const RingSchedule ring(n, count, ring_chunk_elems(n, count, es));
  const std::size_t slices = ring.num_slices();
  const int used = static_cast<int>(std::min<std::size_t>(channels_, slices));
  const ReduceOp combine = combining_op(op);
  const int mean_div = op == ReduceOp::kMean ? n : 1;

  stage(used);
  fork(used, true);
  // Slice-major issue: every event a wait names has already been recorded,
  // and slice s runs on channel s % channels beside the other channels' slices.
  for (std::size_t s = 0; s < slices; ++s) {
    const int c = static_cast<int>(s % channels_);
    for (int t = 0; t < ring.num_steps(); ++t) {
      for (int r = 0; r < n; ++r) {
        const RingOp o = ring.op(s, t, r);
        Rank& k = ranks_[r];
        MIRRORED_CUDA_CHECK(set_device(k.device));
        // The schedule's one dependency: the predecessor's op of the previous
        // step. Two events per channel, by step parity, because this rank
        // records step t before its successor has waited on step t-1.
        if (t > 0) MIRRORED_CUDA_CHECK(cudaStreamWaitEvent(k.streams[c], ranks_[o.peer].step[(t - 1) & 1][c], 0));
        const std::size_t off = o.offset * es;
        if (o.verb == RingVerb::kReduceCopy) {
          const void* theirs = o.peer_input ? in[o.peer] : out[o.peer];
          fold(r, c, at(out[r], off), at(in[r], off), at(theirs, off), o.peer, o.count, dtype, combine,
               o.finalize ? mean_div : 1);
        } else {
          copy(r, c, at(out[r], off), at(out[o.peer], off), o.peer, o.count * es);
        }
        MIRRORED_CUDA_CHECK(cudaEventRecord(k.step[t & 1][c], k.streams[c]));
      }
    }
  }
  join(used, true);
}

void CudaRing::tree_all_reduce(const void* const* in, void* const* out, std::size_t count, DType dtype, ReduceOp op) {
  const int n = size();
  const TreeSchedule tree(n);
  const ReduceOp combine = combining_op(op);
  const int mean_div = op == ReduceOp::kMean ? n : 1;
  // step[0][0] of a rank: "my latest fold is done", recorded on channel 0.
  auto latest = [&](int r) { return ranks_[r].step[0][0]; };

  stage(1);
  fork(1, false);
  for (int l = 0; l < tree.num_levels(); ++l) {
    for (int i = 0; i < tree.num_ops(l); ++i) {
      const TreeOp o = tree.op(l, i);
      Rank& k = ranks_[o.dst];
      MIRRORED_CUDA_CHECK(set_device(k.device));
      if (!o.src_input) MIRRORED_CUDA_CHECK(cudaStreamWaitEvent(k.streams[0], latest(o.src), 0));
      fold(o.dst, 0, out[o.dst], o.dst_input ? in[o.dst] : out[o.dst], o.src_input ? in[o.src] : out[o.src], o.src,
           count, dtype, combine, o.finalize ? mean_div : 1);
      MIRRORED_CUDA_CHECK(cudaEventRecord(latest(o.dst), k.streams[0]));
    }
  }
  // Rank 0 holds the result: hand it to everyone.
  for (int r = 1; r < n; ++r) {
    MIRRORED_CUDA_CHECK(set_device(ranks_[r].device));
    MIRRORED_CUDA_CHECK(cudaStreamWaitEvent(ranks_[r].streams[0], latest(0), 0));
    copy(r, 0, out[r], out[0], 0, count * dtype_size(dtype));
  }
  join(1, false);
}

void CudaRing::broadcast(int n, const void* const* in, void* const* out, std::size_t count, DType dtype, int root) {
  std::lock_guard<std::mutex> lock(mu_);
  DeviceGuard guard;
  begin(n, "broadcast");
  if (root < 0 || root >= n)
    throw std::invalid_argument("root=" + std::to_string(root) + " is not a rank; use 0.." + std::to_string(n - 1));
  const std::size_t bytes = count * dtype_size(dtype);
  if (bytes == 0) return;
  if (one_pass_) {  // one copy kernel per GPU writes all of its ranks' outputs
    return one_pass([&](int g, cudaStream_t s) {
      FusedArgs a;
      a.nin = 1;
      a.in[0] = in[root];
      for (int r : groups_[g].ranks)
        if (out[r] != in[root]) a.out[a.nout++] = out[r];
      if (a.nout) fused_reduce(a, bytes, DType::kUInt8, ReduceOp::kSum, 1, groups_[g].sms, s);
    });
  }
  fork(1, false);
  for (int r = 0; r < n; ++r) copy(r, 0, out[r], in[root], root, bytes);
  join(1, false);
}

void CudaRing::reduce(int n, const void* const* in, void* const* out, std::size_t count, DType dtype, ReduceOp op,
                      int root) {
  std::lock_guard<std::mutex> lock(mu_);
  DeviceGuard guard;
  begin(n, "reduce");
  if (root < 0 || root >= n)
    throw std::invalid_argument("root=" + std::to_string(root) + " is not a rank; use 0.." + std::to_string(n - 1));
  const std::size_t bytes = count * dtype_size(dtype);
  if (bytes == 0) return;
  if (one_pass_) {  // the root's GPU reads every input once and writes the root's output
    return one_pass([&](int g, cudaStream_t s) {
      if (groups_[g].device != ranks_[root].device || (n == 1 && out[root] == in[root])) return;
      FusedArgs a;
      a.nin = n;
      for (int r = 0; r < n; ++r) a.in[r] = in[r];
      a.nout = 1;
      a.out[0] = out[root];
      fused_reduce(a, count, dtype, combining_op(op), op == ReduceOp::kMean ? n : 1, groups_[g].sms, s);
    });
  }
  stage(1);
  fork(1, false);
  // Fold every other rank into the root's output in turn; only the root's
  // output is written, as the contract asks.
  const void* acc = in[root];
  int folded = 0;
  for (int q = 0; q < n; ++q) {
    if (q == root) continue;
    ++folded;
    fold(root, 0, out[root], acc, in[q], q, count, dtype, combining_op(op),
         op == ReduceOp::kMean && folded == n - 1 ? n : 1);
    acc = out[root];
  }
  if (n == 1) copy(root, 0, out[root], in[root], root, bytes);
  join(1, false);
}

void CudaRing::all_gather(int n, const void* const* in, void* const* out, const std::size_t* row_bytes,
                          std::size_t outer) {
  std::lock_guard<std::mutex> lock(mu_);
  DeviceGuard guard;
  begin(n, "all_gather");
  std::size_t pitch = 0;
  for (int j = 0; j < n; ++j) pitch += row_bytes[j];
  if (pitch == 0 || outer == 0) return;
  if (one_pass_) {  // one kernel per GPU, in the widest unit that divides every row and pointer
    int unit = 16;
    auto fits = [&](int u) {
      for (int j = 0; j < n; ++j) {
        if (row_bytes[j] % u || reinterpret_cast<std::uintptr_t>(out[j]) % u) return false;
        if (row_bytes[j] && reinterpret_cast<std::uintptr_t>(in[j]) % u) return false;
      }
      return true;
    };
    while (unit > 1 && !fits(unit)) unit /= 2;
    GatherArgs a;
    a.nin = n;
    a.outer = outer;
    a.col[0] = 0;
    for (int j = 0; j < n; ++j) a.in[j] = in[j], a.col[j + 1] = a.col[j] + row_bytes[j] / unit;
    return one_pass([&](int g, cudaStream_t s) {
      a.nout = 0;
      for (int r : groups_[g].ranks) a.out[a.nout++] = out[r];
      fused_gather(a, unit, groups_[g].sms, s);
    });
  }
  fork(1, false);
  for (int r = 0; r < n; ++r) {
    std::size_t col = 0;
    for (int j = 0; j < n; ++j) {
      if (row_bytes[j] > 0) gather_rows(r, at(out[r], col), pitch, in[j], j, row_bytes[j], outer);
      col += row_bytes[j];
    }
  }
  join(1, false);
}

}  // namespace mirrored::cuda
