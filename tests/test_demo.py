"""The main job, examples/train_digits.py, on a few steps."""

import importlib.util
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

import mirrored as md

pytest.importorskip("sklearn")
pytest.importorskip("matplotlib")
pytest.importorskip("tqdm")

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEMO = ROOT / "examples" / "train_digits.py"


def _load_demo():
    spec = importlib.util.spec_from_file_location("train_digits", DEMO)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_demo_command_line_runs_and_writes_its_outputs(tmp_path):
    proc = subprocess.run([sys.executable, str(DEMO), "--steps", "25", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"final test accuracy: 0\.\d{4}", last), last
    assert float(last.split(":")[1]) > 0.5  # 25 steps already learn most digits
    assert "loss=" in proc.stderr  # the progress bar shows the loss
    assert (tmp_path / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    state = md.checkpoint.load_checkpoint(tmp_path / "digits.ckpt")
    assert int(state["optimizer/_iterations"]) == 25
    # (the optimizer's list of the model's variables is the shorter path to them: TF names them there too)
    assert state["optimizer/_trainable_variables/0"].shape == (64, 128)


def test_one_replica_and_four_replicas_give_the_same_weights(tmp_path):
    demo = _load_demo()
    common = ["--steps", "40", "--batch-size", "64", "--no-progress"]
    demo.main([*common, "--replicas", "4", "--out", str(tmp_path / "r4")])
    demo.main([*common, "--replicas", "1", "--out", str(tmp_path / "r1")])
    # The weights and optimizer state (the input iterator's saved prefetch buffer grows with the replicas).
    four, one = ({k: v for k, v in md.checkpoint.load_checkpoint(tmp_path / run / "digits.ckpt").items()
                  if not k.startswith("iterator/")} for run in ("r4", "r1"))
    assert four.keys() == one.keys()
    for key in four:
        np.testing.assert_allclose(four[key], one[key], rtol=0, atol=1e-5, err_msg=key)


def test_resume_continues_from_the_checkpoint(tmp_path):
    demo = _load_demo()
    args = ["--steps", "30", "--replicas", "2", "--no-progress", "--out", str(tmp_path)]
    demo.main(args[:1] + ["15"] + args[2:])
    demo.main([*args, "--resume"])
    resumed = md.checkpoint.load_checkpoint(tmp_path / "digits.ckpt")
    demo.main([*args, "--out", str(tmp_path / "straight")])
    straight = md.checkpoint.load_checkpoint(tmp_path / "straight" / "digits.ckpt")
    assert int(resumed["optimizer/_iterations"]) == 30
    for key in straight:
        if key.startswith("iterator/"):
            continue
        np.testing.assert_allclose(resumed[key], straight[key], rtol=0, atol=1e-6, err_msg=key)
