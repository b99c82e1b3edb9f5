"""Keras' evaluate and predict of a ranking.Model (ranking/model.py): predict gives `inference`'s
float32 outputs; evaluate gives the loss and the exact AUC over every sample (one per head, as
fit names them), checked against an independent NumPy reference (the AUC by comparing every
positive with every negative, ties one half), against main.py's evaluation (nn.evaluator) and
under XLA; fit's validation runs it. (N Gloo ranks: tests/support/ranking_multirank_worker.py, run by
tests/test_ranking_api.py, checks every rank's figures against one process.)"""
import keras
import numpy as np
import pytest
import tensorflow as tf

from nn import evaluator
from parallel_embedding.collectives import SingleProcess
from tests.test_ranking_heads import compiled, data, two_label_model
from tests.support.api_dlrm import api_dlrm, dlrm_batches
from tests.support.api_steps import api_steps
from utils.errors import ConfigError
from tests.support.references import pairwise_auc


def cross_entropy(labels, logits) -> float:
    y, z = np.asarray(labels, np.float64).ravel(), np.asarray(logits, np.float64).ravel()
    return float(np.mean(np.logaddexp(0.0, z) - y * z))


def test_pairwise_auc_reference():
    assert pairwise_auc([1, 0, 1, 0], [0.9, 0.1, 0.5, 0.5]) == 0.875   # (1 + 1 + 1 + 0.5) / 4
    assert pairwise_auc([0, 1], [0.7, 0.2]) == 0.0


def trained_dlrm(**compile_options):
    model = api_dlrm()
    model.compile(optimizer="adam", learning_rate=0.1, **compile_options)
    api_steps(model, dlrm_batches()[:2])
    return model


def eval_data(repeat: int = 2):
    """The test batches' samples, each `repeat` times (equal inputs: tied scores) with its label
    flipped in every other copy: (x: numerical then ids per feature, labels [n])."""
    data = dlrm_batches()[2:]
    numerical = tf.concat([n for n, _, _ in data] * repeat, 0)
    ids = [tf.concat([ids[f] for _, ids, _ in data] * repeat, 0) for f in range(len(data[0][1]))]
    labels = np.concatenate([np.asarray(y) if r % 2 == 0 else 1 - np.asarray(y) for r in range(repeat)
                             for _, _, y in data])
    return (numerical,) + tuple(ids), tf.constant(labels, tf.float32)


def dataset(x, y, batch=24):   # the last batch smaller
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)


def predicted(model, x, y) -> np.ndarray:
    """predict's logits [n] on `dataset`'s batches, checked against the model's own forward
    (eager: equal within float32 rounding)."""
    logits = model.predict(dataset(x, y), verbose=0).ravel()
    np.testing.assert_allclose(logits, model(x, training=False).numpy().ravel(), rtol=1e-6, atol=1e-6)
    return logits


def test_evaluate_gives_the_loss_and_exact_auc_over_every_sample():
    model = trained_dlrm(metrics=[keras.metrics.BinaryAccuracy(threshold=0.0, name="accuracy")])
    x, y = eval_data()
    logits = predicted(model, x, y)
    assert len(np.unique(logits)) < len(logits)   # ties
    figures = model.evaluate(dataset(x, y), verbose=0, return_dict=True)
    assert set(figures) == {"loss", "auc", "accuracy"}
    assert figures["auc"] == pytest.approx(pairwise_auc(y, logits), abs=1e-12)
    assert figures["loss"] == pytest.approx(cross_entropy(y, logits), rel=1e-6)
    assert figures["accuracy"] == pytest.approx(np.mean((logits > 0) == (y.numpy() > 0.5)), abs=1e-7)
    assert model.evaluate(dataset(x, y), verbose=0) == [figures["loss"], figures["accuracy"], figures["auc"]]


def test_evaluate_gives_main_pys_auc():
    """main.py --model's evaluation (nn.evaluator.evaluate over the model's inference) gives the same AUC."""
    model = trained_dlrm()
    x, y = eval_data()
    batches = [(x[0][i:i + 24], [c[i:i + 24] for c in x[1:]], y[i:i + 24], None, len(y[i:i + 24]))
               for i in range(0, len(y), 24)]
    main = evaluator.evaluate(lambda n, c: tf.reshape(model.inference([n] + c), [-1]), batches, SingleProcess())
    figures = model.evaluate(dataset(x, y), verbose=0, return_dict=True)
    assert figures["auc"] == main["auc"]
    assert figures["loss"] == pytest.approx(main["logloss"], rel=1e-6)


def test_a_compiled_auc_gives_way_to_the_exact_one_and_fit_validates_with_it():
    model = trained_dlrm(metrics=[keras.metrics.AUC(num_thresholds=3, from_logits=True, name="auc")])
    x, y = eval_data()
    history = model.fit(dataset(x, y), validation_data=dataset(x, y), epochs=1, verbose=0).history
    logits = predicted(model, x, y)
    assert history["val_auc"][0] == pytest.approx(pairwise_auc(y, logits), abs=1e-12)
    assert history["val_loss"][0] == pytest.approx(cross_entropy(y, logits), rel=1e-6)


def test_xla_evaluates_as_without():
    plain, xla = trained_dlrm(), trained_dlrm(jit_compile=True)
    for a, b in zip(plain.weights + plain.get_layer("hybrid_embedding").table_variables,
                    xla.weights + xla.get_layer("hybrid_embedding").table_variables):
        b.assign(a)
    x, y = eval_data()
    want = plain.evaluate(dataset(x, y), verbose=0, return_dict=True)
    got = xla.evaluate(dataset(x, y), verbose=0, return_dict=True)
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
    assert got["auc"] == pytest.approx(want["auc"], abs=1e-3)
    np.testing.assert_allclose(xla.predict(dataset(x, y), verbose=0), plain.predict(dataset(x, y), verbose=0),
                               rtol=1e-5, atol=1e-6)


def test_evaluate_gives_a_loss_and_an_auc_per_head():
    model = compiled(two_label_model())
    x, y = data(300)
    figures = model.evaluate(tf.data.Dataset.from_tensor_slices((x, y)).batch(128), verbose=0, return_dict=True)
    assert set(figures) == {"loss", "click_loss", "rating_loss", "click_auc", "rating_auc"}
    out = model.predict(tf.data.Dataset.from_tensor_slices(x).batch(128), verbose=0)
    want = model(x, training=False)
    for head in ("click", "rating"):
        assert figures[f"{head}_auc"] == pytest.approx(pairwise_auc(y[head], out[head]), abs=1e-12)
        assert figures[f"{head}_loss"] == pytest.approx(cross_entropy(y[head], out[head]), rel=1e-6)
    assert figures["loss"] == pytest.approx(figures["click_loss"] + 0.5 * figures["rating_loss"], rel=1e-6)
    for head in ("click", "rating"):
        np.testing.assert_allclose(out[head], want[head].numpy(), rtol=1e-6, atol=1e-6)
    with pytest.raises(ConfigError, match=r"^evaluate: model 'two_label' takes labels as a dict by head "
                                          r"\(click, rating\)$"):
        model.evaluate(tf.data.Dataset.from_tensor_slices((x, y["click"])).batch(128), verbose=0)


def test_sample_weight_is_refused():
    model = trained_dlrm()
    x, y = eval_data()
    with pytest.raises(ConfigError, match=r"^evaluate: model '.*' weighs every sample alike; sample_weight is not "
                                          r"supported$"):
        model.evaluate(x, y, sample_weight=np.ones(len(y)), verbose=0)
