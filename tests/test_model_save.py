"""ranking.Model.save_checkpoint / restore_checkpoint for a model trained by `fit` in a script:
examples/deepfm.py's model, built from ranking.Features and trained without main.py, saved with
its model file and features, is the checkpoint `main.py --model=FILE` writes: main.py's
evaluation of it predicts what the script's model predicts, main.py trains on from it
(--restore_mode=continue; resume is one line: no data position), `deploy.py --model=FILE`
exports it and the export serves the script's predictions; a fresh build restores it bit for bit
(predictions, and the next steps equal the saved model's own). The refusals are one line. (At N
ranks: tests/support/ranking_multirank_worker.py saves with save_checkpoint at 2 ranks and restores into
one process.)"""
import json

import keras
import numpy as np
import pytest
import tensorflow as tf

from deployment.repository_format import ServingLayout, categorical_matrix
from deployment.serving.live import Model as Served
from ranking import CategoricalFeature, Features
from ranking.features import load_model_file
from tests.support.exports import deploy, reference
from tests.test_model_export import PARAMS, python, run_config
from utils.errors import CheckpointError, ConfigError

FILE = "examples/deepfm.py"
HPARAMS = {"embedding_dim": 4, "hidden": [16, 8]}   # PARAMS["deepfm"], as --model_param gives them
CARDS, HOTNESS = (300, 50, 7, 30), (None, 3, None, 2)   # tests/test_model_export.py's synthetic data
B = 64


def features() -> Features:
    return Features([CategoricalFeature(f"cat_{i}", c, h) for i, (c, h) in enumerate(zip(CARDS, HOTNESS))], 3)


def built(hparams=HPARAMS):
    model = load_model_file(FILE)[0](features(), dict(hparams))
    model.compile(optimizer="adagrad", learning_rate=0.05)
    return model


def inputs(rng, n) -> dict:
    x = {"numerical": tf.constant(rng.normal(size=(n, 3)), tf.float32)}
    for i, (c, h) in enumerate(zip(CARDS, HOTNESS)):
        if h is None:
            x[f"cat_{i}"] = tf.constant(rng.integers(0, c, n))
        else:
            lengths = rng.integers(1, h + 1, n)
            x[f"cat_{i}"] = tf.RaggedTensor.from_row_lengths(rng.integers(0, c, lengths.sum()), lengths)
    return x


def as_inputs(batch) -> dict:
    """An evaluation batch of the run (dataloading's) as the model's inputs."""
    x = {"numerical": tf.constant(batch["numerical"])}
    for i, (c, h) in enumerate(zip(batch["categorical"], HOTNESS)):
        x[f"cat_{i}"] = tf.constant(c) if h is None else tf.RaggedTensor.from_row_splits(c.values, c.row_splits)
    return x


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The script: deepfm fitted for 5 steps on random data, saved with its file and features."""
    keras.utils.set_random_seed(3)
    rng = np.random.default_rng(0)
    x, y = inputs(rng, 5 * B), tf.constant(rng.integers(0, 2, 5 * B), tf.float32)
    model = built()
    model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(B), epochs=1, verbose=0)
    root = tmp_path_factory.mktemp("script") / "ckpt"
    path = model.save_checkpoint(str(root), FILE, features(), HPARAMS)
    return model, root, path


def test_the_checkpoint_is_main_pys_and_deploys_serving_the_scripts_predictions(saved, tmp_path):
    model, root, path = saved
    assert path == str(root / "ckpt-5")
    manifest = json.loads((root / "ckpt-5" / "manifest.json").read_text())
    names = [f"cat_{i}" for i in range(4)]
    assert manifest["signature"] == {"model": "deepfm.py", "hparams": HPARAMS, "features": names,
                                     "cardinalities": list(CARDS), "num_numerical": 3, "max_hotness": list(HOTNESS),
                                     "optimizer": "adagrad"}
    # main.py --model=FILE --mode=eval restores it (its signature checked) and predicts as the script's model
    batch, logits = reference(run_config(FILE, PARAMS["deepfm"]), str(root), 300)
    mine = model.inference(as_inputs(batch)).numpy().reshape(-1)
    np.testing.assert_allclose(logits, mine, rtol=1e-6, atol=1e-6)
    # deploy.py --model=FILE exports it; the export serves the same predictions
    result = deploy(f"--checkpoint={root}", f"--output={tmp_path / 'repo'}", "--model_name=m", f"--model={FILE}",
                    "--forms=tables")
    assert result.returncode == 0, result.stderr[-3000:]
    layout = ServingLayout(**json.loads((tmp_path / "repo" / "export.json").read_text())["layout"])
    served = Served(str(tmp_path / "repo")).infer(np.asarray(batch["numerical"]),
                                                  categorical_matrix(batch["categorical"], layout.max_hotness))
    np.testing.assert_allclose(served["logits"][:, 0], mine, rtol=1e-5, atol=1e-5)


def test_main_py_trains_on_from_it_and_resuming_is_one_line(saved, tmp_path):
    _, root, _ = saved
    data = ["--dataset_type=synthetic", "--synthetic_cardinalities=300,50,7,30", "--synthetic_dataset_hotness=1,3,1,2",
            "--synthetic_num_numerical=3", "--optimizer=adagrad", "--batch_size=96", "--synthetic_rows=192",
            "--synthetic_eval_rows=96", f"--model={FILE}", *[f"--model_param={p}" for p in PARAMS["deepfm"]],
            f"--restore_checkpoint_path={root}"]
    out = python(*data, "--restore_mode=continue", f"--save_checkpoint_path={tmp_path / 'on'}")
    assert f"restored {root / 'ckpt-5'} at step 5" in out.stdout + out.stderr
    assert json.loads((tmp_path / "on" / "ckpt-7" / "manifest.json").read_text())["step"] == 7
    with pytest.raises(AssertionError, match=r"error: --restore_mode=resume: .*ckpt-5 records no data position"):
        python(*data, "--restore_mode=resume")


def test_a_fresh_build_restores_it_bit_for_bit_and_trains_on_as_the_saved_model(saved):
    model, root, path = saved
    keras.utils.set_random_seed(11)   # other initial weights, all overwritten
    fresh = built()
    manifest = fresh.restore_checkpoint(str(root))
    assert manifest["path"] == path and manifest["step"] == 5 and int(fresh.global_step.numpy()) == 5
    rng = np.random.default_rng(1)
    x, y = inputs(rng, B), tf.constant(rng.integers(0, 2, B), tf.float32)
    np.testing.assert_array_equal(fresh.inference(x).numpy(), model.inference(x).numpy())
    for _ in range(2):   # the optimizer state too: the next steps are the same
        assert fresh.train_on_batch(x, y) == model.train_on_batch(x, y)
    for a, b in zip(fresh.checkpoint_entries(), model.checkpoint_entries()):
        np.testing.assert_array_equal(a.variable.numpy(), b.variable.numpy(), err_msg=a.name)


def test_the_refusals_are_one_line(saved, tmp_path):
    model, root, _ = saved
    with pytest.raises(ConfigError, match="^save_checkpoint: model_file and features go together .* got model_file "
                                          "alone$"):
        model.save_checkpoint(str(tmp_path / "x"), FILE)
    bare = model.save_checkpoint(str(tmp_path / "bare"))   # restorable in process, not exportable
    result = deploy(f"--checkpoint={bare}", f"--output={tmp_path / 'repo'}", f"--model={FILE}")
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode == 2 and errors == [
        f"error: {bare}: saved without its model file (ranking.Model.save_checkpoint without model_file and features): "
        "nothing to rebuild the model from; save it with them to export it"], result.stderr[-2000:]
    wider = built(dict(HPARAMS, embedding_dim=8))
    before = [v.numpy() for v in wider.dense_variables]
    with pytest.raises(CheckpointError, match=r"tensor \S+ has shape \(\d+, 4\), the model expects \(\d+, 8\)"):
        wider.restore_checkpoint(str(root))
    for a, b in zip(before, wider.dense_variables):   # checked before anything changed
        np.testing.assert_array_equal(a, b.numpy())
