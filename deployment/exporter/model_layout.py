"""What the exporter reads of a trained model (`ExportedModel`): its serving layout
(repository_format.ServingLayout), its tables (where they are in its checkpoint, their shapes),
its lookups (per lookup: the categorical feature it reads, its table, its combiner) and the
dense part's builder. Two kinds of checkpoint: the built-in models' (dlrm.py, dcnv2.py: the
signature is an nn.model_config.ModelConfig's; lookup f = feature f = table f) and a model
file's (main.py --model=FILE: deployment/exporter/model_file.py builds FILE's model);
repository.exported_model reads either."""
import dataclasses
from typing import Callable, Iterator, List, Optional, Tuple

import numpy as np

from deployment.repository_format import TABLE_DTYPE, ServingLayout
from nn.model_config import ModelConfig
from storage import checkpoint

DYNAMIC_IDS = "ids"   # `<table tensor>/ids`: a dynamic table's ids (parallel_embedding/dynamic_table.py's IDS)


@dataclasses.dataclass(frozen=True)
class Table:
    """One embedding table: checkpoint tensor `tensor` [rows, dim]; `dynamic`: a dynamic table's
    (raw ids; its live rows only, their ids in `<tensor>/ids` [rows, 1] int64); `shards`: a dynamic
    table in S > 1 hash shards, their tensor prefixes (`<tensor>/shard_<s>`, by shard), whose live
    rows, ids and updated_at, concatenated in shard order, are the table's."""
    tensor: str
    rows: int
    dim: int
    dynamic: bool = False
    shards: Tuple[str, ...] = ()

    def tensors(self, what: str = "") -> List[str]:
        """The checkpoint tensors that, concatenated by rows, hold the table's rows (`what` "") or
        its `<tensor>/<what>` (ids, updated_at)."""
        return [f"{p}/{what}" if what else p for p in (self.shards or (self.tensor,))]


@dataclasses.dataclass(frozen=True)
class Lookup:
    """One lookup: categorical feature `feature`'s ids (its columns of categorical_features) in table
    `table`, a multi-hot sample's rows combined by `combiner` ("sum" or "mean"), or, for a
    `sequence` of length L, unpooled: its block of embeddings as repository_format says (width
    L D + 1). Ids computed in the model (a cross, a hash, a slice of a history): `feature` None,
    `computed` the index of its ids among the outputs of ExportedModel.computed_ids, `multi_hot`
    whether they are a multi-hot feature's, `name` the model's name of the feature."""
    feature: Optional[int]
    table: int
    combiner: str
    sequence: Optional[int] = None
    computed: Optional[int] = None
    multi_hot: bool = False
    name: str = ""

    def width(self, dim: int) -> int:
        """Its columns of embeddings, for a table of width `dim`."""
        return dim if self.sequence is None else self.sequence * dim + 1


@dataclasses.dataclass(frozen=True)
class ExportedModel:
    """A checkpoint's model as the exporter serves it: requests by `layout` (its embedding_dims per
    lookup), `tables`, `lookups` (embeddings [B, sum of the lookups' widths], in lookup order),
    `name` (the default model name), and `dense(verify)`: the dense part as a tf.Module with the
    checkpoint's weights (numerical [B, n], embeddings -> logits [B], or [B, H] for the layout's H
    `heads`; TensorFlow and Keras: called last; model_file.KerasDense), None for a built-in
    model (model_file.builtin_dense, from the signature). Its layout's `values`: the outputs
    (columns) trained as values (mean squared error), whose predictions are their outputs; every
    other one's is the sigmoid of its logit. `computed_ids`: the model's part that computes the
    ids of its lookups that are not given as they are (a keras.Model taking the categorical
    features `computed_from` (their indices, in order), one-hot [B] int64, multi-hot ragged
    [B, None] int64, giving a list of ids, a Lookup's `computed` indexing it; its weights are the
    dense part's, restored by `dense`), None when every lookup reads a feature as it is."""
    layout: ServingLayout
    tables: List[Table]
    lookups: List[Lookup]
    name: str
    dense: Optional[Callable[[bool], object]]
    computed_ids: Optional[object] = None
    computed_from: Tuple[int, ...] = ()

    @property
    def per_feature(self) -> bool:
        """Lookup f is feature f in table f (the built-in models): tables.json and deltas say `feature`."""
        return all((x.feature, x.table) == (i, i) for i, x in enumerate(self.lookups)) and \
            len(self.tables) == len(self.lookups)

    @property
    def computed(self) -> List[str]:
        """The names of the features whose ids the model computes."""
        return [x.name for x in self.lookups if x.computed is not None]

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
    `<tensor>/ids`, or `<tensor>/shard_<s>/ids` per hash shard) marked so, their rows the live rows
    saved (of all shards)."""
    tensors = manifest["tensors"]

    def table(t: Table) -> Table:
        shards = sorted((n[:-len(DYNAMIC_IDS) - 1] for n in tensors
                         if n.startswith(f"{t.tensor}/shard_") and n.endswith(f"/{DYNAMIC_IDS}")),
                        key=lambda prefix: int(prefix.rsplit("_", 1)[1]))
        parts = shards or ([t.tensor] if f"{t.tensor}/{DYNAMIC_IDS}" in tensors else [])
        if not parts:
            return t
        rows = sum(int(tensors[f"{p}/{DYNAMIC_IDS}"]["shape"][0]) for p in parts)
        return dataclasses.replace(t, rows=rows, dynamic=True, shards=tuple(shards))
    return dataclasses.replace(model, tables=[table(t) for t in model.tables])


def read_blocks(manifest: dict, table: Table, what: str = "", dtype=None,
                verify: bool = True) -> Iterator[Tuple[int, np.ndarray]]:
    """storage.checkpoint.read_blocks of the table's rows (`what` "") or `<tensor>/<what>`: (start,
    rows [start, start + n)) over its shards' tensors concatenated."""
    offset = 0
    for name in table.tensors(what):
        for start, block in checkpoint.read_blocks(manifest, name, dtype, verify):
            yield offset + start, block
        offset += int(manifest["tensors"][name]["shape"][0])


def gather_rows(manifest: dict, table: Table, rows: np.ndarray, dtype=None, verify: bool = True) -> np.ndarray:
    """storage.checkpoint.gather_rows of the table's rows `rows` ([n] ascending, over its shards'
    tensors concatenated) -> [n, dim]."""
    names = table.tensors()
    ends = np.cumsum([int(manifest["tensors"][n]["shape"][0]) for n in names])
    cut = np.searchsorted(rows, ends)
    return np.concatenate([np.zeros((0, table.dim), dtype or np.float32)] + [
        checkpoint.gather_rows(manifest, name, rows[lo:hi] - (end - length), dtype, verify)
        for name, lo, hi, end, length in zip(names, np.r_[0, cut[:-1]], cut, ends,
                                             np.diff(np.r_[0, ends]))])


def read_whole(manifest: dict, table: Table, what: str, verify: bool = True) -> np.ndarray:
    """The table's `<tensor>/<what>` whole (its shards' concatenated)."""
    return np.concatenate([checkpoint.read_tensor(manifest["path"], n, verify) for n in table.tensors(what)])


def is_model_file(signature: dict) -> bool:
    """Whether a checkpoint's signature is a model file's (run/run_model.py), not a built-in model's."""
    return "hparams" in signature


def same_model(a: dict, b: dict) -> bool:
    """Whether two checkpoint signatures are of one model (their optimizers aside)."""
    if is_model_file(a) or is_model_file(b):
        return {k: v for k, v in a.items() if k != "optimizer"} == {k: v for k, v in b.items() if k != "optimizer"}
    return ModelConfig.from_signature(a) == ModelConfig.from_signature(b)


def built_in_export(manifest: dict) -> ExportedModel:
    """The ExportedModel of a built-in model's checkpoint (its dense part: model_file.builtin_dense,
    the example model the run trains)."""
    config = ModelConfig.from_signature(manifest["signature"])
    layout = ServingLayout(config.cardinalities, [t.max_hotness for t in config.tables], config.embedding_dims,
                           config.num_numerical)
    tables = [Table(table_tensor(f), t.cardinality, t.dim) for f, t in enumerate(config.tables)]
    lookups = [Lookup(f, f, t.combiner) for f, t in enumerate(config.tables)]
    return ExportedModel(layout, tables, lookups, "dcnv2" if config.interaction == "cross" else "dlrm", None)


def table_tensor(feature: int) -> str:
    """Feature's table in a built-in model's checkpoint (its DistributedEmbedding's table_name)."""
    return f"embedding/table_{feature}"
