"""Under --amp, evaluation and prediction compute the logits in float32: those of the float32
model with the same weights (the exported model), without bfloat16's quantised ties."""
import numpy as np
import tensorflow as tf

import run.loop as run_loop
from tests.support.builtin import builtin_trainer
from tests.support.configs import TINY, tiny_config

CARDS, B = [int(c) for c in TINY["synthetic_cardinalities"]], 256


def trainer(interaction, xla=False, **amp):
    """The run's trainer of tiny_config's built-in model of `interaction`: Adam at 0.01; `amp`:
    amp=True, compute_dtype=... (a float32 model without)."""
    return builtin_trainer(interaction=interaction, xla=xla, seed=3, learning_rate=0.01, warmup_steps=0,
                           decay_steps=0, **amp)


def batch(seed):
    rng = np.random.default_rng(seed)
    return (tf.constant(rng.normal(size=(B, 3)), tf.float32), [tf.constant(rng.integers(0, c, B)) for c in CARDS],
            tf.constant(rng.integers(0, 2, B), tf.float32))


def test_amp_predictions_are_the_float32_forward():
    """Against the float32 model (Keras' float32 policy, called eagerly) given the AMP model's weights."""
    for interaction in ("dot", "cross"):
        reference = trainer(interaction).model   # given each AMP model's weights in turn, every one
        for xla in (False, True):
            amp = trainer(interaction, xla, amp=True, compute_dtype=tf.bfloat16)
            assert amp.keras_model.get_layer("top_mlp").compute_dtype == "bfloat16"
            for step in range(3):   # trained in bfloat16: weights no float32 run would reach
                amp.train_step(*batch(step))
            for v, r in zip(amp.model.table_variables + amp.model.dense_variables,
                            reference.table_variables + reference.dense_variables, strict=True):
                r.assign(v)
            numerical, categorical, _ = batch(10)
            logits = amp.predict(numerical, categorical).numpy()
            assert logits.dtype == np.float32
            expected = reference.keras_model(reference.inputs(numerical, categorical), training=False)
            assert expected.dtype == tf.float32
            np.testing.assert_allclose(logits, tf.reshape(expected, [-1]).numpy(), rtol=1e-6, atol=1e-6,
                                       err_msg=f"{interaction} xla={xla}")
            assert len(np.unique(logits)) == B   # no ties, which the model's bfloat16 forward has
            assert len(np.unique(amp.keras_model(amp.model.inputs(numerical, categorical)).numpy())) < B


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
