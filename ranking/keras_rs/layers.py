"""keras-rs' `keras_rs.layers`: `TableConfig`, `FeatureConfig` and `DistributedEmbedding`.

Shapes: `b` the batch, feature f of its table's width D_f (a sequence feature: L ids a sample).
"""
from typing import Dict

import keras
import numpy as np
import tensorflow as tf

from ranking.config import FeatureConfig, TableConfig
from ranking.dist_model_parallel import default_collectives
from ranking.embedding import WeightTables
from utils.errors import ConfigError

__all__ = ["DistributedEmbedding", "FeatureConfig", "TableConfig"]


class DistributedEmbedding(WeightTables):
    """keras-rs' `DistributedEmbedding(feature_configs, *, table_stacking="auto", **kwargs)`.

    `feature_configs`: a FeatureConfig or a nested structure of them (dicts, lists, tuples; a
    key need not be its feature's name). Called on ids in the same structure, each [b], [b, 1],
    a dense [b, k] (every id read), a tf.RaggedTensor [b, None] or a tf.SparseTensor [b, k], it
    gives [b, D_f] per feature ([b, L, D_f] for a sequence feature) in that structure.

    The tables are Keras weights updated by the model's optimizer (compile's), as keras-rs' own
    tables are off SparseCore ("default_device", which "auto" picks there): a plain
    `keras.Model` trains them with `compile` and `fit`, or a GradientTape loop of the user's
    with its optimizer. Every placement is the planner's (one process: every table whole).
    `table_stacking` ("auto" or None) is SparseCore's and changes nothing here; a table's own
    optimizer, per-id `weights`, a list of stacked tables and more than one process are one
    line each (at N ranks: ranking.HybridEmbedding in a ranking.Model, or
    ranking.dist_model_parallel, average the dense gradients over the ranks)."""

    def __init__(self, feature_configs, *, table_stacking="auto", seed=(0, 1000), name="distributed_embedding",
                 **kwargs):
        comm = default_collectives()
        if comm.size > 1:
            raise ConfigError(f"keras_rs DistributedEmbedding: {comm.size} ranks: a plain keras.Model's fit does not "
                              f"average the dense gradients over them; at N ranks use ranking.HybridEmbedding in a "
                              f"ranking.Model, or ranking.dist_model_parallel with its DistributedGradientTape")
        if table_stacking not in ("auto", None):
            raise ConfigError(f"keras_rs DistributedEmbedding: table_stacking={table_stacking!r}: stacking tables is "
                              f"SparseCore's; here each table is looked up on its own (give 'auto' or None)")
        self._structure = lambda: feature_configs   # kept as given (Keras would wrap a dict attribute)
        features = keras.tree.flatten(feature_configs)
        for f in features:
            if not isinstance(f, FeatureConfig):
                raise ConfigError(f"keras_rs DistributedEmbedding: feature_configs holds a {type(f).__name__}, "
                                  f"not a keras_rs.layers.FeatureConfig")
            if f.table.optimizer is not None:
                raise ConfigError(f"table {f.table.name!r}: optimizer {f.table.optimizer!r}: the model's optimizer "
                                  f"(compile's) updates the tables here, as keras-rs' does off SparseCore; leave the "
                                  f"table's optimizer None")
        super().__init__(features, collectives=comm, seed=seed, name=name, **kwargs)

    def call(self, inputs, weights=None, training=False):
        if weights is not None:
            raise ConfigError(f"layer {self.name!r}: weights: per-id weights are not supported here (ragged or "
                              f"sparse ids need none)")
        ids = [tf.RaggedTensor.from_sparse(x) if isinstance(x, tf.SparseTensor) else x
               for x in self._flat(inputs)]
        return keras.tree.pack_sequence_as(self._structure(), super().call(ids, training))

    def compute_output_spec(self, inputs, weights=None, training=False):
        return keras.tree.pack_sequence_as(self._structure(), super().compute_output_spec(self._flat(inputs)))

    def _flat(self, inputs) -> list:
        try:
            keras.tree.assert_same_structure(inputs, self._structure())
        except (ValueError, TypeError):
            raise ConfigError(f"layer {self.name!r}: called on inputs of another structure than its "
                              f"feature_configs' ({keras.tree.map_structure(lambda f: f.name, self._structure())})"
                              ) from None
        return keras.tree.flatten(inputs)

    def get_embedding_tables(self) -> Dict[str, np.ndarray]:
        """The tables by their TableConfig's name, whole ([vocabulary_size, embedding_dim] float32)."""
        return {t.name: w for t, w in zip(self.tables, self.whole_tables())}
