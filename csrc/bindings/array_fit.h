// The plans' check that a repeated call's arrays still fit (shared by _core
// and _net): exact NumPy arrays with the plan's dtype (the very descriptor
// object: NumPy shares one per built-in dtype, so a byte-swapped or
// extension dtype never passes), shape and C-contiguity, outputs writeable.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/dtype.h"

namespace mirrored::bindings {

namespace py = pybind11;
using ArrayProxy = py::detail::PyArray_Proxy;

inline const ArrayProxy* fitting(PyObject* h, PyObject* descr, const std::vector<py::ssize_t>& shape, int flags) {
  if (Py_TYPE(h) != py::detail::npy_api::get().PyArray_Type_) return nullptr;
  const auto* a = py::detail::array_proxy(h);
  if (reinterpret_cast<PyObject*>(a->descr) != descr || (a->flags & flags) != flags) return nullptr;
  if (a->nd != static_cast<int>(shape.size()) || !std::equal(shape.begin(), shape.end(), a->dimensions))
    return nullptr;
  return a;
}

constexpr int kReadable = py::detail::npy_api::NPY_ARRAY_C_CONTIGUOUS_;
constexpr int kWritable = kReadable | py::detail::npy_api::NPY_ARRAY_WRITEABLE_;

// The items of a list or tuple of exactly n objects, else nullptr.
inline PyObject** items_of(PyObject* seq, int n) {
  if (PyList_CheckExact(seq)) {
    if (PyList_GET_SIZE(seq) != n) return nullptr;
    return reinterpret_cast<PyListObject*>(seq)->ob_item;
  }
  if (PyTuple_CheckExact(seq)) {
    if (PyTuple_GET_SIZE(seq) != n) return nullptr;
    return reinterpret_cast<PyTupleObject*>(seq)->ob_item;
  }
  return nullptr;
}

// The items of `seq`, n arrays that each fit (`flags`: kReadable for inputs, kWritable for
// outputs), with their data at ptrs[i]; nullptr when one does not fit (the plan's caller then
// validates the call afresh).
template <typename Ptr>
inline PyObject** fitting_items(const py::handle& seq, int n, PyObject* descr, const std::vector<py::ssize_t>& shape,
                                int flags, std::vector<Ptr>& ptrs) {
  PyObject** items = items_of(seq.ptr(), n);
  if (items == nullptr) return nullptr;
  for (int i = 0; i < n; ++i) {
    const auto* a = fitting(items[i], descr, shape, flags);
    if (a == nullptr) return nullptr;
    ptrs[i] = a->data;
  }
  return items;
}

// A result array of `dtype` and `shape`: small ones straight from NumPy, large ones as views of
// a buffer from `alloc(nbytes)` (the face's recycler of dropped results).
// Results at least this large come from the face's recycler (rules._Recycler.MIN_BYTES).
constexpr std::size_t kRecycled = std::size_t{1} << 20;

inline py::array new_result(const py::dtype& dtype, const std::vector<py::ssize_t>& shape, std::size_t nbytes,
                             const py::function& alloc) {
  if (nbytes < kRecycled) return py::array(dtype, shape);
  auto flat = alloc(nbytes).cast<py::array_t<std::uint8_t>>();
  if (static_cast<std::size_t>(flat.size()) < nbytes) throw py::value_error("alloc returned a buffer too small");
  return py::array(dtype, shape, std::vector<py::ssize_t>{}, flat.mutable_data(), flat);
}

// The layout of a batch plan's tensors (host BatchPlan, multi-worker WorkerBatchPlan): each
// tensor's dtype, shape, engine type and count, and its 64-byte aligned offset in the one result
// buffer each replica gets.
class BatchLayout {
 public:
  BatchLayout(std::vector<py::dtype> dtypes, std::vector<std::vector<py::ssize_t>> shapes, const std::vector<int>& codes,
              const char* plan)
      : dtypes_(std::move(dtypes)), shapes_(std::move(shapes)) {
    const std::size_t T = dtypes_.size();
    if (shapes_.size() != T || codes.size() != T)
      throw py::value_error(std::string(plan) + ": one dtype, shape and code per tensor");
    for (std::size_t t = 0; t < T; ++t) {
      types_.push_back(dtype_from_code(codes[t]));
      std::size_t count = 1;
      for (auto d : shapes_[t]) count *= static_cast<std::size_t>(d);
      counts_.push_back(count);
      offsets_.push_back(total_);
      total_ += (count * dtype_size(types_[t]) + 63) / 64 * 64;
    }
    total_ = std::max<std::size_t>(total_, 1);
  }

  int tensors() const { return static_cast<int>(dtypes_.size()); }
  const std::size_t* counts() const { return counts_.data(); }
  const DType* types() const { return types_.data(); }

  // The data of per_replica_lists[r][t] at in[r * T + t]; false when an array does not fit the plan.
  bool inputs(const py::handle& lists, int n, std::vector<const void*>& in) const {
    const int T = tensors();
    PyObject** rows = items_of(lists.ptr(), n);
    if (rows == nullptr) return false;
    in.resize(static_cast<std::size_t>(n) * T);
    for (int r = 0; r < n; ++r) {
      PyObject** items = items_of(rows[r], T);
      if (items == nullptr) return false;
      for (int t = 0; t < T; ++t) {
        const auto* a = fitting(items[t], dtypes_[t].ptr(), shapes_[t], kReadable);
        if (a == nullptr) return false;
        in[r * T + t] = a->data;
      }
    }
    return true;
  }

  // Every replica's result list, views of one fresh buffer per replica (small ones straight from
  // NumPy, large ones from the face's recycler `alloc`), with their data at out[r * T + t].
  py::list outputs(int n, const py::function& alloc, std::vector<void*>& out) const {
    const int T = tensors();
    out.resize(static_cast<std::size_t>(n) * T);
    py::list result(n);
    for (int r = 0; r < n; ++r) {
      auto flat = total_ < kRecycled ? py::array_t<std::uint8_t>(static_cast<py::ssize_t>(total_))
                                     : alloc(total_).cast<py::array_t<std::uint8_t>>();
      if (static_cast<std::size_t>(flat.size()) < total_) throw py::value_error("alloc returned a buffer too small");
      auto* base = reinterpret_cast<char*>(flat.mutable_data());
      py::list row(T);
      for (int t = 0; t < T; ++t) {
        out[r * T + t] = base + offsets_[t];
        row[t] = py::array(dtypes_[t], shapes_[t], std::vector<py::ssize_t>{}, base + offsets_[t], flat);
      }
      result[r] = std::move(row);
    }
    return result;
  }

 private:
  std::vector<py::dtype> dtypes_;
  std::vector<std::vector<py::ssize_t>> shapes_;
  std::vector<DType> types_;
  std::vector<std::size_t> counts_, offsets_;
  std::size_t total_ = 0;
};

}  // namespace mirrored::bindings
