"""A collective blocked on a peer that never arrives: Ctrl-C lands, and stall warnings name the missing task."""

import logging
import os
import signal
import threading
import time

import numpy as np
import pytest

from multiworker_launch import launch
from multiworker_marks import MULTIWORKER

from mirrored.distribute.collective_all_reduce import stall_warning_seconds

pytestmark = MULTIWORKER


def _group(timeout):
    from mirrored.cluster_resolver import TFConfigClusterResolver
    from mirrored.distribute.collective_all_reduce import CollectiveGroup

    return CollectiveGroup.from_cluster_resolver(TFConfigClusterResolver(), 1, timeout=timeout)


# --- task functions (run inside the launched processes) ---------------------------------------


def interrupted_while_blocked():
    """worker:0 blocks in an all-reduce (no timeout) that worker:1 joins only late; SIGINT arrives after 1 s."""
    g = _group(timeout=None)
    if g.rank == 1:
        time.sleep(2.5)  # arrives after worker:0 was interrupted
        try:
            g.all_reduce([np.ones(4, np.float32)], "sum")
        except ConnectionError as e:
            return {"peer_error": str(e)}
        return {"peer_error": None}
    signal_at = []

    def interrupt():
        signal_at.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGINT)  # as Ctrl-C in the terminal would

    threading.Timer(1.0, interrupt).start()
    report = {}
    try:
        g.all_reduce([np.ones(4, np.float32)], "sum")
        report["interrupted_after"] = None
    except KeyboardInterrupt:
        report["interrupted_after"] = time.monotonic() - signal_at[0]
    try:
        g.all_reduce([np.ones(4, np.float32)], "sum")
    except ConnectionError as e:
        report["later"] = str(e)
    time.sleep(4)  # keep serving the store while worker:1 finds out
    return report


def late_peer_with_stall_warnings():
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append((record.levelname, record.getMessage()))

    logging.getLogger("mirrored").addHandler(Keep())
    g = _group(timeout=30.0)
    if g.rank == 1:
        time.sleep(1.8)
    result = g.all_reduce([np.full(3, g.rank + 1.0, np.float32)], "sum")[0]
    return {"records": records, "result": result}


# --- tests -----------------------------------------------------------------------------------


@pytest.mark.parametrize("shm", ["1", "0"], ids=["shm", "gloo"])
def test_ctrl_c_interrupts_a_blocked_collective(shm):
    first, second = launch(interrupted_while_blocked, 2, env={"MIRRORED_SHM": shm}, timeout=60)
    assert first.ok and second.ok, (first.message, first.stderr[-2000:], second.message, second.stderr[-2000:])
    after = first.value["interrupted_after"]
    assert after is not None, "the all-reduce returned although its peer never arrived"
    assert after < 1.5, f"KeyboardInterrupt landed {after:.2f} s after SIGINT"
    # The job's collectives are broken from then on, on this worker and on its peer, with the reason.
    assert "this job's collectives are broken since all_reduce #1" in first.value["later"], first.value["later"]
    assert "KeyboardInterrupt" in first.value["later"]
    peer = second.value["peer_error"]
    assert peer is not None and "worker:0 was interrupted (KeyboardInterrupt) in all_reduce #1" in peer, peer


@pytest.mark.parametrize("shm", ["1", "0"], ids=["shm", "gloo"])
def test_a_stalled_collective_warns_naming_the_missing_task(shm):
    results = launch(late_peer_with_stall_warnings, 2,
                     env={"MIRRORED_SHM": shm, "MIRRORED_STALL_WARNING_SECONDS": "0.5"}, timeout=60)
    for r in results:
        assert r.ok, (r.task, r.message, r.stderr[-2000:])
        # The call is not failed: it completes once the peer arrives.
        np.testing.assert_array_equal(r.value["result"], np.full(3, 3.0, np.float32))
    warnings = [m for level, m in results[0].value["records"] if level == "WARNING"]
    # Waited ~1.8 s with a 0.5 s period: warned at ~0.5, ~1.0, ~1.5 s.
    assert len(warnings) >= 2, warnings
    assert all("all_reduce #1 has waited" in m and "worker:1" in m for m in warnings), warnings
    assert results[1].value["records"] == []  # the late worker waited for nobody


def test_stall_warning_period_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv("MIRRORED_STALL_WARNING_SECONDS", raising=False)
    assert stall_warning_seconds() == 60.0
    monkeypatch.setenv("MIRRORED_STALL_WARNING_SECONDS", "0.25")
    assert stall_warning_seconds() == 0.25
    monkeypatch.setenv("MIRRORED_STALL_WARNING_SECONDS", "0")
    assert stall_warning_seconds() == 0.0
    for bad in ("soon", "-1", "nan", "inf"):
        monkeypatch.setenv("MIRRORED_STALL_WARNING_SECONDS", bad)
        with pytest.raises(ValueError, match="MIRRORED_STALL_WARNING_SECONDS=.* must be a number of seconds"):
            stall_warning_seconds()
