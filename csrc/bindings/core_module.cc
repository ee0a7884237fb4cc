// mirrored._core: the host collectives. Thin: take NumPy arrays already
// validated by mirrored.collectives, pull out their data pointers, release
// the GIL, run the collective.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "host/host_communicator.h"

namespace py = pybind11;
using namespace mirrored;

namespace {

HostCommunicator& comm() {
  static HostCommunicator* c = new HostCommunicator();  // lives as long as the pool
  return *c;
}

std::vector<const void*> inputs_of(const py::list& arrays, const char* argument) {
  std::vector<const void*> ptrs;
  ptrs.reserve(arrays.size());
  for (const py::handle& h : arrays) {
    if (!py::isinstance<py::array>(h)) throw py::type_error(std::string(argument) + ": expected NumPy arrays");
    ptrs.push_back(py::reinterpret_borrow<py::array>(h).data());
  }
  return ptrs;
}

std::vector<void*> outputs_of(const py::list& arrays, const char* argument) {
  std::vector<void*> ptrs;
  ptrs.reserve(arrays.size());
  for (const py::handle& h : arrays) {
    if (!py::isinstance<py::array>(h)) throw py::type_error(std::string(argument) + ": expected NumPy arrays");
    ptrs.push_back(py::reinterpret_borrow<py::array>(h).mutable_data());  // raises if read-only
  }
  return ptrs;
}

// The native dtype of a NumPy dtype, or -1 where the Python layer must
// decide (bfloat16 and other extension dtypes, non-native byte order).
int dtype_code_of(const py::dtype& dt) {
  if (dt.byteorder() == '>' || dt.byteorder() == '<') {
    // '<' is native on little-endian hosts, which are all we build for.
    if (dt.byteorder() == '>') return -1;
  }
  const char kind = dt.kind();
  const auto size = dt.itemsize();
  if (kind == 'f') return size == 2 ? 0 : size == 4 ? 2 : size == 8 ? 3 : -1;
  if (kind == 'i') return size == 1 ? 4 : size == 4 ? 6 : size == 8 ? 7 : -1;
  if (kind == 'u') return size == 1 ? 5 : -1;
  return -1;
}

int size_of(const std::vector<const void*>& in, const std::vector<void*>& out) {
  if (in.size() != out.size()) throw py::value_error("inputs and outputs differ in length");
  return static_cast<int>(in.size());
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "Host-memory collectives of mirrored (one call, all local replicas).";

  m.def("all_reduce", [](const py::list& inputs, const py::list& outputs, std::size_t count, int dtype, int op,
                         int algorithm, std::size_t ring_chunk_bytes) {
    auto in = inputs_of(inputs, "buffers");
    auto out = outputs_of(outputs, "out");
    const int n = size_of(in, out);
    py::gil_scoped_release nogil;
    comm().all_reduce(n, in.data(), out.data(), count, dtype_from_code(dtype), reduce_op_from_code(op),
                      static_cast<Algorithm>(algorithm), ring_chunk_bytes);
  }, py::arg("inputs"), py::arg("outputs"), py::arg("count"), py::arg("dtype"), py::arg("op"), py::arg("algorithm"),
     py::arg("ring_chunk_bytes") = 0);

  m.def("broadcast", [](const py::list& inputs, const py::list& outputs, std::size_t count, int dtype, int root) {
    auto in = inputs_of(inputs, "buffers");
    auto out = outputs_of(outputs, "out");
    const int n = size_of(in, out);
    py::gil_scoped_release nogil;
    comm().broadcast(n, in.data(), out.data(), count, dtype_from_code(dtype), root);
  });

  m.def("reduce", [](const py::list& inputs, const py::list& outputs, std::size_t count, int dtype, int op,
                     int root) {
    auto in = inputs_of(inputs, "buffers");
    auto out = outputs_of(outputs, "out");
    const int n = size_of(in, out);
    py::gil_scoped_release nogil;
    comm().reduce(n, in.data(), out.data(), count, dtype_from_code(dtype), reduce_op_from_code(op), root);
  });

  m.def("all_gather", [](const py::list& inputs, const py::list& outputs, const std::vector<std::size_t>& row_bytes,
                         std::size_t outer) {
    auto in = inputs_of(inputs, "buffers");
    auto out = outputs_of(outputs, "out");
    const int n = size_of(in, out);
    if (row_bytes.size() != in.size()) throw py::value_error("row_bytes needs one entry per buffer");
    py::gil_scoped_release nogil;
    comm().all_gather(n, in.data(), out.data(), row_bytes.data(), outer);
  });

  m.def("batch_all_reduce", [](int n, const py::list& inputs, const py::list& outputs,
                               const std::vector<std::size_t>& counts, const std::vector<int>& dtypes, int op,
                               std::size_t bytes_per_pack, int num_packs, int algorithm,
                               std::size_t ring_chunk_bytes) {
    auto in = inputs_of(inputs, "per_replica_lists");
    auto out = outputs_of(outputs, "out");
    size_of(in, out);
    const int ntensors = static_cast<int>(counts.size());
    if (dtypes.size() != counts.size() || in.size() != static_cast<std::size_t>(n) * ntensors)
      throw py::value_error("batch_all_reduce: inputs must be n * len(counts) arrays with one dtype per tensor");
    std::vector<DType> types;
    for (int code : dtypes) types.push_back(dtype_from_code(code));
    py::gil_scoped_release nogil;
    comm().batch_all_reduce(n, ntensors, in.data(), out.data(), counts.data(), types.data(), reduce_op_from_code(op),
                            bytes_per_pack, num_packs, static_cast<Algorithm>(algorithm), ring_chunk_bytes);
  });

  // The fast path of collectives.batch_all_reduce for many small tensors:
  // reads per_replica_lists[r][t] directly and makes the outputs as views of
  // one buffer per replica (from `alloc`), so the per-tensor cost is a few pointer reads
  // instead of Python-level checks and one allocation per tensor. Returns
  // None when any tensor is not a plain C-contiguous array of a built-in
  // dtype matching replica 0's; the Python layer then converts and reports.
  m.def("batch_all_reduce_lists", [](const py::sequence& lists, int op, std::size_t bytes_per_pack, int num_packs,
                                     int algorithm, std::size_t ring_chunk_bytes,
                                     const py::function& alloc) -> py::object {
    const auto n = static_cast<int>(lists.size());
    const auto T = static_cast<std::size_t>(py::len(lists[0]));
    std::vector<py::array> first(T);
    std::vector<std::size_t> counts(T), offsets(T);
    std::vector<DType> types(T);
    std::vector<const void*> in(n * T);
    std::size_t total = 0;
    for (int r = 0; r < n; ++r) {
      const py::sequence row = lists[r];
      for (std::size_t t = 0; t < T; ++t) {
        const py::object h = row[t];
        if (!py::isinstance<py::array>(h)) return py::none();
        const auto a = py::reinterpret_borrow<py::array>(h);
        if (!(a.flags() & py::array::c_style)) return py::none();
        if (r == 0) {
          const int code = dtype_code_of(a.dtype());
          if (code < 0) return py::none();
          first[t] = a;
          types[t] = dtype_from_code(code);
          counts[t] = static_cast<std::size_t>(a.size());
          offsets[t] = total;
          total += (counts[t] * a.itemsize() + 63) / 64 * 64;  // each output 64-byte aligned
        } else if (!a.dtype().is(first[t].dtype()) && !a.dtype().equal(first[t].dtype())) {
          return py::none();
        } else if (a.ndim() != first[t].ndim() ||
                   !std::equal(a.shape(), a.shape() + a.ndim(), first[t].shape())) {
          return py::none();
        }
        in[r * T + t] = a.data();
      }
    }
    // Shapes and strides once per tensor (replica 0's array is contiguous).
    std::vector<std::vector<py::ssize_t>> shapes(T), strides(T);
    std::vector<py::dtype> dtypes(T);
    for (std::size_t t = 0; t < T; ++t) {
      shapes[t].assign(first[t].shape(), first[t].shape() + first[t].ndim());
      strides[t].assign(first[t].strides(), first[t].strides() + first[t].ndim());
      dtypes[t] = first[t].dtype();
    }
    std::vector<void*> out(n * T);
    py::list result(n);
    for (int r = 0; r < n; ++r) {
      // alloc(nbytes) -> a uint8 array no one else uses (collectives' buffer recycler).
      auto flat = alloc(std::max<std::size_t>(total, 1)).cast<py::array_t<std::uint8_t>>();
      if (static_cast<std::size_t>(flat.size()) < std::max<std::size_t>(total, 1))
        throw py::value_error("batch_all_reduce_lists: alloc returned a buffer that is too small");
      auto* base = reinterpret_cast<char*>(flat.mutable_data());
      py::list row(T);
      for (std::size_t t = 0; t < T; ++t) {
        out[r * T + t] = base + offsets[t];
        row[t] = py::array(dtypes[t], shapes[t], strides[t], base + offsets[t], flat);
      }
      result[r] = std::move(row);
    }
    {
      py::gil_scoped_release nogil;
      comm().batch_all_reduce(n, static_cast<int>(T), in.data(), out.data(), counts.data(), types.data(),
                              reduce_op_from_code(op), bytes_per_pack, num_packs, static_cast<Algorithm>(algorithm),
                              ring_chunk_bytes);
    }
    return std::move(result);
  });

  m.def("choose_algorithm", [](int n, std::size_t bytes) { return algorithm_name(HostCommunicator::choose(n, bytes)); },
        "The algorithm 'auto' picks for n replicas of `bytes` each.");
  m.def("isa", [] { return std::string(comm().isa()); }, "Instruction set of the reduction kernels in use.");
  m.def("num_threads", [] { return ThreadPool::global().size(); }, "Threads of the host collective pool.");
}
