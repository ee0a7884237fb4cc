"""``md.ReduceOp``: how values from different replicas are combined."""

from __future__ import annotations

import enum


class ReduceOp(enum.Enum):
    """Indicates how a set of values should be reduced.

    ``SUM`` and ``MEAN`` are TensorFlow's; ``MIN``, ``MAX`` and ``PROD`` are the
    other ops of the native core (NCCL's set). The value of each member is its
    name, which is also what :mod:`mirrored.collectives` accepts.
    """

    SUM = "SUM"
    MEAN = "MEAN"
    MIN = "MIN"
    MAX = "MAX"
    PROD = "PROD"

    @staticmethod
    def from_variable_aggregation(aggregation) -> "ReduceOp":
        """The op that reduces a variable with ``aggregation`` (SUM or MEAN)."""
        from .options import VariableAggregation

        mapping = {VariableAggregation.SUM: ReduceOp.SUM, VariableAggregation.MEAN: ReduceOp.MEAN}
        if aggregation not in mapping:
            raise ValueError(
                f"Could not convert from `md.VariableAggregation` {aggregation} to "
                "`md.ReduceOp`; only SUM and MEAN aggregations reduce"
            )
        return mapping[aggregation]


# Ops as callers spell them -> ReduceOp: every collective converts its op (spellings are few; bounded anyway).
_KNOWN: dict = {}
_MAX_KNOWN = 64


def as_reduce_op(reduce_op, argument: str = "reduce_op") -> ReduceOp:
    """``reduce_op`` as a :class:`ReduceOp`; strings are enum names in any case.

    As in TensorFlow, only the member names are accepted (``"avg"`` or
    ``"average"`` raise), so a typo can never select a different reduction.
    """
    if type(reduce_op) is ReduceOp:  # (before the dict: a member's hash is Python code)
        return reduce_op
    try:
        return _KNOWN[reduce_op]
    except (KeyError, TypeError):  # not a member or a name seen before (TypeError: unhashable)
        pass
    if isinstance(reduce_op, ReduceOp):
        return reduce_op
    if isinstance(reduce_op, str) and reduce_op.upper() in ReduceOp.__members__:
        if len(_KNOWN) < _MAX_KNOWN:
            _KNOWN[reduce_op] = ReduceOp[reduce_op.upper()]
        return ReduceOp[reduce_op.upper()]
    raise ValueError(
        f"{argument}={reduce_op!r} is not a valid ReduceOp; use one of "
        f"{', '.join('md.ReduceOp.' + m for m in ReduceOp.__members__)} or their names as "
        "strings in any case (e.g. 'sum', 'MEAN')"
    )


_KNOWN.update({op: op for op in ReduceOp})
