"""Training and evaluation on split-binary files through the command line (run_loop.run in process,
dlrm.py and one horovodrun -np 2 as subprocesses)."""
import json
import os
import re
import subprocess

import numpy as np
import pytest

import run.loop as run_loop
from dataloading.feature_spec import SPEC_FILE, split_binary_spec
from dataloading.generate_dataset import synthetic_columns
from dataloading.synthetic import SyntheticDataset
from dataloading.writer import MappingWriter
from storage import checkpoint
from tests.support.configs import TINY
from tests.support.datasets import CARDS, EVAL_ROWS, ROWS, write_dataset
from tests.support.horovod_run import ROOT, horovodrun
from run.config import build_config
from utils.errors import CheckpointError, ConfigError
from tests.support.warm_python import PYTHON

def write_days(path):
    """Two days of TINY's training samples: mappings day1 = samples [0, ROWS), day2 = [ROWS, 2 ROWS),
    both = [0, 2 ROWS); test as write_dataset's."""
    spec = split_binary_spec([f"n{k}" for k in range(3)], {f"c{k}": c for k, c in enumerate(CARDS)},
                             mappings=("day1", "day2", "both", "test"), numerical_dtype="float32", base_dir=str(path))
    data = SyntheticDataset(CARDS, 3, TINY["synthetic_alpha"], TINY["seed"])
    for mapping, (split, first, n) in {"day1": ("train", 0, ROWS), "day2": ("train", ROWS, ROWS),
                                       "both": ("train", 0, 2 * ROWS), "test": ("eval", 0, EVAL_ROWS)}.items():
        with MappingWriter(spec, mapping) as writer:
            writer.write(synthetic_columns(spec, data, split, first, n))
    spec.to_yaml(os.path.join(str(path), SPEC_FILE))
    return str(path)


@pytest.fixture(scope="module")
def one_hot(tmp_path_factory):
    return write_dataset(tmp_path_factory.mktemp("one_hot"))


@pytest.fixture(scope="module")
def multi_hot(tmp_path_factory):
    return write_dataset(tmp_path_factory.mktemp("multi_hot"), {"c0": 3, "c3": 2}, numerical_dtype="float16")


def file_config(path, **overrides):
    values = dict(TINY, dataset_type="split_binary", dataset_path=path, warmup_steps=3, decay_start_step=6,
                  decay_steps=6)
    return build_config(dict(values, **overrides), present={"dataset_type", "dataset_path", *overrides})


def test_files_train_exactly_like_the_synthetic_data_they_hold(one_hot):
    """generate_dataset.py with float32 numericals materialises SyntheticDataset: same run."""
    synthetic = run_loop.run(build_config(dict(TINY, warmup_steps=3, decay_start_step=6, decay_steps=6,
                                           synthetic_rows=ROWS, synthetic_eval_rows=EVAL_ROWS), present=set()))
    files = run_loop.run(file_config(one_hot))
    assert files["steps"] == synthetic["steps"] == 12 and files["samples"] == synthetic["samples"] == EVAL_ROWS
    assert files["auc"] == synthetic["auc"] and files["logloss"] == synthetic["logloss"]
    assert "oracle_auc" not in files


@pytest.mark.slow
def test_batch_order_flags(one_hot):
    base = run_loop.run(file_config(one_hot))
    unshuffled = run_loop.run(file_config(one_hot, shuffle_batch_order=False))
    assert unshuffled["logloss"] != base["logloss"]
    assert run_loop.run(file_config(one_hot, shuffle_batch_order=False))["logloss"] == unshuffled["logloss"]
    partial = run_loop.run(file_config(one_hot, batch_size=100, train_last_partial_batch=True))
    assert partial["steps"] == 16 and run_loop.run(file_config(one_hot, batch_size=100))["steps"] == 15


def test_eval_mapping_and_last_partial_batch(one_hot):
    for valid_batch_size in (500, 128, 333):
        assert run_loop.run(file_config(one_hot, max_steps=2, valid_batch_size=valid_batch_size))["samples"] == 500
    with pytest.raises(ConfigError, match="--eval_mapping=validation: the feature spec has no such mapping"):
        file_config(one_hot, eval_mapping="validation")
    trained = run_loop.run(file_config(one_hot, max_steps=2, train_mapping="test", eval_mapping="train"))
    assert trained["samples"] == ROWS


def test_checkpoint_refuses_another_dataset(one_hot, multi_hot, tmp_path):
    ck = str(tmp_path / "ck")
    run_loop.run(file_config(one_hot, max_steps=2, save_checkpoint_path=ck))
    assert run_loop.run(file_config(one_hot, mode="eval", restore_checkpoint_path=ck))["samples"] == EVAL_ROWS
    with pytest.raises(CheckpointError, match=r"written with max_hotness=\[None, None, None, None\], this run has "
                                              r"max_hotness=\[3, None, None, 2\]"):
        run_loop.run(file_config(multi_hot, mode="eval", restore_checkpoint_path=ck))


def test_checkpoint_of_other_vocabularies_says_why_in_one_line(one_hot, tmp_path):
    """Data preprocessed without --vocab_from has other cardinalities: the refusal names the cause."""
    ck, other = str(tmp_path / "ck"), write_dataset(tmp_path / "other", cards=[12, 41, 7, 30])
    run_loop.run(file_config(one_hot, max_steps=2, save_checkpoint_path=ck))
    with pytest.raises(CheckpointError) as info:
        run_loop.run(file_config(other, mode="eval", restore_checkpoint_path=ck))
    message = str(info.value)
    assert "written with cardinalities=[20, 50, 7, 30], this run has cardinalities=[12, 41, 7, 30]; the data's " \
           "vocabularies differ from the checkpoint's: preprocess new data with --vocab_from=" in message, message
    assert "docs/continuous_training.md" in message and "\n" not in message


def test_empty_eval_mapping_trains_saves_and_says_no_evaluation(tmp_path, capsys):
    """A 0-row test mapping (preproc.criteo --test_fraction=0 on a new day): training runs without
    evaluation and says so at start-up; evaluating or timing it is refused in one line."""
    empty, ck = write_dataset(tmp_path / "data", eval_rows=0), str(tmp_path / "ck")
    result = run_loop.run(file_config(empty, save_checkpoint_path=ck))
    lines = capsys.readouterr().out.splitlines()
    assert "the 'test' mapping (--eval_mapping) has no rows: training without evaluation" in lines
    assert not any(line.startswith("eval at") for line in lines)
    assert result["steps"] == 12 and "auc" not in result
    assert checkpoint.read_manifest(ck)["step"] == 12
    for mode, verb in (("eval", "evaluate"), ("inference", "time")):
        with pytest.raises(ConfigError, match=f"^--eval_mapping=test: the mapping has no rows; nothing to {verb}$"):
            run_loop.run(file_config(empty, mode=mode, restore_checkpoint_path=ck))


def test_final_checkpoint_is_written_before_the_final_evaluation(one_hot, tmp_path, monkeypatch):
    import nn.evaluator

    def failing(*args, **kwargs):
        raise RuntimeError("evaluation failed")

    ck = str(tmp_path / "ck")
    monkeypatch.setattr(nn.evaluator, "evaluate", failing)
    with pytest.raises(RuntimeError, match="evaluation failed"):
        run_loop.run(file_config(one_hot, save_checkpoint_path=ck, evals_per_epoch=0))
    assert checkpoint.read_manifest(ck)["step"] == 12


def test_continue_on_new_data_equals_one_run_over_both_days(one_hot, tmp_path):
    """Day 2 continued from day 1's checkpoint (optimizer state and learning-rate schedule kept,
    file order) is the uninterrupted run over both days; resuming instead is refused."""
    days = write_days(tmp_path / "days")
    flags = dict(shuffle_batch_order=False, decay_steps=30)
    ck, ref = str(tmp_path / "ck"), str(tmp_path / "ref")
    both = run_loop.run(file_config(days, train_mapping="both", save_checkpoint_path=ref, **flags))
    run_loop.run(file_config(days, train_mapping="day1", save_checkpoint_path=ck, **flags))
    with pytest.raises(ConfigError, match="resume: .* was trained with train_mapping=day1, this run has "
                                          "train_mapping=day2; .* --restore_mode=continue"):
        run_loop.run(file_config(days, train_mapping="day2", restore_checkpoint_path=ck, **flags))
    with pytest.raises(ConfigError, match=f"trained with feature_spec={os.path.realpath(days)}/{SPEC_FILE}, this run "
                                          f"has feature_spec={os.path.realpath(one_hot)}/{SPEC_FILE}"):
        run_loop.run(file_config(one_hot, restore_checkpoint_path=ck, **flags))
    day2 = run_loop.run(file_config(days, train_mapping="day2", restore_checkpoint_path=ck, save_checkpoint_path=ck,
                                restore_mode="continue", restore_lr_schedule="continue", **flags))
    assert day2["steps"] == both["steps"] == 24 and day2["auc"] == both["auc"]
    manifest = checkpoint.read_manifest(ck)
    assert manifest["step"] == 24 and manifest["state"]["data"]["epoch"] == 1
    assert manifest["state"]["data"]["definition"]["train_mapping"] == "day2"
    for name in manifest["tensors"]:
        np.testing.assert_array_equal(checkpoint.read_tensor(ck, name), checkpoint.read_tensor(ref, name),
                                      err_msg=name)


def test_multi_hot_combiner_changes_training(multi_hot, one_hot):
    summed = run_loop.run(file_config(multi_hot))
    assert summed["steps"] == 12 and np.isfinite(summed["logloss"])
    assert run_loop.run(file_config(multi_hot, multi_hot_combiner="sum"))["logloss"] == summed["logloss"]
    assert run_loop.run(file_config(multi_hot, multi_hot_combiner="mean"))["logloss"] != summed["logloss"]
    with pytest.raises(ConfigError, match="--multi_hot_combiner only applies to multi-hot features"):
        file_config(one_hot, multi_hot_combiner="mean")


def test_feature_spec_is_a_name_in_the_dataset_directory_or_an_absolute_path(one_hot, tmp_path, monkeypatch):
    """As the reference: --feature_spec names a file inside --dataset_path (a same-named file in
    the current directory is not read), or is an absolute path."""
    import yaml
    with open(os.path.join(one_hot, SPEC_FILE)) as f:
        raw = yaml.safe_load(f)
    raw["source_spec"]["holdout"] = raw["source_spec"]["test"]   # only this spec has the mapping
    with open(os.path.join(one_hot, "other.yaml"), "w") as f:
        yaml.safe_dump(raw, f)
    monkeypatch.chdir(tmp_path)
    (tmp_path / SPEC_FILE).write_text("not: a spec\n")   # decoys in the current directory
    (tmp_path / "other.yaml").write_text("not: a spec\n")
    assert file_config(one_hot, feature_spec=SPEC_FILE).data.cardinalities == CARDS
    result = run_loop.run(file_config(one_hot, feature_spec="other.yaml", eval_mapping="holdout", max_steps=2))
    assert result["steps"] == 2 and result["samples"] == EVAL_ROWS
    assert file_config(one_hot, feature_spec=os.path.join(one_hot, "other.yaml"), eval_mapping="holdout")
    with pytest.raises(ConfigError, match=f"cannot read the feature spec {one_hot}/missing.yaml"):
        file_config(one_hot, feature_spec="missing.yaml")


def dlrm(*args):
    return subprocess.run([*PYTHON, "dlrm.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))


MODEL = ["--embedding_dim=8", "--bottom_mlp_dims=16,8", "--top_mlp_dims=16,1", "--optimizer=adam",
         "--learning_rate=0.01", "--warmup_steps=2", "--decay_start_step=8", "--decay_steps=4", "--batch_size=128",
         "--valid_batch_size=300", "--seed=7", "--print_freq=1"]


def final(log_path):
    with open(log_path) as f:
        records = [json.loads(line) for line in f]
    return {r["step"]: r["loss"] for r in records if r["kind"] == "step"}, records[-1]


@pytest.mark.slow
def test_dlrm_trains_on_split_binary_and_two_ranks_match_one(multi_hot, tmp_path):
    """dlrm.py end to end on a multi-hot dataset, and the same run as 2 Gloo ranks (tables split
    over them, each rank reading its tables' ids for the global batch): same losses and metrics."""
    args = ["--dataset_type=split_binary", f"--dataset_path={multi_hot}", "--validate_dataset", *MODEL]
    one = dlrm(*args, f"--log_path={tmp_path / 'one.json'}")
    assert one.returncode == 0, one.stderr[-3000:]
    assert "validated every value" in one.stdout and re.search(r"eval at step 12: auc 0\.\d+ \| logloss", one.stdout)
    two = horovodrun(2, ["dlrm.py", *args, f"--log_path={tmp_path / 'two.json'}"],
                     timeout=300)
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
    (losses1, end1), (losses2, end2) = final(tmp_path / "one.json"), final(tmp_path / "two.json")
    assert sorted(losses1) == list(range(1, 13)) and sorted(losses2) == list(range(1, 13))
    for step in losses1:
        assert losses2[step] == pytest.approx(losses1[step], rel=1e-5)
    assert end2["auc"] == pytest.approx(end1["auc"], abs=1e-5) and end2["samples"] == end1["samples"] == EVAL_ROWS


def test_dlrm_reports_a_bad_dataset_in_one_line(multi_hot, tmp_path):
    bad = tmp_path / "bad"
    os.makedirs(bad / "train")
    os.makedirs(bad / "test")
    for f in os.listdir(os.path.join(multi_hot, "train")) + [SPEC_FILE]:
        for sub in ("train", "test") if f != SPEC_FILE else ("",):
            src = os.path.join(multi_hot, sub, f)
            open(bad / sub / f, "wb").write(open(src, "rb").read())
    ids = np.fromfile(bad / "test" / "c2.bin", np.int8)
    ids[250] = 7   # cardinality 7
    ids.tofile(bad / "test" / "c2.bin")
    proc = dlrm("--dataset_type=split_binary", f"--dataset_path={bad}", "--validate_dataset", *MODEL)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: {bad}/test/c2.bin: feature 'c2', row 250: ids must be in [0, 7), got 7"), proc.stderr
    os.remove(bad / "train" / "label.bin")
    proc = dlrm("--dataset_type=split_binary", f"--dataset_path={bad}", *MODEL)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == f"error: missing file {bad}/train/label.bin"
