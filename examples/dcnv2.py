"""DCNv2 written with the API: a bottom MLP over the numericals, concatenated with the features'
embeddings, a low-rank cross network, then an MLP to the logit: the model dcnv2.py trains
(run/assembly.py builds it from its flags).

    python main.py --model=examples/dcnv2.py --model_param num_cross_layers=2 ...

Hyper-parameters: embedding_dim (128), embedding_dims ([]: embedding_dim for every feature; else
one width per feature), bottom ([512, 256, 128]), num_cross_layers (3), projection_dim (512; 0:
full rank), top ([1024, 1024, 512, 256]: before the logit), combiner ("sum": of a multi-hot
feature's rows; or "mean"). Seeded as the built-in model: the bottom MLP (s, 0), the top MLP
(s, 100), the cross network (s, 200), the tables (s, 1000), s the run's --seed. Shapes: b
samples, F features of width D_f, d = bottom[-1] + sum D_f.
"""
import keras

import ranking


def build_model(features: ranking.Features, hparams: dict) -> ranking.Model:
    hp = ranking.hyperparameters(hparams, embedding_dim=128, embedding_dims=[], bottom=[512, 256, 128],
                                 num_cross_layers=3, projection_dim=512, top=[1024, 1024, 512, 256], combiner="sum")
    s = features.seed
    x = features.inputs()
    dims = hp["embedding_dims"] or hp["embedding_dim"]
    emb = features.embedding(features.feature_configs(dims, hp["combiner"]))([x[f.name] for f in features])
    # [b, bottom[-1]]; data without numericals have no bottom MLP (a Dense over [b, 0] is refused)
    bottom = [ranking.MLP(hp["bottom"], seed=(s, 0), name="bottom_mlp")(x["numerical"])] if features.num_numerical else []
    x0 = keras.layers.Concatenate(name="cross_input")(bottom + emb)                               # [b, d]
    crossed = ranking.CrossNetwork(hp["num_cross_layers"], hp["projection_dim"], seed=(s, 200),
                                   name="cross")(x0)                                              # [b, d]
    logit = ranking.MLP(hp["top"] + [1], linear_output=True, seed=(s, 100), name="top_mlp")(crossed)   # [b, 1]
    return ranking.Model(x, logit, name="dcnv2")
