"""`python -m mirrored.bench` speaks nccl-tests: header, devices, titled blocks, names, errors, JSON, jobs."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from mirrored import collectives
from mirrored.tools import bench

from multiworker_launch import cluster


@pytest.fixture(autouse=True)
def single_process(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)


def _table(capsys, *argv):
    code = bench.main(list(argv))
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line and not line.startswith("#")]
    return code, out, rows


def test_header_devices_and_a_titled_block_per_algorithm(capsys):
    code, out, rows = _table(capsys, "all_reduce", "-b", "1K", "-e", "4K", "-f", "4", "-g", "2", "-n", "3", "-w", "1",
                             "--algo", "ring,tree")
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == ("# nThread 1 nReplicas 2 nWorkers 1 minBytes 1024 maxBytes 4096 step: 4(factor) "
                        "warmup iters: 1 iters: 3 validation: 1")
    assert "# Using devices" in lines
    devices = [line for line in lines if line.startswith("#  Rank ")]
    assert len(devices) == 2 and f"Pid {os.getpid():6d}" in devices[0] and devices[1].endswith("device cpu:1")
    titles = [line for line in lines if line.startswith("# Algorithm: ")]
    assert titles == ["# Algorithm: ring", "# Algorithm: tree"]
    # Each block has its own column header and its two sizes, in nccl-tests' 13 columns, then min and max over ranks.
    ring_at, tree_at = lines.index(titles[0]), lines.index(titles[1])
    ring_rows = [line for line in lines[ring_at:tree_at] if not line.startswith("#")]
    assert [r.split()[0] for r in ring_rows] == ["1024", "4096"]
    assert all(len(r) == 15 and r[2:5] == ["float", "sum", "-1"] and r[8] == r[12] == "0" for r in rows)
    assert all(r[13] == r[14] == r[9] for r in rows)  # one rank: its time is the minimum, the maximum and -a 1's
    assert "# Out of bounds values : 0 OK" in out
    assert "#   ring        : " in out and "#   tree        : " in out


@pytest.mark.parametrize("collective, redop, root", [
    ("broadcast", "none", "1"), ("all_gather", "none", "-1"), ("reduce", "max", "1"), ("all_reduce", "max", "-1"),
])
def test_redop_is_none_where_nccl_tests_prints_none(capsys, collective, redop, root):
    code, _, rows = _table(capsys, collective, "-b", "256", "-e", "256", "-g", "3", "-n", "2", "-o", "max", "-r", "1")
    assert code == 0
    assert [r[3:5] for r in rows] == [[redop, root]]


def test_nccl_tests_type_and_op_names_and_all(capsys):
    code, _, rows = _table(capsys, "all_reduce", "-b", "64", "-e", "64", "-g", "2", "-n", "1", "-w", "0",
                           "-d", "half,float,double,int32", "-o", "all")
    assert code == 0
    assert sorted({r[2] for r in rows}) == ["double", "float", "half", "int32"]
    assert [r[3] for r in rows if r[2] == "float"] == ["sum", "prod", "max", "min", "avg"]
    assert all(r[8] == "0" for r in rows)
    # NumPy's names mean the same types; `avg` and `mean` are one op.
    assert bench.parse_dtypes("float32,float16,float64") == bench.parse_dtypes("float,half,double")
    assert bench.parse_ops("avg") == bench.parse_ops("mean") == ["mean"]
    assert set(bench.parse_dtypes("all")) >= {"int8", "uint8", "int32", "int64", "float16", "float32", "float64"}


def test_iterations_are_honoured(capsys, monkeypatch):
    calls = []

    class Counting:
        def __getattr__(self, name):
            def call(*args, **kwargs):
                calls.append(name)
                return getattr(collectives, name)(*args, **kwargs)
            return call

    monkeypatch.setattr(bench.Local, "engine", Counting())
    code, _, rows = _table(capsys, "all_reduce", "-b", "16M", "-e", "16M", "-g", "2", "-n", "37", "-w", "2")
    assert code == 0 and len(rows) == 1
    # Out-of-place and in-place: one checked call, the warm-up, then exactly -n timed calls.
    assert calls.count("all_reduce") == 2 * (1 + 2 + 37)


def test_a_wrong_result_is_counted_and_fails_the_run(capsys, monkeypatch):
    class OffByOne:
        def all_reduce(self, buffers, op, *, out, algorithm):
            result = collectives.all_reduce(buffers, op, out=out, algorithm=algorithm)
            result[0][:3] += 1
            return result

    monkeypatch.setattr(bench.Local, "engine", OffByOne())
    code, out, rows = _table(capsys, "all_reduce", "-b", "64", "-e", "64", "-g", "2", "-n", "1")
    assert code == 1
    assert rows[0][8] == "3" and rows[0][12] == "3"
    assert "# Out of bounds values : 6 FAILED" in out


def test_validation_off_prints_na(capsys):
    code, out, rows = _table(capsys, "all_reduce", "-b", "64", "-e", "64", "-g", "2", "-n", "1", "-c", "0")
    assert code == 0 and rows[0][8] == "N/A" and "validation: 0" in out.splitlines()[0]


@pytest.mark.parametrize("argv, message", [
    (["all_reduce", "--algo", "bogus"], "--algo bogus: cpu replicas take auto, ring, direct, tree"),
    (["reduce", "--root", "5", "--replicas", "4"], "--root 5: the job has 4 replicas"),
    (["all_reduce", "-o", "all,sum"], "--op"),
    (["all_reduce", "-o", "mul"], "--op mul"),
    (["all_reduce", "-d", "float8"], "--dtype float8: use nccl-tests' names"),
    (["all_reduce", "-n", "0"], "-n/--iters: '0' must be > 0"),
    (["all_reduce", "-w", "-1"], "-w/--warmup"),
    (["all_reduce", "-b", "1M", "-e", "1K"], "-b 1048576 exceeds -e 1024"),
    (["all_reduce", "-b", "12Q"], "size '12Q'"),
    (["all_reduce", "-g", "0"], "-g/--replicas"),
    (["all_reduce", "--device", "gpu", "--algo", "direct"], "--algo direct: gpu replicas take"),
    (["all_gather_v"], "invalid choice"),
    # Sweeps that cannot progress (they looped forever or ran for minutes) are refused, naming the flag.
    (["all_reduce", "-b", "0", "-e", "64"], "-b 0: multiplying 0 by -f 2 never reaches -e 64"),
    (["all_reduce", "-f", "nan"], "-f/--stepfactor: 'nan' is not a finite number"),
    (["all_reduce", "-f", "inf"], "-f/--stepfactor: 'inf' is not a finite number"),
    (["all_reduce", "-f", "1"], "-f 1: the size must grow"),
    (["all_reduce", "-f", "0.5"], "-f 0.5: the size must grow"),
    (["all_reduce", "-f", "1.0001"], "-f 1.0001: -b 8 to -e 134217728 makes 1663"),
    (["all_reduce", "-i", "0"], "-i 0: the size would never grow"),
    (["all_reduce", "-i", "1", "-e", "1M"], "-i 1: -b 8 to -e 1048576 makes 1048569 sizes (at most 1000)"),
    (["all_reduce", "-g", "100000"], "-g 100000 -e 134217728: the buffers need about"),
    (["all_reduce", "-b", "infK"], "size 'INFK'"),
    (["all_reduce", "-a", "4"], "-a/--average: invalid choice: 4"),
    (["all_reduce", "-c", "-1"], "-c/--check"),
    (["all_reduce", "--csv", "--json"], "not allowed with argument"),
])
def test_argument_errors_are_argparse_errors_before_any_output(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    assert e.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # no header: nothing ran
    assert "error:" in captured.err and message in captured.err


def test_a_gpu_run_without_a_gpu_is_an_argument_error(capsys):
    from mirrored import config

    if config.list_physical_devices("GPU"):
        pytest.skip("this machine has a GPU")
    with pytest.raises(SystemExit) as e:
        bench.main(["all_reduce", "--device", "gpu"])
    assert e.value.code == 2 and "--device gpu" in capsys.readouterr().err


def test_help_shows_the_defaults():
    out = subprocess.run([sys.executable, "-m", "mirrored.bench", "--help"], capture_output=True, text=True,
                         timeout=60).stdout
    text = " ".join(out.split())
    for default in ("(default: 20)", "(default: 5)", "(default: 8)", "(default: 134217728)", "(default: float)",
                    "(default: sum)", "(default: auto)", "(default: 4)"):
        assert default in text, default
    assert "mirrored-run" in text  # the multi-worker mode is documented


def test_plot_checks_matplotlib_before_running(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    with pytest.raises(SystemExit) as e:
        bench.main(["all_reduce", "-b", "8", "-e", "8", "--plot", str(tmp_path / "p.png")])
    captured = capsys.readouterr()
    assert e.value.code == 2 and captured.out == ""
    assert "--plot needs matplotlib: pip install 'mirrored[plot]'" in captured.err


def test_plot_writes_the_figure(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "busbw.png"
    assert bench.main(["all_reduce", "-b", "64", "-e", "1K", "-f", "4", "-g", "2", "-n", "1",
                       "--algo", "ring,tree", "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_json_carries_metadata_and_nccl_tests_formulas(capsys):
    assert bench.main(["all_gather", "-b", "4K", "-e", "16K", "-f", "4", "-g", "4", "-n", "2", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    meta = doc["metadata"]
    from mirrored import __version__, _core

    assert meta["version"] == __version__ and meta["isa"] == _core.isa()
    assert meta["threads"] == _core.num_threads() and meta["iters"] == 2 and meta["warmup"] == 5
    assert meta["device"] == "cpu" and meta["replicas"] == 4 and meta["workers"] == 1
    assert meta["ops"] == ["none"] and meta["types"] == ["float"] and len(meta["devices"]) == 4
    rows = doc["results"]
    assert [r["size"] for r in rows] == [4096, 16384]
    for r in rows:
        m = r["out_of_place"]
        assert r["redop"] == "none" and "in_place" not in r and m["wrong"] == 0
        assert m["algbw"] == pytest.approx(r["size"] / (m["time_us"] * 1e-6) / 1e9)
        assert m["busbw"] == pytest.approx(m["algbw"] * 3 / 4)  # (n-1)/n for all-gather


def test_linear_steps(capsys):
    assert bench.sizes(1024, 4096, 2.0, 1024) == [1024, 2048, 3072, 4096]
    assert bench.sizes(8, 128, 4.0, None) == [8, 32, 128]


# --- across the workers of a job ----------------------------------------------------------------


def _job(argv, num_workers=2, timeout=120):
    spec = cluster(num_workers)
    procs = []
    env = {k: v for k, v in os.environ.items() if k != "MIRRORED_TIMELINE"}
    for index in range(num_workers):
        task_env = dict(env, TF_CONFIG=json.dumps({"cluster": spec, "task": {"type": "worker", "index": index}}))
        procs.append(subprocess.Popen([sys.executable, "-m", "mirrored.bench", *argv], env=task_env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout) + (p.returncode,))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return outs


@pytest.mark.multiworker
def test_a_job_benchmarks_across_workers_and_task_0_prints_one_table():
    pytest.importorskip("mirrored._net", reason="Gloo not built (apt-get install libgloo-dev)")
    (out0, err0, rc0), (out1, err1, rc1) = _job(["all_reduce", "-b", "1K", "-e", "64K", "-f", "64", "-g", "2",
                                                 "-n", "3", "-o", "sum,avg", "-d", "float,int32"])
    assert rc0 == 0 and rc1 == 0, (err0, err1)
    assert out1 == ""  # one table, from task 0
    lines = out0.splitlines()
    assert lines[0].startswith("# nThread 1 nReplicas 4 nWorkers 2 ")
    devices = [line for line in lines if line.startswith("#  Rank ")]
    assert [line.split()[2] for line in devices] == ["0", "1", "2", "3"]
    assert len({line.split()[6] for line in devices}) == 2  # two processes
    rows = [line.split() for line in lines if line and not line.startswith("#")]
    assert len(rows) == 2 * 2 * 2 and all(r[8] == "0" for r in rows)
    assert "# Out of bounds values : 0 OK" in out0


@pytest.mark.multiworker
@pytest.mark.parametrize("argv", [["reduce", "-r", "3", "-o", "max"], ["broadcast", "-r", "2"], ["all_gather"],
                                  ["batch_all_reduce", "--tensor-bytes", "1K"]])
def test_every_collective_is_validated_across_workers(argv):
    pytest.importorskip("mirrored._net", reason="Gloo not built (apt-get install libgloo-dev)")
    (out0, err0, rc0), (out1, err1, rc1) = _job(argv + ["-b", "4K", "-e", "4K", "-g", "2", "-n", "2", "-w", "1",
                                                        "--json"])
    assert rc0 == 0 and rc1 == 0, (err0, err1)
    assert out1 == ""
    doc = json.loads(out0)
    assert doc["metadata"]["workers"] == 2 and doc["metadata"]["replicas"] == 4
    (row,) = doc["results"]
    assert row["replicas"] == 4 and row["out_of_place"]["wrong"] == 0
    assert row.get("in_place", {"wrong": 0})["wrong"] == 0
    factor = bench.bus_factor(argv[0], 4)
    assert row["out_of_place"]["busbw"] == pytest.approx(row["out_of_place"]["algbw"] * factor)


def test_a_root_outside_the_job_is_an_argument_error(monkeypatch, capsys):
    spec = {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": spec, "task": {"type": "worker", "index": 1}}))
    with pytest.raises(SystemExit) as e:
        bench.main(["broadcast", "-g", "2", "-r", "4"])
    assert e.value.code == 2
    assert "the job has 4 replicas (2 per worker x 2 worker(s)); use 0..3" in capsys.readouterr().err


def test_expected_results_cover_every_replica_of_the_job():
    # Folding one replica at a time gives NumPy's reduction over the stacked inputs.
    inputs = np.stack([bench._pattern(50, g, "sum", np.float32) for g in range(5)]).astype(np.float64)
    np.testing.assert_array_equal(bench._expected(50, 5, "sum", np.float32), inputs.sum(0).astype(np.float32))
    np.testing.assert_array_equal(bench._expected(50, 5, "mean", np.int32), inputs.sum(0) / 5)


def test_dash_a_is_nccl_tests_average_across_ranks(monkeypatch):
    # Two ranks whose times differ threefold: -a picks rank 0's, the mean, the minimum or the maximum.
    class TwoRanks(bench.Local):
        def gather(self, values):
            return np.array([values, [values[0] * 3, values[1] + 1]], np.float64)

    def run(average):
        args, device, _ = bench.parse_args(["all_reduce", "-b", "64", "-e", "64", "-g", "2", "-n", "1", "-w", "0",
                                            "-a", average])
        monkeypatch.setattr(bench.Case, "time", lambda self, inplace, iters, warmup: 1e-3)
        (row,) = bench.run(args, device, TwoRanks())
        return row["in_place"]

    times = {a: run(a)["time_us"] for a in "0123"}
    assert times == pytest.approx({"0": 1000.0, "1": 2000.0, "2": 1000.0, "3": 3000.0})
    m = run("1")
    assert (m["time_min_us"], m["time_max_us"]) == pytest.approx((1000.0, 3000.0))
    assert m["wrong"] == 1  # #wrong is summed over ranks whatever -a says
    assert m["algbw"] == pytest.approx(64 / 2e-3 / 1e9)


def test_the_algorithm_has_its_own_flags(capsys):
    outs = []
    for flag in ("-A", "--algorithm", "--algo"):
        assert bench.main(["all_reduce", "-b", "64", "-e", "64", "-g", "2", "-n", "1", flag, "ring,direct"]) == 0
        outs.append([line for line in capsys.readouterr().out.splitlines() if line.startswith("# Algorithm:")])
    assert outs == [["# Algorithm: ring", "# Algorithm: direct"]] * 3


def test_dash_c_checks_that_many_times(capsys, monkeypatch):
    calls = []

    class OffByOne:
        def all_reduce(self, buffers, op, *, out, algorithm):
            calls.append(1)
            result = collectives.all_reduce(buffers, op, out=out, algorithm=algorithm)
            result[0][:2] += 1
            return result

    monkeypatch.setattr(bench.Local, "engine", OffByOne())
    code, out, rows = _table(capsys, "all_reduce", "-b", "64", "-e", "64", "-g", "2", "-n", "4", "-w", "1",
                             "-c", "3")
    assert code == 1
    assert len(calls) == 2 * (3 + 1 + 4)  # per mode: 3 checked runs, the warm-up, 4 timed
    assert rows[0][8] == rows[0][12] == "6"  # 2 wrong elements, 3 checks
    assert "validation: 3" in out.splitlines()[0]


def test_csv_has_one_line_per_size_with_both_modes(capsys):
    import csv

    assert bench.main(["all_reduce", "-b", "256", "-e", "1K", "-g", "2", "-n", "1", "-o", "sum,avg", "-d",
                       "float,int32", "--csv"]) == 0
    lines = list(csv.DictReader(capsys.readouterr().out.splitlines()))
    assert len(lines) == 3 * 2 * 2
    assert list(lines[0])[:10] == list(bench.CSV_FIELDS)
    for r in lines:
        assert r["collective"] == "all_reduce" and r["replicas"] == "2" and r["oop_wrong"] == "0"
        assert float(r["oop_busbw"]) == pytest.approx(float(r["oop_algbw"]) * 2 * (2 - 1) / 2)
        assert float(r["oop_time_min_us"]) <= float(r["oop_time_us"]) <= float(r["oop_time_max_us"])
        # The integer mean is float64: no in-place run, empty cells.
        assert (r["ip_time_us"] == "") == (r["type"] == "int32" and r["redop"] == "avg")
    assert sorted({int(r["size"]) for r in lines}) == [256, 512, 1024]


def test_dash_d_all_says_what_it_ran_and_what_it_skips(capsys, monkeypatch):
    code, out, rows = _table(capsys, "all_reduce", "-b", "64", "-e", "64", "-g", "2", "-n", "1", "-d", "all")
    assert code == 0
    assert "# -d all: int8 uint8 int32 int64 half float double bfloat16 (none skipped)" in out.splitlines()
    assert sorted({r[2] for r in rows}) == sorted(bench.TYPE_NAMES.values())
    monkeypatch.setattr(bench, "_bfloat16", lambda: None)
    code, out, rows = _table(capsys, "all_reduce", "-b", "64", "-e", "64", "-g", "2", "-n", "1", "-d", "all")
    assert code == 0 and "bfloat16" not in {r[2] for r in rows}
    assert "# -d all skips bfloat16: ml_dtypes is not installed (pip install ml_dtypes)" in out.splitlines()
    assert bench.main(["all_reduce", "-b", "64", "-e", "64", "-g", "2", "-n", "1", "-d", "all", "--csv"]) == 0
    assert "-d all skips bfloat16" in capsys.readouterr().err  # scripts read stdout: the note goes to stderr


def test_bfloat16_runs_and_is_a_declared_dependency(capsys):
    import tomllib

    code, _, rows = _table(capsys, "all_reduce", "-b", "64", "-e", "256", "-g", "3", "-n", "1", "-d", "bfloat16",
                           "-o", "sum,max")
    assert code == 0 and {r[2] for r in rows} == {"bfloat16"} and all(r[8] == r[12] == "0" for r in rows)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        dependencies = tomllib.load(f)["project"]["dependencies"]
    assert any(d.startswith("ml_dtypes") for d in dependencies)


def test_a_zero_byte_sweep_is_one_row(capsys):
    code, _, rows = _table(capsys, "all_reduce", "-b", "0", "-e", "0", "-g", "2", "-n", "1")
    assert code == 0 and [r[:2] for r in rows] == [["0", "0"]]


def test_sweep_sizes_are_counted_without_making_them():
    for begin, end, factor, step in [(8, 128 << 20, 2.0, None), (8, 100, 3.0, None), (1, 1, 2.0, None),
                                     (1024, 4096, 2.0, 1024), (5, 17, 2.0, 4), (7, 1000, 1.5, None)]:
        assert bench.count_sizes(begin, end, factor, step) == len(bench.sizes(begin, end, factor, step))
