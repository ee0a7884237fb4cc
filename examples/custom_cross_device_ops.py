"""A CrossDeviceOps plug-in: all-reduce with float16 compression on the wire.

Every reduction the strategy makes — the replicas' all_reduce, strategy.reduce,
extended.reduce_to / batch_reduce_to and variable updates with aggregation —
goes through the plug-in passed as ``cross_device_ops=``. This one halves the
bytes by casting float32 values to float16 before the native all-reduce and
back afterwards (a common gradient-compression trick).

    PYTHONPATH=python python3 examples/custom_cross_device_ops.py
"""

import numpy as np

import mirrored as md


class Fp16CompressedAllReduce(md.cross_device_ops.CrossDeviceOps):
    def __init__(self):
        self.inner = md.cross_device_ops.RingAllReduce()
        self.calls = 0

    def _compress(self, value):
        devices = md.cross_device_ops.get_devices_from(value)
        return md.PerReplica([np.asarray(v, np.float32).astype(np.float16) for v in value.values], devices)

    def batch_reduce_implementation(self, reduce_op, value_destination_pairs, options):
        self.calls += 1
        packed = [(self._compress(v), d) for v, d in value_destination_pairs]
        reduced = self.inner.batch_reduce_implementation(reduce_op, packed, options)
        return [md.Mirrored([r.astype(np.float32) for r in out.values], md.cross_device_ops.get_devices_from(out))
                if isinstance(out, md.Mirrored) else out.astype(np.float32) for out in reduced]

    def reduce_implementation(self, reduce_op, per_replica_value, destinations, options):
        return self.batch_reduce_implementation(reduce_op, [(per_replica_value, destinations)], options)[0]


def main():
    plugin = Fp16CompressedAllReduce()
    strategy = md.MirroredStrategy(["/cpu:0", "/cpu:1", "/cpu:2", "/cpu:3"], cross_device_ops=plugin)
    with strategy.scope():
        w = md.Variable(np.zeros(4, np.float32), aggregation=md.VariableAggregation.MEAN)

    def step():
        rid = md.get_replica_context().replica_id_in_sync_group
        grad = np.full(4, 0.25 * (rid + 1), np.float32)
        mean_grad = md.get_replica_context().all_reduce("MEAN", grad)
        w.assign_sub(0.1 * grad)  # MEAN aggregation: also an all-reduce through the plug-in
        return mean_grad

    mean_grad = strategy.run(step)
    total = strategy.reduce("SUM", mean_grad, axis=None)
    print("mean gradient on replica 0:", strategy.experimental_local_results(mean_grad)[0])
    print("sum over replicas:", total)
    print("w after one step:", w.numpy())
    print("plug-in calls:", plugin.calls)
    return plugin.calls, total, w.numpy()


if __name__ == "__main__":
    main()
