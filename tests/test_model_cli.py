"""main.py --model=FILE (run/run_model.py, examples/): every example trains on synthetic data,
checkpoints, evaluates the checkpoint with --mode=eval (the training run's AUC), and resumes its
step-6 checkpoint as the uninterrupted run goes on; at 2 Gloo ranks (and under horovodrun at one)
the losses and the AUC equal one process on the same global batches, and a checkpoint written at
one rank count resumes at the other (1 -> 2, 2 -> 1) as the one process goes on (DIN at 3 ranks
too); a model file on a feature spec with named, multi-hot features; a bad model file or an
unsupported flag is one error line, before any data is read; so is a model file that exits or
raises (at import, in build_model or compile_args), at export too."""
import os
import re

import numpy as np
import pytest

from dataloading.feature_spec import SPEC_FILE, split_binary_spec
from dataloading.generate_dataset import generate
from deployment.exporter.model_file import model_file_export
from deployment.repository_format import RepositoryError
import run.loop as run_loop
from storage import checkpoint
from tests.support.configs import tiny_config
from tests.support.horovod_run import horovodrun
from tests.support.runs import assert_same_run, records, succeeded
from tests.support.checks import assert_same_checkpoint, assert_same_run_folders, disk_units, tiered
from utils.errors import ConfigError
from tests.support.model_files import DATA, EXAMPLES, FILE_DATA, PLACEMENT, STEPS, error_line, model_args, python


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Per example, its uninterrupted one-process run: (log records, checkpoint root with ckpt-6
    and ckpt-12)."""
    runs = {}

    def run(name):
        if name not in runs:
            path = tmp_path_factory.mktemp(name)
            succeeded(python(*model_args(name), *DATA, "--checkpoint_every_n_steps=6",
                             f"--save_checkpoint_path={path / 'ckpt'}", f"--log_path={path / 'log.json'}"))
            runs[name] = records(path / "log.json"), path / "ckpt"
        return runs[name]
    return run


def resumed(want, log, result):
    """The run that resumed a step-6 checkpoint (its `result`, logged to `log`) went on as `want`."""
    succeeded(result)
    got = records(log)
    assert sorted(got["step"]) == list(range(7, STEPS + 1))
    assert_same_run(got, want, range(7, STEPS + 1))


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_trains_evaluates_its_checkpoint_and_resumes_exactly(tmp_path, uninterrupted, name):
    want, ckpt = uninterrupted(name)
    assert len(want["step"]) == STEPS and all(v > 0 for v in want["step"].values())
    assert 0.5 < want["eval"]["auc"] <= 1.0
    # dlrm.py's defaults give way to --model's flags as main.py's do
    script = "dlrm.py" if name == "dlrm" else "main.py"
    evaluated = succeeded(python(*model_args(name), *DATA[:4], "--seed=7", "--mode=eval", "--valid_batch_size=300",
                                 "--synthetic_eval_rows=500", f"--restore_checkpoint_path={ckpt}",
                                 f"--log_path={tmp_path / 'eval.json'}", script=script))
    assert f"restored {ckpt / 'ckpt-12'}" in evaluated.stdout
    got = records(tmp_path / "eval.json")["eval"]
    assert (got["auc"], got["logloss"], got["samples"]) == (want["eval"]["auc"], want["eval"]["logloss"], 500)
    resumed(want, tmp_path / "resumed.json",
            python(*model_args(name), *DATA, f"--restore_checkpoint_path={ckpt / 'ckpt-6'}",
                   f"--log_path={tmp_path / 'resumed.json'}", script=script))


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_at_two_gloo_ranks_equals_one_process_and_its_checkpoints_move_between_rank_counts(
        tmp_path, uninterrupted, name):
    """Losses and AUC at 2 Gloo ranks equal one process'; the 2 ranks' checkpoint after step 6
    resumed by one process, and the one process' resumed at 2 ranks, go on as the one process."""
    want, one = uninterrupted(name)
    ckpt = tmp_path / "ckpt"
    out = succeeded(horovodrun(2, ["main.py", *model_args(name), *DATA, *PLACEMENT, "--checkpoint_every_n_steps=6",
                                   f"--save_checkpoint_path={ckpt}", f"--log_path={tmp_path / 'run.json'}"]))
    assert "2 ranks" in out.stdout
    assert_same_run(records(tmp_path / "run.json"), want, range(1, STEPS + 1))
    resume = [*model_args(name), *DATA]
    resumed(want, tmp_path / "to_one.json", python(*resume, f"--restore_checkpoint_path={ckpt / 'ckpt-6'}",
                                                   f"--log_path={tmp_path / 'to_one.json'}"))
    resumed(want, tmp_path / "to_two.json",
            horovodrun(2, ["main.py", *resume, *PLACEMENT, f"--restore_checkpoint_path={one / 'ckpt-6'}",
                           f"--log_path={tmp_path / 'to_two.json'}"]))


@pytest.mark.slow
def test_an_example_under_horovodrun_at_one_rank_equals_one_process(tmp_path, uninterrupted):
    want, _ = uninterrupted("din")
    out = succeeded(horovodrun(1, ["main.py", *model_args("din"), *DATA, f"--log_path={tmp_path / 'run.json'}"]))
    assert "1 rank" in out.stdout
    assert_same_run(records(tmp_path / "run.json"), want, range(1, STEPS + 1))


@pytest.mark.slow
def test_din_at_three_gloo_ranks_equals_one_process(tmp_path, uninterrupted):
    """DIN's history (a sequence over the row-sliced item table) at 3 Gloo ranks: the one process'
    losses and AUC, and its checkpoint resumed by one process continues as it."""
    want, _ = uninterrupted("din")
    ckpt = tmp_path / "ckpt"
    succeeded(horovodrun(3, ["main.py", *model_args("din"), *DATA, *PLACEMENT, "--checkpoint_every_n_steps=6",
                             f"--save_checkpoint_path={ckpt}", f"--log_path={tmp_path / 'run.json'}"]))
    assert_same_run(records(tmp_path / "run.json"), want, range(1, STEPS + 1))
    succeeded(python(*model_args("din"), *DATA, f"--restore_checkpoint_path={ckpt / 'ckpt-6'}",
                     f"--log_path={tmp_path / 'resumed.json'}"))
    assert_same_run(records(tmp_path / "resumed.json"), want, range(7, STEPS + 1))


def spec_dataset(path, with_data=True):
    """A feature spec with named features (user, item, multi-hot genres of up to 3), 2 numericals;
    its files written unless `with_data` is false (a run that reads them then fails)."""
    spec = split_binary_spec(["age", "hour"], {"user": 60, "item": 40, "genres": 12}, max_hotness={"genres": 3},
                             numerical_dtype="float32", base_dir=str(path))
    if with_data:
        generate(spec, 96 * 8, 300, seed=3, alpha=1.1)
    else:
        os.makedirs(path, exist_ok=True)
        spec.to_yaml(os.path.join(str(path), SPEC_FILE))
    return str(path)


@pytest.mark.slow
def test_movielens_mlp_on_a_feature_spec_with_a_multi_hot_feature_at_one_and_two_ranks(tmp_path):
    data = spec_dataset(tmp_path / "data")
    out = succeeded(python(*model_args("movielens_mlp"), *FILE_DATA, f"--dataset_path={data}",
                           f"--log_path={tmp_path / 'log.json'}"))
    assert "3 categorical features" in out.stdout
    got = records(tmp_path / "log.json")
    assert sorted(got["step"]) == [4, 8] and got["eval"]["samples"] == 300
    # 2 ranks, model-parallel input: rank r reads the global batch's ids of its tables' features, genres ragged
    succeeded(horovodrun(2, ["main.py", *model_args("movielens_mlp"), *FILE_DATA, f"--dataset_path={data}",
                             "--row_slice_threshold=100", f"--log_path={tmp_path / 'two.json'}"]))
    assert_same_run(records(tmp_path / "two.json"), got, [4, 8])


BAD_MODELS = {
    "no_builder.py": ("import ranking\n\ndef make_model(features, hparams):\n    pass\n",
                      "defines no function build_model(features, hparams)"),
    "two_logits.py": ("import keras, ranking\n\ndef build_model(features, hparams):\n"
                      "    x = features.inputs()\n"
                      "    e = features.embedding(features.feature_configs(4))([x[f.name] for f in features])\n"
                      "    h = keras.layers.Concatenate(name='c')(e)\n"
                      "    return ranking.Model(x, keras.layers.Dense(2, name='out')(h))\n",
                      "build_model: the model gives (2, 2) for 2 samples; it must give one logit per sample ([b] or [b, 1])"),
    "two_heads.py": ("import keras, ranking\n\ndef build_model(features, hparams):\n"
                     "    x = features.inputs()\n"
                     "    e = features.embedding(features.feature_configs(4))([x[f.name] for f in features])\n"
                     "    h = keras.layers.Concatenate(name='c')(e)\n"
                     "    return ranking.Model(x, {'click': keras.layers.Dense(1, name='click')(h),\n"
                     "                             'rating': keras.layers.Dense(1, name='rating')(h)})\n",
                     "build_model: the model has heads (click, rating); the data have one label (label): give one "
                     "logit per sample, or train on data with a label per head (a feature spec's label channel, "
                     "--synthetic_labels)"),
    "unknown_feature.py": ("import keras, ranking\n\ndef build_model(features, hparams):\n"
                           "    x = features.inputs()\n"
                           "    e = features.embedding(features.feature_configs(4, names=['user', 'occupation']))(\n"
                           "        [x['user'], x['item']])\n"
                           "    return ranking.Model(x, keras.layers.Dense(1, name='out')(e[0]))\n",
                           "feature 'occupation' is not in the dataset (its features: user, item, genres)"),
    "exits.py": ("import sys\n\ndef build_model(features, hparams):\n    sys.exit(0)\n",
                 "build_model exited (SystemExit(0)) at line 4; a model file returns its model, it never ends the "
                 "process"),
}


@pytest.mark.parametrize("file", sorted(BAD_MODELS))
def test_a_bad_model_file_is_one_line_before_any_data_is_read(tmp_path, file):
    """The spec's data files do not exist: reading them would fail with another error."""
    source, message = BAD_MODELS[file]
    (tmp_path / file).write_text(source)
    data = spec_dataset(tmp_path / "data", with_data=False)
    line = error_line(python(f"--model={tmp_path / file}", *FILE_DATA, f"--dataset_path={data}"))
    assert line == f"error: --model={tmp_path / file}: {message}"


# A model file that exits or raises outside the run's checks, or is no .py file: (its source, what the line
# says after the file).
ENDS = "; a model file returns its model, it never ends the process"
FAILING_MODELS = {
    "raises.py": ("import ranking\n\ndef build_model(features, hparams):\n    x = features.inputs()\n"
                  "    raise ValueError('no width\\nfor the deep part')\n",
                  "build_model raised ValueError at line 5: no width for the deep part"),
    "exits_with_a_message.py": ("import sys\n\ndef build_model(features, hparams):\n    sys.exit('not today')\n",
                                "build_model exited (SystemExit('not today')) at line 4" + ENDS),
    "fails_to_import.py": ("import ranking\nimport no_such_module_here\n",
                           "importing it raised ModuleNotFoundError at line 2: No module named 'no_such_module_here'"),
    "exits_at_import.py": ("raise SystemExit(3)\n", "importing it exited (SystemExit(3)) at line 1" + ENDS),
    "bad_compile_args.py": ("from examples.wide_and_deep import build_model\n\n"
                            "def compile_args(features, hparams):\n    return 1 / 0\n",
                            "compile_args raised ZeroDivisionError at line 4: division by zero"),
    "model.txt": ("def build_model(features, hparams):\n    pass\n", "not a Python file (its name ends in .py)"),
}


@pytest.mark.parametrize("name", sorted(FAILING_MODELS))
def test_a_model_file_that_exits_or_raises_is_one_line_naming_it(tmp_path, name):
    """In process: the run's ConfigError (main.py's `error:` line, exit code 2, as exits.py above
    shows) and the exporter's RepositoryError (deploy.py's) for the same file."""
    source, message = FAILING_MODELS[name]
    path = tmp_path / name
    path.write_text(source)
    with pytest.raises(ConfigError) as info:
        run_loop.run(tiny_config(model=str(path), model_param=[]))
    assert str(info.value) == f"--model={path}: {message}"
    manifest = {"path": str(tmp_path), "signature": {"cardinalities": [20, 50, 7, 30], "max_hotness": [None] * 4,
                                                     "num_numerical": 3, "hparams": {}}}
    with pytest.raises(RepositoryError) as info:
        model_file_export(manifest, str(path))
    assert str(info.value) == f"--model={path}: {message}"


@pytest.mark.slow
def test_unsupported_flags_and_bad_hyper_parameters_are_one_line(tmp_path):
    line = error_line(python(*model_args("dlrm"), *DATA, "--interaction=cross", "--embedding_dim=8",
                             "--bottom_mlp_dims=8"))
    assert line == ("error: --model=examples/dlrm.py does not take --bottom_mlp_dims, --embedding_dim and "
                    "--interaction (the model file sets its own shape): remove them")
    assert error_line(python(*DATA, "--model_param=hidden=[8]")) == \
        "error: --model_param only applies with --model; remove it or change that flag"
    assert error_line(python(*model_args("deepfm"), *DATA, "--model_param=width=3")) == \
        "error: --model=examples/deepfm.py: hyper-parameter 'width' is not one of this model's (dropout, embedding_dim, hidden)"
    assert error_line(python("--model=examples/deepfm.py", *DATA, "--model_param=dropout=high")) == \
        "error: --model=examples/deepfm.py: hyper-parameter 'dropout' must be float (like 0.0), got 'high'"
    (tmp_path / "params.yaml").write_text("embedding_dim: 4\nhidden: [8]\n")
    out = succeeded(python("--model=examples/deepfm.py", f"--model_params={tmp_path / 'params.yaml'}",
                           "--model_param=hidden=[16]", *DATA, "--max_steps=1",
                           f"--log_path={tmp_path / 'log.json'}"))
    assert "model: examples/deepfm.py" in out.stdout
    assert error_line(python("--model=examples/nope.py", *DATA)) == \
        "error: --model=examples/nope.py: no such file (a Python file defining build_model(features, hparams))"


# Two HybridEmbedding layers: "wide" (a width-1 table per feature) and "deep", whose table "shared"
# features 0 and 3 both read (at 2 ranks, PLACEMENT row-slices it).
TWO_LAYERS = '''import keras, ranking

def build_model(features, hparams):
    x = features.inputs()
    n = features.names
    wide = features.embedding(features.feature_configs(1, prefix="wide_"), name="wide")([x[f] for f in n])
    shared = ranking.TableConfig(name="shared", vocabulary_size=features[n[0]].cardinality, embedding_dim=4,
                                 combiner="sum")
    deep = [ranking.FeatureConfig(name=f, table=shared, input_shape=(None,), output_shape=(None, 4))
            for f in (n[0], n[3])] + features.feature_configs(4, names=n[1:3])
    emb = features.embedding(deep, name="deep")([x[n[0]], x[n[3]], x[n[1]], x[n[2]]])
    h = keras.layers.Concatenate(name="deep_input")(emb + [x["numerical"]])
    h = keras.layers.Dense(8, activation="relu", name="hidden")(h)
    return ranking.Model(x, keras.layers.Add(name="logit")(wide + [keras.layers.Dense(1, name="deep_logit")(h)]))
'''


@pytest.mark.slow
def test_two_embedding_layers_and_a_shared_table(tmp_path):
    """Trains, checkpoints and resumes exactly; at 2 ranks, with model-parallel input (the
    default) and with --data_parallel_input, equals one process."""
    (tmp_path / "two_layers.py").write_text(TWO_LAYERS)
    args = [f"--model={tmp_path / 'two_layers.py'}", *DATA]
    succeeded(python(*args, "--checkpoint_every_n_steps=6", f"--save_checkpoint_path={tmp_path / 'one'}",
                     f"--log_path={tmp_path / 'one.json'}"))
    want = records(tmp_path / "one.json")
    assert len(want["step"]) == STEPS
    resumed(want, tmp_path / "resumed.json", python(*args, f"--restore_checkpoint_path={tmp_path / 'one' / 'ckpt-6'}",
                                                    f"--log_path={tmp_path / 'resumed.json'}"))
    for name, layout in (("model_parallel", []), ("data_parallel", ["--data_parallel_input"])):
        succeeded(horovodrun(2, ["main.py", *args, *PLACEMENT, *layout, f"--log_path={tmp_path / name}.json"]))
        assert_same_run(records(tmp_path / f"{name}.json"), want, range(1, STEPS + 1))


# tests/test_tiered_cli.py's sizes: at --embedding_memory_budget_gb=0.0001 (tiered()) DeepFM's tables of
# features 0 and 2 (3,000 and 2,000 rows, width 1 and 4) go to disk.
TIER_DATA = ["--dataset_type=synthetic", "--synthetic_cardinalities=3000,40,2000,7", "--synthetic_num_numerical=3",
             "--optimizer=adam", "--seed=3", "--learning_rate=0.01", "--batch_size=64", "--valid_batch_size=64",
             "--synthetic_rows=1536", "--synthetic_eval_rows=500", "--warmup_steps=2", "--decay_start_step=16",
             "--decay_steps=8", "--print_freq=4", "--evals_per_epoch=2"]


@pytest.mark.slow
def test_tables_on_disk_equal_memory_and_checkpoints_move_between_tiers(tmp_path):
    """DeepFM (every feature read by two tables) with tables on disk writes the in-memory run's
    checkpoints bit for bit and evaluates alike; a checkpoint written on disk resumes in memory,
    one written in memory resumes on disk, both to the in-memory run's last checkpoint."""
    def train(out, *flags):
        return succeeded(python(*model_args("deepfm"), *TIER_DATA, *flags, f"--save_checkpoint_path={out / 'ckpt'}",
                                f"--log_path={out / 'log.json'}")).stdout

    memory, disk, store = tmp_path / "memory", tmp_path / "disk", tmp_path / "store"
    memory_out = train(memory, "--checkpoint_every_n_steps=12")
    disk_out = train(disk, *tiered(store), "--checkpoint_every_n_steps=12")
    assert set(disk_units(disk_out)) == {(0, 0), (0, 2), (0, 4), (0, 6)} and "cache hits" in disk_out, disk_out
    assert "cache hits" not in memory_out
    assert_same_run_folders(disk, memory)
    assert os.listdir(store) == []
    train(tmp_path / "from_disk", f"--restore_checkpoint_path={disk / 'ckpt' / 'ckpt-12'}")
    train(tmp_path / "to_disk", *tiered(store), f"--restore_checkpoint_path={memory / 'ckpt' / 'ckpt-12'}")
    for resumed in ("from_disk", "to_disk"):
        assert_same_checkpoint(tmp_path / resumed / "ckpt", memory / "ckpt" / "ckpt-24")


@pytest.mark.slow
def test_two_embedding_layers_with_tables_on_disk_at_two_ranks_equal_memory(tmp_path):
    """Both layers' tables within one budget (one planner call over both: "deep"'s larger tables
    partly on disk) at 2 ranks: the checkpoints and evaluations of the same run in
    memory, bit for bit."""
    (tmp_path / "two_layers.py").write_text(TWO_LAYERS)

    def train(out, *flags):
        args = ["main.py", f"--model={tmp_path / 'two_layers.py'}", *TIER_DATA, *PLACEMENT, *flags,
                "--checkpoint_every_n_steps=12", f"--save_checkpoint_path={out / 'ckpt'}",
                f"--log_path={out / 'log.json'}"]
        return succeeded(horovodrun(2, args)).stdout

    memory, disk, store = tmp_path / "memory", tmp_path / "disk", tmp_path / "store"
    train(memory)
    disk_out = train(disk, *tiered(store))
    deep, wide = disk_out.split("layer 'wide'")   # the plans: deep's tables over what wide keeps in memory
    assert disk_units(deep) and not disk_units(wide), disk_out
    assert_same_run_folders(disk, memory)


@pytest.mark.slow
def test_tables_on_disk_at_two_ranks_equal_memory_and_one_process(tmp_path):
    """Wide & Deep at 2 Gloo ranks with model-parallel input (each rank reads the global batch's ids
    of its tables' features) and tables on disk (row shards, whole tables) writes the checkpoints of
    the same run in memory bit for bit and evaluates alike; both equal one process (losses, AUC)."""
    def train(out, *flags, ranks=2):
        placement = ["--row_slice_threshold=6000", "--data_parallel_threshold=30"] if ranks > 1 else []
        args = [*model_args("wide_and_deep"), *TIER_DATA, *placement, *flags, "--checkpoint_every_n_steps=12",
                f"--save_checkpoint_path={out / 'ckpt'}", f"--log_path={out / 'log.json'}"]
        return succeeded(horovodrun(ranks, ["main.py", *args]) if ranks > 1 else python(*args)).stdout

    memory, disk, store = tmp_path / "memory", tmp_path / "disk", tmp_path / "store"
    memory_out = train(memory)
    disk_out = train(disk, *tiered(store))
    units = set(disk_units(disk_out))
    assert {(0, 4), (1, 4)} <= units and disk_units(memory_out) == {}, disk_out   # deep_cat_0: row shards
    assert "cache hits" in disk_out and "2 ranks" in disk_out
    assert_same_run_folders(disk, memory)
    assert os.listdir(store) == []
    one = tmp_path / "one"
    train(one, ranks=1)
    assert_same_run(records(disk / "log.json"), records(one / "log.json"), range(4, 25, 4))


def table_tensors(ckpt) -> dict:
    """A checkpoint's tables (not their optimizer slots or updated_at), by name."""
    manifest = checkpoint.read_manifest(str(ckpt))
    return {n: checkpoint.read_tensor(manifest["path"], n) for n in manifest["tensors"]
            if re.fullmatch(r".*_tables/table_\d+", n)}


def test_frozen_and_zero_initialised_tables_and_the_offloading_line(tmp_path):
    """--embedding_trainable=false: the tables of step 6 are step 3's, the dense weights not;
    --embedding_zeros_initializer: every table zero (frozen: after training too);
    --cpu_offloading_threshold_gb: the built-in path's line (on a CPU, the rank's table bytes)."""
    args = [*model_args("wide_and_deep"), *DATA, "--max_steps=6", "--checkpoint_every_n_steps=3"]
    out = succeeded(python(*args, "--embedding_trainable=false", f"--save_checkpoint_path={tmp_path / 'frozen'}",
                           "--cpu_offloading_threshold_gb=1"))
    first, last = (table_tensors(tmp_path / "frozen" / f"ckpt-{s}") for s in (3, 6))
    assert len(first) == 8 and all(np.array_equal(first[n], last[n]) and first[n].any() for n in first)
    manifest = checkpoint.read_manifest(str(tmp_path / "frozen" / "ckpt-6"))
    assert not np.array_equal(checkpoint.read_tensor(manifest["path"], "deep_0/kernel"),
                              checkpoint.read_tensor(checkpoint.read_manifest(
                                  str(tmp_path / "frozen" / "ckpt-3"))["path"], "deep_0/kernel"))
    table_bytes = 4 * 5 * (300 + 50 + 7 + 30)   # widths 1 and 4 per feature
    assert (f"--cpu_offloading_threshold_gb=1: rank 0's tables take {table_bytes / 2 ** 30:.3g} GiB, all in host "
            f"memory already (no GPU)") in out.stdout.splitlines()
    succeeded(python(*args, "--embedding_trainable=false", "--embedding_zeros_initializer",
                     f"--save_checkpoint_path={tmp_path / 'zeros'}"))
    zeros = table_tensors(tmp_path / "zeros" / "ckpt-6")
    assert len(zeros) == 8 and not any(t.any() for t in zeros.values())


SUBCLASSED = '''import keras, ranking

class Wide(ranking.Model):
    def __init__(self, features):
        super().__init__(name="wide")
        self.names = features.names
        self.emb = features.embedding(features.feature_configs(1))

    def call(self, x):
        return keras.ops.sum(keras.ops.concatenate(self.emb([x[n] for n in self.names]), axis=1), axis=1)

def build_model(features, hparams):
    return Wide(features)
'''


@pytest.mark.slow
def test_a_subclassed_model_at_two_ranks_takes_data_parallel_input(tmp_path):
    """Model-parallel input (the default) gives the layers the data's ids, which a subclassed model's
    inputs do not say: one line naming --data_parallel_input, with which it trains."""
    (tmp_path / "wide.py").write_text(SUBCLASSED)
    args = ["main.py", f"--model={tmp_path / 'wide.py'}", *DATA, "--max_steps=2"]
    out = horovodrun(2, args)
    assert out.returncode != 0 and (
        "error: model-parallel input (--data_parallel_input off) gives the layer its tables' ids of the global batch "
        f"from the data: feature 'cat_0' of layer 'embedding' must take one of --model={tmp_path / 'wide.py'}: "
        "build_model's inputs (features.inputs()) as it is, or give --data_parallel_input") in out.stderr, out.stderr
    succeeded(horovodrun(2, args + ["--data_parallel_input"]))
