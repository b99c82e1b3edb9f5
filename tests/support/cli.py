"""The command-line tests' tiny run (TINY: 4 tables, 12 training steps of batch 128, 500
evaluation samples) in process (config, train), and the entry points as scripts (run_script,
SCRIPT_ARGS: a tiny DLRM)."""
import os
import subprocess

import run.loop as run_loop
from tests.support.configs import TINY as TINY_BASE, make_config
from tests.support.horovod_run import ROOT
from tests.support.warm_python import PYTHON

ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
TINY = dict(TINY_BASE, warmup_steps=3, decay_start_step=6, decay_steps=6, print_freq=100,
            synthetic_rows=128 * 12, synthetic_eval_rows=500)
TINY_STEPS = 12


def config(**overrides):
    """A tiny valid config with `overrides`, which count as set on the command line."""
    return make_config(TINY, **overrides)


def train(**overrides):
    """The tiny run with `overrides`, in process (run.loop.run's result)."""
    return run_loop.run(config(**overrides))


def run_script(*args, timeout=120):
    """`python ARGS` (a warm interpreter) in the checkout, run to its end (text)."""
    return subprocess.run([*PYTHON, *args], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=timeout)


SCRIPT_ARGS = ["--dataset_type=synthetic", "--synthetic_cardinalities=20,50,7,30", "--synthetic_num_numerical=3",
               "--embedding_dim=8", "--bottom_mlp_dims=16,8", "--top_mlp_dims=16,1", "--batch_size=64",
               "--valid_batch_size=256", "--synthetic_rows=256", "--synthetic_eval_rows=256", "--print_freq=1"]
