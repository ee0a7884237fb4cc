"""The CUDA layer without a GPU: the extension builds and imports, reports no
devices, and everything that chooses devices or NCCL degrades cleanly. Each
check runs in a subprocess with CUDA_VISIBLE_DEVICES="" so it holds on GPU
machines too, and so NCCL's once-per-process loading starts fresh."""

import glob
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_without_gpu(code: str) -> str:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def has_cuda_extension() -> bool:
    out = run_without_gpu("""
        import importlib.util, mirrored
        print(importlib.util.find_spec("mirrored._cuda") is not None)
    """)
    return out.strip() == "True"


needs_extension = pytest.mark.skipif(not has_cuda_extension(), reason="built without a CUDA compiler (no nvcc)")


def test_import_and_default_strategy_without_gpu():
    out = run_without_gpu("""
        import mirrored as md
        print(len(md.config.list_physical_devices("GPU")), len(md.config.list_logical_devices("GPU")))
        print(len(md.config.list_physical_devices("CPU")))
        s = md.MirroredStrategy()
        print(s.num_replicas_in_sync, list(s.extended.worker_devices))
    """).splitlines()
    assert out[0] == "0 0"
    assert out[1] == "1"
    assert out[2] == "1 ['/job:localhost/replica:0/task:0/device:CPU:0']"


@needs_extension
def test_extension_reports_no_devices():
    out = run_without_gpu("""
        from mirrored import _cuda
        print(_cuda.device_count())
        for make in (lambda: _cuda.ring([0]), lambda: _cuda.device_properties(0)):
            try:
                make()
            except ValueError as e:
                print("ValueError:", e)
    """).splitlines()
    assert out[0] == "0"
    assert out[1].startswith("ValueError:") and "GPU 0 does not exist (0 visible" in out[1]
    assert out[2].startswith("ValueError:") and "CUDA_VISIBLE_DEVICES" in out[2]


def test_logical_gpu_configuration_without_gpu_names_the_problem():
    out = run_without_gpu("""
        import mirrored as md
        try:
            md.config.set_logical_device_configuration("GPU", 0, count=2)
        except ValueError as e:
            print(e)
        md.config.set_logical_device_configuration("CPU:0", count=3)
        print([d.name[-5:] for d in md.config.list_logical_devices("CPU")])
        try:
            md.config.physical_gpu_index(0)
        except ValueError as e:
            print(e)
    """).splitlines()
    assert "physical GPU:0 does not exist (0 visible" in out[0]
    assert out[1] == "['CPU:0', 'CPU:1', 'CPU:2']"
    assert "GPU:0 is not a logical GPU" in out[2]


@needs_extension
def test_missing_nccl_names_the_pip_package():
    out = run_without_gpu("""
        import logging, sys
        logging.basicConfig(stream=sys.stdout, format="%(levelname)s %(message)s")
        from mirrored.device import gpu as _gpu
        _gpu.nccl_library_candidates = lambda: ["/nonexistent/libnccl.so.2"]
        try:
            _gpu.load_nccl()
        except RuntimeError as e:
            print(" ".join(str(e).split()))
        print(_gpu.nccl_available())
        print(_gpu.default_gpu_algorithm([0, 1]))
        _gpu.default_gpu_algorithm([0, 1])  # warned once only
    """).splitlines()
    assert "pip install nvidia-nccl-cu13" in out[0] and "/nonexistent/libnccl.so.2" in out[0]
    assert out[1] == "False"
    assert out[2].startswith("WARNING ") and "native ring" in out[2] and "pip install nvidia-nccl-cu13" in out[2]
    assert out[3:] == ["auto"]


def test_logical_gpus_fall_back_to_the_ring():
    out = run_without_gpu("""
        import logging, sys
        logging.basicConfig(stream=sys.stdout, format="%(levelname)s %(message)s")
        from mirrored.device import gpu as _gpu
        print(_gpu.default_gpu_algorithm([0, 0]))
    """).splitlines()
    assert out[0].startswith("WARNING ") and "share a GPU" in out[0]
    assert out[1] == "auto"


@needs_extension
def test_wheel_nccl_loads_without_a_gpu():
    pytest.importorskip("nvidia.nccl", reason="nvidia-nccl-cu13 is not installed")
    out = run_without_gpu("""
        from mirrored.device import gpu as _gpu
        path, version = _gpu.load_nccl()
        print(path, version, len(_gpu.nccl_unique_id()))
    """).split()
    assert out[0].endswith("libnccl.so.2")
    assert int(out[1]) >= 21000
    assert out[2] == "128"


def test_gpu_algorithm_validation_needs_no_gpu():
    out = run_without_gpu("""
        from mirrored.collective import cuda as cc
        for devices, algorithm in (((0,), "bogus"), ((0, 0), "nccl")):
            try:
                cc._engine(devices, algorithm)
            except ValueError as e:
                print(e)
    """).splitlines()
    assert "algorithm='bogus' is not a GPU algorithm" in out[0] and "'direct'" in out[0]
    assert "use algorithm='ring' for logical GPUs" in out[1]


def cuda_include_dir():
    nvcc = shutil.which("nvcc")
    roots = [os.environ.get("CUDA_HOME", ""), os.environ.get("CUDA_PATH", ""), "/usr/local/cuda"]
    if nvcc:
        real = os.path.realpath(nvcc)
        roots[:0] = [os.path.dirname(os.path.dirname(real)), os.path.dirname(os.path.dirname(nvcc))]
    for root in filter(None, roots):
        for inc in (os.path.join(root, "include"), *glob.glob(os.path.join(root, "targets", "*", "include"))):
            if os.path.exists(os.path.join(inc, "cuda_runtime_api.h")):
                return inc
    return None


def test_cuda_executor_on_simulated_runtime(tmp_path):
    """csrc/cuda's ring, tree, broadcast, reduce, all_gather and fused batches,
    and csrc/nccl's communicator over a stand-in libnccl, compiled against a
    simulated CUDA runtime (csrc/cuda/sim) and run on the CPU under random
    stream interleavings: the GPU path's ordering and arithmetic, checked
    without a GPU. The whole schedule matrix: `make test`'s native tests run
    its small slice under AddressSanitizer and ThreadSanitizer."""
    cxx = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")
    inc = cuda_include_dir()
    if cxx is None or inc is None:
        pytest.skip("needs a C++ compiler and the CUDA toolkit's headers")
    csrc = os.path.join(ROOT, "csrc")
    sources = ["cuda/sim/sim_test.cc", "cuda/sim/sim_runtime.cc", "cuda/cuda_ring.cc", "cuda/device.cc",
               "cuda/device_batch.cc", "core/packer.cc", "nccl/nccl_lib.cc", "nccl/nccl_communicator.cc"]
    flags = ["-std=c++17", "-O1", "-I", csrc, "-I", inc]
    exe, fake = str(tmp_path / "cuda_sim_test"), str(tmp_path / "libfake_nccl.so")
    # Every translation unit compiles at once (the machine's cores), then one link.
    compiles = [[cxx, *flags, "-fPIC", "-shared", "-o", fake, os.path.join(csrc, "cuda/sim/fake_nccl.cc")]]
    objects = [str(tmp_path / f"{i}.o") for i in range(len(sources))]
    compiles += [[cxx, *flags, "-c", "-o", o, os.path.join(csrc, s)] for o, s in zip(objects, sources)]
    builds = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for cmd in compiles]
    for build in builds:
        _, err = build.communicate(timeout=600)
        assert build.returncode == 0, err[-4000:]
    link = subprocess.run([cxx, "-rdynamic", "-o", exe, *objects, "-ldl"], capture_output=True, text=True, timeout=600)
    assert link.returncode == 0, link.stderr[-4000:]
    env = {k: v for k, v in os.environ.items() if k != "MIRRORED_NATIVE_TEST_SMALL"}
    run = subprocess.run([exe, fake], capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert ", 0 failures" in run.stdout


@needs_extension
def test_a_library_without_nccls_symbols_is_refused():
    libm = next((p for p in ("/lib/x86_64-linux-gnu/libm.so.6", "/usr/lib64/libm.so.6", "/lib64/libm.so.6")
                 if os.path.exists(p)), None)
    if libm is None:
        pytest.skip("no libm.so.6 to stand in for a wrong library")
    out = run_without_gpu(f"""
        from mirrored.device import gpu as _gpu
        _gpu.nccl_library_candidates = lambda: [{libm!r}]
        try:
            _gpu.load_nccl()
        except RuntimeError as e:
            print(" ".join(str(e).split()))
    """)
    assert "lacks ncclGetVersion" in out and "too old an NCCL" in out and "pip install nvidia-nccl-cu13" in out
