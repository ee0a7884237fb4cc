// NumPy (>= 1.22, NEP 49) takes an array-data allocator per contextvars context:
// PyDataMem_SetHandler installs a "mem_handler" capsule of a PyDataMem_Handler in
// the calling thread's current context, and every array keeps a reference to
// the handler that allocated it, which frees it. The pool is one per process and
// never destroyed: arrays it allocated may be freed at any time, up to the end
// of the interpreter.
#include "bindings/array_pool_binding.h"

#include <cstdint>
#include <string>

#include "host/array_pool.h"

namespace py = pybind11;

namespace mirrored::bindings {

namespace {

// NumPy's ABI (numpy/ndarraytypes.h, version 1 of the handler), declared here so that the
// build needs no NumPy headers.
struct DataMemAllocator {
  void* ctx;
  void* (*malloc)(void* ctx, std::size_t size);
  void* (*calloc)(void* ctx, std::size_t nelem, std::size_t elsize);
  void* (*realloc)(void* ctx, void* ptr, std::size_t new_size);
  void (*free)(void* ctx, void* ptr, std::size_t size);
};

struct DataMemHandler {
  char name[127];
  std::uint8_t version;
  DataMemAllocator allocator;
};

// Positions in NumPy's C-API table (numpy/__multiarray_api.h; fixed by its ABI).
constexpr int kGetFeatureVersion = 211;  // PyArray_GetNDArrayCFeatureVersion
constexpr int kSetHandler = 304;         // PyDataMem_SetHandler
constexpr unsigned kFeatureVersionWithHandlers = 0xf;  // NumPy 1.22

host::ArrayPool& pool() {
  static host::ArrayPool* p = [] {
    auto* made = new host::ArrayPool();
    made->guard_fork();  // a fork while a replica thread held its lock would leave the child's held for good
    return made;
  }();
  return *p;
}

void* pool_malloc(void*, std::size_t size) { return pool().allocate(size); }

void* pool_calloc(void*, std::size_t nelem, std::size_t elsize) {
  if (elsize != 0 && nelem > SIZE_MAX / elsize) return nullptr;
  return pool().allocate(nelem * elsize, true);
}

void* pool_realloc(void*, void* ptr, std::size_t new_size) { return pool().reallocate(ptr, new_size); }

void pool_free(void*, void* ptr, std::size_t) { pool().release(ptr); }  // (the block knows its size)

DataMemHandler handler = {"mirrored_replica_arrays", 1, {nullptr, pool_malloc, pool_calloc, pool_realloc, pool_free}};

using SetHandler = PyObject* (*)(PyObject*);

// NumPy's PyDataMem_SetHandler, from its C API table; null with a Python error set when NumPy is older than
// 1.22. Looked up once, at the module's import (under the GIL, before any replica thread exists): a lazy lookup
// in a function-local static would run Python inside the static's guard, where a second thread handed the GIL
// could block holding it, and one that releases the GIL there can be ended by the interpreter's exit inside
// std::call_once (std::terminate).
SetHandler find_numpy_set_handler() {
  PyObject* multiarray = PyImport_ImportModule("numpy._core._multiarray_umath");
  if (multiarray == nullptr) {  // NumPy 1.x
    PyErr_Clear();
    multiarray = PyImport_ImportModule("numpy.core._multiarray_umath");
    if (multiarray == nullptr) return nullptr;
  }
  PyObject* api = PyObject_GetAttrString(multiarray, "_ARRAY_API");
  Py_DECREF(multiarray);
  if (api == nullptr) return nullptr;
  auto table = static_cast<void**>(PyCapsule_GetPointer(api, nullptr));
  Py_DECREF(api);  // (the table lives as long as NumPy's module, which is never unloaded)
  if (table == nullptr) return nullptr;
  if (reinterpret_cast<unsigned (*)()>(table[kGetFeatureVersion])() < kFeatureVersionWithHandlers) {
    PyErr_SetString(PyExc_RuntimeError, "NumPy >= 1.22 is needed for replica array allocation (found an older C API)");
    return nullptr;
  }
  return reinterpret_cast<SetHandler>(table[kSetHandler]);
}

}  // namespace

void def_array_pool(py::module_& m) {
  // One capsule, kept forever: arrays hold references to it.
  static PyObject* capsule = PyCapsule_New(&handler, "mem_handler", nullptr);
  if (capsule == nullptr) throw py::error_already_set();
  m.attr("replica_array_handler") = py::reinterpret_borrow<py::object>(capsule);
  static SetHandler numpy_set_handler = nullptr;
  static std::string numpy_missing;  // why it was not found
  if ((numpy_set_handler = find_numpy_set_handler()) == nullptr) {
    numpy_missing = py::error_already_set().what();
  }
  m.def("set_array_handler", [](py::object handler) {
        if (numpy_set_handler == nullptr) throw std::runtime_error("set_array_handler: " + numpy_missing);
        if (!PyCapsule_IsValid(handler.ptr(), "mem_handler")) {
          throw py::type_error("set_array_handler: handler must be a NumPy mem_handler capsule "
                               "(mirrored._core.replica_array_handler, or what set_array_handler returned)");
        }
        PyObject* previous = numpy_set_handler(handler.ptr());
        if (previous == nullptr) throw py::error_already_set();
        return py::reinterpret_steal<py::object>(previous);
      },
      py::arg("handler"),
      "Makes `handler` (a NumPy mem_handler capsule) allocate the arrays created in this thread's current "
      "context; returns the one it replaces.");
  m.def("replica_array_stats", [] {
        auto s = pool().stats();
        py::dict d;
        d["live_bytes"] = s.live_bytes;
        d["cached_bytes"] = s.cached_bytes;
        d["peak_bytes"] = s.peak_bytes;
        d["hits"] = s.hits;
        d["misses"] = s.misses;
        return d;
      },
      "The replica array pool's counters (csrc/host/array_pool.h).");
  m.def("trim_replica_arrays", [] { pool().trim(); }, "Frees the replica array pool's cached blocks.");
}

}  // namespace mirrored::bindings
