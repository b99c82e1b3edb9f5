"""Dynamic tables in training (--dynamic_tables, one process): the planner's rule 2, the layer
looking raw int64 ids up through DynamicTable (its rows, admissions and evictions equal to
id_map.reference's, its values to a DynamicTable driven alone), the counts on the progress line
and in the JSON log, a run equal to a static run where it must be (zero initial values, capacity
>= distinct ids, K = 1), a resumed run equal to an uninterrupted one bit for bit, and the
one-line refusals."""
import json
import os

import numpy as np
import pytest
import tensorflow as tf

import id_map
import run.assembly as run_assembly
import run.loop as run_loop
import run.runtime as run_runtime
from id_map.reference import Reference, mix
from parallel_embedding.collectives import SingleProcess
from parallel_embedding.dynamic_table import DynamicTable, initial_values, op_error
from parallel_embedding.layer import DistributedEmbedding
from parallel_embedding.planner import (BudgetError, DynamicOptions, PlanError, Tier, TierOptions, dynamic_map_bytes,
                                        plan_tables)
from parallel_embedding.routing import hash_shards
from storage import checkpoint
from deployment.exporter.repository import exported_model
from tests.support.configs import tiny_config
from tests.support.cli import SCRIPT_ARGS, run_script
from utils.errors import CheckpointError, ConfigError


def test_the_planner_keeps_a_dynamic_table_whole_with_its_capacity_and_may_put_it_on_disk():
    dynamic = {1: DynamicOptions(64, 2, "ttl", 5)}
    one = plan_tables([10, 1000, 30], [8, 8, 8], 1, dynamic=dynamic)
    assert [t.kind for t in one.tables] == ["whole", "dynamic", "whole"]
    assert one.tables[1].rows == 64 and one.tables[1].dynamic == dynamic[1]
    two = plan_tables([10, 1000, 30], [8, 8, 8], 2, row_slice_threshold=1, column_slice_threshold=1,
                      data_parallel_threshold=0, dynamic=dynamic,
                      tiers=TierOptions(slots=1, budget_bytes=13_400, min_cache_rows=[1, 1, 1]))
    t = two.tables[1]
    assert t.kind == "dynamic" and len(t.shards) == 1 and (t.shards[0].row_end, t.shards[0].width) == (64, 8)
    # Rule 7: the dynamic table's one hash shard on rank 0 is a unit like the others, the largest (64 rows
    # x 8 x 4 bytes x (1 + 1 slot) = 4,096 bytes): it goes to disk first, its id map staying in memory
    # (128 buckets of 16 bytes, 64 rows of 84, K = 2: 64 candidates of 24), its cache the rest.
    assert two.tiers == ((0, 1, Tier("disk", 30)),)   # rank 1: no dynamic table
    assert dynamic_map_bytes(64, 2) == 128 * 16 + 64 * 84 + 64 * 24 and dynamic_map_bytes(64, 1) == 7_424
    assert (two.map_bytes_on(0), two.map_bytes_on(1), two.memory_bytes_on(1, 1)) == (8_960, 0, 1_280)
    assert two.disk_bytes_on(0, 1) == 4_096 and two.memory_bytes_on(0, 1) == 8_960 + 30 * (64 + 32) + 64 * 4 + 20 * 64
    assert one.memory_bytes_on(0, 1) == one.bytes_on(0, slots=1) + 8_960
    # The smallest plan: the map (fixed), tables 0, 1 and 2 on disk with caches of 1 row.
    with pytest.raises(BudgetError, match=r"rank 0: .* needs 9584 bytes .*: dynamic tables' id maps 8960 bytes; "
                                          r"feature 0 on disk 116 bytes .*; "
                                          r"feature 1 on disk 352 bytes .*; feature 2 on disk 156 bytes"):
        plan_tables([10, 1000, 30], [8, 8, 8], 2, row_slice_threshold=1, column_slice_threshold=1,
                    data_parallel_threshold=0, dynamic=dynamic,
                    tiers=TierOptions(slots=1, budget_bytes=9_583, min_cache_rows=[1, 1, 1]))
    # Two hash shards of it on one rank stay in memory, fixed with the maps (2 x 4,480 bytes): the static
    # tables go to disk around them.
    shards = plan_tables([10, 1000, 30], [8, 8, 8], 1, dynamic={1: DynamicOptions(64, 2, "ttl", 5, shards=2)},
                         tiers=TierOptions(slots=1, budget_bytes=13_408, min_cache_rows=[1, 1, 1]))
    assert {f for _, f, t in shards.tiers if t.kind == "disk"} == {0, 2} and shards.map_bytes_on(0) == 8_960
    # The host threshold (GPU runs) counts the dynamic table's parameters (2,048 bytes), never moves them:
    # tables 0 (320 bytes) and 2 (960) go to host memory while the three exceed it.
    for threshold, host in ((3_328, set()), (3_327, {2}), (2_367, {0, 2}), (0, {0, 2})):
        host_plan = plan_tables([10, 1000, 30], [8, 8, 8], 1, dynamic=dynamic, tiers=TierOptions(
            slots=1, budget_bytes=None, min_cache_rows=[1, 1, 1], host_threshold_bytes=threshold))
        assert {f for _, f, t in host_plan.tiers if t.kind == "host"} == host, threshold
    with pytest.raises(PlanError, match="ttl >= 1 exactly with policy ttl"):
        DynamicOptions(10, 1, "ttl", 0)
    with pytest.raises(PlanError, match="no feature 3"):
        plan_tables([10, 20], [4, 4], 1, dynamic={3: DynamicOptions(5)})


@pytest.mark.parametrize("entry, message", [
    ("1", "expected <feature>:<capacity>"),
    ("1:x", "expected <feature>:<capacity>"),
    ("9:10", "no categorical feature 9"),
    ("cat_9:10", "no categorical feature cat_9"),
    ("1:0", "capacity >= 1"),
    ("1:10:1:mru", "policy must be one of lru, lfu, ttl"),
    ("1:10:1:ttl", "ttl >= 1 exactly with policy ttl"),
])
def test_a_bad_entry_is_one_line_naming_it(entry, message):
    with pytest.raises(ConfigError, match=message) as e:
        tiny_config(dynamic_tables=[entry])
    assert f"--dynamic_tables entry '{entry}'" in str(e.value) and "\n" not in str(e.value)


def test_the_refused_combinations_are_one_line():
    with pytest.raises(ConfigError, match="given twice"):
        tiny_config(dynamic_tables=["1:10", "cat_1:20"])
    # tables on disk or in host memory beside dynamic ones: accepted (tests/test_tiered_cli.py; host memory: below)
    assert tiny_config(dynamic_tables=["1:10"], embedding_memory_budget_gb=1.0, embedding_store_path="/tmp/x",
                       cpu_offloading_threshold_gb=1).dynamic_tables == {1: DynamicOptions(10)}
    with pytest.raises(ConfigError, match="shards <= capacity"):
        tiny_config(dynamic_tables=["1:2:1:lru:0:3"])
    assert tiny_config(dynamic_tables=["cat_1:10:3:lfu", "3:8:1:ttl:4", "0:9:1:lru:0:3"]).dynamic_tables == {
        1: DynamicOptions(10, 3, "lfu"), 3: DynamicOptions(8, 1, "ttl", 4), 0: DynamicOptions(9, shards=3)}


def test_capacities_too_small_for_a_batch_are_one_line_naming_every_table():
    """A batch of 64 with more distinct ids than tables 1's and 3's 8 rows (table 0's 64 are enough):
    dlrm.py stops at the first step with one line naming both tables and the flag (exit 2), no
    traceback."""
    proc = run_script("dlrm.py", *SCRIPT_ARGS, "--dynamic_tables=cat_3:8,cat_0:64,cat_1:8", "--max_steps=3")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        "error: dynamic tables embedding/table_1 (capacity 8 rows), embedding/table_3 (capacity 8 rows): too small "
        "for one batch's distinct ids (every row in use at step 0); raise their capacities "
        "(--dynamic_tables=<feature>:<capacity>)"]


def test_the_layer_maps_raw_int64_ids_as_the_reference_and_updates_as_the_table_alone():
    """Ids far outside any cardinality (2^62 + k), a capacity of 6 under a pool of 12 ids, K = 2:
    rows equal id_map.reference's step by step, refused ids read zeros, the counts are the
    reference's codes counted, and every value equals a DynamicTable driven alone by the same
    ids and gradients."""
    b, capacity, seed = 8, 6, (3, 40)
    plan = plan_tables([1, 50], [4, 4], 1, dynamic={0: DynamicOptions(capacity, 2, "lru")})
    emb = DistributedEmbedding(plan, SingleProcess(), seed=seed)
    step = tf.Variable(0, dtype=tf.int64)
    emb.set_optimizer("adagrad", step)
    alone = DynamicTable("alone", capacity, 4, (seed[0], seed[1] + 0), 2, "lru", optimizer="adagrad")
    ref = Reference(capacity, 2, "lru")
    rng = np.random.default_rng(0)
    pool = (2 ** 62 + rng.integers(0, 2 ** 40, 12)).astype(np.int64)
    codes = []
    for s in range(12):
        ids = rng.choice(pool, b)
        static = rng.integers(0, 50, b)
        looked = emb.lookup([tf.constant(ids), tf.constant(static)], training=True)
        features = emb.exchange(looked, b)
        want_rows, want_codes, _ = ref.find_or_insert(ids.tolist(), s)
        codes += want_codes
        rows = looked.shard_indices[0].numpy()
        assert rows.tolist() == want_rows
        assert not features[0].numpy()[rows < 0].any()
        alone_rows, alone_emb = alone.lookup(tf.constant(ids), tf.constant(s, tf.int64), training=True)
        np.testing.assert_array_equal(features[0].numpy(), alone_emb.numpy())
        feature_grads = [tf.constant(rng.normal(size=(b, 4)), tf.float32) for _ in range(2)]
        emb.apply_gradients(emb.gradients(looked, feature_grads), tf.constant(0.1), False)
        alone.apply_gradients(alone_rows, feature_grads[0], tf.constant(0.1), s)
        step.assign_add(1)
    table = emb.dynamic[plan.tables[0].shards[0]]
    np.testing.assert_array_equal(table.variable.numpy(), alone.variable.numpy())
    np.testing.assert_array_equal(table.slots["accumulator"].numpy(), alone.slots["accumulator"].numpy())
    np.testing.assert_array_equal(table.updated_at.numpy(), alone.updated_at.numpy())
    codes = np.array(codes)
    evicted = int((codes == id_map.EVICTED).sum())
    assert emb.dynamic_stats() == {"embedding/table_0": {
        "live": capacity, "admitted": int((codes == id_map.ADMITTED).sum()) + evicted, "evicted": evicted,
        "refused": int((codes == id_map.REFUSED).sum())}}
    assert evicted > 0 and (codes == id_map.REFUSED).any()
    assert emb.store_stats()["embedding/table_0/evicted"] == evicted


def _losses(log):
    return [r["loss"] for r in map(json.loads, open(log)) if r["kind"] == "step"]


def test_with_room_for_every_id_and_zero_initial_values_a_dynamic_table_trains_as_the_static_one(tmp_path):
    """K = 1, capacity >= the cardinality, tables starting at zero: every id has its own row from
    its first sighting on, and a row's values are the static table's row of that id (the
    dataset's ids as raw ids), so the per-step losses are equal."""
    logs = []
    for name, dynamic in (("static", []), ("dynamic", ["1:50", "cat_3:64:1:lfu"])):
        log = str(tmp_path / f"{name}.json")
        run_loop.run(tiny_config(dynamic_tables=dynamic, max_steps=12, print_freq=1, log_path=log,
                                 embedding_zeros_initializer=True, optimizer="sgd", learning_rate=0.5))
        logs.append(_losses(log))
    assert len(logs[1]) == 12
    np.testing.assert_allclose(logs[1], logs[0], rtol=1e-6)


def _tensors(root):
    manifest = checkpoint.read_manifest(root)
    return {name: checkpoint.read_tensor(root, name) for name in manifest["tensors"]}


def test_a_resumed_run_equals_an_uninterrupted_one_bit_for_bit(tmp_path, capsys):
    """Two dynamic tables, one under constant eviction (lru with K = 2; ttl): checkpoints hold their
    live rows only; a run stopped at step 10 and resumed to 20 ends with every tensor equal to a
    run of 20 steps, and the same losses."""
    settings = dict(dynamic_tables=["1:40:2", "3:30:1:ttl:1"], print_freq=1, optimizer="adagrad",
                    learning_rate=0.1)
    whole, first, resumed = (str(tmp_path / n) for n in ("whole", "first", "resumed"))
    run_loop.run(tiny_config(**settings, max_steps=20, save_checkpoint_path=whole, log_path=whole + ".json"))
    run_loop.run(tiny_config(**settings, max_steps=10, save_checkpoint_path=first))
    saved = _tensors(first)
    assert saved["embedding/table_1/ids"].shape == (40, 1) and "embedding/table_3/last_used" in saved
    run_loop.run(tiny_config(**settings, max_steps=20, restore_checkpoint_path=first, save_checkpoint_path=resumed,
                             log_path=resumed + ".json"))
    a, b = _tensors(whole), _tensors(resumed)
    assert sorted(a) == sorted(b)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    assert a["embedding/table_1/totals"][0, 1] > 0   # evictions happened
    assert _losses(resumed + ".json") == _losses(whole + ".json")[10:]
    out = capsys.readouterr().out
    assert "embedding/table_1: 40 live," in out and " evicted, " in out


def test_a_static_checkpoint_restored_as_dynamic_and_the_reverse_are_refused_naming_the_table(tmp_path):
    static, dynamic = str(tmp_path / "static"), str(tmp_path / "dynamic")
    run_loop.run(tiny_config(max_steps=2, save_checkpoint_path=static))
    run_loop.run(tiny_config(max_steps=2, save_checkpoint_path=dynamic, dynamic_tables=["2:8"]))
    with pytest.raises(ConfigError, match=r"table embedding/table_2 \(feature 2\) is dynamic in this run, static in "
                                          r"the checkpoint"):
        run_loop.run(tiny_config(max_steps=4, restore_checkpoint_path=static, dynamic_tables=["2:8"]))
    with pytest.raises(ConfigError, match=r"table embedding/table_2 \(feature 2\) is static in this run, dynamic in "
                                          r"the checkpoint"):
        run_loop.run(tiny_config(max_steps=4, restore_checkpoint_path=dynamic))
    # export: only the tables form takes a dynamic table (tests/test_dynamic_serving.py)
    assert exported_model(checkpoint.read_manifest(dynamic)).dynamic_tables == ["embedding/table_2"]


def test_hash_shards_cut_the_mixed_hash_range_as_the_reference():
    ids = np.concatenate([np.arange(-50, 2000), [2 ** 63 - 1, -2 ** 63, 2 ** 62 + 7]]).astype(np.int64)
    for shards in (1, 2, 3, 7, 1000):
        want = [(mix(int(i)) * shards) >> 64 for i in ids]
        assert hash_shards(tf.constant(ids), shards).numpy().tolist() == want
    counts = np.bincount(hash_shards(tf.constant(np.arange(30000)), 3).numpy())
    assert counts.min() > 9500   # sequential ids spread evenly


@pytest.mark.slow
def test_hash_shards_in_one_process_train_and_resume_bit_for_bit(tmp_path):
    """A table in 3 hash shards on one rank: each shard its own map and rows (the counts summed
    per table), a run resumed at step 6 equals an uninterrupted one."""
    settings = dict(dynamic_tables=["1:75:2:lru:0:3"], print_freq=1, optimizer="adam")
    whole, first, resumed = (str(tmp_path / n) for n in ("whole", "first", "resumed"))
    run_loop.run(tiny_config(**settings, max_steps=12, save_checkpoint_path=whole, log_path=whole + ".json"))
    run_loop.run(tiny_config(**settings, max_steps=6, save_checkpoint_path=first))
    run_loop.run(tiny_config(**settings, max_steps=12, restore_checkpoint_path=first, save_checkpoint_path=resumed))
    a, b = _tensors(whole), _tensors(resumed)
    assert {n for n in a if n.endswith("/ids")} == {f"embedding/table_1/shard_{k}/ids" for k in range(3)}
    assert sorted(a) == sorted(b)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    live = [len(a[f"embedding/table_1/shard_{k}/ids"]) for k in range(3)]
    record = [r for r in map(json.loads, open(whole + ".json")) if r["kind"] == "step"][-1]
    assert record["embedding/table_1/live"] == sum(live) and min(live) > 0
    # restored at another shard count: tests/test_dynamic_reshard.py


def test_initial_values_hash_seed_id_step_and_column_uniformly():
    ids = tf.constant(np.arange(20000) * 7919 - 10 ** 12, tf.int64)
    values = initial_values(ids, tf.constant(3, tf.int64), tf.constant([5, 6], tf.int64), 4, 0.5).numpy()
    assert values.shape == (20000, 4) and values.min() >= -0.5 and values.max() < 0.5
    assert abs(values.mean()) < 0.01 and abs(values.std() - 0.5 / np.sqrt(3)) < 0.01
    assert abs(np.corrcoef(values[:, 0], values[:, 1])[0, 1]) < 0.05
    again = initial_values(ids[::-1], tf.constant(3, tf.int64), tf.constant([5, 6], tf.int64), 4, 0.5).numpy()
    np.testing.assert_array_equal(again, values[::-1])   # by id, not by position
    later = initial_values(ids, tf.constant(4, tf.int64), tf.constant([5, 6], tf.int64), 4, 0.5).numpy()
    assert not np.isclose(later, values).any(axis=1).all()


def test_while_capacity_does_not_bind_the_shard_count_does_not_change_a_run(tmp_path):
    """A row's initial value is its (seed, id, step)'s and no shard evicts: 1 and 3 hash shards
    train alike (so N ranks, holding any shards, equal one process with one)."""
    logs = []
    for shards in (1, 3):
        log = str(tmp_path / f"{shards}.json")
        run_loop.run(tiny_config(dynamic_tables=[f"1:150:1:lru:0:{shards}"], max_steps=12, print_freq=1, log_path=log,
                                 optimizer="adam"))
        logs.append(_losses(log))
    assert len(logs[0]) == 12
    assert logs[1] == logs[0]


def test_a_dynamic_table_beside_tables_in_host_memory(tmp_path, monkeypatch, capsys):
    """--dynamic_tables beside --cpu_offloading_threshold_gb=0, planned as on a GPU (a CPU has no host
    tier: its memory is the device's): the static tables in host memory (gathered and updated op by
    op), the dynamic one (K = 2, 40 rows for 50 ids: evicting) beside them. Its map's state equals the
    in-memory run's exactly (rows never depend on values), the values within float tolerance (the
    static tables' update uncompiled, as tests/test_tiered.py's host test); each run's step-10
    checkpoint resumed in the other tier ends as that tier's run."""
    real = run_runtime.embedding_plan
    monkeypatch.setattr(run_assembly, "embedding_plan", lambda cfg, n, slots, on_gpu: real(cfg, n, slots, True))
    settings = dict(dynamic_tables=["1:40:2"], optimizer="adam", learning_rate=0.1, max_steps=20)
    tiers = {"memory": {}, "host": dict(cpu_offloading_threshold_gb=0)}
    for name, tier in tiers.items():
        run_loop.run(tiny_config(**settings, **tier, save_checkpoint_path=str(tmp_path / name),
                                 checkpoint_every_n_steps=10))
        assert ("3 in host memory" in capsys.readouterr().out) == (name == "host")
    for name, tier in tiers.items():   # the other tier's checkpoint of step 10, resumed here
        other = tmp_path / ("memory" if name == "host" else "host") / "ckpt-10"
        run_loop.run(tiny_config(**settings, **tier, restore_checkpoint_path=str(other),
                                 save_checkpoint_path=str(tmp_path / f"{name}_resumed")))
    pairs = [("host", "memory"), ("host_resumed", "host"), ("memory_resumed", "memory")]
    for got, want in pairs:
        a, b = _tensors(str(tmp_path / got)), _tensors(str(tmp_path / want / "ckpt-20"))
        assert sorted(a) == sorted(b) and a["embedding/table_1/totals"][0, 1] > 0
        for name in a:
            if a[name].dtype.kind == "f":
                np.testing.assert_allclose(a[name], b[name], rtol=1e-4, atol=1e-6, err_msg=(got, name))
            else:
                np.testing.assert_array_equal(a[name], b[name], err_msg=(got, name))



@pytest.mark.slow
def test_a_dynamic_checkpoint_lacking_updated_at_is_refused_naming_it(tmp_path):
    """A static table's updated_at may be missing (checkpoints written before rows' updates were
    recorded: the rows keep their values); a dynamic table's orders its eviction and has been saved
    since there are dynamic tables: a checkpoint lacking it is refused in one line naming it, in
    memory as in another number of hash shards."""
    for shards in ("1", "2"):
        root = str(tmp_path / shards)
        run_loop.run(tiny_config(max_steps=2, save_checkpoint_path=root, dynamic_tables=[f"2:16:1:lru:0:{shards}"]))
        path = os.path.join(checkpoint.resolve(root), "manifest.json")
        with open(path) as f:
            manifest = json.load(f)
        static_gone = manifest["tensors"].pop("embedding/table_1/updated_at")
        assert static_gone
        with open(path, "w") as f:
            json.dump(manifest, f)
        resumed = tiny_config(max_steps=4, restore_checkpoint_path=root, dynamic_tables=["2:16:1:lru:0:1"])
        run_loop.run(resumed)   # a static table's updated_at is optional
        dynamic = "embedding/table_2/updated_at" if shards == "1" else "embedding/table_2/shard_0/updated_at"
        manifest["tensors"].pop(dynamic)
        with open(path, "w") as f:
            json.dump(manifest, f)
        with pytest.raises(CheckpointError, match=rf"tensors differ from this model's \(missing \['{dynamic}'\]"):
            run_loop.run(resumed)


def test_every_table_too_small_for_a_batch_is_named_in_one_line():
    """Four dynamic tables, 12 distinct ids a feature: capacities 4 (too small), 16, 6 (too small)
    and 6 in 2 hash shards of 3 rows (both too small for their ids): one line names every table
    and shard too small, in the step (op_error's line) and eagerly; one too small: the singular line."""
    plan = plan_tables([1] * 4, [4] * 4, 1, dynamic={0: DynamicOptions(4), 1: DynamicOptions(16), 2: DynamicOptions(6),
                                                     3: DynamicOptions(6, shards=2)})
    emb = DistributedEmbedding(plan, SingleProcess(), seed=(1, 2))
    emb.set_optimizer("sgd", tf.Variable(0, dtype=tf.int64))
    ids = [tf.constant(2 ** 40 + np.arange(12) * 7919 + f, tf.int64) for f in range(4)]
    assert (np.bincount(hash_shards(ids[3], 2).numpy(), minlength=2) > 3).all()   # each shard: more ids than rows
    names = [emb.dynamic_name(s) for s in emb.shards]
    line = (f"dynamic tables {names[0]} (capacity 4 rows), {names[2]} (capacity 6 rows), {names[3]} (capacity 3 "
            f"rows), {names[4]} (capacity 3 rows): too small for one batch's distinct ids (every row in use at step 0)")
    with pytest.raises(tf.errors.InvalidArgumentError) as e:
        tf.function(lambda x: emb.lookup(x, training=True).shard_rows)(ids)
    assert op_error(e.value) == line + "; raise their capacities (--dynamic_tables=<feature>:<capacity>)"
    with pytest.raises(ValueError) as e:
        emb.lookup(ids, training=True)
    assert str(e.value) == line
    ids = [ids[0], ids[1][:2], ids[2][:2], ids[3][:2]]
    with pytest.raises(tf.errors.InvalidArgumentError) as e:
        tf.function(lambda x: emb.lookup(x, training=True).shard_rows)(ids)
    assert op_error(e.value) == (f"dynamic table {names[0]}: capacity 4 rows is too small for one batch's distinct "
                                 "ids (every row in use at step 0); raise its capacity "
                                 "(--dynamic_tables=<feature>:<capacity>)")
