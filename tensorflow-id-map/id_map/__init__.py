"""The id -> row map of a dynamic embedding table (one per table or shard) as TensorFlow ops.

    import id_map
    m = id_map.IdMap("table_3", capacity, admit_after=1, policy="lru", ttl=0, candidate_slots=0)
    rows, codes, evicted, full = m.find_or_insert(ids, step)   ids [n] int64 (raw ids), step [] int64
                                    (the training step) -> rows [n] int32 (-1: refused), codes [n] int32
                                    (HIT, ADMITTED, EVICTED: admitted into the row of evicted[n], REFUSED),
                                    full [] bool: more distinct ids to admit than rows (below)
    rows = m.find(ids)              [n] int64 -> [n] int32, -1 for an id without a row; changes nothing
    state = m.export()              {STATE name: 1-D array}: live ids in eviction order with rows,
                                    counts, last-used steps; candidates; totals [3]
    m.restore(state)                replaces the map's state with an export's
    m.stats()                       {live, capacity, candidates, admitted, evicted, refused}

A row is given to an id at its `admit_after`-th sighting (sightings counted once a step, in a
bounded table of `candidate_slots` counters, 0: capacity); when every row is taken, `policy`
chooses the row to reuse: "lru" the least recently used, "lfu" the least frequently used (steps
seen; ties: least recently), "ttl" the least recently used if unused for `ttl` steps (else the id
is refused). A row in use by the batch is never reused by it: a batch with more distinct admitted
ids than rows is `full` (every row -1, every code REFUSED: the caller fails the step, naming the
table; several tables can be checked at once). Two live ids never share a row. Finds are
spread over TensorFlow's intra-op threads; the results do not depend on the thread count
(src/id_map.h says how). `load()` raises OpLoadError, saying why, when the library is missing
or was built for another TensorFlow.
"""
import itertools
import os

import tensorflow as tf

LIBRARY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_id_map_ops.so")
POLICIES = ("lru", "lfu", "ttl")
HIT, ADMITTED, EVICTED, REFUSED = 0, 1, 2, 3
STATE = ("ids", "rows", "counts", "last_used", "candidate_ids", "candidate_sightings", "candidate_last_seen",
         "totals")
STATS = ("live", "capacity", "candidates", "admitted", "evicted", "refused")
_loaded = []
_serial = itertools.count()


class OpLoadError(RuntimeError):
    """The op library cannot be loaded; the message (one line) says why."""


def load():
    """The library's generated op wrappers (loaded once)."""
    if not _loaded:
        if not os.path.exists(LIBRARY):
            raise OpLoadError(f"{LIBRARY} is missing")
        try:
            _loaded.append(tf.load_op_library(LIBRARY))
        except (tf.errors.NotFoundError, OSError) as e:
            raise OpLoadError(f"{LIBRARY} does not load into TensorFlow {tf.__version__}: "
                              f"{str(e).strip().splitlines()[0]}") from None
    return _loaded[0]


class IdMap:
    """One table's id map (see the module's docstring); `table` names it in every error."""

    def __init__(self, table: str, capacity: int, admit_after: int = 1, policy: str = "lru", ttl: int = 0,
                 candidate_slots: int = 0):
        if policy not in POLICIES:
            raise ValueError(f"dynamic table {table}: unknown eviction policy {policy!r} (one of {', '.join(POLICIES)})")
        if not 1 <= capacity < 2 ** 31 or admit_after < 1 or candidate_slots < 0 or (policy == "ttl") != (ttl >= 1):
            raise ValueError(f"dynamic table {table}: needs 1 <= capacity < 2^31, admit_after >= 1, candidate_slots "
                             f">= 0 and ttl >= 1 exactly with policy ttl (got {capacity}, {admit_after}, "
                             f"{candidate_slots}, ttl {ttl} with {policy})")
        self.table, self.capacity, self.policy = table, capacity, policy
        self._ops = load()
        with tf.init_scope():
            self.handle = self._ops.id_map_handle(table=table, capacity=capacity, admit_after=admit_after,
                                                  policy=policy, ttl=ttl, candidate_slots=candidate_slots,
                                                  shared_name=f"id_map_{next(_serial)}_{table}")

    def find_or_insert(self, ids, step):
        """ids [n] int64, step [] int64 -> rows [n] int32, codes [n] int32, evicted [n] int64, full [] bool."""
        return self._ops.id_map_find_or_insert(self.handle, ids, tf.cast(step, tf.int64))

    def find(self, ids) -> tf.Tensor:
        """ids [n] int64 -> rows [n] int32 (-1: no row)."""
        return self._ops.id_map_find(self.handle, ids)

    def export(self) -> dict:
        """{name in STATE: 1-D tensor} (rows int32, the others int64)."""
        return dict(zip(STATE, self._ops.id_map_export(self.handle)))

    def restore(self, state: dict):
        """Replaces the state with `state` (export()'s form)."""
        self._ops.id_map_import(self.handle, *[tf.cast(state[k], tf.int32 if k == "rows" else tf.int64) for k in STATE])

    def stats(self) -> dict:
        """{name in STATS: int}."""
        return dict(zip(STATS, self._ops.id_map_stats(self.handle).numpy().tolist()))

    def __del__(self):
        if getattr(self, "handle", None) is not None and tf.executing_eagerly():
            self._ops.id_map_destroy(self.handle)
