"""Distributed values: one component per replica, and variables kept in sync.

``PerReplica`` holds values that differ between replicas, ``Mirrored`` values
known to be equal. ``md.Variable`` is a variable on one device outside any
strategy, a ``MirroredVariable`` (``ON_WRITE``: every update reaches every
copy) or a ``SyncOnReadVariable`` (``ON_READ``: each replica updates its own
copy, reads in cross-replica context aggregate) inside a strategy's scope.

Reading a variable returns its buffer itself (inside ``run``, the replica's copy:
a few attribute loads, no copy). Updates write into that buffer while nothing else
holds it; when something does (an array read earlier and still referenced, a view
of it), the variable first takes a new buffer, so an array read before an update
keeps its value: TensorFlow's promise, kept the way its runtime keeps it
(copy-on-write). docs/training.md.
"""

from __future__ import annotations

import inspect
import operator
import sys
import threading
import weakref

import numpy as np

from .._nest import is_nested, map_structure
from ..device import device_util, gpu as _gpu
from ..device import scatter_gather
from ..device.indexed_slices import IndexedSlices
from ..device.tensor_shape import TensorShape
from ..errors import OutOfRangeError
from .context import _local, get_replica_context, get_strategy
from .options import VariableAggregation, VariableSynchronization
from .reduce_util import ReduceOp

# How many times a variable copy was given a new buffer (copy-on-write, see _writable_buffer):
# while it stays the same, every buffer a caller cached (the optimizers' GPU tables) is current.
# Replica threads count under a lock: a lost update could step it back to a value a cache was made at.
buffers_replaced = 0
_buffers_replaced_lock = threading.Lock()


def _numpy_text(value) -> str:
    """A value as TF's variable repr shows it: a scalar plainly (``numpy=1.0``), an array by its repr."""
    value = np.asarray(value)
    if value.ndim == 0:
        return str(value[()])
    text = repr(value)
    return "\n" + text if "\n" in text else text  # (TF starts an array of several lines on a line of its own)

class DistributedValues:
    """Base class of values with one component per replica (``.values``)."""

    def __init__(self, values, devices=None):
        if not isinstance(values, (list, tuple)) or not values:
            raise ValueError(f"values={values!r}: a {type(self).__name__} takes a non-empty list or tuple with one "
                             "component per replica, e.g. md.PerReplica([x0, x1])")
        self._values = tuple(values)
        self._devices = tuple(devices) if devices is not None else None

    @property
    def values(self) -> tuple:
        return self._values

    @property
    def _primary(self):
        return self._values[0]

    def _devices_or(self, default):
        return self._devices if self._devices is not None else default

    def __str__(self) -> str:
        body = ",\n".join(f"  {i}: {v}" for i, v in enumerate(self._values))
        return f"{type(self).__name__}:{{\n{body}\n}}"

    def __repr__(self) -> str:
        body = ",\n".join(f"  {i}: {v!r}" for i, v in enumerate(self._values))
        return f"{type(self).__name__}:{{\n{body}\n}}"


class PerReplica(DistributedValues):
    """Values that may differ from replica to replica (results of ``run``, dataset elements).

    No operators, as TF's: an array with a PerReplica refuses them too (NumPy would compare or combine the array's
    elements with the PerReplica object); ``==`` with another value is identity.
    """

    __array_ufunc__ = None

    def __eq__(self, other):
        if isinstance(other, DistributedValues) or not hasattr(other, "__array__"):
            return self is other
        raise TypeError("a PerReplica holds one value per replica and cannot be compared with an array; compare "
                        "its components: strategy.experimental_local_results(value)")

    def __ne__(self, other):
        return not self.__eq__(other)

    __hash__ = DistributedValues.__hash__


class _PythonScalar:
    """``float()``, ``int()`` and ``bool()`` of the value ``numpy()`` reads (Mirrored's and a variable's)."""

    def __float__(self) -> float:
        return float(self.numpy())

    def __int__(self) -> int:
        return int(self.numpy())

    def __bool__(self) -> bool:
        return bool(self.numpy())


class Mirrored(np.lib.mixins.NDArrayOperatorsMixin, _PythonScalar, DistributedValues):
    """Values known to be identical on every replica (results of all-reduce, broadcast).

    As TF's, it stands for its current replica's component (inside ``run``; replica 0's in cross-replica
    context): operators, NumPy functions, indexing, ``numpy()``, ``shape``, ``dtype`` and ``device`` read that
    component. As TF's too, it is hashable, and ``==`` is element-wise with an array, identity with anything else.
    """

    def __eq__(self, other):
        if hasattr(other, "__array__") and not isinstance(other, DistributedValues):
            return np.equal(self, other)
        return self is other

    def __ne__(self, other):
        if hasattr(other, "__array__") and not isinstance(other, DistributedValues):
            return np.not_equal(self, other)
        return self is not other

    __hash__ = DistributedValues.__hash__

    def _local(self):
        stack = getattr(_local, "stack", None)
        if stack and stack[-1].replica_context is not None and len(self._values) > 1:
            return self._values[stack[-1].replica_context._local_replica_id]
        return self._values[0]

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        if any(isinstance(o, Mirrored) for o in kwargs.get("out", ())):
            return NotImplemented  # its components are values, not buffers to write into
        inputs = tuple(x._local() if isinstance(x, Mirrored) else x for x in inputs)
        return getattr(ufunc, method)(*inputs, **kwargs)

    def __array__(self, dtype=None, copy=None):
        host = device_util.to_host(self._local())
        return np.array(host, dtype=dtype, copy=True) if copy else np.asarray(host, dtype=dtype)

    def __getitem__(self, index):
        return self._local()[index]

    def __iter__(self):
        local = self._local()
        if getattr(local, "ndim", None) == 0:
            raise TypeError("Cannot iterate over a scalar Mirrored value; read it with m.numpy()")
        return iter(local)

    def numpy(self):
        """A host copy of the component (a NumPy scalar for a scalar, as TF's ``numpy()``)."""
        return np.array(device_util.to_host(self._local()), copy=True)[()]

    shape = property(lambda self: TensorShape(self._local().shape))
    dtype = property(lambda self: self._local().dtype)

    @property
    def device(self) -> str:
        """The component's device (replica 0's in cross-replica context)."""
        local = self._local()
        if self._devices is not None:
            return device_util.canonicalize(self._devices[next(i for i, x in enumerate(self._values) if x is local)])
        return device_util.canonicalize(f"/gpu:{local.device.id}" if device_util.on_gpu(local) else "/cpu:0")

    def ref(self) -> "_Ref":
        """A hashable reference to this value (``ref.deref()`` returns it)."""
        return _Ref(self)

    experimental_ref = ref


class _VariableMeta(type):
    # ``md.Variable(...)`` asks the current strategy to create the variable, so
    # the same model code makes a plain variable outside any scope and a
    # MirroredVariable / SyncOnReadVariable inside MirroredStrategy.scope().
    def __call__(cls, *args, **kwargs):
        if cls is Variable:
            return get_strategy().extended._create_variable(*args, **kwargs)
        return super().__call__(*args, **kwargs)

    @property
    def __signature__(cls) -> inspect.Signature:
        # inspect would otherwise show __call__'s (*args, **kwargs): show what md.Variable(...) takes
        # (the strategy's variable creator) and, for the subclasses, their own __init__.
        if cls is Variable:
            function = type(get_strategy().extended)._create_variable
        else:
            function = cls.__init__
        signature = inspect.signature(function)
        return signature.replace(parameters=list(signature.parameters.values())[1:])  # without self


class Variable(np.lib.mixins.NDArrayOperatorsMixin, _PythonScalar, metaclass=_VariableMeta):
    """``md.Variable(initial_value=None, trainable=None, validate_shape=True, caching_device=None, name=None,
    variable_def=None, dtype=None, import_scope=None, constraint=None, synchronization=AUTO, aggregation=NONE,
    shape=None, experimental_enable_variable_lifting=True)``: ``tf.Variable``'s arguments in its order.

    Arithmetic and NumPy functions apply to the current value. As in
    TensorFlow, ``==`` is element-wise, so variables are not hashable: key
    dictionaries by ``var.ref()``.
    """

    def __hash__(self):
        # (None would give Python's "unhashable type: 'DeviceVariable'", naming neither the cause nor the fix)
        raise TypeError(f"Variable is unhashable. Instead, use variable.ref() as the key. (Variable: {self!r})")

    # Named here so that a MirroredVariable, a Mirrored too, compares element-wise as every variable does.
    __eq__ = np.lib.mixins.NDArrayOperatorsMixin.__eq__
    __ne__ = np.lib.mixins.NDArrayOperatorsMixin.__ne__
    _constraint = None  # set by the strategy that creates the variable

    @property
    def constraint(self):
        """The ``constraint`` given at creation (a callable, or None); Keras' optimizers apply it after an update."""
        return self._constraint

    def value(self):
        return self.read_value()

    def is_initialized(self, name=None) -> np.ndarray:
        """Whether the variable (every copy of it) holds a value: always, from its creation on. A new 0-d bool
        array per call, TF's scalar tensor: inside ``strategy.run`` each replica's is its own, so the result is
        PerReplica as in TF (one shared ``np.bool_`` would make ``run`` return it alone)."""
        return np.array(True)

    def read_value_no_copy(self):
        """TF's read that never copies: here every read is one (``read_value`` returns the buffer itself, which
        an update leaves alone while a reader holds it)."""
        return self.read_value()

    def get_shape(self) -> TensorShape:
        """TF's alias of ``shape`` (an ``md.TensorShape``: a tuple with ``as_list()``, ``rank``, ...)."""
        return self.shape

    def numpy(self):
        """A host copy of the current value (a NumPy scalar for a scalar variable, as in TensorFlow)."""
        return np.array(device_util.to_host(self.read_value()), copy=True)[()]

    def __array__(self, dtype=None, copy=None):
        host = device_util.to_host(self.read_value())
        return np.array(host, dtype=dtype, copy=True) if copy else np.asarray(host, dtype=dtype)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        if any(isinstance(o, Variable) for o in kwargs.get("out", ())):
            return NotImplemented  # in-place ufuncs would bypass assign; use var.assign(...)
        inputs = tuple(x.read_value() if isinstance(x, Variable) else x for x in inputs)
        return getattr(ufunc, method)(*inputs, **kwargs)

    def __getitem__(self, index):
        return self.read_value()[index]

    # No __len__, as tf.Variable: len(v) is a TypeError; iterating goes over the rows of the value.
    def __iter__(self):
        value = self.read_value()
        if value.ndim == 0:
            raise TypeError(f"Cannot iterate over a scalar: variable '{self.name}' has shape (); read it with "
                            "v.numpy() or float(v)")
        return iter(value)

    def __pos__(self):
        raise TypeError(f"bad operand type for unary +: '{type(self).__name__}' (as for tf.Variable); use "
                        "v.read_value()")

    # ``v += x`` would rebind v to an array and leave the variable as it is: refused, as tf.Variable refuses it.
    def _in_place(self, operator_text: str, update: str):
        raise RuntimeError(f"`v {operator_text}= x` is not supported for variable '{self.name}' (as for "
                           f"tf.Variable): update it with {update}, or write `out = v {operator_text} x` for a new "
                           "array")

    def __iadd__(self, other):
        self._in_place("+", "v.assign_add(x)")

    def __isub__(self, other):
        self._in_place("-", "v.assign_sub(x)")

    def __imul__(self, other):
        self._in_place("*", "v.assign(v * x)")

    def __itruediv__(self, other):
        self._in_place("/", "v.assign(v / x)")

    def __ipow__(self, other):
        self._in_place("**", "v.assign(v ** x)")

    @property
    def initial_value(self):
        raise RuntimeError(f"initial_value: variable '{self.name}' does not keep the value it was created with "
                           "(TF's eager variables do not either: 'not supported when eager execution is enabled'); "
                           "keep it yourself before creating the variable")

    def ref(self) -> "_Ref":
        """A hashable reference to this variable (``ref.deref()`` returns it)."""
        return _Ref(self)

    experimental_ref = ref  # (TF's deprecated name of ref)

    def __repr__(self) -> str:
        return (f"<mirrored.Variable '{self.name}' shape={self.shape} dtype={self.dtype.name}, "
                f"numpy={_numpy_text(self.numpy())}>")


class _Ref:
    __slots__ = ("_var",)

    def __init__(self, var):
        self._var = var

    def deref(self):
        return self._var

    def __hash__(self):
        return id(self._var)

    def __eq__(self, other):
        return isinstance(other, _Ref) and other._var is self._var


# tf.Variable's scatter methods taking an IndexedSlices: the update each applies (scatter_gather.apply's ops).
_SCATTERS = {"scatter_add": "add", "scatter_sub": "sub", "scatter_mul": "mul", "scatter_div": "div",
             "scatter_max": "max", "scatter_min": "min", "scatter_update": "update"}
# ... and those taking indices of shape [..., K] and updates (no use_locking: TF's have none)
_ND_SCATTERS = {"scatter_nd_add": "add", "scatter_nd_sub": "sub", "scatter_nd_update": "update",
                "scatter_nd_max": "max", "scatter_nd_min": "min"}
_OP_WORDS = {"add": "adds", "sub": "subtracts", "mul": "multiplies by", "div": "divides by",
             "max": "takes the maximum with", "min": "takes the minimum with"}


def _scatter_method(method: str):
    def scatter(self, sparse_delta, use_locking=False, name=None):
        return self._scatter(method, sparse_delta)
    op = _SCATTERS[method]
    scatter.__name__ = scatter.__qualname__ = method
    scatter.__doc__ = (f"``tf.Variable.{method}``: row ``sparse_delta.indices[i]`` of the value "
                       + ("becomes ``sparse_delta.values[i]``" if op == "update" else
                          f"{_OP_WORDS[op]} ``sparse_delta.values[i]`` (repeated rows, each in turn)")
                       + "; returns the variable.")
    return scatter


def _scatter_nd_method(method: str):
    def scatter_nd(self, indices, updates, name=None):
        return self._scatter_nd(method, indices, updates)
    op = _ND_SCATTERS[method]
    scatter_nd.__name__ = scatter_nd.__qualname__ = method
    scatter_nd.__doc__ = (f"``tf.Variable.{method}``: ``indices`` of shape ``[..., K]`` address the first ``K`` "
                          "dimensions; the entry (or slice) at ``indices[i]`` "
                          + ("becomes ``updates[i]`` (a repeated index: the last one)" if op == "update" else
                             f"{_OP_WORDS[op]} ``updates[i]`` (repeated indices, each in turn)")
                          + "; ``updates`` has shape ``indices.shape[:-1] + shape[K:]``. Returns the variable. "
                          "docs/variables.md.")
    return scatter_nd


def _check_sparse_delta(variable, sparse_delta, method: str) -> None:
    if type(sparse_delta) is not IndexedSlices:
        raise TypeError(f"sparse_delta: {method} takes an md.IndexedSlices (values, indices), not a "
                        f"{type(sparse_delta).__name__}; for a dense delta use assign_add/assign_sub")
    if len(variable.shape) == 0:
        raise ValueError(f"sparse_delta: {method} updates rows, and variable '{variable.name}' is a scalar; "
                         "use assign / assign_add")
    rows = tuple(sparse_delta.values.shape)
    if rows[1:] != tuple(variable.shape)[1:]:
        raise ValueError(f"sparse_delta: rows of shape {rows[1:]} do not fit variable '{variable.name}' of shape "
                         f"{tuple(variable.shape)}; each row must have shape {tuple(variable.shape)[1:]}")


class DeviceVariable(Variable):
    """A variable on one device: ``md.Variable`` outside a strategy, and each copy of a distributed one."""

    def __init__(self, value, name: str, device: str, trainable: bool = True,
                 synchronization=VariableSynchronization.AUTO, aggregation=VariableAggregation.NONE):
        self._device = device
        self._value = device_util.place(value, device, copy=True)
        self._shape = TensorShape(self._value.shape)  # (a variable keeps its shape: assign checks it)
        self._name = name
        self._trainable = trainable
        self._synchronization = synchronization
        self._aggregation = aggregation
        self._distributed_container = None

    # The strategy whose scope created it when that strategy keeps plain variables (OneDeviceStrategy), else None
    # (outside any scope, or a copy of a distributed variable, whose container has the strategy).
    _strategy = None
    distribute_strategy = property(lambda self: self._strategy)
    name = property(lambda self: self._name)
    device = property(lambda self: self._device)
    shape = property(lambda self: self._shape)
    dtype = property(lambda self: self._value.dtype)
    trainable = property(lambda self: self._trainable)
    synchronization = property(lambda self: self._synchronization)
    aggregation = property(lambda self: self._aggregation)

    def read_value(self):
        return self._value

    def set_shape(self, shape):
        """``tf.Variable.set_shape``: ``shape`` must be compatible with the variable's (``None`` dimensions match
        any); the shape stays the one it was created with, which is fully known."""
        if not self._shape.is_compatible_with(shape):
            raise ValueError(f"shape: {TensorShape(shape)} is not compatible with the shape {self._shape} of "
                             f"variable '{self._name}'; a variable keeps the shape it was created with")

    def count_up_to(self, limit):
        """``tf.Variable.count_up_to`` (deprecated in TF): adds 1 to a scalar int32 / int64 variable and returns its
        value before; ``OutOfRangeError`` once that value has reached ``limit``."""
        if self.dtype not in (np.int32, np.int64):
            raise TypeError(f"count_up_to: variable '{self._name}' is {self.dtype}; it counts in an int32 or int64 "
                            "variable")
        if self._shape.rank != 0:
            raise ValueError(f"count_up_to: variable '{self._name}' has shape {self._shape}; it counts in a scalar "
                             "variable")
        before = self.numpy()
        if before >= limit:
            raise OutOfRangeError(None, None, f"Reached limit of {limit}: variable '{self._name}' is {before}")
        self.assign_add(np.ones((), self.dtype))
        return before

    # tf.Variable's older readers, which TF keeps on its plain variables (not on distributed ones)

    def sparse_read(self, indices, name=None):
        """The rows of the value at ``indices`` (``tf.gather`` along axis 0), a copy, of what ``read_value``
        reads; indices out of range raise."""
        return scatter_gather.gather(self.read_value(), indices, self._name)

    def gather_nd(self, indices, name=None):
        """``tf.gather_nd``: entry ``indices[i]`` (``K`` numbers) addresses the first ``K`` dimensions of the
        value; the result has shape ``indices.shape[:-1] + shape[K:]``, a copy, of what ``read_value`` reads."""
        return scatter_gather.gather_nd(self.read_value(), indices, self._name)


    def _converted(self, value, argument: str = "value"):
        """``value`` on this variable's device, checked as TF's assign checks it: the same shape; a
        variable of the same dtype; an array or number of another dtype only when it converts
        without changing a value (an int8 variable refuses 300 as TF does; NumPy would wrap it to 44)."""
        variable = isinstance(value, Variable)
        if variable:
            value = value.read_value()
        new = device_util.place(value, self._device)
        if tuple(new.shape) != self.shape:
            raise ValueError(
                f"{argument}: cannot assign a value of shape {tuple(new.shape)} to variable '{self._name}' "
                f"of shape {self.shape}; the shapes must be equal (reshape the value)"
            )
        if new.dtype != self.dtype:
            if variable or not np.can_cast(new.dtype, self.dtype, "same_kind"):
                raise TypeError(
                    f"{argument}: cannot assign a value of dtype {new.dtype} to variable '{self._name}' of dtype "
                    f"{self.dtype}; convert it with .astype({self.dtype.name!r})"
                )
            self._check_fits(new, argument)
        return new

    def _check_fits(self, new, argument: str) -> None:
        """Refuses a value that this variable's (narrower) dtype cannot hold."""
        dtype = self.dtype
        if new.size == 0 or dtype.kind not in "iuf" or new.dtype.kind not in "biuf":
            return
        if dtype.kind == "f":
            if new.dtype.kind != "f" or new.dtype.itemsize <= dtype.itemsize:
                return  # integers and narrower floats round, as TF converts them
            finite = new[abs(new) < np.inf]
            if finite.size == 0 or float(abs(finite).max()) <= float(np.finfo(dtype).max):
                return
            lowest, highest = float(finite.min()), float(finite.max())
        else:
            lowest, highest = int(new.min()), int(new.max())
            info = np.iinfo(dtype)
            if info.min <= lowest and highest <= info.max:
                return
        raise TypeError(
            f"{argument}: cannot assign {lowest if lowest == highest else f'values in [{lowest}, {highest}]'} "
            f"to variable '{self._name}' of dtype "
            f"{dtype}, which holds [{np.iinfo(dtype).min if dtype.kind in 'iu' else -np.finfo(dtype).max}, "
            f"{np.iinfo(dtype).max if dtype.kind in 'iu' else np.finfo(dtype).max}]; TF refuses a value that "
            "does not fit (convert it yourself, e.g. np.clip(...).astype(...), if wrapping is meant)"
        )

    def _writable_buffer(self):
        """This copy's buffer, ready to be written in place: a fresh one first when something else holds it."""
        global buffers_replaced
        value = self._value
        # References: `value`, the attribute, getrefcount's argument. Any other is a
        # reader's (an array or a view read earlier), whose values must not change.
        step = _gpu._step
        if sys.getrefcount(value) > 3:
            if step is not None and step.capturing:
                # A captured update must write where the graph will write on every replay.
                raise RuntimeError(
                    f"variable {self.name!r}: an array read from it is still referenced when it is updated, so "
                    "the update would move it to a new buffer (copy-on-write), which a captured step cannot "
                    "replay; inside md.function drop such references before the update (del them, or read the "
                    "variable where it is used)")
            value = self._value = value.copy()
            with _buffers_replaced_lock:
                buffers_replaced += 1
        if step is not None and step.capturing:  # the graph writes this buffer: md.function checks it stays
            step.captured.setdefault("variable buffers", {})[id(self)] = (self, id(value))
        return value

    # assign, assign_add and assign_sub calls so far: a caller that remembers a value it wrote
    # itself (the optimizers' step count) knows it is still current while this stays the same.
    _stores = 0

    def _store(self, new) -> None:
        """``new`` (this variable's shape, on its device) written into the buffer, converted to its dtype.

        Always a copy: the caller may later write into the array it passed.
        """
        buffer = self._writable_buffer()
        buffer[...] = new
        self._stores += 1

    def assign(self, value, use_locking=None, name=None, read_value=True):
        self._store(self._converted(value))
        return _updated(self, read_value)

    def _combine(self, fn, delta):
        self._store(fn(self._value, self._converted(delta, "delta")))

    def assign_add(self, delta, use_locking=None, name=None, read_value=True):
        self._combine(operator.add, delta)
        return _updated(self, read_value)

    def assign_sub(self, delta, use_locking=None, name=None, read_value=True):
        self._combine(operator.sub, delta)
        return _updated(self, read_value)

    def _scatter(self, method: str, sparse_delta):
        _check_sparse_delta(self, sparse_delta, method)
        op = _SCATTERS[method]
        self._apply(op, scatter_gather.row_plan(self._value, method, op, sparse_delta.indices,
                                                sparse_delta.values, self._name))
        return self

    def _scatter_nd(self, method: str, indices, updates):
        op = _ND_SCATTERS[method]
        self._apply(op, scatter_gather.scatter_nd_plan(self._value, method, op, indices, updates, self._name))
        return self

    def _apply(self, op: str, plan) -> None:
        """A checked update (``plan``: rows and slices) written into this copy's buffer."""
        scatter_gather.apply(self._writable_buffer(), op, *plan)
        self._stores += 1

    def batch_scatter_update(self, sparse_delta, use_locking=False, name=None):
        """``tf.Variable.batch_scatter_update``: ``sparse_delta.indices`` of shape ``[d0, ..., dn]`` update along
        dimension ``n``: ``v[i0, ..., in-1, indices[i0, ..., in]] = values[i0, ..., in]`` (1-D indices: rows, as
        ``scatter_update``). Returns the variable."""
        if type(sparse_delta) is not IndexedSlices:
            raise TypeError(f"sparse_delta: Argument `sparse_delta` must be a `tf.IndexedSlices` (an "
                            f"md.IndexedSlices(values, indices)), not a {type(sparse_delta).__name__}")
        self._apply("update", scatter_gather.batch_plan(self._value, sparse_delta.indices, sparse_delta.values,
                                                        self._name))
        return self

    scatter_add, scatter_sub, scatter_mul, scatter_div, scatter_max, scatter_min, scatter_update = map(
        _scatter_method, _SCATTERS)
    scatter_nd_add, scatter_nd_sub, scatter_nd_update, scatter_nd_max, scatter_nd_min = map(
        _scatter_nd_method, _ND_SCATTERS)


def running_replica_id(strategy):
    """This thread's replica id when it runs a replica of ``strategy``, else None.

    On every read inside ``run``: the top of this thread's context stack, read
    directly (a few attribute loads, no call).
    """
    stack = getattr(_local, "stack", None)
    if stack:
        top = stack[-1]
        if top.replica_context is not None and top.strategy is strategy:
            return top.replica_context._local_replica_id
    return None


def aggregation_in_replicas(variable) -> VariableAggregation:
    """``variable``'s aggregation, which an update inside ``run`` combines the replicas' values by (TF's error
    for NONE)."""
    aggregation = variable.aggregation
    if aggregation == VariableAggregation.NONE:
        raise ValueError(
            f"You must specify an aggregation method to update {type(variable).__name__} '{variable.name}' in "
            "replica context: create it with md.Variable(..., aggregation=md.VariableAggregation.SUM, MEAN or "
            "ONLY_FIRST_REPLICA), or update it in cross-replica context (strategy.extended.update)")
    return aggregation


def update_in_replica(variable, value, apply):
    """``variable``'s update inside ``run``: the replicas' ``value`` combined by its aggregation (in a
    ``merge_call``), then ``apply(combined)`` once. Returns ``variable``."""
    aggregation = aggregation_in_replicas(variable)

    def merge_fn(strategy, per_replica):
        if aggregation == VariableAggregation.ONLY_FIRST_REPLICA:
            combined = strategy.experimental_local_results(per_replica)[0]
        else:
            combined = strategy.extended.reduce_to(ReduceOp.from_variable_aggregation(aggregation), per_replica,
                                                   destinations=variable)
        apply(combined)

    get_replica_context().merge_call(merge_fn, args=(value,))
    return variable


class AssignsThroughUpdate:
    """``assign`` / ``assign_add`` / ``assign_sub`` of a variable whose ``_update(method, value)`` decides
    where and how an update applies (replica or cross-replica context)."""

    def assign(self, value, use_locking=None, name=None, read_value=True):
        return _updated(self._update("assign", value), read_value)

    def assign_add(self, delta, use_locking=None, name=None, read_value=True):
        return _updated(self._update("assign_add", delta), read_value)

    def assign_sub(self, delta, use_locking=None, name=None, read_value=True):
        return _updated(self._update("assign_sub", delta), read_value)


class DistributedVariable(Variable, DistributedValues):
    """A variable with one :class:`DeviceVariable` copy per replica device."""

    _synchronization_mode = None

    def __init__(self, strategy, components, aggregation):
        DistributedValues.__init__(self, components, [c.device for c in components])
        self._strategy = strategy
        self._aggregation = aggregation
        for c in components:
            c._distributed_container = weakref.ref(self)

    distribute_strategy = property(lambda self: self._strategy)
    name = property(lambda self: self._primary.name)
    shape = property(lambda self: self._primary.shape)
    dtype = property(lambda self: self._primary.dtype)
    trainable = property(lambda self: self._primary.trainable)
    aggregation = property(lambda self: self._aggregation)
    synchronization = property(lambda self: self._synchronization_mode)

    @property
    def device(self) -> str:
        return self._component().device

    def _local_replica_id(self):
        return running_replica_id(self._strategy)

    def _component(self) -> DeviceVariable:
        rid = self._local_replica_id()
        return self._values[rid if rid is not None else 0]

    def _update_each_copy(self, method: str, *args):
        """Cross-replica update: ``method(*args)`` applied to every copy (through ``extended.update``)."""
        self._strategy.extended.update(self, lambda v, *a: getattr(v, method)(*a), args=args)
        return self

    __str__ = DistributedValues.__str__
    __repr__ = DistributedValues.__repr__

    is_distributed_variable = True

    # TF's distributed variables have no in-place operators (tf.Variable's RuntimeError is not theirs): Python
    # falls back to the plain operator, so ``v += x`` rebinds the name v to the array v + x and leaves the
    # variable as it is, as in TF.
    def __iadd__(self, other):
        return NotImplemented

    __isub__ = __imul__ = __itruediv__ = __ipow__ = __iadd__

    def set_shape(self, shape):
        raise NotImplementedError(f"set_shape: TensorFlow's {type(self).__name__} does not implement it "
                                  f"('{self.name}'); a variable's shape is fixed at creation")

    def count_up_to(self, limit):
        raise NotImplementedError(f"count_up_to: TensorFlow's {type(self).__name__} does not implement it "
                                  f"('{self.name}'); count with v.assign_add(1) and compare the value yourself")

    # TF 2.21's distributed variables have these tf.Variable methods but not their implementations: tf.Variable's
    # base class raises NotImplementedError (the updates) or AttributeError (the readers), and so do we, naming
    # how to do it instead.

    def _not_implemented(self, method: str):
        raise NotImplementedError(
            f"{method}: TensorFlow's {type(self).__name__} does not implement it ('{self.name}'); "
            + self._instead(method))

    def _instead(self, method: str) -> str:
        """What to do instead of ``method`` (an update TF's distributed variable does not implement)."""
        return (f"apply it to each copy: strategy.extended.update(v, lambda copy: copy.{method}(...)) in "
                "cross-replica context")

    def scatter_nd_add(self, indices, updates, name=None):
        self._not_implemented("scatter_nd_add")

    def scatter_nd_sub(self, indices, updates, name=None):
        self._not_implemented("scatter_nd_sub")

    def scatter_nd_update(self, indices, updates, name=None):
        self._not_implemented("scatter_nd_update")

    def batch_scatter_update(self, sparse_delta, use_locking=False, name=None):
        self._not_implemented("batch_scatter_update")

    def _no_reader(self, method: str):
        raise AttributeError(
            f"{method}: TensorFlow's {type(self).__name__} has no {method} ('{self.name}'); index its value: "
            f"np.asarray(v)[...] in cross-replica context, or v.read_value()[...] inside strategy.run")

    def sparse_read(self, indices, name=None):
        self._no_reader("sparse_read")

    def gather_nd(self, indices, name=None):
        self._no_reader("gather_nd")


class _NdUpdate:
    """One replica's ``scatter_nd_*`` arguments, merged as one value by ``merge_call``."""

    __slots__ = ("indices", "updates")

    def __init__(self, indices, updates):
        self.indices, self.updates = indices, updates


class MirroredVariable(AssignsThroughUpdate, DistributedVariable, Mirrored):
    """``ON_WRITE`` variable: every update is applied to every copy, so copies never drift."""

    _synchronization_mode = VariableSynchronization.ON_WRITE

    def read_value(self):
        # _component() inlined: this runs for every variable on every step.
        stack = getattr(_local, "stack", None)
        if stack:
            top = stack[-1]
            if top.replica_context is not None and top.strategy is self._strategy:
                return self._values[top.replica_context._local_replica_id]._value
        return self._values[0]._value

    def _update(self, method: str, value):
        if self._local_replica_id() is None:
            if isinstance(value, PerReplica):
                raise ValueError(
                    f"value: a PerReplica value cannot be assigned to MirroredVariable '{self.name}' in "
                    "cross-replica context (its copies would differ); reduce it first with "
                    "strategy.reduce(...), or assign inside strategy.run with aggregation SUM or MEAN"
                )
            return self._update_each_copy(method, value)
        return update_in_replica(self, value, lambda reduced: self._update_each_copy(method, reduced))

    def _scatter(self, method: str, sparse_delta):
        summed = self._aggregation in (VariableAggregation.SUM, VariableAggregation.MEAN)
        if summed and method in ("scatter_min", "scatter_max", "scatter_update"):
            raise NotImplementedError(  # (TF's words; its other row scatters take any aggregation)
                f"{method} is only supported for mirrored variable (variable created within certain "
                f"`tf.distribute.Strategy` scope) with NONE or `ONLY_FIRST_REPLICA` aggregation, got: "
                f"{self._aggregation}; variable '{self.name}': update it with assign_add, or create it with "
                "aggregation NONE")
        self._refuse_summed_in_replica(method)
        _check_sparse_delta(self, sparse_delta, method)
        return self._update(method, sparse_delta)

    def _refuse_summed_in_replica(self, method: str) -> None:
        """Index updates inside ``run`` cannot be summed or averaged over the replicas (TF fails on them with an
        AssertionError, or runs each on its replica's copy: the copies drift apart)."""
        if self._aggregation in (VariableAggregation.SUM, VariableAggregation.MEAN) and \
                self._local_replica_id() is not None:
            raise NotImplementedError(
                f"{method}: MirroredVariable '{self.name}' has aggregation {self._aggregation}, and the replicas' "
                f"index updates cannot be summed or averaged; call {method} in cross-replica context (it updates "
                "every copy), or create the variable with aggregation ONLY_FIRST_REPLICA")

    def _scatter_nd(self, method: str, indices, updates):
        # TF 2.21 runs these on one copy (the first in cross-replica context: the copies drift apart); here they
        # update every copy, as the row scatters do (docs/variables.md).
        if self._local_replica_id() is None:
            return self._update_each_copy(method, indices, updates)
        self._refuse_summed_in_replica(method)
        return update_in_replica(self, _NdUpdate(indices, updates),
                                 lambda first: self._update_each_copy(method, first.indices, first.updates))

    scatter_add, scatter_sub, scatter_mul, scatter_div, scatter_max, scatter_min, scatter_update = map(
        _scatter_method, _SCATTERS)
    scatter_nd_max, scatter_nd_min = map(_scatter_nd_method, ("scatter_nd_max", "scatter_nd_min"))


class SyncOnReadVariable(DistributedVariable):
    """``ON_READ`` variable: replicas update their own copy; cross-replica reads aggregate."""

    _synchronization_mode = VariableSynchronization.ON_READ

    def read_value(self):
        if self._local_replica_id() is not None or self._aggregation == VariableAggregation.ONLY_FIRST_REPLICA:
            return self._component().read_value()
        return self._strategy.reduce(ReduceOp.from_variable_aggregation(self._aggregation), self, axis=None)

    def assign(self, value, use_locking=None, name=None, read_value=True):
        return self._updated(self._assign(value), read_value)

    def _updated(self, variable, read_value):
        """As ``_updated``; TF returns a cross-replica update's aggregate read of the new copies, which a variable
        of aggregation NONE cannot give: the copies are updated, then that read raises (ValueError), as in TF."""
        if read_value and self._local_replica_id() is None and self._aggregation == VariableAggregation.NONE:
            self.read_value()  # (raises: NONE has no ReduceOp)
        return _updated(variable, read_value)

    def _assign(self, value):
        if self._local_replica_id() is not None:
            self._component().assign(value)
            return self
        if self._aggregation == VariableAggregation.SUM:
            # Every copy holds x / N so that the SUM read gives back x (TF's rule).
            n = self._strategy.num_replicas_in_sync
            value = (device_util.to_host(_read(value)) / n).astype(self.dtype)
        return self._update_each_copy("assign", value)

    def _add(self, method: str, delta):
        if self._local_replica_id() is not None:
            getattr(self._component(), method)(delta)
            return self
        if self._aggregation == VariableAggregation.SUM:
            raise ValueError(
                f"SyncOnReadVariable '{self.name}' does not support `{method}` in cross-replica context when "
                "aggregation is SUM (each copy would add the full delta); use assign(), or call it inside "
                "strategy.run"
            )
        return self._update_each_copy(method, delta)

    def assign_add(self, delta, use_locking=None, name=None, read_value=True):
        return self._updated(self._add("assign_add", delta), read_value)

    def assign_sub(self, delta, use_locking=None, name=None, read_value=True):
        return self._updated(self._add("assign_sub", delta), read_value)

    def _replica_copy(self, method: str) -> DeviceVariable:
        """This replica's copy, for a method TF runs on it; in cross-replica context TF's read is an aggregate,
        a tensor without the method (AttributeError)."""
        if self._local_replica_id() is None:
            if self._aggregation == VariableAggregation.NONE:
                self.read_value()  # (raises TF's ValueError first: NONE copies have no aggregate to read)
            raise AttributeError(
                f"{method}: SyncOnReadVariable '{self.name}' reads as the aggregate of its copies in cross-replica "
                f"context, which has no {method} (as in TensorFlow); call it inside strategy.run, on the "
                "replica's own copy")
        return self._component()

    def read_value_no_copy(self):
        return self._replica_copy("read_value_no_copy").read_value()

    def _instead(self, method: str) -> str:
        return "update the replicas' copies with a dense delta inside strategy.run: v.assign_add(delta)"

    def _scatter_nd(self, method: str, indices, updates):
        self._replica_copy(method)._scatter_nd(method, indices, updates)
        return self

    scatter_nd_max, scatter_nd_min = map(_scatter_nd_method, ("scatter_nd_max", "scatter_nd_min"))

    def _scatter(self, method: str, sparse_delta):
        raise NotImplementedError(  # (TF's words)
            f"Variables with `synchronization=ON_READ` doesn't support `{method}` (variable '{self.name}'); update "
            "the replica's copy with assign_add / assign inside strategy.run")

    scatter_add, scatter_sub, scatter_mul, scatter_div, scatter_max, scatter_min, scatter_update = map(
        _scatter_method, _SCATTERS)


def _updated(variable, read_value):
    """An update's result: the variable (read as its new value), or None with ``read_value=False``, as TF."""
    return variable if read_value else None


def _read(x):
    return x.read_value() if isinstance(x, Variable) else x




# --- grouping per-replica results ------------------------------------------------------


def regroup(per_replica, wrap_class=PerReplica, always_wrap: bool = False, devices=None, array_type=np.ndarray):
    """One structure with ``wrap_class`` leaves from one structure per replica.

    Leaves that are the same object on every replica stay unwrapped (unless
    ``always_wrap``); copies of one distributed variable become that variable.
    ``array_type``: the replicas' own array type besides NumPy's (GPU strategies: CuPy's), a leaf too.
    """
    v0 = per_replica[0]
    t0 = type(v0)
    # The commonest results, a leaf (an array) or nothing (None): the checks below, in short.
    if t0 is np.ndarray or t0 is array_type or v0 is None:
        for v in per_replica:
            if v is not v0:
                return wrap_class(per_replica, devices)
        return wrap_class(per_replica, devices) if always_wrap else v0
    if isinstance(v0, (list, tuple, dict)) and not isinstance(v0, DistributedValues):
        for v in per_replica[1:]:
            if type(v) is not type(v0) or len(v) != len(v0) or (isinstance(v0, dict) and v.keys() != v0.keys()):
                raise ValueError(
                    f"replicas returned different structures: {_shape_of(v0)} vs {_shape_of(v)}; every replica "
                    "must return the same nesting of tuples, lists and dicts"
                )
        if isinstance(v0, dict):
            return type(v0)((k, regroup([v[k] for v in per_replica], wrap_class, always_wrap, devices, array_type))
                            for k in v0)
        items = [regroup([v[i] for v in per_replica], wrap_class, always_wrap, devices, array_type)
                 for i in range(len(v0))]
        return type(v0)(*items) if hasattr(v0, "_fields") else type(v0)(items)
    same = all(v is v0 for v in per_replica[1:])
    if same and isinstance(v0, DistributedVariable):
        return v0
    container = getattr(v0, "_distributed_container", None)
    if container is not None and all(getattr(v, "_distributed_container", None) is container
                                     for v in per_replica):
        return container()
    if same and not always_wrap:
        return v0
    return wrap_class(per_replica, devices)


def _shape_of(x):
    return map_structure(lambda _: "*", x)


def select_replica(replica_id: int, structure):
    """``structure`` as replica ``replica_id`` sees it: distributed leaves become its component.

    Distributed variables stay whole: inside a replica they read and update
    their own copy.
    """
    def pick(x):
        if isinstance(x, DistributedValues) and not isinstance(x, DistributedVariable):
            return x._values[replica_id]
        return x

    if not is_nested(structure):
        return pick(structure)
    return map_structure(pick, structure)


def value_container(value):
    """The distributed variable that ``value`` is a copy of, else ``value`` itself."""
    container = getattr(value, "_distributed_container", None)
    if container is not None and not isinstance(value, DistributedVariable):
        owner = container()
        if owner is not None:
            return owner
    return value
