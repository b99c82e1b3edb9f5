"""Run under `horovodrun -np N`: a functional ranking.Model at N ranks against the same model in
one process with the whole batch (same seed; the dense weights of rank 0, which compile gives every rank, copied).
Each rank trains on its b samples of every global batch (data-parallel input, the multi-hot
feature ragged) with train_on_batch; checks the global loss at every step, then its dense
weights and every table shard against the matching region of the one-process tables; then
saves a checkpoint under argv[1] (save_checkpoint) and restores it into a fresh one-process
model (restore_checkpoint), whose every tensor (tables, slots, weights, counters) must equal the
reference's. Prints RESULT with the worst difference; exits non-zero on a mismatch.

argv[2] "shared" (default "separate"): six features over the three tables, two a table (one-hot
and multi-hot features sharing one, a one-hot pair sharing the row-sliced one), each sample's
loss weighted (0.5 or 1.5: fit's sample weights); "sequence": the
three features and a sequence feature over each table (max lengths 4, 3 and 2, histories up to
two ids longer), the row-sliced table's read by DIN's TargetAttention with the one-hot feature of
its table as the candidate, the others flattened. argv[3]
"two_label" (default "one_label"): the model has two heads ("click": the data's label, "rating":
numerical 0 above 0), a loss weight each, and each head's loss is checked too.

Then Keras' evaluate and predict on EVAL further global batches, each rank its b samples: every
rank's predictions equal the reference's for its samples; evaluate's figures (the loss and the
exact AUC, per head with two) equal the reference's evaluate on the whole batches and a NumPy
pairwise AUC and mean cross-entropy of the reference's predictions, and the AUC is exactly the
pairwise AUC of the ranks' own predictions; RESULT carries each rank's figures (the test checks
they agree)."""
import json
import sys

import keras
import numpy as np
import tensorflow as tf

from dataloading.synthetic import SyntheticDataset
from parallel_embedding.collectives import SingleProcess, make_collectives
from ranking import FeatureConfig, HybridEmbedding, Model, SequenceMask, TableConfig, TargetAttention
from tests.support.multi_hot import multi_hot_ids
from tests.support.references import pairwise_auc

CARDS, DIMS, COMBINERS = [40, 60, 20], [8, 4, 6], ["sum", "mean", "mean"]   # tables
FEATURES = {"separate": [(0, 1), (1, 3), (2, 2)],   # (table, max hotness; -L: a sequence of max length L) per feature
            "shared": [(0, 1), (1, 3), (2, 2), (0, 1), (1, 1), (2, 3)],
            "sequence": [(0, 1), (1, 3), (2, 2), (0, -4), (1, -3), (2, -2)]}
ARGS = sys.argv[2:] if __name__ == "__main__" else []   # pytest imports this file for its doctests
TABLE_OF, HOTNESS = zip(*FEATURES[ARGS[0] if ARGS else "separate"])
PLAN = dict(row_slice_threshold=300, column_slice_threshold=200, data_parallel_threshold=150)
B, STEPS, EVAL, TOLERANCE = 32, 4, 3, 1e-5
TWO_LABEL = ARGS[1:] == ["two_label"]
WEIGHTED = ARGS[:1] == ["shared"]


def feature(f, t, h):
    if h < 0:   # a sequence
        return FeatureConfig(f"f{f}", TABLES[t], (None, -h), (None, -h, DIMS[t]))
    return FeatureConfig(f"f{f}", TABLES[t], (None, h) if h > 1 else (None,), (None, DIMS[t]))


TABLES = [TableConfig(f"t{t}", c, d, combiner=k) for t, (c, d, k) in enumerate(zip(CARDS, DIMS, COMBINERS))]


def build(comm):
    numerical = keras.Input((3,), name="numerical")
    ids = [keras.Input((None,), dtype="int32", ragged=True, name=f"f{f}") if h != 1 else
           keras.Input((), dtype="int32", name=f"f{f}") for f, h in enumerate(HOTNESS)]
    features = [feature(f, t, h) for f, (t, h) in enumerate(zip(TABLE_OF, HOTNESS))]
    embedded = HybridEmbedding(features, collectives=comm, seed=(7, 1000), **PLAN)(ids)
    for f, h in enumerate(HOTNESS):
        if h < 0 and TABLE_OF[f] == 0:   # DIN: the one-hot feature of table 0 attends over its history
            mask = SequenceMask(-h)(ids[f])
            embedded[f] = TargetAttention(units=(6,), seed=(7, f), name=f"din_{f}")([embedded[0], embedded[f], mask])
        elif h < 0:
            embedded[f] = keras.layers.Flatten()(embedded[f])
    x = keras.layers.Concatenate()([keras.layers.Dense(4, activation="relu", name="bottom")(numerical)] + embedded)
    x = keras.layers.Dense(16, activation="relu", name="top")(x)
    if not TWO_LABEL:
        model = Model([numerical] + ids, keras.layers.Dense(1, name="logit")(x))
        model.compile(optimizer="adagrad", learning_rate=0.1)
        return model
    model = Model([numerical] + ids, {"click": keras.layers.Dense(1, name="click")(x),
                                      "rating": keras.layers.Dense(1, name="rating")(x)})
    model.compile(optimizer="adagrad", learning_rate=0.1, loss_weights={"click": 1.0, "rating": 0.5})
    return model


def batch(data, step, start, n):
    """Samples [start, start + n) of global batch `step`: (numerical, ids...), labels."""
    whole = data.batch("train", step * B, B)
    ids = [tf.constant(c[start:start + n]) for c in whole["categorical"]]
    for f, h in enumerate(HOTNESS):
        if h != 1:   # a sequence: up to two ids longer than its max length
            ids[f] = tf.cast(multi_hot_ids(CARDS[TABLE_OF[f]], h if h > 1 else 2 - h, f, step * B + start, n), tf.int32)
    labels = tf.constant(whole["labels"][start:start + n])
    if TWO_LABEL:
        labels = {"click": labels, "rating": tf.constant(whole["numerical"][start:start + n, 0] > 0, tf.float32)}
    return (tf.constant(whole["numerical"][start:start + n]),) + tuple(ids), labels


def weights(data, step, start, n):
    """Samples [start, start + n)'s weights in global batch `step` (None: unweighted)."""
    if not WEIGHTED:
        return None
    return tf.constant(np.where(data.batch("train", step * B, B)["numerical"][start:start + n, 1] > 0, 1.5, 0.5))


def main():
    comm = make_collectives()
    dist, ref = build(comm), build(SingleProcess())
    ref.set_weights(dist.get_weights())   # rank 0's (compile broadcasts them); the tables start equal by their seed
    data = SyntheticDataset([CARDS[t] for t in TABLE_OF], 3, alpha=1.05, seed=7)
    b, worst = B // comm.size, 0.0

    def check(what, got, want):
        nonlocal worst
        err = float(np.max(np.abs(np.asarray(got) - np.asarray(want)))) if np.size(want) else 0.0
        if not err <= TOLERANCE:
            raise AssertionError(f"rank {comm.rank}: {what}: max abs difference {err:.3g} > {TOLERANCE}")
        worst = max(worst, err)

    for step in range(STEPS):
        start = comm.rank * b
        logs = dist.train_on_batch(*batch(data, step, start, b), sample_weight=weights(data, step, start, b),
                                   return_dict=True)
        ref_logs = ref.train_on_batch(*batch(data, step, 0, B), sample_weight=weights(data, step, 0, B),
                                      return_dict=True)
        for name in ("loss", "click_loss", "rating_loss") if TWO_LABEL else ("loss",):
            check(f"step {step} {name}", logs[name], ref_logs[name])
    for got, want in zip(dist.dense_variables, ref.dense_variables):
        check(got.name, got.numpy(), want.numpy())
    emb = dist.get_layer("hybrid_embedding").embedding
    tables = [v.numpy() for v in ref.get_layer("hybrid_embedding").table_variables]
    for s, var in zip(emb.shards, emb.shard_variables):
        check(f"table {s.feature} rows {s.row_start}:{s.row_end} cols {s.col_start}:{s.col_end}",
              var.numpy()[:s.num_rows], tables[s.feature][s.row_start:s.row_end, s.col_start:s.col_end])
    for f, var in zip(emb.replicated, emb.replicated_variables):
        check(f"replicated table {f}", var.numpy(), tables[f])
    # A checkpoint written at N ranks restores into a fresh one-process model as the reference's state.
    path = dist.save_checkpoint(sys.argv[1])
    fresh = build(SingleProcess())
    fresh.restore_checkpoint(path)
    restored = {e.name: e.variable.numpy() for e in fresh.checkpoint_entries()}
    for e in ref.checkpoint_entries():
        check(f"restored {e.name}", restored[e.name], e.variable.numpy())
    figures = check_evaluation(dist, ref, data, comm, b, check)
    kinds = sorted({t.kind for t in emb.plan.tables})
    truncated = dist.get_layer("hybrid_embedding").sequence_stats()   # the ranks' sums: the reference's
    if truncated != ref.get_layer("hybrid_embedding").sequence_stats():
        raise AssertionError(f"rank {comm.rank}: truncated ids {truncated}, one process "
                             f"{ref.get_layer('hybrid_embedding').sequence_stats()}")
    results = comm.allgather_object({"rank": comm.rank, "kinds": kinds, "max_error": worst, "evaluate": figures,
                                     "truncated": truncated},
                                    "ranking_result")
    if comm.rank == 0:
        print("RESULT", json.dumps(results), flush=True)


def dataset(data, steps, start, n):
    """Samples [start, start + n) of global batches `steps`, one element each."""
    elements = [tf.data.Dataset.from_tensors(batch(data, step, start, n)) for step in steps]
    out = elements[0]
    for e in elements[1:]:
        out = out.concatenate(e)
    return out


def check_evaluation(dist, ref, data, comm, b, check):
    """evaluate and predict at N ranks against the reference on the whole batches (see the
    docstring); returns this rank's evaluate figures."""
    steps = range(STEPS, STEPS + EVAL)
    figures = dist.evaluate(dataset(data, steps, comm.rank * b, b), verbose=0, return_dict=True)
    want = ref.evaluate(dataset(data, steps, 0, B), verbose=0, return_dict=True)
    heads = ["click", "rating"] if TWO_LABEL else [None]
    mine = dist.predict(dataset(data, steps, comm.rank * b, b), verbose=0)
    whole = ref.predict(dataset(data, steps, 0, B), verbose=0)
    labels = [batch(data, step, 0, B)[1] for step in steps]
    weights = {"click": 1.0, "rating": 0.5, None: 1.0}
    loss = 0.0
    for head in heads:
        got, ref_out = (np.reshape(o if head is None else o[head], [EVAL, -1]) for o in (mine, whole))
        check(f"predictions {head}", got, ref_out[:, comm.rank * b:(comm.rank + 1) * b])
        everyone = np.concatenate(comm.allgather_object(got, "predictions"), axis=1).ravel()   # global order
        y = np.concatenate([np.asarray(l if head is None else l[head]) for l in labels])
        z = ref_out.astype(np.float64).ravel()
        name = "auc" if head is None else f"{head}_auc"
        exact = pairwise_auc(y, everyone)   # of the scores the ranks gave
        if not abs(figures[name] - exact) <= 1e-12:
            raise AssertionError(f"rank {comm.rank}: {name} {figures[name]}, of the ranks' predictions {exact}")
        check(name, figures[name], want[name])
        check(f"{name} against NumPy", figures[name], pairwise_auc(y, z))
        mean = float(np.mean(np.logaddexp(0.0, z) - y * z))   # cross-entropy on logits
        if head is not None:
            check(f"{head}_loss", figures[f"{head}_loss"], mean)
        loss += weights[head] * mean
    check("evaluate loss", figures["loss"], loss)
    check("evaluate loss against the reference's", figures["loss"], want["loss"])
    return figures


if __name__ == "__main__":
    main()
