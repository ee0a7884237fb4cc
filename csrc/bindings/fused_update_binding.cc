// mirrored._core.fused_update: the fused optimizer update on host arrays. Thin:
// check the arrays, build the (pointer, count) table, release the GIL, run the kernel.
#include "bindings/fused_update_binding.h"

#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "host/fused_update.h"

namespace py = pybind11;
using namespace mirrored::host;

namespace {

// Whether `dtype` is T's, in the machine's byte order. Not by identity: an unpickled array (a
// parameter server's, multiprocessing's) carries an equal dtype object of its own.
template <typename T>
bool is_dtype(const py::dtype& dtype) {
  return py::detail::npy_api::get().PyArray_EquivTypes_(dtype.ptr(), py::dtype::of<T>().ptr());
}

// The array `h` as a contiguous T buffer of `count` elements (count 0: any), or a ValueError naming it.
template <typename T>
T* buffer_of(py::handle h, std::size_t count, bool writable, const std::string& where) {
  if (!py::isinstance<py::array>(h)) throw py::type_error(where + ": expected a NumPy array");
  auto a = py::reinterpret_borrow<py::array>(h);
  if (!is_dtype<T>(a.dtype()))
    throw py::value_error(where + ": dtype " + std::string(py::str(a.dtype())) + ", expected " +
                          std::string(py::str(py::dtype::of<T>())) + " like the variable's");
  if (!(a.flags() & py::array::c_style)) throw py::value_error(where + ": expected a C-contiguous array");
  if (count != 0 && static_cast<std::size_t>(a.size()) != count)
    throw py::value_error(where + ": " + std::to_string(a.size()) + " elements, the variable has " +
                          std::to_string(count));
  if (writable && !a.writeable()) throw py::value_error(where + ": the array is read-only");
  if (writable) return static_cast<T*>(a.mutable_data());
  return const_cast<T*>(static_cast<const T*>(a.data()));
}

// A NumPy shape as Python prints it.
std::string shape_of(const py::array& a) {
  std::string text = "(";
  for (py::ssize_t d = 0; d < a.ndim(); ++d) text += (d > 0 ? ", " : "") + std::to_string(a.shape(d));
  return text + (a.ndim() == 1 ? ",)" : ")");
}

// Adafactor's entry: the weight's shape (its last two axes factored, the leading ones folded into batches) and
// its slots r (the shape without its last axis), c (without its second to last) and v (the variable's), checked
// against it. A variable of fewer than 2 dims has only v: its r and c are Keras' placeholders, never touched.
template <typename T>
void factored_slots(FusedEntry<T>& e, const py::array& weight, const py::list& slots, const std::string& at) {
  e.shape = mirrored::rules::factored_shape(static_cast<std::size_t>(weight.ndim()),
                                            [&](std::size_t d) { return weight.shape(static_cast<py::ssize_t>(d)); });
  const mirrored::rules::FactoredShape& f = e.shape;
  const std::size_t counts[] = {f.batches * f.rows, f.batches * f.cols, e.count};
  const char* what[] = {"r (the variable's shape without its last axis)",
                        "c (the variable's shape without its second to last axis)", "velocity (the variable's shape)"};
  for (int j = 0; j < 3; ++j) {
    e.slots[j] = nullptr;
    if (!f.factored && j < 2) continue;
    const std::string where = "slots" + at + "[" + std::to_string(j) + "]";
    e.slots[j] = buffer_of<T>(slots[j], 0, true, where);
    const auto size = static_cast<std::size_t>(py::reinterpret_borrow<py::array>(slots[j]).size());
    if (size != counts[j])
      throw py::value_error(where + ": " + std::to_string(size) + " elements, Adafactor's " + what[j] + " of a " +
                            shape_of(weight) + " variable has " + std::to_string(counts[j]));
  }
}

// `grads` is a list with one array per variable, one packed array holding them back to back, or a
// tuple of such lists, one per replica, whose sum (in their order) is each variable's gradient.
// `squares`: None, or one entry per variable, None or its squared gradient (FusedEntry::squares).
template <typename T>
void apply_typed(int rule, const py::list& weights, const py::object& grads, const py::list& slots,
                 const std::vector<bool>& decay, const std::vector<double>& coefficients, double weight_decay,
                 double lr, const py::object& squares) {
  const int num_slots = rule_slots(rule, coefficients.data());
  std::vector<FusedEntry<T>> table(weights.size());
  const bool packed = py::isinstance<py::array>(grads);
  const T* next_grad = packed ? buffer_of<T>(grads, 0, false, "grads") : nullptr;
  const auto replicas = py::isinstance<py::tuple>(grads) ? py::reinterpret_borrow<py::tuple>(grads) : py::tuple();
  const std::size_t more = replicas.empty() ? 0 : replicas.size() - 1;
  std::vector<const T*> others(table.size() * more);
  std::size_t packed_total = 0;
  for (std::size_t k = 0; k < table.size(); ++k) {
    const std::string at = "[" + std::to_string(k) + "]";
    FusedEntry<T>& e = table[k];
    e.weight = buffer_of<T>(weights[k], 0, true, "weights" + at);
    e.count = static_cast<std::size_t>(py::reinterpret_borrow<py::array>(weights[k]).size());
    if (packed) {
      e.grad = next_grad;
      next_grad += e.count;
      packed_total += e.count;
    } else if (more != 0) {
      e.grad = buffer_of<T>(py::reinterpret_borrow<py::list>(replicas[0])[k], e.count, false, "grads[0]" + at);
      for (std::size_t r = 1; r <= more; ++r)
        others[k * more + r - 1] = buffer_of<T>(py::reinterpret_borrow<py::list>(replicas[r])[k], e.count, false,
                                                "grads[" + std::to_string(r) + "]" + at);
    } else {
      e.grad = buffer_of<T>(py::reinterpret_borrow<py::list>(grads)[k], e.count, false, "grads" + at);
    }
    auto var_slots = py::reinterpret_borrow<py::list>(slots[k]);
    if (static_cast<int>(var_slots.size()) != num_slots)
      throw py::value_error("slots" + at + ": " + std::to_string(var_slots.size()) + " slots, the rule has " +
                            std::to_string(num_slots));
    if (rule == static_cast<int>(Rule::kAdafactor)) {
      factored_slots(e, py::reinterpret_borrow<py::array>(weights[k]), var_slots, at);
    } else {
      for (int j = 0; j < kMaxSlots; ++j)
        e.slots[j] = j < num_slots ? buffer_of<T>(var_slots[j], e.count, true, "slots" + at + "[" +
                                                  std::to_string(j) + "]")
                                   : nullptr;
    }
    e.decay = decay[k];
    if (!squares.is_none() && !py::reinterpret_borrow<py::list>(squares)[k].is_none())
      e.squares = buffer_of<T>(py::reinterpret_borrow<py::list>(squares)[k], e.count, false, "squares" + at);
  }
  if (packed && static_cast<std::size_t>(py::reinterpret_borrow<py::array>(grads).size()) != packed_total)
    throw py::value_error("grads: a packed array of " +
                          std::to_string(py::reinterpret_borrow<py::array>(grads).size()) + " elements, the variables have " +
                          std::to_string(packed_total));
  FusedScalars<T> s{};
  for (std::size_t j = 0; j < coefficients.size(); ++j) s.c[j] = static_cast<T>(coefficients[j]);
  s.weight_decay = static_cast<T>(weight_decay);
  s.lr = static_cast<T>(lr);
  py::gil_scoped_release release;
  if (more != 0) {
    fused_update_summed<T>(static_cast<Rule>(rule), table.data(), table.size(), others.data(),
                           static_cast<int>(more + 1), s);
  } else {
    fused_update<T>(static_cast<Rule>(rule), table.data(), table.size(), s);
  }
}

}  // namespace

namespace mirrored::bindings {

void def_host_fused_update(py::module_& m) {
  m.def(
      "fused_update",
      [](int rule, const py::list& weights, const py::object& grads, const py::list& slots,
         const std::vector<bool>& decay, const std::vector<double>& coefficients, double weight_decay, double lr,
         const py::object& squares) {
        const std::string error = rules::coefficients_error(rule, coefficients.size());
        if (!error.empty()) throw py::value_error(error);
        const std::size_t n = weights.size();
        const bool packed = py::isinstance<py::array>(grads);
        const bool summed = py::isinstance<py::tuple>(grads);
        if (!packed && !summed && !py::isinstance<py::list>(grads))
          throw py::type_error("grads: expected a list of arrays, one packed array, or a tuple of lists (one per "
                               "replica, summed)");
        if (summed) {
          if (py::len(grads) < 2)
            throw py::value_error("grads: a tuple of " + std::to_string(py::len(grads)) +
                                  " replicas' lists; pass the list itself for one replica");
          for (auto replica : py::reinterpret_borrow<py::tuple>(grads))
            if (!py::isinstance<py::list>(replica) || py::len(replica) != n)
              throw py::value_error("grads: each replica's entry must be a list with one array per variable");
        }
        if ((!packed && !summed && py::len(grads) != n) || slots.size() != n || decay.size() != n)
          throw py::value_error("weights, grads, slots and decay must have one entry per variable");
        if (!squares.is_none()) {
          if (!py::isinstance<py::list>(squares) || py::len(squares) != n)
            throw py::value_error("squares: expected None or a list with one entry (an array or None) per "
                                  "variable");
          if (summed)
            throw py::value_error("squares: not with a tuple of replicas' gradients; pass their sum as one list");
        }
        if (n == 0) return;
        const py::dtype dtype = py::reinterpret_borrow<py::array>(weights[0]).dtype();
        if (is_dtype<float>(dtype)) {
          apply_typed<float>(rule, weights, grads, slots, decay, coefficients, weight_decay, lr, squares);
        } else if (is_dtype<double>(dtype)) {
          apply_typed<double>(rule, weights, grads, slots, decay, coefficients, weight_decay, lr, squares);
        } else {
          throw py::value_error("weights[0]: dtype " + std::string(py::str(dtype)) +
                                ", the fused host kernel takes float32 and float64");
        }
      },
      py::arg("rule"), py::arg("weights"), py::arg("grads"), py::arg("slots"), py::arg("decay"),
      py::arg("coefficients"), py::arg("weight_decay"), py::arg("lr"), py::arg("squares") = py::none(),
      "Weight decay (where decay[k]) and the rule on every (weight, grad, slots) entry, in place. `grads`: one\n"
      "array per variable, one array holding them back to back (a packed, all-reduced fusion buffer), or a\n"
      "tuple of such lists, one per replica, summed in their order first (as the host all-reduce sums).\n"
      "`squares`: None, or per variable None or the array a squaring rule reads in place of grad * grad\n"
      "(an IndexedSlices gradient's rows squared, then added up; see scatter_add_rows).");
  m.def(
      "scatter_add_rows",
      [](py::array out, py::object squares, py::array values, py::array indices) {
        if (out.ndim() < 1) throw py::value_error("out: expected an array of one or more dimensions");
        const std::size_t rows = static_cast<std::size_t>(out.shape(0));
        const std::size_t width = rows == 0 ? 0 : static_cast<std::size_t>(out.size()) / rows;
        if (!py::isinstance<py::array_t<std::int64_t>>(indices) || indices.ndim() != 1 ||
            !(indices.flags() & py::array::c_style))
          throw py::value_error("indices: expected a C-contiguous 1-D int64 array");
        const std::size_t n = static_cast<std::size_t>(indices.size());
        if (values.ndim() < 1 || static_cast<std::size_t>(values.shape(0)) != n ||
            static_cast<std::size_t>(values.size()) != n * width)
          throw py::value_error("values: expected one row of out's row shape per index");
        const std::int64_t* at = static_cast<const std::int64_t*>(indices.data());
        std::ptrdiff_t bad = -1;
        auto run = [&](auto zero) {
          using T = decltype(zero);
          T* o = buffer_of<T>(out, 0, true, "out");
          T* sq = squares.is_none() ? nullptr : buffer_of<T>(squares, out.size(), true, "squares");
          const T* v = buffer_of<T>(values, 0, false, "values");
          py::gil_scoped_release release;
          bad = scatter_add_rows<T>(o, sq, rows, width, v, at, n);
        };
        if (is_dtype<float>(out.dtype())) {
          run(0.0f);
        } else if (is_dtype<double>(out.dtype())) {
          run(0.0);
        } else {
          throw py::value_error("out: dtype " + std::string(py::str(out.dtype())) + ", expected float32 or float64");
        }
        return bad;
      },
      py::arg("out"), py::arg("squares"), py::arg("values"), py::arg("indices"),
      "out[indices[i]] += values[i] for every i in order (and squares[indices[i]] += values[i]**2 unless\n"
      "`squares` is None), in place, the GIL released. A negative index is skipped. Returns -1, or the first\n"
      "i whose index is past out's rows (then nothing was written).");
}

}  // namespace mirrored::bindings
