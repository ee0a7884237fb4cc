#include "cuda/device_batch.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "core/packer.h"
#include "cuda/check.h"
#include "cuda/device.h"
#include "cuda/stream_scope.h"

namespace mirrored::cuda {
namespace {

constexpr std::size_t round16(std::size_t x) { return (x + 15) / 16 * 16; }

bool capturing(cudaStream_t s) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  MIRRORED_CUDA_CHECK(cudaStreamIsCapturing(s, &status));
  return status != cudaStreamCaptureStatusNone;
}

// A multi-tensor pack placed in the fusion buffers: its byte offset there,
// each entry's offset (16-byte aligned, so the copies move whole vectors),
// and the elements its all-reduce covers (the padding between entries is
// reduced too, and never read).
struct Placed {
  const Pack* pack;
  std::size_t offset;
  std::vector<std::size_t> entry_offset;
  std::size_t count;
};

}  // namespace

DeviceBatch::DeviceBatch(std::vector<int> devices) : ranks_(devices.size()) {
  for (std::size_t r = 0; r < devices.size(); ++r) ranks_[r].device = devices[r];
}

DeviceBatch::~DeviceBatch() {
  DeviceGuard guard;
  for (Rank& k : ranks_) {
    if (set_device(k.device) != cudaSuccess) continue;
    if (k.pending) cudaEventSynchronize(k.used);  // the last batch's kernels read the table and buffers
    if (k.fusion) cudaFree(k.fusion);
    if (k.device_table) cudaFree(k.device_table);
    if (k.host_table) cudaFreeHost(k.host_table);
    if (k.uploaded) cudaEventDestroy(k.uploaded);
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
  MIRRORED_CUDA_CHECK(cudaMalloc(&k.fusion, bytes));
  k.fusion_bytes = bytes;
  return k.fusion;
}

void DeviceBatch::reserve_table(int r, std::size_t entries) {
  Rank& k = ranks_[r];
  MIRRORED_CUDA_CHECK(set_device(k.device));
  if (!k.uploaded) {
    MIRRORED_CUDA_CHECK(cudaDeviceGetAttribute(&k.sms, cudaDevAttrMultiProcessorCount, k.device));
    MIRRORED_CUDA_CHECK(cudaEventCreateWithFlags(&k.uploaded, cudaEventDisableTiming));
    MIRRORED_CUDA_CHECK(cudaEventCreateWithFlags(&k.used, cudaEventDisableTiming));
  }
  if (k.table_entries >= entries) return;
  if (k.pending) MIRRORED_CUDA_CHECK(cudaEventSynchronize(k.used));  // nothing reads the old tables any more
  if (k.device_table) MIRRORED_CUDA_CHECK(cudaFree(k.device_table));
  if (k.host_table) MIRRORED_CUDA_CHECK(cudaFreeHost(k.host_table));
  k.device_table = nullptr, k.host_table = nullptr, k.table_entries = 0, k.pending = false;
  // Room to grow: a model's batch sizes repeat, so this happens once or twice.
  const std::size_t want = std::max<std::size_t>(64, entries + entries / 2);
  MIRRORED_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&k.host_table), want * sizeof(CopyEntry)));
  MIRRORED_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&k.device_table), want * sizeof(CopyEntry)));
  k.table_entries = want;
}

void DeviceBatch::all_reduce(Communicator& comm, const std::vector<std::vector<const void*>>& in,
                             const std::vector<std::vector<void*>>& out, const std::vector<std::size_t>& counts,
                             const std::vector<DType>& dtypes, ReduceOp op, Algorithm algorithm,
                             std::size_t bytes_per_pack, int num_packs) {
  const int n = static_cast<int>(ranks_.size());
  if (static_cast<int>(in.size()) != n || static_cast<int>(out.size()) != n)
    throw std::invalid_argument("batch_all_reduce: got " + std::to_string(in.size()) + " input and " +
                                std::to_string(out.size()) + " output lists for " + std::to_string(n) + " ranks");
  for (int r = 0; r < n; ++r)
    if (in[r].size() != counts.size() || out[r].size() != counts.size())
      throw std::invalid_argument("batch_all_reduce: rank " + std::to_string(r) + " has " +
                                  std::to_string(in[r].size()) + " tensors, expected " +
                                  std::to_string(counts.size()) + " like every rank");
  std::vector<std::size_t> bytes(counts.size());
  for (std::size_t t = 0; t < counts.size(); ++t) bytes[t] = counts[t] * dtype_size(dtypes[t]);
  const std::vector<Pack> packs = plan_packs(bytes, dtypes, bytes_per_pack, num_packs);

  std::lock_guard<std::mutex> lock(mu_);
  DeviceGuard guard;
  std::vector<const void*> pin(n);
  std::vector<void*> pout(n);

  // Lay the multi-tensor packs out back to back in the fusion buffers.
  std::vector<Placed> placed;
  std::size_t total = 0, live_entries = 0;
  for (const Pack& pack : packs) {
    if (pack.bytes == 0 || pack.entries.size() == 1) continue;
    Placed p{&pack, total, {}, 0};
    std::size_t cur = 0;
    for (const PackEntry& e : pack.entries) {
      p.entry_offset.push_back(cur);
      cur = round16(cur + e.bytes);
      live_entries += e.bytes > 0;
    }
    p.count = cur / dtype_size(pack.dtype);
    total += cur;
    placed.push_back(std::move(p));
  }

  struct Lane {
    int leader;
    cudaStream_t stream;
    std::size_t pack_entries = 0, pack_slots = 0, unpack_entries = 0, unpack_slots = 0;
    CopyEntry* table = nullptr;  // on the device
    bool captured = false;       // the stream is being captured into a CUDA graph
  };
  std::vector<Lane> lanes;
  if (!placed.empty()) {
    // Ranks on one GPU reduce the packs in place; across GPUs into a second
    // half of the buffer, so that a one-pass kernel on one GPU never
    // overwrites a pack another GPU is still reading (CudaRing runs its
    // one-shot kernel only out of place).
    bool one_gpu = true;
    for (int r = 1; r < n; ++r) one_gpu = one_gpu && ranks_[r].device == ranks_[0].device;
    const std::size_t result_at = one_gpu ? 0 : total;
    std::vector<char*> f(n);
    for (int r = 0; r < n; ++r) f[r] = static_cast<char*>(fusion(r, total + result_at));
    // Lanes: the ranks of one GPU that queue on one stream share a table and launches.
    std::vector<int> lane_of(n);
    for (int r = 0; r < n; ++r) {
      const cudaStream_t s = current_stream(r, n);
      lane_of[r] = -1;
      for (std::size_t l = 0; l < lanes.size(); ++l)
        if (lanes[l].stream == s && ranks_[lanes[l].leader].device == ranks_[r].device) lane_of[r] = int(l);
      if (lane_of[r] < 0) lane_of[r] = int(lanes.size()), lanes.push_back(Lane{r, s});
    }
    for (std::size_t l = 0; l < lanes.size(); ++l) {
      Lane& lane = lanes[l];
      Rank& k = ranks_[lane.leader];
      std::size_t members = 0;
      for (int r = 0; r < n; ++r) members += lane_of[r] == int(l);
      // Under stream capture the graph replays this upload and these copies long after the
      // call: it gets tables of its own, never rewritten (they live as long as this object),
      // and nothing waits on the host. Otherwise the shared tables, once the last batch is
      // done with them.
      lane.captured = capturing(lane.stream);
      CopyEntry* host = nullptr;
      if (lane.captured) {
        reserve_table(lane.leader, 0);
        CapturedTable t;
        const std::size_t want = 2 * live_entries * members;
        MIRRORED_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&t.host), want * sizeof(CopyEntry)));
        MIRRORED_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&t.device), want * sizeof(CopyEntry)));
        captured_.push_back(t);
        host = t.host, lane.table = t.device;
      } else {
        reserve_table(lane.leader, 2 * live_entries * members);
        if (k.pending) MIRRORED_CUDA_CHECK(cudaEventSynchronize(k.uploaded));  // the last upload has read host_table
        host = k.host_table, lane.table = k.device_table;
      }
      // The pack entries, then the unpack entries: two tables of one upload.
      auto fill = [&](bool pack, std::size_t at, std::size_t& entries, std::size_t& slots) {
        for (int r = 0; r < n; ++r) {
          if (lane_of[r] != int(l)) continue;
          for (const Placed& p : placed)
            for (std::size_t i = 0; i < p.pack->entries.size(); ++i) {
              const PackEntry& e = p.pack->entries[i];
              if (e.bytes == 0) continue;
              char* slot = f[r] + (pack ? 0 : result_at) + p.offset + p.entry_offset[i];
              CopyEntry& c = host[at + entries++];
              c = pack ? CopyEntry{in[r][e.tensor], slot, e.bytes, slots}
                       : CopyEntry{slot, out[r][e.tensor], e.bytes, slots};
              slots += (e.bytes + 15) / 16;
            }
        }
      };
      fill(true, 0, lane.pack_entries, lane.pack_slots);
      fill(false, lane.pack_entries, lane.unpack_entries, lane.unpack_slots);
      MIRRORED_CUDA_CHECK(set_device(k.device));
      if (!lane.captured && k.pending)
        MIRRORED_CUDA_CHECK(cudaStreamWaitEvent(lane.stream, k.used, 0));  // the last batch read the table
      MIRRORED_CUDA_CHECK(cudaMemcpyAsync(lane.table, host, (lane.pack_entries + lane.unpack_entries) * sizeof(CopyEntry),
                                          cudaMemcpyHostToDevice, lane.stream));
      if (!lane.captured) MIRRORED_CUDA_CHECK(cudaEventRecord(k.uploaded, lane.stream));
      multi_copy(lane.table, static_cast<int>(lane.pack_entries), lane.pack_slots, k.sms, lane.stream);
    }
    // Each pack is reduced in place, ordered after the packing on the same streams.
    for (const Placed& p : placed) {
      for (int r = 0; r < n; ++r) pin[r] = f[r] + p.offset, pout[r] = f[r] + result_at + p.offset;
      comm.all_reduce(n, pin.data(), pout.data(), p.count, p.pack->dtype, op, algorithm);
    }
    for (Lane& lane : lanes) {
      Rank& k = ranks_[lane.leader];
      MIRRORED_CUDA_CHECK(set_device(k.device));
      multi_copy(lane.table + lane.pack_entries, static_cast<int>(lane.unpack_entries), lane.unpack_slots, k.sms,
                 lane.stream);
      if (lane.captured) continue;
      MIRRORED_CUDA_CHECK(cudaEventRecord(k.used, lane.stream));
      k.pending = true;
    }
  }
  // A tensor alone in its pack is reduced where it lies.
  for (const Pack& pack : packs) {
    if (pack.bytes == 0 || pack.entries.size() != 1) continue;
    const std::size_t t = pack.entries[0].tensor;
    for (int r = 0; r < n; ++r) pin[r] = in[r][t], pout[r] = out[r][t];
    comm.all_reduce(n, pin.data(), pout.data(), pack.bytes / dtype_size(pack.dtype), pack.dtype, op, algorithm);
  }
}

}  // namespace mirrored::cuda
