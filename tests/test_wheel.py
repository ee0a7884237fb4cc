"""`make wheel`: a manylinux wheel that carries Gloo, installed into a fresh venv, runs a 2-worker job.

The job runs with LD_LIBRARY_PATH empty and must load libgloo from the
wheel's own mirrored.libs/, never from the system (Debian's libgloo0).
"""

import json
import os
import shutil
import subprocess
import sys
import zipfile
from importlib.metadata import version
from pathlib import Path

import pytest
from multiworker_launch import free_ports

pytest.importorskip("mirrored._net", reason="Gloo not built (apt-get install libgloo-dev)")

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [
    pytest.mark.multiworker,
    pytest.mark.slow,
    pytest.mark.skipif(not (ROOT / "Makefile").exists() or not (ROOT / "pyproject.toml").exists(),
                       reason="needs the source tree (Makefile, pyproject.toml)"),
]

# One task of the job: two CPU replicas per worker, a SUM over the job's 4 replicas,
# and where libgloo and mirrored were loaded from.
TASK = r"""
import json, sys
import numpy as np
import mirrored as md

strategy = md.MultiWorkerMirroredStrategy(devices=["/cpu:0", "/cpu:1"])
ids = strategy.run(lambda: np.full(3, md.get_replica_context().replica_id_in_sync_group + 1.0))
total = strategy.reduce("sum", ids, axis=None)
with open("/proc/self/maps") as f:
    gloo = sorted({line.split()[-1] for line in f if "libgloo" in line})
print(json.dumps({"total": total.tolist(), "gloo": gloo, "mirrored": md.__file__, "version": md.__version__,
                  "gloo_available": md.config.is_gloo_available()}))
"""


def _run(cmd, **kwargs):
    result = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    assert result.returncode == 0, f"{cmd} failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    dist = tmp_path_factory.mktemp("dist")
    out = _run(["make", "-C", str(ROOT), "wheel", f"VPY={sys.executable}", f"DIST={dist}"], timeout=1200)
    wheels = list(dist.glob("mirrored-*.whl"))
    assert len(wheels) == 1, (wheels, out.stdout[-2000:])
    return wheels[0], out.stdout


def test_the_wheel_is_manylinux_and_carries_gloo(wheel):
    path, log = wheel
    assert "-manylinux_2_" in path.name and path.name.endswith("_x86_64.whl"), path.name
    assert 'consistent with the following platform tag: "manylinux_2_' in " ".join(log.split()), log[-2000:]
    names = zipfile.ZipFile(path).namelist()
    libs = [n for n in names if n.startswith("mirrored.libs/")]
    for lib in ("libgloo", "libhiredis", "libibverbs", "libnl-3", "libnl-route-3"):
        assert any(os.path.basename(n).startswith(lib + "-") for n in libs), (lib, libs)
    assert "mirrored/py.typed" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), names
    # Shipping their binaries means shipping their notices: one per bundled library's package.
    notices = [n for n in names if "/licenses/bundled/" in n]
    assert any("libgloo" in n for n in notices) and len(notices) >= len(libs), (notices, libs)


def test_a_two_worker_job_runs_from_a_fresh_venv_without_the_system_gloo(wheel, tmp_path):
    path, _ = wheel
    venv = tmp_path / "venv"
    base = getattr(sys, "_base_executable", sys.executable)
    _run([base, "-m", "venv", str(venv)], timeout=300)
    py = str(venv / "bin" / "python")
    _run([py, "-m", "pip", "install", "-q", str(path)], timeout=900)

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MIRRORED_TIMELINE")}
    env["LD_LIBRARY_PATH"] = ""
    site = _run([py, "-c", "import mirrored, os; print(os.path.dirname(mirrored.__file__))"], env=env, cwd=tmp_path,
                timeout=120).stdout.strip()
    # The extension resolves libgloo to the bundled copy (ldd: the loader's own answer).
    net = next(Path(site).glob("_net*.so"))
    ldd = _run(["ldd", str(net)], env=env, timeout=60).stdout
    gloo_lines = [line for line in ldd.splitlines() if "libgloo" in line]
    assert gloo_lines and all("/mirrored.libs/" in line for line in gloo_lines), ldd
    assert "not found" not in ldd, ldd

    ports = free_ports(2)
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    procs = []
    for index in range(2):
        task_env = dict(env, TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}}))
        procs.append(subprocess.Popen([py, "-c", TASK], env=task_env, cwd=tmp_path, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    reports = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=180)
            assert p.returncode == 0, stderr[-3000:]
            reports.append(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r in reports:
        assert r["total"] == [10.0, 10.0, 10.0]  # replicas 1 + 2 + 3 + 4 of the job
        assert r["mirrored"].startswith(str(venv)), r["mirrored"]
        assert r["gloo"] and all("/mirrored.libs/libgloo-" in g for g in r["gloo"]), r["gloo"]
        assert r["gloo_available"] is True
        assert r["version"] == version("mirrored")


@pytest.mark.skipif(shutil.which("cmake") is None, reason="needs cmake")
def test_a_build_without_gloo_says_so_loudly_or_is_refused(tmp_path):
    def configure(*extra):
        return subprocess.run(["cmake", "-S", str(ROOT), "-B", str(tmp_path / "build"), "-DMIRRORED_PYTHON=OFF",
                               "-DCMAKE_DISABLE_FIND_PACKAGE_Gloo=ON", *extra],
                              capture_output=True, text=True, timeout=300)

    warned = configure()
    assert warned.returncode == 0, warned.stderr
    text = " ".join(warned.stderr.split())  # CMake wraps long lines
    assert "CMake Warning" in text and "this build has NO multi-worker support" in text
    assert "Fix: apt-get install libgloo-dev" in text
    refused = configure("-DMIRRORED_REQUIRE_GLOO=ON")
    assert refused.returncode != 0
    assert "MIRRORED_REQUIRE_GLOO=ON: a build without Gloo is refused" in " ".join(refused.stderr.split())
