"""Your own ranking model: a Keras 3 API over the hybrid-parallel embeddings.

Shapes: `b` local batch (this rank's samples), `B = N b` over N ranks, feature f of width D_f.

    from ranking import FeatureConfig, HybridEmbedding, Model, TableConfig
    movies = TableConfig(name="movie", vocabulary_size=4000, embedding_dim=16, combiner="sum")
    features = {"movie": FeatureConfig(name="movie", table=movies, input_shape=(None,), output_shape=(None, 16)),
                "genres": FeatureConfig(name="genres", table=TableConfig(name="genre", vocabulary_size=20,
                                        embedding_dim=16), input_shape=(None, 10), output_shape=(None, 16))}
    ids = {"movie": keras.Input((), dtype="int32", name="movie"),
           "genres": keras.Input((None,), dtype="int32", ragged=True, name="genres")}
    emb = HybridEmbedding(features)(ids)                    # {"movie": [b, 16], "genres": [b, 16]}
    x = keras.layers.Concatenate()([emb["movie"], emb["genres"]])
    logit = keras.layers.Dense(1)(keras.layers.Dense(64, activation="relu")(x))     # [b, 1]
    model = Model(ids, logit)
    model.compile(optimizer="adagrad", learning_rate=0.01)
    model.fit(tf.data.Dataset.from_tensor_slices((ids_values, labels)).batch(b))    # labels [b]

Modules: config.py (`TableConfig`, `FeatureConfig` in keras-rs' field names; `planner_tables`;
a table with `dynamic=DynamicOptions(capacity, ...)` takes raw int64 ids),
embedding.py (`HybridEmbedding`: a Keras layer over parallel_embedding.DistributedEmbedding;
`TableStorage`: tables on disk; `Embedding`: distributed-embeddings' layer with a combiner),
features.py (`Features`: the dataset's features as `main.py --model=FILE`'s builder gets them),
sequences.py (sequence features' ids: the most recent L kept, `SequenceMask`),
nn/layers.py (building blocks: `MLP`, `DotInteraction`, `CrossNetwork`, `FactorizationMachine`,
`TargetAttention`, `TransformerBlock`, `HSTUBlock`; the built-in DLRM / DCNv2 are made of them too),
model.py (`Model`: keras.Model whose fit runs the project's step: sparse row updates, one
grouped allreduce, non-finite stop; `save_checkpoint` / `restore_checkpoint`: its whole state,
main.py's and deploy.py's checkpoint when saved with its model file and features),
precision.py (the AMP dtype, float16 loss scaling, the gradients' non-finite sum),
dist_model_parallel.py (NVIDIA distributed-embeddings' `DistributedEmbedding`,
`DistributedGradientTape`, `broadcast_variables`: `from ranking import dist_model_parallel as dmp`),
keras_rs/ (keras-rs' `layers.DistributedEmbedding`, `TableConfig`, `FeatureConfig` for a plain
keras.Model: `from ranking import keras_rs`).
What works and what remains: docs/models.md.
"""
from parallel_embedding.planner import DynamicOptions
from ranking import dist_model_parallel
from ranking.config import FeatureConfig, TableConfig
from ranking.embedding import HybridEmbedding, TableStorage
from ranking.features import CategoricalFeature, Features, hyperparameters
from nn.layers import (MLP, CrossNetwork, DotInteraction, FactorizationMachine, HSTUBlock, TargetAttention,
                       TransformerBlock)
from ranking.model import Model
from ranking.sequences import SequenceMask

__all__ = ["CategoricalFeature", "CrossNetwork", "DotInteraction", "DynamicOptions", "FactorizationMachine",
           "FeatureConfig", "Features", "HSTUBlock", "HybridEmbedding", "MLP", "Model", "SequenceMask", "TableConfig",
           "TableStorage", "TargetAttention", "TransformerBlock", "dist_model_parallel", "hyperparameters"]
