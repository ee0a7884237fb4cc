"""Pluggable cross-device reduction (``tf.distribute.CrossDeviceOps`` and its built-ins).

The public ``reduce`` / ``batch_reduce`` / ``broadcast`` check their inputs
and call the ``*_implementation`` hooks, which a plug-in overrides. The
built-ins hand all replicas' buffers to :mod:`mirrored.collectives` in one
call (the native core, GIL released); nothing is reduced in Python.
"""

from __future__ import annotations

import functools

import numpy as np

from ..device import dtypes as _dtypes, device_util
from ..device.indexed_slices import IndexedSlices, map_arrays
from ..collective import api as collectives
from ..collective.plan import all_reduce_plan
from ..timeline import enabled_native as tracing
from .options import CommunicationImplementation, CommunicationOptions, check_options
from .reduce_util import ReduceOp, as_reduce_op
from .values import DistributedValues, Mirrored, PerReplica, Variable, _read


def get_devices_from(destinations, argument: str = "destinations") -> tuple:
    """Canonical devices of ``destinations``: a device string, a list of them, distributed values or a variable."""
    if isinstance(destinations, DistributedValues):
        devices = destinations._devices
        if devices is None:
            raise ValueError(f"{argument}: this {type(destinations).__name__} does not know its devices; pass it "
                             "through the strategy (strategy.extended.reduce_to) or give device strings")
    elif isinstance(destinations, (Variable, IndexedSlices)) or hasattr(destinations, "__array_interface__") or \
            device_util.on_gpu(destinations):
        devices = (_device_of(destinations),)
    elif isinstance(destinations, str):
        devices = (device_util.canonicalize(destinations, argument=argument),)
    elif isinstance(destinations, (list, tuple)) and all(isinstance(d, str) for d in destinations):
        devices = tuple(device_util.canonicalize(d, argument=argument) for d in destinations)
    else:
        raise ValueError(f"{argument}={destinations!r}: destinations must be one of a `DistributedValues` object, "
                         "a md.Variable, a device string or a list of device strings")
    if not devices:
        raise ValueError(f"{argument}: destinations can not be empty")
    return devices


def _as_per_replica(value, argument: str = "per_replica_value") -> DistributedValues:
    if isinstance(value, DistributedValues):
        return value
    if isinstance(value, (list, tuple)):
        raise ValueError(f"{argument}: cannot convert a {type(value).__name__} to a PerReplica value; pass one "
                         "array, or md.PerReplica([...]) with one component per replica")
    return PerReplica([value], (_device_of(value),))


def _device_of(x) -> str:
    if isinstance(x, (Variable, IndexedSlices)):
        return x.device
    if device_util.on_gpu(x):
        # CuPy names its *physical* device .id (other CUDA arrays may not say: GPU 0). Several logical
        # GPUs can share it: prefer the running replica's own device, else the first logical GPU on it.
        from ..device import config

        physical = getattr(getattr(x, "device", None), "id", 0)
        current = device_util.current()
        if current is not None and device_util.parse(current).device_type == "GPU" and \
                config.physical_gpu_index(device_util.parse(current).device_index) == physical:
            return current
        for i in range(len(config.list_logical_devices("GPU"))):
            if config.physical_gpu_index(i) == physical:
                return device_util.canonicalize(f"/gpu:{i}")
        return device_util.canonicalize(f"/gpu:{physical}")
    return device_util.canonicalize("/cpu:0")


def _supported_dtypes() -> frozenset:
    found = set()
    for name in _dtypes.SUPPORTED:
        try:
            found.add(np.dtype(name))
        except TypeError:  # bfloat16 without ml_dtypes
            pass
    return frozenset(found)


_SUPPORTED = _supported_dtypes()
_DEFAULT_OPTIONS = CommunicationOptions()


def _buffers(per_replica: DistributedValues, argument: str = "per_replica_value", devices=None,
             check: bool = True) -> list:
    """The components as arrays on their devices, checked to agree in shape and dtype (``check=False``:
    they go to the collective face, which checks them)."""
    devices = devices or get_devices_from(per_replica, argument)
    if device_util.all_cpu(devices):  # the hot path: NumPy arrays on CPU replicas are used as they are
        arrays = [v if type(v) is np.ndarray else device_util.to_host(_read(v)) for v in per_replica._values]
    else:
        arrays = [device_util.place(_read(v), d) for v, d in zip(per_replica.values, devices)]
    if not check:
        return arrays
    first = arrays[0]
    if first.dtype not in _SUPPORTED and first.dtype.newbyteorder("=") not in _SUPPORTED:
        _dtypes.dtype_code(first.dtype, argument)  # raises, naming the argument and the dtypes we take
    for r, a in enumerate(arrays[1:], 1):
        if a.shape != first.shape or a.dtype != first.dtype:
            raise ValueError(f"{argument}: replica {r} has shape {tuple(a.shape)} and dtype {a.dtype} but replica 0 "
                             f"has shape {tuple(first.shape)} and dtype {first.dtype}; every replica must pass "
                             "the same shape and dtype")
    return arrays


def _mirrored(arrays, devices):
    """Results on ``devices`` as TF returns them: one device -> the array, several -> ``Mirrored``."""
    return arrays[0] if len(arrays) == 1 else Mirrored(arrays, devices)


class CrossDeviceOps:
    """Base class of cross-device reduction and broadcast algorithms; subclass it to plug in your own."""

    # The engine of the built-ins: this process's replicas here; the whole
    # job's in CollectiveAllReduce, which swaps in a multi-worker group with
    # the same functions.
    _collectives = collectives
    # Whether those collectives see every replica, so that one component is
    # already the result; not so when other workers hold replicas too.
    _sees_all_replicas = True

    def reduce(self, reduce_op, per_replica_value, destinations, options=None):
        """Reduce ``per_replica_value`` and place the result on ``destinations``.

        ``options``: this call's ``CommunicationOptions``, merged over the strategy's (``bytes_per_pack`` fuses
        a batch; ``timeout_seconds`` and ``implementation`` act across workers, in CollectiveAllReduce).
        """
        op = as_reduce_op(reduce_op)
        options = check_options(options)
        per_replica_value = _as_per_replica(per_replica_value)
        dest_devices = get_devices_from(destinations)
        if self._sees_all_replicas and len(per_replica_value.values) == 1 and \
                dest_devices == get_devices_from(per_replica_value):
            return per_replica_value.values[0]
        if _sparse(per_replica_value):
            return self._reduce_indexed_slices(op, per_replica_value, destinations, options)
        return self.reduce_implementation(op, per_replica_value, destinations, options or _DEFAULT_OPTIONS)

    def batch_reduce(self, reduce_op, value_destination_pairs, options=None):
        """Reduce several ``(per_replica_value, destinations)`` pairs; one result per pair (``options``: as
        :meth:`reduce`'s)."""
        op = as_reduce_op(reduce_op)
        options = check_options(options)
        pairs = []
        local = self._sees_all_replicas  # stays True while every value is one replica's, already where it goes
        if not isinstance(value_destination_pairs, (list, tuple)) or any(
                not isinstance(pair, tuple) or len(pair) != 2 for pair in value_destination_pairs):
            raise ValueError(f"value_destination_pairs={value_destination_pairs!r}: expected a list of "
                             "(per_replica_value, destinations) tuples")
        for v, d in value_destination_pairs:
            if not isinstance(v, DistributedValues):
                v = _as_per_replica(v, "value_destination_pairs")
            # Every pair's destinations are checked (TF's usual (v, v) pair: v's known devices).
            dest = v._devices if d is v and v._devices is not None else get_devices_from(d)
            local = local and len(v._values) == 1 and get_devices_from(v) == dest
            pairs.append((v, d))
        if not pairs:
            return []
        if local:
            return [v._values[0] for v, _ in pairs]
        sparse = [_sparse(v) for v, _ in pairs]
        if not any(sparse):
            return self.batch_reduce_implementation(op, pairs, options or _DEFAULT_OPTIONS)
        # IndexedSlices are gathered one by one, the dense values still fused together (TF splits them so).
        dense = iter(self.batch_reduce_implementation(op, [p for p, s in zip(pairs, sparse) if not s],
                                                      options or _DEFAULT_OPTIONS) if not all(sparse) else ())
        return [self._reduce_indexed_slices(op, v, d, options) if s else next(dense)
                for (v, d), s in zip(pairs, sparse)]

    def _options_kwargs(self, options) -> dict:
        """What a call's ``options`` add to the arguments of this engine's collectives: nothing here (one
        process's collectives have no timeout, and their engine is the ops' own); see CollectiveAllReduce."""
        return {}

    def _reduce_indexed_slices(self, op, per_replica_value, destinations, options=None):
        """TF's reduction of ``IndexedSlices``: not a sum of dense arrays but every replica's rows, concatenated
        in replica order (an all-gather of the values and one of the indices, whatever the ops' algorithm);
        MEAN scales the values by 1 / replicas. Repeated indices stay repeated: densifying adds them up."""
        if op not in (ReduceOp.SUM, ReduceOp.MEAN):
            raise ValueError(f"reduce_op={op}: IndexedSlices reduce with SUM or MEAN only (their rows are "
                             "concatenated); densify them first (md.convert_to_tensor) for MIN, MAX or PROD")
        slices = per_replica_value.values
        first = slices[0]
        for r, s in enumerate(slices[1:], 1):
            if s.dtype != first.dtype or s.values.shape[1:] != first.values.shape[1:]:
                raise ValueError(f"per_replica_value: replica {r} has IndexedSlices of values {s.dtype} "
                                 f"{tuple(s.values.shape)} but replica 0 of {first.dtype} "
                                 f"{tuple(first.values.shape)}; every replica's rows must have one dtype and shape")
        devices = get_devices_from(per_replica_value)
        index_dtype = np.result_type(*[s.indices.dtype for s in slices])  # int32 beside int64: int64, as TF
        job = self._options_kwargs(options)
        values = self._collectives.all_gather([device_util.place(s.values, d) for s, d in zip(slices, devices)],
                                              **job)
        indices = self._collectives.all_gather([device_util.place(s.indices.astype(index_dtype, copy=False), d)
                                                for s, d in zip(slices, devices)], **job)
        if op is ReduceOp.MEAN:
            replicas = getattr(self._collectives, "num_replicas", len(slices))  # every worker's replicas
            values = [_divided(v, replicas) for v in values]
        gathered = [first._with(values=v, indices=i) for v, i in zip(values, indices)]
        dest = get_devices_from(destinations)
        if dest == devices:
            return _mirrored(gathered, devices)
        placed = [map_arrays(lambda a, d=d, k=k: device_util.place(a, d, copy=k > 0), gathered[0])
                  for k, d in enumerate(dest)]
        return _mirrored(placed, dest)

    def _native_batch_reduce(self, devices) -> bool:
        """Whether the built-in native path serves batch_reduce over ``devices`` (a replica context may go
        straight to it)."""
        return False

    def broadcast(self, tensor, destinations):
        """``tensor`` copied to every device of ``destinations``."""
        get_devices_from(destinations)
        return self.broadcast_implementation(tensor, destinations)

    def reduce_implementation(self, reduce_op, per_replica_value, destinations, options):
        raise NotImplementedError(f"{type(self).__name__} must implement reduce_implementation")

    def batch_reduce_implementation(self, reduce_op, value_destination_pairs, options):
        """Default: one ``reduce_implementation`` per pair (override to fuse them)."""
        return [self.reduce_implementation(reduce_op, v, d, options) for v, d in value_destination_pairs]

    def broadcast_implementation(self, tensor, destinations):
        devices = get_devices_from(destinations)
        if type(tensor) is IndexedSlices:
            return _mirrored([map_arrays(lambda a, d=d: device_util.place(a, d, copy=True), tensor)
                              for d in devices], devices)
        return _mirrored([device_util.place(_read(tensor), d, copy=True) for d in devices], devices)

    def _gather(self, per_replica_value, destinations, axis, options=None):
        """Concatenate the components along ``axis`` and place the result on ``destinations``."""
        options = check_options(options)
        per_replica_value = _as_per_replica(per_replica_value)
        src = get_devices_from(per_replica_value)
        dest = get_devices_from(destinations)
        if self._sees_all_replicas and len(per_replica_value.values) == 1 and dest == src:
            return per_replica_value.values[0]
        arrays = [device_util.place(_read(v), d) for v, d in zip(per_replica_value.values, src)]
        _check_gather(arrays, axis)
        gathered = self._collectives.all_gather(arrays, axis=axis, **self._options_kwargs(options))
        if dest == src:
            return Mirrored(gathered, dest)
        return self.broadcast(gathered[0], destinations)


def _sparse(per_replica: DistributedValues) -> bool:
    """Whether every component is an IndexedSlices (some dense ones beside them: the dense path densifies
    them all and sums, as TF's add_n does)."""
    return type(per_replica._values[0]) is IndexedSlices and all(
        type(v) is IndexedSlices for v in per_replica._values)


def _divided(values, n: int):
    """``values / n`` as TF's MEAN of IndexedSlices divides them: floats keep their dtype; integers divide in
    float64 (float32 up to 16 bits)."""
    with device_util.array_device(values):
        if np.dtype(values.dtype).kind in "iu":
            return (values / n).astype(np.float32 if np.dtype(values.dtype).itemsize <= 2 else np.float64)
        return (values / n).astype(values.dtype, copy=False)


def _fresh_to(reduced, destinations):
    """A freshly reduced array placed on ``destinations``: the first device takes it as it is
    (nothing else refers to it), the others get copies."""
    devices = get_devices_from(destinations)
    values = [device_util.place(reduced, devices[0])]
    values += [device_util.place(reduced, d, copy=True) for d in devices[1:]]
    return _mirrored(values, devices)


def _check_gather(arrays, axis):
    if axis is None:  # (TF: "None values not supported")
        raise ValueError("axis=None: gather needs the axis to concatenate along, e.g. axis=0")
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
        raise TypeError(f"axis={axis!r}: expected an int, the axis to concatenate along (e.g. axis=0)")
    first = arrays[0]
    if first.ndim == 0:  # (TF's words: "Can't concatenate scalars")
        raise ValueError(f"axis={axis}: can't concatenate scalars; gather needs arrays of rank >= 1 (use x[None] "
                         "to give each replica's value a dimension of 1)")
    if not -first.ndim <= axis < first.ndim:
        raise ValueError(f"axis={axis} is out of range for values of shape {tuple(first.shape)}; gather needs "
                         "-rank <= axis < rank")
    ax = axis % first.ndim
    for r, a in enumerate(arrays[1:], 1):
        if a.dtype != first.dtype or a.ndim != first.ndim or any(
                s != t for k, (s, t) in enumerate(zip(a.shape, first.shape)) if k != ax):
            raise ValueError(f"value: replica {r} has shape {tuple(a.shape)} / {a.dtype} but replica 0 has "
                             f"{tuple(first.shape)} / {first.dtype}; all_gather allows different sizes along "
                             f"axis {axis} only")


class _NativeAllReduce(CrossDeviceOps):
    """All-reduce of all replicas' buffers in one native call, with fusion of many tensors."""

    _algorithm = "auto"

    _ring_kwargs = {}  # {"chunk_bytes": n} where set (multi-worker collectives take no chunk_bytes)

    def __init__(self, num_packs: int = 1, bytes_per_pack: int = 0):
        if isinstance(num_packs, bool) or not isinstance(num_packs, int) or num_packs < 0:
            raise ValueError(f"num_packs={num_packs!r}: expected an int >= 0 (0 = no packing)")
        if isinstance(bytes_per_pack, bool) or not isinstance(bytes_per_pack, int) or bytes_per_pack < 0:
            raise ValueError(f"bytes_per_pack={bytes_per_pack!r}: expected an int >= 0 (0 = use num_packs)")
        self._num_packs = num_packs
        self._bytes_per_pack = bytes_per_pack

    def _check_devices(self, devices):
        """Hook: refuse devices the algorithm cannot serve."""

    def reduce_implementation(self, reduce_op, per_replica_value, destinations, options):
        devices = get_devices_from(per_replica_value)
        dest = get_devices_from(destinations)
        if dest == devices:
            return self.batch_reduce_implementation(reduce_op, [(per_replica_value, destinations)], options)[0]
        self._check_devices(devices)
        # TF reduces to one device here: the first destination where it holds a component (no copy after
        # the reduce), with the all-reduce's engine. NCCL's reduce for NcclAllReduce is what each GPU's
        # CUDA graph can hold (md.function); the native engine orders the GPUs with events.
        root = devices.index(dest[0]) if dest[0] in devices else 0
        reduced = self._collectives.reduce(_buffers(per_replica_value), reduce_op.value, root=root,
                                           algorithm=self._algorithm, **self._options_kwargs(options))
        return _fresh_to(reduced, destinations)

    def batch_reduce_implementation(self, reduce_op, value_destination_pairs, options):
        # Pairs whose destinations are the value's own devices are all-reduced together in one
        # fused native call; the others are reduced to their destinations one by one.
        results = [None] * len(value_destination_pairs)
        fused, tensors, devices = [], [], None
        for i, (v, d) in enumerate(value_destination_pairs):
            src = v._devices if isinstance(v, DistributedValues) and v._devices is not None else get_devices_from(v)
            if (d is v or src == get_devices_from(d)) and (devices is None or devices == src):
                if devices is None:
                    self._check_devices(src)
                    devices = src
                fused.append(i)
                tensors.append(_buffers(v, "value", devices, check=False))
            else:
                results[i] = self.reduce_implementation(reduce_op, v, d, options)
        if fused:
            per_replica_lists = [list(replica) for replica in zip(*tensors)]
            reduced = self._all_reduce_lists(reduce_op, per_replica_lists, options)
            for i, column in zip(fused, zip(*reduced)):
                results[i] = Mirrored(column, devices)
        return results

    def _all_reduce_lists(self, reduce_op, per_replica_lists, options):
        op = reduce_op._value_  # (.value is a Python-level property)
        # The call's options over the ops' own (CommunicationOptions.merge): a bytes_per_pack of 0 keeps the ops'.
        bytes_per_pack = (options.bytes_per_pack if options is not None else 0) or self._bytes_per_pack
        kwargs = self._call_kwargs(options)
        if len(per_replica_lists[0]) == 1:  # one tensor: whatever the packing, one all-reduce (the cheaper call)
            return [[out] for out in self._collectives.all_reduce([lst[0] for lst in per_replica_lists], op,
                                                                  algorithm=self._algorithm, **kwargs)]
        if bytes_per_pack:
            return self._collectives.batch_all_reduce(per_replica_lists, op, bytes_per_pack=bytes_per_pack,
                                                      algorithm=self._algorithm, **kwargs)
        if self._num_packs == 0:  # no packing: one all-reduce per tensor
            by_tensor = [self._collectives.all_reduce([lst[t] for lst in per_replica_lists], op,
                                                      algorithm=self._algorithm, **kwargs)
                         for t in range(len(per_replica_lists[0]))]
            return [[by_tensor[t][r] for t in range(len(by_tensor))] for r in range(len(per_replica_lists))]
        return self._collectives.batch_all_reduce(per_replica_lists, op, num_packs=self._num_packs,
                                                  algorithm=self._algorithm, **kwargs)

    def _call_kwargs(self, options) -> dict:
        """The engine's arguments of a call with ``options``: the ops' own (chunk_bytes) and what the options
        add (none where they are the defaults: the call is what it is without options)."""
        if options is None or options is _DEFAULT_OPTIONS:
            return self._ring_kwargs
        return {**self._ring_kwargs, **self._options_kwargs(options)}

    def _native_batch_reduce(self, devices) -> bool:
        """Whether a batch_reduce of these ops over ``devices`` ends in :meth:`_all_reduce_lists` (no subclass
        reroutes it) and the ops serve those devices (else batch_reduce raises, naming them)."""
        kind = type(self)
        if not (kind.batch_reduce is CrossDeviceOps.batch_reduce
                and kind.batch_reduce_implementation is _NativeAllReduce.batch_reduce_implementation
                and kind._all_reduce_lists is _NativeAllReduce._all_reduce_lists):
            return False
        try:
            self._check_devices(devices)
        except ValueError:
            return False
        return True

    def _replica_all_reduce(self, reduce_op, options, ordinals, array_type, per_replica):
        """A replica context's all_reduce (``per_replica[r]``: replica r's one array, or its list of arrays;
        the results take the same form) as ``batch_reduce_implementation`` fuses it, without its wrapping in
        PerReplica and Mirrored; None unless every value is what ``_buffers`` would hand on as it is (then
        they go that way: variables, arrays to move): an ``array_type`` array, on replica r's GPU
        ``ordinals[r]`` where ``ordinals`` is given (GPU replicas), NumPy arrays on CPU replicas."""
        if type(per_replica[0]) is not list:  # one array each: one all-reduce
            if not _placed(per_replica, ordinals, array_type):
                return None
            return self._collectives.all_reduce(per_replica, reduce_op._value_, algorithm=self._algorithm,
                                                **self._call_kwargs(options))
        for leaves in zip(*per_replica):
            if not _placed(leaves, ordinals, array_type):
                return None
        return self._all_reduce_lists(reduce_op, per_replica, options)


class _ReplicaAllReduce:
    """``ops._replica_all_reduce`` bound to an op and the replicas' placement (``ordinals``, ``array_type``:
    see there): what a replica context's all_reduce combines with, made once per op. ``bound``: that
    method bound, as a C partial (batch_reduce_to's lists take it: no Python frame of this object's).

    When the ops run this process's collectives (mirrored.collective), a call keeps the plan of its latest
    call of one array per replica: a repeated call runs that plan straight, whose native run checks what
    ``_placed`` and the plan's signature would (each array's type, shape, dtype and strides, and its
    replica's GPU), and goes the validating way only when an array does not fit (or while the timeline
    records: its spans come from that way). On GPU replicas the rendezvous runs that plan before the merge
    order (``combine_first``), on the legacy default streams' handles it was given when it was kept
    (``CallPlan.on_merge_streams``). ``order``: GPU replicas' gpu.MergeOrder (None: CPU replicas).
    """

    __slots__ = ("bound", "_ordinals", "_params", "_plan", "_merged", "_order")

    def __init__(self, ops: "_NativeAllReduce", reduce_op: ReduceOp, options, ordinals, array_type, order=None):
        self.bound = functools.partial(ops._replica_all_reduce, reduce_op, options, ordinals, array_type)
        self._ordinals = ordinals
        # (op, algorithm, chunk_bytes) of the collectives.all_reduce the ops make, or None: another engine's
        self._params = (reduce_op._value_, ops._algorithm, ops._ring_kwargs.get("chunk_bytes", 0)) \
            if ops._collectives is collectives else None
        self._plan = None
        self._merged = None  # GPU replicas: (run, streams, new outputs) of the kept plan (see _first)
        self._order = order

    def __call__(self, per_replica):
        plan = self._plan
        if plan is not None and type(per_replica[0]) is not list and not tracing():
            done = plan.run(per_replica, None)
            if done is not None:
                return done
        results = self.bound(per_replica)
        if results is not None and self._params is not None and type(per_replica[0]) is not list:
            plan = all_reduce_plan(per_replica, *self._params)
            # (A plan of the same signature made for other GPUs would run these arrays there: not kept.)
            if plan is not None and (self._ordinals is None or plan.devices == self._ordinals):
                self._plan = plan
                if self._ordinals is not None:
                    run, streams, new_outputs = plan.on_merge_streams()
                    self._merged = run, streams, functools.partial(self._order.combine, _NewOutputs(new_outputs), None)
        return results

    def combine_first(self, combine):
        """The combine a replica context's all_reduce hands its replicas' rendezvous. CPU replicas: ``combine``
        as it is (the collective's, whose first call is this object's). GPU replicas: ``(self._first, combine)``:
        the rendezvous runs ``_first`` before the replicas' merge order when no replica arrived on a stream of
        the user's and no md.function step is under way, and ``combine`` in the order (gpu.MergeOrder.combine)
        when ``_first`` does not take the call."""
        if self._ordinals is None:
            return combine
        return self._first, combine

    def _first(self, slots):
        """A repeated call's kept plan (one array per replica), run on every GPU's legacy default stream, whose
        handles it was given when it was kept; None when there is none or an array does not fit it (or while
        the timeline records). The merge order would add nothing here: CUDA orders legacy-stream work after
        the work every blocking stream (each replica's) queued before, the inputs' writes, and before the work
        they queue next, the results' reads; and new results (when the latest are still held) are allocated in
        the order, with the legacy streams current (gpu.MergeOrder says why)."""
        merged = self._merged
        if merged is None or type(slots[0]) is list or tracing():
            return None
        run, streams, new_outputs = merged
        return run(slots, None, streams, new_outputs)


class _NewOutputs:
    """A kept plan's ``new_outputs`` as a merge order's combine takes it (``combine(slots)``; slots: None)."""

    __slots__ = ("_new_outputs",)

    def __init__(self, new_outputs):
        self._new_outputs = new_outputs

    def __call__(self, _slots):
        return self._new_outputs()


def _placed(arrays, ordinals, array_type) -> bool:
    """Whether ``arrays[r]`` is an ``array_type`` array on GPU ``ordinals[r]`` (any ``array_type`` where
    ``ordinals`` is None): what device_util.place keeps as it is."""
    for a in arrays:
        if type(a) is not array_type:
            return False
    if ordinals is not None:
        for a, ordinal in zip(arrays, ordinals):
            if a.data.device_id != ordinal:
                return False
    return True


class RingAllReduce(_NativeAllReduce):
    """The native all-reduce over host or CUDA buffers; the default cross-device ops.

    ``chunk_bytes``: bytes each participant handles per ring step (0: the
    engine's default). ``algorithm``: ``'auto'`` (the core picks by size and
    replica count), ``'ring'`` or ``'direct'``. ``num_packs`` /
    ``bytes_per_pack`` fuse many small tensors into few buffers.
    """

    def __init__(self, chunk_bytes: int = 0, num_packs: int = 1, bytes_per_pack: int = 0, algorithm: str = "auto"):
        super().__init__(num_packs, bytes_per_pack)
        if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 0:
            raise ValueError(f"chunk_bytes={chunk_bytes!r}: expected an int >= 0 (0 = the engine's default)")
        if algorithm not in ("auto", "ring", "direct"):
            raise ValueError(f"algorithm={algorithm!r}: expected 'auto', 'ring' or 'direct'")
        self._ring_kwargs = {"chunk_bytes": chunk_bytes} if chunk_bytes else {}
        self._algorithm = algorithm


class HierarchicalCopyAllReduce(_NativeAllReduce):
    """Reduce to a few devices, then broadcast (TF's DGX-1 tree), in the native core."""

    _algorithm = "tree"

    def __init__(self, num_packs: int = 1):
        super().__init__(num_packs)


class NcclAllReduce(_NativeAllReduce):
    """NCCL all-reduce of GPU replicas' buffers."""

    _algorithm = "nccl"

    def __init__(self, num_packs: int = 1):
        super().__init__(num_packs)

    def _check_devices(self, devices):
        cpu = [d for d in devices if not device_util.is_gpu(d)]
        if cpu:
            raise ValueError(f"NcclAllReduce needs GPU replicas but the values are on {cpu}; use "
                             "cross_device_ops=md.cross_device_ops.RingAllReduce() for CPU replicas, or GPU devices")


class CollectiveAllReduce(_NativeAllReduce):
    """All-reduce across every replica of every worker (``tf.distribute``'s collective ops).

    ``group``: the job's :class:`CollectiveGroup`; ``None`` reduces this
    process's replicas only (a one-worker job). ``num_packs`` /
    ``bytes_per_pack`` fuse a batch of tensors into few network messages.
    Every reduction returns on every worker, as in TensorFlow.
    """

    def __init__(self, group=None, num_packs: int = 1, bytes_per_pack: int = 0):
        super().__init__(num_packs, bytes_per_pack)
        if group is not None:
            self._collectives = group
            self._sees_all_replicas = group.num_workers == 1
        self.group = group

    def _options_kwargs(self, options) -> dict:
        """A call's ``timeout_seconds`` and ``implementation``, where they are not the defaults, for the job's
        collectives (which merge them over the strategy's, as CommunicationOptions.merge does)."""
        if self.group is None or options is None:
            return {}
        kwargs = {}
        if options.timeout_seconds is not None:
            kwargs["timeout"] = options.timeout_seconds
        if options.implementation is not CommunicationImplementation.AUTO:
            kwargs["implementation"] = options.implementation._value_
        return kwargs

    def reduce_implementation(self, reduce_op, per_replica_value, destinations, options):
        devices = get_devices_from(per_replica_value)
        if get_devices_from(destinations) == devices:
            return self.batch_reduce_implementation(reduce_op, [(per_replica_value, destinations)], options)[0]
        # An all-reduce, not a reduce to one root: every worker needs the value.
        reduced = self._collectives.all_reduce(_buffers(per_replica_value), reduce_op.value,
                                               **self._options_kwargs(options))[0]
        return self.broadcast(reduced, destinations)


class ReductionToOneDevice(CrossDeviceOps):
    """Copy every component to one device, reduce there, broadcast the result back.

    ``reduce_to_device``: where to reduce (default: the first destination);
    ``accumulation_fn``: if given, ``accumulation_fn(list_of_arrays)`` sums the
    components on that device instead of the native reduce (SUM and MEAN only).
    """

    def __init__(self, reduce_to_device=None, accumulation_fn=None):
        self.reduce_to_device = (device_util.canonicalize(reduce_to_device, argument="reduce_to_device")
                                 if reduce_to_device is not None else None)
        if accumulation_fn is not None and not callable(accumulation_fn):
            raise TypeError(f"accumulation_fn={accumulation_fn!r}: expected a function that adds a list of "
                            "arrays element-wise (e.g. sum or np.add.reduce), or None for the default")
        self.accumulation_fn = accumulation_fn

    def reduce_implementation(self, reduce_op, per_replica_value, destinations, options):
        target = self.reduce_to_device or get_devices_from(destinations)[0]
        _check_available(target, "reduce_to_device" if self.reduce_to_device else "destinations")
        arrays = _buffers(per_replica_value)
        if self.accumulation_fn is not None:
            if reduce_op not in (ReduceOp.SUM, ReduceOp.MEAN):
                raise ValueError(f"reduce_op={reduce_op}: ReductionToOneDevice with accumulation_fn supports "
                                 "SUM and MEAN only; drop accumulation_fn to use the native reduce")
            # On the target (TF runs accumulation_fn under reduce_to_device): on the caller's GPU its kernels
            # would read the copies on the target's stream unordered.
            with device_util.cross_replica_gpu_scope(target):
                reduced = device_util.place(self.accumulation_fn([device_util.place(a, target) for a in arrays]),
                                            target)
            if tuple(reduced.shape) != tuple(arrays[0].shape) or reduced.dtype != arrays[0].dtype:
                raise ValueError(
                    f"accumulation_fn={getattr(self.accumulation_fn, '__name__', self.accumulation_fn)!r} returned "
                    f"shape {tuple(reduced.shape)} and dtype {reduced.dtype} for {len(arrays)} components of shape "
                    f"{tuple(arrays[0].shape)} and dtype {arrays[0].dtype}; it must add the list of arrays "
                    "element-wise and keep their shape and dtype (like np.add.reduce(arrays) or sum(arrays))")
            if reduce_op is ReduceOp.MEAN:
                with device_util.array_device(reduced):
                    reduced = (reduced / len(arrays)).astype(arrays[0].dtype, copy=False)
        else:
            devices = get_devices_from(per_replica_value)
            root = devices.index(target) if target in devices else 0
            return _fresh_to(device_util.place(collectives.reduce(arrays, reduce_op.value, root=root), target),
                             destinations)
        return self.broadcast(reduced, destinations)


def describe(ops, devices) -> str:
    """How a strategy's ``CrossDeviceOps`` reduces over ``devices``, in words, for the engine log line."""
    name = type(ops).__name__
    if type(ops).__module__ != __name__:
        return f"{name} (a user CrossDeviceOps)"
    buffers = "CUDA" if device_util.all_gpu(devices) else "host"
    if isinstance(ops, NcclAllReduce):
        return f"NCCL ({name})"
    if isinstance(ops, HierarchicalCopyAllReduce):
        return f"native tree over {buffers} buffers ({name})"
    if isinstance(ops, ReductionToOneDevice):
        return f"copy to one device, reduce, copy back ({name})"
    algorithm = getattr(ops, "_algorithm", "auto")
    how = "ring, direct or tree picked per call by size and replica count" if algorithm == "auto" else algorithm
    return f"native {how} over {buffers} buffers ({name}, algorithm={algorithm!r})"


def _check_available(device: str, argument: str) -> None:
    """Names a GPU device this machine cannot use, instead of failing later inside CuPy."""
    if not device_util.is_gpu(device):
        return
    from ..device import config

    index = device_util.parse(device).device_index
    gpus = len(config.list_logical_devices("GPU"))
    if index < gpus:
        return
    try:
        import cupy  # noqa: F401
        cupy_note = ""
    except ImportError:
        cupy_note = " and CuPy is not installed (pip install cupy-cuda13x)"
    raise ValueError(
        f"ReductionToOneDevice: {argument} is {device}, but this machine has {gpus} GPU(s) visible to mirrored"
        f"{cupy_note}; reduce on a device it has (e.g. reduce_to_device='/cpu:0' or one of "
        "md.config.list_logical_devices('GPU')), or run on a machine with that GPU, its driver and the CUDA build"
    )


__all__ = ["CrossDeviceOps", "RingAllReduce", "NcclAllReduce", "HierarchicalCopyAllReduce",
           "ReductionToOneDevice", "CollectiveAllReduce", "get_devices_from"]
