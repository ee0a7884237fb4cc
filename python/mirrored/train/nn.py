"""``md.nn``: loss scaling for custom training loops, as ``tf.nn`` spells it.

Optimizers SUM the replicas' gradients (as Keras optimizers under a
tf.distribute strategy do), so each replica's loss must already be divided by
the GLOBAL batch size: then the sum of the replicas' gradients is the gradient
of the mean over the global batch, whatever the number of replicas.

    def step_fn(x, y):
        per_example_loss = cross_entropy(model(x), y)            # shape (per-replica batch,)
        loss = md.nn.compute_average_loss(per_example_loss, global_batch_size=GLOBAL_BATCH)
        loss += md.nn.scale_regularization_loss(weight_decay * (w ** 2).sum())
        ...                                                     # gradients of `loss`
        optimizer.apply_gradients(zip(grads, variables))        # summed across replicas

The arrays are NumPy or CuPy (whatever the replica holds); results are 0-d
arrays of ``per_example_loss``'s dtype, as in TensorFlow: Python floats (and
lists of them) count as float32, and integer losses give a float64 result.
"""

from __future__ import annotations

import numbers

import numpy as np

from ..device.indexed_slices import convert_to_tensor

__all__ = ["compute_average_loss", "scale_regularization_loss"]


def _xp(a):
    """The array module of ``a`` (CuPy for CuPy arrays, else NumPy)."""
    module = type(a).__module__.split(".")[0]
    if module == "cupy":
        import cupy

        return cupy
    return np


def _as_array(value, argument: str):
    """``value`` as an array, as ``tf.convert_to_tensor`` converts it: NumPy and CuPy arrays keep their
    dtype; Python floats become float32 and Python ints int32 (int64 beyond it), TensorFlow's defaults, so
    a loss given as a list gives the float32 result TensorFlow gives."""
    if type(value).__module__.split(".")[0] == "cupy" or isinstance(value, np.ndarray):
        return value
    try:
        return convert_to_tensor(value)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{argument}={value!r:.80}: expected an array of losses ({e})") from None


def _check_loss_dtype(arr, argument: str) -> None:
    """Floating or integer losses, as TensorFlow takes them (integer ones give a float64 result)."""
    if arr.dtype.name == "bfloat16" or np.issubdtype(arr.dtype, np.floating) \
            or (np.issubdtype(arr.dtype, np.integer) and arr.dtype != np.bool_):
        return
    raise TypeError(f"{argument} has dtype {arr.dtype}; expected floating-point (or integer) losses")


def _divide(total, divisor: int, dtype):
    """``total / divisor`` as TensorFlow's division gives it: in ``dtype``, float64 for integer losses."""
    # The divisor as a NumPy scalar, not an array: on a GPU an array would be a host-to-device copy,
    # which CuPy refuses inside a step md.function captures.
    xp = _xp(total)
    if dtype.name != "bfloat16" and np.issubdtype(dtype, np.integer):
        return xp.asarray(total, dtype=np.float64) / np.float64(divisor)
    return (total / dtype.type(divisor)).astype(dtype, copy=False)


def _num_replicas_in_sync(function: str) -> int:
    from ..distribute import distribute_lib

    if distribute_lib.has_strategy() and distribute_lib.in_cross_replica_context():
        raise RuntimeError(f"You are calling `{function}` in cross replica context, while it was expected "
                           "to be called in replica context.")
    context = distribute_lib.get_replica_context()
    return context.num_replicas_in_sync if context is not None else distribute_lib.get_strategy().num_replicas_in_sync


def _scale_by_sample_weight(losses, sample_weight):
    """``losses * sample_weight``, after matching ranks the way Keras losses do.

    A weight of rank ``losses.ndim + 1`` loses its trailing dimension (which
    must be 1); one of rank ``losses.ndim - 1`` gains a trailing 1; then the
    two broadcast (a scalar weight scales every loss).
    """
    xp = _xp(losses)
    weight = sample_weight if _xp(sample_weight) is xp and hasattr(sample_weight, "ndim") \
        else xp.asarray(sample_weight)
    if weight.ndim and weight.ndim - losses.ndim == 1:
        if weight.shape[-1] != 1:
            raise ValueError(f"sample_weight has shape {tuple(weight.shape)}, one more dimension than "
                             f"per_example_loss {tuple(losses.shape)}; that last dimension must be 1")
        weight = weight[..., 0]
    elif weight.ndim and losses.ndim - weight.ndim == 1:
        weight = weight[..., None]
    try:
        np.broadcast_shapes(tuple(losses.shape), tuple(weight.shape))
    except ValueError:
        raise ValueError(f"sample_weight of shape {tuple(weight.shape)} does not broadcast to per_example_loss "
                         f"of shape {tuple(losses.shape)}; pass one weight per example "
                         f"(shape ({losses.shape[0]},)) or a scalar") from None
    return losses * weight


def compute_average_loss(per_example_loss, sample_weight=None, global_batch_size=None):
    """Sum of ``per_example_loss`` (times ``sample_weight``) divided by the global batch size.

    As ``tf.nn.compute_average_loss``. ``global_batch_size`` (a non-negative
    int) defaults, in replica context, to ``per_example_loss.shape[0]`` times
    ``num_replicas_in_sync``: pass it explicitly when replicas may get
    unequal shares (the last partial batch), so that every replica divides by
    the same number. A ``global_batch_size`` of 0 gives 0. Without
    ``global_batch_size`` in cross-replica context (e.g. directly under
    ``strategy.scope()``) it raises RuntimeError, as TensorFlow does.
    """
    losses = _as_array(per_example_loss, "per_example_loss")
    if losses.ndim < 1:
        raise ValueError("Invalid value passed for `per_example_loss`. Expected a tensor with at least rank 1. "
                         f"Received per_example_loss={losses} with rank 0; pass one loss per example")
    _check_loss_dtype(losses, "per_example_loss")
    dtype = losses.dtype
    if sample_weight is not None:
        losses = _scale_by_sample_weight(losses, sample_weight).astype(dtype, copy=False)

    if global_batch_size is None:
        global_batch_size = losses.shape[0] * _num_replicas_in_sync("compute_average_loss")
    else:
        size = global_batch_size
        if hasattr(size, "ndim") and hasattr(size, "dtype"):
            if size.ndim != 0:
                raise ValueError(f"global_batch_size must be scalar. Expected scalar shape, saw shape: "
                                 f"{tuple(size.shape)}")
            if not np.issubdtype(np.dtype(size.dtype), np.integer):
                raise TypeError(f"global_batch_size must be an integer. Got dtype {size.dtype}")
            size = int(size)
        elif isinstance(size, bool) or not isinstance(size, numbers.Integral):
            raise TypeError(f"global_batch_size must be an integer. Got {global_batch_size!r} "
                            f"({type(global_batch_size).__name__}); e.g. global_batch_size=64")
        if size < 0:
            raise ValueError(f"global_batch_size must be non-negative. Got {size}")
        global_batch_size = int(size)

    total = losses.sum(dtype=dtype)
    if global_batch_size == 0:  # div_no_nan: an empty global batch has loss 0
        return _divide(_xp(losses).zeros((), dtype=dtype), 1, dtype)
    return _divide(total, global_batch_size, dtype)


def scale_regularization_loss(regularization_loss):
    """``sum(regularization_loss) / num_replicas_in_sync``, as ``tf.nn.scale_regularization_loss``.

    Every replica adds the same regularisation term; the optimizer's SUM over
    replicas then counts it once. Raises RuntimeError in cross-replica context.
    """
    loss = _as_array(regularization_loss, "regularization_loss")
    _check_loss_dtype(loss, "regularization_loss")
    num_replicas = _num_replicas_in_sync("scale_regularization_loss")
    return _divide(loss.sum(dtype=loss.dtype), num_replicas, loss.dtype)
