"""``md.mixed_precision``: Keras' loss scaling and dtype policies for float16 / bfloat16 training.

    policy = md.mixed_precision.Policy("mixed_float16")   # compute float16, variables float32
    with strategy.scope():
        optimizer = md.mixed_precision.LossScaleOptimizer(md.optimizers.SGD(0.1))

    def step(x, y):
        # forward and backward in float16; the backward pass starts from the scaled loss
        grads = grads_of(optimizer.scale_loss(loss))          # scaled float16 gradients
        optimizer.apply_gradients(zip(grads, variables))      # all-reduced, checked, unscaled, applied

``LossScaleOptimizer`` follows Keras 3 (``keras.mixed_precision.LossScaleOptimizer``):
``apply_gradients`` takes the gradients of the scaled loss, and

1. all-reduces them in their own dtype (float16 and bfloat16 travel as such,
   half the bytes of float32) with one fused collective, as the wrapped
   optimizer would; when the wrapped optimizer clips (``clipnorm``,
   ``clipvalue``, ``global_clipnorm``) or accumulates
   (``gradient_accumulation_steps``), it reduces them itself after step 4,
   since Keras clips each replica's unscaled gradient before the sum and
   accumulates it in that replica's accumulator;
2. checks that every gradient is finite and agrees on the answer across all
   replicas of all workers (one all-reduce of a flag, MIN, across workers);
3. if not, skips the step (the wrapped optimizer's ``iterations`` stays put),
   halves the scale and restarts the count of good steps;
4. else divides the gradients by the scale (float16 and bfloat16 gradients
   become float32 here, as Keras' division promotes them), lets the wrapped
   optimizer apply them, and doubles the scale once ``dynamic_growth_steps``
   steps in a row were finite.

On GPU replicas (float32 or float64 variables, the fused update's dtypes) steps 2 to 4 run on the
devices without a host sync, as TensorFlow's graph mode does: a check kernel into a device flag, the
fused update dividing by the scale and writing nothing when the flag is set, and one kernel that moves
the scale, its counter and ``iterations`` (docs/tf_ports.md, "On GPU replicas"); the same bits, and a
step md.function captures. The host-decided step serves CPU replicas and the cases the device path
does not take (``_device_plan``).

Keras 3 checks the first replica's own gradients only, before the reduction,
so a NaN on another replica reaches the weights (recorded from TensorFlow 2.21
in tests/data/tfport_reference.json); here every replica's counts.

Keras 2's ``get_scaled_loss(loss)`` / ``get_unscaled_gradients(grads)`` work
as they did: once ``get_unscaled_gradients`` has been used, ``apply_gradients``
takes unscaled gradients and does not divide them again. ``dynamic=False``
(Keras 2) keeps ``initial_scale`` fixed and applies every step.

As Keras 3's, the wrapper builds the wrapped optimizer's state before its first check (a skipped first step
leaves the slots, zeros) and turns the wrapped optimizer's ``loss_scale_factor`` off (the gradients are
divided by the scale only).
"""

import contextlib as _contextlib
import math as _math
import numbers as _numbers

import numpy as _np

from ..device import device_util as _device_util, gpu as _gpu
from ..device.indexed_slices import IndexedSlices as _IndexedSlices, map_values as _map_values

__all__ = ["LossScaleOptimizer", "Policy", "DTypePolicy", "global_policy", "set_global_policy"]


# --- dtype policies ------------------------------------------------------------------------------

_FLOATS = ("float16", "bfloat16", "float32", "float64")


class Policy:
    """``Policy("mixed_float16")``: the dtype a model computes in and the dtype its variables keep.

    ``"mixed_float16"`` / ``"mixed_bfloat16"``: compute in float16 / bfloat16,
    variables in float32; a float dtype's name (``"float32"``): both in it.
    Model code reads ``compute_dtype`` and ``variable_dtype`` (as Keras layers do).
    """

    def __init__(self, name):
        if isinstance(name, Policy):
            name = name.name
        if not isinstance(name, str) or (name not in _FLOATS and name not in ("mixed_float16", "mixed_bfloat16")):
            raise ValueError(
                f"name={name!r}: cannot convert it to a mixed precision Policy; valid policies are 'mixed_float16', "
                "'mixed_bfloat16' and the name of a float dtype ('float16', 'bfloat16', 'float32', 'float64')")
        self._name = name

    name = property(lambda self: self._name)

    @property
    def compute_dtype(self) -> str:
        return self._name[len("mixed_"):] if self._name.startswith("mixed_") else self._name

    @property
    def variable_dtype(self) -> str:
        return "float32" if self._name.startswith("mixed_") else self._name

    def __eq__(self, other) -> bool:
        return isinstance(other, Policy) and other.name == self.name

    def __hash__(self) -> int:
        return hash(self.name)

    def __repr__(self) -> str:
        return f'<Policy "{self._name}">'


DTypePolicy = Policy  # Keras 3's name
_global = Policy("float32")


def global_policy() -> Policy:
    """The policy set by ``set_global_policy`` (``float32`` until then)."""
    return _global


def set_global_policy(policy) -> None:
    """Set the global policy: a ``Policy``, its name, or None for ``"float32"``."""
    global _global
    _global = Policy("float32" if policy is None else policy)


# --- loss scaling --------------------------------------------------------------------------------

def _check_scale(value) -> float:
    if isinstance(value, bool) or not isinstance(value, _numbers.Real) or not _math.isfinite(value) or value <= 0:
        raise ValueError(f"initial_scale={value!r}: expected a finite number > 0, e.g. 2**15 (a high scale is "
                         "lowered in a few steps, a low one raised only every dynamic_growth_steps)")
    return float(value)


# The exponent bits of a 2-byte float (all set: an inf or a nan), None for other dtypes; filled
# per dtype on first sight (a dtype's name is slow to read; bfloat16 needs no import of ml_dtypes here).
_HALF_EXPONENTS = {}


def _is_finite(x, device=None) -> bool:
    if type(x) is _IndexedSlices:  # its rows: the dense array's other values are zeros
        x = x.values
    if _device_util.on_gpu(x):
        import cupy

        # On the device's merge stream, ordered after the all-reduce that wrote x (the current stream may not be).
        with _device_util.cross_replica_gpu_scope(device) if device else _contextlib.nullcontext():
            return bool(cupy.isfinite(x).all())
    x = _np.asarray(x)
    if x.dtype.kind in "biu":
        return True  # integers are always finite
    exponent = _HALF_EXPONENTS.get(x.dtype, -1)
    if exponent == -1:
        exponent = _HALF_EXPONENTS[x.dtype] = {"float16": 0x7C00, "bfloat16": 0x7F80}.get(x.dtype.name)
    if exponent is None:
        return bool(_np.isfinite(x).all())
    # NumPy's isfinite on float16 (and ml_dtypes' on bfloat16) runs element by element, ~30x slower
    # than this look at the bits: without the sign, a finite value is below the all-ones exponent.
    return x.size == 0 or int((_np.ascontiguousarray(x).view(_np.uint16) & 0x7FFF).max()) < exponent


def _clips(optimizer) -> bool:
    return any(getattr(optimizer, name, None) is not None for name in ("clipnorm", "clipvalue", "global_clipnorm"))


def _copies(variable) -> tuple:
    """A variable's copies, one per local device (the variable itself when it has one)."""
    from ..distribute.values import DistributedVariable

    return variable.values if isinstance(variable, DistributedVariable) else (variable,)


def _components(value) -> tuple:
    from ..distribute.values import DistributedValues

    return value.values if isinstance(value, DistributedValues) else (value,)


def _placed_components(value) -> list:
    """``(component, its device or None)`` for each component of ``value``."""
    from ..distribute.values import DistributedValues

    if not isinstance(value, DistributedValues):
        return [(value, None)]
    return list(zip(value.values, value._devices_or((None,) * len(value.values))))


class LossScaleOptimizer:
    """Dynamic loss scaling around another optimizer (``keras.mixed_precision.LossScaleOptimizer``).

    ``inner_optimizer``: the optimizer that applies the unscaled gradients;
    its ``learning_rate``, ``iterations``, slots and other attributes are
    reachable through this object. ``dynamic``: adjust the scale (Keras) or
    keep ``initial_scale`` (Keras 2's ``dynamic=False``). ``initial_scale``:
    the first scale. ``dynamic_growth_steps``: how many finite steps in a row
    double the scale.

    Its own state, ``dynamic_scale`` (float32) and ``step_counter`` (int64),
    are variables of the strategy in scope when it is created, saved by
    ``md.train.Checkpoint`` with the wrapped optimizer's.
    """

    def __init__(self, inner_optimizer, dynamic=True, initial_scale=2.0 ** 15, dynamic_growth_steps=2000,
                 name=None):
        if isinstance(inner_optimizer, LossScaleOptimizer):
            raise TypeError("inner_optimizer: a LossScaleOptimizer cannot wrap another LossScaleOptimizer (the "
                            "loss would be scaled twice); wrap the optimizer itself")
        if not callable(getattr(inner_optimizer, "apply_gradients", None)):
            raise TypeError(f"inner_optimizer={inner_optimizer!r}: expected an optimizer (e.g. md.optimizers.SGD(...)) "
                            "with apply_gradients")
        if not isinstance(dynamic, bool):
            raise ValueError(f"dynamic={dynamic!r}: expected True (adjust the scale) or False (keep initial_scale)")
        if isinstance(dynamic_growth_steps, bool) or not isinstance(dynamic_growth_steps, _numbers.Integral) \
                or dynamic_growth_steps < 1:
            raise ValueError(f"dynamic_growth_steps={dynamic_growth_steps!r}: expected an integer >= 1 (the number of "
                             "finite steps in a row after which the scale doubles)")
        from ..distribute import distribute_lib, values
        from ..distribute.options import VariableAggregation

        self.inner_optimizer = inner_optimizer
        # The scale is this optimizer's: the wrapped one's own loss_scale_factor would divide the gradients a
        # second time (Keras 3 turns it off too).
        if getattr(inner_optimizer, "loss_scale_factor", None) is not None:
            inner_optimizer.loss_scale_factor = None
        self.dynamic = dynamic
        self.initial_scale = _check_scale(initial_scale)
        self.dynamic_growth_steps = int(dynamic_growth_steps)
        self.name = name or "loss_scale_optimizer"
        # Updated in cross-replica context only, so every copy holds the same value.
        self.step_counter = values.Variable(_np.int64(0), trainable=False, name=f"{self.name}/step_counter",
                                            aggregation=VariableAggregation.ONLY_FIRST_REPLICA)
        # (beside the counter: a ParameterServerStrategy's ps task updates both in one request)
        with distribute_lib.get_strategy().extended.colocate_vars_with(self.step_counter):
            self.dynamic_scale = values.Variable(_np.float32(self.initial_scale), trainable=False,
                                                 name=f"{self.name}/dynamic_scale",
                                                 aggregation=VariableAggregation.ONLY_FIRST_REPLICA)
        # Keras 3's LossScaleOptimizer is itself an optimizer built with learning_rate=0.0 whose own step count
        # never moves (the wrapped optimizer's counts): its checkpoints hold both, so these are saved beside
        # the scale's state and restore Keras' values.
        self._own_iterations = values.Variable(_np.int64(0), trainable=False, name=f"{self.name}/iteration",
                                               aggregation=VariableAggregation.ONLY_FIRST_REPLICA)
        self._own_learning_rate = values.Variable(_np.float32(0.0), trainable=False, name=f"{self.name}/learning_rate",
                                                  aggregation=VariableAggregation.ONLY_FIRST_REPLICA)
        self._caller_unscales = False
        self._var_list = None  # build(var_list)'s, for apply(grads)
        self._nonfinite = {}  # GPU ordinal -> the int32 flag of the device check (a CuPy array, zero between steps)

    def __getattr__(self, name):
        # Called only for attributes this object lacks: the wrapped optimizer's (get_slot, momentum, ...).
        inner = self.__dict__.get("inner_optimizer")
        if inner is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(inner, name)

    def get_config(self) -> dict:
        """Keras 3's config: the wrapped optimizer serialized, the scale's arguments (``dynamic`` only when
        False, Keras 3 has no such argument)."""
        from .optimizers.serialization import serialize

        config = {"name": self.name, "inner_optimizer": serialize(self.inner_optimizer),
                  "initial_scale": self.initial_scale, "dynamic_growth_steps": self.dynamic_growth_steps}
        if not self.dynamic:
            config["dynamic"] = False
        return config

    @classmethod
    def from_config(cls, config: dict, custom_objects=None):
        from .optimizers.serialization import deserialize

        config = dict(config)
        if "inner_optimizer" not in config:
            raise ValueError("config: a LossScaleOptimizer's config needs 'inner_optimizer' (the wrapped optimizer, "
                             f"serialized). Received: config={config!r}")
        if isinstance(config["inner_optimizer"], dict):
            config["inner_optimizer"] = deserialize(config["inner_optimizer"], custom_objects)
        return cls(**config)

    def _trackable_children(self) -> dict:
        """What a checkpoint saves, under Keras 3's names: the public attributes (``inner_optimizer``,
        ``step_counter``, ``dynamic_scale``) and the wrapper's own ``_iterations`` and ``_learning_rate``."""
        children = {key: value for key, value in vars(self).items() if not key.startswith("_")}
        children.update(_iterations=self._own_iterations, _learning_rate=self._own_learning_rate)
        return children

    # -- the wrapped optimizer's state --
    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, value):
        self.inner_optimizer.learning_rate = value

    @property
    def iterations(self):
        """The wrapped optimizer's step count: skipped steps do not count (Keras 3)."""
        return self.inner_optimizer.iterations

    @property
    def variables(self) -> list:
        """``step_counter``, ``dynamic_scale``, then the wrapped optimizer's variables (Keras 3's order)."""
        inner = self.inner_optimizer.variables
        return [self.step_counter, self.dynamic_scale, *(inner() if callable(inner) else inner)]

    def build(self, var_list) -> None:
        """Create the wrapped optimizer's state for ``var_list`` (this optimizer's own exists already)."""
        self._var_list = list(var_list)
        build = getattr(self.inner_optimizer, "build", None)
        if build is not None:
            build(self._var_list)

    # -- the scale --
    @property
    def loss_scale(self) -> _np.float32:
        """The current scale (Keras 2's name; Keras 3 reads ``dynamic_scale``)."""
        return _np.float32(self.dynamic_scale.numpy())

    @property
    def dynamic_counter(self) -> int:
        """Finite steps since the scale last changed (Keras 2's name for ``step_counter``)."""
        return int(self.step_counter.numpy())

    def scale_loss(self, loss):
        """``loss * scale`` (Keras 3): a float16 or bfloat16 loss becomes float32, as Keras' multiply promotes.

        In replica context on GPU replicas the product is taken on the replica's GPU with its own copy of
        the scale (a GPU array, also for a number such as the backward pass's seed ``scale_loss(1.0)``): the
        step waits for nothing, and md.function can capture it."""
        scale = self._device_scale(loss)
        if scale is None:
            return loss * self.loss_scale
        dtype = _np.result_type(loss.dtype if _device_util.on_gpu(loss) else loss, _np.float32)
        scale = scale.astype(dtype, copy=False)
        return loss.astype(dtype, copy=False) * scale if _device_util.on_gpu(loss) else scale * dtype.type(loss)

    def _device_scale(self, loss):
        """This replica's copy of the scale when ``loss`` (a GPU array or a number) is scaled on its GPU."""
        from ..distribute import distribute_lib

        if not (_device_util.on_gpu(loss) or isinstance(loss, _numbers.Real)) \
                or distribute_lib.in_cross_replica_context():
            return None
        scale = self.dynamic_scale.read_value()
        return scale if _device_util.on_gpu(scale) else None

    def get_scaled_loss(self, loss):
        """``loss * scale`` in ``loss``'s own dtype (Keras 2); a callable loss gives a callable."""
        if callable(loss):
            return lambda: self.get_scaled_loss(loss())
        return loss * self._scale_as(loss)

    def get_unscaled_gradients(self, grads) -> list:
        """Each gradient divided by the scale, in its own dtype (Keras 2); None stays None.

        From then on ``apply_gradients`` takes unscaled gradients, as Keras 2's did.
        """
        self._caller_unscales = True
        reciprocal = 1.0 / float(self.loss_scale)
        return [None if g is None else _map_values(lambda a: a * self._scale_as(a, reciprocal), g) for g in grads]

    def _scale_as(self, x, factor=None):
        factor = float(self.loss_scale) if factor is None else factor
        dtype = getattr(x, "dtype", None)
        return factor if dtype is None else _np.asarray(factor, dtype=dtype)[()]

    # -- the step --
    def apply(self, grads, trainable_variables=None):
        """Keras 3's ``apply``: ``apply_gradients(zip(grads, trainable_variables))``, by default the
        variables given to ``build``. (The wrapped optimizer's own ``apply`` would skip the scaling.)"""
        if trainable_variables is None:
            if self._var_list is None:
                raise ValueError("trainable_variables: none given and build(var_list) was never called; pass the "
                                 "variables, e.g. optimizer.apply(grads, model.trainable_variables)")
            trainable_variables = self._var_list
        grads = list(grads)
        trainable_variables = list(trainable_variables)
        if len(grads) != len(trainable_variables):
            raise ValueError(f"grads: {len(grads)} gradients for {len(trainable_variables)} trainable_variables; "
                             "pass one gradient (or None) per variable")
        return self.apply_gradients(zip(grads, trainable_variables))

    def apply_gradients(self, grads_and_vars, options=None, *, name=None, experimental_aggregate_gradients=True):
        """All-reduce, check, unscale and apply gradients of the scaled loss; returns ``iterations`` after it.

        Called inside ``strategy.run`` (each replica passes its gradients) or in
        cross-replica context, as the wrapped optimizer's ``apply_gradients``.
        A step whose gradients are not all finite (on any replica of any worker)
        changes no weight and returns ``iterations`` unchanged.
        """
        from ..distribute import distribute_lib

        aggregate = bool(experimental_aggregate_gradients)
        if not distribute_lib.in_cross_replica_context():
            grads_and_vars = grads_and_vars if isinstance(grads_and_vars, list) else list(grads_and_vars)
            central = self._central_plan(grads_and_vars, aggregate)
            if central is not None:
                return self._central_replica_step(*central, options)
        pairs = []
        for i, pair in enumerate(grads_and_vars):
            try:
                grad, var = pair
            except (TypeError, ValueError):
                raise ValueError(f"grads_and_vars[{i}]={pair!r}: expected a (gradient, variable) pair; pass "
                                 "zip(grads, variables)") from None
            if grad is not None:
                pairs.append((grad, var))
        if distribute_lib.in_cross_replica_context():
            return self._apply(distribute_lib.get_strategy(), pairs, options, aggregate, False)
        return distribute_lib.get_replica_context().merge_call(
            lambda strategy, merged: self._apply(strategy, merged, options, aggregate, True), args=(pairs,))

    def _apply(self, strategy, pairs, options, aggregate, from_replicas):
        from ..distribute import distribute_lib
        from ..distribute.reduce_util import ReduceOp
        from ..distribute.values import DistributedValues, PerReplica

        if not pairs:
            raise ValueError("grads_and_vars: no gradient was given (all were None or the list is empty)")
        elsewhere = getattr(strategy.extended, "_loss_scale_step", None)
        if elsewhere is not None:  # the scale's state on another task (ParameterServerStrategy): one request
            return elsewhere(self, pairs)
        # Keras builds the wrapped optimizer's state before it decides: a skipped first step leaves the slots
        # (zeros), as TF's does.
        slots = getattr(self.inner_optimizer, "_slots", None)
        if slots is not None and any(id(v) not in slots for _, v in pairs):
            self.inner_optimizer.build([v for _, v in pairs])
        devices = strategy.extended.worker_devices
        if from_replicas and not isinstance(strategy, distribute_lib._DefaultStrategy):
            # merge_call leaves a gradient unwrapped when every replica passed the same object
            # (or there is one local replica): it is still one gradient per replica.
            pairs = [(g if isinstance(g, DistributedValues) else PerReplica([g] * len(devices), devices), v)
                     for g, v in pairs]
        grads = [g for g, _ in pairs]
        distributed = [k for k, g in enumerate(grads) if isinstance(g, DistributedValues)]
        # Keras clips each replica's unscaled gradient before the sum, and accumulates each replica's gradients
        # in that replica's accumulators: an optimizer that clips or accumulates reduces them itself. Otherwise
        # the sum is taken here, in the gradients' own dtype (float16 and bfloat16 move half the bytes), and
        # the check below also catches a sum that overflows.
        # (a MultiOptimizer's sub-optimizers each: any one that clips or accumulates reduces its own)
        parts = getattr(self.inner_optimizer, "optimizers", None) or [self.inner_optimizer]
        reduce_here = aggregate and not any(_clips(part) or getattr(part, "gradient_accumulation_steps", None)
                                            for part in parts)
        reduced = set(distributed) if reduce_here else set()
        if reduced:
            mean = getattr(self.inner_optimizer, "gradient_aggregation", "sum") == "mean"
            for k, g in zip(distributed, strategy.extended.batch_reduce_to(
                    ReduceOp.MEAN if mean else ReduceOp.SUM, [pairs[k] for k in distributed], options=options)):
                grads[k] = g
        plan = self._device_plan(strategy, grads, [v for _, v in pairs], reduced)
        if plan is not None:
            return self._apply_on_device(plan, grads)
        # An all-reduce gives every local copy the same bits: one copy of a reduced gradient tells for all.
        arrays = [c for k, g in enumerate(grads)
                  for c in (_placed_components(g)[:1] if k in reduced else _placed_components(g))]
        if self.dynamic and not self._agreed_finite(strategy, arrays, devices):
            return self._skipped()
        if not self._caller_unscales:
            grads = [self._unscaled(g) for g in grads]
        step = self.inner_optimizer.apply_gradients(
            [(g, v) for g, (_, v) in zip(grads, pairs)], options,
            experimental_aggregate_gradients=aggregate and not reduce_here)
        self._counted_finite()
        return step

    def _skipped(self) -> int:
        """A dynamic step whose gradients were not all finite, decided on the host: nothing applied, the scale
        halved and the count of good steps restarted (Keras); returns ``iterations``, unchanged."""
        self.step_counter.assign(_np.int64(0))
        self.dynamic_scale.assign(self.dynamic_scale.numpy() * _np.float32(0.5))
        return int(self.iterations.numpy())

    def _counted_finite(self) -> None:
        """After a step applied on the host's decision: one more good step, and the scale doubled once
        ``dynamic_growth_steps`` steps in a row were (Keras)."""
        if self.dynamic:
            if int(self.step_counter.numpy()) == self.dynamic_growth_steps - 1:
                self.step_counter.assign(_np.int64(0))
                self.dynamic_scale.assign(self.dynamic_scale.numpy() * _np.float32(2.0))
            else:
                self.step_counter.assign_add(_np.int64(1))

    def _central_plan(self, grads_and_vars: list, aggregate: bool):
        """For a replica's step under CentralStorageStrategy, packed (:meth:`_central_replica_step`): the
        wrapped optimizer's plan (made by an earlier step), its gradients and variables; None where the step
        takes the general path: the first step, gradients the caller unscaled or aggregated, an optimizer that
        clips (Keras clips each replica's unscaled gradients before the sum), accumulates or has a
        ``loss_scale_factor``, or variables the plan does not pack."""
        from .optimizers import base

        inner = self.inner_optimizer
        if (not aggregate or self._caller_unscales or not isinstance(inner, base.Optimizer) or _clips(inner)
                or inner.gradient_accumulation_steps or inner.loss_scale_factor is not None
                or not any(plan.central for plan in inner._plans.values())):
            return None
        grads, variables = inner._check_pairs(grads_and_vars)
        plan = inner._plans.get(tuple(map(id, variables)))
        if plan is None or not plan.central or not plan.packs:
            return None
        if not plan.host[0] and (inner.use_ema or plan.constraints  # (decided on the GPU, as _device_plan says)
                                 or not hasattr(base._gpu_kernel(), "loss_scale_step")):
            return None
        return plan, grads, variables

    def _central_replica_step(self, plan, grads, variables, options):
        """A replica's loss-scaled step for variables kept once (CentralStorageStrategy), packed as the wrapped
        optimizer's step is: this replica packs its gradients in their own dtype (one buffer per dtype, in
        parallel with the other replicas) and merge_call hands the packs over as one object; there
        (:meth:`_central_merged_step`) one fused all-reduce sums them, one replica's sum goes to the variables'
        device, one finiteness decision covers the step, and one fused update applies it, or nothing does."""
        from ..distribute import distribute_lib
        from .optimizers.base import _ReplicaGrads

        ctx = distribute_lib.get_replica_context()
        given = plan.given_dtypes(grads)
        if given is not None and any(_np.result_type(g, _np.float32) != dtype for g, dtype in zip(given, plan.groups)):
            given = None  # (the quotient by the float32 scale would not have the variables' dtype)
        packed = None if given is None else plan.pack(ctx._local_replica_id, grads, given)
        return ctx.merge_call(lambda strategy, merged: self._central_merged_step(strategy, plan, merged, variables,
                                                                                  options),
                              args=(_ReplicaGrads(grads, packed),))

    def _central_merged_step(self, strategy, plan, merged, variables, options):
        """The merge of :meth:`_central_replica_step`. With variables on a GPU the step is decided there, as
        MirroredStrategy's (:meth:`_apply_on_device`); in host memory the host checks the summed buffers (one
        look per dtype), then skips the step or applies the buffers divided by the scale. A replica whose
        gradients did not pack (their dtypes differ) sends the step down the general path."""
        from ..distribute.values import DistributedValues, PerReplica

        devices = strategy.extended.worker_devices
        holders = merged.values if isinstance(merged, DistributedValues) else (merged,) * len(devices)
        if any(h.packed is None for h in holders):
            return self._apply(strategy, [(PerReplica([h.grads[k] for h in holders], devices), v)
                                          for k, v in enumerate(variables)], options, True, False)
        inner = self.inner_optimizer
        columns = [PerReplica([h.packed[j] for h in holders], devices) for j in range(len(plan.groups))]
        # (reduced onto the variables: the strategy takes the sum of a replica on their memory if one is)
        reduced = inner._all_reduce(strategy, columns, [variables[0]] * len(columns), options)
        if not plan.host[0]:
            return self._apply_on_device(plan, None, reduced)
        if self.dynamic and not self._agreed_finite(strategy, [(b, None) for b in reduced], devices):
            return self._skipped()
        scale = _np.float32(self.dynamic_scale.numpy())
        step = inner._advance(plan)
        plan.apply(0, None, step, packed=[b / scale for b in reduced])  # (float16 sums become float32, as Keras')
        self._counted_finite()
        return step + 1

    def _device_plan(self, strategy, grads, variables, reduced):
        """The wrapped optimizer's plan when this step can be decided on the GPUs, else None.

        That takes variables on GPUs that the fused kernel updates (float32, float64), every gradient
        all-reduced here (so every replica of every worker checks the same bits and agrees) and of a dtype
        whose quotient by the float32 scale has its variable's dtype (so the kernel's division in that dtype
        is the host step's), and nothing that branches on the step in Python (moving averages, gradient
        accumulation, constraints) or divides the gradients elsewhere (Keras 2's ``get_unscaled_gradients``,
        ``loss_scale_factor``).
        """
        from .optimizers import base

        inner = self.inner_optimizer
        if (self._caller_unscales or len(reduced) != len(grads) or not isinstance(inner, base.Optimizer)
                or inner.use_ema or inner.gradient_accumulation_steps or inner.loss_scale_factor is not None
                or any(type(_components(g)[0]) is _IndexedSlices for g in grads)):  # (densified on the host path)
            return None
        if any(_np.result_type(_components(g)[0].dtype, _np.float32) != _np.dtype(v.dtype)
               for g, v in zip(grads, variables)):
            return None
        kernel = base._gpu_kernel()
        if kernel is None or not hasattr(kernel, "loss_scale_step"):
            return None
        for i, var in enumerate(variables):
            inner._check_variable(f"grads_and_vars[{i}]", var)
        plan = inner._plan(strategy, variables)
        if any(plan.host) or not plan.packable or plan.constraints:
            return None
        return plan

    def _apply_on_device(self, plan, grads, packed=None):
        """The step decided on each GPU (no host sync): each device's reduced gradients packed (or ``packed``
        already: the reduced buffers of variables kept once, converted to their dtype), checked
        for inf and nan into one flag, applied divided by the scale unless the flag is set, then the scale,
        its counter and ``iterations`` updated there (csrc/cuda/fused_update.h). Returns ``iterations``
        (the variable: reading it waits for the step)."""
        from ..distribute.values import DistributedValues
        from .optimizers.base import LossScaleGate

        inner = self.inner_optimizer
        inner._skips_on_device = inner._skips_on_device or self.dynamic
        step = inner._advance(plan, on_device=True)
        scales, counters = _copies(self.dynamic_scale), _copies(self.step_counter)
        for d in range(plan.num_devices):
            device = plan.copies[d][0].device
            gate = LossScaleGate(
                nonfinite=self._nonfinite_flag(device), scale=scales[d]._writable_buffer().data.ptr,
                counter=counters[d]._writable_buffer().data.ptr, growth_steps=self.dynamic_growth_steps,
                dynamic=self.dynamic)
            device_grads = None if grads is None else [g.values[d] if isinstance(g, DistributedValues) else g
                                                         for g in grads]
            plan.apply(d, device_grads, step, packed=packed, gate=gate)
        return self.iterations

    def _nonfinite_flag(self, device) -> int:
        """The device's check flag (made once, zero: each step's last kernel clears it again)."""
        ordinal = _device_util.physical_ordinal(device)
        flag = self._nonfinite.get(ordinal)
        if flag is None:
            cupy = _gpu.cupy_module()
            with cupy.cuda.Device(ordinal):
                flag = self._nonfinite[ordinal] = cupy.zeros((), _np.int32)
                # Zeroed on this stream, read on the step's: once, the host waits for the zeros.
                cupy.cuda.get_current_stream().synchronize()
        return flag.data.ptr

    def _agreed_finite(self, strategy, arrays, devices) -> bool:
        """Whether every gradient is finite on every replica of every worker. One process checks all its
        replicas' gradients here; across workers one all-reduce (MIN) of a flag makes the answer the
        same everywhere."""
        from ..distribute.reduce_util import ReduceOp
        from ..distribute.values import PerReplica

        finite = all(_is_finite(a, device) for a, device in arrays)
        if strategy.extended._num_workers == 1:
            return finite
        flags = PerReplica([_np.full((), finite, _np.float32) for _ in devices], devices)
        return bool(strategy.reduce(ReduceOp.MIN, flags, axis=None))

    def _unscaled(self, grad, scale=None):
        """``grad / scale`` per component: float16 and bfloat16 become float32, as Keras' division promotes.
        ``scale``: the scale already read (else ``dynamic_scale``'s value)."""
        from ..distribute.values import DistributedValues

        scale = _np.float32(self.dynamic_scale.numpy() if scale is None else scale)
        if not isinstance(grad, DistributedValues):
            return _map_values(lambda a: a / scale, grad)
        devices = grad._devices_or((None,) * len(grad.values))
        parts = []
        for component, device in zip(grad.values, devices):
            # On the component's own device (CuPy), and on the stream the update then reads it on: the
            # device's merge stream (else the update can read the quotient's memory before it is written).
            with _device_util.cross_replica_gpu_scope(device) if device else _contextlib.nullcontext():
                parts.append(_map_values(lambda a: a / scale, component))
        return type(grad)(parts, grad._devices)

    def __repr__(self) -> str:
        return (f"<LossScaleOptimizer name={self.name!r} inner_optimizer={self.inner_optimizer!r} "
                f"dynamic={self.dynamic} loss_scale={float(self.loss_scale)}>")

