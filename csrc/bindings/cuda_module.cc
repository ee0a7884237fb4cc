// mirrored._cuda: collectives over CUDA device buffers (the CUDA ring and
// NCCL). Thin: buffers arrive as device pointers (integers) already validated
// by mirrored.collective.cuda, streams as CUDA stream handles; the GIL is
// released while the work is queued. Imports without a driver or a GPU.
//
// Built a second time with MIRRORED_CUDA_SIM as mirrored._cuda_sim: the same
// module over the simulated CUDA runtime (csrc/cuda/sim) and the stand-in
// libnccl, plus a `sim` submodule that drives the simulated machine. The
// tests' CuPy stand-in (tests/fake_cupy.py) runs on it; users never load it
// (mirrored.device.engine selects it only when asked to).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "bindings/device_fit.h"
#include "bindings/result_ring.h"
#include "cuda/blas.h"
#include "cuda/cuda_ring.h"
#include "cuda/device.h"
#include "cuda/device_batch.h"
#include "cuda/fused_update.h"
#include "cuda/gradient_pack.h"
#include "cuda/scatter_rows.h"
#include "cuda/step_readback.h"
#include "cuda/check.h"
#include "cuda/stream_scope.h"
#include "nccl/hierarchical.h"
#include "nccl/nccl_communicator.h"

#ifdef MIRRORED_CUDA_SIM
#include "cuda/sim/sim_runtime.h"
#define MIRRORED_CUDA_MODULE _cuda_sim
#else
#define MIRRORED_CUDA_MODULE _cuda
#endif

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

// f() with CUDA device `device` current on this thread (the runtime's current device is per thread), the
// thread's own device current again after it.
template <typename F>
decltype(auto) on_device(int device, F&& f) {
  cuda::DeviceGuard guard;
  MIRRORED_CUDA_CHECK(cuda::set_device(device));
  return f();
}

// Whether an output overlaps an input other than its own replica's exactly (in place), or another
// output: the engine reads every input while it writes, so such a call goes to the validating path,
// which computes those outputs aside (collective/rules.py gpu_outputs) or refuses them. Device
// addresses of all GPUs share one space (unified addressing), so any two compare.
bool aliased(const std::vector<std::uintptr_t>& in, const std::vector<std::uintptr_t>& out, std::size_t bytes) {
  const auto overlap = [bytes](std::uintptr_t a, std::uintptr_t b) { return a < b + bytes && b < a + bytes; };
  for (std::size_t k = 0; bytes && k < out.size(); ++k) {
    for (std::size_t j = 0; j < in.size(); ++j)
      if (overlap(out[k], in[j]) && !(j == k && out[k] == in[j])) return true;
    for (std::size_t j = 0; j < k; ++j)
      if (overlap(out[k], out[j])) return true;
  }
  return false;
}

// Whether a stream (not the legacy default stream, which cannot be) is being captured into a CUDA graph.
// Each stream is asked once: replicas that share a GPU mostly share its stream.
bool any_capturing(const Ptrs& streams) {
  for (auto it = streams.begin(); it != streams.end(); ++it) {
    const std::uintptr_t s = *it;
    if (s == 0 || std::find(streams.begin(), it, s) != it) continue;
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    MIRRORED_CUDA_CHECK(cudaStreamIsCapturing(reinterpret_cast<cudaStream_t>(s), &status));
    if (status != cudaStreamCaptureStatusNone) return true;
  }
  return false;
}

// A plan's results for a call on `streams`: a set of `ring` that nobody else holds (result_ring.h), else
// make()'s (arrays replica-major, the pointers the plan writes to), kept in the ring unless the call is
// being captured (a graph writes its results at every replay: they are never handed out again). Returns
// the arrays as a list per replica (`per` arrays each; 0: one flat list) and sets `pointers`. The GIL held.
template <typename Make>
py::object recycled(bindings::ResultRing& ring, const Ptrs& streams, std::size_t per, Ptrs& pointers, Make make) {
  const auto lists = [per](const std::vector<py::object>& arrays) {
    if (per == 0) {
      py::list flat(arrays.size());
      for (std::size_t k = 0; k < arrays.size(); ++k) flat[k] = arrays[k];
      return flat;
    }
    py::list rows(arrays.size() / per);
    for (std::size_t r = 0; r < arrays.size() / per; ++r) {
      py::list row(per);
      for (std::size_t t = 0; t < per; ++t) row[t] = arrays[r * per + t];
      rows[r] = std::move(row);
    }
    return rows;
  };
  const bool captured = any_capturing(streams);
  std::vector<py::object> taken;
  if (!captured && ring.take(streams, taken, pointers)) return lists(taken);
  auto [arrays, made_pointers] = make();
  pointers = made_pointers;
  if (captured) return lists(arrays);
  // (make()'s temporaries are gone: only `arrays` holds the new results)
  return lists(ring.keep(std::move(arrays), std::move(made_pointers), streams));
}

// A planned all_reduce or broadcast of device arrays (mirrored.collective.cuda.CallPlan): the
// engine, algorithm, dtype and op or root, and what the arrays must be (bindings/device_fit.h).
class DeviceCallPlan {
 public:
  DeviceCallPlan(py::object engine, bool reduce, int algorithm, int dtype, int op, int root, std::size_t count,
                 bindings::DeviceFit fit)
      : engine_object_(std::move(engine)), engine_(engine_object_.cast<Engine*>()), reduce_(reduce),
        algorithm_(static_cast<Algorithm>(algorithm)), dtype_(dtype_from_code(dtype)),
        op_(reduce_op_from_code(op)), root_(root), count_(count), fit_(std::move(fit)) {}

  // Checks that the arrays fit, takes `out` (or when it is None a kept set of outputs nobody else
  // holds, else what alloc() returns: a list of arrays that fit), enqueues the collective on
  // streams() with the GIL released and returns the outputs; None, with nothing queued or
  // allocated, when an array does not fit. streams() is asked only once the arrays fit, so only
  // for GPUs that hold them: a plan kept from a machine with more GPUs is never asked for a gone one.
  py::object run(py::handle buffers, py::handle out, const py::function& stream_lookup, const py::function& alloc) {
    std::vector<std::uintptr_t> in, outs;
    if (!fit_.pointers(buffers, in)) return py::none();
    const Ptrs streams = stream_lookup().cast<Ptrs>();
    py::object result = py::reinterpret_borrow<py::object>(out);
    if (out.is(buffers)) {
      outs = in;  // in place: the same arrays, checked once
    } else if (out.is_none()) {
      result = new_outputs(streams, alloc, outs);
    } else if (!fit_.pointers(out, outs) || aliased(in, outs, count_ * dtype_size(dtype_))) {
      return py::none();
    }
    const int n = fit_.replicas();
    auto i = as_ptrs<const void>(in);
    auto o = as_ptrs<void>(outs);
    py::gil_scoped_release nogil;
    cuda::StreamScope scope(as_streams(streams));
    if (reduce_)
      engine_->comm->all_reduce(n, i.data(), o.data(), count_, dtype_, op_, algorithm_);
    else
      engine_->comm->broadcast(n, i.data(), o.data(), count_, dtype_, root_);
    return result;
  }

 private:
  // The outputs of a call without `out`: a kept set nobody else holds, or alloc()'s (result_ring.h).
  py::object new_outputs(const Ptrs& streams, const py::function& alloc, std::vector<std::uintptr_t>& outs) {
    return recycled(results_, streams, 0, outs, [&] {
      py::object made = alloc();
      if (!fit_.pointers(made, outs)) throw py::value_error("CallPlan.run: alloc() made outputs that do not fit");
      return std::make_pair(made.cast<std::vector<py::object>>(), outs);
    });
  }

  py::object engine_object_;  // keeps engine_ alive
  Engine* engine_;
  bool reduce_;
  Algorithm algorithm_;
  DType dtype_;
  ReduceOp op_;
  int root_;
  std::size_t count_;
  bindings::DeviceFit fit_;
  bindings::ResultRing results_;
};

// A planned batch all-reduce of device arrays (mirrored.collective.cuda.BatchPlan): the engine,
// algorithm, packing, each tensor's dtype, count and offset in its replica's one result buffer.
class DeviceBatchPlan {
 public:
  DeviceBatchPlan(py::object engine, int algorithm, int op, std::size_t bytes_per_pack, int num_packs,
                  const std::vector<int>& dtypes, std::vector<std::size_t> counts, std::vector<std::size_t> offsets,
                  bindings::DeviceFit fit)
      : engine_object_(std::move(engine)), engine_(engine_object_.cast<Engine*>()),
        algorithm_(static_cast<Algorithm>(algorithm)), op_(reduce_op_from_code(op)),
        offsets_(std::move(offsets)), fit_(std::move(fit)) {
    std::vector<DType> types;
    for (int d : dtypes) types.push_back(dtype_from_code(d));
    const std::size_t T = static_cast<std::size_t>(fit_.tensors());
    if (types.size() != T || counts.size() != T || offsets_.size() != T)
      throw py::value_error("BatchPlan: one dtype, count and offset per tensor");
    layout_ = cuda::DeviceBatch::plan(std::move(counts), std::move(types), bytes_per_pack, num_packs);
  }

  // Checks that every tensor fits, takes a kept set of results nobody else holds or calls alloc()
  // for (results, each replica's result buffer address), enqueues the batch on streams() (asked
  // once the tensors fit, as DeviceCallPlan::run says) with the GIL released (tensor t of replica r
  // lands at base[r] + offsets[t]) and returns the results; None, with nothing queued or
  // allocated, when a tensor does not fit.
  py::object run(py::handle lists, const py::function& stream_lookup, const py::function& alloc) {
    std::vector<std::uintptr_t> in;
    if (!fit_.batch_pointers(lists, in)) return py::none();
    const Ptrs streams = stream_lookup().cast<Ptrs>();
    const int n = fit_.replicas(), T = fit_.tensors();
    Ptrs bases;
    py::object results = recycled(results_, streams, static_cast<std::size_t>(T), bases, [&] {
      auto made = alloc().cast<std::pair<py::list, Ptrs>>();
      if (static_cast<int>(made.second.size()) != n || static_cast<int>(made.first.size()) != n)
        throw py::value_error("BatchPlan.run: alloc() must give one results list and one base per replica");
      std::vector<py::object> arrays;
      arrays.reserve(static_cast<std::size_t>(n) * T);
      for (py::handle row : made.first) {
        auto tensors = row.cast<py::list>();
        if (static_cast<int>(tensors.size()) != T)
          throw py::value_error("BatchPlan.run: alloc() must give one result per tensor and replica");
        for (py::handle a : tensors) arrays.push_back(py::reinterpret_borrow<py::object>(a));
      }
      return std::make_pair(std::move(arrays), std::move(made.second));
    });
    std::vector<std::vector<const void*>> i(n, std::vector<const void*>(T));
    std::vector<std::vector<void*>> o(n, std::vector<void*>(T));
    for (int r = 0; r < n; ++r)
      for (int t = 0; t < T; ++t) {
        i[r][t] = reinterpret_cast<const void*>(in[static_cast<std::size_t>(r) * T + t]);
        o[r][t] = reinterpret_cast<void*>(bases[r] + offsets_[t]);
      }
    {
      py::gil_scoped_release nogil;
      cuda::StreamScope scope(as_streams(streams));
      engine_->batch.all_reduce(*engine_->comm, i, o, layout_, op_, algorithm_);
    }
    return results;
  }

 private:
  py::object engine_object_;  // keeps engine_ alive
  Engine* engine_;
  Algorithm algorithm_;
  ReduceOp op_;
  cuda::DeviceBatch::Layout layout_;  // the packing, planned once
  std::vector<std::size_t> offsets_;
  bindings::DeviceFit fit_;
  bindings::ResultRing results_;
};

// The fit of a plan's arrays: their exact type, each replica's device, and per tensor
// (shape, strides, dtype, number of elements) as the planning call's arrays gave them.
bindings::DeviceFit device_fit(py::object array_type, std::vector<int> devices, const py::list& specs) {
  std::vector<bindings::DeviceSpec> s;
  for (auto spec : specs) {
    auto t = spec.cast<py::tuple>();
    if (t.size() != 4) throw py::value_error("specs: (shape, strides, dtype, size) per tensor");
    s.push_back({t[0], t[1], t[2], t[3].cast<std::size_t>() == 0});
  }
  if (s.empty()) throw py::value_error("specs: at least one tensor");
  return bindings::DeviceFit(std::move(array_type), std::move(devices), std::move(s));
}

// A collective's device buffers from Python's integers: n inputs and n outputs.
struct DeviceBuffers {
  std::vector<const void*> in;
  std::vector<void*> out;
  int n;
};

DeviceBuffers buffers_of(const Ptrs& in, const Ptrs& out) {
  if (in.size() != out.size()) throw py::value_error("inputs and outputs differ in length");
  return {as_ptrs<const void>(in), as_ptrs<void>(out), static_cast<int>(in.size())};
}

cuda::LossScaleGate gate_of(std::uintptr_t nonfinite, std::uintptr_t scale) {
  return {reinterpret_cast<const int*>(nonfinite), reinterpret_cast<const float*>(scale)};
}

// A rules::StepRows<T> of `values` (`rows` rows of `width` scalars, row r the step lower + r), as bytes of
// the struct: what the select kernel takes by value, or reads from device memory once uploaded.
template <typename T>
std::string step_rows_of(long long lower, int width, const std::vector<double>& values) {
  if (width < 1 || width > rules::kMaxRowWidth)
    throw py::value_error("width=" + std::to_string(width) + ": expected 1 to " + std::to_string(rules::kMaxRowWidth));
  const std::size_t rows = values.size() / static_cast<std::size_t>(width);
  if (rows < 1 || rows > static_cast<std::size_t>(rules::kMaxStepRows) || rows * width != values.size())
    throw py::value_error("values: " + std::to_string(values.size()) + " scalars; expected 1 to " +
                          std::to_string(rules::kMaxStepRows) + " rows of width=" + std::to_string(width));
  rules::StepRows<T> r{};
  r.lower = lower;
  r.rows = static_cast<int>(rows);
  r.width = width;
  for (std::size_t i = 0; i < values.size(); ++i) r.values[i] = static_cast<T>(values[i]);
  return std::string(reinterpret_cast<const char*>(&r), sizeof(r));
}

std::string step_rows(int dtype, long long lower, int width, const std::vector<double>& values) {
  switch (dtype_from_code(dtype)) {
    case DType::kFloat32: return step_rows_of<float>(lower, width, values);
    case DType::kFloat64: return step_rows_of<double>(lower, width, values);
    default: throw py::value_error("dtype: the step's rows are float32 or float64");
  }
}

py::tuple reading_of(const cuda::StepReadback::Reading& r) {
  return py::make_tuple(r.tag, r.status.step, r.status.outside != 0);
}

// A dynamic loss scale's step on the GPU: the host's rows of candidate scalars, the device's pick by its own
// `iterations` (cuda/fused_update.h select_step_row), and the count read back without a wait
// (cuda/step_readback.h). Used by mirrored.train.optimizers.step_window.
void def_step_window(py::module_& m) {
  m.attr("MAX_STEP_ROWS") = rules::kMaxStepRows;
  m.def("step_rows", [](int dtype, long long lower, int width, const std::vector<double>& values) {
          return py::bytes(step_rows(dtype, lower, width, values));
        },
        py::arg("dtype"), py::arg("lower"), py::arg("width"), py::arg("values"),
        "The rows of steps lower, lower + 1, ... (`width` scalars each, row after row in `values`) as the bytes\n"
        "of the device struct select_step_row_from_device reads (upload them into a buffer that large).");
  m.def("select_step_row", [](int device, int dtype, std::uintptr_t iterations, long long lower, int width,
                              const std::vector<double>& values, std::uintptr_t out, std::uintptr_t status,
                              std::uintptr_t stream) {
          const std::string rows = step_rows(dtype, lower, width, values);
          py::gil_scoped_release nogil;
          on_device(device, [&] {
            cuda::select_step_row(dtype_from_code(dtype), reinterpret_cast<const long long*>(iterations), rows.data(),
                                  reinterpret_cast<void*>(out), reinterpret_cast<rules::StepStatus*>(status),
                                  reinterpret_cast<cudaStream_t>(stream));
          });
        },
        py::arg("device"), py::arg("dtype"), py::arg("iterations"), py::arg("lower"), py::arg("width"),
        py::arg("values"), py::arg("out"), py::arg("status"), py::arg("stream"),
        "One thread on `stream`: out[:width] = the row of step *iterations (int64) among the rows of steps\n"
        "lower, lower + 1, ... (passed by value with the launch), and *status = (that step, 1 if it was outside\n"
        "the rows: `out` then NaN).");
  m.def("select_step_row_from_device", [](int device, int dtype, std::uintptr_t iterations, std::uintptr_t rows,
                                          std::uintptr_t out, std::uintptr_t status, std::uintptr_t stream) {
          // The GIL held, as apply_captured: it is recorded into a graph in the order the step issues it.
          on_device(device, [&] {
            cuda::select_step_row_from_device(dtype_from_code(dtype), reinterpret_cast<const long long*>(iterations),
                                              reinterpret_cast<const void*>(rows), reinterpret_cast<void*>(out),
                                              reinterpret_cast<rules::StepStatus*>(status),
                                              reinterpret_cast<cudaStream_t>(stream));
          });
        },
        py::arg("device"), py::arg("dtype"), py::arg("iterations"), py::arg("rows"), py::arg("out"),
        py::arg("status"), py::arg("stream"),
        "select_step_row with the rows read from device memory `rows` (step_rows' bytes, uploaded) when it runs.");
  py::class_<cuda::StepReadback>(m, "StepReadback", py::module_local())
      .def(py::init([](int device, int slots) {
             return on_device(device, [&] { return std::make_unique<cuda::StepReadback>(device, slots); });
           }),
           py::arg("device"), py::arg("slots"))
      .def_property_readonly("in_flight", &cuda::StepReadback::in_flight)
      .def("record", [](cuda::StepReadback& r, std::uintptr_t status, long long tag, std::uintptr_t stream) {
             return on_device(r.device(), [&] {
               return r.record(reinterpret_cast<const rules::StepStatus*>(status), tag,
                               reinterpret_cast<cudaStream_t>(stream));
             });
           },
           py::arg("status"), py::arg("tag"), py::arg("stream"),
           "Queues on `stream` the copy of the device StepStatus `status` (int64 step, int64 outside) into a pinned\n"
           "slot, tagged `tag`; False (nothing queued) when every slot is in flight.")
      .def("arrived", [](cuda::StepReadback& r) {
             py::list out;
             for (const auto& reading : on_device(r.device(), [&] { return r.arrived(); }))
               out.append(reading_of(reading));
             return out;
           },
           "The copies that have arrived, oldest first, as (tag, step, outside); never waits.")
      .def("wait", [](cuda::StepReadback& r, int n) {
             std::vector<cuda::StepReadback::Reading> readings;
             {
               py::gil_scoped_release nogil;
               readings = on_device(r.device(), [&] { return r.wait(n); });
             }
             py::list out;
             for (const auto& reading : readings) out.append(reading_of(reading));
             return out;
           },
           py::arg("n"),
           "Waits for the n-th oldest copy in flight (clamped to those in flight), then returns arrived().");
}

// Variable k's shape as Adafactor factors it (rules::FactoredShape), checked against its count.
rules::FactoredShape factored_shape(const std::vector<std::size_t>& shape, std::size_t count, std::size_t k) {
  std::size_t elements = 1;
  for (std::size_t d : shape) elements *= d;
  if (elements != count)
    throw py::value_error("shapes[" + std::to_string(k) + "]: " + std::to_string(elements) +
                          " elements, counts[" + std::to_string(k) + "] is " + std::to_string(count));
  return rules::factored_shape(shape.size(), [&](std::size_t d) { return shape[d]; });
}

// The fused optimizer update (cuda/fused_update.h): one table per device and
// dtype of a variable set, made once by mirrored.train.optimizers; each step
// is one launch. Pointers arrive as integers, validated by the caller.
void def_fused_update(py::module_& m) {
  py::class_<cuda::FusedUpdateTable>(m, "FusedUpdateTable", py::module_local())  // local: _cuda and _cuda_sim both bind it
      .def(py::init([](int device, int dtype, const Ptrs& weights, const std::vector<Ptrs>& slots,
                       const std::vector<std::size_t>& counts, const std::vector<bool>& decay,
                       const std::optional<std::vector<std::vector<std::size_t>>>& shapes) {
             const std::size_t n = weights.size();
             if (slots.size() != n || counts.size() != n || decay.size() != n || (shapes && shapes->size() != n))
               throw py::value_error("weights, slots, counts, decay (and shapes) must have one entry per variable");
             std::vector<cuda::FusedVariable> variables(n);
             for (std::size_t k = 0; k < n; ++k) {
               if (slots[k].size() > static_cast<std::size_t>(rules::kMaxSlots))
                 throw py::value_error("slots[" + std::to_string(k) + "]: at most " +
                                       std::to_string(rules::kMaxSlots) + " slots");
               cuda::FusedVariable& v = variables[k];
               v.weight = reinterpret_cast<void*>(weights[k]);
               for (int j = 0; j < rules::kMaxSlots; ++j)
                 v.slots[j] = j < static_cast<int>(slots[k].size()) ? reinterpret_cast<void*>(slots[k][j]) : nullptr;
               v.count = counts[k];
               v.decay = decay[k];
               if (shapes) v.shape = factored_shape((*shapes)[k], counts[k], k);
             }
             return std::make_unique<cuda::FusedUpdateTable>(device, dtype_from_code(dtype), variables,
                                                             shapes.has_value());
           }),
           py::arg("device"), py::arg("dtype"), py::arg("weights"), py::arg("slots"), py::arg("counts"),
           py::arg("decay"), py::arg("shapes") = py::none(),
           "`shapes` (Adafactor's tables): each variable's shape, whose last two axes its factored moments\n"
           "reduce over (slots r, c and velocity; fewer than 2 dims: velocity only, r and c untouched).")
      .def_property_readonly("device", &cuda::FusedUpdateTable::device)
      .def_property_readonly("total_count", &cuda::FusedUpdateTable::total_count,
                             "Elements of the packed gradients apply() reads.")
      .def("apply", [](cuda::FusedUpdateTable& t, int rule, std::uintptr_t grads,
                       const std::vector<double>& coefficients, double weight_decay, double lr, std::uintptr_t stream,
                       std::uintptr_t nonfinite, std::uintptr_t scale, std::uintptr_t squares) {
             const std::string error = rules::coefficients_error(rule, coefficients.size());
             if (!error.empty()) throw py::value_error(error);
             py::gil_scoped_release nogil;
             on_device(t.device(), [&] {
               t.apply(static_cast<rules::Rule>(rule), reinterpret_cast<const void*>(grads), coefficients,
                       weight_decay, lr, reinterpret_cast<cudaStream_t>(stream), gate_of(nonfinite, scale),
                       reinterpret_cast<const void*>(squares));
             });
           },
           py::arg("rule"), py::arg("grads"), py::arg("coefficients"), py::arg("weight_decay"), py::arg("lr"),
           py::arg("stream"), py::arg("nonfinite") = 0, py::arg("scale") = 0, py::arg("squares") = 0,
           "Weight decay (where decay[k]) and the rule on every variable, in place, in one launch on `stream`\n"
           "(Lamb: four, over a scratch buffer its first update allocates);\n"
           "`grads`: the packed gradients (total_count elements, the variables' back to back). A loss-scaled\n"
           "step passes `nonfinite` (a device int32: nonzero skips every write) and `scale` (a device float32\n"
           "each gradient is divided by), both read when the kernel runs. `squares` (optional, packed like\n"
           "`grads`, no `scale` with it): what a squaring rule reads in place of grad * grad.")
      .def("apply_from_device", [](cuda::FusedUpdateTable& t, int rule, std::uintptr_t grads, std::uintptr_t scalars,
                                   int coefficients, std::uintptr_t stream, std::uintptr_t nonfinite,
                                   std::uintptr_t scale, std::uintptr_t squares) {
             const std::string error = rules::coefficients_error(rule, static_cast<std::size_t>(coefficients));
             if (!error.empty()) throw py::value_error(error);
             py::gil_scoped_release nogil;
             on_device(t.device(), [&] {
               t.apply_from_device(static_cast<rules::Rule>(rule), reinterpret_cast<const void*>(grads),
                                   reinterpret_cast<const void*>(scalars), coefficients,
                                   reinterpret_cast<cudaStream_t>(stream), gate_of(nonfinite, scale),
                                   reinterpret_cast<const void*>(squares));
             });
           },
           py::arg("rule"), py::arg("grads"), py::arg("scalars"), py::arg("coefficients"), py::arg("stream"),
           py::arg("nonfinite") = 0, py::arg("scale") = 0, py::arg("squares") = 0,
           "apply() with the scalars read when the kernel runs from `scalars`, a device buffer of the table's\n"
           "dtype (the rule's `coefficients` values, then weight decay's rate and lr), e.g. select_step_row's.")
      .def("apply_captured", [](cuda::FusedUpdateTable& t, int rule, std::uintptr_t grads, std::uintptr_t scalars,
                                int coefficients, std::uintptr_t stream, std::uintptr_t nonfinite,
                                std::uintptr_t scale, std::uintptr_t squares) {
             const std::string error = rules::coefficients_error(rule, static_cast<std::size_t>(coefficients));
             if (!error.empty()) throw py::value_error(error);
             // The GIL held: this records (no wait), and the replica threads' captured work must enter
             // the graph in the order the Python step issues it (released, replays read garbage results).
             on_device(t.device(), [&] {
               t.apply_captured(static_cast<rules::Rule>(rule), reinterpret_cast<const void*>(grads),
                                reinterpret_cast<const void*>(scalars), coefficients,
                                reinterpret_cast<cudaStream_t>(stream), gate_of(nonfinite, scale),
                                reinterpret_cast<const void*>(squares));
             });
           },
           py::arg("rule"), py::arg("grads"), py::arg("scalars"), py::arg("coefficients"), py::arg("stream"),
           py::arg("nonfinite") = 0, py::arg("scale") = 0, py::arg("squares") = 0,
           "apply() for a step being captured on `stream` (md.function): the upload and the launch are recorded,\n"
           "the scalars read at each replay from `scalars`, a device buffer of the table's dtype holding the\n"
           "rule's `coefficients` values, then weight decay's rate and lr. The table then serves that graph only.")
      .def("check_finite", [](const cuda::FusedUpdateTable& t, std::uintptr_t grads, std::uintptr_t nonfinite,
                              std::uintptr_t stream) {
             // The GIL held, as apply_captured: it may be recorded into a graph.
             on_device(t.device(), [&] {
               t.check_finite(reinterpret_cast<const void*>(grads), reinterpret_cast<int*>(nonfinite),
                              reinterpret_cast<cudaStream_t>(stream));
             });
           },
           py::arg("grads"), py::arg("nonfinite"), py::arg("stream"),
           "Sets the device int32 `nonfinite` to 1 when one of the packed gradients `grads` (total_count\n"
           "elements) is inf or nan, in one launch on `stream`; leaves it otherwise.");
  m.def("loss_scale_step", [](int device, std::uintptr_t nonfinite, std::uintptr_t scale, std::uintptr_t counter,
                              std::uintptr_t iterations, long long growth_steps, bool dynamic, std::uintptr_t stream) {
          on_device(device, [&] {
            cuda::loss_scale_step(reinterpret_cast<int*>(nonfinite), reinterpret_cast<float*>(scale),
                                  reinterpret_cast<long long*>(counter), reinterpret_cast<long long*>(iterations),
                                  growth_steps, dynamic, reinterpret_cast<cudaStream_t>(stream));
          });
        },
        py::arg("device"), py::arg("nonfinite"), py::arg("scale"), py::arg("counter"), py::arg("iterations"),
        py::arg("growth_steps"), py::arg("dynamic"), py::arg("stream"),
        "LossScaleOptimizer's state after a step's gated updates, on device `device` in one launch on `stream`\n"
        "(Keras' rules): a step whose `nonfinite` (int32) is set halves a dynamic `scale` (float32) and zeroes\n"
        "`counter` (int64); a finite one adds 1 to `iterations` (int64) and doubles a dynamic scale after\n"
        "`growth_steps` in a row. `nonfinite` is cleared for the next step.");

  py::class_<cuda::GradientPack>(m, "GradientPack", py::module_local())
      .def(py::init([](int device, const Ptrs& dst, const std::vector<std::size_t>& bytes) {
             return std::make_unique<cuda::GradientPack>(device, as_ptrs<void>(dst), bytes);
           }),
           py::arg("device"), py::arg("dst"), py::arg("bytes"))
      .def_property_readonly("device", &cuda::GradientPack::device)
      .def("__len__", &cuda::GradientPack::size)
      .def("copy", [](cuda::GradientPack& p, const Ptrs& src, std::uintptr_t stream) {
             const auto sources = as_ptrs<const void>(src);
             py::gil_scoped_release nogil;  // may wait for an earlier upload to have read a host table
             on_device(p.device(), [&] { p.copy(sources, reinterpret_cast<cudaStream_t>(stream)); });
           },
           py::arg("src"), py::arg("stream"),
           "dst[k] = src[k] (bytes[k] each) for every k in one launch on `stream`; the table is uploaded\n"
           "again only when a source moved since the last call.")
      .def("copy_captured", [](cuda::GradientPack& p, const Ptrs& src, std::uintptr_t stream) {
             // The GIL held, as apply_captured: recorded in the order the Python step issues it.
             on_device(p.device(),
                       [&] { p.copy_captured(as_ptrs<const void>(src), reinterpret_cast<cudaStream_t>(stream)); });
           },
           py::arg("src"), py::arg("stream"),
           "copy() recorded into the graph `stream` is capturing (md.function): the upload from the pack's\n"
           "pinned table and the launch. The pack then serves that graph only and must live as long.");
}

// An IndexedSlices densified on a GPU, each row's slices added in slice order
// (cuda/scatter_rows.h). Pointers arrive as integers, checked by
// mirrored.device.indexed_slices.
void def_scatter_rows(py::module_& m) {
  m.def("scatter_rows_workspace_bytes", &cuda::scatter_rows_workspace_bytes, py::arg("slices"), py::arg("rows"),
        "Bytes of device memory scatter_add_rows takes as its workspace.");
  m.def("scatter_add_rows", [](int device, int dtype, std::uintptr_t values, std::uintptr_t indices,
                               bool wide_indices, std::size_t slices, std::size_t width, std::size_t rows,
                               std::uintptr_t out, std::uintptr_t squares, bool accumulate, std::uintptr_t workspace,
                               std::uintptr_t stream) {
          cuda::ScatterRows a;
          a.dtype = dtype_from_code(dtype);
          a.values = reinterpret_cast<const void*>(values);
          a.indices = reinterpret_cast<const void*>(indices);
          a.wide_indices = wide_indices;
          a.slices = slices, a.width = width, a.rows = rows;
          a.out = reinterpret_cast<void*>(out);
          a.squares = reinterpret_cast<void*>(squares);
          a.accumulate = accumulate;
          // The GIL held, as apply_captured: launches only (no wait), which may be recorded into a graph
          // in the order the Python step issues them.
          on_device(device, [&] {
            int sms = 1;
            MIRRORED_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
            cuda::scatter_add_rows(a, reinterpret_cast<void*>(workspace), sms,
                                   reinterpret_cast<cudaStream_t>(stream));
          });
        },
        py::arg("device"), py::arg("dtype"), py::arg("values"), py::arg("indices"), py::arg("wide_indices"),
        py::arg("slices"), py::arg("width"), py::arg("rows"), py::arg("out"), py::arg("squares"),
        py::arg("accumulate"), py::arg("workspace"), py::arg("stream"),
        "out[indices[i]] += values[i] (and squares[indices[i]] += values[i] ** 2 unless squares is 0) on\n"
        "`stream`, each row's slices added in ascending i; indices outside [0, rows) dropped; with\n"
        "accumulate False, out and squares are overwritten (rows not named become 0). `values`: slices x width,\n"
        "`out`: rows x width, C order; indices int64 (wide_indices) or int32; `workspace`:\n"
        "scatter_rows_workspace_bytes(slices, rows) bytes of the device's memory. Six launches, no wait.");
}

#ifdef MIRRORED_CUDA_SIM
namespace sim = cuda::sim;

// The Python stack of the thread whose native id is `native_id` (threading's native_id), as
// traceback.format_stack writes it after a header line; empty when no Python thread has that id.
std::string python_stack_of(long native_id) {
  try {
    py::object frames = py::module_::import("sys").attr("_current_frames")();
    for (py::handle t : py::module_::import("threading").attr("enumerate")()) {
      py::object id = t.attr("native_id");
      if (id.is_none() || id.cast<long>() != native_id) continue;
      py::object frame = frames.attr("get")(t.attr("ident"));
      if (frame.is_none()) return "";
      py::object lines = py::module_::import("traceback").attr("format_stack")(frame);
      return "\nThe holder's Python stack (" + py::str(t).cast<std::string>() + ", most recent call last):\n" +
             py::str("").attr("join")(lines).cast<std::string>();
    }
  } catch (const std::exception&) {  // (py::error_already_set clears Python's error as it is made)
  }
  return "";
}

// A thread that must wait for the simulated machine lets go of the GIL
// meanwhile: the holder may be draining work that needs it. A wait that
// times out (a deadlock, sim_runtime.h) adds the holder's Python stack.
void release_gil_while_blocked(void (*wait)()) {
  if (!PyGILState_Check()) return wait();
  try {
    py::gil_scoped_release nogil;
    wait();
  } catch (const std::logic_error& e) {  // (the GIL is held again here)
    throw std::logic_error(e.what() + python_stack_of(sim::machine_holder()));
  }
}

// A Python callable queued as a kernel: called, and dropped, under the GIL
// whichever thread drains the queue.
std::shared_ptr<py::function> gil_owned(py::function f) {
  return std::shared_ptr<py::function>(new py::function(std::move(f)), [](py::function* p) {
    py::gil_scoped_acquire gil;
    delete p;
  });
}

// Python's cyclic garbage collector held off while a kernel runs (the GIL
// held): a collection there would run finalizers (a dead optimizer's update
// tables, a dead md.function's graphs) inside GPU work, and their host waits
// would drain the work queued behind the running kernel before it. They run
// at the next allocation after it instead, on the host's side, as on a GPU.
class NoCollection {
 public:
  NoCollection() : was_enabled_(disable()) {}
  ~NoCollection() {
    if (was_enabled_) enable();
  }
  NoCollection(const NoCollection&) = delete;
  NoCollection& operator=(const NoCollection&) = delete;

 private:
#if PY_VERSION_HEX >= 0x030A0000
  static bool disable() { return PyGC_Disable() != 0; }
  static void enable() { PyGC_Enable(); }
#else
  static bool disable() {
    py::module_ gc = py::module_::import("gc");
    const bool was = gc.attr("isenabled")().cast<bool>();
    gc.attr("disable")();
    return was;
  }
  static void enable() { py::module_::import("gc").attr("enable")(); }
#endif
  bool was_enabled_;
};

// A kernel runs in a context of its own (contextvars), as GPU work sees none
// of the host's: a finalizer's host wait can drain kernels in the middle of a
// host thread's ContextVar.set (a collection due at its allocation), and a
// kernel's own set (NumPy's errstate) on that thread's context would free the
// variables that set is still reading.
class OwnContext {
 public:
  OwnContext() : context_(PyContext_New()) {
    if (!context_ || PyContext_Enter(context_) != 0) {
      Py_XDECREF(context_);
      throw py::error_already_set();
    }
  }
  ~OwnContext() {
    PyContext_Exit(context_);
    Py_DECREF(context_);
  }
  OwnContext(const OwnContext&) = delete;
  OwnContext& operator=(const OwnContext&) = delete;

 private:
  PyObject* context_;
};

cudaStream_t stream_of(std::uintptr_t handle) { return reinterpret_cast<cudaStream_t>(handle); }
cudaEvent_t event_of(std::uintptr_t handle) { return reinterpret_cast<cudaEvent_t>(handle); }

void check_device(int device) {
  int n = 0;
  cudaGetDeviceCount(&n);
  if (device < 0 || device >= n)
    throw py::value_error("device=" + std::to_string(device) + " is not a simulated GPU (" + std::to_string(n) +
                          " configured by sim.reset)");
}

// on_device() for a device number from a test, checked first.
template <typename F>
decltype(auto) on_simulated(int device, F&& f) {
  check_device(device);
  return on_device(device, std::forward<F>(f));
}

void def_sim(py::module_& m) {
  auto s = m.def_submodule("sim", "The simulated CUDA machine under this engine (tests only).");
  sim::set_block_hook(&release_gil_while_blocked);
  s.def("reset", [](int devices, const std::vector<std::pair<int, int>>& peers, unsigned seed) {
    if (devices < 1) throw py::value_error("devices must be at least 1");
    sim::reset(devices, {peers.begin(), peers.end()}, seed);
  }, py::arg("devices"), py::arg("peers"), py::arg("seed"),
     "Configures `devices` GPUs; kernels of a may read b's memory iff (a, b) is in peers; seed picks drain orders.");
  s.def("set_lock_seconds", [](double seconds) {
    if (!(seconds > 0)) throw py::value_error("seconds must be positive (the longest a thread waits for the machine)");
    sim::set_lock_seconds(seconds);
  }, py::arg("seconds"),
     "How long a thread waits for the machine's lock before the call fails naming the holder (a deadlock); "
     "reset() sets MIRRORED_SIM_LOCK_SECONDS's, else 600.");
  s.def("lock_seconds", [] { return sim::lock_seconds(); });
  s.def("drain", [] {
    py::gil_scoped_release nogil;
    sim::drain();
  }, "Runs every queued kernel and copy, in a random order that respects streams and events.");
  s.def("counters", [] {
    const sim::Counters c = sim::counters();
    py::dict d;
    d["launches"] = c.launches;
    d["graph_launches"] = c.graph_launches;
    d["graph_branches"] = c.graph_branches;
    d["kernels"] = c.kernels;
    d["blas"] = c.blas;
    d["stream_ops"] = c.stream_ops;
    d["host_waits"] = c.host_waits;
    d["calls"] = c.calls;
    return d;
  }, "Engine kernel launches, graph launches and the branches they replayed, stand-in kernels and stand-in cuBLAS products per device, stream operations (records, "
     "waits, copies, syncs), host waits for the GPU (synchronisations, cudaFree) and runtime calls by name (cudaSetDevice: ...) "
     "since reset_counters().");
  s.def("reset_counters", [] { sim::reset_counters(); });
  s.def("current_device", [] { return sim::current_device(); },
        "The calling thread's current device (cudaGetDevice, not counted: CuPy's own calls are not the engine's).");
  s.def("set_current_device", [](int device) {
    check_device(device);
    sim::set_current_device(device);
  }, py::arg("device"), "cudaSetDevice for the calling thread, not counted (CuPy's Device.use).");
  s.def("malloc", [](std::size_t bytes, int device) {
    check_device(device);
    return reinterpret_cast<std::uintptr_t>(sim::allocate(bytes, device));
  }, py::arg("bytes"), py::arg("device"),
     "Device memory (filled with 0xcd) on `device`; 0 when the device's memory limit leaves no room.");
  s.def("set_device_memory_limit", [](std::size_t bytes) { sim::set_device_memory_limit(bytes); }, py::arg("bytes"),
        "Each GPU's memory in bytes (0: no limit; reset() sets MIRRORED_SIM_DEVICE_BYTES's): cudaMalloc and "
        "malloc past it fail.");
  s.def("device_memory_limit", [] { return sim::device_memory_limit(); });
  s.def("bytes_in_use", [](int device) {
    check_device(device);
    return sim::device_bytes_in_use(device);
  }, py::arg("device"), "The device's live memory (cudaMalloc's and malloc's), in bytes.");
  s.def("free", [](std::uintptr_t p, std::uintptr_t stream) {
    const int device = sim::device_of_pointer(reinterpret_cast<void*>(p));
    if (device < 0) throw py::value_error("free: not live simulated device memory");
    on_simulated(device, [&] { sim::release(reinterpret_cast<void*>(p), stream_of(stream)); return 0; });
  }, py::arg("ptr"), py::arg("stream"), "Poisons the memory (0xdb) in the order of `stream`, then forgets it.");
  s.def("device_of", [](std::uintptr_t p) { return sim::device_of_pointer(reinterpret_cast<void*>(p)); },
        "The device of live simulated memory at p; -1 for anything else.");
  s.def("stream_device", [](std::uintptr_t stream, int device) {
    return on_simulated(device, [&] { return sim::device_of_stream(stream_of(stream)); });
  });
  s.def("stream_create", [](int device, bool non_blocking) {
    return on_simulated(device, [&] {
      cudaStream_t st = nullptr;
      cudaStreamCreateWithFlags(&st, non_blocking ? cudaStreamNonBlocking : cudaStreamDefault);
      return reinterpret_cast<std::uintptr_t>(st);
    });
  }, py::arg("device"), py::arg("non_blocking"));
  s.def("event_create", [](int device) {
    return on_simulated(device, [&] {
      cudaEvent_t e = nullptr;
      cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
      return reinterpret_cast<std::uintptr_t>(e);
    });
  });
  s.def("event_destroy", [](std::uintptr_t e) { cudaEventDestroy(event_of(e)); });
  s.def("event_record", [](std::uintptr_t e, std::uintptr_t stream, int device) {
    on_simulated(device, [&] {
      MIRRORED_CUDA_CHECK(cudaEventRecord(event_of(e), stream_of(stream)));  // on the event's device only
      return 0;
    });
  });
  s.def("stream_wait_event", [](std::uintptr_t stream, std::uintptr_t e, int device) {
    on_simulated(device, [&] {
      MIRRORED_CUDA_CHECK(cudaStreamWaitEvent(stream_of(stream), event_of(e), 0));
      return 0;
    });
  });
  s.def("synchronize_stream", [](std::uintptr_t stream, int device) {
    on_simulated(device, [&] {
      py::gil_scoped_release nogil;
      MIRRORED_CUDA_CHECK(cudaStreamSynchronize(stream_of(stream)));
      return 0;
    });
  }, "Runs queued work until the stream's own is done (a null stream is the device's).");
  s.def("synchronize_event", [](std::uintptr_t e) {
    py::gil_scoped_release nogil;
    MIRRORED_CUDA_CHECK(cudaEventSynchronize(event_of(e)));
  });
  s.def("event_done", [](std::uintptr_t e) { return cudaEventQuery(event_of(e)) == cudaSuccess; });
  s.def("launch", [](std::uintptr_t stream, int device, py::function fn) {
    on_simulated(device, [&] {
      if (sim::device_of_stream(stream_of(stream)) != device)
        throw py::value_error("launch: the stream belongs to another device");
      auto f = gil_owned(std::move(fn));
      sim::launch_kernel(stream_of(stream), [f] {
        py::gil_scoped_acquire gil;
        NoCollection no_collection;
        OwnContext own_context;
        (*f)();
      });
      return 0;
    });
  }, py::arg("stream"), py::arg("device"), py::arg("fn"),
     "Queues fn() on the stream as a kernel of `device` (counted in counters()['kernels'], not as an engine launch).");
  s.def("copy_from_host", [](std::uintptr_t stream, int device, std::uintptr_t dst, py::bytes data) {
    on_simulated(device, [&] {
      // A pageable copy: the bytes are taken now (as cudaMemcpyAsync from pageable memory stages them).
      auto held = std::make_shared<std::string>(data);
      sim::enqueue(stream_of(stream), [held, dst] { std::memcpy(reinterpret_cast<void*>(dst), held->data(), held->size()); });
      return 0;
    });
  }, py::arg("stream"), py::arg("device"), py::arg("dst"), py::arg("data"),
     "Queues a host-to-device copy of `data` to dst (a copy, not a kernel).");
  s.def("memcpy", [](std::uintptr_t stream, int device, std::uintptr_t dst, std::uintptr_t src, std::size_t bytes) {
    on_simulated(device, [&] {
      MIRRORED_CUDA_CHECK(cudaMemcpyAsync(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), bytes,
                                          cudaMemcpyDefault, stream_of(stream)));
      return 0;
    });
  }, py::arg("stream"), py::arg("device"), py::arg("dst"), py::arg("src"), py::arg("bytes"),
     "cudaMemcpyAsync of device memory on `device`'s stream.");
  s.def("capturing", [](int device) { return sim::capturing(device); }, py::arg("device"),
        "Whether a stream of `device` is being captured.");
  s.def("begin_capture", [](std::uintptr_t stream, int device) {
    on_simulated(device, [&] { MIRRORED_CUDA_CHECK(cudaStreamBeginCapture(stream_of(stream), cudaStreamCaptureModeRelaxed)); return 0; });
  }, py::arg("stream"), py::arg("device"), "cudaStreamBeginCapture.");
  s.def("is_capturing", [](std::uintptr_t stream, int device) {
    return on_simulated(device, [&] {
      cudaStreamCaptureStatus status;
      MIRRORED_CUDA_CHECK(cudaStreamIsCapturing(stream_of(stream), &status));
      return status != cudaStreamCaptureStatusNone;
    });
  }, py::arg("stream"), py::arg("device"), "cudaStreamIsCapturing: active or invalidated.");
  s.def("end_capture", [](std::uintptr_t stream, int device) {
    return on_simulated(device, [&] {
      cudaGraph_t graph = nullptr;
      MIRRORED_CUDA_CHECK(cudaStreamEndCapture(stream_of(stream), &graph));
      cudaGraphExec_t exec = nullptr;
      const cudaError_t made = cudaGraphInstantiate(&exec, graph, 0);
      cudaGraphDestroy(graph);
      MIRRORED_CUDA_CHECK(made);
      return reinterpret_cast<std::uintptr_t>(exec);
    });
  }, py::arg("stream"), py::arg("device"), "cudaStreamEndCapture then cudaGraphInstantiate: the executable graph.");
  s.def("graph_launch", [](std::uintptr_t exec, std::uintptr_t stream, int device) {
    on_simulated(device, [&] {
      MIRRORED_CUDA_CHECK(cudaGraphLaunch(reinterpret_cast<cudaGraphExec_t>(exec), stream_of(stream)));
      return 0;
    });
  }, py::arg("exec"), py::arg("stream"), py::arg("device"));
  s.def("graph_destroy", [](std::uintptr_t exec) {
    py::gil_scoped_release nogil;
    cudaGraphExecDestroy(reinterpret_cast<cudaGraphExec_t>(exec));
  }, py::arg("exec"));
}
#endif

}  // namespace

PYBIND11_MODULE(MIRRORED_CUDA_MODULE, m) {
  m.doc() = "CUDA-buffer collectives of mirrored: the native ring over device memory, and NCCL loaded at run time.";

  // A GPU out of memory is TF's ResourceExhaustedError (md.errors builds it, naming the device, the bytes and
  // the fix); a plain MemoryError where md.errors cannot be imported.
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const cuda::OutOfMemory& e) {
      try {
        py::object error = py::module_::import("mirrored.errors").attr("gpu_out_of_memory")(
            e.bytes(), e.device(), py::arg("purpose") = "the engine's " + e.purpose());
        PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(error.ptr())), error.ptr());
      } catch (py::error_already_set&) {
        PyErr_SetString(PyExc_MemoryError, e.what());
      }
    }
  });

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

  m.def("blas_load", &cuda::blas::load, py::arg("candidates"),
        "Loads libcublas from the first loadable candidate path; returns that path.");
  m.def("matmul", [](int device, int type, long long m, long long n, long long k, long long batch, std::uintptr_t a,
                     int op_a, long long lda, long long stride_a, std::uintptr_t b, int op_b, long long ldb,
                     long long stride_b, std::uintptr_t c, std::uintptr_t stream) {
          const cuda::blas::Product p{static_cast<cuda::blas::Type>(type), m, n, k, batch,
                                      {reinterpret_cast<const void*>(a), static_cast<cuda::blas::Operation>(op_a), lda,
                                       stride_a},
                                      {reinterpret_cast<const void*>(b), static_cast<cuda::blas::Operation>(op_b), ldb,
                                       stride_b},
                                      reinterpret_cast<void*>(c)};
          py::gil_scoped_release nogil;
          cuda::blas::matmul(device, reinterpret_cast<cudaStream_t>(stream), p);
        },
        py::arg("device"), py::arg("type"), py::arg("m"), py::arg("n"), py::arg("k"), py::arg("batch"), py::arg("a"),
        py::arg("op_a"), py::arg("lda"), py::arg("stride_a"), py::arg("b"), py::arg("op_b"), py::arg("ldb"),
        py::arg("stride_b"), py::arg("c"), py::arg("stream"),
        "C = op(A) op(B) per batch item on `stream` of GPU `device`, with mirrored's cuBLAS handle (cuda/blas.h):\n"
        "row-major operands (ld: elements between rows, stride: between batch items, 0: shared), C contiguous.");

  py::class_<Engine>(m, "Engine")
      .def_property_readonly("backend", [](const Engine& e) { return e.comm->backend(); })
      .def("all_reduce", [](Engine& e, const Ptrs& in, const Ptrs& out, std::size_t count, int dtype, int op,
                            int algorithm, const Ptrs& streams) {
        auto [i, o, n] = buffers_of(in, out);
        py::gil_scoped_release nogil;
        cuda::StreamScope scope(as_streams(streams));
        e.comm->all_reduce(n, i.data(), o.data(), count, dtype_from_code(dtype), reduce_op_from_code(op),
                           static_cast<Algorithm>(algorithm));
      })
      .def("broadcast", [](Engine& e, const Ptrs& in, const Ptrs& out, std::size_t count, int dtype, int root,
                           const Ptrs& streams) {
        auto [i, o, n] = buffers_of(in, out);
        py::gil_scoped_release nogil;
        cuda::StreamScope scope(as_streams(streams));
        e.comm->broadcast(n, i.data(), o.data(), count, dtype_from_code(dtype), root);
      })
      .def("reduce", [](Engine& e, const Ptrs& in, const Ptrs& out, std::size_t count, int dtype, int op, int root,
                        const Ptrs& streams) {
        auto [i, o, n] = buffers_of(in, out);
        py::gil_scoped_release nogil;
        cuda::StreamScope scope(as_streams(streams));
        e.comm->reduce(n, i.data(), o.data(), count, dtype_from_code(dtype), reduce_op_from_code(op), root);
      })
      .def("all_gather", [](Engine& e, const Ptrs& in, const Ptrs& out, const std::vector<std::size_t>& row_bytes,
                            std::size_t outer, const Ptrs& streams) {
        auto [i, o, n] = buffers_of(in, out);
        if (row_bytes.size() != in.size()) throw py::value_error("row_bytes: need one entry per buffer");
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

  py::class_<DeviceCallPlan>(m, "CallPlan")
      .def(py::init([](py::object engine, bool reduce, int algorithm, int dtype, int op, int root, std::size_t count,
                       py::object array_type, std::vector<int> devices, const py::list& specs) {
             return std::make_unique<DeviceCallPlan>(std::move(engine), reduce, algorithm, dtype, op, root, count,
                                                     device_fit(std::move(array_type), std::move(devices), specs));
           }),
           py::arg("engine"), py::arg("reduce"), py::arg("algorithm"), py::arg("dtype"), py::arg("op"),
           py::arg("root"), py::arg("count"), py::arg("array_type"), py::arg("devices"), py::arg("specs"))
      .def("run", &DeviceCallPlan::run, py::arg("buffers"), py::arg("out"), py::arg("streams"), py::arg("alloc"),
           "The all_reduce (reduce) or broadcast of `buffers` into `out` (None: alloc()'s arrays; `buffers`: in\n"
           "place) on streams() (each replica's stream handle, asked once the arrays fit); returns the outputs,\n"
           "or None when an array is not exactly `array_type` with specs[0]'s (shape, strides, dtype) on its\n"
           "replica's device.");
  py::class_<DeviceBatchPlan>(m, "BatchPlan")
      .def(py::init([](py::object engine, int algorithm, int op, std::size_t bytes_per_pack, int num_packs,
                       const std::vector<int>& dtypes, std::vector<std::size_t> counts,
                       std::vector<std::size_t> offsets, py::object array_type, std::vector<int> devices,
                       const py::list& specs) {
             return std::make_unique<DeviceBatchPlan>(std::move(engine), algorithm, op, bytes_per_pack, num_packs,
                                                      dtypes, std::move(counts), std::move(offsets),
                                                      device_fit(std::move(array_type), std::move(devices), specs));
           }),
           py::arg("engine"), py::arg("algorithm"), py::arg("op"), py::arg("bytes_per_pack"), py::arg("num_packs"),
           py::arg("dtypes"), py::arg("counts"), py::arg("offsets"), py::arg("array_type"), py::arg("devices"),
           py::arg("specs"))
      .def("run", &DeviceBatchPlan::run, py::arg("per_replica_lists"), py::arg("streams"), py::arg("alloc"),
           "The batch all-reduce of per_replica_lists[r][t] into alloc()'s (results, base addresses) (tensor t of\n"
           "replica r at base[r] + offsets[t]) on streams() (asked once the tensors fit); returns the results, or\n"
           "None when a tensor does not fit its spec (exactly `array_type`, (shape, strides, dtype), on its\n"
           "replica's device).");

  m.def("ring", [](const std::vector<int>& devices, std::size_t chunk_bytes, int channels) {
    return std::make_unique<Engine>(devices, std::make_unique<cuda::CudaRing>(devices, chunk_bytes, channels));
  }, py::arg("devices"), py::arg("chunk_bytes") = std::size_t(1) << 20, py::arg("channels") = 2,
     "The native ring over the GPUs `devices` (one rank each; repeats are logical GPUs).");
  m.def("nccl", [](const std::vector<int>& devices) {
    py::gil_scoped_release nogil;  // ncclCommInitAll may take seconds
    return std::make_unique<Engine>(devices, std::make_unique<nccl::NcclCommunicator>(devices));
  }, py::arg("devices"), "NCCL over local GPUs (call nccl_load first).");
  m.def("hierarchical", [](const std::vector<int>& devices) {
    py::gil_scoped_release nogil;  // ncclCommInitAll may take seconds
    return std::make_unique<Engine>(devices, std::make_unique<nccl::HierarchicalCommunicator>(devices));
  }, py::arg("devices"),
     "The hierarchical engine over the GPUs `devices` (repeats are logical GPUs): one kernel per GPU folds its\n"
     "replicas, NCCL (one rank per GPU) combines the GPUs, one kernel per GPU writes its replicas' outputs\n"
     "(call nccl_load first).");
  m.def("nccl_rank", [](const py::bytes& unique_id, int rank, int nranks, const std::vector<int>& devices) {
    std::string id = unique_id;
    py::gil_scoped_release nogil;  // waits for the other processes
    return std::make_unique<Engine>(devices, std::make_unique<nccl::NcclCommunicator>(id, rank, nranks, devices));
  }, py::arg("unique_id"), py::arg("rank"), py::arg("nranks"), py::arg("devices"),
     "This process's ranks rank.. rank+len(devices)-1 of an NCCL job of nranks sharing unique_id.");
  def_fused_update(m);
  def_step_window(m);
  def_scatter_rows(m);
#ifdef MIRRORED_CUDA_SIM
  def_sim(m);
#endif
}
