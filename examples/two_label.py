"""Two labels: a shared MLP over the features' embeddings and the numericals, then two heads, a
click logit and a second label's (e.g. a rating above a threshold), each with its own loss and
metric. Under main.py (`--model=examples/two_label.py` on data with two labels: a feature spec
whose label channel names two, or `--dataset_type=synthetic --synthetic_labels=2`) its heads are
named as the data's labels (features.labels); `compile_args` gives the first binary cross-entropy
(evaluated by its exact AUC) and the second the loss `second_loss` (binary cross-entropy, or
"mean_squared_error" for a value such as a rating: evaluated by its RMSE) at weight
`second_weight`. Through the Python API (features with one label: heads click and rating):

    model = build_model(features, {"embedding_dim": 16})
    model.compile(optimizer="adam", learning_rate=0.001,
                  loss={"click": "binary_crossentropy_from_logits", "rating": "binary_crossentropy_from_logits"},
                  loss_weights={"click": 1.0, "rating": 0.5},
                  metrics={"click": [keras.metrics.AUC(from_logits=True, name="auc")],
                           "rating": [keras.metrics.AUC(from_logits=True, name="auc")]})
    model.fit(dataset)   # elements (inputs, {"click": [b], "rating": [b]}); logs click_loss, rating_auc, ...

Hyper-parameters: embedding_dim (16), hidden ([256, 128]: shared), head ([64]: each head's),
second_loss ("binary_crossentropy_from_logits"), second_weight (1.0).
Shapes: b samples, F features of width D, n numericals.
"""
import keras

import ranking

HEADS = ("click", "rating")
BCE = "binary_crossentropy_from_logits"


def _hyperparameters(hparams: dict) -> dict:
    return ranking.hyperparameters(hparams, embedding_dim=16, hidden=[256, 128], head=[64], second_loss=BCE,
                                   second_weight=1.0)


def _heads(features: ranking.Features):
    return features.labels if len(features.labels) > 1 else HEADS


def build_model(features: ranking.Features, hparams: dict) -> ranking.Model:
    hp = _hyperparameters(hparams)
    x = features.inputs()
    emb = features.embedding(features.feature_configs(hp["embedding_dim"]))([x[f.name] for f in features])
    h = keras.layers.Concatenate(name="concat")(emb + [x["numerical"]])                # [b, D F + n]
    h = ranking.MLP(hp["hidden"], name="shared")(h)                                   # [b, hidden[-1]]
    outputs = {head: ranking.MLP(hp["head"] + [1], linear_output=True, name=head)(h)  # [b, 1] each
               for head in _heads(features)}
    return ranking.Model(x, outputs, name="two_label")


def compile_args(features: ranking.Features, hparams: dict) -> dict:
    """compile's loss and loss weight per head, as main.py compiles the model."""
    hp = _hyperparameters(hparams)
    first, second = _heads(features)
    return {"loss": {first: BCE, second: hp["second_loss"]}, "loss_weights": {second: hp["second_weight"]}}
