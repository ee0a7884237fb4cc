"""The distributed variables' indexed calls, one table for TF's recorder (tests/data/record_tf_variable_scatter_nd.py)
and our test of them (tests/test_variable_scatter_nd.py), given each side's IndexedSlices maker and module."""

import numpy as np


def distributed_calls(slices) -> dict:
    """{method: call on a variable}; ``slices(values, indices)`` makes a float32 IndexedSlices."""
    return {
        "scatter_nd_add": lambda v: v.scatter_nd_add([[1], [3]], np.full((2, 3), 10, np.float32)),
        "scatter_nd_sub": lambda v: v.scatter_nd_sub([[1], [3]], np.full((2, 3), 10, np.float32)),
        "scatter_nd_update": lambda v: v.scatter_nd_update([[1], [3]], np.full((2, 3), 10, np.float32)),
        "scatter_nd_max": lambda v: v.scatter_nd_max([[1], [3]], np.full((2, 3), 10, np.float32)),
        "scatter_nd_min": lambda v: v.scatter_nd_min([[1], [3]], np.full((2, 3), -10, np.float32)),
        "batch_scatter_update": lambda v: v.batch_scatter_update(slices(np.full((2, 3), 10), [2, 0])),
        "scatter_add": lambda v: v.scatter_add(slices(np.full((2, 3), 10), [1, 2])),
        "scatter_update": lambda v: v.scatter_update(slices(np.full((2, 3), 10), [1, 2])),
        "scatter_max": lambda v: v.scatter_max(slices(np.full((2, 3), 10), [1, 2])),
        "sparse_read": lambda v: v.sparse_read([2, 0]),
        "gather_nd": lambda v: v.gather_nd([[1, 1]]),
        "is_initialized": lambda v: v.is_initialized(),
        "read_value_no_copy": lambda v: v.read_value_no_copy(),
        "is_distributed_variable": lambda v: v.is_distributed_variable,
    }


def kinds(module) -> dict:
    """{kind: (synchronization, aggregation)} in ``module``'s enums (``tf`` or ``md``)."""
    on_write, on_read = module.VariableSynchronization.ON_WRITE, module.VariableSynchronization.ON_READ
    return {"mirrored": (on_write, module.VariableAggregation.NONE),
            "mirrored_sum": (on_write, module.VariableAggregation.SUM),
            "on_read_sum": (on_read, module.VariableAggregation.SUM)}
