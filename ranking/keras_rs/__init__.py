"""keras-rs' front door: a script written for keras-rs' `DistributedEmbedding` runs with only its
import changed, on one process (CPU or GPU):

    from ranking import keras_rs                         # was: import keras_rs
    item = keras_rs.layers.TableConfig(name="item", vocabulary_size=1000, embedding_dim=16, placement="sparsecore")
    feature_configs = {"item_id": keras_rs.layers.FeatureConfig(name="item", table=item, input_shape=(B,),
                                                                output_shape=(B, 16))}
    embedding = keras_rs.layers.DistributedEmbedding(feature_configs)
    rows = embedding({"item_id": ids})                    # {"item_id": [b, 16]}: feature_configs' structure
    model = keras.Model(inputs, logits)                   # a plain Keras model around it
    model.compile(optimizer="adam", loss=...)
    model.fit(dataset)                                    # the tables train with the model's optimizer

`layers`: `TableConfig`, `FeatureConfig` (ranking.config's, in keras-rs' field names) and
`DistributedEmbedding`. What differs from keras-rs: docs/models.md.
"""
from ranking.keras_rs import layers

__all__ = ["layers"]
