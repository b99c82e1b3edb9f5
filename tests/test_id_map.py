"""The id map op (tensorflow-id-map) against its pure-Python reference (id_map.reference), step
by step at tiny capacities that force constant eviction: the same rows, codes, evictions and
state for each policy and admission after 1 and 3 sightings; never two live ids on one row; the
same results on the parallel path; export and restore; the one-line refusals."""
import numpy as np
import pytest
import tensorflow as tf

import id_map
from id_map.reference import Full, Reference

CASES = [(policy, k) for policy in id_map.POLICIES for k in (1, 3)]


def _options(policy, k, candidate_slots=0):
    return dict(admit_after=k, policy=policy, ttl=2 if policy == "ttl" else 0, candidate_slots=candidate_slots)


def _batches(seed, steps, size, universe, capacity):
    """Zipf-like batches (some ids hot, most rare, negative and huge ids too) with at most
    `capacity` distinct ids each."""
    rng = np.random.default_rng(seed)
    pool = rng.integers(-2 ** 63, 2 ** 63 - 1, size=universe, dtype=np.int64)
    pool[:3] = [0, -1, 2 ** 63 - 1]
    for _ in range(steps):
        ranks = np.minimum(rng.zipf(1.3, size=size) - 1, universe - 1)
        batch = pool[ranks]
        while len(np.unique(batch)) > capacity:
            batch = batch[:-1]
        yield batch


def _state(m):
    return {k: v.numpy().tolist() for k, v in m.export().items()}


def _assert_no_shared_row(m, capacity):
    state = m.export()
    ids, rows = state["ids"].numpy(), state["rows"].numpy()
    assert len(np.unique(rows)) == len(rows) == len(np.unique(ids)) <= capacity
    assert ((rows >= 0) & (rows < capacity)).all()
    np.testing.assert_array_equal(m.find(tf.constant(ids, tf.int64)).numpy(), rows)


@pytest.mark.parametrize("policy,k", CASES)
def test_equals_the_reference_step_by_step_under_constant_eviction(policy, k):
    capacity = 6
    m = id_map.IdMap("t", capacity, **_options(policy, k, candidate_slots=8))
    ref = Reference(capacity, **_options(policy, k, candidate_slots=8))
    seen = {id_map.ADMITTED: 0, id_map.EVICTED: 0, id_map.REFUSED: 0}
    for step, batch in enumerate(_batches(k, 200, 5, 40, capacity), start=1):
        *got, full = m.find_or_insert(tf.constant(batch), step)
        rows, codes, evicted = (t.numpy().tolist() for t in got)
        want = ref.find_or_insert(batch.tolist(), step)
        assert not full
        assert (rows, codes, evicted) == tuple(want), f"step {step}"
        assert _state(m) == ref.export(), f"step {step}"
        _assert_no_shared_row(m, capacity)
        for c in codes:
            seen[c] = seen.get(c, 0) + 1
    assert seen[id_map.EVICTED] >= 10 and (seen[id_map.REFUSED] >= 10 or k == 1 and policy != "ttl"), seen
    stats = m.stats()
    assert (stats["admitted"], stats["evicted"], stats["refused"]) == tuple(ref.totals)
    assert stats["live"] == capacity and stats["capacity"] == capacity


@pytest.mark.parametrize("policy,k", [("lru", 1), ("lfu", 3)])
def test_big_batches_on_the_parallel_path_equal_the_reference(policy, k):
    capacity = 30000
    m = id_map.IdMap("big", capacity, **_options(policy, k))
    ref = Reference(capacity, **_options(policy, k))
    for step, batch in enumerate(_batches(7, 4, 40000, 200000, capacity), start=1):
        assert len(batch) >= 16384   # src/id_map_ops.cc kParallelFrom: finds spread over the threads
        got = tuple(t.numpy().tolist() for t in m.find_or_insert(tf.constant(batch), step))
        assert got == (*ref.find_or_insert(batch.tolist(), step), False), f"step {step}"
    _assert_no_shared_row(m, capacity)
    rows = m.find(tf.constant(batch)).numpy()
    assert (rows == np.array([ref.row_of.get(i, -1) for i in batch.tolist()])).all()


@pytest.mark.parametrize("policy,k", CASES)
def test_an_exported_state_restored_goes_on_the_same(policy, k):
    capacity = 6
    batches = list(_batches(3, 60, 5, 30, capacity))
    a = id_map.IdMap("a", capacity, **_options(policy, k))
    for step, batch in enumerate(batches[:30], start=1):
        a.find_or_insert(tf.constant(batch), step)
    b = id_map.IdMap("b", capacity, **_options(policy, k))
    b.restore(a.export())
    assert _state(b) == _state(a) and b.stats() == a.stats()
    for step, batch in enumerate(batches[30:], start=31):
        got_a = [t.numpy().tolist() for t in a.find_or_insert(tf.constant(batch), step)]
        assert got_a == [t.numpy().tolist() for t in b.find_or_insert(tf.constant(batch), step)]


def test_find_changes_nothing_and_unknown_ids_have_no_row():
    m = id_map.IdMap("t", 4)
    m.find_or_insert(tf.constant([10, 20], tf.int64), 1)
    before = _state(m)
    assert m.find(tf.constant([20, 30, 10], tf.int64)).numpy().tolist() == [1, -1, 0]
    assert _state(m) == before


def test_a_batch_with_more_distinct_ids_than_rows_is_full():
    """Full: every row -1, every code REFUSED (the caller fails the step); the ids before the one
    that found no row admitted, as the reference's state when it raises."""
    m = id_map.IdMap("table_7", 3)
    rows, codes, evicted, full = (t.numpy().tolist() for t in m.find_or_insert(tf.constant([1, 2, 3, 4], tf.int64), 1))
    assert full and rows == [-1] * 4 and codes == [id_map.REFUSED] * 4 and evicted == [0] * 4
    assert m.find(tf.constant([1, 2, 3, 4], tf.int64)).numpy().tolist() == [0, 1, 2, -1]
    ref = Reference(3)
    with pytest.raises(Full):
        ref.find_or_insert([1, 2, 3, 4], 1)


def test_ttl_refuses_until_a_row_expires():
    m = id_map.IdMap("t", 2, policy="ttl", ttl=3)
    m.find_or_insert(tf.constant([1, 2], tf.int64), 1)
    _, codes, _, _ = m.find_or_insert(tf.constant([3], tf.int64), 3)
    assert codes.numpy().tolist() == [id_map.REFUSED]
    rows, codes, evicted, _ = m.find_or_insert(tf.constant([3], tf.int64), 4)
    assert codes.numpy().tolist() == [id_map.EVICTED] and evicted.numpy().tolist() == [1]


@pytest.mark.parametrize("kwargs", [dict(capacity=0), dict(capacity=4, policy="fifo"), dict(capacity=4, policy="ttl"),
                                    dict(capacity=4, ttl=5), dict(capacity=4, admit_after=0)])
def test_bad_settings_are_one_line_naming_the_table(kwargs):
    with pytest.raises(ValueError, match="^dynamic table emb_3: [^\n]*$"):
        id_map.IdMap("emb_3", **kwargs)


def test_a_restore_of_a_bad_state_is_refused_naming_the_table():
    m = id_map.IdMap("t9", 4)
    state = dict(m.export(), ids=tf.constant([1, 2], tf.int64), rows=tf.constant([0, 0], tf.int32),
                 counts=tf.constant([1, 1], tf.int64), last_used=tf.constant([1, 1], tf.int64))
    with pytest.raises(tf.errors.InvalidArgumentError, match="dynamic table t9: cannot restore: a row given twice"):
        m.restore(state)
