"""parallel_embedding.dynamic_table: raw ids in, rows re-initialised (with their slots and
updated_at) on admission and reuse, refused ids reading zeros and taking no update, the live
rows alone checkpointed and restored (the table then goes on exactly as the original), the
one-line refusals."""
import os

import numpy as np
import pytest
import tensorflow as tf

import id_map
from parallel_embedding.collectives import SingleProcess
from parallel_embedding.dynamic_table import DynamicTable
from storage import checkpoint

D = 4


def _table(name="t", capacity=5, **kwargs):
    return DynamicTable(name, capacity, D, seed=(1, 2), **kwargs)


def _step(table, ids, step, lr=0.5):
    """One training step of the loss sum_i i * sum(emb_i): rows [n] and embeddings [n, D] before the update."""
    rows, emb = table.lookup(tf.constant(ids, tf.int64), tf.constant(step, tf.int64), training=True)
    grads = tf.ones_like(emb) * tf.range(1, len(ids) + 1, dtype=tf.float32)[:, None]
    table.apply_gradients(rows, grads, tf.constant(lr), step)
    return rows.numpy(), emb.numpy()


def test_new_rows_are_initialised_refused_ids_read_zeros_and_take_no_update():
    t = _table(capacity=4, admit_after=2, optimizer="adagrad")
    rows, emb = _step(t, [10, 11], 1)
    assert rows.tolist() == [-1, -1] and not emb.any()
    assert (t.updated_at.numpy() == 0).all() and (t.slots["accumulator"].numpy() == 0.1).all()
    rows, emb = _step(t, [10, 11, 10], 2)          # second sighting: admitted
    assert rows.tolist() == [0, 1, 0]
    limit = np.sqrt(1 / 4)
    assert (np.abs(emb) <= limit).all() and np.abs(emb).sum() > 0
    np.testing.assert_array_equal(emb[0], emb[2])
    assert t.updated_at.numpy()[:, 0].tolist() == [3, 3, 0, 0]
    acc = t.slots["accumulator"].numpy()
    assert (acc[0] == 0.1 + 16).all() and (acc[1] == 0.1 + 4).all() and (acc[2:] == 0.1).all()
    assert t.counts()["admitted"] == 2 and t.counts()["refused"] == 2


def test_an_evicted_row_and_its_slots_are_reset_before_reuse():
    t = _table(capacity=2, optimizer="adam")
    for step in range(1, 4):
        _step(t, [1, 2], step)
    trained = t.lookup(tf.constant([1], tf.int64), 4, training=False)[1].numpy()
    rows, emb = _step(t, [3], 4)                     # LRU: id 1 goes, its row 0 goes to id 3
    assert rows.tolist() == [0]
    fresh = t._initial_rows(tf.constant([3], tf.int64), tf.constant(4, tf.int64)).numpy()
    np.testing.assert_allclose(emb, fresh)
    assert not np.allclose(emb, trained)
    m, v = t.slots["m"].numpy()[0], t.slots["v"].numpy()[0]
    assert np.abs(m).sum() > 0 and np.abs(v).sum() > 0   # one update since the reset ...
    rows, emb = _step(t, [1], 5)                         # ... id 1 comes back fresh, not trained
    assert rows.tolist() == [1] and not np.allclose(emb, trained)
    np.testing.assert_allclose(emb, t._initial_rows(tf.constant([1], tf.int64), tf.constant(5, tf.int64)).numpy())
    assert t.counts()["evicted"] == 2 and t.lookup(tf.constant([2], tf.int64), 6, training=False)[0].numpy() == [-1]


def test_unknown_ids_read_zeros_outside_training_and_change_nothing():
    t = _table()
    _step(t, [7], 1)
    before = t.variable.numpy().copy()
    rows, emb = t.lookup(tf.constant([7, 8], tf.int64), 2, training=False)
    assert rows.numpy().tolist() == [0, -1] and not emb.numpy()[1].any() and emb.numpy()[0].any()
    np.testing.assert_array_equal(t.variable.numpy(), before)
    assert t.counts()["live"] == 1


def test_a_batch_too_big_for_the_capacity_is_one_line_naming_the_table():
    t = _table("user_id", capacity=3)
    with pytest.raises(ValueError, match=r"^dynamic table user_id: capacity 3 rows is too small for one batch's "
                                         r"distinct ids[^\n]*$"):
        t.lookup(tf.constant([1, 2, 3, 4], tf.int64), 1, training=True)


def _batches(seed, steps):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        yield np.unique(rng.zipf(1.5, size=6) % 23 - 11)[:5].astype(np.int64) * 1_000_003


@pytest.mark.parametrize("policy,k,optimizer", [("lru", 1, "sgd"), ("lfu", 3, "adagrad"), ("ttl", 3, "adam"),
                                                ("lru", 3, "adam"), ("lfu", 1, "sgd"), ("ttl", 1, "adagrad")])
def test_a_checkpoint_holds_the_live_rows_only_and_the_restored_table_goes_on_the_same(tmp_path, policy, k, optimizer):
    options = dict(capacity=6, admit_after=k, policy=policy, ttl=3 if policy == "ttl" else 0, optimizer=optimizer,
                   candidate_slots=8)
    batches = list(_batches(k, 50))
    a = _table("a", **options)
    for step, ids in enumerate(batches[:25], start=1):
        _step(a, ids, step)
    assert a.counts()["evicted"] > 0
    path = checkpoint.save(str(tmp_path), a.checkpoint_entries(), 25, {}, SingleProcess())
    live = a.counts()["live"]
    manifest = checkpoint.read_manifest(path)
    assert manifest["tensors"]["a"]["shape"] == [live, D]
    b = _table("a", **options)
    b.restore(str(tmp_path))
    assert b.counts() == a.counts()
    for step, ids in enumerate(batches[25:], start=26):
        ra, ea = _step(a, ids, step)
        rb, eb = _step(b, ids, step)
        np.testing.assert_array_equal(ra >= 0, rb >= 0)
        np.testing.assert_allclose(ea, eb, rtol=1e-6, err_msg=f"step {step}")
    assert a.counts() == b.counts()
    every_id = tf.constant(np.concatenate(batches))
    np.testing.assert_allclose(a.lookup(every_id, 99, False)[1].numpy(), b.lookup(every_id, 99, False)[1].numpy(),
                               rtol=1e-6)


def test_a_checkpoint_of_an_empty_table_restores(tmp_path):
    t = _table(admit_after=2)
    entries = t.checkpoint_entries()
    assert all(e.shape[0] == 0 for e in entries if not e.name.endswith(("/totals", "/iterations")))
    checkpoint.save(str(tmp_path), entries, 1, {}, SingleProcess())
    u = _table(admit_after=2)
    u.restore(str(tmp_path))
    assert u.counts() == t.counts() and u.counts()["live"] == 0


def test_a_static_tables_checkpoint_is_refused_naming_the_table(tmp_path):
    var = tf.Variable(tf.zeros([6, D]))
    checkpoint.save(str(tmp_path), [checkpoint.Entry("emb", var, (6, D))], 1, {}, SingleProcess())
    with pytest.raises(ValueError, match=r"^dynamic table emb: .* lacks emb/updated_at \(a static table's"):
        _table("emb").restore(str(tmp_path))
