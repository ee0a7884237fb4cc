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

  // A kept set no one else references, made for a call on these streams (marked used now), or nullptr.
  // The GIL held.
  Set* take(const std::vector<std::uintptr_t>& streams) {
    for (Set& s : sets_) {
      if (s.streams != streams || !unreferenced(s)) continue;
      s.last_use = ++clock_;
      return &s;
    }
    return nullptr;
  }

  // Keeps new results (replacing the set used longest ago when the ring is full) and returns the kept set.
  // The caller must drop every other reference it made to them before the next take() for them to count
  // as free. The GIL held.
  Set& keep(std::vector<py::object> arrays, std::vector<std::uintptr_t> pointers,
            std::vector<std::uintptr_t> streams) {
    Set s;
    s.arrays = std::move(arrays);
    s.pointers = std::move(pointers);
    s.streams = std::move(streams);
    s.last_use = ++clock_;
    static PyObject* const kData = PyUnicode_InternFromString("data");
    static PyObject* const kMem = PyUnicode_InternFromString("mem");
    std::vector<PyObject*> objects;
    for (const py::object& a : s.arrays) {
      objects.push_back(a.ptr());
      py::object data = attribute(a.ptr(), kData);
      if (!data) continue;
      objects.push_back(data.ptr());
      py::object mem = attribute(data.ptr(), kMem);
      if (mem) objects.push_back(mem.ptr());
    }
    std::sort(objects.begin(), objects.end());
    objects.erase(std::unique(objects.begin(), objects.end()), objects.end());
    for (PyObject* o : objects) s.watched.push_back(py::reinterpret_borrow<py::object>(o));
    Set* slot = nullptr;
    if (sets_.size() < kSets) {
      sets_.push_back(std::move(s));
      slot = &sets_.back();
    } else {
      slot = &*std::min_element(sets_.begin(), sets_.end(),
                                [](const Set& a, const Set& b) { return a.last_use < b.last_use; });
      *slot = std::move(s);  // (the old set's arrays live on with whoever holds them)
    }
    return *slot;
  }

  // Records the set's reference counts as those of "nobody else holds it": call once the caller's own
  // temporaries (the allocating call's lists, the base pointers) are gone.
  static void settle(Set& s) {
    s.baseline.clear();
    for (const py::object& o : s.watched) s.baseline.push_back(Py_REFCNT(o.ptr()));
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
