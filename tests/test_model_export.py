"""deployment/deploy.py --model=FILE and serving for checkpoints of main.py --model=FILE: Wide & Deep
(two lookups per feature: wide width 1, deep width 4) trained on synthetic multi-hot data, exported
in every form; its SavedModels (monolithic, ensemble), the tables form served from memory and
serve.py's native frontend predict what the training-time model predicts; a second day continued
from the checkpoint, exported as a delta, is applied by a running server under continuous
requests, none failing, after which it answers as the second day's full export. DeepFM, and a
model file with a table shared by a one-hot and a multi-hot feature (mean combiners, features
given out of order), export and serve equal predictions; so does a model computing ids of its
own (a cross, a slice of a history), refused in one line by the tables form and deltas; the
refusals are one line. A model with
two heads (one trained with mean squared error) exports and serves a column per head, and takes
a delta."""
import json
import os
import shutil
import subprocess
import threading
import time

import numpy as np
import pytest

from deployment.client import ServingClient, free_ports
from deployment.repository_format import ServingLayout, categorical_matrix, read_delta
from deployment.serving.live import Model
from deployment.serving.tiers import TierConfig
from run.config import build_config
from tests.support.configs import TINY
from tests.support.horovod_run import ROOT
from tests.support.redis_server import RedisServer
from tests.support.exports import deploy, reference, served
from tests.support.serving import served_outputs, start_server, stop_server
from tests.support.warm_python import PYTHON

CARDS, HOTNESS = ["300", "50", "7", "30"], ["1", "3", "1", "2"]   # features 1 and 3 multi-hot
DATA = ["--dataset_type=synthetic", f"--synthetic_cardinalities={','.join(CARDS)}",
        f"--synthetic_dataset_hotness={','.join(HOTNESS)}", "--synthetic_num_numerical=3", "--optimizer=adagrad",
        "--learning_rate=0.05", "--batch_size=96", "--valid_batch_size=300", "--synthetic_rows=960",
        "--synthetic_eval_rows=300", "--warmup_steps=0",
        "--print_freq=5", "--evals_per_epoch=0"]
PARAMS = {"wide_and_deep": ["deep_width=4", "hidden=[16,8]", "dropout=0"],
          "deepfm": ["embedding_dim=4", "hidden=[16,8]"]}
SHARED = """
import keras, ranking

def build_model(features, hparams):
    x = features.inputs()
    shared = ranking.TableConfig(name="shared", vocabulary_size=300, embedding_dim=4, combiner="mean")
    tables = {"cat_3": shared, "cat_0": shared,
              "cat_1": ranking.TableConfig(name="own", vocabulary_size=50, embedding_dim=3, combiner="mean"),
              "cat_2": ranking.TableConfig(name="small", vocabulary_size=7, embedding_dim=2, combiner="sum")}
    configs = [ranking.FeatureConfig(name=n, table=t, input_shape=(None, features[n].max_hotness or 1),
                                     output_shape=(None, t.embedding_dim)) for n, t in tables.items()]
    emb = features.embedding(configs)([x[n] for n in tables])
    h = keras.layers.Dense(8, activation="relu", name="hidden")(keras.layers.Concatenate(name="cat")(
        emb + [x["numerical"]]))
    return ranking.Model(x, keras.layers.Dense(1, name="logit")(h), name="shared_mean")
"""
# Two HybridEmbedding layers: "wide" (a width-1 table per feature) and "deep" (cat_0 and the
# multi-hot cat_3 sharing one table): the export numbers the tables across the layers.
TWO_LAYERS = """
import keras, ranking

def build_model(features, hparams):
    x = features.inputs()
    n = features.names
    wide = features.embedding(features.feature_configs(1, prefix="wide_"), name="wide")([x[f] for f in n])
    shared = ranking.TableConfig(name="shared", vocabulary_size=300, embedding_dim=4, combiner="sum")
    deep = [ranking.FeatureConfig(name=f, table=shared, input_shape=(None, features[f].max_hotness or 1),
                                  output_shape=(None, 4)) for f in ("cat_0", "cat_3")]
    emb = features.embedding(deep + features.feature_configs(3, names=["cat_1", "cat_2"]), name="deep")(
        [x["cat_0"], x["cat_3"], x["cat_1"], x["cat_2"]])
    h = keras.layers.Dense(8, activation="relu", name="hidden")(keras.layers.Concatenate(name="deep_input")(
        emb + [x["numerical"]]))
    return ranking.Model(x, keras.layers.Add(name="logit")(wide + [keras.layers.Dense(1, name="deep_logit")(h)]))
"""
# Ids computed in the model: a cross of cat_0 and cat_2 hashed into a table of its own (Keras'
# HashedCrossing, an int64 layer evaluated beside float32 ones), and the first id of the multi-hot cat_3 (a slice of a history) in another.
COMPUTED = """
import keras, ranking

def build_model(features, hparams):
    x = features.inputs()
    cross = keras.layers.HashedCrossing(num_bins=97, name="cross_ids")([x["cat_0"], x["cat_2"]])
    first = keras.layers.Lambda(lambda r: r.to_tensor(default_value=0, shape=[None, 2])[:, 0] % 30,
                                output_shape=(), name="first_of_cat_3")(x["cat_3"])
    configs = features.feature_configs(4) + [
        ranking.FeatureConfig(name=n, table=ranking.TableConfig(name=n, vocabulary_size=v, embedding_dim=4),
                              input_shape=(None, 1), output_shape=(None, 4)) for n, v in (("cross", 97), ("first", 30))]
    emb = features.embedding(configs)([x[n] for n in features.names] + [cross, first])
    h = keras.layers.Dense(8, activation="relu", name="hidden")(keras.layers.Concatenate(name="cat")(
        emb + [x["numerical"]]))
    return ranking.Model(x, keras.layers.Dense(1, name="logit")(h), name="computed")
"""
MODEL_FILES = {"shared_mean": SHARED, "two_layers": TWO_LAYERS}


def python(*args, script="main.py"):
    result = subprocess.run([*PYTHON, script, *args], cwd=ROOT, capture_output=True, text=True, timeout=600,
                            env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=ROOT))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def model_args(path, params=()):
    return [f"--model={path}"] + [f"--model_param={p}" for p in params]


def train(path, params, ckpt, *extra):
    python(*model_args(path, params), *DATA, f"--save_checkpoint_path={ckpt}", *extra)


def run_config(path, params, **extra):
    """The run configuration of DATA (and `extra` flags) with model file `path` (for
    tests.test_deployment_export.reference)."""
    values = dict(TINY, model=path, model_param=list(params), synthetic_cardinalities=CARDS,
                  synthetic_dataset_hotness=HOTNESS, synthetic_num_numerical=3, batch_size=96, valid_batch_size=300,
                  synthetic_rows=960, synthetic_eval_rows=300, optimizer="adagrad", **extra)
    return build_config(values, present={"model", "model_param", "synthetic_dataset_hotness", *extra})


def layout_of(repo):
    with open(os.path.join(repo, "export.json")) as f:
        info = json.load(f)
    return info, ServingLayout(**info["layout"])


def check_served(path, params, ckpt, repo, tmp_path):
    """The export's SavedModels (monolithic, ensemble) and its tables form in memory predict the
    training-time model's logits; returns (eval batch, its categorical_features, logits)."""
    batch, logits = reference(run_config(path, params), ckpt, 300)
    _, layout = layout_of(repo)
    out = served(repo, batch, layout, tmp_path)
    np.testing.assert_allclose(out["logits"][:, 0], logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out["ensemble_logits"], out["logits"], rtol=1e-6, atol=1e-6)
    categorical = categorical_matrix(batch["categorical"], layout.max_hotness)
    tables = Model(repo).infer(np.asarray(batch["numerical"]), categorical)
    np.testing.assert_allclose(tables["logits"], out["logits"], rtol=1e-5, atol=1e-5)
    return batch, categorical, logits


@pytest.fixture(scope="module")
def days(tmp_path_factory):
    """Wide & Deep: day 0 trained and exported in every form (model name m), day 1 continued from
    it on other data and exported as a delta against day 0 and in full."""
    tmp = tmp_path_factory.mktemp("wide_and_deep")
    path, params = "examples/wide_and_deep.py", PARAMS["wide_and_deep"]
    train(path, params, tmp / "ckpt0", "--seed=7")
    python(f"--checkpoint={tmp / 'ckpt0'}", f"--output={tmp / 'repo0'}", "--model_name=m", f"--model={path}",
           "--forms=monolithic,ensemble,tables", script="deployment/deploy.py")
    train(path, params, tmp / "ckpt1", "--seed=8", f"--restore_checkpoint_path={tmp / 'ckpt0'}",
          "--restore_mode=continue")
    delta = python(f"--checkpoint={tmp / 'ckpt1'}", f"--output={tmp / 'delta1'}", f"--delta_from={tmp / 'repo0'}",
                   "--model_name=m", f"--model={path}", script="deployment/deploy.py")
    python(f"--checkpoint={tmp / 'ckpt1'}", f"--output={tmp / 'repo1'}", "--model_name=m", f"--model={path}",
           "--forms=monolithic,tables", script="deployment/deploy.py")
    return {"tmp": tmp, "path": path, "params": params, "delta_line": delta.stdout.strip().splitlines()[-1]}


@pytest.mark.slow
def test_wide_and_deep_exports_and_serves_what_it_predicts(days, tmp_path):
    repo = str(days["tmp"] / "repo0")
    info, layout = layout_of(repo)
    # 2 lookups per feature (wide: tables 0-3 of width 1, deep: tables 4-7 of width 4), in the model's order
    assert layout.lookup_features == [0, 1, 2, 3, 0, 1, 2, 3] and layout.embedding_dims == [1] * 4 + [4] * 4
    assert info["signature"]["model"] == "wide_and_deep.py" and info["models"] == ["m", "m_dense", "m_sparse"]
    with open(os.path.join(repo, "m_tables", "tables.json")) as f:
        tables = json.load(f)
    assert [(t["rows"], t["dim"]) for t in tables["tables"]] == [(300, 1), (50, 1), (7, 1), (30, 1), (300, 4),
                                                                (50, 4), (7, 4), (30, 4)]
    assert [(x["feature"], x["table"], x["embedding_columns"]) for x in tables["lookups"]][3:5] == [
        (3, 3, [3, 4]), (0, 4, [4, 8])]
    check_served(days["path"], days["params"], str(days["tmp"] / "ckpt0"), repo, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["deepfm", "shared_mean", "two_layers"])
def test_other_model_files_export_and_serve_what_they_predict(name, tmp_path):
    if name in MODEL_FILES:
        path, params = str(tmp_path / f"{name}.py"), []
        (tmp_path / f"{name}.py").write_text(MODEL_FILES[name])
    else:
        path, params = f"examples/{name}.py", PARAMS[name]
    train(path, params, tmp_path / "ckpt", "--seed=7")
    out = python(f"--checkpoint={tmp_path / 'ckpt'}", f"--output={tmp_path / 'repo'}", "--model_name=m",
                 f"--model={path}", "--forms=monolithic,ensemble,tables", "--host_table_mb=0.001",
                 script="deployment/deploy.py")
    assert "table files" in out.stdout
    info, layout = layout_of(str(tmp_path / "repo"))
    if name == "shared_mean":   # cat_3 and cat_0 in the shared table 0 (its 4.7 KB in host memory)
        assert layout.lookup_features == [3, 0, 1, 2] and layout.embedding_dims == [4, 4, 3, 2]
        assert info["host_tables"] == [0]
    if name == "two_layers":   # wide: a width-1 table per feature; deep: cat_0 and cat_3 in one table, cat_1's, cat_2's
        assert sorted(zip(layout.lookup_features, layout.embedding_dims)) == sorted(
            [(0, 1), (1, 1), (2, 1), (3, 1), (0, 4), (3, 4), (1, 3), (2, 3)])   # the layers in dense_part's order
        with open(tmp_path / "repo" / "m_tables" / "tables.json") as f:
            assert sorted(t["dim"] for t in json.load(f)["tables"]) == [1, 1, 1, 1, 3, 3, 4]   # 7 tables over 2 layers
    check_served(path, params, str(tmp_path / "ckpt"), str(tmp_path / "repo"), tmp_path)


@pytest.mark.slow
def test_ids_computed_in_the_model_are_computed_in_the_served_graph(tmp_path):
    path = str(tmp_path / "computed.py")
    (tmp_path / "computed.py").write_text(COMPUTED)
    train(path, [], tmp_path / "ckpt", "--seed=7")
    python(f"--checkpoint={tmp_path / 'ckpt'}", f"--output={tmp_path / 'repo'}", "--model_name=m", f"--model={path}",
           script="deployment/deploy.py")
    info, layout = layout_of(str(tmp_path / "repo"))
    assert info["forms"] == ["monolithic", "ensemble"] and layout.lookup_features == [0, 1, 2, 3, None, None]
    batch, logits = reference(run_config(path, []), str(tmp_path / "ckpt"), 300)
    out = served(str(tmp_path / "repo"), batch, layout, tmp_path)
    np.testing.assert_allclose(out["logits"][:, 0], logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out["ensemble_logits"], out["logits"], rtol=1e-6, atol=1e-6)
    for args, message in (
            (["--forms=tables"], "error: feature 'cross''s ids are computed in the model, and the tables form looks "
                                 "up the requests' ids as they are: use --forms=monolithic,ensemble (the id "
                                 "computation in their SavedModels)"),
            ([f"--delta_from={tmp_path / 'repo'}"], "error: --delta_from: feature 'cross''s ids are computed in the "
                                                    "model, and a delta updates the tables form, which looks up the "
                                                    "requests' ids as they are: export it in full "
                                                    "(--forms=monolithic,ensemble)")):
        result = deploy(f"--checkpoint={tmp_path / 'ckpt'}", f"--output={tmp_path / 'other'}", f"--model={path}",
                        *args)
        assert result.returncode == 2 and result.stderr.strip().splitlines() == [message], result.stderr[-2000:]
    assert not os.path.exists(tmp_path / "other")


def test_model_file_refusals_are_one_line(days, tmp_path):
    ckpt = days["tmp"] / "ckpt0"
    for args, message in (
            ([], f"error: {ckpt}/ckpt-10: a checkpoint of model file wide_and_deep.py: pass it as --model=FILE"),
            (["--model=examples/deepfm.py"],
             f"error: --model=examples/deepfm.py: {ckpt}/ckpt-10 was written by model file wide_and_deep.py"),
            ([f"--model={tmp_path / 'wide_and_deep.py'}"],
             f"error: --model={tmp_path / 'wide_and_deep.py'}: not a file")):
        result = deploy(f"--checkpoint={ckpt}", f"--output={tmp_path / 'repo'}", *args)
        assert result.returncode == 2 and result.stderr.strip().splitlines() == [message], result.stderr[-2000:]
    assert not os.path.exists(tmp_path / "repo")


@pytest.mark.parametrize("frontend", ["native", "triton"])
def test_served_by_each_frontend(days, frontend, tmp_path):
    """serve.py (the export's tables form, its choice) answers as the trained model predicts, through
    either frontend (the SavedModels' own predictions: check_served)."""
    tmp = days["tmp"]
    batch, logits = reference(run_config(days["path"], days["params"]), str(tmp / "ckpt0"), 300)
    _, layout = layout_of(str(tmp / "repo0"))
    categorical = categorical_matrix(batch["categorical"], layout.max_hotness)
    log = tmp_path / "server.log"
    out = served_outputs(log, tmp / "repo0", np.asarray(batch["numerical"]), categorical, ("logits",),
                         f"--frontend={frontend}")
    np.testing.assert_allclose(out["logits"][:, 0], logits, rtol=1e-5, atol=1e-5)
    assert "serving m (tables form, step 10 " in log.read_text()


def test_lookup_tiers_with_redis_serve_and_take_the_delta(days, tmp_path):
    """The tables form through the lookup tiers (a cache of a fraction of the tables, Redis):
    exactly the in-memory model's responses, before and after day 1's delta, which they take."""
    tmp = days["tmp"]
    batch, categorical, _ = check_served(days["path"], days["params"], str(tmp / "ckpt0"), str(tmp / "repo0"),
                                        tmp_path)
    check_tiers_take_the_delta(tmp, tmp_path, np.asarray(batch["numerical"]), categorical)


def check_tiers_take_the_delta(tmp, tmp_path, numerical, categorical):
    """`tmp`/repo0 (step 10; a copy: the tiers write the delta into its table files) served through
    a 2 KB row cache and Redis answers exactly as it does in memory, cold and then from the cache
    and Redis; after `tmp`/delta1, which it takes, as `tmp`/repo1 (step 20) does."""
    repo = shutil.copytree(tmp / "repo0", tmp_path / "repo0")
    redis = RedisServer(str(tmp_path)).start()
    try:
        model = Model(str(repo), tiers=TierConfig(cache_bytes=2048, redis_url=redis.url), log=lambda line: None)
        for step, reference_repo in ((10, tmp / "repo0"), (20, tmp / "repo1")):
            if step == 20:
                assert model.apply_delta(read_delta(str(tmp / "delta1"))) > 0
            for _ in range(2):   # cold, then from the cache and Redis
                got = model.infer(numerical, categorical)
                want = Model(str(reference_repo)).infer(numerical, categorical)
                np.testing.assert_array_equal(got["logits"], want["logits"])
                assert set(got["model_version"][:, 0].tolist()) == {step}
        stats = model.stats()
        assert stats["redis"]["up"] and stats["store"]["rows_read"] > 0
        model.close()
    finally:
        redis.stop()


class Load(threading.Thread):
    """A gRPC client sending `batches` in turn until stopped: per response (request index,
    model_version, logits), and the errors."""

    def __init__(self, port, batches):
        super().__init__(daemon=True)
        self.client, self.batches = ServingClient("grpc", f"localhost:{port}", "m"), batches
        self.responses, self.errors, self.stop = [], [], threading.Event()

    def run(self):
        k = 0
        while not self.stop.is_set():
            numerical, categorical = self.batches[k % len(self.batches)]
            try:
                out = self.client.infer(numerical, categorical, ("logits", "model_version"))
            except Exception as e:
                self.errors.append(str(e))
                continue
            self.responses.append((k % len(self.batches), set(out["model_version"][:, 0].tolist()), out["logits"]))
            k += 1


def test_second_day_delta_applied_live_under_requests(days, tmp_path):
    """serve.py (native frontend, tables form) serves day 0 as the model predicts it; day 1's delta
    dropped into its updates folder under continuous requests: none fails, every response is one
    version's, and afterwards it answers as day 1's full export and as the day-1 model predicts."""
    tmp = days["tmp"]
    assert days["delta_line"].startswith(f"exported delta 10 -> 20 to {tmp / 'delta1'}: ")
    batch, categorical, logits0 = check_served(days["path"], days["params"], str(tmp / "ckpt0"), str(tmp / "repo0"),
                                               tmp_path)
    numerical = np.asarray(batch["numerical"])
    batches = [(numerical[k::3], categorical[k::3]) for k in range(3)]
    expected = {step: [Model(str(tmp / repo)).infer(*b)["logits"] for b in batches]
                for step, repo in ((10, "repo0"), (20, "repo1"))}
    updates, log = tmp_path / "updates", tmp_path / "server.log"
    updates.mkdir()
    ports = free_ports(3)
    server = start_server(log, ports, f"--model_repository={tmp / 'repo0'}", f"--updates={updates}",
                          "--poll_seconds=0.5")
    load = Load(ports[1], batches)
    try:
        load.client.wait_ready(120)
        first = load.client.infer(numerical, categorical, ("logits",))["logits"][:, 0]
        np.testing.assert_allclose(first, logits0, rtol=1e-5, atol=1e-5)
        load.start()
        deadline = time.monotonic() + 120
        while len(load.responses) < 30:
            assert time.monotonic() < deadline, "requests before the update"
            time.sleep(0.05)
        shutil.copytree(tmp / "delta1", tmp_path / "delta1")
        os.rename(tmp_path / "delta1", updates / "delta1")   # moved whole: the server never sees it half-written
        while not any(v == {20} for _, v, _ in load.responses[-5:]):
            assert time.monotonic() < deadline + 60, log.read_text()[-3000:]
            time.sleep(0.05)
        count = len(load.responses)
        while len(load.responses) < count + 10:
            time.sleep(0.05)
    finally:
        load.stop.set()
        load.join(60)
        stop_server(server, ports, log)
    assert load.errors == []
    versions = [min(v) for _, v, _ in load.responses]
    assert all(len(v) == 1 for _, v, _ in load.responses) and versions == sorted(versions) and set(versions) == {10, 20}
    for k, (version,), got in load.responses:
        np.testing.assert_array_equal(got, expected[version][k])
    _, logits1 = reference(run_config(days["path"], days["params"]), str(tmp / "ckpt1"), 300)
    np.testing.assert_allclose(np.concatenate([e[:, 0] for e in expected[20]]),
                               np.concatenate([logits1[k::3] for k in range(3)]), rtol=1e-5, atol=1e-5)
    lines = log.read_text().splitlines()
    assert any(line.startswith(f"applied update {updates / 'delta1'} (delta, ") for line in lines)


# examples/two_label.py on two synthetic labels: label by binary cross-entropy, label_1 by mean squared error
TWO_HEADS = ["embedding_dim=4", "hidden=[16,8]", "head=[8]", "second_loss=mean_squared_error", "second_weight=0.5"]


@pytest.fixture(scope="module")
def two_heads(tmp_path_factory):
    """The two-head model trained and exported in every form: (tmp, its export's layout, an eval
    batch, its categorical_features, the training-time model's outputs [300, 2])."""
    tmp = tmp_path_factory.mktemp("two_heads")
    path = "examples/two_label.py"
    train(path, TWO_HEADS, tmp / "ckpt", "--seed=7", "--synthetic_labels=2")
    python(f"--checkpoint={tmp / 'ckpt'}", f"--output={tmp / 'repo'}", "--model_name=m", f"--model={path}",
           "--forms=monolithic,ensemble,tables", script="deployment/deploy.py")
    batch, outputs = reference(run_config(path, TWO_HEADS, synthetic_labels=2), str(tmp / "ckpt"), 300)
    _, layout = layout_of(str(tmp / "repo"))
    return tmp, layout, batch, categorical_matrix(batch["categorical"], layout.max_hotness), outputs


def test_a_model_with_two_heads_exports_a_column_per_head(two_heads, tmp_path):
    """predictions and logits [B, 2] in the labels' order (the layout's heads, Triton's dims [2]):
    each head's logit the training-time model's, label's prediction its sigmoid, label_1's (a
    value: mean squared error) its output; the same from the ensemble and the tables form."""
    tmp, layout, batch, categorical, outputs = two_heads
    assert outputs.shape == (300, 2) and layout.heads == ["label", "label_1"]
    for model in ("m", "m_dense", "m_ensemble"):
        config = (tmp / "repo" / model / "config.pbtxt").read_text()
        assert 'name: "predictions" data_type: TYPE_FP32 dims: [ 2 ]' in config
        assert 'name: "logits" data_type: TYPE_FP32 dims: [ 2 ]' in config
    out = served(str(tmp / "repo"), batch, layout, tmp_path)
    np.testing.assert_allclose(out["logits"], outputs, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out["predictions"][:, 0], 1 / (1 + np.exp(-outputs[:, 0])), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out["predictions"][:, 1], outputs[:, 1], rtol=1e-5, atol=1e-5)
    for key in ("logits", "predictions"):
        np.testing.assert_allclose(out[f"ensemble_{key}"], out[key], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(Model(str(tmp / "repo")).infer(np.asarray(batch["numerical"]), categorical)[key],
                                   out[key], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("frontend", ["native", "triton"])
def test_a_model_with_two_heads_served_by_each_frontend(two_heads, frontend, tmp_path):
    tmp, layout, batch, categorical, outputs = two_heads
    out = served_outputs(tmp_path / "server.log", tmp / "repo", np.asarray(batch["numerical"]), categorical,
                         ("predictions", "logits"), f"--frontend={frontend}")
    np.testing.assert_allclose(out["logits"], outputs, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out["predictions"], np.stack([1 / (1 + np.exp(-outputs[:, 0])), outputs[:, 1]], axis=1),
                               rtol=1e-5, atol=1e-5)


def test_a_model_with_two_heads_takes_a_delta(two_heads, tmp_path):
    """A second day continued from it, exported as a delta: applied to the tables form, it answers
    (both heads, predictions and logits) as the second day's full export."""
    tmp, _, batch, categorical, _ = two_heads
    path = "examples/two_label.py"
    train(path, TWO_HEADS, tmp_path / "ckpt1", "--seed=8", "--synthetic_labels=2",
          f"--restore_checkpoint_path={tmp / 'ckpt'}", "--restore_mode=continue")
    python(f"--checkpoint={tmp_path / 'ckpt1'}", f"--output={tmp_path / 'delta1'}", f"--delta_from={tmp / 'repo'}",
           "--model_name=m", f"--model={path}", script="deployment/deploy.py")
    python(f"--checkpoint={tmp_path / 'ckpt1'}", f"--output={tmp_path / 'repo1'}", "--model_name=m",
           f"--model={path}", "--forms=tables", script="deployment/deploy.py")
    model = Model(str(shutil.copytree(tmp / "repo", tmp_path / "repo0")))
    before = model.infer(np.asarray(batch["numerical"]), categorical)
    assert model.apply_delta(read_delta(str(tmp_path / "delta1"))) > 0
    got = model.infer(np.asarray(batch["numerical"]), categorical)
    want = Model(str(tmp_path / "repo1")).infer(np.asarray(batch["numerical"]), categorical)
    for key in ("predictions", "logits"):
        assert got[key].shape == (300, 2) and not np.array_equal(got[key], before[key])
        np.testing.assert_array_equal(got[key], want[key])
