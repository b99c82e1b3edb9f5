"""Sequence features (ranking/sequences.py, HybridEmbedding's unpooled lookups), DIN's
TargetAttention, BST's TransformerBlock and HSTU's HSTUBlock, against NumPy: rows, masks, truncation to the most
recent L, the rows' gradients with duplicate ids summed into one update, padded and ragged inputs
alike, a dynamic table, the layers' formulas and their masked positions, synthetic histories, and
the configuration's one-line errors, the export's lookups. Two Gloo
ranks against one process: tests/test_ranking_api.py (the "sequence" features of
tests/support/ranking_multirank_worker.py)."""
import keras
import numpy as np
import pytest
import tensorflow as tf

from deployment.exporter.model_file import _lookups
from deployment.repository_format import RepositoryError
from parallel_embedding.planner import DynamicOptions
from ranking import (CategoricalFeature, FeatureConfig, Features, HSTUBlock, HybridEmbedding, Model, SequenceMask,
                     TableConfig, TargetAttention, TransformerBlock)
from utils.errors import ConfigError

ROWS, DIM, L = 30, 4, 3
HISTORIES = [[1, 2, 3, 4, 5], [], [7], [8, 8], [9, 9, 9, 2]]   # lengths 5, 0, 1, 2, 4 (two over L)


def kept(history):
    """The most recent L ids, in order."""
    return history[-L:]


def layer(**table):
    items = TableConfig("items", ROWS, DIM, **table)
    return HybridEmbedding({"item": FeatureConfig("item", items, (None,), (None, DIM)),
                            "history": FeatureConfig("history", items, (None, L), (None, L, DIM))}, seed=(4, 9))


def numpy_history(table, histories):
    """[b, L, D]: each sample's kept ids' rows, then zeros."""
    out = np.zeros([len(histories), L, table.shape[1]], np.float32)
    for i, h in enumerate(histories):
        for j, r in enumerate(kept(h)):
            out[i, j] = table[r]
    return out


def padded(histories, width=6):
    """Dense [b, width] ids with -1 padding between and after the ids (order kept)."""
    out = np.full([len(histories), width], -1, np.int64)
    for i, h in enumerate(histories):
        positions = np.sort(np.random.default_rng(i).choice(width, len(h), replace=False))
        out[i, positions] = h
    return out


def test_a_sequence_gives_its_most_recent_rows_unpooled_beside_a_one_hot_feature_of_its_table():
    emb = layer()
    items = tf.constant([1, 2, 3, 4, 5], tf.int64)
    ragged = tf.ragged.constant(HISTORIES, tf.int64)
    out = emb({"item": items, "history": ragged})
    table = emb.table_variables[0].numpy()
    assert out["history"].shape == (5, L, DIM) and out["item"].shape == (5, DIM)
    np.testing.assert_array_equal(out["history"].numpy(), numpy_history(table, HISTORIES))
    np.testing.assert_array_equal(out["item"].numpy(), table[items.numpy()])
    want_mask = [[j < len(kept(h)) for j in range(L)] for h in HISTORIES]
    np.testing.assert_array_equal(SequenceMask(L)(ragged).numpy(), want_mask)
    assert emb.sequence_stats() == {"hybrid_embedding/history": {"truncated": 2 + 1}}
    # dense ids, -1 wherever padding is: the same rows and mask
    dense = padded(HISTORIES)
    np.testing.assert_array_equal(emb({"item": items, "history": dense})["history"].numpy(), out["history"].numpy())
    np.testing.assert_array_equal(SequenceMask(L)(dense).numpy(), want_mask)
    assert emb.sequence_stats()["hybrid_embedding/history"]["truncated"] == 6
    # a functional model's output spec
    ids = {"item": keras.Input((), dtype="int64", name="item"),
           "history": keras.Input((None,), dtype="int64", ragged=True, name="history")}
    assert tuple(layer()(ids)["history"].shape) == (None, L, DIM)


def test_a_train_step_updates_each_id_by_its_positions_gradients_summed():
    """logit_i = sum_j <K_j, h_ij> + <k, item_i>; one SGD step of the mean cross-entropy moves
    row r by -lr * the sum of its occurrences' gradients (the history's and the item's)."""
    ids = {"item": keras.Input((), dtype="int64", name="item"),
           "history": keras.Input((None,), dtype="int64", ragged=True, name="history")}
    emb = layer(combiner="mean")
    out = emb(ids)
    x = keras.layers.Concatenate()([keras.layers.Flatten()(out["history"]), out["item"]])
    dense = keras.layers.Dense(1, use_bias=False, name="logit")
    model = Model(ids, dense(x))
    model.compile(optimizer="sgd", learning_rate=0.5)
    kernel = np.random.default_rng(3).normal(size=[(L + 1) * DIM, 1]).astype(np.float32)
    dense.kernel.assign(kernel)
    table = emb.table_variables[0].numpy()
    items, labels = np.array([1, 2, 3, 8, 0]), np.array([1, 0, 1, 1, 0], np.float32)
    h = numpy_history(table, HISTORIES)
    z = h.reshape(5, -1) @ kernel[:L * DIM, 0] + table[items] @ kernel[L * DIM:, 0]
    dz = (1 / (1 + np.exp(-z)) - labels) / 5   # d mean cross-entropy / d logit
    want = table.copy()
    for i, history in enumerate(HISTORIES):
        for j, r in enumerate(kept(history)):
            want[r] -= 0.5 * dz[i] * kernel[j * DIM:(j + 1) * DIM, 0]
        want[items[i]] -= 0.5 * dz[i] * kernel[L * DIM:, 0]
    model.train_on_batch({"item": tf.constant(items), "history": tf.ragged.constant(HISTORIES, tf.int64)},
                         tf.constant(labels))
    np.testing.assert_allclose(emb.table_variables[0].numpy(), want, rtol=1e-5, atol=1e-6)
    # fit's logs count the truncated ids: 3 a pass over these histories (this step's and fit's)
    data = tf.data.Dataset.from_tensors(({"item": tf.constant(items), "history": tf.ragged.constant(HISTORIES,
                                                                                                     tf.int64)},
                                         tf.constant(labels)))
    assert model.fit(data, epochs=2, verbose=0).history["hybrid_embedding/history/truncated"] == [6, 9]


def test_a_dynamic_tables_sequence_reads_the_rows_its_one_hot_feature_reads():
    """Raw ids (any int64), trained a step: each position's row is the row the table's one-hot
    feature reads for the same id (its first id here), ids seen twice read one row, positions past
    the length zeros; a dense input (no padding value for raw ids) is refused."""
    ids = {"item": keras.Input((), dtype="int64", name="item"),
           "history": keras.Input((None,), dtype="int64", ragged=True, name="history")}
    emb = layer(dynamic=DynamicOptions(capacity=ROWS))
    out = emb(ids)
    model = Model(ids, keras.layers.Dense(1)(keras.layers.Concatenate()([keras.layers.Flatten()(out["history"]),
                                                                         out["item"]])))
    model.compile(optimizer="sgd", learning_rate=0.5)
    raw = [[h * 10_000_000_019 - 5 for h in history] for history in HISTORIES]
    batch = {"item": tf.constant([kept(h)[0] if h else 77 for h in raw], tf.int64),
             "history": tf.ragged.constant(raw, tf.int64)}
    model.train_on_batch(batch, tf.constant([1.0, 0.0, 1.0, 0.0, 1.0]))
    out = emb(batch)
    history, item = out["history"].numpy(), out["item"].numpy()
    seen = {}
    for i, h in enumerate(raw):
        for j, r in enumerate(kept(h)):
            assert history[i, j].any()
            np.testing.assert_array_equal(history[i, j], seen.setdefault(r, history[i, j]))
        if h:
            np.testing.assert_array_equal(history[i, 0], item[i])
        assert not history[i, len(kept(h)):].any()
    assert len({row.tobytes() for row in seen.values()}) == len(seen)   # one row an id
    with pytest.raises(ConfigError, match="feature 'history': a sequence over dynamic table 'items' takes ragged"):
        emb({"item": tf.constant([1], tf.int64), "history": tf.constant([[1, 2]], tf.int64)})


def numpy_attention(layer, q, k, mask):
    """DIN's activation unit and weighted sum, in NumPy, with the layer's weights."""
    kernels = [w.numpy() for w in layer.unit.kernels]
    biases = [w.numpy() for w in layer.unit.biases]
    qq = np.broadcast_to(q[:, None, :], k.shape)
    x = np.concatenate([qq, k, qq - k, qq * k], axis=-1)
    for i, (w, b) in enumerate(zip(kernels, biases)):
        x = x @ w + b
        if i < len(kernels) - 1:
            x = 1 / (1 + np.exp(-x))
    scores = x[..., 0]
    if layer.normalize:
        e = np.where(mask, np.exp(scores - scores.max(axis=1, keepdims=True)), 0.0)
        scores = e / np.maximum(e.sum(axis=1, keepdims=True), 1e-30)
    weights = np.where(mask, scores, 0.0)
    return (weights[..., None] * np.where(mask[..., None], k, 0.0)).sum(axis=1)


@pytest.mark.parametrize("normalize", [False, True])
def test_target_attention_is_dins_and_its_masked_positions_change_nothing(normalize):
    rng = np.random.default_rng(5)
    q, k = rng.normal(size=[4, 6]).astype(np.float32), rng.normal(size=[4, 5, 6]).astype(np.float32)
    mask = np.array([[1, 1, 1, 0, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], bool)
    attention = TargetAttention(units=(8, 4), normalize=normalize, seed=(2, 3))
    got = attention([tf.constant(q), tf.constant(k), tf.constant(mask)]).numpy()
    np.testing.assert_allclose(got, numpy_attention(attention, q, k, mask), rtol=1e-5, atol=1e-6)
    assert not got[1].any()   # an empty history

    def outputs_and_gradients(items):
        items = tf.constant(items)
        with tf.GradientTape() as tape:
            tape.watch(items)
            out = attention([tf.constant(q), items, tf.constant(mask)])
            loss = tf.reduce_sum(out * np.arange(6, dtype=np.float32))
        return out.numpy(), tape.gradient(loss, [items] + attention.trainable_variables)

    changed = np.where(mask[..., None], k, np.float32(np.nan))   # whatever the masked positions hold
    (want, want_grads), (out, grads) = outputs_and_gradients(k), outputs_and_gradients(changed)
    np.testing.assert_array_equal(out, want)
    for g, w in zip(grads, want_grads):
        np.testing.assert_array_equal(g.numpy(), w.numpy())
    assert not np.any(np.where(mask[..., None], 0.0, grads[0].numpy()))   # no gradient to masked items
    # under XLA: the same values
    compiled = tf.function(lambda *x: attention(list(x)), jit_compile=True)
    np.testing.assert_allclose(compiled(tf.constant(q), tf.constant(k), tf.constant(mask)).numpy(), got,
                               rtol=1e-5, atol=1e-6)


def numpy_block(block, x, mask):
    """TransformerBlock's post-norm layer in NumPy with its weights: [b, L, D], mask [b, L]."""
    w = {v.path.split("/", 1)[1]: v.numpy().astype(np.float64) for v in block.weights}
    x = np.where(mask[..., None], x, 0.0) + (w["positions"][None] if "positions" in w else 0.0)

    def project(name, v):
        return np.einsum("bld,dhk->blhk", v, w[f"attention/{name}/kernel"]) + w[f"attention/{name}/bias"]
    q, k, v = project("query", x), project("key", x), project("value", x)
    scores = np.einsum("bqhk,bshk->bhqs", q, k) / np.sqrt(q.shape[-1])
    allowed = mask[:, None, :, None] & mask[:, None, None, :]
    if block.causal:
        allowed = allowed & np.tril(np.ones([x.shape[1]] * 2, bool))
    scores = np.where(allowed, scores, -1e9)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    attended = np.einsum("bqhk,hkd->bqd", np.einsum("bhqs,bshk->bqhk", p, v),
                         w["attention/attention_output/kernel"]) + w["attention/attention_output/bias"]

    def norm(name, y):
        mean, var = y.mean(-1, keepdims=True), y.var(-1, keepdims=True)
        return (y - mean) / np.sqrt(var + 1e-6) * w[f"{name}/gamma"] + w[f"{name}/beta"]
    y = norm("norm_0", x + attended)
    ff = np.maximum(y @ w["ff_0/kernel"] + w["ff_0/bias"], 0) @ w["ff_1/kernel"] + w["ff_1/bias"]
    return np.where(mask[..., None], norm("norm_1", y + ff), 0.0)


@pytest.mark.parametrize("causal, positions", [(False, True), (True, False)])
def test_transformer_block_is_bsts_layer_and_its_masked_positions_change_nothing(causal, positions):
    rng = np.random.default_rng(8)
    x = rng.normal(size=[3, 5, 8]).astype(np.float32)
    mask = np.array([[1, 1, 1, 1, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]], bool)
    block = TransformerBlock(heads=2, ff_units=12, max_length=5 if positions else None, causal=causal, seed=(4, 4),
                             name="block")
    got = block([tf.constant(x), tf.constant(mask)]).numpy()
    np.testing.assert_allclose(got, numpy_block(block, x, mask), rtol=1e-4, atol=1e-5)
    assert not got[1].any() and not got[0, 4].any()   # masked positions come out as zeros
    changed = np.where(mask[..., None], x, np.float32(np.nan))
    np.testing.assert_array_equal(block([tf.constant(changed), tf.constant(mask)]).numpy(), got)
    later = x.copy()
    later[:, 3:] += 1.0   # positions 3 and 4 changed
    moved = block([tf.constant(later), tf.constant(mask)]).numpy()
    assert np.array_equal(moved[:, :3], got[:, :3]) == causal   # causal: earlier positions see only the past
    compiled = tf.function(lambda *a: block(list(a)), jit_compile=True)
    np.testing.assert_allclose(compiled(tf.constant(x), tf.constant(mask)).numpy(), got, rtol=1e-5, atol=1e-5)


def numpy_hstu(block, x, mask, key_bias=None):
    """HSTUBlock in NumPy with its weights: [b, L, D], mask [b, L], key_bias [b, L, heads or 1]."""
    def norm(t):
        return (t - t.mean(-1, keepdims=True)) / np.sqrt(t.var(-1, keepdims=True) + 1e-6)

    def silu(t):
        return t / (1 + np.exp(-t))
    b, length, _ = x.shape
    h, dv, dqk = block.heads, block.v_dim, block.qk_dim
    x = np.where(mask[..., None], x, 0).astype(np.float64)
    uvqk = silu(norm(x) @ block.uvqk.kernel.numpy() + block.uvqk.bias.numpy())
    u, v, q, k = np.split(uvqk, np.cumsum([h * dv, h * dv, h * dqk])[:3], axis=-1)
    bias = block.bias.numpy()
    out = np.zeros((b, length, h * dv))
    for s in range(b):
        for head in range(h):
            for i in range(length):
                for j in range(length):
                    if not (mask[s, i] and mask[s, j]) or (block.causal and j > i):
                        continue
                    score = q[s, i, head * dqk:(head + 1) * dqk] @ k[s, j, head * dqk:(head + 1) * dqk] + \
                        bias[j - i + length - 1]
                    if key_bias is not None:
                        score += key_bias[s, j, head % key_bias.shape[-1]]
                    out[s, i, head * dv:(head + 1) * dv] += silu(score) / length * v[s, j, head * dv:(head + 1) * dv]
    y = x + (norm(out) * u) @ block.out.kernel.numpy() + block.out.bias.numpy()
    return np.where(mask[..., None], y, 0)


@pytest.mark.parametrize("causal", [True, False])
def test_hstu_block_is_pointwise_attention_and_its_masked_positions_change_nothing(causal):
    rng = np.random.default_rng(9)
    x = rng.normal(size=[3, 5, 8]).astype(np.float32)
    mask = np.array([[1, 1, 1, 0, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]], bool)
    block = HSTUBlock(5, heads=2, attention_dim=3, causal=causal, seed=(4, 5), name="hstu")
    block.build([(None, 5, 8), (None, 5)])
    block.bias.assign(rng.normal(size=[9]).astype(np.float32))   # a trained relative bias
    got = block([tf.constant(x), tf.constant(mask)]).numpy()
    assert (block.qk_dim, block.v_dim) == (3, 4)
    np.testing.assert_allclose(got, numpy_hstu(block, x, mask), rtol=1e-4, atol=1e-5)
    assert not got[1].any() and not got[0, 3:].any()
    changed = np.where(mask[..., None], x, np.float32(np.nan))
    np.testing.assert_array_equal(block([tf.constant(changed), tf.constant(mask)]).numpy(), got)
    later = x.copy()
    later[:, 3:] += 1.0
    moved = block([tf.constant(later), tf.constant(mask)]).numpy()
    assert np.array_equal(moved[:, :3], got[:, :3]) == causal
    compiled = tf.function(lambda *a: block(list(a)), jit_compile=True)
    np.testing.assert_allclose(compiled(tf.constant(x), tf.constant(mask)).numpy(), got, rtol=1e-5, atol=1e-5)
    kept = tf.constant(np.where(mask[..., None], x, 0))
    with tf.GradientTape() as tape:
        tape.watch(kept)
        loss = tf.reduce_sum(block([kept, tf.constant(mask)]))
    grad = tape.gradient(loss, kept).numpy()
    assert np.all(np.isfinite(grad)) and not grad[~mask].any()   # masked positions take no gradient
    with pytest.raises(ConfigError, match=r"layer 'hstu': takes x \[b, L, D\] \(L 5\) and mask \[b, L\]"):
        HSTUBlock(5, name="hstu")([tf.zeros([2, 4, 8]), tf.ones([2, 4], tf.bool)])
    with pytest.raises(ConfigError, match="layer 'h2': heads must be a positive int, got 0"):
        HSTUBlock(5, heads=0, name="h2")


@pytest.mark.parametrize("width", [2, 1])
def test_hstu_block_adds_a_key_bias_per_head(width):
    """[x, mask, key_bias]: each key's bias (per head, or one for all) added to every query's score,
    as in NumPy; a masked key's bias changes nothing; under XLA too; a bias of another width is
    refused naming the layer."""
    rng = np.random.default_rng(11)
    x = rng.normal(size=[3, 5, 8]).astype(np.float32)
    mask = np.array([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]], bool)
    key_bias = rng.normal(size=[3, 5, width]).astype(np.float32) * 2
    block = HSTUBlock(5, heads=2, attention_dim=3, seed=(4, 6), name="hstu")
    got = block([tf.constant(x), tf.constant(mask), tf.constant(key_bias)]).numpy()
    np.testing.assert_allclose(got, numpy_hstu(block, x, mask, key_bias), rtol=1e-4, atol=1e-5)
    assert not np.allclose(got, block([tf.constant(x), tf.constant(mask)]).numpy(), atol=1e-3)
    moved = np.where(mask[..., None], key_bias, np.float32(50.0))
    np.testing.assert_array_equal(block([tf.constant(x), tf.constant(mask), tf.constant(moved)]).numpy(), got)
    compiled = tf.function(lambda *a: block(list(a)), jit_compile=True)
    np.testing.assert_allclose(compiled(tf.constant(x), tf.constant(mask), tf.constant(key_bias)).numpy(), got,
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(ConfigError, match=r"layer 'h3': takes x \[b, L, D\] \(L 5\) and mask \[b, L\] \(and "
                                          r"key_bias \[b, L, 2 or 1\]\), got shapes \(3, 5, 8\), \(3, 5\), \(3, 5, 3\)"):
        HSTUBlock(5, heads=2, name="h3")([tf.constant(x), tf.constant(mask), tf.zeros([3, 5, 3])])


def test_xla_trains_a_din_as_without():
    """compile(jit_compile=True): the dense part, its SequenceMask fed the history padded, trains
    as the plain step (the same losses and table, float32 rounding)."""
    def trained(xla):
        ids = {"item": keras.Input((), dtype="int64", name="item"),
               "history": keras.Input((None,), dtype="int64", ragged=True, name="history")}
        emb = layer()(ids)
        mask = SequenceMask(L)(ids["history"])
        user = TargetAttention((6,), seed=(1, 2))([emb["item"], emb["history"], mask])
        model = Model(ids, keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(seed=5))(
            keras.layers.Concatenate()([emb["item"], user])))
        model.compile(optimizer="adagrad", learning_rate=0.5, jit_compile=xla)
        x = {"item": tf.constant([1, 2, 3, 4, 5], tf.int64), "history": tf.ragged.constant(HISTORIES, tf.int64)}
        y = tf.constant([1.0, 0.0, 1.0, 0.0, 1.0])
        losses = [float(model.train_on_batch(x, y)) for _ in range(3)]
        return losses, model.get_layer("hybrid_embedding").table_variables[0].numpy()
    (plain, table), (xla, xla_table) = trained(False), trained(True)
    assert plain[0] != plain[-1]
    np.testing.assert_allclose(xla, plain, rtol=1e-5)
    np.testing.assert_allclose(xla_table, table, rtol=1e-5, atol=1e-6)


def test_sequence_configuration_errors_name_the_feature():
    items = TableConfig("items", ROWS, DIM)
    with pytest.raises(ConfigError, match=r"feature 'h': a sequence feature's output_shape is \(batch, L, 4\) "
                                          r"\(table 'items'\'s embedding_dim\) with input_shape \(batch, L\)"):
        FeatureConfig("h", items, (None, 5), (None, 3, DIM))
    with pytest.raises(ConfigError, match="feature 'h': a sequence feature's output_shape"):
        FeatureConfig("h", items, (None,), (None, 3, DIM))
    with pytest.raises(ConfigError, match="feature 'g': multi-hot and pooled, but table 'seq' has no combiner"):
        FeatureConfig("g", TableConfig("seq", ROWS, DIM, combiner=None), (None, 4), (None, DIM))
    FeatureConfig("h", TableConfig("seq", ROWS, DIM, combiner=None), (None, 4), (None, 4, DIM))   # a sequence: fine
    with pytest.raises(ConfigError, match="SequenceMask: max_length must be a positive integer, got 0"):
        SequenceMask(0)
    with pytest.raises(ConfigError, match=r"layer 'din': takes candidate \[b, D\], items \[b, L, D\] and mask "
                                          r"\[b, L\] of one D and L"):
        TargetAttention(name="din")([tf.zeros([2, 4]), tf.zeros([2, 3, 5]), tf.ones([2, 3], tf.bool)])


def test_export_reads_a_sequence_as_an_unpooled_lookup():
    """The export's lookups (tests/test_sequence_export.py serves them): the history's block of
    embeddings L D + 1 wide, its L recorded; the item's pooled, D wide."""
    features = Features([CategoricalFeature("item", ROWS), CategoricalFeature("history", ROWS, L)], 0)
    ids = features.inputs()
    emb = layer()
    out = emb({"item": ids["item"], "history": ids["history"]})
    model = Model(ids, keras.layers.Dense(1)(keras.layers.Concatenate()([keras.layers.Flatten()(out["history"]),
                                                                         out["item"]])))
    computed = []   # the ids the model computes: none here
    lookups, widths, sources = _lookups(model, emb, features, "din.py", 0, computed)
    assert [(x.feature, x.sequence, x.computed) for x in lookups] == [(0, None, None), (1, L, None)] and not computed
    assert widths == [DIM, L * DIM + 1] and sources == [id(ids["item"]), id(ids["history"])]
    with pytest.raises(RepositoryError):   # not a functional model with a dict of inputs
        _lookups(layer(), emb, features, "din.py", 0, [])


def test_synthetic_histories_and_their_affinity_term_against_python():
    """--synthetic_history_length=L: a last feature "history" over cat_0's vocabulary, 0..L ids a
    sample; the oracle logit is the other features' plus s_h * max_j <v[c_0], v[h_j]> / 2."""
    from dataloading import synthetic
    from tests.support.flag_defaults import build
    cfg = build(synthetic_cardinalities=["50", "8", "6"], synthetic_history_length=5)
    assert cfg.data.shape.names == ["cat_0", "cat_1", "cat_2", "history"]
    assert (cfg.data.cardinalities, cfg.data.max_hotness) == ([50, 8, 6, 50], [None, None, None, 5])
    with pytest.raises(ConfigError, match="synthetic_history_length must be >= 0, got -1"):
        build(synthetic_history_length=-1)
    data = synthetic.SyntheticDataset([50, 8, 6, 50], 2, 1.05, 3, [None, None, None, 5], history=5)
    plain = synthetic.SyntheticDataset([50, 8, 6], 2, 1.05, 3)
    got, base = data.batch("train", 10, 200), plain.batch("train", 10, 200)
    history = got["categorical"][3]
    lengths = np.diff(history.row_splits)
    assert lengths.min() == 0 and lengths.max() == 5 and history.values.max() < 50
    for k in range(3):
        np.testing.assert_array_equal(got["categorical"][k], base["categorical"][k])
    v = synthetic._effect_table(3, synthetic._AFFINITY, 0, 50, 4)
    for i in range(200):
        items = history.values[history.row_splits[i]:history.row_splits[i + 1]]
        c = got["categorical"][0][i]
        affinity = synthetic._AFFINITY_SCALE * max(float(v[c] @ v[h]) / 2 for h in items) if len(items) else 0.0
        assert abs(float(got["oracle_logits"][i]) - (float(base["oracle_logits"][i]) + affinity)) < 1e-5
    with pytest.raises(ValueError, match="history 5: the last feature is a history of feature 0's items"):
        synthetic.SyntheticDataset([50, 8, 6, 40], 2, 1.05, 3, [None, None, None, 5], history=5)
