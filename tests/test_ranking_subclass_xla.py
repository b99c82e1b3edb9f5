"""XLA for a subclassed ranking.Model (ranking/model.py): a subclass that writes its forward as
the halves embedding_call (its HybridEmbedding, outside XLA) and dense_call (XLA-compiled,
forward and backward) trains under compile(jit_compile=True) as without it and as the same
functional model, with Keras weights in either half; XLA compiles the dense ops, not the
lookups or updates; evaluation too; a subclass writing one half, or call and the halves, is
refused in one line."""
import keras
import numpy as np
import pytest
import tensorflow as tf

from ranking import DotInteraction, FeatureConfig, HybridEmbedding, MLP, Model, TableConfig
from tests.support.compiled import xla_compiled_ops
from tests.support.api_dlrm import BOTTOM, CARDS, DIM, HOTNESS, TOP, api_dlrm, dlrm_batches
from tests.support.api_steps import api_steps
from utils.errors import ConfigError


class HalvesDLRM(Model):
    """tests/test_ranking_layers.py's api_dlrm as a subclass written in halves; the bottom MLP in
    embedding_call (`bottom_first`: its weights trained through the part outside XLA) or in
    dense_call (the numericals passed through)."""

    def __init__(self, bottom_first: bool):
        super().__init__(name="halves_dlrm")
        features = [FeatureConfig(name=f"f{f}", table=TableConfig(name=f"t{f}", vocabulary_size=c, embedding_dim=DIM,
                                                                  combiner="mean" if h > 1 else "sum"),
                                  input_shape=(None, h) if h > 1 else (None,), output_shape=(None, DIM))
                    for f, (c, h) in enumerate(zip(CARDS, HOTNESS))]
        self.emb = HybridEmbedding(features, seed=(3, 1000))
        self.bottom = MLP(BOTTOM, seed=(3, 0), name="bottom_mlp")
        self.interaction = DotInteraction(name="interaction")
        self.top = MLP(TOP, linear_output=True, seed=(3, 100), name="top_mlp")
        self.bottom.build((None, 3))   # built here: MLP's initial values cannot be made in Keras' build graph
        self.top.build((None, 16))
        self.bottom_first = bottom_first

    def embedding_call(self, inputs, training=False):
        embedded = self.emb(inputs[1:])
        if self.bottom_first:
            return [self.bottom(inputs[0])] + embedded
        return {"numerical": inputs[0], "embedded": embedded}

    def dense_call(self, e, training=False):
        vectors = e if self.bottom_first else [self.bottom(e["numerical"])] + e["embedded"]
        return self.top(self.interaction(vectors))


def compiled(model, data, **options):
    numerical, ids, _ = data[0]
    model([numerical] + ids)
    model.compile(optimizer="adam", learning_rate=0.1, **options)
    return model


@pytest.mark.parametrize("bottom_first", [False, True])
def test_halves_train_under_xla_as_without_and_as_the_functional_model(bottom_first):
    data = dlrm_batches()
    functional = api_dlrm()
    functional.compile(optimizer="adam", learning_rate=0.1)
    plain, xla = compiled(HalvesDLRM(bottom_first), data), compiled(HalvesDLRM(bottom_first), data, jit_compile=True)
    want = api_steps(functional, data)
    assert api_steps(plain, data) == want   # the halves are the forward, bit for bit
    np.testing.assert_allclose(api_steps(xla, data), want, rtol=1e-4, atol=0)
    by_path = {w.path: w for w in functional.weights}
    for model in (plain, xla):
        assert sorted(w.path for w in model.weights) == sorted(by_path)
        for w in model.weights:   # the bottom MLP's too: trained on either side of the cut
            np.testing.assert_allclose(w.numpy(), by_path[w.path].numpy(), rtol=0, atol=1e-4, err_msg=w.path)
    for got, ref in zip(xla.emb.table_variables, functional.get_layer("hybrid_embedding").table_variables):
        np.testing.assert_allclose(got.numpy(), ref.numpy(), rtol=0, atol=1e-4)
    numerical, ids, labels = data[0]
    compiled_ops = xla_compiled_ops(tf.function(xla.step_on), [numerical] + ids, labels)
    assert {"MatMul", "BiasAdd", "BiasAddGrad", "ReluGrad"} <= compiled_ops
    assert not {"ResourceGather", "ResourceScatterAdd", "ResourceScatterSub"} & compiled_ops
    assert not xla_compiled_ops(tf.function(plain.step_on), [numerical] + ids, labels)
    assert {"MatMul", "BiasAdd"} <= xla_compiled_ops(tf.function(xla.inference), [numerical] + ids)
    np.testing.assert_allclose(xla.inference([numerical] + ids).numpy(), plain.inference([numerical] + ids).numpy(),
                               rtol=0, atol=1e-3)


def test_evaluate_under_xla():
    data = dlrm_batches()
    xla = compiled(HalvesDLRM(False), data, jit_compile=True)
    x = (tf.concat([n for n, _, _ in data], 0),) + tuple(tf.concat([ids[f] for _, ids, _ in data], 0)
                                                         for f in range(len(CARDS)))
    y = tf.concat([labels for _, _, labels in data], 0)
    figures = xla.evaluate(tf.data.Dataset.from_tensor_slices((x, y)).batch(32), verbose=0, return_dict=True)
    logits = xla(x, training=False).numpy().ravel()
    z, labels = logits.astype(np.float64), y.numpy()
    assert figures["loss"] == pytest.approx(np.mean(np.logaddexp(0.0, z) - labels * z), rel=1e-5)
    assert 0.0 < figures["auc"] < 1.0


def test_one_half_or_call_and_the_halves_are_refused():
    table = TableConfig(name="t", vocabulary_size=10, embedding_dim=4)

    class OneHalf(Model):
        def __init__(self):
            super().__init__(name="one_half")
            self.emb = HybridEmbedding([FeatureConfig("f", table, (None,), (None, 4))])

        def embedding_call(self, inputs, training=False):
            return self.emb([inputs])[0]

    class Both(OneHalf):
        def dense_call(self, e, training=False):
            return keras.ops.sum(e, axis=1)

        def call(self, inputs, training=False):
            return self.dense_call(self.embedding_call(inputs))

    with pytest.raises(ConfigError, match="^model 'one_half' writes embedding_call; a subclassed ranking.Model writes "
                                          "call, or the halves embedding_call and dense_call$"):
        OneHalf().compile()
    with pytest.raises(ConfigError, match="model 'one_half' writes embedding_call; "):   # within Keras' lines
        OneHalf()(tf.zeros([2], tf.int32))
    both = Both()
    both(tf.zeros([2], tf.int32))
    with pytest.raises(ConfigError, match="^model 'one_half' writes embedding_call and dense_call and call; "):
        both.compile()


SUBCLASS_FILE = '''
import keras
import ranking


class Halves(ranking.Model):
    def __init__(self, features):
        super().__init__(name="halves")
        self.names = [f.name for f in features]
        self.embedding = features.embedding(features.feature_configs(8))
        self.hidden = keras.layers.Dense(16, activation="relu", name="hidden")
        self.logit = keras.layers.Dense(1, name="logit")
        self.hidden.build((None, 8 * len(self.names) + features.num_numerical))   # built before the run compiles
        self.logit.build((None, 16))

    def embedding_call(self, inputs, training=False):
        return self.embedding([inputs[n] for n in self.names]) + [inputs["numerical"]]

    def dense_call(self, e, training=False):
        return self.logit(self.hidden(keras.ops.concatenate(e, axis=1)))


def build_model(features, hparams):
    return Halves(features)
'''


def test_model_file_subclass_with_xla(tmp_path):
    """main.py --model=FILE --xla with a subclass in halves: the losses of the run without --xla."""
    from tests.support.api_steps import DLRM, run_losses
    path = tmp_path / "halves.py"
    path.write_text(SUBCLASS_FILE)
    flags = dict(model=str(path), model_param=[])
    plain, plain_result = run_losses(tmp_path, "plain", **flags)
    xla, xla_result = run_losses(tmp_path, "xla", xla=True, **flags)
    assert len(plain) == DLRM["max_steps"]
    np.testing.assert_allclose(xla, plain, rtol=1e-4, atol=0)
    assert xla_result["auc"] == pytest.approx(plain_result["auc"], abs=1e-3)


class TwoHeads(Model):
    """A subclass in halves with two heads: a shared Dense over the embeddings and numericals."""

    def __init__(self):
        super().__init__(name="two_heads")
        table = TableConfig(name="t", vocabulary_size=50, embedding_dim=4)
        self.emb = HybridEmbedding([FeatureConfig("u", table, (None,), (None, 4)),
                                    FeatureConfig("v", table, (None,), (None, 4))], seed=(5, 0))
        self.shared = keras.layers.Dense(8, activation="relu", name="shared")
        self.heads = {h: keras.layers.Dense(1, name=h) for h in ("click", "rating")}
        self.shared.build((None, 11))
        for layer in self.heads.values():
            layer.build((None, 8))

    def embedding_call(self, inputs, training=False):
        return self.emb([inputs["u"], inputs["v"]]) + [inputs["numerical"]]

    def dense_call(self, e, training=False):
        h = self.shared(keras.ops.concatenate(e, axis=1))
        return {name: layer(h) for name, layer in self.heads.items()}


def test_two_heads_under_xla():
    rng = np.random.default_rng(0)
    x = {"u": rng.integers(0, 50, 64), "v": rng.integers(0, 50, 64), "numerical": rng.normal(size=(64, 3))}
    x = {k: tf.constant(v, tf.float32 if k == "numerical" else tf.int64) for k, v in x.items()}
    y = {"click": tf.constant(rng.integers(0, 2, 64), tf.float32),
         "rating": tf.cast(x["numerical"][:, 0] > 0, tf.float32)}
    logs = []
    for jit in (False, True):
        keras.utils.set_random_seed(1)   # the same initial Keras weights
        model = TwoHeads()
        model(x)
        model.compile(optimizer="adam", learning_rate=0.05, loss={"click": "binary_crossentropy_from_logits",
                                                                 "rating": "binary_crossentropy_from_logits"},
                      loss_weights={"rating": 0.5}, jit_compile=jit)
        logs.append([model.train_on_batch(x, y, return_dict=True) for _ in range(3)])
    for plain, xla in zip(*logs):
        assert set(xla) == {"loss", "click_loss", "rating_loss"}
        for name in plain:
            assert xla[name] == pytest.approx(plain[name], rel=1e-4)
