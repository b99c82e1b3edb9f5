"""nn/layers.py (the ranking/ API's building blocks): MLP, DotInteraction, CrossNetwork and
FactorizationMachine against NumPy and against nn/'s arithmetic on the same weights; the dot
interaction's op against TensorFlow's ops; DLRM written with the API equals the earlier
built-in trainer (its steps, recorded: tests/support/recorded.py); a
DeepFM-shaped model learns a pairwise interaction; inputs that cannot interact are one-line errors
naming the layer."""
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import nn.interaction as nn_interaction
from nn.interaction import dot_interaction_width
from nn.mlp import dense_initial_values, mlp_forward
from ranking import (CrossNetwork, DotInteraction, FactorizationMachine, FeatureConfig, HybridEmbedding, MLP, Model,
                     TableConfig)
from tests.support.recorded import assert_as_recorded, assert_values_as_recorded, model_state, recorded
from tests.support.references import numpy_cross, numpy_dot_interaction
from utils.errors import ConfigError
from tests.support.api_dlrm import B, CARDS, STEPS, api_dlrm, dlrm_batches


def numpy_mlp(x, kernels, biases, activation, linear_output):
    for i, (k, b) in enumerate(zip(kernels, biases)):
        x = x @ k + b
        if i < len(kernels) - 1 or not linear_output:
            x = activation(x)
    return x


def test_mlp_has_nn_mlps_weights_names_and_outputs():
    x = tf.constant(np.random.default_rng(0).standard_normal((6, 5)), tf.float32)
    for linear_output in (False, True):
        layer = MLP([16, 8, 3], linear_output=linear_output, seed=(4, 100), name="top_mlp")
        got = layer(x).numpy()
        kernels, biases = zip(*(dense_initial_values(n, w, i, (4, 100)) for i, (n, w) in
                                enumerate(zip([5, 16, 8], [16, 8, 3]))))
        paths = [f"top_mlp/dense_{i}/{n}" for i in range(3) for n in ("kernel", "bias")]
        assert [w.path for w in layer.weights] == paths
        for ours, theirs in zip(layer.kernels + layer.biases, kernels + biases):
            assert ours.path + ":0" == ours.value.name   # the tf.Variable's name (a checkpoint's)
            np.testing.assert_array_equal(ours.numpy(), theirs.numpy())
        np.testing.assert_array_equal(got, mlp_forward(x, kernels, biases, linear_output).numpy())
        reference = numpy_mlp(x.numpy().astype(np.float64), [k.numpy() for k in layer.kernels],
                              [b.numpy() for b in layer.biases], lambda v: np.maximum(v, 0), linear_output)
        np.testing.assert_allclose(got, reference, rtol=1e-5, atol=1e-5)
        assert (got.min() < 0) == linear_output
    tanh = MLP([4, 2], activation="tanh", seed=(1, 2))
    got = tanh(x).numpy()
    reference = numpy_mlp(x.numpy().astype(np.float64), [k.numpy() for k in tanh.kernels],
                          [b.numpy() for b in tanh.biases], np.tanh, False)
    np.testing.assert_allclose(got, reference, rtol=1e-5, atol=1e-6)
    clone = MLP.from_config(tanh.get_config())
    clone(x)
    for a, b in zip(tanh.weights, clone.weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


@pytest.mark.parametrize("batch,features,dim", [(1, 1, 1), (3, 8, 7), (5, 26, 16)])
def test_dot_interaction_is_nns_and_matches_numpy(batch, features, dim):
    rng = np.random.default_rng(batch + features + dim)
    bottom = tf.constant(rng.standard_normal((batch, dim)), tf.float32)
    embeddings = [tf.constant(rng.standard_normal((batch, dim)), tf.float32) for _ in range(features)]
    layer = DotInteraction()
    theirs = nn_interaction.DotInteraction(features, dim)
    for training in (False, True):
        got = layer([bottom] + embeddings, training=training).numpy()
        np.testing.assert_array_equal(got, theirs(bottom, embeddings, training=training).numpy())
        assert got.shape == (batch, dot_interaction_width(features, dim))
        np.testing.assert_allclose(got, numpy_dot_interaction(bottom.numpy(), [e.numpy() for e in embeddings]),
                                   rtol=1e-5, atol=1e-5)
    symbolic = DotInteraction()([keras.Input((dim,)) for _ in range(features + 1)])
    assert tuple(symbolic.shape) == (None, dot_interaction_width(features, dim))


def test_dot_interaction_op_gradients_equal_tensorflows():
    """In training the layer runs the custom op (kernel "auto" or "custom"), except inside an
    XLA-compiled function and in inference; its gradients equal TensorFlow's ops'."""
    op = pytest.importorskip("dot_based_interact")
    rng = np.random.default_rng(7)
    vectors = [tf.constant(rng.standard_normal((16, 8)), tf.float32) for _ in range(6)]
    upstream = tf.constant(rng.standard_normal((16, dot_interaction_width(5, 8))), tf.float32)
    results = {}
    for kernel in ("custom", "tf"):
        layer = DotInteraction(kernel=kernel)
        with tf.GradientTape() as tape:
            tape.watch(vectors)
            out = layer(vectors, training=True)
        results[kernel] = (out.numpy(), [g.numpy() for g in tape.gradient(out, vectors, output_gradients=upstream)])
        assert (layer._dot._op is op) == (kernel == "custom")
    np.testing.assert_allclose(results["custom"][0], results["tf"][0], rtol=1e-5, atol=1e-5)
    for got, want in zip(results["custom"][1], results["tf"][1]):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

    layer = DotInteraction()
    specs = [tf.TensorSpec([None, 8], tf.float32)] * 6

    def ops(training, **compile_options):
        fn = tf.function(lambda *v: layer(list(v), training=training), **compile_options)
        return {node.op for node in fn.get_concrete_function(*specs).graph.as_graph_def().node}
    assert "DotBasedInteract" in ops(True)
    assert "DotBasedInteract" not in ops(True, jit_compile=True) | ops(False)
    compiled = tf.function(lambda v: layer(v, training=True), jit_compile=True)(vectors)
    np.testing.assert_allclose(compiled.numpy(), results["tf"][0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("projection_dim", [0, 3])
def test_cross_network_is_nns_and_matches_numpy(projection_dim):
    rng = np.random.default_rng(projection_dim)
    parts = [tf.constant(rng.standard_normal((4, w)), tf.float32) for w in (4, 3, 3)]
    layer = CrossNetwork(3, projection_dim, seed=(3, 200), name="cross")
    layer(parts)
    initial = [nn_interaction.cross_initial_values(10, projection_dim, l, (3, 200)) for l in range(3)]
    ours = [w for group in layer.cross_layers for w in group.group]
    assert [w.path for w in ours] == [f"cross/layer_{l}/{n}" for l, mats in enumerate(initial)
                                      for n in [m for m, _ in mats] + ["bias"]]
    assert all(w.path + ":0" == w.value.name for w in ours)
    for ours_group, mats in zip(layer.cross_layers, initial):
        for w, (_, v) in zip(ours_group.group, mats):
            np.testing.assert_array_equal(w.numpy(), v.numpy())
        assert not ours_group.group[-1].numpy().any()
        b = tf.random.stateless_normal([10], seed=(1, len(ours_group.name)))   # non-zero biases, checked too
        ours_group.group[-1].assign(b)
    got = layer(parts).numpy()
    x0 = np.concatenate([p.numpy() for p in parts], axis=1)
    np.testing.assert_array_equal(got, nn_interaction.cross_forward(tf.constant(x0), layer.matrices,
                                                                    layer.biases).numpy())
    np.testing.assert_allclose(layer(tf.constant(x0)).numpy(), got, rtol=0, atol=0)
    want = numpy_cross(x0.astype(np.float64), [([m.numpy() for m in ms], b.numpy())
                                               for ms, b in zip(layer.matrices, layer.biases)])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    clone = CrossNetwork.from_config(CrossNetwork(2, projection_dim, seed=(5, 6)).get_config())
    assert clone.seed == (5, 6) and clone.num_layers == 2 and clone.projection_dim == projection_dim


def test_factorization_machine_matches_numpy():
    rng = np.random.default_rng(3)
    embeddings = [rng.standard_normal((5, 4)).astype(np.float32) for _ in range(4)]
    got = FactorizationMachine()([tf.constant(e) for e in embeddings]).numpy()
    e = np.stack(embeddings, 1).astype(np.float64)
    pairs = sum(np.sum(e[:, f] * e[:, g], axis=1) for f in range(4) for g in range(f))
    assert got.shape == (5, 1)
    np.testing.assert_allclose(got[:, 0], pairs, rtol=1e-5, atol=1e-5)
    one = FactorizationMachine()([tf.constant(embeddings[0])]).numpy()   # no pairs
    np.testing.assert_allclose(one, np.zeros((5, 1)), atol=1e-5)


class _BatchLosses(keras.callbacks.Callback):
    """Keras' running mean of the epoch's losses after each step."""

    def on_epoch_begin(self, epoch, logs=None):
        self.means = []

    def on_train_batch_end(self, batch, logs=None):
        self.means.append(float(logs["loss"]))


def running_means(losses):
    """What Keras' loss tracker (keras.metrics.Mean: a float32 total and count) shows after each
    of `losses`: the same float32 operations, so that a step's loss is compared bit for bit."""
    total, means = np.float32(0), []
    for k, loss in enumerate(losses):
        total = np.float32(total + np.float32(loss))
        means.append(float(total / np.float32(k + 1)))
    return means


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
def test_dlrm_written_with_the_api_equals_the_builtin(optimizer):
    data = dlrm_batches()
    want = recorded("ranking_layers")
    model = api_dlrm()
    assert {w.path for w in model.weights} == set(want["dense_entries"])
    assert_as_recorded(model_state(model), want["initial"], "initial")   # the same seeds: the same weights, tables
    assert model.get_layer("interaction").engine._op is nn_interaction.interaction_op("auto")   # --interaction=dot
    model.compile(optimizer=optimizer, learning_rate=0.1)
    assert sorted(e.name for e in model.checkpoint_entries(weights_only=True) if e.replicated) == want["dense_entries"]
    dataset = tf.data.Dataset.from_tensor_slices(
        ((tf.concat([n for n, _, _ in data], 0),) + tuple(
            tf.concat([ids[f] for _, ids, _ in data], 0) for f in range(len(CARDS))),
         tf.concat([labels for _, _, labels in data], 0))).batch(B)
    recorder = _BatchLosses()
    model.fit(dataset, epochs=1, verbose=0, shuffle=False, callbacks=[recorder])
    case = want[f"float32/{optimizer}"]
    assert_values_as_recorded(recorder.means, running_means(case["losses"]), "running means")   # as the weights
    assert_as_recorded(model_state(model), case["final"], f"after {STEPS} steps", trained=True)


def test_dlrm_dense_part_exports_without_the_op(tmp_path):
    """The dense part of the API's DLRM (trained with the op) exports as a SavedModel without it."""
    model = api_dlrm()
    model.compile(optimizer="sgd", learning_rate=0.1)
    n, ids, labels = dlrm_batches()[0]
    model.train_on_batch((n,) + tuple(ids), labels)
    model.dense_part().export(str(tmp_path / "dense"), verbose=False)
    with open(tmp_path / "dense" / "saved_model.pb", "rb") as f:
        assert b"DotBasedInteract" not in f.read()
    loaded = tf.saved_model.load(str(tmp_path / "dense"))
    served = loaded.serve([n] + model.get_layer("hybrid_embedding")(list(ids)))
    np.testing.assert_allclose(served.numpy(), model((n,) + tuple(ids)).numpy(), rtol=0, atol=1e-6)


def test_deepfm_shaped_model_learns_a_pairwise_interaction():
    """Width-1 embeddings summed (first order) + FM term + MLP over the concatenated embeddings,
    added: the loss falls where the label is an interaction of two features (no first-order signal)."""
    vocab, dim, n = 20, 8, 1024
    rng = np.random.default_rng(0)
    ids = [rng.integers(0, vocab, n).astype(np.int32) for _ in range(3)]
    labels = ((ids[0] < vocab // 2) == (ids[1] < vocab // 2)).astype(np.float32)
    features = []
    for f in range(3):
        for kind, width in (("wide", 1), ("deep", dim)):
            table = TableConfig(name=f"{kind}_{f}", vocabulary_size=vocab, embedding_dim=width, combiner="sum")
            features.append(FeatureConfig(name=f"{kind}_{f}", table=table, input_shape=(None,),
                                          output_shape=(None, width)))
    inputs = [keras.Input((), dtype="int32", name=f"f{f}") for f in range(3)]
    embedded = HybridEmbedding(features, seed=(0, 5))([x for x in inputs for _ in range(2)])
    wide, deep = embedded[0::2], embedded[1::2]
    first = keras.layers.Add(name="first_order")(wide)
    second = FactorizationMachine(name="fm")(deep)
    mlp = MLP([16, 1], linear_output=True, seed=(0, 7), name="deep_mlp")(keras.layers.Concatenate()(deep))
    model = Model(inputs, keras.layers.Add(name="logit")([first, second, mlp]))
    model.compile(optimizer="adam", learning_rate=0.02)
    history = model.fit(tf.data.Dataset.from_tensor_slices((tuple(ids), labels)).batch(128), epochs=8,
                        verbose=0, shuffle=False).history["loss"]
    assert history[0] > 0.6 and history[-1] < 0.35, history


def test_inputs_that_cannot_interact_are_one_line_errors(monkeypatch):
    table = lambda name, width: TableConfig(name=name, vocabulary_size=10, embedding_dim=width)   # noqa: E731
    features = [FeatureConfig("a", table("a", 4), (None,), (None, 4)), FeatureConfig("b", table("b", 6), (None,),
                                                                                      (None, 6))]
    ids = [keras.Input((), dtype="int32", name="a"), keras.Input((), dtype="int32", name="b")]
    a, b = HybridEmbedding(features)(ids)
    bottom = MLP([8], name="bottom_mlp")(keras.Input((3,)))
    cases = [(lambda: DotInteraction(name="interaction")([bottom, a]),
              "layer 'interaction': its inputs must have one width; input 0 (the bottom output) has width 8, "
              "input 1 has width 4"),
             (lambda: DotInteraction(name="interaction")([a, a, b]),
              "layer 'interaction': its inputs must have one width; input 0 (the bottom output) has width 4, "
              "input 2 has width 6"),
             (lambda: FactorizationMachine(name="fm")([a, b]),
              "layer 'fm': its inputs must have one width; input 0 (the first embedding) has width 4, "
              "input 1 has width 6"),
             (lambda: FactorizationMachine(name="fm")([]), "layer 'fm': takes a list of embeddings"),
             (lambda: DotInteraction(name="interaction")(a), "layer 'interaction': takes a list of vectors")]
    for build, message in cases:
        with pytest.raises(ConfigError) as error:
            build()
        assert str(error.value).startswith(message) and len(str(error.value).splitlines()) == 1
    monkeypatch.setitem(sys.modules, "dot_based_interact", None)    # the op library missing
    for cached in (nn_interaction._load_op, nn_interaction._warn_fallback):
        cached.cache_clear()
    try:
        with pytest.raises(ConfigError, match=r"^layer 'interaction' \(kernel='custom'\): the dot interaction op "
                                              r"cannot load .*; rebuild it with make setup, or use kernel='auto'$"):
            DotInteraction(kernel="custom", name="interaction")([a, a])
    finally:
        for cached in (nn_interaction._load_op, nn_interaction._warn_fallback):
            cached.cache_clear()


def test_mlp_and_cross_network_first_built_inside_a_traced_call_equal_eager_ones():
    """A subclassed model's layers are first built in its first (traced) call: their initial values
    are made eagerly all the same (they outlive the trace), equal to layers built eagerly."""
    class Sub(keras.Model):
        def __init__(self):
            super().__init__()
            self.cross, self.mlp = CrossNetwork(2, 2, seed=(1, 2)), MLP([4, 1], seed=(1, 3))

        def call(self, x):
            return self.mlp(self.cross(x))

    x = tf.constant(np.random.default_rng(0).normal(size=(5, 3)), tf.float32)
    traced, eager = Sub(), Sub()
    step = tf.function(lambda v: traced(v))
    got = [step(x), step(x)]
    want = eager(x)
    for g in got:
        np.testing.assert_array_equal(g.numpy(), want.numpy())
    assert len(traced.weights) == len(eager.weights) == 2 * 3 + 2 * 2   # cross: U, V, bias per layer
    for a, b in zip(traced.weights, eager.weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=a.path)
