"""DistributedEmbedding: the embedding tables of a ranking model, laid out by a `Plan`.

Shapes: `B` global batch, `b = B / N` local batch, `F` features, `D_f` feature f's width,
`N` world size, `W_r` the summed width of rank r's shards.

Forward, on every rank:
1. `lookup`: ids -> rows of this rank's shards ([B, w] each, for the whole global batch) and of
   the replicated tables ([b, D_f], local rows only). A row shard looks up only the ids inside
   its row range; the others read a spare row and are zeroed, so the N partial results sum to
   the full lookup. A dynamic table in S > 1 hash shards at N > 1 ranks is routed instead: each
   hash shard's owner holds only its own K_s ids (in global batch order) and looks up [K_s, D]
   (routing.py).
2. `exchange`: one all-to-all sends each rank its b rows of every shard; column slices are
   re-joined, row shards summed, and the F features come back in feature order ([b, D_f]).
   A routed shard's rows travel in the same all-to-all, each only to the rank whose sample it
   is (a multi-hot table's summed per sample by the owner first), and are summed into that
   rank's [b, D_f] at their samples: one table's traffic, not S.

Backward (`gradients`): the reverse all-to-all brings every shard the gradient of its B rows
(a routed shard: of its K_s ids); the table gradients are IndexedSlices applied by the owner
(replicated tables: the b-row slices of all ranks, gathered) with `apply_gradients`, the
optimizer of `set_optimizer`. With data-parallel input each rank starts from ids of its own b
rows of every feature; one all-to-all of ids gives each shard's owner the global batch first (a
routed shard: only its own ids, from every rank, in the same all-to-all: routing.py).

Features sharing a table (`inputs_per_table` m_f > 1) give it the ids of its m_f inputs
concatenated input by input: [m_f b] locally, [m_f B] globally (each input's B rows in global
order); rows come back the same way, [m_f b, D_f], and the table is looked up, exchanged and
updated once.

Multi-hot features take a `tf.RaggedTensor` of ids ([rows, None]) instead of a vector; a row's
embedding is the sum (combiner "sum") or mean ("mean") of its ids' rows, zeros for an empty
row, and each id's row gets the row's gradient (divided by the row's length for "mean").
With data-parallel input the exchange is jagged (`Jagged`): of a multi-hot input only the rows
that hold ids travel. Two counts per feature travel with the one-hot ids, then one more
all-to-all carries those rows' lengths and their ids; the owner looks them up as those rows,
rank by rank, and sends each rank its own in the rows' all-to-all; each rank puts them back in
their places (zeros elsewhere) and returns their gradients only. So a sequence looked up
position by position (ranking/sequences.py) sends its kept ids and their rows, not L x b.
Model-parallel input sends every row: a rank there does not know which of its samples' rows
hold ids.

>>> from parallel_embedding.collectives import SingleProcess
>>> emb = DistributedEmbedding(plan_tables([1000, 20], [16, 16], world_size=1), SingleProcess(), seed=(1, 100),
...                            combiners=["sum", "mean"])
>>> [e.shape for e in emb([tf.constant([3, 7]), tf.ragged.constant([[0, 19, 4], []])], local_batch=2)]
[TensorShape([2, 16]), TensorShape([2, 16])]
"""
import contextlib
import dataclasses
import math
from typing import Dict, List, NamedTuple, Optional, Sequence, Set, Union

import numpy as np
import tensorflow as tf

from storage.checkpoint import Entry, replicated_entries
from parallel_embedding import UPDATED_AT
from parallel_embedding.choices import COMBINERS
from parallel_embedding.dynamic_table import IDS, DynamicTable, capacity_check, resharded_entries, tensor_names
from parallel_embedding.optimizers import make_optimizer
from parallel_embedding.planner import Plan, Shard, plan_tables  # noqa: F401 (plan_tables: the example)
from parallel_embedding.routing import Router, Routes, assert_size, hash_shards
from parallel_embedding.tiered import DiskTier, DynamicUnit, Unit
from utils.errors import ConfigError
from utils.logger import DYNAMIC_COUNTS

_INIT_BLOCK_ROWS = 1 << 16


def shard_initial_value(rows: int, dim: int, shard: Shard, seed) -> tf.Tensor:
    """The shard's part of the table initialised as U(-sqrt(1/rows), sqrt(1/rows)).

    The full table is defined block by block (2^16 rows, each from its own stateless seed), so a
    shard's values do not depend on how the table is cut: any world size starts from the same
    weights. Only the blocks the shard covers are generated.
    """
    limit = math.sqrt(1.0 / rows)
    parts = []
    first, last = shard.row_start // _INIT_BLOCK_ROWS, (shard.row_end - 1) // _INIT_BLOCK_ROWS
    for block in range(first, last + 1):
        start = block * _INIT_BLOCK_ROWS
        n = min(_INIT_BLOCK_ROWS, rows - start)
        values = tf.random.stateless_uniform([n, dim], seed=tf.random.experimental.stateless_fold_in(seed, block),
                                             minval=-limit, maxval=limit)
        lo, hi = max(shard.row_start - start, 0), min(shard.row_end - start, n)
        parts.append(values[lo:hi, shard.col_start:shard.col_end])
    return tf.concat(parts, axis=0) if parts else tf.zeros([0, shard.width])


class FlatIds(NamedTuple):
    """One feature's ids for n samples (batch rows) as K ids: one-hot (K = n, `sample` None) or multi-hot."""
    ids: tf.Tensor                     # [K]
    sample: Optional[tf.Tensor]        # [K] the sample each id belongs to
    weights: Optional[tf.Tensor]       # [K] its combiner weight (None: 1)
    num_samples: Optional[tf.Tensor]   # n


def flatten_ids(ids: Union[tf.Tensor, tf.RaggedTensor], combiner: str) -> FlatIds:
    if not isinstance(ids, tf.RaggedTensor):
        return FlatIds(ids, None, None, None)
    sample = ids.value_rowids()
    weights = None
    if combiner == "mean":
        lengths = tf.cast(tf.maximum(ids.row_lengths(), 1), tf.float32)
        weights = tf.gather(1.0 / lengths, sample)
    return FlatIds(ids.values, sample, weights, ids.nrows())


def combine(gathered: tf.Tensor, flat: FlatIds) -> tf.Tensor:
    """[K, w] rows of the K ids -> [n, w] rows of the n samples (the combiner)."""
    if flat.sample is None:
        return gathered
    if flat.weights is not None:
        gathered = gathered * flat.weights[:, None]
    return tf.math.unsorted_segment_sum(gathered, flat.sample, flat.num_samples)


def spread(grad: tf.Tensor, flat: FlatIds) -> tf.Tensor:
    """The gradient of `combine`: [n, w] -> [K, w]."""
    if flat.sample is None:
        return grad
    grad = tf.gather(grad, flat.sample)
    return grad if flat.weights is None else grad * flat.weights[:, None]


def num_samples(ids) -> tf.Tensor:
    return tf.cast(ids.nrows(), tf.int32) if isinstance(ids, tf.RaggedTensor) else tf.shape(ids)[0]


def check_ids(features: Sequence[Union[int, str]], ids: Sequence[tf.Tensor], cardinalities: Sequence[int]) -> list:
    """Assertions that every id of `features` (their flat ids and cardinalities, in the same
    order) is in [0, cardinality), to run before any gather: XLA clamps out-of-range gathers
    silently, a GPU gather returns zeros, and a row shard skips ids outside its range by design.
    `features`: their indices, or names where one has none (ids a model computes)."""
    if not features:
        return []
    named = any(isinstance(f, str) for f in features)
    id_range = tf.stack([tf.stack([tf.reduce_min(tf.cast(i, tf.int64)), tf.reduce_max(tf.cast(i, tf.int64))])
                         for i in ids])
    cardinalities = tf.constant(list(cardinalities), tf.int64)
    in_range = tf.logical_and(id_range[:, 0] >= 0, id_range[:, 1] < cardinalities)
    return [tf.debugging.Assert(tf.reduce_all(in_range), [
        "embedding ids out of range [0, cardinality) in features (0-based):",
        tf.boolean_mask(tf.constant([str(f) for f in features]) if named else tf.constant(list(features), tf.int64),
                        tf.logical_not(in_range)),
        "min/max ids:", id_range, "cardinalities:", cardinalities], summarize=64)]


class Jagged(NamedTuple):
    """Which rows of the multi-hot inputs hold ids, with data-parallel input at N > 1 ranks: only
    those rows travel in the exchange and its reverse (the others are zeros, their gradients unused)."""
    local: Dict[int, tf.Tensor]   # per multi-hot feature of any rank's static shards: [m_f b] bool, this rank's rows
    owned: Dict[int, tf.Tensor]   # per multi-hot feature of this rank's static shards: [N] int32, each rank's count


class LookedUp(NamedTuple):
    """What `lookup` returns: rows and the variable indices they came from (for gradients)."""
    shard_rows: List[tf.Tensor]        # per local shard: [m B, w] (a routed shard: [K, w], its ids'; a
                                       # jagged one: the rows that hold ids, rank by rank, `_exchange_ids`)
    shard_indices: List[tf.Tensor]     # per local shard: [K] row indices into its variable
    shard_ids: List[FlatIds]           # per local shard: its feature's ids (a routed shard: its rows)
    replicated_rows: List[tf.Tensor]   # per replicated table: [b, D_f]
    replicated_ids: List[FlatIds]      # per replicated table: its feature's ids
    routes: Optional[Routes] = None    # the routed shards' (None: the plan has none at this world size)
    jagged: Optional[Jagged] = None    # data-parallel input at N > 1 ranks (None: every row travels)


class DistributedEmbedding(tf.Module):
    """The F embedding tables of a model, placed by `plan`, executed with `collectives`.

    Variables: `shard_variables` (this rank's shards, model-parallel: updated here only, never
    allreduced; a row shard has one spare row at the end) and `replicated_variables` (whole
    tables on every rank, data-parallel).

    Input: F id tensors. Model-parallel input (the default): feature f is [B] if this rank holds
    a shard of it, [b] if it is replicated, and ignored otherwise (pass an empty tensor);
    `input_rows(f)` says which. Data-parallel input: every feature [b]. A multi-hot feature is
    a ragged [B, None] or [b, None] instead, combined by `combiners[f]` ("sum" or "mean").
    `inputs_per_table[f]` = m_f > 1 (default 1): table f is read by m_f inputs, its ids theirs
    concatenated input by input ([m_f B] or [m_f b]), its output [m_f b, D_f] likewise.
    Tables start as `shard_initial_value`, or zeros with `zeros_initializer`; each table variable
    is `make_variable(initial value, name=...)` (a tf.Variable; ranking's distributed-embeddings
    front door makes them Keras weights).

    Shards the plan puts on disk (`plan.tier(rank, f)`, see tiered.py) keep their rows and slots
    in files under `store_path` and a cache of the tier's `cache_rows` rows in their variables,
    victims chosen by `cache_policy`; their ids must pass through `staged` before the lookup.

    Tables of kind "dynamic" (planner rule 2) take raw int64 ids: each of this rank's hash shards
    is a DynamicTable (`dynamic`, by shard) whose variable is the shard's, mapping the ids of its
    hash range (`hash_shards`) to rows at the global step before the gathers, the others reading
    zeros as a row shard's do; at N > 1 ranks a table of S > 1 hash shards is routed instead (each
    owner receives, maps and returns only its shards' ids: routing.py); its rows >= 0 are updated by
    its own optimizer; its checkpoint holds
    its live rows (`dynamic_name(s)`; restored at another shard count within `restoring`), its
    counts are in `dynamic_stats` and `store_stats`. A hash shard the plan puts on disk (one a rank)
    keeps its rows and slots in the store and its DynamicTable's variable is the cache
    (tiered.DynamicUnit); its map stays in memory and decides in the step, as in memory.

    Its collective operations are named after `name` (`<name>_rows`, ...): two embeddings of one
    model need different names.

    Changed rows: every table records per row the global step that last updated it (0: never),
    `updated_at` [rows, 1] int32 beside the table (one per row range: a table's column slices
    share one; tables on disk: in host memory, set when a training batch is staged), saved
    with the optimizer state as tensor `<table>/updated_at`; an export compares it with an earlier
    export's step to write only the rows updated since (deployment/exporter/deltas.py).
    """

    def __init__(self, plan: Plan, collectives, seed, data_parallel_input: bool = False,
                 combiners: Optional[Sequence[str]] = None, zeros_initializer: bool = False,
                 store_path: Optional[str] = None, cache_policy: str = "lru", make_variable=tf.Variable,
                 inputs_per_table: Optional[Sequence[int]] = None, name="embedding"):
        super().__init__(name=name)
        self.plan, self.comm = plan, collectives
        self.data_parallel_input = data_parallel_input
        self.combiners = list(combiners or ["sum"] * len(plan.tables))
        if len(self.combiners) != len(plan.tables) or set(self.combiners) - set(COMBINERS):
            raise ValueError(f"combiners: one of {', '.join(COMBINERS)} per table ({len(plan.tables)}), got {combiners}")
        self.inputs_per_table = list(inputs_per_table or [1] * len(plan.tables))
        if len(self.inputs_per_table) != len(plan.tables) or min(self.inputs_per_table) < 1:
            raise ValueError(f"inputs_per_table: a positive count per table ({len(plan.tables)}), "
                             f"got {inputs_per_table}")
        self.rank, self.size = collectives.rank, collectives.size
        self.shards = plan.shards_on(self.rank)
        self.replicated = plan.replicated
        tables = plan.tables
        self.cardinalities = [t.rows for t in tables]
        self.dims = [t.dim for t in tables]

        def initial_value(s: Shard) -> tf.Tensor:
            if zeros_initializer:
                return tf.zeros([s.num_rows, s.width])
            return shard_initial_value(tables[s.feature].rows, tables[s.feature].dim, s, (seed[0], seed[1] + s.feature))

        self._initial_value = initial_value
        self.shard_variables, self.updated_at = [], []   # updated_at: per shard, None for a later column slice
        self.dynamic: Dict[Shard, DynamicTable] = {}   # hash shard -> its dynamic table (variable, slots, updated_at)
        units = {}
        for s in self.shards:
            table, tier = tables[s.feature], plan.tier(self.rank, s.feature)
            if table.kind == "dynamic":   # a hash shard: the table's seed and initial range in every shard
                d = table.dynamic
                self.dynamic[s] = DynamicTable(
                    self.dynamic_name(s), s.num_rows, s.width, (seed[0], seed[1] + s.feature), d.admit_after,
                    d.policy, d.ttl, zeros_initializer=zeros_initializer, initializer_rows=d.capacity,
                    cache_rows=tier.cache_rows)
                self.shard_variables.append(self.dynamic[s].variable)
                self.updated_at.append(None)
                if tier.kind == "disk":   # its rows in the store, its cache the table's variable (one shard a rank)
                    k, n = table.shards.index(s), len(table.shards)
                    units[s.feature] = DynamicUnit(s.feature, self.dynamic[s], tier.cache_rows, None if n == 1 else
                                                   lambda ids, k=k, n=n: hash_shards(ids, n).numpy() == k)
                continue
            if tier.kind == "disk":   # a cache of C rows and the spare row, filled by staging
                value = tf.zeros([tier.cache_rows + 1, s.width])
            else:
                value = initial_value(s)
                if table.kind == "row":   # the spare row that out-of-shard ids read (and is never saved)
                    value = tf.concat([value, tf.zeros([1, s.width])], axis=0)
            with tf.device("/CPU:0" if tier.kind == "host" else None):   # host: GPU runs' big tables
                self.shard_variables.append(make_variable(value, name=self.variable_name(s)))
            if tier.kind == "disk":
                unit = units.setdefault(s.feature, Unit(s.feature, s.row_start, s.num_rows, tier.cache_rows))
                unit.variables.append(self.shard_variables[-1])
            # (tables on disk: the unit's host array, indexed by row, not by cache slot)
            with tf.device(self.shard_variables[-1].device):
                self.updated_at.append(tf.Variable(tf.zeros([self.shard_variables[-1].shape[0], 1], tf.int32),
                                                   trainable=False, name=f"{self.variable_name(s)}/{UPDATED_AT}")
                                       if s.col_start == 0 and tier.kind != "disk" else None)
        if units and data_parallel_input and self.size > 1:
            raise ConfigError("--data_parallel_input: tables on disk need their ids on the owner rank before the step")
        self.tiered = DiskTier(units, self.cardinalities, store_path, cache_policy, self.rank) if units else None
        # Tables in host memory are gathered and updated where they are, outside the XLA islands.
        self._on_host = any(plan.tier(self.rank, s.feature).kind == "host" for s in self.shards)
        whole = [Shard(f, self.rank, 0, tables[f].rows, 0, tables[f].dim) for f in self.replicated]
        self.replicated_variables = [make_variable(initial_value(s), name=self.table_name(s.feature))
                                     for s in whole]
        self.updated_at += [tf.Variable(tf.zeros([s.num_rows, 1], tf.int32), trainable=False,
                                        name=f"{self.table_name(s.feature)}/{UPDATED_AT}") for s in whole]
        # Positions in variables_in_order (and updated_at): a dynamic table's variable (its own
        # optimizer's) and the others (the table optimizer's).
        self._dynamic_at = {i: self.dynamic[s] for i, s in enumerate(self.shards) if s in self.dynamic}
        self._static_at = [i for i in range(len(self.variables_in_order)) if i not in self._dynamic_at]
        self.global_features = plan.features_on(self.rank)
        # Routed: the dynamic tables in S > 1 hash shards at N > 1 ranks (their shards rank by rank).
        self.router = Router(plan, collectives, self.inputs_per_table, data_parallel_input, name)
        # Static layout of the exchange: W_i, the floats rank i sends per local sample (its shards'
        # widths, each times its table's inputs; routed shards apart); rank i's block holds its shards
        # in order, shard s as [m_f b, w_s]; for every feature, the (index in every rank's shards,
        # shard) pairs that make it up.
        m = self.inputs_per_table
        self._static_on = [[s for s in plan.shards_on(r) if s.feature not in self.router.features]
                           for r in range(self.size)]
        self._widths = [sum(m[s.feature] * s.width for s in shards) for shards in self._static_on]
        self._all_shards = [s for shards in self._static_on for s in shards]
        self._exchanged = sorted({s.feature for s in self._all_shards})
        pieces = {f: [] for f in range(len(tables))}
        for k, s in enumerate(self._all_shards):
            pieces[s.feature].append((k, s))
        # Column slices may sit on any ranks: join them in column order.
        self._pieces = {f: sorted(p, key=lambda piece: piece[1].col_start) for f, p in pieces.items()}
        self._features_of = [[f for f in plan.features_on(r) if f not in self.router.features]
                             for r in range(self.size)]   # the ids `_exchange_ids` carries
        self._lookup = tf.function(self._lookup_impl, jit_compile=True, autograph=False)
        self.optimizer, self._step = None, None   # set_optimizer
        self._resharding: Dict[int, List[str]] = {}   # inside `restoring`: feature -> its saved hash shards

    def table_name(self, feature: int) -> str:
        """The name of feature's whole table (checkpoints use it for every shard of the table)."""
        return f"{self.name}/table_{feature}"

    def dynamic_name(self, s: Shard) -> str:
        """The name of a dynamic table's hash shard `s` (its checkpoint tensors' prefix): the
        table's name if it has one shard, else `<table>/shard_<k>` for its k-th."""
        shards = self.plan.tables[s.feature].shards
        return self.table_name(s.feature) + (f"/shard_{shards.index(s)}" if len(shards) > 1 else "")

    def variable_name(self, s: Shard) -> str:
        if self.plan.tables[s.feature].kind == "whole":
            return self.table_name(s.feature)
        return f"{self.table_name(s.feature)}/rows_{s.row_start}_{s.row_end}/cols_{s.col_start}_{s.col_end}"

    @property
    def variables_in_order(self) -> List[tf.Variable]:
        """Shard variables, then replicated ones: the order of `gradients`' output."""
        return self.shard_variables + self.replicated_variables

    def input_rows(self, feature: int) -> str:
        """Which ids of `feature` this rank's input carries: "global" ([B]), "local" ([b]) or "none"."""
        if self.data_parallel_input or feature in self.replicated:
            return "local"
        return "global" if feature in self.global_features else "none"

    def __call__(self, ids: Sequence[tf.Tensor], local_batch, training: bool = False) -> List[tf.Tensor]:
        """ids (see the class docstring) -> F features [b, D_f] of the local batch of b rows."""
        return self.exchange(self.lookup(ids, training), local_batch)

    # Forward -----------------------------------------------------------------------------------

    def lookup(self, ids: Sequence[tf.Tensor], training: bool = False) -> LookedUp:
        """Gathers this rank's rows. Training runs the gathers as one XLA-compiled function (faster
        on large batches; one-hot only, since multi-hot id counts vary from batch to batch); ids
        outside [0, cardinality) fail a check either way. A dynamic table's ids are raw int64 values
        (any): its DynamicTable maps them to rows at the global step (training: admitting and
        evicting), before the gathers; a routed table's (routing.py) after the data-parallel input
        exchange gives each hash shard's owner its own ids only (model-parallel input: the owner
        keeps its own of the global ids)."""
        ids, exchange_checks, routes, owned_ids, jagged = list(ids), [], None, [], None
        if self.data_parallel_input and self.size > 1:   # the routed tables' ids in the same exchange
            local = {f: ids[f].row_lengths() > 0 for f in self._exchanged if isinstance(ids[f], tf.RaggedTensor)}
            ids, routes, owned_ids, exchange_checks, held = self._exchange_ids(ids)
            jagged = Jagged(local, {f: held[f] for f in self._exchanged if f in held})
        checked = self.global_features + self.replicated if not self.data_parallel_input or self.size == 1 \
            else list(range(len(ids)))
        flat = {f: flatten_ids(ids[f], self.combiners[f]) for f in checked}
        if self.router.shards and not self.data_parallel_input:
            routes, owned_ids = self.router.keep_own(flat)
        full = []   # every dynamic table's capacity, checked at once: one line names all too small
        shard_ids = [None if s.feature in self.router.features else
                     self._dynamic_rows(s, flat[s.feature], training, full) if s in self.dynamic else flat[s.feature]
                     for s in self.shards]
        replicated_ids = [flat[f] for f in self.replicated]
        one_hot = all(flat[f].sample is None for f in checked)
        lookup = self._lookup if training and one_hot and not self._on_host else self._lookup_impl
        ranged = [f for f in checked if self.plan.tables[f].kind != "dynamic"]   # a dynamic table takes any int64
        checks = check_ids(ranged, [flat[f].ids for f in ranged], [self.cardinalities[f] for f in ranged])
        with tf.control_dependencies(checks + exchange_checks):   # a routed shard's own ids, varying in number
            routed = [self.dynamic[s].rows(ids_s, self._step, training, full)
                      for s, ids_s in zip(self.router.on[self.rank], owned_ids)]
        with tf.control_dependencies(checks + exchange_checks + capacity_check(full, self._step)):
            rows, indices, replicated_rows = lookup(shard_ids, replicated_ids)
            for s, owned, i in zip(self.router.on[self.rank], routes.owned if routes else [], routed):
                # outside the compiled gathers; -1 reads zeros
                k = self.shards.index(s)
                gathered = tf.where((i >= 0)[:, None], tf.gather(self.shard_variables[k], tf.maximum(i, 0)), 0.0)
                rows[k] = gathered if owned.weights is None else gathered * owned.weights[:, None]
                indices[k], shard_ids[k] = i, FlatIds(i, None, None, None)
        return LookedUp(rows, indices, shard_ids, replicated_rows, replicated_ids, routes, jagged)

    def _dynamic_rows(self, s: Shard, flat: FlatIds, training: bool, full: list) -> FlatIds:
        """A dynamic table's hash shard `s`: raw ids -> its rows (-1: none, or another shard's id),
        outside the compiled lookup; the shard's DynamicTable sees its own ids in batch order (its
        capacity check appended to `full`)."""
        table, shards = self.dynamic[s], self.plan.tables[s.feature].shards
        if len(shards) == 1:
            return flat._replace(ids=table.rows(flat.ids, self._step, training, full))
        mine = tf.equal(hash_shards(flat.ids, len(shards)), shards.index(s))
        rows = table.rows(tf.boolean_mask(flat.ids, mine), self._step, training, full)
        return flat._replace(ids=tf.tensor_scatter_nd_update(tf.fill(tf.shape(flat.ids), -1), tf.where(mine), rows))

    def _lookup_impl(self, shard_ids: List[FlatIds], replicated_ids: List[FlatIds]):
        rows, indices = [], []
        for s, var, flat in zip(self.shards, self.shard_variables, shard_ids):
            if flat is None:   # a routed shard's, looked up after
                rows.append(None)
                indices.append(None)
                continue
            i = flat.ids
            if s in self.dynamic:   # rows from DynamicTable.rows; -1 (none) reads zeros
                index = i
                gathered = tf.where((i >= 0)[:, None], tf.gather(var, tf.maximum(i, 0)), 0.0)
            elif self.tiered and s.feature in self.tiered.units:   # staged: cache slots, the spare row C outside
                spare = self.tiered.units[s.feature].capacity
                index = i
                gathered = tf.gather(var, index)
                if self.plan.tables[s.feature].kind == "row":
                    gathered = tf.where((index < spare)[:, None], gathered, 0.0)
            elif self.plan.tables[s.feature].kind == "row":
                local = i - tf.cast(s.row_start, i.dtype)
                inside = tf.logical_and(local >= 0, local < s.num_rows)
                index = tf.where(inside, local, tf.cast(s.num_rows, i.dtype))   # the spare row
                gathered = tf.where(inside[:, None], tf.gather(var, index), 0.0)
            else:
                index = i
                gathered = tf.gather(var, index)
            rows.append(combine(gathered, flat))
            indices.append(index)
        replicated_rows = [combine(tf.gather(var, flat.ids), flat)
                           for var, flat in zip(self.replicated_variables, replicated_ids)]
        return rows, indices, replicated_rows

    def _exchange_ids(self, ids: List[tf.Tensor]):
        """Data-parallel input: every rank's b rows of ids -> (the features this rank holds: a
        one-hot one's B rows, a multi-hot one's rows that hold ids, rank by rank (`Jagged`); the
        routed tables' Routes (None if the plan routes none) and, per routed shard of this rank,
        its ids (routing.py); checks of the amounts received, which the lookup must wait for; per
        multi-hot feature held here, each rank's count of rows that hold ids, [N] int32).
        One all-to-all carries the one-hot ids ([b] each) and, per multi-hot feature, two counts
        (its rows that hold ids, its ids), and after them, to each rank, this rank's ids of the
        routed shards there (`Router.outgoing_ids`: a count per shard and input, then the ids; the
        message int64 then); a second one (only if a feature exchanged here is multi-hot) each
        multi-hot feature's lengths of the rows that hold ids, then its ids. Every rank takes part
        in both, even one that receives nothing; the checks consume every result, so graph
        optimisation never prunes an all-to-all on one rank (the others would wait forever).

        Example, N = 2, b = 2: rank 0 holds feature 0 (one-hot), rank 1 features 1 and 2
        (multi-hot). Global rows 0-1 are rank 0's input, rows 2-3 rank 1's:
            f0: a0 a1 | a2 a3      f1: [p] [q r] | [] [s]      f2: [t u] [] | [v] [w x]
        First all-to-all, each rank sends, per destination rank r, its b ids of every one-hot
        feature of r and two counts of every multi-hot one: rank 0 sends [a0 a1 | 2 3 1 2]
        (counts [2, 4]), rank 1 [a2 a3 | 1 1 2 3]. Rank 1 receives [2 3 1 2 | 1 1 2 3]: per source
        rank and feature, (rows that hold ids, ids). Second all-to-all, per multi-hot feature the
        held rows' lengths, then the ids: rank 0 sends [] to rank 0 and [1 2 p q r | 2 t u] to
        rank 1, rank 1 [1 s | 1 2 v w x] to itself. Rank 1 splits what it receives by those
        counts: f1 = [p] [q r] | [s] (held rows per rank [2 1]), f2 = [t u] | [v] [w x] ([1 2]).
        A table of m inputs (`inputs_per_table`) counts as m features for its one-hot ids, its ids
        [m b] the m inputs' b rows each; it gets their B rows each, concatenated input by input (a
        multi-hot table's rows that hold ids: each rank's in its (input, row) order)."""
        ragged = [isinstance(i, tf.RaggedTensor) for i in ids]
        dtype = tf.int64 if any((i.values if r else i).dtype == tf.int64 for i, r in zip(ids, ragged)) else tf.int32
        m, n = self.inputs_per_table, self.size
        b = num_samples(ids[0]) // m[0]
        features = [f for f in self.global_features if f not in self.router.features]

        def size(f):   # elements of feature f in the first message, from each rank
            return 2 if ragged[f] else m[f] * b

        def first(f):
            if not ragged[f]:
                return ids[f]
            return tf.stack([tf.reduce_sum(tf.cast(ids[f].row_lengths() > 0, tf.int32)), tf.size(ids[f].values)])

        routed = self.router.outgoing_ids({f: flatten_ids(ids[f], self.combiners[f]) for f in self.router.features})
        wire = tf.int64 if self.router.shards else dtype   # the routed ids: int64
        send = [tf.cast(x, wire) for r in range(n) for x in [first(f) for f in self._features_of[r]] + routed.send[r]]
        counts = tf.stack([tf.add_n([0] + [size(f) for f in self._features_of[r]]) +
                           sum(tf.size(x) for x in routed.send[r]) for r in range(n)])
        received = self.comm.alltoall(tf.concat(send, 0) if send else tf.zeros([0], wire), counts,
                                      f"{self.name}_ids")
        lead = tf.add_n([0] + [size(f) for f in features])
        received, routes, owned_ids, checks = self.router.incoming_ids(received, lead, routed)
        parts = tf.split(tf.reshape(tf.cast(received, dtype), [n, -1]), tf.stack([size(f) for f in features]),
                         num=len(features), axis=1) if features else []
        out, held, multi = list(ids), {}, []
        for f, x in zip(features, parts):
            if ragged[f]:
                multi.append((f, tf.cast(x, tf.int32)))   # [N, 2]: held rows, ids
            else:   # [N, m b] (rank, input, row) -> [m B] (input, rank, row)
                out[f] = tf.reshape(tf.transpose(tf.reshape(x, [n, m[f], -1]), [1, 0, 2]), [-1])
        if any(ragged[f] for fs in self._features_of for f in fs):
            values = [[tf.concat([tf.cast(tf.boolean_mask(ids[f].row_lengths(), ids[f].row_lengths() > 0), dtype),
                                  tf.cast(ids[f].values, dtype)], 0) for f in self._features_of[r] if ragged[f]]
                      for r in range(n)]
            received = self.comm.alltoall(
                tf.concat(sum(values, []), 0) if any(values) else tf.zeros([0], dtype),
                tf.stack([tf.add_n([tf.size(v) for v in vs]) if vs else 0 for vs in values]),
                f"{self.name}_multi_hot_ids")
            sizes = tf.stack([tf.reduce_sum(x, axis=1) for _, x in multi], axis=1) if multi else tf.zeros([n, 0],
                                                                                                         tf.int32)
            checks.append(assert_size(received, tf.reduce_sum(sizes), "multi-hot ids"))
            if multi:   # received in (source rank, feature) order: the held rows' lengths, then the ids
                blocks = tf.split(received, tf.reshape(sizes, [-1]), num=n * len(multi))
                for k, (f, x) in enumerate(multi):
                    pieces = [tf.split(blocks[r * len(multi) + k], x[r], num=2) for r in range(n)]
                    out[f] = tf.RaggedTensor.from_row_lengths(tf.concat([p[1] for p in pieces], 0),
                                                              tf.concat([p[0] for p in pieces], 0))
                    held[f] = x[:, 0]
        return out, routes, owned_ids, [c for c in checks if c is not None], held

    def exchange(self, looked_up: LookedUp, local_batch) -> List[tf.Tensor]:
        """This rank's rows -> the F features of the local batch (`local_batch` = b rows, [b, D_f])."""
        out = [None] * len(self.plan.tables)
        for f, rows in zip(self.replicated, looked_up.replicated_rows):
            out[f] = rows
        if self.size == 1:   # every table on this rank, in feature order (a dynamic table's hash shards summed)
            for s, rows in zip(self.shards, looked_up.shard_rows):
                out[s.feature] = rows if out[s.feature] is None else out[s.feature] + rows
            return out
        if not any(self._widths) and not self.router.shards:
            return out
        b, m, jagged = local_batch, self.inputs_per_table, looked_up.jagged
        # To each rank r: each static shard's rows of r's m x b rows, in (input, row) order (jagged:
        # only those that hold ids), then the rows of r's ids in the routed shards here (wire order).
        static = [[] for _ in range(self.size)]
        for s, rows in zip(self.shards, looked_up.shard_rows):
            if s.feature not in self.router.features:
                for r, x in enumerate(self._split_by_rank(rows, s, m[s.feature], jagged)):
                    static[r].append(x)
        routed = self.router.to_wire([looked_up.shard_rows[self.shards.index(s)] for s in self.router.on[self.rank]],
                                     looked_up.routes)
        sizes = [[self._rows_of(s.feature, b, jagged) * s.width for s in shards] for shards in self._static_on]
        received = self.comm.alltoall(
            tf.concat([x for r in range(self.size) for x in static[r] + routed[r]] or [tf.zeros([0])], 0),
            tf.stack([tf.add_n([tf.size(x) for x in static[r]] + [self.router.floats(r, looked_up.routes, mine=True)])
                      for r in range(self.size)]), f"{self.name}_rows")
        received, routed, checks = self.router.from_ranks(received, [tf.add_n([0] + xs) for xs in sizes],
                                                          looked_up.routes, mine=False)
        if checks:
            with tf.control_dependencies(checks):
                received, routed = tf.identity(received), [tf.identity(x) for x in routed]
        pieces = tf.split(received, tf.stack([x for xs in sizes for x in xs]),
                          num=len(self._all_shards)) if self._all_shards else []
        for f, parts in self._pieces.items():
            if parts:
                parts = [tf.reshape(pieces[k], [-1, s.width]) for k, s in parts]
                if jagged and f in jagged.local:   # the rows that hold ids, back in their places
                    where = tf.cast(tf.where(jagged.local[f]), tf.int32)
                    parts = [tf.scatter_nd(where, x, [m[f] * b, x.shape[1]]) for x in parts]
                out[f] = tf.add_n(parts) if self.plan.tables[f].kind in ("row", "dynamic") else tf.concat(parts, axis=1)
        if self.router.shards:   # each id's row summed into its sample's
            for f, rows in self.router.combine(routed, looked_up.routes, b).items():
                out[f] = rows
        return out

    def _by_rank(self, rows: tf.Tensor, m: int) -> tf.Tensor:
        """[m B, w] rows in (input, rank, row) order -> [N, m b w] in (rank, input, row) order."""
        return tf.reshape(tf.transpose(tf.reshape(rows, [m, self.size, -1]), [1, 0, 2]), [self.size, -1])

    def _split_by_rank(self, rows: tf.Tensor, s: Shard, m: int, jagged: Optional[Jagged]) -> List[tf.Tensor]:
        """Shard s's [m B, w] rows (input, rank, row) -> per rank r, flat, r's m x b rows in (input,
        row) order: those that hold ids if the feature is jagged, else all of them."""
        if not jagged or s.feature not in jagged.owned:
            return tf.unstack(self._by_rank(rows, m), num=self.size)
        return tf.split(tf.reshape(rows, [-1]), jagged.owned[s.feature] * s.width, num=self.size)   # rank by rank

    def _rows_of(self, feature: int, b, jagged: Optional[Jagged], rank: Optional[int] = None):
        """How many of a rank's m_f x b rows of `feature` travel: this rank's (`rank` None) or, on
        the feature's owner, rank `rank`'s."""
        if not jagged or feature not in jagged.local:
            return self.inputs_per_table[feature] * b
        if rank is None:
            return tf.reduce_sum(tf.cast(jagged.local[feature], tf.int32))
        return jagged.owned[feature][rank]

    # Backward ----------------------------------------------------------------------------------

    def gradients(self, looked_up: LookedUp, feature_grads: Sequence[tf.Tensor]) -> List[tf.IndexedSlices]:
        """Gradients of the F features ([b, D_f]) -> IndexedSlices for `variables_in_order`."""
        shard_grads = self._reverse_exchange(feature_grads, looked_up.routes, looked_up.jagged)
        grads = [tf.IndexedSlices(spread(g, flat), i, tf.shape(v, out_type=i.dtype))
                 for g, i, flat, v in zip(shard_grads, looked_up.shard_indices, looked_up.shard_ids,
                                          self.shard_variables)]
        for f, flat, var in zip(self.replicated, looked_up.replicated_ids, self.replicated_variables):
            g, ids = spread(feature_grads[f], flat), flat.ids
            if self.size > 1:   # every rank applies the whole batch's rows
                g = self.comm.allgather(g, f"{self.name}_replicated_{f}_grad")
                ids = self.comm.allgather(ids, f"{self.name}_replicated_{f}_ids")
            grads.append(tf.IndexedSlices(g, ids, tf.shape(var, out_type=ids.dtype)))
        return grads

    def _reverse_exchange(self, feature_grads, routes: Optional[Routes], jagged: Optional[Jagged]) -> List[tf.Tensor]:
        """[b, D_f] per feature -> [B, w] per local shard (a routed shard: [K, w], the gradients of
        its ids' rows in global batch order) (the reverse all-to-all)."""
        if self.size == 1:
            return [feature_grads[s.feature] for s in self.shards]
        if not any(self._widths) and not self.router.shards:
            return []
        m = self.inputs_per_table
        b = tf.shape(feature_grads[0])[0] // m[0]
        send, counts = [], []
        for r in range(self.size):   # to rank r: its static shards' [m b, w] (jagged: the rows that hold ids), then
            static = []              # its routed shards' [c, w]
            for s in self._static_on[r]:
                g = feature_grads[s.feature][:, s.col_start:s.col_end]
                if jagged and s.feature in jagged.local:
                    g = tf.boolean_mask(g, jagged.local[s.feature])
                static.append(tf.reshape(g, [-1]))
            send += static + self.router.gradients_to(r, feature_grads, routes)
            counts.append(tf.add_n([tf.size(x) for x in static] + [self.router.floats(r, routes, mine=False)]))
        received = self.comm.alltoall(tf.concat(send, axis=0) if send else tf.zeros([0]), tf.stack(counts),
                                      f"{self.name}_grads")
        static = self._static_on[self.rank]
        sizes = [[self._rows_of(s.feature, b, jagged, r) * s.width for s in static] for r in range(self.size)]
        received, routed, _ = self.router.from_ranks(received, [tf.add_n([0] + xs) for xs in sizes], routes,
                                                     mine=True)
        out = {}
        if static:   # per rank, my shards' rows in a row -> per shard [N, m b, w] (rank, input, row)
            blocks = tf.split(received, tf.stack([x for xs in sizes for x in xs]), num=self.size * len(static))
            for t, s in enumerate(static):
                x = tf.reshape(tf.concat(blocks[t::len(static)], 0), [-1, s.width])
                if not jagged or s.feature not in jagged.owned:   # jagged: the rows as lookup gave them
                    # [N, m b, w] (rank, input, row) -> [m B, w] (input, rank, row)
                    x = tf.reshape(tf.transpose(tf.reshape(x, [self.size, m[s.feature], -1]), [1, 0, 2]),
                                   [-1, s.width])
                out[s] = x
        out.update(self.router.owned_gradients(routed, routes))
        return [out[s] for s in self.shards]

    # Optimizer and checkpoints ---------------------------------------------------------------

    def set_optimizer(self, name: str, step: tf.Variable, beta1: float = 0.9, beta2: float = 0.999,
                      compiled: bool = True, scope: str = "table_optimizer"):
        """Creates the table optimizer ("sgd", "adagrad" or "adam", lazy: see optimizers.py) whose
        slots, shaped as `variables_in_order`, `apply_gradients` updates. `step`: the global step
        counter (int64 [], the trainer's, incremented after each update): an update records step + 1
        as its rows' updated_at. `compiled` false: the update runs op by op (debugging). `scope`:
        the optimizer's name (its update counter is tensor `<scope>/iterations`)."""
        self._step = step
        static = [self.variables_in_order[i] for i in self._static_at]
        static_updated_at = [self.updated_at[i] for i in self._static_at]
        self.optimizer = make_optimizer(name, static, scope, beta1, beta2)
        for table in self.dynamic.values():   # its own optimizer state, checkpointed with its live rows
            table.set_optimizer(name, beta1, beta2)
        if self.tiered:
            self._open_store()

        def update(grads, lr):
            self.optimizer.apply(zip(grads, static), lr)
            step = tf.cast(self._step + 1, tf.int32)
            for grad, updated_at in zip(grads, static_updated_at):
                if updated_at is not None:
                    n = tf.shape(grad.indices)[0]
                    updated_at.scatter_update(tf.IndexedSlices(tf.fill([n, 1], step), grad.indices))
        # The sparse update as one XLA-compiled function: on CPU about 5x faster than TensorFlow's
        # scatter kernels, and only the given rows are written either way. Multi-hot batches (a
        # varying number of ids) take the uncompiled one: XLA would recompile every step.
        compiled = compiled and not self._on_host
        self._update = {False: tf.function(update, jit_compile=True, autograph=False) if compiled else update,
                        True: update}

    def _open_store(self):
        """Creates the disk tier's files: tables from their initial values, slots as fresh slot rows."""
        slots = self.optimizer.slots
        shards = {f: [s for s in self.shards if s.feature == f] for f in self.tiered.units}
        parts = {f: [unit.table.parts] if isinstance(unit, DynamicUnit) else
                 [[v] + list(slots[v.ref()].values()) for v in unit.variables]
                 for f, unit in self.tiered.units.items()}

        def initial_rows(unit, i, j, start, stop):   # a dynamic table's rows: zeros until admitted
            s = shards[unit.feature][i]
            if j == 0 and not isinstance(unit, DynamicUnit):
                return self._initial_value(dataclasses.replace(s, row_start=s.row_start + start,
                                                               row_end=s.row_start + stop)).numpy()
            return np.broadcast_to(parts[unit.feature][i][j][0].numpy(), (stop - start, s.width))

        self.tiered.open(parts, initial_rows)

    def staged(self, elements, training: bool):
        """Elements (numerical, ids, ...) ready for the lookup: with tables on disk, their ids
        become cache slots, staged one element ahead (tiered.py); otherwise `elements` itself.
        Training: the k-th element's rows get updated_at step + k (the step counter now, k from 1)."""
        if not self.tiered:
            return elements
        return self.tiered.staged(elements, training, int(self._step.numpy()) + 1 if training else None)

    def store_stats(self) -> dict:
        """The disk tier's figures since the last call (tiered.DiskTier.stats), and every dynamic
        table's counts (`dynamic_stats`) as `<table>/<count>`; {} without either."""
        stats = self.tiered.stats() if self.tiered else {}
        stats.update({f"{table}/{k}": v for table, counts in self.dynamic_stats().items() for k, v in counts.items()})
        return stats

    def close(self):
        """Removes the disk tier's files (the checkpoint is the durable state)."""
        if self.tiered:
            self.tiered.close()

    def apply_gradients(self, grads: Sequence[tf.IndexedSlices], lr: tf.Tensor, multi_hot: bool):
        """Updates the rows named by `grads` (`gradients`' output, rescaled at will) and their
        optimizer slots, at learning rate `lr`, and records the step counter + 1 as their
        updated_at; `multi_hot`: the batch had a multi-hot feature. A dynamic table updates only
        its rows >= 0 (an id without a row gets no update), by its own optimizer, uncompiled."""
        for i, table in self._dynamic_at.items():
            table.apply_gradients(grads[i].indices, grads[i].values, lr, self._step)
        self._update[multi_hot]([grads[i] for i in self._static_at], lr)

    def dynamic_stats(self) -> Dict[str, Dict[str, int]]:
        """Per dynamic table, by table name: its live rows and its admitted, evicted and refused
        ids since the start of its lineage (id_map's totals, checkpointed), summed over its hash
        shards on every rank (at N ranks a collective: every rank calls it at the same point)."""
        stats: Dict[str, Dict[str, int]] = {}
        for s, table in self.dynamic.items():
            total = stats.setdefault(self.table_name(s.feature), dict.fromkeys(DYNAMIC_COUNTS, 0))
            for k, v in table.counts().items():
                if k in total:
                    total[k] += v
        if self.size > 1 and any(t.kind == "dynamic" for t in self.plan.tables):
            merged: Dict[str, Dict[str, int]] = {}
            for part in self.comm.allgather_object(stats, f"{self.name}_dynamic_stats"):
                for name, counts in part.items():
                    total = merged.setdefault(name, dict.fromkeys(DYNAMIC_COUNTS, 0))
                    for k, v in counts.items():
                        total[k] += v
            stats = dict(sorted(merged.items()))
        return stats

    def variables_by_name(self) -> Dict[str, tf.Variable]:
        """This rank's table variables and table optimizer state, by stable variable name."""
        named = {v.name.split(":")[0]: v for v in self.variables_in_order + self.updated_at if v is not None}
        named.update(self.optimizer.variables_by_name() if self.optimizer else {})
        for table in self.dynamic.values():
            named.update({v.name.split(":")[0]: v for v in [table.updated_at] + list(table.slots.values())
                          if v is not None})
            named.update(table.optimizer.variables_by_name())
        return named

    def checkpoint_entries(self, weights_only: bool = False) -> List[Entry]:
        """This rank's tables as parts of world-size-independent tensors: tensor `table_name(f)` is
        feature f's whole table [rows_f, D_f]; shard s holds its rows [row_start, row_end) x columns
        [col_start, col_end) (not the spare row), a replicated table all of it (rank 0 saves it).
        Unless `weights_only`, the optimizer's state too: slot k of a table as tensor
        `table_name(f)/k`, cut as the table, the update counter (replicated), and the rows' updated_at
        [rows_f, 1] int32 as tensor `table_name(f)/updated_at`. A dynamic table's hash shard: its
        live rows only (DynamicTable.checkpoint_entries, under `dynamic_name(s)`, sized by the
        checkpoint on restore; inside `restoring`, a table saved in another number of hash shards:
        entries that read them all and re-hash their ids into this run's shards)."""
        slots = self.optimizer.slots if self.optimizer and not weights_only else {}
        entries = []
        sources = {}
        for unit in (self.tiered.units.values() if self.tiered else ()):
            if isinstance(unit, DynamicUnit):   # its DynamicTable's entries, below
                continue
            sources.update({v.ref(): parts for v, parts in zip(unit.variables, self.tiered.sources(unit))})
            if slots and any(s.feature == unit.feature and s.col_start == 0 for s in self.shards):
                entries.append(Entry(f"{self.table_name(unit.feature)}/{UPDATED_AT}",
                                     self.tiered.updated_at(unit, lambda: int(self._step.numpy())),
                                     (self.cardinalities[unit.feature], 1), unit.row_start))
        for s, table in self.dynamic.items():   # its live rows only (dynamic_table.py)
            if s.feature not in self._resharding:
                entries += table.checkpoint_entries(weights_only or not self.optimizer)
        for f, saved in self._resharding.items():
            entries += self._resharded_entries(f, saved, weights_only or not self.optimizer)
        for s, var, updated_at in zip(self.shards, self.shard_variables, self.updated_at):
            if s in self.dynamic:
                continue
            name, shape = self.table_name(s.feature), (self.cardinalities[s.feature], self.dims[s.feature])
            pieces = self._with_slots(name, var, slots)
            if var.ref() in sources:   # on disk: streamed from and to the store
                pieces = [(tensor, source) for (tensor, _), source in zip(pieces, sources[var.ref()])]
            entries += [Entry(tensor, v, shape, s.row_start, s.col_start, None if var.ref() in sources else s.num_rows)
                        for tensor, v in pieces]
            if slots and updated_at is not None:
                entries.append(Entry(f"{name}/{UPDATED_AT}", updated_at, (shape[0], 1), s.row_start, 0, s.num_rows))
        replicated = {tensor: v for f, var in zip(self.replicated, self.replicated_variables)
                      for tensor, v in self._with_slots(self.table_name(f), var, slots)}
        if self._counted(weights_only):
            replicated[self.optimizer.iterations.name.split(":")[0]] = self.optimizer.iterations
        if slots:
            replicated.update({f"{self.table_name(f)}/{UPDATED_AT}": v
                               for f, v in zip(self.replicated, self.updated_at[len(self.shards):])})
        return entries + replicated_entries(replicated)

    def _counted(self, weights_only: bool) -> bool:
        """Whether checkpoints hold the table optimizer's update counter: with the optimizer's state,
        when the plan has a table that is not dynamic (on any rank: the counter is replicated; each
        dynamic table counts its own updates)."""
        return bool(self.optimizer) and not weights_only and any(t.kind != "dynamic" for t in self.plan.tables)

    @staticmethod
    def _with_slots(name: str, var: tf.Variable, slots: dict) -> list:
        """(tensor name, variable) of a table variable and of its optimizer slots."""
        return [(name, var)] + [(f"{name}/{k}", slot) for k, slot in slots.get(var.ref(), {}).items()]

    def checkpoint_names(self, weights_only: bool = False) -> Set[str]:
        """Every tensor of `checkpoint_entries` on any rank: the logical tensors of the tables in a
        complete checkpoint."""
        tables = self.plan.tables
        names = {self.table_name(f) for f in range(len(tables)) if tables[f].kind != "dynamic"}
        if self.optimizer and not weights_only:
            names |= {f"{name}/{k}" for name in names for k in self.optimizer.slot_names + (UPDATED_AT,)}
        if self._counted(weights_only):
            names.add(self.optimizer.iterations.name.split(":")[0])
        slots = self.optimizer.slot_names if self.optimizer else ()
        for t in tables:
            prefixes = self._resharding.get(t.feature, [self.dynamic_name(s) for s in t.shards]) \
                if t.kind == "dynamic" else []
            for prefix in prefixes:
                names.update(tensor_names(prefix, t.dynamic.policy, slots, weights_only or not self.optimizer))
        return names

    def _resharded_entries(self, feature: int, saved: List[str], weights_only: bool) -> List[Entry]:
        """Restore-only entries of dynamic table `feature` saved in the hash shards `saved` (their
        tensor prefixes): every rank holding one of its shards reads them all (dynamic_table.reshard)."""
        t = self.plan.tables[feature]
        tables = {t.shards.index(s): table for s, table in self.dynamic.items() if s.feature == feature}
        if not tables:
            return []
        slots = list(next(iter(tables.values())).slots)
        name = self.table_name(feature)
        names = [n[len(name):].lstrip("/") for n in tensor_names(name, t.dynamic.policy, slots, weights_only)]
        return resharded_entries(name, saved, names, tables, [s.num_rows for s in t.shards],
                                 lambda ids: hash_shards(ids, len(t.shards)).numpy())

    @contextlib.contextmanager
    def restoring(self, tensors: Dict[str, dict]):
        """The block that restores a checkpoint whose manifest's "tensors" are `tensors`: checks them
        (check_checkpoint), and within the block `checkpoint_entries` and `checkpoint_names` take a
        dynamic table saved in another number of hash shards in the checkpoint's shards (their ids
        re-hashed into this run's on restore: dynamic_table.reshard says what is kept exactly)."""
        self.check_checkpoint(tensors)
        self._resharding = {}
        for t in self.plan.tables:
            saved = self._saved_shards(t.feature, tensors)
            if t.kind == "dynamic" and saved and len(saved) != len(t.shards):
                self._resharding[t.feature] = saved
        try:
            yield self
        finally:
            self._resharding = {}

    def _saved_shards(self, feature: int, tensors: Dict[str, dict]) -> List[str]:
        """The tensor prefixes of a table's dynamic hash shards in a checkpoint (by shard; [] if it
        holds the table static): the table's name, or `<table>/shard_<k>` for k < P."""
        name = self.table_name(feature)
        saved = [n[:-len(IDS) - 1] for n in tensors if n.startswith(f"{name}/") and n.endswith(f"/{IDS}")]
        return sorted(saved, key=lambda prefix: int(prefix.rsplit("_", 1)[1]) if prefix != name else -1)

    def check_checkpoint(self, tensors: Dict[str, dict]):
        """Raises ConfigError, one line naming the table, where a checkpoint's tensors (its manifest's
        "tensors") hold a dynamic table as static or the reverse (a dynamic table checkpoints its ids)."""
        for t in self.plan.tables:
            name = self.table_name(t.feature)
            saved = self._saved_shards(t.feature, tensors)
            if (name in tensors or saved) and bool(saved) != (t.kind == "dynamic"):
                raise ConfigError(
                    f"table {name} (feature {t.feature}) is {'dynamic' if t.kind == 'dynamic' else 'static'} in this "
                    f"run, {'dynamic' if saved else 'static'} in the checkpoint: a table's kind cannot change "
                    "across a restore (--dynamic_tables)")
