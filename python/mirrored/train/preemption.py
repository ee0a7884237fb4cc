"""Preemption: ``tf.distribute.experimental.PreemptionCheckpointHandler`` and ``TerminationConfig``.

    strategy = md.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model, optimizer = ...
    checkpoint = md.train.Checkpoint(model=model, optimizer=optimizer)
    handler = md.distribute.experimental.PreemptionCheckpointHandler(
        strategy.cluster_resolver, checkpoint, checkpoint_dir="ckpt")   # restores the latest, if any
    while handler.total_run_calls < STEPS:
        handler.run(distributed_train_step, next(iterator))

A SIGTERM to any worker (or a ``termination_watcher_fn`` returning True)
makes every worker save a checkpoint at the same step and exit with
``RESTART_EXIT_CODE``; ``mirrored-run --max-restarts`` starts the job again,
and the new handler restores that checkpoint, so ``total_run_calls`` (and the
training) carry on where they stopped, exactly as an uninterrupted job would.

How the workers agree, as TensorFlow: the worker with the notice announces
"save at run ``total_run_calls + 1``" in a key-value store (TF: its
coordination service; here the job's rendezvous store), and every worker
reads the store at the start of each ``run`` (or
``save_checkpoint_if_preempted``): one store round trip per step. All save at
the start of that run, meet once (a collective) and exit.

``RESTART_EXIT_CODE`` (``mirrored.distribute.preemption``) is TensorFlow's
own default for platforms other than GCE (``sys.exit(42)``); ``mirrored-run``
treats it as "restart". The handler lives in the training layer (it drives
checkpoint managers); ``md.distribute.experimental`` exposes it under TF's name.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import shutil
import signal
import sys
import threading
import time

import numpy as np

from ..distribute.options import VariableAggregation
from ..distribute.preemption import RESTART_EXIT_CODE
from ..distribute.reduce_util import ReduceOp
from ..distribute.values import Variable
from .checkpoint import Checkpoint, _strategy_of
from .checkpoint_management import CheckpointManager

__all__ = ["RESTART_EXIT_CODE", "PreemptionCheckpointHandler", "TerminationConfig"]

_ITERATION_VARIABLE = "checkpointed_runs"  # TF's name: the same key in the checkpoint
# The announced steps: where every worker saves and trains on (a grace period left), or saves and exits.
_STAGES = ("initial", "final")
# Handlers are created in the same order on every worker: the n-th ones share their store keys.
_instances = itertools.count()
_log = logging.getLogger("mirrored")


class TerminationConfig:
    """How preemption shows up and what to do then (``tf.distribute.experimental.TerminationConfig``).

    ``termination_watcher_fn``: called about once a second in a thread; True
    means "this worker will be preempted" (default: the SIGTERM handler only).
    ``exit_fn``: called after the checkpoint is saved (default:
    ``sys.exit(RESTART_EXIT_CODE)``). ``grace_period``: seconds between the
    notice and the preemption; training continues until close to its end after
    a first checkpoint (default 0: save and exit at the next step).
    ``save_fn``: called instead of ``CheckpointManager.save()``.
    """

    def __init__(self, termination_watcher_fn=None, exit_fn=None, grace_period=None, save_fn=None):
        for name, fn in (("termination_watcher_fn", termination_watcher_fn), ("exit_fn", exit_fn),
                         ("save_fn", save_fn)):
            if fn is not None and not callable(fn):
                raise TypeError(f"TerminationConfig({name}={fn!r}): expected a function or None")
        if grace_period is not None and (isinstance(grace_period, bool) or not isinstance(grace_period, (int, float))
                                         or not grace_period >= 0):
            raise ValueError(f"TerminationConfig(grace_period={grace_period!r}): expected a number of seconds >= 0")
        self.termination_watcher_fn = termination_watcher_fn
        self.exit_fn = exit_fn
        self.grace_period = grace_period
        self.save_fn = save_fn


def _default_exit():
    sys.exit(RESTART_EXIT_CODE)


def _non_chief_checkpoint_dir(checkpoint_dir: str, task_id) -> str:
    """Where a worker other than the chief writes: ``{parent}/workertemp_{id}/{name}`` (TF's layout)."""
    parent, base = os.path.split(os.path.abspath(checkpoint_dir))
    return os.path.join(parent, f"workertemp_{task_id}", base)


class PreemptionCheckpointHandler:
    """Save at an agreed step and exit when any worker is preempted; restore at start-up (TF's contract).

    ``cluster_resolver``: the strategy's (``strategy.cluster_resolver``), or
    None for a single worker. ``checkpoint_or_checkpoint_manager``: an
    ``md.train.CheckpointManager`` (it restores and saves), or an
    ``md.train.Checkpoint`` together with ``checkpoint_dir``, where the
    handler keeps one checkpoint (workers other than the chief write to a
    temporary ``workertemp_<id>`` directory beside it, deleted on exit).
    Every worker must create its handler (in the same order, if several) and
    call ``run`` once per synchronous step: the agreed step counts runs.
    """

    def __init__(self, cluster_resolver, checkpoint_or_checkpoint_manager, checkpoint_dir=None,
                 termination_config=None):
        if isinstance(checkpoint_or_checkpoint_manager, Checkpoint):
            if not checkpoint_dir:
                raise ValueError("PreemptionCheckpointHandler: when a Checkpoint is passed, a checkpoint_dir must "
                                 "be passed as well (or pass an md.train.CheckpointManager)")
        elif not isinstance(checkpoint_or_checkpoint_manager, CheckpointManager):
            raise TypeError(f"checkpoint_or_checkpoint_manager={checkpoint_or_checkpoint_manager!r}: expected an "
                            "md.train.Checkpoint or an md.train.CheckpointManager")
        if termination_config is None:
            termination_config = TerminationConfig()
        elif not isinstance(termination_config, TerminationConfig):
            raise TypeError(f"termination_config={termination_config!r}: expected a "
                            "md.distribute.experimental.TerminationConfig")
        if cluster_resolver is not None and "ps" in cluster_resolver.cluster_spec().as_dict():
            raise NotImplementedError("PreemptionCheckpointHandler does not support a cluster with 'ps' tasks "
                                      "(parameter-server training)")
        self._cluster_resolver = cluster_resolver
        self._exit_fn = termination_config.exit_fn or _default_exit
        self._save_fn = termination_config.save_fn
        self._grace_period = termination_config.grace_period or 0
        self._watcher_fn = termination_config.termination_watcher_fn

        checkpoint = (checkpoint_or_checkpoint_manager if isinstance(checkpoint_or_checkpoint_manager, Checkpoint)
                      else checkpoint_or_checkpoint_manager.checkpoint)
        found = list(checkpoint._variables().values())
        self._strategy = _strategy_of(found)
        self._is_chief = bool(self._strategy.extended.should_checkpoint)
        self._task_id = getattr(cluster_resolver, "task_id", None) or 0
        if isinstance(checkpoint_or_checkpoint_manager, CheckpointManager):
            self._read_manager = self._write_manager = checkpoint_or_checkpoint_manager
            self._temporary_dir = None
        else:
            self._read_manager = CheckpointManager(checkpoint, checkpoint_dir, max_to_keep=1)
            if self._is_chief:
                self._write_manager, self._temporary_dir = self._read_manager, None
            else:
                write_dir = _non_chief_checkpoint_dir(checkpoint_dir, self._task_id)
                self._write_manager = CheckpointManager(checkpoint, write_dir, max_to_keep=1)
                self._temporary_dir = os.path.dirname(write_dir)

        if _ITERATION_VARIABLE not in checkpoint._objects:
            with self._strategy.scope():
                runs = Variable(np.int64(0), trainable=False, name=_ITERATION_VARIABLE, dtype=np.int64,
                                aggregation=VariableAggregation.ONLY_FIRST_REPLICA)
            setattr(checkpoint, _ITERATION_VARIABLE, runs)
        self._checkpointed_runs = checkpoint._objects[_ITERATION_VARIABLE]
        self._read_manager.restore_or_initialize()
        self._run_counter = int(self._checkpointed_runs.numpy())

        # Where the announced steps live: the job's rendezvous store (TF uses its coordination service's
        # key-value store), or this object for a single worker (TF's "local mode").
        group = getattr(self._strategy.extended, "_group", None)
        self._store = group.store if group is not None and group.num_workers > 1 else None
        self._key_prefix = f"mirrored-preemption-{next(_instances)}"
        self._local_steps = {}
        self._notice = threading.Event()       # this worker's own SIGTERM / watcher notice
        self._notice_time = None
        self._saved_in_grace = False
        self._estimated_run_time = 0.0
        self._closed = threading.Event()
        if self._watcher_fn is not None:
            self._watcher = threading.Thread(target=self._poll_watcher, daemon=True,
                                             name=f"PreemptionWatcher-{self._task_id}")
            self._watcher.start()
        else:
            self._watcher = None
            if threading.current_thread() is not threading.main_thread():
                raise RuntimeError("PreemptionCheckpointHandler installs a SIGTERM handler, which Python allows "
                                   "only in the main thread; create it there, or pass a TerminationConfig with "
                                   "a termination_watcher_fn")
            signal.signal(signal.SIGTERM, self._on_sigterm)
            # Python's handlers interrupt system calls (EINTR) in whichever thread the kernel picks, the
            # native collective threads included; the notice only needs a flag, so let them restart.
            signal.siginterrupt(signal.SIGTERM, False)
        _log.info("PreemptionCheckpointHandler: %d runs restored from %s", self._run_counter,
                  self._read_manager.latest_checkpoint)

    # -- TF's API --
    @property
    def total_run_calls(self) -> int:
        """How many times ``run`` was called, counting the runs before a restart (saved in the checkpoint)."""
        return self._run_counter

    def run(self, distributed_train_function, *args, **kwargs):
        """``distributed_train_function(*args, **kwargs)``, after saving and exiting if a worker was preempted."""
        self._check_preemption_and_maybe_checkpoint()
        begin = time.monotonic()
        result = distributed_train_function(*args, **kwargs)
        self._run_counter += 1
        self._estimated_run_time += (time.monotonic() - begin - self._estimated_run_time) / self._run_counter
        return result

    def save_checkpoint_if_preempted(self, *args, **kwargs) -> None:
        """Save (passing the arguments to ``CheckpointManager.save``) and exit if a worker was preempted.

        The alternative to ``run``: call it once per step, after the step.
        """
        self._check_preemption_and_maybe_checkpoint(*args, **kwargs)
        self._run_counter += 1
        self._estimated_run_time = 0.0

    @contextlib.contextmanager
    def watch_preemption_scope(self):
        """A scope for the training loop (TF needs it for TPUs; here, as in TF for multi-worker, it only yields).

        Errors of a step already reach every worker through the collectives.
        """
        yield

    # -- the notice --
    def _on_sigterm(self, signum, frame):
        self._record_notice()

    def _poll_watcher(self):
        while not self._closed.wait(1.0):
            if self._watcher_fn():
                self._record_notice()
                return

    def _record_notice(self):
        if not self._notice.is_set():
            self._notice_time = time.monotonic()
            self._notice.set()
            _log.info("PreemptionCheckpointHandler: worker %s received a termination notice", self._task_id)

    def _own_stage(self):
        """Which step this worker's notice asks for: None, ``"initial"`` (grace left) or ``"final"``."""
        if not self._notice.is_set():
            return None
        # Leave time for the final save: three times two steps, as TensorFlow reserves.
        remaining = self._notice_time + self._grace_period - 6 * self._estimated_run_time - time.monotonic()
        return "final" if self._grace_period <= 0 or remaining <= 0 else "initial"

    def _published(self) -> dict:
        """The steps announced so far, ``{"initial": n, "final": m}`` (one store round trip with several workers)."""
        if self._store is None:
            return dict(self._local_steps)
        keys = {stage: f"{self._key_prefix}/{stage}" for stage in _STAGES}
        missing = set(self._store.wait(list(keys.values()), 0.0))
        return {stage: int(self._store.get(key)) for stage, key in keys.items() if key not in missing}

    def _publish(self, stage: str) -> int:
        """Announce that every worker saves at the start of the next run (``total_run_calls + 1``)."""
        step = self._run_counter + 1
        if self._store is None:
            self._local_steps[stage] = step
        else:
            self._store.set(f"{self._key_prefix}/{stage}", str(step).encode())
        _log.info("PreemptionCheckpointHandler: worker %s asks every worker to save at run %d (%s)", self._task_id,
                  step, stage)
        return step

    def _check_preemption_and_maybe_checkpoint(self, *args, **kwargs) -> None:
        """TF's protocol. A worker with a notice announces ``run + 1`` unless a step is announced already.

        Steps are synchronous, so when one worker starts run ``r`` no other has
        finished it; any other worker therefore reads the announcement at the
        latest when it starts run ``r + 1``, and all save there. Workers that
        announce at the same time announce the same step (they are all at the
        start of ``r``: none could pass it without the others).
        """
        published = self._published()
        stage = self._own_stage()
        if stage == "final" and "final" not in published:
            published["final"] = self._publish("final")
        elif stage == "initial" and not published:
            published["initial"] = self._publish("initial")
        if published.get("final") == self._run_counter:
            self._save_checkpoint(*args, **kwargs)
            self._barrier()  # every worker has read the step before the store's task may exit
            self._shutdown()
            _log.info("PreemptionCheckpointHandler: checkpoint saved at run %d; exiting", self._run_counter)
            self._exit_fn()
        elif published.get("initial") == self._run_counter and not self._saved_in_grace:
            # A grace period: save now, in case it ends sooner than announced, and train on until near its end.
            self._save_checkpoint(*args, **kwargs)
            self._saved_in_grace = True

    def _barrier(self) -> None:
        if self._store is not None:
            values = self._strategy.experimental_distribute_values_from_function(lambda ctx: np.int32(1))
            self._strategy.reduce(ReduceOp.SUM, values, axis=None)

    def _save_checkpoint(self, *args, **kwargs) -> None:
        self._checkpointed_runs.assign(np.int64(self._run_counter))
        if self._save_fn is not None:
            self._save_fn(*args, **kwargs)
        else:
            self._write_manager.save(*args, **kwargs)

    def _shutdown(self) -> None:
        # The SIGTERM handler stays: the launcher may signal this task while it exits with RESTART_EXIT_CODE.
        self._closed.set()
        if self._temporary_dir is not None:
            shutil.rmtree(self._temporary_dir, ignore_errors=True)
