"""DeepFM: first-order terms (a width-1 embedding per categorical feature and a linear map of the
numericals), the factorization machine's pairwise term over the features' embeddings, and an MLP
over the embeddings and numericals, their sum the logit.

    python main.py --model=examples/deepfm.py --model_param embedding_dim=10 ...

Hyper-parameters: embedding_dim (10), hidden ([400, 400, 400]), dropout (0.0). Shapes: b samples,
F features of width D, n numericals (none: no linear map).
"""
import keras

import ranking


def build_model(features: ranking.Features, hparams: dict) -> ranking.Model:
    hp = ranking.hyperparameters(hparams, embedding_dim=10, hidden=[400, 400, 400], dropout=0.0)
    x = features.inputs()
    ids = [x[f.name] for f in features]
    first = features.feature_configs(1, prefix="first_")                     # F tables [cardinality, 1]
    vectors = features.feature_configs(hp["embedding_dim"], prefix="fm_")     # F tables [cardinality, D]
    emb = features.embedding(first + vectors)(ids + ids)                     # 2F x [b, D]
    first_out, vector_out = emb[:len(ids)], emb[len(ids):]
    if features.num_numerical:   # a spec may have none: a Dense over [b, 0] is refused
        first_out.append(keras.layers.Dense(1, name="numerical_linear")(x["numerical"]))   # [b, 1]
    first_order = keras.layers.Add(name="first_order")(first_out) if len(first_out) > 1 else first_out[0]   # [b, 1]
    second_order = ranking.FactorizationMachine(name="fm")(vector_out)        # [b, 1]
    h = keras.layers.Concatenate(name="deep_input")(vector_out + [x["numerical"]])   # [b, D F + n]
    for i, units in enumerate(hp["hidden"]):
        h = keras.layers.Dense(units, activation="relu", name=f"deep_{i}")(h)
        if hp["dropout"]:
            h = keras.layers.Dropout(hp["dropout"], name=f"deep_dropout_{i}")(h)
    deep = keras.layers.Dense(1, name="deep_logit")(h)                        # [b, 1]
    return ranking.Model(x, keras.layers.Add(name="logit")([first_order, second_order, deep]), name="deepfm")
