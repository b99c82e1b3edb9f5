"""Non-finite training and bad values in the data stop the run at once, naming the step or the
file, feature and row, with the checkpoints written before it intact and nothing written after."""
import glob
import json
import os
import re
import shutil

import numpy as np
import pytest
import tensorflow as tf

import run.loop as run_loop
from dataloading.batches import epoch_order
from dataloading.feature_spec import SPEC_FILE, FeatureSpec
from dataloading.split_binary import SplitBinaryDataset
from tests.support.datasets import BATCH, ROWS, write_dataset
from tests.test_dataset_cli import MODEL, dlrm, file_config
from tests.test_train_step import batch_tensors, make_trainer
from utils.errors import DatasetError, NonFiniteError


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    return write_dataset(tmp_path_factory.mktemp("clean"))


def corrupted(clean, tmp_path, file, dtype, row, value):
    """A copy of the dataset at `clean` with element `row` of `file` set to `value`."""
    path = str(tmp_path / "data")
    shutil.copytree(clean, path)
    values = np.fromfile(os.path.join(path, file), dtype)
    values[row] = value
    values.tofile(os.path.join(path, file))
    return path


def checkpoints(root):
    with open(os.path.join(root, "latest")) as f:
        latest = f.read().strip()
    return sorted(os.listdir(root)), latest


def test_a_nan_numerical_stops_training_at_its_batch_naming_file_and_row(clean, tmp_path):
    """Row 700's second numerical is NaN (no --validate_dataset): training stops before the step
    that would read it; the checkpoints of the steps before it are kept, no later one is written."""
    path = corrupted(clean, tmp_path, "train/numerical.bin", np.float32, 700 * 3 + 1, np.nan)
    root = str(tmp_path / "ckpt")
    cfg = file_config(path, save_checkpoint_path=root, checkpoint_every_n_steps=2)
    with pytest.raises(DatasetError) as info:
        run_loop.run(cfg)
    assert str(info.value) == f"{path}/train/numerical.bin: feature 'n1', row 700: numerical values must be finite, got nan"
    bad_step = int(np.flatnonzero(epoch_order(cfg.seed, 0, ROWS // BATCH) == 700 // BATCH)[0])   # steps before it
    assert bad_step >= 2   # (seed 5: 5) so that there is a checkpoint to keep
    names, latest = checkpoints(root)
    last = bad_step // 2 * 2
    assert latest == f"ckpt-{last}" and names == sorted({f"ckpt-{max(last - 2, 2)}", f"ckpt-{last}", "latest"})


def test_an_out_of_range_id_without_the_scan_gives_the_scans_line(clean, tmp_path):
    path = corrupted(clean, tmp_path, "train/c2.bin", np.int8, 250, 7)   # cardinality 7
    with pytest.raises(DatasetError) as scanned:
        SplitBinaryDataset(FeatureSpec.from_yaml(os.path.join(path, SPEC_FILE)), {"train": "train"}).validate()
    proc = dlrm("--dataset_type=split_binary", f"--dataset_path={path}", *MODEL)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == f"error: {scanned.value}" == \
        f"error: {path}/train/c2.bin: feature 'c2', row 250: ids must be in [0, 7), got 7"


def test_a_diverging_learning_rate_stops_at_the_step_and_keeps_the_good_checkpoints(clean, tmp_path):
    root, log = tmp_path / "ckpt", tmp_path / "log.json"
    proc = dlrm("--dataset_type=split_binary", f"--dataset_path={clean}", *MODEL, "--learning_rate=1e30",
                "--print_freq=100",   # no progress line: the save after the bad step finds it
                f"--save_checkpoint_path={root}", "--checkpoint_every_n_steps=1", f"--log_path={log}")
    assert proc.returncode == 1, proc.stderr[-3000:]
    line = proc.stderr.strip().splitlines()[-1]
    # whichever overflows first in float32: the loss, or the gradients' sum (the step's non-finite flag)
    found = re.fullmatch(r"error: step (\d+): non-finite (loss \((nan|inf)\)|gradients) at learning rate \S+; "
                         r"training stopped, nothing saved from step \1 on", line)
    assert found, line
    step = int(found.group(1))
    assert 2 <= step < ROWS // BATCH
    names, latest = checkpoints(root)
    assert latest == f"ckpt-{step - 1}" and names == sorted({f"ckpt-{max(step - 2, 1)}", f"ckpt-{step - 1}", "latest"})
    for piece in glob.glob(os.path.join(root, latest, "*.npy")):   # the kept state is finite
        assert np.all(np.isfinite(np.load(piece))), piece
    with open(log) as f:
        kinds = [json.loads(line)["kind"] for line in f]
    assert "final" not in kinds and "eval" not in kinds


def test_non_finite_gradients_with_a_finite_loss_stop_float32_training(monkeypatch):
    trainer = make_trainer("dot")
    layer = trainer.keras_model.get_layer("bottom_mlp")
    forward = layer.call

    @tf.custom_gradient
    def overflowing_backward(y):   # the forward unchanged (the loss stays finite), the bottom MLP's gradients inf
        return y, lambda grad: grad * np.inf

    trainer.train_step(*batch_tensors())
    trainer.check_finite()   # a good step passes
    monkeypatch.setattr(layer, "call", lambda *a, **k: overflowing_backward(forward(*a, **k)))
    trainer.train_step = tf.function(trainer._train_step)   # retrace with the patched layer
    assert np.isfinite(float(trainer.train_step(*batch_tensors(64))))
    monkeypatch.setattr(layer, "call", forward)
    trainer.train_step = tf.function(trainer._train_step)
    trainer.train_step(*batch_tensors(128))   # a later good step: the first bad one is reported
    with pytest.raises(NonFiniteError, match=r"^step 2: non-finite gradients at learning rate 0.5; training "
                                             r"stopped, nothing saved from step 2 on$"):
        trainer.check_finite()


def test_float16_overflow_under_loss_scaling_is_skipped_not_stopped():
    trainer = make_trainer("dot", tf.float16)
    trainer.loss_scale.scale.assign(2.0 ** 40)   # scaled float16 gradients overflow: a skipped step
    trainer.train_step(*batch_tensors())
    assert float(trainer.loss_scale.scale.numpy()) == 2.0 ** 39
    trainer.check_finite()
