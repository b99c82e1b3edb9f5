"""main.py --model=FILE with a model of several heads (examples/two_label.py) on data with two labels:
synthetic (--synthetic_labels=2) and a split-binary feature spec whose label channel names two
(written, read back, and converted to split TFRecords). It trains with a loss per head (progress
line and JSON log), evaluates with an exact AUC per head equal to an independent NumPy AUC of the
same predictions, resumes bit for bit, and at 2 Gloo ranks equals one process; the mismatches of
heads and labels and the built-in models on two labels are one error line. The model file's
compile_args chooses a loss and weight per head (binary cross-entropy: AUC; mean squared error:
RMSE), checked against NumPy; exported and served (native frontend and Triton), the model is scored
by deployment/evaluate_accuracy.py per head with its metric as main.py --mode=eval scores its
checkpoint (a one-output regression model: by its RMSE). (Export and serving of heads: tests/test_model_export.py.)"""
import json

import numpy as np
import pytest

from dataloading.feature_spec import SPEC_FILE, FeatureSpec, split_binary_spec
from dataloading.generate_dataset import generate
from dataloading.split_binary import SplitBinaryDataset
from dataloading.split_tfrecords import open_split_tfrecords
from dataloading.synthetic import SyntheticDataset
from dataloading.to_tfrecords import convert
from deployment.client import free_ports
from run.config import build_config
from tests.support.configs import TINY
from tests.support.horovod_run import horovodrun
from tests.support.model_files import DATA, FILE_DATA, PLACEMENT, STEPS, error_line, python
from tests.support.runs import succeeded
from tests.support.serving import script, start_server, stop_server
from tests.support.checks import assert_same_checkpoint, log_records
from utils.errors import ConfigError

MODEL = ["--model=examples/two_label.py", "--model_param=embedding_dim=4", "--model_param=hidden=[16,8]",
         "--model_param=head=[8]"]
TWO_LABELS = [*DATA, "--synthetic_labels=2"]
HEADS = ("label", "label_1")


def numpy_auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """ROC AUC by the rank-sum (Mann-Whitney) formula, tied scores at their average rank."""
    _, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)
    ranks = (np.cumsum(counts) - (counts - 1) / 2.0)[inverse]
    positive = labels == 1
    p, n = int(positive.sum()), int((~positive).sum())
    return float((ranks[positive].sum() - p * (p + 1) / 2.0) / (p * n))


def steps(path) -> dict:
    """{step: (loss, each head's loss)} of a JSON log."""
    return {r["step"]: (r["loss"],) + tuple(r[f"{h}_loss"] for h in HEADS)
            for r in log_records(path) if r["kind"] == "step"}


def last_eval(path) -> dict:
    return [r for r in log_records(path) if r["kind"] == "eval"][-1]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The one-process run on two synthetic labels: (its log, its checkpoint root)."""
    path = tmp_path_factory.mktemp("two_label")
    out = succeeded(python(*MODEL, *TWO_LABELS, f"--save_checkpoint_path={path / 'ckpt'}",
                           f"--log_path={path / 'log.json'}"))
    assert f"step 1/{STEPS} |" in out.stdout and " | label loss " in out.stdout and " | label_1 loss " in out.stdout
    return path / "log.json", path / "ckpt"


def eval_outputs(run):
    """The run's model's outputs [n, H] and the labels [n, H] over its evaluation data (padding cut)."""
    outputs, labels = [], []
    for numerical, categorical, y, _, valid in run._eval_data():
        outputs.append(run.trainer.predict(numerical, categorical).numpy()[:int(valid)])
        labels.append(y.numpy()[:int(valid)])
    return np.concatenate(outputs), np.concatenate(labels)


def test_two_labels_train_with_a_loss_per_head_and_evaluate_an_auc_per_head(uninterrupted):
    log, _ = uninterrupted
    got = steps(log)
    assert sorted(got) == list(range(1, STEPS + 1))
    for loss, label, label_1 in got.values():   # the loss is the heads' sum (weights 1)
        assert loss == pytest.approx(label + label_1, rel=1e-6) and label > 0 and label_1 > 0
    final = last_eval(log)
    assert final["samples"] == 500
    for h in HEADS:
        assert 0.5 < final[f"{h}_auc"] <= 1.0 and final[f"{h}_oracle_auc"] > 0.7
    # the first head's figures are the run's auc and logloss (--keep_best_checkpoint chooses by them)
    assert (final["auc"], final["logloss"]) == (final["label_auc"], final["label_logloss"])
    assert final["label_auc"] != final["label_1_auc"]


def test_each_heads_auc_is_the_numpy_auc_of_the_same_predictions(uninterrupted):
    """The training run's checkpoint evaluated in this process: each head's AUC equals a NumPy
    rank-sum AUC of the predictions and labels of the evaluation batches, and the training run's."""
    from run.loop import Run
    log, ckpt = uninterrupted
    values = {"mode": "eval", "dataset_type": "synthetic", "synthetic_cardinalities": ["300", "50", "7", "30"],
              "synthetic_num_numerical": 3, "synthetic_eval_rows": 500, "valid_batch_size": 300, "seed": 7,
              "synthetic_labels": 2, "model": "examples/two_label.py",
              "model_param": ["embedding_dim=4", "hidden=[16,8]", "head=[8]"], "restore_checkpoint_path": str(ckpt)}
    run = Run(build_config(dict(TINY, **values), set(values)))
    try:
        metrics = run.evaluate(run.start_step)
        logits, labels = eval_outputs(run)
    finally:
        run.model.embeddings.close()
    assert logits.shape == labels.shape == (500, 2)
    trained = last_eval(log)
    for h, head in enumerate(HEADS):
        assert metrics[f"{head}_auc"] == pytest.approx(numpy_auc(labels[:, h], logits[:, h]), abs=1e-12)
        assert metrics[f"{head}_auc"] == trained[f"{head}_auc"]


def test_a_run_stopped_and_resumed_equals_the_uninterrupted_one_bit_for_bit(tmp_path, uninterrupted):
    log, ckpt = uninterrupted
    first = tmp_path / "first"
    succeeded(python(*MODEL, *TWO_LABELS, "--max_steps=6", "--checkpoint_every_n_steps=3",
                     f"--save_checkpoint_path={first}", f"--log_path={tmp_path / 'first.json'}"))
    succeeded(python(*MODEL, *TWO_LABELS, f"--restore_checkpoint_path={first}",
                     f"--save_checkpoint_path={tmp_path / 'resumed'}", f"--log_path={tmp_path / 'resumed.json'}"))
    want, resumed = steps(log), steps(tmp_path / "resumed.json")
    assert sorted(resumed) == list(range(7, STEPS + 1))
    assert all(resumed[s] == want[s] for s in resumed), (resumed, want)
    assert_same_checkpoint(tmp_path / "resumed", ckpt)
    got, final = last_eval(tmp_path / "resumed.json"), last_eval(log)
    assert all(got[f"{h}_{m}"] == final[f"{h}_{m}"] for h in HEADS for m in ("auc", "logloss"))


@pytest.mark.slow
def test_two_gloo_ranks_equal_one_process(tmp_path, uninterrupted):
    log, _ = uninterrupted
    succeeded(horovodrun(2, ["main.py", *MODEL, *TWO_LABELS, *PLACEMENT, f"--log_path={tmp_path / 'two.json'}"]))
    want, got = steps(log), steps(tmp_path / "two.json")
    assert sorted(got) == sorted(want)
    for s in want:
        assert got[s] == pytest.approx(want[s], rel=1e-5, abs=1e-6), s
    a, b = last_eval(tmp_path / "two.json"), last_eval(log)
    assert a["samples"] == b["samples"] == 500
    for h in HEADS:
        for m in ("auc", "logloss"):
            assert a[f"{h}_{m}"] == pytest.approx(b[f"{h}_{m}"], rel=1e-5, abs=1e-6), (h, m)


def two_label_spec(path):
    """Two labels click and rating, named features, a multi-hot one; written with generate()."""
    spec = split_binary_spec(["age", "hour"], {"user": 60, "item": 40, "genres": 12}, ["click", "rating"],
                             max_hotness={"genres": 3}, numerical_dtype="float32", base_dir=str(path))
    generate(spec, 96 * 8, 300, seed=3, alpha=1.1)
    return spec


def test_a_split_binary_spec_with_two_labels_round_trips(tmp_path):
    """Written, read back: labels [n, 2] in the spec's order, SyntheticDataset's two labels; the same
    from split TFRecords; a one-label spec is written as before (one chunk, label.bin)."""
    spec = two_label_spec(tmp_path / "data")
    read = FeatureSpec.from_yaml(str(tmp_path / "data" / SPEC_FILE))
    assert read.labels == ["click", "rating"] and read.label == "click"
    assert [c.files for c in read.mapping("train") if c.features == ["click", "rating"]] == [["train/label.bin"]]
    files = SplitBinaryDataset(read, {"train": "train", "eval": "test"})
    assert files.label_names == ["click", "rating"]
    truth = SyntheticDataset(read.cardinalities, 2, 1.1, 3, labels=2)
    got, want = files.batch("eval", 10, 50), truth.batch("eval", 10, 50)
    assert got["labels"].shape == (50, 2) and np.array_equal(got["labels"], want["labels"])
    assert got["labels"][:, 0].tolist() != got["labels"][:, 1].tolist()
    convert(read, str(tmp_path / "tfrecords"), ["train", "test"], 32, 0)
    records = open_split_tfrecords(str(tmp_path / "tfrecords" / SPEC_FILE), {"eval": "test"})
    assert np.array_equal(records.batch("eval", 0, 96)["labels"], files.batch("eval", 0, 96)["labels"])
    one = split_binary_spec(["age"], {"user": 60}).to_dict()
    assert one["channel_spec"]["label"] == ["label"] and one["feature_spec"]["label"] == {"dtype": "bool"}
    assert one["source_spec"]["train"][1] == {"type": "split_binary", "features": ["label"],
                                              "files": ["train/label.bin"]}
    empty = dict(one, channel_spec=dict(one["channel_spec"], label=[]))
    with pytest.raises(Exception, match="channel_spec.label: must not be empty"):
        FeatureSpec.from_dict(empty)


def test_two_label_model_on_a_two_label_feature_spec(tmp_path):
    """Its heads are named as the spec's labels (click, rating) and each evaluated."""
    two_label_spec(tmp_path / "data")
    out = succeeded(python(*MODEL, *FILE_DATA, f"--dataset_path={tmp_path / 'data'}",
                           f"--log_path={tmp_path / 'log.json'}"))
    assert " | click loss " in out.stdout and " | rating loss " in out.stdout
    final = last_eval(tmp_path / "log.json")
    assert final["samples"] == 300 and 0.0 < final["click_auc"] < 1.0 and 0.0 < final["rating_auc"] < 1.0


ONE_OUTPUT = ("import keras, ranking\n\ndef build_model(features, hparams):\n"
              "    x = features.inputs()\n"
              "    e = features.embedding(features.feature_configs(4))([x[f.name] for f in features])\n"
              "    h = keras.layers.Concatenate(name='c')(e)\n"
              "    return ranking.Model(x, keras.layers.Dense(1, name='out')(h))\n")

# A subclassed model (its heads known after a forward) with heads named otherwise than the labels.
CLICK_RATING = ("import keras, ranking\n\nclass M(ranking.Model):\n"
                "    def __init__(self, features):\n"
                "        super().__init__(name='m')\n"
                "        self.names = features.names\n"
                "        self.emb = features.embedding(features.feature_configs(4))\n"
                "        self.click = keras.layers.Dense(1, name='click')\n"
                "        self.rating = keras.layers.Dense(1, name='rating')\n"
                "    def call(self, x, training=False):\n"
                "        h = keras.ops.concatenate(self.emb([x[n] for n in self.names]), axis=1)\n"
                "        return {'click': self.click(h), 'rating': self.rating(h)}\n\n"
                "def build_model(features, hparams):\n"
                "    return M(features)\n")


def test_heads_and_labels_that_do_not_match_are_one_line(tmp_path):
    assert error_line(python(*MODEL, *DATA)) == (   # on one label its heads are click and rating
        "error: --model=examples/two_label.py: build_model: the model has heads (click, rating); the data have one "
        "label (label): give one logit per sample, or train on data with a label per head (a feature spec's label "
        "channel, --synthetic_labels)")
    (tmp_path / "click_rating.py").write_text(CLICK_RATING)
    assert error_line(python(f"--model={tmp_path / 'click_rating.py'}", *TWO_LABELS)) == (
        f"error: --model={tmp_path / 'click_rating.py'}: build_model: the model's heads (click, rating) are not the "
        "data's labels (label, label_1): give a head per label, named as it (features.labels)")
    (tmp_path / "one.py").write_text(ONE_OUTPUT)
    assert error_line(python(f"--model={tmp_path / 'one.py'}", *TWO_LABELS)) == (
        f"error: --model={tmp_path / 'one.py'}: build_model: the model gives one output; the data have labels "
        "label, label_1: give a head per label, named as it (a dict of outputs by features.labels)")
    assert error_line(python(*TWO_LABELS, "--embedding_dim=8", "--bottom_mlp_dims=16,8", script="dlrm.py")) == (
        "error: the data have 2 labels (label, label_1); the built-in DLRM/DCNv2 learn one: train a model with a "
        "head per label with --model=FILE (docs/models.md)")
    assert error_line(python(*TWO_LABELS, "--synthetic_labels=0", *MODEL)) == \
        "error: --synthetic_labels must be positive, got 0"
    two_label_spec(tmp_path / "data")
    assert error_line(python(*FILE_DATA, f"--dataset_path={tmp_path / 'data'}", "--synthetic_labels=2")) == (
        "error: --synthetic_labels only applies with --dataset_type=synthetic; remove it or change that flag")


# examples/two_label.py's compile_args: label by binary cross-entropy, label_1 by mean squared error at weight 0.5
MSE_HEAD = [*MODEL, "--model_param=second_loss=mean_squared_error", "--model_param=second_weight=0.5"]


def bce(labels, logits) -> float:
    return float(np.mean(np.maximum(logits, 0) - logits * labels + np.log1p(np.exp(-np.abs(logits)))))


def test_a_loss_and_a_weight_per_head_from_the_model_file_against_numpy():
    """One step's losses are a NumPy reference's on the model's outputs before it (binary
    cross-entropy, mean squared error, their sum weighted 1 and 0.5); the evaluation gives label_1
    its RMSE (no AUC) and label its AUC, each equal to NumPy's of the same predictions."""
    from run.loop import Run
    values = {"dataset_type": "synthetic", "synthetic_cardinalities": ["300", "50", "7", "30"],
              "synthetic_num_numerical": 3, "synthetic_eval_rows": 500, "valid_batch_size": 300, "seed": 7,
              "synthetic_labels": 2, "model": "examples/two_label.py", "optimizer": "adam", "learning_rate": 0.01,
              "model_param": ["embedding_dim=4", "hidden=[16,8]", "head=[8]", "second_loss=mean_squared_error",
                              "second_weight=0.5"]}
    run = Run(build_config(dict(TINY, **values), set(values)))
    try:
        numerical, categorical, y, _, _ = next(iter(run._eval_data()))
        before, y = run.trainer.predict(numerical, categorical).numpy(), y.numpy()
        got = {k: float(v) for k, v in run.trainer.train_step(numerical, categorical, y).items()}
        want = {"label_loss": bce(y[:, 0], before[:, 0]), "label_1_loss": float(np.mean((before[:, 1] - y[:, 1]) ** 2))}
        want["loss"] = want["label_loss"] + 0.5 * want["label_1_loss"]
        assert got == pytest.approx(want, rel=1e-5)
        metrics = run.evaluate(1)
        after, labels = eval_outputs(run)
    finally:
        run.model.embeddings.close()
    assert after.shape == (500, 2)
    assert metrics["label_1_rmse"] == pytest.approx(np.sqrt(np.mean((after[:, 1] - labels[:, 1]) ** 2)), rel=1e-9)
    assert "label_1_auc" not in metrics and "label_1_logloss" not in metrics
    assert metrics["auc"] == metrics["label_auc"] == pytest.approx(numpy_auc(labels[:, 0], after[:, 0]), abs=1e-12)


FOCAL = ONE_OUTPUT + ("\n\ndef compile_args(features, hparams):\n"
                      "    return {'loss': keras.losses.BinaryFocalCrossentropy(from_logits=True, gamma=2.0)}\n")


def focal(labels, logits, gamma=2.0, alpha=0.25) -> float:
    """Keras' binary focal cross-entropy (no class balancing) on logits."""
    p = 1 / (1 + np.exp(-logits))
    p_t = np.where(labels == 1, p, 1 - p)
    return float(np.mean((1 - p_t) ** gamma * -np.log(p_t)))


@pytest.mark.parametrize("loss", ["focal", "huber"])
def test_any_keras_loss_of_a_logit_or_a_value_trains_under_main_py(tmp_path, loss):
    """A head's loss beyond cross-entropy and MSE: binary focal cross-entropy on a logit (one
    output, evaluated by AUC) or Huber on a value (label_1 of examples/two_label.py, by RMSE);
    one step's loss equals NumPy's on the outputs before it."""
    from run.loop import Run
    (tmp_path / "focal.py").write_text(FOCAL)
    values = {"dataset_type": "synthetic", "synthetic_cardinalities": ["300", "50", "7", "30"],
              "synthetic_num_numerical": 3, "synthetic_eval_rows": 500, "valid_batch_size": 300, "seed": 7,
              "optimizer": "adam", "learning_rate": 0.01, "model_param": []}
    values.update({"model": str(tmp_path / "focal.py")} if loss == "focal" else {
        "model": "examples/two_label.py", "synthetic_labels": 2,
        "model_param": ["embedding_dim=4", "hidden=[16,8]", "head=[8]", "second_loss=huber"]})
    run = Run(build_config(dict(TINY, **values), set(values)))
    try:
        numerical, categorical, y, _, _ = next(iter(run._eval_data()))
        before, y = run.trainer.predict(numerical, categorical).numpy(), y.numpy()
        step = run.trainer.train_step(numerical, categorical, y)   # its loss, or by head with the loss
        got = float(step["loss"] if isinstance(step, dict) else step)
        metrics = run.evaluate(1)
    finally:
        run.model.embeddings.close()
    if loss == "focal":
        assert got == pytest.approx(focal(y.reshape(-1), before.reshape(-1)), rel=1e-5)
        assert 0.0 < metrics["auc"] < 1.0
    else:
        error = before[:, 1] - y[:, 1]
        huber = np.where(np.abs(error) <= 1, 0.5 * error ** 2, np.abs(error) - 0.5)
        assert got == pytest.approx(bce(y[:, 0], before[:, 0]) + float(np.mean(huber)), rel=1e-5)
        assert "label_1_auc" not in metrics and metrics["label_1_rmse"] > 0


METRICS = ONE_OUTPUT + ("\n\ndef compile_args(features, hparams):\n"
                        "    return {'metrics': hparams.get('metrics', ['mae', keras.metrics.BinaryAccuracy("
                        "name='accuracy', threshold=0.0)])}\n")


def test_compile_args_metrics_are_evaluated_over_every_sample_and_printed(tmp_path, capsys):
    """Keras metrics (a name, an object) from the model file's compile_args: each evaluation's
    figures over all samples, NumPy's of the same outputs, in its line and log; a metric that is
    not Keras' is one line."""
    from run.loop import Run
    (tmp_path / "metrics.py").write_text(METRICS)
    values = {"dataset_type": "synthetic", "synthetic_cardinalities": ["300", "50", "7", "30"],
              "synthetic_num_numerical": 3, "synthetic_eval_rows": 500, "valid_batch_size": 300, "seed": 7,
              "model": str(tmp_path / "metrics.py"), "model_param": []}
    run = Run(build_config(dict(TINY, **values), set(values)))
    try:
        metrics = run.evaluate(0)
        logits, labels = eval_outputs(run)
    finally:
        run.model.embeddings.close()
    logits, labels = logits.reshape(-1), labels.reshape(-1)
    assert metrics["mae"] == pytest.approx(np.mean(np.abs(logits - labels)), rel=1e-5)
    assert metrics["accuracy"] == pytest.approx(np.mean((logits > 0) == (labels > 0.5)), abs=1e-6)
    line = [l for l in capsys.readouterr().out.splitlines() if l.startswith("eval at step 0")][0]
    assert f" | mae {metrics['mae']:.5f} | accuracy {metrics['accuracy']:.5f} | 500 samples" in line
    values["model_param"] = ["metrics=[nope]"]
    with pytest.raises(ConfigError) as info:
        Run(build_config(dict(TINY, **values), set(values)))
    assert str(info.value) == f"--model={tmp_path / 'metrics.py'}: compile_args: metric 'nope' is not a Keras metric"


@pytest.fixture(scope="module")
def value_head(tmp_path_factory):
    """MSE_HEAD trained on two synthetic labels and exported (monolithic and tables form, model m):
    (the run, its log, its checkpoint, the export, main.py --mode=eval's figures of the checkpoint)."""
    from run.loop import Run
    path = tmp_path_factory.mktemp("value_head")
    out = succeeded(python(*MSE_HEAD, *TWO_LABELS, f"--save_checkpoint_path={path / 'ckpt'}",
                           f"--log_path={path / 'log.json'}"))
    succeeded(python(f"--checkpoint={path / 'ckpt'}", f"--output={path / 'repo'}", "--model_name=m",
                     "--model=examples/two_label.py", "--forms=monolithic,tables", script="deployment/deploy.py"))
    values = {"mode": "eval", "dataset_type": "synthetic", "synthetic_cardinalities": ["300", "50", "7", "30"],
              "synthetic_num_numerical": 3, "synthetic_eval_rows": 500, "valid_batch_size": 300, "seed": 7,
              "synthetic_labels": 2, "model": "examples/two_label.py", "restore_checkpoint_path": str(path / "ckpt"),
              "model_param": [p.split("=", 1)[1] for p in MSE_HEAD if p.startswith("--model_param=")]}
    run = Run(build_config(dict(TINY, **values), set(values)))
    try:
        offline = run.evaluate(run.start_step)
    finally:
        run.model.embeddings.close()
    return out, path / "log.json", path / "ckpt", path / "repo", offline


def test_the_losses_per_head_in_the_progress_line_json_log_and_evaluation(value_head):
    out, log, _, _, _ = value_head
    assert " | label loss " in out.stdout and " | label_1 loss " in out.stdout
    assert [line for line in out.stdout.splitlines() if line.startswith("eval at step")][-1].split(" | ")[:-1] == [
        f"eval at step {STEPS}: label_auc {last_eval(log)['label_auc']:.5f}",
        f"label_logloss {last_eval(log)['label_logloss']:.5f}",
        f"label_oracle_auc {last_eval(log)['label_oracle_auc']:.5f}",
        f"label_1_rmse {last_eval(log)['label_1_rmse']:.5f}"]
    for loss, label, label_1 in steps(log).values():
        assert loss == pytest.approx(label + 0.5 * label_1, rel=1e-6)


EVAL_DATA = ["--dataset_type=synthetic", "--synthetic_cardinalities=300,50,7,30", "--synthetic_num_numerical=3",
             "--synthetic_eval_rows=500", "--seed=7", "--model_name=m", "--batch_size=200"]


@pytest.mark.parametrize("frontend,protocol", [("native", "grpc"), ("triton", "http")])
def test_evaluate_accuracy_scores_each_served_head_as_the_in_process_evaluation(value_head, frontend, protocol,
                                                                                tmp_path):
    """Each head by its metric (label: AUC and logloss; label_1, trained with mean squared error:
    RMSE) within 1e-6 of main.py --mode=eval's of the checkpoint; a model with heads evaluated
    without its export, or on data whose labels are not its heads, is one line."""
    _, _, _, repo, offline = value_head
    log, ports = tmp_path / "server.log", free_ports(3)
    server = start_server(log, ports, f"--model_repository={repo}", f"--frontend={frontend}")
    try:
        url = f"--url=localhost:{ports[0 if protocol == 'http' else 1]}"
        result = script("evaluate_accuracy.py", *EVAL_DATA, "--synthetic_labels=2", f"--model_repository={repo}",
                        f"--protocol={protocol}", url, "--wait_s=120", f"--output_json={tmp_path / 'm.json'}")
        assert result.returncode == 0, result.stderr[-3000:]
        errors = [] if frontend != "native" else [
            script("evaluate_accuracy.py", *EVAL_DATA, "--synthetic_labels=2", f"--protocol={protocol}", url),
            script("evaluate_accuracy.py", *EVAL_DATA, f"--model_repository={repo}", f"--protocol={protocol}", url)]
    finally:
        stop_server(server, ports, log)
    served = json.loads((tmp_path / "m.json").read_text())
    assert served["samples"] == offline["samples"] == 500
    figures = ("label_auc", "label_logloss", "label_1_rmse", "auc", "logloss")
    assert served.keys() - {"seconds", "samples_per_s"} == set(figures) | {"samples"}
    for k in figures:
        assert served[k] == pytest.approx(offline[k], abs=1e-6), k
    assert f"served m over {protocol}: label_auc {offline['label_auc']:.5f} | label_logloss " \
           f"{offline['label_logloss']:.5f} | label_1_rmse {offline['label_1_rmse']:.5f} | 500 samples" in result.stdout
    assert [error_line(e) for e in errors] == ([] if frontend != "native" else [
        "error: model 'm' gives 2 outputs a sample (heads): name its export with --model_repository (its export.json "
        "names the heads and how each is scored)",
        "error: model 'm''s heads (label, label_1) are not the data's labels (label): evaluate it on data with a label "
        "per head, named as it"])


ONE_VALUE = ONE_OUTPUT + "\n\ndef compile_args(features, hparams):\n    return {'loss': 'mean_squared_error'}\n"


@pytest.mark.slow
def test_a_one_output_regression_model_and_the_refusals(tmp_path):
    (tmp_path / "value.py").write_text(ONE_VALUE)
    value = [f"--model={tmp_path / 'value.py'}", *DATA]
    out = succeeded(python(*value, f"--log_path={tmp_path / 'log.json'}", f"--save_checkpoint_path={tmp_path / 'c'}"))
    final = last_eval(tmp_path / "log.json")
    assert final["auc"] is None and 0.0 < final["rmse"] < 1.0
    assert f"eval at step {STEPS}: rmse {final['rmse']:.5f} | 500 samples" in out.stdout
    # exported (export.json: layout.values [0]) and served, evaluate_accuracy.py scores its output by RMSE
    succeeded(python(f"--checkpoint={tmp_path / 'c'}", f"--output={tmp_path / 'repo'}", "--model_name=m",
                     f"--model={tmp_path / 'value.py'}", "--forms=monolithic", script="deployment/deploy.py"))
    assert json.loads((tmp_path / "repo" / "export.json").read_text())["layout"]["values"] == [0]
    log, ports = tmp_path / "server.log", free_ports(3)
    server = start_server(log, ports, f"--model_repository={tmp_path / 'repo'}", "--frontend=native")
    try:
        served = script("evaluate_accuracy.py", *EVAL_DATA, f"--model_repository={tmp_path / 'repo'}",
                        f"--url=localhost:{ports[0]}", "--wait_s=120", f"--output_json={tmp_path / 'm.json'}")
        assert served.returncode == 0, served.stderr[-3000:]
    finally:
        stop_server(server, ports, log)
    figures = json.loads((tmp_path / "m.json").read_text())
    assert figures["auc"] is None and figures["rmse"] == pytest.approx(final["rmse"], abs=1e-6)
    assert f"served m over http: rmse {final['rmse']:.5f} | 500 samples" in served.stdout
    assert error_line(python(*value, "--keep_best_checkpoint", f"--save_checkpoint_path={tmp_path / 'ckpt'}")) == (
        f"error: --keep_best_checkpoint chooses by an output's auc; --model={tmp_path / 'value.py'} evaluates no "
        "output by AUC and logloss (its compile_args trains each as a value, evaluated by RMSE)")
    assert error_line(python(*MODEL, *TWO_LABELS, "--model_param=second_loss=binary_crossentropy")) == (
        "error: --model=examples/two_label.py: compile_args: the loss of head 'label_1' is 'binary_crossentropy', on "
        "probabilities (from_logits=False); the model gives logits: a logit of a binary label "
        "('binary_crossentropy_from_logits', keras.losses.BinaryFocalCrossentropy(from_logits=True), Hinge: "
        "evaluated by AUC) or a value ('mse', 'mae', Huber, ...: by RMSE)")
    (tmp_path / "optimizer.py").write_text(ONE_OUTPUT + "\n\ndef compile_args(features, hparams):\n"
                                           "    return {'optimizer': 'sgd'}\n")
    assert error_line(python(f"--model={tmp_path / 'optimizer.py'}", *DATA)) == (
        f"error: --model={tmp_path / 'optimizer.py'}: compile_args gives 'optimizer'; it chooses compile's loss, "
        "loss_weights and metrics (the optimizer, learning rate, XLA and loss scale are the run's flags)")
