"""ranking.dist_model_parallel (distributed-embeddings' front door) and ranking.embedding.Embedding
(its Embedding layer with a combiner): a script written for distributed-embeddings trains, with
only its imports changed, as the plain Keras model with the same weights and Keras optimizer: at
one process (eager and in a tf.function) and at one and two
Gloo ranks on the same global batches (tests/support/ranking_dmp_worker.py); tables are Keras weights with
IndexedSlices gradients, updated sparsely by SGD and Adagrad; the unsupported options are one line;
XLA by TensorFlow's auto-clustering at two ranks."""
import json

import keras
import numpy as np
import pytest
import tensorflow as tf

from ranking import dist_model_parallel as dmp, embedding
from ranking.embedding import ONE_PROCESS
from tests.support.horovod_run import horovodrun
from tests.support.ranking_dmp_worker import OPTIMIZERS, TABLES, UNSEEDED, batches, drawn, pair, train_step
from utils.errors import ConfigError


def train(dist, ref, optimizer, steps, input_table_map=None, compiled=False):
    """Per-step losses of the dmp model and the reference, each with its own `optimizer`."""
    dist_opt, ref_opt = OPTIMIZERS[optimizer](), OPTIMIZERS[optimizer]()
    step_fn = tf.function(train_step) if compiled else train_step
    out = []
    for step, (x, labels) in enumerate(batches(steps, input_table_map)):
        out.append((float(step_fn(dist, dist_opt, x, labels, step == 0, True)),
                    float(train_step(ref, ref_opt, x, labels, step == 0, False))))
    return out


def assert_same_weights(dist, ref):
    for layer in ("bottom", "top", "logit"):
        for got, want in zip(getattr(dist, layer).get_weights(), getattr(ref, layer).get_weights()):
            np.testing.assert_allclose(got, want, atol=1e-6)
    for got, e in zip(dist.distributed.get_weights(), ref.embeddings):
        np.testing.assert_allclose(got, e.embeddings.numpy(), atol=1e-6)


@pytest.mark.parametrize("optimizer,compiled", [("sgd", False), ("adagrad", True), ("adam", False)])
def test_one_process_equals_plain_keras(optimizer, compiled):
    dist, ref = pair()
    start = [e.embeddings.numpy() for e in ref.embeddings]
    losses = train(dist, ref, optimizer, 4, compiled=compiled)
    np.testing.assert_allclose([d for d, _ in losses], [r for _, r in losses], atol=1e-6)
    assert_same_weights(dist, ref)
    assert all(np.abs(w - s).max() > 1e-3 for w, s in zip(dist.distributed.get_weights(), start))


def test_tables_are_keras_weights_with_sparse_gradients():
    dist, _ = pair()
    tables = dist.distributed.weights
    assert [tuple(v.shape) for v in tables] == TABLES
    assert all(any(v is w for w in dist.trainable_variables) for v in tables)
    (x, labels), = batches(1)
    with tf.GradientTape() as tape:
        loss = keras.losses.BinaryCrossentropy(from_logits=True)(labels, dist(x, training=True))
    grads = dmp.DistributedGradientTape(tape).gradient(loss, tables)
    assert all(isinstance(g, tf.IndexedSlices) for g in grads)
    for optimizer in ("sgd", "adagrad"):   # rows not looked up stay as they were
        before = [v.numpy() for v in tables]
        OPTIMIZERS[optimizer]().apply_gradients(zip(grads, tables))
        for v, b, ids in zip(tables, before, x[1]):
            untouched = np.setdiff1d(np.arange(v.shape[0]), ids.numpy())
            np.testing.assert_array_equal(v.numpy()[untouched], b[untouched])
            assert np.abs(v.numpy() - b).max() > 0


def test_shared_table_at_one_process():
    table_map = [0, 1, 2, 0]
    dist, ref = pair(input_table_map=table_map)
    losses = train(dist, ref, "adagrad", 3, table_map)
    np.testing.assert_allclose([d for d, _ in losses], [r for _, r in losses], atol=1e-6)
    assert_same_weights(dist, ref)


def test_keras_shaped_ids_and_combiner():
    """[b, 1] ids give [b, 1, D] as Keras' Embedding; a layer with a combiner combines multi-hot ids."""
    class Combined(keras.layers.Embedding):
        combiner = "mean"
    layer = dmp.DistributedEmbedding([keras.layers.Embedding(10, 3), Combined(10, 3)])
    tables = layer.get_weights()
    one, multi = layer([tf.constant([[2], [5]]), tf.ragged.constant([[1, 4], [7]])])
    assert one.shape == (2, 1, 3)
    np.testing.assert_allclose(one[:, 0], tables[0][[2, 5]])
    np.testing.assert_allclose(multi, [(tables[1][1] + tables[1][4]) / 2, tables[1][7]], atol=1e-7)


def test_distributed_embeddings_embedding_layer():
    """ranking.embedding.Embedding, distributed-embeddings' layer (`from ranking import embedding`):
    a combiner's sum or mean of each sample's rows (dense [b, k] or ragged), Keras' lookup
    without one; wrapped by DistributedEmbedding, the same rows; a bad combiner is one line."""
    layers = [embedding.Embedding(10, 3, combiner="sum"), embedding.Embedding(12, 2, combiner="mean"),
              embedding.Embedding(8, 4)]
    ids = [tf.constant([[1, 4], [7, 7]]), tf.ragged.constant([[3, 11, 0], [5]]), tf.constant([[2], [6]])]
    own = [layer(x).numpy() for layer, x in zip(layers, ids)]
    w = [layer.embeddings.numpy() for layer in layers]
    np.testing.assert_allclose(own[0], [w[0][1] + w[0][4], 2 * w[0][7]], atol=1e-7)
    np.testing.assert_allclose(own[1], [(w[1][3] + w[1][11] + w[1][0]) / 3, w[1][5]], atol=1e-7)
    np.testing.assert_array_equal(own[2], w[2][[[2], [6]]])
    wrapped = dmp.DistributedEmbedding(layers)
    wrapped.set_weights(w)
    for got, want in zip(wrapped(ids), own):
        np.testing.assert_allclose(got, want, atol=1e-7)
    with pytest.raises(ConfigError, match="^Embedding: combiner must be None, sum or mean, got 'max'$"):
        embedding.Embedding(10, 3, combiner="max")


def test_unsupported_options_are_one_line():
    embeddings = [keras.layers.Embedding(10, 4), keras.layers.Embedding(20, 4)]
    cases = [
        (dict(gpu_embedding_size=1000), "gpu_embedding_size=1000"),
        (dict(input_table_map=[0, 0]), "no input for table 1"),
        (dict(input_table_map=[0, 2]), "got 2"),
    ]
    for kwargs, words in cases:
        with pytest.raises(ConfigError, match=words) as error:
            dmp.DistributedEmbedding(embeddings, **kwargs)
        assert "\n" not in str(error.value)
    with pytest.raises(ConfigError, match="mask_zero"):
        dmp.DistributedEmbedding([keras.layers.Embedding(10, 4, mask_zero=True)])
    layer = dmp.DistributedEmbedding(embeddings)
    with pytest.raises(ConfigError, match=r"table 1 has shape \(10, 4\), expected \(20, 4\)"):
        layer.set_weights([np.zeros((10, 4)), np.zeros((10, 4))])
    with pytest.raises(ConfigError, match="root_rank=1"):
        dmp.broadcast_variables(layer.weights, root_rank=1)


@pytest.mark.parametrize("ranks,kinds", [(1, ["whole"]), (2, ["column", "replicated", "row"])])
def test_gloo_ranks_equal_one_process(ranks, kinds):
    """SGD, Adagrad, Adam; at 2 ranks over row-sliced, column-sliced and replicated tables; Adagrad
    with every table shared by two inputs; model-parallel input (dp_input=False) over those
    tables, and over shared tables placed whole, where each rank takes only its own tables' inputs;
    tables drawn by a Keras initializer, seeded or not, equal to one process's; keras-rs' front door
    refused at 2 ranks in one line."""
    out = horovodrun(ranks, ["tests/support/ranking_dmp_worker.py"])
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    line = next(l for l in out.stdout.splitlines() if "RESULT" in l)
    results = json.loads(line.split("RESULT", 1)[1])
    assert [r["rank"] for r in results] == list(range(ranks)) and all(r["max_error"] <= 1e-5 for r in results)
    for r in results:
        runs = r["runs"]
        assert all(runs[name]["kinds"] == kinds for name in ("sgd", "adagrad", "adam", "adagrad shared",
                                                              "sgd model-parallel input"))
        assert runs["sgd model-parallel input"]["inputs"] == [0, 1, 2]   # every table has a part on each rank
        whole = runs["adagrad shared model-parallel input whole tables"]
        assert whole["kinds"] == ["whole"]
    # Whole tables: each rank takes the inputs of the tables it holds (tests/ranking_dmp_worker.SHARED's 0 and 3 read
    # table 0, 1 and 4 table 1, 2 and 5 table 2; memory_balanced puts the largest, table 0, alone at 2 ranks).
    placed = [r["runs"]["adagrad shared model-parallel input whole tables"]["inputs"] for r in results]
    assert placed == ([[0, 1, 2, 3, 4, 5]] if ranks == 1 else [[0, 3], [1, 2, 4, 5]])
    alone = drawn(UNSEEDED, ONE_PROCESS).whole_tables()   # an unseeded Keras initializer: the same tables at any N
    for r in results:
        for got, want in zip(r["unseeded"], alone):
            np.testing.assert_array_equal(np.asarray(got, np.float32), want)
    assert [r["keras_rs"] for r in results] == ([None] if ranks == 1 else [
        "keras_rs DistributedEmbedding: 2 ranks: a plain keras.Model's fit does not average the dense gradients "
        "over them; at N ranks use ranking.HybridEmbedding in a ranking.Model, or ranking.dist_model_parallel with "
        "its DistributedGradientTape"] * 2)
    if ranks == 2:   # a rank given every input under model-parallel input: one line naming its own
        assert [r["wrong_inputs"] for r in results] == [
            f"layer 'distributed_embedding': dp_input=False: rank {r} takes the ids of inputs {want} "
            f"(strategy.input_ids_list[{r}]), got 6 inputs" for r, want in enumerate(placed)]


@pytest.mark.slow
def test_gloo_ranks_with_xla_auto_clustering(tmp_path):
    """XLA as NVIDIA's scripts turn it on, tf.config.optimizer.set_jit(True) (TensorFlow's
    auto-clustering of a graph's XLA-compilable ops; the CPU also needs TF_XLA_FLAGS): the dmp
    model's step in a tf.function at 2 ranks equals one process, and XLA compiled its matmuls."""
    dump = tmp_path / "xla"
    env = {"TF_XLA_FLAGS": "--tf_xla_cpu_global_jit", "XLA_FLAGS": f"--xla_dump_to={dump} --xla_dump_hlo_as_text"}
    out = horovodrun(2, ["tests/support/ranking_dmp_worker.py", "xla"], env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    results = json.loads(next(l for l in out.stdout.splitlines() if "RESULT" in l).split("RESULT", 1)[1])
    assert all(run["kinds"] == ["column", "replicated", "row"] for r in results for run in r["runs"].values())
    assert all(r["max_error"] <= 1e-5 for r in results)
    assert any(" dot(" in p.read_text() for p in dump.glob("*cluster_*after_optimizations.txt"))
