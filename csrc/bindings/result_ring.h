// The results a GPU plan (mirrored._cuda's CallPlan and BatchPlan) hands out
// again once nobody else holds them. TF's collectives return new tensors, and
// making a replica's results (one allocation, a CuPy array per tensor) costs
// the Python side microseconds per array; but a caller cannot tell a new array
// from a recycled one that nothing references. So a plan keeps its last sets of
// results (kSets: the usual `result = collective(...)` holds the previous
// result while the next call runs) and reuses one whose every array, memory
// pointer and allocation has exactly the references the ring itself holds:
// a result still named anywhere, a view of it (which holds the array, its
// memory pointer or its allocation), a DLPack capsule or a
// __cuda_array_interface__ consumer keeps its set out of reuse.
//
// Ordering: a set is reused only for a call on the very streams its last call
// ran on. Work the caller queued there on the old results (reads of them)
// precedes the collective that overwrites them, as with CuPy's own pool, whose
// freed blocks serve the stream they were freed on.
#pragma once

#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace mirrored::bindings {

namespace py = pybind11;

class ResultRing {
 public:
  static constexpr std::size_t kSets = 2;

  struct Set {
    std::vector<py::object> arrays;       // replica-major: the plan's outputs of every replica
    std::vector<std::uintptr_t> pointers;  // what the plan writes to (each output's, or each replica's base)
    std::vector<std::uintptr_t> streams;   // the streams of the call that last wrote the set
    std::vector<py::object> watched;       // the arrays, their `data` and `data.mem`: each object once
    std::vector<Py_ssize_t> baseline;      // watched[k]'s reference count when only the ring held it
    std::uint64_t last_use = 0;
  };

  ResultRing() { sets_.reserve(kSets); }  // (a kept set never moves)

  // A kept set no one else references, made for a call on these streams: its arrays (referenced here,
  // before anything else can run, so that no other call takes it too) and the pointers the plan writes to.
  // False when there is none. The GIL held.
  bool take(const std::vector<std::uintptr_t>& streams, std::vector<py::object>& arrays,
            std::vector<std::uintptr_t>& pointers) {
    for (Set& s : sets_) {
      if (s.streams != streams || !unreferenced(s)) continue;
      s.last_use = ++clock_;
      arrays = s.arrays;
      pointers = s.pointers;
      return true;
    }
    return false;
  }

  // Keeps new results (replacing the set used longest ago when the ring is full) and returns its arrays,
  // referenced for the caller. The caller must hold no other reference to them: their reference counts now
  // are those of "nobody else holds them". The GIL held.
  //
  // Python may run inside (the replaced set's arrays go, and their finalizers run, which may let another
  // thread's call through this plan run): the ring is whole by then and the new set already the caller's.
  std::vector<py::object> keep(std::vector<py::object> arrays, std::vector<std::uintptr_t> pointers,
                               std::vector<std::uintptr_t> streams) {
    Set s;
    s.arrays = std::move(arrays);
    s.pointers = std::move(pointers);
    s.streams = std::move(streams);
    s.last_use = ++clock_;
    static PyObject* const kData = PyUnicode_InternFromString("data");
    static PyObject* const kMem = PyUnicode_InternFromString("mem");
    std::vector<py::object> objects;  // (held while gathered: an attribute may be made on access)
    for (const py::object& a : s.arrays) {
      objects.push_back(a);
      py::object data = attribute(a.ptr(), kData);
      if (!data) continue;
      py::object mem = attribute(data.ptr(), kMem);
      objects.push_back(std::move(data));
      if (mem) objects.push_back(std::move(mem));
    }
    std::sort(objects.begin(), objects.end(), [](const py::object& a, const py::object& b) { return a.ptr() < b.ptr(); });
    for (std::size_t k = 0; k < objects.size(); ++k)
      if (k == 0 || objects[k].ptr() != objects[k - 1].ptr()) s.watched.push_back(objects[k]);
    objects.clear();
    for (const py::object& o : s.watched) s.baseline.push_back(Py_REFCNT(o.ptr()));
    std::vector<py::object> handed = s.arrays;
    Set replaced;
    if (sets_.size() < kSets) {
      sets_.push_back(std::move(s));
    } else {
      Set& oldest = *std::min_element(sets_.begin(), sets_.end(),
                                      [](const Set& a, const Set& b) { return a.last_use < b.last_use; });
      replaced = std::move(oldest);
      oldest = std::move(s);
    }
    return handed;  // (then `replaced` goes: its arrays live on with whoever holds them)
  }

 private:
  static bool unreferenced(const Set& s) {
    for (std::size_t k = 0; k < s.watched.size(); ++k)
      if (Py_REFCNT(s.watched[k].ptr()) != s.baseline[k]) return false;
    return !s.baseline.empty();
  }

  static py::object attribute(PyObject* o, PyObject* name) {
    PyObject* v = PyObject_GetAttr(o, name);
    if (v == nullptr) {
      PyErr_Clear();
      return py::object();
    }
    return py::reinterpret_steal<py::object>(v);
  }

  std::vector<Set> sets_;  // at most kSets
  std::uint64_t clock_ = 0;
};

}  // namespace mirrored::bindings
