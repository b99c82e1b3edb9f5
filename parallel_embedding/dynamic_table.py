"""A dynamic embedding table: raw 64-bit ids in, no vocabulary, admission and eviction
(DistributedEmbedding holds one per hash shard of a table of kind "dynamic"). Its state: an id map
(id_map.IdMap: raw id -> row), the rows [capacity, D], their optimizer slots [capacity, D] and
updated_at [capacity, 1] int32.

    table = DynamicTable(name, capacity, dim, seed, admit_after=1, policy="lru", ttl=0,
                         candidate_slots=0, optimizer="sgd", zeros_initializer=False, initializer_rows=0,
                         cache_rows=0)      cache_rows C > 0: its rows on disk (below)
    rows, emb = table.lookup(ids, step, training)   ids [n] int64 raw -> rows [n] int32 (-1: no row),
                                        emb [n, D]; an id without a row (refused: not yet admitted,
                                        or no row to reuse under ttl; unknown, not training) reads
                                        zeros. Training: new rows, and their slots and updated_at,
                                        are re-initialised before they are read
    table.apply_gradients(rows, grads, lr, step)    grads [n, D] of emb: only rows >= 0 (and
                                        their slots) change; their updated_at becomes step + 1
    rows = table.rows(ids, step, training, full=None)   the rows alone (lookup's first half:
                                        admission, eviction, re-initialisation; the caller gathers
                                        rows >= 0); `full` a list: the capacity check left to the
                                        caller (capacity_check over several tables' entries)
    table.set_optimizer(name, beta1, beta2, scope)  replaces the constructor's optimizer (fresh slots)
    table.parts                         [variable, slot variables...] (on disk: a row's parts)
    table.counts()                      {live, capacity, candidates, admitted, evicted, refused}
    entries = table.checkpoint_entries(weights_only)    storage.checkpoint entries of the live rows
                                        only, sized by the checkpoint when restored: tensors `<name>`
                                        [L, D], `<name>/<slot>` [L, D], `<name>/updated_at` [L, 1]
                                        int32, `<name>/ids` [L, 1] int64 (in eviction order),
                                        `<name>/counts` (lfu) or `<name>/last_used` (ttl) [L, 1] int32,
                                        `<name>/candidates` [M, 3] int64 (id, sightings, last seen),
                                        `<name>/totals` [1, 3] int64, `<name>/iterations` [1, 1] int64
                                        (the optimizer's updates); `weights_only`: without the slots
                                        and `iterations` (restored: the live rows' slots start fresh).
                                        The ids and the rest of [L, 1] or less are a snapshot taken now,
                                        restored first (the table takes their state: restore_tensors);
                                        the rows, slots and updated_at are streamed (RowSources): saved
                                        from the live rows of the snapshot and restored into rows
                                        0..L-1 a block of rows at a time (storage.checkpoint.BLOCK_BYTES;
                                        on disk between the store and the files, never L rows at once)
    table.checkpoint_names(weights_only)    those tensors' names
    table.restore(path)                 the table from a checkpoint (storage.checkpoint.restore of its
                                        entries): its live ids take rows 0..L-1 in eviction order
    capacity_check(full, step)          fails the step with one line naming every table whose batch
                                        had more distinct ids to admit than rows
    op_error(e)                         the one line of that failure, of an id map op's error or of
                                        the disk tier's in the step, or None for any other exception
    reshard(parts, policy, shards, shard_of)    a table's in-memory checkpoint tensors in P hash
                                        shards -> in `shards`, and each saved live row's new shard
                                        and row (what is kept exactly and what is not: its docstring)
    resharded_entries(...)              restore-only entries that read P saved shards and restore
                                        this rank's new ones through `reshard`, the rows and slots
                                        streamed into their new rows a block at a time

On disk (`cache_rows` C > 0; parallel_embedding/tiered.py): the map stays in memory and runs in
the step as above, the variable and slots [C, D] are a cache of the rows, updated_at is kept per
row by the store, and `store` (a RowStore, set by the disk tier) holds the rest:
    store.place(rows [n], step, codes [n]) -> slots [n] int32   the map's rows (-1: none) as cache
                                        slots, in the step (codes None: not training): missing rows
                                        read, admitted rows (codes ADMITTED, EVICTED) given a slot
                                        unread (the step re-initialises it); training: updated_at
                                        of the rows >= 0 becomes step + 1
    store.read(rows [n], j) -> [n, D] float32   part j (0: the row, then the k slots, `parts`'
                                        order) of rows [n], through the cache (a checkpoint's block)
    store.clear()                       empties the cache (a restore begins)
    store.write(rows, j, values [n, D])  part j of rows (a slice, or [n]) in the file (a restore's block)
    store.updated_at                    [capacity] int32, per row, in host memory
So the step computes exactly what it computes in memory, on cache slots instead of rows.

Rows are re-initialised as a static table's: U(-sqrt(1/rows), sqrt(1/rows)), rows = capacity or
`initializer_rows` (zeros with `zeros_initializer`), the values a hash of (seed, id, step, column)
(`initial_values`): they do not depend on the id's position in the batch, nor on which hash
shard or rank admits it. Slots take the optimizer's initial value, updated_at 0. Policies, admission and what a step is: id_map's
docstring. A batch with more distinct ids to admit than rows fails with one line naming the table.
LRU needs only the eviction order: it checkpoints no counters.
"""
import math
import re
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

import id_map
from parallel_embedding import UPDATED_AT
from parallel_embedding.optimizers import make_optimizer
from storage import checkpoint
from storage.checkpoint import Entry
from utils.errors import CheckpointError, ConfigError

IDS, TOTALS, CANDIDATES, ITERATIONS = "ids", "totals", "candidates", "iterations"
ORDER_KEY = {"lru": None, "lfu": "counts", "ttl": "last_used"}   # the per-row state a policy needs


def tensor_names(table: str, policy: str, slots: Sequence[str], weights_only: bool = False) -> List[str]:
    """The names of the checkpoint tensors of dynamic table `table` (DynamicTable.checkpoint_entries)
    under `policy` with optimizer slots `slots`."""
    extra = [ORDER_KEY[policy]] if ORDER_KEY[policy] else []
    optimizer = [] if weights_only else list(slots)
    return [table] + [f"{table}/{k}" for k in optimizer + [UPDATED_AT, IDS] + extra + [CANDIDATES, TOTALS]
                      + ([] if weights_only else [ITERATIONS])]


def capacity_check(full: Sequence[Tuple[str, int, tf.Tensor]], step) -> List[tf.Operation]:
    """That no table of `full` ((name, capacity, full []) of DynamicTable.rows) met a batch with more
    distinct ids to admit than rows, as one line naming every table that did: "dynamic table T:
    capacity C rows is too small for one batch's distinct ids (every row in use at step S)", or
    "dynamic tables T1 (capacity C1 rows), T2 (...): too small for ...". Eagerly: raises ValueError
    with the line, returns []; in a function: [the check], for the rows to depend on."""
    if not full:
        return []
    flags = tf.stack([f for _, _, f in full])
    tail = ["too small for one batch's distinct ids (every row in use at step ",
            tf.strings.as_string(tf.cast(step, tf.int64)), ")"]
    one = tf.strings.join([tf.strings.reduce_join(tf.boolean_mask(
        tf.constant([f"dynamic table {t}: capacity {c} rows is " for t, c, _ in full]), flags))] + tail)
    many = tf.strings.join(["dynamic tables ", tf.strings.reduce_join(tf.boolean_mask(
        tf.constant([f"{t} (capacity {c} rows)" for t, c, _ in full]), flags), separator=", "), ": "] + tail)
    count = tf.reduce_sum(tf.cast(flags, tf.int32))
    line = tf.where(count > 1, many, one)
    if tf.executing_eagerly():
        if count > 0:
            raise ValueError(line.numpy().decode())
        return []
    return [tf.debugging.Assert(count == 0, [line])]


def op_error(e: BaseException):
    """The one line of a dynamic table's error `e` in the step: capacity_check's (naming the
    tables, and the flag to change), an id map op's, or the disk tier's (a StoreError of
    `store.place`, e.g. a cache too small for a step's rows); None when `e` is something else."""
    if not isinstance(e, tf.errors.OpError):
        return None
    store = re.search(r"StoreError: (.*)$", e.message, re.M)
    if store:
        return store[1]
    line = re.search(r"assertion failed: \[(dynamic tables? .*)\]$", e.message, re.M)
    if line:
        many = line[1].startswith("dynamic tables ")
        return (line[1].replace("\\'", "'") + f"; raise {'their capacities' if many else 'its capacity'} "
                "(--dynamic_tables=<feature>:<capacity>)")
    line = re.search(r"^dynamic table .*$", e.message, re.M)
    return line[0] if line else None


def _signed(x: int) -> int:
    """The int64 with the 64 bits of `x` (0 <= x < 2^64)."""
    return x - (1 << 64) if x >= 1 << 63 else x


_MIX = (_signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB))   # splitmix64's finaliser, as the id map's
_GOLDEN = _signed(0x9E3779B97F4A7C15)   # splitmix64's increment


def shift(x: tf.Tensor, k: int) -> tf.Tensor:
    """x >> k on the 64 bits of int64 `x` read unsigned."""
    return tf.bitwise.bitwise_and(tf.bitwise.right_shift(x, k), (1 << (64 - k)) - 1)


def mix(x: tf.Tensor) -> tf.Tensor:
    """int64 [...] -> splitmix64's finaliser of each element's 64 bits, as int64 bits (the id map's
    mixing; id_map.reference.mix in Python)."""
    x = tf.bitwise.bitwise_xor(x, shift(x, 30)) * _MIX[0]
    x = tf.bitwise.bitwise_xor(x, shift(x, 27)) * _MIX[1]
    return tf.bitwise.bitwise_xor(x, shift(x, 31))


def initial_values(ids, step, seed, dim: int, limit: float) -> tf.Tensor:
    """ids [k] int64, step [] int64, seed [2] int64 -> [k, dim] float32 in [-limit, limit): each value
    24 bits of a hash of (seed, id, step, column)."""
    key = mix(tf.bitwise.bitwise_xor(mix(ids + seed[0]), mix(step * _GOLDEN + seed[1])))
    bits = mix(key[:, None] + tf.range(1, dim + 1, dtype=tf.int64)[None, :] * _GOLDEN)
    unit = tf.cast(shift(bits, 40), tf.float32) * (1.0 / (1 << 24))   # [0, 1)
    return (2.0 * unit - 1.0) * limit


class _Tensor:
    """One of a table's checkpoint tensors held in memory (ids, policy state, candidates, totals,
    iterations; in a re-sharding, updated_at) as an entry's variable: storage.checkpoint saves
    `numpy()` (the snapshot) and restores through `assign`, which hands the value to `restoring`."""

    def __init__(self, name: str, value: np.ndarray, restoring: "_Restoring"):
        self.name, self.value, self.shape, self.dtype, self._restoring = name, value, value.shape, value.dtype, restoring

    def numpy(self) -> np.ndarray:
        return self.value

    def assign(self, value):
        self._restoring.received(self.name, np.asarray(value))


class _Streamed:
    """One of a table's per-row checkpoint tensors [L, w] (rows, slots; updated_at) as an entry's
    storage.checkpoint.RowSource, saved and restored a block of rows at a time: `read(start, stop)`
    gives rows [start, stop) (None: restore-only), `write(start, values)` takes them, only once
    `restoring` has the in-memory tensors (storage.checkpoint.restore restores entries in order:
    they come first)."""

    def __init__(self, name: str, shape: tuple, dtype, restoring: "_Restoring",
                 read: Optional[Callable[[int, int], np.ndarray]], write: Callable[[int, np.ndarray], None]):
        self.name, self.shape, self.dtype, self._restoring = name, shape, np.dtype(dtype), restoring
        self._read, self._write = read, write

    def read_rows(self, start: int, stop: int) -> np.ndarray:
        return self._read(start, stop)

    def write_rows(self, start: int, values: np.ndarray):
        if not self._restoring.done_once:
            raise CheckpointError(f"{self.name}: restored before its table's ids (entries out of order)")
        self._write(start, values)


class _Restoring:
    """Collects the in-memory tensors `names` as they are restored; once every one has come, hands
    them to `done` (tensor name -> value: DynamicTable.restore_tensors, or a re-sharding's), before
    the streamed tensors are written."""

    def __init__(self, names: List[str], done: Callable[[Dict[str, np.ndarray]], None]):
        self.names, self.done, self.values, self.done_once = names, done, {}, False

    def received(self, name: str, value: np.ndarray):
        self.values[name] = value
        if len(self.values) == len(self.names):
            values, self.values = self.values, {}
            self.done(values)
            self.done_once = True


def reshard(parts: List[Dict[str, np.ndarray]], policy: str, shards: int,
            shard_of: Callable[[np.ndarray], np.ndarray]
            ) -> Tuple[List[Dict[str, np.ndarray]], np.ndarray, np.ndarray]:
    """A dynamic table's checkpoint tensors in P = len(parts) hash shards -> the same in `shards`,
    and where each saved live row goes.

    parts[k]: old shard k's in-memory tensors by their name after `<shard>/` (IDS, UPDATED_AT and
    the policy's ORDER_KEY [L_k, *], in eviction order; CANDIDATES [M_k, 3]; TOTALS [1, 3];
    ITERATIONS [1, 1] where saved; any other per-row tensor moves as these). shard_of: ids [n] int64
    -> [n] their new shards (routing.hash_shards). Returns the same names for each new shard,
    and (to_shard [G], to_row [G]): the new shard and row of each saved live row, G = sum L_k, old
    shard 0's rows first (its rows and slots go there: resharded_entries streams them).

    Kept exactly: every live id with its row, slots, updated_at and policy state (counts, last-used
    step); every candidate (id, sightings, last sighting); the totals summed over the shards; the
    update counter (every shard's is the table's step count: their maximum). Not kept: the order
    between ids of different old shards, which no checkpoint holds. It is merged by last-used step
    (ttl: last_used; lru: updated_at, the step after the id's last training lookup; lfu: counts,
    then updated_at), each old shard's own order kept, ties in old shard order; so an id last used
    earlier is still evicted first, but two ids last used in one step may swap. A new shard's
    totals are an even split of the sums (their sum is exact). A candidate a new shard's full set
    (4 ways) cannot take is dropped, as a full set drops one.
    """
    rows_of = [k for k in parts[0] if k not in (CANDIDATES, TOTALS, ITERATIONS)]
    merged = {k: np.concatenate([p[k] for p in parts]) for k in rows_of}
    key = merged[UPDATED_AT][:, 0].astype(np.int64)
    if policy == "ttl":
        key = merged["last_used"][:, 0].astype(np.int64)
    elif policy == "lfu":
        key = (merged["counts"][:, 0].astype(np.int64) << 32) + key
    old = np.repeat(np.arange(len(parts)), [len(p[IDS]) for p in parts])
    ends = np.cumsum([len(p[IDS]) for p in parts])
    key = np.concatenate([np.maximum.accumulate(k) for k in np.split(key, ends[:-1])]) if len(key) else key
    order = np.lexsort((np.arange(len(key)), old, key))   # a merge: each old shard's order kept
    new = shard_of(merged[IDS][order, 0])
    cands = np.concatenate([p[CANDIDATES] for p in parts])
    cand_new = shard_of(cands[:, 0])
    totals = np.sum([p[TOTALS][0] for p in parts], axis=0)
    to_shard, to_row = np.empty(len(key), np.int64), np.empty(len(key), np.int64)
    out = []
    for s in range(shards):
        mine = order[new == s]
        to_shard[mine], to_row[mine] = s, np.arange(len(mine))
        part = {k: v[mine] for k, v in merged.items()}
        part[CANDIDATES] = cands[cand_new == s]
        part[TOTALS] = (totals // shards + (s < totals % shards))[None, :].astype(np.int64)
        if ITERATIONS in parts[0]:
            part[ITERATIONS] = np.max([p[ITERATIONS] for p in parts], axis=0)
        out.append(part)
    return out, to_shard, to_row


def resharded_entries(name: str, saved: List[str], names: List[str], tables: Dict[int, "DynamicTable"],
                      capacities: List[int], shard_of: Callable[[np.ndarray], np.ndarray]) -> List[Entry]:
    """Restore-only entries of dynamic table `name` checkpointed in hash shards with the tensor
    prefixes `saved` (by shard) and restored as len(capacities) shards of `capacities` rows, of
    which this rank holds `tables` (new shard -> its DynamicTable); `names`: each saved shard's
    tensors after its prefix ("" the rows). First every saved shard's in-memory tensors (ids,
    updated_at, policy state, candidates, totals: sized by the checkpoint); once all are read,
    `reshard` cuts them anew and each table takes its part (restore_tensors). Then the saved rows
    and slots, streamed a block at a time, each row written into the new shard and row `reshard`
    gave it where this rank holds that shard. A new shard given more live ids than rows raises
    ConfigError, one line naming the table and shard."""
    some = next(iter(tables.values()))
    parts = [""] + [k for k in some.slots if k in names]   # streamed; the rest in memory
    small = [k for k in names if k not in parts]
    fresh = [k for k in some.slots if k not in names]

    def full(prefix: str, k: str) -> str:
        return f"{prefix}/{k}" if k else prefix
    where = {}   # "to_shard", "to_row" [G] and "start" [P] (saved shard k's first row in G), once read

    def done(read: Dict[str, np.ndarray]):
        saved_parts = [{k: read[full(prefix, k)] for k in small} for prefix in saved]
        new, where["to_shard"], where["to_row"] = reshard(saved_parts, some.policy, len(capacities), shard_of)
        where["start"] = np.cumsum([0] + [len(read[full(prefix, IDS)]) for prefix in saved])
        for s, (part, capacity) in enumerate(zip(new, capacities)):
            if len(part[IDS]) > capacity:
                raise ConfigError(f"dynamic table {name}: its checkpoint's {len(saved)} hash shard(s) restored as "
                                  f"{len(capacities)} give hash shard {s} {len(part[IDS])} live ids for its {capacity} "
                                  f"rows: restore with {len(saved)} shard(s) or a larger capacity (--dynamic_tables)")
        for s, table in tables.items():
            table.restore_tensors({full(table.table, k): v for k, v in new[s].items()})

    def writer(k: int, j: int):
        def write(start: int, values: np.ndarray):
            g = where["start"][k] + start + np.arange(len(values))
            for s, table in tables.items():
                mine = where["to_shard"][g] == s
                table.write_part(j, where["to_row"][g[mine]], values[mine], fresh if j == 0 else ())
        return write

    restoring = _Restoring([full(prefix, k) for prefix in saved for k in small], done)
    return [Entry(n, _Tensor(n, np.zeros((0, 0)), restoring), (0, 0), sized_by_checkpoint=True)
            for n in restoring.names] + \
        [Entry(full(prefix, k), _Streamed(full(prefix, k), (0, int(some.dim)), np.float32, restoring, None, writer(i, j)),
               (0, int(some.dim)), sized_by_checkpoint=True)
         for i, prefix in enumerate(saved) for k in parts for j in [some.part_index(k)]]


class DynamicTable(tf.Module):
    """See the module's docstring."""

    def __init__(self, name: str, capacity: int, dim: int, seed: Sequence[int], admit_after: int = 1,
                 policy: str = "lru", ttl: int = 0, candidate_slots: int = 0, optimizer: str = "sgd",
                 zeros_initializer: bool = False, initializer_rows: int = 0, cache_rows: int = 0):
        super().__init__()   # `name` may hold "/": the module keeps its class's name
        self.table, self.capacity, self.dim, self.policy = name, capacity, dim, policy
        self.map = id_map.IdMap(name, capacity, admit_after, policy, ttl, candidate_slots)
        self._seed = tf.constant(seed, tf.int64)
        self._limit = 0.0 if zeros_initializer else math.sqrt(1.0 / (initializer_rows or capacity))
        # a row is initialised when admitted; on disk (`cache_rows`) the variable and slots are the cache
        self.variable = tf.Variable(tf.zeros([cache_rows or capacity, dim]), name=name)
        self.updated_at = None if cache_rows else \
            tf.Variable(tf.zeros([capacity, 1], tf.int32), trainable=False, name=f"{name}/{UPDATED_AT}")
        self.store = None   # on disk: its RowStore (the module's docstring), set by the disk tier
        self.set_optimizer(optimizer)

    def set_optimizer(self, name: str, beta1: float = 0.9, beta2: float = 0.999, scope: str = ""):
        """The optimizer `apply_gradients` uses ("sgd", "adagrad", "adam"), its slots fresh; `scope`
        names its variables (default `<table>_optimizer`, "/" as "_")."""
        scope = scope or f"{self.table}_optimizer".replace("/", "_")
        self.optimizer = make_optimizer(name, [self.variable], scope, beta1, beta2)
        self.slots: Dict[str, tf.Variable] = self.optimizer.slots[self.variable.ref()]

    def _initial_rows(self, ids, step) -> tf.Tensor:
        """ids [k] int64 admitted at `step` -> their rows' initial values [k, D]."""
        return initial_values(ids, tf.cast(step, tf.int64), self._seed, self.dim, self._limit)

    def lookup(self, ids, step, training: bool):
        """ids [n] int64, step [] int64 -> rows [n] int32 (-1: none), embeddings [n, D]."""
        rows = self.rows(ids, step, training)
        found = rows >= 0
        emb = tf.gather(self.variable, tf.maximum(rows, 0)) * tf.cast(found, self.variable.dtype)[:, None]
        return rows, emb

    def rows(self, ids, step, training: bool, full: Optional[list] = None):
        """ids [n] int64, step [] int64 -> rows [n] int32 (-1: none); training: admits and evicts,
        and re-initialises new rows. A batch with more distinct ids to admit than rows fails
        (capacity_check); with `full` (a list) the table's (name, capacity, full []) is appended to
        it instead, for the caller to check with other tables'."""
        ids = tf.reshape(tf.cast(ids, tf.int64), [-1])
        if training:
            rows, codes, _, is_full = self.map.find_or_insert(ids, step)
            if full is None:
                with tf.control_dependencies(capacity_check([(self.table, self.capacity, is_full)], step)):
                    rows = tf.identity(rows)
            else:
                full.append((self.table, self.capacity, is_full))
            rows = self._placed(rows, step, codes)
            new = (codes == id_map.ADMITTED) | (codes == id_map.EVICTED)
            self._reset(tf.boolean_mask(rows, new), self._initial_rows(tf.boolean_mask(ids, new), step))
            return rows
        return self._placed(self.map.find(ids), step)

    def _placed(self, rows, step, codes=None):
        """The map's rows [n] int32 (codes [n]: the map's in training) as the variable's indices:
        themselves in memory, their cache slots on disk (`store.place`, a host call in the step)."""
        if self.store is None:
            return rows

        def place(r, s, *c):
            return self.store.place(r.numpy(), int(s.numpy()), c[0].numpy() if c else None)
        slots = tf.py_function(place, [rows, tf.cast(step, tf.int64)] + ([codes] if codes is not None else []),
                               tf.int32)
        slots.set_shape(rows.shape)
        return slots

    def _reset(self, rows, values):
        """New rows [k] take `values` [k, D], their slots the initial value, updated_at 0 (on disk:
        set by `store.place`)."""
        self.variable.scatter_update(tf.IndexedSlices(values, rows))
        for slot, var in self.slots.items():
            var.scatter_update(tf.IndexedSlices(self.optimizer._slot_init(slot, values), rows))
        if self.updated_at is not None:
            self.updated_at.scatter_update(tf.IndexedSlices(tf.zeros_like(rows)[:, None], rows))

    def apply_gradients(self, rows, grads, lr, step):
        """rows [n] int32 from lookup, grads [n, D]: the rows >= 0 take the optimizer's update."""
        found = rows >= 0
        kept = tf.boolean_mask(rows, found)
        self.optimizer.apply([(tf.IndexedSlices(tf.boolean_mask(grads, found), kept), self.variable)], lr)
        if self.updated_at is not None:
            self.updated_at.scatter_update(
                tf.IndexedSlices(tf.fill([tf.size(kept), 1], tf.cast(step, tf.int32) + 1), kept))

    @property
    def parts(self) -> List[tf.Variable]:
        """The variable and its optimizer slots, in the order of a row's parts on disk."""
        return [self.variable] + list(self.slots.values())

    def counts(self) -> Dict[str, int]:
        return self.map.stats()

    def checkpoint_names(self, weights_only: bool = False) -> List[str]:
        return tensor_names(self.table, self.policy, list(self.slots), weights_only)

    def part_index(self, slot: str) -> int:
        """The index in `parts` of optimizer slot `slot` ("": the rows, 0)."""
        return 1 + list(self.slots).index(slot) if slot else 0

    def read_part(self, part: int, rows: np.ndarray) -> np.ndarray:
        """rows [n] -> their part `part` of `parts` [n, D] (on disk through the store)."""
        if self.store is not None:
            return self.store.read(rows, part)
        return tf.gather(self.parts[part], rows).numpy()

    def write_part(self, part: int, rows, values: np.ndarray, fresh: Sequence[str] = ()):
        """rows (a slice, or [n] int64) take `values` [n, D] as their part `part` of `parts` (on disk
        in the store, its cache emptied first: restore_tensors); the slots `fresh` (with part 0)
        their initial value."""
        values = np.asarray(values, np.float32)
        writes = [(part, values)] + [(self.part_index(k), self.optimizer._slot_init(k, values).numpy()) for k in fresh]
        for j, value in writes:
            if self.store is not None:
                self.store.write(rows, j, value)
            elif isinstance(rows, slice):
                self.parts[j][rows].assign(value)
            else:
                self.parts[j].scatter_update(tf.IndexedSlices(value, rows))

    def checkpoint_entries(self, weights_only: bool = False) -> List[Entry]:
        """See the module's docstring. The per-row tensors (rows, slots, updated_at) are streamed:
        saved from the live rows now in blocks of rows (on disk from the cache or the store) and
        restored into rows 0..L-1 likewise, after the ids and the rest (held in memory)."""
        state = {k: v.numpy() for k, v in self.map.export().items()}
        rows = state["rows"]
        column = {IDS: state["ids"][:, None],
                  CANDIDATES: np.stack([state["candidate_ids"], state["candidate_sightings"],
                                        state["candidate_last_seen"]], axis=1),
                  TOTALS: state["totals"][None, :], ITERATIONS: self.optimizer.iterations.numpy().reshape(1, 1)}
        if ORDER_KEY[self.policy]:
            column[ORDER_KEY[self.policy]] = state[ORDER_KEY[self.policy]].astype(np.int32)[:, None]
        names = self.checkpoint_names(weights_only)
        small = {f"{self.table}/{k}": v for k, v in column.items() if f"{self.table}/{k}" in names}
        restoring = _Restoring(list(small), self.restore_tensors)
        fresh = [k for k in self.slots if f"{self.table}/{k}" not in names]
        shape, live = (len(rows), int(self.dim)), lambda start, n: slice(start, start + n)

        def part(j: int) -> tuple:   # (read, write) of part j of `parts`
            return (lambda start, stop: self.read_part(j, rows[start:stop]),
                    lambda start, values: self.write_part(j, live(start, len(values)), values, fresh if j == 0 else ()))
        streamed = {f"{self.table}/{k}" if k else self.table: (shape, np.float32, *part(self.part_index(k)))
                    for k in [""] + [k for k in self.slots if k not in fresh]}
        streamed[f"{self.table}/{UPDATED_AT}"] = (
            (len(rows), 1), np.int32, lambda start, stop: self._updated_at(rows[start:stop])[:, None],
            lambda start, values: self._set_updated_at(live(start, len(values)), values[:, 0]))
        return [Entry(n, _Tensor(n, v, restoring), v.shape, sized_by_checkpoint=True) for n, v in small.items()] + \
            [Entry(n, _Streamed(n, shape, dtype, restoring, read, write), shape, sized_by_checkpoint=True)
             for n, (shape, dtype, read, write) in streamed.items()]

    def _updated_at(self, rows: np.ndarray) -> np.ndarray:
        """rows [n] -> their updated_at [n] int32 (on disk kept by the store)."""
        if self.store is not None:
            return self.store.updated_at[rows]
        return tf.gather(self.updated_at, rows).numpy()[:, 0]

    def _set_updated_at(self, rows: slice, values: np.ndarray):
        """Rows `rows` take updated_at `values` [n] int32."""
        if self.store is not None:
            self.store.updated_at[rows] = values
        else:
            self.updated_at[rows].assign(np.asarray(values, np.int32)[:, None])

    def restore(self, path: str):
        """Replaces the table's state with its checkpoint's at `path` (a checkpoint folder or root)."""
        names = self.checkpoint_names()
        tensors = checkpoint.read_manifest(path)["tensors"]
        missing = [n for n in names if n not in tensors]
        if missing:
            raise ValueError(f"dynamic table {self.table}: {checkpoint.resolve(path)} lacks {missing[0]} "
                             f"(a static table's checkpoint, or another eviction policy's)")
        checkpoint.restore(path, self.checkpoint_entries(), {}, set(names), extra_ok=True)

    def restore_tensors(self, read: Dict[str, np.ndarray]):
        """Replaces the table's state but its rows and slots with `read`: tensor name -> value, as
        `checkpoint_entries` names them (ids, the policy's state, candidates, totals; updated_at and
        `iterations` where given). Its live ids take rows 0..L-1, whose rows and slots `write_part`
        sets next (on disk the cache is emptied first)."""
        ids = read[f"{self.table}/{IDS}"][:, 0]
        live = len(ids)
        if live > self.capacity:
            raise ValueError(f"dynamic table {self.table}: its checkpoint holds {live} live rows, the capacity is "
                             f"{self.capacity}")
        key = ORDER_KEY[self.policy]
        per_row = read[f"{self.table}/{key}"][:, 0].astype(np.int64) if key else None
        cands = read[f"{self.table}/{CANDIDATES}"]
        if self.store is not None:
            self.store.clear()
        self.map.restore({"ids": ids, "rows": np.arange(live, dtype=np.int32),
                          "counts": per_row if key == "counts" else np.ones(live, np.int64),
                          "last_used": per_row if key == "last_used" else np.full(live, -1, np.int64),
                          "candidate_ids": cands[:, 0], "candidate_sightings": cands[:, 1],
                          "candidate_last_seen": cands[:, 2], "totals": read[f"{self.table}/{TOTALS}"][0]})
        if f"{self.table}/{UPDATED_AT}" in read:
            self._set_updated_at(slice(0, live), read[f"{self.table}/{UPDATED_AT}"][:, 0])
        if f"{self.table}/{ITERATIONS}" in read:
            self.optimizer.iterations.assign(read[f"{self.table}/{ITERATIONS}"][0, 0])
