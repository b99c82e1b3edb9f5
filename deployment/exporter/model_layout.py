"""What the exporter reads of a trained model's config: its serving layout
(repository_format.ServingLayout) and where its tables are in its checkpoint."""
from deployment.repository_format import ServingLayout
from nn.model_config import ModelConfig


def serving_layout(model: ModelConfig) -> ServingLayout:
    """The layout of the requests that the model's export serves."""
    return ServingLayout(model.cardinalities, [t.max_hotness for t in model.tables], model.embedding_dims,
                         model.num_numerical)


def table_tensor(feature: int) -> str:
    """Feature's table in a RankingModel checkpoint (its DistributedEmbedding's table_name)."""
    return f"embedding/table_{feature}"
