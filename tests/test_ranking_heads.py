"""A ranking.Model with several heads (examples/two_label.py): a loss, a loss weight and a
metric per head, trained by fit on synthetic data whose second label is a threshold of a
numerical feature; each head's logged loss is its global-batch mean; main.py refuses a model
with several heads in one line; a head or a loss that does not fit is one line at compile.
(Two Gloo ranks against one process: tests/test_ranking_api.py, "two_label".)"""
import importlib.util

import keras
import numpy as np
import pytest
import tensorflow as tf

from dataloading.synthetic import SyntheticDataset
from ranking import CategoricalFeature, Features, FeatureConfig, HybridEmbedding, Model, TableConfig
from utils.errors import ConfigError

CARDS, B = [50, 30, 20], 128
HPARAMS = {"embedding_dim": 4, "hidden": [16], "head": [8]}


def two_label_model():
    spec = importlib.util.spec_from_file_location("two_label", "examples/two_label.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    keras.utils.set_random_seed(1)
    features = Features([CategoricalFeature(f"cat_{i}", c, None) for i, c in enumerate(CARDS)], 3)
    return module.build_model(features, HPARAMS)


def data(rows=2048):
    """(inputs by name, labels {"click": the data's, "rating": numerical 0 above 0})."""
    b = SyntheticDataset(CARDS, 3, 0.0, seed=3).batch("train", 0, rows)
    x = {"numerical": b["numerical"], **{f"cat_{i}": b["categorical"][i].astype(np.int64) for i in range(3)}}
    return x, {"click": b["labels"], "rating": (b["numerical"][:, 0] > 0).astype(np.float32)}


def compiled(model, **options):
    model.compile(optimizer="adam", learning_rate=0.01, loss_weights={"click": 1.0, "rating": 0.5},
                  metrics={head: [keras.metrics.AUC(from_logits=True, name="auc")] for head in ("click", "rating")},
                  **options)
    return model


def test_two_label_example_fits_a_loss_and_a_metric_per_head():
    x, y = data()
    model = compiled(two_label_model())
    history = model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(B), epochs=3, verbose=0).history
    assert set(history) == {"loss", "click_loss", "rating_loss", "click_auc", "rating_auc"}
    np.testing.assert_allclose(history["loss"], np.add(history["click_loss"], 0.5 * np.array(history["rating_loss"])),
                               rtol=1e-5)
    assert history["rating_auc"][-1] > 0.97 > history["rating_auc"][0]    # the threshold is learnt
    assert history["rating_loss"][-1] < 0.5 * history["rating_loss"][0]


def test_each_heads_loss_is_its_global_batch_mean():
    """One step's logged losses are those of the model before the step: binary cross-entropy
    per head on the batch, and their weighted sum."""
    x, y = data(B)
    model = compiled(two_label_model())
    before = model(x, training=True)
    bce = keras.losses.BinaryCrossentropy(from_logits=True)
    want = {h: float(bce(y[h][:, None], before[h])) for h in ("click", "rating")}
    logs = model.train_on_batch(x, y, return_dict=True)
    assert logs["click_loss"] == pytest.approx(want["click"], rel=1e-6)
    assert logs["rating_loss"] == pytest.approx(want["rating"], rel=1e-6)
    assert logs["loss"] == pytest.approx(want["click"] + 0.5 * want["rating"], rel=1e-6)


def test_xla_and_amp_carry_two_heads():
    x, y = data(B)
    plain = compiled(two_label_model()).train_on_batch(x, y, return_dict=True)
    xla = compiled(two_label_model(), jit_compile=True).train_on_batch(x, y, return_dict=True)
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        amp = two_label_model()
    finally:
        keras.mixed_precision.set_global_policy("float32")
    amp = compiled(amp).train_on_batch(x, y, return_dict=True)
    for name in ("loss", "click_loss", "rating_loss"):
        assert xla[name] == pytest.approx(plain[name], rel=1e-4)
        assert amp[name] == pytest.approx(plain[name], rel=2e-2)


def small_model(outputs):
    ids = keras.Input((), dtype="int32", name="f")
    table = TableConfig(name="t", vocabulary_size=10, embedding_dim=4)
    h = HybridEmbedding([FeatureConfig(name="f", table=table, input_shape=(None,), output_shape=(None, 4))])([ids])[0]
    return Model(ids, {name: keras.layers.Dense(units, name=f"{name}_out")(h) for name, units in outputs.items()}
                 if outputs else keras.layers.Dense(1, name="out")(h))


@pytest.mark.parametrize("outputs, options, message", [
    ({"click": 1, "rating": 2}, {}, r"compile: head 'rating' \(layer 'rating_out'\) gives shape \(None, 2\); a head "
                                    r"gives one logit per sample \(\[b\] or \[b, 1\]\)"),
    ({"click": 1, "rating": 1}, {"loss": {"click": "binary_crossentropy_from_logits"}},
     "compile: loss names heads click; model '.*' has the heads click, rating"),
    ({"click": 1, "rating": 1}, {"loss_weights": {"clicks": 1.0}},
     "compile: loss_weights names heads clicks; model '.*' has the heads click, rating"),
    (None, {"loss": {"click": "binary_crossentropy_from_logits"}},
     r"compile: loss is a dict by head \(click\); model '.*' gives one output"),
    (None, {"loss_weights": {"click": 1.0}},
     "compile: loss_weights applies to a model with several heads; model '.*' gives one output"),
])
def test_heads_that_do_not_fit_are_one_line_at_compile(outputs, options, message):
    with pytest.raises(ConfigError, match=f"^{message}$"):
        small_model(outputs).compile(**options)


def test_labels_not_by_head_are_one_line():
    model = small_model({"click": 1, "rating": 1})
    model.compile()
    with pytest.raises(ConfigError, match=r"^model '.*': its labels must be a dict by head \(click, rating\), "
                                          r"got one tensor$"):
        model.train_on_batch(tf.constant([1, 2]), tf.constant([0.0, 1.0]))
