"""Optimizers whose ``apply_gradients`` is one fused all-reduce plus mirrored updates.

``apply_gradients(grads_and_vars)`` may be called inside ``strategy.run``
(each replica passes its own gradients) or in cross-replica context, under
``strategy.scope()`` (with ``PerReplica`` gradients, or plain ones, which are
the final gradient already). Either way it

1. SUMS every gradient across all replicas of all workers with ONE
   ``strategy.extended.batch_reduce_to(SUM, ...)``, as Keras optimizers do
   under a tf.distribute strategy (``experimental_aggregate_gradients=True``)
   — so each replica's loss must be divided by the GLOBAL batch size
   (``md.nn.compute_average_loss``). The gradients are packed into few
   buffers (``CommunicationOptions.bytes_per_pack`` honoured) instead of one
   collective per variable;
2. updates every copy of every variable with ``strategy.extended.update`` and
   the same reduced gradient, so the copies (and the slot variables, which
   are mirrored too) stay bit-identical;
3. increments ``iterations``.

``gradient_aggregation="mean"`` (a constructor argument) averages instead of
summing: the habit of Horovod and PyTorch DDP, where each replica's loss is the
mean over its own share of the batch.

The update rules are TensorFlow's (``tf.keras.optimizers.SGD`` / ``Adam``):

* SGD, momentum ``mu``:  ``v = mu*v - lr*g``;  ``w += v``
  (Nesterov: ``w += mu*v - lr*g``); without momentum ``w -= lr*g``.
* Adam at step ``t`` (1-based):  ``m = b1*m + (1-b1)*g``;
  ``v = b2*v + (1-b2)*g*g``;  ``w -= lr*sqrt(1-b2^t)/(1-b1^t) * m/(sqrt(v)+eps)``
  — Kingma & Ba's Algorithm 1 with the bias correction folded into the step
  size, so ``epsilon`` is their "epsilon hat" (section 2).

A learning rate is a number or a callable of the step (``iterations`` before
this update, from 0), e.g. ``lambda step: 0.1 * 0.5 ** (step // 100)``.
"""

from __future__ import annotations

import math
import numbers

import numpy as np

__all__ = ["Optimizer", "SGD", "Adam", "sgd_update", "adam_update"]


# --- the update rules on one replica's arrays (NumPy or CuPy); they return new arrays ----------------
# Variables never change a buffer in place (an array read from a variable stays
# valid), so the rules are pure functions and the update assigns their results.

def sgd_update(w, g, velocity, lr: float, momentum: float, nesterov: bool):
    """One SGD step: ``(new w, new velocity)``; ``velocity`` is None without momentum."""
    if velocity is None:
        return w - lr * g, None
    velocity = momentum * velocity - lr * g
    return (w + momentum * velocity - lr * g if nesterov else w + velocity), velocity


def adam_update(w, g, m, v, lr: float, beta_1: float, beta_2: float, epsilon: float, t: int):
    """One Adam step (``t`` counts from 1): ``(new w, new m, new v)``."""
    m = beta_1 * m + (1.0 - beta_1) * g
    v = beta_2 * v + (1.0 - beta_2) * (g * g)
    step_size = lr * math.sqrt(1.0 - beta_2 ** t) / (1.0 - beta_1 ** t)
    return w - step_size * m / (v ** 0.5 + epsilon), m, v


# --- the distributed optimizer --------------------------------------------------------------------

def _check_aggregation(value) -> str:
    """``"sum"`` or ``"mean"`` from those strings (any case) or ``md.ReduceOp.SUM`` / ``MEAN``."""
    from ..distribute.reduce_util import ReduceOp

    if isinstance(value, ReduceOp):
        value = value.value
    if isinstance(value, str) and value.lower() in ("sum", "mean"):
        return value.lower()
    raise ValueError(f"gradient_aggregation={value!r}: expected 'sum' (Keras: gradients summed across "
                     "replicas, loss divided by the global batch size) or 'mean' (gradients averaged)")


def _check_rate(value, argument: str, allow_callable: bool, low: float = 0.0, high: float | None = None):
    if allow_callable and callable(value):
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        kind = "a number or a callable of the step" if allow_callable else "a number"
        raise ValueError(f"{argument}={value!r}: expected {kind}")
    if value < low or (high is not None and value >= high):
        bound = f"in [{low}, {high})" if high is not None else f">= {low}"
        raise ValueError(f"{argument}={value!r}: expected a value {bound}")
    return float(value)


class Optimizer:
    """Base class: state handling, the fused all-reduce and the mirrored update.

    Subclasses name their slots (``_slot_names``) and implement ``_rule``, the
    update of one replica's copy of one variable and its slots.
    """

    _slot_names: tuple = ()

    def __init__(self, learning_rate, name: str, gradient_aggregation="sum"):
        self.learning_rate = _check_rate(learning_rate, "learning_rate", allow_callable=True)
        self.name = name
        self.gradient_aggregation = _check_aggregation(gradient_aggregation)
        self._iterations = None
        self._slots = {}  # id(variable) -> (variable, {slot name: MirroredVariable})
        # The strategy whose variables this optimizer updates: the one in scope when it
        # is created (as Keras does), else that of the first variables it updates.
        from ..distribute import distribute_lib

        self._strategy = distribute_lib.get_strategy() if distribute_lib.has_strategy() else None

    # -- state --
    @property
    def iterations(self):
        """The number of ``apply_gradients`` calls so far: a mirrored int64 variable."""
        if self._iterations is None:
            from ..distribute import distribute_lib

            self._create_state(self._strategy or distribute_lib.get_strategy(), ())
        return self._iterations

    def get_slot(self, var, slot_name: str):
        """The slot variable ``slot_name`` (e.g. ``"momentum"``, ``"m"``) of ``var``."""
        if slot_name not in self._slot_names:
            raise KeyError(f"slot_name={slot_name!r}: {type(self).__name__} has slots {list(self._slot_names)}")
        entry = self._slots.get(id(var))
        if entry is None:
            raise KeyError(f"var={getattr(var, 'name', var)!r} has no slots yet: apply_gradients to it first")
        return entry[1][slot_name]

    def variables(self) -> list:
        """``iterations`` and every slot variable, in creation order."""
        state = [] if self._iterations is None else [self._iterations]
        return state + [s for _, slots in self._slots.values() for s in slots.values()]

    def _create_state(self, strategy, var_list) -> None:
        """Create ``iterations`` and the slots of ``var_list`` that do not exist yet.

        Runs in cross-replica context under ``strategy.scope()`` so that every
        state variable is mirrored on the same devices as the model's.
        """
        from ..distribute import values
        from ..distribute.options import VariableAggregation

        if self._strategy is not None and strategy is not self._strategy:
            raise ValueError(
                f"{type(self).__name__} {self.name!r} was created for {self._strategy!r} and is now asked to "
                f"update variables under {strategy!r}; create one optimizer per strategy (inside its scope)"
            )
        missing = [v for v in var_list if id(v) not in self._slots]
        if self._iterations is not None and not missing:
            return
        with strategy.scope():
            if self._iterations is None:
                self._iterations = values.Variable(
                    np.int64(0), name=f"{self.name}/iterations", trainable=False, dtype=np.int64,
                    aggregation=VariableAggregation.ONLY_FIRST_REPLICA)
            for var in missing:
                base = var.name.split(":")[0]  # "dense0/w:0" -> slots "dense0/w/m:0", ...
                slots = {
                    slot: values.Variable(np.zeros(var.shape, dtype=var.dtype), name=f"{base}/{slot}",
                                          trainable=False)
                    for slot in self._slot_names
                }
                self._slots[id(var)] = (var, slots)
        self._strategy = strategy

    # -- the step --
    def learning_rate_at(self, step: int) -> float:
        """The learning rate used by the update at ``step`` (0-based)."""
        lr = self.learning_rate(step) if callable(self.learning_rate) else self.learning_rate
        return _check_rate(lr, f"learning_rate({step})", allow_callable=False)

    def apply_gradients(self, grads_and_vars, options=None, *, name=None, experimental_aggregate_gradients=True):
        """Sum (or average) the gradients across replicas and update every copy of the variables.

        ``grads_and_vars``: pairs ``(gradient, variable)``; pairs whose gradient
        is None are skipped, as TensorFlow does. Each gradient has its
        variable's shape exactly (no broadcasting). ``options``: an
        ``md.CommunicationOptions`` for the fused all-reduce. ``name`` is
        accepted for Keras compatibility. ``experimental_aggregate_gradients=False``
        (Keras' switch) skips the all-reduce: each replica's copy is updated
        with that replica's own gradient, which the caller must have
        aggregated already (e.g. with ``ReplicaContext.all_reduce``), or the
        copies drift apart. Returns the new value of ``iterations`` (a Python int).
        """
        from ..distribute import distribute_lib

        pairs = self._check_pairs(grads_and_vars)
        aggregate = bool(experimental_aggregate_gradients)
        if distribute_lib.in_cross_replica_context():
            return self._distributed_apply(distribute_lib.get_strategy(), pairs, options, aggregate, False)
        if not distribute_lib.has_strategy():
            owner = next((v.distribute_strategy for _, v in pairs
                          if getattr(v, "distribute_strategy", None) is not None
                          and not isinstance(v.distribute_strategy, distribute_lib._DefaultStrategy)), None)
            if owner is not None:
                raise RuntimeError(
                    f"{type(self).__name__}.apply_gradients was called outside strategy.run and outside "
                    f"strategy.scope(), on variables of {owner!r}; call it inside strategy.run(step_fn) (each "
                    "replica passes its gradients), or under `with strategy.scope():` with PerReplica gradients")
        # options stay out of the merged arguments: each replica may pass its own (equal)
        # options object, which merge_call would turn into a PerReplica.
        return distribute_lib.get_replica_context().merge_call(
            lambda strategy, merged: self._distributed_apply(strategy, merged, options, aggregate, True),
            args=(pairs,))

    def _check_pairs(self, grads_and_vars) -> list:
        from ..distribute import values

        pairs = []
        for i, pair in enumerate(grads_and_vars):
            try:
                grad, var = pair
            except (TypeError, ValueError):
                raise ValueError(
                    f"grads_and_vars[{i}]={pair!r}: expected a (gradient, variable) pair; "
                    "pass zip(grads, variables)") from None
            if grad is None:
                continue
            if not isinstance(var, values.Variable):
                raise TypeError(
                    f"grads_and_vars[{i}]: variable {var!r} is not an md.Variable; create the model's "
                    "variables with md.Variable inside strategy.scope()")
            if not var.trainable:
                raise ValueError(f"grads_and_vars[{i}]: variable {var.name!r} was created with "
                                 "trainable=False; optimizers update trainable variables only")
            if not np.issubdtype(np.dtype(var.dtype), np.floating) and np.dtype(var.dtype).name != "bfloat16":
                raise TypeError(f"grads_and_vars[{i}]: variable {var.name!r} has dtype {var.dtype}; "
                                "optimizers update floating-point variables only")
            _check_gradient_shape(i, grad, var)
            pairs.append((grad, var))
        if not pairs:
            raise ValueError("grads_and_vars: no gradient was given (all were None or the list is empty)")
        if len({id(v) for _, v in pairs}) != len(pairs):
            raise ValueError("grads_and_vars: a variable appears twice; sum its gradients first")
        return pairs

    def _distributed_apply(self, strategy, pairs, options, aggregate, from_replicas):
        from ..distribute import distribute_lib
        from ..distribute.reduce_util import ReduceOp
        from ..distribute.values import DistributedValues, PerReplica

        variables = [var for _, var in pairs]
        self._create_state(strategy, variables)
        as_local = getattr(strategy.extended, "_as_local", None)  # multi-worker: one local replica's part
        if from_replicas and not isinstance(strategy, distribute_lib._DefaultStrategy):
            # merge_call leaves a gradient unwrapped when every replica passed the same
            # object (or there is one local replica): it is still one gradient per replica.
            devices = strategy.extended.worker_devices
            pairs = [(g if isinstance(g, DistributedValues) else PerReplica([g] * len(devices), devices), v)
                     for g, v in pairs]
        elif as_local is not None:
            pairs = [(as_local(g), v) for g, v in pairs]
        reduced = [grad for grad, _ in pairs]
        # One fused collective for all gradients: the replicas' gradients of a variable
        # arrive as one PerReplica value, reduced onto that variable's devices. A plain
        # gradient given in cross-replica context is the final gradient already.
        distributed = [k for k, (grad, _) in enumerate(pairs) if isinstance(grad, DistributedValues)]
        if aggregate and distributed:
            op = ReduceOp.SUM if self.gradient_aggregation == "sum" else ReduceOp.MEAN
            for k, grad in zip(distributed, strategy.extended.batch_reduce_to(
                    op, [pairs[k] for k in distributed], options=options)):
                reduced[k] = grad
        step = int(self._iterations.numpy())
        lr = self.learning_rate_at(step)
        for (_, var), grad in zip(pairs, reduced):
            strategy.extended.update(var, self._copy_updater(var, lr, step), args=(grad,), group=True)
        self._iterations.assign_add(np.int64(1))
        return step + 1

    def _copy_updater(self, var, lr: float, step: int):
        """The function ``extended.update`` calls on each copy of ``var`` with that copy's gradient."""
        copies = _copies(var)
        slots = [_copies(s) for s in self._slots[id(var)][1].values()]

        def update_copy(copy, grad):
            # The slot copies that belong with this copy of the variable sit at the same index.
            i = next(k for k, c in enumerate(copies) if c is copy)
            new_w, *new_slots = self._rule(copy.read_value(), grad, [s[i].read_value() for s in slots], lr, step)
            copy.assign(new_w)
            for slot, value in zip(slots, new_slots):
                slot[i].assign(value)

        return update_copy

    def _rule(self, w, g, slots, lr: float, step: int):
        """``(new w, *new slots)`` from one replica's arrays: the optimizer's update rule."""
        raise NotImplementedError(f"{type(self).__name__} must implement _rule")

    def __repr__(self) -> str:
        return (f"<{type(self).__name__} name={self.name!r} learning_rate={self.learning_rate!r} "
                f"gradient_aggregation={self.gradient_aggregation!r}>")


def _check_gradient_shape(i: int, grad, var) -> None:
    """A gradient (each replica's, for PerReplica) must have its variable's shape exactly."""
    from ..distribute.values import DistributedValues

    components = grad.values if isinstance(grad, DistributedValues) else (grad,)
    for g in components:
        shape = tuple(g.shape) if hasattr(g, "shape") else np.shape(g)
        if shape != tuple(var.shape):
            raise ValueError(
                f"grads_and_vars[{i}]: the gradient of variable {var.name!r} has shape {shape}, the variable "
                f"has shape {tuple(var.shape)}; a gradient must have its variable's shape (it is never broadcast)")


def _copies(var) -> tuple:
    """The per-device copies of a variable (a variable outside any strategy is its own copy)."""
    from ..distribute import values

    return var.values if isinstance(var, values.DistributedVariable) else (var,)


class SGD(Optimizer):
    """Gradient descent with optional (Nesterov) momentum, as ``tf.keras.optimizers.SGD``."""

    def __init__(self, learning_rate=0.01, momentum: float = 0.0, nesterov: bool = False, name: str = "SGD",
                 gradient_aggregation="sum"):
        super().__init__(learning_rate, name, gradient_aggregation)
        self.momentum = _check_rate(momentum, "momentum", allow_callable=False, low=0.0, high=1.0)
        if nesterov and self.momentum == 0.0:
            raise ValueError("nesterov=True needs momentum > 0 (e.g. momentum=0.9)")
        self.nesterov = bool(nesterov)
        self._slot_names = ("momentum",) if self.momentum > 0.0 else ()

    def _rule(self, w, g, slots, lr: float, step: int):
        new_w, velocity = sgd_update(w, g, slots[0] if slots else None, lr, self.momentum, self.nesterov)
        return (new_w, velocity) if slots else (new_w,)


class Adam(Optimizer):
    """Adam (Kingma & Ba, 2014), as ``tf.keras.optimizers.Adam`` (no amsgrad)."""

    _slot_names = ("m", "v")

    def __init__(self, learning_rate=0.001, beta_1: float = 0.9, beta_2: float = 0.999,
                 epsilon: float = 1e-7, name: str = "Adam", gradient_aggregation="sum"):
        super().__init__(learning_rate, name, gradient_aggregation)
        self.beta_1 = _check_rate(beta_1, "beta_1", allow_callable=False, low=0.0, high=1.0)
        self.beta_2 = _check_rate(beta_2, "beta_2", allow_callable=False, low=0.0, high=1.0)
        self.epsilon = _check_rate(epsilon, "epsilon", allow_callable=False)

    def _rule(self, w, g, slots, lr: float, step: int):
        m, v = slots
        return adam_update(w, g, m, v, lr, self.beta_1, self.beta_2, self.epsilon, step + 1)
