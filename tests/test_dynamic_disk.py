"""A dynamic table itself on disk (--dynamic_tables under --embedding_memory_budget_gb): its id map in
memory, deciding in the step as in memory, its rows and optimizer slots in the store behind a cache of
32 of its 48 rows (parallel_embedding/tiered.py, DynamicUnit). A run with it evicting and refusing
equals the same run in memory bit for bit: the losses, every evaluation (the one after step 48 with
batch 49 read ahead into the cache) and both checkpoints (the map's state, live rows, slots,
updated_at); a checkpoint resumed in the other tier ends as both; deploy.py exports its checkpoints
and a delta; a model file (examples/dlrm.py) with the table on disk trains as dlrm.py in memory; at 2
Gloo ranks, one hash shard on disk on each, the same checkpoint as in memory, which restored at 1
rank as 1 hash shard on disk trains on as in memory. A checkpoint streams the table's live rows
between the store and its files a block at a time, re-sharded on restore too.

BUDGET (28,561 bytes) holds, at 1 rank, the dynamic table's id map (7,616 bytes), tables 1 and 3 in
memory, table 2 on disk (a cache of 32 rows, 2 x (8 + 8) ids in flight) and table 0 on disk: 48 rows
of 96 bytes in memory would be 4,608 bytes, on disk 32 cache rows of 128 and an index of 4 a row,
4,288."""
import contextlib
import os
import re

import numpy as np
import pytest
import tensorflow as tf

from parallel_embedding.collectives import SingleProcess
from parallel_embedding.dynamic_table import op_error
from parallel_embedding.layer import DistributedEmbedding
from parallel_embedding.planner import DynamicOptions, TierOptions, plan_tables
from parallel_embedding.tiered import ShardFile
from storage import checkpoint
from tests.support.horovod_run import horovodrun
from tests.support.runs import one_process, succeeded
from tests.support.checks import assert_same_checkpoint, assert_same_run_folders, log_records, one_error

MODEL = ["--dataset_type=synthetic", "--synthetic_cardinalities=400,40,2000,7", "--synthetic_num_numerical=3",
         "--embedding_dim=8", "--bottom_mlp_dims=16,8", "--top_mlp_dims=16,1", "--optimizer=adam", "--seed=3"]
# 96 steps of 8; evaluations after 48 and 96.
DATA = ["--learning_rate=0.01", "--batch_size=8", "--valid_batch_size=8", "--synthetic_rows=768",
        "--synthetic_eval_rows=160", "--warmup_steps=2", "--decay_start_step=64", "--decay_steps=32",
        "--print_freq=16", "--evals_per_epoch=2"]
DYNAMIC = "--dynamic_tables=0:48:2"   # 48 rows for its 400 ids, admitted at their 2nd sighting, LRU
BUDGET = "--embedding_memory_budget_gb=0.0000266"


def on_disk(store) -> list:
    os.makedirs(store, exist_ok=True)
    return [BUDGET, f"--embedding_store_path={store}"]


def run(out, *args, ranks=1, log=True, dynamic=DYNAMIC):
    """Trains dlrm.py with MODEL, DATA, `dynamic` and `args` into out/ckpt (log out/log.json): its output."""
    args = ["dlrm.py", *MODEL, *DATA, dynamic, *args, f"--save_checkpoint_path={out / 'ckpt'}"]
    args += [f"--log_path={out / 'log.json'}"] if log else []
    return succeeded(one_process(*args) if ranks == 1 else horovodrun(ranks, args)).stdout


def plan_line(stdout: str, feature: int) -> str:
    return next(line for line in stdout.splitlines() if re.match(rf"(\[\d+\]<stdout>:)?\d+\s+{feature}\s", line))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The run in memory and with table 0 on disk, checkpoints after 48 and 96: {name: (dir, stdout)}."""
    out = {}
    for name in ("memory", "disk"):
        d = tmp_path_factory.mktemp(name)
        flags = on_disk(d / "store") if name == "disk" else []
        out[name] = d, run(d, *flags, "--checkpoint_every_n_steps=48")
    return out


def test_a_dynamic_table_on_disk_equals_memory(runs):
    (memory, memory_out), (disk, disk_out) = runs["memory"], runs["disk"]
    assert re.search(r"\sdynamic\s.*\sdisk\s+32\s", plan_line(disk_out, 0)), disk_out
    assert re.search(r"\swhole\s.*\sdisk\s", plan_line(disk_out, 2)), disk_out
    assert "disk" not in memory_out.split("\nmodel:")[0], memory_out
    assert_same_run_folders(disk, memory, steps=(48, 96))
    losses = [[(r["step"], r["loss"]) for r in log_records(d / "log.json") if r["kind"] == "step"]
              for d in (memory, disk)]
    assert losses[0] == losses[1] and len(losses[0]) == 6
    steps = [r for r in log_records(disk / "log.json") if r["kind"] == "step"]
    last = steps[-1]
    assert last["embedding/table_0/evicted"] > 0 and last["embedding/table_0/refused"] > 0, last
    # rows went to the store and came back
    assert sum(r["store_rows_written"] for r in steps) > 0 and sum(r["store_rows_read"] for r in steps) > 0
    assert min(r["cache_hit_rate"] for r in steps) < 1
    saved = checkpoint.read_tensor(str(disk / "ckpt" / "ckpt-96"), "embedding/table_0/ids")
    assert len(saved) == 48   # every row live: a checkpoint holds them, read through the cache and the store
    assert os.listdir(disk / "store") == []


def test_checkpoints_move_between_memory_and_disk(tmp_path, runs):
    """Each run's step-48 checkpoint resumed in the other tier ends as both (step 96)."""
    memory, disk = runs["memory"][0], runs["disk"][0]
    to_disk = run(tmp_path / "to_disk", *on_disk(tmp_path / "store"),
                  f"--restore_checkpoint_path={memory / 'ckpt' / 'ckpt-48'}", log=False)
    from_disk = run(tmp_path / "from_disk", f"--restore_checkpoint_path={disk / 'ckpt' / 'ckpt-48'}", log=False)
    assert re.search(r"\sdynamic\s.*\sdisk\s", plan_line(to_disk, 0)), to_disk
    assert "disk" not in from_disk.split("\nmodel:")[0], from_disk
    assert "resuming at batch 48" in to_disk and "resuming at batch 48" in from_disk, from_disk
    for out in ("to_disk", "from_disk"):
        assert_same_checkpoint(tmp_path / out / "ckpt", memory / "ckpt" / "ckpt-96")
    assert os.listdir(tmp_path / "store") == []


def test_eval_of_a_checkpoint_with_a_dynamic_table_on_disk(tmp_path, runs):
    """--mode=eval, the table on disk: the in-memory run's final evaluation."""
    memory = runs["memory"][0]
    os.makedirs(tmp_path / "s")
    out = one_process("dlrm.py", *MODEL, DYNAMIC, "--embedding_memory_budget_gb=0.0000235",   # caches of 16 rows
                      f"--embedding_store_path={tmp_path / 's'}", "--mode=eval", "--valid_batch_size=8",
                      "--synthetic_eval_rows=160", f"--restore_checkpoint_path={memory / 'ckpt'}",
                      f"--log_path={tmp_path / 'eval.json'}")
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.search(r"\sdynamic\s.*\sdisk\s", plan_line(out.stdout, 0)), out.stdout
    got = [r for r in log_records(tmp_path / "eval.json") if r["kind"] == "eval"][-1]
    want = [r for r in log_records(memory / "log.json") if r["kind"] == "eval"][-1]
    assert (got["auc"], got["logloss"]) == (want["auc"], want["logloss"])


def test_a_model_file_with_the_table_on_disk_equals_the_built_in_in_memory(tmp_path, runs):
    """main.py --model=examples/dlrm.py (its tables staged by run/run_model.py) with table 0 on disk:
    the losses and evaluations of dlrm.py in memory, bit for bit."""
    data = [a for a in MODEL if not a.startswith(("--embedding_dim", "--bottom_mlp_dims", "--top_mlp_dims"))]
    out = succeeded(one_process("main.py", "--model=examples/dlrm.py", "--model_param=embedding_dim=8",
                                "--model_param=bottom=[16,8]", "--model_param=top=[16]", *data, *DATA, DYNAMIC,
                                *on_disk(tmp_path / "store"), f"--log_path={tmp_path / 'log.json'}")).stdout
    assert re.search(r"\sdynamic\s.*\sdisk\s", plan_line(out, 0)), out

    def figures(path):
        return [(r["kind"], r["step"], r.get("loss"), r.get("auc"), r.get("logloss")) for r in log_records(path)
                if r["kind"] in ("step", "eval")]
    assert figures(tmp_path / "log.json") == figures(runs["memory"][0] / "log.json")
    assert os.listdir(tmp_path / "store") == []


def test_export_and_a_delta_of_checkpoints_written_on_disk(tmp_path, runs):
    """deploy.py reads a checkpoint written with the table on disk as any: the tables form of step 48,
    then a delta to step 96 carrying the ids evicted in between."""
    ckpt = runs["disk"][0] / "ckpt"

    def deploy(*args):
        return succeeded(one_process("deployment/deploy.py", *args)).stdout.strip().splitlines()[-1]
    assert "tables form chosen" in deploy(f"--checkpoint={ckpt / 'ckpt-48'}", f"--output={tmp_path / 'r'}")
    line = deploy(f"--checkpoint={ckpt / 'ckpt-96'}", f"--output={tmp_path / 'd'}", f"--delta_from={tmp_path / 'r'}")
    evicted = re.search(r", ([\d,]+) ids evicted from 1 dynamic table", line)
    assert evicted and int(evicted[1].replace(",", "")) > 0, line


@pytest.mark.slow
def test_two_ranks_hash_shards_on_disk_equal_memory_and_restore_as_one_shard(tmp_path):
    """At 2 Gloo ranks: table 0 in 2 hash shards of 64 rows (K = 1, evicting), one a rank, each on disk
    with a cache of 32 rows beside table 2's row shard on disk (table 3 as large as table 1, so that
    both ranks need the same): the same checkpoint as in memory, bit for bit. That checkpoint (step
    64) restored at 1 rank as 1 hash shard of 128 rows (dynamic_table.reshard), on disk and in memory,
    trains on to the same checkpoint (step 96)."""
    args = ["--synthetic_cardinalities=400,40,2000,40"]
    dynamic, sliced = "--dynamic_tables=0:128:1:lru:0:2", ["--max_steps=64", "--row_slice_threshold=1000"]
    memory = run(tmp_path / "memory", *args, *sliced, ranks=2, log=False, dynamic=dynamic)
    os.makedirs(tmp_path / "store")
    disk = run(tmp_path / "disk", *args, *sliced, "--embedding_memory_budget_gb=0.0000225",
               f"--embedding_store_path={tmp_path / 'store'}", ranks=2, log=False, dynamic=dynamic)
    for rank in (0, 1):
        assert re.search(rf"\n(\[\d\]<stdout>:)?{rank}\s+0\s+dynamic\s.*\sdisk\s", disk), disk
    assert_same_checkpoint(tmp_path / "disk" / "ckpt", tmp_path / "memory" / "ckpt")
    totals = [checkpoint.read_tensor(str(tmp_path / "disk" / "ckpt"), f"embedding/table_0/shard_{s}/totals")
              for s in (0, 1)]
    assert all(t[0, 1] > 0 for t in totals), totals   # evictions in both shards
    assert os.listdir(tmp_path / "store") == []

    restore = f"--restore_checkpoint_path={tmp_path / 'disk' / 'ckpt'}"
    whole = run(tmp_path / "whole_disk", *args, restore, "--embedding_memory_budget_gb=0.000037",
                f"--embedding_store_path={tmp_path / 'store'}", log=False, dynamic="--dynamic_tables=0:128:1")
    assert re.search(r"\sdynamic\s.*\sdisk\s", plan_line(whole, 0)) and "resuming at batch 64" in whole, whole
    run(tmp_path / "whole_memory", *args, restore, log=False, dynamic="--dynamic_tables=0:128:1")
    assert_same_checkpoint(tmp_path / "whole_disk" / "ckpt", tmp_path / "whole_memory" / "ckpt")
    assert checkpoint.read_manifest(str(tmp_path / "whole_disk" / "ckpt"))["step"] == 96
    assert os.listdir(tmp_path / "store") == []


def test_a_missing_store_is_one_error_line(tmp_path):
    missing = tmp_path / "missing"
    line = one_error(one_process("dlrm.py", *MODEL, *DATA, DYNAMIC, BUDGET, f"--embedding_store_path={missing}"), 2)
    assert f"--embedding_store_path={missing}" in line and "no such directory" in line, line


def test_a_cache_too_small_for_a_step_is_one_line(tmp_path):
    """A dynamic table on disk whose cache (2 rows, a plan made with a minimum below one batch's ids)
    cannot hold a step's rows: the step fails, and its error's one line (dynamic_table.op_error, what
    main.py prints) names the feature, the cache and the rank."""
    plan = plan_tables([0, 10], [4, 4], 1, dynamic={0: DynamicOptions(64)},
                       tiers=TierOptions(slots=0, budget_bytes=7_936, min_cache_rows=[2, 10]))
    assert plan.tier(0, 0).kind == "disk" and plan.tier(0, 0).cache_rows == 2, plan.tiers
    emb = DistributedEmbedding(plan, SingleProcess(), seed=(1, 2), store_path=str(tmp_path))
    emb.set_optimizer("sgd", tf.Variable(0, dtype=tf.int64))
    try:
        lookup = tf.function(lambda ids: emb.lookup(ids, training=True).shard_rows)
        lookup([tf.constant([5, 6], tf.int64), tf.constant([1, 2])])   # 2 rows: they fit
        with pytest.raises(tf.errors.OpError) as e:
            lookup([tf.constant([7, 8, 9], tf.int64), tf.constant([1, 2, 3])])
        assert re.fullmatch(r"feature 0: the cache of 2 rows on rank 0 cannot hold the rows of the batches in flight "
                            r"\(\d more needed\)", op_error(e.value)), e.value.message
    finally:
        emb.close()


def _embedding(store=None, shards=1):
    """A dynamic table of 400 rows (K = 2, LRU, Adam) in `shards` hash shards beside a static table of
    10 rows, at 1 rank: on disk in `store` with a cache of 32 rows, or in memory (store None)."""
    tiers = TierOptions(slots=2, budget_bytes=66_912, min_cache_rows=[32, 10]) if store else None
    plan = plan_tables([0, 10], [4, 4], 1, dynamic={0: DynamicOptions(400, 2, shards=shards)}, tiers=tiers)
    assert (plan.tier(0, 0).kind == "disk" and plan.tier(0, 0).cache_rows == 32) == bool(store), plan.tiers
    emb = DistributedEmbedding(plan, SingleProcess(), seed=(1, 2), store_path=store)
    emb.set_optimizer("adam", tf.Variable(0, dtype=tf.int64))
    return emb


def _train(emb, steps, first=0):
    """`steps` steps of 16 raw ids from a pool of 450 (admitting and evicting) and 16 static ids."""
    rng = np.random.default_rng(first)
    pool = (2 ** 61 + np.arange(450) * 7919).astype(np.int64)
    for step in range(first, first + steps):
        emb._step.assign(step)
        looked = emb.lookup([tf.constant(rng.choice(pool, 16)), tf.constant(rng.integers(0, 10, 16))], training=True)
        grads = emb.gradients(looked, [tf.constant(rng.normal(size=(16, 4)), tf.float32) for _ in range(2)])
        emb.apply_gradients(grads, tf.constant(0.05), False)


@contextlib.contextmanager
def _store_accesses():
    """The rows of every read and write of a store file (tiered.ShardFile) in the block: a list of counts."""
    counts, read, write = [], ShardFile.read, ShardFile.write

    def rows(r):
        return r.stop - r.start if isinstance(r, slice) else len(r)
    ShardFile.read = lambda self, r, *a, **k: counts.append(rows(r)) or read(self, r, *a, **k)
    ShardFile.write = lambda self, r, *a, **k: counts.append(rows(r)) or write(self, r, *a, **k)
    try:
        yield counts
    finally:
        ShardFile.read, ShardFile.write = read, write


def _same_checkpoints(a, b):
    names = sorted(checkpoint.read_manifest(a)["tensors"])
    assert names == sorted(checkpoint.read_manifest(b)["tensors"])
    for name in names:
        np.testing.assert_array_equal(checkpoint.read_tensor(a, name), checkpoint.read_tensor(b, name), err_msg=name)


def test_a_checkpoint_streams_the_live_rows_between_the_store_and_its_files(tmp_path, monkeypatch):
    """A dynamic table on disk (400 rows, a cache of 32) checkpoints its live rows, slots and updated_at
    a block at a time (storage.checkpoint.BLOCK_BYTES, here 8 rows of 4 floats): no read or write of
    its store file during a save or a restore takes more than 8 rows, though more than 300 are live.
    The checkpoint equals the in-memory run's bit for bit; restored on disk (from memory's) and in
    memory (from disk's) each trains on to the in-memory run's next checkpoint; a checkpoint of 2
    hash shards in memory restored as 1 on disk (dynamic_table.reshard) equals it restored in memory."""
    monkeypatch.setattr(checkpoint, "BLOCK_BYTES", 8 * 4 * 4)
    (tmp_path / "a").mkdir()
    memory, disk = _embedding(), _embedding(str(tmp_path / "a"))
    try:
        for emb in (memory, disk):
            _train(emb, 100)
        live = disk.dynamic_stats()["embedding/table_0"]["live"]
        assert live > 300 and disk.dynamic_stats() == memory.dynamic_stats(), disk.dynamic_stats()
        assert disk.dynamic_stats()["embedding/table_0"]["evicted"] > 0
        with _store_accesses() as saving:
            checkpoint.save(str(tmp_path / "disk"), disk.checkpoint_entries(), 100, {}, SingleProcess())
        checkpoint.save(str(tmp_path / "memory"), memory.checkpoint_entries(), 100, {}, SingleProcess())
        assert saving and max(saving) <= 8, saving
        _same_checkpoints(str(tmp_path / "disk"), str(tmp_path / "memory"))

        _train(memory, 6, first=100)
        checkpoint.save(str(tmp_path / "memory_106"), memory.checkpoint_entries(), 106, {}, SingleProcess())
        for source, store in (("memory", str(tmp_path / "b")), ("disk", None)):
            if store:
                os.makedirs(store)
            emb = _embedding(store)
            try:
                with _store_accesses() as restoring:
                    checkpoint.restore(str(tmp_path / source), emb.checkpoint_entries(), {}, emb.checkpoint_names())
                assert not store or (restoring and max(restoring) <= 8), restoring
                _train(emb, 6, first=100)
                checkpoint.save(str(tmp_path / f"from_{source}"), emb.checkpoint_entries(), 106, {}, SingleProcess())
                _same_checkpoints(str(tmp_path / f"from_{source}"), str(tmp_path / "memory_106"))
            finally:
                emb.close()
    finally:
        disk.close()

    two = _embedding(shards=2)
    _train(two, 100)
    checkpoint.save(str(tmp_path / "two"), two.checkpoint_entries(), 100, {}, SingleProcess())
    tensors = checkpoint.read_manifest(str(tmp_path / "two"))["tensors"]
    for name, store in (("one_disk", str(tmp_path / "c")), ("one_memory", None)):
        if store:
            os.makedirs(store)
        emb = _embedding(store)
        try:
            with _store_accesses() as restoring, emb.restoring(tensors):
                checkpoint.restore(str(tmp_path / "two"), emb.checkpoint_entries(), {}, emb.checkpoint_names())
            assert not store or (restoring and max(restoring) <= 8), restoring
            checkpoint.save(str(tmp_path / name), emb.checkpoint_entries(), 100, {}, SingleProcess())
        finally:
            emb.close()
    assert checkpoint.read_tensor(str(tmp_path / "one_disk"), "embedding/table_0/ids").shape[0] > 300
    _same_checkpoints(str(tmp_path / "one_disk"), str(tmp_path / "one_memory"))
