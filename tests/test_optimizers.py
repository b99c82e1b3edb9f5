"""Optimizers: values against NumPy, and sparsity (untouched rows and slots bit-identical) in the
run's step (run.run_model.RunTrainer over the built-in DLRM, examples/dlrm.py)."""
import numpy as np
import pytest
import tensorflow as tf

from parallel_embedding.optimizers import make_optimizer
from tests.support.builtin import builtin_trainer, variables_by_name

EPS, B1, B2 = 1e-7, 0.8, 0.95


def dlrm(cards, num_numerical, dim, bottom, top, optimizer="sgd", **flags):
    """The run's trainer of the built-in DLRM of these sizes, at learning rate 0.1 (no warm-up or decay)."""
    return builtin_trainer(synthetic_cardinalities=[str(c) for c in cards], synthetic_num_numerical=num_numerical,
                           embedding_dim=[str(dim)], bottom_mlp_dims=[str(d) for d in bottom],
                           top_mlp_dims=[str(d) for d in top], optimizer=optimizer, learning_rate=0.1,
                           warmup_steps=0, decay_steps=0, **flags)


def numpy_step(name, w, state, g, lr, t):
    """One reference update of rows with (already summed) gradient g; t is the 1-based count."""
    if name == "sgd":
        return w - lr * g
    if name == "adagrad":
        state["acc"] = state["acc"] + g * g
        return w - lr * g / (np.sqrt(state["acc"]) + EPS)
    state["m"] = B1 * state["m"] + (1 - B1) * g
    state["v"] = B2 * state["v"] + (1 - B2) * g * g
    lr_t = lr * np.sqrt(1 - B2 ** t) / (1 - B1 ** t)
    return w - lr_t * state["m"] / (np.sqrt(state["v"]) + EPS)


def initial_state(name, shape):
    return {"acc": np.full(shape, 0.1), "m": np.zeros(shape), "v": np.zeros(shape)}


@pytest.mark.parametrize("mode", ["eager", "graph", "xla"])
@pytest.mark.parametrize("name", ["sgd", "adagrad", "adam"])
def test_sparse_and_dense_updates_match_numpy(name, mode):
    rng = np.random.default_rng(7)
    table0 = rng.standard_normal((12, 3)).astype(np.float32)
    dense0 = rng.standard_normal((4, 2)).astype(np.float32)
    table, dense = tf.Variable(table0, name="table"), tf.Variable(dense0, name="dense")
    opt = make_optimizer(name, [table, dense], "opt", beta1=B1, beta2=B2)
    indices = np.array([2, 5, 2, 9], dtype=np.int32)   # 2 is duplicated

    def step(values, dense_grad, lr):
        opt.apply([(tf.IndexedSlices(values, indices, tf.constant([12, 3])), table), (dense_grad, dense)], lr)

    if mode != "eager":
        step = tf.function(step, jit_compile=(mode == "xla"))
    t_ref, d_ref = table0.astype(np.float64), dense0.astype(np.float64)
    t_state, d_state = initial_state(name, t_ref.shape), initial_state(name, d_ref.shape)
    for t in (1, 2, 3):
        values = rng.standard_normal((4, 3)).astype(np.float32)
        dense_grad = rng.standard_normal((4, 2)).astype(np.float32)
        lr = 0.1 * t
        step(tf.constant(values), tf.constant(dense_grad), tf.constant(lr))
        summed = np.zeros_like(t_ref)
        np.add.at(summed, indices, values)
        rows = np.unique(indices)
        # Lazy: only the rows in the batch move, with their own slot rows.
        sub_state = {k: v[rows] for k, v in t_state.items()}
        t_ref[rows] = numpy_step(name, t_ref[rows], sub_state, summed[rows], lr, t)
        for k in t_state:
            t_state[k][rows] = sub_state[k]
        d_ref = numpy_step(name, d_ref, d_state, dense_grad, lr, t)
    np.testing.assert_allclose(table.numpy(), t_ref, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(dense.numpy(), d_ref, rtol=2e-5, atol=2e-6)
    untouched = np.setdiff1d(np.arange(12), indices)
    np.testing.assert_array_equal(table.numpy()[untouched], table0[untouched])
    assert int(opt.iterations.numpy()) == 3


@pytest.mark.parametrize("xla", [False, True])
@pytest.mark.parametrize("name", ["sgd", "adagrad", "adam"])
def test_train_step_leaves_untouched_rows_and_slots_bit_identical(name, xla):
    cards = [50, 40, 30]
    trainer = dlrm(cards, 4, 8, (16, 8), (16, 1), name, xla=xla, seed=3)
    before = {k: v.numpy().copy() for k, v in variables_by_name(trainer).items()}
    ids = [tf.constant([1, 3, 3, 7], tf.int32), tf.constant([0, 0, 0, 0], tf.int32), tf.constant([29, 5, 6, 7], tf.int32)]
    trainer.train_step(tf.random.stateless_normal([4, 4], seed=(1, 1)), ids, tf.constant([1.0, 0.0, 1.0, 0.0]))
    after = variables_by_name(trainer)
    for f, (card, id_t) in enumerate(zip(cards, ids)):
        touched = np.unique(id_t.numpy())
        untouched = np.setdiff1d(np.arange(card), touched)
        names = [n for n in before if n.startswith(f"embedding/table_{f}")]
        assert len(names) == 2 + {"sgd": 0, "adagrad": 1, "adam": 2}[name]   # table, its slots and updated_at
        for n in names:
            np.testing.assert_array_equal(after[n].numpy()[untouched], before[n][untouched], err_msg=n)
            assert not np.array_equal(after[n].numpy()[touched], before[n][touched]), n
        updated_at = after[f"embedding/table_{f}/updated_at"].numpy()[:, 0]   # step 1 updated the touched rows
        assert updated_at[touched].tolist() == [1] * len(touched) and not updated_at[untouched].any()
    # Dense weights all moved.
    assert not np.array_equal(after["top_mlp/dense_0/kernel"].numpy(), before["top_mlp/dense_0/kernel"])


def test_table_gradients_stay_indexed_slices():
    """The model's gradients with respect to its tables, and those the step hands the table
    optimizer, are the looked-up rows' (IndexedSlices), not dense [rows, D] ones."""
    trainer = dlrm([1000], 2, 4, (4,), (4, 1), run_eagerly=True, seed=0)
    numerical, ids = tf.ones([2, 2]), [tf.constant([3, 4])]
    with tf.GradientTape() as tape:
        out = trainer.keras_model(trainer.model.inputs(numerical, ids))
    grad = tape.gradient(out, trainer.model.table_variables)[0]
    assert isinstance(grad, tf.IndexedSlices)
    assert grad.values.shape == (2, 4)
    embedding, applied = trainer.model.embeddings.layers[0].embedding, []
    apply_gradients = embedding.apply_gradients
    embedding.apply_gradients = lambda grads, *a: applied.append(grads) or apply_gradients(grads, *a)
    trainer.train_step(numerical, ids, tf.constant([1.0, 0.0]))
    [[grad]] = applied
    assert isinstance(grad, tf.IndexedSlices)
    assert grad.values.shape == (2, 4)


@pytest.mark.parametrize("bad_id", [30, -1])
def test_out_of_range_ids_fail_naming_the_feature(bad_id):
    trainer = dlrm([50, 30], 2, 4, (4,), (4, 1), seed=0)
    ids = [tf.constant([1, 2], tf.int32), tf.constant([3, bad_id], tf.int32)]
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"out of range.*features \(0-based\):.*\[1\]"):
        trainer.train_step(tf.ones([2, 2]), ids, tf.constant([1.0, 0.0]))
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"out of range.*features \(0-based\):.*\[1\]"):
        trainer.predict(tf.ones([2, 2]), ids)
