// The host collectives' per-replica buffers as the bindings receive them:
// one NumPy array per replica for the inputs and one for the outputs.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <string>
#include <vector>

namespace mirrored::bindings {

namespace py = pybind11;

// The data pointers of `arrays`; `argument` names the caller's argument in the error.
inline std::vector<const void*> inputs_of(const py::list& arrays, const char* argument) {
  std::vector<const void*> ptrs;
  ptrs.reserve(arrays.size());
  for (const py::handle& h : arrays) {
    if (!py::isinstance<py::array>(h)) throw py::type_error(std::string(argument) + ": expected NumPy arrays");
    ptrs.push_back(py::reinterpret_borrow<py::array>(h).data());
  }
  return ptrs;
}

inline std::vector<void*> outputs_of(const py::list& arrays, const char* argument) {
  std::vector<void*> ptrs;
  ptrs.reserve(arrays.size());
  for (const py::handle& h : arrays) {
    if (!py::isinstance<py::array>(h)) throw py::type_error(std::string(argument) + ": expected NumPy arrays");
    ptrs.push_back(py::reinterpret_borrow<py::array>(h).mutable_data());  // raises if read-only
  }
  return ptrs;
}

// A collective's inputs and outputs, as many of each: `n` of them.
struct Buffers {
  std::vector<const void*> in;
  std::vector<void*> out;
  int n;
};

inline Buffers buffers_of(const py::list& inputs, const char* inputs_argument, const py::list& outputs) {
  Buffers b{inputs_of(inputs, inputs_argument), outputs_of(outputs, "out"), 0};
  if (b.in.size() != b.out.size()) throw py::value_error("inputs and outputs differ in length");
  b.n = static_cast<int>(b.in.size());
  return b;
}

}  // namespace mirrored::bindings
