"""DCNv2 written with the API: a bottom MLP over the numericals, concatenated with the features'
embeddings, a low-rank cross network, then an MLP to the logit (what dcnv2.py trains).

    python main.py --model=examples/dcnv2.py --model_param num_cross_layers=2 ...

Hyper-parameters: embedding_dim (128), bottom ([512, 256, 128]), num_cross_layers (3),
projection_dim (512; 0: full rank), top ([1024, 1024, 512, 256]: before the logit). Shapes: b
samples, F features of width D, d = bottom[-1] + F D.
"""
import keras

import ranking


def build_model(features: ranking.Features, hparams: dict) -> ranking.Model:
    hp = ranking.hyperparameters(hparams, embedding_dim=128, bottom=[512, 256, 128], num_cross_layers=3,
                                 projection_dim=512, top=[1024, 1024, 512, 256])
    x = features.inputs()
    emb = features.embedding(features.feature_configs(hp["embedding_dim"]))([x[f.name] for f in features])
    bottom = ranking.MLP(hp["bottom"], name="bottom_mlp")(x["numerical"])                    # [b, bottom[-1]]
    x0 = keras.layers.Concatenate(name="cross_input")([bottom] + emb)                         # [b, d]
    crossed = ranking.CrossNetwork(hp["num_cross_layers"], hp["projection_dim"], name="cross")(x0)   # [b, d]
    logit = ranking.MLP(hp["top"] + [1], linear_output=True, name="top_mlp")(crossed)          # [b, 1]
    return ranking.Model(x, logit, name="dcnv2")
