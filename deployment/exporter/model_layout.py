"""What the exporter reads of a trained model (`ExportedModel`): its serving layout
(repository_format.ServingLayout), its tables (where they are in its checkpoint, their shapes),
its lookups (per lookup: the categorical feature it reads, its table, its combiner) and the
dense part's builder. Two kinds of checkpoint: the built-in models' (dlrm.py, dcnv2.py: the
signature is an nn.model_config.ModelConfig's; lookup f = feature f = table f) and a model
file's (main.py --model=FILE: deployment/exporter/model_file.py builds FILE's model);
repository.exported_model reads either."""
import dataclasses
from typing import Callable, List, Optional, Tuple

from deployment.repository_format import TABLE_DTYPE, ServingLayout
from nn.model_config import ModelConfig

DYNAMIC_IDS = "ids"   # `<table tensor>/ids`: a dynamic table's ids (parallel_embedding/dynamic_table.py's IDS)


@dataclasses.dataclass(frozen=True)
class Table:
    """One embedding table: checkpoint tensor `tensor` [rows, dim]; `dynamic`: a dynamic table's
    (raw ids; its live rows only, their ids in `<tensor>/ids` [rows, 1] int64)."""
    tensor: str
    rows: int
    dim: int
    dynamic: bool = False


@dataclasses.dataclass(frozen=True)
class Lookup:
    """One lookup: categorical feature `feature`'s ids (its columns of categorical_features) in table
    `table`, a multi-hot sample's rows combined by `combiner` ("sum" or "mean")."""
    feature: int
    table: int
    combiner: str


@dataclasses.dataclass(frozen=True)
class ExportedModel:
    """A checkpoint's model as the exporter serves it: requests by `layout` (its embedding_dims per
    lookup), `tables`, `lookups` (embeddings [B, sum of the lookups' widths], in lookup order),
    `name` (the default model name), and `dense(verify)`: the dense part as a tf.Module with the
    checkpoint's weights (numerical [B, n], embeddings -> logits [B], or [B, H] for the layout's H
    `heads`; TensorFlow: called last), None for a built-in model (saved_models.Dense, built from
    the signature). `values`: the outputs (columns) trained as values (mean squared error), whose
    predictions are their outputs; every other one's is the sigmoid of its logit."""
    layout: ServingLayout
    tables: List[Table]
    lookups: List[Lookup]
    name: str
    dense: Optional[Callable[[bool], object]]
    values: Tuple[int, ...] = ()

    @property
    def per_feature(self) -> bool:
        """Lookup f is feature f in table f (the built-in models): tables.json and deltas say `feature`."""
        return all((x.feature, x.table) == (i, i) for i, x in enumerate(self.lookups)) and \
            len(self.tables) == len(self.lookups)

    @property
    def dynamic_tables(self) -> List[str]:
        """The tensors of its dynamic tables."""
        return [t.tensor for t in self.tables if t.dynamic]

    @property
    def table_bytes(self) -> int:
        """The bytes of the tables as served (float32)."""
        return sum(t.rows * t.dim for t in self.tables) * TABLE_DTYPE.itemsize


def with_dynamic_tables(model: ExportedModel, manifest: dict) -> ExportedModel:
    """`model` with the tables its checkpoint (manifest) holds as dynamic ones (a tensor
    `<tensor>/ids`) marked so, their rows the live rows saved."""
    tensors = manifest["tensors"]

    def table(t: Table) -> Table:
        if f"{t.tensor}/{DYNAMIC_IDS}" not in tensors:
            return t
        return dataclasses.replace(t, rows=int(tensors[f"{t.tensor}/{DYNAMIC_IDS}"]["shape"][0]), dynamic=True)
    return dataclasses.replace(model, tables=[table(t) for t in model.tables])


def is_model_file(signature: dict) -> bool:
    """Whether a checkpoint's signature is a model file's (run/user_model.py), not a built-in model's."""
    return "hparams" in signature


def same_model(a: dict, b: dict) -> bool:
    """Whether two checkpoint signatures are of one model (their optimizers aside)."""
    if is_model_file(a) or is_model_file(b):
        return {k: v for k, v in a.items() if k != "optimizer"} == {k: v for k, v in b.items() if k != "optimizer"}
    return ModelConfig.from_signature(a) == ModelConfig.from_signature(b)


def built_in_export(manifest: dict) -> ExportedModel:
    """The ExportedModel of a built-in model's checkpoint (its dense part: saved_models.Dense)."""
    config = ModelConfig.from_signature(manifest["signature"])
    layout = ServingLayout(config.cardinalities, [t.max_hotness for t in config.tables], config.embedding_dims,
                           config.num_numerical)
    tables = [Table(table_tensor(f), t.cardinality, t.dim) for f, t in enumerate(config.tables)]
    lookups = [Lookup(f, f, t.combiner) for f, t in enumerate(config.tables)]
    return ExportedModel(layout, tables, lookups, "dcnv2" if config.interaction == "cross" else "dlrm", None)


def table_tensor(feature: int) -> str:
    """Feature's table in a RankingModel checkpoint (its DistributedEmbedding's table_name)."""
    return f"embedding/table_{feature}"
