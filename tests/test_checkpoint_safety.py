"""Checkpoints no crafted file can turn against the user, no crash can litter, no restore can stall.

Each test is one fault of the adversarial audit (issue 20 items 3, 6, 7, 8 and 9).
"""

import hashlib
import json
import os
import pathlib
import signal
import struct
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

import mirrored as md
from mirrored.train import checkpoint as ckpt_mod


def _model(value=0.0, shape=(3,)):
    strategy = md.MirroredStrategy(devices=["/cpu:0"])
    with strategy.scope():
        return {"w": md.Variable(np.full(shape, value, np.float32), name="w")}


def _finishes(fn, timeout=60.0):
    """Run ``fn`` in a thread; return what it raised (or None). A call that blocks fails the test, not hangs it."""
    outcome = {}

    def target():
        try:
            fn()
        except BaseException as e:  # reported to the test
            outcome["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"{fn} blocked for {timeout} s"
    return outcome.get("error")


def _temporaries(directory):
    return sorted(n for n in os.listdir(directory) if ".tmp-" in n)


# --- item 3: a crafted state file never makes a manager delete what is not its own --------------------

def test_crafted_state_file_cannot_make_the_manager_delete_other_files(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    precious = tmp_path / "precious.txt"
    precious.write_text("keep me")
    absolute = tmp_path / "absolute.txt"
    absolute.write_text("keep me too")
    notes = run / "notes.txt"  # inside the directory, but not a checkpoint of this manager
    notes.write_text("mine")
    other_prefix = run / "other-1"
    other_prefix.write_text("another manager's")
    (run / "checkpoint").write_text(textwrap.dedent(f"""\
        model_checkpoint_path: "ckpt-1"
        all_model_checkpoint_paths: "../precious.txt"
        all_model_checkpoint_paths: {json.dumps(str(absolute))}
        all_model_checkpoint_paths: "notes.txt"
        all_model_checkpoint_paths: "other-1"
        all_model_checkpoint_paths: "ckpt-1/../../precious.txt"
        """))
    manager = md.train.CheckpointManager(md.train.Checkpoint(model=_model()), run, max_to_keep=1)
    for _ in range(4):
        manager.save()
    assert precious.read_text() == "keep me"
    assert absolute.read_text() == "keep me too"
    assert notes.read_text() == "mine"
    assert other_prefix.read_text() == "another manager's"
    assert sorted(os.listdir(run)) == ["checkpoint", "ckpt-4", "notes.txt", "other-1"]
    assert manager.checkpoints == [str(run / "ckpt-4")]


def test_a_checkpoint_replaced_by_a_directory_or_link_is_not_followed(tmp_path):
    run = tmp_path / "run"
    manager = md.train.CheckpointManager(md.train.Checkpoint(model=_model()), run, max_to_keep=1)
    first = manager.save()
    os.remove(first)
    target = tmp_path / "target.txt"
    target.write_text("outside")
    os.symlink(target, first)  # the oldest checkpoint is now a link to a file outside
    manager.save()
    assert target.read_text() == "outside"
    assert not os.path.lexists(first) or os.path.islink(first)


# --- item 6: an interrupted save leaves nothing after the next save -----------------------------------

def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_temporaries_of_dead_writers_are_swept_by_the_next_save(tmp_path):
    run = tmp_path / "run"
    manager = md.train.CheckpointManager(md.train.Checkpoint(model=_model()), run, max_to_keep=2)
    manager.save()
    host = ckpt_mod._HOST
    dead = _dead_pid()
    stale = [f".ckpt-7.tmp-{host}-{dead}-0123abcd", f".checkpoint.tmp-{host}-{dead}-89abcdef"]
    live_writer = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        kept = [f".ckpt-8.tmp-{host}-{live_writer.pid}-0123abcd",  # a save in progress elsewhere
                f".ckpt-9.tmp-otherhost-{dead}-0123abcd",          # another host's: its pid means nothing here
                f".model.tmp-{host}-{dead}-0123abcd"]              # another prefix's
        # A live process that started after the file was last written reused the dead writer's PID.
        reused = [f".ckpt-10.tmp-{host}-{live_writer.pid}-0123abcd", f".ckpt-11.tmp-{host}-{os.getpid()}-0123abcd"]
        for name in stale + kept + reused:
            (run / name).write_bytes(b"partial")
        # Last written a minute before either live process started (this test's own process may have run
        # for hours under a long test session: "an hour ago" is not before it).
        before_both = min(ckpt_mod._start_time(os.getpid()), ckpt_mod._start_time(live_writer.pid)) - 60
        for name in reused:
            os.utime(run / name, (before_both, before_both))
        manager.save()
        assert _temporaries(run) == sorted(kept)
    finally:
        live_writer.stdin.close()
        live_writer.wait()


_SAVE_FOREVER = """
import sys, numpy as np, mirrored as md
w = md.Variable(np.zeros(4_000_000, np.float32))  # 16 MB: a save takes long enough to be cut short
manager = md.train.CheckpointManager(md.Checkpoint(w=w), sys.argv[1], max_to_keep=2)
for i in range(1, 10**6):
    w.assign(np.full(w.shape, i, np.float32))
    manager.save()
    print(i, flush=True)
"""


def _interrupt_a_save(directory, sig):
    proc = subprocess.Popen([sys.executable, "-c", _SAVE_FOREVER, str(directory)], stdout=subprocess.PIPE)
    try:
        assert proc.stdout.readline()  # one complete save
        proc.stdout.readline()
        proc.send_signal(sig)  # most likely in the middle of writing the next one
        proc.wait(timeout=120)
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
    return proc.returncode


def test_a_sigterm_mid_save_removes_its_temporary_and_still_terminates(tmp_path):
    for _ in range(3):
        assert _interrupt_a_save(tmp_path / "run", signal.SIGTERM) == -signal.SIGTERM
        assert _temporaries(tmp_path / "run") == []


def test_a_sigkill_mid_save_leaves_nothing_after_the_next_save(tmp_path):
    run = tmp_path / "run"
    for _ in range(3):
        assert _interrupt_a_save(run, signal.SIGKILL) == -signal.SIGKILL
    strategy = md.MirroredStrategy(devices=["/cpu:0"])
    with strategy.scope():
        w = md.Variable(np.zeros(4_000_000, np.float32))
    manager = md.train.CheckpointManager(md.Checkpoint(w=w), run, max_to_keep=2)
    manager.restore_or_initialize()
    assert w.numpy().min() >= 1
    manager.save()
    assert _temporaries(run) == []


# --- item 7: a FIFO or a device never blocks a restore ------------------------------------------------

@pytest.mark.parametrize("call", ["restore", "load_variable", "list_variables", "load_checkpoint"])
def test_a_fifo_is_refused_at_once(tmp_path, call):
    fifo = tmp_path / "ckpt-1"
    os.mkfifo(fifo)
    calls = {
        "restore": lambda: md.train.Checkpoint(model=_model()).restore(fifo),
        "load_variable": lambda: md.train.load_variable(fifo, "model/w"),
        "list_variables": lambda: md.train.list_variables(fifo),
        "load_checkpoint": lambda: md.train.load_checkpoint(fifo),
    }
    error = _finishes(calls[call])
    assert isinstance(error, md.train.CheckpointError), error
    assert "FIFO" in str(error) and str(fifo) in str(error)


def test_a_fifo_recorded_as_latest_is_refused_at_once(tmp_path):
    os.mkfifo(tmp_path / "ckpt-1")
    (tmp_path / "checkpoint").write_text('model_checkpoint_path: "ckpt-1"\n')
    manager = md.train.CheckpointManager(md.train.Checkpoint(model=_model()), tmp_path)
    error = _finishes(manager.restore_or_initialize)
    assert isinstance(error, md.train.CheckpointError) and "FIFO" in str(error)


def test_a_link_to_dev_zero_is_refused_without_reading_it(tmp_path):
    link = tmp_path / "ckpt-1"
    os.symlink("/dev/zero", link)
    for fn in (lambda: md.train.Checkpoint(model=_model()).restore(link), lambda: md.train.load_checkpoint(link)):
        error = _finishes(fn)
        assert isinstance(error, md.train.CheckpointError), error
        assert "character device" in str(error) and str(link) in str(error)


def test_a_directory_is_refused(tmp_path):
    with pytest.raises(IsADirectoryError, match="is a directory"):
        md.train.Checkpoint(model=_model()).restore(tmp_path)
    with pytest.raises(ValueError, match="no checkpoint recorded in this directory"):
        md.train.load_checkpoint(tmp_path)  # as tf.train.load_checkpoint: a directory means its latest
    with pytest.raises(md.train.CheckpointError, match="a directory"):
        md.checkpoint.load_checkpoint(tmp_path)


# --- item 9: crafted index entries with a valid digest name the file and the fault --------------------

def _crafted(path, index, data=b""):
    """A file of mirrored's format around ``index`` (a JSON-able object or raw bytes), its digest valid."""
    raw = index if isinstance(index, bytes) else json.dumps(index).encode()
    body = ckpt_mod._MAGIC + bytes([ckpt_mod._VERSION]) + struct.pack("<Q", len(raw)) + raw + data
    path.write_bytes(body + hashlib.sha256(body).digest())
    return path


def _entry(**fields):
    entry = {"key": "model/w", "dtype": "float32", "shape": [3], "offset": 0, "nbytes": 12}
    entry.update(fields)
    return {"entries": [entry], "data_bytes": 12}


_TWELVE = np.arange(3, dtype=np.float32).tobytes()


@pytest.mark.parametrize("index,data,message", [
    (_entry(dtype="O"), _TWELVE, "dtype 'O'"),
    (_entry(dtype="<U3"), _TWELVE, "dtype '<U3'"),
    (_entry(dtype="V12"), _TWELVE, "dtype 'V12'"),
    (_entry(dtype="no such dtype"), _TWELVE, "dtype 'no such dtype'"),
    (_entry(dtype=["float32"]), _TWELVE, "not a dtype name"),
    (_entry(nbytes=8), _TWELVE, "nbytes 8"),
    (_entry(nbytes=True), _TWELVE, "nbytes True"),
    (_entry(offset=4), _TWELVE, "offset 4"),
    (_entry(offset=-12), _TWELVE, "offset -12"),
    (_entry(shape=[-3]), _TWELVE, "shape"),
    (_entry(shape=[1.5, 2]), _TWELVE, "shape"),
    (_entry(shape="3"), _TWELVE, "shape"),
    (_entry(shape=[2**62, 2**62]), _TWELVE, "nbytes"),
    (_entry(key=7), _TWELVE, "no 'key'"),
    ({"entries": [_entry()["entries"][0]] * 2, "data_bytes": 24}, _TWELVE * 2, "appears twice"),
    ({"entries": _entry()["entries"], "data_bytes": 24}, _TWELVE * 2, "data_bytes"),
    ({"entries": "model/w", "data_bytes": 12}, _TWELVE, "entries"),
    ({"data_bytes": 0}, b"", "entries"),
    ([1, 2], b"", "entries"),
    (b"[" * 100_000 + b"]" * 100_000, b"", "not valid JSON"),
    (b"\xff\xfe", b"", "not valid JSON"),
])
def test_crafted_index_entries_name_the_file_and_the_fault(tmp_path, index, data, message):
    path = _crafted(tmp_path / "ckpt-1", index, data)
    for fn in (md.train.load_checkpoint, md.train.list_variables,
               lambda p: md.train.load_variable(p, "model/w"),
               lambda p: md.train.Checkpoint(model=_model()).restore(p)):
        with pytest.raises(md.train.CheckpointError) as info:
            fn(path)
        assert str(path) in str(info.value) and message in str(info.value)


def test_a_valid_crafted_file_restores(tmp_path):
    # The helper above writes what mirrored writes: the faults, not the helper, fail the tests above.
    path = _crafted(tmp_path / "ckpt-1", _entry(), _TWELVE)
    model = _model()
    md.train.Checkpoint(model=model).read(path).assert_consumed()  # no save_counter in it: read(), as TF
    np.testing.assert_array_equal(model["w"].numpy(), [0, 1, 2])


# --- item 8: memory on restore --------------------------------------------------------------------------

def _in_subprocess(code: str, *args) -> str:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *map(str, args)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


_PEAK_MIB = """
def peak_mib():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) // 1024 for line in status if line.startswith("VmHWM:"))
"""


def test_a_large_sparse_file_is_rejected_by_its_header_without_reading_it(tmp_path):
    sparse = tmp_path / "sparse"
    with open(sparse, "wb") as f:
        f.truncate(1 << 30)
    headed = tmp_path / "headed"  # a genuine header announcing an index of 1 GiB
    with open(headed, "wb") as f:
        f.write(ckpt_mod._MAGIC + bytes([ckpt_mod._VERSION]) + struct.pack("<Q", (1 << 30) - 100))
        f.truncate(1 << 30)
    # The peak as VmHWM (this process's own), not ru_maxrss: getrusage keeps the parent's peak across
    # fork and exec, so a big test process would be measured instead of the load.
    out = _in_subprocess(_PEAK_MIB + textwrap.dedent("""
        import sys, mirrored as md
        for path, expected in ((sys.argv[1], "not a mirrored checkpoint"), (sys.argv[2], "announces an index")):
            try:
                md.train.load_checkpoint(path)
            except md.train.CheckpointError as e:
                assert expected in str(e), e
        print(peak_mib())
    """), sparse, headed)
    assert int(out) < 400  # MiB: the interpreter with NumPy and mirrored, not the files
    sparse_growth = _in_subprocess(_PEAK_MIB + textwrap.dedent("""
        import sys, mirrored as md
        before = peak_mib()
        try:
            md.train.load_checkpoint(sys.argv[1])
        except md.train.CheckpointError:
            pass
        print(peak_mib() - before)
    """), sparse)
    assert int(sparse_growth) < 16  # MiB: the header, not the file


def test_an_entry_larger_than_memory_raises_memory_error(tmp_path):
    huge = 1 << 40  # 1 TiB, as a sparse file: the index is genuine, the allocation impossible
    path = tmp_path / "ckpt-1"
    index = json.dumps({"entries": [{"key": "model/w", "dtype": "float32", "shape": [huge // 4], "offset": 0,
                                     "nbytes": huge}], "data_bytes": huge}).encode()
    with open(path, "wb") as f:
        f.write(ckpt_mod._MAGIC + bytes([ckpt_mod._VERSION]) + struct.pack("<Q", len(index)) + index)
        try:
            f.truncate(f.tell() + huge + 32)
        except OSError:
            pytest.skip("this filesystem has no sparse files of 1 TiB")
    for fn in (md.train.load_checkpoint, lambda p: md.train.load_variable(p, "model/w"),
               lambda p: md.train.Checkpoint(model=_model()).restore(p)):
        error = _finishes(lambda: fn(path), timeout=60)
        assert isinstance(error, MemoryError), error
        assert str(path) in str(error)


_PEAK = """
import sys, tracemalloc, numpy as np, mirrored as md
path, mode = sys.argv[1], sys.argv[2]
n, size = 6, 4 << 20                      # 6 variables of 16 MiB: 96 MiB
strategy = md.MirroredStrategy(devices=["/cpu:0"])
with strategy.scope():
    model = [md.Variable(np.full(size, i, np.float32)) for i in range(n)]
if mode == "write":
    md.train.Checkpoint(model=model).write(path)
    sys.exit(0)
with strategy.scope():
    fresh = [md.Variable(np.zeros(size, np.float32)) for _ in range(n)]
tracemalloc.start()
if mode == "restore":
    md.train.Checkpoint(model=fresh).read(path).assert_consumed()
    assert all(float(v.numpy()[-1]) == i for i, v in enumerate(fresh))
else:
    arrays = md.train.load_checkpoint(path)
_, peak = tracemalloc.get_traced_memory()
print(peak / (size * 4))                  # in variables
"""


def test_restore_streams_one_variable_at_a_time(tmp_path):
    path = tmp_path / "big.ckpt"
    _in_subprocess(_PEAK, path, "write")
    restore_peak = float(_in_subprocess(_PEAK, path, "restore"))
    load_peak = float(_in_subprocess(_PEAK, path, "load"))
    # Counted from tracemalloc's start: the 6 variables' new values (assign stores a copy), plus one variable
    # being read and a 4 MiB read buffer. Reading the whole file first would be 12.
    assert restore_peak < 6 + 1.5
    assert load_peak < 6 + 0.5   # the result itself, nothing doubled


def test_a_python_sigterm_handler_stays_in_charge_during_a_save(tmp_path):
    # The preemption handler's SIGTERM handler only records the notice: a save in flight must go on.
    received = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    try:
        tmp = tmp_path / ".w.ckpt.tmp-x"
        tmp.write_bytes(b"partial")
        with ckpt_mod._RemoveOnSigterm(str(tmp)):
            os.kill(os.getpid(), signal.SIGTERM)
            assert tmp.exists()  # not removed: the process is not ending
        assert received == [signal.SIGTERM]
        assert signal.getsignal(signal.SIGTERM) is not None and received  # the recorder is back in place
        os.kill(os.getpid(), signal.SIGTERM)
        assert received == [signal.SIGTERM, signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_any_flipped_bit_gives_a_checkpoint_error_naming_the_file(tmp_path):
    strategy = md.MirroredStrategy(devices=["/cpu:0"])
    with strategy.scope():
        model = {"w": md.Variable(np.arange(6, dtype=np.float32).reshape(2, 3)), "n": md.Variable(np.int64(3))}
    path = md.train.Checkpoint(model=model).write(tmp_path / "ckpt-1")
    blob = pathlib.Path(path).read_bytes()
    for at in range(len(blob)):
        damaged = bytearray(blob)
        damaged[at] ^= 1 << (at % 8)
        with open(path, "wb") as f:
            f.write(damaged)
        with pytest.raises(md.train.CheckpointError) as info:
            md.train.load_checkpoint(path)
        assert str(path) in str(info.value), at


@pytest.mark.parametrize("kind", ["fifo", "dev_zero"])
def test_a_state_file_that_is_a_fifo_or_device_is_refused_at_once(tmp_path, kind):
    state = tmp_path / "checkpoint"
    if kind == "fifo":
        os.mkfifo(state)
    else:
        os.symlink("/dev/zero", state)
    for fn in (lambda: md.train.latest_checkpoint(tmp_path),
               lambda: md.train.CheckpointManager(md.train.Checkpoint(model=_model()), tmp_path)):
        error = _finishes(fn)
        assert isinstance(error, md.train.CheckpointError), error
        assert "checkpoint state file" in str(error) and str(state) in str(error)
