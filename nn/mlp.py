"""Multi-layer perceptrons (DLRM's bottom and top MLPs): the weights' initial values and the
forward pass of nn.layers.MLP (the Keras layer)."""
import math
from typing import Callable, Sequence, Tuple

import tensorflow as tf

from nn.initializers import glorot_normal, normal


def dense_initial_values(in_dim: int, width: int, index: int, seed) -> Tuple[tf.Tensor, tf.Tensor]:
    """Layer `index` of an MLP seeded `seed` (two ints): kernel [in_dim, width] Glorot-normal and
    bias [width] N(0, 1/width), as NVIDIA's reference; float32."""
    kernel = glorot_normal([in_dim, width], (seed[0], seed[1] + 2 * index))
    bias = normal([width], (seed[0], seed[1] + 2 * index + 1), math.sqrt(1.0 / width))
    return kernel, bias


def mlp_forward(x, kernels: Sequence, biases: Sequence, linear_output: bool,
                activation: Callable = tf.nn.relu) -> tf.Tensor:
    """x [B, in_dim] through the layers (kernels [in, out], biases [out]) with `activation`; the
    last layer linear when `linear_output`. Computes in x's dtype (the weights are cast)."""
    last = len(kernels) - 1
    for i, (kernel, bias) in enumerate(zip(kernels, biases)):
        if kernel.shape[0] == 0:    # no input features: x @ kernel (zeros) without oneDNN's matmul, which aborts
            x = tf.reduce_sum(x[:, :, None] * tf.cast(kernel, x.dtype)[None], axis=1)
        else:
            x = tf.matmul(x, tf.cast(kernel, x.dtype))
        x = tf.nn.bias_add(x, tf.cast(bias, x.dtype))
        if i < last or not linear_output:
            x = activation(x)
    return x

