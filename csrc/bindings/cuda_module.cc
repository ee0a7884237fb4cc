// mirrored._cuda: collectives over CUDA device buffers (the CUDA ring and
// NCCL). Thin: buffers arrive as device pointers (integers) already validated
// by mirrored._cuda_collectives, streams as CUDA stream handles; the GIL is
// released while the work is queued. Imports without a driver or a GPU.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "cuda/cuda_ring.h"
#include "cuda/device.h"
#include "cuda/device_batch.h"
#include "cuda/stream_scope.h"
#include "nccl/nccl_communicator.h"

namespace py = pybind11;
using namespace mirrored;

namespace {

using Ptrs = std::vector<std::uintptr_t>;

// A device communicator and the fusion buffers its batches use.
struct Engine {
  Engine(std::vector<int> devices, std::unique_ptr<Communicator> c)
      : comm(std::move(c)), batch(std::move(devices)) {}
  std::unique_ptr<Communicator> comm;
  cuda::DeviceBatch batch;
};

template <typename T>
std::vector<T*> as_ptrs(const Ptrs& p) {
  std::vector<T*> v;
  v.reserve(p.size());
  for (auto x : p) v.push_back(reinterpret_cast<T*>(x));
  return v;
}

std::vector<cudaStream_t> as_streams(const Ptrs& s) { return as_ptrs<CUstream_st>(s); }

int size_of(const Ptrs& in, const Ptrs& out) {
  if (in.size() != out.size()) throw py::value_error("inputs and outputs differ in length");
  return static_cast<int>(in.size());
}

}  // namespace

PYBIND11_MODULE(_cuda, m) {
  m.doc() = "CUDA-buffer collectives of mirrored: the native ring over device memory, and NCCL loaded at run time.";

  m.def("device_count", &cuda::device_count, "GPUs the CUDA runtime sees; 0 without a driver or a GPU (never raises).");
  m.def("device_properties", [](int ordinal) {
    const auto p = cuda::device_properties(ordinal);
    py::dict d;
    d["name"] = p.name;
    d["total_memory"] = p.total_memory;
    d["multiprocessors"] = p.multiprocessors;
    d["compute_capability"] = py::make_tuple(p.major, p.minor);
    return d;
  });

  m.def("nccl_load", [](const std::vector<std::string>& candidates) {
    const auto& lib = nccl::load(candidates);
    return py::make_tuple(lib.path, lib.version);
  }, "Loads libnccl from the first loadable candidate path; returns (path, version code).");
  m.def("nccl_unique_id", [] { return py::bytes(nccl::unique_id()); });

  py::class_<Engine>(m, "Engine")
      .def_property_readonly("backend", [](const Engine& e) { return e.comm->backend(); })
      .def("all_reduce", [](Engine& e, const Ptrs& in, const Ptrs& out, std::size_t count, int dtype, int op,
                            int algorithm, const Ptrs& streams) {
        const int n = size_of(in, out);
        auto i = as_ptrs<const void>(in);
        auto o = as_ptrs<void>(out);
        py::gil_scoped_release nogil;
        cuda::StreamScope scope(as_streams(streams));
        e.comm->all_reduce(n, i.data(), o.data(), count, dtype_from_code(dtype), reduce_op_from_code(op),
                           static_cast<Algorithm>(algorithm));
      })
      .def("broadcast", [](Engine& e, const Ptrs& in, const Ptrs& out, std::size_t count, int dtype, int root,
                           const Ptrs& streams) {
        const int n = size_of(in, out);
        auto i = as_ptrs<const void>(in);
        auto o = as_ptrs<void>(out);
        py::gil_scoped_release nogil;
        cuda::StreamScope scope(as_streams(streams));
        e.comm->broadcast(n, i.data(), o.data(), count, dtype_from_code(dtype), root);
      })
      .def("reduce", [](Engine& e, const Ptrs& in, const Ptrs& out, std::size_t count, int dtype, int op, int root,
                        const Ptrs& streams) {
        const int n = size_of(in, out);
        auto i = as_ptrs<const void>(in);
        auto o = as_ptrs<void>(out);
        py::gil_scoped_release nogil;
        cuda::StreamScope scope(as_streams(streams));
        e.comm->reduce(n, i.data(), o.data(), count, dtype_from_code(dtype), reduce_op_from_code(op), root);
      })
      .def("all_gather", [](Engine& e, const Ptrs& in, const Ptrs& out, const std::vector<std::size_t>& row_bytes,
                            std::size_t outer, const Ptrs& streams) {
        const int n = size_of(in, out);
        if (row_bytes.size() != in.size()) throw py::value_error("row_bytes: need one entry per buffer");
        auto i = as_ptrs<const void>(in);
        auto o = as_ptrs<void>(out);
        py::gil_scoped_release nogil;
        cuda::StreamScope scope(as_streams(streams));
        e.comm->all_gather(n, i.data(), o.data(), row_bytes.data(), outer);
      })
      .def("batch_all_reduce", [](Engine& e, const std::vector<Ptrs>& in, const std::vector<Ptrs>& out,
                                  const std::vector<std::size_t>& counts, const std::vector<int>& dtypes, int op,
                                  std::size_t bytes_per_pack, int num_packs, int algorithm, const Ptrs& streams) {
        if (counts.size() != dtypes.size()) throw py::value_error("counts and dtypes differ in length");
        std::vector<std::vector<const void*>> i;
        std::vector<std::vector<void*>> o;
        for (const auto& p : in) i.push_back(as_ptrs<const void>(p));
        for (const auto& p : out) o.push_back(as_ptrs<void>(p));
        std::vector<DType> dts;
        for (int d : dtypes) dts.push_back(dtype_from_code(d));
        py::gil_scoped_release nogil;
        cuda::StreamScope scope(as_streams(streams));
        e.batch.all_reduce(*e.comm, i, o, counts, dts, reduce_op_from_code(op), static_cast<Algorithm>(algorithm),
                           bytes_per_pack, num_packs);
      });

  m.def("ring", [](const std::vector<int>& devices, std::size_t chunk_bytes, int channels) {
    return std::make_unique<Engine>(devices, std::make_unique<cuda::CudaRing>(devices, chunk_bytes, channels));
  }, py::arg("devices"), py::arg("chunk_bytes") = std::size_t(1) << 20, py::arg("channels") = 2,
     "The native ring over the GPUs `devices` (one rank each; repeats are logical GPUs).");
  m.def("nccl", [](const std::vector<int>& devices) {
    py::gil_scoped_release nogil;  // ncclCommInitAll may take seconds
    return std::make_unique<Engine>(devices, std::make_unique<nccl::NcclCommunicator>(devices));
  }, py::arg("devices"), "NCCL over local GPUs (call nccl_load first).");
  m.def("nccl_rank", [](const py::bytes& unique_id, int rank, int nranks, const std::vector<int>& devices) {
    std::string id = unique_id;
    py::gil_scoped_release nogil;  // waits for the other processes
    return std::make_unique<Engine>(devices, std::make_unique<nccl::NcclCommunicator>(id, rank, nranks, devices));
  }, py::arg("unique_id"), py::arg("rank"), py::arg("nranks"), py::arg("devices"),
     "This process's ranks rank.. rank+len(devices)-1 of an NCCL job of nranks sharing unique_id.");
}
