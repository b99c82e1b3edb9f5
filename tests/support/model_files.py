"""main.py --model=FILE as the model-file tests run it: the synthetic data's flags (DATA: 12 steps
of 96), every example at small sizes (EXAMPLES, model_args), the placement that row-slices and
replicates tables at 2 ranks, split-binary files' flags (FILE_DATA), and a run's one error line."""
import os
import subprocess

from tests.support.horovod_run import ROOT
from tests.support.warm_python import PYTHON

DATA = ["--dataset_type=synthetic", "--synthetic_cardinalities=300,50,7,30", "--synthetic_num_numerical=3",
        "--optimizer=adam", "--learning_rate=0.01", "--seed=7", "--batch_size=96", "--valid_batch_size=300",
        "--synthetic_rows=1152", "--synthetic_eval_rows=500", "--warmup_steps=2", "--decay_start_step=8",
        "--decay_steps=4", "--print_freq=1"]
STEPS = 12
# Each example at small sizes (dropout off: Keras' masks are not checkpointed and depend on the rank count).
EXAMPLES = {
    "wide_and_deep": ["deep_width=4", "hidden=[16,8]", "dropout=0"],
    "deepfm": ["embedding_dim=4", "hidden=[16,8]"],
    "movielens_mlp": ["embedding_dim=4", "hidden=[16,8]"],
    "dlrm": ["embedding_dim=8", "bottom=[16,8]", "top=[16]"],
    "dcnv2": ["embedding_dim=8", "bottom=[16,8]", "num_cross_layers=2", "projection_dim=4", "top=[16]"],
    "din": ["width=4", "attention=[8]", "hidden=[16,8]"],
    "bst": ["width=4", "heads=2", "attention=[8]", "hidden=[16,8]"],
    "hstu": ["width=4", "heads=2", "hidden=[16,8]"],
}


# The sequence models' data: a history of up to 6 items of cat_0's (their candidate's) vocabulary.
EXAMPLE_DATA = {name: ["--synthetic_history_length=6"] for name in ("din", "bst", "hstu")}


# Table 0 of every example (300 rows) row-sliced over the ranks, the 7-row tables replicated.
PLACEMENT = ["--row_slice_threshold=200", "--data_parallel_threshold=60"]


def model_args(name):
    """main.py's flags of example `name` at its small sizes."""
    return [f"--model=examples/{name}.py"] + [f"--model_param={p}" for p in EXAMPLES[name]] + EXAMPLE_DATA.get(name, [])


def python(*args, script="main.py"):
    """`python SCRIPT ARGS` (a warm interpreter) in the checkout, run to its end (text)."""
    return subprocess.run([*PYTHON, script, *args], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))


def error_line(result):
    """The run's one error line (it failed with exit status 2, no traceback)."""
    assert result.returncode == 2, f"{result.stdout[-2000:]}\n{result.stderr[-2000:]}"
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    return errors[0]


FILE_DATA = ["--dataset_type=split_binary", "--optimizer=adagrad", "--learning_rate=0.05", "--batch_size=96",
             "--valid_batch_size=100", "--warmup_steps=0", "--decay_steps=0", "--print_freq=4"]
