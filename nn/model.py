"""The built-in DLRM and DCNv2 (dlrm.py, dcnv2.py): the example model files `builtin_model_file`
names (ranking.Model's made of nn.layers' Keras layers), handed the tables of `model_tables`."""
import os
from typing import Optional, Tuple

from nn.interaction import DOT_KERNELS
from nn.model_config import ModelConfig
from parallel_embedding.collectives import SingleProcess
from parallel_embedding.layer import DistributedEmbedding
from parallel_embedding.planner import Plan, plan_tables

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
