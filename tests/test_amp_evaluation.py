"""Under --amp, evaluation and prediction compute the logits in float32: those of the float32
model with the same weights (the exported model), without bfloat16's quantised ties."""
import numpy as np
import tensorflow as tf

import run.loop as run_loop
from nn.lr_schedule import LearningRateSchedule
from nn.model import RankingModel
from nn.model_config import ModelConfig, table_configs
from nn.trainer import Trainer
from tests.configs import tiny_config

CARDS, B = [20, 50, 7, 30], 256


def model(compute_dtype, interaction):
    config = ModelConfig(tables=table_configs(cardinalities=CARDS, dims=[8] * 4), num_numerical=3,
                         bottom_mlp_dims=(16, 8), top_mlp_dims=(16, 1), interaction=interaction, num_cross_layers=2,
                         cross_layer_projection_dim=4)
    return RankingModel(config, seed=3, compute_dtype=compute_dtype)


def batch(seed):
    rng = np.random.default_rng(seed)
    return (tf.constant(rng.normal(size=(B, 3)), tf.float32), [tf.constant(rng.integers(0, c, B)) for c in CARDS],
            tf.constant(rng.integers(0, 2, B), tf.float32))


def test_amp_predictions_are_the_float32_forward():
    for interaction in ("dot", "cross"):
        for xla in (False, True):
            amp = Trainer(model(tf.bfloat16, interaction), "adam", LearningRateSchedule(0.01, 0, 0, 0), xla=xla)
            for step in range(3):   # trained in bfloat16: weights no float32 run would reach
                amp.train_step(*batch(step))
            reference = model(tf.float32, interaction)
            for v, r in zip(amp.model.table_variables + amp.model.dense_variables,
                            reference.table_variables + reference.dense_variables):
                r.assign(v)
            numerical, categorical, _ = batch(10)
            logits = amp.predict(numerical, categorical).numpy()
            assert logits.dtype == np.float32
            np.testing.assert_allclose(logits, reference(numerical, categorical).numpy(), rtol=1e-6, atol=1e-6,
                                       err_msg=f"{interaction} xla={xla}")
            assert len(np.unique(logits)) == B   # no ties (bfloat16 logits had many)


def test_amp_run_evaluates_like_its_checkpoint_in_float32(tmp_path):
    root = str(tmp_path / "ck")
    trained = run_loop.run(tiny_config(amp=True, save_checkpoint_path=root))
    evaluated = run_loop.run(tiny_config(mode="eval", restore_checkpoint_path=root))   # float32
    assert (trained["auc"], trained["logloss"]) == (evaluated["auc"], evaluated["logloss"])


def test_float16_checkpoint_restores_without_amp_and_back(tmp_path, monkeypatch):
    """A float16 AMP run (a GPU's; faked here by its compute dtype) checkpoints its loss scale:
    evaluating or resuming it without --amp leaves the scale unread, and an AMP run resumes a
    checkpoint without one from the initial scale."""
    import ranking.precision
    from storage import checkpoint
    fp16, plain = str(tmp_path / "fp16"), str(tmp_path / "plain")
    monkeypatch.setattr(ranking.precision, "amp_dtype", lambda: tf.float16)
    trained = run_loop.run(tiny_config(amp=True, save_checkpoint_path=fp16, max_steps=10))
    assert set(ranking.precision.LOSS_SCALE_STATE) <= set(checkpoint.read_manifest(fp16)["tensors"])
    run_loop.run(tiny_config(save_checkpoint_path=plain, max_steps=10))
    assert run_loop.run(tiny_config(amp=True, restore_checkpoint_path=plain, max_steps=20))["steps"] == 20
    monkeypatch.undo()
    evaluated = run_loop.run(tiny_config(mode="eval", restore_checkpoint_path=fp16))
    assert (evaluated["auc"], evaluated["logloss"]) == (trained["auc"], trained["logloss"])
    assert run_loop.run(tiny_config(restore_checkpoint_path=fp16, max_steps=20))["steps"] == 20
