"""``md.function``: a step captured once per input signature and replayed as CUDA graphs.

TensorFlow's ``tf.function`` contract for NumPy/CuPy steps under a GPU strategy::

    @md.function
    def train_step(iterator):
        return strategy.run(step_fn, args=(next(iterator),))

    strategy.run(md.function(step_fn), args=(batch,))   # the same, for one replica step

The first call with an input signature (structure, shapes, dtypes, devices, Python values)
runs the step eagerly, as a warm-up, then captures it: every GPU's work (the replicas'
CuPy kernels, the collectives, the optimizer's update) is recorded into one CUDA graph per
GPU, from the GPU's step stream (replicas that share a GPU as parallel branches forked from it,
device/gpu.py StepScope) and from a memory pool of the graph's own. Later calls with
that signature copy their inputs into the captured input buffers and launch the graphs:
no Python of the step runs. docs/function.md says what may change between calls.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import functools
import inspect
import logging
import sys
import threading
import traceback
import types
import warnings
import weakref

import numpy as np

from .._nest import flatten, flatten_with_structure_key, map_structure, pack_sequence_as
from ..device import config, device_util, gpu as _gpu
from . import distribute_lib, function_signature, input_lib
from .input_lib import DistributedIterator
from .values import DistributedValues, Variable

MAX_SIGNATURES = 16  # captured signatures kept per function; the least recently used goes first
MAX_TRACE_TYPES = 256  # trace types remembered per function, for experimental_get_tracing_count
RETRACING_CALLS = 5  # TF's threshold: warn when this many calls in a row each captured anew
_capturing = threading.Lock()  # one capture at a time: the running step (device/gpu.py) is process-wide


class EagerFallbackWarning(RuntimeWarning):
    """``md.function`` runs a step eagerly (a CPU strategy, or a step that cannot be captured)."""


def function(func=None, input_signature=None, autograph=True, jit_compile=None, reduce_retracing=False,
             experimental_implements=None, experimental_autograph_options=None, experimental_attributes=None,
             experimental_relax_shapes=None, experimental_compile=None, experimental_follow_type_hints=None):
    """``tf.function``'s signature: ``md.function(fn)`` or ``@md.function`` / ``@md.function(...)``.

    ``input_signature`` and ``reduce_retracing`` (``experimental_relax_shapes``, its old name) act as in TF
    (function_signature.py). The other TensorFlow-only arguments are accepted and have no effect (there is no
    graph to compile: the step is Python, captured as CUDA graphs).
    """
    if func is None:
        return functools.partial(function, input_signature=input_signature, autograph=autograph,
                                 jit_compile=jit_compile, reduce_retracing=reduce_retracing,
                                 experimental_implements=experimental_implements,
                                 experimental_autograph_options=experimental_autograph_options,
                                 experimental_attributes=experimental_attributes,
                                 experimental_relax_shapes=experimental_relax_shapes,
                                 experimental_compile=experimental_compile,
                                 experimental_follow_type_hints=experimental_follow_type_hints)
    if not callable(func):
        raise TypeError(f"{func!r} is not a callable object (md.function wraps a callable, the step: "
                        "md.function(train_step))")
    return Function(func, input_signature, bool(reduce_retracing or experimental_relax_shapes))


class Function:
    """A step that runs eagerly once per input signature, then as captured CUDA graphs."""

    def __init__(self, python_function, input_signature=None, reduce_retracing=False):
        functools.update_wrapper(self, python_function)
        self._python_function = python_function
        self._input_signature = function_signature.validate(python_function, input_signature)
        self._binder = None if self._input_signature is None else function_signature.Binder(
            python_function, self._input_signature)
        # Without a signature, calls bind to the Python function's parameters as TF binds them (its refusals,
        # and one trace type for f(x), f(x=x) and f(x, <the default>)).
        self._canonical = function_signature.canonical_binder(python_function)
        self._reduce_retracing = reduce_retracing
        self._traces = _Traces()
        self._steps: collections.OrderedDict = collections.OrderedDict()  # signature -> _Captured or reason
        self._lock = threading.RLock()
        self._recent = collections.deque(maxlen=RETRACING_CALLS)  # whether each recent call captured
        self._captures = 0  # signatures captured (or tried): a shape, or a stale step, captures anew
        self._warned: set = set()
        self._bound = weakref.WeakKeyDictionary()  # instance -> its md.function (a decorated method)

    @property
    def python_function(self):
        return self._python_function

    @property
    def input_signature(self):
        """The ``input_signature`` given (a tuple of ``md.TensorSpec`` structures), or None."""
        return self._input_signature

    @property
    def name(self) -> str:
        return self._python_function.__name__

    def experimental_get_tracing_count(self) -> int:
        """How many times the function was traced, as TF counts: once with an input_signature, else once per
        call whose trace type no earlier trace covers (see function_signature.py)."""
        return self._traces.count

    def get_concrete_function(self, *args, **kwargs) -> "ConcreteFunction":
        """TF's ``get_concrete_function``: with an input_signature, of the signature (no arguments needed);
        else of these arguments' shapes and dtypes (a trace of their type, as TF's)."""
        if self._binder is not None:
            if args or kwargs:
                self._binder.bind(args, kwargs)
            self._commit_trace(self._new_trace(args, kwargs))
            return ConcreteFunction(self, function_signature.ConcreteBinder(self._python_function,
                                                                            *self._binder.example()))
        if not args and not kwargs and _takes_arguments(self._python_function):
            raise TypeError(f"md.function({self._describe()}).get_concrete_function(): pass example arguments "
                            "(arrays or md.TensorSpec), or give md.function an input_signature")
        args, kwargs = self._canonical(args, kwargs)
        binder = function_signature.ConcreteBinder(self._python_function, args, kwargs)
        self._commit_trace(self._new_trace(args, kwargs))
        return ConcreteFunction(self, binder)

    def _new_trace(self, args, kwargs):
        """The trace type a call of these arguments adds (TF's count of traces: one per signature, or one per
        call of a type no earlier trace covers), or None: an earlier trace covers it."""
        if self._binder is not None:
            kind = ("input_signature", ())
        else:
            kind = function_signature.trace_type(args, kwargs)
        if any(function_signature.covers(traced, kind) for traced in self._traces.types):
            return None
        if self._reduce_retracing:
            kind = function_signature.relaxed(kind, self._traces.types)
        return kind

    def _commit_trace(self, kind) -> None:
        if kind is not None:
            self._traces.types.append(kind)
            self._traces.count += 1

    def __deepcopy__(self, memo):
        """A function of a deep copy of the Python function, with the same options and no traces yet (a shallow
        ``copy.copy`` shares the traces and captures, as tf.function's copies do)."""
        return Function(copy.deepcopy(self._python_function, memo), self._input_signature, self._reduce_retracing)

    def __get__(self, instance, owner):
        """A decorated method: one md.function per instance (its own traces and captures), the same one at every
        access, as tf.function's."""
        if instance is None:
            return self
        try:
            return self._bound[instance]
        except (KeyError, TypeError):
            pass
        bound = Function(_WeakMethod(self._python_function, instance), self._input_signature,
                         self._reduce_retracing)
        try:
            self._bound[instance] = bound
        except TypeError:  # (an instance that cannot be a weak key: a fresh function at each access)
            pass
        return bound

    def __call__(self, *args, **kwargs):
        args, kwargs = self._bind(args, kwargs)
        return self._call(None, args, kwargs)

    def _bind(self, args, kwargs):
        if self._binder is not None:
            return self._binder.bind(args, kwargs)
        return self._canonical(args, kwargs)

    def _run_in_strategy(self, strategy, args, kwargs):
        """``strategy.run(md.function(fn), args, kwargs)``: the whole replica step is the captured step (each
        replica's arguments bound to the input_signature, as TF's function called per replica binds them)."""
        args, kwargs = self._bind(tuple(args), kwargs or {})
        return self._call(strategy, tuple(args), kwargs)

    # --- calls -----------------------------------------------------------------------

    def _call(self, strategy, args, kwargs, count=True):
        """``count=False``: the call's trace is not counted (a concrete function's call: its trace was)."""
        if _gpu.step_scope() is not None or config.functions_run_eagerly():
            # inside another md.function's step: part of that step; or md.config.run_functions_eagerly(True): the
            # Python function at every call, neither traced nor captured (TF's debugging mode)
            return self._eager(strategy, args, kwargs)
        with self._lock:
            inputs = _Inputs(args, kwargs)
            key = (id(strategy), inputs.signature)
            step = self._steps.get(key)
            if step is None:
                # (A call of a kept signature was counted at its first call: its inputs' type was the same.)
                # A trace counts once the step ran: TF does not keep a trace that raised.
                kind = self._new_trace(args, kwargs) if count else None
                result = self._first_call(key, strategy, inputs)
                self._commit_trace(kind)
                return result
            self._steps.move_to_end(key)
            self._recent.append(False)
            if isinstance(step, str):
                return self._eager(strategy, *inputs.eager())
            if step.stale():  # the graph would write a buffer that is no longer only its variable's
                del self._steps[key]
                return self._first_call(key, strategy, inputs)
            return step.replay(inputs)

    def _eager(self, strategy, args, kwargs):
        # (md.config.run_functions_eagerly(True) is TF's mode without autograph: loops run as plain Python)
        fn = self._python_function if config.functions_run_eagerly() else _as_body(self._python_function)
        if strategy is not None:
            return strategy.run(fn, args=args, kwargs=kwargs)
        return fn(*args, **kwargs)

    def _first_call(self, key, strategy, inputs):
        """Warm-up (the eager step) then capture; or, where capture is impossible, eager from now on."""
        self._captures += 1
        self._recent.append(True)
        if len(self._recent) == RETRACING_CALLS and all(self._recent) and "retracing" not in self._warned:
            self._warned.add("retracing")
            logging.getLogger("mirrored").warning(
                "%d out of the last %d calls to %s triggered md.function retracing. Capturing is expensive and "
                "the number of captures is bounded (%d kept): pass arrays of fixed shapes and dtypes (e.g. "
                "batch(..., drop_remainder=True)), not changing Python values.", RETRACING_CALLS,
                RETRACING_CALLS, self._describe(), MAX_SIGNATURES)
        seen = []  # the strategies the step runs (strategy.run reports each while this is set)
        distribute_lib._run_observer = seen.append
        try:
            result = self._eager(strategy, *inputs.eager())
        finally:
            distribute_lib._run_observer = None
        if strategy is not None:
            seen.append(strategy)
        reason = inputs.uncapturable or _gpu_reason(seen, inputs)
        step = reason
        if reason is None:
            with _capturing:
                step = _capture(self._python_function, strategy, inputs, _ordinals(seen, inputs))
            if isinstance(step, BaseException):
                reason = f"the step cannot be captured as a CUDA graph: {_what_broke(step)}"
                step = reason
        if reason is not None:
            self._warn_once(reason)
        self._steps[key] = step
        while len(self._steps) > MAX_SIGNATURES:
            self._steps.popitem(last=False)
        return result

    def _warn_once(self, reason: str):
        if reason not in self._warned:
            self._warned.add(reason)
            warnings.warn(f"md.function({self._describe()}): {reason}; it runs eagerly for these inputs",
                          EagerFallbackWarning, stacklevel=_caller_stacklevel())

    def _describe(self) -> str:
        return getattr(self._python_function, "__qualname__", repr(self._python_function))

    def __repr__(self):
        return f"<md.function {self._describe()}>"


class _Traces:
    """A function's trace types so far (TF's, for the count of traces) and their count. Bounded, as the captures
    are: a step given a new Python value at every call would otherwise keep them all."""

    def __init__(self):
        self.types = collections.deque(maxlen=MAX_TRACE_TYPES)
        self.count = 0


class ConcreteFunction:
    """TF's ``ConcreteFunction`` of an ``md.function``: calls of its one trace type (arguments bound to its
    specs, as the function with that input_signature binds them)."""

    def __init__(self, function: Function, binder):
        self._function, self._binder = function, binder

    @property
    def structured_input_signature(self):
        """``(args, kwargs)`` as TF's: per parameter its ``md.TensorSpec`` structure, each spec named after its
        parameter and place (x, x_0, y_a), and the Python values it was traced with as they are."""
        return self._binder.structured()

    @property
    def inputs(self) -> list:
        return list(self._binder.concrete_inputs())

    @property
    def name(self) -> str:
        return self._function.name

    def __call__(self, *args, **kwargs):
        args, kwargs = self._binder.bind(args, kwargs)
        return self._function._call(None, args, kwargs, count=False)  # (its one trace is counted)

    def __repr__(self):
        return f"<md.ConcreteFunction {self._function._describe()}{self._binder.description}>"


def _as_body(fn):
    """``fn`` run as an md.function's body: its ``for`` loops over distributed inputs as autograph's (see
    input_lib.function_body)."""
    @functools.wraps(fn)
    def body(*args, **kwargs):
        with input_lib.function_body():
            return fn(*args, **kwargs)
    return body


def _takes_arguments(fn) -> bool:
    return any(p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
               for p in inspect.signature(fn).parameters.values())


# --- which GPUs a step uses ---------------------------------------------------------

def _gpu_reason(strategies, inputs) -> str | None:
    """Why a step that ran these strategies, with these inputs, cannot be captured (None: it can)."""
    if not strategies and not inputs.ordinals:
        return "the step ran no strategy.run and takes no GPU arrays (CUDA graphs capture GPU work only)"
    for s in strategies:
        devices = s.extended.worker_devices
        if not device_util.all_gpu(tuple(devices)):
            return (f"its strategy runs on {list(devices)}, not on GPUs only (CUDA graphs capture GPU work; "
                    "a CPU step gains nothing from capture)")
        if s.extended._num_workers != 1:
            return "multi-worker strategies are not captured (their collectives wait on the host)"
        refusal = s.extended._capture_refusal()
        if refusal is not None:
            return refusal
    return None


def _ordinals(strategies, inputs) -> list:
    found = {device_util.physical_ordinal(d) for s in strategies for d in s.extended.worker_devices}
    return sorted(found | inputs.ordinals)


# --- inputs -------------------------------------------------------------------------

class _OneBatch:
    """What an iterator argument is to the step: the batch this call took from it, once."""

    def __init__(self, batch):
        self._batch = batch
        self._taken = False

    def __iter__(self):
        return self

    def __next__(self):
        if self._taken:
            raise RuntimeError("md.function: the step took a second batch from an iterator argument in one call; "
                               "a step takes at most one batch per call from each iterator (call next() once)")
        self._taken = True
        return self._batch

    get_next = __next__


def _is_device_array(x) -> bool:
    return type(x).__module__.partition(".")[0] == "cupy" and hasattr(x, "__cuda_array_interface__")


class _Inputs:
    """A call's arguments: iterator arguments replaced by the batch each gives for this call, their
    signature, and the arrays a captured step reads from its own buffers."""

    def __init__(self, args, kwargs):
        self.structure = (tuple(args), dict(kwargs or {}))
        leaves, nesting = flatten_with_structure_key(self.structure)
        self.iterators = [i for i, leaf in enumerate(leaves) if isinstance(leaf, DistributedIterator)]
        for i in self.iterators:
            # (at the end TF's function raises OutOfRangeError: ours is a StopIteration too)
            leaves[i] = leaves[i].get_next()
        self.leaves = leaves
        self.uncapturable = None
        self.ordinals = set()
        # How the arguments nest is part of the signature: f(a, b), f(a, y=b) and f((a, b)) flatten alike.
        self.signature = (nesting,) + tuple(
            ("iterator", tuple(map(self._spec, flatten(leaf))), repr(_structure(leaf)))
            if i in self.iterators else self._spec(leaf) for i, leaf in enumerate(leaves))

    def _spec(self, leaf):
        if isinstance(leaf, Variable):
            return ("variable", id(leaf))
        if isinstance(leaf, DistributedValues):
            return (type(leaf).__name__, leaf._devices,
                    tuple(self._array_spec(c, device) for c, device in zip(leaf.values, leaf._devices_or(
                        [None] * len(leaf.values)))))
        if _is_device_array(leaf) or isinstance(leaf, np.ndarray):
            return self._array_spec(leaf, None)
        try:
            hash(leaf)
        except TypeError:
            return ("object", id(leaf))
        return ("value", type(leaf), leaf)

    def _array_spec(self, x, device):
        if _is_device_array(x):
            self.ordinals.add(int(x.data.device_id))
            return ("device", x.shape, x.dtype.str, int(x.data.device_id))
        if isinstance(x, np.ndarray):
            if device is None or not device_util.is_gpu(device):
                self.uncapturable = self.uncapturable or (
                    "a host NumPy array argument has no GPU to be copied to (pass CuPy arrays, or a distributed "
                    "dataset's batches, to a captured step)")
            return ("host", x.shape, x.dtype.str, device)
        return ("value", type(x), x) if isinstance(x, (int, float, bool, str, type(None))) else ("object", id(x))

    def eager(self):
        """The arguments of an eager call: iterators give the batch they gave for this call."""
        leaves = list(self.leaves)
        for i in self.iterators:
            leaves[i] = _OneBatch(leaves[i])
        return pack_sequence_as(self.structure, leaves)

    def sources(self):
        """Every array the captured step reads, with where it goes: (flat position, array, device string)."""
        out = []
        for i, leaf in enumerate(self.leaves):
            parts = flatten(leaf) if i in self.iterators else [leaf]
            for j, part in enumerate(parts):
                if isinstance(part, DistributedValues) and not isinstance(part, Variable):
                    devices = part._devices_or([None] * len(part.values))
                    for k, (c, d) in enumerate(zip(part.values, devices)):
                        if _is_device_array(c) or isinstance(c, np.ndarray):
                            out.append(((i, j, k), c, d))
                elif _is_device_array(part):
                    out.append(((i, j, None), part, None))
        return out


def _structure(x):
    return map_structure(lambda _: None, x)


# --- capture and replay -------------------------------------------------------------

class _Captured:
    """One signature's graphs (one per GPU), streams, private pool, input buffers and outputs."""

    def __init__(self, scope, pools, graphs, buffers, outputs):
        self.scope, self.pools, self.graphs, self.buffers, self.outputs = scope, pools, graphs, buffers, outputs
        self.updated = list(scope.captured.get("variable buffers", {}).values())
        # Graphs on several GPUs: a replay joins them as an eager strategy.run does (device/gpu.py)
        self.across = _gpu.CrossGpuOrder(graphs) if len(graphs) > 1 else None
        # An input buffer lives on its source's GPU, but any GPU's graph may read it (a replica on GPU 1 given
        # an array of GPU 0). Its copy is queued on its own GPU's step stream, which the other GPUs' graphs do
        # not follow: each GPU holding input buffers records an event after its copies, and every other GPU's
        # step stream waits for it before its graph (else a replay may read the last call's input).
        self.copied = {}
        self.constants = []  # the arrays the step reads without being given them (_closure_arrays), held
        cupy = _gpu.cupy_module()
        if self.across is not None:
            for ordinal in sorted({o for _, o in buffers}):
                with cupy.cuda.Device(ordinal):
                    self.copied[ordinal] = cupy.cuda.Event(disable_timing=True)
        # Per GPU, the events a replay enters and leaves its step stream by, re-recorded at every replay (a
        # wait takes an event's latest record): a replay makes no event, so its host work is the same
        # whatever the GPU still has queued (tests/test_function_replay_cost.py).
        self.entered, self.left = {}, {}
        for ordinal in scope.streams:
            with cupy.cuda.Device(ordinal):
                self.entered[ordinal] = cupy.cuda.Event(disable_timing=True)
                self.left[ordinal] = cupy.cuda.Event(disable_timing=True)

    def stale(self) -> bool:
        """Whether a variable the graph updates in place has another buffer now, or its buffer is held
        by someone else (an array read from it between calls, which must keep its values: TF's
        promise, kept eagerly by copy-on-write). Then the step is captured again, after an eager
        step that moves the variable to a buffer of its own."""
        for variable, buffer in self.updated:
            value = variable._value
            # References: `value`, the attribute, getrefcount's argument; any other is a holder's.
            if id(value) != buffer or sys.getrefcount(value) > 3:
                return True
        return False

    def replay(self, inputs):
        cupy = _gpu.cupy_module()
        streams = self.scope.streams
        if self.across is not None:  # each GPU's legacy stream after every GPU's work so far
            self.across.join()
        for ordinal, stream in streams.items():  # after the eager work queued so far (inputs included)
            with cupy.cuda.Device(ordinal):
                entered = self.entered[ordinal]
                entered.record(cupy.cuda.Stream.null)
                stream.wait_event(entered)
        for (_, source, _), (buffer, ordinal) in zip(inputs.sources(), self.buffers):
            _copy_into(buffer, source, streams[ordinal])
        for ordinal, event in self.copied.items():  # every GPU's graph after every input copy
            with cupy.cuda.Device(ordinal):
                event.record(streams[ordinal])
            for other, stream in streams.items():
                if other != ordinal:
                    with cupy.cuda.Device(other):
                        stream.wait_event(event)
        for hook in self.scope.replay_hooks:
            hook()
        for ordinal, graph in self.graphs.items():
            with cupy.cuda.Device(ordinal):
                graph.launch(streams[ordinal])
        for ordinal, stream in streams.items():  # eager work queued later runs after the replay
            with cupy.cuda.Device(ordinal):
                left = self.left[ordinal]
                left.record(stream)
                cupy.cuda.Stream.null.wait_event(left)
        if self.across is not None:  # and readers on any GPU after every GPU's graph
            self.across.join()
        return self.outputs


def _copy_into(buffer, source, stream):
    """One asynchronous copy of an input (device or host array) into its captured buffer."""
    if isinstance(source, np.ndarray):
        host = np.ascontiguousarray(source, buffer.dtype)
        buffer.data.copy_from_host_async(host.ctypes.data, host.nbytes, stream)
        return
    if not source.flags.c_contiguous:
        with stream:
            source = source.copy()
    buffer.data.copy_from_device_async(source.data, buffer.nbytes, stream)


def _capture(fn, strategy, inputs, ordinals):
    """The step captured into one graph per GPU of ``ordinals``, or the exception that stopped it."""
    cupy = _gpu.cupy_module()
    pool, host_written = cupy.cuda.MemoryPool(), cupy.cuda.MemoryPool()
    streams = {}
    for o in ordinals:
        with cupy.cuda.Device(o):
            streams[o] = _gpu.step_stream(o)
            streams[o].wait_event(cupy.cuda.Stream.null.record())
    scope = _gpu.StepScope(streams, pool.malloc, capturing=True, host_written=host_written.malloc)
    # The input buffers, filled with this call's inputs before the capture begins.
    leaves = [list(flatten(leaf)) if i in inputs.iterators else [leaf] for i, leaf in enumerate(inputs.leaves)]
    buffers = []
    with cupy.cuda.using_allocator(host_written.malloc):
        for (i, j, k), source, device in inputs.sources():
            ordinal = int(source.data.device_id) if k is None or _is_device_array(source) else \
                device_util.physical_ordinal(device)
            with cupy.cuda.Device(ordinal):
                buffer = cupy.empty(source.shape, source.dtype)
            _copy_into(buffer, source, streams[ordinal])
            buffers.append((buffer, ordinal))
            part = leaves[i][j]
            if k is None:
                leaves[i][j] = buffer
            else:
                components = list(part.values)
                components[k] = buffer
                leaves[i][j] = type(part)(components, part._devices)
    flat = [pack_sequence_as(leaf, parts) if i in inputs.iterators else parts[0]
            for i, (leaf, parts) in enumerate(zip(inputs.leaves, leaves))]
    for i in inputs.iterators:
        flat[i] = _OneBatch(flat[i])
    args, kwargs = pack_sequence_as(inputs.structure, flat)
    began, graphs, error = [], {}, None
    first = ordinals[0]
    try:
        # Relaxed: a pool may take a new block (cudaMalloc) while capturing; other threads (the replicas)
        # may call the runtime meanwhile.
        relaxed = getattr(cupy.cuda.runtime, "streamCaptureModeRelaxed", None)
        for o in ordinals:
            with cupy.cuda.Device(o):
                streams[o].begin_capture(mode=relaxed)
            began.append(o)
        with _gpu.running_step(scope), _on_step_streams(cupy, streams, first), \
                cupy.cuda.using_allocator(pool.malloc):
            body = _as_body(fn)
            outputs = strategy.run(body, args=args, kwargs=kwargs) if strategy is not None else body(*args, **kwargs)
    except Exception as e:
        error = e
    for o in began:
        try:
            with cupy.cuda.Device(o):
                graphs[o] = streams[o].end_capture()
        except Exception as e:
            error = error or e
    if error is not None:
        return error
    captured = _Captured(scope, (pool, host_written), graphs, buffers, outputs)
    captured.constants = _closure_arrays(fn, [leaf for leaf in inputs.leaves if not _is_device_array(leaf)])
    return captured


class _WeakMethod:
    """A decorated method bound to its instance without keeping it alive. The function kept for each instance
    (``Function.__get__``, by weak key) holds this, not a bound method: a bound method's strong reference from the
    value to its key would keep every object with a decorated method, and its arrays, alive for good."""

    def __init__(self, func, instance):
        self.__func__ = func
        self._instance = weakref.ref(instance)
        self.__signature__ = inspect.signature(types.MethodType(func, instance))  # (without ``self``)
        self.__name__ = getattr(func, "__name__", type(func).__name__)
        self.__qualname__ = getattr(func, "__qualname__", self.__name__)
        self.__doc__ = getattr(func, "__doc__", None)

    @property
    def __self__(self):
        return self._instance()

    def __call__(self, *args, **kwargs):
        instance = self._instance()
        if instance is None:  # (only a function kept past its object can get here)
            raise ReferenceError(f"md.function {self.__qualname__}: its object was deleted")
        return self.__func__(instance, *args, **kwargs)


# How far the walk for a step's closure constants goes: objects deep, and objects in all (a capture is made once).
_CLOSURE_DEPTH, _CLOSURE_OBJECTS = 4, 20000


def _closure_arrays(fn, arguments) -> list:
    """The device arrays the step can reach without being given them: through its closure, the globals its code
    names (nested functions' too), a bound method's instance or an object argument (a decorated method's
    ``self``), and the containers and plain objects there. The
    graph reads their memory, so the capture holds them: rebinding a name to another array then leaves the
    graph reading the array it captured (TF's tf.function captures closure tensors by value too), never freed
    memory. Variables and the package's own objects are not walked: their buffers are the capture's business."""
    found, seen, budget = {}, set(), [_CLOSURE_OBJECTS]

    def walk(x, depth):
        if id(x) in seen or budget[0] <= 0:
            return
        seen.add(id(x))
        budget[0] -= 1
        if _is_device_array(x):
            found[id(x)] = x
            return
        if depth == 0 or isinstance(x, (str, bytes, int, float, complex, type, types.ModuleType, np.ndarray)) \
                or (type(x).__module__.partition(".")[0] == "mirrored" and type(x) is not _WeakMethod):
            return
        if isinstance(x, dict):
            items = list(x.values())
        elif isinstance(x, (list, tuple, set, frozenset)):
            items = list(x)
        elif isinstance(x, types.FunctionType):
            items = _function_reaches(x)
        elif isinstance(x, (types.MethodType, _WeakMethod)):
            items = [x.__func__, x.__self__]
        else:
            items = list(getattr(x, "__dict__", {}).values())
        for item in items:
            walk(item, depth - 1)

    walk(fn, _CLOSURE_DEPTH + 1)
    for argument in arguments:
        walk(argument, _CLOSURE_DEPTH)
    return list(found.values())


def _function_reaches(fn) -> list:
    """A function's closure cells' contents and the globals its code (and its nested code) names."""
    items = [cell.cell_contents for cell in fn.__closure__ or () if _cell_has_contents(cell)]
    codes, names = [fn.__code__], set()
    while codes:
        code = codes.pop()
        names.update(code.co_names)
        codes.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    items += [fn.__globals__[name] for name in names if name in fn.__globals__]
    return items


def _cell_has_contents(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # (a cell not yet bound)
        return False
    return True


@contextlib.contextmanager
def _on_step_streams(cupy, streams: dict, first: int):
    """Every GPU's step stream current on that GPU for the step's own code, and GPU ``first`` current. Work
    the step queues on another GPU (under ``with array.device``, as strategy.reduce along an axis computes
    each replica's part) is then captured into that GPU's graph; on its legacy stream it would run once,
    now, while the capture records nothing of it."""
    with contextlib.ExitStack() as stack:
        for o in sorted(streams, key=lambda o: o == first):  # the first GPU last: it stays current
            stack.enter_context(cupy.cuda.Device(o))
            stack.enter_context(streams[o])
        yield


def _caller_stacklevel() -> int:
    """The stacklevel of warnings.warn that names the first frame outside mirrored (the user's call)."""
    level, frame = 1, sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__", "").startswith("mirrored"):
        level, frame = level + 1, frame.f_back
    return level


# What broke a capture, recognised by the refusal's text, and how to write the step so that it captures.
_CUBLAS_HINT = ("CuPy refuses cuBLAS (`@`, cupy.matmul, dot, tensordot) while a stream is capturing: write the "
                "step's matrix products with md.linalg.matmul (or md.matmul), whose cuBLAS calls capture")
_UPLOAD_HINT = ("a host value became a GPU array inside the step (cupy.asarray/array of NumPy or Python data, "
                "ndarray.set, arange, or CuPy's concatenate/stack of more than 8 small arrays, which uploads a "
                "pointer table), a copy CuPy refuses while a stream is capturing: make such arrays before the "
                "step and pass them in (inputs are copied into the captured buffers at every call), and keep "
                "constants as Python or NumPy scalars")
_WAIT_HINT = ("the step waits for the GPU to read a value on the host (float(), int(), bool(), .item(), .get(), "
              "cupy.asnumpy, Variable.numpy()), which a capture cannot record: return the array and read it "
              "after the call")
_LOSS_SCALE_HINT = ("LossScaleOptimizer read its loss scale on the host: Keras 2's get_scaled_loss and "
                    "get_unscaled_gradients do, and so does a step it cannot decide on the GPUs (docs/function.md); "
                    "use scale_loss and pass the scaled gradients to apply_gradients, or run the step without "
                    "md.function")
_WAITS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "D2H transfers are disallowed")


def _what_broke(error: BaseException) -> str:
    """The error, the line of the step (not of mirrored or CuPy) that made it and the operation of mirrored
    it was in, for the warning, with the fix where there is one."""
    frames = []  # (module, frame), outermost first, without CuPy's Cython frames (not the step's)
    tb = error.__traceback__
    while tb is not None:
        if not tb.tb_frame.f_code.co_filename.endswith((".pyx", ".pxd", ".pxi")):
            frames.append((tb.tb_frame.f_globals.get("__name__", ""), tb))
        tb = tb.tb_next
    where, user = "", -1
    for i in range(len(frames) - 1, -1, -1):
        module, tb = frames[i]
        if not module.startswith(("mirrored", "cupy", "fake_cupy")):
            line = traceback.extract_tb(tb, limit=1)[0]
            where, user = f" (at {line.filename}:{line.lineno}, in {line.name}: {line.line})", i
            break
    # The innermost of mirrored's functions the step's line called: the operation that broke the capture.
    inside = [(module, tb.tb_frame.f_code.co_qualname) for module, tb in frames[user + 1:]
              if module.startswith("mirrored.")]
    operation = f" inside {inside[-1][0]}.{inside[-1][1]}" if inside else ""
    message = str(error)
    hint = ""
    if isinstance(error, NotImplementedError) and "cuBLAS" in message:
        hint = _CUBLAS_HINT
    elif "H2D transfers are disallowed" in message:
        hint = _UPLOAD_HINT
    elif any(wait in message for wait in _WAITS):
        hint = _LOSS_SCALE_HINT if any(m == "mirrored.train.mixed_precision" for m, _ in inside) else _WAIT_HINT
    return f"{type(error).__name__}: {message}{where}{operation}{'; ' + hint if hint else ''}"
