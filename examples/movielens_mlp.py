"""HugeCTR's MovieLens example: every categorical feature (there: user id, item id, multi-hot
genres) embedded at width 16 with a sum combiner, concatenated (there: reshaped to 48), an MLP
128-128-1; no numerical input.

    python main.py --model=examples/movielens_mlp.py --dataset_type=split_binary --dataset_path=...

Hyper-parameters: embedding_dim (16), hidden ([128, 128]). Shapes: b samples, F features.
"""
import keras

import ranking


def build_model(features: ranking.Features, hparams: dict) -> ranking.Model:
    hp = ranking.hyperparameters(hparams, embedding_dim=16, hidden=[128, 128])
    x = features.inputs()
    del x["numerical"]                                                       # the model takes no numericals
    emb = features.embedding(features.feature_configs(hp["embedding_dim"], combiner="sum"))(
        [x[f.name] for f in features])                                       # F x [b, 16]
    h = keras.layers.Concatenate(name="concat")(emb) if len(emb) > 1 else emb[0]   # [b, 16 F]
    logit = ranking.MLP(hp["hidden"] + [1], linear_output=True, name="mlp")(h)    # [b, 1]
    return ranking.Model(x, logit, name="movielens_mlp")
