"""Keras 3's learning-rate schedules (``keras.optimizers.schedules``): the same classes, arguments,
defaults, values and configs.

A schedule is a callable of the step; an optimizer given one as ``learning_rate`` calls it once per
step with ``iterations`` before the update (from 0), never per variable or device. Keras computes a
schedule in the dtype of ``initial_learning_rate`` (float32 for a Python number), casting the step and
every argument to it: so do these, with NumPy float32 scalars, so the learning rate an update uses is
Keras' to float32 rounding.
"""

import math as _math

import numpy as _np

__all__ = ["LearningRateSchedule", "ExponentialDecay", "PiecewiseConstantDecay", "PolynomialDecay",
           "InverseTimeDecay", "CosineDecay", "CosineDecayRestarts", "serialize", "deserialize"]


def _float(value):
    """``value`` as Keras' ``convert_to_tensor`` makes it: a Python number is float32, a NumPy scalar keeps its
    float dtype."""
    if isinstance(value, (_np.floating, _np.ndarray)) and _np.asarray(value).dtype.kind == "f":
        return _np.asarray(value)[()]
    return _np.float32(value)


def _check_steps(value, argument: str):
    if isinstance(value, bool) or not isinstance(value, (int, float, _np.integer, _np.floating)):
        raise TypeError(f"Argument `{argument}` must be a number of steps. Received: {argument}={value!r}")
    if value <= 0:
        raise ValueError(f"Argument `{argument}` must be > 0. Received: {argument}={value}")
    return value


def _step(step, t):
    """The step cast to the schedule's dtype (Keras: ``ops.cast(step, dtype)``); a variable gives its value."""
    if hasattr(step, "numpy"):
        step = step.numpy()
    return t(_np.asarray(step).item())


class LearningRateSchedule:
    """The base of every schedule: ``__call__(step)`` gives the learning rate at ``step``, ``get_config()`` the
    arguments ``from_config`` rebuilds it from. Subclass it for a schedule of your own."""

    def __call__(self, step):
        raise NotImplementedError(f"Learning rate schedule '{type(self).__name__}' must override "
                                  "`__call__(self, step)`.")

    def get_config(self):
        raise NotImplementedError(f"Learning rate schedule '{type(self).__name__}' must override `get_config()` "
                                  "in order to be serializable.")

    @classmethod
    def from_config(cls, config):
        return cls(**config)

    def __repr__(self) -> str:
        try:
            arguments = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        except NotImplementedError:
            arguments = ""
        return f"{type(self).__name__}({arguments})"


class _DecayOverSteps(LearningRateSchedule):
    """What ExponentialDecay and InverseTimeDecay share: Keras' five arguments, and the progress
    ``step / decay_steps`` (floored with ``staircase``) in the learning rate's dtype."""

    def __init__(self, initial_learning_rate, decay_steps, decay_rate, staircase, name):
        self.initial_learning_rate = initial_learning_rate
        self.decay_steps = _check_steps(decay_steps, "decay_steps")
        self.decay_rate = decay_rate
        self.staircase = staircase
        self.name = name

    def _progress(self, step):
        """``(the initial rate, its scalar type, the progress)``."""
        lr = _float(self.initial_learning_rate)
        t = lr.dtype.type
        p = _step(step, t) / t(self.decay_steps)
        return lr, t, _np.floor(p) if self.staircase else p

    def get_config(self):
        return {"initial_learning_rate": self.initial_learning_rate, "decay_steps": self.decay_steps,
                "decay_rate": self.decay_rate, "staircase": self.staircase, "name": self.name}


class ExponentialDecay(_DecayOverSteps):
    """``initial_learning_rate * decay_rate ** (step / decay_steps)`` (the exponent floored with ``staircase``)."""

    def __init__(self, initial_learning_rate, decay_steps, decay_rate, staircase=False, name="ExponentialDecay"):
        super().__init__(initial_learning_rate, decay_steps, decay_rate, staircase, name)

    def __call__(self, step):
        lr, t, p = self._progress(step)
        return lr * _np.power(t(self.decay_rate), p)


class PiecewiseConstantDecay(LearningRateSchedule):
    """``values[0]`` up to and including ``boundaries[0]``, ``values[i]`` in ``(boundaries[i-1], boundaries[i]]``,
    ``values[-1]`` after the last boundary."""

    def __init__(self, boundaries, values, name="PiecewiseConstant"):
        if len(boundaries) != len(values) - 1:
            raise ValueError("The length of boundaries should be 1 less than the length of values. Received: "
                             f"boundaries={boundaries} of length {len(boundaries)}, and values={values} "
                             f"of length {len(values)}.")
        if not len(boundaries):
            raise ValueError("Argument `boundaries` needs at least one step. Received: boundaries=[] "
                             "(for a constant rate pass a number as `learning_rate`)")
        self.boundaries = boundaries
        self.values = values
        self.name = name

    def __call__(self, step):
        values = [_float(v) if isinstance(v, float) else _np.asarray(v)[()] for v in self.values]
        step = step.numpy() if hasattr(step, "numpy") else step
        step = _np.asarray(step)[()]
        # Keras casts each boundary to the step's dtype and sums value * (step in its interval).
        boundaries = [step.dtype.type(b) for b in self.boundaries]
        t = values[0].dtype.type
        result = t(0) + t(step <= boundaries[0]) * values[0]
        result += t(step > boundaries[-1]) * values[-1]
        for low, high, value in zip(boundaries[:-1], boundaries[1:], values[1:-1]):
            result += t((step > low) & (step <= high)) * value
        return t(result)

    def get_config(self):
        return {"boundaries": self.boundaries, "values": self.values, "name": self.name}


class PolynomialDecay(LearningRateSchedule):
    """From ``initial_learning_rate`` to ``end_learning_rate`` over ``decay_steps`` along ``(1 - p) ** power``;
    with ``cycle`` the decay restarts over a multiple of ``decay_steps`` instead of staying at the end."""

    def __init__(self, initial_learning_rate, decay_steps, end_learning_rate=0.0001, power=1.0, cycle=False,
                 name="PolynomialDecay"):
        self.initial_learning_rate = initial_learning_rate
        self.decay_steps = _check_steps(decay_steps, "decay_steps")
        self.end_learning_rate = end_learning_rate
        self.power = power
        self.cycle = cycle
        self.name = name

    def __call__(self, step):
        lr = _float(self.initial_learning_rate)
        t = lr.dtype.type
        end, power = t(self.end_learning_rate), t(self.power)
        step, decay_steps = _step(step, t), t(self.decay_steps)
        if self.cycle:
            multiplier = t(1.0) if step == 0 else _np.ceil(step / t(self.decay_steps))
            decay_steps = decay_steps * multiplier
        else:
            step = _np.minimum(step, decay_steps)
        p = step / decay_steps
        return (lr - end) * _np.power(t(1) - p, power) + end

    def get_config(self):
        return {"initial_learning_rate": self.initial_learning_rate, "decay_steps": self.decay_steps,
                "end_learning_rate": self.end_learning_rate, "power": self.power, "cycle": self.cycle,
                "name": self.name}


class InverseTimeDecay(_DecayOverSteps):
    """``initial_learning_rate / (1 + decay_rate * step / decay_steps)`` (the ratio floored with ``staircase``)."""

    def __init__(self, initial_learning_rate, decay_steps, decay_rate, staircase=False, name="InverseTimeDecay"):
        super().__init__(initial_learning_rate, decay_steps, decay_rate, staircase, name)

    def __call__(self, step):
        lr, t, p = self._progress(step)
        return lr / (t(1) + t(self.decay_rate) * p)


def _cosine(fraction, t):
    """``0.5 * (1 + cos(pi * fraction))`` in dtype ``t``, Keras' order."""
    return t(0.5) * (t(1.0) + _np.cos(t(_math.pi) * fraction))


class CosineDecay(LearningRateSchedule):
    """Cosine decay (Loshchilov & Hutter's SGDR without restarts) from ``initial_learning_rate`` to
    ``alpha * initial_learning_rate`` over ``decay_steps``; with ``warmup_target``, first a linear warmup from
    ``initial_learning_rate`` to ``warmup_target`` over ``warmup_steps``, then the decay from the target."""

    def __init__(self, initial_learning_rate, decay_steps, alpha=0.0, name="CosineDecay", warmup_target=None,
                 warmup_steps=0):
        self.initial_learning_rate = initial_learning_rate
        self.decay_steps = _check_steps(decay_steps, "decay_steps")
        self.alpha = alpha
        self.name = name
        self.warmup_steps = warmup_steps
        self.warmup_target = warmup_target

    def _decay(self, step, decay_steps, decay_from, t):
        decayed = t(1 - self.alpha) * _cosine(step / decay_steps, t) + t(self.alpha)
        return decay_from * decayed

    def __call__(self, step):
        lr = _float(self.initial_learning_rate)
        t = lr.dtype.type
        decay_steps, step = t(self.decay_steps), _step(step, t)
        if self.warmup_target is None:
            return self._decay(_np.minimum(step, decay_steps), decay_steps, lr, t)
        target, warmup_steps = t(self.warmup_target), t(self.warmup_steps)
        step = _np.minimum(step, decay_steps + warmup_steps)
        if step < warmup_steps:
            return (target - lr) * (step / warmup_steps) + lr
        return self._decay(step - warmup_steps, decay_steps, target, t)

    def get_config(self):
        return {"initial_learning_rate": self.initial_learning_rate, "decay_steps": self.decay_steps,
                "alpha": self.alpha, "name": self.name, "warmup_target": self.warmup_target,
                "warmup_steps": self.warmup_steps}


class CosineDecayRestarts(LearningRateSchedule):
    """Cosine decay with warm restarts (SGDR): the first period lasts ``first_decay_steps``, each next one
    ``t_mul`` times longer and starting from ``m_mul`` times the previous initial rate; ``alpha`` is the floor
    as a fraction of the initial rate."""

    def __init__(self, initial_learning_rate, first_decay_steps, t_mul=2.0, m_mul=1.0, alpha=0.0, name="SGDRDecay"):
        self.initial_learning_rate = initial_learning_rate
        self.first_decay_steps = _check_steps(first_decay_steps, "first_decay_steps")
        self._t_mul = t_mul
        self._m_mul = m_mul
        self.alpha = alpha
        self.name = name

    def __call__(self, step):
        lr = _float(self.initial_learning_rate)
        t = lr.dtype.type
        alpha, t_mul, m_mul = t(self.alpha), t(self._t_mul), t(self._m_mul)
        fraction = _step(step, t) / t(self.first_decay_steps)
        if t_mul == t(1.0):
            i_restart = _np.floor(fraction)
            fraction = fraction - i_restart
        else:
            i_restart = _np.floor(_np.log(t(1.0) - fraction * (t(1.0) - t_mul)) / _np.log(t_mul))
            sum_r = (t(1.0) - _np.power(t_mul, i_restart)) / (t(1.0) - t_mul)
            fraction = (fraction - sum_r) / _np.power(t_mul, i_restart)
        cosine = t(0.5) * _np.power(m_mul, i_restart) * (t(1.0) + _np.cos(t(_math.pi) * fraction))
        return lr * ((t(1) - alpha) * cosine + alpha)

    def get_config(self):
        return {"initial_learning_rate": self.initial_learning_rate, "first_decay_steps": self.first_decay_steps,
                "t_mul": self._t_mul, "m_mul": self._m_mul, "alpha": self.alpha, "name": self.name}


_SCHEDULES = {cls.__name__: cls for cls in (ExponentialDecay, PiecewiseConstantDecay, PolynomialDecay,
                                            InverseTimeDecay, CosineDecay, CosineDecayRestarts)}
_MODULE = "keras.optimizers.schedules"


def serialize(learning_rate_schedule):
    """A schedule as Keras 3's serialized dict: ``{"module", "class_name", "config", "registered_name"}``."""
    if not isinstance(learning_rate_schedule, LearningRateSchedule):
        raise TypeError("serialize() takes a LearningRateSchedule. Received: "
                        f"learning_rate_schedule={learning_rate_schedule!r}")
    cls = type(learning_rate_schedule)
    builtin = _SCHEDULES.get(cls.__name__) is cls
    return {"module": _MODULE if builtin else cls.__module__, "class_name": cls.__name__,
            "config": learning_rate_schedule.get_config(),
            "registered_name": None if builtin else cls.__name__}


def deserialize(config, custom_objects=None):
    """The schedule of a ``serialize`` dict (or of ``{"class_name", "config"}``); ``custom_objects`` maps the
    names of schedules of your own to their classes."""
    if not isinstance(config, dict) or "class_name" not in config or "config" not in config:
        raise ValueError("deserialize() takes a dict with 'class_name' and 'config' (what serialize() returns). "
                         f"Received: config={config!r}")
    name = config["class_name"]
    classes = {**_SCHEDULES, **(custom_objects or {})}
    registered = config.get("registered_name")
    cls = classes.get(registered) or classes.get(name)
    if cls is None:
        raise ValueError(f"Unknown decay: '{name}'. Please ensure you are using a "
                         "`keras.utils.custom_object_scope` and that this object is included in the scope, "
                         "or pass it in `custom_objects`.")
    return cls.from_config(config["config"])
