"""DLRM written with the API: a bottom MLP over the numericals to the embedding width, the
pairwise dot interaction of it and the features' embeddings, a top MLP to the logit: the model
dlrm.py trains (run/assembly.py builds it from its flags), with its default sizes.

    python main.py --model=examples/dlrm.py --model_param embedding_dim=64 --model_param bottom=[256,64] ...

Hyper-parameters: embedding_dim (128), bottom ([512, 256, 128]; its last entry is the embedding
width), top ([1024, 1024, 512, 256]: before the logit), combiner ("sum": of a multi-hot
feature's rows; or "mean"), kernel (the interaction's in training: "auto", "custom" or "tf",
nn.layers.DotInteraction). Seeded as the built-in model: the bottom MLP (s, 0), the top MLP
(s, 100), the tables (s, 1000), s the run's --seed. Shapes: b samples, F features of width D.
"""
import ranking


def build_model(features: ranking.Features, hparams: dict) -> ranking.Model:
    hp = ranking.hyperparameters(hparams, embedding_dim=128, bottom=[512, 256, 128], top=[1024, 1024, 512, 256],
                                 combiner="sum", kernel="auto")
    s = features.seed
    x = features.inputs()
    emb = features.embedding(features.feature_configs(hp["embedding_dim"], hp["combiner"]))(
        [x[f.name] for f in features])                                                      # F x [b, D]
    # [b, D]; data without numericals have no bottom MLP (a Dense over [b, 0] is refused)
    bottom = [ranking.MLP(hp["bottom"], seed=(s, 0), name="bottom_mlp")(x["numerical"])] if features.num_numerical else []
    interaction = ranking.DotInteraction(hp["kernel"], name="interaction")(bottom + emb)
    # interaction: [b, round_up_8(D + (F+1)F/2)]
    logit = ranking.MLP(hp["top"] + [1], linear_output=True, seed=(s, 100), name="top_mlp")(interaction)  # [b, 1]
    return ranking.Model(x, logit, name="dlrm")
