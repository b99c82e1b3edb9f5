"""A subclassed model whose Keras layers are built on their first call (not in `__init__`):
main.py --model=FILE builds them by a forward before compile, so that it trains as the same model
with its layers built in `__init__` (per-step losses and checkpoint, tensor names and slots
included, bit for bit); through the API, weights made after compile are one line at the first step."""
import keras
import pytest
import tensorflow as tf

from ranking import FeatureConfig, HybridEmbedding, Model, TableConfig
from tests.support.model_files import DATA, python
from tests.support.runs import succeeded
from tests.support.checks import assert_same_checkpoint, log_records
from utils.errors import ConfigError

MODEL = """
import keras, ranking

class Subclass(ranking.Model):
    def __init__(self, features):
        super().__init__(name="subclass")
        self.names = features.names
        self.embedding = features.embedding(features.feature_configs(4))
        self.hidden = keras.layers.Dense(8, activation="relu", name="hidden")
        self.logit = keras.layers.Dense(1, name="logit")
        if BUILT:
            self.hidden.build((None, 4 * len(self.names) + features.num_numerical))
            self.logit.build((None, 8))

    def call(self, x, training=False):
        h = keras.ops.concatenate(self.embedding([x[n] for n in self.names]) + [x["numerical"]], axis=1)
        return self.logit(self.hidden(h))

def build_model(features, hparams):
    return Subclass(features)
"""


@pytest.mark.slow
def test_a_lazily_built_subclass_trains_as_one_built_in_init(tmp_path):
    runs = {}
    for built in (False, True):
        path = tmp_path / f"built_{built}.py"
        path.write_text(f"BUILT = {built}\n" + MODEL)
        out = tmp_path / f"run_{built}"
        succeeded(python(f"--model={path}", *DATA, f"--save_checkpoint_path={out / 'ckpt'}",
                         f"--log_path={out / 'log.json'}"))
        runs[built] = out
    lazy, built = ({r["step"]: r["loss"] for r in log_records(runs[b] / "log.json") if r["kind"] == "step"}
                   for b in (False, True))
    assert lazy == built and len(lazy) == 12
    assert_same_checkpoint(runs[False] / "ckpt", runs[True] / "ckpt")   # "hidden/kernel" with its Adam slots


class Lazy(Model):
    def __init__(self):
        super().__init__(name="lazy")
        table = TableConfig(name="t", vocabulary_size=10, embedding_dim=4)
        self.embedding = HybridEmbedding([FeatureConfig(name="f", table=table, input_shape=(None,),
                                                        output_shape=(None, 4))])
        self.logit = keras.layers.Dense(1, name="logit")

    def call(self, x, training=False):
        return self.logit(self.embedding([x])[0])


def test_weights_made_after_compile_are_one_line_at_the_first_step():
    model = Lazy()
    model.compile(optimizer="adam")
    with pytest.raises(ConfigError, match=r"^model 'lazy': weight 'lazy/logit/kernel' was made after compile \(a "
                                          r"layer built on its first call\); build each layer in __init__ before "
                                          r"compile: layer.build\(input_shape\)$"):
        model.train_on_batch(tf.constant([1, 2]), tf.constant([0.0, 1.0]))
