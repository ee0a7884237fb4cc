// The plans' check that a repeated call's arrays still fit (shared by _core
// and _net): exact NumPy arrays with the plan's dtype (the very descriptor
// object: NumPy shares one per built-in dtype, so a byte-swapped or
// extension dtype never passes), shape and C-contiguity, outputs writeable.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <vector>

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

}  // namespace mirrored::bindings
