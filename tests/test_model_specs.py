"""Every example on the data users bring: a feature spec without numerical features (an
Avazu-shaped log), one with a single categorical feature, multi-hot features and a history; a
model of the user's whose layer reads the zero-width numerical input is one line naming it."""
import math

import pytest

from dataloading.feature_spec import split_binary_spec
from dataloading.generate_dataset import generate
import run.loop as run_loop
from tests.support.configs import tiny_config
from tests.support.model_files import EXAMPLES
from utils.errors import ConfigError

SEQUENCE_MODELS = ("din", "bst", "hstu")
# (numerical features, categorical features and cardinalities, max_hotness of the multi-hot ones)
SPECS = {
    "no_numerical": ([], {"item": 40, "user": 60, "genres": 12, "history": 40}, {"genres": 3, "history": 4}),
    "one_categorical": (["age", "hour"], {"item": 40}, {}),
}


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    paths = {}
    for name, (numerical, categorical, hot) in SPECS.items():
        spec = split_binary_spec(numerical, categorical, max_hotness=hot, numerical_dtype="float32",
                                 base_dir=str(tmp_path_factory.mktemp(name)))
        generate(spec, 64 * 6, 200, seed=4, alpha=1.1)
        paths[name] = spec.base_dir
    return paths


def train(path, model, params):
    return run_loop.run(tiny_config(dataset_type="split_binary", dataset_path=path, batch_size=64,
                                    valid_batch_size=100, warmup_steps=0, decay_steps=0, model=model,
                                    model_param=params))


@pytest.mark.parametrize("spec", sorted(SPECS))
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_every_example_trains_on_the_spec(datasets, name, spec):
    params = EXAMPLES[name] + (["candidate=item", "history=history"] if name in SEQUENCE_MODELS else [])
    if name in SEQUENCE_MODELS and spec == "one_categorical":
        with pytest.raises(ConfigError) as info:
            train(datasets[spec], f"examples/{name}.py", params)
        assert str(info.value) == (f"--model=examples/{name}.py: feature 'history' is not in the dataset "
                                   "(its features: item)")
        return
    metrics = train(datasets[spec], f"examples/{name}.py", params)
    assert math.isfinite(metrics["logloss"]) and 0.0 <= metrics["auc"] <= 1.0


ZERO_WIDTH = '''import keras, ranking

def build_model(features, hparams):
    x = features.inputs()
    e = features.embedding(features.feature_configs(4))([x[f.name] for f in features])
    h = keras.layers.Concatenate(name="c")(e + [keras.layers.Dense(2, name="numerical_in")(x["numerical"])])
    return ranking.Model(x, keras.layers.Dense(1, name="out")(h))
'''


def test_a_layer_over_no_numerical_features_is_one_line(datasets, tmp_path):
    (tmp_path / "zero.py").write_text(ZERO_WIDTH)
    with pytest.raises(ConfigError) as info:
        train(datasets["no_numerical"], str(tmp_path / "zero.py"), [])
    assert str(info.value) == (
        f"--model={tmp_path / 'zero.py'}: build_model: weight 'numerical_in/kernel' has shape (0, 2): a layer over "
        "a zero-width input ('numerical' is [b, 0] on data without numerical features: leave it out where "
        "features.num_numerical is 0)")
