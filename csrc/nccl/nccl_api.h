// The few NCCL types and entry points we use, declared by us from NCCL's
// documented ABI (stable since 2.x), so the build needs no NCCL headers and
// the library is only looked for at run time.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

namespace mirrored::nccl {

using Comm = struct ncclComm*;
using Result = int;  // ncclResult_t: 0 is success
constexpr Result kSuccess = 0;
constexpr int kUniqueIdBytes = 128;
struct UniqueId {
  char internal[kUniqueIdBytes];
};

// ncclDataType_t and ncclRedOp_t values.
enum DataType : int { kInt8 = 0, kUint8 = 1, kInt32 = 2, kInt64 = 4, kFloat16 = 6, kFloat32 = 7, kFloat64 = 8, kBfloat16 = 9 };
enum RedOp : int { kSum = 0, kProd = 1, kMax = 2, kMin = 3, kAvg = 4 };

// ncclAvg exists from NCCL 2.10 (version code 21000).
constexpr int kAvgSince = 21000;

struct Api {
  Result (*GetVersion)(int*);
  const char* (*GetErrorString)(Result);
  const char* (*GetLastError)(Comm);  // optional (NCCL >= 2.13)
  Result (*GetUniqueId)(UniqueId*);
  Result (*CommInitRank)(Comm*, int nranks, UniqueId id, int rank);
  Result (*CommInitAll)(Comm*, int ndev, const int* devlist);
  Result (*CommDestroy)(Comm);
  Result (*AllReduce)(const void*, void*, std::size_t, int dtype, int op, Comm, cudaStream_t);
  Result (*Broadcast)(const void*, void*, std::size_t, int dtype, int root, Comm, cudaStream_t);
  Result (*Reduce)(const void*, void*, std::size_t, int dtype, int op, int root, Comm, cudaStream_t);
  Result (*AllGather)(const void*, void*, std::size_t, int dtype, Comm, cudaStream_t);
  Result (*GroupStart)();
  Result (*GroupEnd)();
};

}  // namespace mirrored::nccl
