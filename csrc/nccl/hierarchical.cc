#include "nccl/hierarchical.h"

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "cuda/check.h"
#include "cuda/device.h"
#include "cuda/fused.h"
#include "cuda/stream_scope.h"

namespace mirrored::nccl {

using cuda::make_event;

HierarchicalCommunicator::HierarchicalCommunicator(std::vector<int> devices) : devices_(std::move(devices)) {
  if (devices_.empty()) throw std::invalid_argument("devices: the hierarchical engine needs at least one GPU replica");
  for (int d : devices_)
    if (std::count(devices_.begin(), devices_.end(), d) > cuda::kMaxFused)  // one fold kernel takes them all
      throw std::invalid_argument("devices: more than " + std::to_string(cuda::kMaxFused) + " replicas on GPU " +
                                  std::to_string(d) + "; the hierarchical engine takes at most that many per GPU "
                                  "(use algorithm='ring')");
  cuda::DeviceGuard guard;
  try {
    for (int r = 0; r < size(); ++r) {
      cuda::check_ordinal(devices_[r], "devices");
      auto g = std::find_if(groups_.begin(), groups_.end(), [&](const Group& x) { return x.device == devices_[r]; });
      if (g == groups_.end()) {
        g = groups_.insert(groups_.end(), Group{devices_[r], 1, {}});
        MIRRORED_CUDA_CHECK(cuda::set_device(g->device));
        MIRRORED_CUDA_CHECK(cudaDeviceGetAttribute(&g->sms, cudaDevAttrMultiProcessorCount, g->device));
        g->ready = make_event();
        g->done = make_event();
        g->used = make_event();
      }
      g->ranks.push_back(r);
    }
    std::vector<int> gpus;
    for (const Group& g : groups_) gpus.push_back(g.device);
    across_ = std::make_unique<NcclCommunicator>(std::move(gpus));
  } catch (...) {
    release();
    throw;
  }
}

HierarchicalCommunicator::~HierarchicalCommunicator() { release(); }

void HierarchicalCommunicator::release() noexcept {
  cuda::DeviceGuard guard;
  for (Group& g : groups_) {
    if (cuda::set_device(g.device) != cudaSuccess) continue;
    if (g.pending) cudaEventSynchronize(g.used);  // the last reduce's NCCL call reads the fold buffer
    if (g.fold) cudaFree(g.fold);
    for (cudaEvent_t e : {g.ready, g.done, g.used})
      if (e) cudaEventDestroy(e);
    g.ready = g.done = g.used = nullptr;
    g.fold = nullptr;
  }
  for (const auto& [device, p] : captured_)
    if (cuda::set_device(device) == cudaSuccess) cudaFree(p);
  captured_.clear();
}

void HierarchicalCommunicator::begin(int n, const char* what) {
  check_buffers(n, size(), what, "replica");
  cuda::current_streams(n, callers_);
  leads_.clear();
  for (const Group& g : groups_) leads_.push_back(callers_[g.ranks[0]]);
}

template <typename F>
void HierarchicalCommunicator::on_leads(F f) {
  auto joined = [&](const Group& g, int r) { return callers_[r] == callers_[g.ranks[0]]; };
  for (Group& g : groups_) {
    MIRRORED_CUDA_CHECK(cuda::set_device(g.device));
    for (int r : g.ranks) {
      if (joined(g, r)) continue;
      MIRRORED_CUDA_CHECK(cudaEventRecord(g.ready, callers_[r]));
      MIRRORED_CUDA_CHECK(cudaStreamWaitEvent(callers_[g.ranks[0]], g.ready, 0));
    }
  }
  f();
  for (Group& g : groups_) {
    if (std::all_of(g.ranks.begin(), g.ranks.end(), [&](int r) { return joined(g, r); })) continue;
    MIRRORED_CUDA_CHECK(cuda::set_device(g.device));
    MIRRORED_CUDA_CHECK(cudaEventRecord(g.done, callers_[g.ranks[0]]));
    for (int r : g.ranks)
      if (!joined(g, r)) MIRRORED_CUDA_CHECK(cudaStreamWaitEvent(callers_[r], g.done, 0));
  }
}

void HierarchicalCommunicator::all_reduce(int n, const void* const* in, void* const* out, std::size_t count,
                                          DType dtype, ReduceOp op, Algorithm algorithm) {
  std::lock_guard<std::mutex> lock(mu_);
  cuda::DeviceGuard guard;
  begin(n, "all_reduce");
  if (count * dtype_size(dtype) == 0) return;
  const ReduceOp combine = combining_op(op);
  on_leads([&] {
    std::vector<const void*> sums;
    std::vector<void*> results;
    for (std::size_t k = 0; k < groups_.size(); ++k) {  // each GPU folds its replicas, in replica order
      const Group& g = groups_[k];
      const int lead = g.ranks[0];
      sums.push_back(out[lead]);
      results.push_back(out[lead]);
      if (g.ranks.size() == 1 && out[lead] == in[lead]) continue;
      cuda::FusedArgs a;
      for (int r : g.ranks) a.in[a.nin++] = in[r];
      a.out[a.nout++] = out[lead];
      MIRRORED_CUDA_CHECK(cuda::set_device(g.device));
      cuda::fused_reduce(a, count, dtype, combine, 1, g.sms, leads_[k]);
    }
    if (groups_.size() > 1) {  // one NCCL rank per GPU, in place: the same bytes on every GPU
      cuda::StreamScope scope(leads_);
      across_->all_reduce(gpus(), sums.data(), results.data(), count, dtype, combine, algorithm);
    }
    const int mean_div = op == ReduceOp::kMean ? n : 1;
    for (std::size_t k = 0; k < groups_.size(); ++k) {  // and hands the result to its other replicas
      const Group& g = groups_[k];
      cuda::FusedArgs a;
      a.in[a.nin++] = out[g.ranks[0]];
      for (int r : g.ranks)
        if (r == g.ranks[0] ? mean_div > 1 : out[r] != out[g.ranks[0]]) a.out[a.nout++] = out[r];
      if (a.nout == 0) continue;
      MIRRORED_CUDA_CHECK(cuda::set_device(g.device));
      cuda::fused_reduce(a, count, dtype, ReduceOp::kSum, mean_div, g.sms, leads_[k]);
    }
  });
}

void HierarchicalCommunicator::broadcast(int n, const void* const* in, void* const* out, std::size_t count,
                                         DType dtype, int root) {
  std::lock_guard<std::mutex> lock(mu_);
  cuda::DeviceGuard guard;
  begin(n, "broadcast");
  if (root < 0 || root >= n)
    throw std::invalid_argument("root=" + std::to_string(root) + " is not a replica; use 0.." + std::to_string(n - 1));
  const std::size_t bytes = count * dtype_size(dtype);
  if (bytes == 0) return;
  on_leads([&] {
    // The NCCL buffer of each GPU: the root's output on its GPU, the lead's output elsewhere.
    std::vector<const void*> sources;
    std::vector<void*> targets;
    int root_gpu = 0;
    for (std::size_t k = 0; k < groups_.size(); ++k) {
      const Group& g = groups_[k];
      const bool has_root = std::find(g.ranks.begin(), g.ranks.end(), root) != g.ranks.end();
      if (has_root) root_gpu = static_cast<int>(k);
      targets.push_back(out[has_root ? root : g.ranks[0]]);
      sources.push_back(has_root ? in[root] : targets.back());
    }
    if (groups_.size() > 1) {
      cuda::StreamScope scope(leads_);
      across_->broadcast(gpus(), sources.data(), targets.data(), bytes, DType::kUInt8, root_gpu);
    }
    for (std::size_t k = 0; k < groups_.size(); ++k) {
      const Group& g = groups_[k];
      cuda::FusedArgs a;
      a.in[a.nin++] = groups_.size() > 1 ? targets[k] : in[root];
      for (int r : g.ranks)
        if (out[r] != a.in[0]) a.out[a.nout++] = out[r];
      if (a.nout == 0) continue;
      MIRRORED_CUDA_CHECK(cuda::set_device(g.device));
      cuda::fused_reduce(a, bytes, DType::kUInt8, ReduceOp::kSum, 1, g.sms, leads_[k]);
    }
  });
}

cuda::CudaRing& HierarchicalCommunicator::native() {
  if (!native_) native_ = std::make_unique<cuda::CudaRing>(devices_);
  return *native_;
}

void* HierarchicalCommunicator::fold_buffer(std::size_t k, std::size_t bytes, bool captured) {
  Group& g = groups_[k];
  void* p = nullptr;
  if (captured) {
    p = cuda::device_malloc(bytes, "captured hierarchical fold buffer");
    captured_.emplace_back(g.device, p);
    return p;
  }
  if (g.fold_bytes < bytes) {
    if (g.pending) MIRRORED_CUDA_CHECK(cudaEventSynchronize(g.used));  // (once or twice: sizes repeat)
    if (g.fold) MIRRORED_CUDA_CHECK(cudaFree(g.fold));
    g.fold = nullptr, g.fold_bytes = 0, g.pending = false;
    g.fold = cuda::device_malloc(bytes, "hierarchical fold buffer");
    g.fold_bytes = bytes;
  }
  if (g.pending && g.last != leads_[k]) MIRRORED_CUDA_CHECK(cudaStreamWaitEvent(leads_[k], g.used, 0));
  return g.fold;
}

void HierarchicalCommunicator::reduce(int n, const void* const* in, void* const* out, std::size_t count, DType dtype,
                                      ReduceOp op, int root) {
  std::lock_guard<std::mutex> lock(mu_);
  cuda::DeviceGuard guard;
  begin(n, "reduce");
  if (root < 0 || root >= n)
    throw std::invalid_argument("root=" + std::to_string(root) + " is not a replica; use 0.." + std::to_string(n - 1));
  const std::size_t bytes = count * dtype_size(dtype);
  if (bytes == 0) return;
  const ReduceOp combine = combining_op(op);
  on_leads([&] {
    std::vector<const void*> sends;
    std::vector<void*> recvs;
    std::vector<std::size_t> folded;  // the GPUs whose fold buffer NCCL reads (eager calls)
    int root_gpu = 0;
    for (std::size_t k = 0; k < groups_.size(); ++k) {  // each GPU folds its replicas, in replica order
      const Group& g = groups_[k];
      const bool has_root = std::find(g.ranks.begin(), g.ranks.end(), root) != g.ranks.end();
      MIRRORED_CUDA_CHECK(cuda::set_device(g.device));
      void* target = nullptr;
      if (has_root) {
        root_gpu = static_cast<int>(k);
        target = out[root];
      } else if (g.ranks.size() > 1) {
        const bool captured = cuda::capturing(leads_[k]);
        target = fold_buffer(k, bytes, captured);
        if (!captured) folded.push_back(k);
      }
      if (target == nullptr) {  // one replica: NCCL sends its input as it is
        sends.push_back(in[g.ranks[0]]);
        recvs.push_back(const_cast<void*>(in[g.ranks[0]]));  // (NCCL writes only the root's)
        continue;
      }
      sends.push_back(target);
      recvs.push_back(target);
      if (g.ranks.size() == 1 && target == in[g.ranks[0]]) continue;
      cuda::FusedArgs a;
      for (int r : g.ranks) a.in[a.nin++] = in[r];
      a.out[a.nout++] = target;
      cuda::fused_reduce(a, count, dtype, combine, 1, g.sms, leads_[k]);
    }
    if (groups_.size() > 1) {
      cuda::StreamScope scope(leads_);
      across_->reduce(gpus(), sends.data(), recvs.data(), count, dtype, combine, root_gpu);
    }
    for (std::size_t k : folded) {
      Group& g = groups_[k];
      MIRRORED_CUDA_CHECK(cuda::set_device(g.device));
      MIRRORED_CUDA_CHECK(cudaEventRecord(g.used, leads_[k]));
      g.pending = true, g.last = leads_[k];
    }
    if (op == ReduceOp::kMean) {  // the root's output divided in place
      const Group& g = groups_[root_gpu];
      cuda::FusedArgs a;
      a.in[a.nin++] = out[root];
      a.out[a.nout++] = out[root];
      MIRRORED_CUDA_CHECK(cuda::set_device(g.device));
      cuda::fused_reduce(a, count, dtype, ReduceOp::kSum, n, g.sms, leads_[root_gpu]);
    }
  });
}

bool HierarchicalCommunicator::gathers_by_gpu(const std::size_t* row_bytes, std::size_t outer) const {
  const std::size_t per = groups_[0].ranks.size();
  if (outer != 1) return false;
  for (int r = 0; r < size(); ++r)
    if (row_bytes[r] != row_bytes[0]) return false;
  for (std::size_t k = 0; k < groups_.size(); ++k) {
    if (groups_[k].ranks.size() != per) return false;
    for (std::size_t j = 0; j < per; ++j)
      if (groups_[k].ranks[j] != static_cast<int>(k * per + j)) return false;
  }
  return true;
}

void HierarchicalCommunicator::all_gather(int n, const void* const* in, void* const* out,
                                          const std::size_t* row_bytes, std::size_t outer) {
  std::lock_guard<std::mutex> lock(mu_);
  check_buffers(n, size(), "all_gather", "replica");  // (before the native engine is made for nothing)
  if (!gathers_by_gpu(row_bytes, outer)) return native().all_gather(n, in, out, row_bytes, outer);
  cuda::DeviceGuard guard;
  begin(n, "all_gather");
  const std::size_t row = row_bytes[0], block = row * groups_[0].ranks.size(), total = block * groups_.size();
  if (total == 0) return;
  auto at = [](void* p, std::size_t bytes) { return static_cast<char*>(p) + bytes; };
  // The widest unit (16 down to 1 byte) that divides the rows and every pointer the gathers touch.
  int unit = 16;
  auto fits = [&](int u) {
    if (row % u) return false;
    for (int r = 0; r < n; ++r)
      if (reinterpret_cast<std::uintptr_t>(in[r]) % u || reinterpret_cast<std::uintptr_t>(out[r]) % u) return false;
    return true;
  };
  while (unit > 1 && !fits(unit)) unit /= 2;
  on_leads([&] {
    std::vector<const void*> sends;
    std::vector<void*> recvs;
    for (std::size_t k = 0; k < groups_.size(); ++k) {  // each GPU gathers its replicas into its block of the lead's output
      const Group& g = groups_[k];
      void* mine = at(out[g.ranks[0]], k * block);
      cuda::GatherArgs a;
      a.outer = 1;
      a.col[0] = 0;
      for (int r : g.ranks) a.in[a.nin] = in[r], a.col[a.nin + 1] = a.col[a.nin] + row / unit, ++a.nin;
      a.out[a.nout++] = mine;
      MIRRORED_CUDA_CHECK(cuda::set_device(g.device));
      cuda::fused_gather(a, unit, g.sms, leads_[k]);
      sends.push_back(mine);
      recvs.push_back(out[g.ranks[0]]);
    }
    if (groups_.size() > 1) {  // NCCL's in-place all-gather of the GPUs' blocks (rank-major: GPU order)
      const std::vector<std::size_t> blocks(groups_.size(), block);
      cuda::StreamScope scope(leads_);
      across_->all_gather(gpus(), sends.data(), recvs.data(), blocks.data(), 1);
    }
    for (std::size_t k = 0; k < groups_.size(); ++k) {  // and hands the whole to its other replicas
      const Group& g = groups_[k];
      cuda::FusedArgs a;
      a.in[a.nin++] = out[g.ranks[0]];
      for (std::size_t j = 1; j < g.ranks.size(); ++j) a.out[a.nout++] = out[g.ranks[j]];
      if (a.nout == 0) continue;
      MIRRORED_CUDA_CHECK(cuda::set_device(g.device));
      cuda::fused_reduce(a, total, DType::kUInt8, ReduceOp::kSum, 1, g.sms, leads_[k]);
    }
  });
}

}  // namespace mirrored::nccl
