"""The "mirrored" logger: MIRRORED_LOG_LEVEL, one handler of its own, and the engine each strategy chose."""

import logging
import os
import subprocess
import sys
import textwrap

import pytest

import mirrored as md


def python(code, **env):
    """Runs ``code`` in a fresh interpreter with ``env`` added; returns (stdout, stderr)."""
    base = {k: v for k, v in os.environ.items() if k != "MIRRORED_LOG_LEVEL"}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120, env=dict(base, **env))
    assert done.returncode == 0, done.stderr
    return done.stdout, done.stderr


LEVELS = """
    import logging, mirrored
    log = logging.getLogger("mirrored")
    print(log.getEffectiveLevel(), len(log.handlers), len(logging.getLogger().handlers))
"""


@pytest.mark.parametrize("value, level", [(None, logging.WARNING), ("INFO", logging.INFO), ("debug", logging.DEBUG),
                                          ("error", logging.ERROR), ("15", 15)])
def test_mirrored_log_level_sets_the_level_of_the_mirrored_logger_only(value, level):
    out, err = python(LEVELS, **({} if value is None else {"MIRRORED_LOG_LEVEL": value}))
    assert out.split() == [str(level), "1", "0"]  # our handler; the root logger untouched
    assert err == ""


def test_a_bad_level_is_named_and_warning_is_used():
    out, err = python(LEVELS, MIRRORED_LOG_LEVEL="verbose")
    assert out.split() == [str(logging.WARNING), "1", "0"]
    assert "MIRRORED_LOG_LEVEL='verbose' is not a log level; use one of DEBUG, INFO, WARNING" in err


def test_info_shows_the_engine_of_mirrored_strategy():
    _, err = python("""
        import mirrored as md
        md.MirroredStrategy(["/cpu:0", "/cpu:1"])
        md.MirroredStrategy(["/cpu:0", "/cpu:1"], cross_device_ops=md.cross_device_ops.HierarchicalCopyAllReduce())
        class Mine(md.cross_device_ops.RingAllReduce):
            pass
        md.MirroredStrategy(["/cpu:0"], cross_device_ops=Mine())
    """, MIRRORED_LOG_LEVEL="INFO")
    lines = err.splitlines()
    assert len(lines) == 3
    assert all(" INFO mirrored: MirroredStrategy: " in line for line in lines)
    assert lines[0].endswith("2 replica(s) on ['/job:localhost/replica:0/task:0/device:CPU:0', "
                             "'/job:localhost/replica:0/task:0/device:CPU:1']; reductions: native ring, direct or "
                             "tree picked per call by size and replica count over host buffers "
                             "(RingAllReduce, algorithm='auto')")
    assert lines[1].endswith("reductions: native tree over host buffers (HierarchicalCopyAllReduce)")
    assert lines[2].endswith("reductions: Mine (a user CrossDeviceOps)")


def test_nothing_is_printed_at_the_default_level():
    _, err = python("""
        import mirrored as md
        md.MirroredStrategy(["/cpu:0", "/cpu:1"])
        md.MultiWorkerMirroredStrategy()
    """)
    assert err == ""


def test_an_application_that_configures_logging_sees_each_record_once():
    _, err = python("""
        import logging, sys
        import mirrored as md
        logging.basicConfig(stream=sys.stderr, format="app %(name)s %(levelname)s %(message)s")
        md.MirroredStrategy(["/cpu:0"])
    """, MIRRORED_LOG_LEVEL="INFO")
    assert err.count("MirroredStrategy: 1 replica(s)") == 1
    assert err.startswith("app mirrored INFO MirroredStrategy")


def test_caplog_sees_engine_records(caplog):
    with caplog.at_level(logging.INFO, logger="mirrored"):
        md.MultiWorkerMirroredStrategy()
    assert any(r.name == "mirrored" and "MultiWorkerMirroredStrategy: one worker" in r.getMessage()
               for r in caplog.records)
