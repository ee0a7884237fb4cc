"""The optimizer step: Keras' order of operations, one fused all-reduce, one fused update per device.

``apply_gradients(grads_and_vars)`` may be called inside ``strategy.run`` (each replica
passes its own gradients) or in cross-replica context under ``strategy.scope()`` (with
``PerReplica`` gradients, or plain ones, which are the final gradient already). In
Keras 3's order under a tf.distribute strategy, it

1. clips each replica's gradients (``clipnorm`` per gradient, ``global_clipnorm`` over
   all of them, or ``clipvalue``) *before* they are summed, as Keras does;
2. SUMS the gradients across all replicas of all workers with ONE
   ``strategy.extended.batch_reduce_to`` (packed into few buffers,
   ``CommunicationOptions.bytes_per_pack`` honoured), as Keras optimizers do under a
   strategy, so each replica's loss is divided by the GLOBAL batch size
   (``md.nn.compute_average_loss``); ``gradient_aggregation="mean"`` averages instead.
   CPU replicas of one process skip the all-reduce: each replica's fused update reads every
   replica's gradients and sums them itself, in the order the all-reduce sums them
   (:class:`_Summands`, docs/replica_arrays.md);
3. applies weight decay (``w -= w * weight_decay * lr``) and the update rule to every
   variable and slot of a device in ONE fused update, in place: the host kernel of
   ``csrc/host/fused_update.cc`` over a table of (pointer, count) entries, or the same
   rule element-wise per variable for arrays the kernel does not take. Each replica
   updates its own device's copies with the same reduced gradients, so the copies stay
   bit-identical;
4. updates Keras' moving averages (``use_ema``: a second fused pass) and applies the
   constraints;
5. increments ``iterations``.

Keras 3's ``loss_scale_factor`` divides the gradients first; with
``gradient_accumulation_steps`` a step that only accumulates adds each replica's gradients
to its accumulators (no all-reduce), and every n-th step applies their average
(docs/training.md, "Keras 3's extra options").

What is per variable and fixed (the copies on each device, their slots, which ones
decay, the dtype groups) is computed once per strategy and variable list (a
:class:`_Plan`) and reused on every step.

Arrays read from a variable stay valid as TensorFlow promises: an update writes into a
variable's buffer only when nothing else holds it, and otherwise gives the variable a
new buffer first (copy-on-write, as TensorFlow's runtime does). docs/training.md.
"""

from __future__ import annotations

import collections
import copy
import inspect
import itertools
import math
import numbers
import operator
import re
import sys
import threading
import uuid
import weakref
from typing import NamedTuple

import numpy as np

from ..._core import fused_update as _fused_update
from ...device import device_util, gpu as _gpu
from ...device.dtypes import dtype_code
from ...device.indexed_slices import IndexedSlices, map_values, scatter_add_rows
from ...distribute import distribute_lib, values
from ...distribute.options import VariableAggregation
from ...distribute.reduce_util import ReduceOp
from ...distribute.values import DistributedValues, DistributedVariable, PerReplica
from .rules import (ADAFACTOR, EMA, HOST_COEFFICIENTS, PER_VARIABLE, SGD, SQUARING, SquaredGradient,
                    apply as apply_rule, array_module, ema, weight_decay as apply_weight_decay)
from .schedules import LearningRateSchedule, deserialize as deserialize_schedule, serialize as serialize_schedule
from .step_window import StepWindow

__all__ = ["LossScaleGate", "Optimizer", "check_loss_scale_factor", "check_rate"]

# Held while a plan makes its staging buffers (_Plan._staging), which replica threads ask for at once.
_staging_lock = threading.Lock()


class _FlooredIterations(int):
    """``iterations`` under gradient accumulation: Keras' ``floor_divide(_iterations, steps)``, a read-only
    count (``int(x)``, ``x.numpy()``); the variable itself (the real count, checkpointed) is ``_iterations``."""

    def numpy(self):
        return np.int64(self)


def check_rate(value, argument: str, allow_callable: bool = False, low: float = 0.0, high: float | None = None,
               high_inclusive: bool = False):
    """``value`` as a float in ``[low, high)`` (``[low, high]`` with ``high_inclusive``), or a callable."""
    if allow_callable and callable(value):
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        kind = "a number or a callable of the step" if allow_callable else "a number"
        raise ValueError(f"{argument}={value!r}: expected {kind}")
    if value < low or (high is not None and (value > high if high_inclusive else value >= high)):
        bound = f"in [{low}, {high}{']' if high_inclusive else ')'}" if high is not None else f">= {low}"
        raise ValueError(f"{argument}={value!r}: expected a value {bound}")
    return float(value)


def check_loss_scale_factor(value):
    """Keras 3's ``loss_scale_factor``: None, or a finite nonzero number."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real)
                              or not math.isfinite(value) or value == 0):
        raise ValueError(f"loss_scale_factor={value!r}: expected a finite nonzero number (the loss is multiplied by "
                         "it, the gradients divided), or None")
    return value


def _takes_an_argument(fn) -> bool:
    """Whether ``fn`` can be called with one positional argument (a schedule of the step), not only with none."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # (no signature to read: call it as a schedule)
        return True
    return any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL) for p in parameters)


def _snake_case(name: str) -> str:
    """Keras' default name of an optimizer class: ``AdamW`` -> ``adam_w``, ``RMSprop`` -> ``rm_sprop``."""
    name = re.sub(r"(.)([A-Z][a-z]+)", r"\1_\2", name)
    return re.sub(r"([a-z])([A-Z])", r"\1_\2", name).lower()


def _check_positive(value, argument: str):
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{argument}={value!r}: expected a number > 0 (or None, the default, for no clipping); "
                         f"Keras ignores {argument} <= 0 silently, here it is an error")
    return float(value)


def _check_aggregation(value) -> str:
    """``"sum"`` or ``"mean"`` from those strings (any case) or ``md.ReduceOp.SUM`` / ``MEAN``."""
    if isinstance(value, ReduceOp):
        value = value.value
    if isinstance(value, str) and value.lower() in ("sum", "mean"):
        return value.lower()
    raise ValueError(f"gradient_aggregation={value!r}: expected 'sum' (Keras: gradients summed across "
                     "replicas, loss divided by the global batch size) or 'mean' (gradients averaged)")


class Optimizer:
    """Base class of the Keras optimizers (``md.optimizers.SGD``, ``Adam``, ...).

    A subclass names its slots (``_slot_specs``: ``(name, initial value)`` pairs), its
    rule (``_rule``, a code of :mod:`.rules`) and computes the rule's scalars for a
    dtype and step (``_coefficients``).
    """

    _slot_specs: tuple = ()
    _slot_aliases: dict = {}
    _rule: int = SGD
    _coefficients_use_step = False  # whether _coefficients reads `step` (Adam's bias corrections do)
    _config_keys: tuple = ()  # the subclass's own arguments, in Keras' get_config order

    def __init__(self, learning_rate, name: str | None, gradient_aggregation="sum", *, weight_decay=None, clipnorm=None,
                 clipvalue=None, global_clipnorm=None, use_ema=False, ema_momentum=0.99, ema_overwrite_frequency=None,
                 loss_scale_factor=None, gradient_accumulation_steps=None, **kwargs):
        kwargs.pop("decay", None)  # Keras: "no longer supported and will be ignored"
        if kwargs:
            raise ValueError(f"Argument(s) not recognized: {kwargs}")
        self.use_ema = bool(use_ema)
        self.ema_momentum = ema_momentum
        self.ema_overwrite_frequency = ema_overwrite_frequency
        if self.use_ema:  # Keras checks these only with use_ema
            self.ema_momentum = check_rate(ema_momentum, "ema_momentum", low=0.0, high=1.0, high_inclusive=True)
            if ema_overwrite_frequency is not None and (
                    isinstance(ema_overwrite_frequency, bool)
                    or not isinstance(ema_overwrite_frequency, numbers.Integral)
                    or ema_overwrite_frequency < 1):
                raise ValueError("`ema_overwrite_frequency` must be an integer >= 1 or None. Received: "
                                 f"ema_overwrite_frequency={ema_overwrite_frequency!r}")
        self.loss_scale_factor = check_loss_scale_factor(loss_scale_factor)
        if gradient_accumulation_steps and (
                isinstance(gradient_accumulation_steps, bool)
                or not isinstance(gradient_accumulation_steps, numbers.Integral) or gradient_accumulation_steps < 2):
            raise ValueError("`gradient_accumulation_steps` must be an integer >= 2. Received: "
                             f"gradient_accumulation_steps={gradient_accumulation_steps!r}")
        self.gradient_accumulation_steps = int(gradient_accumulation_steps) if gradient_accumulation_steps else None
        self.learning_rate = learning_rate
        # Keras' default: the class name in snake case (Adam -> "adam", RMSprop -> "rm_sprop"), which also
        # names `iterations` ("adam/iterations").
        self.name = name or _snake_case(type(self).__name__)
        self.gradient_aggregation = _check_aggregation(gradient_aggregation)
        if weight_decay is not None:
            weight_decay = check_rate(weight_decay, "weight_decay")
        self.weight_decay = weight_decay
        self.clipnorm = _check_positive(clipnorm, "clipnorm")
        self.clipvalue = _check_positive(clipvalue, "clipvalue")
        self.global_clipnorm = _check_positive(global_clipnorm, "global_clipnorm")
        if sum(a is not None for a in (clipnorm, clipvalue, global_clipnorm)) > 1:
            raise ValueError("Only one of `clipnorm`, `clipvalue` and `global_clipnorm` can be set. Received: "
                             f"clipnorm={clipnorm}, clipvalue={clipvalue}, global_clipnorm={global_clipnorm}")
        self._iterations = None
        # (iterations' value, its first copy, that copy's _stores) after the last step this process took:
        # the step count without a read from the GPU, and what a captured step's replays count from
        self._known_step = None
        # Set by a LossScaleOptimizer whose steps are checked on the GPU: a step may leave `iterations`
        # where it was, which only the device knows (see _counted_step); the range that holds the device's
        # count, for the steps whose scalars the device then selects (step_window.py).
        self._skips_on_device = False
        self._window = StepWindow()
        self._slots = {}  # id(variable) -> (variable, {slot name: slot variable})
        # Set by a Checkpoint restored before the slots existed: called once they are created (Keras' deferred
        # restoration of an optimizer's variables, at build).
        self._restore_on_build = None
        self._plans = {}  # tuple of variable ids -> _Plan
        self._checked = {}  # tuple of variable ids -> (their shapes, the variables), once checked
        self._exclude_ids: set = set()
        self._exclude_names: tuple = ()
        self.built = False
        # The strategy whose variables this optimizer updates: the one in scope when it
        # is created (as Keras does), else that of the first variables it updates.
        self._strategy = distribute_lib.get_strategy() if distribute_lib.has_strategy() else None
        # Names this optimizer's state on parameter servers, which keep a copy of it beside their variables
        # (ParameterServerStrategy: distribute/parameter_server/values.py).
        self._ps_key = uuid.uuid4().hex

    def _without_state(self, **arguments):
        """A copy with this optimizer's arguments (``arguments`` replaced) and no state: no slots, plans or
        steps yet. A ps task applies the updates of its variables with one (ParameterServerStrategy)."""
        fresh = copy.copy(self)
        fresh._iterations = fresh._known_step = fresh._restore_on_build = fresh._strategy = None
        fresh._skips_on_device = fresh.built = False
        fresh._window = StepWindow()
        fresh._slots, fresh._plans, fresh._checked, fresh._exclude_ids = {}, {}, {}, set()
        for name, value in arguments.items():
            setattr(fresh, name, value)
        return fresh

    # -- arguments --
    def get_config(self) -> dict:
        """The arguments ``from_config`` rebuilds this optimizer from (no state), with Keras 3's keys: a number
        learning rate as Keras' float32 variable holds it, a schedule as ``schedules.serialize`` writes it.
        ``gradient_aggregation`` (no Keras argument) is there only when it is not the default ``"sum"``."""
        lr = self._learning_rate
        if isinstance(lr, LearningRateSchedule):
            lr = serialize_schedule(lr)
        elif not callable(lr):
            lr = float(np.float32(lr))
        config = {"name": self.name, "learning_rate": lr, "weight_decay": self.weight_decay,
                  "clipnorm": self.clipnorm, "global_clipnorm": self.global_clipnorm, "clipvalue": self.clipvalue,
                  "use_ema": self.use_ema, "ema_momentum": self.ema_momentum,
                  "ema_overwrite_frequency": self.ema_overwrite_frequency,
                  "loss_scale_factor": self.loss_scale_factor,
                  "gradient_accumulation_steps": self.gradient_accumulation_steps}
        config.update((key, getattr(self, key)) for key in self._config_keys)
        if self.gradient_aggregation != "sum":
            config["gradient_aggregation"] = self.gradient_aggregation
        return config

    @classmethod
    def from_config(cls, config: dict, custom_objects=None):
        """The optimizer of a ``get_config`` dict; a serialized schedule (a dict) becomes the schedule again
        (``custom_objects``: the classes of schedules of your own, by name)."""
        config = dict(config)
        if isinstance(config.get("learning_rate"), dict):
            config["learning_rate"] = deserialize_schedule(config["learning_rate"], custom_objects)
        return cls(**config)

    @property
    def learning_rate(self):
        """The learning rate as Keras' property gives it: a schedule's value at the current step (float32), a
        callable of no arguments' value, else the number (or a callable of the step, which is given as is)."""
        lr = self._learning_rate
        if isinstance(lr, LearningRateSchedule):  # (at the count of apply_gradients calls, as Keras' _iterations)
            self._refresh_state()
            return np.float32(self.learning_rate_at(0 if self._iterations is None else int(self._iterations.numpy())))
        if callable(lr) and not self._rate_takes_step:
            return lr()
        return lr

    @learning_rate.setter
    def learning_rate(self, value):
        if isinstance(getattr(self, "_learning_rate", None), LearningRateSchedule):
            raise TypeError("This optimizer was created with a `LearningRateSchedule` object as its `learning_rate` "
                            "constructor argument, hence its learning rate is not settable. If you need the learning "
                            "rate to be settable, you should instantiate the optimizer with a float `learning_rate` "
                            "argument.")
        self._learning_rate = check_rate(value, "learning_rate", allow_callable=True)
        # A callable is Keras' callable of no arguments, or a schedule (or any function) of the step.
        self._rate_takes_step = callable(value) and _takes_an_argument(value)

    def learning_rate_at(self, step: int) -> float:
        """The learning rate used by the update at ``step`` (0-based)."""
        lr = self._learning_rate
        if callable(lr):
            lr = lr(step) if self._rate_takes_step else lr()
        return check_rate(lr, f"learning_rate({step})")

    def exclude_from_weight_decay(self, var_list=None, var_names=None) -> None:
        """Variables (``var_list``), or variables whose name contains one of ``var_names``, get no weight decay.

        As in Keras, call it before the optimizer is built.
        """
        if self.built:
            raise ValueError("`exclude_from_weight_decay()` can only be configured before the optimizer is built.")
        self._exclude_ids = {id(v) for v in (var_list or ())}
        self._exclude_names = tuple(var_names or ())

    def _use_weight_decay(self, var) -> bool:
        if id(var) in self._exclude_ids:
            return False
        return not any(name in var.name for name in self._exclude_names)

    # -- state --
    @property
    def iterations(self):
        """The number of ``apply_gradients`` calls so far: a mirrored int64 variable. With
        ``gradient_accumulation_steps``, the number of updates (Keras: calls // steps) as a read-only count."""
        self._refresh_state()
        if self._iterations is None:
            self._create_state(self._strategy or distribute_lib.get_strategy(), ())
        if self.gradient_accumulation_steps:
            return _FlooredIterations(int(self._iterations.numpy()) // self.gradient_accumulation_steps)
        return self._iterations

    def _rule_step(self, step: int) -> int:
        """Keras' ``iterations`` at real step ``step``: the update rules and the moving average count updates."""
        return step // self.gradient_accumulation_steps if self.gradient_accumulation_steps else step

    @property
    def variables(self) -> list:
        """``iterations`` and every slot variable, in Keras 3's ``_variables`` order (its build order; Keras' list
        also holds the learning rate, a variable there and a number here)."""
        self._refresh_state()
        state = [] if self._iterations is None else [self._iterations]
        return state + [slot for _, _, slot in self._keras_variables().values()]

    # -- Keras 3's names for the state, as its checkpoints hold it --
    @property
    def _keras_slot_groups(self) -> tuple:
        """The rule's slots in the order Keras 3's ``build`` creates them: group after group, each group's slots
        interleaved variable by variable (``add_optimizer_variables(var_list, [names])``)."""
        return (self._slot_names,) if self._slot_specs else ()

    def _keras_variables(self) -> dict:
        """Keras 3's ``_variables`` numbering of the slots: ``index -> (variable, slot name, slot variable)``.

        ``_variables`` holds ``iterations`` (0), the learning rate when it is a number (1), then what ``build``
        creates for the variables in build order: moving averages (``use_ema``), gradient accumulators, then the
        rule's slots; a checkpoint names each slot ``_variables/<index>``.
        """
        groups = ((("average",),) if self.use_ema else ()) \
            + ((("gradient_accumulator",),) if self.gradient_accumulation_steps else ()) + self._keras_slot_groups
        index = 1 if callable(self._learning_rate) else 2
        numbered = {}
        for group in groups:
            for var, slots in self._slots.values():
                for name in group:
                    if name not in slots:  # (a slot only some variables have: Muon's velocity)
                        continue
                    numbered[index] = (var, name, slots[name])
                    index += 1
        return numbered

    def _keras_scalars(self) -> dict:
        """``name -> value`` of the scalars Keras 3 keeps in variables and this optimizer in Python numbers:
        ``_learning_rate`` (float32) unless it is a schedule."""
        return {} if callable(self._learning_rate) else {"_learning_rate": np.float32(self._learning_rate)}

    def _restore_keras_scalar(self, name: str, value) -> None:
        """A checkpoint's value of a ``_keras_scalars`` entry: the learning rate, as Keras restores it."""
        self.learning_rate = float(value)

    @property
    def _slot_names(self) -> tuple:
        return tuple(name for name, _ in self._slot_specs)

    @property
    def _state_specs(self) -> tuple:
        """Every per-variable state: the rule's slots, then Keras' moving average (``average``, with
        ``use_ema``) and gradient accumulator (``gradient_accumulator``), zeros at first as in Keras."""
        return (self._slot_specs + ((("average", 0.0),) if self.use_ema else ())
                + ((("gradient_accumulator", 0.0),) if self.gradient_accumulation_steps else ()))

    def get_slot(self, var, slot_name: str):
        """The slot variable ``slot_name`` (Keras' names: ``"momentum"``, ``"velocity"``, ...) of ``var``."""
        name = self._slot_aliases.get(slot_name, slot_name)
        names = [n for n, _ in self._state_specs]
        if name not in names:
            raise KeyError(f"slot_name={slot_name!r}: {type(self).__name__} has slots {names}")
        self._refresh_state()
        entry = self._slots.get(id(var))
        if entry is None:
            raise KeyError(f"var={getattr(var, 'name', var)!r} has no slots yet: call build([var]) or "
                           "apply_gradients to it first")
        if name not in entry[1]:
            raise KeyError(f"slot_name={slot_name!r}: variable {var.name!r} has slots {sorted(entry[1])} in "
                           f"{type(self).__name__}")
        return entry[1][name]

    def build(self, var_list) -> None:
        """Create ``iterations`` and the slots of every variable of ``var_list`` (Keras 3's ``build``).

        ``apply_gradients`` builds what is missing by itself; call it inside the
        strategy's scope, as Keras ports do.
        """
        try:
            var_list = list(var_list)
        except TypeError:
            raise TypeError(f"var_list={var_list!r}: expected a list of md.Variable") from None
        for i, var in enumerate(var_list):
            self._check_variable(f"var_list[{i}]", var)
        strategy = self._strategy or next(
            (v.distribute_strategy for v in var_list if getattr(v, "distribute_strategy", None) is not None),
            distribute_lib.get_strategy())
        self._create_state(strategy, var_list)
        self.built = True

    def _create_state(self, strategy, var_list) -> None:
        """Create ``iterations`` and the slots of ``var_list`` that do not exist yet, mirrored like the model."""
        if self._strategy is not None and strategy is not self._strategy:
            raise ValueError(
                f"{type(self).__name__} {self.name!r} was created for {self._strategy!r} and is now asked to "
                f"update variables under {strategy!r}; create one optimizer per strategy (inside its scope)"
            )
        missing = [v for v in var_list if id(v) not in self._slots]
        if self._iterations is not None and not missing:
            return
        elsewhere = getattr(strategy.extended, "_create_optimizer_state", None)
        if elsewhere is not None:  # the state lives on other tasks (ParameterServerStrategy's ps): handles here
            self._strategy = strategy
            elsewhere(self, var_list)
            return
        with strategy.scope():
            if self._iterations is None:
                self._iterations = values.Variable(
                    np.int64(0), name=f"{self.name}/iterations", trainable=False, dtype=np.int64,
                    aggregation=VariableAggregation.ONLY_FIRST_REPLICA)
            for var in missing:
                base = var.name.split(":")[0]  # "dense0/w:0" -> slots "dense0/w/momentum:0", ...
                self._slots[id(var)] = (var, {
                    slot: values.Variable(self._slot_initial_value(slot, initial, var, shape, dtype),
                                          name=f"{base}/{slot}", trainable=False)
                    for slot, initial in self._var_state_specs(var)
                    for shape, dtype in [self._slot_shape(slot, var)]})
        self._strategy = strategy
        restore, self._restore_on_build = self._restore_on_build, None
        if restore is not None and missing:
            restore(self)

    def _slot_initial_value(self, name: str, initial: float, var, shape, dtype):
        """The value ``var``'s slot ``name`` starts from: ``initial`` (its ``_state_specs`` entry) everywhere,
        through float32 as Keras' Constant initializer casts it."""
        return np.full(shape, np.float32(initial), dtype)

    def _var_state_specs(self, var) -> tuple:
        """``var``'s per-variable state (:attr:`_state_specs`; Muon gives only some variables a velocity)."""
        return self._state_specs

    def _slot_shape(self, name: str, var) -> tuple:
        """``(shape, dtype)`` of ``var``'s slot ``name``: the variable's (Adafactor's factored moments differ)."""
        return var.shape, var.dtype

    def _refresh_state(self) -> None:
        """Bring into view state that lives on other tasks and that steps run elsewhere create or change
        (ParameterServerStrategy: the ps copies' slots and step count); nothing to do for other strategies."""
        refresh = getattr(getattr(self._strategy, "extended", None), "_refresh_optimizer_state", None)
        if refresh is not None:
            refresh(self)

    def _defer_restore(self, restore) -> None:
        """Keep a checkpoint's ``restore`` of the state not built yet for the build (Keras' deferred
        restoration); under ParameterServerStrategy the ps task that builds the state keeps it."""
        stash = getattr(getattr(self._strategy, "extended", None), "_stash_optimizer_restore", None)
        if stash is not None:
            stash(self, restore)
        else:
            self._restore_on_build = restore

    def scale_loss(self, loss):
        """Keras 3's ``scale_loss``: ``loss * loss_scale_factor`` (the loss itself without one); the gradients
        of the scaled loss are divided by the factor again before the update."""
        if self.loss_scale_factor is None:
            return loss
        return loss * self.loss_scale_factor

    def finalize_variable_values(self, var_list) -> None:
        """Keras' end of training: with ``use_ema``, every copy of each variable of ``var_list`` takes its
        moving average's value (call it in cross-replica context, e.g. after the training loop)."""
        if not self.use_ema:
            return
        var_list = list(var_list)
        for i, var in enumerate(var_list):
            entry = self._slots.get(id(var))
            if entry is None:
                raise ValueError(f"var_list[{i}]: variable {getattr(var, 'name', var)!r} has no moving average in "
                                 f"optimizer {self.name!r}; pass the variables it updated")
            copies = var.values if isinstance(var, DistributedVariable) else (var,)
            averages = entry[1]["average"]
            averages = averages.values if isinstance(averages, DistributedVariable) else (averages,)
            for copy, average in zip(copies, averages):
                copy._writable_buffer()[...] = average._value

    def _unscale(self, grads: list) -> list:
        """Keras divides the gradients by ``loss_scale_factor`` (in each gradient's dtype) before anything else."""
        if self.loss_scale_factor is None:
            return grads
        return [map_values(lambda a: a / _dtype_of(a).type(self.loss_scale_factor), g) for g in grads]

    # -- the step --
    def apply(self, grads, trainable_variables=None):
        """Keras 3's ``apply(grads, trainable_variables)``: ``apply_gradients(zip(grads, trainable_variables))``;
        without variables, the ones the optimizer was built with."""
        if trainable_variables is None:
            if not self.built:
                raise ValueError("When passing `grads` without `variables`, the optimizer must already be built "
                                 "on a list of variables. Call `optimizer.build(trainable_variables)` first.")
            trainable_variables = [v for v, _ in self._slots.values()]
        grads, trainable_variables = list(grads), list(trainable_variables)
        if len(grads) != len(trainable_variables):
            raise ValueError(f"grads: {len(grads)} gradients for {len(trainable_variables)} variables; pass one "
                             "gradient per variable")
        return self.apply_gradients(zip(grads, trainable_variables))

    def apply_gradients(self, grads_and_vars, options=None, *, name=None, experimental_aggregate_gradients=True):
        """Clip, sum (or average) across replicas, and update every copy of the variables in place.

        ``grads_and_vars``: pairs ``(gradient, variable)``; pairs whose gradient is None
        are skipped, as TensorFlow does. Each gradient has its variable's shape exactly
        (no broadcasting). ``options``: an ``md.CommunicationOptions`` for the fused
        all-reduce. ``name`` is accepted for Keras compatibility.
        ``experimental_aggregate_gradients=False`` (Keras' switch) skips the all-reduce:
        each replica's copy is updated with that replica's own gradient, which the
        caller must have aggregated already (e.g. with ``ReplicaContext.all_reduce``), or
        the copies drift apart. Returns the new value of ``iterations`` (a Python int).
        """
        grads, variables = self._check_pairs(grads_and_vars)
        on_parameter_servers = getattr(type(variables[0]), "_apply_gradients", None)
        if on_parameter_servers is not None:  # variables on ps tasks: updated there (ParameterServerStrategy)
            return on_parameter_servers(self, grads, variables)
        aggregate = bool(experimental_aggregate_gradients)
        if distribute_lib.in_cross_replica_context():
            try:
                return self._cross_replica_step(distribute_lib.get_strategy(), grads, variables, options, aggregate)
            except MemoryError as error:  # (in strategy.run, the replica's GPU names it)
                _gpu.raise_if_out_of_memory(error)
                raise
        if not distribute_lib.has_strategy():
            owner = next((v.distribute_strategy for v in variables
                          if getattr(v, "distribute_strategy", None) is not None
                          and not isinstance(v.distribute_strategy, distribute_lib._DefaultStrategy)), None)
            if owner is not None:
                raise RuntimeError(
                    f"{type(self).__name__}.apply_gradients was called outside strategy.run and outside "
                    f"strategy.scope(), on variables of {owner!r}; call it inside strategy.run(step_fn) (each "
                    "replica passes its gradients), or under `with strategy.scope():` with PerReplica gradients")
        ctx = distribute_lib.get_replica_context()
        grads = self._unscale(grads)
        if not self.gradient_accumulation_steps:  # else clipped after the accumulated average (merge step)
            grads = self._clip(grads)
        if IndexedSlices in map(type, grads):
            grads, aggregate = self._sparse_step(ctx, grads, variables, options, aggregate)
        packed = None
        # From the second step on, this replica packs its gradients into its fusion buffer
        # (in parallel with the other replicas): the all-reduce then moves one buffer per dtype.
        # (Variables kept once, not aggregated: the first replica's gradients go to them, packed. Kept once,
        # they take the replicas' sum into their accumulators too: packed also under gradient accumulation.)
        plan = self._plans.get(tuple(map(id, variables)))
        if plan is not None and plan.packs and not plan.sums_replicas and \
                (plan.central or not self.gradient_accumulation_steps) and \
                (aggregate or plan.central and ctx._local_replica_id == 0) and \
                ctx.strategy.num_replicas_in_sync > 1:
            packed = plan.pack(ctx._local_replica_id, grads)
        # options stay out of the merged arguments: each replica may pass its own (equal)
        # options object, which merge_call would turn into a PerReplica.
        plan, reduced, step, update, packed_reduced = ctx.merge_call(
            lambda strategy, merged: self._merged_replica_step(strategy, merged, variables, options, aggregate),
            args=(_ReplicaGrads(grads, packed),))
        if update is None:  # applied in the merge
            return step + 1
        if not update:
            plan.apply(ctx._local_replica_id, grads, step, update=False)
        elif reduced is None:
            plan.apply(ctx._local_replica_id, grads, step)
            plan.clear_sparse(ctx._local_replica_id)  # (a sparse step's buffers: only without an all-reduce)
        elif type(reduced) is _Summands:
            plan.apply(ctx._local_replica_id, None, step, summands=reduced.grads)
            # Every replica has read the others' gradients before any returns to code that may write them.
            ctx._group.exchange(ctx._local_replica_id, "apply_gradients", None, _release)
        elif packed is not None or packed_reduced:
            plan.apply(ctx._local_replica_id, None, step, packed=reduced)
        else:
            plan.apply(ctx._local_replica_id, reduced, step)
        return step + 1

    def _sparse_step(self, ctx, grads, variables, options, aggregate) -> tuple:
        """A replica's gradients of a step with IndexedSlices, as Keras' TF backend takes them: all-reduced
        first (dense ones summed, IndexedSlices' rows gathered from every replica), then densified, their
        rows' squares apart where the rule squares; returns them and whether they still need the all-reduce.
        (Under gradient accumulation Keras adds them to its dense accumulators: densified, no more.)"""
        if self.gradient_accumulation_steps:
            return _densified(grads, variables), aggregate
        if aggregate and ctx.strategy.num_replicas_in_sync > 1:
            op = ReduceOp.SUM if self.gradient_aggregation == "sum" else ReduceOp.MEAN
            grads, aggregate = ctx.all_reduce(op, grads, options), False
        squares = self._rule in SQUARING
        plan = self._plans.get(tuple(map(id, variables)))  # (none before the first step)
        targets = plan.sparse_targets(ctx._local_replica_id, grads, squares) if plan is not None else None
        if targets is None:
            return _densified(grads, variables, squares), aggregate
        return [_dense(g, var, squares, target) for g, var, target in zip(grads, variables, targets)], aggregate

    def _check_variable(self, where: str, var) -> None:
        if not isinstance(var, values.Variable):
            raise TypeError(f"{where}: variable {var!r} is not an md.Variable; create the model's variables with "
                            "md.Variable inside strategy.scope()")
        if not var.trainable:
            raise ValueError(f"{where}: variable {var.name!r} was created with trainable=False; optimizers update "
                             "trainable variables only")
        dtype = np.dtype(var.dtype)
        if not np.issubdtype(dtype, np.floating) and dtype.name != "bfloat16":
            raise TypeError(f"{where}: variable {var.name!r} has dtype {var.dtype}; optimizers update "
                            "floating-point variables only")

    def _check_pairs(self, grads_and_vars) -> tuple:
        """``(grads, variables)`` without the None gradients; the variables' checks run once per list."""
        try:
            pairs = grads_and_vars if isinstance(grads_and_vars, list) else list(grads_and_vars)
        except TypeError:
            raise TypeError(f"grads_and_vars={grads_and_vars!r}: expected a list of (gradient, variable) pairs, "
                            "e.g. zip(grads, variables)") from None
        try:
            grads = [g for g, _ in pairs]
            variables = [v for _, v in pairs]
        except (TypeError, ValueError):
            return self._check_pairs_one_by_one(pairs)
        # (C loops over the gradients, no Python per gradient: a None, or a shape not the variable's, takes the
        # checks one by one, which skip the Nones and raise naming the pair)
        if _NONE_TYPE in map(type, grads):
            return self._check_pairs_one_by_one(pairs)
        checked = self._checked.get(tuple(map(id, variables)))
        try:
            if checked is None or list(map(_SHAPE, grads)) != checked[0]:
                return self._check_pairs_one_by_one(pairs)
        except AttributeError:  # (a gradient without a shape)
            return self._check_pairs_one_by_one(pairs)
        return grads, variables

    def _check_pairs_one_by_one(self, pairs) -> tuple:
        grads, variables = [], []
        for i, pair in enumerate(pairs):
            try:
                grad, var = pair
            except (TypeError, ValueError):
                raise ValueError(
                    f"grads_and_vars[{i}]={pair!r}: expected a (gradient, variable) pair; "
                    "pass zip(grads, variables)") from None
            if grad is None:
                continue
            self._check_variable(f"grads_and_vars[{i}]", var)
            _check_gradient_shape(i, grad, var)
            grads.append(grad)
            variables.append(var)
        if not grads:
            raise ValueError("grads_and_vars: no gradient was given (all were None or the list is empty)")
        if len({id(v) for v in variables}) != len(variables):
            raise ValueError("grads_and_vars: a variable appears twice; sum its gradients first")
        # The entry keeps its variables referenced, so their ids stay theirs.
        self._checked.setdefault(tuple(map(id, variables)), ([tuple(v.shape) for v in variables], variables))
        return grads, variables

    def _clip(self, grads: list) -> list:
        """One replica's gradients clipped as Keras' ``_clip_gradients`` does (new arrays; the inputs stay)."""
        # IndexedSlices are clipped by their rows, as Keras' TF backend clips them (tf.clip_by_norm of the
        # values, their squares in the global norm, each value clipped): a repeated index is two rows here.
        if self.clipnorm is not None:
            return [map_values(lambda a: _clip_by_norm(a, self.clipnorm), g) for g in grads]
        if self.global_clipnorm is not None:
            scaled = _clip_by_global_norm([_rows(g) for g in grads], self.global_clipnorm)
            return [g._with(values=a) if type(g) is IndexedSlices else a for g, a in zip(grads, scaled)]
        if self.clipvalue is not None:
            return [map_values(lambda a: array_module(a).clip(a, -self.clipvalue, self.clipvalue), g)
                    for g in grads]
        return grads

    def _cross_replica_step(self, strategy, grads, variables, options, aggregate):
        """``apply_gradients`` under ``strategy.scope()``: each replica's part clipped, reduced, applied per device."""
        as_local = getattr(strategy.extended, "_as_local", None)  # multi-worker: one local replica's part
        if as_local is not None:
            grads = [as_local(g) for g in grads]
        if self.loss_scale_factor is not None:
            grads = [PerReplica(self._unscale(list(g.values)), g._devices) if isinstance(g, DistributedValues)
                     else self._unscale([g])[0] for g in grads]
        if self.gradient_accumulation_steps:  # Keras adds IndexedSlices to its dense accumulators
            grads = _densified(grads, variables)
        plan = self._plan(strategy, variables)
        step = self._advance(plan)
        if plan.central and self.gradient_accumulation_steps and aggregate:
            grads = self._reduced(strategy, grads, variables, options)  # (one accumulator: of the replicas' sum)
        if self.gradient_accumulation_steps:
            if not self._is_update_step(step):
                for d in range(plan.num_devices):
                    plan.apply(d, [_component(g, d) for g in grads], step, update=False)
                return step + 1
            grads = [PerReplica([plan.accumulated(d, k, g.values[d]) for d in range(len(g.values))], g._devices)
                     if isinstance(g, DistributedValues) else plan.accumulated(0, k, g) for k, g in enumerate(grads)]
            # (clipped below, each replica's part, as on every step)
        distributed = [k for k, g in enumerate(grads) if isinstance(g, DistributedValues)]
        if distributed and (self.clipnorm or self.global_clipnorm or self.clipvalue):
            replicas, devices = len(grads[distributed[0]].values), grads[distributed[0]]._devices
            clipped = []
            for r in range(replicas):
                # On the replica's GPU and its merge stream: ordered after the accumulated average computed
                # there (plan.accumulated), which the clip on another stream would read unfinished.
                with device_util.cross_replica_gpu_scope(devices[r]):
                    clipped.append(self._clip([grads[k].values[r] for k in distributed]))
            for j, k in enumerate(distributed):
                grads[k] = PerReplica([clipped[r][j] for r in range(replicas)], grads[k]._devices)
        plain = [k for k, g in enumerate(grads) if not isinstance(g, DistributedValues)]
        if plain:
            for k, g in zip(plain, self._clip([grads[k] for k in plain])):
                grads[k] = g
        if aggregate:
            grads = self._reduced(strategy, grads, variables, options)
        grads = _densified(grads, variables, self._rule in SQUARING)  # (IndexedSlices: their gathered rows)
        for d in range(plan.num_devices):
            plan.apply(d, [_component(g, d) for g in grads], step)
        return step + 1

    def _reduced(self, strategy, grads: list, variables, options) -> list:
        """``grads`` with the distributed ones reduced onto their variables (one fused collective)."""
        grads = list(grads)
        distributed = [k for k, g in enumerate(grads) if isinstance(g, DistributedValues)]
        if distributed:
            for k, g in zip(distributed, self._all_reduce(strategy, [grads[k] for k in distributed],
                                                          [variables[k] for k in distributed], options)):
                grads[k] = g
        return grads

    def _merged_replica_step(self, strategy, merged, variables, options, aggregate):
        """Once per step in replica context (inside merge_call): the fused all-reduce and the bookkeeping.

        Returns ``(plan, reduced, step, update, packed_reduced)``: ``reduced`` (None without an all-reduce)
        holds one list of reduced gradients per local replica, and merge_call hands
        each replica its own; ``packed_reduced``: those lists are fusion buffers, one per dtype, that no
        replica packed itself. With ``gradient_accumulation_steps``, ``update`` is False on
        the steps that only accumulate (nothing is reduced); on the others each replica's
        gradients are its accumulated average, clipped, then reduced (Keras' order). Without clipping,
        a packable plan takes that average packed (:meth:`_Plan.accumulated_packed`): a constant number of
        kernels per replica and one all-reduce per dtype, whatever the number of variables.
        """
        devices = strategy.extended.worker_devices
        holders = merged.values if isinstance(merged, DistributedValues) else (merged,) * len(devices)
        plan = self._plan(strategy, variables)
        step = self._advance(plan)
        if plan.central:
            self._central_step(strategy, plan, holders, variables, step, options, aggregate)
            return plan, None, step, None, False
        reduced, packed_reduced = None, False
        if self.gradient_accumulation_steps:
            if not self._is_update_step(step):
                return plan, None, step, False, False
            if plan.packable and not self._clips():
                holders = [_ReplicaGrads(None, plan.accumulated_packed(d, plan.pack_on_device(d, h.grads)))
                           for d, h in enumerate(holders)]
                reduced, packed_reduced = PerReplica([h.packed for h in holders], devices), True
            else:
                holders = [_ReplicaGrads(plan.accumulated_and_clipped(d, h.grads), None)
                           for d, h in enumerate(holders)]
                reduced = PerReplica([h.grads for h in holders], devices)  # without an all-reduce: its own average
        if aggregate and strategy.num_replicas_in_sync > 1:
            if plan.sums_replicas and reduced is None:
                # Every replica's gradients are final (all have arrived): each update sums them itself.
                return plan, _Summands(tuple(plan.host_grads(h.grads) for h in holders)), step, True, False
            if all(h.packed is not None for h in holders):
                # One packed gradient per replica and dtype, reduced onto every replica's device.
                columns = [PerReplica([h.packed[j] for h in holders], devices) for j in range(len(plan.groups))]
                destinations = [list(devices)] * len(columns)
            else:
                columns = [PerReplica([h.grads[k] for h in holders], devices) for k in range(len(variables))]
                destinations = variables
            results = self._all_reduce(strategy, columns, destinations, options)
            reduced = PerReplica([[_component(g, r) for g in results] for r in range(len(holders))], devices)
            packed_reduced = packed_reduced or destinations is not variables
        return plan, reduced, step, True, packed_reduced

    def _central_step(self, strategy, plan, holders: list, variables, step: int, options, aggregate) -> None:
        """The step of variables kept once for all replicas (CentralStorageStrategy), in the merge: every replica's
        gradients summed in one fused collective (from the second step on, the replicas' packed buffers, one per
        dtype, as MirroredStrategy's: the same sums), one replica's sum taken to the variables' device (a copy
        per dtype: to the host, or between GPUs; none from a replica on the variables' GPU; without
        ``aggregate``: the first replica's gradients, aggregated by the caller), accumulated
        (``gradient_accumulation_steps``) and applied there once, by the fused update."""
        devices = strategy.extended.worker_devices
        packed = None
        if len(holders) == 1 or not aggregate:
            # the one replica's gradients, or the first one's (aggregated by the caller), packed where it packs,
            # taken to the variables' device (from a compute GPU to parameters on the host)
            packed = plan.on_variables_device(holders[0].packed) if holders[0].packed is not None else None
            grads = plan.on_variables_device(holders[0].grads) if packed is None else None
        elif all(h.packed is not None for h in holders):
            columns = [PerReplica([h.packed[j] for h in holders], devices) for j in range(len(plan.groups))]
            # (reduced onto the variables: the strategy takes the sum of a replica on their memory if one is)
            grads, packed = None, self._all_reduce(strategy, columns, [variables[0]] * len(columns), options)
        else:
            grads = self._all_reduce(strategy, [PerReplica([h.grads[k] for h in holders], devices)
                                                for k in range(len(variables))], variables, options)
        if self.gradient_accumulation_steps:
            if not self._is_update_step(step):  # (packed: one fused accumulate per dtype)
                plan.apply(0, grads, step, packed=packed, update=False)
                return
            if packed is not None and not self._clips():  # (the average packed: a few kernels per dtype)
                packed = plan.accumulated_packed(0, packed)
            else:
                grads = plan.accumulated_and_clipped(0, grads if packed is None else plan.unpacked(packed))
                packed = None
        plan.apply(0, grads, step, packed=packed)

    def _clips(self) -> bool:
        """Whether gradients are clipped (``clipnorm``, ``global_clipnorm`` or ``clipvalue``)."""
        return self.clipnorm is not None or self.global_clipnorm is not None or self.clipvalue is not None

    def _is_update_step(self, step: int) -> bool:
        """With gradient accumulation, whether ``step`` applies the accumulated gradients (Keras:
        ``(_iterations + 1) % gradient_accumulation_steps == 0``)."""
        return (step + 1) % self.gradient_accumulation_steps == 0

    def _all_reduce(self, strategy, columns, destinations, options) -> list:
        """One fused collective for every column (a gradient, or a packed buffer of them, on every replica)."""
        op = ReduceOp.SUM if self.gradient_aggregation == "sum" else ReduceOp.MEAN
        return strategy.extended.batch_reduce_to(op, list(zip(columns, destinations)), options=options)

    def _plan(self, strategy, variables) -> "_Plan":
        key = tuple(map(id, variables))
        plan = self._plans.get(key)
        if plan is None:
            self._create_state(strategy, variables)
            self.built = True
            plan = self._plans[key] = self._new_plan(variables)
        return plan

    def _new_plan(self, variables) -> "_Plan":
        return _Plan(self, variables)

    def _advance(self, plan, on_device: bool = False) -> int:
        """The step being taken (``iterations`` before it), its scalars prepared; each device's copy of
        ``iterations`` goes up with its update (``_Plan.apply``).

        Under ``md.function``'s capture nothing may wait for the GPU: the step is the one counted by the
        eager warm-up step that precedes every capture, the captured update reads the step's scalars
        from device buffers, and a replay hook counts the step and uploads its scalars before each replay.

        ``on_device``: a loss-scaled step decided on the GPUs (LossScaleOptimizer). After a step the GPU may
        have skipped, the returned step is an upper bound; when the scalars follow the step, they are
        prepared for every step the device may be at, and the device picks its own (step_window.py).
        """
        scope = _gpu.step_scope()
        if scope is not None and scope.capturing:
            if self.use_ema or self.gradient_accumulation_steps:
                raise NotImplementedError(
                    f"optimizer {self.name!r}: use_ema and gradient_accumulation_steps branch on the step in Python, "
                    "which a step captured by md.function cannot replay; run this step without md.function")
            # The capture runs nothing, so it counts its applies by itself: a second apply of this optimizer
            # in the step is the step after the first's, as eagerly. Each replay's hooks count them again.
            # (A second apply under a dynamic scale: its step is the first's + 1 at most, and its device picks
            # the row of whatever the first apply left in `iterations`.)
            counted = (self, "next step")
            first = counted not in scope.captured
            step = self._counted_step(plan) if first else scope.captured[counted]
            scope.captured[counted] = step + 1
            selected = on_device and self._selects_on_device()
            scalars = plan.capture_scalars(scope, step, selected)
            scope.replay_hooks.append(lambda: self._before_replay(plan, scalars, scope, selected, first))
            return step
        self._prepare_step(plan, on_device and self._selects_on_device())
        return plan.next_step - 1

    def _selects_on_device(self) -> bool:
        """Whether a loss-scaled step's device picks its scalars (they follow a step only the GPU knows)."""
        return self._skips_on_device and self._scalars_use_step()

    def _prepare_step(self, plan, selected: bool) -> None:
        """Counts the step and prepares its scalars: with ``selected``, one row per step the device may be at."""
        step = self._counted_step(plan, bounded=selected)
        if selected:
            bounds = self._window.bounds(step)
            # (None: no count known within MAX_ROWS applies, after an assignment: read it, a wait)
            lower, step = bounds if bounds is not None else (self._read_step(),) * 2
            plan.prepare_rows(lower, step)
        else:
            plan.prepare(step)
            if not self._skips_on_device:  # the count is exact: the range starts there once steps may skip
                self._window.known_exactly(step)
        self._window.counted()
        self._known_step = (step + 1, plan.iterations[0], plan.iterations[0]._stores)

    def _counted_step(self, plan, bounded: bool = False) -> int:
        """``iterations`` now: the count this optimizer keeps, read from ``iterations`` (on a GPU: a copy to
        the host, which waits for the GPU) only when someone else assigned it since this optimizer counted.

        After a step a LossScaleOptimizer may have skipped on the GPU, the count is an upper bound: exact
        enough for scalars that do not follow the step, for a capture (each replay's hook counts again) and
        where the device selects the scalars (``bounded``); otherwise read back, a copy that waits."""
        first = plan.iterations[0]
        known = self._known_step
        scope = _gpu.step_scope()
        capturing = scope is not None and scope.capturing
        if known is not None and known[1] is first and known[2] == first._stores:
            if bounded or not self._skips_on_device or capturing or not self._scalars_use_step():
                return known[0]
            return self._read_step()
        if capturing:
            raise RuntimeError(
                f"optimizer {self.name!r}: `iterations` was assigned after md.function's warm-up step, so a "
                "captured step cannot know its value without waiting for the GPU; assign it outside the step")
        return self._read_step()

    def _read_step(self) -> int:
        """``iterations`` read back (on a GPU a copy that waits for the last step): the exact count."""
        step = int(self._iterations.numpy())
        self._window.known_exactly(step)
        return step

    def _scalars_use_step(self) -> bool:
        return self._coefficients_use_step or callable(self._learning_rate)

    def _before_replay(self, plan, scalars, scope, selected: bool, first: bool) -> None:
        """Before each replay of a captured step, for one of its applies (in their order): the apply counted,
        its scalars uploaded into the buffers its update reads (``scalars``, from ``capture_scalars``): the
        step's, or the rows the device selects from. Before the step's ``first`` apply of this optimizer, the
        copy of the device's count is queued, after the earlier replays' work (the last apply counted)."""
        if selected and first:
            ordinal = device_util.physical_ordinal(plan.copies[0][0].device)
            self._window.record(ordinal, scope.streams[ordinal].ptr)
        self._prepare_step(plan, selected)
        plan.upload_scalars(scalars, scope)

    def _step_state(self, step: int, dtypes) -> None:
        """Hook: state shared by every variable of a step (Nadam's momentum-schedule product)."""

    def _coefficients(self, t, lr, step):
        """The scalars of ``self._rule`` for dtype ``t`` (a NumPy scalar type) at ``step``."""
        raise NotImplementedError(f"{type(self).__name__} must implement _coefficients")

    def __repr__(self) -> str:
        return (f"<{type(self).__name__} name={self.name!r} learning_rate={self.learning_rate!r} "
                f"gradient_aggregation={self.gradient_aggregation!r}>")


def _scope_error(var, copies: int, other, other_copies: int) -> ValueError:
    """The error of a step over variables made in different strategies' scopes (Keras: "Trying to create
    optimizer slot variable under the scope for tf.distribute.Strategy ..., which is different from the scope
    used for the original variable")."""
    against = (f"variable {other.name!r} has {other_copies}" if other is not None
               else f"the optimizer's strategy has {other_copies} local replicas")
    return ValueError(f"variable {var.name!r} has {copies} copies but {against}: the variables were created "
                      "under the scope of a different strategy (or of none); create every variable, and the "
                      "optimizer, inside the same strategy.scope()")


class _Plan:
    """What a step needs per device for one list of variables, computed once and reused.

    ``copies[d][k]`` is variable k's copy on local device d, ``slots[d][k]`` its slot
    copies there (in the rule's order); ``decay[k]`` whether it takes weight decay.
    """

    def __init__(self, optimizer: Optimizer, variables: list):
        self.optimizer = optimizer
        self.variables = list(variables)  # keeps the ids of the plan's key alive
        per_var = [v.values if isinstance(v, DistributedVariable) else (v,) for v in variables]
        for v, copies in zip(variables, per_var):
            if len(copies) != len(per_var[0]):
                raise _scope_error(v, len(copies), variables[0], len(per_var[0]))
        self.num_devices = len(per_var[0])
        state = [optimizer._slots[id(v)][1] for v in variables]

        def per_device(names):  # [d][k]: variable k's state `names` (in that order) on device d
            copies = [[s.values if isinstance(s, DistributedVariable) else (s,)
                       for s in (st[n] for n in names if n in st)]  # (Muon: velocity for some variables only)
                      for st in state]
            return [[[c[d] for c in var_copies] for var_copies in copies] for d in range(self.num_devices)]

        self.copies = [[copies[d] for copies in per_var] for d in range(self.num_devices)]
        self.slots = per_device(optimizer._slot_names)  # the rule's slots, in its order
        # Keras' moving averages (use_ema) and gradient accumulators: [d][k], or None
        self.averages = ([[a for (a,) in var] for var in per_device(("average",))]
                         if optimizer.use_ema else None)
        self.accumulators = ([[a for (a,) in var] for var in per_device(("gradient_accumulator",))]
                             if optimizer.gradient_accumulation_steps else None)
        self.decay = [optimizer.weight_decay is not None and optimizer._use_weight_decay(v) for v in variables]
        self.dtypes = [np.dtype(v.dtype) for v in variables]
        self.groups = {}  # dtype -> indices of its variables
        for k, dtype in enumerate(self.dtypes):
            self.groups.setdefault(dtype, []).append(k)
        # Whether each group's indices ascend (a plan may order them otherwise: Muon's), so that one group's
        # gradients are the caller's list as it is.
        self.in_order = True
        self.host = [all(type(c._value) is np.ndarray for c in copies) for copies in self.copies]
        # Per device, every copy the update writes (variables, then slots), for the copy-on-write check.
        self.written = [copies + [s for slots in device_slots for s in slots]
                        + (self.averages[d] if self.averages else [])
                        + (self.accumulators[d] if self.accumulators else [])
                        for d, (copies, device_slots) in enumerate(zip(self.copies, self.slots))]
        # float32/float64 variables all on host, or all on GPUs with the CUDA kernel: each replica
        # packs its gradients into a fusion buffer per dtype (allocated once, on its device), and
        # the fused kernel reads the reduced buffer in place.
        kernel = _host_kernel if all(self.host) else _gpu_kernel() if not any(self.host) else None
        # (A rule of rules.PER_VARIABLE has no fused kernel: it runs variable by variable.)
        self.fused = optimizer._rule not in PER_VARIABLE
        self.packable = (kernel is not None and self.fused
                         and all(dtype in _KERNEL_DTYPES for dtype in self.groups))
        # Host replicas of one process whose all-reduce sums in replica order: no pack and no all-reduce,
        # the update sums the replicas' gradients (see _Summands).
        extended = optimizer._strategy.extended if optimizer._strategy is not None else None
        # One copy of each variable for several local replicas (CentralStorageStrategy): the step is applied
        # once, in the merge (see Optimizer._merged_replica_step).
        # (also one compute device whose variables live elsewhere: a GPU's replica over parameters on the host)
        self.central = extended is not None and (
            self.num_devices != len(extended.worker_devices)
            or getattr(extended, "_plain_variables", True) is False)
        if self.central and not hasattr(extended, "_variables_updated"):  # only central storage keeps one copy
            raise _scope_error(variables[0], self.num_devices, None, len(extended.worker_devices))
        self.sums_replicas = (self.packable and all(self.host) and self.num_devices > 1
                              and optimizer.gradient_aggregation == "sum" and extended is not None
                              and extended._sums_host_replicas_in_order())
        # Whether each replica packs its gradients (see Optimizer.apply_gradients). Central variables: CPU
        # replicas of host variables, or GPU replicas (the native pack on each; one reduced buffer per dtype
        # then goes to the variables' device, see Optimizer._central_step).
        replicas = tuple(extended.worker_devices) if extended is not None else ()
        self.packs = self.packable and (not self.central or all(self.host) and device_util.all_cpu(replicas)
                                        or device_util.all_gpu(replicas) and _gpu_kernel() is not None)
        # The devices of the fusion buffers, by pack slot: the replicas' where they pack for central variables,
        # then the variables' GPU (its update packs gradients that come unpacked); else each copy's device.
        self.pack_devices = [copies[0].device for copies in self.copies]
        self.own_pack = list(range(self.num_devices))  # per copy device: its pack slot
        if self.central and self.packs:
            self.pack_devices, self.own_pack = list(replicas), [len(replicas)]
            if not self.host[0]:
                self.pack_devices.append(self.copies[0][0].device)
        self.fusion_buffers = [[device_util.empty(sum(self.copies[0][k]._value.size for k in indices), dtype,
                                                  device)
                                for dtype, indices in self.groups.items()]
                               for device in self.pack_devices] if self.packable else None
        self.gpu_tables = [None] * self.num_devices  # per device: one FusedUpdateTable per dtype
        # per device: the tables of its gradient accumulators (_accumulate_packed), and when they were made
        self.accumulator_tables = [None] * self.num_devices
        self.accumulator_tables_made_at = [None] * self.num_devices
        # per device: the native copies of its accumulators into its fusion buffers and of zeros into them
        # (accumulated_packed, _reset_accumulators), the sources they read, and when they were made
        self.accumulator_packs = [None] * self.num_devices
        self.accumulator_packs_made_at = [None] * self.num_devices
        # per pack slot: (staged dtypes, the GradientPack of its eager steps)
        self.gpu_packs = [None] * len(self.pack_devices)
        self.staging = {}  # (pack slot, id(fusion buffer), dtype) -> a buffer the pack fills with gradients of dtype
        self.source_dtypes = {}  # staged dtypes (pack) -> per variable, the dtype its gradient is copied in
        # (device, dtype, "gradients" | "squares") -> a buffer of a sparse step (sparse_targets, _pack_squares)
        self.sparse_buffers = {}
        self.sparse_clean = {}  # device -> whether its host sparse buffers are all zeros (sparse_targets)
        self.sparse_named = {}  # device -> the views and indices its last sparse_targets wrote (clear_sparse)
        weakref.finalize(self, _retire_tables, self.gpu_tables)
        weakref.finalize(self, _retire_tables, self.accumulator_tables)
        weakref.finalize(self, _retire_tables, self.accumulator_packs)
        weakref.finalize(self, _retire_tables, self.gpu_packs)
        self.tables_made_at = [None] * self.num_devices  # values.buffers_replaced when they were made
        self.rule = optimizer._rule
        # Keras applies a variable's constraint after its update: (index, constraint) of those that have one.
        self.constraints = [(k, v.constraint) for k, v in enumerate(variables)
                            if getattr(v, "constraint", None) is not None]
        self.coefficients = {}
        self.decay_factors = {}
        self.ema_coefficients = {}  # dtype -> (momentum, 1 - momentum) of this step's moving average
        self.ema_overwrite = False  # this step ends by overwriting the variables with their averages
        iterations = optimizer._iterations
        self.iterations = iterations.values if isinstance(iterations, DistributedVariable) else (iterations,)
        self.next_step = None
        # (lower, {dtype: every row's scalars, row after row}) when the device selects the step's scalars
        self.rows = None

    def prepare(self, step: int) -> None:
        """The step's scalars for every dtype (once per step, not per variable or device)."""
        opt = self.optimizer
        # The learning rate follows the real step; the rules (and the moving average) count updates
        # (Keras' `iterations`, floor-divided under gradient accumulation).
        lr = opt.learning_rate_at(step)
        rule_step = opt._rule_step(step)
        opt._step_state(rule_step, self.dtypes)
        self.next_step = step + 1
        self.rows = None
        self.coefficients.clear()
        self.decay_factors.clear()
        self.ema_coefficients.clear()
        for dtype in set(self.dtypes):
            t = dtype.type
            # Keras keeps the learning rate in a float32 variable and casts it to the variable's dtype.
            lr_t = t(np.float32(lr))
            self.coefficients[dtype] = opt._coefficients(t, lr_t, rule_step)
            if opt.weight_decay is not None:
                self.decay_factors[dtype] = (t(np.float32(opt.weight_decay)), lr_t)  # tf.cast of a float
            if opt.use_ema:
                # Keras: cast(iterations != 0, dtype) * ema_momentum, and 1 - that, in the variable's dtype.
                momentum = t(rule_step != 0) * t(opt.ema_momentum)
                self.ema_coefficients[dtype] = (momentum, t(1) - momentum)
        frequency = opt.ema_overwrite_frequency
        self.ema_overwrite = bool(opt.use_ema and frequency and (rule_step + 1) % frequency == 0)

    def prepare_rows(self, lower: int, upper: int) -> None:
        """The scalars of every step from ``lower`` to ``upper`` (one row each, per dtype), for a device that
        selects the row of its own count; the plan's step is ``upper`` (the count it keeps)."""
        for d in range(self.num_devices):  # (made here, once, not by the replica threads that apply at once)
            self._status_pointer(d)
        rows = {dtype: [] for dtype in self.groups}
        for step in range(lower, upper + 1):
            self.prepare(step)
            for dtype, values in rows.items():
                values.extend(map(float, self._scalars(dtype)))
        self.rows = (lower, rows)

    def host_grads(self, grads: list) -> list:
        """``grads`` as the host kernel reads them: C-contiguous NumPy arrays of their variables' dtypes (the
        list itself where every one is already, checked by C loops: no Python per gradient)."""
        if self.reads_as_they_are(grads, np.ndarray):
            return grads
        return list(map(_host_grad, grads, self.dtypes))

    def reads_as_they_are(self, grads: list, array_type) -> bool:
        """Whether every gradient is what the kernels read: an ``array_type`` array (the exact type) of its
        variable's dtype, C-contiguous. Checked by C loops over the list (map of C functions), so a step whose
        gradients need nothing costs no Python per gradient; any other takes the per-gradient conversion."""
        try:
            return (all(map(operator.is_, map(type, grads), itertools.repeat(array_type)))
                    and list(map(_DTYPE, grads)) == self.dtypes and all(map(_C_CONTIGUOUS, grads)))
        except AttributeError:
            return False

    def on_variables_device(self, arrays: list) -> list:
        """A replica's gradients, or its fusion buffers (one per dtype), on the variables' device for the update
        of variables kept once: a copy each (to the host, or between GPUs), none where they are there already."""
        device = self.copies[0][0].device
        with device_util.cross_replica_gpu_scope(device):
            return [SquaredGradient(*(device_util.place(x, device) for x in a)) if type(a) is SquaredGradient
                    else device_util.place(a, device) for a in arrays]

    def given_dtypes(self, grads: list) -> tuple | None:
        """Per dtype group, the one dtype of its gradients, for :meth:`pack`'s ``given``; None where a group's
        gradients differ in dtype or one is not dense."""
        if IndexedSlices in map(type, grads) or SquaredGradient in map(type, grads):
            return None
        dtypes = _dtypes_of(grads)
        given = tuple(_one_dtype([dtypes[k] for k in indices]) for indices in self.groups.values())
        return None if any(g is None for g in given) else given  # (not `None in`: a dtype == None is float64's)

    def pack(self, slot: int, grads: list, given: tuple | None = None) -> list:
        """``grads`` copied into pack slot ``slot``'s fusion buffers (``pack_devices[slot]``), one per dtype
        (converted to it). ``given`` (:meth:`given_dtypes`): the gradients' dtypes kept, a group of another
        dtype than its variables' packed into a staging buffer of its own dtype, returned in place of the
        fusion buffer (a loss-scaled step reduces gradients in their dtype: float16 moves half the bytes)."""
        buffers = self.fusion_buffers[slot]
        if given is not None:
            buffers = [b if g == dtype else self._staging(slot, b, g)
                       for b, g, dtype in zip(buffers, given, self.groups)]
        if type(buffers[0]) is np.ndarray:
            for buffer, indices in zip(buffers, self.groups.values()):
                np.concatenate([grads[k] for k in indices], axis=None, out=buffer)
            return buffers
        # On a GPU, one launch of the native multi-tensor copy over a table made once: CuPy's
        # concatenate of many arrays uploads a pointer table from pageable memory on every call, which
        # CuPy refuses while a stream is capturing (md.function).
        cupy = _gpu.cupy_module()
        ordinal = device_util.physical_ordinal(self.pack_devices[slot])
        # A group whose gradients all have another dtype (mixed precision: float16 gradients of float32
        # variables) is copied as such into a staging buffer and converted by one kernel over the whole
        # buffer, not one per gradient.
        dtypes = _dtypes_of(grads)
        staged = given or tuple(_one_dtype([dtypes[k] for k in indices]) for indices in self.groups.values())
        staged = tuple(None if s == dtype else s for s, dtype in zip(staged, self.groups))
        if dtypes == self._source_dtypes(staged) and \
                all(map(operator.is_, map(type, grads), itertools.repeat(cupy.ndarray))) and \
                all(map(_C_CONTIGUOUS, grads)) and all(map(operator.eq, map(_DEVICE_ID, grads),
                                                           itertools.repeat(ordinal))):
            # (the common step: every gradient as the pack copies it, checked by C loops, no Python per gradient)
            sources = grads if len(self.groups) == 1 and self.in_order else \
                [grads[k] for indices in self.groups.values() for k in indices]
        else:
            sources = [_packable(cupy, grads[k], staged_dtype or dtype, ordinal)
                       for (dtype, indices), staged_dtype in zip(self.groups.items(), staged) for k in indices]
        src = list(map(_POINTER, sources))
        stream = cupy.cuda.get_current_stream().ptr
        scope = _gpu.step_scope()
        if scope is not None and scope.capturing:
            pack = self._make_pack(slot, ordinal, staged)  # the graph's own: its table is never rewritten
            scope.captured.setdefault("gradient packs", []).append([pack])
            weakref.finalize(scope, _retire_tables, [pack])
            pack.copy_captured(src, stream)
        else:
            if self.gpu_packs[slot] is None or self.gpu_packs[slot][0] != staged:
                self.gpu_packs[slot] = (staged, self._make_pack(slot, ordinal, staged))
            self.gpu_packs[slot][1].copy(src, stream)
        if given is None:
            for buffer, staged_dtype in zip(buffers, staged):
                if staged_dtype is not None:
                    buffer[...] = self._staging(slot, buffer, staged_dtype)
        return buffers

    def _source_dtypes(self, staged: tuple) -> list:
        """Per variable, the dtype the pack copies its gradient in: its staged group's (``staged``), else its own."""
        expected = self.source_dtypes.get(staged)
        if expected is None:
            expected = list(self.dtypes)
            for indices, staged_dtype in zip(self.groups.values(), staged):
                for k in indices:
                    expected[k] = staged_dtype or expected[k]
            self.source_dtypes[staged] = expected
        return expected

    def in_variables_dtypes(self, device: int, packed: list) -> list:
        """Packed buffers in their variables' dtypes: one of another dtype (:meth:`pack`'s ``given``, reduced as
        such) converted into device ``device``'s fusion buffer of the group, one kernel each."""
        slot = self.own_pack[device]
        return [buffer if buffer.dtype == dtype else _converted(self.fusion_buffers[slot][j], buffer)
                for j, (buffer, dtype) in enumerate(zip(packed, self.groups))]

    def _staging(self, slot: int, buffer, dtype):
        """Pack slot ``slot``'s staging buffer of ``dtype`` for fusion buffer ``buffer``. Made once, for every
        slot at once (the group's buffer of each), by the eager step that precedes a capture: that step may pack
        on one slot only (variables kept once: the variables' own, before the replicas pack from the next step
        on, which may be the captured one), and a capture cannot make them (an upload)."""
        key = (slot, id(buffer), np.dtype(dtype))
        stage = self.staging.get(key)
        if stage is None:
            # Replica threads pack at once, and the first to get here makes every slot's buffer: allocated only
            # (device_util.empty), as an upload queued on this replica's stream would be unordered with another
            # replica's pack into its buffer on its own stream, and could land over the gradients; and under a
            # lock, as a buffer made twice would leave the loser's pack table pointing at freed memory.
            with _staging_lock:
                group = next(j for j, b in enumerate(self.fusion_buffers[slot]) if b is buffer)
                for other, (buffers, device) in enumerate(zip(self.fusion_buffers, self.pack_devices)):
                    other_key = (other, id(buffers[group]), np.dtype(dtype))
                    if other_key not in self.staging:
                        self.staging[other_key] = device_util.empty(buffer.size, dtype, device)
                stage = self.staging[key]
        return stage

    def _make_pack(self, slot: int, ordinal: int, staged: tuple):
        """The native multi-tensor copy of pack slot ``slot``'s gradients into its fusion buffers, or for a
        group with a ``staged`` dtype into its staging buffer (table order: the groups', each group's
        variables back to back)."""
        dst, nbytes = [], []
        for buffer, indices, staged_dtype in zip(self.fusion_buffers[slot], self.groups.values(), staged):
            target = buffer if staged_dtype is None else self._staging(slot, buffer, staged_dtype)
            at = target.data.ptr
            for k in indices:
                size = self.copies[0][k]._value.size * target.itemsize
                dst.append(at)
                nbytes.append(size)
                at += size
        return _gpu_kernel().GradientPack(ordinal, dst, nbytes)

    def apply(self, device: int, grads, step: int, packed=None, update: bool = True, gate=None,
              summands=None) -> None:
        """:meth:`_apply_on` device ``device``; for variables kept once for all replicas (CentralStorageStrategy),
        the strategy then refreshes what its replicas read of them."""
        self._apply_on(device, grads, step, packed, update, gate, summands)
        if self.central:
            self.optimizer._strategy.extended._variables_updated(self, update)

    def _apply_on(self, device: int, grads, step: int, packed=None, update: bool = True, gate=None,
                  summands=None) -> None:
        """Weight decay and the rule on every variable and slot of local device ``device``, in place;
        then Keras' moving average (``use_ema``), the constraints and the step count.
        ``update=False`` (gradient accumulation, a step that only accumulates): ``grads`` are added
        to the device's accumulators instead of applied.

        ``grads``: one gradient per variable, or None with ``packed``: one reduced
        fusion buffer per dtype, or with ``summands`` (host copies): every replica's gradients
        (``_Summands.grads``), summed by the kernel. float32 and float64 go through the fused kernel, one
        call per dtype: on host csrc/host/fused_update.cc, on a GPU one launch of
        csrc/cuda/fused_update.cu over a table made once. Anything else (float16,
        bfloat16) goes through the same rule element-wise, variable by variable.

        ``gate`` (a :class:`LossScaleGate`, GPU copies of a ``packable`` plan only): a loss-scaled step,
        decided on the device (md.mixed_precision.LossScaleOptimizer's, no host sync).

        A gradient may be a rules.SquaredGradient (an IndexedSlices' of a squaring rule, densified with its
        rows' squares): the kernel reads those squares in place of ``g * g``.
        """
        if self.host[device]:
            if not update:
                self._accumulate(device, grads, packed)
            else:
                self._apply_host(device, grads, packed, summands)
                self._reset_accumulators(device)
            self._finish(device)
            self.iterations[device]._writable_buffer().fill(self.next_step)
            return
        # GPU copies: on their GPU's legacy default stream, ordered after every replica
        # stream's work (the gradients, the all-reduce) and before the next step's.
        name = self.copies[device][0].device
        with device_util.device_scope(name), device_util.cross_replica_gpu_scope(name):
            scope = _gpu.step_scope()
            if scope is not None and scope.capturing:
                # md.function: the update reads the step's scalars from device buffers that a hook
                # refreshes before each replay, and the step is counted on the device.
                if self.packable:
                    self._apply_gpu_captured(device, grads, packed, scope, gate)
                else:
                    self._apply_each(device, grads, self.groups)
                self._constrain(device)
                if gate is not None:
                    self._count_step(device, gate)
                else:
                    self.iterations[device]._writable_buffer()[...] += 1
                return
            if not update:
                self._accumulate(device, grads, packed)
            elif self.packable:
                self._apply_gpu(device, grads, packed, gate)
            else:
                self._apply_each(device, grads, self.groups)
            if update:
                self._reset_accumulators(device)
            self._finish(device)
            if gate is not None:
                self._count_step(device, gate)
            else:
                self.iterations[device]._writable_buffer().fill(self.next_step)  # one kernel, no upload

    def accumulated(self, device: int, k: int, g):
        """Keras' gradient of an update step under gradient accumulation: ``(g + accumulator) / steps``
        (a new array, in the variable's dtype) with variable k's accumulator on local device ``device``."""
        acc = self.accumulators[device][k]._value
        with device_util.cross_replica_gpu_scope(self.copies[device][0].device):
            if g.dtype != acc.dtype:
                g = g.astype(acc.dtype)
            total = g + acc
            total /= acc.dtype.type(self.optimizer.gradient_accumulation_steps)
        return total

    def accumulated_and_clipped(self, device: int, grads: list) -> list:
        """A replica's gradients of an update step (in merge_call): accumulated, then clipped (Keras' order),
        on its device's merge stream (ordered after the accumulations and the replica's own work)."""
        with device_util.cross_replica_gpu_scope(self.copies[device][0].device):
            return self.optimizer._clip([self.accumulated(device, k, g) for k, g in enumerate(grads)])

    def _accumulate(self, device: int, grads, packed=None) -> None:
        """A step that only accumulates: ``accumulator += g``, each replica its own gradients (as Keras does
        under a strategy: the accumulators are summed across replicas only when applied). ``packed`` (in place
        of ``grads``: one reduced fusion buffer per dtype, variables kept once): one fused call per dtype.
        A packable plan's ``grads`` take the same fused call: on host the kernel reads them where they are, on a
        GPU they are packed first (one launch)."""
        self._writable(device)
        if packed is None and self.packable:
            if self.host[device]:
                grads = self.host_grads(grads)
                packed = [grads] if len(self.groups) == 1 and self.in_order else [[grads[k] for k in indices]
                                                                 for indices in self.groups.values()]
            else:
                packed = self.pack(self.own_pack[device], _plains(grads))
        if packed is not None:
            self._accumulate_packed(device, packed)
            return
        for acc, g in zip(self.accumulators[device], grads):
            buffer = acc._value
            buffer += g if g.dtype == buffer.dtype else g.astype(buffer.dtype)

    def _accumulate_packed(self, device: int, packed) -> None:
        """``accumulator += g`` for every variable from the packed gradients, one fused update per dtype over the
        accumulators: the SGD rule at learning rate -1, whose ``w - g * -1`` is ``w + g`` exactly (the product
        only flips the sign), so the same bits as the element-wise sum. On host the host kernel, on a GPU one
        launch over a table of the accumulators (made once, again only after a copy-on-write)."""
        accumulators = list(map(_VALUE, self.accumulators[device]))
        if self.host[device]:
            for buffer, indices in zip(packed, self.groups.values()):
                _host_kernel(SGD, [accumulators[k] for k in indices], buffer, [[] for _ in indices],
                             [False] * len(indices), [-1.0], 0.0, 0.0)
            return
        if self.accumulator_tables_made_at[device] != values.buffers_replaced:
            self.accumulator_tables[device] = self._make_tables(device, accumulators)
            self.accumulator_tables_made_at[device] = values.buffers_replaced
        stream = array_module(packed[0]).cuda.get_current_stream().ptr
        for table, buffer, dtype in zip(self.accumulator_tables[device], packed, self.groups):
            table.apply(SGD, _gpu_grad(buffer, dtype, table.total_count).data.ptr, [-1.0], 0.0, 0.0, stream)

    def pack_on_device(self, device: int, grads: list) -> list:
        """A replica's gradients packed into local device ``device``'s fusion buffers, on its merge stream."""
        with device_util.cross_replica_gpu_scope(self.copies[device][0].device):
            return self.pack(self.own_pack[device], _plains(grads))

    def accumulated_packed(self, device: int, packed: list) -> list:
        """Keras' gradients of an update step under gradient accumulation, ``(g + accumulator) / steps``, for the
        packed ``g`` (one buffer per dtype in the fusion layout, of the variables' dtypes): the fused accumulate
        adds ``g`` to the accumulators (``accumulator + g``: the bits of ``g + accumulator``), their sums are
        copied back into packed buffers and divided there, one operation per dtype (on a GPU: one launch of the
        native multi-tensor copy into the device's fusion buffers, then the divisions). Returns those buffers
        (on host ``packed`` itself, overwritten). The accumulators are zeroed after the update
        (:meth:`_reset_accumulators`)."""
        with device_util.cross_replica_gpu_scope(self.copies[device][0].device):
            self._writable(device)
            self._accumulate_packed(device, packed)
            steps = self.optimizer.gradient_accumulation_steps
            if self.host[device]:
                accumulators = list(map(_VALUE, self.accumulators[device]))
                for buffer, indices in zip(packed, self.groups.values()):
                    np.concatenate([accumulators[k] for k in indices], axis=None, out=buffer)
                out = packed
            else:
                copy_back, sources, _ = self._accumulator_packs(device)
                copy_back.copy(sources, array_module(packed[0]).cuda.get_current_stream().ptr)
                out = self.fusion_buffers[self.own_pack[device]]
            for buffer in out:
                buffer /= buffer.dtype.type(steps)
        return out

    def _accumulator_packs(self, device: int) -> tuple:
        """Device ``device``'s native copies of its accumulators: ``(copy into its fusion buffers, the
        accumulators' pointers, copy of zeros into them)``, made once (again only after a copy-on-write). The
        zeros' copy reads one buffer of zeros as large as the largest accumulator, for every one of them."""
        if self.accumulator_packs_made_at[device] != values.buffers_replaced:
            accumulators = [self.accumulators[device][k]._value for indices in self.groups.values() for k in indices]
            ordinal = device_util.physical_ordinal(self.copies[device][0].device)
            copy_back = self._make_pack(self.own_pack[device], ordinal, (None,) * len(self.groups))
            nbytes = [a.nbytes for a in accumulators]
            zeros = device_util.place(np.zeros(max(nbytes, default=0), np.uint8), self.copies[device][0].device)
            # (uploaded on this thread's stream, read by later steps' copies on theirs: waited for once, here)
            device_util.written_event(_gpu.cupy_module(), zeros).synchronize()
            zeroing = _gpu_kernel().GradientPack(ordinal, [a.data.ptr for a in accumulators], nbytes)
            # (the zeros stay referenced by the sources' tuple: the copy reads them on every step)
            self.accumulator_packs[device] = (copy_back, [a.data.ptr for a in accumulators],
                                              (zeroing, [zeros.data.ptr] * len(accumulators), zeros))
            self.accumulator_packs_made_at[device] = values.buffers_replaced
        return self.accumulator_packs[device]

    def unpacked(self, packed) -> list:
        """Per variable, a view of its part of ``packed`` (one buffer per dtype, the fusion layout)."""
        views = [None] * len(self.variables)
        for buffer, indices in zip(packed, self.groups.values()):
            at = 0
            for k in indices:
                value = self.copies[0][k]._value
                views[k] = buffer[at:at + value.size].reshape(value.shape)
                at += value.size
        return views

    def _reset_accumulators(self, device: int) -> None:
        """The accumulators zeroed after an update: a packable plan's with no Python per variable (on host
        each filled from C, on a GPU one launch of the native copy of zeros into them)."""
        if self.accumulators is None:
            return
        if not self.packable:
            for acc in self.accumulators[device]:
                acc._writable_buffer().fill(0)
            return
        self._writable(device)
        if self.host[device]:
            collections.deque(map(np.ndarray.fill, map(_VALUE, self.accumulators[device]), itertools.repeat(0)), 0)
            return
        zeroing, zeros, _ = self._accumulator_packs(device)[2]
        zeroing.copy(zeros, _gpu.cupy_module().cuda.get_current_stream().ptr)

    def _finish(self, device: int) -> None:
        """After the update (or the accumulation): the moving average, then the constraints (Keras' order)."""
        if self.averages is not None:
            self._moving_average(device)
        self._constrain(device)

    def _moving_average(self, device: int) -> None:
        """Keras' ``average = momentum * average + (1 - momentum) * w`` for every variable of the device:
        on host one fused kernel call per dtype (rules.EMA: the averages as weights, the variables as
        gradients), else element-wise per variable; then, every ``ema_overwrite_frequency`` updates, each
        variable takes its average's value."""
        self._writable(device)
        weights = list(map(_VALUE, self.copies[device]))
        averages = list(map(_VALUE, self.averages[device]))
        for dtype, indices in self.groups.items():
            c = self.ema_coefficients[dtype]
            if self.host[device] and dtype in _KERNEL_DTYPES:
                _host_kernel(EMA, [averages[k] for k in indices], [weights[k] for k in indices],
                             [[] for _ in indices], [False] * len(indices), [float(x) for x in c], 0.0, 0.0)
            else:
                for k in indices:
                    ema(averages[k], weights[k], (), c)
        if self.ema_overwrite:
            for w, average in zip(weights, averages):
                w[...] = average

    def _constrain(self, device: int) -> None:
        """``w = constraint(w)`` for each constrained variable's copy on ``device``, in place (Keras' order)."""
        for k, constraint in self.constraints:
            weights = self.copies[device][k]._writable_buffer()
            weights[...] = constraint(weights)

    def _scalars(self, dtype) -> list:
        """The step's scalars of ``dtype``: the rule's coefficients, then weight decay's (rate, lr)."""
        return list(self.coefficients[dtype]) + list(self.decay_factors.get(dtype, (0.0, 0.0)))

    def capture_scalars(self, scope, step: int, selected: bool = False) -> dict:
        """For one apply of a captured step: every device's scalars in a device buffer per dtype (from the
        scope's pool of host-written buffers), which the captured update reads through 0-d views. The scalars the
        rules branch on in Python (``rules.HOST_COEFFICIENTS``) stay host values, fixed at capture.
        ``selected``: the device selects them from rows of candidate steps (``prepare_rows``), uploaded into a
        buffer of their own, by a kernel the graph holds.

        Returns them (``{device: {dtype: _CapturedScalars}}``) for the apply's replay hook, and files them as
        ``scope.captured[self]`` for the update of this apply to read. Each apply of the plan in one step has
        buffers of its own: the next apply's files them over this one's only after every replica has updated
        (its merge_call waits for them all)."""
        self.prepare(step)
        cupy = _gpu.cupy_module()
        host_positions = HOST_COEFFICIENTS.get(self.rule, ())
        per_device = {}
        for d in range(self.num_devices):
            ordinal = device_util.physical_ordinal(self.copies[d][0].device)
            per_device[d] = {}
            with cupy.cuda.Device(ordinal), scope.streams[ordinal], cupy.cuda.using_allocator(scope.host_written):
                for dtype in self.groups:
                    host = self._scalars(dtype)
                    buffer = cupy.empty(len(host), dtype)
                    views = [h if i in host_positions else buffer[i] for i, h in enumerate(host)]
                    n = len(self.coefficients[dtype])
                    rows = cupy.empty(len(_step_rows(dtype, 0, host)), np.uint8) if selected else None
                    per_device[d][dtype] = _CapturedScalars(buffer, ordinal, tuple(views[:n]), tuple(views[n:]), rows)
        scope.captured[self] = per_device
        return per_device

    def upload_scalars(self, scalars, scope) -> None:
        """This step's scalars (``prepare`` or ``prepare_rows`` done) copied into one apply's buffers
        (``capture_scalars``'), on the step's streams.

        Each is one asynchronous copy from pageable host memory: CUDA takes the bytes before the call returns
        (the array may go at once) and, for a copy this small (a few hundred bytes at most), without waiting
        for the stream (measured on an H100: the host still runs hundreds of replays ahead), so the replay
        keeps nothing. A pinned staging buffer per copy cost every replay an allocation and an event, kept
        until the copy had run; the first replay after the host waited for the GPU then released all those
        the host had queued ahead, hundreds, while the GPU had nothing to run
        (tests/test_function_replay_cost.py)."""
        for buffers in scalars.values():
            for dtype, captured in buffers.items():
                if captured.rows is not None:
                    lower, rows = self.rows
                    host = np.frombuffer(_step_rows(dtype, lower, rows[dtype], len(self._scalars(dtype))), np.uint8)
                    target = captured.rows
                else:
                    host, target = np.array(self._scalars(dtype), dtype), captured.buffer
                target.data.copy_from_host_async(host.ctypes.data, host.nbytes, scope.streams[captured.ordinal])

    def _writable(self, device: int) -> None:
        """Copy-on-write (values.DeviceVariable._writable_buffer) for every copy of the device, at the cost
        of one C loop when no copy is held elsewhere (the common case)."""
        written = self.written[device]
        buffers = list(map(_VALUE, written))
        # References to each: its copy's attribute, the list, map's argument.
        if max(map(sys.getrefcount, buffers)) > 3:
            del buffers
            for c in written:
                c._writable_buffer()

    def _apply_host(self, device: int, grads, packed, summands=None) -> None:
        # (After the replicas' rendezvous: a gradient of any replica that holds one of these buffers is
        # counted here, and the buffer is replaced before it is written.)
        self._writable(device)
        weights = list(map(_VALUE, self.copies[device]))
        rest = {}
        whole = len(self.groups) == 1 and self.in_order  # (one dtype: the lists as they are, no per-group copy)
        ready = None if grads is None or not self.packable else self.host_grads(_plains(grads))
        for j, (dtype, indices) in enumerate(self.groups.items()):
            if dtype not in _KERNEL_DTYPES or not self.fused:
                rest[dtype] = indices
                continue
            weight_decay, lr = self.decay_factors.get(dtype, (0.0, 0.0))
            if packed is not None:
                group_grads = packed[j]
            elif summands is not None:
                group_grads = summands if whole else tuple([replica[k] for k in indices] for replica in summands)
            elif ready is not None:
                group_grads = ready if whole else [ready[k] for k in indices]
            else:
                group_grads = [_host_grad(_plain(grads[k]), dtype) for k in indices]
            # (Squares only where IndexedSlices gave them: a dense step's call is as it always was.)
            squares = () if grads is None or SquaredGradient not in map(type, grads) else \
                ([_host_grad(grads[k].squares, dtype) if type(grads[k]) is SquaredGradient else None
                  for k in indices],)
            _host_kernel(self.rule, [weights[k] for k in indices], group_grads,
                         [list(map(_VALUE, self.slots[device][k])) for k in indices],
                         [self.decay[k] for k in indices], [float(c) for c in self.coefficients[dtype]],
                         float(weight_decay), float(lr), *squares)
        if rest:
            self._apply_each(device, grads, rest)

    def _step_inputs(self, device: int, grads, packed) -> tuple:
        """A GPU step's gradients packed in the variables' dtypes (``packed`` when the all-reduce packed
        them), IndexedSlices' squares, and the current stream the update launches on."""
        squares = self._pack_squares(device, grads)
        if packed is None:
            packed = self.pack(self.own_pack[device], _plains(grads))
        else:
            packed = self.in_variables_dtypes(device, packed)
        return packed, squares, array_module(packed[0]).cuda.get_current_stream().ptr

    def _apply_gpu(self, device: int, grads, packed, gate=None) -> None:
        """One launch per dtype: the device's table (made once, again only after a copy-on-write)."""
        self._writable(device)
        _retired_tables.clear()
        if self.tables_made_at[device] != values.buffers_replaced:
            self.gpu_tables[device] = self._make_tables(device)
            self.tables_made_at[device] = values.buffers_replaced
        packed, squares, stream = self._step_inputs(device, grads, packed)
        cupy = array_module(packed[0])
        grads = self._checked_grads(self.gpu_tables[device], packed, stream, gate)
        for table, grad, dtype, square in zip(self.gpu_tables[device], grads, self.groups, squares):
            if self.rows is not None:
                # The device picks the row of its own count into a buffer of this stream (its pool
                # reuses the block only for this stream's later work, after the update read it).
                lower, rows = self.rows
                width = len(self._scalars(dtype))
                scalars = cupy.empty(width, dtype)
                _gpu_kernel().select_step_row(table.device, dtype_code(dtype), self._iterations_pointer(device),
                                              lower, width, rows[dtype], scalars.data.ptr,
                                              self._status_pointer(device), stream)
                table.apply_from_device(self.rule, grad, scalars.data.ptr, len(self.coefficients[dtype]), stream,
                                        *_gate_pointers(gate), squares=square)
                continue
            weight_decay, lr = self.decay_factors.get(dtype, (0.0, 0.0))
            table.apply(self.rule, grad, [float(c) for c in self.coefficients[dtype]], float(weight_decay), float(lr),
                        stream, *_gate_pointers(gate), squares=square)
        if self.rows is not None and device == 0:
            self.optimizer._window.record(table.device, stream)

    def _iterations_pointer(self, device: int) -> int:
        return self.iterations[device]._writable_buffer().data.ptr

    def _status_pointer(self, device: int) -> int:
        return self.optimizer._window.status(device_util.physical_ordinal(self.copies[device][0].device)).data.ptr

    def _apply_gpu_captured(self, device: int, grads, packed, scope, gate=None) -> None:
        """``_apply_gpu`` recorded into the step's graph: tables of the capture's own (kept by the scope as
        long as the graph), each launch reading its scalars from the capture's buffer of its dtype."""
        for c in self.written[device]:
            c._writable_buffer()  # the graph writes these buffers: md.function checks they stay
        packed, squares, stream = self._step_inputs(device, grads, packed)
        tables = self._make_tables(device)
        scope.captured.setdefault("fused update tables", []).append(tables)
        weakref.finalize(scope, _retire_tables, tables)
        grads = self._checked_grads(tables, packed, stream, gate)
        for table, grad, dtype, square in zip(tables, grads, self.groups, squares):
            captured = scope.captured[self][device][dtype]
            if captured.rows is not None:  # the graph's kernel picks the row of the device's count
                _gpu_kernel().select_step_row_from_device(
                    table.device, dtype_code(dtype), self._iterations_pointer(device), captured.rows.data.ptr,
                    captured.buffer.data.ptr, self._status_pointer(device), stream)
            table.apply_captured(self.rule, grad, captured.buffer.data.ptr, len(captured.coefficients), stream,
                                 *_gate_pointers(gate), squares=square)

    def sparse_targets(self, device: int, grads: list, squares: bool):
        """Where a replica step densifies its IndexedSlices: per gradient, None (not IndexedSlices) or
        ``(gradient, squares or None)``, views in the variable's place of device ``device``'s buffers laid out
        as the fusion buffer (made once); None for a plan that densifies into new arrays (central variables,
        dtypes the kernel does not take). On host, sparse buffers kept zero (one per dtype for the gradients,
        one for their squares): after the update :meth:`clear_sparse` zeroes only the rows the slices named,
        so a step costs O(rows named) beyond the dense one, not two new table-sized zero arrays (whose pages
        fault in when the kernel first reads them). On a GPU, the fusion buffer itself (the pack then copies
        the gradient onto itself) and the squares buffer :meth:`_pack_squares` hands the kernel: the GPU
        densify writes them whole, so nothing is allocated, zeroed after or copied again."""
        if not self.packable or self.central:
            return None
        host = self.host[device]
        kinds = ("gradients", "squares") if squares else ("gradients",)  # (a plan's rule squares or never does)
        if host and not self.sparse_clean.get(device, False):  # (made now, or a step that failed before clear_sparse)
            for dtype in self.groups:
                for kind in kinds:
                    self._sparse_buffer(device, dtype, kind).fill(0)
        targets, named = [None] * len(grads), []
        for (dtype, indices), fusion in zip(self.groups.items(), self.fusion_buffers[device]):
            buffers = [self._sparse_buffer(device, dtype, kind) if host or kind == "squares" else fusion
                       for kind in kinds]
            at = 0
            for k in indices:
                value = self.copies[device][k]._value
                if type(grads[k]) is IndexedSlices:
                    views = tuple(b[at:at + value.size].reshape(value.shape) for b in buffers)
                    targets[k] = (views[0], views[1] if squares else None)
                    named.append((views, grads[k].indices))
                at += value.size
        if host:
            self.sparse_clean[device] = False
            self.sparse_named[device] = named
        return targets

    def clear_sparse(self, device: int) -> None:
        """After a step that densified into :meth:`sparse_targets`' views: the rows it wrote zeroed again."""
        named = self.sparse_named.pop(device, None)
        if named is None:
            return
        for views, indices in named:
            rows = indices[indices >= 0]  # (an index past the rows raised before anything was written)
            for view in views:
                view[rows] = 0
        self.sparse_clean[device] = True

    def _pack_squares(self, device: int, grads) -> list:
        """Per dtype, a pointer to the squares the kernel reads in place of ``g * g`` (0: none, it squares):
        with a rules.SquaredGradient among ``grads``, a buffer laid out as the fusion buffer (made once per
        device and dtype), holding each SquaredGradient's squares and each dense gradient's ``g * g`` (in the
        variable's dtype, the kernel's product) in its variable's place."""
        if grads is None or SquaredGradient not in map(type, grads):
            return [0] * len(self.groups)
        cupy = _gpu.cupy_module()
        ordinal = device_util.physical_ordinal(self.copies[device][0].device)
        pointers = []
        for dtype, indices in self.groups.items():
            if not any(type(grads[k]) is SquaredGradient for k in indices):
                pointers.append(0)
                continue
            buffer = self._squares_buffer(device, dtype)
            at = 0
            for k in indices:
                g = grads[k]
                view = buffer[at:at + self.copies[device][k]._value.size].reshape(self.copies[device][k]._value.shape)
                at += view.size
                if type(g) is SquaredGradient:
                    if g.squares.data.ptr != view.data.ptr:  # (else densified in place: sparse_targets)
                        view[...] = g.squares
                else:  # (as the pack takes it: on this GPU, in the variable's dtype)
                    g = _packable(cupy, g, dtype, ordinal).reshape(view.shape)
                    cupy.multiply(g, g, out=view)
            pointers.append(buffer.data.ptr)
        return pointers

    def _squares_buffer(self, device: int, dtype):
        """Device ``device``'s squares buffer of ``dtype`` (made once, by the first sparse step:
        an eager one precedes a capture)."""
        return self._sparse_buffer(device, dtype, "squares")

    def _sparse_buffer(self, device: int, dtype, kind: str):
        """Device ``device``'s buffer ``kind`` of ``dtype``, laid out as its fusion buffer (made once)."""
        key = (device, dtype, kind)
        buffer = self.sparse_buffers.get(key)
        if buffer is None:
            size = sum(self.copies[device][k]._value.size for k in self.groups[dtype])
            buffer = self.sparse_buffers[key] = device_util.empty(size, dtype, self.copies[device][0].device)
        return buffer

    def _checked_grads(self, tables, packed, stream, gate) -> list:
        """The packed gradients' pointers; for a dynamic loss-scaled step, each first checked for inf and nan
        into the gate's flag (every dtype's before any update reads the flag)."""
        grads = [_gpu_grad(buffer, dtype, table.total_count).data.ptr
                 for table, buffer, dtype in zip(tables, packed, self.groups)]
        if gate is not None and gate.dynamic:
            for table, grad in zip(tables, grads):
                table.check_finite(grad, gate.nonfinite, stream)
        return grads

    def _count_step(self, device: int, gate) -> None:
        """A loss-scaled step's end on device ``device`` (rules::loss_scale_step, one launch): ``iterations``
        +1 only when the step was applied, and the loss scale and its counter updated."""
        iterations = self.iterations[device]._writable_buffer()
        ordinal = device_util.physical_ordinal(self.copies[device][0].device)
        stream = array_module(iterations).cuda.get_current_stream().ptr
        _gpu_kernel().loss_scale_step(ordinal, gate.nonfinite, gate.scale, gate.counter, iterations.data.ptr,
                                      gate.growth_steps, gate.dynamic, stream)

    def _make_tables(self, device: int, accumulators=None) -> list:
        """Device ``device``'s fused update tables, one per dtype: of its variables and their slots, or of
        ``accumulators`` (their arrays, no slots, no weight decay: _accumulate_packed's)."""
        module = _gpu_kernel()
        ordinal = device_util.physical_ordinal(self.copies[device][0].device)
        tables = []
        for dtype, indices in self.groups.items():
            shapes = None
            if accumulators is None:
                weights = [self.copies[device][k]._value for k in indices]
                slots = [[s._value for s in self.slots[device][k]] for k in indices]
                decay = [self.decay[k] for k in indices]
                if self.rule == ADAFACTOR:  # (its moments reduce over the last two axes: the table needs shapes)
                    shapes = [w.shape for w in weights]
            else:
                weights, slots, decay = [accumulators[k] for k in indices], [[]] * len(indices), [False] * len(indices)
            tables.append(module.FusedUpdateTable(
                ordinal, dtype_code(dtype), [w.data.ptr for w in weights],
                [[s.data.ptr for s in var_slots] for var_slots in slots], [w.size for w in weights], decay, shapes))
        return tables

    def _apply_each(self, device: int, grads, groups: dict) -> None:
        """The rule element-wise, variable by variable (dtypes and arrays no kernel takes)."""
        weights = [c._writable_buffer() for c in self.copies[device]]
        slots = [[s._writable_buffer() for s in slots] for slots in self.slots[device]]
        scope = _gpu.step_scope()
        captured = scope.captured[self][device] if scope is not None and scope.capturing else None
        for dtype, indices in groups.items():
            if captured is None:
                coefficients = self.coefficients[dtype]
                weight_decay, lr = self.decay_factors.get(dtype, (0.0, 0.0))
            else:  # 0-d views of the device buffers each replay's hook refreshes
                coefficients, (weight_decay, lr) = captured[dtype].coefficients, captured[dtype].decay
            for k in indices:
                g = grads[k]
                if type(g) is not SquaredGradient and g.dtype != dtype:  # (a SquaredGradient has the variable's)
                    g = g.astype(dtype)
                if self.decay[k]:
                    apply_weight_decay(weights[k], weight_decay, lr)
                apply_rule(self.rule, weights[k], g, slots[k], coefficients)


_KERNEL_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


class _CapturedScalars(NamedTuple):
    """One dtype's scalars of a captured apply on one device: ``buffer`` (device, the rule's coefficients then
    weight decay's rate and lr), read by the update also through 0-d views (``coefficients``, ``decay``;
    host values where ``rules.HOST_COEFFICIENTS``); ``rows``: the device buffer of the rows the graph's select
    kernel picks from into ``buffer`` (None: each replay's hook uploads ``buffer`` itself)."""

    buffer: object
    ordinal: int
    coefficients: tuple
    decay: tuple
    rows: object


def _step_rows(dtype, lower: int, values: list, width: int | None = None) -> bytes:
    """The rows ``values`` (of ``width`` scalars each; one row without it) as the select kernel's device struct."""
    width = len(values) if width is None else width
    return _gpu_kernel().step_rows(dtype_code(dtype), lower, width, [float(v) for v in values])


class LossScaleGate(NamedTuple):
    """A loss-scaled step's state on one GPU, as device pointers (csrc/cuda/fused_update.h): ``nonfinite``
    an int32 flag the check sets (zero between steps), ``scale`` the float32 loss scale, ``counter`` the int64
    count of good steps; ``dynamic``: check and adjust the scale (else apply every step at a fixed scale)."""

    nonfinite: int
    scale: int
    counter: int
    growth_steps: int
    dynamic: bool


def _gate_pointers(gate) -> tuple:
    """The fused update's ``nonfinite`` and ``scale`` arguments (0: none) for ``gate``."""
    if gate is None:
        return 0, 0
    return gate.nonfinite if gate.dynamic else 0, gate.scale


_VALUE = operator.attrgetter("_value")
_SHAPE = operator.attrgetter("shape")
_DTYPE = operator.attrgetter("dtype")
_C_CONTIGUOUS = operator.attrgetter("flags.c_contiguous")
_DEVICE_ID = operator.attrgetter("data.device_id")
_POINTER = operator.attrgetter("data.ptr")
_NONE_TYPE = type(None)
_host_kernel = _fused_update


# Tables of plans, or of captured steps, collected (by the garbage collector, on any thread) while
# md.function was capturing a step: freeing their device memory then would break the capture, so they
# go at the next eager update.
_retired_tables = []


def _retire_tables(tables: list) -> None:
    step = _gpu._step
    if step is not None and step.capturing and any(tables):
        _retired_tables.append(tables)


def _gpu_kernel():
    """The CUDA engine's extension when it has the fused update kernel, else None."""
    return _gpu.cuda_module_having("FusedUpdateTable")


def _host_grad(g, dtype):
    """``g`` as the kernel takes it: a C-contiguous NumPy array of the variable's dtype."""
    if type(g) is np.ndarray and g.dtype == dtype and g.flags.c_contiguous:
        return g
    return np.ascontiguousarray(g, dtype)


def _one_dtype(dtypes):
    """The dtype of every one of ``dtypes``, or None when they differ (or there are none)."""
    seen = set(map(np.dtype, dtypes))
    return seen.pop() if len(seen) == 1 else None


def _packable(cupy, g, dtype, ordinal: int):
    """Gradient ``g`` as the native pack copies it: a C-contiguous CuPy array of ``dtype`` on GPU ``ordinal``
    (converted as concatenate's ``out=`` would, by a kernel of the current stream where it is not)."""
    if isinstance(g, cupy.ndarray) and g.dtype == dtype and g.flags.c_contiguous and g.data.device_id == ordinal:
        return g
    with cupy.cuda.Device(ordinal):
        return cupy.ascontiguousarray(cupy.array(g, dtype=dtype, copy=False))


def _converted(target, buffer):
    """``buffer``'s values written into ``target`` (of another dtype) by one kernel; returns ``target``."""
    target[...] = buffer
    return target


def _gpu_grad(buffer, dtype, count: int):
    """A reduced fusion buffer as the GPU kernel reads it: contiguous, of the variables' dtype and size."""
    if buffer.dtype != dtype or buffer.size != count or not buffer.flags.c_contiguous:
        raise RuntimeError(f"the reduced gradient buffer has dtype {buffer.dtype}, {buffer.size} elements "
                           f"(contiguous: {buffer.flags.c_contiguous}); the update expects {dtype}, {count}")
    return buffer


class _Summands:
    """Every local replica's gradients (one list per replica, host arrays as the kernel reads them), handed
    by merge_call to each replica, whose fused update sums them in replica order as it applies them: the
    host all-reduce's sum, bit for bit (MirroredExtended._sums_host_replicas_in_order), without a pack or
    an all-reduce. The merge_call is the rendezvous after which every gradient is final; the exchange
    after the update (``_release``) keeps each replica from returning, and so from writing its gradients,
    before every replica has read them. One opaque object, so select_replica hands it on unwalked."""

    __slots__ = ("grads",)

    def __init__(self, grads: tuple):
        self.grads = grads


def _release(slots) -> list:
    return [None] * len(slots)


class _ReplicaGrads:
    """One replica's gradients (and its fusion buffers, once packed), handed to merge_call as one object
    rather than regrouped variable by variable."""

    __slots__ = ("grads", "packed")

    def __init__(self, grads, packed):
        self.grads = grads
        self.packed = packed


def _component(value, r: int):
    return value.values[r] if isinstance(value, DistributedValues) else value


def _check_gradient_shape(i: int, grad, var) -> None:
    """A gradient (each replica's, for PerReplica) must have its variable's shape exactly."""
    components = grad.values if isinstance(grad, DistributedValues) else (grad,)
    for g in components:
        if type(g) is IndexedSlices:
            shape = tuple(g.shape) if g.dense_shape is not None else \
                (tuple(var.shape)[:1] + tuple(g.values.shape)[1:])  # (no dense shape: its rows must fit)
        else:
            shape = tuple(g.shape) if hasattr(g, "shape") else np.shape(g)
        if shape != tuple(var.shape):
            raise ValueError(
                f"grads_and_vars[{i}]: the gradient of variable {var.name!r} has shape {shape}, the variable "
                f"has shape {tuple(var.shape)}; a gradient must have its variable's shape (it is never broadcast)")


def _rows(g):
    return g.values if type(g) is IndexedSlices else g


def _plain(g):
    """A gradient as the kernel's ``grads`` take it (a SquaredGradient's dense gradient)."""
    return g.grad if type(g) is SquaredGradient else g


def _plains(grads: list) -> list:
    """:func:`_plain` of each gradient; the list itself when none is a SquaredGradient (a C loop finds out)."""
    return list(map(_plain, grads)) if SquaredGradient in map(type, grads) else grads


def _dense(g, var, squares: bool = False, target=None):
    """Gradient ``g`` as a dense array of its variable's shape and dtype: IndexedSlices scattered (repeated
    indices add up, in their order), on the device of their values; with ``squares``, a
    rules.SquaredGradient whose squares add up the slices' squares row by row (one pass over the slices, see
    scatter_add_rows). ``target``: ``(gradient, squares)`` arrays to scatter into (_Plan.sparse_targets),
    else new ones. Others as they are."""
    if type(g) is not IndexedSlices:
        return g
    xp = array_module(g.values)
    shape = tuple(var.shape)
    with device_util.array_device(g.values):
        slices = g._with(values=g.values.astype(np.dtype(var.dtype), copy=False))
        # A GPU's arrays are written whole by the densify; a host's start as zeros (new ones, whose pages fault
        # in lazily, or the plan's, kept zero by clear_sparse).
        overwrite = xp is not np
        if target is None:
            new = xp.empty if overwrite else xp.zeros
            target = (new(shape, slices.dtype), new(shape, slices.dtype) if squares else None)
        dense = scatter_add_rows(target[0], slices, squares=target[1], overwrite=overwrite)
        return SquaredGradient(dense, target[1]) if squares else dense


def _densified(grads: list, variables: list, squares: bool = False) -> list:
    """Every IndexedSlices gradient (or replica component of one) densified for the update (see _dense)."""
    out = []
    for g, var in zip(grads, variables):
        if isinstance(g, DistributedValues) and IndexedSlices in map(type, g.values):
            g = type(g)([_dense(c, var, squares) for c in g.values], g._devices)
        out.append(_dense(g, var, squares))
    return out


def _dtype_of(g):
    return g.dtype if hasattr(g, "dtype") else np.asarray(g).dtype


def _dtypes_of(grads: list) -> list:
    """Each gradient's dtype: a C loop where every one has a ``dtype``."""
    try:
        return list(map(_DTYPE, grads))
    except AttributeError:
        return list(map(_dtype_of, grads))


def _clip_by_norm(g, clipnorm: float):
    """``tf.clip_by_norm(g, clipnorm)``: ``g * clipnorm / max(||g||, clipnorm)`` in g's dtype."""
    xp, t = array_module(g), _dtype_of(g).type
    l2sum = (g * g).sum()
    l2norm = xp.where(l2sum > 0, xp.sqrt(l2sum), l2sum)
    return (g * t(clipnorm)) / xp.maximum(l2norm, t(clipnorm))


def _clip_by_global_norm(grads: list, clipnorm: float) -> list:
    """Keras' ``clip_by_global_norm``: every gradient scaled by ``clipnorm / max(global norm, clipnorm)``."""
    xp, t = array_module(grads[0]), _dtype_of(grads[0]).type
    norm = xp.sqrt(sum((g * g).sum() for g in grads))
    # Keras' form: a NaN or infinite norm makes the scale NaN. (The array module's functions
    # for scalar-first operations: a NumPy scalar does not defer to a GPU array.)
    scale = xp.multiply(t(clipnorm), xp.minimum(xp.divide(t(1.0), norm), t(1.0 / clipnorm))) + (norm - norm)
    return [g * scale for g in grads]
