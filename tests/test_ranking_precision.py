"""AMP and XLA on the Keras model API (ranking/model.py; run/run_model.py for main.py --model):
DLRM written with the API under Keras' mixed precision equals the built-in Trainer under AMP
(bfloat16; float16 with its loss scaling: its steps recorded before it was removed,
tests/support/recorded.py; skipped overflowing steps, static scale); evaluation computes in
float32; XLA compiles the dense part and equals the plain step; main.py --model with --amp and
--xla trains as without, and a float16 checkpoint restores without --amp."""
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import ranking.precision
import run.loop as run_loop
from ranking import FeatureConfig, HybridEmbedding, Model, TableConfig
from tests.support.compiled import xla_compiled_ops
from tests.support.configs import make_config
from tests.support.recorded import (FIXTURE, RTOL, assert_as_recorded, assert_values_as_recorded, model_state, recorded,
                            recording_cpu)
from tests.support.api_dlrm import api_dlrm, dlrm_batches
from utils.errors import ConfigError
from tests.support.api_steps import DLRM, api_steps, run_losses


def built_under(policy: str, build=api_dlrm):
    """`build()` under Keras' global dtype policy `policy` (restored after)."""
    saved = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy(policy)
    try:
        return build()
    finally:
        keras.mixed_precision.set_global_policy(saved)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_mixed_bfloat16_equals_the_builtin_dlrm(optimizer):
    """Keras' "mixed_bfloat16" policy computes what the built-in --amp computes on the CPU:
    the same per-step losses, tables and dense weights (float32), bit for bit (recorded)."""
    data = dlrm_batches()
    model = built_under("mixed_bfloat16")
    assert model.get_layer("top_mlp").compute_dtype == "bfloat16"
    model.compile(optimizer=optimizer, learning_rate=0.1)
    assert model.loss_scale is None   # bfloat16 needs no loss scaling
    want = recorded("ranking_layers")[f"bfloat16/{optimizer}"]
    assert_values_as_recorded(api_steps(model, data), want["losses"], "losses", dtype="bfloat16")
    assert_as_recorded(model_state(model), want["final"], f"after {len(data)} steps", trained=True)
    assert all(w.value.dtype == tf.float32 for w in model.weights)
    assert all(t.dtype == tf.float32 for t in model.get_layer("hybrid_embedding").table_variables)


def test_amp_losses_are_close_to_float32():
    data = dlrm_batches()
    losses = {}
    for policy in ("float32", "mixed_bfloat16", "mixed_float16"):
        model = built_under(policy)
        model.compile(optimizer="adam", learning_rate=0.1)
        losses[policy] = api_steps(model, data)
    for policy in ("mixed_bfloat16", "mixed_float16"):
        assert np.all(np.isfinite(losses[policy]))
        np.testing.assert_allclose(losses[policy], losses["float32"], rtol=2e-2, err_msg=policy)


def assert_float16_as_recorded(got, want, what: str):
    """Within 1e-6 of the recorded float16 step on the recording CPU; elsewhere within float16's
    rounding of the largest value (tests/support/recorded.py)."""
    atol = 1e-6 if recording_cpu() else RTOL["float16"] * np.max(np.abs(want))
    np.testing.assert_allclose(got, want, rtol=0, atol=atol, err_msg=what)


def test_mixed_float16_scales_the_loss_as_the_builtin_trainer():
    """float16: dynamic loss scaling (the built-in's LossScale), the same losses and updates
    as the built-in float16 trainer (SGD, loss scaling; its values recorded) within float16's rounding."""
    data = dlrm_batches()
    model = built_under("mixed_float16")
    model.compile(optimizer="sgd", learning_rate=0.1)
    want = dict(np.load(os.path.join(FIXTURE, "ranking_layers_float16_sgd.npz")))
    assert_float16_as_recorded(api_steps(model, data), want.pop("losses"), "losses")
    assert float(model.loss_scale.scale.numpy()) == float(want.pop("loss_scale")) == 2.0 ** 15
    state = model_state(model)
    assert sorted(state) == sorted(want)
    for name, value in want.items():
        assert_float16_as_recorded(state[name], value, name)
    assert {"loss_scale/scale", "loss_scale/good_steps"} <= {e.name for e in model.checkpoint_entries()}


def test_float16_overflow_skips_the_update_and_halves_the_scale():
    data = dlrm_batches()
    model = built_under("mixed_float16")
    model.compile(optimizer="sgd", learning_rate=0.1)
    model.loss_scale.scale.assign(2.0 ** 40)   # scaled float16 gradients overflow to inf
    before = [v.numpy().copy() for v in model.dense_variables + model.get_layer("hybrid_embedding").table_variables]
    loss = api_steps(model, data[:1])[0]
    after = model.dense_variables + model.get_layer("hybrid_embedding").table_variables
    assert np.isfinite(loss) and float(model.loss_scale.scale.numpy()) == 2.0 ** 39
    for b, a in zip(before, after):
        np.testing.assert_array_equal(a.numpy(), b)
    assert int(model.global_step.numpy()) == 1
    model.check_finite()   # a skipped step is no error


def test_static_loss_scale_never_changes_and_needs_float16():
    data = dlrm_batches()
    model = built_under("mixed_float16")
    model.compile(optimizer="sgd", learning_rate=0.1, loss_scale=8.0)
    model.loss_scale.scale.assign(3.0)   # a restored scale is not used
    assert np.all(np.isfinite(api_steps(model, data)))
    assert float(model.loss_scale.value.numpy()) == 8.0
    with pytest.raises(ConfigError, match=r"^compile: loss_scale applies to a model computing in float16 \(built "
                                          r"under Keras' 'mixed_float16' policy\); model '.*' computes in bfloat16"):
        built_under("mixed_bfloat16").compile(optimizer="sgd", loss_scale=8.0)


@pytest.mark.parametrize("xla", [False, True])
def test_amp_inference_is_the_float32_forward(xla):
    """Evaluation under AMP computes in float32: the logits of the float32 model with the same weights."""
    data = dlrm_batches()
    model = built_under("mixed_bfloat16")
    model.compile(optimizer="adam", learning_rate=0.1, jit_compile=xla)
    api_steps(model, data[:3])   # trained in bfloat16
    reference = built_under("float32")
    for w, r in zip(model.weights, reference.weights):
        r.assign(w)
    for got, want in zip(model.get_layer("hybrid_embedding").table_variables,
                         reference.get_layer("hybrid_embedding").table_variables):
        want.assign(got)
    numerical, ids, _ = data[3]
    logits = tf.function(model.inference)([numerical] + ids).numpy()
    assert logits.dtype == np.float32
    np.testing.assert_allclose(logits, reference([numerical] + ids).numpy(), rtol=1e-6, atol=1e-6)
    assert len(np.unique(logits)) == len(logits)   # no bfloat16 ties
    assert model.get_layer("top_mlp").compute_dtype == "bfloat16"   # its policy again after


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_xla_step_equals_the_plain_one_and_compiles_the_dense_part(optimizer):
    data = dlrm_batches()
    plain, xla = api_dlrm(), api_dlrm()
    plain.compile(optimizer=optimizer, learning_rate=0.1)
    xla.compile(optimizer=optimizer, learning_rate=0.1, jit_compile=True)
    np.testing.assert_allclose(api_steps(xla, data), api_steps(plain, data), rtol=1e-4, atol=0)
    for a, b in zip(xla.weights, plain.weights):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=0, atol=1e-4, err_msg=a.path)
    numerical, ids, labels = data[0]
    dense_step = {"MatMul", "BiasAdd", "BiasAddGrad"}
    assert dense_step <= xla_compiled_ops(tf.function(xla.step_on), [numerical] + ids, labels)
    assert not dense_step & xla_compiled_ops(tf.function(plain.step_on), [numerical] + ids, labels)
    assert {"MatMul", "BiasAdd"} <= xla_compiled_ops(tf.function(xla.inference), [numerical] + ids)
    compiled = xla_compiled_ops(tf.function(xla.step_on), [numerical] + ids, labels)
    assert not {"ResourceGather", "ResourceScatterAdd", "ResourceScatterSub"} & compiled   # lookups, updates outside


def test_xla_refusals_name_the_model_or_layer():
    class Subclassed(Model):
        def __init__(self):
            super().__init__(name="sub")
            table = TableConfig(name="t", vocabulary_size=10, embedding_dim=4)
            self.emb = HybridEmbedding([FeatureConfig(name="f", table=table, input_shape=(None,),
                                                      output_shape=(None, 4))])
            self.top = keras.layers.Dense(1)

        def call(self, ids, training=False):
            return self.top(self.emb([ids])[0])

    model = Subclassed()
    model(tf.zeros([2], tf.int32))
    with pytest.raises(ConfigError, match=r"^compile: jit_compile \(XLA\) compiles a subclassed model's dense part, "
                                          r"which it writes as the halves embedding_call and dense_call "
                                          r"\(docs/models.md\); model 'sub' writes only call$"):
        model.compile(jit_compile=True)


@pytest.mark.slow
def test_model_file_with_amp_and_xla(tmp_path, monkeypatch):
    """--xla: the losses of the run without it (within the built-in XLA tests' 1e-4); --amp
    (bfloat16 on the CPU): finite, close; float16 (posing as a GPU): loss scaling on, and its
    checkpoint restores without --amp."""
    plain, _ = run_losses(tmp_path, "plain")
    assert len(plain) == 12
    xla, _ = run_losses(tmp_path, "xla", xla=True)
    np.testing.assert_allclose(xla, plain, rtol=1e-4, atol=0)
    amp, _ = run_losses(tmp_path, "amp", amp=True)
    assert np.all(np.isfinite(amp))
    np.testing.assert_allclose(amp, plain, rtol=2e-2)
    monkeypatch.setattr(ranking.precision, "amp_dtype", lambda: tf.float16)
    fp16, trained = run_losses(tmp_path, "fp16", amp=True, loss_scale=1024.0,
                               save_checkpoint_path=str(tmp_path / "ck"))
    np.testing.assert_allclose(fp16, plain, rtol=2e-2)
    # evaluated in float32 by the run, as by a float32 run restoring its checkpoint (no loss scale read)
    evaluated = run_loop.run(make_config(DLRM, mode="eval", restore_checkpoint_path=str(tmp_path / "ck")))
    assert (evaluated["auc"], evaluated["logloss"]) == (trained["auc"], trained["logloss"])
    monkeypatch.setattr(ranking.precision, "amp_dtype", lambda: tf.bfloat16)
    with pytest.raises(ConfigError, match=r"^--loss_scale applies to float16 AMP \(--amp on a GPU\); this run "
                                          r"computes in bfloat16, which needs no loss scaling$"):
        run_loop.run(make_config(DLRM, amp=True, loss_scale=1024.0))
