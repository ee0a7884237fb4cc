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
    """One optimizer's range ``[lower, upper]`` of its GPU step count, and the copies that narrow it."""

    def __init__(self):
        self.lower = None  # a count the device had reached (None: none known yet)
        self._epoch = 0  # copies taken before the last exact count (an assignment) are stale: tagged older
        self._readback = None  # (ordinal, native StepReadback) of the first device
        self._status = {}  # ordinal -> the device's StepStatus buffer (two int64: step read, outside the rows)

    def known_exactly(self, step: int) -> None:
        """The device's count is ``step`` (read back, or never skipped): copies in flight are stale now."""
        self.lower = step
        self._epoch += 1

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
        """Queues on ``stream`` the copy of GPU ``ordinal``'s status (the first device's; every copy of the
        count is the same) to the host; a step whose every slot is still in flight records nothing."""
        if self._readback is None:
            self._readback = (ordinal, _gpu.cuda_module().StepReadback(ordinal, MAX_ROWS))
        if self._readback[0] == ordinal:
            self._readback[1].record(self.status(ordinal).data.ptr, self._epoch, stream)

    def lower_bound(self, upper: int) -> int | None:
        """``lower`` for a step whose count is at most ``upper``: raised by the copies that arrived, without a
        wait unless the rows ``lower..upper`` would exceed :data:`MAX_ROWS`; None when no count is known."""
        if self._readback is not None:
            for reading in self._readback[1].arrived():
                self._take(reading)
            while self.lower is not None and upper - self.lower >= MAX_ROWS:
                reading = self._readback[1].wait_oldest()
                if reading is None:
                    return None
                self._take(reading)
        if self.lower is None or upper - self.lower >= MAX_ROWS:
            return None
        return self.lower

    def _take(self, reading) -> None:
        epoch, step, outside = reading
        if outside:
            raise RuntimeError(
                f"the GPU found its step count {step} outside the rows of scalars the host sent (a bug of mirrored's "
                "loss-scaled step: the host's count of applies must bound it); the weights of that step are NaN. "
                "Please report it; LossScaleOptimizer(dynamic=False) or an optimizer whose scalars do not follow "
                "the step avoids the path")
        if epoch == self._epoch and (self.lower is None or step > self.lower):
            self.lower = step
