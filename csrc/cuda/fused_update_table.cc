// FusedUpdateTable (fused_update.h): the table built and uploaded once, the
// packed gradients' pointers rewritten only when that buffer moves, one
// launch per step. Plain host code over the CUDA runtime: the real build and
// the simulated runtime share it.
#include <algorithm>
#include <stdexcept>
#include <string>

#include "core/lamb.h"
#include "core/variable_sums.h"
#include "cuda/check.h"
#include "cuda/device.h"
#include "cuda/fused_adafactor.h"
#include "cuda/fused_update.h"

namespace mirrored::cuda {

namespace {

std::size_t entry_bytes_of(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return sizeof(rules::FusedEntry<float>);
    case DType::kFloat64: return sizeof(rules::FusedEntry<double>);
    default:
      throw std::invalid_argument("fused_update: dtype " + std::string(dtype_name(dtype)) +
                                  ", the GPU kernel takes float32 and float64");
  }
}

template <typename T>
void fill(void* host_table, const std::vector<FusedVariable>& variables) {
  auto* table = static_cast<rules::FusedEntry<T>*>(host_table);
  for (std::size_t k = 0; k < variables.size(); ++k) {
    const FusedVariable& v = variables[k];
    rules::FusedEntry<T>& e = table[k];
    e.weight = static_cast<T*>(v.weight);
    e.grad = nullptr;  // set by the first apply
    for (int j = 0; j < rules::kMaxSlots; ++j) e.slots[j] = static_cast<T*>(v.slots[j]);
    e.count = v.count;
    e.decay = v.decay;
    e.shape = v.shape;
  }
}

}  // namespace

FusedUpdateTable::FusedUpdateTable(int device, DType dtype, const std::vector<FusedVariable>& variables,
                                   bool factored)
    : device_(device), dtype_(dtype), entries_(static_cast<int>(variables.size())),
      entry_bytes_(entry_bytes_of(dtype)) {
  check_ordinal(device, "device");
  for (const FusedVariable& v : variables) {
    offsets_.push_back(total_count_);
    total_count_ += v.count;
    max_count_ = std::max(max_count_, v.count);
    lanes_ += rules::sum_lanes(v.count);
    groups_ += rules::sum_groups(rules::sum_lanes(v.count));
  }
  DeviceGuard guard;
  MIRRORED_CUDA_CHECK(set_device(device));
  MIRRORED_CUDA_CHECK(cudaDeviceGetAttribute(&sms_, cudaDevAttrMultiProcessorCount, device));
  if (factored) {
    for (const FusedVariable& v : variables) {
      adafactor_scratch_ += rules::adafactor_scratch_count(v.count, v.shape);
      adafactor_work_ = std::max(adafactor_work_, rules::adafactor_work(v.count, v.shape));
    }
    adafactor_scratch_ = std::max<std::size_t>(adafactor_scratch_, 1);
  }
  table_.emplace(device, std::max<std::size_t>(1, variables.size()) * entry_bytes_);
  if (dtype == DType::kFloat32) {
    fill<float>(table_->host(), variables);
  } else {
    fill<double>(table_->host(), variables);
  }
}

FusedUpdateTable::~FusedUpdateTable() = default;

template <typename T>
void FusedUpdateTable::point_grads_at(const void* grads, const void* squares) {
  auto* table = static_cast<rules::FusedEntry<T>*>(table_->host());
  const T* base = static_cast<const T*>(grads);
  const T* squared = static_cast<const T*>(squares);
  for (int k = 0; k < entries_; ++k) {
    table[k].grad = base + offsets_[k];
    table[k].squares = squared != nullptr ? squared + offsets_[k] : nullptr;
  }
}

namespace {

void check_squares(const void* squares, LossScaleGate gate) {
  // The kernel would divide the gradients by the scale, not their squares by its square.
  if (squares != nullptr && gate.scale != nullptr)
    throw std::invalid_argument("fused_update: squares with a loss scale (the gate takes dense gradients only)");
}

}  // namespace

template <typename T>
void FusedUpdateTable::launch(rules::Rule rule, const std::vector<double>& coefficients, double weight_decay,
                              double lr, cudaStream_t stream, LossScaleGate gate) {
  rules::FusedScalars<T> s{};
  for (std::size_t j = 0; j < coefficients.size(); ++j) s.c[j] = static_cast<T>(coefficients[j]);
  s.weight_decay = static_cast<T>(weight_decay);
  s.lr = static_cast<T>(lr);
  launch_rule(rule, &s, nullptr, 0, stream, gate);
}

bool FusedUpdateTable::nothing_to_do(rules::Rule rule) const {
  if (rule != rules::Rule::kAdafactor) return entries_ == 0 || max_count_ == 0;
  if (adafactor_scratch_ == 0) throw std::invalid_argument("fused_update: Adafactor on a table made without the variables' shapes");
  return entries_ == 0 || adafactor_work_ == 0;
}

void FusedUpdateTable::launch_rule(rules::Rule rule, const void* scalars, const void* device_scalars,
                                   int coefficients, cudaStream_t stream, LossScaleGate gate) {
  if (rule == rules::Rule::kAdafactor) {
    fused_adafactor(dtype_, table_->device(), entries_, adafactor_work_,
                    scratch(adafactor_scratch_ * dtype_size(dtype_), stream), scalars, device_scalars,
                    coefficients, sms_, stream, gate);
    return;
  }
  LambScratch lamb{};
  if (rule == rules::Rule::kLamb)
    lamb = {scratch(rules::lamb_scratch_count(entries_, lanes_, groups_) * dtype_size(dtype_), stream), lanes_,
            groups_, total_count_};
  if (scalars != nullptr) {
    fused_update(rule, dtype_, table_->device(), entries_, max_count_, scalars, sms_, stream, gate, lamb);
  } else {
    fused_update_from_device(rule, dtype_, table_->device(), entries_, max_count_, device_scalars, coefficients, sms_,
                             stream, gate, lamb);
  }
}

FusedUpdateTable::DeviceMemory::~DeviceMemory() {
  if (data == nullptr) return;
  DeviceGuard guard;
  if (set_device(device) == cudaSuccess) cudaFree(data);
}

void* FusedUpdateTable::scratch(std::size_t bytes, cudaStream_t stream) {
  if (scratch_.data == nullptr) {  // once per table, never per step
    scratch_.data = device_malloc(bytes, "the fused update's sums");
    scratch_.device = device_;
    scratch_.bytes = bytes;
  } else if (bytes > scratch_.bytes) {  // (a table serves one optimizer: its rule's scratch never grows)
    throw std::logic_error("fused_update: a table's scratch is its first rule's");
  } else if (stream != scratch_stream_) {
    table_->after_last_use(stream);  // the last update, on another stream, may still read the scratch
  }
  scratch_stream_ = stream;
  return scratch_.data;
}

void FusedUpdateTable::apply_captured(rules::Rule rule, const void* grads, const void* device_scalars,
                                      int coefficients, cudaStream_t stream, LossScaleGate gate,
                                      const void* squares) {
  if (coefficients > rules::kMaxCoefficients) throw std::invalid_argument("fused_update: too many coefficients");
  check_squares(squares, gate);
  if (table_->pending() || (captured_ && (grads != grads_ || squares != squares_)))
    throw std::logic_error("fused_update: a captured table serves one capture (make a new table for another)");
  if (nothing_to_do(rule)) return;
  if (dtype_ == DType::kFloat32) {
    point_grads_at<float>(grads, squares);
  } else {
    point_grads_at<double>(grads, squares);
  }
  grads_ = grads;
  squares_ = squares;
  captured_ = true;
  table_->upload_captured(entries_ * entry_bytes_, stream);
  launch_rule(rule, nullptr, device_scalars, coefficients, stream, gate);
}

void FusedUpdateTable::check_finite(const void* grads, int* nonfinite, cudaStream_t stream) const {
  count_nonfinite(dtype_, grads, total_count_, nonfinite, sms_, stream);
}

void FusedUpdateTable::point_and_upload(const void* grads, const void* squares, cudaStream_t stream,
                                        LossScaleGate gate) {
  check_squares(squares, gate);
  if (grads == grads_ && squares == squares_) return;
  table_->rewrite();
  if (dtype_ == DType::kFloat32) {
    point_grads_at<float>(grads, squares);
  } else {
    point_grads_at<double>(grads, squares);
  }
  table_->upload(entries_ * entry_bytes_, stream);
  grads_ = grads;
  squares_ = squares;
}

void FusedUpdateTable::apply_from_device(rules::Rule rule, const void* grads, const void* device_scalars,
                                         int coefficients, cudaStream_t stream, LossScaleGate gate,
                                         const void* squares) {
  if (captured_) throw std::logic_error("fused_update: this table belongs to a captured graph");
  if (coefficients > rules::kMaxCoefficients) throw std::invalid_argument("fused_update: too many coefficients");
  if (nothing_to_do(rule)) return;
  point_and_upload(grads, squares, stream, gate);
  launch_rule(rule, nullptr, device_scalars, coefficients, stream, gate);
  table_->used_by(stream);
}

void FusedUpdateTable::apply(rules::Rule rule, const void* grads, const std::vector<double>& coefficients,
                             double weight_decay, double lr, cudaStream_t stream, LossScaleGate gate,
                             const void* squares) {
  if (captured_) throw std::logic_error("fused_update: this table belongs to a captured graph");
  if (coefficients.size() > static_cast<std::size_t>(rules::kMaxCoefficients))
    throw std::invalid_argument("fused_update: too many coefficients");
  if (nothing_to_do(rule)) return;
  point_and_upload(grads, squares, stream, gate);
  if (dtype_ == DType::kFloat32) {
    launch<float>(rule, coefficients, weight_decay, lr, stream, gate);
  } else {
    launch<double>(rule, coefficients, weight_decay, lr, stream, gate);
  }
  table_->used_by(stream);
}

}  // namespace mirrored::cuda
