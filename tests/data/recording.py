"""What the recorders of this folder share (never imported by the tests): TensorFlow imported quietly, the
tests folder on the path (the scenarios and their adapters' base), the report of a result that lacks its
scenario's key words, a run per replica count in a process of its own, and the reference written."""

import json
import os
import subprocess
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import tensorflow as tf  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def logical_cpus(count: int):
    """``count`` logical CPUs for the whole recording (TF cannot change them later), its logging quiet."""
    tf.get_logger().setLevel("ERROR")
    tf.config.set_logical_device_configuration(tf.config.list_physical_devices("CPU")[0],
                                               [tf.config.LogicalDeviceConfiguration()] * count)


def report_missing_words(label: str, result, words) -> None:
    """Says on stderr which of the scenario's key ``words`` TF's ``result`` lacks (a result that raised none)."""
    raised = isinstance(result, dict) and "raises" in result
    missing = [w for w in words if not raised or w.lower() not in result["msg"].lower()]
    if missing:
        print(f"{label}: TF's result lacks {missing}: {result}", file=sys.stderr)


def record_scenarios(scenarios, n: int, run) -> dict:
    """Every scenario of ``scenarios`` that runs at ``n`` replicas: ``run(fn)``'s result by name.
    RECORD_VERBOSE=1 names each scenario as it starts (TF crashes the process on some inputs: the last name is
    the culprit)."""
    results = {}
    for name, (fn, ns, words) in scenarios.SCENARIOS.items():
        if n not in ns:
            continue
        if os.environ.get("RECORD_VERBOSE"):
            print(name, file=sys.stderr, flush=True)
        results[name] = run(fn)
        if isinstance(results[name], dict) and "raises" in results[name]:
            report_missing_words(f"{name} n={n}", results[name], words)
    return results


def record_by_replicas(script: str, ns) -> dict:
    """{scenario: {str(n): result}}: ``script n`` prints n replicas' results, each n in a process of its own (TF
    keys its collectives by a group number that a strategy of another size in the same process would reuse)."""
    out = {}
    for n in ns:
        text = subprocess.run([sys.executable, script, str(n)], check=True, stdout=subprocess.PIPE, text=True).stdout
        for name, result in json.loads(text).items():
            out.setdefault(name, {})[str(n)] = result
    return out


def record_in_children(command: list, names: list, timeout_s: float) -> dict:
    """{name: result} of the cases ``names``: ``command + names left`` prints one JSON ``[name, result]`` line per
    case; a child that TF killed or hung is restarted past the case it was on, which is recorded as
    ``{"tf_crashed": status}``."""
    results = {}
    while len(results) < len(names):
        left = [name for name in names if name not in results]
        proc = subprocess.Popen(command + left, stdout=subprocess.PIPE, text=True)
        try:
            out, _ = proc.communicate(timeout=timeout_s)
            status = proc.returncode
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
            status = "timeout"
        for line in out.splitlines():
            name, result = json.loads(line)
            results[name] = result
        if status != 0 and len(results) < len(names):
            culprit = left[len(out.splitlines())]
            print(f"{culprit}: TF ended with {status}", file=sys.stderr)
            results[culprit] = {"tf_crashed": status}
    return results


def write_reference(filename: str, out, **json_options) -> None:
    with open(os.path.join(HERE, filename), "w") as f:
        json.dump(out, f, **json_options)
        f.write("\n")


def record_each(scenarios, adapter) -> dict:
    """Every scenario of ``scenarios`` (one replica count each) over ``adapter``: its result by name."""
    results = {name: scenarios.run_scenario(adapter, fn) for name, (fn, _) in scenarios.SCENARIOS.items()}
    for name, (_, words) in scenarios.SCENARIOS.items():
        report_missing_words(name, results[name], words)
    return results
