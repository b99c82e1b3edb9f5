"""DLRM written with the ranking API at small sizes, as the earlier built-in model (seed 3;
interaction "dot", learning rate 0.1, tables of width DIM, feature 2 multi-hot and combined by
"mean"), and its batches: the model the API tests train against the recorded steps
(tests/support/recorded.py)."""
import keras
import tensorflow as tf

from dataloading.synthetic import SyntheticDataset
from ranking import DotInteraction, FeatureConfig, HybridEmbedding, MLP, Model, TableConfig
from tests.support.multi_hot import multi_hot_ids

CARDS, HOTNESS, DIM, BOTTOM, TOP, B, STEPS = [40, 30, 20], [1, 1, 3], 4, (8, 4), (16, 1), 32, 4
DATA = SyntheticDataset(CARDS, 3, 0.0, seed=11)


def dlrm_batches():
    """STEPS batches (numerical [B, 3], ids per feature, labels [B]); feature 2 multi-hot (ragged)."""
    out = []
    for step in range(STEPS):
        b = DATA.batch("train", step * B, B)
        ids = [tf.constant(c) for c in b["categorical"]]
        ids[2] = tf.cast(multi_hot_ids(CARDS[2], HOTNESS[2], 2, step * B, B), tf.int32)
        out.append((tf.constant(b["numerical"]), ids, tf.constant(b["labels"])))
    return out


def api_dlrm():
    """DLRM in a few lines of the API, seeded as the earlier built-in model (seed 3)."""
    features = [FeatureConfig(name=f"f{f}", table=TableConfig(name=f"t{f}", vocabulary_size=c, embedding_dim=DIM,
                                                              combiner="mean" if h > 1 else "sum"),
                              input_shape=(None, h) if h > 1 else (None,), output_shape=(None, DIM))
                for f, (c, h) in enumerate(zip(CARDS, HOTNESS))]
    numerical = keras.Input((3,), name="numerical")
    ids = [keras.Input((None,), dtype="int32", ragged=True, name=f"f{f}") if h > 1 else
           keras.Input((), dtype="int32", name=f"f{f}") for f, h in enumerate(HOTNESS)]
    embedded = HybridEmbedding(features, seed=(3, 1000))(ids)
    bottom = MLP(BOTTOM, seed=(3, 0), name="bottom_mlp")(numerical)
    x = DotInteraction(name="interaction")([bottom] + embedded)
    logit = MLP(TOP, linear_output=True, seed=(3, 100), name="top_mlp")(x)
    return Model([numerical] + ids, logit)
