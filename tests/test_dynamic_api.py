"""Dynamic tables in the Keras API (ranking/) and in model files (main.py --model=FILE with
--dynamic_tables): a ranking.Model whose table is dynamic (TableConfig(dynamic=DynamicOptions))
trains bit for bit as the earlier built-in trainer on the same plan (its steps, recorded:
tests/support/recorded.py), raw ids far outside any cardinality under constant
eviction, its counts in fit's logs; a model file trains with the flag on synthetic data and on
raw-id data (split-binary, `raw_ids: true`), resumes bit for bit, is exported in the tables form
and served as it predicts for ids seen and never seen; the refusals are one line."""
import dataclasses
import json

import keras
import numpy as np
import pytest
import tensorflow as tf

import run.loop as run_loop
from dataloading.feature_spec import split_binary_spec
from dataloading.writer import MappingWriter
from deployment.exporter.repository import write_repository
from deployment.serving.live import Model as ServedTables
from parallel_embedding.planner import DynamicOptions
from ranking import FeatureConfig, HybridEmbedding, Model, TableConfig
from storage import checkpoint
from tests.support.configs import tiny_config
from tests.support.multi_hot import multi_hot_ids
from tests.support.recorded import assert_as_recorded, assert_values_as_recorded, model_state, recorded
from tests.test_ranking_api import (B, BOTTOM, CARDS, COMBINERS, DATA, DIMS, HOTNESS, TOP, builtin_name,
                                    seeded_as_the_builtin)
from tests.support.checks import assert_same_checkpoint
from utils.errors import ConfigError

DYNAMIC = DynamicOptions(24, 2, "lru")   # feature 1 (30 ids): a capacity of 24, admitted at the 2nd sighting
RAW = 2 ** 40 + 7919 * np.arange(CARDS[1], dtype=np.int64)   # feature 1's ids as raw 64-bit ids


def raw_batches(steps=12):
    """tests.test_ranking_api's batches, `steps` of them, feature 1's ids raw."""
    out = []
    for step in range(steps):
        b = DATA.batch("train", step * B, B)
        hot = tf.cast(multi_hot_ids(CARDS[2], HOTNESS[2], 2, step * B, B), tf.int32)
        ids = [tf.constant(b["categorical"][0]), tf.constant(RAW[b["categorical"][1]]), hot]
        out.append((tf.constant(b["numerical"]), ids, tf.constant(b["labels"])))
    return out


def api_model():
    """tests.test_ranking_api's model (the built-in DCNv2 without cross layers, its initial
    weights) with table t1 dynamic: its rows the capacity's."""
    tables = [TableConfig(name=f"t{f}", vocabulary_size=DYNAMIC.capacity if f == 1 else c, embedding_dim=d,
                          combiner=k, dynamic=DYNAMIC if f == 1 else None)
              for f, (c, d, k) in enumerate(zip(CARDS, DIMS, COMBINERS))]
    features = [FeatureConfig(name=f"f{f}", table=t, input_shape=(None, h) if h > 1 else (None,),
                              output_shape=(None, t.embedding_dim)) for f, (t, h) in enumerate(zip(tables, HOTNESS))]
    numerical = keras.Input((3,), name="numerical")
    ids = [keras.Input((), dtype="int32", name="f0"), keras.Input((), dtype="int64", name="f1"),
           keras.Input((None,), dtype="int32", ragged=True, name="f2")]
    x = numerical
    bottom = [keras.layers.Dense(w, activation="relu", name=f"bottom_{i}") for i, w in enumerate(BOTTOM)]
    for layer in bottom:
        x = layer(x)
    x = keras.layers.Concatenate()([x] + HybridEmbedding(features, seed=(3, 1000))(ids))
    top = [keras.layers.Dense(w, activation="relu" if i < len(TOP) - 1 else None, name=f"top_{i}")
           for i, w in enumerate(TOP)]
    for layer in top:
        x = layer(x)
    model = Model([numerical] + ids, x)
    seeded_as_the_builtin(bottom, top)
    return model


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_a_dynamic_table_in_the_api_trains_as_the_builtin_one_bit_for_bit(optimizer):
    """Raw ids near 2^40, 24 rows for 30 ids, K = 2: the losses, the tables, the maps' counts and
    each live id's row equal the built-in trainer's on the same plan (table 1 dynamic, recorded);
    fit's logs carry the counts."""
    data = raw_batches()
    want = recorded("dynamic_api")
    model = api_model()
    emb = model.get_layer("hybrid_embedding")
    assert_as_recorded(model_state(model, builtin_name), want["initial"], "initial")
    model.compile(optimizer=optimizer, learning_rate=0.1)
    got = [model.train_on_batch((n,) + tuple(ids), labels, return_dict=True)["loss"] for n, ids, labels in data]
    assert_values_as_recorded(got, want[optimizer]["losses"], "losses")
    assert_as_recorded(model_state(model, builtin_name), want[optimizer]["final"], f"after {len(data)} steps",
                       trained=True)
    counts = want[optimizer]["counts"]   # the built-in's embedding/table_1
    assert emb.dynamic_stats() == {"hybrid_embedding/t1": counts}
    assert counts["live"] == DYNAMIC.capacity and counts["evicted"] > 0 and counts["refused"] > 0
    found = emb.embedding.dynamic[emb.embedding.shards[1]].rows(tf.constant(RAW), None, False).numpy()
    np.testing.assert_array_equal(found, want[optimizer]["raw_rows"])
    assert (found >= 0).sum() == DYNAMIC.capacity
    n, ids, labels = data[0]
    history = model.fit(tf.data.Dataset.from_tensors(((n,) + tuple(ids), labels)), verbose=0, shuffle=False)
    logs = history.history
    assert logs["hybrid_embedding/t1/live"] == [DYNAMIC.capacity]
    assert logs["hybrid_embedding/t1/admitted"][0] >= counts["admitted"]


def test_a_dynamic_table_config_is_checked_in_one_line():
    with pytest.raises(ConfigError, match=r"^table 'u': a dynamic table's rows are its capacity: vocabulary_size "
                                          r"10 != dynamic.capacity 24$"):
        TableConfig(name="u", vocabulary_size=10, embedding_dim=4, dynamic=DYNAMIC)
    with pytest.raises(ConfigError, match=r"^table 'u': dynamic must be None or a "
                                          r"parallel_embedding.planner.DynamicOptions, got dict$"):
        TableConfig(name="u", vocabulary_size=10, embedding_dim=4, dynamic={"capacity": 10})


# Model files -----------------------------------------------------------------------------------------------------

WIDE_AND_DEEP = dict(model="examples/wide_and_deep.py", model_param=["deep_width=4", "hidden=[16,8]", "dropout=0"],
                     synthetic_cardinalities=["300", "50", "7", "30"], batch_size=96, synthetic_rows=96 * 12,
                     synthetic_eval_rows=300, valid_batch_size=300, optimizer="adagrad", learning_rate=0.05,
                     print_freq=1)


def tensors(root):
    manifest = checkpoint.read_manifest(str(root))
    return {n: checkpoint.read_tensor(manifest["path"], n) for n in manifest["tensors"]}


def resumed_equals_uninterrupted(tmp_path, settings, steps=12):
    """Trains `settings` for `steps` steps, and for half of them then resumed: the same checkpoint
    bit for bit; returns the uninterrupted run's checkpoint."""
    whole, first, resumed = (tmp_path / n for n in ("whole", "first", "resumed"))
    run_loop.run(tiny_config(**settings, max_steps=steps, save_checkpoint_path=str(whole)))
    run_loop.run(tiny_config(**settings, max_steps=steps // 2, save_checkpoint_path=str(first)))
    run_loop.run(tiny_config(**settings, max_steps=steps, restore_checkpoint_path=str(first),
                             save_checkpoint_path=str(resumed)))
    assert_same_checkpoint(resumed / f"ckpt-{steps}", whole / f"ckpt-{steps}")
    return whole / f"ckpt-{steps}"


def test_a_model_file_trains_with_dynamic_tables_and_resumes_bit_for_bit(tmp_path, capsys):
    """Wide & Deep (a wide and a deep table per feature) with cat_0 and cat_1 dynamic (K = 2; lfu
    evicting): both tables of each are dynamic, checkpointed as live rows, counted on the progress
    line (their sums); stopped at step 6 and resumed, the same checkpoint as 12 steps bit for bit."""
    settings = dict(WIDE_AND_DEEP, dynamic_tables=["cat_0:100:2", "cat_1:40:1:lfu"])
    ckpt = tensors(resumed_equals_uninterrupted(tmp_path, settings))
    live = 0
    for name, capacity in (("table_0", 100), ("table_4", 100), ("table_1", 40), ("table_5", 40)):
        ids = ckpt[f"embedding_tables/{name}/ids"][:, 0]
        live += len(ids)
        assert 0 < len(ids) <= capacity and len(set(ids.tolist())) == len(ids)
        assert ckpt[f"embedding_tables/{name}"].shape == (len(ids), 1 if name < "table_4" else 4)
    assert "embedding_tables/table_2/ids" not in ckpt and ckpt["embedding_tables/table_2"].shape == (7, 1)
    assert ckpt["embedding_tables/table_1/totals"][0, 1] > 0   # lfu evicted
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step 12/12")]
    # four dynamic tables: their sums, and the tables that refused and evicted the most (utils.logger.SHOWN_TABLES)
    assert f"| 4 dynamic tables: {live:,} live, " in lines[0] and " | most refused and evicted: embedding/" in lines[0]


@pytest.mark.slow
def test_a_model_file_restored_at_another_hash_shard_count_trains_on_as_at_its_own(tmp_path):
    """Wide & Deep with cat_0 dynamic in 3 hash shards (its capacity never binding), resumed at 3 and
    at 1 shard: the same losses, exactly (tests/test_dynamic_reshard.py says why), through the model
    file's layers (run.run_model's restoring)."""
    first = str(tmp_path / "first")
    run_loop.run(tiny_config(**WIDE_AND_DEEP, dynamic_tables=["cat_0:600:1:lru:0:3"], max_steps=6,
                             save_checkpoint_path=first))
    assert "embedding_tables/table_0/shard_2/ids" in checkpoint.read_manifest(first)["tensors"]
    losses = {}
    for shards in (3, 1):
        out = str(tmp_path / str(shards))
        run_loop.run(tiny_config(**WIDE_AND_DEEP, dynamic_tables=[f"cat_0:600:1:lru:0:{shards}"], max_steps=12,
                                 restore_checkpoint_path=first, save_checkpoint_path=out, log_path=out + ".json"))
        losses[shards] = [r["loss"] for r in map(json.loads, open(out + ".json")) if r["kind"] == "step"]
    assert len(losses[3]) == 6 and losses[1] == losses[3]


def write_raw_data(folder, rows=96 * 8, seed=0):
    """A split-binary dataset: "user" raw 64-bit ids (a few hundred values near +-2^62), "c" (5
    rows), "tags" multi-hot raw ids (up to 3); 2 numericals; labels depending on the user."""
    rng = np.random.default_rng(seed)
    pool = rng.integers(-2 ** 62, 2 ** 62, 300)
    user = pool[np.minimum(rng.zipf(1.3, rows) - 1, len(pool) - 1)]
    lengths = rng.integers(0, 4, rows)
    tags = rng.integers(2 ** 50, 2 ** 50 + 40, int(lengths.sum()))
    spec = split_binary_spec(["n0", "n1"], {"user": None, "c": 5, "tags": None}, mappings=["train", "test"],
                             max_hotness={"tags": 3}, base_dir=str(folder))
    for mapping in ("train", "test"):
        with MappingWriter(spec, mapping) as writer:
            numerical = rng.normal(size=(2, rows)).astype(np.float16)
            writer.write({"n0": numerical[0], "n1": numerical[1],
                          "label": (user % 3 == 0) ^ (rng.random(rows) < 0.1), "user": user, "c": np.arange(rows) % 5,
                          "tags": (tags, lengths)})
    spec.to_yaml(str(folder / "feature_spec.yaml"))
    return pool


RAW_DATA = dict(WIDE_AND_DEEP, dataset_type="split_binary", eval_mapping="test",
                dynamic_tables=["user:64:1:lru", "tags:48:2:ttl:3"])


def test_a_model_file_trains_on_raw_ids_and_resumes_bit_for_bit(tmp_path):
    """Raw-id features (`raw_ids: true`) in a model file: their tables dynamic with the flag's
    capacities, every live id one of the data's keys, resumed bit for bit."""
    pool = write_raw_data(tmp_path / "data")
    settings = dict({k: v for k, v in RAW_DATA.items() if not k.startswith("synthetic")},
                    dataset_path=str(tmp_path / "data"))
    ckpt = tensors(resumed_equals_uninterrupted(tmp_path, settings, steps=8))
    for name, f, capacity in (("table_0", "user", 64), ("table_3", "user", 64), ("table_2", "tags", 48)):
        ids = ckpt[f"embedding_tables/{name}/ids"][:, 0]
        assert 0 < len(ids) <= capacity
        assert set(ids.tolist()) <= (set(pool.tolist()) if f == "user" else set(range(2 ** 50, 2 ** 50 + 40)))
    manifest = checkpoint.read_manifest(str(tmp_path / "whole"))
    assert manifest["signature"]["cardinalities"] == [64, 5, 48]


def test_a_model_file_with_a_dynamic_table_exports_and_serves_what_it_predicts(tmp_path):
    """The raw-id run exported in the tables form (each dynamic table's ids file): served
    predictions equal the restored model's for ids seen and never seen (reading zeros)."""
    pool = write_raw_data(tmp_path / "data")
    cfg = tiny_config(**dict({k: v for k, v in RAW_DATA.items() if not k.startswith("synthetic")},
                             dataset_path=str(tmp_path / "data"), max_steps=8,
                             save_checkpoint_path=str(tmp_path / "ckpt")))
    run_loop.run(cfg)
    ckpt = checkpoint.resolve(str(tmp_path / "ckpt"))
    write_repository(ckpt, str(tmp_path / "repo"), "m", forms=("tables",), model_file=cfg.model.model)
    assert (tmp_path / "repo" / "m_tables" / "table_0.ids.npy").exists()
    rng = np.random.default_rng(1)
    b = 40
    user = np.concatenate([rng.choice(pool, b - 4), [2 ** 61 + 5, -3, 0, 2 ** 63 - 1]])   # the last 4 never seen
    tags = rng.integers(2 ** 50 - 5, 2 ** 50 + 45, (b, 3))   # some never seen
    numerical = rng.normal(size=(b, 2)).astype(np.float32)
    live = set(checkpoint.read_tensor(ckpt, "embedding_tables/table_0/ids")[:, 0].tolist())
    assert 0 < sum(u in live for u in user.tolist()) < b - 4   # ids live, ids evicted or never seen
    restored = dataclasses.replace(cfg.checkpoints, restore_checkpoint_path=ckpt, save_checkpoint_path="")
    r = run_loop.Run(dataclasses.replace(cfg, mode="eval", checkpoints=restored))
    want = r.trainer.predict(tf.constant(numerical), [tf.constant(user), tf.constant(np.arange(b) % 5),
                                                      tf.RaggedTensor.from_tensor(tf.constant(tags))]).numpy()
    served = ServedTables(str(tmp_path / "repo"), log=lambda line: None)
    try:
        got = served.infer(numerical, np.concatenate([user[:, None], (np.arange(b) % 5)[:, None], tags], 1))
    finally:
        served.close()
    np.testing.assert_allclose(got["logits"][:, 0], want, rtol=1e-5, atol=1e-6)


# cat_0 through features.feature_configs; cat_1 through its own static table (read twice with hparam "twice").
OWN_TABLES = """
import keras, ranking

def build_model(features, hparams):
    x = features.inputs()
    own = ranking.TableConfig(name="own", vocabulary_size=50, embedding_dim=3, combiner="sum")
    configs = features.feature_configs(3, names=["cat_0"]) + [
        ranking.FeatureConfig(name="own_" + n, table=own, input_shape=(None,), output_shape=(None, 3))
        for n in ["cat_1"] + (["cat_0"] if hparams.get("twice") else [])]
    emb = features.embedding(configs)([x["cat_0"], x["cat_1"]] + ([x["cat_0"]] if hparams.get("twice") else []))
    return ranking.Model(x, keras.layers.Dense(1, name="logit")(keras.layers.Concatenate()(emb + [x["numerical"]])))
"""


def test_model_file_refusals_are_one_line(tmp_path):
    """--dynamic_tables naming a feature the model makes no table of with features.feature_configs,
    or one a static table reads; a static checkpoint restored with the table dynamic, and the reverse."""
    (tmp_path / "own.py").write_text(OWN_TABLES)
    own = dict(WIDE_AND_DEEP, model=str(tmp_path / "own.py"), model_param=[], max_steps=1)
    for params, flag, message in (
            ([], "cat_1:40", f"--dynamic_tables: --model={tmp_path / 'own.py'}: build_model makes no table of feature "
                             "'cat_1' with features.feature_configs(...), which makes its table dynamic"),
            (["twice=1"], "cat_0:40", f"--dynamic_tables: feature 'cat_0' (dynamic) is read by the static table 'own' "
                                      f"of layer 'embedding' in --model={tmp_path / 'own.py'}: build_model; make its "
                                      "table with features.feature_configs(...)")):
        with pytest.raises(ConfigError) as e:
            run_loop.run(tiny_config(**dict(own, model_param=params), dynamic_tables=[flag]))
        assert str(e.value) == message
    static, dynamic = str(tmp_path / "static"), str(tmp_path / "dynamic")
    run_loop.run(tiny_config(**WIDE_AND_DEEP, max_steps=2, save_checkpoint_path=static))
    with pytest.raises(ConfigError, match=r"^table embedding_tables/table_1 \(feature 1\) is dynamic in this run, "
                                          r"static in the checkpoint: a table's kind cannot change"):
        run_loop.run(tiny_config(**WIDE_AND_DEEP, max_steps=4, restore_checkpoint_path=static,
                                 dynamic_tables=["cat_1:40"]))
    run_loop.run(tiny_config(**WIDE_AND_DEEP, max_steps=2, save_checkpoint_path=dynamic, dynamic_tables=["cat_1:40"]))
    with pytest.raises(ConfigError, match=r"^table embedding_tables/table_1 \(feature 1\) is static in this run, "
                                          r"dynamic in the checkpoint"):
        run_loop.run(tiny_config(**WIDE_AND_DEEP, max_steps=4, restore_checkpoint_path=dynamic))


@pytest.mark.slow
def test_a_model_file_at_two_gloo_ranks_equals_one_process(tmp_path):
    """Wide & Deep with cat_0's tables in 2 hash shards (one per rank, evicting) and cat_3's whole
    (lfu), model-parallel input: the per-step losses, the maps' state bit for bit, the values
    within float tolerance and the counts in the JSON log equal one process's."""
    from tests.support.horovod_run import horovodrun
    from tests.test_dynamic_multirank import assert_same_tables
    from tests.support.model_files import DATA, model_args, python
    from tests.support.runs import records, succeeded
    args = [*model_args("wide_and_deep"), *DATA, "--max_steps=6", "--dynamic_tables=cat_0:60:2:lru:0:2,cat_3:30:1:lfu"]
    one, two = tmp_path / "one", tmp_path / "two"
    succeeded(python(*args, f"--log_path={one}.json", f"--save_checkpoint_path={one}"))
    out = succeeded(horovodrun(2, ["main.py", *args, f"--log_path={two}.json", f"--save_checkpoint_path={two}"]))
    assert "2 ranks" in out.stdout
    want, got = records(f"{one}.json"), records(f"{two}.json")
    for s in range(1, 7):
        assert got["step"][s] == pytest.approx(want["step"][s], rel=1e-5, abs=1e-6), s
    assert_same_tables(tensors(two), tensors(one), "embedding_tables/", ("table_4/shard_1/ids", "table_7/counts"))
    counts = [{k: v for r in map(json.loads, open(f"{run}.json")) if r["kind"] == "step" and r["step"] == 6
               for k, v in r.items() if k.startswith("embedding/")} for run in (one, two)]
    assert counts[0] == counts[1] and counts[0]["embedding/deep_cat_0/evicted"] > 0
