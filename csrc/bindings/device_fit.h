// The GPU plans' check that a repeated call's arrays still fit (mirrored._cuda's CallPlan and
// BatchPlan; the host plans' counterpart is array_fit.h): each array is exactly the planned array
// type (CuPy's ndarray, or the tests' stand-in with the same attribute names) with the planned
// dtype, shape and strides, and its memory (`a.data`) on its replica's GPU. Five attribute reads
// an array (shape, strides, dtype, data, then data.device_id and data.ptr): CuPy's
// __cuda_array_interface__ builds a dict and looks up the current stream, which costs more.
// Anything unexpected (another type, an attribute that is missing or not an integer, a null
// pointer under a non-empty array) is "does not fit", never an error here: the plan's caller then
// validates the call afresh and reports it, naming the argument.
#pragma once

#include <pybind11/pybind11.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

namespace mirrored::bindings {

namespace py = pybind11;

// One tensor of a plan: what each replica's array must have.
struct DeviceSpec {
  py::object shape, strides, dtype;  // as the planning call's arrays gave them (tuples, a NumPy dtype)
  bool empty = false;                // no elements: CuPy may give such an array a null pointer
};

class DeviceFit {
 public:
  DeviceFit(py::object array_type, std::vector<int> devices, std::vector<DeviceSpec> specs)
      : type_(std::move(array_type)), devices_(std::move(devices)), specs_(std::move(specs)) {}

  int replicas() const { return static_cast<int>(devices_.size()); }
  int tensors() const { return static_cast<int>(specs_.size()); }

  // ptrs[r] = the data of arrays[r] (a list or tuple of one array per replica, of tensor 0's spec);
  // false when one does not fit.
  bool pointers(py::handle arrays, std::vector<std::uintptr_t>& ptrs) const {
    const int n = replicas();
    if (!sized(arrays.ptr(), n)) return false;
    ptrs.resize(n);
    for (int r = 0; r < n; ++r) {
      py::object a = item(arrays.ptr(), r, n);
      if (!a || !pointer(a.ptr(), specs_[0], devices_[r], ptrs[r])) return false;
    }
    return true;
  }

  // ptrs[r * T + t] = the data of lists[r][t]; false when one does not fit.
  bool batch_pointers(py::handle lists, std::vector<std::uintptr_t>& ptrs) const {
    const int n = replicas(), T = tensors();
    if (!sized(lists.ptr(), n)) return false;
    ptrs.resize(static_cast<std::size_t>(n) * T);
    for (int r = 0; r < n; ++r) {
      py::object row = item(lists.ptr(), r, n);
      if (!row || !sized(row.ptr(), T)) return false;
      for (int t = 0; t < T; ++t) {
        py::object a = item(row.ptr(), t, T);
        if (!a || !pointer(a.ptr(), specs_[t], devices_[r], ptrs[static_cast<std::size_t>(r) * T + t])) return false;
      }
    }
    return true;
  }

 private:
  // Whether seq is a list or tuple of exactly n objects.
  static bool sized(PyObject* seq, int n) {
    if (PyList_CheckExact(seq)) return PyList_GET_SIZE(seq) == n;
    if (PyTuple_CheckExact(seq)) return PyTuple_GET_SIZE(seq) == n;
    return false;
  }

  // seq[i], held (an attribute read of an earlier item runs Python code, which may change a list);
  // empty when seq no longer holds n items.
  static py::object item(PyObject* seq, int i, int n) {
    if (!sized(seq, n)) return py::object();
    return py::reinterpret_borrow<py::object>(PyList_CheckExact(seq) ? PyList_GET_ITEM(seq, i) : PyTuple_GET_ITEM(seq, i));
  }

  // Whether attribute `name` of o equals `expected` (identical first: NumPy shares one descriptor per
  // built-in dtype, and equal small-integer tuples compare item by item without a call).
  static bool attribute_equals(PyObject* o, PyObject* name, PyObject* expected) {
    PyObject* v = PyObject_GetAttr(o, name);
    if (v == nullptr) {
      PyErr_Clear();
      return false;
    }
    int same = v == expected ? 1 : PyObject_RichCompareBool(v, expected, Py_EQ);
    Py_DECREF(v);
    if (same < 0) PyErr_Clear();
    return same == 1;
  }

  // An attribute of o as an integer (false when missing or not an integer).
  template <typename T>
  static bool integer_attribute(PyObject* o, PyObject* name, T& value) {
    PyObject* v = PyObject_GetAttr(o, name);
    if (v == nullptr) {
      PyErr_Clear();
      return false;
    }
    bool ok = PyLong_Check(v);
    if (ok) {
      if constexpr (std::is_signed_v<T>) {
        const long long x = PyLong_AsLongLong(v);
        value = static_cast<T>(x);
      } else {
        const unsigned long long x = PyLong_AsUnsignedLongLong(v);
        value = static_cast<T>(x);
      }
      if (PyErr_Occurred()) {  // out of range (a negative pointer)
        PyErr_Clear();
        ok = false;
      }
    }
    Py_DECREF(v);
    return ok;
  }

  bool pointer(PyObject* a, const DeviceSpec& s, int device, std::uintptr_t& ptr) const {
    static PyObject* const kDtype = PyUnicode_InternFromString("dtype");
    static PyObject* const kShape = PyUnicode_InternFromString("shape");
    static PyObject* const kStrides = PyUnicode_InternFromString("strides");
    static PyObject* const kData = PyUnicode_InternFromString("data");
    static PyObject* const kDeviceId = PyUnicode_InternFromString("device_id");
    static PyObject* const kPtr = PyUnicode_InternFromString("ptr");
    if (reinterpret_cast<PyObject*>(Py_TYPE(a)) != type_.ptr()) return false;
    if (!attribute_equals(a, kDtype, s.dtype.ptr()) || !attribute_equals(a, kShape, s.shape.ptr()) ||
        !attribute_equals(a, kStrides, s.strides.ptr()))
      return false;
    PyObject* data = PyObject_GetAttr(a, kData);
    if (data == nullptr) {
      PyErr_Clear();
      return false;
    }
    long long on = -1;
    const bool fits = integer_attribute(data, kDeviceId, on) && on == device && integer_attribute(data, kPtr, ptr) &&
                      (ptr != 0 || s.empty);
    Py_DECREF(data);
    return fits;
  }

  py::object type_;
  std::vector<int> devices_;
  std::vector<DeviceSpec> specs_;
};

}  // namespace mirrored::bindings
