"""ranking/ (the Keras 3 API): a functional Keras model over HybridEmbedding, trained by Keras'
fit through ranking.Model's step, equals the earlier built-in trainer on the same batches
(its steps, recorded: tests/support/recorded.py); the configuration's errors; Keras'
variable tracking; a subclassed model with Keras' layers."""
import json

import keras
import numpy as np
import pytest
import tensorflow as tf

from dataloading.synthetic import SyntheticDataset
from nn.mlp import dense_initial_values
from parallel_embedding.collectives import SingleProcess
from ranking import DynamicOptions, FeatureConfig, HybridEmbedding, Model, TableConfig, TableStorage
from storage import checkpoint
from tests.support.horovod_run import horovodrun
from tests.support.multi_hot import multi_hot_ids
from tests.support.recorded import assert_as_recorded, assert_values_as_recorded, model_state, recorded
from tests.support.references import pairwise_auc
from utils.errors import ConfigError, NonFiniteError

CARDS, DIMS, COMBINERS, HOTNESS = [40, 30, 20], [8, 4, 6], ["sum", "sum", "mean"], [1, 1, 3]
BOTTOM, TOP, B, STEPS = (8, 4), (16, 1), 32, 4
DATA = SyntheticDataset(CARDS, 3, 0.0, seed=5)


def batches():
    """STEPS batches (numerical [B, 3], ids per feature, labels [B]); feature 2 multi-hot (ragged)."""
    out = []
    for step in range(STEPS):
        b = DATA.batch("train", step * B, B)
        ids = [tf.constant(c) for c in b["categorical"]]
        ids[2] = tf.cast(multi_hot_ids(CARDS[2], HOTNESS[2], 2, step * B, B), tf.int32)
        out.append((tf.constant(b["numerical"]), ids, tf.constant(b["labels"])))
    return out


def features():
    return [FeatureConfig(name=f"f{f}", table=TableConfig(name=f"t{f}", vocabulary_size=c, embedding_dim=d,
                                                          combiner=k),
                          input_shape=(None, h) if h > 1 else (None,), output_shape=(None, d))
            for f, (c, d, k, h) in enumerate(zip(CARDS, DIMS, COMBINERS, HOTNESS))]


def seeded_as_the_builtin(bottom, top):
    """Gives the Keras Dense layers `bottom` and `top` (built) the initial weights of the built-in
    model's MLPs seeded 3 (nn.layers.MLP: the bottom MLP (3, 0), the top MLP (3, 100))."""
    for layers, seed in ((bottom, (3, 0)), (top, (3, 100))):
        for i, layer in enumerate(layers):
            kernel, bias = dense_initial_values(layer.kernel.shape[0], layer.kernel.shape[1], i, seed)
            layer.kernel.assign(kernel)
            layer.bias.assign(bias)


def builtin_name(path: str) -> str:
    """The built-in model's name of keras_model's weight `path` ("top_1/kernel": "top_mlp/dense_1/kernel")."""
    layer, weight = path.split("/")
    kind, index = layer.split("_")
    return f"{kind}_mlp/dense_{index}/{weight}"


def keras_model():
    """DCNv2 without cross layers (concat(bottom MLP, embeddings) -> top MLP, as the earlier
    built-in model (seed 3) with interaction "cross" and no cross layers) written with Keras' layers
    over HybridEmbedding, with the built-in model's initial weights."""
    numerical = keras.Input((3,), name="numerical")
    ids = [keras.Input((None,), dtype="int32", ragged=True, name=f"f{f}") if h > 1 else
           keras.Input((), dtype="int32", name=f"f{f}") for f, h in enumerate(HOTNESS)]
    embedded = HybridEmbedding(features(), seed=(3, 1000))(ids)
    x = numerical
    bottom = [keras.layers.Dense(w, activation="relu", name=f"bottom_{i}") for i, w in enumerate(BOTTOM)]
    for layer in bottom:
        x = layer(x)
    x = keras.layers.Concatenate()([x] + embedded)
    top = [keras.layers.Dense(w, activation="relu" if i < len(TOP) - 1 else None, name=f"top_{i}")
           for i, w in enumerate(TOP)]
    for layer in top:
        x = layer(x)
    model = Model([numerical] + ids, x)
    seeded_as_the_builtin(bottom, top)
    return model


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
def test_fit_equals_the_builtin_trainer(optimizer):
    """The built-in trainer's losses, tables and dense weights on these batches, bit for bit (recorded;
    tests/support/recorded.py says where)."""
    data = batches()
    want = recorded("ranking_api")
    model = keras_model()
    # same seed: the same tables; the built-in model's initial dense weights
    assert_as_recorded(model_state(model, builtin_name), want["initial"], "initial")
    model.compile(optimizer=optimizer, learning_rate=0.1)
    got_losses = [model.train_on_batch((n,) + tuple(ids), labels, return_dict=True)["loss"] for n, ids, labels in data]
    assert_values_as_recorded(got_losses, want[optimizer]["losses"], "losses")   # as the tables and weights
    assert_as_recorded(model_state(model, builtin_name), want[optimizer]["final"], f"after {STEPS} steps", trained=True)
    assert int(model.global_step.numpy()) == STEPS


def test_fit_on_tf_data_trains_like_train_on_batch():
    """Keras' fit over a tf.data of the same batches (ragged ids included) takes the same steps."""
    data = batches()
    model_a, model_b = keras_model(), keras_model()
    for m in (model_a, model_b):
        m.compile(optimizer="adagrad", learning_rate=0.1)
    for n, ids, labels in data:
        model_a.train_on_batch((n,) + tuple(ids), labels)
    dataset = tf.data.Dataset.from_tensor_slices(
        ((tf.concat([n for n, _, _ in data], 0),) + tuple(
            tf.concat([ids[f] for _, ids, _ in data], 0) for f in range(len(CARDS))),
         tf.concat([labels for _, _, labels in data], 0))).batch(B)
    history = model_b.fit(dataset, epochs=1, verbose=0, shuffle=False)
    assert len(history.history["loss"]) == 1
    for a, b in zip(model_a.get_layer("hybrid_embedding").table_variables,
                    model_b.get_layer("hybrid_embedding").table_variables):
        np.testing.assert_array_equal(b.numpy(), a.numpy())
    for a, b in zip(model_a.dense_variables, model_b.dense_variables):
        np.testing.assert_array_equal(b.numpy(), a.numpy())
    assert model_b.predict(dataset, verbose=0).shape == (STEPS * B, 1)


def state(model) -> list:
    return [v.numpy() for v in model.get_layer("hybrid_embedding").table_variables + model.dense_variables]


def test_fit_weighs_each_sample_as_keras():
    """A sample's loss times its weight, summed over the batch and divided by its size (Keras'
    "sum_over_batch_size"): SGD with weights 1 on the first half of each batch and 0 on the
    other takes the steps of SGD at half the learning rate on the first halves alone (the tables'
    rows too: the others get no gradient), its loss is half theirs, compile's weighted metric (a
    weighted mean) theirs, its unweighted metric that of every sample (as Keras); all-zero
    weights change nothing. evaluate refuses weighted data, compile a loss reduced
    otherwise, in one line."""
    data = batches()
    weighted, half = keras_model(), keras_model()
    weighted.compile(optimizer="sgd", learning_rate=0.1, weighted_metrics=[keras.metrics.MeanSquaredError(name="mse")],
                     metrics=[keras.metrics.MeanAbsoluteError(name="mae")])
    half.compile(optimizer="sgd", learning_rate=0.05, metrics=[keras.metrics.MeanSquaredError(name="mse")])
    w = tf.constant([1.0] * (B // 2) + [0.0] * (B // 2))
    for n, ids, labels in data:
        mae = np.mean(np.abs(labels.numpy() - weighted.predict_on_batch((n,) + tuple(ids))[:, 0]))
        got = weighted.train_on_batch((n,) + tuple(ids), labels, sample_weight=w, return_dict=True)
        want = half.train_on_batch((n[:B // 2],) + tuple(i[:B // 2] for i in ids), labels[:B // 2], return_dict=True)
        np.testing.assert_allclose(got["loss"], want["loss"] / 2, rtol=1e-6)
        np.testing.assert_allclose(got["mse"], want["mse"], rtol=1e-5)   # Keras' weighted mean
        np.testing.assert_allclose(got["mae"], mae, rtol=1e-5)
    for a, b in zip(state(weighted), state(half)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    zero = keras_model()
    zero.compile(optimizer="sgd", learning_rate=0.1)
    before = state(zero)
    dataset = tf.data.Dataset.from_tensors(((data[0][0],) + tuple(data[0][1]), data[0][2], tf.zeros([B])))
    assert zero.fit(dataset, verbose=0).history["loss"] == [0.0]
    for a, b in zip(state(zero), before):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ConfigError) as info:
        zero.evaluate(dataset, verbose=0)
    assert str(info.value) == (f"evaluate: model {zero.name!r} weighs every sample alike (the exact AUC); its data "
                               "carry sample weights: give it (x, labels)")
    with pytest.raises(ConfigError) as info:
        keras_model().compile(loss=keras.losses.BinaryCrossentropy(from_logits=True, reduction="sum"))
    assert str(info.value) == ("compile: the loss has reduction 'sum'; the step takes the global batch's mean of "
                               "the samples' losses (Keras' 'sum_over_batch_size')")


def test_a_plain_keras_model_is_refused_at_its_first_step():
    """Keras' own fit never updates the tables (they are not Keras weights): one line at the first
    step, naming the layer; a forward in training outside a tape is only a forward."""
    inputs = [keras.Input((), dtype="int32", name=f"f{f}") for f in range(2)]
    embedded = HybridEmbedding(features()[:2], name="tables")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(1)(keras.layers.Concatenate()(embedded)))
    model.compile(optimizer="adam", loss=keras.losses.BinaryCrossentropy(from_logits=True))
    ids = [tf.constant([1, 2]), tf.constant([3, 4])]
    assert model(ids, training=True).shape == (2, 1)
    with pytest.raises(ConfigError) as info:
        model.fit(ids, tf.constant([0.0, 1.0]), verbose=0)
    assert str(info.value) == (
        "layer 'tables': called in training outside ranking.Model's step, the one that updates its tables (a plain "
        "keras.Model's fit or a GradientTape of your own never would): build the model as ranking.Model and train "
        "it with fit or train_on_batch (a loop of your own: ranking.dist_model_parallel)")


def test_evaluate_scores_a_regression_by_its_loss_and_an_auc_only_if_asked():
    """An output trained for a binary label (a cross-entropy, hinge: ranking.features.binary_loss, as main.py
    scores it) gets the exact AUC; a regression its loss, and an AUC only where a metric asks."""
    n, ids, labels = batches()[0]
    x = (n,) + tuple(ids)
    for loss, metrics, keys in (("binary_crossentropy_from_logits", None, {"loss", "auc"}),
                                (keras.losses.Hinge(), None, {"loss", "auc"}),   # a binary label's score too
                                ("mse", None, {"loss"}),
                                ("mse", [keras.metrics.AUC(name="auc")], {"loss", "auc"})):
        model = keras_model()
        model.compile(loss=loss, metrics=metrics)
        logs = model.evaluate(tf.data.Dataset.from_tensors((x, labels)), verbose=0, return_dict=True)
        assert set(logs) == keys, (loss, logs)
        if "auc" in keys:   # the exact AUC
            want = pairwise_auc(labels.numpy(), model.predict_on_batch(x)[:, 0])
            assert logs["auc"] == pytest.approx(want, abs=1e-6)


def test_keras_optimizer_objects_train_as_the_named_optimizers():
    """Keras' SGD, Adagrad and Adam objects (a learning-rate schedule too) take the steps of the
    step's optimizers of the same settings; another optimizer, or a setting the step does not
    take, is one line."""
    data = batches()

    def trained(**compiled):
        model = keras_model()
        model.compile(**compiled)
        for n, ids, labels in data[:2]:
            model.train_on_batch((n,) + tuple(ids), labels)
        return state(model)

    decay = keras.optimizers.schedules.ExponentialDecay(0.1, 1, 0.5)
    for given, want in ((keras.optimizers.Adam(0.05, beta_1=0.8), dict(optimizer="adam", learning_rate=0.05,
                                                                      beta_1=0.8)),
                        (keras.optimizers.Adagrad(0.1), dict(optimizer="adagrad", learning_rate=0.1)),
                        (keras.optimizers.SGD(decay), dict(optimizer="sgd", learning_rate=decay))):
        for a, b in zip(trained(optimizer=given), trained(**want)):
            np.testing.assert_array_equal(a, b)
    for given, message in (
            (keras.optimizers.SGD(0.1, momentum=0.9), "compile: SGD(momentum=0.9) is not the step's SGD, which takes "
                                                      "learning_rate only (its other settings at Keras' defaults)"),
            (keras.optimizers.Adam(amsgrad=True), "compile: Adam(amsgrad=True) is not the step's Adam, which takes "
                                                  "learning_rate, beta_1 and beta_2 only (its other settings at Keras' "
                                                  "defaults)"),
            (keras.optimizers.RMSprop(), "compile: the step updates the tables and weights by SGD, Adagrad or Adam; "
                                         "the optimizer is Keras' RMSprop")):
        with pytest.raises(ConfigError) as info:
            keras_model().compile(optimizer=given)
        assert str(info.value) == message
    with pytest.raises(ConfigError, match=r"^compile: the optimizer object has its learning rate; learning_rate=0.1 "
                                          r"gives it twice$"):
        keras_model().compile(optimizer=keras.optimizers.SGD(), learning_rate=0.1)


def test_tables_are_not_keras_weights():
    model = keras_model()
    emb = model.get_layer("hybrid_embedding")
    table_refs = {v.ref() for v in emb.table_variables}
    assert not table_refs & {v.value.ref() for v in model.trainable_variables}
    assert len(model.trainable_variables) == 2 * (len(BOTTOM) + len(TOP))
    assert emb.count_params() == sum(c * d for c, d in zip(CARDS, DIMS))
    names = [v.name for v in model.dense_variables]
    assert len(set(names)) == len(names)


def test_shared_table_and_dense_multi_hot():
    """Two features of one table look up the same rows; a dense [b, k] multi-hot input is k ids a sample."""
    genre = TableConfig(name="genre", vocabulary_size=20, embedding_dim=4, combiner="mean")
    item = TableConfig(name="item", vocabulary_size=50, embedding_dim=4, combiner="sum")
    layer = HybridEmbedding({
        "a": FeatureConfig(name="a", table=item, input_shape=(None, 1), output_shape=(None, 4)),
        "b": FeatureConfig(name="b", table=item, input_shape=(None,), output_shape=(None, 4)),
        "g": FeatureConfig(name="g", table=genre, input_shape=(None, 2), output_shape=(None, 4))}, seed=(1, 2))
    out = layer({"a": tf.constant([[3], [7]]), "b": tf.constant([7, 49]), "g": tf.constant([[1, 5], [2, 2]])})
    item_table, genre_table = [v.numpy() for v in layer.table_variables]
    assert len(layer.table_variables) == 2
    np.testing.assert_array_equal(out["a"].numpy(), item_table[[3, 7]])
    np.testing.assert_array_equal(out["b"].numpy(), item_table[[7, 49]])
    np.testing.assert_allclose(out["g"].numpy(), [(genre_table[1] + genre_table[5]) / 2, genre_table[2]], atol=1e-7)


def test_subclassed_model_with_keras_layers():
    """A subclassed ranking.Model with BatchNormalization, Dropout and Add trains with fit."""
    table = TableConfig(name="t", vocabulary_size=30, embedding_dim=8, combiner="sum")

    class TwoFeatures(Model):
        def __init__(self):
            super().__init__()
            self.emb = HybridEmbedding([FeatureConfig(name="u", table=table, input_shape=(None,),
                                                      output_shape=(None, 8)),
                                        FeatureConfig(name="v", table=table, input_shape=(None,),
                                                      output_shape=(None, 8))])
            self.norm = keras.layers.BatchNormalization()
            self.drop = keras.layers.Dropout(0.5)
            self.out = keras.layers.Dense(1)

        def call(self, inputs, training=False):
            u, v = self.emb(inputs)
            return self.out(self.drop(self.norm(keras.layers.Add()([u, v]), training=training), training=training))

    model = TwoFeatures()
    rng = np.random.default_rng(0)
    x = (rng.integers(0, 30, 64).astype(np.int32), rng.integers(0, 30, 64).astype(np.int32))
    y = (x[0] < 15).astype(np.float32)
    model(x)
    model.compile(optimizer="adam", learning_rate=0.05, metrics=[keras.metrics.AUC(from_logits=True, name="auc")])
    before = model.emb.table_variables[0].numpy().copy()
    moving = model.norm.moving_mean.numpy().copy()
    history = model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(16), epochs=5, verbose=0).history
    assert history["loss"][-1] < history["loss"][0]
    assert history["auc"][-1] > history["auc"][0]
    assert not np.array_equal(model.emb.table_variables[0].numpy(), before)
    assert not np.array_equal(model.norm.moving_mean.numpy(), moving)
    assert model.predict(x, batch_size=16, verbose=0).shape == (64, 1)


def test_a_branch_on_a_tensor_is_an_error_at_the_first_step_and_keras_ops_where_trains():
    """The step is traced without AutoGraph, as Keras traces it: `if` on a tensor's value is
    refused at the first step; the same choice written with keras.ops.where trains."""
    table = TableConfig(name="t", vocabulary_size=30, embedding_dim=4)

    class Branching(Model):
        def __init__(self, where):
            super().__init__()
            self.where = where
            self.emb = HybridEmbedding([FeatureConfig(name="u", table=table, input_shape=(None,),
                                                      output_shape=(None, 4))])
            self.out = keras.layers.Dense(1)

        def call(self, inputs, training=False):
            u = self.emb(inputs)[0]
            if self.where:
                return self.out(keras.ops.where(keras.ops.sum(u) > 0, u, -u))
            return self.out(u if keras.ops.sum(u) > 0 else -u)

    x = (np.arange(32, dtype=np.int32) % 30,)
    y = (x[0] < 15).astype(np.float32)
    for where in (False, True):
        model = Branching(where)
        model(x)   # eager: a tensor's value is a Python bool
        model.compile(optimizer="sgd", learning_rate=0.1)
        data = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
        if where:
            assert np.isfinite(model.fit(data, epochs=1, verbose=0).history["loss"][-1])
        else:
            with pytest.raises(TypeError, match="as a Python `bool` is not allowed"):
                model.fit(data, epochs=1, verbose=0)


def test_fit_stops_after_a_non_finite_step():
    model = keras_model()
    model.compile(optimizer="sgd", learning_rate=0.1)
    n, ids, labels = batches()[0]
    bad = tf.tensor_scatter_nd_update(labels, [[5]], [float("nan")])
    dataset = tf.data.Dataset.from_tensors(((n,) + tuple(ids), labels)).concatenate(
        tf.data.Dataset.from_tensors(((n,) + tuple(ids), bad))).repeat(2)
    with pytest.raises(NonFiniteError, match="step 2: non-finite"):
        model.fit(dataset, verbose=0)
    assert int(model.global_step.numpy()) == 2


def test_configuration_errors_name_what_is_wrong():
    t = TableConfig(name="t", vocabulary_size=10, embedding_dim=4)
    with pytest.raises(ConfigError, match="table 't': combiner"):
        TableConfig(name="t", vocabulary_size=10, embedding_dim=4, combiner="sqrtn")
    with pytest.raises(ConfigError, match="feature 'f': output_shape must be"):
        FeatureConfig(name="f", table=t, input_shape=(None,), output_shape=(None, 5))
    other = TableConfig(name="t", vocabulary_size=11, embedding_dim=4)
    with pytest.raises(ConfigError, match="table 't' is declared twice"):
        HybridEmbedding([FeatureConfig("a", t, (None,), (None, 4)), FeatureConfig("b", other, (None,), (None, 4))])
    layer = HybridEmbedding({"a": FeatureConfig("a", t, (None,), (None, 4))})
    with pytest.raises(ConfigError, match="feature 'a': missing"):
        layer({"b": tf.constant([1])})
    sgd = TableConfig(name="s", vocabulary_size=10, embedding_dim=4, optimizer="sgd")
    adam = TableConfig(name="a", vocabulary_size=10, embedding_dim=4, optimizer="adam")
    inp = [keras.Input((), dtype="int32"), keras.Input((), dtype="int32")]
    emb = HybridEmbedding([FeatureConfig("x", adam, (None,), (None, 4)), FeatureConfig("y", sgd, (None,), (None, 4))])
    model = Model(inp, keras.layers.Dense(1)(keras.layers.Concatenate()(emb(inp))))
    with pytest.raises(ConfigError, match="^table 's' of layer '[a-z_0-9]+': its optimizer is 'sgd', compile's is 'adam'; "
                                          "compile's updates every table"):
        model.compile(optimizer="adam")
    with pytest.raises(ConfigError, match="^table 'a' of layer .*: its optimizer is 'adam', compile's is 'sgd'"):
        model.compile(optimizer="sgd")
    drawn = TableConfig(name="d", vocabulary_size=8, embedding_dim=4, initializer="glorot_uniform",
                        dynamic=DynamicOptions(capacity=8))
    with pytest.raises(ConfigError, match="^table 'd': a Keras initializer draws a table whole in memory; a dynamic "
                                          "table starts from the project's initializer"):
        HybridEmbedding([FeatureConfig("a", drawn, (None,), (None, 4))])
    with pytest.raises(ConfigError, match="^table 'd': initializer must be None \\(the project's uniform\\), 'zeros' or a "
                                          "Keras initializer, got 'gaussian'"):
        TableConfig(name="d", vocabulary_size=8, embedding_dim=4, initializer="gaussian")


@pytest.mark.parametrize("features, heads", [("separate", "one_label"), ("shared", "one_label"),
                                            ("separate", "two_label"), ("sequence", "one_label")])
@pytest.mark.slow
def test_two_gloo_ranks_equal_one_process(tmp_path, features, heads):
    """tests/support/ranking_multirank_worker.py: row, column and replicated tables, one-hot and ragged
    multi-hot, each read by one feature or shared by two (weighted samples), one head or two (each
    head's loss), a sequence over each (DIN's attention over one); its checkpoint restores into one process;
    Keras' evaluate gives every rank the one process' figures, and the truncated ids their count."""
    out = horovodrun(2, ["tests/support/ranking_multirank_worker.py", str(tmp_path), features, heads])
    assert out.returncode == 0, f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    results = json.loads(next(l for l in out.stdout.splitlines() if "RESULT " in l).split("RESULT ", 1)[1])
    assert [r["rank"] for r in results] == [0, 1]
    assert results[0]["kinds"] == ["column", "replicated", "row"]
    assert all(r["max_error"] <= 1e-5 for r in results), results
    # Keras' evaluate: the same figures on every rank (each checked against one process by the worker)
    names = {"loss", "click_loss", "rating_loss", "click_auc", "rating_auc"} if heads == "two_label" \
        else {"loss", "auc"}
    assert set(results[0]["evaluate"]) == names
    assert results[0]["evaluate"] == results[1]["evaluate"]
    truncated = {f"hybrid_embedding/f{f}" for f in (3, 4, 5)} if features == "sequence" else set()
    assert set(results[0]["truncated"]) == truncated and all(r["truncated"] == results[0]["truncated"] for r in results)
    assert all(n["truncated"] > 0 for n in results[0]["truncated"].values())


def test_checkpoint_restores_and_training_continues(tmp_path):
    """Saved after two steps and restored into a fresh model, the next steps' losses and every
    tensor equal the uninterrupted model's (tables, slots, Keras weights, dense slots, step)."""
    data = batches()
    run, resumed = keras_model(), keras_model()
    for m in (run, resumed):
        m.compile(optimizer="adam", learning_rate=0.1)
    for n, ids, labels in data[:2]:
        run.train_on_batch((n,) + tuple(ids), labels)
    path = checkpoint.save(str(tmp_path), run.checkpoint_entries(), 2, {}, SingleProcess())
    assert run.checkpoint_names() == set(checkpoint.read_manifest(path)["tensors"])
    checkpoint.restore(path, resumed.checkpoint_entries(), {}, resumed.checkpoint_names())
    for n, ids, labels in data[2:]:
        want = run.train_on_batch((n,) + tuple(ids), labels, return_dict=True)["loss"]
        assert resumed.train_on_batch((n,) + tuple(ids), labels, return_dict=True)["loss"] == want
    got = {e.name: e.variable.numpy() for e in resumed.checkpoint_entries()}
    want = {e.name: e.variable.numpy() for e in run.checkpoint_entries()}
    assert got.keys() == want.keys() and "global_step" in got and "top_1/kernel/m" in got
    assert "table_optimizer/iterations" in got   # one layer: the name the built-in models' checkpoints have
    assert "hybrid_embedding_tables/table_2/v" in got
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_dense_part_exports_and_serves_the_models_logits(tmp_path):
    """The dense part (numerical + the embeddings' rows -> logit) as a SavedModel gives the model's logits."""
    model = keras_model()
    model.compile(optimizer="sgd", learning_rate=0.1)
    n, ids, labels = batches()[0]
    model.train_on_batch((n,) + tuple(ids), labels)
    dense = model.dense_part()
    assert [tuple(i.shape) for i in dense.inputs] == [(None, 3)] + [(None, d) for d in DIMS]
    assert len(dense.weights) == len(model.weights)
    dense.export(str(tmp_path / "dense"), verbose=False)
    loaded = tf.saved_model.load(str(tmp_path / "dense"))   # held: its variables live as long as it does
    served = loaded.serve([n] + model.get_layer("hybrid_embedding")(list(ids)))
    np.testing.assert_array_equal(served.numpy(), model((n,) + tuple(ids)).numpy())


def two_layer_model():
    """Two HybridEmbedding layers: "user_side" (a one-hot and a ragged multi-hot feature sharing
    table t) and "item_side" (its own table t, feature b), multiplied into a logit."""
    t = TableConfig(name="t", vocabulary_size=10, embedding_dim=4, combiner="sum")
    a, b = keras.Input((), dtype="int32", name="a"), keras.Input((), dtype="int32", name="b")
    c = keras.Input((None,), dtype="int32", ragged=True, name="c")
    ea, ec = HybridEmbedding([FeatureConfig("a", t, (None,), (None, 4)), FeatureConfig("c", t, (None, 3), (None, 4))],
                             name="user_side")([a, c])
    eb = HybridEmbedding([FeatureConfig("b", t, (None,), (None, 4))], name="item_side", seed=(0, 7))([b])[0]
    user = keras.layers.Add(name="user")([ea, ec])
    return Model([a, b, c], keras.layers.Dense(1, name="logit")(keras.layers.Multiply()([user, eb])))


def test_two_embedding_layers_train_checkpoint_and_restore(tmp_path):
    """Each layer's tables and table optimizer have their own checkpoint names; restored after two
    steps into a fresh model, the next steps' losses and every tensor equal the uninterrupted model's."""
    rng = np.random.default_rng(3)
    data = [((rng.integers(0, 10, 6).astype(np.int32), rng.integers(0, 10, 6).astype(np.int32),
              tf.ragged.constant([[1, 2], [], [3, 4, 5], [9], [0, 0], [7]], tf.int32)),
             rng.integers(0, 2, 6).astype(np.float32)) for _ in range(4)]
    run, resumed = two_layer_model(), two_layer_model()
    for m in (run, resumed):
        m.compile(optimizer="adam", learning_rate=0.1)
    before = [v.numpy().copy() for l in run.embedding_layers for v in l.table_variables]
    for x, labels in data[:2]:
        run.train_on_batch(x, labels)
    after = [v.numpy() for l in run.embedding_layers for v in l.table_variables]
    assert all(not np.array_equal(x, y) for x, y in zip(before, after))
    path = checkpoint.save(str(tmp_path), run.checkpoint_entries(), 2, {}, SingleProcess())
    names = run.checkpoint_names()
    assert names == set(checkpoint.read_manifest(path)["tensors"])
    assert {"user_side_tables/table_0/m", "item_side_tables/table_0/m", "user_side_table_optimizer/iterations",
            "item_side_table_optimizer/iterations"} <= names and "table_optimizer/iterations" not in names
    checkpoint.restore(path, resumed.checkpoint_entries(), {}, resumed.checkpoint_names())
    for x, labels in data[2:]:
        want = run.train_on_batch(x, labels, return_dict=True)["loss"]
        assert resumed.train_on_batch(x, labels, return_dict=True)["loss"] == want
    got = {e.name: e.variable.numpy() for e in resumed.checkpoint_entries()}
    for e in run.checkpoint_entries():
        np.testing.assert_array_equal(got[e.name], e.variable.numpy(), err_msg=e.name)


class _SameNames(Model):
    """Two HybridEmbedding layers named alike (a functional model refuses that itself)."""

    def __init__(self):
        super().__init__(name="same_names")
        t = TableConfig(name="t", vocabulary_size=10, embedding_dim=4)
        self.user = HybridEmbedding([FeatureConfig("a", t, (None,), (None, 4))], name="side")
        self.item = HybridEmbedding([FeatureConfig("b", t, (None,), (None, 4))], name="side")
        self.logit = keras.layers.Dense(1)

    def call(self, x):
        return self.logit(self.user([x[0]])[0] * self.item([x[1]])[0])


def test_two_embedding_layers_of_one_name_are_refused():
    with pytest.raises(ConfigError, match="model 'same_names': two HybridEmbedding layers are named 'side'"):
        _SameNames().compile(optimizer="sgd")


def test_storage_counts_compiles_optimizer_slots():
    """TableStorage's budget counts the optimizer's slots: compile with another optimizer is one line."""
    t = TableConfig(name="t", vocabulary_size=10, embedding_dim=4)
    inp = keras.Input((), dtype="int32")
    layer = HybridEmbedding([FeatureConfig("a", t, (None,), (None, 4))], storage=TableStorage(10 ** 6, 4, slots=2),
                            name="stored")
    model = Model(inp, keras.layers.Dense(1)(layer([inp])[0]))
    with pytest.raises(ConfigError, match="layer 'stored': its storage counts 2 optimizer slots per parameter, "
                                          "compile's 'adagrad' has 1"):
        model.compile(optimizer="adagrad")
