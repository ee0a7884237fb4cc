"""Type stubs of the host-collective extension (csrc/bindings/core_module.cc).

Arrays must already be validated by mirrored.collective.rules: C-contiguous,
one per replica, same dtype; dtype/op/algorithm are the codes of
mirrored._dtypes and mirrored.collectives.ALGORITHMS.
"""

from typing import Any, Callable

import numpy as np

def all_reduce(inputs: list[np.ndarray], outputs: list[np.ndarray], count: int, dtype: int, op: int,
               algorithm: int, ring_chunk_bytes: int = 0) -> None: ...
def broadcast(inputs: list[np.ndarray], outputs: list[np.ndarray], count: int, dtype: int, root: int) -> None: ...
def reduce(inputs: list[np.ndarray], outputs: list[np.ndarray], count: int, dtype: int, op: int, root: int) -> None: ...
def all_gather(inputs: list[np.ndarray], outputs: list[np.ndarray], row_bytes: list[int], outer: int) -> None: ...
def batch_all_reduce(n: int, inputs: list[np.ndarray], outputs: list[np.ndarray], counts: list[int],
                     dtypes: list[int], op: int, bytes_per_pack: int, num_packs: int, algorithm: int,
                     ring_chunk_bytes: int) -> None: ...

def fused_update(rule: int, weights: list[np.ndarray],
                 grads: list[np.ndarray] | np.ndarray | tuple[list[np.ndarray], ...],
                 slots: list[list[np.ndarray]], decay: list[bool], coefficients: list[float], weight_decay: float,
                 lr: float, squares: list[np.ndarray | None] | None = None) -> None:
    """The optimizer rule (mirrored.train.optimizers.rules' codes) on every variable, in place; grads: one
    array per variable, one packed buffer holding them back to back, or a tuple of per-variable lists, one
    per replica, summed in that order (the host all-reduce's) before the rule. squares: per variable, what
    a squaring rule reads in place of grad * grad (None: it squares)."""

def scatter_add_rows(out: np.ndarray, squares: np.ndarray | None, values: np.ndarray,
                     indices: np.ndarray) -> int:
    """out[indices[i]] += values[i] in order (and squares[indices[i]] += values[i] ** 2), in place; a negative
    index skipped. Returns -1, or the first i whose index is past out's rows (nothing written then)."""

class CallPlan:
    """A validated all_reduce / broadcast (kind) of n arrays of one dtype and shape."""
    def __init__(self, kind: str, n: int, dtype: np.dtype, shape: tuple, dtype_code: int, op: int, algorithm: int,
                 ring_chunk_bytes: int, root: int, alloc) -> None: ...
    def run(self, inputs: list, outputs: list | None) -> list[np.ndarray] | None: ...

class BatchPlan:
    """A validated batch all-reduce: per tensor a dtype and shape; results are views of one buffer per replica."""
    def __init__(self, n: int, dtypes: list[np.dtype], shapes: list[tuple], dtype_codes: list[int], op: int,
                 bytes_per_pack: int, num_packs: int, algorithm: int, ring_chunk_bytes: int, alloc) -> None: ...
    def run(self, per_replica_lists: list) -> list[list[np.ndarray]] | None: ...

class Rendezvous:
    """The replicas' rendezvous of strategy.run (csrc/bindings/rendezvous_binding.cc; distribute_lib._Group)."""
    n: int
    unfinished: int
    unclaimed: bool
    completed: bool
    order: Any
    def __init__(self, n: int, aborted: type[BaseException], tracing: Callable[[], bool],
                 traced: Callable[..., Any]) -> None: ...
    def exchange(self, rid: int, kind: str, payload: Any, combine: Callable[[list[Any]], Any]) -> Any: ...
    def _exchange(self, rid: int, kind: str, payload: Any, combine: Callable[[list[Any]], Any]) -> Any: ...
    def reset(self, idle: list[Any] | None, fn: Callable[[int], Any] | None = None, outputs: list[Any] | None = None,
              errors: list[BaseException] | None = None, claims: dict[int, Any] | None = None, mine: Any = None,
              arrived: list[bool] | None = None, woken: bool = True) -> None: ...
    def pool(self, complete: Callable[[], Any], wake: Callable[[], bool], handoff: float) -> None: ...
    def cooperate(self, state: tuple[tuple[Any, str, Any], ...], gpu: tuple | None, greenlet: Any) -> None: ...
    def save_state(self) -> tuple: ...
    def restore_state(self, saved: tuple) -> None: ...
    def claim(self) -> int | None: ...
    def arrive(self, i: int, caller: bool) -> None: ...
    def abort(self) -> None: ...
    def run_replica(self, i: int, caller: bool = True) -> None: ...
    def drain(self) -> None: ...
    def finish_aborted(self) -> None: ...

def choose_algorithm(n: int, bytes: int) -> str: ...
def isa() -> str: ...
def num_threads() -> int: ...

replica_array_handler: Any
"""NumPy's mem_handler capsule of the replica array pool (csrc/host/array_pool.h): CPU replicas' arrays."""

def set_array_handler(handler: Any) -> Any:
    """Makes ``handler`` (a NumPy mem_handler capsule) allocate the arrays created in this thread's current
    context; returns the one it replaces."""

def replica_array_stats() -> dict[str, int]:
    """The pool's live_bytes, cached_bytes, peak_bytes, hits and misses."""

def trim_replica_arrays() -> None:
    """Frees the pool's cached blocks."""
