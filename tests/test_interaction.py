"""DotInteraction and CrossNetwork against NumPy."""
import numpy as np
import pytest
import tensorflow as tf

from nn.interaction import DotInteraction, dot_interaction_width
from nn.layers import CrossNetwork
from tests.support.references import numpy_cross, numpy_dot_interaction


@pytest.mark.parametrize("batch,features,dim", [(1, 1, 1), (3, 8, 7), (5, 26, 16), (2, 32, 129)])
def test_dot_interaction_matches_numpy(batch, features, dim):
    rng = np.random.default_rng(batch * 1000 + features)
    bottom = rng.standard_normal((batch, dim)).astype(np.float32)
    embeddings = [rng.standard_normal((batch, dim)).astype(np.float32) for _ in range(features)]
    out = DotInteraction(features, dim)(tf.constant(bottom), [tf.constant(e) for e in embeddings]).numpy()
    expected = numpy_dot_interaction(bottom, embeddings)
    assert out.shape == (batch, dot_interaction_width(features, dim)) == expected.shape
    assert out.shape[1] % 8 == 0
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


def test_dot_interaction_width_is_padded_reference_width():
    # DLRM on Criteo: 26 tables, D=128: 128 + 27*26/2 = 479 -> 480.
    assert dot_interaction_width(26, 128) == 480
    assert dot_interaction_width(26, 16) == 368
    assert dot_interaction_width(1, 7) == 8


def test_dot_interaction_gradient_matches_numerical():
    rng = np.random.default_rng(0)
    bottom = tf.constant(rng.standard_normal((2, 3)), tf.float64)
    emb = [tf.constant(rng.standard_normal((2, 3)), tf.float64) for _ in range(3)]
    layer = DotInteraction(3, 3)

    def f(b):
        return layer(b, emb)

    theoretical, numerical = tf.test.compute_gradient(f, [bottom])
    np.testing.assert_allclose(theoretical[0], numerical[0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("projection_dim", [0, 3])
def test_cross_network_matches_numpy(projection_dim):
    dim, layers = 10, 3
    net = CrossNetwork(layers, projection_dim, seed=(3, 0))
    net.build([(None, 4), (None, 3), (None, 3)])
    for b in net.biases:   # non-zero biases so they are checked too
        b.assign(tf.random.stateless_normal([dim], seed=(1, 2)))
    x0 = np.random.default_rng(1).standard_normal((4, dim)).astype(np.float32)
    expected = numpy_cross(x0, [([m.numpy() for m in ms], b.numpy()) for ms, b in zip(net.matrices, net.biases)])
    dense, sparse = tf.constant(x0[:, :4]), [tf.constant(x0[:, 4:7]), tf.constant(x0[:, 7:])]
    np.testing.assert_allclose(net([dense] + sparse).numpy(), expected, rtol=1e-4, atol=1e-5)
    shapes = [tuple(m.shape) for m in net.matrices[0]]
    assert shapes == ([(dim, dim)] if projection_dim == 0 else [(dim, 3), (3, dim)])
