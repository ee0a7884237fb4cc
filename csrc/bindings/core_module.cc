// mirrored._core: the host collectives, and the fused optimizer update on host
// arrays (fused_update_binding.cc). Thin: take NumPy arrays already
// validated by the collective face (mirrored/collective/plan.py), pull out
// their data pointers, release the GIL, run the collective. A plan object
// does the same for a repeated call after checking that its arrays still fit.
// Also the replicas' rendezvous of strategy.run (rendezvous_binding.cc).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "bindings/array_fit.h"
#include "bindings/array_pool_binding.h"
#include "bindings/host_buffers.h"
#include "bindings/fused_update_binding.h"
#include "bindings/rendezvous_binding.h"
#include "host/host_communicator.h"

namespace py = pybind11;
using namespace mirrored;

namespace {

HostCommunicator& comm() {
  static HostCommunicator* c = new HostCommunicator();  // lives as long as the pool
  return *c;
}

// --- plans: calls the Python face validated once ----------------------------
//
// The face (mirrored/collective/plan.py) checks a collective's first call of a
// signature and keeps a plan for it. A repeated call only has to show that its
// arrays still fit (bindings/array_fit.h). Anything else returns None and the
// face validates the call afresh, with messages naming the argument.

using bindings::fitting;
using bindings::items_of;
using bindings::kReadable;
using bindings::kWritable;

using bindings::kRecycled;
using bindings::new_result;

// all_reduce or broadcast of one array per replica.
class CallPlan {
 public:
  CallPlan(std::string kind, int n, py::dtype dtype, std::vector<py::ssize_t> shape, int dtype_code, int op,
           int algorithm, std::size_t chunk_bytes, int root, py::function alloc)
      : broadcast_(kind == "broadcast"), n_(n), dtype_(std::move(dtype)), shape_(std::move(shape)),
        type_(dtype_from_code(dtype_code)), op_(reduce_op_from_code(op)), algorithm_(static_cast<Algorithm>(algorithm)),
        chunk_bytes_(chunk_bytes), root_(root), alloc_(std::move(alloc)) {
    if (kind != "broadcast" && kind != "all_reduce") throw py::value_error("CallPlan: kind is all_reduce or broadcast");
    if (root < 0 || root >= n) throw py::value_error("CallPlan: root out of range");
    count_ = 1;
    for (auto d : shape_) count_ *= static_cast<std::size_t>(d);
  }

  // The outputs (`outputs` itself as a new list, or new arrays when it is None), or None when the
  // arrays do not fit this plan.
  py::object run(const py::handle& inputs, const py::handle& outputs) {
    PyObject* descr = dtype_.ptr();
    std::vector<const void*> in(n_);
    std::vector<void*> out(n_);
    if (bindings::fitting_items(inputs, n_, descr, shape_, kReadable, in) == nullptr) return py::none();
    py::list result(n_);
    if (outputs.is_none()) {
      const std::size_t nbytes = count_ * dtype_size(type_);
      for (int i = 0; i < n_; ++i) {
        py::array r = new_result(dtype_, shape_, nbytes, alloc_);
        out[i] = r.mutable_data();
        result[i] = std::move(r);
      }
    } else {
      PyObject** out_items = bindings::fitting_items(outputs, n_, descr, shape_, kWritable, out);
      if (out_items == nullptr) return py::none();
      for (int i = 0; i < n_; ++i) result[i] = py::reinterpret_borrow<py::object>(out_items[i]);
    }
    {
      py::gil_scoped_release nogil;
      if (broadcast_)
        comm().broadcast(n_, in.data(), out.data(), count_, type_, root_);
      else
        comm().all_reduce(n_, in.data(), out.data(), count_, type_, op_, algorithm_, chunk_bytes_);
    }
    return std::move(result);
  }

 private:
  bool broadcast_;
  int n_;
  py::dtype dtype_;
  std::vector<py::ssize_t> shape_;
  std::size_t count_;
  DType type_;
  ReduceOp op_;
  Algorithm algorithm_;
  std::size_t chunk_bytes_;
  int root_;
  py::function alloc_;
};

// All-reduce of T tensors per replica, fused by the engine into packs. The results of a replica
// are views of one buffer (from `alloc`), each 64-byte aligned: one allocation per replica.
class BatchPlan {
 public:
  BatchPlan(int n, std::vector<py::dtype> dtypes, std::vector<std::vector<py::ssize_t>> shapes,
            const std::vector<int>& codes, int op, std::size_t bytes_per_pack, int num_packs, int algorithm,
            std::size_t chunk_bytes, py::function alloc)
      : n_(n), layout_(std::move(dtypes), std::move(shapes), codes, "BatchPlan"), op_(reduce_op_from_code(op)),
        bytes_per_pack_(bytes_per_pack), num_packs_(num_packs), algorithm_(static_cast<Algorithm>(algorithm)),
        chunk_bytes_(chunk_bytes), alloc_(std::move(alloc)) {}

  // per_replica_lists[r][t] -> a list per replica of its results, or None when they do not fit.
  py::object run(const py::handle& lists) {
    std::vector<const void*> in;
    if (!layout_.inputs(lists, n_, in)) return py::none();
    std::vector<void*> out;
    py::list result = layout_.outputs(n_, alloc_, out);
    {
      py::gil_scoped_release nogil;
      comm().batch_all_reduce(n_, layout_.tensors(), in.data(), out.data(), layout_.counts(), layout_.types(), op_,
                              bytes_per_pack_, num_packs_, algorithm_, chunk_bytes_);
    }
    return std::move(result);
  }

 private:
  int n_;
  bindings::BatchLayout layout_;
  ReduceOp op_;
  std::size_t bytes_per_pack_;
  int num_packs_;
  Algorithm algorithm_;
  std::size_t chunk_bytes_;
  py::function alloc_;
};

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "Host-memory collectives of mirrored (one call, all local replicas).";

  m.def("all_reduce", [](const py::list& inputs, const py::list& outputs, std::size_t count, int dtype, int op,
                         int algorithm, std::size_t ring_chunk_bytes) {
    auto [in, out, n] = bindings::buffers_of(inputs, "buffers", outputs);
    py::gil_scoped_release nogil;
    comm().all_reduce(n, in.data(), out.data(), count, dtype_from_code(dtype), reduce_op_from_code(op),
                      static_cast<Algorithm>(algorithm), ring_chunk_bytes);
  }, py::arg("inputs"), py::arg("outputs"), py::arg("count"), py::arg("dtype"), py::arg("op"), py::arg("algorithm"),
     py::arg("ring_chunk_bytes") = 0);

  m.def("broadcast", [](const py::list& inputs, const py::list& outputs, std::size_t count, int dtype, int root) {
    auto [in, out, n] = bindings::buffers_of(inputs, "buffers", outputs);
    py::gil_scoped_release nogil;
    comm().broadcast(n, in.data(), out.data(), count, dtype_from_code(dtype), root);
  });

  m.def("reduce", [](const py::list& inputs, const py::list& outputs, std::size_t count, int dtype, int op,
                     int root) {
    auto [in, out, n] = bindings::buffers_of(inputs, "buffers", outputs);
    py::gil_scoped_release nogil;
    comm().reduce(n, in.data(), out.data(), count, dtype_from_code(dtype), reduce_op_from_code(op), root);
  });

  m.def("all_gather", [](const py::list& inputs, const py::list& outputs, const std::vector<std::size_t>& row_bytes,
                         std::size_t outer) {
    auto [in, out, n] = bindings::buffers_of(inputs, "buffers", outputs);
    if (row_bytes.size() != in.size()) throw py::value_error("row_bytes needs one entry per buffer");
    py::gil_scoped_release nogil;
    comm().all_gather(n, in.data(), out.data(), row_bytes.data(), outer);
  });

  m.def("batch_all_reduce", [](int n, const py::list& inputs, const py::list& outputs,
                               const std::vector<std::size_t>& counts, const std::vector<int>& dtypes, int op,
                               std::size_t bytes_per_pack, int num_packs, int algorithm,
                               std::size_t ring_chunk_bytes) {
    [[maybe_unused]] auto [in, out, replicas] = bindings::buffers_of(inputs, "per_replica_lists", outputs);  // (n counts the replicas here)
    const int ntensors = static_cast<int>(counts.size());
    if (dtypes.size() != counts.size() || in.size() != static_cast<std::size_t>(n) * ntensors)
      throw py::value_error("batch_all_reduce: inputs must be n * len(counts) arrays with one dtype per tensor");
    std::vector<DType> types;
    for (int code : dtypes) types.push_back(dtype_from_code(code));
    py::gil_scoped_release nogil;
    comm().batch_all_reduce(n, ntensors, in.data(), out.data(), counts.data(), types.data(), reduce_op_from_code(op),
                            bytes_per_pack, num_packs, static_cast<Algorithm>(algorithm), ring_chunk_bytes);
  });

  py::class_<CallPlan>(m, "CallPlan")
      .def(py::init<std::string, int, py::dtype, std::vector<py::ssize_t>, int, int, int, std::size_t, int,
                    py::function>(),
           py::arg("kind"), py::arg("n"), py::arg("dtype"), py::arg("shape"), py::arg("dtype_code"), py::arg("op"),
           py::arg("algorithm"), py::arg("ring_chunk_bytes"), py::arg("root"), py::arg("alloc"))
      .def("run", &CallPlan::run, py::arg("inputs"), py::arg("outputs"));

  py::class_<BatchPlan>(m, "BatchPlan")
      .def(py::init<int, std::vector<py::dtype>, std::vector<std::vector<py::ssize_t>>, const std::vector<int>&, int,
                    std::size_t, int, int, std::size_t, py::function>(),
           py::arg("n"), py::arg("dtypes"), py::arg("shapes"), py::arg("dtype_codes"), py::arg("op"),
           py::arg("bytes_per_pack"), py::arg("num_packs"), py::arg("algorithm"), py::arg("ring_chunk_bytes"),
           py::arg("alloc"))
      .def("run", &BatchPlan::run, py::arg("per_replica_lists"));

  m.def("choose_algorithm", [](int n, std::size_t bytes) { return algorithm_name(HostCommunicator::choose(n, bytes)); },
        "The algorithm 'auto' picks for n replicas of `bytes` each.");
  m.def("isa", [] { return std::string(comm().isa()); }, "Instruction set of the reduction kernels in use.");
  m.def("num_threads", [] { return ThreadPool::global().size(); }, "Threads of the host collective pool.");
  m.def("host_pool_started", &ThreadPool::global_started,
        "Whether the host collective pool exists (from the first host collective on; its size is then fixed).");
  bindings::def_host_fused_update(m);
  bindings::def_array_pool(m);
  if (bindings::add_rendezvous(m.ptr()) < 0) throw py::error_already_set();
}
