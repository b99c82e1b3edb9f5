"""DIN (Zhou et al., 2018, "Deep Interest Network"): the candidate item attends over the user's
history of items, read from the same table; the attended history, the candidate, the other
features' pooled embeddings and the numericals go through an MLP to the logit.

    python main.py --model=examples/din.py --dataset_type=synthetic --synthetic_history_length=20 ...

Hyper-parameters: candidate ("cat_0": the one-hot feature of the candidate item), history
("history": a multi-hot feature of the same items, most recent last, read as a sequence),
max_length (0: the history feature's max_hotness; fewer keeps the most recent), width (16:
every table's), attention ([80, 40]: the activation unit's hidden layers), normalize (False:
DIN's unnormalised weights; True: a softmax over the history), pooling ("attention"; "mean": the
history pooled instead, the mean of all its rows, DIN's base model, to measure what the attention
adds; max_length then unset), hidden ([200, 80]: the MLP before its logit). Shapes: b samples,
L max_length, D width, F features, n numericals.
"""
import keras

import ranking
from utils.errors import ConfigError


def build_model(features: ranking.Features, hparams: dict) -> ranking.Model:
    hp = ranking.hyperparameters(hparams, candidate="cat_0", history="history", max_length=0, width=16,
                                 attention=[80, 40], normalize=False, pooling="attention", hidden=[200, 80])
    if hp["pooling"] not in ("attention", "mean"):
        raise ConfigError(f"din: pooling must be 'attention' or 'mean', got {hp['pooling']!r}")
    mean = hp["pooling"] == "mean"
    candidate, history = features.history_configs(hp["candidate"], hp["history"], hp["width"], hp["max_length"],
                                                  "mean", pooled=mean)
    others = [f.name for f in features if f.name not in (candidate.name, history.name)]
    x = features.inputs()
    emb = features.embedding([candidate, history] + features.feature_configs(hp["width"], names=others))(
        [x[candidate.name], x[history.name]] + [x[name] for name in others])   # [b, D], [b, L, D], F-2 x [b, D]
    interest = emb[1]                                                          # pooled: [b, D]
    if not mean:
        mask = ranking.SequenceMask(history.ids_per_sample, name="history_mask")(x[history.name])   # [b, L]
        interest = ranking.TargetAttention(hp["attention"], normalize=hp["normalize"], seed=(features.seed, 7),
                                           name="attention")([emb[0], emb[1], mask])          # [b, D]
    h = keras.layers.Concatenate(name="mlp_input")([emb[0], interest] + emb[2:] + [x["numerical"]])
    logit = ranking.MLP(hp["hidden"] + [1], linear_output=True, seed=(features.seed, 11), name="mlp")(h)
    return ranking.Model(x, logit, name="din")
