"""``tf.data.Options`` and the auto-shard policy that distributed input reads from them."""

from __future__ import annotations

import enum


class AutoShardPolicy(enum.IntEnum):
    """How ``experimental_distribute_dataset`` shares a dataset between workers (``tf.data.experimental``)."""

    OFF = -1
    AUTO = 0
    FILE = 1
    DATA = 2
    HINT = 3


class DistributeOptions:
    """``options.experimental_distribute``: ``auto_shard_policy`` (default AUTO) and ``num_devices``."""

    def __init__(self):
        self._auto_shard_policy = AutoShardPolicy.AUTO
        self._policy_set = False  # set explicitly: it wins when options are merged
        self.num_devices = None

    @property
    def auto_shard_policy(self) -> AutoShardPolicy:
        return self._auto_shard_policy

    @auto_shard_policy.setter
    def auto_shard_policy(self, value):
        try:
            if isinstance(value, str):
                self._auto_shard_policy = AutoShardPolicy[value.upper()]
            elif isinstance(value, bool):
                raise TypeError(value)
            else:
                self._auto_shard_policy = AutoShardPolicy(value)
            self._policy_set = True
        except (KeyError, ValueError, TypeError):
            raise ValueError(f"auto_shard_policy={value!r}: expected md.data.experimental.AutoShardPolicy "
                             f"({', '.join(p.name for p in AutoShardPolicy)})") from None

    def __repr__(self) -> str:
        return f"DistributeOptions(auto_shard_policy={self._auto_shard_policy!r})"


class Options:
    """``tf.data.Options``: ``experimental_distribute`` (sharding) and ``deterministic``.

    ``deterministic=False`` lets every ``map(num_parallel_calls=...)`` of the
    pipeline that did not set ``deterministic`` itself yield results in the
    order they complete, as in tf.data.
    """

    def __init__(self):
        self.experimental_distribute = DistributeOptions()
        self.deterministic = None

    def __repr__(self) -> str:
        return f"Options(experimental_distribute={self.experimental_distribute!r}, deterministic={self.deterministic})"


def merge_options(options: list) -> Options:
    """tf.data's merge of the options of a pipeline (upstream first): what a later one sets wins."""
    if len(options) == 1:
        return options[0]
    merged = Options()  # (none: the defaults)
    for o in options:
        if o.deterministic is not None:
            merged.deterministic = o.deterministic
        if o.experimental_distribute._policy_set:
            merged.experimental_distribute.auto_shard_policy = o.experimental_distribute.auto_shard_policy
        if o.experimental_distribute.num_devices is not None:
            merged.experimental_distribute.num_devices = o.experimental_distribute.num_devices
    return merged


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
