"""DIN's training step on histories of realistic lengths: this project's model (ranking.Model, a
HybridEmbedding whose history is a sequence feature: ragged ids in, the most recent L kept)
against the same model written as a Keras user would without it (ids padded to L,
keras.layers.Embedding, DIN's attention in Keras layers over all L positions, Keras' Adam), the
same MLP, on the same batches, timed alternately in one process. Prints one JSON record per
timed round and a summary: samples/s of each, their ratio, each one's mean loss over the timed
steps.

    .venv/bin/python benchmarks/din_step.py [--batch 1024] [--max_length 500] [--mean_length 50]
        [--items 100000] [--dim 16] [--steps 10] [--rounds 2]

History lengths are lognormal (sigma 1, scaled to `--mean_length`), capped at `--max_length`;
labels are random (the loss is there to show both train the same problem, not to be learned).
"""
import argparse
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import ranking  # noqa: E402

ATTENTION, HIDDEN = [80, 40], [200, 80]


def batches(args, count, seed=0):
    """`count` batches: (candidate [b] int64, history lengths [b], history ids flat, labels [b, 1])."""
    rng = np.random.default_rng(seed)
    sigma = 1.0
    mu = np.log(args.mean_length) - sigma ** 2 / 2
    out = []
    for _ in range(count):
        lengths = np.minimum(np.round(rng.lognormal(mu, sigma, args.batch)).astype(np.int64), args.max_length)
        ids = rng.integers(0, args.items, lengths.sum())
        out.append((rng.integers(0, args.items, args.batch), lengths, ids,
                    rng.integers(0, 2, (args.batch, 1)).astype(np.float32)))
    return out


def head(candidate, interest, seed):
    h = keras.layers.Concatenate()([candidate, interest])
    return ranking.MLP(HIDDEN + [1], linear_output=True, seed=(seed, 11), name="mlp")(h)


def project_model(args):
    items = ranking.TableConfig("items", args.items, args.dim)
    features = {"item": ranking.FeatureConfig("item", items, (None,), (None, args.dim)),
                "history": ranking.FeatureConfig("history", items, (None, args.max_length),
                                                 (None, args.max_length, args.dim))}
    ids = {"item": keras.Input((), dtype="int64", name="item"),
           "history": keras.Input((None,), dtype="int64", ragged=True, name="history")}
    emb = ranking.HybridEmbedding(features)(ids)
    mask = ranking.SequenceMask(args.max_length)(ids["history"])
    interest = ranking.TargetAttention(ATTENTION, seed=(1, 7))([emb["item"], emb["history"], mask])
    model = ranking.Model(ids, head(emb["item"], interest, 1))
    model.compile(optimizer="adam", learning_rate=0.001)
    return model


def keras_attention(item, rows, mask):
    """DIN's activation unit and masked sum (TargetAttention's formula) in Keras' own layers and ops,
    over every one of the L positions, as a Keras user writes it."""
    length = rows.shape[1]
    q = keras.ops.repeat(item[:, None, :], length, axis=1)                      # [b, L, D]
    x = keras.layers.Concatenate()([q, rows, q - rows, q * rows])               # [b, L, 4D]
    for units in ATTENTION:
        x = keras.layers.Dense(units, activation="sigmoid")(x)
    scores = keras.layers.Dense(1)(x)[:, :, 0]                                  # [b, L]
    weights = keras.ops.where(mask, scores, 0.0)
    return keras.ops.sum(weights[:, :, None] * rows, axis=1)                    # [b, D]


def keras_model(args):
    candidate = keras.Input((), dtype="int64", name="item")
    history = keras.Input((args.max_length,), dtype="int64", name="history")   # padded with -1
    table = keras.layers.Embedding(args.items + 1, args.dim, name="items")     # row 0: padding
    rows = table(keras.ops.add(history, 1))
    item = table(keras.ops.add(candidate, 1))
    interest = keras_attention(item, rows, keras.ops.greater_equal(history, 0))
    model = keras.Model({"item": candidate, "history": history}, head(item, interest, 1))
    model.compile(optimizer=keras.optimizers.Adam(0.001), loss=keras.losses.BinaryCrossentropy(from_logits=True))
    return model


def inputs(batch, args, padded):
    candidate, lengths, ids, labels = batch
    if padded:
        history = np.full((len(lengths), args.max_length), -1, np.int64)
        history[np.arange(args.max_length)[None, :] < lengths[:, None]] = ids
        return {"item": tf.constant(candidate), "history": tf.constant(history)}, tf.constant(labels)
    ragged = tf.RaggedTensor.from_row_lengths(tf.constant(ids), tf.constant(lengths))
    return {"item": tf.constant(candidate), "history": ragged}, tf.constant(labels[:, 0])


def timed(model, data, args, padded):
    """(samples/s over `data`, the mean loss), after one untimed step."""
    fed = [inputs(b, args, padded) for b in data]
    model.train_on_batch(*fed[0])
    losses, start = [], time.perf_counter()
    for x, y in fed:
        out = model.train_on_batch(x, y)
        losses.append(float(out[0] if isinstance(out, (list, tuple)) else out))
    return len(fed) * args.batch / (time.perf_counter() - start), float(np.mean(losses))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--max_length", type=int, default=500)
    parser.add_argument("--mean_length", type=float, default=50.0)
    parser.add_argument("--items", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    models = {"project": project_model(args), "keras": keras_model(args)}
    data = batches(args, args.steps)
    lengths = np.concatenate([b[1] for b in data])
    figures = {name: [] for name in models}
    for r in range(args.rounds):
        for name, model in models.items():
            rate, loss = timed(model, data, args, padded=name == "keras")
            figures[name].append(rate)
            print(json.dumps({"round": r, "model": name, "samples_per_s": round(rate, 1), "mean_loss": round(loss, 5)}),
                  flush=True)
    best = {name: max(rates) for name, rates in figures.items()}
    print(json.dumps({"summary": True, "batch": args.batch, "max_length": args.max_length,
                      "mean_length": round(float(lengths.mean()), 1), "items": args.items, "dim": args.dim,
                      "project_samples_per_s": round(best["project"], 1),
                      "keras_samples_per_s": round(best["keras"], 1),
                      "ratio": round(best["project"] / best["keras"], 3)}), flush=True)


if __name__ == "__main__":
    main()
