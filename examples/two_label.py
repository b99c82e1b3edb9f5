"""Two labels: a shared MLP over the features' embeddings and the numericals, then two heads, a
click logit and a second label's (e.g. a rating above a threshold), each with its own loss and
metric. The data loaders of main.py carry one label, so this model trains through the Python API:

    model = build_model(features, {"embedding_dim": 16})
    model.compile(optimizer="adam", learning_rate=0.001,
                  loss={"click": "binary_crossentropy_from_logits", "rating": "binary_crossentropy_from_logits"},
                  loss_weights={"click": 1.0, "rating": 0.5},
                  metrics={"click": [keras.metrics.AUC(from_logits=True, name="auc")],
                           "rating": [keras.metrics.AUC(from_logits=True, name="auc")]})
    model.fit(dataset)   # elements (inputs, {"click": [b], "rating": [b]}); logs click_loss, rating_auc, ...

Hyper-parameters: embedding_dim (16), hidden ([256, 128]: shared), head ([64]: each head's).
Shapes: b samples, F features of width D, n numericals.
"""
import keras

import ranking

HEADS = ("click", "rating")


def build_model(features: ranking.Features, hparams: dict) -> ranking.Model:
    hp = ranking.hyperparameters(hparams, embedding_dim=16, hidden=[256, 128], head=[64])
    x = features.inputs()
    emb = features.embedding(features.feature_configs(hp["embedding_dim"]))([x[f.name] for f in features])
    h = keras.layers.Concatenate(name="concat")(emb + [x["numerical"]])                # [b, D F + n]
    h = ranking.MLP(hp["hidden"], name="shared")(h)                                   # [b, hidden[-1]]
    outputs = {head: ranking.MLP(hp["head"] + [1], linear_output=True, name=head)(h) for head in HEADS}   # [b, 1] each
    return ranking.Model(x, outputs, name="two_label")
