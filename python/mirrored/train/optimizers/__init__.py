"""Keras 3's optimizers for distributed NumPy/CuPy training: ``SGD``, ``Adam``, ``AdamW``, ``RMSprop``,
``Adagrad``, ``Nadam``, ``Adamax``, ``Adadelta``, ``Lion``, ``Ftrl``, ``Lamb``, ``Adafactor``,
``ScheduleFreeAdamW`` and ``Muon``, with Keras' arguments (``weight_decay``, ``clipnorm``, ``clipvalue``,
``global_clipnorm``), ``build(var_list)`` and results; ``MultiOptimizer`` and ``OptimizerMap`` (variables routed
to optimizers by path, :mod:`.multi_optimizer`); ``get``, ``serialize`` and ``deserialize`` as Keras'.

``apply_gradients`` clips, sums the gradients across replicas in one fused all-reduce and
updates every variable and slot of a device in one fused, in-place update (:mod:`.base`).
The update rules are Keras' element-wise sequences (:mod:`.rules`); a learning rate is a
number, a schedule of :mod:`.schedules` (Keras' ``keras.optimizers.schedules``) or a callable of the
step (``iterations`` before the update, from 0), e.g. ``lambda step: 0.1 * 0.5 ** (step // 100)``.

The namespace holds Keras' names and two documented extras: ``rules`` (the update rules, the fused kernels'
reference) and ``sgd_update`` / ``adam_update`` (one step on copies of arrays).
"""

import numpy as _np

from . import rules, schedules
from .base import Optimizer
from .keras import (SGD, Adadelta, Adafactor, Adagrad, Adam, Adamax, AdamW, Ftrl, Lamb, Lion, Nadam, RMSprop,
                    ScheduleFreeAdamW)
from .multi_optimizer import MultiOptimizer, OptimizerMap
from .muon import Muon
from .serialization import deserialize, get, register_builtin as _register_builtin, serialize

_register_builtin(MultiOptimizer)  # get / serialize / deserialize know it by name, as Keras' do
del _register_builtin

# The modules behind the names above are no part of the namespace (`from .base import ...` still works).
del base, keras, multi_optimizer, muon, serialization, step_window  # noqa: F821  (bound by the imports above)

__all__ = [  # Keras' keras.optimizers names (LossScaleOptimizer: set by md.train), then ours
    "schedules", "Optimizer", "SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Nadam", "Adamax", "Adadelta", "Lion",
    "Ftrl", "Lamb", "Adafactor", "ScheduleFreeAdamW", "Muon", "LossScaleOptimizer", "MultiOptimizer",
    "OptimizerMap", "get", "serialize",
    "deserialize",
    "rules", "sgd_update", "adam_update",
]


def sgd_update(w, g, velocity, lr: float, momentum: float, nesterov: bool):
    """One Keras SGD step on copies of the arrays: ``(new w, new velocity)``; ``velocity`` is None without
    momentum. The arithmetic is in ``w``'s dtype, in Keras' order."""
    t = _np.asarray(w).dtype.type
    w = _np.array(w, copy=True)
    if velocity is None:
        rules.sgd(w, _np.asarray(g, w.dtype), (), (t(lr),))
        return w, None
    velocity = _np.array(velocity, dtype=w.dtype, copy=True)
    rule = rules.sgd_nesterov if nesterov else rules.sgd_momentum
    rule(w, _np.asarray(g, w.dtype), (velocity,), (t(lr), t(momentum)))
    return w, velocity


def adam_update(w, g, m, v, lr: float, beta_1: float, beta_2: float, epsilon: float, t: int):
    """One Keras Adam step at step ``t`` (from 1) on copies of the arrays: ``(new w, new m, new v)``."""
    w = _np.array(w, copy=True)
    m, v = _np.array(m, dtype=w.dtype, copy=True), _np.array(v, dtype=w.dtype, copy=True)
    opt = Adam.__new__(Adam)
    opt.beta_1, opt.beta_2, opt.epsilon = beta_1, beta_2, epsilon
    scalar = w.dtype.type
    rules.adam(w, _np.asarray(g, w.dtype), (m, v), opt._coefficients(scalar, scalar(lr), t - 1))
    return w, m, v
