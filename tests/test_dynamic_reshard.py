"""A dynamic table's checkpoint restored at another hash-shard count (DistributedEmbedding.restoring,
dynamic_table.reshard): every live id keeps its row, slots, updated_at and policy state, every
candidate its sightings, in the shard its hash now picks, at any rank count; the totals' sums
are kept; a run restored at 1 or 2 shards trains on as the run restored at its own 3; a new
shard given more live ids than rows is refused in one line."""
import json
import types

import numpy as np
import pytest
import tensorflow as tf

import run.loop as run_loop
from parallel_embedding.collectives import SingleProcess
from parallel_embedding.layer import DistributedEmbedding
from parallel_embedding.planner import DynamicOptions, plan_tables
from parallel_embedding.routing import hash_shards
from storage import checkpoint
from tests.support.configs import tiny_config
from utils.errors import ConfigError

DIM, SLOT = 4, "m"   # adam's first slot


def _embeddings(shards, policy, world_size=1):
    """One DistributedEmbedding per rank of a table of 2 pools' raw ids in `shards` hash shards."""
    plan = plan_tables([1, 50], [DIM, DIM], world_size,
                       dynamic={0: DynamicOptions(2400, 2, policy, 3 if policy == "ttl" else 0, shards)})
    out = []
    for rank in range(world_size):
        comm = SingleProcess() if world_size == 1 else types.SimpleNamespace(rank=rank, size=world_size)
        emb = DistributedEmbedding(plan, comm, seed=(3, 40))
        emb.set_optimizer("adam", tf.Variable(0, dtype=tf.int64))
        out.append(emb)
    return out


def _state(embs):
    """Every live id -> (its row, slot m, updated_at, counts, last-used step, its shard), every
    candidate (id, sightings, last seen), the summed totals and update counters, of all ranks."""
    live, cands, totals, iterations = {}, set(), 0, set()
    for emb in embs:
        for s, table in emb.dynamic.items():
            shards = emb.plan.tables[0].shards
            st = {k: v.numpy() for k, v in table.map.export().items()}
            for i, r, c, u in zip(st["ids"], st["rows"], st["counts"], st["last_used"]):
                live[int(i)] = (table.variable[r].numpy().tolist(), table.slots[SLOT][r].numpy().tolist(),
                                int(table.updated_at[r, 0]), int(c), int(u), shards.index(s))
            cands |= set(zip(st["candidate_ids"].tolist(), st["candidate_sightings"].tolist(),
                             st["candidate_last_seen"].tolist()))
            totals = totals + st["totals"]
            iterations.add(int(table.optimizer.iterations.numpy()))
    return live, cands, totals.tolist(), iterations


def _trained(policy, root):
    """A 3-shard table trained 10 steps on ids from a pool of 400 (K = 2: candidates left),
    then checkpointed at `root`."""
    (emb,) = _embeddings(3, policy)
    rng = np.random.default_rng(1)
    pool = (2 ** 62 + rng.integers(0, 2 ** 40, 400)).astype(np.int64)
    for step in range(10):
        emb._step.assign(step)
        ids = rng.choice(pool, 64)
        looked = emb.lookup([tf.constant(ids), tf.constant(rng.integers(0, 50, 64))], training=True)
        grads = emb.gradients(looked, [tf.constant(rng.normal(size=(64, DIM)), tf.float32) for _ in range(2)])
        emb.apply_gradients(grads, tf.constant(0.05), False)
    checkpoint.save(root, emb.checkpoint_entries(), 10, {}, SingleProcess())
    return emb


def _restored(root, shards, policy, world_size=1):
    embs = _embeddings(shards, policy, world_size)
    tensors = checkpoint.read_manifest(root)["tensors"]
    for emb in embs:
        with emb.restoring(tensors):
            checkpoint.restore(root, emb.checkpoint_entries(), {}, emb.checkpoint_names())
    return embs


@pytest.mark.parametrize("policy", ["lru", "lfu", "ttl"])
def test_every_live_id_and_candidate_moves_to_its_new_shard_with_its_state(tmp_path, policy):
    """3 -> 1, 2 and 3 shards (and 3 -> 2 at 2 ranks, shard s on rank s % 2): the same live ids
    with bit-equal rows, slots and updated_at, the policy's counts or last-used step, each in
    the shard its hash picks; the same candidates; the totals and update counters summed and
    kept (the candidate tables, of 2400 / S slots, so sparse that no set overflows). Back from 1
    shard to 3: every shard's tensors as first saved but the totals (split evenly, their sum
    kept): each old shard's eviction order survives the merge."""
    root = str(tmp_path / "three")
    original = _state([_trained(policy, root)])
    live, cands, totals, _ = original
    assert len(live) > 30 and len(cands) > 10 and totals[1] == 0   # no eviction: the capacity does not bind
    compared = {"lru": (0, 1, 2), "lfu": (0, 1, 2, 3), "ttl": (0, 1, 2, 4)}[policy]   # the policy's state
    for shards, world_size in ((1, 1), (2, 1), (3, 1), (2, 2)):
        got = _state(_restored(root, shards, policy, world_size))
        assert sorted(got[0]) == sorted(live)
        for i, saved in live.items():
            assert [got[0][i][k] for k in compared] == [saved[k] for k in compared]
        place = hash_shards(tf.constant(list(live), tf.int64), shards).numpy().tolist()
        assert [got[0][i][5] for i in live] == place
        assert got[1:] == original[1:]
    one = str(tmp_path / "one")
    (emb,) = _restored(root, 1, policy)
    checkpoint.save(one, emb.checkpoint_entries(), 10, {}, SingleProcess())
    (back,) = _restored(one, 3, policy)
    again = str(tmp_path / "again")
    checkpoint.save(again, back.checkpoint_entries(), 10, {}, SingleProcess())
    first, second = (checkpoint.read_manifest(r)["tensors"] for r in (root, again))
    assert sorted(first) == sorted(second)
    for name in first:
        a, b = checkpoint.read_tensor(root, name), checkpoint.read_tensor(again, name)
        if name.endswith("/candidates"):   # a set's ways in import order
            a, b = sorted(map(tuple, a)), sorted(map(tuple, b))
        if not name.endswith("/totals"):
            np.testing.assert_array_equal(a, b, err_msg=name)


def test_a_new_shard_given_more_live_ids_than_rows_is_refused_in_one_line(tmp_path):
    """30 live ids in one shard of 30 rows: at 2 shards of 15 rows one shard gets more than 15."""
    root = str(tmp_path / "full")
    plan = plan_tables([1, 50], [DIM, DIM], 1, dynamic={0: DynamicOptions(30)})
    emb = DistributedEmbedding(plan, SingleProcess(), seed=(3, 40))
    emb.set_optimizer("sgd", tf.Variable(0, dtype=tf.int64))
    ids = np.arange(30, dtype=np.int64) * 1000 + 7
    emb.lookup([tf.constant(ids), tf.constant(np.zeros(30, np.int64))], training=True)
    checkpoint.save(root, emb.checkpoint_entries(), 1, {}, SingleProcess())
    counts = np.bincount(hash_shards(tf.constant(ids), 2).numpy(), minlength=2)
    fuller = int(np.argmax(counts))
    assert counts[fuller] > 15
    plan = plan_tables([1, 50], [DIM, DIM], 1, dynamic={0: DynamicOptions(30, shards=2)})
    emb = DistributedEmbedding(plan, SingleProcess(), seed=(3, 40))
    emb.set_optimizer("sgd", tf.Variable(0, dtype=tf.int64))
    with pytest.raises(ConfigError, match=rf"^dynamic table embedding/table_0: its checkpoint's 1 hash shard\(s\) "
                                          rf"restored as 2 give hash shard {fuller} {counts[fuller]} live ids for its "
                                          r"15 rows: restore with 1 shard\(s\) or a larger capacity "
                                          r"\(--dynamic_tables\)$"):
        with emb.restoring(checkpoint.read_manifest(root)["tensors"]):
            checkpoint.restore(root, emb.checkpoint_entries(), {}, emb.checkpoint_names())


def _losses(log):
    return [r["loss"] for r in map(json.loads, open(log)) if r["kind"] == "step"]


@pytest.mark.slow
def test_a_run_restored_at_another_shard_count_trains_on_as_at_its_own(tmp_path):
    """Trained 6 steps at 3 shards (K = 2, Adam; the capacity never binds), resumed to 14 at 3, 1
    and 2 shards: the same losses, exactly: each id's row, slots and updated_at are restored
    bit for bit, a new row's initial values hash (seed, id, step, column), the admissions are
    the same (the candidates kept, no set overflowing), and a shard's partial rows are summed
    with the other shards' zeros, which adds nothing. The live ids and their rows at the end equal."""
    settings = dict(synthetic_cardinalities=["20", "2000", "7", "30"], print_freq=1, optimizer="adam")
    first = str(tmp_path / "first")
    run_loop.run(tiny_config(**settings, dynamic_tables=["1:3000:2:lru:0:3"], max_steps=6, save_checkpoint_path=first))
    losses, rows = {}, {}
    for shards in (3, 1, 2):
        out = str(tmp_path / str(shards))
        run_loop.run(tiny_config(**settings, dynamic_tables=[f"1:3000:2:lru:0:{shards}"], max_steps=14,
                                 restore_checkpoint_path=first, save_checkpoint_path=out, log_path=out + ".json"))
        losses[shards] = _losses(out + ".json")
        names = checkpoint.read_manifest(out)["tensors"]
        prefixes = [n[:-4] for n in names if n.startswith("embedding/table_1") and n.endswith("/ids")]
        ids = np.concatenate([checkpoint.read_tensor(out, p + "/ids")[:, 0] for p in prefixes])
        values = np.concatenate([checkpoint.read_tensor(out, p) for p in prefixes])
        rows[shards] = dict(zip(ids.tolist(), map(tuple, values.tolist())))
        if shards == 3:
            assert len(prefixes) == 3 and checkpoint.read_tensor(out, prefixes[0] + "/totals")[0, 1] == 0
            assert len(ids) > 100 and checkpoint.read_tensor(out, prefixes[0] + "/candidates").shape[0] > 20
    assert len(losses[3]) == 8
    assert losses[1] == losses[3] and losses[2] == losses[3]
    assert rows[1] == rows[3] and rows[2] == rows[3]
