#include "cuda/device_batch.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "cuda/check.h"
#include "cuda/cuda_ring.h"
#include "cuda/device.h"
#include "cuda/stream_scope.h"

namespace mirrored::cuda {
namespace {

constexpr std::size_t round16(std::size_t x) { return (x + 15) / 16 * 16; }

}  // namespace

DeviceBatch::Layout DeviceBatch::plan(std::vector<std::size_t> counts, std::vector<DType> dtypes,
                                      std::size_t bytes_per_pack, int num_packs) {
  if (counts.size() != dtypes.size()) throw std::invalid_argument("batch_all_reduce: one dtype per tensor count");
  Layout l;
  std::vector<std::size_t> bytes(counts.size());
  for (std::size_t t = 0; t < counts.size(); ++t) bytes[t] = counts[t] * dtype_size(dtypes[t]);
  l.packs = plan_packs(bytes, dtypes, bytes_per_pack, num_packs);
  // The multi-tensor packs back to back in the fusion buffers.
  for (std::size_t k = 0; k < l.packs.size(); ++k) {
    const Pack& pack = l.packs[k];
    if (pack.bytes == 0 || pack.entries.size() == 1) continue;
    Layout::Placed p{k, l.fused_bytes, {}, 0};
    std::size_t cur = 0;
    for (const PackEntry& e : pack.entries) {
      p.entry_offset.push_back(cur);
      cur = round16(cur + e.bytes);
      l.live_entries += e.bytes > 0;
    }
    p.count = cur / dtype_size(pack.dtype);
    l.fused_bytes += cur;
    l.placed.push_back(std::move(p));
  }
  // The one-pass launches: the non-empty tensors by dtype, in batch order.
  for (std::size_t t = 0; t < counts.size(); ++t) {
    if (bytes[t] == 0) continue;
    auto g = std::find_if(l.groups.begin(), l.groups.end(),
                          [&](const Layout::Group& x) { return x.dtype == dtypes[t]; });
    if (g == l.groups.end()) g = l.groups.insert(l.groups.end(), Layout::Group{dtypes[t], {}, 0});
    g->tensors.push_back(t);
    g->slots += (bytes[t] + 15) / 16;
  }
  l.counts = std::move(counts);
  l.dtypes = std::move(dtypes);
  return l;
}

DeviceBatch::DeviceBatch(std::vector<int> devices) : ranks_(devices.size()) {
  for (std::size_t r = 0; r < devices.size(); ++r) {
    ranks_[r].device = devices[r];
    one_gpu_ = one_gpu_ && devices[r] == devices[0];
  }
}

DeviceBatch::~DeviceBatch() {
  DeviceGuard guard;
  for (Rank& k : ranks_) {
    if (set_device(k.device) != cudaSuccess) continue;
    if (k.pending) cudaEventSynchronize(k.used);  // the last batch's kernels read the buffers
    for (Table& t : k.tables) {
      if (t.pending) cudaEventSynchronize(t.done);
      if (t.device) cudaFree(t.device);
      if (t.host) cudaFreeHost(t.host);
      if (t.done) cudaEventDestroy(t.done);
    }
    if (k.fusion) cudaFree(k.fusion);
    if (k.ready) cudaEventDestroy(k.ready);
    if (k.used) cudaEventDestroy(k.used);
  }
  for (const CapturedTable& t : captured_) {
    cudaFree(t.device);
    cudaFreeHost(t.host);
  }
}

void* DeviceBatch::fusion(int r, std::size_t bytes) {
  Rank& k = ranks_[r];
  if (k.fusion_bytes >= bytes) return k.fusion;
  MIRRORED_CUDA_CHECK(set_device(k.device));
  if (k.fusion) {
    // An earlier batch may still be reading it on some stream of this device.
    MIRRORED_CUDA_CHECK(cudaDeviceSynchronize());
    MIRRORED_CUDA_CHECK(cudaFree(k.fusion));
    k.fusion = nullptr;
    k.fusion_bytes = 0;
  }
  k.fusion = device_malloc(bytes, "batch fusion buffer");
  k.fusion_bytes = bytes;
  return k.fusion;
}

void DeviceBatch::prepare(int r) {
  Rank& k = ranks_[r];
  MIRRORED_CUDA_CHECK(set_device(k.device));
  if (k.used) return;
  MIRRORED_CUDA_CHECK(cudaDeviceGetAttribute(&k.sms, cudaDevAttrMultiProcessorCount, k.device));
  MIRRORED_CUDA_CHECK(cudaEventCreateWithFlags(&k.ready, cudaEventDisableTiming));
  MIRRORED_CUDA_CHECK(cudaEventCreateWithFlags(&k.used, cudaEventDisableTiming));
}

DeviceBatch::Table* DeviceBatch::table(int r, std::size_t bytes, bool captured, char** host, char** device) {
  Rank& k = ranks_[r];
  if (captured) {
    // The graph replays this upload and these kernels long after the call: tables of its own, never
    // rewritten (they live as long as this object), and nothing waits on the host.
    // Each kept as soon as it exists, so an allocation that fails leaks nothing (the destructor frees them).
    CapturedTable& t = captured_.emplace_back();
    t.host = static_cast<char*>(host_malloc(bytes, "captured batch pointer table"));
    t.device = static_cast<char*>(device_malloc(bytes, "captured batch pointer table"));
    *host = t.host, *device = t.device;
    return nullptr;
  }
  Table& t = k.tables[k.next_table];
  k.next_table = (k.next_table + 1) % kTables;
  // A wait only when the GPU is still on the batch kTables calls back.
  if (t.pending && cudaEventQuery(t.done) == cudaErrorNotReady) MIRRORED_CUDA_CHECK(cudaEventSynchronize(t.done));
  t.pending = false;
  if (!t.done) MIRRORED_CUDA_CHECK(cudaEventCreateWithFlags(&t.done, cudaEventDisableTiming));
  if (t.bytes < bytes) {
    if (t.device) MIRRORED_CUDA_CHECK(cudaFree(t.device));
    if (t.host) MIRRORED_CUDA_CHECK(cudaFreeHost(t.host));
    t.device = t.host = nullptr, t.bytes = 0;
    // Room to grow: a model's batch sizes repeat, so this happens once or twice.
    const std::size_t want = std::max<std::size_t>(4096, bytes + bytes / 2);
    // (t.bytes stays 0 until both exist: after an OutOfMemory the next call frees what there is and retries)
    t.host = static_cast<char*>(host_malloc(want, "batch pointer table"));
    t.device = static_cast<char*>(device_malloc(want, "batch pointer table"));
    t.bytes = want;
  }
  *host = t.host, *device = t.device;
  return &t;
}

void DeviceBatch::all_reduce(Communicator& comm, const std::vector<std::vector<const void*>>& in,
                             const std::vector<std::vector<void*>>& out, const Layout& layout, ReduceOp op,
                             Algorithm algorithm) {
  const int n = static_cast<int>(ranks_.size());
  if (static_cast<int>(in.size()) != n || static_cast<int>(out.size()) != n)
    throw std::invalid_argument("batch_all_reduce: got " + std::to_string(in.size()) + " input and " +
                                std::to_string(out.size()) + " output lists for " + std::to_string(n) + " ranks");
  for (int r = 0; r < n; ++r)
    if (in[r].size() != layout.counts.size() || out[r].size() != layout.counts.size())
      throw std::invalid_argument("batch_all_reduce: rank " + std::to_string(r) + " has " +
                                  std::to_string(in[r].size()) + " tensors, expected " +
                                  std::to_string(layout.counts.size()) + " like every rank");
  std::lock_guard<std::mutex> lock(mu_);
  DeviceGuard guard;
  // One pass where one kernel reads every rank: all of them on one GPU of this process (the CUDA
  // ring; an NCCL communicator's ranks may span processes).
  if (one_gpu_ && dynamic_cast<CudaRing*>(&comm) != nullptr) return one_pass(in, out, layout, op);
  packed(comm, in, out, layout, op, algorithm);
}

void DeviceBatch::one_pass(const std::vector<std::vector<const void*>>& in, const std::vector<std::vector<void*>>& out,
                           const Layout& layout, ReduceOp op) {
  const int n = static_cast<int>(ranks_.size());
  std::size_t entries = 0;
  for (const Layout::Group& g : layout.groups) entries += g.tensors.size();
  if (entries == 0) return;
  prepare(0);
  for (int r = 1; r < n; ++r) prepare(r);
  MIRRORED_CUDA_CHECK(set_device(ranks_[0].device));
  // The launch goes on rank 0's stream, after every other rank's stream's queued work, which then waits for it.
  const cudaStream_t lead = current_stream(0, n);
  std::vector<int> joined;  // ranks with a stream of their own
  for (int r = 1; r < n; ++r) {
    const cudaStream_t s = current_stream(r, n);
    bool seen = s == lead;
    for (int q : joined) seen = seen || current_stream(q, n) == s;
    if (seen) continue;
    joined.push_back(r);
    MIRRORED_CUDA_CHECK(cudaEventRecord(ranks_[r].ready, s));
    MIRRORED_CUDA_CHECK(cudaStreamWaitEvent(lead, ranks_[r].ready, 0));
  }
  // The table: every entry, then every entry's 2n pointers (the groups' in order).
  const std::size_t entry_bytes = entries * sizeof(ReduceEntry);
  const std::size_t bytes = entry_bytes + entries * 2 * n * sizeof(void*);
  const bool captured = capturing(lead);
  char *host = nullptr, *device = nullptr;
  Table* t = table(0, bytes, captured, &host, &device);
  auto* e = reinterpret_cast<ReduceEntry*>(host);
  auto* p = reinterpret_cast<const void**>(host + entry_bytes);
  for (const Layout::Group& g : layout.groups) {
    std::size_t slot = 0;
    const std::size_t per = 16 / dtype_size(g.dtype);
    for (std::size_t tensor : g.tensors) {
      bool vectorised = true;
      for (int r = 0; r < n; ++r) {
        *p++ = in[r][tensor];
        vectorised = vectorised && aligned16(in[r][tensor]);
      }
      for (int r = 0; r < n; ++r) {
        *p++ = out[r][tensor];
        vectorised = vectorised && aligned16(out[r][tensor]);
      }
      *e++ = ReduceEntry{slot, layout.counts[tensor], vectorised};
      slot += (layout.counts[tensor] + per - 1) / per;
    }
  }
  MIRRORED_CUDA_CHECK(cudaMemcpyAsync(device, host, bytes, cudaMemcpyHostToDevice, lead));
  const auto* table_entries = reinterpret_cast<const ReduceEntry*>(device);
  const auto* table_pointers = reinterpret_cast<const void* const*>(device + entry_bytes);
  const int mean_div = op == ReduceOp::kMean ? n : 1;
  std::size_t first = 0;
  for (const Layout::Group& g : layout.groups) {
    multi_reduce(table_entries + first, table_pointers + first * 2 * n, static_cast<int>(g.tensors.size()), n,
                 g.slots, g.dtype, combining_op(op), mean_div, ranks_[0].sms, lead);
    first += g.tensors.size();
  }
  if (t) {
    MIRRORED_CUDA_CHECK(cudaEventRecord(t->done, lead));
    t->pending = true;
  }
  if (joined.empty()) return;
  MIRRORED_CUDA_CHECK(cudaEventRecord(ranks_[0].used, lead));
  for (int r : joined) MIRRORED_CUDA_CHECK(cudaStreamWaitEvent(current_stream(r, n), ranks_[0].used, 0));
}

void DeviceBatch::packed(Communicator& comm, const std::vector<std::vector<const void*>>& in,
                         const std::vector<std::vector<void*>>& out, const Layout& layout, ReduceOp op,
                         Algorithm algorithm) {
  const int n = static_cast<int>(ranks_.size());
  std::vector<const void*> pin(n);
  std::vector<void*> pout(n);
  struct Lane {
    int leader;
    cudaStream_t stream;
    std::size_t pack_entries = 0, pack_slots = 0, unpack_entries = 0, unpack_slots = 0;
    CopyEntry* table = nullptr;  // on the device
    Table* ring = nullptr;       // the ring's table (null: a captured call's own)
  };
  std::vector<Lane> lanes;
  if (!layout.placed.empty()) {
    // Ranks on one GPU reduce the packs in place; across GPUs into a second
    // half of the buffer, so that a one-pass kernel on one GPU never
    // overwrites a pack another GPU is still reading (CudaRing runs its
    // one-shot kernel only out of place).
    const std::size_t total = layout.fused_bytes;
    const std::size_t result_at = one_gpu_ ? 0 : total;
    std::vector<char*> f(n);
    for (int r = 0; r < n; ++r) f[r] = static_cast<char*>(fusion(r, total + result_at));
    // Whose result buffer replica r's unpack reads: its own, or (an engine that writes one output per
    // GPU) that of the first replica on its GPU, which the replicas of that GPU then all name as output.
    std::vector<int> reader(n);
    for (int r = 0; r < n; ++r) {
      reader[r] = r;
      for (int q = 0; q < r && comm.one_output_per_gpu() && reader[r] == r; ++q)
        if (ranks_[q].device == ranks_[r].device) reader[r] = q;
    }
    // Lanes: the ranks of one GPU that queue on one stream share a table and launches.
    std::vector<int> lane_of(n);
    for (int r = 0; r < n; ++r) {
      const cudaStream_t s = current_stream(r, n);
      lane_of[r] = -1;
      for (std::size_t l = 0; l < lanes.size(); ++l)
        if (lanes[l].stream == s && ranks_[lanes[l].leader].device == ranks_[r].device) lane_of[r] = int(l);
      if (lane_of[r] < 0) lane_of[r] = int(lanes.size()), lanes.push_back(Lane{r, s});
    }
    // Every lane's table is taken (and filled) before anything is queued: a GPU out of memory here leaves
    // no half-issued batch behind.
    std::vector<CopyEntry*> hosts(lanes.size());
    for (std::size_t l = 0; l < lanes.size(); ++l) {
      Lane& lane = lanes[l];
      prepare(lane.leader);
      std::size_t members = 0;
      for (int r = 0; r < n; ++r) members += lane_of[r] == int(l);
      const bool captured = capturing(lane.stream);
      char *host_bytes = nullptr, *device_bytes = nullptr;
      lane.ring = table(lane.leader, 2 * layout.live_entries * members * sizeof(CopyEntry), captured, &host_bytes,
                        &device_bytes);
      auto* host = reinterpret_cast<CopyEntry*>(host_bytes);
      lane.table = reinterpret_cast<CopyEntry*>(device_bytes);
      // The pack entries, then the unpack entries: two tables of one upload.
      auto fill = [&](bool pack, std::size_t at, std::size_t& entries, std::size_t& slots) {
        for (int r = 0; r < n; ++r) {
          if (lane_of[r] != int(l)) continue;
          for (const Layout::Placed& p : layout.placed) {
            const Pack& packed = layout.packs[p.pack];
            for (std::size_t i = 0; i < packed.entries.size(); ++i) {
              const PackEntry& e = packed.entries[i];
              if (e.bytes == 0) continue;
              char* slot = (pack ? f[r] : f[reader[r]] + result_at) + p.offset + p.entry_offset[i];
              CopyEntry& c = host[at + entries++];
              c = pack ? CopyEntry{in[r][e.tensor], slot, e.bytes, slots}
                       : CopyEntry{slot, out[r][e.tensor], e.bytes, slots};
              slots += (e.bytes + 15) / 16;
            }
          }
        }
      };
      fill(true, 0, lane.pack_entries, lane.pack_slots);
      fill(false, lane.pack_entries, lane.unpack_entries, lane.unpack_slots);
      hosts[l] = host;
    }
    // What a lane queued is marked in flight: its table and fusion buffer are then waited for by the next
    // batch even when this one stops half-way (the engine's reduce ran out of memory for its scratch).
    auto queued = [&](Lane& lane) {
      Rank& k = ranks_[lane.leader];
      MIRRORED_CUDA_CHECK(set_device(k.device));
      if (lane.ring) {
        MIRRORED_CUDA_CHECK(cudaEventRecord(lane.ring->done, lane.stream));
        lane.ring->pending = true;
      }
      MIRRORED_CUDA_CHECK(cudaEventRecord(k.used, lane.stream));
      k.pending = true;
    };
    std::size_t issued = 0;  // lanes whose packing is queued
    try {
      for (std::size_t l = 0; l < lanes.size(); ++l) {
        Lane& lane = lanes[l];
        Rank& k = ranks_[lane.leader];
        const bool captured = lane.ring == nullptr;
        const CopyEntry* host = hosts[l];
        MIRRORED_CUDA_CHECK(set_device(k.device));
        // The fusion buffers: after the last batch's unpack (a wait on the GPU, not the host).
        if (!captured && k.pending) MIRRORED_CUDA_CHECK(cudaStreamWaitEvent(lane.stream, k.used, 0));
        MIRRORED_CUDA_CHECK(cudaMemcpyAsync(lane.table, host,
                                            (lane.pack_entries + lane.unpack_entries) * sizeof(CopyEntry),
                                            cudaMemcpyHostToDevice, lane.stream));
        multi_copy(lane.table, static_cast<int>(lane.pack_entries), lane.pack_slots, k.sms, lane.stream);
        issued = l + 1;
      }
      // Each pack is reduced in place, ordered after the packing on the same streams.
      for (const Layout::Placed& p : layout.placed) {
        for (int r = 0; r < n; ++r) pin[r] = f[r] + p.offset, pout[r] = f[reader[r]] + result_at + p.offset;
        comm.all_reduce(n, pin.data(), pout.data(), p.count, layout.packs[p.pack].dtype, op, algorithm);
      }
    } catch (...) {
      for (std::size_t l = 0; l < issued; ++l)
        if (lanes[l].ring) queued(lanes[l]);  // (a captured call's work is the capture's, invalid now)
      throw;
    }
    for (Lane& lane : lanes) {
      Rank& k = ranks_[lane.leader];
      MIRRORED_CUDA_CHECK(set_device(k.device));
      multi_copy(lane.table + lane.pack_entries, static_cast<int>(lane.unpack_entries), lane.unpack_slots, k.sms,
                 lane.stream);
      if (lane.ring) queued(lane);  // (else captured)
    }
  }
  // A tensor alone in its pack is reduced where it lies.
  for (const Pack& pack : layout.packs) {
    if (pack.bytes == 0 || pack.entries.size() != 1) continue;
    const std::size_t t = pack.entries[0].tensor;
    for (int r = 0; r < n; ++r) pin[r] = in[r][t], pout[r] = out[r][t];
    comm.all_reduce(n, pin.data(), pout.data(), pack.bytes / dtype_size(pack.dtype), pack.dtype, op, algorithm);
  }
}

}  // namespace mirrored::cuda
