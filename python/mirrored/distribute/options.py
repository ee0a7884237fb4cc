"""Option objects and enums of the public API, with TensorFlow's names and values."""

from __future__ import annotations

import collections
import enum
import logging
import math
import numbers


class VariableSynchronization(enum.Enum):
    """When a distributed variable's copies are synchronized."""

    AUTO = 0
    NONE = 1
    ON_WRITE = 2
    ON_READ = 3


class VariableAggregation(enum.Enum):
    """How the replicas' updates of a distributed variable are combined."""

    NONE = 0
    SUM = 1
    MEAN = 2
    ONLY_FIRST_REPLICA = 3
    ONLY_FIRST_TOWER = 3  # TF 1.11's name: an alias of ONLY_FIRST_REPLICA


class CommunicationImplementation(enum.Enum):
    """Which collective implementation cross-worker communication uses."""

    AUTO = "AUTO"
    RING = "RING"
    NCCL = "NCCL"


# TF 2.0-2.3 name of the same enum (``tf.distribute.experimental.CollectiveCommunication``).
CollectiveCommunication = CommunicationImplementation


class InputReplicationMode(enum.Enum):
    """How input pipelines map to replicas (``InputOptions``)."""

    PER_WORKER = "PER_WORKER"
    PER_REPLICA = "PER_REPLICA"


class CommunicationOptions:
    """Options for cross-replica collectives (``tf.distribute.experimental.CommunicationOptions``).

    ``bytes_per_pack`` > 0 splits a batch of tensors into packs of about that
    many bytes (0: let the implementation choose); ``timeout_seconds`` bounds
    how long a collective waits for its peers (``None``, ``0`` as in TensorFlow,
    or ``float('inf')``: no timeout; at most ``MAX_TIMEOUT_SECONDS``).
    """

    # About 31 years: every native deadline (now + timeout, in nanoseconds) stays representable.
    MAX_TIMEOUT_SECONDS = 1e9

    def __init__(self, bytes_per_pack: int = 0, timeout_seconds: float | None = None,
                 implementation=CommunicationImplementation.AUTO):
        if isinstance(bytes_per_pack, bool) or not isinstance(bytes_per_pack, int) or bytes_per_pack < 0:
            raise ValueError(f"Argument `bytes_per_pack` must be >=0, Received {bytes_per_pack!r}: expected a "
                             "non-negative int (0 = auto)")
        _check_timeout(timeout_seconds, self.MAX_TIMEOUT_SECONDS)
        if isinstance(implementation, str) and implementation.upper() in CommunicationImplementation.__members__:
            implementation = CommunicationImplementation[implementation.upper()]
        if not isinstance(implementation, CommunicationImplementation):
            raise ValueError(
                f"implementation={implementation!r}: expected md.CommunicationImplementation.AUTO, RING or NCCL"
            )
        self.bytes_per_pack = bytes_per_pack
        self.timeout_seconds = timeout_seconds
        self.implementation = implementation

    def merge(self, options: "CommunicationOptions | None") -> "CommunicationOptions":
        """A new ``CommunicationOptions``: these, with the fields of ``options`` that are not their defaults
        (``bytes_per_pack`` != 0, ``timeout_seconds`` not None, ``implementation`` not AUTO) taking precedence;
        a copy of these where ``options`` is None (as TensorFlow's)."""
        if options is None:
            return CommunicationOptions(self.bytes_per_pack, self.timeout_seconds, self.implementation)
        options = check_options(options)
        return CommunicationOptions(
            bytes_per_pack=options.bytes_per_pack or self.bytes_per_pack,
            timeout_seconds=options.timeout_seconds if options.timeout_seconds is not None else self.timeout_seconds,
            implementation=(options.implementation
                            if options.implementation is not CommunicationImplementation.AUTO
                            else self.implementation),
        )

    def __repr__(self) -> str:
        return (f"CommunicationOptions(bytes_per_pack={self.bytes_per_pack}, "
                f"timeout_seconds={self.timeout_seconds}, implementation={self.implementation})")


class CollectiveHints:
    """``tf.distribute.experimental.CollectiveHints(bytes_per_pack=0, timeout_seconds=None)``: TF 2.2's name of
    the collective options, deprecated since for ``CommunicationOptions``. As TensorFlow's, it makes a
    ``CommunicationOptions`` (without ``implementation``), so every ``options=`` argument takes it, and nothing is
    an instance of it."""

    _warned = False

    def __new__(cls, bytes_per_pack=0, timeout_seconds=None):
        if not CollectiveHints._warned:  # (TF logs its deprecation once too)
            CollectiveHints._warned = True
            logging.getLogger("mirrored").warning(
                "CollectiveHints is deprecated: use md.distribute.experimental.CommunicationOptions instead")
        return CommunicationOptions(bytes_per_pack=bytes_per_pack, timeout_seconds=timeout_seconds)


class CommunicationOptionsTypeError(TypeError, AttributeError):
    """``options=`` of a collective call that is not a ``CommunicationOptions``. An ``AttributeError`` too:
    TensorFlow fails reading the missing field (``'str' object has no attribute 'bytes_per_pack'``)."""


def check_options(options, argument: str = "options"):
    """``options`` when it is None or a ``CommunicationOptions``; else a CommunicationOptionsTypeError naming
    ``argument`` and the fix."""
    if options is None or type(options) is CommunicationOptions or isinstance(options, CommunicationOptions):
        return options
    raise CommunicationOptionsTypeError(
        f"{argument}={options!r}: expected md.distribute.experimental.CommunicationOptions(bytes_per_pack=..., "
        f"timeout_seconds=..., implementation=...) or None ('{type(options).__name__}' object has no attribute "
        "'bytes_per_pack')")


def _check_timeout(value, limit):
    """Refuses a timeout the native deadlines could not represent, naming the argument and the fix."""
    if value is None:
        return
    fix = "pass a positive number of seconds, or None / 0 / float('inf') for no timeout"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"timeout_seconds={value!r}: expected a number of seconds; {fix}")
    try:
        seconds, overflowed = float(value), False
    except OverflowError:  # an int too large for a float
        seconds, overflowed = (math.inf if value > 0 else -math.inf), True
    if math.isnan(seconds) or seconds < 0:
        raise ValueError(f"timeout_seconds={value!r}: must be >= 0 (0: no timeout, as in TensorFlow); {fix}")
    if seconds > limit and (overflowed or not math.isinf(seconds)):
        raise ValueError(f"timeout_seconds={value!r}: above the longest supported timeout, {limit:g} s (about 31 "
                         "years); for no timeout pass None or float('inf')")


def no_timeout(timeout_seconds) -> bool:
    """Whether a (validated) ``timeout_seconds`` means "wait as long as it takes"."""
    return timeout_seconds is None or timeout_seconds == 0 or math.isinf(timeout_seconds)


class InputOptions(collections.namedtuple("InputOptions", [
        "experimental_fetch_to_device", "experimental_replication_mode",
        "experimental_place_dataset_on_device", "experimental_per_replica_buffer_size"])):
    """Options for distributing datasets (``tf.distribute.InputOptions``, a named tuple as in TF).

    ``experimental_fetch_to_device`` (default True, as TF's) places each replica's slice on its device in the
    background prefetcher; False leaves it on the host. ``experimental_per_replica_buffer_size`` is how many
    batches per replica the prefetcher keeps ready (0: none, each step is prepared when it is asked for).
    ``experimental_place_dataset_on_device`` needs ``PER_REPLICA`` replication and no fetch to the device:
    ``distribute_datasets_from_function`` checks that, as TF's does.
    """

    __slots__ = ()

    def __new__(cls, experimental_fetch_to_device=None,
                experimental_replication_mode=InputReplicationMode.PER_WORKER,
                experimental_place_dataset_on_device=False, experimental_per_replica_buffer_size=1):
        if isinstance(experimental_per_replica_buffer_size, bool) or \
                not isinstance(experimental_per_replica_buffer_size, numbers.Integral) or \
                experimental_per_replica_buffer_size < 0:
            raise ValueError(
                f"experimental_per_replica_buffer_size={experimental_per_replica_buffer_size!r}: expected an int >= 0 "
                "(0 turns prefetching off)")
        if experimental_fetch_to_device is None:  # TF's default
            experimental_fetch_to_device = True
        return super().__new__(cls, experimental_fetch_to_device, experimental_replication_mode,
                               experimental_place_dataset_on_device, int(experimental_per_replica_buffer_size))


class RunOptions(collections.namedtuple("RunOptions", [
        "experimental_enable_dynamic_batch_size", "experimental_bucketizing_dynamic_shape",
        "experimental_xla_options"], defaults=(True, False, None))):
    """Options for ``Strategy.run`` (``tf.distribute.RunOptions``, a named tuple as in TF).

    Accepted for compatibility; replicas always run eagerly here, so the
    XLA/bucketizing knobs have nothing to change.
    """

    __slots__ = ()
