"""TensorFlow checkpoints (TensorBundle) read without TensorFlow: names, values, restore by object names, faults.

The checkpoint under tests/data/tf_checkpoint was written by TensorFlow 2.21
(make_tf_checkpoint.py beside it); expected.npz holds TF's own reading of it.
"""

import os
import pathlib
import shutil

import numpy as np
import pytest

import mirrored as md
from mirrored.data import crc32c as crc
from mirrored.train import tensorbundle

DATA = pathlib.Path(__file__).parent / "data" / "tf_checkpoint"
MANAGED = DATA / "managed"
V = "/.ATTRIBUTES/VARIABLE_VALUE"


def _expected() -> dict:
    with np.load(DATA / "expected.npz", allow_pickle=False) as npz:
        return {k.replace("|", "/"): npz[k] for k in npz.files}


@pytest.fixture
def tf_dir(tmp_path):
    target = tmp_path / "managed"
    shutil.copytree(MANAGED, target)
    return target


def test_latest_checkpoint_of_a_tensorflow_directory_is_its_newest_prefix():
    assert md.train.latest_checkpoint(MANAGED) == str(MANAGED / "ckpt-3")


def test_list_variables_matches_tensorflow():
    expected = _expected()
    listed = md.train.list_variables(MANAGED)
    assert [name for name, _ in listed] == sorted(expected)
    for name, shape in listed:
        if name != tensorbundle.OBJECT_GRAPH_KEY:
            assert tuple(shape) == expected[name].shape, name
    # The prefix, its .index and its data shard name the same checkpoint.
    for path in (MANAGED / "ckpt-3", MANAGED / "ckpt-3.index", MANAGED / "ckpt-3.data-00000-of-00001"):
        assert md.train.list_variables(path) == listed


def test_load_variable_matches_tensorflow_values_and_dtypes():
    dtypes = {"model/scale": "bfloat16", "model/codes": "int8", "model/count": "int64", "model/flag": "bool",
              "model/half": "float16", "model/dense/w": "float32", "model/dense/b": "float64",
              "model/empty": "float32"}
    for name, want in _expected().items():
        got = md.train.load_variable(MANAGED, name)
        if name == tensorbundle.OBJECT_GRAPH_KEY:
            assert isinstance(got, bytes) and got == want.tobytes()
            continue
        np.testing.assert_array_equal(np.asarray(got).astype(want.dtype), want, err_msg=name)
        short = name[:-len(V)]
        if short in dtypes:
            assert got.dtype.name == dtypes[short], name
    assert int(md.train.load_variable(MANAGED / "ckpt-2", "step" + V)) == 2


def test_crc32c_is_castagnoli():
    assert crc.crc32c(b"123456789") == 0xE3069283  # the standard check value
    assert crc.crc32c(b"") == 0
    assert crc.unmask(crc.mask(0x12345678)) == 0x12345678


@pytest.mark.parametrize("n", [1, 4096 * 64 - 1, 4096 * 64, 4096 * 64 + 17, (1 << 20) + 3, 65536 * 64,
                               65536 * 64 + 99, 65536 * 70 + 5])
def test_crc32c_in_lanes_equals_the_byte_loop(n):
    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes()
    for start in (0, 0xDEADBEEF):
        assert crc.crc32c(data, start) == crc._crc32c_bytes(data, start)
    half = n // 2
    assert crc.crc32c(data[half:], crc.crc32c(data[:half])) == crc.crc32c(data)


class Dense:
    def __init__(self, n_in, n_out):
        self.w = md.Variable(np.zeros((n_in, n_out), np.float32))
        self.b = md.Variable(np.zeros(n_out, np.float64))


class Model:
    def __init__(self, w_shape=(3, 2)):
        import ml_dtypes

        self.dense = Dense(*w_shape)
        self.layers = [Dense(2, 4), Dense(4, 1)]
        self.scale = md.Variable(np.zeros((2, 2), ml_dtypes.bfloat16))
        self.codes = md.Variable(np.zeros(5, np.int8))
        self.count = md.Variable(np.int64(0))
        self.empty = md.Variable(np.zeros((0, 3), np.float32))
        self.flag = md.Variable(False)
        self.half = md.Variable(np.zeros(3, np.float16))


def _variables(model) -> dict:
    return {"model/dense/w": model.dense.w, "model/dense/b": model.dense.b,
            **{f"model/layers/{i}/{k}": getattr(layer, k) for i, layer in enumerate(model.layers) for k in "wb"},
            **{f"model/{k}": getattr(model, k) for k in ("scale", "codes", "count", "empty", "flag", "half")}}


@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_restore_into_a_port_by_tensorflow_object_names(replicas):
    strategy = md.MirroredStrategy(devices=[f"/cpu:{i}" for i in range(replicas)])
    with strategy.scope():
        model, step = Model(), md.Variable(np.int64(0))
    ckpt = md.train.Checkpoint(model=model, step=step)
    ckpt.restore(md.train.latest_checkpoint(MANAGED)).assert_consumed()
    expected = _expected()
    for key, var in _variables(model).items():
        np.testing.assert_array_equal(np.asarray(var.numpy()).astype(np.float64),
                                      expected[key + V].astype(np.float64), err_msg=key)
        assert all(np.array_equal(np.asarray(c), np.asarray(var.values[0])) for c in var.values)
    assert int(step.numpy()) == 3 and int(ckpt.save_counter.numpy()) == 3


def test_a_partial_port_restores_what_it_tracks():
    strategy = md.MirroredStrategy(devices=["/cpu:0"])
    with strategy.scope():
        dense = Dense(3, 2)
    status = md.train.Checkpoint(model={"dense": dense}).restore(MANAGED / "ckpt-3")
    np.testing.assert_array_equal(dense.w.numpy(), _expected()["model/dense/w" + V])
    with pytest.raises(AssertionError, match="model/layers/0/w"):
        status.assert_consumed()
    status.assert_existing_objects_matched()


def test_a_variable_of_another_shape_is_named_and_nothing_is_restored():
    strategy = md.MirroredStrategy(devices=["/cpu:0"])
    with strategy.scope():
        model = Model(w_shape=(3, 5))
    with pytest.raises(md.train.CheckpointError, match=r"model/dense/w: file has float32\[3, 2\], variable is "
                                                       r"float32\[3, 5\]"):
        md.train.Checkpoint(model=model).restore(MANAGED / "ckpt-3")
    assert not model.codes.numpy().any()  # nothing assigned


def test_a_tensorflow_file_given_as_a_mirrored_file_says_what_it_is():
    for path in (MANAGED / "ckpt-3.index", MANAGED / "ckpt-3", MANAGED / "ckpt-3.data-00000-of-00001"):
        with pytest.raises(md.train.CheckpointError, match="TensorFlow checkpoint .*ckpt-3.* pass that prefix"):
            md.checkpoint.load_checkpoint(path)  # mirrored's own files only


def test_load_checkpoint_reads_tensorflow_files_as_tf_train_load_checkpoint():
    reader = md.train.load_checkpoint(MANAGED)  # a directory: its latest, as TF's
    assert reader.get_variable_to_shape_map() == dict(md.train.list_variables(MANAGED / "ckpt-3"))
    for name in reader.get_variable_to_shape_map():
        assert reader.has_tensor(name)
        if name != "_CHECKPOINTABLE_OBJECT_GRAPH":
            expected = md.train.load_variable(MANAGED / "ckpt-3", name)
            assert reader.get_variable_to_dtype_map()[name] == expected.dtype
            np.testing.assert_array_equal(reader.get_tensor(name), expected)
    with pytest.raises(md.train.NotFoundError):
        reader.get_tensor("nope")


def _flip(path, at):
    blob = bytearray(path.read_bytes())
    blob[at] ^= 0x01
    path.write_bytes(bytes(blob))


def test_a_corrupted_tensor_is_named_and_nothing_is_restored(tf_dir):
    with tensorbundle.BundleReader(tf_dir / "ckpt-3") as bundle:
        entry = bundle.entry("model/codes" + V)
    _flip(tf_dir / "ckpt-3.data-00000-of-00001", entry.offset + 2)
    with pytest.raises(md.train.CheckpointError, match=r"model/codes/.*CRC32C mismatch"):
        md.train.load_variable(tf_dir, "model/codes" + V)
    strategy = md.MirroredStrategy(devices=["/cpu:0"])
    with strategy.scope():
        model, step = Model(), md.Variable(np.int64(0))
    with pytest.raises(md.train.CheckpointError, match="CRC32C mismatch"):
        md.train.Checkpoint(model=model, step=step).restore(tf_dir / "ckpt-3")
    assert int(step.numpy()) == 0 and not model.dense.w.numpy().any()


def test_a_corrupted_index_block_is_refused(tf_dir):
    _flip(tf_dir / "ckpt-3.index", 10)
    with pytest.raises(md.train.CheckpointError, match=r"ckpt-3.index.*corrupted"):
        md.train.list_variables(tf_dir / "ckpt-3")


@pytest.mark.parametrize("cut", [0, 20, 47, -1])
def test_a_truncated_index_is_refused(tf_dir, cut):
    index = tf_dir / "ckpt-3.index"
    blob = index.read_bytes()
    index.write_bytes(blob[:cut] if cut >= 0 else blob[:-1])
    with pytest.raises(md.train.CheckpointError, match="ckpt-3.index"):
        md.train.list_variables(tf_dir / "ckpt-3")


def test_a_truncated_or_missing_data_shard_is_named(tf_dir):
    with tensorbundle.BundleReader(tf_dir / "ckpt-3") as bundle:
        last = max((bundle.entry(k) for k in bundle.keys), key=lambda e: e.offset)
    data = tf_dir / "ckpt-3.data-00000-of-00001"
    data.write_bytes(data.read_bytes()[:last.offset + last.size - 1])
    with pytest.raises(md.train.CheckpointError, match=f"truncated: tensor '{last.key}'"):
        md.train.load_variable(tf_dir, last.key)
    os.remove(data)
    with pytest.raises(FileNotFoundError, match="data-00000-of-00001"):
        md.train.load_variable(tf_dir, last.key)


def test_an_unknown_name_lists_what_the_checkpoint_holds():
    with pytest.raises(KeyError, match="model/dense/w/.ATTRIBUTES/VARIABLE_VALUE"):
        md.train.load_variable(MANAGED, "model/nothing")


def test_a_manager_on_a_tensorflow_directory_restores_its_latest(tf_dir):
    strategy = md.MirroredStrategy(devices=["/cpu:0"])
    with strategy.scope():
        model, step = Model(), md.Variable(np.int64(0))
    manager = md.train.CheckpointManager(md.train.Checkpoint(model=model, step=step), tf_dir, max_to_keep=2)
    assert manager.restore_or_initialize() == str(tf_dir / "ckpt-3")
    assert int(step.numpy()) == 3
    manager.save()  # ckpt-4, a mirrored file; TensorFlow's files are not this manager's to delete
    assert (tf_dir / "ckpt-2.index").exists() and (tf_dir / "ckpt-4").exists()


def test_any_flipped_bit_of_the_index_gives_a_named_error_or_the_true_values(tf_dir):
    index = tf_dir / "ckpt-3.index"
    blob = index.read_bytes()
    expected = _expected()
    for at in range(len(blob)):
        for bit in (0x01 << (at % 8),):
            damaged = bytearray(blob)
            damaged[at] ^= bit
            index.write_bytes(bytes(damaged))
            try:
                listed = md.train.list_variables(tf_dir / "ckpt-3")
                values = {name: md.train.load_variable(tf_dir / "ckpt-3", name) for name, _ in listed}
            except (md.train.CheckpointError, FileNotFoundError, KeyError) as e:
                assert "ckpt-3" in str(e), (at, bit, e)
                continue
            # Only the footer's padding is outside every checksum: what loads is what TensorFlow wrote.
            assert sorted(values) == sorted(expected), (at, bit)
