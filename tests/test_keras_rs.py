"""ranking.keras_rs, keras-rs' front door: a script written as keras-rs' documentation shows it
(tests/support/keras_rs_script.py, its import changed) trains in a plain keras.Model as the same model in
plain Keras (keras.layers.Embedding tables, combined by hand) from the same weights; sparse ids
as ragged ones; Keras initializers; the differences that remain are one line each."""
import keras
import numpy as np
import pytest
import tensorflow as tf

from ranking import keras_rs
from tests.support import keras_rs_script as script
from utils.errors import ConfigError


class Reference(keras.Model):
    """The script's Ranker in plain Keras: the item table read by two features, the tag table summed."""

    def __init__(self):
        super().__init__()
        self.item = keras.layers.Embedding(script.ITEMS, script.EMBEDDING_DIM)
        self.tag = keras.layers.Embedding(script.TAGS, 4)
        self.item.build(None), self.tag.build(None)
        self.hidden = keras.layers.Dense(16, activation="relu")
        self.out = keras.layers.Dense(1)

    def call(self, inputs):
        ids = inputs["sparse"]
        tags = tf.gather(self.tag.embeddings, ids["tags"])   # ragged [b, None, 4]
        x = tf.concat([self.item(ids["item_id"]), self.item(ids["last_item_id"])[:, 0], tf.reduce_sum(tags, axis=1),
                       inputs["dense"]], axis=1)
        return self.out(self.hidden(x))


def test_a_keras_rs_script_trains_in_a_plain_keras_model_as_plain_keras_does():
    keras.utils.set_random_seed(11)
    model, ref = script.Ranker(), Reference()
    (x, _), = script.dataset(1).take(1)
    model(x), ref(x)
    tables = model.embedding_layer.get_embedding_tables()
    assert {k: v.shape for k, v in tables.items()} == {"item": (60, 8), "tag": (25, 4)}
    assert 0.03 < tables["tag"].std() < 0.05   # TruncatedNormal(stddev=0.05), not the project's uniform
    ref.item.embeddings.assign(tables["item"])
    ref.tag.embeddings.assign(tables["tag"])
    for mine, theirs in ((model.hidden, ref.hidden), (model.out, ref.out)):
        theirs.set_weights(mine.get_weights())
    # The tables are Keras weights with row gradients, in the model's trainable variables.
    assert sum(v.path.startswith("distributed_embedding/") for v in model.trainable_variables) == 2
    got, want = script.compile_and_fit(model), script.compile_and_fit(ref)
    np.testing.assert_allclose(got.history["loss"], want.history["loss"], atol=1e-6)
    auc = [next(v for k, v in h.history.items() if k.startswith("auc")) for h in (got, want)]   # auc, auc_1
    np.testing.assert_allclose(*auc, atol=1e-6)
    after = model.embedding_layer.get_embedding_tables()
    np.testing.assert_allclose(after["item"], ref.item.embeddings.numpy(), atol=1e-6)
    np.testing.assert_allclose(after["tag"], ref.tag.embeddings.numpy(), atol=1e-6)
    assert np.abs(after["item"] - tables["item"]).max() > 1e-3   # trained


def features(**table):
    t = keras_rs.layers.TableConfig(name="t", vocabulary_size=20, embedding_dim=4, **table)
    return {"a": keras_rs.layers.FeatureConfig(name="a", table=t, input_shape=(None, 3), output_shape=(None, 4))}


def test_sparse_ids_as_ragged_ones_and_seeded_initializers():
    layer = keras_rs.layers.DistributedEmbedding(features(combiner="mean"))
    ragged = tf.ragged.constant([[1, 2], [], [7, 7, 3]], dtype=tf.int64)
    np.testing.assert_array_equal(layer({"a": ragged.to_sparse()})["a"], layer({"a": ragged})["a"])
    init = keras.initializers.RandomNormal(stddev=0.2, seed=5)
    drawn = keras_rs.layers.DistributedEmbedding(features(initializer=init)).get_embedding_tables()["t"]
    np.testing.assert_array_equal(drawn, init((20, 4), "float32"))
    unseeded = [keras_rs.layers.DistributedEmbedding(features(initializer="glorot_uniform")).get_embedding_tables()["t"]
                for _ in range(2)]
    np.testing.assert_array_equal(*unseeded)   # seeded from the layer's seed: the same on every rank


def test_the_differences_are_one_line_each():
    with pytest.raises(ConfigError, match="^table 't': optimizer 'Adagrad': one optimizer, compile's, updates every "
                                          "table here"):
        features(optimizer=keras.optimizers.Adagrad(0.1))
    with pytest.raises(ConfigError, match="^table 't': optimizer 'adam': the model's optimizer \\(compile's\\) "
                                          "updates the tables here, as keras-rs' does off SparseCore"):
        keras_rs.layers.DistributedEmbedding(features(optimizer="adam"))
    with pytest.raises(ConfigError, match="table_stacking=\\[\\['t'\\]\\]: stacking tables is SparseCore's"):
        keras_rs.layers.DistributedEmbedding(features(), table_stacking=[["t"]])
    layer = keras_rs.layers.DistributedEmbedding(features())
    ids = tf.constant([[1, 2, 3]])
    with pytest.raises(ConfigError, match="weights: per-id weights are not supported here"):
        layer({"a": ids}, weights={"a": tf.ones([1, 3])})
    with pytest.raises(ConfigError, match="called on inputs of another structure than its feature_configs' "
                                          "\\({'a': 'a'}\\)"):
        layer({"b": ids})
    with pytest.raises(ConfigError, match="^table 't': placement must be one of auto, default_device, sparsecore"):
        features(placement="tpu")
