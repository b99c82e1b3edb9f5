"""XLA for a functional ranking.Model whose HybridEmbedding is fed ids computed in the model
(ranking/model.py's ids_part): a crossed feature hashed from two inputs and a shifted one, next
to an input fed as it is and a ragged one; the dense part also takes a value computed from the
ids. Under compile(jit_compile=True) it trains as without (losses, weights, tables within the
1e-4 of the other XLA tests), XLA compiling the dense ops and their gradients but not the id
arithmetic, lookups or updates, and infers as without; ids computed from looked-up rows are one
line. main.py --model=FILE --xla with such a model file trains as without."""
import keras
import numpy as np
import pytest
import tensorflow as tf

from ranking import FeatureConfig, HybridEmbedding, MLP, Model, TableConfig
from tests.support.compiled import xla_compiled_nodes, xla_compiled_ops
from tests.support.api_dlrm import BOTTOM, CARDS, DIM, HOTNESS, dlrm_batches
from tests.support.api_steps import api_steps, run_losses
from utils.errors import ConfigError

CROSSED = 97   # rows of the table of the crossed feature (f0, f1)


def computed_ids_model():
    """numerical, f0, f1, f2 (ragged) -> embeddings of f0 as given, of (f0 * 31 + f1) mod 97, of
    f2 and of f1 + 1 mod 30; concatenated with the bottom MLP's output and f1 / 30 (a value the
    dense part computes from an id) into the top MLP. Seeded: two calls give the same model."""
    numerical = keras.Input((3,), name="numerical")
    ids = [keras.Input((None,), dtype="int32", ragged=True, name=f"f{f}") if h > 1 else
           keras.Input((), dtype="int32", name=f"f{f}") for f, h in enumerate(HOTNESS)]
    crossed = keras.ops.mod(ids[0] * 31 + ids[1], CROSSED)
    shifted = keras.ops.mod(ids[1] + 1, CARDS[1])
    tables = [(f"t{f}", c, "mean" if h > 1 else "sum", (None, h) if h > 1 else (None,))
              for f, (c, h) in enumerate(zip(CARDS, HOTNESS))]
    tables[1] = ("crossed", CROSSED, "sum", (None,))
    features = [FeatureConfig(name=name, table=TableConfig(name=name, vocabulary_size=rows, embedding_dim=DIM,
                                                           combiner=combiner),
                              input_shape=shape, output_shape=(None, DIM)) for name, rows, combiner, shape in tables]
    features.append(FeatureConfig(name="shifted", table=TableConfig(name="shifted", vocabulary_size=CARDS[1],
                                                                    embedding_dim=DIM), input_shape=(None,),
                                  output_shape=(None, DIM)))
    embedded = HybridEmbedding(features, seed=(3, 1000), name="emb")([ids[0], crossed, ids[2], shifted])
    bottom = MLP(BOTTOM, seed=(3, 0), name="bottom_mlp")(numerical)
    value = keras.ops.expand_dims(keras.ops.cast(ids[1], "float32") / CARDS[1], 1)
    x = keras.layers.Concatenate(name="concat")([bottom, value] + embedded)
    logit = MLP((8, 1), linear_output=True, seed=(3, 100), name="top_mlp")(x)
    return Model([numerical] + ids, logit, name="computed_ids")


def test_ids_computed_in_the_model_train_under_xla_as_without():
    data = dlrm_batches()
    plain, xla = computed_ids_model(), computed_ids_model()
    plain.compile(optimizer="adam", learning_rate=0.1)
    xla.compile(optimizer="adam", learning_rate=0.1, jit_compile=True)
    want = api_steps(plain, data)
    np.testing.assert_allclose(api_steps(xla, data), want, rtol=1e-4, atol=0)
    assert len(set(want)) == len(want)   # it trains
    for a, b in zip(xla.weights, plain.weights):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=0, atol=1e-4, err_msg=a.path)
    emb = {m: m.get_layer("emb") for m in (plain, xla)}
    for got, ref in zip(emb[xla].table_variables, emb[plain].table_variables):
        np.testing.assert_allclose(got.numpy(), ref.numpy(), rtol=0, atol=1e-4)
    numerical, ids, labels = data[0]
    compiled = xla_compiled_nodes(tf.function(xla.step_on), [numerical] + ids, labels)
    ops = {op for op, _ in compiled}
    assert {"MatMul", "BiasAdd", "BiasAddGrad", "ReluGrad"} <= ops
    assert not {"ResourceGather", "ResourceScatterAdd", "ResourceScatterSub"} & ops
    # the ids' arithmetic (a FloorMod) is outside; the dense part's value from an id (a Cast) inside
    assert [name for op, name in compiled if op == "FloorMod" and not name.startswith("gradient_tape/")] == []
    assert any(op == "Cast" and name.startswith("computed_ids_dense") for op, name in compiled)
    assert not xla_compiled_ops(tf.function(plain.step_on), [numerical] + ids, labels)
    assert {"MatMul", "BiasAdd"} <= xla_compiled_ops(tf.function(xla.inference), [numerical] + ids)
    np.testing.assert_allclose(xla.inference([numerical] + ids).numpy(), plain.inference([numerical] + ids).numpy(),
                               rtol=0, atol=1e-3)


def test_ids_computed_from_looked_up_rows_are_one_line():
    ids = keras.Input((), dtype="int32", name="f")
    first = HybridEmbedding([FeatureConfig(name="f", table=TableConfig(name="t", vocabulary_size=10, embedding_dim=4),
                                           input_shape=(None,), output_shape=(None, 4))], name="first")(ids)[0]
    again = keras.ops.cast(keras.ops.sum(keras.ops.abs(first), axis=1) * 5, "int32") % 10
    second = HybridEmbedding([FeatureConfig(name="g", table=TableConfig(name="u", vocabulary_size=10, embedding_dim=4),
                                            input_shape=(None,), output_shape=(None, 4))], name="second")([again])[0]
    model = Model(ids, keras.layers.Dense(1)(keras.layers.Concatenate()([first, second])), name="nested")
    with pytest.raises(ConfigError, match=r"^compile: jit_compile \(XLA\) runs the lookups before the dense part; "
                                          r"model 'nested' computes ids it looks up from layer 'first''s outputs$"):
        model.compile(jit_compile=True)


# A model file whose HybridEmbedding is fed a crossed feature hashed in the model from cat_0 and cat_1.
CROSSED_FILE = '''import keras, ranking

def build_model(features, hparams):
    x = features.inputs()
    n = features.names
    crossed = keras.ops.mod(x[n[0]] * 31 + x[n[1]], 97)
    table = ranking.TableConfig(name="crossed", vocabulary_size=97, embedding_dim=4)
    configs = features.feature_configs(4) + [ranking.FeatureConfig(name="crossed", table=table, input_shape=(None,),
                                                                   output_shape=(None, 4))]
    emb = features.embedding(configs)([x[f] for f in n] + [crossed])
    h = keras.layers.Dense(8, activation="relu", name="hidden")(keras.layers.Concatenate(name="c")(
        emb + [x["numerical"]]))
    return ranking.Model(x, keras.layers.Dense(1, name="logit")(h))
'''


def test_main_py_with_xla_trains_a_model_file_fed_computed_ids_as_without(tmp_path):
    """main.py --model=FILE --xla (in process: run.loop.run): the losses and evaluation of the run
    without --xla, within the other XLA tests' 1e-4."""
    (tmp_path / "crossed.py").write_text(CROSSED_FILE)
    model = {"model": str(tmp_path / "crossed.py"), "model_param": []}
    plain, plain_eval = run_losses(tmp_path, "plain", **model)
    xla, xla_eval = run_losses(tmp_path, "xla", xla=True, **model)
    assert len(plain) == 12 and len(set(plain)) > 1
    np.testing.assert_allclose(xla, plain, rtol=1e-4, atol=0)
    assert xla_eval["auc"] == pytest.approx(plain_eval["auc"], abs=1e-4)
