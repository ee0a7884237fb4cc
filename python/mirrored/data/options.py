"""``tf.data.Options``: every option TF 2.21 has, type-checked and merged as tf.data does.

What md.data acts on: ``deterministic`` (``map``/``interleave``/``batch`` with
``num_parallel_calls``), ``experimental_distribute.auto_shard_policy``
(distributed input), ``threading.private_threadpool_size`` (the most threads
one parallel transformation uses) and ``autotune.enabled`` (``False``:
``AUTOTUNE`` parallelism stays at its first value). The others tune TF's graph
rewrites and runtime; they are kept, compared and merged so ported code runs
unchanged, and do nothing here (docs/data.md lists them).
"""

from __future__ import annotations

import enum
import logging


class ExternalStatePolicy(enum.Enum):
    """``tf.data.experimental.ExternalStatePolicy`` (how TF serializes stateful functions; no effect here)."""

    WARN = 0
    IGNORE = 1
    FAIL = 2


class AutotuneAlgorithm(enum.Enum):
    """``tf.data.experimental.AutotuneAlgorithm`` (TF's tuner; md.data's AUTOTUNE has one, see docs/data.md)."""

    DEFAULT = 0
    HILL_CLIMB = 1
    GRADIENT_DESCENT = 2
    MAX_PARALLELISM = 3
    STAGE_BASED = 4


class _Option:
    """One type-checked option of an :class:`OptionsBase` (``None`` until set, or ``default()``)."""

    def __init__(self, types, default=None):
        self.types, self.default = types, default

    def __set_name__(self, owner, name):
        self.name = name.lstrip("_")  # (an option behind a property of its own is stored under its public name)

    def __get__(self, options, owner=None):
        if options is None:
            return self
        if self.name not in options._options:
            options._options[self.name] = None if self.default is None else self.default()
        return options._options[self.name]

    def __set__(self, options, value):
        options._check_mutable()
        if not isinstance(value, self.types):
            raise TypeError(f'Property "{self.name}" must be of type {self.types}, got: {value!r} '
                            f"(type: {type(value)})")
        options._options[self.name] = value


class OptionsBase:
    """A set of options (``tf.data``'s ``OptionsBase``): unknown names are refused, options compare by value,
    and the object a dataset's ``options()`` returns is read-only."""

    def __init__(self):
        object.__setattr__(self, "_options", {})
        object.__setattr__(self, "_mutable", True)

    def _check_mutable(self) -> None:
        if not self._mutable:
            raise ValueError("Mutating `tf.data.Options()` returned by `tf.data.Dataset.options()` has no effect. "
                             "Use `tf.data.Dataset.with_options(options)` to set or update dataset options.")

    def _set_mutable(self, mutable: bool) -> None:
        object.__setattr__(self, "_mutable", mutable)
        for value in self._options.values():
            if isinstance(value, OptionsBase):
                value._set_mutable(mutable)

    def __setattr__(self, name, value):
        if not hasattr(type(self), name):
            raise AttributeError(f"Cannot set the property {name} on {type(self).__name__}.")
        object.__setattr__(self, name, value)

    def __eq__(self, other):
        if not isinstance(other, type(self)):
            return NotImplemented
        return all(getattr(self, n) == getattr(other, n) for n in set(self._options) | set(other._options))

    def __ne__(self, other):
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    __hash__ = None  # mutable, compared by value

    def __repr__(self) -> str:
        set_ = ", ".join(f"{n}={getattr(self, n)!r}" for n in sorted(self._options)
                         if getattr(self, n) != getattr(type(self)(), n))
        return f"{type(self).__name__}({set_})"


def merge_options(*options_list):
    """tf.data's merge: a new object with every option any of them sets, a later one winning; nested option
    sets merge option by option."""
    if not options_list:
        raise ValueError("At least one options should be provided")
    result_type = type(options_list[0])
    for options in options_list:
        if not isinstance(options, result_type):
            raise TypeError(f"Could not merge incompatible options of type {type(options)} and {result_type}.")
    default, result = result_type(), result_type()
    for options in options_list:
        for name in options._options:
            this, that, unset = getattr(result, name), getattr(options, name), getattr(default, name)
            if that == unset:
                continue
            if this != unset and isinstance(this, OptionsBase):
                that = merge_options(this, that)
            elif this != unset and name == "framework_type":  # a list: both sets of names
                that = this + that
            result._options[name] = that
    return result


class AutoShardPolicy(enum.IntEnum):
    """How ``experimental_distribute_dataset`` shares a dataset between workers (``tf.data.experimental``)."""

    OFF = -1
    AUTO = 0
    FILE = 1
    DATA = 2
    HINT = 3


class DistributeOptions(OptionsBase):
    """``options.experimental_distribute``: ``auto_shard_policy`` (default AUTO; an ``AutoShardPolicy``, or its
    name) and ``num_devices``."""

    _auto_shard_policy = _Option(AutoShardPolicy, lambda: AutoShardPolicy.AUTO)
    num_devices = _Option(int)

    @property
    def auto_shard_policy(self) -> AutoShardPolicy:
        return self._auto_shard_policy

    @auto_shard_policy.setter
    def auto_shard_policy(self, value):
        if isinstance(value, str):  # md.data also takes the policy's name
            try:
                value = AutoShardPolicy[value.upper()]
            except KeyError:
                raise ValueError(f"auto_shard_policy={value!r}: expected md.data.experimental.AutoShardPolicy "
                                 f"({', '.join(p.name for p in AutoShardPolicy)})") from None
        elif isinstance(value, int) and not isinstance(value, (bool, AutoShardPolicy)):
            try:
                value = AutoShardPolicy(value)
            except ValueError:
                raise ValueError(f"auto_shard_policy={value!r}: expected md.data.experimental.AutoShardPolicy "
                                 f"({', '.join(p.name for p in AutoShardPolicy)})") from None
        self._auto_shard_policy = value

    def __eq__(self, other):
        if not isinstance(other, DistributeOptions):
            return NotImplemented
        return (self.auto_shard_policy, self.num_devices) == (other.auto_shard_policy, other.num_devices)


class AutotuneOptions(OptionsBase):
    """``options.autotune``: ``enabled=False`` keeps AUTOTUNE parallelism at its first value; ``cpu_budget``,
    ``ram_budget``, ``autotune_algorithm``, ``initial_parallelism``, ``min_parallelism`` are TF's tuner's."""

    enabled = _Option(bool)
    cpu_budget = _Option(int)
    ram_budget = _Option(int)
    autotune_algorithm = _Option(AutotuneAlgorithm)
    initial_parallelism = _Option(int)
    min_parallelism = _Option(int)


class OptimizationOptions(OptionsBase):
    """``options.experimental_optimization``: TF's graph rewrites (no graph here: kept, no effect)."""

    apply_default_optimizations = _Option(bool)
    filter_fusion = _Option(bool)
    filter_parallelization = _Option(bool)
    inject_prefetch = _Option(bool)
    seq_interleave_prefetch = _Option(bool)
    map_and_batch_fusion = _Option(bool)
    map_and_filter_fusion = _Option(bool)
    map_fusion = _Option(bool)
    map_parallelization = _Option(bool)
    noop_elimination = _Option(bool)
    parallel_batch = _Option(bool)
    shuffle_and_repeat_fusion = _Option(bool)


class ServiceOptions(OptionsBase):
    """``options.experimental_service`` (the tf.data service's; no service here)."""

    pinned = _Option(bool)


class ThreadingOptions(OptionsBase):
    """``options.threading``: ``private_threadpool_size`` caps the threads of one parallel transformation
    (``map``/``interleave`` with ``num_parallel_calls``); ``max_intra_op_parallelism`` is TF's op threads'."""

    max_intra_op_parallelism = _Option(int)
    private_threadpool_size = _Option(int)


class Options(OptionsBase):
    """``tf.data.Options``. ``deterministic=False`` lets every parallel ``map``/``interleave``/``batch`` of the
    pipeline that did not set ``deterministic`` itself yield results in the order they complete, as in tf.data.
    ``experimental_deterministic`` and ``experimental_threading`` are TF's older names of ``deterministic``
    and ``threading``."""

    autotune = _Option(AutotuneOptions, AutotuneOptions)
    deterministic = _Option(bool)
    experimental_distribute = _Option(DistributeOptions, DistributeOptions)
    experimental_external_state_policy = _Option(ExternalStatePolicy)
    experimental_optimization = _Option(OptimizationOptions, OptimizationOptions)
    experimental_slack = _Option(bool)
    experimental_symbolic_checkpoint = _Option(bool)
    experimental_service = _Option(ServiceOptions, ServiceOptions)
    experimental_warm_start = _Option(bool)
    dataset_name = _Option(str)
    framework_type = _Option(list)
    threading = _Option(ThreadingOptions, ThreadingOptions)

    _ALIASES = {"experimental_deterministic": "deterministic", "experimental_threading": "threading"}

    def __getattr__(self, name):  # only for names not found otherwise: the aliases
        if name in Options._ALIASES:
            if name == "experimental_threading":
                logging.getLogger("mirrored.data").warning(
                    "options.experimental_threading is deprecated. Use options.threading instead.")
            return getattr(self, Options._ALIASES[name])
        raise AttributeError(f"'Options' object has no attribute '{name}'")

    def __setattr__(self, name, value):
        super().__setattr__(Options._ALIASES.get(name, name), value)

    def __dir__(self):
        return sorted(set(super().__dir__()) | set(Options._ALIASES))

    def merge(self, options) -> "Options":
        """These options merged with ``options`` (its settings win): a new object."""
        return merge_options(self, options)


def policy_of(dataset) -> AutoShardPolicy:
    """The auto-shard policy ``dataset`` carries (AUTO when it carries no options)."""
    options = getattr(dataset, "options", None)
    if callable(options):
        try:
            options = options()
        except TypeError:
            options = None
    distribute = getattr(options, "experimental_distribute", None)
    return getattr(distribute, "auto_shard_policy", AutoShardPolicy.AUTO) if distribute is not None \
        else AutoShardPolicy.AUTO
