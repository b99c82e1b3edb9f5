"""A training script written the way keras-rs' documentation uses `keras_rs.layers`
(TableConfig, FeatureConfig, DistributedEmbedding in a plain keras.Model, compile and fit), with
only its import changed: `from ranking import keras_rs` for `import keras_rs`. Its feature dict's
keys are not the features' names, one table is read by two features, and it mixes placements,
combiners and a Keras initializer."""
import keras
import numpy as np
import tensorflow as tf

from ranking import keras_rs

GLOBAL_BATCH_SIZE = 32
ITEMS, TAGS, EMBEDDING_DIM = 60, 25, 8


def feature_configs():
    item_table = keras_rs.layers.TableConfig(
        name="item", vocabulary_size=ITEMS, embedding_dim=EMBEDDING_DIM, placement="sparsecore")
    tag_table = keras_rs.layers.TableConfig(
        name="tag", vocabulary_size=TAGS, embedding_dim=4, combiner="sum", placement="auto",
        initializer=keras.initializers.TruncatedNormal(stddev=0.05))
    return {
        "item_id": keras_rs.layers.FeatureConfig(
            name="item", table=item_table, input_shape=(GLOBAL_BATCH_SIZE,),
            output_shape=(GLOBAL_BATCH_SIZE, EMBEDDING_DIM)),
        "last_item_id": keras_rs.layers.FeatureConfig(
            name="last_item", table=item_table, input_shape=(GLOBAL_BATCH_SIZE, 1),
            output_shape=(GLOBAL_BATCH_SIZE, EMBEDDING_DIM)),
        "tags": keras_rs.layers.FeatureConfig(
            name="tags", table=tag_table, input_shape=(GLOBAL_BATCH_SIZE, 5), output_shape=(GLOBAL_BATCH_SIZE, 4)),
    }


class Ranker(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.embedding_layer = keras_rs.layers.DistributedEmbedding(feature_configs())
        self.hidden = keras.layers.Dense(16, activation="relu", name="hidden")
        self.out = keras.layers.Dense(1, name="out")

    def call(self, inputs):
        rows = self.embedding_layer(inputs["sparse"])
        x = keras.ops.concatenate([rows["item_id"], rows["last_item_id"], rows["tags"], inputs["dense"]], axis=1)
        return self.out(self.hidden(x))


def dataset(steps: int, seed: int = 3) -> tf.data.Dataset:
    rng = np.random.default_rng(seed)
    n = steps * GLOBAL_BATCH_SIZE
    item = rng.integers(0, ITEMS, n).astype(np.int32)
    last = rng.integers(0, ITEMS, (n, 1)).astype(np.int32)
    tags = tf.ragged.constant([rng.integers(0, TAGS, rng.integers(0, 6)).tolist() for _ in range(n)], dtype=tf.int32,
                              row_splits_dtype=tf.int64)
    dense = rng.normal(size=(n, 3)).astype(np.float32)
    labels = ((item % 3 == 0) ^ (dense[:, 0] > 0.5)).astype(np.float32)
    x = {"sparse": {"item_id": item, "last_item_id": last, "tags": tags}, "dense": dense}
    return tf.data.Dataset.from_tensor_slices((x, labels)).batch(GLOBAL_BATCH_SIZE, drop_remainder=True)


def compile_and_fit(model: keras.Model, steps: int = 6, epochs: int = 2):
    model.compile(optimizer=keras.optimizers.Adam(learning_rate=0.01),
                  loss=keras.losses.BinaryCrossentropy(from_logits=True),
                  metrics=[keras.metrics.AUC(from_logits=True)])
    return model.fit(dataset(steps), epochs=epochs, verbose=0)
