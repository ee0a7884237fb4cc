// mirrored._net: the rendezvous store and the Gloo communicator of a
// multi-worker job. Thin: arrays arrive validated by the collective face
// (mirrored/collective/multi_worker.py), which keeps a plan per call
// signature; every call that can block releases the GIL.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <vector>

#include "bindings/array_fit.h"
#include "bindings/host_buffers.h"
#include "net/errors.h"
#include "net/gloo_communicator.h"
#include "net/store.h"

namespace py = pybind11;
using namespace mirrored;
using namespace mirrored::net;

namespace {

// Seconds from Python as milliseconds, never overflowing: NaN and negatives
// are 0, and anything above 1e9 s (about 31 years; Python refuses such
// timeouts) is 1e9 s, which every deadline computation can still add to now.
std::chrono::milliseconds millis(double seconds) {
  if (!(seconds > 0)) return std::chrono::milliseconds(0);
  return std::chrono::milliseconds(static_cast<long long>(std::min(seconds, 1e9) * 1000.0));
}

// A call's own timeout (CommunicationOptions.timeout_seconds of that call) for
// GlooCommunicator::CallTimeout: negative (None from Python) keeps the
// communicator's; 0 is none; else as millis().
std::chrono::milliseconds call_timeout(double seconds) {
  return seconds < 0 ? std::chrono::milliseconds(-1) : millis(seconds);
}

// The op the workers compare: agreed_op when given (>= 0), else the op itself.
ReduceOp agreed_op_or(int agreed_op, ReduceOp op) { return agreed_op < 0 ? op : reduce_op_from_code(agreed_op); }

// Run about every 100 ms by a collective waiting for peers, on the waiting
// thread: lets Ctrl-C land (the signal's Python exception stays set and
// surfaces when the call returns) and logs stall warnings.
void python_wait_hook(const WaitReport& report) {
  py::gil_scoped_acquire gil;
  if (PyErr_CheckSignals() != 0) {
    PyObject* type = PyErr_Occurred();
    throw Interrupted(type ? reinterpret_cast<PyTypeObject*>(type)->tp_name : "a signal");
  }
  if (!report.stalled) return;
  std::string who;
  for (const auto& t : report.missing) who += (who.empty() ? "" : ", ") + t;
  char waited[32];
  std::snprintf(waited, sizeof(waited), "%.1f", report.waited_s);
  try {
    py::module_::import("logging").attr("getLogger")("mirrored").attr("warning")(
        report.collective + " has waited " + waited + " s for " + (who.empty() ? "its peers" : who) +
        " to arrive; still waiting (warned every MIRRORED_STALL_WARNING_SECONDS; the call fails only at "
        "CommunicationOptions.timeout_seconds)");
  } catch (py::error_already_set& e) {
    e.discard_as_unraisable("mirrored stall warning");
  }
}

// --- plans: calls the collective face validated once ------------------------
//
// mirrored/collective/multi_worker.py validates a collective's first call of
// a signature and keeps one of these for it (in the face's cache,
// mirrored/collective/plan.py). A repeated call shows that its arrays still
// fit (bindings/array_fit.h), else returns None and is validated afresh; then
// one native call with the GIL released. The workers still agree on every
// call: each collective's header carries its signature (and a batch's layout
// digest), so workers that call differently raise the same error everywhere.

using bindings::fitting;
using bindings::items_of;
using bindings::kReadable;
using bindings::kWritable;

// The communicator a plan runs on, kept alive by the plan.
GlooCommunicator& communicator_of(const py::object& comm) { return comm.cast<GlooCommunicator&>(); }

// all_reduce, broadcast or reduce of one array per local replica.
class WorkerPlan {
 public:
  WorkerPlan(py::object comm, const std::string& kind, int n, py::dtype dtype, std::vector<py::ssize_t> shape,
             int dtype_code, int op, int algorithm, int root, int agreed_op, py::function alloc, double timeout)
      : comm_(std::move(comm)), c_(communicator_of(comm_)), timeout_(call_timeout(timeout)), n_(n),
        dtype_(std::move(dtype)),
        shape_(std::move(shape)), type_(dtype_from_code(dtype_code)), op_(reduce_op_from_code(op)),
        agreed_(agreed_op < 0 ? op_ : reduce_op_from_code(agreed_op)), algorithm_(static_cast<Algorithm>(algorithm)),
        root_(root), alloc_(std::move(alloc)) {
    if (kind == "all_reduce") kind_ = CollectiveHeader::kAllReduce;
    else if (kind == "broadcast") kind_ = CollectiveHeader::kBroadcast;
    else if (kind == "reduce") kind_ = CollectiveHeader::kReduce;
    else throw py::value_error("WorkerPlan: kind is all_reduce, broadcast or reduce");
    if (n != c_.local_replicas()) throw py::value_error("WorkerPlan: n must be the group's local replicas");
    if (root < 0 || root >= n * c_.size()) throw py::value_error("WorkerPlan: root out of range");
    count_ = 1;
    for (auto d : shape_) count_ *= static_cast<std::size_t>(d);
  }

  // all_reduce, broadcast: the outputs (`outputs` as a new list, or new arrays when it is None).
  // reduce: [the root's result] on the worker holding the root replica, [None] elsewhere.
  // None when the arrays do not fit this plan.
  py::object run(const py::handle& inputs, const py::handle& outputs) {
    PyObject* descr = dtype_.ptr();
    std::vector<const void*> in(n_);
    std::vector<void*> out(n_);
    if (bindings::fitting_items(inputs, n_, descr, shape_, kReadable, in) == nullptr) return py::none();
    const bool reduce = kind_ == CollectiveHeader::kReduce;
    const int local_root = root_ % n_;
    const bool holds_root = root_ / n_ == c_.rank();
    py::list result(reduce ? 1 : n_);
    if (outputs.is_none()) {
      const std::size_t nbytes = count_ * dtype_size(type_);
      if (reduce) {  // one result, every replica's slot pointing at it (only the root's is written)
        py::array r = bindings::new_result(dtype_, shape_, nbytes, alloc_);
        std::fill(out.begin(), out.end(), r.mutable_data());
        result[0] = holds_root ? py::object(std::move(r)) : py::none();
      } else {
        for (int i = 0; i < n_; ++i) {
          py::array r = bindings::new_result(dtype_, shape_, nbytes, alloc_);
          out[i] = r.mutable_data();
          result[i] = std::move(r);
        }
      }
    } else {
      PyObject** out_items = bindings::fitting_items(outputs, n_, descr, shape_, kWritable, out);
      if (out_items == nullptr) return py::none();
      if (!reduce)
        for (int i = 0; i < n_; ++i) result[i] = py::reinterpret_borrow<py::object>(out_items[i]);
      if (reduce) result[0] = holds_root ? py::reinterpret_borrow<py::object>(out_items[local_root]) : py::none();
    }
    {
      py::gil_scoped_release nogil;
      GlooCommunicator::CallTimeout bound(timeout_);
      if (kind_ == CollectiveHeader::kAllReduce)
        c_.all_reduce_as(n_, in.data(), out.data(), count_, type_, op_, algorithm_, agreed_);
      else if (kind_ == CollectiveHeader::kBroadcast)
        c_.broadcast(n_, in.data(), out.data(), count_, type_, root_);
      else
        c_.reduce_as(n_, in.data(), out.data(), count_, type_, op_, root_, agreed_);
    }
    return std::move(result);
  }

 private:
  py::object comm_;
  GlooCommunicator& c_;
  std::chrono::milliseconds timeout_;  // the call's own (negative: the communicator's)
  CollectiveHeader::Kind kind_;
  int n_;
  py::dtype dtype_;
  std::vector<py::ssize_t> shape_;
  std::size_t count_;
  DType type_;
  ReduceOp op_, agreed_;
  Algorithm algorithm_;
  int root_;
  py::function alloc_;
};

// All-reduce of T tensors per local replica, fused by the engines' packer
// (GlooCommunicator::batch_all_reduce). The results of a replica are views of
// one buffer, each 64-byte aligned: one allocation per replica.
class WorkerBatchPlan {
 public:
  WorkerBatchPlan(py::object comm, int n, std::vector<py::dtype> dtypes, std::vector<std::vector<py::ssize_t>> shapes,
                  const std::vector<int>& codes, int op, std::size_t bytes_per_pack, int num_packs, int algorithm,
                  int agreed_op, py::function alloc, double timeout)
      : comm_(std::move(comm)), c_(communicator_of(comm_)), timeout_(call_timeout(timeout)), n_(n),
        layout_(std::move(dtypes), std::move(shapes), codes, "WorkerBatchPlan"), op_(reduce_op_from_code(op)),
        agreed_(agreed_op < 0 ? op_ : reduce_op_from_code(agreed_op)), bytes_per_pack_(bytes_per_pack),
        num_packs_(num_packs), algorithm_(static_cast<Algorithm>(algorithm)), alloc_(std::move(alloc)) {
    if (n != c_.local_replicas()) throw py::value_error("WorkerBatchPlan: n must be the group's local replicas");
  }

  // per_replica_lists[r][t] -> a list per replica of its results, or None when they do not fit.
  py::object run(const py::handle& lists) {
    std::vector<const void*> in;
    if (!layout_.inputs(lists, n_, in)) return py::none();
    std::vector<void*> out;
    py::list result = layout_.outputs(n_, alloc_, out);
    {
      py::gil_scoped_release nogil;
      GlooCommunicator::CallTimeout bound(timeout_);
      c_.batch_all_reduce(n_, layout_.tensors(), in.data(), out.data(), layout_.counts(), layout_.types(), op_,
                          bytes_per_pack_, num_packs_, algorithm_, agreed_);
    }
    return std::move(result);
  }

 private:
  py::object comm_;
  GlooCommunicator& c_;
  std::chrono::milliseconds timeout_;
  int n_;
  bindings::BatchLayout layout_;
  ReduceOp op_, agreed_;
  std::size_t bytes_per_pack_;
  int num_packs_;
  Algorithm algorithm_;
  py::function alloc_;
};

// all_gather of one array per local replica (their shapes may differ along
// `axis`; the plan holds each one's). Every call opens with the workers'
// size table (GlooCommunicator::agree_gather): other workers' extents may
// change from call to call, so the results are shaped per call.
class WorkerGatherPlan {
 public:
  WorkerGatherPlan(py::object comm, py::dtype dtype, int dtype_code, std::vector<std::vector<py::ssize_t>> shapes,
                   int axis, py::function alloc, double timeout)
      : comm_(std::move(comm)), c_(communicator_of(comm_)), timeout_(call_timeout(timeout)), dtype_(std::move(dtype)), shapes_(std::move(shapes)),
        type_(dtype_from_code(dtype_code)), axis_(axis), alloc_(std::move(alloc)) {
    n_ = static_cast<int>(shapes_.size());
    if (n_ != c_.local_replicas()) throw py::value_error("WorkerGatherPlan: one shape per local replica");
    const auto& first = shapes_[0];
    if (axis < 0 || axis >= static_cast<int>(first.size())) throw py::value_error("WorkerGatherPlan: axis out of range");
    outer_ = 1;
    inner_ = dtype_size(type_);
    for (int d = 0; d < axis; ++d) outer_ *= static_cast<std::size_t>(first[d]);
    for (std::size_t d = axis + 1; d < first.size(); ++d) inner_ *= static_cast<std::size_t>(first[d]);
    for (const auto& s : shapes_) record_.emplace_back(s.begin(), s.end());
  }

  // A list of every local replica's result, or None when the arrays do not fit this plan.
  py::object run(const py::handle& inputs) {
    PyObject** items = items_of(inputs.ptr(), n_);
    if (items == nullptr) return py::none();
    std::vector<const void*> in(n_);
    for (int i = 0; i < n_; ++i) {
      const auto* a = fitting(items[i], dtype_.ptr(), shapes_[i], kReadable);
      if (a == nullptr) return py::none();
      in[i] = a->data;
    }
    std::vector<std::uint64_t> extents;
    {
      py::gil_scoped_release nogil;
      GlooCommunicator::CallTimeout bound(timeout_);
      extents = c_.agree_gather(n_, type_, axis_, record_);
    }
    std::vector<py::ssize_t> shape = shapes_[0];
    std::uint64_t extent = 0;
    for (auto e : extents) extent += e;
    shape[axis_] = static_cast<py::ssize_t>(extent);
    std::vector<std::uint64_t> row_bytes(extents.size());
    for (std::size_t i = 0; i < extents.size(); ++i) row_bytes[i] = extents[i] * inner_;
    const std::size_t nbytes = outer_ * extent * inner_;
    std::vector<void*> out(n_);
    py::list result(n_);
    for (int i = 0; i < n_; ++i) {
      py::array r = bindings::new_result(dtype_, shape, nbytes, alloc_);
      out[i] = r.mutable_data();
      result[i] = std::move(r);
    }
    {
      py::gil_scoped_release nogil;
      GlooCommunicator::CallTimeout bound(timeout_);
      c_.all_gather_planned(n_, in.data(), out.data(), row_bytes.data(), outer_);
    }
    return std::move(result);
  }

 private:
  py::object comm_;
  GlooCommunicator& c_;
  std::chrono::milliseconds timeout_;
  py::dtype dtype_;
  std::vector<std::vector<py::ssize_t>> shapes_;
  std::vector<std::vector<std::uint64_t>> record_;
  DType type_;
  int axis_;
  int n_;
  std::size_t outer_, inner_;
  py::function alloc_;
};

// Stopping the server joins its threads: an explicit close() makes that moment deterministic.
struct Server {
  std::unique_ptr<StoreServer> impl;
  void close() {
    py::gil_scoped_release nogil;
    impl.reset();
  }
};

}  // namespace

PYBIND11_MODULE(_net, m) {
  m.doc() = "Multi-worker rendezvous store and Gloo collectives of mirrored.";

  // A peer that did not arrive in time: TF's DeadlineExceededError (md.errors), a TimeoutError through it.
  py::object timeout_base = py::reinterpret_borrow<py::object>(PyExc_TimeoutError);
  try {
    timeout_base = py::module_::import("mirrored.errors").attr("PeerDeadlineExceededError");
  } catch (py::error_already_set&) {
  }
  py::register_exception<PeerTimeout>(m, "PeerTimeoutError", timeout_base);
  py::register_exception<PeerLost>(m, "PeerLostError", PyExc_ConnectionError);
  py::register_exception<Refused>(m, "RefusedError", PyExc_PermissionError);
  // md.errors owns the classes users catch; a signal's exception is already set.
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const CollectiveMismatch& e) {
      PyObject* cls = PyExc_ValueError;
      py::object holder;
      try {
        holder = py::module_::import("mirrored.errors").attr("CollectiveMismatchError");
        cls = holder.ptr();
      } catch (py::error_already_set&) {
      }
      PyErr_SetString(cls, e.what());
    } catch (const Interrupted& e) {
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_KeyboardInterrupt, e.what());
    }
  });

  py::class_<Server>(m, "StoreServer")
      .def(py::init([](const std::string& host, int port, const std::string& token, int num_tasks,
                       std::vector<std::string> task_names) {
             return Server{std::make_unique<StoreServer>(host, port, token, num_tasks, StoreLimits{},
                                                         std::move(task_names))};
           }),
           py::arg("host"), py::arg("port"), py::arg("token"), py::arg("num_tasks"),
           py::arg("task_names") = std::vector<std::string>{})
      .def_property_readonly("port", [](const Server& s) { return s.impl ? s.impl->port() : -1; })
      .def("stats",
           [](const Server& s) {
             py::dict d;
             if (!s.impl) return d;
             const auto st = s.impl->stats();
             d["admitted"] = st.admitted;
             d["pending"] = st.pending;
             d["keys"] = st.keys;
             d["stored_bytes"] = st.stored_bytes;
             d["buffered_bytes"] = st.buffered_bytes;
             d["dropped"] = st.dropped;
             return d;
           },
           "Connections, keys and bytes the server holds now, and connections it dropped.")
      .def("close", &Server::close);

  py::class_<StoreClient, std::shared_ptr<StoreClient>>(m, "StoreClient")
      .def(py::init([](const std::string& host, int port, const std::string& token, int rank,
                       const std::string& server_task, double timeout, const py::object& on_wait,
                       const std::string& instance) {
             // While the store is unreachable: Ctrl-C lands, and on_wait(seconds) can report.
             StoreClient::WaitCallback callback = [&on_wait](std::chrono::milliseconds waited) {
               py::gil_scoped_acquire gil;
               if (PyErr_CheckSignals() != 0) throw py::error_already_set();
               if (!on_wait.is_none()) on_wait(static_cast<double>(waited.count()) / 1000.0);
             };
             py::gil_scoped_release nogil;
             return std::make_shared<StoreClient>(host, port, token, rank, server_task, millis(timeout), callback,
                                                  instance);
           }),
           py::arg("host"), py::arg("port"), py::arg("token"), py::arg("rank"), py::arg("server_task"),
           py::arg("timeout"), py::arg("on_wait") = py::none(), py::arg("instance") = "")
      .def("set",
           [](StoreClient& c, const std::string& key, const py::bytes& value) {
             std::string v = value;
             py::gil_scoped_release nogil;
             c.set(key, std::vector<char>(v.begin(), v.end()));
           })
      .def("get",
           [](StoreClient& c, const std::string& key) {
             std::vector<char> v;
             {
               py::gil_scoped_release nogil;
               v = c.get(key);
             }
             return py::bytes(v.data(), v.size());
           })
      .def("wait",
           [](StoreClient& c, const std::vector<std::string>& keys, double timeout) {
             py::gil_scoped_release nogil;
             return c.wait(keys, millis(timeout));
           },
           "Waits for the keys; returns those still missing at the timeout.")
      .def("status", [](StoreClient& c) {
        std::vector<TaskState> tasks;
        {
          py::gil_scoped_release nogil;
          tasks = c.status();
        }
        py::list out;
        for (const auto& t : tasks) out.append(py::make_tuple(t.connected, t.departed, t.progress));
        return out;
      }, "Per task: (connected, departed, last collective started).");

  py::class_<GlooCommunicator>(m, "GlooCommunicator")
      .def(py::init([](std::shared_ptr<StoreClient> store, std::vector<std::string> tasks, int local_replicas,
                       const std::string& host, double timeout, const std::string& scope) {
             std::unique_ptr<GlooCommunicator> comm;
             {
               py::gil_scoped_release nogil;
               comm = std::make_unique<GlooCommunicator>(std::move(store), std::move(tasks), local_replicas, host,
                                                         millis(timeout), scope);
             }
             comm->set_wait_hook(python_wait_hook);
             return comm;
           }),
           py::arg("store"), py::arg("tasks"), py::arg("local_replicas"), py::arg("host"), py::arg("timeout"),
           py::arg("scope"))
      .def_property_readonly("rank", &GlooCommunicator::rank)
      .def_property_readonly("size", &GlooCommunicator::size)
      .def_property_readonly("local_replicas", &GlooCommunicator::local_replicas)
      .def_property_readonly("collectives", &GlooCommunicator::collectives,
                             "Collectives started so far: the number of the last one.")
      .def("set_stall_warning",
           [](GlooCommunicator& c, double seconds) { c.set_stall_warning(millis(seconds)); },
           "Log a warning when a collective has waited this long for peers, and again every period (0: never).")
      .def("all_reduce",
           [](GlooCommunicator& c, const py::list& inputs, const py::list& outputs, std::size_t count, int dtype,
              int op, int algorithm, int agreed_op, double timeout) {
             auto [in, out, n] = bindings::buffers_of(inputs, "inputs", outputs);
             const ReduceOp rop = reduce_op_from_code(op);
             const ReduceOp agreed = agreed_op_or(agreed_op, rop);
             py::gil_scoped_release nogil;
             GlooCommunicator::CallTimeout bound(call_timeout(timeout));
             c.all_reduce_as(n, in.data(), out.data(), count, dtype_from_code(dtype), rop,
                             static_cast<Algorithm>(algorithm), agreed);
           },
           py::arg("inputs"), py::arg("outputs"), py::arg("count"), py::arg("dtype"), py::arg("op"),
           py::arg("algorithm"), py::arg("agreed_op") = -1, py::arg("timeout") = -1.0,
           "agreed_op: the op the workers compare (default: op); an integer MEAN runs as a SUM but must "
           "still match the other workers' MEAN. timeout: this call's (seconds, 0: none; negative: the "
           "communicator's).")
      .def("broadcast",
           [](GlooCommunicator& c, const py::list& inputs, const py::list& outputs, std::size_t count, int dtype,
              int root, double timeout) {
             auto [in, out, n] = bindings::buffers_of(inputs, "inputs", outputs);
             py::gil_scoped_release nogil;
             GlooCommunicator::CallTimeout bound(call_timeout(timeout));
             c.broadcast(n, in.data(), out.data(), count, dtype_from_code(dtype), root);
           },
           py::arg("inputs"), py::arg("outputs"), py::arg("count"), py::arg("dtype"), py::arg("root"),
           py::arg("timeout") = -1.0)
      .def_property_readonly("shared_memory_off",
                             [](const GlooCommunicator& c) {
                               py::gil_scoped_release nogil;  // asks the store
                               return c.shared_memory_off();
                             },
                             "Why all-reduces do not use shared memory ('' when they do).")
      .def("reduce",
           [](GlooCommunicator& c, const py::list& inputs, const py::list& outputs, std::size_t count, int dtype,
              int op, int root, int agreed_op, double timeout) {
             auto [in, out, n] = bindings::buffers_of(inputs, "inputs", outputs);
             const ReduceOp rop = reduce_op_from_code(op);
             const ReduceOp agreed = agreed_op_or(agreed_op, rop);
             py::gil_scoped_release nogil;
             GlooCommunicator::CallTimeout bound(call_timeout(timeout));
             c.reduce_as(n, in.data(), out.data(), count, dtype_from_code(dtype), rop, root, agreed);
           },
           py::arg("inputs"), py::arg("outputs"), py::arg("count"), py::arg("dtype"), py::arg("op"), py::arg("root"),
           py::arg("agreed_op") = -1, py::arg("timeout") = -1.0, "agreed_op, timeout: as for all_reduce.")
      .def("all_gather",
           [](GlooCommunicator& c, const py::list& inputs, const py::list& outputs,
              const std::vector<std::size_t>& row_bytes, std::size_t outer) {
             auto [in, out, n] = bindings::buffers_of(inputs, "inputs", outputs);
             if (row_bytes.size() == in.size() * static_cast<std::size_t>(c.size()) && c.size() > 1) {
               // Every replica's row size: the sizes were agreed by exchange(..., "all_gather").
               std::vector<std::uint64_t> job(row_bytes.begin(), row_bytes.end());
               py::gil_scoped_release nogil;
               c.all_gather_planned(n, in.data(), out.data(), job.data(), outer);
               return;
             }
             if (row_bytes.size() != in.size()) throw py::value_error("row_bytes needs one entry per buffer");
             py::gil_scoped_release nogil;
             c.all_gather(n, in.data(), out.data(), row_bytes.data(), outer);
           })
      .def("exchange",
           [](GlooCommunicator& c, const std::vector<std::uint64_t>& mine, const std::string& kind) {
             if (kind != "exchange" && kind != "all_gather")
               throw py::value_error("kind must be 'exchange' or 'all_gather'");
             py::gil_scoped_release nogil;
             return c.exchange(mine, kind == "all_gather" ? CollectiveHeader::kAllGather : CollectiveHeader::kExchange);
           },
           py::arg("mine"), py::arg("kind") = "exchange",
           "Every process's list (all of one length), concatenated in rank order. kind='all_gather' opens a "
           "gather whose data stage all_gather(..., row_bytes of every replica of the job) completes.")
      .def("barrier", [](GlooCommunicator& c) {
        py::gil_scoped_release nogil;
        c.barrier();
      })
      .def("batch_all_reduce",
           [](GlooCommunicator& c, int n, const py::list& inputs, const py::list& outputs,
              const std::vector<std::size_t>& counts, const std::vector<int>& dtypes, int op, std::size_t bytes_per_pack,
              int num_packs, int algorithm, int agreed_op, double timeout) {
             [[maybe_unused]] auto [in, out, replicas] = bindings::buffers_of(inputs, "inputs", outputs);  // (n counts the replicas here)
             const int ntensors = static_cast<int>(counts.size());
             if (dtypes.size() != counts.size() || in.size() != static_cast<std::size_t>(n) * ntensors)
               throw py::value_error("batch_all_reduce: inputs must be n * len(counts) arrays with one dtype per tensor");
             std::vector<DType> types;
             for (int code : dtypes) types.push_back(dtype_from_code(code));
             const ReduceOp rop = reduce_op_from_code(op);
             const ReduceOp agreed = agreed_op_or(agreed_op, rop);
             py::gil_scoped_release nogil;
             GlooCommunicator::CallTimeout bound(call_timeout(timeout));
             c.batch_all_reduce(n, ntensors, in.data(), out.data(), counts.data(), types.data(), rop, bytes_per_pack,
                                num_packs, static_cast<Algorithm>(algorithm), agreed);
           },
           py::arg("n"), py::arg("inputs"), py::arg("outputs"), py::arg("counts"), py::arg("dtypes"), py::arg("op"),
           py::arg("bytes_per_pack"), py::arg("num_packs"), py::arg("algorithm"), py::arg("agreed_op") = -1,
           py::arg("timeout") = -1.0,
           "Tensors fused by the engines' packer; inputs and outputs replica-major (n * len(counts) arrays).")
      .def("close", [](GlooCommunicator& c) {
        py::gil_scoped_release nogil;
        c.close();
      }, "Closes the mesh now (peers blocked on this process fail at once); later calls raise.");

  py::class_<WorkerPlan>(m, "WorkerPlan")
      .def(py::init<py::object, const std::string&, int, py::dtype, std::vector<py::ssize_t>, int, int, int, int, int,
                    py::function, double>(),
           py::arg("comm"), py::arg("kind"), py::arg("n"), py::arg("dtype"), py::arg("shape"), py::arg("dtype_code"),
           py::arg("op"), py::arg("algorithm"), py::arg("root"), py::arg("agreed_op"), py::arg("alloc"),
           py::arg("timeout") = -1.0)
      .def("run", &WorkerPlan::run, py::arg("inputs"), py::arg("outputs"));

  py::class_<WorkerBatchPlan>(m, "WorkerBatchPlan")
      .def(py::init<py::object, int, std::vector<py::dtype>, std::vector<std::vector<py::ssize_t>>,
                    const std::vector<int>&, int, std::size_t, int, int, int, py::function, double>(),
           py::arg("comm"), py::arg("n"), py::arg("dtypes"), py::arg("shapes"), py::arg("dtype_codes"), py::arg("op"),
           py::arg("bytes_per_pack"), py::arg("num_packs"), py::arg("algorithm"), py::arg("agreed_op"),
           py::arg("alloc"), py::arg("timeout") = -1.0)
      .def("run", &WorkerBatchPlan::run, py::arg("per_replica_lists"));

  py::class_<WorkerGatherPlan>(m, "WorkerGatherPlan")
      .def(py::init<py::object, py::dtype, int, std::vector<std::vector<py::ssize_t>>, int, py::function, double>(),
           py::arg("comm"), py::arg("dtype"), py::arg("dtype_code"), py::arg("shapes"), py::arg("axis"),
           py::arg("alloc"), py::arg("timeout") = -1.0)
      .def("run", &WorkerGatherPlan::run, py::arg("inputs"));
}
