"""The disk tier (parallel_embedding/tiered.py) in one process, under the run's step (the built-in
DLRM, examples/dlrm.py, handed its tables on the plan: run.run_model.RunTrainer).

- Training and evaluation through caches of the rows of the batches in flight (constant
  eviction) are bit-identical to the in-memory tables: every loss, logit and checkpoint tensor.
- Checkpoints move between the tiers (tiered -> memory, tiered -> tiered, memory -> tiered).
- Victims against a pure-Python reference: exact LRU, and LFU where each selection refreshes
  the reserve; LFU keeps frequently used rows that LRU evicts.
- The store's statistics against what the cache held before each batch; the store's errors.
"""
import collections
import functools
import os
import re
import types

import numpy as np
import pytest
import tensorflow as tf

from storage import checkpoint
from nn.model import model_tables
from nn.model_config import ModelConfig, table_configs
from parallel_embedding.collectives import SingleProcess
from parallel_embedding.planner import (BYTES_PER_ELEMENT, INDEX_BYTES_PER_ROW, SLOT_OVERHEAD_BYTES, assign_tiers,
                                        plan_tables)
from parallel_embedding import tiered
from parallel_embedding.tiered import DiskTier, Unit
from run.run_model import RunTrainer
from tests.support.builtin import builtin_trainer
from utils.errors import ConfigError, DatasetError, StoreError

# Features 1 and 2 go to disk (600 and 1,000 rows, caches of 2 x batch x hotness rows); 0 and 3 stay in
# memory (on disk, their caches would hold every row). Multi-hot: features 0 and 2, mean combiner.
CARDS, DIM, DISK = [50, 600, 1000, 30], 8, (1, 2)
HOTNESS = {"one": [None] * 4, "multi": [3, None, 2, None]}
SLOTS = {"sgd": 0, "adagrad": 1, "adam": 2}
BATCH, EVAL_BATCH, STEPS = 16, 8, 12


def model_config(hot: str) -> ModelConfig:
    hotness = HOTNESS[hot]
    return ModelConfig(tables=table_configs(cardinalities=CARDS, dims=[DIM] * 4, max_hotness=hotness,
                                            multi_hot_combiner="mean" if any(hotness) else None),
                       num_numerical=3, bottom_mlp_dims=(16, 8), top_mlp_dims=(16, 1))


def make_batches(hot: str, n: int, batch: int, seed: int) -> list:
    """n elements (numerical [batch, 3], F ids, labels [batch]): half of the ids from a feature's
    first 20 rows (repeats within and across batches), half uniform; multi-hot rows of 0 to
    max_hotness ids, and one batch whose multi-hot features have no ids at all."""
    rng = np.random.default_rng(seed)

    def ids(c, size):
        return np.where(rng.random(size) < 0.5, rng.integers(0, min(c, 20), size), rng.integers(0, c, size))

    out = []
    for i in range(n):
        cat = []
        for f, (c, h) in enumerate(zip(CARDS, HOTNESS[hot])):
            if h:
                lengths = rng.integers(0, h + 1, batch) * (i != 2)
                cat.append(tf.RaggedTensor.from_row_lengths(ids(c, lengths.sum()), lengths))
            else:
                cat.append(tf.constant(ids(c, batch), tf.int32 if f == 1 else tf.int64))
        out.append((tf.constant(rng.normal(size=(batch, 3)), tf.float32), tuple(cat),
                    tf.constant(rng.integers(0, 2, batch), tf.float32)))
    return out


@functools.lru_cache(maxsize=None)
def batches(hot: str, n: int = STEPS, batch: int = BATCH, seed: int = 0) -> list:
    return make_batches(hot, n, batch, seed)


def disk_plan(hot: str, slots: int, rows_in_flight: int):
    """The plan with features 1 and 2 on disk at the smallest budget: caches of min_cache_rows =
    rows_in_flight x hotness rows, far fewer than the tables' rows."""
    min_cache = [rows_in_flight * (h or 1) for h in HOTNESS[hot]]
    row_bytes = BYTES_PER_ELEMENT * (1 + slots) * DIM
    budget = sum(min_cache[f] * (row_bytes + SLOT_OVERHEAD_BYTES) + c * INDEX_BYTES_PER_ROW if f in DISK
                 else c * row_bytes for f, c in enumerate(CARDS))
    plan = assign_tiers(plan_tables(CARDS, [DIM] * 4, 1), slots, budget, min_cache)
    assert [(f, t.kind, t.cache_rows) for _, f, t in plan.tiers] == [(f, "disk", min_cache[f]) for f in DISK]
    assert all(8 * min_cache[f] <= CARDS[f] for f in DISK)
    return plan


def directory(tmp_path, name: str) -> str:
    os.mkdir(tmp_path / name)
    return str(tmp_path / name)


def build(hot: str, optimizer: str, store=None, rows_in_flight: int = 2 * BATCH, policy: str = "lru",
          xla: bool = False, amp: bool = False, plan=None) -> RunTrainer:
    """The run's trainer of the built-in DLRM of model_config(hot), in memory, or with the disk
    plan if `store` (a directory), or on `plan`."""
    plan = plan or (disk_plan(hot, SLOTS[optimizer], rows_in_flight) if store else None)
    hotness = HOTNESS[hot]
    return builtin_trainer(plan, max_hotness=hotness, multi_hot_combiner="mean" if any(hotness) else None,
                           store_path=store, cache_policy=policy, synthetic_cardinalities=[str(c) for c in CARDS],
                           embedding_dim=[str(DIM)], seed=3, optimizer=optimizer, learning_rate=0.1, warmup_steps=0,
                           decay_start_step=100, decay_steps=100, xla=xla,
                           **(dict(amp=True, compute_dtype=tf.bfloat16) if amp else {}))


def tables(trainer: RunTrainer):
    """The trainer's tables (the DistributedEmbedding of its model's layer)."""
    return trainer.model.embeddings.layers[0].embedding


def train(trainer: RunTrainer, elements) -> list:
    """Losses of train steps on `elements`, staged."""
    return [float(trainer.train_step(*e)) for e in trainer.model.embeddings.staged(iter(elements), training=True)]


def state(trainer: RunTrainer, weights_only: bool = False) -> dict:
    """Every checkpoint tensor's part this trainer holds, by (name, row_start, col_start)."""
    out = {}
    for e in trainer.checkpoint_entries(weights_only):
        v = e.variable
        value = v.read_rows(0, v.shape[0]) if e.streamed else v.numpy()
        out[e.name, e.row_start, e.col_start] = value if e.num_rows is None else value[:e.num_rows]
    return out


def assert_same_state(a: dict, b: dict):
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and np.array_equal(a[key], b[key]), key


@functools.lru_cache(maxsize=None)
def in_memory(hot: str, optimizer: str, xla: bool = False, amp: bool = False):
    """(losses, state) of the in-memory run on batches(hot)."""
    trainer = build(hot, optimizer, xla=xla, amp=amp)
    return train(trainer, batches(hot)), state(trainer)


def check_evicted(trainer: RunTrainer):
    """The run read and wrote back more rows than its caches hold."""
    stats = trainer.model.embeddings.store_stats()
    units = tables(trainer).tiered.units.values()
    assert stats["store_rows_written"] > 0 and stats["store_rows_read"] > 2 * sum(u.capacity for u in units)


# Bit-identical to the tables in memory ----------------------------------------------------------------

VARIANTS = [(optimizer, hot, {}) for optimizer in SLOTS for hot in HOTNESS] + [
    ("adagrad", "multi", dict(policy="lfu")), ("adam", "one", dict(xla=True)), ("adam", "multi", dict(amp=True))]


@pytest.mark.parametrize("optimizer, hot, options", VARIANTS,
                         ids=[f"{o}-{h}" + "".join(f"-{k}={v}" for k, v in kw.items()) for o, h, kw in VARIANTS])
@pytest.mark.slow
def test_training_through_tiny_caches_is_bit_identical(tmp_path, optimizer, hot, options):
    trainer = build(hot, optimizer, str(tmp_path), **options)
    losses = train(trainer, batches(hot))
    check_evicted(trainer)
    expected_losses, expected_state = in_memory(hot, optimizer, **{k: v for k, v in options.items() if k != "policy"})
    assert losses == expected_losses
    assert_same_state(state(trainer), expected_state)
    trainer.model.embeddings.close()


def test_evaluation_between_training_steps_is_bit_identical(tmp_path):
    """Every third step, two evaluation batches staged while a training batch is in its step and
    the next one staged: caches of exactly the rows of those four batches."""
    evals = batches("multi", 2, EVAL_BATCH, 1)

    def run(trainer):
        emb, losses, logits = trainer.model.embeddings, [], []
        for step, element in enumerate(emb.staged(iter(batches("multi")), training=True)):
            losses.append(float(trainer.train_step(*element)))
            if step % 3 == 0:
                logits += [trainer.predict(*e[:2]).numpy() for e in emb.staged(iter(evals), training=False)]
        return losses, logits, state(trainer)

    on_disk = run(build("multi", "adam", str(tmp_path), rows_in_flight=2 * (BATCH + EVAL_BATCH)))
    memory = run(build("multi", "adam"))
    assert on_disk[0] == memory[0]
    assert len(on_disk[1]) == 8 and all(np.array_equal(a, b) for a, b in zip(on_disk[1], memory[1]))
    assert_same_state(on_disk[2], memory[2])


# Checkpoints across tiers ------------------------------------------------------------------------------

def save(trainer: RunTrainer, root, weights_only: bool = False) -> str:
    return checkpoint.save(str(root), trainer.checkpoint_entries(weights_only), int(trainer.step.numpy()),
                           model_config("multi").signature(None if weights_only else "adam"), SingleProcess())


def restore(trainer: RunTrainer, path: str, weights_only: bool = False):
    checkpoint.restore(path, trainer.checkpoint_entries(weights_only),
                       model_config("multi").signature(None if weights_only else "adam"),
                       trainer.checkpoint_names(weights_only), extra_ok=weights_only,
                       optional=trainer.optional_names())


def test_checkpoints_move_between_tiers(tmp_path):
    """Saved after k steps with the next batch staged (its rows cached, dirty and pinned), then
    restored into memory, into a fresh store, and from memory into a store: m more steps give the
    uninterrupted run's losses and state, bit for bit."""
    data, k = batches("multi"), 5

    def run_with_save(trainer, root):   # saves between steps k and k + 1, as main.py does
        losses = []
        for step, element in enumerate(trainer.model.embeddings.staged(iter(data), training=True)):
            losses.append(float(trainer.train_step(*element)))
            if step + 1 == k:
                path = save(trainer, root)
        return losses, path

    memory = build("multi", "adam")
    losses, memory_ckpt = run_with_save(memory, tmp_path / "memory_ckpt")
    expected = state(memory)
    on_disk = build("multi", "adam", directory(tmp_path, "a"))
    disk_losses, disk_ckpt = run_with_save(on_disk, tmp_path / "disk_ckpt")
    assert disk_losses == losses
    assert_same_state(state(on_disk), expected)
    for name in memory.checkpoint_names():   # updated_at too: batch k + 1, staged before the save, not yet in it
        assert np.array_equal(checkpoint.read_tensor(disk_ckpt, name), checkpoint.read_tensor(memory_ckpt, name))
    for path, store in ((disk_ckpt, None), (disk_ckpt, "b"), (memory_ckpt, "c")):
        trainer = build("multi", "adam", store and directory(tmp_path, store))
        restore(trainer, path)
        assert train(trainer, data[k:]) == losses[k:]
        assert_same_state(state(trainer), expected)


def test_weights_only_checkpoints_move_between_tiers(tmp_path):
    """The weights of a run on disk, saved alone, are the in-memory run's; restored into memory and
    into a store (fresh optimizers), training goes on identically."""
    on_disk = build("multi", "adam", directory(tmp_path, "a"))
    train(on_disk, batches("multi"))
    path = save(on_disk, tmp_path / "ckpt", weights_only=True)
    expected = in_memory("multi", "adam")[1]
    names = on_disk.checkpoint_names(weights_only=True)
    assert names and all(np.array_equal(checkpoint.read_tensor(path, n), expected[n, 0, 0]) for n in names)
    runs = []
    for store in (None, "b"):
        trainer = build("multi", "adam", store and directory(tmp_path, store))
        restore(trainer, path, weights_only=True)
        assert all(np.array_equal(v, expected[key]) for key, v in state(trainer, weights_only=True).items())
        runs.append((train(trainer, batches("multi", 4, BATCH, 2)), state(trainer)))
    assert runs[0][0] == runs[1][0]
    assert_same_state(runs[0][1], runs[1][1])


# Victims ----------------------------------------------------------------------------------------------

def single_unit(tmp_path, rows: int, capacity: int, policy: str, width: int = 2):
    """DiskTier of one feature on disk, `rows` x `width`, row i initially i * width + [0, 1, ...]."""
    variable = tf.Variable(tf.zeros([capacity + 1, width]), name="embedding/table_0")
    unit = Unit(0, 0, rows, capacity)
    unit.variables.append(variable)
    tables = DiskTier({0: unit}, [rows], str(tmp_path), policy, 0)
    initial = np.arange(rows * width, dtype=np.float32).reshape(rows, width)
    tables.open({0: [[variable]]}, lambda unit, i, j, start, stop: initial[start:stop])
    return tables, unit, initial


def stage_all(tables, unit, initial, id_batches) -> list:
    """Stages `id_batches` for training; the consumer adds 1 to the cache rows of each batch's
    unique ids (its "step") after checking that its slots hold its ids with their values so far.
    Returns the set of cached rows after each batch was staged."""
    snapshots, updates = [], np.zeros(len(initial), np.float32)

    def source():
        for ids in id_batches:
            yield None, (tf.constant(ids),)
            snapshots.append(set(unit.id_of[unit.id_of >= 0].tolist()))

    variable = unit.variables[0]
    for ids, (_, (slots,)) in zip(id_batches, tables.staged(source(), training=True)):
        slots = slots.numpy()
        assert np.array_equal(unit.id_of[slots], ids)
        assert np.array_equal(variable.numpy()[slots], initial[ids] + updates[ids, None])
        unique = np.unique(slots)
        variable.scatter_add(tf.IndexedSlices(tf.ones([len(unique), initial.shape[1]]), unique))
        updates[np.unique(ids)] += 1
    tables.flush()
    assert np.array_equal(unit.files[0].read(slice(None))[:, 0], initial + updates[:, None])
    return snapshots


def random_batches(rows: int, most: int, n: int, seed: int = 0) -> list:
    """n batches of 1 to `most` distinct rows (Zipf-like popularity), each with repeats, shuffled."""
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, rows + 1)
    out = []
    for _ in range(n):
        rows_of_batch = rng.choice(rows, rng.integers(1, most + 1), replace=False, p=p / p.sum())
        out.append(rng.permutation(np.concatenate([rows_of_batch, rng.choice(rows_of_batch, 2)])))
    return out


class Reference:
    """A cache of `capacity` rows by the policy's rules: a batch's missing rows take free slots,
    then evict the unpinned rows (neither in the batch nor in the previous one, which is still in
    its step) of lowest key: last use (LRU), or (uses since loaded, last use) (LFU). `check`
    accepts any order among rows of equal key (without ties, it allows one cache exactly)."""

    def __init__(self, capacity: int, policy: str):
        self.capacity, self.policy = capacity, policy
        self.cached, self.previous, self.last_use, self.uses = set(), set(), {}, {}

    def key(self, row):
        return self.last_use[row] if self.policy == "lru" else (self.uses[row], self.last_use[row])

    def check(self, t: int, batch: set, after: set):
        """The cache `after` batch t (its rows) was staged; moves on to it."""
        misses, evicted = batch - self.cached, self.cached - after
        assert after == (self.cached - evicted) | batch
        candidates = self.cached - batch - self.previous
        assert evicted <= candidates and len(evicted) == max(0, len(misses) - (self.capacity - len(self.cached)))
        kept = candidates - evicted
        if evicted and kept:
            assert max(map(self.key, evicted)) <= min(map(self.key, kept)), t
        self.uses.update(dict.fromkeys(misses, 0))
        for row in batch:
            self.uses[row] += 1
            self.last_use[row] = t
        self.cached, self.previous = after, batch


@pytest.mark.parametrize("policy, capacity, rows, most", [
    ("lru", 7, 40, 3), ("lru", 32, 200, 8),   # 32: victims from a reserve kept across batches
    ("lfu", 7, 40, 3)])   # exact LFU: capacity // 4 = 1 gives every selection a fresh reserve
def test_victims_follow_the_reference_policy(tmp_path, monkeypatch, policy, capacity, rows, most):
    monkeypatch.setattr(tiered, "_MAPPED_BYTES", 0)   # file pages dropped from the process after every access
    monkeypatch.setattr(tiered, "_MIN_MAPPED_BYTES", 0)
    tables, unit, initial = single_unit(tmp_path, rows, capacity, policy)
    id_batches = random_batches(rows, most, 300)
    reference = Reference(capacity, policy)
    for t, (ids, after) in enumerate(zip(id_batches, stage_all(tables, unit, initial, id_batches))):
        reference.check(t, set(ids.tolist()), after)
    tables.close()


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_lfu_keeps_the_frequently_used_rows_that_lru_evicts(tmp_path, policy):
    """Rows 0-3 used in three batches, then 24 rows once each, two a batch, through 16 slots."""
    id_batches = [np.arange(4)] * 3 + [np.array([4 + i, 5 + i]) for i in range(0, 24, 2)]
    tables, unit, initial = single_unit(tmp_path, 40, 16, policy)
    cached = stage_all(tables, unit, initial, id_batches)[-1]
    assert len(cached) == 16 and cached & {0, 1, 2, 3} == ({0, 1, 2, 3} if policy == "lfu" else set())
    tables.close()


def test_a_consumer_that_stops_releases_every_pin(tmp_path):
    tables, unit, _ = single_unit(tmp_path, 40, 8, "lru")
    elements = [(None, (tf.constant([i, i + 1]),)) for i in range(5)]
    staged = tables.staged(iter(elements), training=True)
    next(staged)
    _, (slots,) = next(staged)
    assert unit.pinned[slots.numpy()].all()
    staged.close()
    assert not unit.pinned.any()
    with pytest.raises(ZeroDivisionError):
        for _ in tables.staged(iter(elements), training=True):
            1 / 0
    assert not unit.pinned.any()
    tables.close()


def test_a_cache_too_small_for_the_batches_in_flight_is_a_store_error(tmp_path):
    tables, _, _ = single_unit(tmp_path, 40, 5, "lru")
    elements = [(None, (tf.constant([i, i + 1, i + 2]),)) for i in range(0, 9, 3)]
    with pytest.raises(StoreError, match=r"^feature 0: the cache of 5 rows on rank 0 cannot hold the rows of the "
                                         r"batches in flight \(1 more needed\)$"):
        list(tables.staged(iter(elements), training=True))
    tables.close()


# Statistics -------------------------------------------------------------------------------------------

def test_store_statistics_count_what_the_caches_held(tmp_path):
    """Hits and misses from the rows each cache held before each batch: rows read are the misses,
    rows written the evictions (every cached row is dirty in training)."""
    trainer = build("multi", "adam", str(tmp_path))
    emb = trainer.model.embeddings
    units, before = tables(trainer).tiered.units, []

    def source():   # runs in the staging thread: before[t] is what the caches held when batch t came
        for element in batches("multi"):
            before.append({f: set(u.id_of[u.id_of >= 0].tolist()) for f, u in units.items()})
            yield element
        before.append({f: set(u.id_of[u.id_of >= 0].tolist()) for f, u in units.items()})

    for element in emb.staged(source(), training=True):
        trainer.train_step(*element)
    counts = collections.Counter()
    for (_, ids, _), cached, after in zip(batches("multi"), before, before[1:]):
        for f in units:
            rows = set(np.asarray(ids[f].values if isinstance(ids[f], tf.RaggedTensor) else ids[f]).tolist())
            counts.update(ids=len(rows), hits=len(rows & cached[f]), evicted=len(cached[f] - after[f]))
    misses = counts["ids"] - counts["hits"]
    stats = emb.store_stats()
    row_bytes = (1 + SLOTS["adam"]) * DIM * 4
    assert stats["cache_hit_rate"] == counts["hits"] / counts["ids"] and 0 < stats["cache_hit_rate"] < 1
    assert (stats["store_rows_read"], stats["store_rows_written"]) == (misses, counts["evicted"])
    assert stats["store_mb_read_per_step"] == misses * row_bytes / 2 ** 20 / STEPS
    assert stats["store_mb_written_per_step"] == counts["evicted"] * row_bytes / 2 ** 20 / STEPS
    assert stats["staging_ms_per_step"] > 0 and stats["store_wait_ms_per_step"] >= 0
    assert emb.store_stats()["store_rows_read"] == 0   # counted since the last call
    emb.close()


# Errors -----------------------------------------------------------------------------------------------

def assert_refused(message: str, store, plan):
    """The tables on `plan` with files under `store`, opened as the model's compile opens them
    (DistributedEmbedding.set_optimizer), refuse with exactly `message`, and the run's built-in model
    with exactly it too (no model file named: dlrm.py's is the project's)."""
    embedding = model_tables(model_config("one"), plan, seed=3, store_path=store)
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        embedding.set_optimizer("sgd", tf.Variable(0, dtype=tf.int64))
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        build("one", "sgd", store, plan=plan)


@pytest.mark.parametrize("make", [lambda p: p / "missing", lambda p: (p / "file").write_text("") or p / "file"],
                         ids=["missing", "file"])
def test_a_store_path_that_is_no_directory_is_a_config_error(tmp_path, make):
    path = str(make(tmp_path))
    assert_refused(f"--embedding_store_path={path}: no such directory", path, disk_plan("one", 0, 2 * BATCH))


def test_no_store_path_is_a_config_error():
    assert_refused("the embedding plan puts tables on disk: --embedding_store_path is needed", None,
                   disk_plan("one", 0, 2 * BATCH))


def test_too_little_free_space_is_a_config_error_naming_the_bytes(tmp_path, monkeypatch):
    monkeypatch.setattr(tiered.shutil, "disk_usage", lambda path: types.SimpleNamespace(free=0))
    need = (CARDS[1] + CARDS[2]) * 3 * DIM * 4
    with pytest.raises(ConfigError, match=f"^--embedding_store_path={tmp_path}: rank 0's tables on disk need {need:,} bytes, 0 are free$"):
        build("one", "adam", str(tmp_path))


def test_a_second_run_on_the_same_store_is_a_config_error(tmp_path):
    first = build("one", "adam", str(tmp_path))
    train(first, batches("one")[:3])
    before = state(first)
    with pytest.raises(ConfigError, match="another run is using this embedding store file"):
        build("one", "adam", str(tmp_path))
    assert_same_state(state(first), before)   # its files untouched
    first.model.embeddings.close()


def test_a_store_file_deleted_during_training_is_a_store_error(tmp_path):
    trainer = build("one", "sgd", str(tmp_path))
    file = os.path.join(str(tmp_path), "table_2.bin")
    with pytest.raises(StoreError, match=f"^{file}: the embedding store file was deleted during the run$"):
        for step, element in enumerate(trainer.model.embeddings.staged(iter(batches("one")), training=True)):
            trainer.train_step(*element)
            if step == 2:
                os.remove(file)
    assert step in (2, 3)   # the batch staged when the file went, or the next one
    trainer.model.embeddings.close()


@pytest.mark.parametrize("bad", [-1, CARDS[2]])
def test_ids_out_of_range_are_a_dataset_error_naming_the_feature(tmp_path, bad):
    trainer = build("one", "sgd", str(tmp_path))
    numerical, ids, labels = batches("one")[0]
    ids = ids[:2] + (tf.tensor_scatter_nd_update(ids[2], [[5]], tf.constant([bad], ids[2].dtype)),) + ids[3:]
    with pytest.raises(DatasetError, match=r"^feature 2: ids out of range \[0, 1000\)"):
        next(iter(trainer.model.embeddings.staged(iter([(numerical, ids, labels)]), training=True)))
    trainer.model.embeddings.close()


def test_close_removes_the_store_files(tmp_path):
    trainer = build("one", "sgd", str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["table_1.bin", "table_2.bin"]
    trainer.model.embeddings.close()
    assert os.listdir(tmp_path) == []


def test_tables_in_host_memory_train_as_in_memory():
    """The host tier (GPU runs, --cpu_offloading_threshold_gb): its tables and slots on the CPU,
    gathered and updated outside the XLA islands. Here on a CPU: the same results (the update,
    run op by op, may round differently from the compiled one)."""
    plan = assign_tiers(plan_tables(CARDS, [DIM] * 4, 1), SLOTS["adam"], None, [1] * 4, host_threshold_bytes=0)
    assert {(f, t.kind) for _, f, t in plan.tiers} == {(f, "host") for f in range(len(CARDS))}
    trainer = build("one", "adam", plan=plan)
    emb = tables(trainer)
    slots = [s for v in emb.shard_variables for s in emb.optimizer.slots[v.ref()].values()]
    assert all(v.device.endswith("CPU:0") for v in emb.shard_variables + slots)
    losses = train(trainer, batches("one"))
    expected_losses, expected_state = in_memory("one", "adam")
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    got = state(trainer)
    assert got.keys() == expected_state.keys()
    for key in got:
        np.testing.assert_allclose(got[key], expected_state[key], rtol=1e-4, atol=1e-6, err_msg=str(key))
