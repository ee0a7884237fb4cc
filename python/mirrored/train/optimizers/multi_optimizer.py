"""Keras 3's ``MultiOptimizer`` and ``OptimizerMap``: each variable updated by the optimizer its path selects.

``OptimizerMap(default_optimizer, optimizer_map=None)`` maps a variable's path to an optimizer: the key equal to
the path, else the one key that matches the whole path as a regular expression (``re.fullmatch``; two matching
keys are an error), else ``default_optimizer``. An md.Variable's path is its name without TensorFlow's ``:0``
(``"encoder/dense/kernel:0"`` -> ``"encoder/dense/kernel"``), as a Keras variable's ``path`` reads; an object
with a ``path`` of its own is looked up by that.

``MultiOptimizer(optimizer_map, loss_scale_factor=None, name=None)`` takes an OptimizerMap or any callable of a
variable that returns its optimizer. A step routes the gradients to the sub-optimizers by a table computed once
per list of variables (a C-level gather per sub-optimizer, no Python per variable), then each sub-optimizer takes
its own fused step: its clipping, its all-reduce, its fused update on each device (:mod:`.base`). So a step costs
the sum of the parts' constants, whatever the number of variables: per sub-optimizer one merge, one fused
all-reduce per dtype and one fused update per device and dtype. Keras' TensorFlow backend sums each
sub-optimizer's gradients in an all-reduce of its own, after that sub-optimizer's clipping, and so does this one.

As in Keras, a checkpoint of a MultiOptimizer holds its own ``_iterations`` and ``_learning_rate`` (0.0) and the
variables it was built for, not the sub-optimizers' state: track them in the checkpoint too
(``md.train.Checkpoint(optimizer=multi, adam=adam, sgd=sgd)``) to restore their slots (docs/training.md).
"""

from __future__ import annotations

import operator
import re
import sys
from collections.abc import MutableMapping

import numpy as np

from ...device import device_util
from ...distribute import distribute_lib, values
from ...distribute.options import VariableAggregation
from ...distribute.values import DistributedVariable
from .base import Optimizer, _snake_case, check_loss_scale_factor

__all__ = ["MultiOptimizer", "OptimizerMap"]

_TRAILING_INDEX = re.compile(r":\d+$")


def variable_path(variable) -> str:
    """Keras' ``variable.path`` of ``variable``: its own ``path`` where it has one, else its name without ``:0``."""
    path = getattr(variable, "path", None)
    if isinstance(path, str):
        return path
    return _TRAILING_INDEX.sub("", variable.name)


def _loss_scale_optimizer():
    """md.mixed_precision.LossScaleOptimizer, which md.train sets as this package's ``LossScaleOptimizer``
    (mixed_precision imports this package, so it is not imported here); a tuple of no types before that."""
    return getattr(sys.modules[__package__], "LossScaleOptimizer", ())


def _is_optimizer(value) -> bool:
    """Whether ``value`` is what Keras calls an Optimizer: ours, a LossScaleOptimizer or a MultiOptimizer."""
    return isinstance(value, (Optimizer, MultiOptimizer, _loss_scale_optimizer()))


class OptimizerMap(MutableMapping):
    """Keras 3's ``keras.optimizers.OptimizerMap``: variable paths (or regular expressions of them) to optimizers.

    ``map[path]`` is the optimizer of the key equal to ``path``, else of the one key ``re.fullmatch`` matches
    (``"encoder/.*"`` for everything under ``encoder``; two such keys are a ValueError), else
    ``default_optimizer``; ``map(variable)`` looks up the variable's path. ``optimizer_map``: a dict, kept (not
    copied) and not checked, as Keras keeps it; ``map[key] = optimizer`` checks the key and the optimizer.
    """

    def __init__(self, default_optimizer, optimizer_map=None):
        if not _is_optimizer(default_optimizer):
            raise TypeError("default_optimizer must be a Keras Optimizer instance. "
                            f"Received: {default_optimizer} (e.g. md.optimizers.Adam())")
        if optimizer_map is not None and not isinstance(optimizer_map, dict):
            raise TypeError(f"optimizer_map must be a dictionary. Received: {optimizer_map}")
        self._default_optimizer = default_optimizer
        self._optimizer_map = optimizer_map or {}

    @property
    def default_optimizer(self):
        return self._default_optimizer

    def __getitem__(self, key):
        if key in self._optimizer_map:
            return self._optimizer_map[key]
        matching = [pattern for pattern in self._optimizer_map if re.fullmatch(pattern, key)]
        if len(matching) > 1:
            raise ValueError(f"Multiple optimizers assigned to variable {key}. (the patterns {matching} all match "
                             "it: make them exclusive, or add its exact path as a key)")
        return self._optimizer_map[matching[0]] if matching else self._default_optimizer

    def __setitem__(self, key, optimizer):
        # (Keras' order of checks: a duplicate key first, whatever the value)
        if key in self._optimizer_map:
            raise ValueError(f"'{key}' already exists in the OptimizerMap with value {self._optimizer_map[key]}. "
                             "Please make sure to not use duplicated keys.")
        if not isinstance(key, str):
            raise ValueError(f"key must be a string. Received: {key}")
        if not _is_optimizer(optimizer):
            raise ValueError(f"optimizer must be a Keras Optimizer instance. Received: {optimizer}")
        if isinstance(optimizer, _loss_scale_optimizer()):
            raise ValueError("optimizer cannot be LossScaleOptimizer.")
        if isinstance(optimizer, MultiOptimizer):
            raise ValueError("optimizer cannot be MultiOptimizer.")
        self._optimizer_map[key] = optimizer

    def __delitem__(self, key):
        del self._optimizer_map[key]

    def __len__(self):
        return len(self._optimizer_map)

    def __iter__(self):
        return iter(self._optimizer_map)

    def __call__(self, variable):
        return self[variable_path(variable)]

    def get_config(self) -> dict:
        from .serialization import serialize

        return {"default_optimizer": serialize(self._default_optimizer),
                "optimizer_map": {key: serialize(opt) for key, opt in self._optimizer_map.items()}}

    @classmethod
    def from_config(cls, config: dict, custom_objects=None):
        from .serialization import deserialize

        mapped = config.get("optimizer_map")
        mapped = None if mapped is None else {key: deserialize(opt, custom_objects) for key, opt in mapped.items()}
        return cls(deserialize(config["default_optimizer"], custom_objects), mapped)

    def __repr__(self) -> str:
        return f"<OptimizerMap default_optimizer={self._default_optimizer!r} optimizer_map={self._optimizer_map!r}>"


class _Route:
    """One variable list's split among the sub-optimizers, computed once: per sub-optimizer with variables, the
    gather of its gradients (``operator.itemgetter``, a C loop) and its variables (the same list each step, so
    the sub-optimizer's own plan is found by their ids)."""

    __slots__ = ("parts", "variables")

    def __init__(self, parts: list, variables: list):
        self.parts = parts  # [(optimizer, gather, its variables)]
        self.variables = variables  # keeps the ids of the route's key alive


def _gather(indices: list):
    """A C-level gather of ``indices`` from a list, always a tuple (itemgetter of one index gives the item)."""
    if len(indices) == 1:
        index = indices[0]
        return lambda items: (items[index],)
    return operator.itemgetter(*indices)


class MultiOptimizer:
    """Keras 3's ``keras.optimizers.MultiOptimizer``: each variable updated by the optimizer ``optimizer_map``
    gives it (an :class:`OptimizerMap`, or a callable of the variable).

    ``optimizers``: the sub-optimizers (the map's, in its order, then its default; a callable's as it returns
    them at ``build``). ``loss_scale_factor`` is set on every sub-optimizer (None too, as Keras does).
    ``learning_rate`` is the sub-optimizers' own: reading or setting it here is an AttributeError.
    ``iterations`` counts this optimizer's steps; each sub-optimizer counts its own.
    """

    def __init__(self, optimizer_map, loss_scale_factor=None, name=None):
        if not callable(optimizer_map):
            raise TypeError(f"optimizer_map={optimizer_map!r}: expected an md.optimizers.OptimizerMap or a callable "
                            "that returns the optimizer of a variable (e.g. OptimizerMap(md.optimizers.SGD(), "
                            "{'encoder/.*': md.optimizers.Adam()}))")
        self.name = name or _snake_case(type(self).__name__)
        self._optimizer_map = optimizer_map
        self._inner_optimizers = []
        self._loss_scale_factor = check_loss_scale_factor(loss_scale_factor)
        # The map's optimizers in its order, then the default (Keras' order, which `variables` follows).
        listed = list(optimizer_map.values()) if hasattr(optimizer_map, "values") else []
        default = getattr(optimizer_map, "default_optimizer", None)
        for opt in listed + ([default] if default is not None else []):
            if not any(opt is known for known in self._inner_optimizers):
                opt.loss_scale_factor = loss_scale_factor
                self._inner_optimizers.append(opt)
        self.built = False
        self._built_variables = []
        self._optimizer_index = {}  # id(variable) -> index of its sub-optimizer, from build
        self._routes = {}  # tuple of variable ids -> _Route
        self._strategy = distribute_lib.get_strategy() if distribute_lib.has_strategy() else None
        self._iterations = None
        self._learning_rate_variable = None
        self._iteration_copies = None

    # -- what Keras' MultiOptimizer exposes --
    @property
    def optimizers(self) -> list:
        return self._inner_optimizers

    @property
    def learning_rate(self):
        raise AttributeError("Learning rate cannot be accessed on a MultiOptimizer. Access the learning rate on "
                             "the individual sub-optimizers instead.")

    @learning_rate.setter
    def learning_rate(self, value):
        raise AttributeError("Learning rate cannot be set on a MultiOptimizer. Set the learning rate on the "
                             "individual sub-optimizers instead.")

    @property
    def loss_scale_factor(self):
        return self._loss_scale_factor

    @loss_scale_factor.setter
    def loss_scale_factor(self, value):
        self._loss_scale_factor = check_loss_scale_factor(value)
        for opt in self._inner_optimizers:
            opt.loss_scale_factor = value

    def scale_loss(self, loss):
        """Keras 3's ``scale_loss``: ``loss * loss_scale_factor`` (the loss itself without one)."""
        return loss if self._loss_scale_factor is None else loss * self._loss_scale_factor

    @property
    def iterations(self):
        """This optimizer's step count (an int64 mirrored variable); each sub-optimizer's ``iterations`` its own."""
        return self._own_state()[0]

    @property
    def variables(self) -> list:
        """``iterations``, then each sub-optimizer's variables in ``optimizers`` order (Keras' order; Keras' list
        also holds each learning rate, a variable there and a number here)."""
        out = [self.iterations]
        for opt in self._inner_optimizers:
            inner = opt.variables
            out.extend(inner() if callable(inner) else inner)
        return out

    def _own_state(self) -> tuple:
        """``(iterations, learning rate)``: Keras' own variables of a MultiOptimizer (its learning rate stays 0.0),
        made in the strategy of the optimizer (the one in scope at its creation, else its variables')."""
        if self._iterations is None:
            strategy = self._strategy or distribute_lib.get_strategy()
            with strategy.scope():
                self._iterations = values.Variable(np.int64(0), name=f"{self.name}/iterations", trainable=False,
                                                   dtype=np.int64, aggregation=VariableAggregation.ONLY_FIRST_REPLICA)
                self._learning_rate_variable = values.Variable(
                    np.float32(0.0), name=f"{self.name}/learning_rate", trainable=False,
                    aggregation=VariableAggregation.ONLY_FIRST_REPLICA)
            copies = self._iterations.values if isinstance(self._iterations, DistributedVariable) \
                else (self._iterations,)
            # One copy per local replica: each replica counts its own (else None: counted once, in a merge).
            self._iteration_copies = copies if len(copies) == len(strategy.extended.worker_devices) else None
            self._strategy = strategy
        return self._iterations, self._learning_rate_variable

    def _trackable_children(self) -> dict:
        """What a checkpoint holds of a MultiOptimizer, as Keras 3's: ``_iterations``, ``_learning_rate`` and,
        once built, ``_trainable_variables`` (the sub-optimizers' state is not tracked, as in Keras)."""
        iterations, learning_rate = self._own_state()
        children = {"_iterations": iterations, "_learning_rate": learning_rate}
        if self.built:
            children["_trainable_variables"] = list(self._built_variables)
        return children

    # -- build and routing --
    def build(self, var_list) -> None:
        """Route every variable of ``var_list`` to its sub-optimizer and build each sub-optimizer on its variables;
        a second build does nothing (Keras)."""
        if self.built:
            return
        try:
            var_list = list(var_list)
        except TypeError:
            raise TypeError(f"var_list={var_list!r}: expected a list of md.Variable") from None
        if self._strategy is None:
            self._strategy = next((v.distribute_strategy for v in var_list
                                   if getattr(v, "distribute_strategy", None) is not None), None)
        lso = _loss_scale_optimizer()
        parts = [[] for _ in self._inner_optimizers]
        index = {}
        for var in var_list:
            opt = self._optimizer_map(var)
            if not _is_optimizer(opt):
                raise ValueError(f"Optimizer for variable {var} is not an Optimizer instance. (optimizer_map returned "
                                 f"{opt!r}; return an md.optimizers optimizer)")
            if isinstance(opt, lso):
                raise ValueError("LossScaleOptimizer cannot be used inside an MultiOptimizer. (wrap the "
                                 "MultiOptimizer in the LossScaleOptimizer instead)")
            if isinstance(opt, MultiOptimizer):
                raise ValueError("MultiOptimizer cannot be used inside an MultiOptimizer.")
            k = next((i for i, known in enumerate(self._inner_optimizers) if known is opt), None)
            if k is None:  # (a callable's new optimizer)
                opt.loss_scale_factor = self._loss_scale_factor
                self._inner_optimizers.append(opt)
                parts.append([])
                k = len(self._inner_optimizers) - 1
            index[id(var)] = k
            parts[k].append(var)
        for opt, part in zip(self._inner_optimizers, parts):
            if part:
                opt.build(part)
        self._own_state()
        self._optimizer_index = index
        self._built_variables = var_list
        self.built = True

    def _route(self, variables: list) -> _Route:
        """The split of ``variables`` (every built variable once, in any order) among the sub-optimizers."""
        key = tuple(map(id, variables))
        route = self._routes.get(key)
        if route is not None:
            return route
        if len(variables) != len(self._optimizer_index):
            raise ValueError(f"Gradients must match trainable variables one-to-one. Received {len(variables)} "
                             f"gradients and {len(self._optimizer_index)} variables. (pass a gradient, or None, for "
                             "every variable the optimizer was built with)")
        indices = [[] for _ in self._inner_optimizers]
        for i, var in enumerate(variables):
            k = self._optimizer_index.get(id(var))
            if k is None:
                raise KeyError(f"variable {getattr(var, 'name', var)!r} is not one of the variables this "
                               f"MultiOptimizer {self.name!r} was built with; build it on the model's variables")
            indices[k].append(i)
        parts = [(opt, _gather(ks), [variables[i] for i in ks])
                 for opt, ks in zip(self._inner_optimizers, indices) if ks]
        route = self._routes[key] = _Route(parts, list(variables))
        return route

    # -- the step --
    def apply(self, grads, trainable_variables=None):
        """Keras 3's ``apply``: one step of every sub-optimizer on its share of ``grads``; without
        ``trainable_variables``, the variables of ``build``. No gradients: nothing happens (Keras)."""
        grads = list(grads)
        if not grads:
            return None
        if trainable_variables is None:
            if not self.built:
                raise ValueError("When passing `grads` without `variables`, the optimizer must already be built on "
                                 "a list of variables. Call `optimizer.build(trainable_variables)` first.")
            trainable_variables = self._built_variables
        return self._step(grads, list(trainable_variables), None, True)

    def apply_gradients(self, grads_and_vars, options=None, *, name=None, experimental_aggregate_gradients=True):
        """One step of every sub-optimizer on its share of ``grads_and_vars`` (a pair per built variable; a None
        gradient leaves its variable alone), inside ``strategy.run`` or in cross-replica context as any
        optimizer's; ``options`` and ``experimental_aggregate_gradients`` go to each sub-optimizer. Returns
        ``iterations``."""
        try:
            pairs = grads_and_vars if isinstance(grads_and_vars, list) else list(grads_and_vars)
            grads, variables = list(map(operator.itemgetter(0), pairs)), list(map(operator.itemgetter(1), pairs))
        except (TypeError, IndexError):
            raise TypeError(f"grads_and_vars={grads_and_vars!r}: expected a list of (gradient, variable) pairs, "
                            "e.g. zip(grads, variables)") from None
        return self._step(grads, variables, options, bool(experimental_aggregate_gradients))

    def _step(self, grads: list, variables: list, options, aggregate: bool):
        if len(grads) != len(variables):
            raise ValueError(f"grads: {len(grads)} gradients for {len(variables)} variables; pass one gradient per "
                             "variable")
        if not self.built:
            if distribute_lib.in_cross_replica_context():
                self.build(variables)
            else:  # (the state is made once, in cross-replica context: in a merge of the replicas)
                distribute_lib.get_replica_context().merge_call(lambda strategy: self.build(variables))
        for opt, gather, part in self._route(variables).parts:
            opt.apply_gradients(list(zip(gather(grads), part)), options,
                                experimental_aggregate_gradients=aggregate)
        self._count_step()
        return self._iterations

    def _count_step(self) -> None:
        """``iterations`` + 1: in replica context each replica adds one to its own copy in place (one kernel on a
        GPU, which md.function captures); where the copies are not one per local replica (CentralStorageStrategy's
        variable kept once), once, in a merge."""
        ctx = distribute_lib.get_replica_context()
        iterations = self._iterations
        if ctx is None:  # (cross-replica context)
            iterations.assign_add(np.int64(1))
            return
        copies = self._iteration_copies
        if copies is None:
            ctx.merge_call(lambda strategy: iterations.assign_add(np.int64(1)))
            return
        copy = copies[ctx._local_replica_id]
        if type(copy._value) is np.ndarray:
            buffer = copy._writable_buffer()
            buffer += 1
            return
        with device_util.device_scope(copy.device), device_util.cross_replica_gpu_scope(copy.device):
            buffer = copy._writable_buffer()
            buffer += 1  # (in place: one kernel)

    def finalize_variable_values(self, var_list) -> None:
        """Each sub-optimizer's ``finalize_variable_values`` on its share of ``var_list`` (moving averages)."""
        var_list = list(var_list)
        parts = [[] for _ in self._inner_optimizers]
        for var in var_list:
            k = self._optimizer_index.get(id(var))
            if k is None:
                raise KeyError(f"variable {getattr(var, 'name', var)!r} is not one of the variables this "
                               f"MultiOptimizer {self.name!r} was built with")
            parts[k].append(var)
        for opt, part in zip(self._inner_optimizers, parts):
            if part:
                opt.finalize_variable_values(part)

    def set_weights(self, weights) -> None:
        """Assign ``weights`` (arrays in ``variables`` order) to ``variables``."""
        if not self.built:
            raise ValueError("You are calling `set_weights()` on an optimizer that has not yet been built. Please "
                             "call `optimizer.build(trainable_variables)` to create the optimizer weights before "
                             "calling `set_weights()`.")
        weights, variables = list(weights), self.variables
        if len(weights) != len(variables):
            raise ValueError(f"weights: {len(weights)} arrays for the {len(variables)} variables of MultiOptimizer "
                             f"{self.name!r} (its iterations, then each sub-optimizer's); pass one per variable")
        for i, (var, weight) in enumerate(zip(variables, weights)):
            if tuple(np.shape(weight)) != tuple(var.shape):
                raise ValueError(f"weights[{i}] has shape {tuple(np.shape(weight))}, variable {var.name!r} has "
                                 f"shape {tuple(var.shape)}")
            var.assign(np.asarray(weight, dtype=var.dtype))

    # -- configuration --
    def get_config(self) -> dict:
        """Keras 3's config: ``optimizer_map`` serialized (an OptimizerMap's config), ``loss_scale_factor``,
        ``name``. A callable map has no config: use an OptimizerMap to save one."""
        if not isinstance(self._optimizer_map, OptimizerMap):
            raise TypeError(f"MultiOptimizer {self.name!r}: its optimizer_map {self._optimizer_map!r} is a callable, "
                            "which get_config cannot serialize; use an md.optimizers.OptimizerMap")
        config = {"module": "keras.optimizers", "class_name": "OptimizerMap",
                  "config": self._optimizer_map.get_config(), "registered_name": None}
        return {"optimizer_map": config, "loss_scale_factor": self._loss_scale_factor, "name": self.name}

    @classmethod
    def from_config(cls, config: dict, custom_objects=None):
        config = dict(config)
        mapped = config.get("optimizer_map")
        if isinstance(mapped, dict):
            if mapped.get("class_name") != "OptimizerMap":
                raise ValueError(f"config['optimizer_map']={mapped!r}: expected a serialized OptimizerMap "
                                 "(MultiOptimizer.get_config()'s)")
            config["optimizer_map"] = OptimizerMap.from_config(mapped.get("config", {}), custom_objects)
        return cls(**config)

    def __repr__(self) -> str:
        return f"<MultiOptimizer name={self.name!r} optimizers={self._inner_optimizers!r}>"
