"""Randomised differential test of md.function against TensorFlow 2.21's tf.function: the cases that
tests/function_differential_cases.py draws from its seed (retracing with Python scalars, strings, None, tuples,
lists, dicts, NumPy scalars and arrays of new shapes and dtypes, keywords and defaults, reduce_retracing;
input_signature binding and its refusals; get_concrete_function and its calls; decorated methods; Python side
effects; steps that call strategy.run; the decorator's forms and attributes), recorded from TF by
tests/data/record_tf_function.py, replayed here on CPU. Every observation must be TF's, or one of the deliberate
differences of docs/function.md ("Against tf.function"):

* a Python scalar the function returns stays a Python scalar (TF converts it to an int32 / float32 tensor): the
  values must be TF's;
* on CPU the function runs eagerly, so its Python side effects happen at every call that runs it (TF's at every
  trace);
* strategy.run(md.function(fn)) counts the traces on the function (TF's stays 0: it traces a clone);
* an error raised while the step runs is the eager library's, of TF's class (TF's words are its graph's).

The suite never imports TensorFlow."""

import json
import os
import warnings

import numpy as np
import pytest

import function_differential_cases as cases
import mirrored as md
from mirrored.distribute.function import EagerFallbackWarning

with open(os.path.join(os.path.dirname(__file__), "data", "tf_function_reference.json")) as _f:
    _RECORD = json.load(_f)
REFERENCE = _RECORD["cases"]
CASES = cases.generate()


class Mirrored:
    function = staticmethod(md.function)
    TensorSpec = md.TensorSpec
    Variable = md.Variable

    @staticmethod
    def to_numpy(x):
        return np.asarray(x.numpy() if hasattr(x, "numpy") else x)

    @staticmethod
    def rank(spec):
        return spec.shape.rank

    @staticmethod
    def dtype_name(dtype):
        return np.dtype(dtype).name


_STRATEGIES = {}


def _strategy(n):
    if n not in _STRATEGIES:
        _STRATEGIES[n] = md.MirroredStrategy([f"/cpu:{i}" for i in range(n)])
    return _STRATEGIES[n]


def _run(case):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EagerFallbackWarning)
        return cases.run_case(Mirrored, case, _strategy(case["n"]) if case["kind"] == "strategy" else None)


# --- comparing -----------------------------------------------------------------------------------------------

def _reason(message):
    """The reason of a binding refusal (between the first pair of backticks), in mirrored's dtype spelling."""
    return message.split("`")[1].replace("dtype=tf.", "dtype=") if "`" in message else message


def assert_same_result(got, want, where):
    if isinstance(want, dict) and "raises" in want:
        assert isinstance(got, dict) and "raises" in got, (where, got, want)
        assert got["raises"] == want["raises"], (where, got, want)
        if want["msg"].startswith("Binding inputs to tf.function failed due to `"):
            assert got["msg"].startswith("Binding inputs to tf.function failed due to `"), (where, got, want)
            # TF's reason word for word; mirrored's may go on with what to pass instead.
            assert _reason(got["msg"]).startswith(_reason(want["msg"])), (where, got["msg"], want["msg"])
        elif not want["msg"].startswith("in user code:"):  # (TF's error raised while tracing: its graph's words)
            assert want["msg"] in got["msg"], (where, got, want)
        return
    assert not (isinstance(got, dict) and "raises" in got), (where, got, want)
    if want is None or "str" in want:
        assert got == want, (where, got, want)
        return
    if "dtype" not in want:
        (form, items), = want.items()
        assert list(got) == [form], (where, got, want)
        if form == "dict":
            assert [k for k, _ in got[form]] == [k for k, _ in items], (where, got, want)
            pairs = zip([v for _, v in got[form]], [v for _, v in items])
        else:
            assert len(got[form]) == len(items), (where, got, want)
            pairs = zip(got[form], items)
        for g, w in pairs:
            assert_same_result(g, w, where)
        return
    assert got["shape"] == want["shape"] and got["v"] == want["v"], (where, got, want)
    if not got["python"]:  # (a Python scalar result stays one: TF's is a tensor)
        assert got["dtype"] == want["dtype"], (where, got, want)


def _calls(got, want, name, keys=("count", "counts")):
    assert len(got["calls"]) == len(want["calls"])
    for i, (g, w) in enumerate(zip(got["calls"], want["calls"])):
        assert_same_result(g["result"], w["result"], f"{name} call {i}")
        for key in keys:
            if key in w:
                assert g[key] == w[key], (f"{name} call {i}: {key}", got["calls"], want["calls"])


def _tf_slip(result):
    """TF's own failure, not a rule: its reduce_retracing over a ``**kwargs`` function given a new keyword raises
    IndexError from inside its trace-type code. mirrored traces the call."""
    return isinstance(result, dict) and result.get("raises") == "IndexError" and "list index out of range" in \
        result["msg"]


def _before_tf_slip(got, want):
    """The calls up to TF's failure, if any (after it the counts part: mirrored counted the trace)."""
    slips = [i for i, w in enumerate(want["calls"]) if _tf_slip(w["result"])]
    end = slips[0] if slips else len(want["calls"])
    return dict(got, calls=got["calls"][:end]), dict(want, calls=want["calls"][:end])


@pytest.mark.parametrize("name", [n for n in CASES if CASES[n]["kind"] in ("retrace", "signature")])
def test_retracing_and_binding_as_tensorflow(name):
    got, want = _run(CASES[name]), REFERENCE[name]
    if "wrap" in want:
        assert_same_result(got.get("wrap"), want["wrap"], name)
        return
    _calls(*_before_tf_slip(got, want), name)


@pytest.mark.parametrize("name", [n for n in CASES if CASES[n]["kind"] == "concrete"])
def test_concrete_functions_as_tensorflow(name):
    got, want = _run(CASES[name]), REFERENCE[name]
    if "concrete" in want:
        if want["concrete"]["msg"].startswith("in user code:"):
            # TF traces the Python function there and raises its error; md.function's get_concrete_function runs
            # nothing (there is no graph to build): the error comes at the first call that runs it.
            assert "inputs" in got, got
            return
        assert_same_result(got.get("concrete"), want["concrete"], name)
        return
    assert got["inputs"] == want["inputs"] and got["count"] == want["count"], (got, want)
    _calls(got, want, name)


@pytest.mark.parametrize("name", [n for n in CASES if CASES[n]["kind"] == "method"])
def test_decorated_methods_bind_per_instance_as_tensorflow(name):
    got, want = _run(CASES[name]), REFERENCE[name]
    assert (got["same_bound"], got["name"]) == (want["same_bound"], want["name"])
    _calls(got, want, name)


@pytest.mark.parametrize("name", [n for n in CASES if CASES[n]["kind"] == "side_effect"])
def test_side_effects_happen_at_every_eager_call(name):
    """TF's Python runs at each trace; on CPU md.function runs the function at every call (docs/function.md)."""
    got, want = _run(CASES[name]), REFERENCE[name]
    _calls(got, want, name)
    assert [w["effects"] for w in want["calls"]] == [w["count"] for w in want["calls"]]
    ran = np.cumsum([not ("raises" in (g["result"] or {})) for g in got["calls"]]).tolist()
    assert [g["effects"] for g in got["calls"]] == ran


@pytest.mark.parametrize("name", [n for n in CASES if CASES[n]["kind"] == "strategy"])
def test_steps_that_call_strategy_run_as_tensorflow(name):
    case = CASES[name]
    got, want = _run(case), REFERENCE[name]
    if case["form"] == "inner":
        # strategy.run(md.function(fn)) counts the traces on the function (TF traces a per-strategy clone of it,
        # whose count is not public, and reports 0 for the function): one per type of argument, as TF's clone.
        _calls(got, want, name, keys=())
        seen = [(a["array"]["dtype"], tuple(a["array"]["shape"])) for a in (c["args"][0] for c in case["calls"])]
        assert [g["count"] for g in got["calls"]] == [len(set(seen[:i + 1])) for i in range(len(seen))]
        assert all(w["count"] == 0 for w in want["calls"])
    else:
        _calls(got, want, name)
    for i, (g, w) in enumerate(zip(got["calls"], want["calls"])):
        assert_same_result(g["eager"], w["eager"], f"{name} eager {i}")
        assert_same_result(g["result"], g["eager"], f"{name} function against eager {i}")


@pytest.mark.parametrize("name", [n for n in CASES if CASES[n]["kind"] == "decorator"])
def test_decorator_forms_and_attributes_as_tensorflow(name):
    got, want = _run(CASES[name]), REFERENCE[name]
    for key in ("name", "doc", "qualname_tail", "module_is_cases", "python_function", "wrapped"):
        assert got[key] == want[key], key
    _calls(got, want, name)
    for key in ("count", "counts_after", "counts_after_new_type"):
        assert got["copy"][key] == want["copy"][key], key
    assert_same_result(got["copy"]["result"], want["copy"]["result"], f"{name} copy")
    assert got["deepcopy"]["count"] == want["deepcopy"]["count"]
    assert_same_result(got["deepcopy"]["result"], want["deepcopy"]["result"], f"{name} deepcopy")
    for g, w in zip(got["refusals"], want["refusals"]):
        assert_same_result(g, w, f"{name} refusal")


# --- the same calls on a GPU: captured and replayed -----------------------------------------------------------

def _on_gpu(x):
    import gpu_env

    if isinstance(x, np.ndarray):
        return gpu_env.cupy.asarray(x)
    if isinstance(x, (tuple, list)):
        return type(x)(map(_on_gpu, x))
    if isinstance(x, dict):
        return {k: _on_gpu(v) for k, v in x.items()}
    return x


class OnGpu(Mirrored):
    """Arguments' arrays on GPU 0 (CuPy), so that md.function captures the calls and replays them."""

    @staticmethod
    def function(fn, **options):
        wrapped = md.function(fn, **options)

        class Call:
            def __call__(self, *args, **kwargs):
                return wrapped(*_on_gpu(args), **_on_gpu(kwargs))

            def experimental_get_tracing_count(self):
                return wrapped.experimental_get_tracing_count()

        return Call()

    @staticmethod
    def to_numpy(x):
        import gpu_env

        return gpu_env.cupy.asnumpy(x) if hasattr(x, "__cuda_array_interface__") else Mirrored.to_numpy(x)


@pytest.mark.gpu
@pytest.mark.parametrize("name", [n for n in CASES if CASES[n]["kind"] in ("retrace", "side_effect")
                                  and CASES[n].get("signature") is None])
def test_captured_calls_retrace_as_tensorflow(name):
    """A call of a new trace type warms up and captures, a repeated one replays: results and trace counts are
    TF's all the same; the Python function runs at a capture's warm-up and capture (twice), never at a replay.
    (Without a signature: with one, a CuPy array of another dtype is refused, not cast, as TF refuses a tensor.)"""
    case = CASES[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EagerFallbackWarning)
        got = cases.run_case(OnGpu, case)
    _calls(*_before_tf_slip(got, REFERENCE[name]), name)
    if case["kind"] == "side_effect":  # (one argument: an array, or a Python value that has no GPU to capture)
        want, seen = [], set()
        for call in case["calls"]:
            (form, body), = call["args"][0].items()
            key = (body["dtype"], tuple(body["shape"])) if form == "array" else None
            want.append(1 if key is None else 0 if key in seen else 2)  # eager; replayed; warm-up and capture
            seen.add(key)
        assert np.diff([0] + [g["effects"] for g in got["calls"]]).tolist() == want
