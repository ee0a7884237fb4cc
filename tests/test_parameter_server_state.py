"""ParameterServerStrategy keeps the optimizer's state on the ps tasks, where the coordinator sees and saves it.

As in TF, the slots and the step count are ps variables: ``optimizer.iterations``, ``variables`` and ``get_slot``
on the coordinator are handles to them, and ``md.train.Checkpoint`` saves and restores them in the same layout as
under MirroredStrategy or no strategy. In-process clusters (tests/test_parameter_server_strategy.py); the scheduled
functions live in tests/ps_model.py.
"""

import numpy as np
import pytest

import mirrored as md
from mirrored.distribute.parameter_server import rpc
from mirrored.distribute.parameter_server.values import ShardedVariable
from mirrored.train.checkpoint import CheckpointError

import ps_model
from test_parameter_server_strategy import Coordinator, in_process_cluster, partitioners, process_cluster

SLOTS = {"sgd": ["momentum"], "adam": ["momentum", "velocity"]}


def plain_model(optimizer: str, batches) -> ps_model.Model:
    """``optimizer``'s model trained on ``batches`` without a strategy: the reference state."""
    model = ps_model.Model(optimizer)
    train_plain(model, batches)
    return model


def train_plain(model, batches) -> None:
    for x, y in batches:
        gw, gb = ps_model.gradients(model.w, model.b, x, y)
        model.optimizer.apply_gradients([(gw, model.w), (gb, model.b)])


def train_ps(strategy, model, batches) -> None:
    coordinator = Coordinator(strategy)
    for batch in batches:
        coordinator.schedule(model.train_step, args=batch)
    coordinator.join()


def assert_same_state(model, reference, optimizer: str) -> None:
    """Weights, step count and every slot equal bit for bit."""
    np.testing.assert_array_equal(model.w.numpy(), reference.w.numpy())
    np.testing.assert_array_equal(model.b.numpy(), reference.b.numpy())
    assert int(model.optimizer.iterations.numpy()) == int(reference.optimizer.iterations.numpy())
    for name in SLOTS[optimizer]:
        for var, ref in ((model.w, reference.w), (model.b, reference.b)):
            np.testing.assert_array_equal(np.asarray(model.optimizer.get_slot(var, name).read_value()),
                                          reference.optimizer.get_slot(ref, name).numpy())


SHARDED = partitioners.FixedShardsPartitioner(2)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("num_ps,partitioner", [(1, None), (2, None), (2, SHARDED)])
def test_the_coordinator_sees_the_ps_copies_slots_and_step_count(optimizer, num_ps, partitioner):
    batches = ps_model.data(5)
    with in_process_cluster(num_workers=1, num_ps=num_ps, variable_partitioner=partitioner) as strategy:
        with strategy.scope():
            model = ps_model.Model(optimizer)
        train_ps(strategy, model, batches)
        reference = plain_model(optimizer, batches)
        assert_same_state(model, reference, optimizer)
        opt = model.optimizer
        assert opt.built and opt.iterations.device == "/job:ps/replica:0/task:0/device:CPU:0"
        # Keras 3's order: iterations, then the slots variable by variable; each slot beside its variable
        # (a sharded slot is a ShardedVariable, named 'ShardedVariable' as TF names every one; its shards carry
        # the slot's name: 'w/momentum/part_0:0', ...)
        names = [v.variables[0].name.split("/part_")[0] if isinstance(v, ShardedVariable) else v.name.split(":")[0]
                 for v in opt.variables]
        assert names == [v.name.split(":")[0] for v in reference.optimizer.variables]
        if partitioner is None:
            assert opt.get_slot(model.w, "momentum").device == model.w.device
        else:
            slot = opt.get_slot(model.w, "momentum")
            assert [s.device for s in slot.variables] == [s.device for s in model.w.variables]


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_assigning_the_state_on_the_coordinator_writes_the_ps_copies(optimizer):
    batches = ps_model.data(4)
    with in_process_cluster(num_workers=1, num_ps=2) as strategy:
        with strategy.scope():
            model = ps_model.Model(optimizer)
        train_ps(strategy, model, batches[:2])
        reference = plain_model(optimizer, batches[:2])
        # the plain loop's state set from the coordinator, then both go on: the same run
        model.optimizer.iterations.assign(7)
        reference.optimizer.iterations.assign(7)
        for name in SLOTS[optimizer]:
            model.optimizer.get_slot(model.b, name).assign(np.full(3, 0.25, np.float32))
            reference.optimizer.get_slot(reference.b, name).assign(np.full(3, 0.25, np.float32))
        step = Coordinator(strategy).schedule(model.train_step, args=batches[2]).fetch()
        assert step == 8  # (both ps tasks' copies applied at step 7)
        train_ps(strategy, model, batches[3:])
        train_plain(reference, batches[2:])
        assert_same_state(model, reference, optimizer)


def test_iterations_before_any_step_is_zero_on_the_ps():
    with in_process_cluster(num_workers=1) as strategy:
        with strategy.scope():
            model = ps_model.Model("adam")
        iterations = model.optimizer.iterations
        assert int(iterations.numpy()) == 0 and iterations.device.startswith("/job:ps/")
        assert [v.name for v in model.optimizer.variables] == [iterations.name]


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("partitioner", [None, SHARDED])
def test_checkpoint_then_a_new_cluster_continues_the_uninterrupted_run(tmp_path, optimizer, partitioner):
    batches = ps_model.data(6)
    with in_process_cluster(num_workers=1, num_ps=2, variable_partitioner=partitioner) as strategy:
        with strategy.scope():
            model = ps_model.Model(optimizer)
        train_ps(strategy, model, batches[:3])
        path = md.train.Checkpoint(model=model).save(str(tmp_path / "ckpt"))
    with in_process_cluster(num_workers=1, num_ps=2, variable_partitioner=partitioner) as strategy:
        with strategy.scope():
            model = ps_model.Model(optimizer)
        # restored before the first step: the slots wait for their build on the ps tasks
        md.train.Checkpoint(model=model).restore(path)
        assert int(model.optimizer.iterations.numpy()) == 3
        train_ps(strategy, model, batches[3:])
        assert_same_state(model, plain_model(optimizer, batches), optimizer)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_a_ps_checkpoint_is_the_plain_loops_and_back(tmp_path, optimizer):
    batches = ps_model.data(6)
    with in_process_cluster(num_workers=1, num_ps=2) as strategy:
        with strategy.scope():
            model = ps_model.Model(optimizer)
        train_ps(strategy, model, batches[:3])
        ps_path = md.train.Checkpoint(model=model).save(str(tmp_path / "ps" / "ckpt"))
    reference = plain_model(optimizer, batches[:3])
    plain_path = md.train.Checkpoint(model=reference).save(str(tmp_path / "plain" / "ckpt"))
    # the same file layout (TF's names, Keras 3's _variables/N) and the same values
    ps_entries, plain_entries = md.train.list_variables(ps_path), md.train.list_variables(plain_path)
    assert ps_entries == plain_entries
    for name, _ in plain_entries:
        if name != "save_counter/.ATTRIBUTES/VARIABLE_VALUE":
            np.testing.assert_array_equal(md.train.load_variable(ps_path, name),
                                          md.train.load_variable(plain_path, name))
    # a PSS save restored without a strategy (before the optimizer's build) continues as the plain loop
    restored = ps_model.Model(optimizer)
    md.train.Checkpoint(model=restored).restore(ps_path)
    train_plain(restored, batches[3:])
    uninterrupted = plain_model(optimizer, batches)
    assert_same_state(restored, uninterrupted, optimizer)
    # and a plain save restored under PSS
    with in_process_cluster(num_workers=1, num_ps=2) as strategy:
        with strategy.scope():
            model = ps_model.Model(optimizer)
        md.train.Checkpoint(model=model).restore(plain_path)
        train_ps(strategy, model, batches[3:])
        assert_same_state(model, uninterrupted, optimizer)


def test_a_restore_after_steps_assigns_the_ps_copies_at_once(tmp_path):
    batches = ps_model.data(5)
    with in_process_cluster(num_workers=1, num_ps=2) as strategy:
        with strategy.scope():
            model = ps_model.Model("adam")
        train_ps(strategy, model, batches[:2])
        checkpoint = md.train.Checkpoint(model=model)
        path = checkpoint.save(str(tmp_path / "ckpt"))
        train_ps(strategy, model, batches[2:4])  # moves on; the restore goes back
        checkpoint.restore(path).assert_consumed()
        assert int(model.optimizer.iterations.numpy()) == 2
        train_ps(strategy, model, batches[2:])
        assert_same_state(model, plain_model("adam", batches), "adam")


def test_a_checkpoint_of_another_optimizer_kind_is_refused_naming_the_fix(tmp_path):
    batches = ps_model.data(2)
    with in_process_cluster(num_workers=1) as strategy:
        with strategy.scope():
            model = ps_model.Model("adam")
        train_ps(strategy, model, batches)
        path = md.train.Checkpoint(model=model).save(str(tmp_path / "ckpt"))
    with in_process_cluster(num_workers=1) as strategy:  # restored before the build: refused at the build
        with strategy.scope():
            model = ps_model.Model("sgd")
        md.train.Checkpoint(model=model).restore(path)
        coordinator = Coordinator(strategy)
        coordinator.schedule(model.train_step, args=batches[0])
        with pytest.raises(CheckpointError, match="create the optimizer it was saved with"):
            coordinator.join()
    with in_process_cluster(num_workers=1) as strategy:  # restored after it: refused at once
        with strategy.scope():
            model = ps_model.Model("sgd")
        train_ps(strategy, model, batches[:1])
        with pytest.raises(CheckpointError, match="create the optimizer it was saved with"):
            md.train.Checkpoint(model=model).restore(path)


def test_a_step_request_does_not_carry_the_optimizers_state():
    with in_process_cluster(num_workers=1) as strategy:
        with strategy.scope():
            model = ps_model.Model("adam")
        sent = len(rpc.dumps(model.optimizer, "optimizer")[0])
        train_ps(strategy, model, ps_model.data(2))
        assert len(model.optimizer.variables) == 5 and model.optimizer.built  # (handles now)
        assert len(rpc.dumps(model.optimizer, "optimizer")[0]) == sent


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_a_dynamic_loss_scale_grows_and_halves_as_the_plain_loops(optimizer):
    batches = ps_model.data(9)
    blow_ups = [False, False, False, True, False, True, True, False, False]
    with in_process_cluster(num_workers=1, num_ps=2) as strategy:
        with strategy.scope():
            model = ps_model.ScaledModel(optimizer)
        coordinator = Coordinator(strategy)
        steps = [coordinator.schedule(model.train_step, args=batch + (blow_up,))
                 for batch, blow_up in zip(batches, blow_ups)]
        coordinator.join()
        reference = ps_model.scaled_plain_loop(optimizer, batches, blow_ups)
        assert [s.fetch() for s in steps] == [1, 2, 3, 3, 4, 4, 4, 5, 6]  # (skipped steps do not count)
        assert model.optimizer.loss_scale == reference.optimizer.loss_scale
        assert model.optimizer.dynamic_counter == reference.optimizer.dynamic_counter
        assert_same_state(model, reference, optimizer)


def test_a_loss_scaled_step_adds_one_request_for_the_scale():
    batches = ps_model.data(4)
    with in_process_cluster(num_workers=1, num_ps=1) as strategy:
        with strategy.scope():
            model = ps_model.ScaledModel("adam")
        # per step: the scale, w and b read by the step (one request each), the scale's update, one update of
        # both variables; (+1: the first stats request)
        assert ps_model.requests_of_later_steps(strategy, Coordinator(strategy), model, batches) == 3 * 5 + 1


def test_a_loss_scale_optimizer_made_outside_the_scope_is_refused_naming_the_fix():
    with in_process_cluster(num_workers=1) as strategy:
        with strategy.scope():
            model = ps_model.Model("sgd")
        model.optimizer = md.mixed_precision.LossScaleOptimizer(model.optimizer)
        with pytest.raises(ValueError, match="create it there"):
            Coordinator(strategy).schedule(ps_model.apply_one, args=(model.optimizer, np.ones(3, np.float32),
                                                                     model.b)).fetch()


@pytest.mark.multiworker
def test_processes_checkpoint_then_a_new_cluster_continues_the_uninterrupted_run(tmp_path):
    batches = ps_model.data(6)
    with process_cluster(num_workers=1, num_ps=2) as strategy:
        with strategy.scope():
            model = ps_model.Model("adam")
        train_ps(strategy, model, batches[:3])
        path = md.train.Checkpoint(model=model).save(str(tmp_path / "ckpt"))
    with process_cluster(num_workers=1, num_ps=2) as strategy:
        with strategy.scope():
            model = ps_model.Model("adam")
        md.train.Checkpoint(model=model).restore(path)  # (before the first step: restored at the ps build)
        train_ps(strategy, model, batches[3:])
        assert_same_state(model, plain_model("adam", batches), "adam")


def test_a_hung_worker_misses_its_heartbeat_and_its_function_runs_on_another(monkeypatch):
    from mirrored.distribute.parameter_server import coordinator as coordinator_lib

    # (the deadline only says how soon the hang is found: a healthy worker that misses it by a busy machine
    # gets its function rescheduled too, which still gives these results)
    monkeypatch.setattr(coordinator_lib, "HEARTBEAT_SECONDS", 1.0)
    ps_model.RELEASE_HUNG.clear()
    with in_process_cluster(num_workers=2) as strategy:
        coordinator = Coordinator(strategy)
        try:
            held = coordinator_lib._Closure(ps_model.hang_worker, (1,), {}, coordinator_lib._RemoteValueImpl())
            coordinator._cluster.queue.put(held, tag=1)  # (worker 1's own: it takes it, and hangs)
            assert held.output.fetch() == 0  # rescheduled on worker 0 once worker 1 missed its heartbeat
            others = [coordinator.schedule(ps_model.identity, args=(i,)) for i in range(4)]
            coordinator.join()
            assert coordinator.fetch(others) == list(range(4))
        finally:
            ps_model.RELEASE_HUNG.set()



@pytest.mark.parametrize("value", ["soon", "-1", "inf"])
def test_a_bad_heartbeat_deadline_is_refused_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv("MIRRORED_PS_HEARTBEAT_SECONDS", value)
    with in_process_cluster(num_workers=1) as strategy:
        with pytest.raises(ValueError, match="MIRRORED_PS_HEARTBEAT_SECONDS=.*a number >= 0"):
            Coordinator(strategy)


def test_steps_on_the_coordinator_and_on_a_worker_share_the_state():
    batches = ps_model.data(4)
    with in_process_cluster(num_workers=1, num_ps=2) as strategy:
        with strategy.scope():
            model = ps_model.Model("adam")
            for x, y in batches[:2]:  # on the coordinator itself, in the strategy's scope
                gw, gb = ps_model.gradients(model.w, model.b, x, y)
                model.optimizer.apply_gradients([(gw, model.w), (gb, model.b)])
        assert int(model.optimizer.iterations.numpy()) == 2
        train_ps(strategy, model, batches[2:])
        assert_same_state(model, plain_model("adam", batches), "adam")
