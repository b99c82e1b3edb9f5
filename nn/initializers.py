"""Deterministic initialisers (stateless: the same seed gives the same weights on any rank)."""
import math

import tensorflow as tf


def glorot_normal(shape, seed):
    """Glorot-normal as Keras: truncated normal with stddev sqrt(2 / (fan_in + fan_out))."""
    fan_in, fan_out = shape[0], shape[-1]
    stddev = math.sqrt(2.0 / (fan_in + fan_out)) / 0.87962566103423978
    return tf.random.stateless_truncated_normal(shape, seed=seed, stddev=stddev)


def normal(shape, seed, stddev):
    return tf.random.stateless_normal(shape, seed=seed, stddev=stddev)
