"""A stand-in for CuPy over the simulated CUDA machine (``mirrored._cuda_sim.sim``),
so that the GPU path runs, and is checked, on machines without a GPU.

What it keeps of CuPy is what the GPU path relies on:

* device memory comes from the simulator (``sim.malloc``): a kernel of the
  engine may touch it only from its own device or a peer's, and a launch that
  names memory already freed fails;
* freeing is stream-ordered as in CuPy's memory pool: the memory is poisoned
  (0xdb bytes) in the order of the stream it was allocated on, where the pool
  would hand it out again; so anything reading it after a free without being
  ordered before it reads poison;
* every operation is a kernel queued on the current stream of the current
  device (per thread, as CuPy's); kernels run only when the host waits (a
  stream's, an event's or a device's synchronisation, ``asnumpy``), in a random
  order that respects streams, events and the legacy default stream's
  implicit synchronisation;
* kernels capture device pointers, never the arrays, so an array may go
  while work that reads it is still queued (and then the poison shows);
* products of float and complex arrays (``@``, ``matmul``, ``dot``,
  ``tensordot``, ``einsum``) are refused while the current stream is
  capturing, with CuPy's NotImplementedError: CuPy's cuBLAS calls are;
* a host-to-device copy on a capturing stream is refused with CuPy 14's
  RuntimeError (``copy_from_host_async``, and so ``array``/``asarray`` of host
  data, ``ndarray.set``, ``arange``), and so is a concatenation (or stack) that
  CuPy runs as one kernel over a pointer table it uploads: more than 8 arrays,
  all of the result's dtype, under 2 MiB each on average.

Arithmetic is NumPy's on host views of the simulated memory; results of
functions this module does not define come from NumPy by the same route
(the shape and dtype worked out first from placeholder inputs, the values
when the kernel runs). dtypes are CuPy's (no bfloat16).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import functools
import gc
import operator
import threading
import types
import warnings
import weakref

import numpy as np

from mirrored import _cuda_sim  # type: ignore[attr-defined]

sim = _cuda_sim.sim
__version__ = "13.0.0-sim"

_DTYPES = {np.dtype(t) for t in (np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32,
                                 np.uint64, np.float16, np.float32, np.float64, np.complex64, np.complex128)}
bool_, int8, int16, int32, int64 = np.bool_, np.int8, np.int16, np.int32, np.int64
uint8, uint16, uint32, uint64 = np.uint8, np.uint16, np.uint32, np.uint64
float16, float32, float64, complex64, complex128 = np.float16, np.float32, np.float64, np.complex64, np.complex128
newaxis = None
inf, nan, pi, e = np.inf, np.nan, np.pi, np.e


def _dtype(dtype) -> np.dtype:
    dt = np.dtype(float64 if dtype is None else dtype)
    if dt not in _DTYPES:
        raise TypeError(f"Unsupported type {dt}")
    return dt


# --- devices and streams (per thread, as CuPy's) -------------------------------

_tls = threading.local()


def _device_id() -> int:
    """The calling thread's current device: the simulated runtime's (CuPy's is the CUDA runtime's), so
    that the engine sees the device CuPy made current, as it does on a GPU."""
    return sim.current_device()


def _device_stack() -> list:
    """This thread's ``with Device`` stack, as CuPy's (cupy/cuda/device.pyx ``_ThreadLocal.push/pop``): one
    per thread, shared by every Device object. An enter pushes the device current then, an exit pops the
    latest entry, whichever Device exits: ``with`` blocks interleaved on one thread (greenlets) unwind
    each other's devices, as on CuPy."""
    stack = getattr(_tls, "devices", None)
    if stack is None:
        stack = _tls.devices = []
    return stack


class Device:
    def __init__(self, device=None):
        self.id = _device_id() if device is None else int(getattr(device, "id", device))

    def __enter__(self):
        current = _device_id()
        _device_stack().append(current)
        if self.id != current:
            self.use()
        return self

    def __exit__(self, *exc):
        sim.set_current_device(_device_stack().pop())

    def use(self):
        sim.set_current_device(self.id)  # (validates the ordinal)
        return self

    def synchronize(self):
        sim.drain()

    @property
    def compute_capability(self) -> str:
        return "90"

    def __eq__(self, other):
        return isinstance(other, Device) and other.id == self.id

    def __hash__(self):
        return hash(self.id)

    def __int__(self):
        return self.id

    def __repr__(self):
        return f"<CUDA Device {self.id}>"


def _streams() -> dict:
    """This thread's current stream per device."""
    d = getattr(_tls, "streams", None)
    if d is None:
        d = _tls.streams = {}
    return d


def _stream_stacks() -> tuple:
    """This thread's ``with stream`` stacks, as CuPy's (cupy/cuda/stream.pyx ``_ThreadLocal``): each
    enter pushes the stream on its device's stack and the device on one list; each exit pops the
    latest device's latest stream, whichever stream exits, and makes the one below current. Code
    that interleaves ``with`` blocks on one thread (greenlets) unwinds another's stream, as on CuPy."""
    stacks = getattr(_tls, "stream_stacks", None)
    if stacks is None:
        stacks = _tls.stream_stacks = ([], {})
    return stacks


def _check_stream_device(stream) -> int:
    """The stream's device, which must be the current one (CuPy's check_stream_device_match)."""
    device, current = stream._device(), _device_id()
    if device != current:
        raise RuntimeError(f"The device that the stream is created on ({device}) does not match with the "
                           f"current device ({current})")
    return device


class Stream:
    """A stream of the device current at creation; ``Stream.null`` is every device's legacy default stream."""

    null: "Stream"

    def __init__(self, null=False, non_blocking=False, ptds=False):
        self.device_id = -1 if null else _device_id()
        # Never destroyed: destroying a simulated stream runs all queued work, which would hide races.
        self.ptr = 0 if null else sim.stream_create(self.device_id, bool(non_blocking))

    def _device(self) -> int:
        return _device_id() if self.ptr == 0 else self.device_id

    def __enter__(self):
        d = _check_stream_device(self)
        devices, stacks = _stream_stacks()
        stacks.setdefault(d, [Stream.null]).append(self)
        devices.append(d)
        _streams()[d] = self
        return self

    def __exit__(self, *exc):
        devices, stacks = _stream_stacks()
        stack = stacks[devices.pop()]
        stack.pop()
        below = stack[-1]
        _streams()[below._device()] = below  # (the null stream: on the device current now, as CuPy)

    def use(self):
        _streams()[_check_stream_device(self)] = self
        return self

    def synchronize(self):
        sim.synchronize_stream(self.ptr, self._device())

    def record(self, event=None):
        event = event or Event()
        event.record(self)
        return event

    def wait_event(self, event):
        sim.stream_wait_event(self.ptr, event.ptr, self._device())

    @property
    def done(self) -> bool:
        return self.record().done

    # Stream capture, as CuPy's: what is queued between begin and end becomes a Graph (nothing runs).
    def begin_capture(self, mode=None):
        if self.ptr == 0:
            raise RuntimeError("cudaErrorStreamCaptureImplicit: the legacy default stream cannot be captured")
        sim.begin_capture(self.ptr, self.device_id)

    def is_capturing(self) -> bool:
        return self.ptr != 0 and sim.is_capturing(self.ptr, self.device_id)

    def end_capture(self):
        return Graph(sim.end_capture(self.ptr, self.device_id), self.device_id)

    def __eq__(self, other):
        return isinstance(other, Stream) and other.ptr == self.ptr

    def __hash__(self):
        return hash(self.ptr)

    def __repr__(self):
        return f"<Stream {self.ptr} (device {self.device_id})>"


Stream.null = Stream(null=True)


_machine = {"devices": 0}  # GPUs of the simulated machine (configure())


def get_current_stream(device_id=-1) -> Stream:
    """This thread's current stream of GPU ``device_id`` (-1: the current GPU), as CuPy's: IndexError for
    an ordinal the machine lacks."""
    device = _device_id() if device_id == -1 else int(device_id)
    if not 0 <= device < _machine["devices"]:  # (CuPy's per-device list, sized once: no runtime call)
        raise IndexError("list index out of range")
    return _streams().get(device, Stream.null)


class Graph:
    """An instantiated CUDA graph (``cupy.cuda.graph.Graph``): ``launch`` replays the captured work."""

    def __init__(self, exec_ptr: int, device_id: int):
        self._exec, self.device_id = exec_ptr, device_id
        weakref.finalize(self, _destroy_graph, exec_ptr)

    def launch(self, stream=None):
        stream = stream or get_current_stream(self.device_id)
        sim.graph_launch(self._exec, stream.ptr, self.device_id)

    def upload(self, stream=None):
        pass


def _destroy_graph(exec_ptr):
    try:
        sim.graph_destroy(exec_ptr)
    except Exception:  # interpreter teardown: the simulation may be gone first
        pass


class Event:
    """An event of the GPU current at its creation (CUDA's rule; CuPy's Event keeps no device)."""

    def __init__(self, block=False, disable_timing=False, interprocess=False):
        self.ptr = sim.event_create(_device_id())
        weakref.finalize(self, sim.event_destroy, self.ptr)

    def record(self, stream=None):
        """As CuPy's: on ``stream``, by default the current GPU's current stream; ``Stream.null`` is the
        current GPU's legacy stream, so an event of another GPU is refused there, as CUDA refuses it."""
        stream = get_current_stream() if stream is None else stream
        sim.event_record(self.ptr, stream.ptr, _device_id())

    def synchronize(self):
        sim.synchronize_event(self.ptr)

    @property
    def done(self) -> bool:
        return sim.event_done(self.ptr)


# --- memory ----------------------------------------------------------------------

class OutOfMemoryError(MemoryError):
    """``cupy.cuda.memory.OutOfMemoryError``: CuPy's words and arguments (cupy/cuda/memory.pyx)."""

    def __init__(self, size, total, limit=0):
        self._size, self._total, self._limit = size, total, limit
        limit_words = f", limit set to: {limit:,} bytes" if limit else ""
        super().__init__(f"Out of memory allocating {size:,} bytes (allocated so far: {total:,} bytes{limit_words}).")

    def __reduce__(self):
        return type(self), (self._size, self._total, self._limit)


def _device_malloc(size: int, device: int) -> int:
    """Device memory from the simulator; past its memory limit (``sim.set_device_memory_limit``), CuPy's pool
    collects garbage and tries once more, then raises OutOfMemoryError."""
    ptr = sim.malloc(size, device)
    if not ptr:
        gc.collect()  # (CuPy frees its cached blocks and collects garbage before giving up)
        ptr = sim.malloc(size, device)
    if not ptr:
        raise OutOfMemoryError(size, sim.bytes_in_use(device), sim.device_memory_limit())
    return ptr


def _free(ptr, stream):
    try:
        sim.free(ptr, stream)
    except Exception:  # interpreter teardown: the simulation may be gone first
        pass


class Memory:
    """One allocation, freed (poisoned, stream-ordered) when the last array on it goes.

    Work that is being captured must not take memory from CuPy's default pool: the
    graph would keep the block's address while the pool hands it out again, so
    every replay would write into someone else's array. An allocation on a thread
    whose current stream is capturing therefore fails (use a pool of the graph's
    own: ``with cupy.cuda.using_allocator(MemoryPool().malloc)``). Other threads
    (an input pipeline's) allocate as usual: md.function captures in relaxed mode,
    where CUDA lets them call cudaMalloc.
    """

    def __init__(self, size: int):
        self.device_id = _device_id()
        self.size = size
        if get_current_stream(self.device_id).is_capturing():
            raise RuntimeError("cudaErrorStreamCaptureUnsupported: cudaMalloc from CuPy's default pool inside the "
                               f"capture of a stream of device {self.device_id} (allocate from a graph-private "
                               "MemoryPool)")
        self.ptr = _device_malloc(size, self.device_id)
        _pool.taken(self.device_id, size)
        weakref.finalize(self, _free_default, self.ptr, get_current_stream(self.device_id).ptr, self.device_id, size)


def _free_default(ptr, stream, device, size):
    _free(ptr, stream)
    _pool.given_back(device, size)


class PooledMemory:
    """A block of a MemoryPool: back in the pool's free list (for its stream) when the last array on it goes."""

    def __init__(self, pool, ptr: int, size: int, device_id: int, stream_ptr: int):
        self.ptr, self.size, self.device_id = ptr, size, device_id
        weakref.finalize(self, pool._give_back, (device_id, stream_ptr, size), ptr)

    @property
    def device(self):
        return Device(self.device_id)


class MemoryPool:
    """CuPy's caching pool, per device and stream: a freed block serves the next request of its size on
    its stream; its blocks go back to the device only with ``free_all_blocks`` or the pool. Blocks are
    taken from the device directly, so a pool of its own may allocate while a stream is captured
    (CuPy's graph-private pool)."""

    def __init__(self, allocator=None):
        self._free = {}  # (device, stream, size) -> block pointers
        self._blocks = {}  # pointer -> bytes, every block this pool holds
        self._lock = threading.Lock()
        weakref.finalize(self, MemoryPool._release, self._blocks)

    def malloc(self, size: int):
        device = _device_id()
        stream = get_current_stream(device).ptr
        size = max(512, -(-int(size) // 512) * 512)
        with self._lock:
            cached = self._free.get((device, stream, size))
            ptr = cached.pop() if cached else None
        if ptr is None:
            ptr = _device_malloc(size, device)
            with self._lock:
                self._blocks[ptr] = size
        return MemoryPointer(PooledMemory(self, ptr, size, device, stream), 0)

    def _give_back(self, key, ptr):
        with self._lock:
            self._free.setdefault(key, []).append(ptr)

    def used_bytes(self):
        with self._lock:
            cached = sum(k[2] * len(v) for k, v in self._free.items())
        return self.total_bytes() - cached

    def total_bytes(self):
        with self._lock:
            return sum(self._blocks.values())

    def free_all_blocks(self, stream=None):
        with self._lock:
            for (device, s, _), ptrs in self._free.items():
                for p in ptrs:
                    self._blocks.pop(p, None)
                    _free(p, s)
            self._free.clear()

    @staticmethod
    def _release(blocks):
        for p in list(blocks):
            _free(p, 0)
        blocks.clear()


def _current_allocator():
    return getattr(_tls, "allocator", None)


def alloc(size: int):
    """``cupy.cuda.alloc``: memory on the current device from the thread's current allocator."""
    allocator = _current_allocator()
    return allocator(size) if allocator is not None else MemoryPointer(Memory(size), 0)


@contextlib.contextmanager
def using_allocator(allocator=None):
    """``cupy.cuda.using_allocator(allocator)``: this thread's allocations come from ``allocator(size)`` (None:
    unpooled memory). A generator context, as CuPy's (cupy/cuda/__init__.py): each object is entered once, and
    its exit puts back the allocator current at its enter."""
    previous = _current_allocator()
    _tls.allocator = allocator
    try:
        yield
    finally:
        _tls.allocator = previous


class UnownedMemory:
    """Somebody else's device memory (``__cuda_array_interface__``), kept alive through ``owner``."""

    def __init__(self, ptr: int, size: int, owner, device_id: int):
        self.ptr, self.size, self.owner, self.device_id = ptr, size, owner, device_id

    @property
    def device(self):
        return Device(self.device_id)


class MemoryPointer:
    def __init__(self, mem, offset: int):
        self.mem = mem
        self.ptr = mem.ptr + offset
        self.device_id = mem.device_id

    @property
    def device(self):
        return Device(self.device_id)

    def __add__(self, offset: int):
        return MemoryPointer(self.mem, self.ptr - self.mem.ptr + int(offset))

    def copy_from_device_async(self, src, size, stream=None):
        """A device-to-device copy (cudaMemcpyAsync, not a kernel) queued on the stream (by default the
        current GPU's current stream, as CuPy's). ``src``: a MemoryPointer, as CuPy's typed argument."""
        if not isinstance(src, MemoryPointer):
            raise TypeError(f"Argument 'src' has incorrect type (expected cupy.cuda.memory.MemoryPointer, got "
                            f"{type(src).__name__})")
        stream = get_current_stream() if stream is None else stream
        sim.memcpy(stream.ptr, self.device_id, self.ptr, src.ptr, int(size))

    def copy_from_host_async(self, mem, size, stream=None):
        """A host-to-device copy queued on the stream; the host bytes at ``mem`` are taken now (pageable).
        Refused, as CuPy 14 refuses it, while that stream is capturing."""
        stream = _h2d_stream(stream or get_current_stream(self.device_id))
        address = mem.value if isinstance(mem, ctypes.c_void_p) else int(mem)
        sim.copy_from_host(stream.ptr, self.device_id, self.ptr, ctypes.string_at(address, int(size)))

    def __int__(self):
        return self.ptr


# CuPy 14 refuses every host-to-device copy on a capturing stream: the graph would replay the copy from
# host memory that is long gone or rewritten (pageable: CUDA would even read it at capture, not replay).
# cupy.array/asarray of host data, ndarray.set, arange and concatenate's pointer table all copy this way.
H2D_REFUSAL = "the current stream is capturing, so H2D transfers are disallowed"


def _h2d_stream(stream):
    """``stream``, the stream of a host-to-device copy; CuPy's RuntimeError if it is capturing."""
    if stream.is_capturing():
        raise RuntimeError(H2D_REFUSAL)
    return stream


class _Pinned(bytearray):
    """Pinned host memory: plain host memory here."""


def alloc_pinned_memory(nbytes: int):
    return _Pinned(nbytes)


class _Pool:
    """The default pool's counts, per device (CuPy's answer for the current device): ``used_bytes``, the bytes of
    live default allocations; ``total_bytes``, the bytes CuPy's cache would hold: the most in use since
    ``free_all_blocks`` (the allocations themselves are unpooled here)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._used = collections.Counter()
        self._held = collections.Counter()

    def taken(self, device, size):
        with self._lock:
            self._used[device] += size
            self._held[device] = max(self._held[device], self._used[device])

    def given_back(self, device, size):
        with self._lock:
            self._used[device] -= size

    def set_limit(self, size=None, fraction=None):
        pass

    def free_all_blocks(self):
        device = _device_id()
        with self._lock:
            self._held[device] = self._used[device]

    def used_bytes(self):
        return self._used[_device_id()]

    def total_bytes(self):
        return self._held[_device_id()]


_pool = _Pool()


def get_default_memory_pool():
    return _pool


def get_default_pinned_memory_pool():
    return _pool


# --- kernels ---------------------------------------------------------------------

class _Desc:
    """What a kernel needs of an array: its pointer and layout, not the array."""

    __slots__ = ("ptr", "shape", "strides", "dtype")

    def __init__(self, a):
        self.ptr, self.shape, self.strides, self.dtype = a.data.ptr, a.shape, a.strides, a.dtype

    def view(self) -> np.ndarray:
        """A host view of the simulated device memory (it is host memory underneath)."""
        if 0 in self.shape:
            return np.empty(self.shape, self.dtype)
        lo = sum(s * (n - 1) for s, n in zip(self.strides, self.shape) if s < 0)
        hi = sum(s * (n - 1) for s, n in zip(self.strides, self.shape) if s > 0) + self.dtype.itemsize
        buf = (ctypes.c_char * (hi - lo)).from_address(self.ptr + lo)
        return np.ndarray(self.shape, self.dtype, buffer=buf, offset=-lo, strides=self.strides)


def _launch(work, *arrays):
    """Queues work(*host views of arrays) on the current stream of the current device."""
    descs = [_Desc(a) for a in arrays]
    device = _device_id()
    for a in arrays:
        if a.data.device_id != device and (device, a.data.device_id) not in _peers:
            raise ValueError(f"array on device {a.data.device_id} used from device {device} without peer access")

    def run():
        work(*(d.view() for d in descs))

    sim.launch(get_current_stream(device).ptr, device, run)


_peers: set = set()


_atomic_order = np.random.default_rng(0)  # the order add.at's "atomics" add in (_ufunc_at), seeded by configure


def configure(devices: int, peers, seed: int):
    """The simulated machine: ``devices`` GPUs, peer access for the (a, b) pairs in peers, and a drain seed."""
    sim.drain()
    sim.reset(devices, list(peers), seed)
    _machine["devices"] = devices
    _atomic_order.bit_generator.state = np.random.default_rng(seed).bit_generator.state
    _peers.clear()
    _peers.update(peers)


def _apply(fn, args, kwargs, out=None):
    """fn(*args, **kwargs) of NumPy as a kernel: the result array now, its values when the kernel runs."""
    arrays = []
    template = _template((args, kwargs), arrays)  # the arguments with each array as its index in `arrays`
    with np.errstate(all="ignore"), warnings.catch_warnings():  # placeholders are zeros: 0/0 is expected
        warnings.simplefilter("ignore")
        p_args, p_kwargs = _fill(template, [_placeholder(a) for a in arrays])
        shaped = fn(*p_args, **p_kwargs)
    if isinstance(shaped, tuple):
        return tuple(_apply(lambda *a, i=i, **k: fn(*a, **k)[i], args, kwargs) for i in range(len(shaped)))
    shaped = np.asarray(shaped)
    if out is None:
        out = ndarray(shaped.shape, shaped.dtype)

    def work(dst, *views):
        real_args, real_kwargs = _fill(template, views)
        with np.errstate(all="ignore"):  # GPU arithmetic does not warn (inf, nan, wrap-around)
            np.copyto(dst, fn(*real_args, **real_kwargs), casting="unsafe")

    _launch(work, out, *arrays)
    return out


class _Slot(int):
    """Where an array was among a kernel's arguments (kernels hold no array, as in CuPy)."""


def _template(x, arrays):
    if isinstance(x, ndarray):
        arrays.append(x)
        return _Slot(len(arrays) - 1)
    if isinstance(x, (list, tuple)):
        return type(x)(_template(v, arrays) for v in x)
    if isinstance(x, dict):
        return {k: _template(v, arrays) for k, v in x.items()}
    return x


def _fill(x, values):
    if isinstance(x, _Slot):
        return values[x]
    if isinstance(x, (list, tuple)):
        return type(x)(_fill(v, values) for v in x)
    if isinstance(x, dict):
        return {k: _fill(v, values) for k, v in x.items()}
    return x


def _placeholder(a):
    """A stand-in of array a for working out a result's shape and dtype, without its memory."""
    return np.broadcast_to(np.zeros((), a.dtype), a.shape)


# --- arrays ----------------------------------------------------------------------

def _c_strides(shape, itemsize):
    strides, step = [], itemsize
    for n in reversed(shape):
        strides.append(step)
        step *= n if n > 1 else 1
    return tuple(reversed(strides))


class _Flags:
    __slots__ = ("c_contiguous", "f_contiguous")

    def __init__(self, shape, strides, itemsize, size):
        self.c_contiguous = size <= 1 or strides == _c_strides(shape, itemsize)
        self.f_contiguous = size <= 1 or strides == tuple(reversed(_c_strides(tuple(reversed(shape)), itemsize)))

    def __getitem__(self, key):
        return {"C_CONTIGUOUS": self.c_contiguous, "F_CONTIGUOUS": self.f_contiguous}[key]

    @staticmethod
    def contiguous(shape, size):
        f = _Flags.__new__(_Flags)
        f.c_contiguous = True
        f.f_contiguous = size <= 1 or sum(n > 1 for n in shape) <= 1
        return f


# CuPy's products of float and complex arrays call cuBLAS, whose stream setting (cupy_backends'
# cublas.setStream, before every routine) refuses a capturing stream: such a step cannot be captured
# unless its products go through mirrored's own cuBLAS handle (md.linalg.matmul).
CUBLAS_REFUSAL = "calling cuBLAS API during stream capture is currently unsupported"
_CUBLAS_FUNCTIONS = frozenset({"matmul", "dot", "tensordot", "einsum", "inner", "vdot", "outer"})


def _cublas(product):
    """``product`` (a function queuing kernels) as a CuPy function that calls cuBLAS: refused while the
    current stream is capturing."""
    @functools.wraps(product)
    def checked(*args, **kwargs):
        if any(isinstance(x, ndarray) and x.dtype.kind in "fc" for x in args) and \
                get_current_stream().is_capturing():
            raise NotImplementedError(CUBLAS_REFUSAL)
        return product(*args, **kwargs)
    return checked


def _kernel(fn):
    return lambda *args: _apply(fn, args, {})


def _binary(ufunc, reflected=False):
    def op(self, other):
        if not isinstance(other, (ndarray, int, float, complex, bool, np.generic, np.ndarray)):
            return NotImplemented
        if isinstance(other, np.ndarray):
            other = asarray(other)
        return _apply(ufunc, (other, self) if reflected else (self, other), {})
    return op


def _inplace(ufunc):
    def op(self, other):
        if isinstance(other, np.ndarray):
            other = asarray(other)
        _apply(functools.partial(ufunc, casting="same_kind"), (self, other), {}, out=self)
        return self
    return op


class ndarray:
    __module__ = "cupy"  # what mirrored (and users) test for CuPy arrays

    def __init__(self, shape, dtype=float, memptr=None, strides=None, order="C"):
        self.shape = tuple(int(n) for n in (shape if isinstance(shape, (tuple, list)) else (shape,)))
        self.dtype = _dtype(dtype)
        self.size = int(np.prod(self.shape, dtype=np.int64))
        c_strides = _c_strides(self.shape, self.dtype.itemsize)
        self.strides = c_strides if strides is None else tuple(strides)
        self.flags = _Flags(self.shape, self.strides, self.dtype.itemsize, self.size) if strides is not None \
            and self.strides != c_strides else _Flags.contiguous(self.shape, self.size)
        self.data = alloc(self.size * self.dtype.itemsize) if memptr is None else memptr

    ndim = property(lambda self: len(self.shape))
    itemsize = property(lambda self: self.dtype.itemsize)
    nbytes = property(lambda self: self.size * self.dtype.itemsize)
    device = property(lambda self: Device(self.data.device_id))
    T = property(lambda self: self.transpose())
    # CuPy's: a view holds the array that owns its memory (the root, whatever it was made from); None for an
    # array made over a pointer. Copy-on-write checks (variables') count these references.
    base = None

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.shape, "typestr": self.dtype.str, "data": (self.data.ptr, False), "version": 3,
                "strides": None if self.flags.c_contiguous else self.strides,
                "stream": get_current_stream(self.data.device_id).ptr or 1}

    def __repr__(self):
        return f"fake_cupy.ndarray(shape={self.shape}, dtype={self.dtype}, device={self.data.device_id})"

    def __len__(self):
        if not self.shape:
            raise TypeError("len() of unsized object")
        return self.shape[0]

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]

    def __array__(self, *args, **kwargs):
        raise TypeError("Implicit conversion to a NumPy array is not allowed. Please use `.get()` to construct a "
                        "NumPy array explicitly.")

    # views
    def _view(self, shape, strides, offset_bytes=0, dtype=None):
        view = ndarray(shape, dtype or self.dtype, memptr=self.data + offset_bytes, strides=strides)
        view.base = self if self.base is None else self.base
        return view

    def __getitem__(self, key):
        placeholder = np.lib.stride_tricks.as_strided(np.zeros(1, self.dtype), self.shape, self.strides)
        if _is_basic(key):
            keys = key if isinstance(key, tuple) else (key,)
            # (with an Ellipsis NumPy gives a 0-d view, not a scalar of its own, for a full integer index)
            v = placeholder[keys if any(k is Ellipsis for k in keys) else keys + (Ellipsis,)]
            offset = (v.__array_interface__["data"][0] - placeholder.__array_interface__["data"][0]) if v.size else 0
            return self._view(v.shape, v.strides, offset)
        return _apply(lambda a, k: a[k], (self, _host_key(key)), {})

    def __setitem__(self, key, value):
        if isinstance(value, np.ndarray):
            value = asarray(value)
        if _is_basic(key):
            target = self[key]
            shape = target.shape  # (kernels hold no array: freeing one stays possible, as in CuPy)
            _apply(lambda v: np.broadcast_to(v, shape), (value,), {}, out=target)
            return
        key = _host_key(key)
        if isinstance(value, ndarray):
            _launch(lambda dst, v: _scatter(dst, key, v), self, value)
        else:
            _launch(lambda dst: _scatter(dst, key, value), self)

    def view(self, dtype=None):
        dt = _dtype(dtype)
        if dt.itemsize != self.itemsize:
            if not self.flags.c_contiguous:
                raise ValueError("To change to a dtype of a different size, the array must be C-contiguous")
            shape = self.shape[:-1] + (self.shape[-1] * self.itemsize // dt.itemsize,) if self.shape else ()
            return self._view(shape, _c_strides(shape, dt.itemsize), dtype=dt)
        return self._view(self.shape, self.strides, dtype=dt)

    def reshape(self, *shape, order="C"):
        shape = shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
        shape = np.broadcast_to(np.zeros((), np.bool_), self.shape).reshape(shape).shape  # NumPy's rules (-1 too)
        if self.flags.c_contiguous:
            return self._view(shape, _c_strides(shape, self.itemsize))
        return self.copy().reshape(shape)

    def transpose(self, *axes):
        axes = axes[0] if len(axes) == 1 and isinstance(axes[0], (tuple, list)) else axes
        axes = tuple(axes) or tuple(reversed(range(self.ndim)))
        return self._view(tuple(self.shape[a] for a in axes), tuple(self.strides[a] for a in axes))

    def ravel(self, order="C"):
        return self.reshape(-1)

    def flatten(self, order="C"):
        return self.copy().reshape(-1)

    def copy(self, order="C"):
        return _apply(np.array, (self,), {})

    def astype(self, dtype, order="K", casting=None, subok=None, copy=True):
        dt = _dtype(dtype)
        if not copy and dt == self.dtype:
            return self
        out = ndarray(self.shape, dt)
        _apply(lambda a: a, (self,), {}, out=out)
        return out

    def fill(self, value):
        dtype, shape = self.dtype, self.shape
        _apply(lambda v: np.broadcast_to(np.asarray(v, dtype), shape), (value,), {}, out=self)

    def get(self, stream=None, order="C", out=None):
        return asnumpy(self, stream=stream, out=out)

    def set(self, arr, stream=None):
        """As CuPy's: a NumPy array of this dtype and shape only, copied with this array's GPU current, on
        ``stream`` (by default that GPU's current stream)."""
        if not isinstance(arr, np.ndarray):
            raise TypeError("Only numpy.ndarray can be set to cupy.ndarray")
        if self.dtype != arr.dtype:
            raise TypeError(f"{arr.dtype} array cannot be set to {self.dtype} array")
        if self.shape != arr.shape:
            raise ValueError(f"Shape mismatch. Old shape: {self.shape}, new shape: {arr.shape}")
        if not (self.flags.c_contiguous or self.flags.f_contiguous):
            raise RuntimeError("Cannot set to non-contiguous array")
        with Device(self.data.device_id), get_current_stream() if stream is None else stream:
            _upload(arr, self)

    def item(self):
        return self.get().item()

    def tolist(self):
        return self.get().tolist()

    def __float__(self):
        return float(self.get())

    def __int__(self):
        return int(self.get())

    def __bool__(self):
        return bool(self.get())

    def __index__(self):
        return operator.index(self.get().item())

    def __neg__(self):
        return _apply(np.negative, (self,), {})

    def __abs__(self):
        return _apply(np.abs, (self,), {})

    def __pos__(self):
        return self.copy()

    def __invert__(self):
        return _apply(np.invert, (self,), {})

    def __matmul__(self, other):
        return _cublas(_kernel(np.matmul))(self, other)

    def __rmatmul__(self, other):
        return _cublas(_kernel(np.matmul))(other, self)

    def __dlpack__(self, stream=None):
        raise BufferError("fake_cupy arrays do not export DLPack")


for _name, _uf in (("add", np.add), ("sub", np.subtract), ("mul", np.multiply), ("truediv", np.true_divide),
                   ("floordiv", np.floor_divide), ("mod", np.remainder), ("pow", np.power), ("and", np.bitwise_and),
                   ("or", np.bitwise_or), ("xor", np.bitwise_xor), ("lshift", np.left_shift),
                   ("rshift", np.right_shift)):
    setattr(ndarray, f"__{_name}__", _binary(_uf))
    setattr(ndarray, f"__r{_name}__", _binary(_uf, reflected=True))
    setattr(ndarray, f"__i{_name}__", _inplace(_uf))
for _name, _uf in (("lt", np.less), ("le", np.less_equal), ("gt", np.greater), ("ge", np.greater_equal),
                   ("eq", np.equal), ("ne", np.not_equal)):
    setattr(ndarray, f"__{_name}__", _binary(_uf))
ndarray.__hash__ = None


def _reduction(fn):
    def method(self, axis=None, dtype=None, out=None, keepdims=False):
        kwargs = {"axis": axis, "keepdims": keepdims}
        if dtype is not None:
            kwargs["dtype"] = dtype
        return _apply(fn, (self,), kwargs, out=out)
    return method


for _name in ("sum", "prod", "mean", "max", "min", "any", "all"):
    setattr(ndarray, _name, _reduction(getattr(np, _name)))
ndarray.var = lambda self, axis=None, dtype=None, keepdims=False, ddof=0: _apply(
    np.var, (self,), {"axis": axis, "keepdims": keepdims, "ddof": ddof})
ndarray.std = lambda self, axis=None, dtype=None, keepdims=False, ddof=0: _apply(
    np.std, (self,), {"axis": axis, "keepdims": keepdims, "ddof": ddof})
ndarray.argmax = lambda self, axis=None: _apply(np.argmax, (self,), {"axis": axis})
ndarray.argmin = lambda self, axis=None: _apply(np.argmin, (self,), {"axis": axis})
ndarray.clip = lambda self, a_min=None, a_max=None: _apply(np.clip, (self, a_min, a_max), {})
ndarray.dot = _cublas(_kernel(np.dot))
ndarray.squeeze = lambda self, axis=None: self.reshape(np.empty(self.shape, np.bool_).squeeze(axis).shape)


def _scatter(dst, key, value):
    """``dst[key] = value`` as CuPy's scatter kernel writes it: one thread per element, so a row that an index
    array names more than once keeps any one of its values (here: an order drawn anew for each kernel)."""
    if isinstance(key, np.ndarray) and key.dtype.kind in "iu" and key.ndim >= 1 and key.size > 1:
        selected = dst[key]
        order = _atomic_order.permutation(key.size)
        rows = key.reshape(-1)[order]
        dst[rows] = np.broadcast_to(value, selected.shape).reshape((key.size,) + selected.shape[key.ndim:])[order]
        return
    dst[key] = value


def _is_basic(key) -> bool:
    keys = key if isinstance(key, tuple) else (key,)
    return all(k is None or k is Ellipsis or isinstance(k, (slice, int, np.integer)) and not isinstance(k, bool)
               for k in keys)


def _host_key(key):
    """An advanced index: device index arrays are read back first (CuPy would keep them on the GPU)."""
    keys = key if isinstance(key, tuple) else (key,)
    out = tuple(asnumpy(k) if isinstance(k, ndarray) else k for k in keys)
    return out if isinstance(key, tuple) else out[0]


# --- creation and transfer ---------------------------------------------------------

def _upload(host: np.ndarray, out: ndarray):
    """Queues a copy of host (taken now, as a pageable copy is) into out on the current stream: refused
    while that stream is capturing (copy_from_host_async)."""
    data = np.array(host, dtype=out.dtype, copy=True)
    if out.flags.c_contiguous:
        out.data.copy_from_host_async(data.ctypes.data, data.nbytes)
    else:
        _h2d_stream(get_current_stream(out.data.device_id))
        _launch(lambda dst: np.copyto(dst, data), out)


def empty(shape, dtype=float64, order="C"):
    return ndarray(shape, dtype)


def empty_like(a, dtype=None, order="K", subok=None, shape=None):
    return ndarray(a.shape if shape is None else shape, a.dtype if dtype is None else dtype)


def full(shape, fill_value, dtype=None, order="C"):
    out = ndarray(shape, np.array(fill_value).dtype if dtype is None else dtype)
    out.fill(fill_value)
    return out


def full_like(a, fill_value, dtype=None, order="K", subok=None, shape=None):
    out = empty_like(a, dtype, shape=shape)
    out.fill(fill_value)
    return out


def zeros(shape, dtype=float64, order="C"):
    return full(shape, 0, dtype)


def ones(shape, dtype=float64, order="C"):
    return full(shape, 1, dtype)


def zeros_like(a, dtype=None, order="K", subok=None, shape=None):
    return full_like(a, 0, dtype, shape=shape)


def ones_like(a, dtype=None, order="K", subok=None, shape=None):
    return full_like(a, 1, dtype, shape=shape)


def arange(start, stop=None, step=1, dtype=None):
    host = np.arange(start, stop, step, dtype=dtype)
    out = ndarray(host.shape, host.dtype)
    _upload(host, out)
    return out


def array(obj, dtype=None, copy=True, order="K", subok=False, ndmin=0, blocking=False):
    if hasattr(obj, "__cuda_array_interface__") and not isinstance(obj, ndarray):
        obj = _from_interface(obj)
    if isinstance(obj, ndarray):
        dt = obj.dtype if dtype is None else _dtype(dtype)
        if not copy and dt == obj.dtype and obj.data.device_id == _device_id():
            return obj
        out = ndarray(obj.shape, dt)  # on the current device: a peer copy when obj lies elsewhere
        _apply(lambda v: v, (obj,), {}, out=out)
        return out
    host = np.asarray(obj, dtype=dtype)
    out = ndarray(host.shape, host.dtype)  # (refuses dtypes CuPy lacks)
    _upload(host, out)
    return out


def asarray(a, dtype=None, order=None, blocking=False):
    if isinstance(a, ndarray):
        return a if dtype is None or _dtype(dtype) == a.dtype else a.astype(dtype)
    if hasattr(a, "__cuda_array_interface__"):
        v = _from_interface(a)
        return v if dtype is None else v.astype(dtype)
    return array(a, dtype)


def ascontiguousarray(a, dtype=None):
    a = asarray(a, dtype)
    return a if a.flags.c_contiguous else a.copy()


def _from_interface(obj) -> ndarray:
    cai = obj.__cuda_array_interface__
    ptr = cai["data"][0]
    dtype = np.dtype(cai["typestr"])
    shape = tuple(cai["shape"])
    device = sim.device_of(ptr) if ptr else _device_id()
    if device < 0:
        raise ValueError("the __cuda_array_interface__ pointer is not device memory of the simulated GPUs")
    strides = cai.get("strides") or _c_strides(shape, dtype.itemsize)
    size = int(np.prod(shape)) * dtype.itemsize
    return ndarray(shape, dtype, memptr=MemoryPointer(UnownedMemory(ptr, size, obj, device), 0), strides=strides)


def from_dlpack(obj):
    if hasattr(obj, "__cuda_array_interface__"):
        return _from_interface(obj)
    raise TypeError("CuPy can only import DLPack tensors on a CUDA device (this one is not)")


def asnumpy(a, stream=None, order="C", out=None, blocking=True):
    """The array's values on the host: a copy queued on the stream, then a wait for that stream."""
    if not isinstance(a, ndarray):
        return np.asarray(a)
    host = np.empty(a.shape, a.dtype) if out is None else out
    with Device(a.data.device_id):
        s = stream or get_current_stream()
        with s:
            _launch(lambda src: np.copyto(host, src), a)
        s.synchronize()
    return host


def get_array_module(*args):
    import sys

    return sys.modules[__name__] if any(isinstance(a, ndarray) for a in args) else np


# CuPy's concatenate (cupy/_core/_routines_manipulation.pyx, _concatenate) copies more than this many
# arrays, all of the result's dtype and under this many bytes each on average, in one kernel that reads
# them through a table of their pointers, which it uploads from host memory first; else one copy kernel
# per array.
_SINGLE_KERNEL_ARRAYS = 8
_SINGLE_KERNEL_BYTES_PER_ARRAY = 2 * 1024 * 1024


def _concatenate_table(arrays: list, dtype: np.dtype):
    """CuPy's single-kernel concatenation's host work: the arrays must be on the current device, and
    their pointer table is uploaded (a host-to-device copy: refused while the current stream captures)."""
    if len(arrays) <= _SINGLE_KERNEL_ARRAYS or any(a.dtype != dtype for a in arrays):
        return
    if sum(a.nbytes for a in arrays) >= _SINGLE_KERNEL_BYTES_PER_ARRAY * len(arrays):
        return
    device = _device_id()
    for a in arrays:
        if a.data.device_id != device:
            raise ValueError(f"Array device must be same as the current device: array device = "
                             f"{a.data.device_id} while current = {device}")
    array(np.array([a.data.ptr for a in arrays], np.int64))


def concatenate(arrays, axis=0, out=None, dtype=None):
    arrays = [a.ravel() for a in arrays] if axis is None else list(arrays)
    axis = 0 if axis is None else axis
    if dtype is not None:
        arrays = [a.astype(dtype, copy=False) for a in arrays]
    devices = [a for a in arrays if isinstance(a, ndarray)]
    if devices:
        _concatenate_table(devices, out.dtype if out is not None else np.result_type(*(a.dtype for a in devices)))
    return _apply(np.concatenate, (arrays,), {"axis": axis}, out=out)


def stack(arrays, axis=0, out=None):
    """CuPy's: the arrays, each given a new axis, concatenated along it."""
    arrays = [asarray(a) for a in arrays]
    if not arrays:
        raise ValueError("need at least one array to stack")
    axis = axis + arrays[0].ndim + 1 if axis < 0 else axis
    return concatenate([a.reshape(a.shape[:axis] + (1,) + a.shape[axis:]) for a in arrays], axis, out=out)


def _module_function(name):
    fn = getattr(np, name)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        out = kwargs.pop("out", None)
        args = tuple(asarray(a) if isinstance(a, np.ndarray) else a for a in args)
        return _apply(fn, args, kwargs, out=out)
    return wrapper


def unique(ar, return_index=False, return_inverse=False, return_counts=False, axis=None):
    """A result whose shape depends on the values: as in CuPy, the host waits for them (asnumpy)."""
    result = np.unique(asnumpy(ar), return_index=return_index, return_inverse=return_inverse,
                       return_counts=return_counts, axis=axis)
    return tuple(asarray(r) for r in result) if isinstance(result, tuple) else asarray(result)


# CuPy 14's ufunc.at (cupy/_core/_routines_indexing.pyx, _scatter_op): one atomic per element, for the
# ufuncs and array dtypes below only; any other ufunc's .at raises NotImplementedError.
_AT_DTYPES = {
    "add": ("int32", "int64", "float16", "float32", "float64", "uint32", "uint64"),
    "subtract": ("int32", "uint32"),
    "maximum": ("int32", "int64", "float32", "float64", "uint32", "uint64"),
    "minimum": ("int32", "int64", "float32", "float64", "uint32", "uint64"),
    "bitwise_and": ("int32", "int64", "uint32", "uint64"),
    "bitwise_or": ("int32", "int64", "uint32", "uint64"),
    "bitwise_xor": ("int32", "int64", "uint32", "uint64"),
}
# Its float atomicMax/atomicMin are CAS loops over fmaxf/fminf: a NaN, held or added, loses to a number, and a
# float64 entry it touches is rounded to float32 (as an H100 showed with CuPy 14.2: 1 + 2**-40 became 1.0).


def _float_extremum(ufunc):
    def at(out, indices, b):
        if out.dtype != np.float64:
            return ufunc.at(out, indices, b)
        narrow, touched = out.astype(np.float32), np.zeros(out.shape, bool)
        ufunc.at(narrow, indices, np.asarray(b).astype(np.float32))
        touched[indices] = True
        out[touched] = narrow[touched]
    return types.SimpleNamespace(at=at)


_AT_UFUNCS = {"maximum": _float_extremum(np.fmax), "minimum": _float_extremum(np.fmin)}


def _ufunc_at(ufunc):
    """``cupy.<ufunc>.at(a, indices, b)`` (CuPy 14): in place, one kernel; repeated indices apply in turn, in
    an order drawn anew for each run of the kernel where CuPy's atomics would pick one (``add.at``: a
    float sum of a repeated index differs in its last bits from order to order). Refused as CuPy refuses
    it: NotImplementedError for a ufunc without ``.at``, TypeError for an array dtype its atomics lack."""
    name = {"divide": "true_divide"}.get(ufunc.__name__, ufunc.__name__)  # (CuPy's name for it)
    supported = _AT_DTYPES.get(name)
    ufunc = _AT_UFUNCS.get(name, ufunc)

    def at(a, indices, b=None):
        if supported is None:
            raise NotImplementedError(f"`cupy_{name}.at` is not supported yet")
        if np.dtype(a.dtype).name not in supported:
            raise TypeError(f"cupy.{name}.at only supports {', '.join(supported)}{',' if name == 'subtract' else ''} "
                            "as data type")

        def combined(a, indices, b):
            out = np.array(a)
            if ufunc is np.add and isinstance(indices, np.ndarray) and indices.ndim == 1:
                order = _atomic_order.permutation(len(indices))
                indices, b = indices[order], np.broadcast_to(b, (len(order),) + out.shape[1:])[order]
            ufunc.at(out, indices, b)
            return out
        _apply(combined, (a, indices, b), {}, out=a)
    return at


def __getattr__(name):
    """NumPy's ufuncs and array functions, run as kernels (see _apply)."""
    if name.startswith("_") or not callable(getattr(np, name, None)):
        raise AttributeError(f"module 'cupy' (fake_cupy) has no attribute {name!r}")
    if name in _CUBLAS_FUNCTIONS:
        return _cublas(_module_function(name))
    function = _module_function(name)
    if isinstance(getattr(np, name), np.ufunc):
        function.at = _ufunc_at(getattr(np, name))
    return function


class _Runtime:
    # cudaStreamCaptureMode (the simulator captures in relaxed mode whatever is asked)
    streamCaptureModeGlobal, streamCaptureModeThreadLocal, streamCaptureModeRelaxed = 0, 1, 2

    def getDeviceCount(self):
        return _cuda_sim.device_count()

    def getDevice(self):
        """The calling thread's current device (cudaGetDevice: per host thread, greenlets share it)."""
        return _device_id()

    def setDevice(self, device):
        Device(device).use()

    def getDeviceProperties(self, ordinal):
        return {"name": b"Simulated GPU", "totalGlobalMem": 1 << 34, "multiProcessorCount": 4, "major": 9, "minor": 0}

    def deviceSynchronize(self):
        sim.drain()


class _Cuda:
    """cupy.cuda"""

    Device = Device
    Stream = Stream
    Event = Event
    MemoryPointer = MemoryPointer
    Memory = Memory
    MemoryPool = MemoryPool
    UnownedMemory = UnownedMemory
    using_allocator = staticmethod(using_allocator)
    runtime = _Runtime()
    get_current_stream = staticmethod(get_current_stream)
    alloc_pinned_memory = staticmethod(alloc_pinned_memory)
    alloc = staticmethod(alloc)

    class memory:
        OutOfMemoryError = OutOfMemoryError
        MemoryPointer = MemoryPointer
        UnownedMemory = UnownedMemory
        MemoryPool = MemoryPool

    class graph:
        Graph = Graph


cuda = _Cuda()
