"""ranking/keras_internals.py, the private Keras API ranking.Model builds on, against the Keras
installed: its version is one the shim was checked against, keras.Model(inputs, outputs) is an
instance of its Functional, and its TFEpochIterator gives evaluate's batches as evaluate reads
them ((first step, last step, iterator) per group, num_batches, reset, catch_stop_iteration)."""
import keras
import numpy as np
import tensorflow as tf

from ranking.keras_internals import CHECKED, Functional, TFEpochIterator


def test_the_installed_keras_is_one_the_shim_was_checked_against():
    assert keras.__version__ in CHECKED, (
        f"Keras {keras.__version__} is not among ranking/keras_internals.py's CHECKED {CHECKED}: run the "
        f"ranking tests (tests/test_ranking_*.py) on it, fix the shim if they fail, then add the version")


def test_a_functional_keras_model_is_an_instance_of_functional():
    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    assert isinstance(model, Functional) and issubclass(Functional, keras.Model)


def test_the_epoch_iterator_gives_every_batch_once_per_reset():
    data = tf.data.Dataset.from_tensor_slices(np.arange(10, dtype=np.float32)).batch(3)
    batches = TFEpochIterator(x=data, y=None, batch_size=None, steps_per_epoch=None, shuffle=False,
                              distribute_strategy=tf.distribute.get_strategy())
    assert batches.num_batches == 4
    for _ in range(2):
        batches.reset()
        seen, steps = [], []
        with batches.catch_stop_iteration():
            for begin, end, iterator in batches:
                steps.extend(range(begin, end + 1))
                for _ in range(end - begin + 1):
                    seen.extend(next(iterator).numpy().tolist())
        assert steps == [0, 1, 2, 3] and seen == list(range(10))
