// The ordered GPU densify (csrc/cuda/scatter_rows.cu) on a real GPU, against
// the host loop (host/fused_update.h scatter_add_rows) bit for bit: float32 and
// float64, with and without squares, adding into `out` and overwriting it,
// rows named once, a few times and a hundred thousand times, beyond one grid;
// and three runs of the same slices giving the same bits (where atomics would
// not). Without a GPU it reports itself skipped
// (exit 77): the simulated runtime's test (csrc/cuda/sim/scatter_rows_test.cc)
// runs the same phases.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "check.h"
#include "cuda/device.h"
#include "cuda/scatter_rows.h"
#include "host/fused_update.h"

using namespace mirrored;

namespace {

constexpr int kSkipped = 77;

#define CUDA_OK(call) CHECK((call) == cudaSuccess)

struct Case {
  std::size_t slices, width, rows, distinct;  // distinct: rows the slices name (0: any)
  bool squares, accumulate;
};

const std::vector<Case> kCases = {
    {0, 8, 10, 0, true, true},          {1, 1, 1, 0, false, true},
    {1000, 64, 100000, 0, true, false}, {65536, 64, 100000, 64, true, true},
    {300000, 3, 1000, 3, true, false},  {4099, 33, 17, 0, false, true},  {200000, 16, 50, 1, true, true},
};

template <typename T>
T* upload(const std::vector<T>& host) {
  void* p = nullptr;
  CUDA_OK(cudaMalloc(&p, host.size() * sizeof(T) + 1));
  if (!host.empty()) CUDA_OK(cudaMemcpy(p, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  return static_cast<T*>(p);
}

template <typename T>
std::vector<T> download(const T* device, std::size_t n) {
  std::vector<T> host(n);
  if (n) CUDA_OK(cudaMemcpy(host.data(), device, n * sizeof(T), cudaMemcpyDeviceToHost));
  return host;
}

template <typename T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

template <typename T>
void check_case(const Case& c, DType dtype) {
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> pick(-50, 50), scale(0, 3);
  const double magnitudes[] = {1.0, 1e-3, 3e4, 1e7};  // mixed: a sum's bits depend on its order
  std::vector<T> values(c.slices * c.width), out(c.rows * c.width), squares(c.rows * c.width);
  for (auto& v : values) v = static_cast<T>(pick(rng) * magnitudes[scale(rng)] / 7);
  for (auto& o : out) o = static_cast<T>(pick(rng));
  for (auto& q : squares) q = static_cast<T>(pick(rng) + 60);
  std::uniform_int_distribution<std::int64_t> row(0, static_cast<std::int64_t>(c.distinct ? c.distinct : c.rows) - 1);
  std::vector<std::int64_t> indices(c.slices);
  for (auto& i : indices) i = row(rng);
  if (c.slices > 2) indices[1] = -1, indices[2] = static_cast<std::int64_t>(c.rows);  // dropped on a GPU
  std::vector<T> want = c.accumulate ? out : std::vector<T>(out.size(), T(0));
  std::vector<T> want_squares = c.accumulate ? squares : std::vector<T>(out.size(), T(0));
  std::vector<std::int64_t> kept;
  std::vector<T> kept_values;
  for (std::size_t i = 0; i < c.slices; ++i)
    if (indices[i] >= 0 && indices[i] < static_cast<std::int64_t>(c.rows)) {
      kept.push_back(indices[i]);
      kept_values.insert(kept_values.end(), values.begin() + i * c.width, values.begin() + (i + 1) * c.width);
    }
  CHECK(host::scatter_add_rows<T>(want.data(), c.squares ? want_squares.data() : nullptr, c.rows, c.width,
                                  kept_values.data(), kept.data(), kept.size()) == -1);
  T* d_values = upload(values);
  std::int64_t* d_indices = upload(indices);
  void* workspace = nullptr;
  CUDA_OK(cudaMalloc(&workspace, cuda::scatter_rows_workspace_bytes(c.slices, c.rows)));
  int sms = 1;
  CUDA_OK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  for (int run = 0; run < 3; ++run) {  // the same bits every time
    T* d_out = upload(out);
    T* d_squares = upload(squares);
    cuda::ScatterRows a;
    a.dtype = dtype;
    a.values = d_values, a.indices = d_indices, a.wide_indices = true;
    a.slices = c.slices, a.width = c.width, a.rows = c.rows;
    a.out = d_out, a.squares = c.squares ? d_squares : nullptr, a.accumulate = c.accumulate;
    cuda::scatter_add_rows(a, workspace, sms, nullptr);
    CUDA_OK(cudaDeviceSynchronize());
    CHECK(same_bits(download(d_out, out.size()), want));
    if (c.squares) CHECK(same_bits(download(d_squares, out.size()), want_squares));
    CUDA_OK(cudaFree(d_out));
    CUDA_OK(cudaFree(d_squares));
  }
  CUDA_OK(cudaFree(d_values));
  CUDA_OK(cudaFree(d_indices));
  CUDA_OK(cudaFree(workspace));
}

TEST(gpu_densify_equals_the_host_loop_bit_for_bit_every_run) {
  for (const Case& c : kCases) {
    check_case<float>(c, DType::kFloat32);
    check_case<double>(c, DType::kFloat64);
  }
}

}  // namespace

int main() {
  if (cuda::device_count() == 0) {
    std::printf("skipped: no GPU\n");
    return kSkipped;
  }
  return check::run_all();
}
