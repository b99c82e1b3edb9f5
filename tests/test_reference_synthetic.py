"""The reference's synthetic_dataset_* flags (NVIDIA's main.py), mapped onto our synthetic data:
the same configuration as our flags, multi-hot synthetic data (--synthetic_dataset_hotness)
training exactly like generate_dataset.py's multi-hot files, and the feature spec as the shape
(--synthetic_dataset_use_feature_spec); and the reference's writer of synthetic files,
dataloading/prepare_synthetic_dataset.py, with its flags."""
import os
import subprocess

import numpy as np
import pytest
import yaml

import run.loop as run_loop
from dataloading.feature_spec import SPEC_FILE, FeatureSpec, split_binary_spec
from dataloading.generate_dataset import generate
from dataloading.split_binary import RaggedIds, SplitBinaryDataset
from dataloading.synthetic import SyntheticDataset
from tests.support.configs import TINY
from tests.support.horovod_run import ROOT
from run.config import build_config
from utils.errors import ConfigError
from tests.support.warm_python import PYTHON

SCHEDULE = dict(warmup_steps=3, decay_start_step=6, decay_steps=6)


def config(**flags):
    """TINY with `flags` set on the command line."""
    return build_config(dict(TINY, **SCHEDULE, **flags), present=set(flags))


def test_reference_names_configure_what_ours_do():
    ref = config(synthetic_dataset_cardinalities=["20", "50", "7"], synthetic_dataset_num_numerical_features=5,
                 synthetic_dataset_train_batches=7, synthetic_dataset_valid_batches=3, batch_size=64,
                 valid_batch_size=100, embedding_dim=["8"])
    ours = config(synthetic_cardinalities=["20", "50", "7"], synthetic_num_numerical=5, synthetic_rows=7 * 64,
                  synthetic_eval_rows=300, batch_size=64, valid_batch_size=100, embedding_dim=["8"])
    assert ref == ours and ref.data.synthetic_rows == 448 and ref.data.max_hotness == [None] * 3
    hot = config(synthetic_dataset_hotness=["3", "1", "1", "20"])
    assert hot.data.max_hotness == [3, None, None, 20] and hot.combiners == ["sum"] * 4


@pytest.mark.parametrize("flags, message", [
    (dict(dataset_type="split_binary", dataset_path="/nowhere", synthetic_dataset_train_batches=3),
     "--synthetic_dataset_train_batches only applies with --dataset_type=synthetic"),
    (dict(synthetic_dataset_cardinalities=["5"], synthetic_cardinalities=["5"]),
     "--synthetic_dataset_cardinalities and --synthetic_cardinalities set the same thing; give one"),
    (dict(synthetic_dataset_train_batches=0), "--synthetic_dataset_train_batches must be positive, got 0"),
    (dict(mode="eval", restore_checkpoint_path="/ck", synthetic_dataset_train_batches=3),
     "--synthetic_dataset_train_batches only applies with --mode=train"),
    (dict(mode="inference", synthetic_dataset_valid_batches=3),
     "--synthetic_dataset_valid_batches only applies with --mode=train or --mode=eval"),
    (dict(synthetic_dataset_hotness=["2", "2"]), "--synthetic_dataset_hotness has 2 values but there are 4"),
    (dict(synthetic_dataset_hotness=["2", "0", "1", "1"]), "--synthetic_dataset_hotness entries must be positive"),
    (dict(synthetic_dataset_use_feature_spec=True), "--synthetic_dataset_use_feature_spec needs --dataset_path"),
])
def test_reference_flags_are_refused_in_one_line_where_they_cannot_apply(flags, message):
    with pytest.raises(ConfigError) as e:
        config(**flags)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_multi_hot_synthetic_ids():
    data = SyntheticDataset([20, 50], 2, 1.05, 3, hotness=[4, None])
    batch = data.batch("train", 10, 200)
    ids, lengths = data.multi_hot("train", 10, 200, 0, 4)
    ragged = batch["categorical"][0]
    assert isinstance(ragged, RaggedIds) and data.max_hotness == [4, None]
    np.testing.assert_array_equal(ragged.values, ids)
    np.testing.assert_array_equal(np.diff(ragged.row_splits), lengths)
    one_hot = SyntheticDataset([20, 50], 2, 1.05, 3).batch("train", 10, 200)   # same labels: same planted ids
    for key in ("labels", "oracle_logits", "numerical"):
        np.testing.assert_array_equal(batch[key], one_hot[key])
    np.testing.assert_array_equal(batch["categorical"][1], one_hot["categorical"][1])


@pytest.fixture(scope="module")
def multi_hot_files(tmp_path_factory):
    """TINY's data (seed 5) with c0 up to 3 ids and c3 up to 2, as files (float32 numericals)."""
    path = str(tmp_path_factory.mktemp("mh"))
    spec = split_binary_spec(["n0", "n1", "n2"], {f"c{k}": c for k, c in enumerate([20, 50, 7, 30])},
                             max_hotness={"c0": 3, "c3": 2}, numerical_dtype="float32", base_dir=path)
    generate(spec, 128 * 12, 500, seed=TINY["seed"], alpha=TINY["synthetic_alpha"])
    return path


def test_synthetic_hotness_trains_exactly_like_the_multi_hot_files(multi_hot_files):
    synthetic = run_loop.run(config(synthetic_dataset_hotness=["3", "1", "1", "2"], synthetic_dataset_train_batches=12,
                                synthetic_dataset_valid_batches=1))
    files = run_loop.run(build_config(dict(TINY, **SCHEDULE, dataset_type="split_binary", dataset_path=multi_hot_files),
                                  present={"dataset_type", "dataset_path"}))
    assert synthetic["steps"] == files["steps"] == 12 and synthetic["samples"] == files["samples"] == 500
    assert synthetic["auc"] == files["auc"] and synthetic["logloss"] == files["logloss"]


def test_use_feature_spec_takes_the_shape_from_the_spec(multi_hot_files, tmp_path):
    with open(os.path.join(multi_hot_files, SPEC_FILE)) as f:
        raw = yaml.safe_load(f)
    for name in raw["channel_spec"]["categorical"]:
        raw["feature_spec"][name]["alpha"] = 0.5
    path = str(tmp_path / "spec.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(raw, f)
    cfg = config(synthetic_dataset_use_feature_spec=True, feature_spec=path)
    data = cfg.data
    assert data.cardinalities == [20, 50, 7, 30] and data.num_numerical == 3 and data.max_hotness == [3, None, None, 2]
    assert data.synthetic_alpha == 0.5 and data.dataset_type == "synthetic"
    with pytest.raises(ConfigError, match="^--synthetic_cardinalities: --synthetic_dataset_use_feature_spec takes"):
        config(synthetic_dataset_use_feature_spec=True, feature_spec=path, synthetic_cardinalities=["4"])
    with pytest.raises(ConfigError, match="^--synthetic_alpha: .* gives the ids' alpha; remove one"):
        config(synthetic_dataset_use_feature_spec=True, feature_spec=path, synthetic_alpha=1.0)
    raw["feature_spec"]["c0"]["alpha"] = 1.2
    with open(path, "w") as f:
        yaml.safe_dump(raw, f)
    with pytest.raises(ConfigError, match=r"gives the features different alphas \[0.5, 1.2\]"):
        config(synthetic_dataset_use_feature_spec=True, feature_spec=path)


def test_dlrm_accepts_the_reference_synthetic_flags():
    proc = subprocess.run(
        [*PYTHON, "dlrm.py", "--dataset_type=synthetic", "--synthetic_dataset_cardinalities=20,50,7,30",
         "--synthetic_dataset_hotness=3,1,1,2", "--synthetic_dataset_num_numerical_features=3",
         "--synthetic_dataset_train_batches=4", "--synthetic_dataset_valid_batches=2", "--batch_size=64",
         "--valid_batch_size=100", "--embedding_dim=8", "--bottom_mlp_dims=16,8", "--top_mlp_dims=16,1",
         "--warmup_steps=1", "--decay_start_step=2", "--decay_steps=2", "--learning_rate=0.1", "--print_freq=2"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "training steps 0..4 (4 per epoch, batch 64)" in proc.stdout and "| 200 samples" in proc.stdout


def prepare(*args):
    return subprocess.run([*PYTHON, "-m", "dataloading.prepare_synthetic_dataset", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))


def test_prepare_synthetic_dataset_takes_the_references_flags(multi_hot_files, tmp_path):
    """The reference's writer command: train and test of num_entries rounded down to batches, the
    standard layout, SyntheticDataset's rows (uniform ids); --feature_spec gives the shape."""
    out = str(tmp_path / "syn")
    proc = prepare(f"--synthetic_dataset_dir={out}", "--synthetic_dataset_num_entries=1000",
                   "--synthetic_dataset_batch_size=128", "--synthetic_dataset_table_sizes=20,50",
                   "--num_numerical_features=2", "--seed=3")
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = SplitBinaryDataset(FeatureSpec.from_yaml(os.path.join(out, SPEC_FILE)), {"train": "train", "eval": "test"})
    assert data.rows("train") == data.rows("eval") == 896 and os.path.isfile(os.path.join(out, "train", "cat_1.bin"))
    for split in ("train", "eval"):
        got, want = data.batch(split, 0, 896), SyntheticDataset([20, 50], 2, 0.0, 3).batch(split, 0, 896)
        np.testing.assert_array_equal(got["labels"], want["labels"])
        np.testing.assert_array_equal(got["numerical"], want["numerical"].astype(np.float16))
        for f in range(2):
            np.testing.assert_array_equal(got["categorical"][f], want["categorical"][f])
    shaped = str(tmp_path / "shaped")
    proc = prepare(f"--synthetic_dataset_dir={shaped}", "--synthetic_dataset_num_entries=300",
                   "--synthetic_dataset_batch_size=100", f"--feature_spec={multi_hot_files}/{SPEC_FILE}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    spec = FeatureSpec.from_yaml(os.path.join(shaped, SPEC_FILE))
    assert spec.cardinalities == [20, 50, 7, 30] and spec.max_hotness == [3, None, None, 2]
    proc = prepare(f"--synthetic_dataset_dir={shaped}", f"--feature_spec={multi_hot_files}/{SPEC_FILE}",
                   "--num_numerical_features=4")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == (
        "error: --num_numerical_features: --feature_spec gives the dataset's shape; remove one")
