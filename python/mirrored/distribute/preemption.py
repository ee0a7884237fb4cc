"""Preemption: ``tf.distribute.experimental.PreemptionCheckpointHandler``'s contract.

``RESTART_EXIT_CODE`` is the exit status of a task that saved a checkpoint
because the job was preempted (SIGTERM) and wants to be started again. It is
TensorFlow's default for platforms other than GCE (``sys.exit(42)`` in
``failure_handling.BorgTerminationConfig``); ``mirrored-run`` restarts a job
whose tasks exit with it.
"""

RESTART_EXIT_CODE = 42

__all__ = ["RESTART_EXIT_CODE"]
