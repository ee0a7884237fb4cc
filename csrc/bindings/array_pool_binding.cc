// NumPy (>= 1.22, NEP 49) takes an array-data allocator per contextvars context:
// PyDataMem_SetHandler installs a "mem_handler" capsule of a PyDataMem_Handler in
// the calling thread's current context, and every array keeps a reference to
// the handler that allocated it, which frees it. The pool is one per process and
// never destroyed: arrays it allocated may be freed at any time, up to the end
// of the interpreter.
#include "bindings/array_pool_binding.h"

#include <pybind11/gil_safe_call_once.h>

#include <cstdint>

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

// Found once. The first call imports NumPy's module, which runs Python: a function-local static would let a
// second thread, handed the GIL meanwhile, block on the static's guard while holding the GIL (a deadlock);
// gil_safe_call_once_and_store waits for the first call with the GIL released.
SetHandler numpy_set_handler() {
  PYBIND11_CONSTINIT static py::gil_safe_call_once_and_store<SetHandler> storage;
  return storage
      .call_once_and_store_result([] {
        py::module_ multiarray;
        try {
          multiarray = py::module_::import("numpy._core._multiarray_umath");
        } catch (py::error_already_set&) {  // NumPy 1.x
          multiarray = py::module_::import("numpy.core._multiarray_umath");
        }
        py::object api = multiarray.attr("_ARRAY_API");
        auto table = static_cast<void**>(PyCapsule_GetPointer(api.ptr(), nullptr));
        if (table == nullptr) throw py::error_already_set();
        auto feature_version = reinterpret_cast<unsigned (*)()>(table[kGetFeatureVersion])();
        if (feature_version < kFeatureVersionWithHandlers) {
          throw std::runtime_error("NumPy >= 1.22 is needed for replica array allocation (found an older C API)");
        }
        return reinterpret_cast<SetHandler>(table[kSetHandler]);
      })
      .get_stored();
}

}  // namespace

void def_array_pool(py::module_& m) {
  // One capsule, kept forever: arrays hold references to it.
  static PyObject* capsule = PyCapsule_New(&handler, "mem_handler", nullptr);
  if (capsule == nullptr) throw py::error_already_set();
  m.attr("replica_array_handler") = py::reinterpret_borrow<py::object>(capsule);
  m.def("set_array_handler", [](py::object handler) {
        if (!PyCapsule_IsValid(handler.ptr(), "mem_handler")) {
          throw py::type_error("set_array_handler: handler must be a NumPy mem_handler capsule "
                               "(mirrored._core.replica_array_handler, or what set_array_handler returned)");
        }
        PyObject* previous = numpy_set_handler()(handler.ptr());
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
