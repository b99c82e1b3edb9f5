"""BST (Chen et al., 2019, "Behavior Sequence Transformer"): transformer layers over the user's
history of items, with learned position embeddings, then pooled for the candidate item by DIN's
target attention (BST itself appends the candidate as a last position and flattens the layer's
outputs); the pooled history, the candidate, the other features' pooled embeddings and the
numericals go through an MLP to the logit.

    python main.py --model=examples/bst.py --dataset_type=synthetic --synthetic_history_length=20 ...

Hyper-parameters: candidate ("cat_0"), history ("history"), max_length (0: the history feature's
max_hotness), width (16), blocks (1), heads (2), causal (False: each item attends to the whole
history; True: to the items before it), attention ([32]: the pooling's activation unit), hidden
([200, 80]). The candidate and history read one table, as in examples/din.py. Shapes: b samples,
L max_length, D width.
"""
import keras

import ranking


def build_model(features: ranking.Features, hparams: dict) -> ranking.Model:
    hp = ranking.hyperparameters(hparams, candidate="cat_0", history="history", max_length=0, width=16, blocks=1,
                                 heads=2, causal=False, attention=[32], hidden=[200, 80], side=[])
    candidate, history = features.history_configs(hp["candidate"], hp["history"], hp["width"], hp["max_length"])
    length = history.ids_per_sample
    sequences = [candidate, history] + features.sequence_configs(hp["side"], hp["width"], length)
    others = [f.name for f in features if f.name not in {c.name for c in sequences}]
    x = features.inputs()
    emb = features.embedding(sequences + features.feature_configs(hp["width"], names=others))(
        [x[c.name] for c in sequences] + [x[name] for name in others])   # [b, D], [b, L, D] (+ side), the others [b, D]
    mask = ranking.SequenceMask(length, name="history_mask")(x[history.name])   # [b, L]
    h = keras.layers.Add(name="history_rows")(emb[1:len(sequences)]) if hp["side"] else emb[1]   # [b, L, D]
    emb = emb[:2] + emb[len(sequences):]
    for i in range(hp["blocks"]):
        h = ranking.TransformerBlock(hp["heads"], max_length=length if i == 0 else None, causal=hp["causal"],
                                     seed=(features.seed, 20 + i), name=f"block_{i}")([h, mask])   # [b, L, D]
    pooled = ranking.TargetAttention(hp["attention"], seed=(features.seed, 7), name="attention")([emb[0], h, mask])
    h = keras.layers.Concatenate(name="mlp_input")([emb[0], pooled] + emb[2:] + [x["numerical"]])
    logit = ranking.MLP(hp["hidden"] + [1], linear_output=True, seed=(features.seed, 11), name="mlp")(h)
    return ranking.Model(x, logit, name="bst")
