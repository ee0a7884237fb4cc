// A dynamic loss scale's step count, selected on the simulated runtime
// (cuda/fused_update.h select_step_row, cuda/step_readback.h): the host sends
// the rows of every step between a count that arrived and its count of
// applies, the device picks its own count's row (by value and from device
// memory, alternately) while rules::loss_scale_step skips every fifth step,
// and the counts come back without a wait until the host is kRows applies
// ahead; a count outside the rows gives NaN and the flag. On two devices from
// two threads at once (for ThreadSanitizer), in random kernel orders. Exit
// status 0 when all is right.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <thread>

#include "cuda/fused_update.h"
#include "cuda/sim/expect.h"
#include "cuda/sim/sim_runtime.h"
#include "cuda/step_readback.h"

using namespace mirrored;
using namespace mirrored::cuda;

namespace {

using sim_check::failures;

constexpr int kWidth = 3, kRows = 8, kSteps = 60;

double scalar(long long step, int j) { return static_cast<double>(step * 10 + j) + 0.25; }

// Device `device`'s run: the number of rows that were not the device count's (0 when all is right).
int run(int device, long long* waits_from_the_cap) {
  cudaSetDevice(device);
  cudaStream_t s;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  auto* iterations = static_cast<long long*>(sim::allocate(2 * sizeof(long long), device));
  auto* counter = iterations + 1;
  auto* status = static_cast<rules::StepStatus*>(sim::allocate(sizeof(rules::StepStatus), device));
  auto* out = static_cast<double*>(sim::allocate(kWidth * sizeof(double), device));
  auto* device_rows = static_cast<rules::StepRows<double>*>(sim::allocate(sizeof(rules::StepRows<double>), device));
  auto* nonfinite = static_cast<int*>(sim::allocate(sizeof(int), device));
  auto* scale = static_cast<float*>(sim::allocate(sizeof(float), device));
  *iterations = 0, *counter = 0, *nonfinite = 0, *scale = 1024.0f;
  *status = {0, 0};
  auto wrong = std::make_shared<int>(0);
  StepReadback readback(device, kRows);
  long long lower = 0, lower_at = 0;
  const auto take = [&](const std::vector<StepReadback::Reading>& readings) {
    for (const auto& r : readings)
      if (r.tag > lower_at) lower = r.status.step, lower_at = r.tag;
  };
  for (long long apply = 0; apply < kSteps; ++apply) {
    take(readback.arrived());
    if (apply - lower_at >= kRows) {  // kRows applies ahead: wait for the copy of half that ago
      ++*waits_from_the_cap;
      while (apply - lower_at >= kRows / 2 && readback.in_flight() > 0) take(readback.wait(readback.in_flight()));
    }
    if (apply - lower_at >= kRows) return -1;
    auto rows = std::make_shared<rules::StepRows<double>>();
    rows->lower = lower, rows->rows = static_cast<int>(apply - lower_at + 1), rows->width = kWidth;
    for (int r = 0; r < rows->rows; ++r)
      for (int j = 0; j < kWidth; ++j) rows->values[r * kWidth + j] = scalar(lower + r, j);
    if (apply % 2) {
      select_step_row(DType::kFloat64, iterations, rows.get(), out, status, s);
    } else {
      sim::enqueue(s, [=] { *device_rows = *rows; });  // the upload
      select_step_row_from_device(DType::kFloat64, iterations, device_rows, out, status, s);
    }
    sim::enqueue(s, [=] {  // what the update would read: the row of the count the device has now
      for (int j = 0; j < kWidth; ++j) *wrong += out[j] != scalar(*iterations, j);
      *nonfinite = apply % 5 == 3;  // (the step's check)
    });
    readback.record(status, apply, s);
    loss_scale_step(nonfinite, scale, counter, iterations, 2, true, s);
  }
  cudaStreamSynchronize(s);
  const long long skipped = kSteps / 5 + (kSteps % 5 > 3);
  if (*iterations != kSteps - skipped || status->outside) return -1;
  // A count outside the rows (after a skip the host did not see, say): NaN scalars and the flag, no quiet row.
  rules::StepRows<double> beyond{};
  beyond.lower = *iterations + 1, beyond.rows = 1, beyond.width = kWidth;
  select_step_row(DType::kFloat64, iterations, &beyond, out, status, s);
  cudaStreamSynchronize(s);
  if (!std::isnan(out[0]) || !status->outside || status->step != *iterations) return -1;
  cudaStreamDestroy(s);
  return *wrong;
}

void check(unsigned seed) {
  sim::reset(2, {}, seed);
  int wrong[2] = {-1, -1};
  long long waits[2] = {0, 0};
  std::thread other([&] { wrong[1] = run(1, &waits[1]); });
  wrong[0] = run(0, &waits[0]);
  other.join();
  EXPECT(wrong[0] == 0 && wrong[1] == 0, "seed %u: device 0 %d wrong, device 1 %d wrong (-1: a wrong state)", seed,
         wrong[0], wrong[1]);
  // Only the other thread's syncs run kernels here, so some copies arrive without a wait; none would after
  // kRows applies: the host waited at most once per kRows / 2 applies after the first kRows.
  EXPECT(waits[0] <= 1 + (kSteps - kRows) / (kRows / 2) && waits[1] <= 1 + (kSteps - kRows) / (kRows / 2),
         "seed %u: %lld and %lld waits at the cap", seed, waits[0], waits[1]);
}

}  // namespace

int main() {
  for (unsigned seed = 0; seed < 8; ++seed) check(seed);
  std::printf("step rows selected on the simulated runtime: %d failures\n", failures);
  return failures ? 1 : 0;
}
