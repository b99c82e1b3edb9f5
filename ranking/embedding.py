"""HybridEmbedding: the hybrid-parallel embedding tables as a Keras 3 layer.

Shapes: `b` local batch (this rank's samples), `B = N b`, feature f of width D_f.

    emb = HybridEmbedding({"user": FeatureConfig(...), "genres": FeatureConfig(...)})
    out = emb({"user": ids [b] or [b, 1], "genres": ragged [b, None] or dense [b, k]})
    out["user"]: [b, D_user] float32; a list of features in gives a list out, in that order.

A sequence feature (FeatureConfig output_shape (batch, L, D)) gives its rows unpooled: ids ragged
[b, None] (most recent last) or dense [b, k] (ids < 0 padding) -> [b, L, D], sample i's kept ids'
rows at positions 0..n_i - 1 in order, zeros after (n_i = min(its length, L): the most recent L
kept, the others counted: `sequence_stats`); `sequences.SequenceMask(L)` of the same ids is its
[b, L] mask. Its table sees it as L inputs of b rows (position-major, one id or none each:
sequences.by_position), so every table kind, rank count and tier serves it as a multi-hot input.

The tables are a `parallel_embedding.DistributedEmbedding` placed by one `plan_tables` call over
the ranks of `collectives` (default: one process); the layers of a `TableGroup` (a model's layers
made by ranking.Features.embedding) are placed by one call over all their tables. Every rank
feeds its own b samples of every feature (data-parallel input); the embedding exchanges ids and
rows with the all-to-alls of the plan (of a sequence, only its kept ids' rows travel). Features
sharing a table are looked up together, their ids concatenated (the embedding's
`inputs_per_table`: one lookup, exchange and update per table at any N).

Model-parallel input (`data_parallel_input=False`, N > 1): the layer looks up only ids given
through `given_table_ids`, per table as `input_rows(t)` says: its features' ids of the global
batch ([k_t B]) where this rank holds a shard of table t, of the local batch ([k_t b]) where t is
replicated; the inputs still give b. The run (run/run_model.py) reads them from the data.

A layer may instead be handed its tables built (`embedding`: a DistributedEmbedding on the plan
of the caller's one planner call, as the built-in DLRM / DCNv2's, run/assembly.py): it then plans
nothing, and its tables keep that embedding's checkpoint names ("embedding/table_<t>").

With `storage` (a `TableStorage`), the planner puts the tables that exceed a memory budget on
disk (parallel_embedding/tiered.py); their ids must then be staged before each step: the run
stages each batch's `table_ids` and hands the step the cache slots through `given_table_ids`.

The tables are not Keras weights: `model.trainable_variables` holds only the dense layers', so
Keras (or any dense optimizer) never touches them; `table_variables` lists this rank's, and
`ranking.Model`'s train step updates their looked-up rows with the embedding's sparse optimizer.
During that step the layer records what it looked up (`recording`): the step differentiates the
loss with respect to the looked-up rows, not the tables.
"""
import contextlib
import dataclasses
from typing import List, Mapping, Optional, Sequence, Union

import keras
import numpy as np
import tensorflow as tf
from tensorflow.python.eager import record   # whether a gradient tape is recording

from parallel_embedding.collectives import SingleProcess
from parallel_embedding.exchange import LookedUp
from parallel_embedding.ids import num_samples
from parallel_embedding.layer import DistributedEmbedding
from parallel_embedding.planner import BudgetError, TierOptions, plan_tables
from ranking.config import COMBINERS, FeatureConfig, planner_tables
from ranking.sequences import by_position, recent_ids
from utils.errors import ConfigError


ONE_PROCESS = SingleProcess()   # the default collectives, shared so that a model's layers agree


@dataclasses.dataclass(frozen=True)
class TableStorage:
    """The tables' tiers: the planner keeps a rank's embedding state (tables and `slots` optimizer
    slots per parameter: 0 SGD, 1 Adagrad, 2 Adam) within `budget_bytes` (None: no limit) and puts
    the largest tables on disk, in files under `store_path`, each with a cache of rows for the ids
    of twice `batch_rows` samples (the batches in flight), victims chosen by `cache_policy`
    ("lru" or "lfu"); the largest tables left in memory go to host memory until the rest take at
    most `host_threshold_bytes` of parameters (None: never; a GPU run's --cpu_offloading_threshold_gb)."""
    budget_bytes: Optional[int]
    batch_rows: int
    slots: int
    store_path: Optional[str] = None
    cache_policy: str = "lru"
    host_threshold_bytes: Optional[int] = None


class Recorded:
    """One forward's lookups (filled by `HybridEmbedding.call` inside `recording`): per call, the
    embedding's `LookedUp` and the exchanged table rows (T x [k_t b, D_t], watched by the tape)."""

    def __init__(self, tape: tf.GradientTape):
        self.tape = tape
        self.calls: List[tuple] = []   # (LookedUp, rows per table)


class TableGroup:
    """The HybridEmbedding layers of one model planned together: one `plan_tables` call over all
    their tables (the layers in the order they were made, each one's tables in its order) on the
    ranks of `collectives` (default: one process), with the keyword arguments `placement`
    (strategy and thresholds) and the tiers of `storage` (its budgets a rank's for all the layers),
    made at the first use of any layer's `embedding` (or by `plan`); each layer's tables are its
    part of that plan (Plan.part). A layer made without a group is a group of its own, planned at
    once. A layer added after the plan is made: a one-line ConfigError; a budget too small for the
    layers: BudgetError naming them.
    `one_row`: every table is built static, in memory and of one row [1, D_t] (no `storage`; the
    layers' `tables` keep their configs' shapes): a model built for its dense part and its tables'
    configs and names, never to look up (the exporter's: its tables are streamed from a checkpoint,
    so that exporting needs no memory for them)."""

    def __init__(self, collectives=None, storage: Optional[TableStorage] = None, one_row: bool = False,
                 **placement):
        if one_row and storage is not None:
            raise ValueError("TableGroup: one-row tables are in memory: no storage")
        self.comm, self.storage, self.placement = collectives or ONE_PROCESS, storage, placement
        self.one_row = one_row
        self.layers: List["HybridEmbedding"] = []
        self.planned = False

    def add(self, layer: "HybridEmbedding"):
        if self.planned:
            raise ConfigError(f"layer {layer.name!r}: made after the tables of layer(s) "
                              f"{', '.join(repr(l.name) for l in self.layers)} were planned (at the first use of "
                              f"one): make every HybridEmbedding of the model before using any")
        self.layers.append(layer)

    def plan(self):
        """Plans the tables of every layer added and builds each layer's (once)."""
        if self.planned:
            return
        tables = [t for layer in self.layers for t in layer.tables]
        storage = self.storage
        tiers = None if storage is None else TierOptions(storage.slots, storage.budget_bytes, [
            rows for layer in self.layers for rows in layer._min_cache_rows(storage.batch_rows)],
            storage.host_threshold_bytes)
        try:
            plan = plan_tables([1 if self.one_row else t.vocabulary_size for t in tables],
                               [t.embedding_dim for t in tables], self.comm.size, tiers=tiers,
                               dynamic={i: t.dynamic for i, t in enumerate(tables) if t.dynamic and not self.one_row},
                               **self.placement)
        except BudgetError as e:
            names = ", ".join(repr(l.name) for l in self.layers)
            raise BudgetError(f"layer {names}: {e}" if len(self.layers) == 1 else
                              f"layers {names} (their tables numbered across them in that order): {e}") from None
        self.planned = True
        first = 0
        for layer in self.layers:
            layer._build_tables(plan.part(first, len(layer.tables)))
            first += len(layer.tables)


class HybridEmbedding(keras.layers.Layer):
    """Features (`FeatureConfig`s: a dict by name or a list) -> one [b, D_f] float32 per feature.

    Tables are planned by `plan_tables(rows, dims, N, strategy, column_slice_threshold,
    row_slice_threshold, data_parallel_threshold, tiers)` over the N ranks of `collectives` (tiers:
    `storage`'s, None for every table in memory), initialised
    from `seed` (two ints; the same seed gives the same tables at any N, and as
    `DistributedEmbedding(..., seed=seed)` of the same shapes), or to zeros with
    `zeros_initializer` (or every table's initializer "zeros"). The k features of a table share
    its lookup: their ids concatenated, [k b], its rows [k b, D] split back per feature.
    `data_parallel_input` false: model-parallel input at N > 1 (the module docstring).
    `trainable` false (Keras' attribute): `ranking.Model`'s step neither differentiates nor updates
    the tables (frozen). A table with `dynamic` options (planner rule 2) takes raw int64 ids (no
    range check), mapped to rows at the model's global step; its counts: `dynamic_stats`.
    `embedding`: the tables built (a DistributedEmbedding, one table per feature in feature order,
    each of the feature table's (rows, dim), a dynamic one of its capacity's rows; its
    collectives, plan, tiers, input layout, initial values, combiners and names are its own):
    nothing is planned, and the placement, storage, seed and initializer arguments are not taken.
    Other tables: a one-line ConfigError. `group`: a TableGroup planning the layer's tables with
    its other layers' (its collectives, placement and storage, not the layer's own).
    """

    def __init__(self, features: Union[Mapping[str, FeatureConfig], Sequence[FeatureConfig]], *,
                 collectives=None, seed=(0, 1000), strategy: str = "memory_balanced",
                 column_slice_threshold: Optional[int] = None, row_slice_threshold: Optional[int] = None,
                 data_parallel_threshold: Optional[int] = None, storage: Optional[TableStorage] = None,
                 data_parallel_input: bool = True, zeros_initializer: bool = False,
                 embedding: Optional[DistributedEmbedding] = None, group: Optional["TableGroup"] = None,
                 name: str = "hybrid_embedding", **kwargs):
        super().__init__(name=name, **kwargs)
        if isinstance(features, Mapping):
            for key, f in features.items():
                if key != f.name:
                    raise ConfigError(f"feature {f.name!r} is given under the key {key!r}")
            self._dict_input, self.features = True, list(features.values())
        else:
            self._dict_input, self.features = False, list(features)
        if not self.features:
            raise ConfigError("HybridEmbedding: no features given")
        self.tables, self.table_of = planner_tables(self.features)
        # Per table, its inputs of b rows: one a pooled feature, L a sequence feature.
        self._table_inputs = [sum(self._inputs_of(f) for f, i in zip(self.features, self.table_of) if i == t)
                              for t in range(len(self.tables))]
        if group is not None and (collectives, storage, strategy, column_slice_threshold, row_slice_threshold,
                                  data_parallel_threshold) != (None, None, "memory_balanced", None, None, None):
            raise ConfigError(f"layer {self.name!r}: a layer of a TableGroup takes the group's collectives, "
                              f"placement and storage, not its own")
        comm = embedding.comm if embedding is not None else group.comm if group is not None else \
            collectives or ONE_PROCESS
        zeros = {t.initializer == "zeros" for t in self.tables}
        if len(zeros) > 1:
            raise ConfigError(f"table {next(t.name for t in self.tables if t.initializer == 'zeros')!r}: "
                              f"initializer 'zeros' must be every table's or none's")
        self._handed_tables = embedding is not None
        self._embedding: Optional[DistributedEmbedding] = None
        if embedding is not None:
            self.storage, self._group = None, None
            self.model_parallel_input = comm.size > 1 and not embedding.data_parallel_input
            self._embedding = self._handed(embedding, comm)
        else:
            self._group = group or TableGroup(collectives, storage, strategy=strategy,
                                              column_slice_threshold=column_slice_threshold,
                                              row_slice_threshold=row_slice_threshold,
                                              data_parallel_threshold=data_parallel_threshold)
            self.storage = self._group.storage
            self.model_parallel_input = comm.size > 1 and not data_parallel_input
            self._table_settings = dict(seed=tuple(seed), data_parallel_input=comm.size > 1 and data_parallel_input,
                                        zeros_initializer=zeros == {True} or zeros_initializer)
            self._group.add(self)
            if group is None:   # a layer of its own: planned now
                self._group.plan()
        # The rows of features sharing a table travel as one input: one-hot ones become ragged
        # rows of one id when another feature of their table is multi-hot or a sequence.
        self._ragged_table = [any(f.multi_hot or f.sequence for f, t in zip(self.features, self.table_of) if t == i)
                              for i in range(len(self.tables))]
        self._truncated = {f.name: tf.Variable(tf.constant(0, tf.int64), trainable=False,
                                               name=f"{self.name}/{f.name}/truncated")
                           for f in self.features if f.sequence}
        self._recorded: Optional[Recorded] = None
        self._given_ids: Optional[list] = None

    @property
    def embedding(self) -> DistributedEmbedding:
        """The tables built: handed to the layer, or on its part of its group's plan (made now if
        this is the first use of a layer of the group)."""
        if self._embedding is None:
            self._group.plan()
        return self._embedding

    def _min_cache_rows(self, batch_rows: int) -> List[int]:
        """Per table, the rows of the ids of twice `batch_rows` samples (a disk table's fewest cache rows)."""
        return [2 * batch_rows * sum(f.ids_per_sample for f, i in zip(self.features, self.table_of) if i == t)
                for t in range(len(self.tables))]

    def _build_tables(self, plan):
        """Makes the layer's DistributedEmbedding on `plan` (its tables' part of its group's plan)."""
        storage = self._group.storage
        combiners = [t.combiner or "sum" for t in self.tables]   # None: a table of sequences only, never combined
        self._embedding = DistributedEmbedding(plan, self._group.comm, combiners=combiners,
                                               make_variable=self._table_variable,
                                               store_path=storage and storage.store_path,
                                               cache_policy=storage.cache_policy if storage else "lru",
                                               inputs_per_table=self._table_inputs,
                                               name=f"{self.name}_tables", **self._table_settings)
        drawn = {t: table for t, table in enumerate(self.tables) if table.initializer not in (None, "zeros")}
        for table in drawn.values():
            if table.dynamic or storage:
                raise ConfigError(f"table {table.name!r}: a Keras initializer draws a table whole in memory; a "
                                  f"{'dynamic table' if table.dynamic else 'layer with storage'} starts from the "
                                  f"project's initializer (None) or 'zeros'")
        if drawn:
            self._set_tables({t: _drawn(table, self._table_settings["seed"], t) for t, table in drawn.items()})

    def _set_tables(self, whole: Mapping[int, np.ndarray]) -> None:
        """Sets tables (by index) from whole arrays [rows_t, D_t]; each rank takes its shards' rows
        and columns (a row shard's spare row stays)."""
        emb = self._embedding
        for s, v in zip(emb.shards, emb.shard_variables):
            if s.feature in whole:
                piece = np.asarray(whole[s.feature][s.row_start:s.row_end, s.col_start:s.col_end], np.float32)
                v.assign(tf.concat([piece, v[s.num_rows:]], axis=0))
        for t, v in zip(emb.replicated, emb.replicated_variables):
            if t in whole:
                v.assign(np.asarray(whole[t], np.float32))

    @staticmethod
    def _inputs_of(feature: FeatureConfig) -> int:
        return feature.ids_per_sample if feature.sequence else 1

    def _handed(self, embedding: DistributedEmbedding, comm) -> DistributedEmbedding:
        """`embedding`, checked to hold the features' own tables (one per feature, of its shape) on `comm`."""
        want = [(t.vocabulary_size, t.embedding_dim) for t in self.tables]
        got = [(None if t.kind == "dynamic" else t.rows, t.dim) for t in embedding.plan.tables]
        if embedding.comm is not comm or len(self.tables) != len(self.features) or len(got) != len(want) or any(
                g != w and g != (None, w[1]) for g, w in zip(got, want)):
            raise ConfigError(f"layer {self.name!r}: the embedding handed to it holds tables (rows, dim) "
                              f"{[(g[0] or 'dynamic', g[1]) for g in got]}, not its features' {want} on its "
                              f"collectives")
        if embedding.inputs_per_table != self._table_inputs:
            raise ConfigError(f"layer {self.name!r}: the embedding handed to it reads {embedding.inputs_per_table} "
                              f"inputs a table, its features {self._table_inputs} (a sequence of length L: L)")
        return embedding

    def _table_variable(self, initial_value: tf.Tensor, name: str) -> tf.Variable:
        """One table variable (or shard) of the embedding: here a tf.Variable, no Keras weight."""
        return tf.Variable(initial_value, name=name)

    def _table_rows(self, table_ids, b, training) -> List[tf.Tensor]:
        """Per table: its features' rows of the local batch ([k_t b, D_t]), outside `recording`.
        In training under a gradient tape, only for a frozen layer (ranking.Model's step records
        the others): else a one-line ConfigError, as nothing would update the tables."""
        if training and self.trainable and record.could_possibly_record():
            raise ConfigError(f"layer {self.name!r}: called in training outside ranking.Model's step, the one that "
                              f"updates its tables (a plain keras.Model's fit or a GradientTape of your own never "
                              f"would): build the model as ranking.Model and train it with fit or train_on_batch "
                              f"(a loop of your own: ranking.dist_model_parallel)")
        return self.embedding(table_ids, b, training=bool(training))

    @property
    def collectives(self):
        return self.embedding.comm

    @property
    def table_variables(self) -> List[tf.Variable]:
        """This rank's table variables (shards, then replicated tables): updated sparsely, never by Keras."""
        return self.embedding.variables_in_order

    def count_params(self) -> int:
        """This rank's table parameters (the `Param #` of `model.summary()`; not in its totals,
        which count Keras weights)."""
        return int(sum(np.prod(v.shape) for v in self.table_variables))

    def dynamic_stats(self) -> dict:
        """Per dynamic table, by "<layer>/<its TableConfig's name>" (tables handed to the layer: by
        their own names): its live rows and admitted, evicted and refused ids
        (DistributedEmbedding.dynamic_stats; at N ranks a collective)."""
        if self._handed_tables:
            return self.embedding.dynamic_stats()
        names = {self.embedding.table_name(t): f"{self.name}/{table.name}" for t, table in enumerate(self.tables)}
        return {names[name]: counts for name, counts in self.embedding.dynamic_stats().items()}

    def sequence_stats(self) -> dict:
        """Per sequence feature, by "<layer>/<feature>": {"truncated": the ids its calls dropped
        from samples longer than its L} since the layer was made, summed over every rank (at N
        ranks a collective); {} without sequence features."""
        counts = {f"{self.name}/{name}": int(v.numpy()) for name, v in self._truncated.items()}
        if counts and self.collectives.size > 1:
            parts = self.collectives.allgather_object(counts, f"{self.name}_sequence_stats")
            counts = {name: sum(p[name] for p in parts) for name in counts}
        return {name: {"truncated": n} for name, n in counts.items()}

    @contextlib.contextmanager
    def recording(self, tape: tf.GradientTape):
        """Within: calls look up outside `tape`, have it watch the exchanged rows, and record both."""
        self._recorded = Recorded(tape)
        try:
            yield self._recorded
        finally:
            self._recorded = None

    def call_inputs(self) -> list:
        """The KerasTensors of the layer's (first) call in a functional model, in feature order."""
        node = self._inbound_nodes[0]
        inputs = node.arguments.args[0] if node.arguments.args else node.arguments.kwargs["inputs"]
        return [inputs[f.name] for f in self.features] if self._dict_input else list(inputs)

    def input_rows(self, table: int) -> str:
        """The rows of `table`'s ids the layer looks up: "global" ([k_t B]: model-parallel input, a
        shard of it on this rank), "local" ([k_t b]) or "none" (ignored: no shard of it here)."""
        return self.embedding.input_rows(table)

    def table_ids(self, ids: Sequence) -> List[Union[tf.Tensor, tf.RaggedTensor]]:
        """Ids in feature order -> per table, its features' ids concatenated in feature order
        ([k_t b] or ragged [k_t b, None]; a sequence of length L: L inputs of b rows, position-major):
        what the embedding looks up (and its `staged` stages)."""
        return self._table_ids(self._normalized(ids)[0])

    @contextlib.contextmanager
    def given_table_ids(self, table_ids: Sequence):
        """Within: calls look up `table_ids` (`table_ids`' output, e.g. staged into cache slots)
        instead of their inputs' ids; the inputs still give the batch size."""
        self._given_ids = list(table_ids)
        try:
            yield
        finally:
            self._given_ids = None

    def _feature_ids(self, inputs):
        """The inputs in feature order, normalized (`_normalized`)."""
        if self._dict_input:
            missing = [f.name for f in self.features if f.name not in inputs]
            if missing:
                raise ConfigError(f"feature {missing[0]!r}: missing from the inputs of layer {self.name!r}")
            inputs = [inputs[f.name] for f in self.features]
        elif len(inputs) != len(self.features):
            raise ConfigError(f"layer {self.name!r}: {len(inputs)} inputs for {len(self.features)} features")
        return self._normalized(inputs)

    def _normalized(self, inputs: Sequence):
        """Ids in feature order -> (one-hot [b], multi-hot ragged [b, None], a sequence its L
        positions ragged [L b, None]; per sequence feature by name, the ids it dropped)."""
        ids, truncated = [], {}
        for f, x, t in zip(self.features, inputs, self.table_of):
            if f.sequence:
                if self.tables[t].dynamic and not isinstance(x, tf.RaggedTensor):
                    raise ConfigError(f"feature {f.name!r}: a sequence over dynamic table {self.tables[t].name!r} "
                                      f"takes ragged ids [b, None] (its raw ids have no padding value)")
                kept, truncated[f.name] = recent_ids(x, f.ids_per_sample, f"feature {f.name!r}")
                ids.append(by_position(kept, f.ids_per_sample))
            elif not f.multi_hot:
                if isinstance(x, tf.RaggedTensor):
                    raise ConfigError(f"feature {f.name!r}: one-hot (input_shape {f.input_shape}) but given ragged ids")
                x = tf.convert_to_tensor(x)
                ids.append(tf.reshape(x, [-1]) if x.shape.rank == 2 else x)
            else:
                ids.append(x if isinstance(x, tf.RaggedTensor) else tf.RaggedTensor.from_tensor(x))
        return ids, truncated

    def _table_ids(self, ids) -> List[Union[tf.Tensor, tf.RaggedTensor]]:
        """Per table: its features' ids, concatenated in feature order ([k_t b] or ragged [k_t b, None])."""
        out = []
        for t, ragged in enumerate(self._ragged_table):
            parts = [x for x, i in zip(ids, self.table_of) if i == t]
            if ragged:
                parts = [x if isinstance(x, tf.RaggedTensor) else tf.RaggedTensor.from_tensor(x[:, None])
                         for x in parts]
                dtype = tf.int64 if any(p.dtype == tf.int64 for p in parts) else parts[0].dtype
                parts = [tf.cast(p, dtype) for p in parts]
            if self.tables[t].dynamic:   # raw 64-bit ids
                parts = [tf.cast(p, tf.int64) for p in parts]
            out.append(parts[0] if len(parts) == 1 else tf.concat(parts, axis=0))
        return out

    def call(self, inputs, training=None):
        ids, truncated = self._feature_ids(inputs)
        for name, n in truncated.items():
            self._truncated[name].assign_add(n)
        b = num_samples(ids[0]) // self._inputs_of(self.features[0])
        if self.model_parallel_input and self._given_ids is None:
            raise ConfigError(f"layer {self.name!r} takes model-parallel input: its tables' ids are given "
                              f"(given_table_ids), not taken from its inputs")
        table_ids = self._table_ids(ids) if self._given_ids is None else self._given_ids
        if self._recorded is None:
            rows = self._table_rows(table_ids, b, training)
        else:
            with self._recorded.tape.stop_recording():
                looked_up = self.embedding.lookup(table_ids, training=True)
                rows = self.embedding.exchange(looked_up, b)
            self._recorded.tape.watch(rows)
            self._recorded.calls.append((looked_up, rows))
        taken, inputs = [0] * len(self.tables), self._table_inputs
        out = []
        for f, t in zip(self.features, self.table_of):   # table t's rows [m_t b, D]: its inputs' b rows each
            n = self._inputs_of(f)
            if inputs[t] == 1 and not f.sequence:
                out.append(rows[t])
            else:
                mine = tf.reshape(rows[t], [inputs[t], -1, self.tables[t].embedding_dim])[taken[t]:taken[t] + n]
                out.append(tf.transpose(mine, [1, 0, 2]) if f.sequence else mine[0])
            taken[t] += n
        return {f.name: o for f, o in zip(self.features, out)} if self._dict_input else out

    def compute_output_spec(self, inputs, training=None):
        specs = [keras.KerasTensor((None,) + tuple(f.output_shape[1:]), "float32") for f in self.features]
        return {f.name: s for f, s in zip(self.features, specs)} if self._dict_input else specs

    def gradients(self, looked_up: LookedUp, row_grads: Sequence[tf.Tensor]) -> List[tf.IndexedSlices]:
        """Gradients of a recorded call's exchanged rows (T x [k_t b, D_t]) -> IndexedSlices of
        `table_variables` (the reverse all-to-all)."""
        return self.embedding.gradients(looked_up, row_grads)


def _drawn(table, seed, t: int) -> np.ndarray:
    """Table `t` drawn whole by its Keras initializer, seeded from `seed` and t where it has no seed
    of its own (a seeded Keras initializer draws the same values on every call, so on every rank)."""
    init = keras.initializers.get(table.initializer)
    config = init.get_config()
    if "seed" in config and config["seed"] is None:
        init = type(init).from_config({**config, "seed": int(seed[0]) * 1_000_003 + int(seed[1]) + t})
    return np.asarray(init((table.vocabulary_size, table.embedding_dim), "float32"))


class WeightTables(HybridEmbedding):
    """A HybridEmbedding whose tables are Keras weights, for a Keras optimizer of the user's:
    `trainable_variables` holds this rank's table shards (`embedding_table` "shard") and
    replicated tables ("replicated"), a table's gradient is a tf.IndexedSlices of the rows looked
    up (their sum over the ranks' local losses: the reverse all-to-all). `whole_tables` and
    `set_whole_tables` read and set the tables whole at any world size. The fronts of
    distributed-embeddings (dist_model_parallel) and keras-rs (keras_rs) are made of it."""

    def __init__(self, features, **kwargs):
        self._keras_tables: List[keras.Variable] = []
        super().__init__(features, **kwargs)
        shards = len(self.embedding.shard_variables)
        for i, variable in enumerate(self._keras_tables):
            variable.embedding_table = "shard" if i < shards else "replicated"

    def _table_variable(self, initial_value: tf.Tensor, name: str) -> tf.Variable:
        """A Keras weight (so in `trainable_variables`); the embedding gets its tf.Variable."""
        variable = self.add_weight(shape=initial_value.shape, initializer=lambda shape, dtype: initial_value,
                                   name=name.replace("/", "."), trainable=True)
        self._keras_tables.append(variable)
        return variable.value

    def _table_rows(self, table_ids, b, training) -> List[tf.Tensor]:
        """The rows ([k_t b, D_t] per table) with the tables' gradients."""
        looked_up = self.embedding.lookup(table_ids, training=bool(training))
        rows = self.embedding.exchange(looked_up, b)
        embedding = self.embedding

        @tf.custom_gradient
        def with_table_gradients(*rows_and_tables):
            def gradient(*row_grads):
                return [None] * len(rows) + embedding.gradients(looked_up, row_grads)
            return [tf.identity(r) for r in rows_and_tables[:len(rows)]], gradient

        # The tables enter as reads (no copy), through which their gradients reach the variables.
        return with_table_gradients(*rows, *[tf.convert_to_tensor(v) for v in embedding.variables_in_order])

    def whole_tables(self) -> List[np.ndarray]:
        """The whole tables ([rows_t, D_t] float32, in `tables` order) at any world size, on every
        rank (one allreduce)."""
        emb = self.embedding
        whole = [np.zeros((t.vocabulary_size, t.embedding_dim), np.float32) for t in self.tables]
        for s, v in zip(emb.shards, emb.shard_variables):
            whole[s.feature][s.row_start:s.row_end, s.col_start:s.col_end] = v.numpy()[:s.num_rows]
        if self.collectives.rank == 0:
            for t, v in zip(emb.replicated, emb.replicated_variables):
                whole[t] = v.numpy()
        if self.collectives.size > 1:
            whole = [np.asarray(w) for w in self.collectives.allreduce_sum([tf.constant(w) for w in whole],
                                                                             f"{self.name}_whole_tables")]
        return whole

    def set_whole_tables(self, whole: Sequence) -> None:
        """Sets the tables from whole arrays ([rows_t, D_t], in `tables` order; shapes checked by
        the caller); each rank takes the rows and columns of its shards."""
        self.embedding   # planned
        self._set_tables(dict(enumerate(whole)))


class Embedding(keras.layers.Embedding):
    """distributed-embeddings' `Embedding` (`from ranking import embedding`, as its
    `distributed_embeddings.python.layers import embedding`): Keras' Embedding with a `combiner`,
    "sum" or "mean" of each sample's rows (ids [b, k] or ragged [b, None] -> [b, D]), None for
    Keras' own lookup. dist_model_parallel.DistributedEmbedding takes it as a table combining so."""

    def __init__(self, input_dim: int, output_dim: int, combiner: Optional[str] = None, **kwargs):
        if combiner not in (None,) + COMBINERS:
            raise ConfigError(f"Embedding: combiner must be None, {' or '.join(COMBINERS)}, got {combiner!r}")
        super().__init__(input_dim, output_dim, **kwargs)
        self.combiner = combiner

    def call(self, inputs):
        if self.combiner is None:
            return super().call(inputs)
        rows = tf.gather(self.embeddings.value, tf.cast(inputs, tf.int64))   # [b, k, D], ragged or not
        return tf.reduce_sum(rows, axis=1) if self.combiner == "sum" else tf.reduce_mean(rows, axis=1)

    def compute_output_shape(self, input_shape):
        return super().compute_output_shape(input_shape) if self.combiner is None \
            else (input_shape[0], self.output_dim)

    def get_config(self):
        return {**super().get_config(), "combiner": self.combiner}
