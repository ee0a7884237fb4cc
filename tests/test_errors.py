"""md.errors against TF 2.21's tf.errors (tests/data/tf_errors_reference.json, recorded by
tests/data/record_tf_errors.py): every class and code, their facts, and the class mirrored raises where TF raises
one for the same user action (a missing file, a corrupt record, a missing checkpoint...), each still the Python
built-in mirrored raised before."""

import builtins
import inspect
import io
import json
import os
import pickle

import numpy as np
import pytest

import mirrored as md
from mirrored.data.readers import tfrecord_bytes

with open(os.path.join(os.path.dirname(__file__), "data", "tf_errors_reference.json")) as _f:
    REFERENCE = json.load(_f)

# The Python built-in each OpError is too, so code written against mirrored's earlier errors keeps catching them.
BUILTINS = {"CancelledError": RuntimeError, "UnknownError": RuntimeError, "InvalidArgumentError": ValueError,
            "DeadlineExceededError": TimeoutError, "NotFoundError": FileNotFoundError,
            "AlreadyExistsError": FileExistsError, "PermissionDeniedError": PermissionError,
            "UnauthenticatedError": PermissionError, "ResourceExhaustedError": MemoryError,
            "FailedPreconditionError": RuntimeError, "AbortedError": RuntimeError, "OutOfRangeError": StopIteration,
            "UnimplementedError": NotImplementedError, "InternalError": RuntimeError,
            "UnavailableError": ConnectionError, "DataLossError": ValueError}


def test_every_class_and_code_of_tf_errors():
    for name, code in REFERENCE["codes"].items():
        assert getattr(md.errors, name) == code, name
    for name in REFERENCE["classes"]:
        assert isinstance(getattr(md.errors, name), type) and name in md.errors.__all__, name
    assert sorted(BUILTINS) == sorted(n for n in REFERENCE["classes"] if REFERENCE["classes"][n]["bases"][0] ==
                                      "OpError")


@pytest.mark.parametrize("name", sorted(REFERENCE["classes"]))
def test_class_facts_match_tf(name):
    want, cls = REFERENCE["classes"][name], getattr(md.errors, name)
    tf_bases = [getattr(md.errors, b, None) or getattr(builtins, b) for b in want["bases"]]
    assert all(issubclass(cls, base) for base in tf_bases), (cls.__mro__, want["bases"])
    assert [p for p in inspect.signature(cls.__init__).parameters][1:] == want["parameters"]
    if "error_code" not in want:  # OperatorNotAllowedInGraphError: a TypeError, not an OpError
        assert issubclass(cls, TypeError) and not issubclass(cls, md.errors.OpError)
        return
    args = (None, None, "the message") + ((5,) if cls is md.errors.OpError else ())
    e = cls(*args)
    got = {"error_code": e.error_code, "message": e.message, "str": str(e), "op": e.op, "node_def": e.node_def,
           "payloads": e.experimental_payloads}
    assert got == {k: want[k] for k in got}
    again = pickle.loads(pickle.dumps(e))
    assert {"type": type(again).__name__, "message": again.message, "error_code": again.error_code} == \
        want["pickled"]
    with_payloads = cls(*args[:3], *args[3:], {"k": b"v"})
    assert {k: v.decode() for k, v in with_payloads.experimental_payloads.items()} == want["given_payloads"]
    assert pickle.loads(pickle.dumps(with_payloads)).experimental_payloads == {"k": b"v"}
    if name in BUILTINS:
        assert issubclass(cls, BUILTINS[name])
    with pytest.raises(AttributeError):
        e.error_code = 3  # read-only, as TF's
    if cls is not md.errors.OpError:
        assert cls.error_code == want["error_code"]  # on the class too (mirrored's earlier classes had it)


def test_code_class_mapping_matches_tf_compat_v1():
    for code, name in REFERENCE["class_of_code"].items():
        assert md.errors.exception_type_from_error_code(int(code)) is getattr(md.errors, name)
    for name, code in REFERENCE["code_of_class"].items():
        assert md.errors.error_code_from_exception_type(getattr(md.errors, name)) == code
    with pytest.raises(KeyError):
        md.errors.exception_type_from_error_code(99)
    with pytest.raises(KeyError):
        md.errors.error_code_from_exception_type(ValueError)


def test_out_of_range_is_still_a_stop_iteration_in_loops():
    it = iter(md.data.Dataset.range(2))
    assert [int(x) for x in it] == [0, 1]
    with pytest.raises(md.errors.OutOfRangeError, match="End of sequence") as caught:
        it.get_next()
    assert isinstance(caught.value, StopIteration) and caught.value.error_code == md.errors.OUT_OF_RANGE


def test_from_os_error_maps_errno_as_tf_and_keeps_the_os_class():
    denied = md.errors.from_os_error(PermissionError(1, "Operation not permitted", "/sys/x"))
    assert type(denied) is md.errors.PermissionDeniedError and str(denied) == "/sys/x; Operation not permitted"
    assert denied.errno == 1 and denied.filename == "/sys/x" and isinstance(denied, PermissionError)
    read_only = md.errors.from_os_error(OSError(30, "Read-only file system", "/ro"), "cannot write /ro")
    assert isinstance(read_only, md.errors.PermissionDeniedError) and str(read_only) == "cannot write /ro"
    assert type(md.errors.from_os_error(FileExistsError(17, "File exists", "f"))) is md.errors.AlreadyExistsError
    other = IsADirectoryError(21, "Is a directory", "d")
    assert md.errors.from_os_error(other) is other
    assert type(md.errors.from_os_error(other, "d is a directory")) is IsADirectoryError


# --- where TF raises them --------------------------------------------------------------------------------------

def _tf(action):
    return REFERENCE["actions"][action]


def _raises_as_tf(action, builtin, fn, *words):
    """``fn()`` raises TF's recorded class for ``action`` (from md.errors), still the ``builtin`` it was."""
    want = _tf(action)["raises"][0]
    with pytest.raises(getattr(md.errors, want)) as caught:
        fn()
    assert isinstance(caught.value, builtin), caught.value
    for word in words:
        assert word in str(caught.value), (word, str(caught.value))
    return caught.value


def _drain(dataset):
    for _ in dataset:
        pass


@pytest.mark.parametrize("action, reader", [("tfrecord_missing_file", md.data.TFRecordDataset),
                                            ("textline_missing_file", md.data.TextLineDataset),
                                            ("fixed_length_missing_file",
                                             lambda p: md.data.FixedLengthRecordDataset(p, 4))])
def test_missing_input_file_is_not_found(tmp_path, action, reader):
    path = str(tmp_path / "absent")
    assert "No such file or directory" in _tf(action)["msg"]
    _raises_as_tf(action, FileNotFoundError, lambda: _drain(reader(path)), path, "No such file or directory")


def test_list_files_without_match_is_invalid_argument(tmp_path):
    assert "No files matched pattern" in _tf("list_files_no_match")["msg"]
    _raises_as_tf("list_files_no_match", FileNotFoundError,
                  lambda: md.data.Dataset.list_files(str(tmp_path / "none-*.txt")), "No files matched pattern")
    with pytest.raises(ValueError):  # and an InvalidArgumentError is a ValueError
        md.data.Dataset.list_files(str(tmp_path / "none-*.txt"))


def _damaged_tfrecord(path, damage):
    data = tfrecord_bytes(b"hello") + tfrecord_bytes(b"world!")
    if isinstance(damage, int):
        data = data[:damage]
    else:
        data = data[:damage[0]] + damage[1] + data[damage[0] + len(damage[1]):]
    path.write_bytes(data)
    return str(path)


@pytest.mark.parametrize("action, damage, words", [
    ("tfrecord_bad_length_crc", (8, b"\0"), ("corrupted record at 0", "Is this even a TFRecord file?")),
    ("tfrecord_bad_data_crc", (12, b"J"), ("corrupted record at 12",)),
    ("tfrecord_truncated_data", 21 + 14, ("truncated record at 21",))])
def test_corrupt_tfrecord_is_data_loss(tmp_path, action, damage, words):
    for word in words:
        assert word in _tf(action)["msg"]
    path = _damaged_tfrecord(tmp_path / "r.tfrecord", damage)
    _raises_as_tf(action, ValueError, lambda: _drain(md.data.TFRecordDataset(path)), *words)


def test_truncated_tfrecord_header_is_data_loss_where_tf_stops_silently(tmp_path):
    # TF ends the dataset without a word at a record header cut short (the record is lost unnoticed);
    # mirrored says so, as for a record cut short after its header (docs/tf_semantics.md).
    assert _tf("tfrecord_truncated_header") == {"raises": None}
    path = _damaged_tfrecord(tmp_path / "r.tfrecord", 21 + 6)
    with pytest.raises(md.errors.DataLossError, match="truncated record at 21"):
        _drain(md.data.TFRecordDataset(path))


def test_corrupt_compressed_input_is_data_loss(tmp_path):
    path = tmp_path / "c.csv"
    path.write_bytes(b"not zlib at all\n")
    with pytest.raises(md.errors.DataLossError, match="cannot decompress it as ZLIB"):
        _drain(md.data.TextLineDataset(str(path), compression_type="ZLIB"))


def test_load_of_missing_saved_dataset_is_not_found(tmp_path):
    assert "element_spec file not found" in _tf("load_missing")["msg"]
    _raises_as_tf("load_missing", FileNotFoundError, lambda: _drain(md.data.Dataset.load(str(tmp_path / "nope"))),
                  "element_spec file not found")


def test_get_next_past_the_end_is_out_of_range():
    it = iter(md.data.Dataset.range(1))
    it.get_next()
    assert "End of sequence" in _tf("get_next_past_end")["msg"]
    _raises_as_tf("get_next_past_end", StopIteration, it.get_next, "End of sequence")


@pytest.mark.parametrize("action, method", [("checkpoint_restore_missing", "restore"),
                                            ("checkpoint_read_missing", "read")])
def test_checkpoint_of_missing_prefix_is_not_found(tmp_path, action, method):
    assert "Failed to find any matching files for" in _tf(action)["msg"]
    ckpt = md.train.Checkpoint(v=md.Variable(np.float32(1.0)))
    e = _raises_as_tf(action, FileNotFoundError, lambda: getattr(ckpt, method)(str(tmp_path / "nope-1")),
                      "Failed to find any matching files for")
    assert md.train.NotFoundError is md.errors.NotFoundError and e.error_code == md.errors.NOT_FOUND


def test_load_variable_of_missing_key_is_not_found_and_a_key_error(tmp_path):
    assert _tf("load_variable_missing_key")["msg"] == "Key w not found in checkpoint"
    path = md.train.Checkpoint(v=md.Variable(np.float32(1.0))).write(str(tmp_path / "k" / "ckpt"))
    e = _raises_as_tf("load_variable_missing_key", KeyError, lambda: md.train.load_variable(path, "w"),
                      "Key w not found in checkpoint")
    assert str(e).startswith("Key w not found in checkpoint")  # the message, not KeyError's repr of it
    assert pickle.loads(pickle.dumps(e)).message == e.message


def test_corrupt_checkpoint_is_data_loss(tmp_path):
    assert "Checksum does not match" in _tf("checkpoint_corrupt_data")["msg"]
    path = md.train.Checkpoint(v=md.Variable(np.float32(1.0))).write(str(tmp_path / "c" / "ckpt"))
    with open(path, "rb") as f:
        data = bytearray(f.read())
    data[-33] ^= 0xFF  # a byte of the value (the file ends with the value, then its 32-byte digest)
    with open(path, "wb") as f:
        f.write(bytes(data))
    ckpt = md.train.Checkpoint(v=md.Variable(np.float32(0.0)))
    _raises_as_tf("checkpoint_corrupt_data", md.train.CheckpointError, lambda: ckpt.read(path), "corrupted")
    assert float(ckpt.v.numpy()) == 0.0  # nothing assigned


def test_truncated_checkpoint_is_data_loss(tmp_path):
    # TF: an OpError ("file is too short to be an sstable") for a truncated index; a DataLossError for a
    # damaged one. mirrored: DataLossError for either, still its CheckpointError.
    assert "too short" in _tf("checkpoint_truncated_index")["msg"]
    path = md.train.Checkpoint(v=md.Variable(np.float32(1.0))).write(str(tmp_path / "t" / "ckpt"))
    with open(path, "r+b") as f:
        f.truncate(10)
    for call in (lambda: md.train.Checkpoint(v=md.Variable(np.float32(0.0))).read(path),
                 lambda: md.train.list_variables(path)):
        with pytest.raises(md.errors.DataLossError, match="truncated") as caught:
            call()
        assert isinstance(caught.value, md.train.CheckpointError)


def test_unwritable_checkpoint_directory_is_permission_denied(tmp_path, monkeypatch):
    # Tests may run as root, who writes anywhere: the refusal of the OS is simulated where mirrored creates the
    # directory; TF's recorded class is for /sys, where root too gets EPERM.
    assert "Operation not permitted" in _tf("manager_save_not_permitted")["msg"]

    def refuse(path, *args, **kwargs):
        raise PermissionError(1, "Operation not permitted", path)

    monkeypatch.setattr(os, "makedirs", refuse)
    manager = md.train.CheckpointManager(md.train.Checkpoint(v=md.Variable(np.float32(1.0))),
                                         str(tmp_path / "ro" / "dir"), max_to_keep=1)
    for action, call in (("manager_save_not_permitted", manager.save),
                         ("checkpoint_write_not_permitted",
                          lambda: md.train.Checkpoint(v=md.Variable(np.float32(1.0))).write(
                              str(tmp_path / "ro2" / "ckpt")))):
        e = _raises_as_tf(action, PermissionError, call, "Operation not permitted")
        assert e.errno == 1


def test_checkpoint_too_large_for_memory_is_resource_exhausted(tmp_path, monkeypatch):
    from mirrored.train import checkpoint as checkpoint_module
    path = md.train.Checkpoint(v=md.Variable(np.zeros(4, np.float32))).write(str(tmp_path / "m" / "ckpt"))
    real_open = open

    def tiny_meminfo(name, *args, **kwargs):
        if name == "/proc/meminfo":
            return io.StringIO("MemAvailable: 0 kB\nSwapFree: 0 kB\n")
        return real_open(name, *args, **kwargs)

    monkeypatch.setattr("builtins.open", tiny_meminfo)
    with pytest.raises(md.errors.ResourceExhaustedError, match="bytes of memory available") as caught:
        checkpoint_module._check_memory(path, 16)
    assert isinstance(caught.value, MemoryError) and caught.value.error_code == md.errors.RESOURCE_EXHAUSTED
