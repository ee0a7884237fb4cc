// mirrored._core.Rendezvous: where the replicas of one strategy.run meet for
// each collective, and the cooperative scheduler of the replicas that share
// the caller's thread as greenlets (rendezvous_binding.cc).
#pragma once

#include <Python.h>

namespace mirrored::bindings {

// Adds the Rendezvous type to `module`; returns -1 with a Python error set on failure.
int add_rendezvous(PyObject* module);

}  // namespace mirrored::bindings
