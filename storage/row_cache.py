"""The row cache: which rows of a table a cache of C slots holds, and which make room for new ones.
NumPy only. Its users keep the rows' values, indexed by slot ([C, ...] arrays or variables), and
their own locking: training's disk tier (parallel_embedding/tiered.py) and serving's lookup tiers.

Shapes: R the table's rows (ids in [0, R)), C the slots. State (read freely; written only by the
methods):
    slot_of   [R] int32   each row's slot, -1: not cached
    id_of     [C] int64   each slot's row, -1: empty
    last_use  [C] int64   the operation (`clock`) that last used each slot
    uses      [C] int32   the operations that used each slot's row since it was admitted
    pinned    [C] int32   pins per slot: a pinned slot is never a victim
    filled    slots [0, filled) have held a row since the last reset
    clock     operations started (`tick`)

Operations:
    tick()                           starts an operation: what it uses or admits is no victim in it
    use(slots [n])                   the slots' rows are used now (a slot repeated counts once)
    admit(ids [m], policy) -> (slots [m], evicted [m])
                                     caches rows `ids` (unique, not cached): never-used slots first,
                                     then the victims of `policy`; `evicted` the rows those slots
                                     held (-1: none), no longer cached; the new rows used now.
                                     CacheFull where too few slots are neither pinned nor
                                     used in this operation
    pin(slots [n]), unpin(slots [n]) one pin more / less per slot (n unique)
    reset()                          empties the cache (nothing pinned)

Victims (POLICIES): "lru", the least recently used; "lfu", the least used since admitted, ties by
age. They come from a reserve of the lowest-ranked quarter of the slots (at least the number
needed), best first, that one pass over the cache refreshes when it runs out; a slot used or pinned
since the pass is skipped. So an operation costs O(its rows), not O(C); LRU is exact, LFU ranks by
the uses at the last pass.

Memory: INDEX_BYTES per table row, SLOT_BYTES per slot (`nbytes`), besides the users' values.
"""
from typing import Tuple

import numpy as np

POLICIES = ("lru", "lfu")
INDEX_BYTES = 4    # slot_of
SLOT_BYTES = 24    # id_of, last_use, uses, pinned


class CacheFull(RuntimeError):
    """An admission found too few slots neither pinned nor used in its operation for its last
    `need` rows."""

    def __init__(self, capacity: int, need: int):
        super().__init__(f"a cache of {capacity} rows has no room for {need} more: the rest are pinned or in use")
        self.need = need


class RowCache:
    """A cache of `capacity` slots for the rows of a table of `rows` rows (see the module's docstring)."""

    def __init__(self, rows: int, capacity: int):
        self.rows, self.capacity = rows, capacity
        self.slot_of = np.full(rows, -1, np.int32)
        self.id_of = np.full(capacity, -1, np.int64)
        self.last_use = np.zeros(capacity, np.int64)
        self.uses = np.zeros(capacity, np.int32)
        self.pinned = np.zeros(capacity, np.int32)
        self.filled = self.clock = 0
        self._reserve = np.zeros(0, np.int64)   # victim candidates, best first
        self._reserve_pos = self._reserved_at = 0

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.slot_of, self.id_of, self.last_use, self.uses, self.pinned))

    def tick(self):
        self.clock += 1

    def use(self, slots: np.ndarray):
        self.last_use[slots] = self.clock
        self.uses[slots] += 1

    def pin(self, slots: np.ndarray):
        self.pinned[slots] += 1

    def unpin(self, slots: np.ndarray):
        self.pinned[slots] -= 1

    def admit(self, ids: np.ndarray, policy: str) -> Tuple[np.ndarray, np.ndarray]:
        """ids [m] (unique, not cached) -> (their slots [m], the rows evicted from them [m], -1: none)."""
        slots = self._victims(len(ids), policy)
        evicted = self.id_of[slots]
        self.slot_of[evicted[evicted >= 0]] = -1
        self.slot_of[ids] = slots
        self.id_of[slots] = ids
        self.uses[slots] = 1
        return slots, evicted

    def _victims(self, m: int, policy: str) -> np.ndarray:
        """m distinct slots: never-used ones first, then the reserve's valid ones; marked used now."""
        take = min(m, self.capacity - self.filled)
        chosen = [np.arange(self.filled, self.filled + take)]
        self.last_use[chosen[0]] = self.clock
        self.filled += take
        need = m - take
        while need:
            if self._reserve_pos >= len(self._reserve):
                self._refill(need, policy)
            candidates = self._reserve[self._reserve_pos:self._reserve_pos + 2 * need]
            valid = (self.pinned[candidates] == 0) & (self.last_use[candidates] <= self._reserved_at)
            taken = np.flatnonzero(valid)[:need]
            self.last_use[candidates[taken]] = self.clock
            chosen.append(candidates[taken])
            need -= len(taken)
            self._reserve_pos += int(taken[-1]) + 1 if need == 0 else len(candidates)
        return np.concatenate(chosen)

    def _refill(self, need: int, policy: str):
        """One pass: the lowest-ranked quarter (at least `need`) of the slots neither pinned nor
        used in this operation, best victim first."""
        self._reserved_at = self.clock - 1
        free = np.flatnonzero((self.pinned == 0) & (self.last_use <= self._reserved_at))
        if len(free) < need:
            raise CacheFull(self.capacity, need)
        if policy == "lru":
            key = self.last_use[free]
        elif policy == "lfu":
            key = (self.uses[free].astype(np.int64) << 32) + self.last_use[free]
        else:
            raise ValueError(f"cache policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        n = min(len(free), max(need, self.capacity // 4))
        if n < len(free):
            part = np.argpartition(key, n - 1)[:n]
            free, key = free[part], key[part]
        self._reserve, self._reserve_pos = free[np.argsort(key, kind="stable")], 0

    def reset(self):
        assert not self.pinned.any(), "a row cache is emptied with rows pinned"
        self.slot_of.fill(-1)
        self.id_of.fill(-1)
        self.filled, self._reserve, self._reserve_pos = 0, np.zeros(0, np.int64), 0
