"""Table and feature configuration in keras-rs' field names, mapped onto the planner's tables.

A `TableConfig` is one embedding table (rows x width, combiner); a `FeatureConfig` is one input
looked up in a table; several features may name the same table. `planner_tables(features)` gives
the distinct tables in order of first use ([rows_t], [D_t], combiners) and, per feature, the index
of its table: the planner places tables, not features. A table given `dynamic` (a
parallel_embedding.planner.DynamicOptions) is a dynamic table: its features take raw int64 ids.
"""
import dataclasses
from typing import Any, List, Optional, Sequence, Tuple, Union

from parallel_embedding.choices import COMBINERS, OPTIMIZERS as TABLE_OPTIMIZERS
from parallel_embedding.planner import DynamicOptions
from utils.errors import ConfigError

PLACEMENTS = ("auto", "default_device", "sparsecore")   # keras-rs' names, all placed by the planner


@dataclasses.dataclass(frozen=True)
class TableConfig:
    """One embedding table: `vocabulary_size` rows x `embedding_dim` columns.

    Fields as keras-rs' `TableConfig`; what each does here:
    - initializer: None (the project's U(-sqrt(1/rows), sqrt(1/rows)), the same at any world
      size), "zeros" (every table of the layer then starts at zero), or a Keras initializer (an
      object or a name Keras knows, e.g. keras.initializers.TruncatedNormal(stddev=0.05)): the
      table is drawn whole by it on every rank at build (one unseeded is seeded from the layer's
      seed, so every rank draws the same table), each rank keeping its shards; not for a
      dynamic table or one on disk (a one-line ConfigError at build);
    - optimizer: None (compile's optimizer) or one of "sgd", "adagrad", "adam", which must then
      be compile's (one sparse optimizer updates every table; another is one line at compile
      naming the table);
    - combiner: "sum" or "mean" over a multi-hot sample's ids (keras-rs' default, "mean"), or
      None for a table only sequence features read (their rows are never combined);
    - placement: "auto", "default_device" or "sparsecore" (keras-rs' names): the planner places
      the table over the ranks (sharding a large table over the ranks, SparseCore's purpose, is
      its model-parallel placement; no SparseCore is used);
    - max_ids_per_partition, max_unique_ids_per_partition: SparseCore (TPU) sizing hints,
      accepted for keras-rs compatibility and checked to be positive; no other effect here;
    - dynamic (not keras-rs'): None, or a DynamicOptions making the table dynamic (planner rule 2;
      docs/dynamic_tables.md): its features take raw int64 ids (any value, no vocabulary), mapped
      to its `capacity` rows (= vocabulary_size) with admission after `admit_after` sightings and
      eviction by `policy` (lru, lfu, ttl) in `shards` hash shards.
    """
    name: str
    vocabulary_size: int
    embedding_dim: int
    initializer: Optional[Union[str, Any]] = None
    optimizer: Optional[str] = None
    combiner: str = "mean"
    placement: str = "auto"
    max_ids_per_partition: int = 256
    max_unique_ids_per_partition: int = 256
    dynamic: Optional[DynamicOptions] = None

    def __post_init__(self):
        where = f"table {self.name!r}"
        if not self.name or not isinstance(self.name, str):
            raise ConfigError(f"TableConfig: name must be a non-empty string, got {self.name!r}")
        for field in ("vocabulary_size", "embedding_dim", "max_ids_per_partition", "max_unique_ids_per_partition"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{where}: {field} must be a positive integer, got {value!r}")
        if self.initializer not in (None, "zeros"):
            import keras
            try:
                keras.initializers.get(self.initializer)
            except (ValueError, TypeError):
                raise ConfigError(f"{where}: initializer must be None (the project's uniform), 'zeros' or a Keras "
                                  f"initializer, got {self.initializer!r}") from None
        if self.optimizer not in (None,) + TABLE_OPTIMIZERS:
            kind = self.optimizer if isinstance(self.optimizer, str) else type(self.optimizer).__name__
            raise ConfigError(f"{where}: optimizer {kind!r}: one optimizer, compile's, updates every table here; "
                              f"leave it None or name compile's ({', '.join(TABLE_OPTIMIZERS)})")
        if self.combiner not in COMBINERS + (None,):
            raise ConfigError(f"{where}: combiner must be one of {', '.join(COMBINERS)} or None (a table of "
                              f"sequence features only), got {self.combiner!r}")
        if self.placement not in PLACEMENTS:
            raise ConfigError(f"{where}: placement must be one of {', '.join(PLACEMENTS)} (the planner places "
                              f"tables), got {self.placement!r}")
        if self.dynamic is not None and not isinstance(self.dynamic, DynamicOptions):
            raise ConfigError(f"{where}: dynamic must be None or a parallel_embedding.planner.DynamicOptions, "
                              f"got {type(self.dynamic).__name__}")
        if self.dynamic is not None and self.dynamic.capacity != self.vocabulary_size:
            raise ConfigError(f"{where}: a dynamic table's rows are its capacity: vocabulary_size "
                              f"{self.vocabulary_size} != dynamic.capacity {self.dynamic.capacity}")


@dataclasses.dataclass(frozen=True)
class FeatureConfig:
    """One input looked up in `table`. `input_shape`: (batch,) or (batch, 1) for one id per
    sample ("one-hot"), (batch, k) with k > 1 for up to k ids per sample ("multi-hot": a ragged
    [b, None] or a dense [b, k] input, combined by the table's combiner). `output_shape`:
    (batch, embedding_dim) of its table, pooled; or (batch, L, embedding_dim) with input_shape
    (batch, L): a sequence feature (a user's history, most recent id last), its rows unpooled,
    [b, L, D] with zeros after each sample's length (HybridEmbedding). The batch entry may be None."""
    name: str
    table: TableConfig
    input_shape: Tuple[Optional[int], ...]
    output_shape: Tuple[Optional[int], ...]

    def __post_init__(self):
        where = f"feature {self.name!r}"
        if not self.name or not isinstance(self.name, str):
            raise ConfigError(f"FeatureConfig: name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.table, TableConfig):
            raise ConfigError(f"{where}: table must be a ranking.TableConfig, got {type(self.table).__name__}")
        shape = tuple(self.input_shape)
        if len(shape) not in (1, 2) or (len(shape) == 2 and (shape[1] is None or shape[1] < 1)):
            raise ConfigError(f"{where}: input_shape must be (batch,) or (batch, k) with k >= 1, got {self.input_shape}")
        out, dim = tuple(self.output_shape), self.table.embedding_dim
        if len(out) == 3:
            if out[2] != dim or len(shape) != 2 or out[1] != shape[1]:
                raise ConfigError(f"{where}: a sequence feature's output_shape is (batch, L, {dim}) (table "
                                  f"{self.table.name!r}'s embedding_dim) with input_shape (batch, L), got "
                                  f"output_shape {self.output_shape} for input_shape {self.input_shape}")
        elif len(out) != 2 or out[1] != dim:
            raise ConfigError(f"{where}: output_shape must be (batch, {dim}) (table {self.table.name!r}'s "
                              f"embedding_dim), or (batch, L, {dim}) for a sequence, got {self.output_shape}")
        elif self.multi_hot and self.table.combiner is None:
            raise ConfigError(f"{where}: multi-hot and pooled, but table {self.table.name!r} has no combiner "
                              f"(None: sequence features only)")

    @property
    def sequence(self) -> bool:
        """Whether the feature is a sequence: its rows unpooled, output_shape (batch, L, D)."""
        return len(self.output_shape) == 3

    @property
    def multi_hot(self) -> bool:
        """Whether a sample's several ids are pooled into one row (a sequence's are not)."""
        return len(self.input_shape) == 2 and self.input_shape[1] > 1 and not self.sequence

    @property
    def ids_per_sample(self) -> int:
        """The most ids a sample has: k of input_shape (batch, k) (a sequence's L), else 1."""
        return self.input_shape[1] if len(self.input_shape) == 2 else 1


def planner_tables(features: Sequence[FeatureConfig]) -> Tuple[List[TableConfig], List[int]]:
    """The distinct tables of `features` in order of first use, and per feature its table's index.
    A name used by two different TableConfigs, or two features of one name, is a ConfigError."""
    tables, index, names = [], {}, set()
    for f in features:
        if f.name in names:
            raise ConfigError(f"feature {f.name!r} is configured twice")
        names.add(f.name)
        known = index.get(f.table.name)
        if known is None:
            index[f.table.name] = len(tables)
            tables.append(f.table)
        elif tables[known] != f.table:
            raise ConfigError(f"table {f.table.name!r} is declared twice with different settings: "
                              f"{tables[known]} and {f.table}")
    return tables, [index[f.table.name] for f in features]
