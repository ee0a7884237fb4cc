"""Records TensorFlow 2.21's tf.errors (every class and code: bases, error_code, constructor, message, str, pickling,
experimental_payloads, the code <-> class mapping of tf.compat.v1.errors) and the class and message TF raises for
each user action of ``actions`` below (a missing file, a corrupt record, a missing checkpoint...):
tests/data/tf_errors_reference.json, read by tests/test_errors.py (never imported by the tests).

    /path/to/venv-with-tensorflow/bin/python tests/data/record_tf_errors.py
"""

import inspect
import os
import pickle
import tempfile

from recording import tf, write_reference  # (this folder)

CLASSES = sorted(n for n in dir(tf.errors) if isinstance(getattr(tf.errors, n), type))
CODES = sorted(n for n in dir(tf.errors) if n.isupper())


def class_facts(name):
    cls = getattr(tf.errors, name)
    facts = {"bases": [b.__name__ for b in cls.__mro__[1:] if b is not object],
             "parameters": list(inspect.signature(cls.__init__).parameters)[1:]}
    if not issubclass(cls, tf.errors.OpError):
        return facts
    e = cls(None, None, "the message") if cls is not tf.errors.OpError else cls(None, None, "the message", 5)
    again = pickle.loads(pickle.dumps(e))
    with_payloads = (cls(None, None, "m", {"k": b"v"}) if cls is not tf.errors.OpError
                     else cls(None, None, "m", 5, {"k": b"v"}))
    facts.update(error_code=e.error_code, message=e.message, str=str(e), op=e.op, node_def=e.node_def,
                 payloads=e.experimental_payloads, given_payloads={k: v.decode() for k, v in
                                                                   with_payloads.experimental_payloads.items()},
                 pickled={"type": type(again).__name__, "message": again.message, "error_code": again.error_code})
    return facts


def raised(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - TF's error is the recorded answer
        return {"raises": [c.__name__ for c in type(e).__mro__ if c is not object], "msg": str(e)}
    return {"raises": None}


def drain(dataset):
    for _ in dataset:
        pass


def tfrecord(path, damage):
    """A file of two records, then ``damage``d: (offset, bytes) overwritten, or an int: the length kept."""
    with tf.io.TFRecordWriter(path) as w:
        w.write(b"hello")
        w.write(b"world!")
    with open(path, "r+b") as f:
        if isinstance(damage, int):
            f.truncate(damage)
        else:
            f.seek(damage[0])
            f.write(damage[1])
    return path


def actions(root):
    join = lambda *p: os.path.join(root, *p)  # noqa: E731
    ck = tf.train.Checkpoint(v=tf.Variable(1.0))
    saved = ck.write(join("ok", "ckpt"))
    with open(saved + ".data-00000-of-00001", "r+b") as f:
        f.write(b"\xff\xff\xff\xff")
    corrupt_data = saved
    ck2 = tf.train.Checkpoint(v=tf.Variable(1.0))
    index = ck2.write(join("ix", "ckpt"))
    with open(index + ".index", "r+b") as f:
        f.truncate(10)
    it = iter(tf.data.Dataset.range(1))
    next(it)
    cases = {
        "tfrecord_missing_file": lambda: drain(tf.data.TFRecordDataset(join("absent.tfrecord"))),
        "textline_missing_file": lambda: drain(tf.data.TextLineDataset(join("absent.txt"))),
        "fixed_length_missing_file": lambda: drain(tf.data.FixedLengthRecordDataset(join("absent.bin"), 4)),
        "list_files_no_match": lambda: tf.data.Dataset.list_files(join("none-*.txt")),
        "tfrecord_bad_length_crc": lambda: drain(tf.data.TFRecordDataset(tfrecord(join("a.tfrecord"), (8, b"\0")))),
        "tfrecord_bad_data_crc": lambda: drain(tf.data.TFRecordDataset(tfrecord(join("b.tfrecord"), (12, b"J")))),
        "tfrecord_truncated_header": lambda: drain(tf.data.TFRecordDataset(tfrecord(join("c.tfrecord"), 21 + 6))),
        "tfrecord_truncated_data": lambda: drain(tf.data.TFRecordDataset(tfrecord(join("d.tfrecord"), 21 + 14))),
        "load_missing": lambda: drain(tf.data.Dataset.load(join("no-saved-dataset"))),
        "get_next_past_end": lambda: it.get_next(),
        "checkpoint_restore_missing": lambda: tf.train.Checkpoint(v=tf.Variable(1.0)).restore(join("nope-1")),
        "checkpoint_read_missing": lambda: tf.train.Checkpoint(v=tf.Variable(1.0)).read(join("nope-1")),
        "load_variable_missing_key": lambda: tf.train.load_variable(ck.write(join("k", "ckpt")), "w"),
        "checkpoint_corrupt_data": lambda: tf.train.Checkpoint(v=tf.Variable(0.0)).read(corrupt_data),
        "checkpoint_truncated_index": lambda: tf.train.Checkpoint(v=tf.Variable(0.0)).read(index),
        "list_variables_truncated_index": lambda: tf.train.list_variables(index),
        # root writes anywhere it may: /sys refuses every new entry (EPERM), as a read-only directory refuses a user
        "manager_save_not_permitted": lambda: tf.train.CheckpointManager(ck, "/sys/mirrored-errors-probe",
                                                                         max_to_keep=1).save(),
        "checkpoint_write_not_permitted": lambda: ck.write("/sys/mirrored-errors-probe/ckpt"),
    }
    return {name: raised(fn) for name, fn in cases.items()}


if __name__ == "__main__":
    compat = tf.compat.v1.errors
    with tempfile.TemporaryDirectory() as root:
        reference = {
            "classes": {name: class_facts(name) for name in CLASSES},
            "codes": {name: getattr(tf.errors, name) for name in CODES},
            "class_of_code": {str(getattr(tf.errors, n)): compat.exception_type_from_error_code(
                getattr(tf.errors, n)).__name__ for n in CODES if n != "OK"},
            "code_of_class": {n: compat.error_code_from_exception_type(getattr(tf.errors, n)) for n in CLASSES
                              if n not in ("OpError", "OperatorNotAllowedInGraphError")},
            "actions": {k: {**v, "msg": v["msg"].replace(root, "<dir>")} if "msg" in v else v
                        for k, v in actions(root).items()},
        }
    write_reference("tf_errors_reference.json", reference, indent=1)
