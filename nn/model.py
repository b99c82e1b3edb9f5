"""The built-in DLRM and DCNv2 (dlrm.py, dcnv2.py): the example model files `builtin_model_file`
names (ranking.Model's made of nn.layers' Keras layers), handed the tables of `model_tables`."""
import os
from typing import List, Optional, Set, Tuple

import tensorflow as tf

from storage.checkpoint import Entry, replicated_entries
from nn.interaction import DOT_KERNELS, FLAG_SETTINGS
from nn.layers import MLP, CrossNetwork, DotInteraction
from nn.model_config import ModelConfig
from parallel_embedding.collectives import SingleProcess
from parallel_embedding.layer import DistributedEmbedding
from parallel_embedding.planner import Plan, plan_tables


class DenseArch(tf.Module):
    """The dense part of the model `config` describes: numerical [b, n] and the F looked-up
    embeddings ([b, D_f]) -> logits [b] float32, through nn.layers' MLP "bottom_mlp", the
    interaction (DotInteraction "interaction", its kernel from config.interaction; or
    CrossNetwork "cross" on concat(bottom output, embeddings)) and MLP "top_mlp" (linear
    output): data-parallel weights, float32, named by Keras path as in checkpoints
    ("bottom_mlp/dense_0/kernel", "cross/layer_0/U"). The layers are built here, with
    `autocast=False`: they compute in the dtype the call chooses."""

    def __init__(self, config: ModelConfig, seed: int = 0):
        super().__init__(name="dense_arch")
        self.bottom_mlp = MLP(config.bottom_mlp_dims, linear_output=False, seed=(seed, 0), name="bottom_mlp",
                              autocast=False)
        self.bottom_mlp.build((None, config.num_numerical))
        vectors = [(None, config.bottom_mlp_dims[-1])] + [(None, d) for d in config.embedding_dims]
        if config.interaction == "cross":
            self.interaction = CrossNetwork(config.num_cross_layers, config.cross_layer_projection_dim,
                                            seed=(seed, 200), name="cross", autocast=False)
        else:
            self.interaction = DotInteraction(DOT_KERNELS[config.interaction], settings=FLAG_SETTINGS,
                                              name="interaction", autocast=False)
        self.interaction.build(vectors)
        self.top_mlp = MLP(config.top_mlp_dims, linear_output=True, seed=(seed, 100), name="top_mlp", autocast=False)
        self.top_mlp.build((None, self.interaction.compute_output_shape(vectors)[-1]))

    @property
    def dense_variables(self) -> List[tf.Variable]:
        """The weights' tf.Variables (named by their Keras paths): the MLPs' kernels, then their
        biases; the cross network's matrices, then its biases."""
        weights = self.bottom_mlp.kernels + self.bottom_mlp.biases + self.top_mlp.kernels + self.top_mlp.biases
        if isinstance(self.interaction, CrossNetwork):
            weights += [m for ms in self.interaction.matrices for m in ms] + self.interaction.biases
        return [w.value for w in weights]

    def __call__(self, numerical: tf.Tensor, embeddings: List[tf.Tensor], training: bool = False,
                 compute_dtype=tf.float32) -> tf.Tensor:
        """Computes in `compute_dtype`; `training` (and whether the caller compiles this with XLA)
        chooses the dot interaction's implementation (see nn.layers.DotInteraction)."""
        embeddings = [tf.cast(e, compute_dtype) for e in embeddings]
        bottom = self.bottom_mlp(tf.cast(numerical, compute_dtype))
        x = self.interaction([bottom] + embeddings, training=training)
        return tf.cast(tf.squeeze(self.top_mlp(x), axis=1), tf.float32)


# The built-in models' files: DLRM and DCNv2 written with the ranking/ API.
EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def builtin_model_file(config: ModelConfig) -> Tuple[str, dict]:
    """The model file of the built-in model `config` describes and its hyper-parameters:
    examples/dcnv2.py (interaction "cross") or examples/dlrm.py (a dot interaction, its kernel
    the interaction's: DOT_KERNELS), sized by the config's embedding widths, bottom MLP, top MLP
    (less its last entry, the logit), cross layers and multi-hot combiner."""
    multi_hot = [t.combiner for t in config.tables if t.max_hotness]
    common = dict(bottom=list(config.bottom_mlp_dims), top=list(config.top_mlp_dims[:-1]),
                  combiner=multi_hot[0] if multi_hot else "sum")
    if config.interaction == "cross":
        return os.path.join(EXAMPLES, "dcnv2.py"), dict(common, embedding_dims=list(config.embedding_dims),
                                                        num_cross_layers=config.num_cross_layers,
                                                        projection_dim=config.cross_layer_projection_dim)
    return os.path.join(EXAMPLES, "dlrm.py"), dict(common, embedding_dim=config.embedding_dims[0],
                                                   kernel=DOT_KERNELS[config.interaction])


def model_tables(config: ModelConfig, plan: Optional[Plan] = None, collectives=None, *, seed: int = 0,
                 **options) -> DistributedEmbedding:
    """The tables of the model `config` describes, as the DistributedEmbedding the built-in model's
    HybridEmbedding is handed: placed by `plan` (default: every table whole) over the ranks of
    `collectives` (default: one process), seeded (seed, 1000) as the built-in models' tables with
    --seed=seed, combined by the config's combiners. `options`: DistributedEmbedding's
    (data_parallel_input, zeros_initializer, store_path, cache_policy)."""
    collectives = collectives or SingleProcess()
    plan = plan or plan_tables(config.cardinalities, config.embedding_dims, collectives.size)
    return DistributedEmbedding(plan, collectives, seed=(seed, 1000), combiners=config.combiners, **options)


class RankingModel(tf.Module):
    """numerical [b, n] float32 + categorical ids (F tensors, see DistributedEmbedding) -> logits [b].

    The model `config` describes over `embeddings`, its tables as the caller built them
    (`model_tables`: placement and tiers decided by the caller's one planner call; default: one
    process, every table whole); the dense part (DenseArch) is data-parallel (every rank computes
    its local batch b). DLRM (interaction "dot"): bottom MLP on the numericals, DotInteraction
    with the F embeddings, top MLP. DCNv2 (interaction "cross"): cross network on concat(bottom
    output, embeddings), top MLP. `compute_dtype` is float32, or bfloat16/float16 under AMP
    (tables and master weights stay float32). Tables that are not config's: ValueError.
    """

    def __init__(self, config: ModelConfig, embeddings: Optional[DistributedEmbedding] = None, *, seed: int = 0,
                 compute_dtype=tf.float32):
        super().__init__(name="ranking_model")
        self.compute_dtype = tf.as_dtype(compute_dtype)
        self.embeddings = embeddings or model_tables(config, seed=seed)
        # a dynamic table's rows are its capacity, not the data's cardinality
        shapes = [(c if t.dynamic else t.rows, t.dim)
                  for t, c in zip(self.embeddings.plan.tables, config.cardinalities)]
        if len(shapes) != len(config.cardinalities) or shapes != list(zip(config.cardinalities, config.embedding_dims)):
            raise ValueError(f"the embedding's tables (rows, dim) {shapes} are not the model's "
                             f"{list(zip(config.cardinalities, config.embedding_dims))}")
        self.dense = DenseArch(config, seed)

    @property
    def table_variables(self) -> List[tf.Variable]:
        """This rank's embedding variables (shards, then replicated tables; sparse updates)."""
        return self.embeddings.variables_in_order

    @property
    def dense_variables(self) -> List[tf.Variable]:
        """MLP and cross-network weights (data-parallel, dense updates)."""
        return self.dense.dense_variables

    @property
    def interaction(self):
        """The interaction's computation: nn.interaction.DotInteraction (its `_op`: the custom op or
        None), or the CrossNetwork layer."""
        layer = self.dense.interaction
        return layer.engine if isinstance(layer, DotInteraction) else layer

    def checkpoint_entries(self) -> List[Entry]:
        """The model's weights as checkpoint entries: the tables' (DistributedEmbedding), then the
        dense variables (replicated)."""
        dense = replicated_entries({v.name.split(":")[0]: v for v in self.dense_variables})
        return self.embeddings.checkpoint_entries(weights_only=True) + dense

    def checkpoint_names(self) -> Set[str]:
        """The logical tensors of the model's weights in a checkpoint (on any rank)."""
        return self.embeddings.checkpoint_names(weights_only=True) | {e.name for e in self.checkpoint_entries()}

    def __call__(self, numerical: tf.Tensor, categorical: List[tf.Tensor], training: bool = False) -> tf.Tensor:
        embeddings = self.embeddings(categorical, tf.shape(numerical)[0], training)
        return self.predict_from_embeddings(numerical, embeddings, training)

    def predict_from_embeddings(self, numerical: tf.Tensor, embeddings: List[tf.Tensor], training: bool = False,
                                compute_dtype=None) -> tf.Tensor:
        """The dense part: numerical [b, n] and looked-up embeddings (F x [b, D_f]) -> logits [b].
        `training` (and whether the caller compiles this with XLA) choose the interaction's
        implementation (see nn.layers.DotInteraction); `compute_dtype` overrides the model's
        (evaluation computes in float32)."""
        return self.dense(numerical, embeddings, training, compute_dtype or self.compute_dtype)
