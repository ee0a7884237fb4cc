// mirrored._net: the rendezvous store and the Gloo communicator of a
// multi-worker job. Thin: arrays arrive validated by
// mirrored.collective_all_reduce; every call that can block releases the GIL.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <memory>
#include <vector>

#include "net/errors.h"
#include "net/gloo_communicator.h"
#include "net/store.h"

namespace py = pybind11;
using namespace mirrored;
using namespace mirrored::net;

namespace {

std::chrono::milliseconds millis(double seconds) {
  return std::chrono::milliseconds(static_cast<long long>(seconds * 1000.0));
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

  py::class_<Server>(m, "StoreServer")
      .def(py::init([](const std::string& host, int port, const std::string& token, int num_tasks) {
             return Server{std::make_unique<StoreServer>(host, port, token, num_tasks)};
           }),
           py::arg("host"), py::arg("port"), py::arg("token"), py::arg("num_tasks"))
      .def_property_readonly("port", [](const Server& s) { return s.impl ? s.impl->port() : -1; })
      .def("close", &Server::close);

  py::class_<StoreClient, std::shared_ptr<StoreClient>>(m, "StoreClient")
      .def(py::init([](const std::string& host, int port, const std::string& token, int rank,
                       const std::string& server_task, double timeout) {
             py::gil_scoped_release nogil;
             return std::make_shared<StoreClient>(host, port, token, rank, server_task, millis(timeout));
           }),
           py::arg("host"), py::arg("port"), py::arg("token"), py::arg("rank"), py::arg("server_task"),
           py::arg("timeout"))
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
             py::gil_scoped_release nogil;
             return std::make_unique<GlooCommunicator>(std::move(store), std::move(tasks), local_replicas, host,
                                                       millis(timeout), scope);
           }),
           py::arg("store"), py::arg("tasks"), py::arg("local_replicas"), py::arg("host"), py::arg("timeout"),
           py::arg("scope"))
      .def_property_readonly("rank", &GlooCommunicator::rank)
      .def_property_readonly("size", &GlooCommunicator::size)
      .def_property_readonly("local_replicas", &GlooCommunicator::local_replicas)
      .def("all_reduce",
           [](GlooCommunicator& c, const py::list& inputs, const py::list& outputs, std::size_t count, int dtype,
              int op, int algorithm) {
             auto in = inputs_of(inputs);
             auto out = outputs_of(outputs);
             const int n = size_of(in, out);
             py::gil_scoped_release nogil;
             c.all_reduce(n, in.data(), out.data(), count, dtype_from_code(dtype), reduce_op_from_code(op),
                          static_cast<Algorithm>(algorithm));
           })
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
              int op, int root) {
             auto in = inputs_of(inputs);
             auto out = outputs_of(outputs);
             const int n = size_of(in, out);
             py::gil_scoped_release nogil;
             c.reduce(n, in.data(), out.data(), count, dtype_from_code(dtype), reduce_op_from_code(op), root);
           })
      .def("all_gather",
           [](GlooCommunicator& c, const py::list& inputs, const py::list& outputs,
              const std::vector<std::size_t>& row_bytes, std::size_t outer) {
             auto in = inputs_of(inputs);
             auto out = outputs_of(outputs);
             const int n = size_of(in, out);
             if (row_bytes.size() != in.size()) throw py::value_error("row_bytes needs one entry per buffer");
             py::gil_scoped_release nogil;
             c.all_gather(n, in.data(), out.data(), row_bytes.data(), outer);
           })
      .def("exchange",
           [](GlooCommunicator& c, const std::vector<std::uint64_t>& mine) {
             py::gil_scoped_release nogil;
             return c.exchange(mine);
           },
           "Every process's list (all of one length), concatenated in rank order.")
      .def("barrier", [](GlooCommunicator& c) {
        py::gil_scoped_release nogil;
        c.barrier();
      })
      .def("close", [](GlooCommunicator& c) {
        py::gil_scoped_release nogil;
        c.close();
      }, "Closes the mesh now (peers blocked on this process fail at once); later calls raise.");
}
