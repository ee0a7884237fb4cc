// The fused optimizer update on GPU memory: one launch per device and dtype
// applies weight decay and an optimizer's rule to every variable and slot of a
// table (core/optimizer_rules.h: FusedEntry, the multi-tensor-apply way), with
// the host kernel's element math, so the bits are the host's. Lamb, whose
// trust ratio needs each variable's norms, takes kLambLaunches instead.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <optional>
#include <vector>

#include "core/dtype.h"
#include "core/optimizer_rules.h"
#include "cuda/uploaded_table.h"

namespace mirrored::cuda {

// A loss-scaled step's gate (md.mixed_precision.LossScaleOptimizer on a GPU),
// read by the kernel when it runs: `nonfinite`, an int32 that count_nonfinite
// sets when a gradient is inf or nan, skips every write of the update (the
// weights and slots keep their bits, as Keras' skipped step); `scale`, the
// float32 loss scale, divides each gradient first. Null: an ordinary step.
struct LossScaleGate {
  const int* nonfinite = nullptr;
  const float* scale = nullptr;
};

// Lamb's scratch (core/lamb.h, rules::LambSums' layout): `data`, in memory of
// the launch's device, holds rules::lamb_scratch_count(entries, lanes, groups)
// T's, where `lanes` and `groups` are the table's in all (sum_lanes and
// sum_groups of each entry's count, added up) and `count` its elements in all.
struct LambScratch {
  void* data = nullptr;
  std::size_t lanes = 0, groups = 0, count = 0;
};

// Launches of one Lamb update (lanes, groups, ratios, apply: core/lamb.h says why four).
constexpr int kLambLaunches = 4;

// `table`: `entries` FusedEntry<T> in memory of `stream`'s device (uploaded on
// `stream` before), T from `dtype` (float32 or float64); `max_count`: the
// largest entry's count (it sizes the grid); `scalars`: a host FusedScalars<T>,
// passed by value. `sms` bounds the grid. One launch; Lamb's kLambLaunches
// over `lamb` (which it needs).
void fused_update(rules::Rule rule, DType dtype, const void* table, int entries, std::size_t max_count,
                  const void* scalars, int sms, cudaStream_t stream, LossScaleGate gate = {}, LambScratch lamb = {});

// The same, with the scalars read by the kernel from device memory when it
// runs (a captured step's, refreshed before each replay): `device_scalars`
// holds `coefficients` T's, then weight decay's rate and lr (rules.py's order).
void fused_update_from_device(rules::Rule rule, DType dtype, const void* table, int entries, std::size_t max_count,
                              const void* device_scalars, int coefficients, int sms, cudaStream_t stream,
                              LossScaleGate gate = {}, LambScratch lamb = {});

// Sets `*nonfinite` (an int32 in device memory) to 1 when one of the `count`
// elements of `data` (float32 or float64, e.g. a packed, all-reduced gradient
// buffer) is inf or nan; leaves it otherwise. One launch.
void count_nonfinite(DType dtype, const void* data, std::size_t count, int* nonfinite, int sms, cudaStream_t stream);

// rules::loss_scale_step on device memory, one thread: the step after the
// gated updates of a device (`scale` float32, the others int64).
void loss_scale_step(int* nonfinite, float* scale, long long* counter, long long* iterations, long long growth_steps,
                     bool dynamic, cudaStream_t stream);

// rules::select_step_row on device memory, one thread on `stream`: the row
// of step `*iterations` (int64) of `rows` into `out` (the scalars a
// fused_update_from_device then reads), and `status` written. `rows`: a host
// rules::StepRows<T>, T from `dtype`, passed by value (the launch copies it).
void select_step_row(DType dtype, const long long* iterations, const void* rows, void* out, rules::StepStatus* status,
                     cudaStream_t stream);

// The same with the rows in device memory (a captured step's, uploaded before
// each replay).
void select_step_row_from_device(DType dtype, const long long* iterations, const void* device_rows, void* out,
                                 rules::StepStatus* status, cudaStream_t stream);

// One variable of a FusedUpdateTable: its buffer and its slots' (the rule's
// order) on the table's device, `count` elements each.
struct FusedVariable {
  void* weight;
  void* slots[rules::kMaxSlots];
  std::size_t count;
  bool decay;
  rules::FactoredShape shape{};  // a factored table's (Adafactor's)
};

// The device-side table of one device's variables of one dtype, built once
// per variable set: every step is then a single launch (Lamb: kLambLaunches,
// over a scratch its first update allocates; Adafactor: one per phase). The
// gradients come packed, the variables' back to back in table order; the
// table holds their pointers, so it is uploaded again (on the launch's
// stream, ordered after the last launch that read it) only when the packed
// buffer moves.
class FusedUpdateTable {
 public:
  // `factored`: the variables carry their shapes and the table Adafactor's scratch (cuda/fused_adafactor.h,
  // made here once), so that it takes Rule::kAdafactor, in rules::kAdafactorPhases launches a step.
  FusedUpdateTable(int device, DType dtype, const std::vector<FusedVariable>& variables, bool factored = false);
  ~FusedUpdateTable();
  FusedUpdateTable(const FusedUpdateTable&) = delete;
  FusedUpdateTable& operator=(const FusedUpdateTable&) = delete;

  int device() const { return device_; }
  std::size_t total_count() const { return total_count_; }

  // The rule (coefficients: rules.py's for it, weight decay's factors) on
  // every variable, with `grads` the packed gradients in device memory; one
  // launch on `stream`, which must be of the table's device (current).
  // `squares` (optional): packed like `grads`, what a squaring rule reads in
  // place of grad * grad (rules::FusedEntry::squares); not with a gate's scale.
  void apply(rules::Rule rule, const void* grads, const std::vector<double>& coefficients, double weight_decay,
             double lr, cudaStream_t stream, LossScaleGate gate = {}, const void* squares = nullptr);

  // The same with the scalars read from `device_scalars` when the kernel runs
  // (fused_update_from_device): a step whose scalars the device selects.
  void apply_from_device(rules::Rule rule, const void* grads, const void* device_scalars, int coefficients,
                         cudaStream_t stream, LossScaleGate gate = {}, const void* squares = nullptr);

  // The same for a step being captured into a CUDA graph on `stream`: the
  // table's upload (from its pinned host copy, which a capture's table never
  // rewrites) and the launch are recorded, the scalars read from
  // `device_scalars` (fused_update_from_device) at each replay. No events: a
  // table captured once serves only that capture's graph.
  void apply_captured(rules::Rule rule, const void* grads, const void* device_scalars, int coefficients,
                      cudaStream_t stream, LossScaleGate gate = {}, const void* squares = nullptr);

  // count_nonfinite over packed gradients `grads` (total_count elements of
  // the table's dtype): a loss-scaled step's check, before its gated apply.
  void check_finite(const void* grads, int* nonfinite, cudaStream_t stream) const;

 private:
  template <typename T>
  void point_grads_at(const void* grads, const void* squares);
  void point_and_upload(const void* grads, const void* squares, cudaStream_t stream, LossScaleGate gate);
  bool nothing_to_do(rules::Rule rule) const;
  // The rule's launches with host `scalars` (a FusedScalars) or `device_scalars`, the other null.
  void launch_rule(rules::Rule rule, const void* scalars, const void* device_scalars, int coefficients,
                   cudaStream_t stream, LossScaleGate gate);
  template <typename T>
  void launch(rules::Rule rule, const std::vector<double>& coefficients, double weight_decay, double lr,
              cudaStream_t stream, LossScaleGate gate);
  void* scratch(std::size_t bytes, cudaStream_t stream);

  int device_;
  DType dtype_;
  int entries_;
  int sms_ = 1;
  std::size_t entry_bytes_;
  std::size_t max_count_ = 0;
  std::size_t total_count_ = 0;
  std::vector<std::size_t> offsets_;  // each variable's first element in the packed gradients
  std::size_t adafactor_work_ = 0;  // rules::adafactor_work's largest over the variables
  std::size_t adafactor_scratch_ = 0;  // T's of Adafactor's scratch (a factored table's; 0: not factored)
  std::size_t lanes_ = 0, groups_ = 0;  // of every variable's sum (core/variable_sums.h), in all: Lamb's scratch
  // The scratch of a rule that sums over whole variables (Lamb's LambScratch::data, Adafactor's), made by
  // its first update (scratch()); freed after table_ (whose destructor waits for the last launch), so
  // declared before it.
  struct DeviceMemory {
    int device = -1;
    void* data = nullptr;
    std::size_t bytes = 0;
    ~DeviceMemory();
  } scratch_;
  cudaStream_t scratch_stream_ = nullptr;  // the stream of the last update that used the scratch
  std::optional<UploadedTable> table_;  // entries_ FusedEntry<dtype_>; made once the device is current
  const void* grads_ = nullptr;         // the packed gradients the device table points at
  const void* squares_ = nullptr;       // and their squares (null: the kernel squares the gradients)
  bool captured_ = false;               // apply_captured was called: the table belongs to a graph
};

}  // namespace mirrored::cuda
