"""The cache tier, per process: the tables that fit the budget held whole (_Whole), the others'
hot rows in one cache per width D (_Group, its _Cache: storage/row_cache.py's RowCache with the
rows' values), shared by the threads serving requests. The budget's shares: config.py's
cache_capacities.
"""
import threading
from typing import Iterator, List, Optional, Tuple

import numpy as np

from storage.row_cache import RowCache


class _Whole:
    """A table held whole in memory: `values` [rows, D]."""

    def __init__(self, values: np.ndarray):
        self.values = values
        self.lookups = 0

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """ids (any shape) -> [*ids.shape, D]."""
        self.lookups += ids.size
        return self.values[ids]

    hits = property(lambda self: self.lookups)   # every id is found

    def replace(self, ids: np.ndarray, rows: np.ndarray):
        self.values[ids] = rows

    nbytes = property(lambda self: self.values.nbytes)


class _Cache(RowCache):
    """A table's hot rows: `values` [C, D], row i of slot i (which rows: storage/row_cache.py,
    victims by `policy`). `generation` counts updates: rows read below before an update are not
    filled after it."""

    def __init__(self, rows: int, dim: int, capacity: int, policy: str):
        super().__init__(rows, capacity)
        self.policy = policy
        self.lock = threading.Lock()
        self.values = np.empty((capacity, dim), np.float32)
        self.generation = self.lookups = self.hits = 0

    @property
    def nbytes(self) -> int:
        return self.values.nbytes + super().nbytes

    def lookup(self, ids: np.ndarray) -> Tuple[np.ndarray, Optional[np.ndarray], int]:
        """ids [n] -> (rows [n, D], the cached ones filled; miss mask [n], None if none missed;
        the generation to fill the missed rows with)."""
        with self.lock:
            self.tick()
            slots = self.slot_of[ids]
            hit = slots >= 0
            used = slots[hit]
            self.use(used)
            n_hit = len(used)
            self.lookups += len(ids)
            self.hits += n_hit
            if n_hit == len(ids):
                return self.values[slots], None, self.generation
            out = np.empty((len(ids), self.values.shape[1]), np.float32)
            out[hit] = self.values[used]
            return out, ~hit, self.generation

    def fill(self, ids: np.ndarray, rows: np.ndarray, generation: int):
        """Caches rows `ids` [n] (unique) read below, unless an update came since `generation`."""
        if not self.capacity:
            return
        with self.lock:
            if generation != self.generation:
                return
            new = self.slot_of[ids] < 0   # another request may have cached some meanwhile
            ids, rows = ids[new][:self.capacity], rows[new][:self.capacity]
            if not len(ids):
                return
            self.tick()
            slots, _ = self.admit(ids, self.policy)
            self.values[slots] = rows

    def replace(self, ids: np.ndarray, rows: np.ndarray):
        """Rows `ids` become `rows` where cached; fills of rows read before this are dropped."""
        with self.lock:
            slots = self.slot_of[ids]
            cached = slots >= 0
            self.values[slots[cached]] = rows[cached]
            self.generation += 1


class _Group:
    """The cached tables of one width D sharing one cache: row i of `features[k]` is the cache's
    row starts[k] + i."""

    def __init__(self, features: List[int], rows: List[int], dim: int, capacity: int, policy: str):
        self.features, self.dim = features, dim
        self.starts = np.cumsum([0] + rows)
        self.offset = dict(zip(features, self.starts[:-1].tolist()))
        self.cache = _Cache(int(self.starts[-1]), dim, capacity, policy)

    def split(self, ids: np.ndarray) -> Iterator[Tuple[int, np.ndarray]]:
        """Sorted cache rows [n] -> per feature among them, in order: (feature, its table's ids)."""
        bounds = np.searchsorted(ids, self.starts)
        for k, f in enumerate(self.features):
            if bounds[k + 1] > bounds[k]:
                yield f, ids[bounds[k]:bounds[k + 1]] - self.starts[k]
