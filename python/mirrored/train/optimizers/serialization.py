"""``get``, ``serialize`` and ``deserialize``: Keras 3's ``keras.optimizers`` functions for md's optimizers.

A serialized optimizer is Keras' dict ``{"module", "class_name", "config", "registered_name"}`` with the
optimizer's ``get_config()``; a built-in class is found by its name in any case (``"adam"``, ``"ADAM"``,
``"AdamW"``, ``"rmsprop"``), as Keras' ``deserialize`` looks it up. Only the arguments travel, no state.
"""

from __future__ import annotations

from .base import Optimizer
from .keras import (SGD, Adadelta, Adafactor, Adagrad, Adam, Adamax, AdamW, Ftrl, Lamb, Lion, Nadam, RMSprop,
                    ScheduleFreeAdamW)
from .muon import Muon

_OPTIMIZERS = (SGD, Adam, AdamW, RMSprop, Adagrad, Nadam, Adamax, Adadelta, Lion, Ftrl, Lamb, Adafactor,
               ScheduleFreeAdamW, Muon)

_MODULE = "keras.optimizers"

# Classes besides the optimizers of .keras that get / deserialize know by name: md.train registers
# LossScaleOptimizer (md.mixed_precision imports this package, so this module does not import it).
_REGISTERED: list = []


def register_builtin(cls) -> None:
    """Make ``cls`` a built-in of ``get`` / ``serialize`` / ``deserialize`` (module ``keras.optimizers``)."""
    if cls not in _REGISTERED:
        _REGISTERED.append(cls)


def _builtins() -> dict:
    """``lower-case class name -> class`` of the built-in optimizers (Keras' ``ALL_OBJECTS_DICT``)."""
    classes = [*_OPTIMIZERS, *_REGISTERED]
    return {cls.__name__.lower(): cls for cls in classes}


def _optimizer_types() -> tuple:
    return (Optimizer, *_REGISTERED)


def _class_of(config: dict, custom_objects):
    """The class a serialized dict names: ``custom_objects``' by its registered or class name, else a built-in
    one by its class name in any case; None when none is known."""
    custom = custom_objects or {}
    name = config["class_name"]
    for key in (config.get("registered_name"), name):
        if key is not None and key in custom:
            return custom[key]
    return _builtins().get(name.lower()) if isinstance(name, str) else None


def serialize(optimizer):
    """``optimizer`` (an md optimizer or LossScaleOptimizer) as Keras 3's serialized dict; None and a string
    (an optimizer's name) come back as they are, as Keras' do."""
    if optimizer is None or isinstance(optimizer, str):
        return optimizer
    if not isinstance(optimizer, _optimizer_types()):
        raise TypeError(f"optimizer={optimizer!r}: expected an optimizer (e.g. md.optimizers.Adam()) to serialize")
    cls = type(optimizer)
    builtin = _builtins().get(cls.__name__.lower()) is cls
    return {"module": _MODULE if builtin else cls.__module__, "class_name": cls.__name__,
            "config": optimizer.get_config(), "registered_name": None if builtin else cls.__name__}


def deserialize(config, custom_objects=None):
    """The optimizer of a serialized dict (``serialize``'s, or ``{"class_name": ..., "config": {...}}``, the
    config optional); ``custom_objects`` maps the names of optimizer (and schedule) classes of your own to
    them. A new optimizer, without state."""
    if not isinstance(config, dict) or "class_name" not in config:
        raise ValueError("config: expected a dict with 'class_name' and 'config' (what "
                         f"md.optimizers.serialize returns). Received: config={config!r}")
    cls = _class_of(config, custom_objects)
    if cls is None:
        raise ValueError(f"Unknown optimizer: {config['class_name']!r} (config={config!r}). Use one of "
                         f"{sorted(_builtins())} in any case, or pass your class in custom_objects")
    arguments = config.get("config", {})
    if not isinstance(arguments, dict):
        raise ValueError(f"config['config']={arguments!r}: expected the dict of the optimizer's arguments "
                         "(its get_config())")
    return cls.from_config(arguments, custom_objects=custom_objects)


def get(identifier):
    """An optimizer from ``identifier``: a name (``"adam"``, ``"SGD"``, any case) gives one with the default
    arguments, a dict one of its config (``deserialize``), an optimizer comes back as it is, None is None.
    Anything else is a ValueError naming it, as Keras'."""
    if identifier is None:
        return None
    if isinstance(identifier, (dict, str)):
        config = identifier if isinstance(identifier, dict) else {"class_name": identifier, "config": {}}
        if not isinstance(config.get("class_name"), str) or _class_of(config, None) is None:
            raise ValueError(f"Could not interpret optimizer identifier: {identifier}")
        identifier = deserialize(config)
    if isinstance(identifier, _optimizer_types()):
        return identifier
    raise ValueError(f"Could not interpret optimizer identifier: {identifier}")
