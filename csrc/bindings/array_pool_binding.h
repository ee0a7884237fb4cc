// NumPy's array-data allocator backed by csrc/host/array_pool.h, a part of mirrored._core
// (core_module.cc registers it): what CPU replicas allocate their arrays with.
#pragma once

#include <pybind11/pybind11.h>

namespace mirrored::bindings {

void def_array_pool(pybind11::module_& m);

}  // namespace mirrored::bindings
