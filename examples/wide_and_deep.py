"""Wide & Deep as HugeCTR's continuous-training example has it: a "wide" width-1 embedding per
categorical feature, summed and added to the logit; a "deep" part: width-16 embeddings of every
categorical feature concatenated with the numericals into an MLP 1024-1024-1 with dropout 0.5.

    python main.py --model=examples/wide_and_deep.py --model_param hidden=[256,256] ...

Hyper-parameters: deep_width (16), hidden ([1024, 1024]: the MLP before its logit), dropout
(0.5, after each hidden layer; 0 for runs that must repeat exactly: Keras' dropout masks are
not checkpointed and differ with the rank count). Shapes: b samples, F features, n numericals.
"""
import keras

import ranking


def build_model(features: ranking.Features, hparams: dict) -> ranking.Model:
    hp = ranking.hyperparameters(hparams, deep_width=16, hidden=[1024, 1024], dropout=0.5)
    x = features.inputs()
    ids = [x[f.name] for f in features]
    wide = features.feature_configs(1, prefix="wide_")                       # F tables [cardinality, 1]
    deep = features.feature_configs(hp["deep_width"], prefix="deep_")        # F tables [cardinality, 16]
    emb = features.embedding(wide + deep)(ids + ids)                         # 2F x [b, D]
    wide_out, deep_out = emb[:len(ids)], emb[len(ids):]
    wide_logit = keras.layers.Add(name="wide_sum")(wide_out) if len(wide_out) > 1 else wide_out[0]   # [b, 1]
    h = keras.layers.Concatenate(name="deep_input")(deep_out + [x["numerical"]])   # [b, 16 F + n]
    for i, units in enumerate(hp["hidden"]):
        h = keras.layers.Dense(units, activation="relu", name=f"deep_{i}")(h)
        if hp["dropout"]:
            h = keras.layers.Dropout(hp["dropout"], name=f"deep_dropout_{i}")(h)
    deep_logit = keras.layers.Dense(1, name="deep_logit")(h)                  # [b, 1]
    return ranking.Model(x, keras.layers.Add(name="logit")([wide_logit, deep_logit]), name="wide_and_deep")
