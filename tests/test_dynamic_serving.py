"""Export and serving of dynamic tables (raw 64-bit ids): checkpoints of a built-in model
whose tables 0 (one-hot) and 1 (multi-hot, mean) are parallel_embedding.dynamic_table.DynamicTable
trained a few steps at tiny capacities (constant eviction), table 2 static. The tables form holds
each dynamic table's ids file; the in-memory forms are refused naming the table; served
predictions for raw ids seen, evicted and never seen (zeros), ids >= 2^31 and negative ones,
equal an in-process computation from the trained tables, in memory and through the lookup
tiers; deltas (by id: new, changed, evicted) applied live, after evictions, a table growing in
memory and through the tiers, a restart serving what the store holds, two servers sharing
Redis; deploy.py's lines; and a run trained with --dynamic_tables exported, served and updated."""
import dataclasses
import json
import os
import re
import shutil
import subprocess

import numpy as np
import pytest
import tensorflow as tf

from deployment.exporter.model_layout import DYNAMIC_IDS
from deployment.exporter.repository import ExportError, write_delta_repository, write_repository
from deployment.repository_format import CATEGORICAL, LIVE, NUMERICAL, PAD, PREDICTIONS, live_ids, read_delta
from deployment.serving.id_index import RowIndex
from deployment.serving.live import DenseModel, Model, Updater
from deployment.serving.native import ServedModel, TensorSpec
from deployment.serving.tiers import LookupTiers, TierConfig, store_state
from nn.model_config import ModelConfig, table_configs
from parallel_embedding import dynamic_table
from parallel_embedding.collectives import SingleProcess
from parallel_embedding.dynamic_table import DynamicTable
from storage import checkpoint
from tests.support.builtin import builtin_config, builtin_model
from tests.support.horovod_run import ROOT
from tests.support.redis_server import RedisServer
from tests.support.small_disk import fill, free_bytes, tmpfs
from utils.errors import CheckpointError, StoreError
from tests.support.warm_python import PYTHON

D = 4
CONFIG = ModelConfig(tables=table_configs(cardinalities=[6, 8, 7], dims=[D, D, D], max_hotness=[None, 3, None],
                                          multi_hot_combiner="mean"),
                     num_numerical=3, bottom_mlp_dims=(8, D), top_mlp_dims=(8, 1), interaction="cross",
                     num_cross_layers=1, cross_layer_projection_dim=4)
CAPACITY = [6, 8]
U0 = np.array([2 ** 40 + k for k in range(10)] + [-5, 2 ** 31 + 7, 2 ** 63 - 1, 0], np.int64)   # table 0's ids
U1 = np.array([3 * 2 ** 33 + k for k in range(14)] + [-(2 ** 62)], np.int64)                      # table 1's
UNSEEN = np.array([17, 2 ** 35, -2 ** 63], np.int64)
STEPS = {0: range(1, 4), 1: range(4, 7), 2: range(7, 10)}   # day: its training steps
RUNS = ["r0" * 16, "r1" * 16, "r2" * 16]


def weights():
    """The checkpoint entries of the weights of CONFIG's built-in model (seed 3) as the run builds
    it (its tables "embedding/table_<t>", its dense weights by name), on one process."""
    model = builtin_model(builtin_config(CONFIG, seed=3))
    model.compile(optimizer="sgd")
    return model.checkpoint_entries(weights_only=True)


def train_step(table, ids, step):
    rows, emb = table.lookup(tf.constant(ids, tf.int64), tf.constant(step, tf.int64), training=True)
    grads = tf.ones_like(emb) * tf.range(1, len(ids) + 1, dtype=tf.float32)[:, None]
    table.apply_gradients(rows, grads, tf.constant(0.3), step)


def requests(seed=0, n=64):
    """(numerical [n, 3], categorical [n, 1 + 3 + 1]): raw ids seen on any day and never seen."""
    rng = np.random.default_rng(seed)
    ids0 = rng.choice(np.concatenate([U0, UNSEEN]), n)
    ids1 = rng.choice(np.concatenate([U1, UNSEEN]), (n, 3))
    ids1[rng.random((n, 3)) < 0.3] = PAD
    ids1[:, 0] = rng.choice(U1, n)   # every sample at least one id
    static = rng.integers(0, 7, n)
    return rng.normal(size=(n, 3)).astype(np.float32), np.concatenate([ids0[:, None], ids1, static[:, None]], 1)


def reference_embeddings(tables, static, categorical):
    """NumPy from the in-process state: table 0's rows, table 1's mean over its present ids (ids
    without a row read zeros), table 2's rows."""
    def rows(table, ids):
        return table.lookup(tf.constant(ids.reshape(-1), tf.int64), 0, training=False)[1].numpy().reshape(
            ids.shape + (D,))
    e0 = rows(tables[0], categorical[:, 0])
    present = categorical[:, 1:4] != PAD
    e1 = (rows(tables[1], categorical[:, 1:4]) * present[:, :, None]).sum(1) / present.sum(1)[:, None]
    return np.concatenate([e0, e1, static[categorical[:, 4]]], 1).astype(np.float32)


@pytest.fixture(scope="module")
def days(tmp_path_factory):
    """Checkpoints of days 0, 1, 2 (each trained on from the one before), the full exports of days
    0 and 1, the deltas 0 -> 1 and 1 -> 2 (the latter against the first delta), and per day the
    expected embeddings of requests()."""
    tmp = tmp_path_factory.mktemp("dyn")
    static = weights() + [   # table 2 is never updated
        checkpoint.Entry("embedding/table_2/updated_at", tf.Variable(tf.zeros([7, 1], tf.int32)), (7, 1))]
    tables = [DynamicTable(f"t{t}", CAPACITY[t], D, seed=(t, 9), policy="lru") for t in range(2)]
    rng = np.random.default_rng(5)
    numerical, categorical = requests()
    static_rows = next(e.variable for e in static if e.name == "embedding/table_2").numpy()
    out = {"ckpt": [], "expected": [], "counts": []}
    for day, steps in STEPS.items():
        for step in steps:
            train_step(tables[0], rng.choice(U0, 4, replace=False), step)
            train_step(tables[1], rng.choice(U1[:5 if day == 0 else None], 5, replace=False), step)
        dynamic = [dataclasses.replace(e, name=e.name.replace(f"t{t}", f"embedding/table_{t}", 1))
                   for t, table in enumerate(tables) for e in table.checkpoint_entries()]
        kept = [e for e in static if not any(e.name == f"embedding/table_{t}" or
                                             e.name.startswith(f"embedding/table_{t}/") for t in range(2))]
        lineage = [{"run": RUNS[d], "from_step": STEPS[d][0] - 1} for d in range(day + 1)]
        out["ckpt"].append(checkpoint.save(str(tmp / f"day{day}"), kept + dynamic, steps[-1], CONFIG.signature(),
                                           SingleProcess(), state={"lineage": lineage}))
        out["expected"].append(reference_embeddings(tables, static_rows, categorical))
        out["counts"].append([t.counts() for t in tables])
    out["repos"] = [str(tmp / f"repo{day}") for day in range(2)]
    for ckpt, repo in zip(out["ckpt"], out["repos"]):
        write_repository(ckpt, repo, "m")
    out["deltas"] = [str(tmp / "delta01"), str(tmp / "delta12")]
    write_delta_repository(out["ckpt"][1], out["deltas"][0], out["repos"][0], "m")
    write_delta_repository(out["ckpt"][2], out["deltas"][1], out["deltas"][0], "m")
    out["inputs"] = numerical, categorical
    # What the tests rest on: table 0 full and evicting every day, table 1 growing on day 1
    assert all(c[0]["evicted"] > 0 for c in out["counts"])
    assert out["counts"][0][1]["live"] == 5 and out["counts"][1][1]["live"] == 8
    return out


def served(model, days):
    numerical, categorical = days["inputs"]
    with model.snapshot() as snapshot:
        return model.embeddings(snapshot, categorical), model.infer(numerical, categorical)


def check_serves(model, days, day):
    """`model` serves day `day`: its embeddings as the in-process tables', its predictions as the
    dense model's on them."""
    numerical, _ = days["inputs"]
    embeddings, out = served(model, days)
    np.testing.assert_allclose(embeddings, days["expected"][day], rtol=1e-6, atol=1e-7)
    dense = DenseModel(os.path.join(days["repos"][min(day, 1)], "m_dense"), model.layout)
    np.testing.assert_allclose(out["predictions"], dense(numerical, days["expected"][day])["predictions"], rtol=1e-5)
    assert (out["model_version"] == STEPS[day][-1]).all()


def test_the_tables_form_holds_each_dynamic_tables_ids(days):
    assert dynamic_table.IDS == DYNAMIC_IDS
    info = json.load(open(os.path.join(days["repos"][0], "export.json")))
    assert info["forms"] == ["tables"]   # chosen: the in-memory forms cannot take raw ids
    tables = json.load(open(os.path.join(days["repos"][0], "m_tables", "tables.json")))["tables"]
    assert [t.get("dynamic", False) for t in tables] == [True, True, False]
    manifest = checkpoint.read_manifest(days["ckpt"][0])
    for t in range(2):
        ids = np.load(os.path.join(days["repos"][0], "m_tables", tables[t]["ids_file"]))
        saved = checkpoint.read_tensor(manifest["path"], f"embedding/table_{t}/ids")
        np.testing.assert_array_equal(ids[:, 0], saved[:, 0])
        assert (ids[:, 1] == LIVE).all() and tables[t]["rows"] == len(saved)
        np.testing.assert_array_equal(np.load(os.path.join(days["repos"][0], "m_tables", f"table_{t}.npy")),
                                      checkpoint.read_tensor(manifest["path"], f"embedding/table_{t}"))
        np.testing.assert_array_equal(live_ids(days["repos"][0], t), np.sort(saved[:, 0]))
    listed = {e["file"] for e in info["files"]}
    assert {"m_tables/table_0.ids.npy", "m_tables/table_1.ids.npy"} <= listed


@pytest.mark.parametrize("forms", [["monolithic"], ["ensemble", "tables"]])
def test_in_memory_forms_are_refused_naming_the_table(days, tmp_path, forms):
    with pytest.raises(ExportError, match=r"^--forms=(monolithic|ensemble): table embedding/table_0 is dynamic"):
        write_repository(days["ckpt"][0], str(tmp_path / "r"), "m", forms=forms)
    assert not os.path.exists(tmp_path / "r")


@pytest.mark.parametrize("tiers", [None, TierConfig(cache_bytes=200)], ids=["memory", "tiers"])
def test_served_predictions_equal_the_in_process_ones_for_ids_seen_and_unseen(days, tmp_path, tiers):
    repo = str(tmp_path / "repo")
    shutil.copytree(days["repos"][0], repo)
    model = Model(repo, tiers, log=lambda line: None)
    try:
        check_serves(model, days, 0)
        numerical, categorical = days["inputs"]
        unseen = categorical.copy()
        unseen[:, 0] = UNSEEN[np.arange(len(unseen)) % len(UNSEEN)]
        with model.snapshot() as snapshot:
            assert not model.embeddings(snapshot, unseen)[:, :D].any()   # the default row: zeros
        bad = categorical.copy()
        bad[0, 4] = 7   # the static table keeps its range check
        with pytest.raises(Exception, match=r"out of range .* features \(0-based\): \[2\]"):
            model.infer(numerical, bad)
    finally:
        model.close()


def test_a_delta_carries_new_changed_and_evicted_ids(days):
    d = read_delta(days["deltas"][0])
    assert d.dynamic(0) and d.dynamic(1) and (2 not in d.features or not d.dynamic(2))
    for t in range(2):
        base, new = live_ids(days["repos"][0], t), live_ids(days["repos"][1], t)
        np.testing.assert_array_equal(d.live(t), new)
        assert d.table(t)["evicted"] == len(np.setdiff1d(base, new))
        ids, rows = d.rows(t)
        assert set(np.setdiff1d(new, base)) <= set(ids) and set(ids) <= set(new)
        ids_file = np.load(os.path.join(days["repos"][1], "m_tables", f"table_{t}.ids.npy"))[:, 0]
        values = np.load(os.path.join(days["repos"][1], "m_tables", f"table_{t}.npy"))
        np.testing.assert_array_equal(rows, values[np.argsort(ids_file)][np.searchsorted(np.sort(ids_file), ids)])
    assert d.table(0)["evicted"] > 0


def test_deltas_after_eviction_applied_live_in_memory(days, tmp_path):
    repo = str(tmp_path / "repo")
    shutil.copytree(days["repos"][0], repo)
    model = Model(repo, log=lambda line: None)
    try:
        assert model.apply_delta(read_delta(days["deltas"][0])) > 0   # table 1 grows: 5 -> 8 rows
        check_serves(model, days, 1)
        model.apply_delta(read_delta(days["deltas"][1]))
        check_serves(model, days, 2)
    finally:
        model.close()


def test_deltas_through_the_tiers_and_a_restart(days, tmp_path):
    repo = str(tmp_path / "repo")
    shutil.copytree(days["repos"][1], repo)
    config = TierConfig(cache_bytes=200)
    model = Model(repo, config, log=lambda line: None)
    try:
        served(model, days)   # rows cached before the update
        model.apply_delta(read_delta(days["deltas"][1]))
        check_serves(model, days, 2)
    finally:
        model.close()
    model = Model(repo, config, log=lambda line: None)   # the store holds day 2: its ids files too
    try:
        check_serves(model, days, 2)
    finally:
        model.close()


def test_two_servers_sharing_redis_agree_on_rows_across_a_delta(days, tmp_path):
    """Redis keyed by row: server a, updated first, fills it with day 2's rows; server b, still on
    day 1, serves day 1 (values of another version are misses), then takes the same delta and
    serves day 2 with a's rows (the same ids in the same rows)."""
    server = RedisServer(tmp_path).start()
    models = []
    try:
        for name in "ab":
            shutil.copytree(days["repos"][1], tmp_path / name)
            models.append(Model(str(tmp_path / name), TierConfig(cache_bytes=200, redis_url=server.url),
                                log=lambda line: None))
        a, b = models
        a.apply_delta(read_delta(days["deltas"][1]))
        check_serves(a, days, 2)
        a._current.tables.redis.drain()   # a's fills reach Redis
        check_serves(b, days, 1)
        b.apply_delta(read_delta(days["deltas"][1]))
        check_serves(b, days, 2)
        assert b.stats()["redis"]["hits"] > 0
    finally:
        for model in models:
            model.close()
        server.stop()


@pytest.mark.parametrize("cache_bytes", [200, 10 ** 6], ids=["cached", "held_whole"])
def test_a_delta_needing_more_rows_than_the_store_holds_grows_it_through_the_tiers(days, tmp_path, cache_bytes):
    """Table 1 has 5 rows in day 0's export and 8 live ids on day 1: the store's table and ids files
    grow to 8 rows (store.json records it), day 1 is served through the cache (rows cached
    before the delta) or with the table held whole, and after a restart, and day 2's delta on top."""
    repo = str(tmp_path / "repo")
    shutil.copytree(days["repos"][0], repo)
    config = TierConfig(cache_bytes=cache_bytes)
    model = Model(repo, config, log=lambda line: None)
    try:
        check_serves(model, days, 0)
        model.apply_delta(read_delta(days["deltas"][0]))
        check_serves(model, days, 1)
        assert store_state(repo)["rows"] == {"1": 8}
        assert np.load(os.path.join(repo, "m_tables", "table_1.npy"), mmap_mode="r").shape == (8, D)
    finally:
        model.close()
    model = Model(repo, config, log=lambda line: None)
    try:
        check_serves(model, days, 1)
        model.apply_delta(read_delta(days["deltas"][1]))
        check_serves(model, days, 2)
    finally:
        model.close()


def listing(directory):
    """{path: bytes} of every file under `directory`."""
    return {os.path.relpath(os.path.join(d, n), directory): os.path.getsize(os.path.join(d, n))
            for d, _, names in os.walk(directory) for n in names}


def test_a_delta_onto_a_full_device_is_one_line_and_the_served_version_stays(days, tmp_path, monkeypatch):
    """Through the tiers, the repository on a full 4 MiB tmpfs: the delta is refused in one line
    naming the table directory and the bytes (checked before the copy of its dense model, and
    when the device fills during the copy), nothing written or left behind, day 0 still served
    and restartable; with room again, the same delta under a new name is applied."""
    with tmpfs(tmp_path / "disk", "4m") as disk:
        repo = str(shutil.copytree(days["repos"][0], disk / "repo"))
        updates = tmp_path / "updates"
        shutil.copytree(days["deltas"][0], updates / "d1")
        lines = []
        model = Model(repo, TierConfig(cache_bytes=200), log=lambda line: None)
        updater = Updater(model, str(updates), log=lines.append)
        try:
            before = listing(repo)
            free = fill(disk, 8 << 10)
            updater.poll()
            table_dir = re.escape(os.path.join(repo, "m_tables"))
            served = re.escape(str(model.version))
            assert re.fullmatch(rf"refused update {re.escape(str(updates / 'd1'))}: {table_dir}: no space left on "
                                rf"device: the update needs about [0-9,]+ bytes there, {free:,} were free \(nothing "
                                rf"of it left; serving {served}\)", lines[-1]), lines
            assert listing(repo) == before and free_bytes(disk) == free
            check_serves(model, days, 0)

            usage = shutil.disk_usage(disk)   # room reported, not there: the copy finds the device full
            monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=1 << 40))
            shutil.copytree(days["deltas"][0], updates / "d1-again")
            updater.poll()
            assert re.fullmatch(rf"refused update .*d1-again: {table_dir}: no space left on device: the update needs "
                                rf"about [0-9,]+ bytes there, {1 << 40:,} were free \(nothing of it left; serving "
                                rf"{served}\)", lines[-1]), lines
            monkeypatch.undo()
            assert listing(repo) == before and free_bytes(disk) == free
            check_serves(model, days, 0)

            os.remove(disk / "ballast")
            shutil.copytree(days["deltas"][0], updates / "d1-with-room")
            updater.poll()
            assert lines[-1].startswith(f"applied update {updates / 'd1-with-room'} (delta, "), lines
            check_serves(model, days, 1)
        finally:
            model.close()
        restarted = Model(repo, TierConfig(cache_bytes=200), log=lambda line: None)
        check_serves(restarted, days, 1)
        restarted.close()


def test_a_table_grown_on_a_full_device_is_one_line_and_its_files_stay_as_they_were(days, tmp_path):
    """The store's grow allocates its new rows before the header names them (writes through the
    mapping never meet a full device): on a full tmpfs one line naming the file and the bytes, the
    table's files as they were."""
    with tmpfs(tmp_path / "disk", "1m") as disk:
        repo = str(shutil.copytree(days["repos"][0], disk / "repo"))
        tiers = LookupTiers(repo)
        try:
            before = listing(repo)
            fill(disk, 16 << 10)   # room for store.json, not for the rows
            table = re.escape(os.path.join(repo, "m_tables", "table_1.npy"))
            with pytest.raises(StoreError, match=rf"^{table}: cannot grow from 5 to 5000 rows: No space left on "
                                                 rf"device \([0-9,]+ bytes more\)$"):
                with tiers.advancing(tiers.version, dataclasses.replace(tiers.version, step=99)):
                    tiers.grow(1, 5000)
            after = listing(repo)
            assert {k: v for k, v in after.items() if k != "m_tables/store.json"} == \
                {k: v for k, v in before.items() if k != "m_tables/store.json"}
            assert np.load(os.path.join(repo, "m_tables", "table_1.npy")).shape == (5, D)
        finally:
            tiers.close()


def test_row_index_moves_by_id():
    index = RowIndex(np.array([[10, LIVE], [20, LIVE], [30, LIVE]]))
    assert index.find(np.array([[20, 31], [10, 30]])).tolist() == [[1, -1], [0, 2]]
    moved, rows, changed = index.moved(np.array([20, 40, 50]), np.array([20, 30, 40, 50]))
    assert rows.tolist() == [1, 0, 3] and changed.tolist() == [0, 3]   # 10 evicted: 40 takes its row
    assert moved.find(np.array([10, 20, 30, 40, 50])).tolist() == [-1, 1, 2, 0, 3]
    with pytest.raises(ValueError, match="ids new to the served version have no row"):
        index.moved(np.array([20]), np.array([20, 60]))
    with pytest.raises(ValueError, match="not live after it"):
        index.moved(np.array([70]), np.array([20]))


def test_the_native_frontend_takes_raw_ids_past_int32_as_json(days):
    model = Model(days["repos"][0], log=lambda line: None)
    try:
        numerical, categorical = days["inputs"]
        categorical = categorical[:4].copy()
        categorical[:, 0] = [2 ** 63 - 1, -2 ** 63, 2 ** 31 + 7, 2 ** 40]
        served_model = ServedModel("m", [TensorSpec(NUMERICAL, np.float32, (3,)),
                                         TensorSpec(CATEGORICAL, np.int64, (categorical.shape[1],))],
                                   [TensorSpec(PREDICTIONS, np.float32, (1,))], 8, model.infer)
        out = served_model.run([(NUMERICAL, "FP32", [4, 3], numerical[:4].tolist()),
                                (CATEGORICAL, "INT64", list(categorical.shape), categorical.tolist())], None)
        np.testing.assert_array_equal(out[PREDICTIONS], model.infer(numerical[:4], categorical)[PREDICTIONS])
    finally:
        model.close()


def deploy(*args):
    return subprocess.run([*PYTHON, "deployment/deploy.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))


def test_deploy_refuses_in_one_line_and_says_what_it_wrote(days, tmp_path):
    refused = deploy(f"--checkpoint={days['ckpt'][0]}", f"--output={tmp_path / 'r'}", "--forms=tables,monolithic")
    assert refused.returncode == 2 and refused.stderr.strip().splitlines() == [
        "error: --forms=monolithic: table embedding/table_0 is dynamic (raw 64-bit ids), which only the tables form "
        "serves: use --forms=tables"]
    written = deploy(f"--checkpoint={days['ckpt'][0]}", f"--output={tmp_path / 'r'}")
    assert written.returncode == 0, written.stderr[-3000:]
    assert written.stdout.strip().splitlines()[-1].endswith(
        "; tables form chosen: table embedding/table_0 is dynamic (raw 64-bit ids)")
    delta = deploy(f"--checkpoint={days['ckpt'][1]}", f"--output={tmp_path / 'd'}", f"--delta_from={tmp_path / 'r'}")
    assert delta.returncode == 0, delta.stderr[-3000:]
    info = read_delta(str(tmp_path / "d")).info
    evicted = sum(t["evicted"] for t in info["tables"] if t.get("dynamic"))
    line = delta.stdout.strip().splitlines()[-1]
    assert evicted > 0 and f", {evicted:,} ids evicted from 2 dynamic table(s) (" in line


@pytest.fixture(scope="module", params=["1:40:2", "1:51:2:lru:0:3"], ids=["whole", "3_hash_shards"])
def trained(tmp_path_factory, request):
    """A DLRM trained with tables 1 and 2 dynamic (capacities 40, admitted at the second sighting,
    or 51 in 3 hash shards of 17 rows, and 8: table 1 evicting; one process), day 0 of 6 steps and
    day 1 of 4 more from it: checkpoints, full exports, the delta."""
    import run.loop as run_loop
    from tests.support.configs import tiny_config
    tmp = tmp_path_factory.mktemp("trained")
    ckpts = []
    for day, (steps, seed) in enumerate([(6, 5), (4, 6)]):
        restore = {"restore_checkpoint_path": ckpts[-1], "restore_mode": "continue"} if ckpts else {}
        run_loop.run(tiny_config(save_checkpoint_path=str(tmp / f"day{day}"), max_steps=steps, evals_per_epoch=0,
                                 seed=seed, dynamic_tables=[request.param, "2:8"], **restore))
        ckpts.append(checkpoint.resolve(str(tmp / f"day{day}")))
    repos = [str(tmp / f"repo{day}") for day in range(2)]
    for ckpt, repo in zip(ckpts, repos):
        write_repository(ckpt, repo, "m")
    write_delta_repository(ckpts[1], str(tmp / "delta"), repos[0], "m")
    return ckpts, repos, str(tmp / "delta")


def dynamic_tensor(ckpt, f, what=""):
    """Dynamic table f's `what` ("" its rows) in a checkpoint: its tensor, or its hash shards' concatenated."""
    tensors = checkpoint.read_manifest(ckpt)["tensors"]
    shards = sorted((n[:-4] for n in tensors if n.startswith(f"embedding/table_{f}/shard_") and n.endswith("/ids")),
                    key=lambda n: int(n.rsplit("_", 1)[1])) or [f"embedding/table_{f}"]
    return np.concatenate([checkpoint.read_tensor(ckpt, f"{p}/{what}" if what else p) for p in shards])


def checkpoint_embeddings(ckpt, categorical):
    """embeddings [B, 4 * 8] in NumPy from a checkpoint's tensors: a dynamic table's rows found by
    id in its `/ids` (zeros for an id not there), a static table's by row."""
    manifest = checkpoint.read_manifest(ckpt)
    parts = []
    for f in range(categorical.shape[1]):
        if f"embedding/table_{f}" in manifest["tensors"] and f"embedding/table_{f}/ids" not in manifest["tensors"]:
            parts.append(checkpoint.read_tensor(ckpt, f"embedding/table_{f}")[categorical[:, f]])
            continue
        rows = dynamic_tensor(ckpt, f)
        at = {int(i): r for r, i in enumerate(dynamic_tensor(ckpt, f, "ids")[:, 0])}
        rows = np.concatenate([rows, np.zeros((1, rows.shape[1]), rows.dtype)])
        parts.append(rows[[at.get(int(i), len(rows) - 1) for i in categorical[:, f]]])
    return np.concatenate(parts, 1).astype(np.float32)


def test_a_trained_run_served_and_updated_live_equals_its_checkpoints(trained):
    """Served predictions equal those computed from the checkpoint for ids live, evicted (live on
    day 0 only) and never seen (2^45, and ids of the synthetic data never admitted); a table in
    hash shards is exported as one (its shards' live rows and ids in one ids file)."""
    ckpts, repos, delta = trained
    totals = [dynamic_tensor(c, 1, "totals").sum(0) for c in ckpts]
    assert totals[1][1] > totals[0][1]   # table 1 evicted ids on day 1
    rng = np.random.default_rng(3)
    live = [dynamic_tensor(c, 1, "ids")[:, 0] for c in ckpts]
    assert len(np.setdiff1d(live[0], live[1])) > 0   # evicted on day 1
    tables = json.load(open(os.path.join(repos[0], "m_tables", "tables.json")))["tables"]
    np.testing.assert_array_equal(np.load(os.path.join(repos[0], "m_tables", tables[1]["ids_file"]))[:, 0], live[0])
    categorical = np.stack([rng.integers(0, 20, 64),
                            rng.choice(np.concatenate([live[0], live[1], np.arange(50), [2 ** 45]]), 64),
                            rng.choice(np.array([0, 3, 6, 2 ** 40, -9]), 64), rng.integers(0, 30, 64)], 1)
    numerical = rng.normal(size=(64, 3)).astype(np.float32)
    model = Model(repos[0], log=lambda line: None)
    try:
        for day in range(2):
            if day:
                assert read_delta(delta).table(1)["evicted"] > 0
                model.apply_delta(read_delta(delta))
            expected = checkpoint_embeddings(ckpts[day], categorical)
            with model.snapshot() as snapshot:
                np.testing.assert_array_equal(model.embeddings(snapshot, categorical), expected)
            dense = DenseModel(os.path.join(repos[day], "m_dense"), model.layout)
            np.testing.assert_allclose(model.infer(numerical, categorical)["predictions"],
                                       dense(numerical, expected)["predictions"], rtol=1e-6)
    finally:
        model.close()


def test_a_dynamic_table_in_hash_shards_is_exported_as_one_and_an_id_in_two_shards_refused(tmp_path):
    """Shards 0 and 1 of table 0 (two DynamicTables' checkpoints under `shard_<s>`): the tables form
    writes their rows and ids concatenated in shard order; an id live in both is refused."""
    shards = [DynamicTable(f"t{s}", 4, D, seed=(0, 1)) for s in range(2)]
    train_step(shards[0], np.array([5, 2 ** 50]), 1)
    train_step(shards[1], np.array([-7, 2 ** 40, 9]), 1)

    def saved(name, tables):
        entries = [e for e in weights() if e.name != "embedding/table_0"] + [
            dataclasses.replace(e, name=e.name.replace(t.table, f"embedding/table_0/shard_{s}", 1))
            for s, t in enumerate(tables) for e in t.checkpoint_entries()]
        return checkpoint.save(str(tmp_path / name), entries, 1, CONFIG.signature(), SingleProcess())

    repo = str(tmp_path / "r")
    write_repository(saved("c", shards), repo, "m")
    table = json.load(open(os.path.join(repo, "m_tables", "tables.json")))["tables"][0]
    ids = np.load(os.path.join(repo, "m_tables", table["ids_file"]))
    np.testing.assert_array_equal(ids[:, 0], np.concatenate([t.map.export()["ids"].numpy() for t in shards]))
    assert table["rows"] == 5 and (ids[:, 1] == LIVE).all()
    np.testing.assert_array_equal(np.load(os.path.join(repo, "m_tables", "table_0.npy")), np.concatenate(
        [tf.gather(t.variable, t.map.export()["rows"]).numpy() for t in shards]))
    with pytest.raises(CheckpointError, match=r"table embedding/table_0's ids \(embedding/table_0/shard_0/ids, "
                                              r"embedding/table_0/shard_1/ids\) hold an id twice"):
        write_repository(saved("twice", [shards[0], shards[0]]), str(tmp_path / "r2"), "m")
