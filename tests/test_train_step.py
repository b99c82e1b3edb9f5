"""The run's train step (run.run_model.RunTrainer over the built-in DLRM / DCNv2, examples/dlrm.py
/ dcnv2.py) in its variants (graph, XLA, AMP, float16 loss scaling) against the float32 eager step."""
import functools

import numpy as np
import pytest
import tensorflow as tf

from dataloading.synthetic import SyntheticDataset
from tests.support.builtin import builtin_trainer, variables_by_name
from tests.support.compiled import xla_compiled_ops

CARDS = [40, 30, 20]
DATA = SyntheticDataset(CARDS, 4, 0.0, seed=2)


def make_trainer(interaction, compute_dtype=tf.float32, xla=False, **flags):
    """The built-in model of `interaction` ("dot": DLRM, "cross": DCNv2) trained by SGD at 0.5,
    computing in `compute_dtype` (not float32: --amp computing in it); `flags` the run's others."""
    cross = dict(num_cross_layers=2, cross_layer_projection_dim=6) if interaction == "cross" else {}
    amp = dict(amp=True, compute_dtype=compute_dtype) if compute_dtype != tf.float32 else {}
    return builtin_trainer(synthetic_cardinalities=[str(c) for c in CARDS], synthetic_num_numerical=4,
                           embedding_dim=["8"], bottom_mlp_dims=["32", "8"], top_mlp_dims=["32", "16", "1"],
                           interaction=interaction, seed=11, optimizer="sgd", learning_rate=0.5, warmup_steps=0,
                           decay_steps=0, xla=xla, **cross, **amp, **flags)


def batch_tensors(start=0, size=64):
    b = DATA.batch("train", start, size)
    return tf.constant(b["numerical"]), [tf.constant(c) for c in b["categorical"]], tf.constant(b["labels"])


def one_step(trainer):
    before = {k: v.numpy().copy() for k, v in variables_by_name(trainer).items()}
    loss = float(trainer.train_step(*batch_tensors()))
    delta = {k: v.numpy() - before[k] for k, v in variables_by_name(trainer).items() if v.dtype == tf.float32}
    return loss, delta


@functools.lru_cache(maxsize=None)
def eager_step(interaction):
    """(loss, deltas) of one_step of the float32 eager trainer of `interaction`: every variant's
    reference (the same seed: built alike, it steps alike)."""
    return one_step(make_trainer(interaction, run_eagerly=True))


def relative_error(a, b):
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-12)


def cosine(a, b):
    return float(np.sum(a * b) / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.mark.parametrize("interaction", ["dot", "cross"])
@pytest.mark.parametrize("variant", ["graph", "xla", "amp_bfloat16", "amp_float16"])
def test_step_variants_close_to_float32_eager(interaction, variant):
    ref_loss, ref_delta = eager_step(interaction)
    if variant == "graph":
        trainer, tol = make_trainer(interaction), 1e-4
    elif variant == "xla":
        trainer, tol = make_trainer(interaction, xla=True), 1e-4
    elif variant == "amp_bfloat16":
        trainer, tol = make_trainer(interaction, tf.bfloat16), None   # 8-bit mantissa: direction only
    else:
        # 10-bit mantissa: through two cross layers the deltas differ by up to ~3% (seed-dependent).
        trainer, tol = make_trainer(interaction, tf.float16), 0.05   # dynamic loss scaling
    loss, delta = one_step(trainer)
    assert loss == pytest.approx(ref_loss, rel=tol / 5 if tol else 5e-3)
    for name, ref in ref_delta.items():
        if np.linalg.norm(ref) > 1e-6:
            if tol:
                assert relative_error(delta[name], ref) < tol, name
            else:
                assert cosine(delta[name], ref) > 0.95, name
    dtype = {"amp_bfloat16": tf.bfloat16, "amp_float16": tf.float16}.get(variant, tf.float32)
    assert trainer.model.compute_dtype == dtype
    assert {trainer.keras_model.get_layer(name).compute_dtype for name in ("bottom_mlp", "top_mlp")} == {dtype.name}
    assert (trainer.loss_scale is not None) == (variant == "amp_float16")


def test_float16_overflow_skips_the_update_and_halves_the_scale():
    trainer = make_trainer("dot", tf.float16)
    trainer.loss_scale.scale.assign(2.0 ** 40)   # scaled float16 gradients overflow to inf
    before = {k: v.numpy().copy() for k, v in variables_by_name(trainer).items()}
    trainer.train_step(*batch_tensors())
    after = variables_by_name(trainer)
    assert float(trainer.loss_scale.scale.numpy()) == 2.0 ** 39
    for name in ("embedding/table_0", "top_mlp/dense_0/kernel", "bottom_mlp/dense_1/bias"):
        np.testing.assert_array_equal(after[name].numpy(), before[name])
    assert int(trainer.step.numpy()) == 1    # the data position still advances


def test_loss_scale_grows_after_finite_interval():
    trainer = make_trainer("dot", tf.float16)
    trainer.loss_scale.growth_interval = 3
    scale0 = float(trainer.loss_scale.scale.numpy())
    for i in range(3):
        trainer.train_step(*batch_tensors(64 * i))
    assert float(trainer.loss_scale.scale.numpy()) == 2 * scale0
    assert int(trainer.loss_scale.good_steps.numpy()) == 0


def test_static_loss_scale_steps_equal_the_unscaled_ones():
    """--loss_scale: a power-of-two scale is exact, so the updates do not depend on it (the run
    takes --loss_scale only for float16, whose steps two such scales must give bit for bit)."""
    low, high = make_trainer("dot", tf.float16, loss_scale=2.0 ** 10), make_trainer("dot", tf.float16,
                                                                                    loss_scale=2.0 ** 13)
    before = {k: v.numpy().copy() for k, v in variables_by_name(low).items()}
    for i in range(3):
        low.train_step(*batch_tensors(64 * i))
        high.train_step(*batch_tensors(64 * i))
    after = variables_by_name(high)
    for name, v in variables_by_name(low).items():
        if not name.startswith("loss_scale/"):   # the scale's own state, below
            np.testing.assert_array_equal(after[name].numpy(), v.numpy(), err_msg=name)
    assert not np.array_equal(after["top_mlp/dense_0/kernel"].numpy(), before["top_mlp/dense_0/kernel"])
    assert (float(low.loss_scale.value.numpy()), float(high.loss_scale.value.numpy())) == (2.0 ** 10, 2.0 ** 13)


def test_static_loss_scale_never_changes():
    """Unlike the dynamic scale (halved above), a static one stays on overflow and after any
    number of finite steps; the overflowing step is skipped."""
    trainer = make_trainer("dot", tf.float16, loss_scale=2.0 ** 40)
    before = {k: v.numpy().copy() for k, v in variables_by_name(trainer).items()}
    trainer.train_step(*batch_tensors())
    after = variables_by_name(trainer)
    for name in ("embedding/table_0", "top_mlp/dense_0/kernel"):
        np.testing.assert_array_equal(after[name].numpy(), before[name])
    assert float(trainer.loss_scale.value.numpy()) == 2.0 ** 40
    trainer = make_trainer("dot", tf.float16, loss_scale=8.0)
    trainer.loss_scale.growth_interval = 1
    trainer.loss_scale.scale.assign(3.0)   # a restored scale is not used either
    loss, delta = one_step(trainer)
    assert float(trainer.loss_scale.value.numpy()) == 8.0 and np.isfinite(loss)
    assert np.linalg.norm(delta["top_mlp/dense_0/kernel"]) > 0


@pytest.mark.parametrize("xla", [False, True])
def test_frozen_tables_stay_and_the_mlps_train_as_usual(xla):
    """--embedding_trainable=false: the tables and their optimizer state never
    change; a step's dense update is the trainable model's (it does not depend on the tables' update)."""
    frozen, trainable = make_trainer("dot", xla=xla, embedding_trainable=False), make_trainer("dot", xla=xla)
    _, delta = one_step(frozen)
    _, reference = one_step(trainable)
    for name, d in delta.items():
        if name.startswith("embedding/"):
            assert not d.any(), name
            assert reference[name].any(), name
        else:
            np.testing.assert_allclose(d, reference[name], rtol=1e-5, atol=1e-7, err_msg=name)
    assert any(delta[name].any() for name in delta if "mlp" in name)
    tables = [v.numpy().copy() for v in frozen.model.table_variables]
    for i in range(1, 4):
        frozen.train_step(*batch_tensors(64 * i))
    for v, t in zip(frozen.model.table_variables, tables):
        np.testing.assert_array_equal(v.numpy(), t)
@pytest.mark.parametrize("interaction", ["dot", "cross"])
def test_xla_compiles_the_dense_forward_and_backward(interaction):
    """With xla, the MLPs' matmuls, their backward (BiasAddGrad) and the loss are inside XLA-compiled
    functions of the train step, and the forward inside those of predict; without, only the
    lookups and the table update are (the dot interaction's matmuls are BatchMatMul)."""
    numerical, categorical, labels = batch_tensors()
    dense_step, dense_predict = {"MatMul", "BiasAddGrad", "Log1p"}, {"MatMul", "BiasAdd"}
    xla = make_trainer(interaction, xla=True)
    assert dense_step <= xla_compiled_ops(xla.train_step, numerical, categorical, labels)
    assert dense_predict <= xla_compiled_ops(xla.predict, numerical, categorical)
    plain = make_trainer(interaction)
    assert not dense_step & xla_compiled_ops(plain.train_step, numerical, categorical, labels)
    assert not dense_predict & xla_compiled_ops(plain.predict, numerical, categorical)
    assert {"ResourceGather", "ResourceScatterSub"} <= xla_compiled_ops(plain.train_step, numerical, categorical,
                                                                        labels)


def test_run_eagerly_runs_the_step_op_by_op():
    """The Python of an eager step runs at every step, eagerly; the default step runs it once,
    while tracing. Both train the same."""
    def record(trainer):
        calls, layer = [], trainer.keras_model.get_layer("top_mlp")
        forward = layer.call
        layer.call = lambda *a, **k: calls.append(tf.executing_eagerly()) or forward(*a, **k)
        return calls
    eager, graph = make_trainer("dot", run_eagerly=True), make_trainer("dot")
    eager_calls, graph_calls = record(eager), record(graph)
    for start in (0, 64, 128):
        eager_loss = float(eager.train_step(*batch_tensors(start)))
        assert eager_loss == pytest.approx(float(graph.train_step(*batch_tensors(start))), rel=1e-5)
    assert eager_calls == [True] * 3 and graph_calls == [False]
    numerical, categorical, _ = batch_tensors(192)
    np.testing.assert_allclose(eager.predict(numerical, categorical), graph.predict(numerical, categorical),
                               rtol=1e-5, atol=1e-6)
    assert not hasattr(eager.predict, "get_concrete_function") and hasattr(graph.predict, "get_concrete_function")
