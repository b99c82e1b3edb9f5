"""DLRM and DCNv2 ranking models."""
from typing import List, Sequence, Set

import tensorflow as tf

from nn.checkpoint import Entry, replicated_entries
from nn.interaction import CrossNetwork, DotInteraction, dot_interaction_width
from nn.mlp import MLP
from parallel_embedding.collectives import SingleProcess
from parallel_embedding.layer import DistributedEmbedding
from parallel_embedding.planner import Plan, plan_tables

# The dot interactions' kernels (see interaction_op): dot_custom is the custom op or an error, never the
# fallback; dot_tensorflow never uses the op.
DOT_KERNELS = {"dot": "auto", "dot_custom": "custom", "dot_tensorflow": "tf"}


class RankingModel(tf.Module):
    """numerical [b, n] float32 + categorical ids (F tensors, see DistributedEmbedding) -> logits [b].

    The tables are placed by `plan` over the ranks of `collectives` (default: one process, every
    table whole); the dense part is data-parallel (every rank computes its local batch b). DLRM (interaction "dot"): bottom MLP on the numericals, DotInteraction with the F
    embeddings, top MLP. DCNv2 (interaction "cross"): x0 = concat(bottom output, embeddings),
    cross network, top MLP. `compute_dtype` is float32, or bfloat16/float16 under AMP (tables
    and master weights stay float32). `combiners`: per table, "sum" (default) or "mean" of a
    multi-hot feature's rows. `zeros_initializer`: the tables start at zero.
    """

    def __init__(self, cardinalities: Sequence[int], embedding_dims: Sequence[int], num_numerical: int,
                 bottom_mlp_dims: Sequence[int], top_mlp_dims: Sequence[int], interaction: str = "dot",
                 num_cross_layers: int = 3, cross_layer_projection_dim: int = 512, seed: int = 0,
                 compute_dtype=tf.float32, plan: Plan = None, collectives=None, data_parallel_input: bool = False,
                 combiners: Sequence[str] = None, zeros_initializer: bool = False):
        super().__init__(name="ranking_model")
        self.compute_dtype = tf.as_dtype(compute_dtype)
        collectives = collectives or SingleProcess()
        plan = plan or plan_tables(cardinalities, embedding_dims, collectives.size)
        self.embeddings = DistributedEmbedding(plan, collectives, seed=(seed, 1000),
                                               data_parallel_input=data_parallel_input, combiners=combiners,
                                               zeros_initializer=zeros_initializer)
        self.bottom_mlp = MLP(num_numerical, bottom_mlp_dims, linear_output=False, seed=(seed, 0), name="bottom_mlp")
        if interaction in DOT_KERNELS:
            self.interaction = DotInteraction(len(cardinalities), bottom_mlp_dims[-1], kernel=DOT_KERNELS[interaction])
            top_in = dot_interaction_width(len(cardinalities), bottom_mlp_dims[-1])
        else:
            top_in = bottom_mlp_dims[-1] + sum(embedding_dims)
            self.interaction = CrossNetwork(top_in, num_cross_layers, cross_layer_projection_dim, seed=(seed, 200))
        self.top_mlp = MLP(top_in, top_mlp_dims, linear_output=True, seed=(seed, 100), name="top_mlp")

    @property
    def table_variables(self) -> List[tf.Variable]:
        """This rank's embedding variables (shards, then replicated tables; sparse updates)."""
        return self.embeddings.variables_in_order

    @property
    def dense_variables(self) -> List[tf.Variable]:
        """MLP and cross-network weights (data-parallel, dense updates)."""
        dense = self.bottom_mlp.kernels + self.bottom_mlp.biases + self.top_mlp.kernels + self.top_mlp.biases
        if isinstance(self.interaction, CrossNetwork):
            dense += [w for ws in self.interaction.weights for w in ws] + self.interaction.biases
        return dense

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

    def predict_from_embeddings(self, numerical: tf.Tensor, embeddings: List[tf.Tensor],
                                training: bool = False, compute_dtype=None) -> tf.Tensor:
        """The dense part: numerical [b, n] and looked-up embeddings (F x [b, D_f]) -> logits [b].
        `training` selects the kernels tuned for the train step (see DotInteraction);
        `compute_dtype` overrides the model's (evaluation computes in float32)."""
        dt = compute_dtype or self.compute_dtype
        embeddings = [tf.cast(e, dt) for e in embeddings]
        bottom = self.bottom_mlp(tf.cast(numerical, dt))
        if isinstance(self.interaction, DotInteraction):
            x = self.interaction(bottom, embeddings, training)
        else:
            x = self.interaction(tf.concat([bottom] + embeddings, axis=1))
        return tf.cast(tf.squeeze(self.top_mlp(x), axis=1), tf.float32)
