"""The command-line tests' tiny DLRM (MODEL; DATA: 12 steps of 96 with the schedule's warm-up
and decay; PLACEMENT: a row-sliced and a replicated table) and their checks: a run in one
process, its success, its --log_path records, two runs' losses and evaluations alike."""
import json
import os
import subprocess
import time

import pytest

from tests.support.horovod_run import ROOT
from tests.support.warm_python import PYTHON

MODEL = ["--dataset_type=synthetic", "--synthetic_cardinalities=300,50,7,30,90", "--synthetic_num_numerical=3",
         "--embedding_dim=8", "--bottom_mlp_dims=16,8", "--top_mlp_dims=16,1", "--optimizer=adam", "--seed=7"]
# 12 steps of 96 (divisible by 2 and 3), the schedule's warm-up and decay inside them.
DATA = ["--learning_rate=0.01", "--batch_size=96", "--valid_batch_size=300", "--synthetic_rows=1152",
        "--synthetic_eval_rows=500", "--warmup_steps=2", "--decay_start_step=8", "--decay_steps=4",
        "--print_freq=1", "--evals_per_epoch=1"]
# Table 0 (2,400 elements) row-sliced over the ranks, table 2 (56) replicated on every rank.
PLACEMENT = ["--row_slice_threshold=2000", "--data_parallel_threshold=60"]
STEPS = 12


def one_process(*args, timeout=300):
    """`python ARGS` (a warm interpreter) in the checkout, run to its end (text)."""
    return subprocess.run([*PYTHON, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))


def succeeded(result):
    """`result`, having exited with 0 (else its output's tails)."""
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def records(log_path):
    """{"step": {step: loss}, "eval": the last evaluation record}."""
    with open(log_path) as f:
        lines = [json.loads(line) for line in f]
    return {"step": {r["step"]: r["loss"] for r in lines if r["kind"] == "step"},
            "eval": [r for r in lines if r["kind"] == "eval"][-1]}


def assert_same_losses(got, want, steps):
    """Same losses (records') at `steps`."""
    for s in steps:
        assert got["step"][s] == pytest.approx(want["step"][s], rel=1e-5, abs=1e-6), s


def assert_same_run(got, want, steps):
    """Same losses at `steps`, same final evaluation."""
    assert_same_losses(got, want, steps)
    for metric in ("auc", "logloss"):
        assert got["eval"][metric] == pytest.approx(want["eval"][metric], rel=1e-5, abs=1e-6), metric
    assert got["eval"]["samples"] == want["eval"]["samples"]


def wait_for(condition, seconds, what):
    """Until condition() holds, at most `seconds`."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
