// The host fused optimizer update's binding, a part of mirrored._core
// (core_module.cc registers it): csrc/host/fused_update.h over NumPy arrays.
#pragma once

#include <pybind11/pybind11.h>

namespace mirrored::bindings {

void def_host_fused_update(pybind11::module_& m);

}  // namespace mirrored::bindings
