"""Sequence models exported and served (deployment/deploy.py --model=FILE, serve.py): DIN, BST and
the HSTU-style ranker (examples/) trained on synthetic histories of up to 6 items with max_length
4, so that requests hold histories of length 0, 1 and over the maximum; their SavedModels
(monolithic, ensemble), the tables form in memory and through the lookup tiers with Redis,
serve.py's native frontend (the history padded, or as variable-length ids over JSON and gRPC)
and Triton's predict what the training-time model predicts, and so does a dynamic item table's
tables form; a second day's delta is taken by the tables form; the NumPy and TensorFlow sparse
parts agree on hand-made histories (padding anywhere, over the maximum, empty); a model reading
a history's ids outside its lookups and a SequenceMask is refused in one line."""
import json
import urllib.error
import urllib.request

import numpy as np
import pytest
import tensorflow as tf

from deployment.repository_format import PAD, categorical_matrix
from deployment.serving.live import Model, unpooled
from run.config import build_config
from tests.support.configs import TINY
from tests.support.exports import deploy, reference, served
from tests.test_model_export import check_tiers_take_the_delta, layout_of, python
from deployment.client import ServingClient, free_ports
from tests.support.serving import start_server, stop_server

HISTORY, MAX_LENGTH = 6, 4
CARDS = ["300", "50", "7"]
PARAMS = {"din": ["width=4", "attention=[8]", "hidden=[16,8]", f"max_length={MAX_LENGTH}"],
          "bst": ["width=4", "heads=2", "attention=[8]", "hidden=[16,8]", f"max_length={MAX_LENGTH}"],
          "hstu": ["width=4", "heads=2", "hidden=[16,8]", f"max_length={MAX_LENGTH}"]}
DATA = ["--dataset_type=synthetic", f"--synthetic_cardinalities={','.join(CARDS)}", "--synthetic_num_numerical=3",
        f"--synthetic_history_length={HISTORY}", "--optimizer=adagrad", "--learning_rate=0.05", "--batch_size=96",
        "--valid_batch_size=300", "--synthetic_rows=960", "--synthetic_eval_rows=300", "--warmup_steps=0",
        "--print_freq=5", "--evals_per_epoch=0"]


def model_args(name):
    return [f"--model=examples/{name}.py"] + [f"--model_param={p}" for p in PARAMS[name]]


def run_config(name, **extra):
    values = dict(TINY, model=f"examples/{name}.py", model_param=PARAMS[name], synthetic_cardinalities=CARDS,
                  synthetic_num_numerical=3, synthetic_history_length=HISTORY, batch_size=96, valid_batch_size=300,
                  synthetic_rows=960, synthetic_eval_rows=300, optimizer="adagrad", **extra)
    return build_config(values, present={"model", "model_param", "synthetic_history_length", *extra})


@pytest.fixture(scope="module")
def din(tmp_path_factory):
    """DIN: day 0 trained and exported in every form (model m), day 1 continued on other data and
    exported as a delta and in full; (tmp, an eval batch of day 0, its categorical_features, the
    training-time logits)."""
    tmp = tmp_path_factory.mktemp("din")
    python(*model_args("din"), *DATA, "--seed=7", f"--save_checkpoint_path={tmp / 'ckpt0'}")
    python(f"--checkpoint={tmp / 'ckpt0'}", f"--output={tmp / 'repo0'}", "--model_name=m", "--model=examples/din.py",
           "--forms=monolithic,ensemble,tables", script="deployment/deploy.py")
    python(*model_args("din"), *DATA, "--seed=8", f"--save_checkpoint_path={tmp / 'ckpt1'}",
           f"--restore_checkpoint_path={tmp / 'ckpt0'}", "--restore_mode=continue")
    python(f"--checkpoint={tmp / 'ckpt1'}", f"--output={tmp / 'delta1'}", f"--delta_from={tmp / 'repo0'}",
           "--model_name=m", "--model=examples/din.py", script="deployment/deploy.py")
    python(f"--checkpoint={tmp / 'ckpt1'}", f"--output={tmp / 'repo1'}", "--model_name=m", "--model=examples/din.py",
           "--forms=tables", script="deployment/deploy.py")
    batch, logits = reference(run_config("din"), str(tmp / "ckpt0"), 300)
    _, layout = layout_of(str(tmp / "repo0"))
    return tmp, batch, categorical_matrix(batch["categorical"], layout.max_hotness), logits


def check_forms(repo, batch, categorical, logits, tmp_path):
    """The SavedModels (monolithic, ensemble) and the tables form in memory predict `logits`."""
    _, layout = layout_of(repo)
    out = served(repo, batch, layout, tmp_path)
    np.testing.assert_allclose(out["logits"][:, 0], logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out["ensemble_logits"], out["logits"], rtol=1e-6, atol=1e-6)
    tables = Model(repo).infer(np.asarray(batch["numerical"]), categorical)
    np.testing.assert_allclose(tables["logits"][:, 0], logits, rtol=1e-5, atol=1e-5)


def test_din_exports_its_history_unpooled_and_serves_what_it_predicts(din, tmp_path):
    tmp, batch, categorical, logits = din
    info, layout = layout_of(str(tmp / "repo0"))
    history = (categorical[:, -HISTORY:] != PAD).sum(1)
    assert {0, 1, HISTORY} <= set(history.tolist())   # empty, one item, over max_length
    # candidate cat_0 and the history in one table (width 4): the history's block L D + 1
    assert layout.max_hotness == [None, None, None, HISTORY] and layout.lookup_features[:2] == [0, 3]
    assert layout.embedding_dims[:2] == [4, MAX_LENGTH * 4 + 1]
    check_forms(str(tmp / "repo0"), batch, categorical, logits, tmp_path)


@pytest.mark.parametrize("name", ["bst", "hstu"])
def test_bst_and_hstu_export_and_serve_what_they_predict(name, tmp_path):
    python(*model_args(name), *DATA, "--seed=7", f"--save_checkpoint_path={tmp_path / 'ckpt'}")
    python(f"--checkpoint={tmp_path / 'ckpt'}", f"--output={tmp_path / 'repo'}", "--model_name=m",
           f"--model=examples/{name}.py", "--forms=monolithic,ensemble,tables", script="deployment/deploy.py")
    batch, logits = reference(run_config(name), str(tmp_path / "ckpt"), 300)
    _, layout = layout_of(str(tmp_path / "repo"))
    check_forms(str(tmp_path / "repo"), batch, categorical_matrix(batch["categorical"], layout.max_hotness), logits,
                tmp_path)


def test_a_dynamic_item_table_serves_its_history_by_raw_id(tmp_path):
    """The candidate and its history in one dynamic table (raw ids, 200 rows; an id not live reads
    zeros): the tables form, its only one, predicts what the model does."""
    dynamic = ["cat_0:200", "history:200"]
    python(*model_args("din"), *DATA, "--seed=7", f"--dynamic_tables={','.join(dynamic)}",
           f"--save_checkpoint_path={tmp_path / 'ckpt'}")
    out = python(f"--checkpoint={tmp_path / 'ckpt'}", f"--output={tmp_path / 'repo'}", "--model_name=m",
                 "--model=examples/din.py", script="deployment/deploy.py")
    assert "tables form chosen: table embedding_tables/table_0 is dynamic" in out.stdout
    batch, logits = reference(run_config("din", dynamic_tables=dynamic), str(tmp_path / "ckpt"), 300)
    _, layout = layout_of(str(tmp_path / "repo"))
    got = Model(str(tmp_path / "repo")).infer(np.asarray(batch["numerical"]),
                                              categorical_matrix(batch["categorical"], layout.max_hotness))
    np.testing.assert_allclose(got["logits"][:, 0], logits, rtol=1e-5, atol=1e-5)


def infer_json(port, inputs):
    """One KServe v2 JSON request to model m: (HTTP status, the answer's document)."""
    body = json.dumps({"inputs": [{"name": n, "datatype": d, "shape": list(np.shape(v)),
                                   "data": np.asarray(v).reshape(-1).tolist()} for n, d, v in inputs]}).encode()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/models/m/infer", body, timeout=60) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def answers_both_forms(din, port):
    """The server on HTTP `port` answers din's requests with the model's logits, the history in its
    padded columns and as variable-length ids with their lengths (JSON); (the variable-length
    request's inputs, the lengths)."""
    _, batch, categorical, logits = din
    numerical = np.asarray(batch["numerical"], np.float32)
    history = categorical[:, -HISTORY:]
    lengths = (history != PAD).sum(1)
    ids = history[history != PAD]   # row by row, each sample's oldest first
    client = ServingClient("http", f"localhost:{port}", "m")
    client.wait_ready(120)
    np.testing.assert_allclose(client.infer(numerical, categorical, ("logits",))["logits"][:, 0], logits,
                               rtol=1e-5, atol=1e-5)
    client.close()
    ragged = [("numerical_features", "FP32", numerical), ("categorical_features", "INT64", categorical[:, :3]),
              ("categorical_3", "INT64", ids), ("categorical_3_lengths", "INT64", lengths)]
    status, answer = infer_json(port, ragged)
    assert status == 200, answer
    out = {o["name"]: np.asarray(o["data"]) for o in answer["outputs"]}
    np.testing.assert_allclose(out["logits"], logits, rtol=1e-5, atol=1e-5)
    return ragged, lengths


def test_native_server_answers_as_the_model_predicts_padded_or_variable_length(din, tmp_path):
    """The history in its padded columns, or as variable-length ids with their lengths (JSON and
    gRPC): the same logits, the model's; lengths that do not add up or exceed the columns: 400."""
    tmp, batch, categorical, logits = din
    numerical = np.asarray(batch["numerical"], np.float32)
    ports = free_ports(3)
    server = start_server(tmp_path / "server.log", ports, f"--model_repository={tmp / 'repo0'}")
    try:
        ragged, lengths = answers_both_forms(din, ports[0])
        import tritonclient.grpc as grpc
        tensors = []
        for name, datatype, value in ragged:
            tensors.append(grpc.InferInput(name, list(value.shape), datatype))
            tensors[-1].set_data_from_numpy(value.astype(np.float32 if datatype == "FP32" else np.int64))
        with grpc.InferenceServerClient(f"localhost:{ports[1]}") as channel:
            got = channel.infer("m", tensors).as_numpy("logits")
        np.testing.assert_allclose(got[:, 0], logits, rtol=1e-5, atol=1e-5)
        more = lengths.copy()
        more[np.argmin(lengths)] += 1   # an empty history given one id
        status, answer = infer_json(ports[0], ragged[:3] + [("categorical_3_lengths", "INT64", more)])
        assert status == 400 and f"input 'categorical_3_lengths' sums to {lengths.sum() + 1}, but " \
            f"'categorical_3' holds {lengths.sum()} ids" in answer["error"], answer
        long = [ragged[0], ("categorical_features", "INT64", categorical[:1, :3]),
                ("categorical_3", "INT64", np.arange(HISTORY + 1)), ("categorical_3_lengths", "INT64", [HISTORY + 1])]
        status, answer = infer_json(ports[0], [long[0][:2] + (numerical[:1],)] + long[1:])
        assert status == 400 and f"each sample's count must be 0 to {HISTORY}" in answer["error"], answer
        status, answer = infer_json(ports[0], ragged[:3])
        assert status == 400 and "'categorical_3' (variable-length ids) and 'categorical_3_lengths'" \
            in answer["error"], answer
    finally:
        stop_server(server, ports, tmp_path / "server.log")


def test_triton_frontend_answers_padded_or_variable_length_as_the_model_predicts(din, tmp_path):
    """serve.py --frontend=triton --triton_variable_length (a real Triton server, each request
    served as it comes): the history in its padded columns, or as variable-length ids with their
    lengths (histories of length 0, 1 and more); lengths that do not add up: the line that names
    them, with Triton's status for a model's refusal (500). (Triton's dynamic batching of padded requests: tests/test_serving.py.)"""
    tmp, batch, categorical, logits = din
    ports = free_ports(3)
    server = start_server(tmp_path / "server.log", ports, f"--model_repository={tmp / 'repo0'}", "--frontend=triton",
                          "--triton_variable_length")
    try:
        ragged, lengths = answers_both_forms(din, ports[0])
        assert {0, 1} <= set(lengths.tolist()) and lengths.max() > MAX_LENGTH
        more = lengths.copy()
        more[np.argmin(lengths)] += 1
        status, answer = infer_json(ports[0], ragged[:3] + [("categorical_3_lengths", "INT64", more)])
        assert status == 500 and f"input 'categorical_3_lengths' sums to {lengths.sum() + 1}, but " \
            f"'categorical_3' holds {lengths.sum()} ids" in answer["error"], answer   # Triton's status for a refusal
    finally:
        stop_server(server, ports, tmp_path / "server.log")


def test_lookup_tiers_with_redis_take_the_second_days_delta(din, tmp_path):
    """The tables form through a small row cache and Redis answers as in memory, cold and cached,
    before day 1's delta, and then as day 1's full export."""
    tmp, batch, categorical, _ = din
    check_tiers_take_the_delta(tmp, tmp_path, np.asarray(batch["numerical"]), categorical)


def test_numpy_and_tensorflow_sparse_parts_agree_on_any_history(din):
    """Hand-made requests (padding between ids, 6 ids of which the last 4 are kept, none): the
    tables form's NumPy lookups equal the sparse SavedModel's, and `unpooled` against a loop."""
    tmp, batch, categorical, _ = din
    cases = np.array([[5, PAD, 7, PAD, PAD, 9], [1, 2, 3, 4, 5, 6], [PAD] * 6, [PAD, PAD, PAD, PAD, PAD, 42]])
    request = np.repeat(categorical[:1], len(cases), axis=0)
    request[:, -HISTORY:] = cases
    sparse = tf.saved_model.load(str(tmp / "repo0" / "m_sparse" / "1" / "model.savedmodel"))
    want = sparse.signatures["serving_default"](categorical_features=tf.constant(request))["embeddings"].numpy()
    model = Model(str(tmp / "repo0"))
    with model.snapshot() as snapshot:
        got = model.embeddings(snapshot, request)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    block = got[:, 4:4 + MAX_LENGTH * 4 + 1]
    assert block[:, -1].tolist() == [3, 6, 0, 1]
    assert not block[0, 3 * 4:-1].any() and not block[2, :-1].any() and not block[3, 4:-1].any()
    rows = np.random.default_rng(0).normal(size=(len(cases), HISTORY, 3)).astype(np.float32)
    present = cases != PAD
    expect = np.zeros((len(cases), MAX_LENGTH * 3 + 1), np.float32)
    for s in range(len(cases)):
        kept = [j for j in range(HISTORY) if present[s, j]][-MAX_LENGTH:]
        for slot, j in enumerate(kept):
            expect[s, slot * 3:(slot + 1) * 3] = rows[s, j]
        expect[s, -1] = present[s].sum()
    np.testing.assert_array_equal(unpooled(rows, present, MAX_LENGTH), expect)


READS_IDS = """
import keras, ranking

def build_model(features, hparams):
    candidate, history = features.history_configs("cat_0", "history", 4, 4)
    x = features.inputs()
    emb = features.embedding([candidate, history])([x["cat_0"], x["history"]])
    count = keras.layers.Lambda(lambda ids: keras.ops.cast(ids.row_lengths(), "float32")[:, None],
                                name="count", output_shape=(1,))(x["history"])
    h = keras.layers.Concatenate()([emb[0], keras.layers.Flatten()(emb[1]), count, x["numerical"]])
    return ranking.Model(x, keras.layers.Dense(1, name="logit")(h), name="reads_ids")
"""


def test_a_history_read_outside_its_lookups_is_refused(tmp_path):
    (tmp_path / "reads_ids.py").write_text(READS_IDS)
    path = str(tmp_path / "reads_ids.py")
    python(f"--model={path}", *DATA, "--seed=7", f"--save_checkpoint_path={tmp_path / 'ckpt'}")
    result = deploy(f"--checkpoint={tmp_path / 'ckpt'}", f"--output={tmp_path / 'repo'}", f"--model={path}")
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        f"error: --model={path}: input 'history' is read by layer 'count' beside the embeddings; the export serves "
        "a feature's ids to the model only through its lookups, and a sequence's through a SequenceMask too"], \
        result.stderr[-2000:]
