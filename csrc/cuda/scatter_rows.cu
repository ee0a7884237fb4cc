// scatter_add_rows' kernels: thin __global__ wrappers over the phases of
// scatter_rows_body.cuh, which the simulated runtime runs the same way.
// Compiled without FMA contraction (-fmad=false), as fused_update.cu: a
// square is rounded before it is added, as on the host.
#include "cuda/check.h"
#include "cuda/fused.h"
#include "cuda/scatter_rows.h"
#include "cuda/scatter_rows_body.cuh"

namespace mirrored::cuda {
namespace {

__device__ inline std::size_t thread_index() { return blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; }
__device__ inline std::size_t grid_threads() { return static_cast<std::size_t>(gridDim.x) * blockDim.x; }

template <typename T>
__global__ void __launch_bounds__(kFusedThreads) clear_kernel(ScatterRows a, ScatterWork w) {
  scatter_clear_body<T>(a, w, thread_index(), grid_threads());
}
__global__ void __launch_bounds__(kFusedThreads) count_kernel(ScatterRows a, ScatterWork w) {
  scatter_count_body(a, w, thread_index(), grid_threads());
}
__global__ void __launch_bounds__(kFusedThreads) reserve_kernel(ScatterRows a, ScatterWork w) {
  scatter_reserve_body(a, w, thread_index(), grid_threads());
}
__global__ void __launch_bounds__(kFusedThreads) fill_kernel(ScatterRows a, ScatterWork w) {
  scatter_fill_body(a, w, thread_index(), grid_threads());
}
__global__ void __launch_bounds__(kFusedThreads) rank_kernel(ScatterRows a, ScatterWork w) {
  scatter_rank_body(a, w, thread_index(), grid_threads());
}
template <typename T>
__global__ void __launch_bounds__(kFusedThreads) sum_kernel(ScatterRows a, ScatterWork w) {
  scatter_sum_body<T>(a, w, thread_index(), grid_threads());
}

template <typename T>
void launch(const ScatterRows& a, ScatterWork w, int sms, cudaStream_t stream) {
  clear_kernel<T><<<fused_blocks(scatter_clear_work(a), sms), kFusedThreads, 0, stream>>>(a, w);
  MIRRORED_CUDA_CHECK(cudaGetLastError());
  if (a.slices == 0) return;
  const unsigned per_slice = fused_blocks(a.slices, sms);
  count_kernel<<<per_slice, kFusedThreads, 0, stream>>>(a, w);
  reserve_kernel<<<per_slice, kFusedThreads, 0, stream>>>(a, w);
  fill_kernel<<<per_slice, kFusedThreads, 0, stream>>>(a, w);
  rank_kernel<<<per_slice, kFusedThreads, 0, stream>>>(a, w);
  sum_kernel<T><<<fused_blocks(a.slices * a.width, sms), kFusedThreads, 0, stream>>>(a, w);
  MIRRORED_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void scatter_add_rows(const ScatterRows& a, void* workspace, int sms, cudaStream_t stream) {
  check_scatter_rows(a);
  const ScatterWork w = scatter_work(workspace, a.slices, a.rows);
  with_scatter_type(a.dtype, [&](auto zero) { launch<decltype(zero)>(a, w, sms, stream); });
}

}  // namespace mirrored::cuda
