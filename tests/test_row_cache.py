"""storage/row_cache.py against a pure-Python reference of the policies (a dict per row), at tiny
capacities so that nearly every admission evicts: training's pattern (one operation per batch,
its rows and the previous batch's pinned) and serving's (a lookup, then a fill of what it missed,
nothing pinned); rows pinned at random never evicted; a full cache; reset; memory."""
import collections

import numpy as np
import pytest

from storage.row_cache import INDEX_BYTES, POLICIES, SLOT_BYTES, CacheFull, RowCache

ROWS = 60


class Reference:
    """The policies by their definition: per cached row its last use and its uses since admitted.
    An admission fills free slots, then evicts, among the cached rows neither pinned nor used in
    its operation, those of lowest key: last use (LRU) or (uses, last use) (LFU), in any order
    among equal keys (`exact`; else any of them)."""

    def __init__(self, capacity: int, policy: str, exact: bool = True):
        self.capacity, self.policy, self.exact = capacity, policy, exact
        self.last_use, self.uses, self.clock = {}, {}, 0

    def key(self, row):
        return self.last_use[row] if self.policy == "lru" else (self.uses[row], self.last_use[row])

    def tick(self):
        self.clock += 1

    def use(self, rows):
        for row in set(rows):
            self.last_use[row] = self.clock
            self.uses[row] += 1

    def admit(self, rows, pinned: set, evicted: set):
        """Checks the cache's choice `evicted` for new `rows`, then takes it."""
        candidates = {r for r in self.last_use if r not in pinned and self.last_use[r] < self.clock}
        assert len(evicted) == max(0, len(rows) - (self.capacity - len(self.last_use)))
        assert evicted <= candidates
        kept = candidates - evicted
        if self.exact and evicted and kept:
            assert max(map(self.key, evicted)) <= min(map(self.key, kept))
        for row in evicted:
            del self.last_use[row], self.uses[row]
        for row in rows:
            self.last_use[row], self.uses[row] = self.clock, 1


def cached_rows(cache: RowCache) -> set:
    return set(np.flatnonzero(cache.slot_of >= 0).tolist())


def check_same(cache: RowCache, reference: Reference):
    """The cache holds the reference's rows, with their last use and uses; its maps agree."""
    rows = np.flatnonzero(cache.slot_of >= 0)
    assert set(rows.tolist()) == set(reference.last_use)
    slots = cache.slot_of[rows]
    assert np.array_equal(cache.id_of[slots], rows) and (cache.id_of >= 0).sum() == len(rows) <= cache.capacity
    assert cache.last_use[slots].tolist() == [reference.last_use[r] for r in rows.tolist()]
    assert cache.uses[slots].tolist() == [reference.uses[r] for r in rows.tolist()]


def use_cached(cache, reference, ids):
    """Starts an operation; the cached rows of `ids` [n] are used -> (slots [n], cached [n] bool)."""
    cache.tick()
    reference.tick()
    slots = cache.slot_of[ids]
    hit = slots >= 0
    cache.use(slots[hit])
    reference.use(ids[hit].tolist())
    return slots, hit


def admit_and_check(cache, reference, rows, policy):
    """Admits `rows` (unique, not cached) in the current operation, checked against the reference;
    returns their slots."""
    pinned = set(cache.id_of[cache.pinned > 0].tolist())
    before = cached_rows(cache)
    slots, evicted = cache.admit(rows, policy)
    assert np.array_equal(cache.slot_of[rows], slots) and len(set(slots.tolist())) == len(rows)
    evicted = evicted[evicted >= 0]
    assert set(evicted.tolist()) == before - cached_rows(cache) and not pinned & set(evicted.tolist())
    reference.admit(rows.tolist(), pinned, set(evicted.tolist()))
    return slots


def zipf_rows(rng, most: int) -> np.ndarray:
    """1 to `most` distinct rows of ROWS, popular ones more often."""
    p = 1.0 / np.arange(1, ROWS + 1)
    return rng.choice(ROWS, rng.integers(1, most + 1), replace=False, p=p / p.sum())


# LFU ranks by the uses at the last pass over the cache: exact where every pass is used up at once
# (capacity // 4 <= 1: a reserve of exactly the slots needed); LRU is exact at any capacity.
CASES = [("lru", c) for c in (1, 2, 3, 7, 16, 33)] + [("lfu", c) for c in (1, 2, 3, 7)]


@pytest.mark.parametrize("policy, capacity", CASES)
def test_training_pattern_follows_the_reference(policy, capacity):
    """One operation per batch: its cached rows used and pinned, the rest admitted and pinned; a
    batch's pins held until the next batch is admitted too (the step in flight)."""
    rng = np.random.default_rng(capacity)
    cache, reference = RowCache(ROWS, capacity), Reference(capacity, policy)
    keep = 1 if capacity >= 2 else 0
    pins = collections.deque()
    for _ in range(400):
        rows = np.sort(zipf_rows(rng, max(1, capacity // (keep + 1))))
        slots, hit = use_cached(cache, reference, rows)
        cache.pin(slots[hit])
        new = admit_and_check(cache, reference, rows[~hit], policy)
        cache.pin(new)
        pins.append(np.concatenate([slots[hit], new]))
        while len(pins) > keep:
            cache.unpin(pins.popleft())
        check_same(cache, reference)


@pytest.mark.parametrize("policy, capacity", CASES)
def test_serving_pattern_follows_the_reference(policy, capacity):
    """A lookup (ids with repeats: each row used once), then a fill of at most `capacity` of the
    rows it missed, in an operation of its own; nothing pinned."""
    rng = np.random.default_rng(100 + capacity)
    cache, reference = RowCache(ROWS, capacity), Reference(capacity, policy)
    for _ in range(400):
        rows = zipf_rows(rng, min(2 * capacity + 2, ROWS // 2))
        ids = rng.permutation(np.concatenate([rows, rng.choice(rows, 3)]))
        _, hit = use_cached(cache, reference, ids)
        missed = np.unique(ids[~hit])[:capacity]
        if len(missed):
            cache.tick()
            reference.tick()
            admit_and_check(cache, reference, missed, policy)
        check_same(cache, reference)


@pytest.mark.parametrize("policy, capacity", [("lru", 6), ("lfu", 6), ("lru", 16), ("lfu", 16)])
def test_rows_pinned_at_random_are_never_evicted(policy, capacity):
    """Rows pinned for random spans, without being used (up to all but one slot), stay cached;
    victims are among the others, and at capacity 6 (every pass used up at once) the reference's.
    (At 16 a row pinned during a pass waits for the next one.)"""
    rng = np.random.default_rng(7)
    cache, reference = RowCache(ROWS, capacity), Reference(capacity, policy, exact=capacity < 8)
    held = []   # (slot, the operation that unpins it)
    for t in range(600):
        cache.tick()
        reference.tick()
        for slot, until in [h for h in held if h[1] == t]:
            cache.unpin(np.array([slot]))
        held = [h for h in held if h[1] > t]
        pinned_rows = set(cache.id_of[cache.pinned > 0].tolist())
        free = capacity - len(pinned_rows)
        rows = np.array(sorted(set(zipf_rows(rng, free).tolist()) - cached_rows(cache)), np.int64)
        admit_and_check(cache, reference, rows, policy)
        assert pinned_rows <= cached_rows(cache)
        cached = np.flatnonzero(cache.id_of >= 0)
        if len(held) < capacity - 1 and len(cached):
            slot = int(rng.choice(cached))
            cache.pin(np.array([slot]))
            held.append((slot, t + int(rng.integers(1, 20))))
        check_same(cache, reference)


def test_a_cache_with_every_other_slot_pinned_or_in_use_is_full():
    cache = RowCache(ROWS, 3)
    cache.tick()
    slots, _ = cache.admit(np.array([0, 1, 2]), "lru")
    cache.pin(slots[:2])
    cache.tick()
    cache.use(slots[2:])   # used in this operation: no victim in it either
    with pytest.raises(CacheFull, match=r"^a cache of 3 rows has no room for 1 more") as e:
        cache.admit(np.array([5]), "lru")
    assert e.value.need == 1
    cache.tick()
    _, evicted = cache.admit(np.array([5]), "lru")   # the next operation may take the unpinned slot
    assert evicted.tolist() == [2] and cached_rows(cache) == {0, 1, 5}


def test_reset_empties_the_cache():
    cache = RowCache(ROWS, 8)
    cache.tick()
    cache.admit(np.arange(8), "lru")
    cache.tick()
    cache.admit(np.array([8]), "lru")   # a pass: a reserve of 2, one left
    cache.pin(np.array([0]))
    with pytest.raises(AssertionError):
        cache.reset()
    cache.unpin(np.array([0]))
    cache.reset()
    assert cache.filled == 0 and cached_rows(cache) == set() and (cache.id_of == -1).all()
    for row in range(20, 29):   # 8 rows in the 8 slots from the first, then the first one evicted
        cache.tick()
        slots, evicted = cache.admit(np.array([row]), "lru")
        assert (slots.tolist(), evicted.tolist()) == (([row - 20], [-1]) if row < 28 else ([0], [20]))


def test_unknown_policy_and_memory():
    cache = RowCache(ROWS, 2)
    cache.tick()
    cache.admit(np.array([0, 1]), "lru")
    cache.tick()
    with pytest.raises(ValueError, match="cache policy must be one of lru, lfu, got 'fifo'"):
        cache.admit(np.array([2]), "fifo")
    assert RowCache(1000, 30).nbytes == 1000 * INDEX_BYTES + 30 * SLOT_BYTES
