"""A dynamic table in hash shards at N ranks is routed (parallel_embedding/routing.py):
each shard's owner receives, maps and returns only the ids of its hash range. Two and three ranks
run as threads of this process over collectives that record what every rank sends, against one
process holding the same shards: the features, the maps' state and the tables' values equal bit
for bit, under eviction, with one-hot ids, multi-hot ids ("mean") of a table read by two inputs,
and a static table beside them, for model- and data-parallel input; and the rows' and gradients'
all-to-alls carry each id's row once (one table's traffic), not S [B, D] blocks, a multi-hot
table's summed per sample and hash shard by the shard's owner."""
import collections
import threading

import numpy as np
import pytest
import tensorflow as tf

from parallel_embedding.collectives import SingleProcess
from parallel_embedding.layer import DistributedEmbedding
from parallel_embedding.planner import DynamicOptions, plan_tables
from parallel_embedding.routing import hash_shards

B, STEPS = 12, 8
DIMS = [8, 4, 6]
INPUTS = [1, 1, 2]                 # table 2 is read by two inputs
COMBINERS = ["sum", "sum", "mean"]
# Table 0: 24 rows in 3 hash shards for 60 ids, admitted at the 2nd sighting, LRU (evicting);
# table 1 static; table 2: 40 rows in 2 hash shards for 100 ids, LFU, multi-hot.
DYNAMIC = {0: DynamicOptions(24, 2, "lru", shards=3), 2: DynamicOptions(40, 1, "lfu", shards=2)}
POOL = [2 ** 40 + 7919 * np.arange(60, dtype=np.int64), None, 2 ** 50 + 104729 * np.arange(100, dtype=np.int64)]


class Ranks:
    """N ranks as threads: the collectives DistributedEmbedding calls, met at a barrier; `sent`
    counts, per collective name, the elements every rank sent."""

    def __init__(self, n: int):
        self.n, self.barrier, self.lock = n, threading.Barrier(n), threading.Lock()
        self.boxes, self.sent = collections.defaultdict(dict), collections.Counter()

    def comm(self, rank: int):
        return _Rank(self, rank)


class _Rank(SingleProcess):
    def __init__(self, ranks: Ranks, rank: int):
        self.ranks, self.rank, self.size, self.calls = ranks, rank, ranks.n, 0

    def _meet(self, value):
        """Every rank's `value` of this call, in rank order."""
        self.calls += 1
        with self.ranks.lock:
            self.ranks.boxes[self.calls][self.rank] = value
        self.ranks.barrier.wait()
        return [self.ranks.boxes[self.calls][r] for r in range(self.size)]

    def alltoall(self, tensor, counts, name):
        value = tensor.numpy()
        with self.ranks.lock:
            self.ranks.sent[name] += value.size
        parts = np.split(value, np.cumsum(np.asarray(counts))[:-1])
        return tf.constant(np.concatenate([p[self.rank] for p in self._meet(parts)]), tensor.dtype)

    def allgather(self, tensor, name):
        return tf.constant(np.concatenate(self._meet(tensor.numpy())), tensor.dtype)

    def allgather_object(self, obj, name):
        return self._meet(obj)


def batches():
    """Per step, every feature's global ids: [B] (table 0 raw, table 1 in [0, 50)) and [2 B, None]."""
    rng = np.random.default_rng(7)
    out = []
    for _ in range(STEPS):
        lengths = rng.integers(0, 4, 2 * B)
        hot = tf.RaggedTensor.from_row_lengths(rng.choice(POOL[2], lengths.sum()), lengths)
        out.append([tf.constant(rng.choice(POOL[0], B)), tf.constant(rng.integers(0, 50, B)), hot])
    return out


def rows_of(x, rank, n, m=1):
    """A global [m B] (or ragged) input's rows of `rank`: each input's b rows, input by input."""
    b = B // n
    return tf.concat([x[i * B + rank * b:i * B + (rank + 1) * b] for i in range(m)], axis=0)


def train(emb, step, inputs, grads, results):
    """Runs the steps on one rank: per step its features (per feature [m b, D]) into `results`."""
    for ids, g in zip(inputs, grads):
        looked_up = emb.lookup(ids, training=True)
        results.append(emb.exchange(looked_up, B // emb.size))
        emb.apply_gradients(emb.gradients(looked_up, g), tf.constant(0.5), multi_hot=True)
        step.assign_add(1)


def embedding(plan, comm, data_parallel, combiners=COMBINERS, inputs=INPUTS):
    emb = DistributedEmbedding(plan, comm, seed=(1, 100), data_parallel_input=data_parallel, combiners=combiners,
                               inputs_per_table=inputs)
    step = tf.Variable(0, dtype=tf.int64)
    emb.set_optimizer("adagrad", step)
    return emb, step


def run_ranks(ranks, embs, data, grads, data_parallel, inputs):
    """`train` on every rank, each a thread, from the global batches `data` and feature gradients
    `grads`; returns each rank's features per step."""
    n, got, errors = ranks.n, [[] for _ in range(ranks.n)], []

    def rank(r):
        emb, step = embs[r]

        def ids(x, f):
            if data_parallel or emb.input_rows(f) == "local":
                return rows_of(x, r, n, inputs[f])
            return x if emb.input_rows(f) == "global" else tf.zeros([0], tf.int64)
        try:
            train(emb, step, [[ids(x, f) for f, x in enumerate(batch)] for batch in data],
                  [[rows_of(g, r, n, m) for g, m in zip(gs, inputs)] for gs in grads], got[r])
        except BaseException as e:   # noqa: BLE001 (raised below)
            errors.append(e)
            ranks.barrier.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return got


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("data_parallel", [False, True], ids=["model_parallel", "data_parallel"])
def test_routed_hash_shards_equal_one_process_and_send_each_row_once(n, data_parallel):
    data = batches()
    rng = np.random.default_rng(3)
    grads = [[tf.constant(rng.normal(size=(m * B, d)), tf.float32) for m, d in zip(INPUTS, DIMS)]
             for _ in range(STEPS)]
    one, one_step = embedding(plan_tables([60, 50, 100], DIMS, 1, dynamic=DYNAMIC), SingleProcess(), False)
    want = []
    train(one, one_step, data, grads, want)

    ranks, plan = Ranks(n), plan_tables([60, 50, 100], DIMS, n, dynamic=DYNAMIC)
    embs = [embedding(plan, ranks.comm(r), data_parallel) for r in range(n)]
    assert [len(emb.dynamic) for emb, _ in embs] == ([3, 2] if n == 2 else [2, 2, 1])
    got = run_ranks(ranks, embs, data, grads, data_parallel, INPUTS)
    for s in range(STEPS):   # the features of the global batch, bit for bit: the owners sum a sample's
        for f, m in enumerate(INPUTS):   # ids' rows, and the ranks the shards' sums, as one process does
            rows = tf.concat([got[r][s][f][i * (B // n):(i + 1) * (B // n)] for i in range(m) for r in range(n)], 0)
            np.testing.assert_array_equal(rows.numpy(), want[s][f].numpy(), err_msg=f"{s} {f}")
    for emb, _ in embs:   # each hash shard's map and rows bit for bit
        for shard, table in emb.dynamic.items():
            reference = one.dynamic[next(s for s in one.dynamic if s.feature == shard.feature and
                                         s.row_start == shard.row_start)]
            state, expected = table.map.export(), reference.map.export()
            for k in expected:
                np.testing.assert_array_equal(state[k].numpy(), expected[k].numpy(), err_msg=k)
            np.testing.assert_array_equal(table.variable.numpy(), reference.variable.numpy())
    assert one.dynamic_stats()["embedding/table_0"]["evicted"] > 0

    # Traffic: the rows' and gradients' all-to-alls carry the static layout's blocks and each id's
    # row once: B D_0 for table 0 (one table's) and (its ids) D_2 for table 2, where every hash
    # shard sent its [m B, D] block before (S_0 B D_0 + S_2 2B D_2); table 2 (multi-hot): one row
    # per sample and hash shard (its ids' rows summed by their owner).
    emb = embs[0][0]
    static = sum(n * (B // n) * w for w in emb._widths) * STEPS
    ids = sum(int(batch[2].values.shape[0]) for batch in data)
    samples = sum(len(set(zip(batch[2].value_rowids().numpy(), hash_shards(batch[2].values, 2).numpy())))
                  for batch in data)   # (sample, shard) pairs of table 2
    assert samples < ids
    routed = B * STEPS * DIMS[0] + samples * DIMS[2]
    assert routed < (3 * B * DIMS[0] + 2 * 2 * B * DIMS[2]) * STEPS
    assert ranks.sent["embedding_grads"] == static + routed
    counts = n * (3 * INPUTS[0] + 2 * INPUTS[2]) * STEPS   # data-parallel: per rank and shard, a count per input
    if data_parallel:   # the routed ids ride in the ids' all-to-all (an all-to-all of their own before), after
        # table 1's B ids for each rank holding a shard of it: table 0's ids, table 2's each with its sample
        # and the sample's id count (one int64); no multi-hot ids' all-to-all either (the only multi-hot
        # table is routed: that all-to-all sent nothing before)
        assert "embedding_routed_ids" not in ranks.sent and "embedding_multi_hot_ids" not in ranks.sent
        assert {f for fs in emb._features_of for f in fs} == {1}
        static_ids = sum(len(fs) for fs in emb._features_of) * B * STEPS
        assert ranks.sent["embedding_ids"] == static_ids + counts + B * STEPS + 2 * ids
        assert ranks.sent["embedding_rows"] == static + routed
    else:   # no all-to-all of its own: the owners send each rank its rows' samples with the rows,
        # after a count per shard (an all-to-all of samples carried as many, a sample an id, before)
        assert "embedding_routed_positions" not in ranks.sent
        assert ranks.sent["embedding_rows"] == static + routed + n * 5 * STEPS + B * STEPS + samples


@pytest.mark.parametrize("data_parallel", [False, True], ids=["model_parallel", "data_parallel"])
def test_a_plan_of_routed_tables_alone(data_parallel):
    """No static table beside the routed one: the rows' all-to-all carries routed rows only."""
    data = [batch[:1] for batch in batches()]
    grads = [[tf.constant(np.random.default_rng(s).normal(size=(B, DIMS[0])), tf.float32)] for s in range(STEPS)]
    dynamic = {0: DYNAMIC[0]}
    one, one_step = embedding(plan_tables([60], DIMS[:1], 1, dynamic=dynamic), SingleProcess(), False, ["sum"], [1])
    want = []
    train(one, one_step, data, grads, want)
    ranks = Ranks(2)
    plan = plan_tables([60], DIMS[:1], 2, dynamic=dynamic)
    embs = [embedding(plan, ranks.comm(r), data_parallel, ["sum"], [1]) for r in range(2)]
    got = run_ranks(ranks, embs, data, grads, data_parallel, [1])
    for s in range(STEPS):
        np.testing.assert_allclose(tf.concat([got[0][s][0], got[1][s][0]], 0).numpy(), want[s][0].numpy(),
                                   rtol=1e-6, atol=1e-7, err_msg=str(s))
    # model-parallel input: with the rows, per owner and rank a count per shard (3) and a sample per id
    assert ranks.sent["embedding_rows"] == (B * DIMS[0] + (0 if data_parallel else 2 * 3 + B)) * STEPS
    assert ranks.sent["embedding_grads"] == B * DIMS[0] * STEPS
    if data_parallel:   # the ids' all-to-all carries only routed ids: per rank a count per shard (3), and the ids
        assert ranks.sent["embedding_ids"] == (2 * 3 + B) * STEPS
    assert set(ranks.sent) == {"embedding_rows", "embedding_grads"} | ({"embedding_ids"} if data_parallel else set())
