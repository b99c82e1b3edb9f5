"""A dynamic embedding table: raw 64-bit ids in, no vocabulary, admission and eviction (issue 29;
DistributedEmbedding holds one per hash shard of a table of kind "dynamic"). Its state: an id map
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
    rows = table.rows(ids, step, training)  the rows alone (lookup's first half: admission, eviction,
                                        re-initialisation; the caller gathers rows >= 0)
    table.set_optimizer(name, beta1, beta2, scope)  replaces the constructor's optimizer (fresh slots)
    table.parts                         [variable, slot variables...] (on disk: a row's parts)
    table.counts()                      {live, capacity, candidates, admitted, evicted, refused}
    entries = table.checkpoint_entries(weights_only)    storage.checkpoint entries of the live rows
                                        only (a snapshot, taken now; sized by the checkpoint when
                                        restored: storage.checkpoint.restore assigns them all, then
                                        the table takes their state): tensors `<name>` [L, D], `<name>/<slot>`
                                        [L, D], `<name>/updated_at` [L, 1] int32, `<name>/ids` [L, 1]
                                        int64 (in eviction order), `<name>/counts` (lfu) or
                                        `<name>/last_used` (ttl) [L, 1] int32, `<name>/candidates`
                                        [M, 3] int64 (id, sightings, last seen), `<name>/totals` [1, 3]
                                        int64, `<name>/iterations` [1, 1] int64 (the optimizer's updates);
                                        `weights_only`: without the slots and `iterations` (restored:
                                        the live rows' slots start fresh)
    table.checkpoint_names(weights_only)    those tensors' names
    table.restore(path)                 the table from a checkpoint (storage.checkpoint.read_tensor):
                                        its live ids take rows 0..L-1 in eviction order
    op_error(e)                         the one line of an id map op's error (a batch with more ids to
                                        admit than rows) or of the disk tier's in the step, or None
                                        for any other exception
    reshard(parts, policy, shards, shard_of)    a table's checkpoint tensors in P hash shards -> in
                                        `shards` (what is kept exactly and what is not: its docstring)
    resharded_entries(...)              restore-only entries that read P saved shards and restore
                                        this rank's new ones through `reshard`

On disk (`cache_rows` C > 0; parallel_embedding/tiered.py): the map stays in memory and runs in
the step as above, the variable and slots [C, D] are a cache of the rows, updated_at is kept per
row by the store, and `store` (a RowStore, set by the disk tier) holds the rest:
    store.place(rows [n], step, codes [n]) -> slots [n] int32   the map's rows (-1: none) as cache
                                        slots, in the step (codes None: not training): missing rows
                                        read, admitted rows (codes ADMITTED, EVICTED) given a slot
                                        unread (the step re-initialises it); training: updated_at
                                        of the rows >= 0 becomes step + 1
    store.read(rows [L]) -> (parts [L, 1 + k, D] float32, updated_at [L] int32)   the rows with
                                        their k slots (`parts`' order), through the cache
    store.write(parts [L, 1 + k, D], updated_at [L])   rows 0..L-1 (a restore; the cache emptied)
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
from typing import Callable, Dict, List, Sequence

import numpy as np
import tensorflow as tf

import id_map
from parallel_embedding import UPDATED_AT
from parallel_embedding.optimizers import make_optimizer
from storage import checkpoint
from storage.checkpoint import Entry
from utils.errors import ConfigError

IDS, TOTALS, CANDIDATES, ITERATIONS = "ids", "totals", "candidates", "iterations"
ORDER_KEY = {"lru": None, "lfu": "counts", "ttl": "last_used"}   # the per-row state a policy needs


def tensor_names(table: str, policy: str, slots: Sequence[str], weights_only: bool = False) -> List[str]:
    """The names of the checkpoint tensors of dynamic table `table` (DynamicTable.checkpoint_entries)
    under `policy` with optimizer slots `slots`."""
    extra = [ORDER_KEY[policy]] if ORDER_KEY[policy] else []
    optimizer = [] if weights_only else list(slots)
    return [table] + [f"{table}/{k}" for k in optimizer + [UPDATED_AT, IDS] + extra + [CANDIDATES, TOTALS]
                      + ([] if weights_only else [ITERATIONS])]


def op_error(e: BaseException):
    """The one line of the id map op's error `e` (its line naming the table, and for a capacity too
    small the flag to change) or of the disk tier's in the step (a StoreError of `store.place`, e.g.
    a cache too small for a step's rows), or None when `e` is something else."""
    if not isinstance(e, tf.errors.OpError):
        return None
    store = re.search(r"StoreError: (.*)$", e.message, re.M)
    if store:
        return store[1]
    line = re.search(r"^dynamic table .*$", e.message, re.M)
    if line is None:
        return None
    hint = "; raise its capacity (--dynamic_tables=<feature>:<capacity>)" if "too small" in line[0] else ""
    return line[0] + hint


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
    """One tensor of a table's checkpoint as an entry's variable: storage.checkpoint saves
    `numpy()` (the snapshot) and restores through `assign`, which hands the value to `restoring`."""

    def __init__(self, name: str, value: np.ndarray, restoring: "_Restoring"):
        self.name, self.value, self.shape, self.dtype, self._restoring = name, value, value.shape, value.dtype, restoring

    def numpy(self) -> np.ndarray:
        return self.value

    def assign(self, value):
        self._restoring.received(self.name, np.asarray(value))


class _Restoring:
    """Collects the tensors `names` as they are restored; once every one has come, hands them to
    `done` (tensor name -> value: DynamicTable.restore_tensors, or a re-sharding's)."""

    def __init__(self, names: List[str], done: Callable[[Dict[str, np.ndarray]], None]):
        self.names, self.done, self.values = names, done, {}

    def received(self, name: str, value: np.ndarray):
        self.values[name] = value
        if len(self.values) == len(self.names):
            values, self.values = self.values, {}
            self.done(values)


def reshard(parts: List[Dict[str, np.ndarray]], policy: str, shards: int,
            shard_of: Callable[[np.ndarray], np.ndarray]) -> List[Dict[str, np.ndarray]]:
    """A dynamic table's checkpoint tensors in P = len(parts) hash shards -> the same in `shards`.

    parts[k]: old shard k's tensors by their name after `<shard>/` ("" the rows [L_k, D]; IDS,
    UPDATED_AT, the slots and the policy's ORDER_KEY [L_k, *], in eviction order; CANDIDATES
    [M_k, 3]; TOTALS [1, 3]; ITERATIONS [1, 1] where saved). shard_of: ids [n] int64 -> [n] their
    new shards (the layer's hash_shards). Returns the same names for each new shard.

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
    out = []
    for s in range(shards):
        part = {k: v[order][new == s] for k, v in merged.items()}
        part[CANDIDATES] = cands[cand_new == s]
        part[TOTALS] = (totals // shards + (s < totals % shards))[None, :].astype(np.int64)
        if ITERATIONS in parts[0]:
            part[ITERATIONS] = np.max([p[ITERATIONS] for p in parts], axis=0)
        out.append(part)
    return out


def resharded_entries(name: str, saved: List[str], names: List[str], tables: Dict[int, "DynamicTable"],
                      capacities: List[int], shard_of: Callable[[np.ndarray], np.ndarray]) -> List[Entry]:
    """Restore-only entries of dynamic table `name` checkpointed in hash shards with the tensor
    prefixes `saved` (by shard) and restored as len(capacities) shards of `capacities` rows, of
    which this rank holds `tables` (new shard -> its DynamicTable); `names`: each saved shard's
    tensors after its prefix ("" the rows). Once every saved shard is read (sized by the
    checkpoint), `reshard` cuts them anew and each table takes its part (restore_tensors). A new
    shard given more live ids than rows raises ConfigError, one line naming the table and shard."""
    full = [f"{prefix}/{k}" if k else prefix for prefix in saved for k in names]

    def done(read: Dict[str, np.ndarray]):
        parts = [{k: read[f"{prefix}/{k}" if k else prefix] for k in names} for prefix in saved]
        policy = next(iter(tables.values())).policy
        new = reshard(parts, policy, len(capacities), shard_of)
        for s, (part, capacity) in enumerate(zip(new, capacities)):
            if len(part[IDS]) > capacity:
                raise ConfigError(f"dynamic table {name}: its checkpoint's {len(saved)} hash shard(s) restored as "
                                  f"{len(capacities)} give hash shard {s} {len(part[IDS])} live ids for its {capacity} "
                                  f"rows: restore with {len(saved)} shard(s) or a larger capacity (--dynamic_tables)")
        for s, table in tables.items():
            table.restore_tensors({f"{table.table}/{k}" if k else table.table: v for k, v in new[s].items()})

    restoring = _Restoring(full, done)
    return [Entry(n, _Tensor(n, np.zeros((0, 0)), restoring), (0, 0), sized_by_checkpoint=True) for n in full]


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

    def rows(self, ids, step, training: bool):
        """ids [n] int64, step [] int64 -> rows [n] int32 (-1: none); training: admits and evicts,
        and re-initialises new rows."""
        ids = tf.reshape(tf.cast(ids, tf.int64), [-1])
        if training:
            try:
                rows, codes, _ = self.map.find_or_insert(ids, step)
            except tf.errors.InvalidArgumentError as e:   # eagerly: the op's line alone
                raise ValueError(e.message.split("}} ")[-1].split(" [Op:")[0]) from None
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

    def checkpoint_entries(self, weights_only: bool = False) -> List[Entry]:
        state = {k: v.numpy() for k, v in self.map.export().items()}
        rows = state["rows"]
        if self.store is None:
            parts = np.stack([tf.gather(v, rows).numpy() for v in self.parts], axis=1)
            updated_at = tf.gather(self.updated_at, rows).numpy()[:, 0]
        else:
            parts, updated_at = self.store.read(rows)
        column = {IDS: state["ids"][:, None], UPDATED_AT: updated_at[:, None],
                  CANDIDATES: np.stack([state["candidate_ids"], state["candidate_sightings"],
                                        state["candidate_last_seen"]], axis=1),
                  TOTALS: state["totals"][None, :], ITERATIONS: self.optimizer.iterations.numpy().reshape(1, 1)}
        if ORDER_KEY[self.policy]:
            column[ORDER_KEY[self.policy]] = state[ORDER_KEY[self.policy]].astype(np.int32)[:, None]
        column.update({slot: parts[:, j + 1] for j, slot in enumerate(self.slots)})
        values = {self.table: parts[:, 0]}
        values.update({f"{self.table}/{k}": v for k, v in column.items()})
        names = self.checkpoint_names(weights_only)
        restoring = _Restoring(names, self.restore_tensors)
        return [Entry(name, _Tensor(name, values[name], restoring), values[name].shape, sized_by_checkpoint=True)
                for name in names]

    def restore(self, path: str):
        """Replaces the table's state with its checkpoint's at `path` (a checkpoint folder or root)."""
        names = self.checkpoint_names()
        tensors = checkpoint.read_manifest(path)["tensors"]
        missing = [n for n in names if n not in tensors]
        if missing:
            raise ValueError(f"dynamic table {self.table}: {checkpoint.resolve(path)} lacks {missing[0]} "
                             f"(a static table's checkpoint, or another eviction policy's)")
        self.restore_tensors({n: checkpoint.read_tensor(path, n) for n in names})

    def restore_tensors(self, read: Dict[str, np.ndarray]):
        """Replaces the table's state with `read`: tensor name -> value, as `checkpoint_entries`
        names them (without the slots and `iterations`: the live rows' slots start fresh)."""
        ids = read[f"{self.table}/{IDS}"][:, 0]
        live = len(ids)
        if live > self.capacity:
            raise ValueError(f"dynamic table {self.table}: its checkpoint holds {live} live rows, the capacity is "
                             f"{self.capacity}")
        key = ORDER_KEY[self.policy]
        per_row = read[f"{self.table}/{key}"][:, 0].astype(np.int64) if key else None
        cands = read[f"{self.table}/{CANDIDATES}"]
        self.map.restore({"ids": ids, "rows": np.arange(live, dtype=np.int32),
                          "counts": per_row if key == "counts" else np.ones(live, np.int64),
                          "last_used": per_row if key == "last_used" else np.full(live, -1, np.int64),
                          "candidate_ids": cands[:, 0], "candidate_sightings": cands[:, 1],
                          "candidate_last_seen": cands[:, 2], "totals": read[f"{self.table}/{TOTALS}"][0]})
        rows = read[self.table]
        parts = [rows] + [read[f"{self.table}/{slot}"] if f"{self.table}/{slot}" in read
                          else self.optimizer._slot_init(slot, rows).numpy() for slot in self.slots]
        updated_at = read[f"{self.table}/{UPDATED_AT}"]
        if self.store is None:
            for var, value in zip(self.parts, parts):
                var[:live].assign(value)
            self.updated_at[:live].assign(updated_at)
        else:
            self.store.write(np.stack(parts, axis=1), updated_at[:, 0])
        if f"{self.table}/{ITERATIONS}" in read:
            self.optimizer.iterations.assign(read[f"{self.table}/{ITERATIONS}"][0, 0])
