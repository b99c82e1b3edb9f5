"""The two parts of Keras' private API that ranking.Model builds on, held here alone so that a
Keras release that moves them breaks one file, and `tests/test_keras_internals.py` says so.

    Functional        keras.Model(inputs, outputs)'s class: FunctionalModel subclasses it
    TFEpochIterator   fit's and evaluate's batches over x (a dataset, arrays, ...), on TensorFlow

Checked against the Keras versions of CHECKED (requirements.txt pins one); another version is
refused by the test until the ranking tests have passed on it and it is added here.
"""
from keras.src.backend.tensorflow.trainer import TFEpochIterator
from keras.src.models.functional import Functional

CHECKED = ("3.15.1",)

__all__ = ["CHECKED", "Functional", "TFEpochIterator"]
