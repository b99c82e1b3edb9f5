"""Multi-hot features (ragged ids, sum/mean combiners) against a dense NumPy formulation.

A batch of ragged ids is the weight matrix M [n, rows] (M[i, k] = how often id k is in row i,
divided by the row's length for "mean"): the embeddings are M @ table, the table's gradient
M^T @ g.
"""
import numpy as np
import pytest
import tensorflow as tf

from dataloading.synthetic import SyntheticDataset
from parallel_embedding.collectives import SingleProcess
from parallel_embedding.layer import DistributedEmbedding
from parallel_embedding.planner import plan_tables
from tests.support.builtin import builtin_trainer, variables_by_name
from tests.support.multi_hot import multi_hot_ids

CARDS, DIMS = [30, 7], [4, 6]


def weight_matrix(ids: tf.RaggedTensor, rows: int, combiner: str) -> np.ndarray:
    m = np.zeros([int(ids.nrows()), rows])
    for i, row in enumerate(ids.to_list()):
        for k in row:
            m[i, k] += 1.0 / len(row) if combiner == "mean" else 1.0
    return m


@pytest.mark.parametrize("combiner", ["sum", "mean"])
def test_lookup_and_gradient_match_the_dense_formulation(combiner):
    emb = DistributedEmbedding(plan_tables(CARDS, DIMS, 1), SingleProcess(), seed=(1, 2), combiners=[combiner] * 2)
    ids = [multi_hot_ids(CARDS[0], 4, 0, 0, 12), tf.constant(np.arange(12) % CARDS[1])]
    assert 0 in ids[0].row_lengths().numpy() and max(map(len, ids[0].to_list())) > 1
    looked_up = emb.lookup(ids)
    out = emb.exchange(looked_up, 12)
    m = weight_matrix(ids[0], CARDS[0], combiner)
    tables = [v.numpy() for v in emb.shard_variables]
    np.testing.assert_allclose(out[0].numpy(), m @ tables[0], atol=1e-6)
    np.testing.assert_array_equal(out[0].numpy()[ids[0].row_lengths().numpy() == 0], 0.0)   # empty rows
    np.testing.assert_allclose(out[1].numpy(), tables[1][ids[1].numpy()], atol=0)
    g = [tf.random.stateless_normal([12, d], seed=(3, d)) for d in DIMS]
    grads = emb.gradients(looked_up, g)
    dense = tf.math.unsorted_segment_sum(grads[0].values, grads[0].indices, CARDS[0]).numpy()
    np.testing.assert_allclose(dense, m.T @ g[0].numpy(), atol=1e-5)


def train(multi_hot_as_ragged: bool, optimizer: str):
    """Five steps of the run's built-in DLRM on features 0 (multi-hot, mean) and 1 (one-hot; if
    asked, a multi-hot feature, of up to 2 ids, fed as ragged rows of one id)."""
    trainer = builtin_trainer(max_hotness=[3, 2 if multi_hot_as_ragged else None], multi_hot_combiner="mean",
                              synthetic_cardinalities=[str(c) for c in CARDS], synthetic_num_numerical=3,
                              embedding_dim=["8"], bottom_mlp_dims=["16", "8"], top_mlp_dims=["16", "1"], seed=4,
                              optimizer=optimizer, learning_rate=0.1, warmup_steps=0, decay_steps=0)
    data, losses = SyntheticDataset(CARDS, 3, seed=5), []
    for step in range(5):
        batch = data.batch("train", 16 * step, 16)
        one_hot = tf.constant(batch["categorical"][1])
        if multi_hot_as_ragged:
            one_hot = tf.RaggedTensor.from_row_lengths(one_hot, tf.ones([16], tf.int64))
        categorical = [multi_hot_ids(CARDS[0], 3, 0, 16 * step, 16), one_hot]
        losses.append(float(trainer.train_step(tf.constant(batch["numerical"]), categorical,
                                               tf.constant(batch["labels"]))))
    assert trainer.train_step.experimental_get_tracing_count() <= 2   # not one trace per id count
    return losses, {k: v.numpy() for k, v in variables_by_name(trainer).items()}


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
def test_one_hot_as_ragged_trains_like_one_hot(optimizer):
    """The multi-hot path (segment sums, uncompiled update) against the one-hot path (compiled
    gathers and update) on the same one-id-per-row feature."""
    losses, weights = train(False, optimizer)
    ragged_losses, ragged_weights = train(True, optimizer)
    np.testing.assert_allclose(ragged_losses, losses, rtol=1e-6)
    for k in weights:
        np.testing.assert_allclose(ragged_weights[k], weights[k], atol=1e-5, err_msg=k)


def test_unknown_combiner_is_refused():
    with pytest.raises(ValueError, match="combiners"):
        DistributedEmbedding(plan_tables(CARDS, DIMS, 1), SingleProcess(), seed=(1, 2), combiners=["max", "sum"])
