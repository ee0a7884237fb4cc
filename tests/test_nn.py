"""md.nn loss scaling with tf.nn's semantics, and a TF-style training loop that trains the same at any
replica count: per-replica loss / global batch, gradients SUMMED by the optimizer (as Keras does)."""

import numpy as np
import pytest

import mirrored as md


def _strategy(n):
    return md.MirroredStrategy(devices=[f"/cpu:{i}" for i in range(n)])


# --- compute_average_loss / scale_regularization_loss ---------------------------------------------

def test_compute_average_loss_divides_the_sum_by_the_global_batch():
    losses = np.array([1.0, 2.0, 3.0, 6.0], np.float32)
    out = md.nn.compute_average_loss(losses, global_batch_size=8)
    assert out.dtype == np.float32 and out.shape == ()
    assert float(out) == 1.5
    assert float(md.nn.compute_average_loss(losses)) == 3.0  # no strategy: one replica, batch 4
    assert float(md.nn.compute_average_loss(losses, global_batch_size=0)) == 0.0  # div_no_nan
    assert float(md.nn.compute_average_loss(losses, global_batch_size=np.int64(4))) == 3.0


def test_default_divisor_is_the_per_replica_batch_times_replicas_in_sync():
    strategy = _strategy(4)
    out = strategy.run(lambda: md.nn.compute_average_loss(np.full(3, 6.0)))
    assert all(float(v) == 18.0 / 12 for v in out.values)  # 3 rows x 4 replicas
    assert float(strategy.reduce("SUM", out, axis=None)) == 6.0  # the global mean
    reg = strategy.run(lambda: md.nn.scale_regularization_loss(np.array([2.0, 6.0])))
    assert all(float(v) == 2.0 for v in reg.values)  # 8 / 4 replicas: summed, counted once


def test_sample_weight_broadcasts_as_keras_losses_do():
    losses = np.array([[1.0, 2.0], [3.0, 4.0]])
    # Scalar weight; per-example weight (rank one less: a trailing 1 is added); a trailing 1 squeezed.
    assert float(md.nn.compute_average_loss(losses, sample_weight=0.5, global_batch_size=2)) == 2.5
    w = np.array([1.0, 0.0])
    assert float(md.nn.compute_average_loss(losses, sample_weight=w, global_batch_size=2)) == 1.5
    per_example = np.array([1.0, 2.0, 3.0])
    out = md.nn.compute_average_loss(per_example, sample_weight=np.array([[2.0], [0.0], [1.0]]), global_batch_size=5)
    assert float(out) == 1.0
    with pytest.raises(ValueError, match="does not broadcast"):
        md.nn.compute_average_loss(per_example, sample_weight=np.ones(2), global_batch_size=3)
    with pytest.raises(ValueError, match="last dimension must be 1"):
        md.nn.compute_average_loss(per_example, sample_weight=np.ones((3, 2)), global_batch_size=3)


@pytest.mark.parametrize("bad,error,message", [
    (8.0, TypeError, "global_batch_size must be an integer"),
    (True, TypeError, "global_batch_size must be an integer"),
    (np.float32(8), TypeError, "global_batch_size must be an integer"),
    (np.array([8]), ValueError, "global_batch_size must be scalar"),
    (-1, ValueError, "global_batch_size must be non-negative"),
])
def test_global_batch_size_must_be_a_non_negative_integer(bad, error, message):
    with pytest.raises(error, match=message):
        md.nn.compute_average_loss(np.ones(4), global_batch_size=bad)


def test_bad_losses_and_cross_replica_context_raise_as_tf_does():
    with pytest.raises(ValueError, match="at least rank 1"):
        md.nn.compute_average_loss(np.float64(1.0), global_batch_size=1)
    with pytest.raises(TypeError, match="floating-point"):
        md.nn.compute_average_loss(np.array([True, False]), global_batch_size=3)
    strategy = _strategy(2)
    with strategy.scope():
        with pytest.raises(RuntimeError, match="`compute_average_loss` in cross replica context"):
            md.nn.compute_average_loss(np.ones(4))
        with pytest.raises(RuntimeError, match="`scale_regularization_loss` in cross replica context"):
            md.nn.scale_regularization_loss(np.ones(1))
        # With an explicit global batch size it is fine anywhere.
        assert float(md.nn.compute_average_loss(np.ones(4), global_batch_size=8)) == 0.5


# --- the TF custom-training-loop idiom: the same losses at any replica count -------------------------

GLOBAL_BATCH, STEPS, L2 = 8, 6, 0.01


def _data():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(GLOBAL_BATCH * STEPS, 5))
    y = x @ rng.normal(size=(5, 1)) + 0.1 * rng.normal(size=(GLOBAL_BATCH * STEPS, 1))
    return x, y


def _step_fn(w, optimizer):
    def step(x, y):
        w_local = np.asarray(w.read_value())
        err = x @ w_local - y
        per_example_loss = (err ** 2).sum(axis=1)
        # As TF's guide: per-replica loss scaled by the global batch, regularisation by the replica count.
        loss = md.nn.compute_average_loss(per_example_loss) + md.nn.scale_regularization_loss(L2 * (w_local ** 2).sum())
        n = md.get_replica_context().num_replicas_in_sync
        grad = 2 * x.T @ err / (len(x) * n) + 2 * L2 * w_local / n
        optimizer.apply_gradients([(grad, w)])
        return loss
    return step


def _train(n):
    strategy = _strategy(n)
    with strategy.scope():
        w = md.Variable(np.zeros((5, 1)), name="w")
        optimizer = md.optimizers.SGD(0.1, momentum=0.5)
    x, y = _data()
    step = _step_fn(w, optimizer)
    dataset = strategy.experimental_distribute_dataset(
        [(x[i:i + GLOBAL_BATCH], y[i:i + GLOBAL_BATCH]) for i in range(0, len(x), GLOBAL_BATCH)])
    losses = [float(strategy.reduce("SUM", strategy.run(step, args=batch), axis=None)) for batch in dataset]
    return np.array(losses), w.numpy()


def test_a_tf_style_loop_gives_the_same_losses_at_1_2_and_4_replicas():
    losses1, w1 = _train(1)
    assert losses1[-1] < losses1[0] / 2  # it trains
    for n in (2, 4):
        losses, w = _train(n)
        np.testing.assert_allclose(losses, losses1, rtol=1e-12, err_msg=f"{n} replicas")
        np.testing.assert_allclose(w, w1, rtol=1e-12)


def _worker_train():
    from mirrored.distribute.multi_worker_strategy import MultiWorkerMirroredStrategy

    strategy = MultiWorkerMirroredStrategy(md.CommunicationOptions(timeout_seconds=30), devices=["/cpu:0"])
    with strategy.scope():
        w = md.Variable(np.zeros((5, 1)), name="w")
        optimizer = md.optimizers.SGD(0.1, momentum=0.5)
    x, y = _data()
    step = _step_fn(w, optimizer)
    k, share = strategy.cluster_resolver.task_id, GLOBAL_BATCH // 2
    losses = []
    for i in range(0, len(x), GLOBAL_BATCH):  # each worker takes its half of every global batch
        rows = slice(i + k * share, i + (k + 1) * share)
        losses.append(float(strategy.reduce("SUM", strategy.run(step, args=(x[rows], y[rows])), axis=None)))
    return losses, w.numpy()


@pytest.mark.multiworker
def test_a_tf_style_loop_gives_the_same_losses_across_2_workers():
    pytest.importorskip("mirrored._net", reason="Gloo not built (apt-get install libgloo-dev)")
    from multiworker_launch import launch

    results = launch(_worker_train, 2, timeout=120)
    for r in results:
        assert r.ok, (r.task, r.error, r.message, r.stderr[-2000:])
    losses1, w1 = _train(1)
    for r in results:
        losses, w = r.value
        np.testing.assert_allclose(losses, losses1, rtol=1e-12)
        np.testing.assert_allclose(w, w1, rtol=1e-12)
