"""Keras 3's optimizers: their arguments, defaults, slots and per-step scalars.

Each class names its slots (``_slot_specs``: Keras' names and initial values), checks
its arguments as Keras does, and computes, once per step and dtype, the scalars its
rule in :mod:`.rules` needs (``_coefficients``), in the variable's dtype and in the
order Keras' ``update_step`` computes them. The step itself (clipping, weight decay,
the all-reduce, the fused update) is the base class's.
"""

from __future__ import annotations

import numpy as np

from .rules import (ADADELTA, ADAFACTOR, ADAGRAD, ADAM, ADAM_AMSGRAD, ADAMAX, FTRL, LAMB, LION, NADAM, RMSPROP,
                    SCHEDULE_FREE_ADAMW, SGD as PLAIN_SGD, SGD_MOMENTUM, SGD_NESTEROV)
from .base import Optimizer, check_rate
from .step_window import MAX_ROWS

__all__ = ["SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Nadam", "Adamax", "Adadelta", "Lion", "Ftrl", "Lamb",
           "Adafactor", "ScheduleFreeAdamW"]


def _pow(base, exponent):
    return np.power(base, exponent)


def _cast(t, value: float):
    """Keras' ``ops.cast(value, dtype)`` of a Python float: TensorFlow makes it a float32 tensor first.
    (A Python float meeting a tensor in an operator converts to the tensor's dtype directly: ``t(value)``.)"""
    return t(np.float32(value))


class SGD(Optimizer):
    """Gradient descent with optional (Nesterov) momentum, as ``keras.optimizers.SGD``."""

    _config_keys = ("momentum", "nesterov")

    def __init__(self, learning_rate=0.01, momentum: float = 0.0, nesterov: bool = False, weight_decay=None,
                 clipnorm=None, clipvalue=None, global_clipnorm=None, name: str | None = None,
                 gradient_aggregation="sum", **kwargs):
        super().__init__(learning_rate, name, gradient_aggregation, weight_decay=weight_decay,
                         clipnorm=clipnorm, clipvalue=clipvalue, global_clipnorm=global_clipnorm, **kwargs)
        self.momentum = check_rate(momentum, "momentum", low=0.0, high=1.0, high_inclusive=True)
        if nesterov and self.momentum == 0.0:
            raise ValueError("nesterov=True needs momentum > 0 (e.g. momentum=0.9)")
        self.nesterov = bool(nesterov)
        self._slot_specs = (("momentum", 0.0),) if self.momentum else ()
        self._rule = (SGD_NESTEROV if self.nesterov else SGD_MOMENTUM) if self.momentum else PLAIN_SGD

    def _coefficients(self, t, lr, step):
        return (lr,) if not self.momentum else (lr, _cast(t, self.momentum))


class Adam(Optimizer):
    """Adam (Kingma & Ba, 2014), as ``keras.optimizers.Adam``; ``amsgrad=True`` adds the slot ``velocity_hat``
    (the largest velocity so far), by which the step divides."""

    _config_keys = ("beta_1", "beta_2", "epsilon", "amsgrad")

    _coefficients_use_step = True  # bias corrections (Nadam: the momentum schedule) follow the step

    _slot_specs = (("momentum", 0.0), ("velocity", 0.0))
    _slot_aliases = {"m": "momentum", "v": "velocity", "vhat": "velocity_hat"}  # tf.keras' legacy names
    _rule = ADAM

    def __init__(self, learning_rate=0.001, beta_1: float = 0.9, beta_2: float = 0.999, epsilon: float = 1e-7,
                 amsgrad: bool = False, weight_decay=None, clipnorm=None, clipvalue=None, global_clipnorm=None,
                 name: str | None = None, gradient_aggregation="sum", **kwargs):
        super().__init__(learning_rate, name, gradient_aggregation,
                         weight_decay=weight_decay, clipnorm=clipnorm, clipvalue=clipvalue,
                         global_clipnorm=global_clipnorm, **kwargs)
        self.amsgrad = bool(amsgrad)
        if self.amsgrad:
            # Keras' slot name: a checkpoint carries it as `velocity_hat`.
            self._slot_specs = Adam._slot_specs + (("velocity_hat", 0.0),)
            self._rule = ADAM_AMSGRAD
        self.beta_1 = check_rate(beta_1, "beta_1", low=0.0, high=1.0)
        self.beta_2 = check_rate(beta_2, "beta_2", low=0.0, high=1.0)
        self.epsilon = check_rate(epsilon, "epsilon")

    @property
    def _keras_slot_groups(self) -> tuple:
        # Keras builds momentum and velocity together, velocity_hat after them all.
        return (("momentum", "velocity"),) + ((("velocity_hat",),) if self.amsgrad else ())

    def _coefficients(self, t, lr, step):
        local_step = t(step + 1)
        beta_1_power = _pow(_cast(t, self.beta_1), local_step)
        beta_2_power = _pow(_cast(t, self.beta_2), local_step)
        alpha = lr * np.sqrt(t(1) - beta_2_power) / (t(1) - beta_1_power)
        return t(1 - self.beta_1), t(1 - self.beta_2), alpha, t(self.epsilon)


class AdamW(Adam):
    """Adam with decoupled weight decay (Loshchilov & Hutter), as ``keras.optimizers.AdamW``:
    Keras' Adam with ``weight_decay=0.004`` by default."""

    def __init__(self, learning_rate=0.001, weight_decay=0.004, beta_1: float = 0.9, beta_2: float = 0.999,
                 epsilon: float = 1e-7, amsgrad: bool = False, clipnorm=None, clipvalue=None, global_clipnorm=None,
                 name: str | None = None, gradient_aggregation="sum", **kwargs):
        if weight_decay is None:
            raise ValueError("Argument `weight_decay` must be a float. Received: weight_decay=None")
        super().__init__(learning_rate, beta_1, beta_2, epsilon, amsgrad, weight_decay=weight_decay,
                         clipnorm=clipnorm, clipvalue=clipvalue, global_clipnorm=global_clipnorm, name=name,
                         gradient_aggregation=gradient_aggregation, **kwargs)


class RMSprop(Optimizer):
    """RMSprop (Hinton), as ``keras.optimizers.RMSprop``: ``rho``, ``momentum``, ``centered``."""

    _config_keys = ("rho", "momentum", "epsilon", "centered")

    _rule = RMSPROP

    def __init__(self, learning_rate=0.001, rho: float = 0.9, momentum: float = 0.0, epsilon: float = 1e-7,
                 centered: bool = False, weight_decay=None, clipnorm=None, clipvalue=None, global_clipnorm=None,
                 name: str | None = None, gradient_aggregation="sum", **kwargs):
        super().__init__(learning_rate, name, gradient_aggregation, weight_decay=weight_decay,
                         clipnorm=clipnorm, clipvalue=clipvalue, global_clipnorm=global_clipnorm, **kwargs)
        self.rho = check_rate(rho, "rho", low=0.0, high=1.0, high_inclusive=True)
        self.momentum = check_rate(momentum, "momentum", low=0.0, high=1.0, high_inclusive=True)
        self.epsilon = check_rate(epsilon, "epsilon")
        self.centered = bool(centered)
        # The order rules.rmsprop reads them in: velocity, average_gradient, momentum.
        self._slot_specs = ((("velocity", 0.0),) + ((("average_gradient", 0.0),) if self.centered else ())
                            + ((("momentum", 0.0),) if self.momentum else ()))

    @property
    def _keras_slot_groups(self) -> tuple:
        # Keras builds all velocities, then momentums, then average gradients (the rule reads them in another order).
        return tuple((name,) for name in ("velocity", "momentum", "average_gradient") if name in self._slot_names)

    def _coefficients(self, t, lr, step):
        return (lr, t(self.rho), t(1 - self.rho), t(self.epsilon), t(self.momentum), t(self.centered))


class Adagrad(Optimizer):
    """Adagrad (Duchi et al., 2011), as ``keras.optimizers.Adagrad``."""

    _config_keys = ("initial_accumulator_value", "epsilon")

    _rule = ADAGRAD

    def __init__(self, learning_rate=0.001, initial_accumulator_value: float = 0.1, epsilon: float = 1e-7,
                 weight_decay=None, clipnorm=None, clipvalue=None, global_clipnorm=None, name: str | None = None,
                 gradient_aggregation="sum", **kwargs):
        super().__init__(learning_rate, name, gradient_aggregation, weight_decay=weight_decay,
                         clipnorm=clipnorm, clipvalue=clipvalue, global_clipnorm=global_clipnorm, **kwargs)
        self.initial_accumulator_value = check_rate(initial_accumulator_value, "initial_accumulator_value")
        self.epsilon = check_rate(epsilon, "epsilon")
        self._slot_specs = (("accumulator", self.initial_accumulator_value),)

    def _coefficients(self, t, lr, step):
        return lr, t(self.epsilon)


class Nadam(Optimizer):
    """Adam with Nesterov momentum (Dozat, 2015), as ``keras.optimizers.Nadam``.

    Keras keeps the running product of the momentum schedule (``u_product``) in a
    variable; here it is a function of ``iterations`` (recomputed after a restore),
    so checkpoints hold nothing beyond the slots and ``iterations``.
    """

    _config_keys = ("beta_1", "beta_2", "epsilon")

    _coefficients_use_step = True  # bias corrections (Nadam: the momentum schedule) follow the step

    _slot_specs = (("momentum", 0.0), ("velocity", 0.0))
    _rule = NADAM

    def __init__(self, learning_rate=0.001, beta_1: float = 0.9, beta_2: float = 0.999, epsilon: float = 1e-7,
                 weight_decay=None, clipnorm=None, clipvalue=None, global_clipnorm=None, name: str | None = None,
                 gradient_aggregation="sum", **kwargs):
        super().__init__(learning_rate, name, gradient_aggregation, weight_decay=weight_decay,
                         clipnorm=clipnorm, clipvalue=clipvalue, global_clipnorm=global_clipnorm, **kwargs)
        self.beta_1 = check_rate(beta_1, "beta_1", low=0.0, high=1.0)
        self.beta_2 = check_rate(beta_2, "beta_2", low=0.0, high=1.0)
        self.epsilon = check_rate(epsilon, "epsilon")
        # The products after the latest steps, {steps: value} in `_u_dtype`: a step whose scalars the GPU
        # selects asks for a few steps before the last one (step_window.py), each computed once.
        self._u_products, self._u_dtype = {}, None

    def _u_product_at(self, steps: int, dtype):
        """``u_product`` after ``steps`` updates, in the dtype of the first variable (Keras' choice)."""
        t = dtype.type
        if dtype != self._u_dtype:
            self._u_products, self._u_dtype = {}, dtype
        known = self._u_products
        value = known.get(steps)
        if value is not None:
            return value
        step = max((s for s in known if s < steps), default=0)
        value = known.get(step, t(1.0))
        while step < steps:
            step += 1
            value = value * t(self.beta_1) * (t(1.0) - t(0.5) * _pow(t(0.96), t(step)))
        known[steps] = value
        for old in [s for s in known if s < steps - 2 * MAX_ROWS]:
            del known[old]
        return value

    def _keras_scalars(self) -> dict:
        # Keras' `_u_product` variable (created at build, in the first variable's dtype): the product after the
        # updates so far.
        scalars = super()._keras_scalars()
        if self._slots and self._iterations is not None:
            dtype = np.dtype(next(iter(self._slots.values()))[0].dtype)
            scalars["_u_product"] = self._u_product_at(self._rule_step(int(self._iterations.numpy())), dtype)
        return scalars

    def _restore_keras_scalar(self, name: str, value) -> None:
        if name != "_u_product":
            super()._restore_keras_scalar(name, value)
            return
        # The product after the restored step count: later products continue from it, as Keras' variable does.
        self._u_products, self._u_dtype = {self._rule_step(int(self._iterations.numpy())): value}, value.dtype

    def _step_state(self, step: int, dtypes) -> None:
        self._u_product_now = self._u_product_at(step + 1, dtypes[0])

    def _coefficients(self, t, lr, step):
        beta_1, beta_2, decay = _cast(t, self.beta_1), _cast(t, self.beta_2), _cast(t, 0.96)
        u_t = beta_1 * (t(1.0) - t(0.5) * _pow(decay, t(step + 1)))
        u_t_1 = beta_1 * (t(1.0) - t(0.5) * _pow(decay, t(step + 2)))
        u_product_t = t(self._u_product_now)
        u_product_t_1 = u_product_t * u_t_1
        beta_2_power = _pow(beta_2, t(step + 1))
        return (lr, t(self.epsilon), t(1) - beta_1, t(1) - beta_2, u_t_1, t(1) - u_product_t_1, t(1) - u_t,
                t(1) - u_product_t, t(1) - beta_2_power)


class Adamax(Optimizer):
    """Adam with the infinity norm (Kingma & Ba, 2014, section 7), as ``keras.optimizers.Adamax``: slots
    ``momentum`` and ``norm`` (the decayed largest |gradient|)."""

    _config_keys = ("beta_1", "beta_2", "epsilon")

    _coefficients_use_step = True  # the bias correction 1 - beta_1^t
    _slot_specs = (("momentum", 0.0), ("norm", 0.0))
    _rule = ADAMAX

    def __init__(self, learning_rate=0.001, beta_1: float = 0.9, beta_2: float = 0.999, epsilon: float = 1e-7,
                 weight_decay=None, clipnorm=None, clipvalue=None, global_clipnorm=None, name: str | None = None,
                 gradient_aggregation="sum", **kwargs):
        super().__init__(learning_rate, name, gradient_aggregation, weight_decay=weight_decay,
                         clipnorm=clipnorm, clipvalue=clipvalue, global_clipnorm=global_clipnorm, **kwargs)
        self.beta_1 = check_rate(beta_1, "beta_1", low=0.0, high=1.0)
        self.beta_2 = check_rate(beta_2, "beta_2", low=0.0, high=1.0, high_inclusive=True)
        self.epsilon = check_rate(epsilon, "epsilon")

    def _coefficients(self, t, lr, step):
        beta_1_power = _pow(_cast(t, self.beta_1), t(step + 1))
        return t(1 - self.beta_1), t(self.beta_2), lr, t(1) - beta_1_power, t(self.epsilon)


class Adadelta(Optimizer):
    """Adadelta (Zeiler, 2012), as ``keras.optimizers.Adadelta``: slots ``accumulated_grad`` and
    ``accumulated_delta_var``; Keras' default ``learning_rate`` is 0.001 (the paper's 1.0 is ``learning_rate=1.0``)."""

    _config_keys = ("rho", "epsilon")

    _slot_specs = (("accumulated_grad", 0.0), ("accumulated_delta_var", 0.0))
    _rule = ADADELTA

    def __init__(self, learning_rate=0.001, rho: float = 0.95, epsilon: float = 1e-7, weight_decay=None,
                 clipnorm=None, clipvalue=None, global_clipnorm=None, name: str | None = None,
                 gradient_aggregation="sum", **kwargs):
        super().__init__(learning_rate, name, gradient_aggregation, weight_decay=weight_decay,
                         clipnorm=clipnorm, clipvalue=clipvalue, global_clipnorm=global_clipnorm, **kwargs)
        self.rho = check_rate(rho, "rho", low=0.0, high=1.0, high_inclusive=True)
        self.epsilon = check_rate(epsilon, "epsilon")

    def _coefficients(self, t, lr, step):
        return lr, t(self.rho), t(1 - self.rho), t(self.epsilon)


class Lion(Optimizer):
    """Lion (Chen et al., 2023, "Symbolic Discovery of Optimization Algorithms"), as ``keras.optimizers.Lion``:
    the sign of an interpolated momentum; slot ``momentum``."""

    _config_keys = ("beta_1", "beta_2")

    _slot_specs = (("momentum", 0.0),)
    _rule = LION

    def __init__(self, learning_rate=0.001, beta_1: float = 0.9, beta_2: float = 0.99, weight_decay=None,
                 clipnorm=None, clipvalue=None, global_clipnorm=None, name: str | None = None,
                 gradient_aggregation="sum", **kwargs):
        super().__init__(learning_rate, name, gradient_aggregation, weight_decay=weight_decay,
                         clipnorm=clipnorm, clipvalue=clipvalue, global_clipnorm=global_clipnorm, **kwargs)
        if isinstance(beta_1, (int, float)) and not isinstance(beta_1, bool) and (beta_1 <= 0 or beta_1 > 1):
            raise ValueError("Argument `beta_1` must be in the [0, 1] range. Otherwise, the optimizer degenerates "
                             f"to SignSGD. Received: beta_1={beta_1}.")
        self.beta_1 = check_rate(beta_1, "beta_1", low=0.0, high=1.0, high_inclusive=True)
        self.beta_2 = check_rate(beta_2, "beta_2", low=0.0, high=1.0, high_inclusive=True)

    def _coefficients(self, t, lr, step):
        beta_1, beta_2 = _cast(t, self.beta_1), _cast(t, self.beta_2)
        return lr, beta_1, t(1.0) - beta_1, beta_2, t(1.0) - beta_2


class Ftrl(Optimizer):
    """FTRL-Proximal (McMahan et al., 2013), as ``keras.optimizers.Ftrl``: slots ``accumulator`` (starting at
    ``initial_accumulator_value``) and ``linear``; L1, L2 and L2-shrinkage regularization and ``beta``."""

    _config_keys = ("learning_rate_power", "initial_accumulator_value", "l1_regularization_strength",
                    "l2_regularization_strength", "l2_shrinkage_regularization_strength", "beta")

    _rule = FTRL

    def __init__(self, learning_rate=0.001, learning_rate_power: float = -0.5,
                 initial_accumulator_value: float = 0.1, l1_regularization_strength: float = 0.0,
                 l2_regularization_strength: float = 0.0, l2_shrinkage_regularization_strength: float = 0.0,
                 beta: float = 0.0, weight_decay=None, clipnorm=None, clipvalue=None, global_clipnorm=None,
                 name: str | None = None, gradient_aggregation="sum", **kwargs):
        super().__init__(learning_rate, name, gradient_aggregation, weight_decay=weight_decay,
                         clipnorm=clipnorm, clipvalue=clipvalue, global_clipnorm=global_clipnorm, **kwargs)
        self.learning_rate_power = check_rate(learning_rate_power, "learning_rate_power", low=-float("inf"),
                                              high=0.0, high_inclusive=True)
        self.initial_accumulator_value = check_rate(initial_accumulator_value, "initial_accumulator_value")
        self.l1_regularization_strength = check_rate(l1_regularization_strength, "l1_regularization_strength")
        self.l2_regularization_strength = check_rate(l2_regularization_strength, "l2_regularization_strength")
        self.l2_shrinkage_regularization_strength = check_rate(l2_shrinkage_regularization_strength,
                                                               "l2_shrinkage_regularization_strength")
        self.beta = check_rate(beta, "beta")
        self._slot_specs = (("accumulator", self.initial_accumulator_value), ("linear", 0.0))

    def _coefficients(self, t, lr, step):
        # Keras: l2_reg + beta / (2.0 * lr) with lr a tensor, in the variable's dtype; the other products are of
        # Python floats, cast once.
        with np.errstate(divide="ignore", invalid="ignore"):  # learning rate 0: inf or NaN, as in Keras
            l2_reg = t(self.l2_regularization_strength) + t(self.beta) / (t(2.0) * lr)
        return (lr, t(-self.learning_rate_power), t(2 * self.l2_shrinkage_regularization_strength), t(2) * l2_reg,
                t(self.l1_regularization_strength))


class Lamb(Optimizer):
    """LAMB (You et al., 2019), as ``keras.optimizers.Lamb``: Adam's moments (slots ``momentum`` and
    ``velocity``), each variable's step scaled by the trust ratio ``|w| / |step|``. The ratio needs the norms of
    whole variables: the fused update takes them in two passes on host and four launches per GPU and dtype
    (csrc/core/lamb.h), whatever the number of variables."""

    _config_keys = ("beta_1", "beta_2", "epsilon")
    _coefficients_use_step = True  # the bias corrections 1 - beta^t
    _slot_specs = (("momentum", 0.0), ("velocity", 0.0))
    _rule = LAMB

    def __init__(self, learning_rate=0.001, beta_1: float = 0.9, beta_2: float = 0.999, epsilon: float = 1e-7,
                 weight_decay=None, clipnorm=None, clipvalue=None, global_clipnorm=None, name: str | None = None,
                 gradient_aggregation="sum", **kwargs):
        super().__init__(learning_rate, name, gradient_aggregation, weight_decay=weight_decay,
                         clipnorm=clipnorm, clipvalue=clipvalue, global_clipnorm=global_clipnorm, **kwargs)
        self.beta_1 = check_rate(beta_1, "beta_1", low=0.0, high=1.0)
        self.beta_2 = check_rate(beta_2, "beta_2", low=0.0, high=1.0)
        self.epsilon = check_rate(epsilon, "epsilon")

    @property
    def _keras_slot_groups(self) -> tuple:
        return (("momentum", "velocity"),)

    def _coefficients(self, t, lr, step):
        local_step = t(step + 1)
        beta_1_power = _pow(_cast(t, self.beta_1), local_step)
        beta_2_power = _pow(_cast(t, self.beta_2), local_step)
        return (t(1 - self.beta_1), t(1 - self.beta_2), lr, t(1.0) - beta_1_power, t(1.0) - beta_2_power,
                t(self.epsilon))


class Adafactor(Optimizer):
    """Adafactor (Shazeer & Stern, 2018), as ``keras.optimizers.Adafactor``: for a variable of 2 or more
    dimensions the second moments are factored over its last two axes, slots ``r`` (shape ``var.shape[:-1]``)
    and ``c`` (``var.shape[:-2] + var.shape[-1:]``); every variable has ``velocity`` (its shape). Keras gives a
    variable of fewer dimensions int32 scalars as ``r`` and ``c``, and so does this (checkpoints hold them).

    The learning rate is capped at ``1 / sqrt(step)`` (``relative_step`` changes nothing in Keras 3.15: the
    cap applies either way) and scaled by ``max(epsilon_2, rms(w))``. The fused update takes it: six phases over
    every variable of a device and dtype (one launch each on a GPU), see docs/training.md."""

    _config_keys = ("beta_2_decay", "epsilon_1", "epsilon_2", "clip_threshold", "relative_step")
    _coefficients_use_step = True  # rho_t and beta_2_t follow the step
    _slot_specs = (("r", 0.0), ("c", 0.0), ("velocity", 0.0))
    _rule = ADAFACTOR

    def __init__(self, learning_rate=0.001, beta_2_decay: float = -0.8, epsilon_1: float = 1e-30,
                 epsilon_2: float = 1e-3, clip_threshold: float = 1.0, relative_step: bool = True,
                 weight_decay=None, clipnorm=None, clipvalue=None, global_clipnorm=None, name: str | None = None,
                 gradient_aggregation="sum", **kwargs):
        super().__init__(learning_rate, name, gradient_aggregation, weight_decay=weight_decay,
                         clipnorm=clipnorm, clipvalue=clipvalue, global_clipnorm=global_clipnorm, **kwargs)
        self.beta_2_decay = check_rate(beta_2_decay, "beta_2_decay", low=-float("inf"))
        self.epsilon_1 = check_rate(epsilon_1, "epsilon_1")
        self.epsilon_2 = check_rate(epsilon_2, "epsilon_2")
        self.clip_threshold = _positive(clip_threshold, "clip_threshold")
        self.relative_step = bool(relative_step)

    @property
    def _keras_slot_groups(self) -> tuple:
        return (("r", "c", "velocity"),)

    def _slot_shape(self, name: str, var) -> tuple:
        shape = tuple(var.shape)
        if name not in ("r", "c"):  # velocity, and Keras' average and gradient accumulator
            return super()._slot_shape(name, var)
        if len(shape) < 2:
            return (), np.int32
        return (shape[:-1] if name == "r" else shape[:-2] + shape[-1:]), var.dtype

    def _coefficients(self, t, lr, step):
        local_step = t(step + 1)
        rho_t = np.minimum(lr, t(1) / np.sqrt(local_step))
        beta_2_t = t(1) - _pow(local_step, t(self.beta_2_decay))
        return rho_t, t(self.epsilon_2), t(self.epsilon_1), beta_2_t, t(1) - beta_2_t, t(self.clip_threshold)


class ScheduleFreeAdamW(Optimizer):
    """Schedule-Free AdamW (Defazio et al., 2024), as ``keras.optimizers.ScheduleFreeAdamW``: no learning-rate
    schedule, an average of the iterates instead. The variable holds y, where the gradient is taken (between
    the Adam-style sequence z and its running average x); slot ``momentum`` holds z (a copy of the variable
    at build, as Keras' build assigns it) and ``velocity`` Adam's second moment. x is not kept: each step
    recovers it from y and z, averages it towards z with weight ``1 / t`` and sets ``y = (1 - beta_1) * z +
    beta_1 * x``. ``warmup_steps`` > 0 ramps the learning rate linearly over the first steps
    (``lr * min(t / warmup_steps, 1)``, ``t`` the update's number from 1); weight decay is Keras' decoupled
    one, at the learning rate without the ramp.

    Keras 3.15 keeps nothing else (no running learning-rate maximum or weight sums: the average's weight is
    ``1 / t``) and swaps nothing for evaluation: the variable holds y throughout, as in Keras. The update is
    element-wise, so it is one fused update per device and dtype like Adam's."""

    _config_keys = ("beta_1", "beta_2", "epsilon", "warmup_steps")
    _coefficients_use_step = True  # the bias correction, the average's weight 1 / t and the warmup follow t
    _slot_specs = (("momentum", 0.0), ("velocity", 0.0))
    _rule = SCHEDULE_FREE_ADAMW

    def __init__(self, learning_rate=0.0025, beta_1: float = 0.9, beta_2: float = 0.999, epsilon: float = 1e-8,
                 warmup_steps: int = 0, weight_decay=None, clipnorm=None, clipvalue=None, global_clipnorm=None,
                 use_ema=False, ema_momentum=0.99, ema_overwrite_frequency=None, loss_scale_factor=None,
                 gradient_accumulation_steps=None, name: str | None = None, gradient_aggregation="sum", **kwargs):
        super().__init__(learning_rate, name, gradient_aggregation, weight_decay=weight_decay,
                         clipnorm=clipnorm, clipvalue=clipvalue, global_clipnorm=global_clipnorm, use_ema=use_ema,
                         ema_momentum=ema_momentum, ema_overwrite_frequency=ema_overwrite_frequency,
                         loss_scale_factor=loss_scale_factor,
                         gradient_accumulation_steps=gradient_accumulation_steps, **kwargs)
        # beta_1 divides (x is recovered as (y - (1 - beta_1) * z) / beta_1): 0 would make every weight NaN.
        self.beta_1 = _positive(check_rate(beta_1, "beta_1", low=0.0, high=1.0, high_inclusive=True), "beta_1")
        # beta_2 = 1 makes the bias correction 1 - beta_2^t zero, a division by it NaN.
        self.beta_2 = check_rate(beta_2, "beta_2", low=0.0, high=1.0)
        self.epsilon = check_rate(epsilon, "epsilon")
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, (int, float, np.integer, np.floating)) \
                or not np.isfinite(warmup_steps) or warmup_steps < 0:
            raise ValueError(f"warmup_steps={warmup_steps!r}: expected a number of steps >= 0 (0: no warmup)")
        self.warmup_steps = int(warmup_steps) if isinstance(warmup_steps, np.integer) else warmup_steps

    def _slot_initial_value(self, name, initial, var, shape, dtype):
        if name != "momentum":
            return super()._slot_initial_value(name, initial, var, shape, dtype)
        return np.array(var.numpy(), dtype).reshape(shape)  # z starts at the variable (Keras' build)

    def _coefficients(self, t, lr, step):
        local_step = t(step + 1)
        beta_1, beta_2 = _cast(t, self.beta_1), _cast(t, self.beta_2)
        if self.warmup_steps > 0:
            # Keras: ops.cast(warmup_steps, dtype), an int exactly, a float through float32
            warmup = t(self.warmup_steps) if isinstance(self.warmup_steps, int) else _cast(t, self.warmup_steps)
            lr = lr * np.minimum(local_step / warmup, t(1.0))
        weight = t(1.0) / local_step
        return (lr, t(1) - beta_2, t(1) - _pow(beta_2, local_step), _cast(t, self.epsilon), t(1) - beta_1, beta_1,
                t(1) - weight, weight)


def _positive(value, argument: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)) or not value > 0:
        raise ValueError(f"{argument}={value!r}: expected a number > 0")
    return float(value)
