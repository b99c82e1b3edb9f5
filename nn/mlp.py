"""Multi-layer perceptrons (DLRM's bottom and top MLPs)."""
import math
from typing import Sequence

import tensorflow as tf

from nn.initializers import glorot_normal, normal


class MLP(tf.Module):
    """Dense layers with ReLU; the last layer is linear when `linear_output` (the logit).

    Input [B, in_dim] -> output [B, widths[-1]]. Kernels Glorot-normal, biases
    N(0, 1/width) as NVIDIA's reference. Variables are float32; `__call__` computes in the
    dtype of its input (bfloat16/float16 under AMP).

    >>> mlp = MLP(13, [512, 256, 64], linear_output=False, seed=(1, 0), name="bottom_mlp")
    >>> mlp(tf.zeros([4, 13])).shape
    TensorShape([4, 64])
    """

    def __init__(self, in_dim: int, widths: Sequence[int], linear_output: bool, seed, name: str):
        super().__init__(name=name)
        self.linear_output = linear_output
        self.kernels, self.biases = [], []
        for i, width in enumerate(widths):
            self.kernels.append(tf.Variable(glorot_normal([in_dim, width], (seed[0], seed[1] + 2 * i)),
                                            name=f"{name}/dense_{i}/kernel"))
            self.biases.append(tf.Variable(normal([width], (seed[0], seed[1] + 2 * i + 1), math.sqrt(1.0 / width)),
                                           name=f"{name}/dense_{i}/bias"))
            in_dim = width

    def __call__(self, x):
        last = len(self.kernels) - 1
        for i, (kernel, bias) in enumerate(zip(self.kernels, self.biases)):
            if kernel.shape[0] == 0:    # no input features: x @ kernel (zeros) without oneDNN's matmul, which aborts
                x = tf.reduce_sum(x[:, :, None] * tf.cast(kernel, x.dtype)[None], axis=1)
            else:
                x = tf.matmul(x, tf.cast(kernel, x.dtype))
            x = tf.nn.bias_add(x, tf.cast(bias, x.dtype))
            if i < last or not self.linear_output:
                x = tf.nn.relu(x)
        return x
