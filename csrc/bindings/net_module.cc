// mirrored._net: the rendezvous store and the Gloo communicator of a
// multi-worker job. Thin: arrays arrive validated by
// mirrored.collective_all_reduce; every call that can block releases the GIL.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <vector>

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

std::vector<const void*> inputs_of(const py::list& arrays) {
  std::vector<const void*> ptrs;
  for (const py::handle& h : arrays) ptrs.push_back(h.cast<py::array>().data());
  return ptrs;
}

std::vector<void*> outputs_of(const py::list& arrays) {
  std::vector<void*> ptrs;
  for (const py::handle& h : arrays) ptrs.push_back(h.cast<py::array>().mutable_data());  // raises if read-only
  return ptrs;
}

int size_of(const std::vector<const void*>& in, const std::vector<void*>& out) {
  if (in.size() != out.size()) throw py::value_error("inputs and outputs differ in length");
  return static_cast<int>(in.size());
}

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

// The hot path of CollectiveGroup.all_reduce([x], op, out=[x]): one
// contiguous, writeable, native-order NumPy array reduced in place, checked
// here in a few hundred nanoseconds. False, touching nothing, when the call
// needs the general path (Python validates and explains there).
bool all_reduce_in_place(GlooCommunicator& c, const py::list& buffers, int op, int algorithm) {
  if (buffers.size() != 1 || c.local_replicas() != 1) return false;
  const py::handle h = buffers[0];
  if (!py::array::check_(h)) return false;
  auto a = py::reinterpret_borrow<py::array>(h);
  constexpr int kNeed = py::detail::npy_api::NPY_ARRAY_C_CONTIGUOUS_ | py::detail::npy_api::NPY_ARRAY_WRITEABLE_;
  if ((a.flags() & kNeed) != kNeed) return false;
  const py::dtype dt = a.dtype();
  if (dt.byteorder() == '>') return false;
  const char kind = dt.kind();
  const auto size = dt.itemsize();
  int code = -1;
  if (kind == 'f') code = size == 2 ? 0 : size == 4 ? 2 : size == 8 ? 3 : -1;
  else if (kind == 'i') code = size == 1 ? 4 : size == 4 ? 6 : size == 8 ? 7 : -1;
  else if (kind == 'u') code = size == 1 ? 5 : -1;
  const ReduceOp rop = reduce_op_from_code(op);
  if (code < 0 || (rop == ReduceOp::kMean && kind != 'f')) return false;  // integer MEAN: float64 result
  void* data = a.mutable_data();
  const std::size_t count = static_cast<std::size_t>(a.size());
  const void* in[1] = {data};
  void* out[1] = {data};
  py::gil_scoped_release nogil;
  c.all_reduce(1, in, out, count, dtype_from_code(code), rop, static_cast<Algorithm>(algorithm));
  return true;
}

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

  py::register_exception<PeerTimeout>(m, "PeerTimeoutError", PyExc_TimeoutError);
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
              int op, int algorithm, int agreed_op) {
             auto in = inputs_of(inputs);
             auto out = outputs_of(outputs);
             const int n = size_of(in, out);
             const ReduceOp rop = reduce_op_from_code(op);
             const ReduceOp agreed = agreed_op < 0 ? rop : reduce_op_from_code(agreed_op);
             py::gil_scoped_release nogil;
             c.all_reduce_as(n, in.data(), out.data(), count, dtype_from_code(dtype), rop,
                             static_cast<Algorithm>(algorithm), agreed);
           },
           py::arg("inputs"), py::arg("outputs"), py::arg("count"), py::arg("dtype"), py::arg("op"),
           py::arg("algorithm"), py::arg("agreed_op") = -1,
           "agreed_op: the op the workers compare (default: op); an integer MEAN runs as a SUM but must "
           "still match the other workers' MEAN.")
      .def("all_reduce_in_place", &all_reduce_in_place, py::arg("buffers"), py::arg("op"), py::arg("algorithm"),
           "all_reduce of one contiguous array in place, if it qualifies for the fast path (else False).")
      .def("broadcast",
           [](GlooCommunicator& c, const py::list& inputs, const py::list& outputs, std::size_t count, int dtype,
              int root) {
             auto in = inputs_of(inputs);
             auto out = outputs_of(outputs);
             const int n = size_of(in, out);
             py::gil_scoped_release nogil;
             c.broadcast(n, in.data(), out.data(), count, dtype_from_code(dtype), root);
           })
      .def_property_readonly("shared_memory_off",
                             [](const GlooCommunicator& c) {
                               py::gil_scoped_release nogil;  // asks the store
                               return c.shared_memory_off();
                             },
                             "Why all-reduces do not use shared memory ('' when they do).")
      .def("reduce",
           [](GlooCommunicator& c, const py::list& inputs, const py::list& outputs, std::size_t count, int dtype,
              int op, int root, int agreed_op) {
             auto in = inputs_of(inputs);
             auto out = outputs_of(outputs);
             const int n = size_of(in, out);
             const ReduceOp rop = reduce_op_from_code(op);
             const ReduceOp agreed = agreed_op < 0 ? rop : reduce_op_from_code(agreed_op);
             py::gil_scoped_release nogil;
             c.reduce_as(n, in.data(), out.data(), count, dtype_from_code(dtype), rop, root, agreed);
           },
           py::arg("inputs"), py::arg("outputs"), py::arg("count"), py::arg("dtype"), py::arg("op"), py::arg("root"),
           py::arg("agreed_op") = -1, "agreed_op: as for all_reduce.")
      .def("all_gather",
           [](GlooCommunicator& c, const py::list& inputs, const py::list& outputs,
              const std::vector<std::size_t>& row_bytes, std::size_t outer) {
             auto in = inputs_of(inputs);
             auto out = outputs_of(outputs);
             const int n = size_of(in, out);
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
      .def("close", [](GlooCommunicator& c) {
        py::gil_scoped_release nogil;
        c.close();
      }, "Closes the mesh now (peers blocked on this process fail at once); later calls raise.");
}
