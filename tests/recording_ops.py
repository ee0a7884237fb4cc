"""A CrossDeviceOps for route tests: the built-in ring with ``batch_reduce_implementation`` overridden,
so every batch reduce comes through it, and counted."""

import mirrored as md


class RecordingImplementation(md.cross_device_ops.RingAllReduce):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def batch_reduce_implementation(self, reduce_op, value_destination_pairs, options):
        self.calls += 1
        return super().batch_reduce_implementation(reduce_op, value_destination_pairs, options)
