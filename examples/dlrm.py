"""DLRM written with the API: a bottom MLP over the numericals to the embedding width, the
pairwise dot interaction of it and the features' embeddings, a top MLP to the logit (what
dlrm.py trains, with its default sizes).

    python main.py --model=examples/dlrm.py --model_param embedding_dim=64 --model_param bottom=[256,64] ...

Hyper-parameters: embedding_dim (128), bottom ([512, 256, 128]; its last entry is the embedding
width), top ([1024, 1024, 512, 256]: before the logit). Shapes: b samples, F features of width D.
"""
import ranking


def build_model(features: ranking.Features, hparams: dict) -> ranking.Model:
    hp = ranking.hyperparameters(hparams, embedding_dim=128, bottom=[512, 256, 128], top=[1024, 1024, 512, 256])
    x = features.inputs()
    emb = features.embedding(features.feature_configs(hp["embedding_dim"]))([x[f.name] for f in features])
    bottom = ranking.MLP(hp["bottom"], name="bottom_mlp")(x["numerical"])    # [b, D]
    interaction = ranking.DotInteraction(name="interaction")([bottom] + emb)  # [b, round_up_8(D + (F+1)F/2)]
    logit = ranking.MLP(hp["top"] + [1], linear_output=True, name="top_mlp")(interaction)   # [b, 1]
    return ranking.Model(x, logit, name="dlrm")
