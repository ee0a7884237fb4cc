#include "nccl/nccl_communicator.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>

#include "cuda/check.h"
#include "cuda/device.h"
#include "cuda/stream_scope.h"

namespace mirrored::nccl {
namespace {

// Our dtype codes -> ncclDataType_t, in csrc/core/dtype.h's order.
constexpr int kDataTypes[kNumDTypes] = {kFloat16, kBfloat16, kFloat32, kFloat64, kInt8, kUint8, kInt32, kInt64};

int nccl_dtype(DType t) {
  dtype_size(t);  // validates the code
  return kDataTypes[static_cast<int>(t)];
}

void check_devices(const std::vector<int>& devices) {
  if (devices.empty()) throw std::invalid_argument("devices: NCCL needs at least one GPU");
  for (int d : devices) cuda::check_ordinal(d, "devices");
  std::vector<int> sorted(devices);
  std::sort(sorted.begin(), sorted.end());
  if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end())
    throw std::invalid_argument(
        "devices: NCCL cannot place two ranks on one GPU (logical GPUs); use algorithm='ring' for them");
}

}  // namespace

NcclCommunicator::NcclCommunicator(std::vector<int> devices) : lib_(loaded()), devices_(std::move(devices)) {
  check_devices(devices_);
  cuda::DeviceGuard guard;
  comms_.resize(devices_.size(), nullptr);
  MIRRORED_NCCL_CHECK(lib_, CommInitAll(comms_.data(), size(), devices_.data()), nullptr);
  nranks_ = size();
}

NcclCommunicator::NcclCommunicator(const std::string& id, int first_rank, int nranks, std::vector<int> devices)
    : lib_(loaded()), devices_(std::move(devices)) {
  check_devices(devices_);
  if (id.size() != sizeof(UniqueId))
    throw std::invalid_argument("unique_id: expected " + std::to_string(sizeof(UniqueId)) + " bytes from nccl_unique_id(), got " +
                                std::to_string(id.size()));
  if (nranks < 1 || first_rank < 0 || first_rank + size() > nranks)
    throw std::invalid_argument("rank=" + std::to_string(first_rank) + " with " + std::to_string(size()) +
                                " local devices does not fit nranks=" + std::to_string(nranks));
  UniqueId uid;
  std::memcpy(uid.internal, id.data(), sizeof(uid));
  cuda::DeviceGuard guard;
  comms_.resize(devices_.size(), nullptr);
  // Several ranks from one thread: their inits must be one group, or the
  // first would wait forever for the others.
  MIRRORED_NCCL_CHECK(lib_, GroupStart(), nullptr);
  for (int i = 0; i < size(); ++i) {
    MIRRORED_CUDA_CHECK(cuda::set_device(devices_[i]));
    const Result r = lib_.api.CommInitRank(&comms_[i], nranks, uid, first_rank + i);
    if (r != kSuccess) {
      lib_.api.GroupEnd();
      check(lib_, r, "ncclCommInitRank", nullptr);
    }
  }
  MIRRORED_NCCL_CHECK(lib_, GroupEnd(), nullptr);
  nranks_ = nranks;
}

NcclCommunicator::~NcclCommunicator() {
  for (Comm c : comms_)
    if (c) lib_.api.CommDestroy(c);
}

void NcclCommunicator::begin(int n, const char* what) const {
  check_buffers(n, size(), what, "local NCCL rank");
}

int NcclCommunicator::nccl_op(ReduceOp op) const {
  switch (op) {
    case ReduceOp::kSum: return kSum;
    case ReduceOp::kProd: return kProd;
    case ReduceOp::kMin: return kMin;
    case ReduceOp::kMax: return kMax;
    case ReduceOp::kMean:
      if (lib_.version < kAvgSince)
        throw std::runtime_error("op='mean' needs NCCL >= 2.10 (loaded " + std::to_string(lib_.version) + " from " +
                                 lib_.path + "); upgrade with `pip install -U nvidia-nccl-cu13`");
      return kAvg;
  }
  throw std::invalid_argument("unknown reduce op code " + std::to_string(static_cast<int>(op)));
}

template <typename F>
void NcclCommunicator::group(int n, F f) {
  std::lock_guard<std::mutex> lock(mu_);
  cuda::DeviceGuard guard;
  MIRRORED_NCCL_CHECK(lib_, GroupStart(), nullptr);
  try {
    for (int r = 0; r < n; ++r) {
      MIRRORED_CUDA_CHECK(cuda::set_device(devices_[r]));  // a null stream means this device's
      f(r, cuda::current_stream(r, n));
    }
  } catch (...) {
    lib_.api.GroupEnd();
    throw;
  }
  MIRRORED_NCCL_CHECK(lib_, GroupEnd(), comms_[0]);
}

void NcclCommunicator::all_reduce(int n, const void* const* in, void* const* out, std::size_t count, DType dtype,
                                  ReduceOp op, Algorithm) {
  begin(n, "all_reduce");
  const int dt = nccl_dtype(dtype), o = nccl_op(op);
  if (count == 0) return;
  group(n, [&](int r, cudaStream_t s) {
    MIRRORED_NCCL_CHECK(lib_, AllReduce(in[r], out[r], count, dt, o, comms_[r], s), comms_[r]);
  });
}

void NcclCommunicator::broadcast(int n, const void* const* in, void* const* out, std::size_t count, DType dtype,
                                 int root) {
  begin(n, "broadcast");
  if (root < 0 || root >= nranks_)
    throw std::invalid_argument("root=" + std::to_string(root) + " is not a rank; use 0.." + std::to_string(nranks_ - 1));
  const int dt = nccl_dtype(dtype);
  if (count == 0) return;
  group(n, [&](int r, cudaStream_t s) {
    MIRRORED_NCCL_CHECK(lib_, Broadcast(in[r], out[r], count, dt, root, comms_[r], s), comms_[r]);
  });
}

void NcclCommunicator::reduce(int n, const void* const* in, void* const* out, std::size_t count, DType dtype,
                              ReduceOp op, int root) {
  begin(n, "reduce");
  if (root < 0 || root >= nranks_)
    throw std::invalid_argument("root=" + std::to_string(root) + " is not a rank; use 0.." + std::to_string(nranks_ - 1));
  const int dt = nccl_dtype(dtype), o = nccl_op(op);
  if (count == 0) return;
  group(n, [&](int r, cudaStream_t s) {
    MIRRORED_NCCL_CHECK(lib_, Reduce(in[r], out[r], count, dt, o, root, comms_[r], s), comms_[r]);
  });
}

void NcclCommunicator::all_gather(int n, const void* const* in, void* const* out, const std::size_t* row_bytes,
                                  std::size_t outer) {
  begin(n, "all_gather");
  for (int j = 1; j < n; ++j)
    if (row_bytes[j] != row_bytes[0] || outer != 1)
      throw std::invalid_argument(
          "all_gather: NCCL gathers equal-sized buffers along axis 0 only; use the CUDA ring for other shapes");
  if (row_bytes[0] == 0) return;
  group(n, [&](int r, cudaStream_t s) {
    MIRRORED_NCCL_CHECK(lib_, AllGather(in[r], out[r], row_bytes[0], kUint8, comms_[r], s), comms_[r]);
  });
}

std::string unique_id() {
  const Library& lib = loaded();
  UniqueId id;
  MIRRORED_NCCL_CHECK(lib, GetUniqueId(&id), nullptr);
  return std::string(id.internal, sizeof(id));
}

}  // namespace mirrored::nccl
