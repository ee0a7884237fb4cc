"""The step a dynamic loss scale leaves to the GPU, bounded by the host without waiting for it.

On GPU replicas ``md.mixed_precision.LossScaleOptimizer`` decides on the device whether a step is applied: a
step with an inf or nan gradient is skipped and leaves ``iterations`` where it was. The host, which never waits
for that answer, knows only a range that holds the device's count: at most ``upper``, the applies it made (the
optimizer's own count), and at least ``lower``, a value the device had reached before. For an optimizer whose
scalars follow the step (Adam's bias corrections, a learning-rate schedule) each step therefore sends one row of
scalars per candidate step, ``lower`` to ``upper``, and a one-thread kernel picks the row of the device's own
``iterations`` just before the fused update reads it (csrc/cuda/fused_update.h ``select_step_row``).

``lower`` is learnt without a wait too: the select kernel leaves the step it read in a small status buffer, of
which each step queues an asynchronous copy into pinned host memory (csrc/cuda/step_readback.h); a later step
takes the copies that have arrived (an event query, no wait). Only when the range would exceed
:data:`MAX_ROWS` rows (the host is that many applies ahead of the GPU) does the host wait, for the oldest copy.
docs/training.md, "Loss scaling on GPU replicas".
"""

from __future__ import annotations

import numpy as np

from ...device import gpu as _gpu

__all__ = ["StepWindow", "MAX_ROWS"]

# The rows a step sends at most (csrc/core/optimizer_rules.h kMaxStepRows): the host runs that many applies
# ahead of the GPU before it waits, where a CUDA launch queue of ~1000 kernels would soon block it anyway.
MAX_ROWS = 32


class StepWindow:
    """One optimizer's range ``[lower, upper]`` of its GPU step count, and the copies that narrow it.

    Every apply of the optimizer is counted (``counted``), so a count that arrives tells for the apply it was
    read by: the count before apply ``a`` was ``v``, so the count before apply ``A`` lies in ``[v, v + A - a]``,
    whatever the host counted (skips do not widen the range)."""

    def __init__(self):
        self.lower = None  # a count the device had before apply self._lower_at (None: none known yet)
        self._lower_at = 0
        self._applies = 0  # the optimizer's applies counted so far
        self._fresh_from = 0  # copies taken by an apply before this one are stale (read before an assignment)
        self._readback = None  # (ordinal, native StepReadback) of the first device
        self._status = {}  # ordinal -> the device's StepStatus buffer (two int64: step read, outside the rows)

    def known_exactly(self, step: int) -> None:
        """The count before the next apply is ``step`` (read back, or no step skipped): copies in flight are stale."""
        self.lower, self._lower_at = step, self._applies
        self._fresh_from = self._applies

    def counted(self) -> None:
        """An apply was made (after its ``bounds``, if any)."""
        self._applies += 1

    def status(self, ordinal: int):
        """GPU ``ordinal``'s status buffer, which its select kernels write (made once, zero)."""
        status = self._status.get(ordinal)
        if status is None:
            cupy = _gpu.cupy_module()
            with cupy.cuda.Device(ordinal):
                status = self._status[ordinal] = cupy.zeros(2, np.int64)
                # Zeroed on this stream, written on the step's: once, the host waits for the zeros.
                cupy.cuda.get_current_stream().synchronize()
        return status

    def record(self, ordinal: int, stream: int) -> None:
        """Queues on ``stream`` the copy of GPU ``ordinal``'s status to the host, after the select of the last
        apply counted (the first device's: every copy of the count is the same); nothing when every slot is
        still in flight."""
        if self._readback is None:
            self._readback = (ordinal, _gpu.cuda_module().StepReadback(ordinal, MAX_ROWS))
        if self._readback[0] == ordinal:
            self._readback[1].record(self.status(ordinal).data.ptr, self._applies - 1, stream)

    def bounds(self, upper: int):
        """``(lower, upper)`` for the next apply, whose count the host bounds by ``upper``: narrowed by the copies
        that arrived, without a wait unless the range would exceed :data:`MAX_ROWS` rows (then it waits for
        copies until it is half that); None when no count is known within it."""
        readback = self._readback[1] if self._readback is not None else None
        if readback is not None:
            for reading in readback.arrived():
                self._take(reading)
            if self.lower is not None and self._applies - self._lower_at >= MAX_ROWS:
                # The host is MAX_ROWS applies ahead of the last count that arrived: it waits until it is half as
                # far ahead, so that the next wait is that many applies away (not one per apply at the edge).
                while self._applies - self._lower_at >= MAX_ROWS // 2 and readback.in_flight:
                    # (one copy per apply, the newest taken by the last one: the copy of MAX_ROWS // 2 - 1 ago)
                    for reading in readback.wait(readback.in_flight - MAX_ROWS // 2 + 2):
                        self._take(reading)
        if self.lower is None or self._applies - self._lower_at >= MAX_ROWS:
            return None
        return self.lower, min(upper, self.lower + self._applies - self._lower_at)

    def _take(self, reading) -> None:
        applied_at, step, outside = reading
        if outside:
            raise RuntimeError(
                f"the GPU found its step count {step} outside the rows of scalars the host sent (a bug of mirrored's "
                "loss-scaled step: the host's count of applies must bound it); the weights of that step are NaN. "
                "Please report it; LossScaleOptimizer(dynamic=False) or an optimizer whose scalars do not follow "
                "the step avoids the path")
        if applied_at >= self._fresh_from and applied_at > self._lower_at:
            self.lower, self._lower_at = step, applied_at
