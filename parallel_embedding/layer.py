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
import dataclasses
import math
from typing import Dict, List, Optional, Sequence

import numpy as np
import tensorflow as tf

from parallel_embedding import UPDATED_AT
from parallel_embedding.choices import COMBINERS
from parallel_embedding.dynamic_table import DynamicTable, capacity_check
from parallel_embedding.exchange import Exchange, Jagged, LookedUp
from parallel_embedding.ids import FlatIds, check_ids, combine, flatten_ids
from parallel_embedding.optimizers import make_optimizer
from parallel_embedding.planner import Plan, Shard, plan_tables  # noqa: F401 (plan_tables: the example)
from parallel_embedding.routing import Router, hash_shards
from parallel_embedding.table_state import TableState
from parallel_embedding.tiered import DiskTier, DynamicUnit, Unit
from utils.errors import ConfigError

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


class DistributedEmbedding(Exchange, TableState, tf.Module):
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


    # Backward ----------------------------------------------------------------------------------


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


