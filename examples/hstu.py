"""An HSTU-style ranker (Zhai et al., 2024, "Actions Speak Louder than Words"): the candidate item
is placed right after the user's history, causal HSTU layers run over the sequence, and the
candidate's output position (it has seen the whole history, the history never sees it) goes,
with the other features' pooled embeddings and the numericals, through an MLP to the logit.

    python main.py --model=examples/hstu.py --dataset_type=synthetic --synthetic_history_length=20 ...

Hyper-parameters: candidate ("cat_0"), history ("history"), max_length (0: the history feature's
max_hotness; fewer keeps the most recent), width (16), blocks (2), heads (2), attention_dim (0:
width / heads), hidden ([200, 80]), side ([]: features aligned with the history, such as
preproc.raw's aligned_with and gaps_of, each looked up in a table of its own and added to the
history's rows), time_bias ("": none; a history's time gaps, gaps_of: each item's gap looked up in
a table of width `heads`, HSTUBlock's key bias, so that the candidate weighs an item by how long
before the event it came). The candidate and history read one table, as in examples/din.py.
Shapes: b samples, L max_length, D width, H heads.
"""
import keras

import ranking


def build_model(features: ranking.Features, hparams: dict) -> ranking.Model:
    hp = ranking.hyperparameters(hparams, candidate="cat_0", history="history", max_length=0, width=16, blocks=2,
                                 heads=2, attention_dim=0, hidden=[200, 80], side=[], time_bias="")
    candidate, history = features.history_configs(hp["candidate"], hp["history"], hp["width"], hp["max_length"])
    length = history.ids_per_sample
    side = features.sequence_configs(hp["side"], hp["width"], length)
    bias = features.sequence_configs([hp["time_bias"]] if hp["time_bias"] else [], hp["heads"], length, "bias_")
    sequences = [candidate, history] + side + bias
    others = [f.name for f in features if f.name not in {candidate.name, history.name, *hp["side"], hp["time_bias"]}]
    x = features.inputs()
    emb = features.embedding(sequences + features.feature_configs(hp["width"], names=others))(
        [x[name] for name in [candidate.name, history.name, *hp["side"]] + [hp["time_bias"]] * bool(bias) + others])   # [b, D], [b, L, D] (+ side), [b, L, H]?, ...
    rows = keras.layers.Add(name="history_rows")(emb[1:2 + len(side)]) if side else emb[1]   # [b, L, D]
    key_bias = [keras.ops.pad(emb[2 + len(side)], [[0, 0], [0, 1], [0, 0]])] if bias else []   # [b, L + 1, H]
    emb = emb[:1] + emb[len(sequences):]                                              # the candidate, the others
    kept = keras.ops.sum(keras.ops.cast(ranking.SequenceMask(length, name="history_mask")(x[history.name]),
                                        "int32"), axis=1)                           # [b]: n, the kept items
    at = keras.ops.one_hot(kept, length + 1)                                        # [b, L + 1]: the candidate's slot
    items = keras.ops.pad(rows, [[0, 0], [0, 1], [0, 0]]) + at[:, :, None] * emb[0][:, None, :]   # [b, L + 1, D]
    mask = keras.ops.less_equal(keras.ops.arange(length + 1)[None, :], kept[:, None])   # history and candidate
    h = items
    for i in range(hp["blocks"]):
        h = ranking.HSTUBlock(length + 1, hp["heads"], attention_dim=hp["attention_dim"] or None,
                              seed=(features.seed, 30 + i), name=f"hstu_{i}")([h, mask] + key_bias)   # [b, L + 1, D]
    target = keras.ops.sum(h * at[:, :, None], axis=1)                              # [b, D]: at the candidate
    h = keras.layers.Concatenate(name="mlp_input")([emb[0], target] + emb[1:] + [x["numerical"]])
    logit = ranking.MLP(hp["hidden"] + [1], linear_output=True, seed=(features.seed, 11), name="mlp")(h)
    return ranking.Model(x, logit, name="hstu")
